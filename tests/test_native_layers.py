"""The native files' layering (issue 24): each file of native/ calls only the files below it in the order that
core_internal.h documents, so there is no circle between them (the core never calls the course or the service:
what a failed write leads to is handed to it as callbacks), and every file builds without a warning under
-Wall -Wextra, checked on the compiled objects (nm), not on the text. And on the Python side fabriclab/_native.py
is the one module that touches the native engine: its struct, its functions, its constants."""
import re
import shutil
import subprocess

import pytest

from native_build import ROOT, libfabric_flags

NATIVE = ROOT / "native"
PACKAGE = ROOT / "fabriclab"
#: The engine's names as Python reaches them: its functions and constants through lib, its structs through
#: ffi, its pointer through a NativeEngine's _ptr.
ENGINE_USE = re.compile(r"\blib\.(fl_|FL_)\w+|\"fl_\w+ ?\*|\b(engine|native)\._ptr\b")
#: What the binding (fabriclab.fi) takes from native/ besides libfabric: signals.c and fabriclab_native.h's option.
BINDING_USE = re.compile(r"\blib\.(fl_signals_\w+|FL_OPT_\w+)")


@pytest.fixture(scope="module")
def objects(tmp_path_factory):
    """Each native/*.c compiled on its own: {file name: (defined fl_ symbols, used fl_ symbols)}."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler")
    out = tmp_path_factory.mktemp("native-objects")
    found, warned = {}, []
    includes = [f for f in libfabric_flags() if f.startswith("-I")]
    for source in sorted(NATIVE.glob("*.c")):
        target = out / f"{source.stem}.o"
        build = subprocess.run([cc, "-O2", "-Wall", "-Wextra", "-c", str(source), *includes, "-o", str(target)],
                               capture_output=True, text=True, timeout=120)
        assert build.returncode == 0, build.stderr
        if "warning:" in build.stderr:
            warned.append(build.stderr)
        symbols = subprocess.run(["nm", str(target)], capture_output=True, text=True, check=True).stdout
        defined, used = set(), set()
        for line in symbols.splitlines():
            kind, name = line.split()[-2:]
            if not name.startswith("fl"):
                continue
            (used if kind == "U" else defined).add(name)
        found[source.name] = (defined, used)
    return found, warned


def calls(found: dict) -> dict[str, set[str]]:
    """Which files each file calls (uses a symbol another defines)."""
    owner = {name: file for file, (defined, _) in found.items() for name in defined}
    return {file: {owner[name] for name in used if name in owner} - {file} for file, (_, used) in found.items()}


def documented_order() -> list[str]:
    """The files as core_internal.h lists them, top first."""
    header = (NATIVE / "core_internal.h").read_text()
    return re.findall(r"^ \*\s+(\w+\.c)\s{2,}", header, re.MULTILINE)


def test_no_circle_between_native_files(objects):
    graph = calls(objects[0])
    state: dict[str, int] = {}

    def visit(file, trail):
        if state.get(file) == 1:
            loop = trail[trail.index(file):] + [file]
            pytest.fail("a circle between native files: " + " -> ".join(loop))
        if state.get(file) == 2:
            return
        state[file] = 1
        for callee in sorted(graph[file]):
            visit(callee, trail + [file])
        state[file] = 2

    for file in sorted(graph):
        visit(file, [])


def test_each_file_calls_only_those_below_it(objects):
    graph, order = calls(objects[0]), documented_order()
    listed = set(order)
    assert "core.c" in listed and "service.c" in listed, f"core_internal.h lists no call order: {order}"
    unlisted_callers = {f for f in graph if f not in listed and graph[f] - {"core.c"}}
    assert not unlisted_callers, f"files that call others but are not in core_internal.h's order: {unlisted_callers}"
    upward = [f"{file} calls {callee}" for file in order for callee in sorted(graph.get(file, ()))
              if callee in listed and order.index(callee) <= order.index(file)]
    assert not upward, "calls that run up core_internal.h's order:\n" + "\n".join(upward)
    assert graph["core.c"] <= {"imm.c"}, f"the core calls {graph['core.c']}"


def test_native_files_build_without_warnings(objects):
    assert not objects[1], "\n".join(objects[1])


def test_only_native_py_touches_the_engine():
    """multi_nic.py once filled fl_engine's fields and called fl_target_run itself; now _native.NativeTarget and
    write_run do, as NativeEngine does for the service."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        name = path.relative_to(PACKAGE).as_posix()
        if name == "_native.py":
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            uses = [m.group(0) for m in ENGINE_USE.finditer(line)]
            if name == "fi.py" or name.startswith("fi/"):
                uses = [u for u in uses if not BINDING_USE.fullmatch(u)]
            found += [f"fabriclab/{name}:{number}: {u}" for u in uses]
    assert not found, "the native engine reached around fabriclab/_native.py:\n" + "\n".join(found)
