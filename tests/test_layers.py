"""The package's layers (fabriclab/__init__.py names them): each module imports only from the layers
below it, a stage only from the stages before it, and loading the library loads no stage, course or tool."""
import ast
import pathlib
import subprocess
import sys

import fabriclab

PACKAGE = pathlib.Path(fabriclab.__file__).parent
BINDING = {"fi", "_fabric"}
CORE = {"nics", "_native", "memory", "gpu", "topology", "shmclean", "cli", "engine", "bootstrap"}
STAGES = ["unidirectional", "bidirectional", "rdma_write", "opqueue", "multi_nic", "threaded", "batched"]
TOP = {"course", "tools", "__main__"}


def layer(name: str) -> tuple[int, int]:
    """(layer, position in it): binding 0, core 1, stages 2 (by chapter), course/tools/__main__ 3."""
    first = name.split(".")[0]
    if first in BINDING:
        return 0, 0
    if first in CORE:
        return 1, 0
    if first in STAGES:
        return 2, STAGES.index(first)
    assert first in TOP, f"fabriclab.{name} belongs to no layer: add it to fabriclab/__init__.py and here"
    return 3, 0


def imported_modules(path: pathlib.Path, name: str) -> set[str]:
    """The fabriclab modules a module imports (relative or absolute, at any depth in the file)."""
    package = name.split(".")[:-1] if path.name != "__init__.py" else name.split(".")
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[:len(package) - node.level + 1] + (node.module.split(".") if node.module else [])
            elif node.module and node.module.split(".")[0] == "fabriclab":
                base = node.module.split(".")[1:]
            else:
                continue
            for alias in node.names:
                candidate = base + [alias.name]
                if (PACKAGE.joinpath(*candidate).with_suffix(".py").exists()
                        or PACKAGE.joinpath(*candidate).is_dir()):
                    found.add(".".join(candidate))
                elif base:
                    found.add(".".join(base))
        elif isinstance(node, ast.Import):
            found |= {a.name.split(".", 1)[1] for a in node.names if a.name.startswith("fabriclab.")}
    return found


def modules():
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(PACKAGE).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        if parts:
            yield ".".join(parts), path


def test_every_import_runs_down_the_layers():
    wrong = []
    for name, path in modules():
        mine = layer(name)
        for other in imported_modules(path, name):
            theirs = layer(other)
            upward = theirs[0] > mine[0] or (mine[0] == theirs[0] == 2 and theirs[1] > mine[1])
            across = mine[0] == theirs[0] == 3 and name.split(".")[0] != other.split(".")[0]  # course <-> tools
            if upward or across:
                wrong.append(f"fabriclab.{name} imports fabriclab.{other}")
    assert not wrong, "imports that run up (or across) the layers:\n" + "\n".join(wrong)


def test_the_layer_test_sees_imports():
    # The rule above passes vacuously if imported_modules finds nothing: check it on known edges.
    assert "fi" in imported_modules(PACKAGE / "engine.py", "engine")
    assert "rdma_write" in imported_modules(PACKAGE / "multi_nic.py", "multi_nic")
    assert "tools.peers" in imported_modules(PACKAGE / "tools" / "bench.py", "tools.bench")
    assert layer("fi") < layer("engine") < layer("rdma_write") < layer("multi_nic") < layer("tools.bench")


def test_the_library_loads_no_stage_course_or_tool():
    code = ("import sys, fabriclab.engine, fabriclab.bootstrap; from fabriclab import Engine\n"
            "print(' '.join(sorted(m for m in sys.modules if m.startswith('fabriclab'))))")
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    unwanted = [m for m in loaded if layer(m.split(".", 1)[1] if "." in m else "fi")[0] >= 2]
    assert not unwanted, f"import fabriclab.engine loaded {unwanted}"
