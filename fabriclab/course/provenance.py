"""What a committed notebook was executed on, and whether the code it ran has changed since.

``make lessons`` executes each notebook in place and then ``stamp``s it: the notebook's metadata gets a
``fabriclab`` block with the machine (cores, CPU), the providers libfabric offered, the commit, and a SHA-256
of every source the notebook depends on, file by file. tests/test_notebooks_fresh.py recomputes those hashes
and fails, naming the notebook and the files, when they differ: the outputs a reader sees in the browser
were produced by other code than the one in the checkout.

What a notebook depends on is found, not declared, so that a new or edited notebook needs nothing by hand:
- its own code cells (an edited cell that was not run again shows old outputs too);
- the fabriclab modules its cells import, or run with ``python -m``, the checkout's scripts they name
  (``examples/*.py``), and every fabriclab module those import in turn (every import in a module, lazy ones
  in functions included: a module that might run counts);
- the C the binding is built from (``native/*.c``, ``*.h``, ``build_ffi.py``) when any of those modules
  loads the cffi extension, the modeled provider's (``native/sim/``) when any loads that provider, and the
  recorded data (``fabriclab/data/``) when any reads it.

Stamping after execution rather than from a first cell keeps the notebooks' content free of bookkeeping and
works on whatever notebooks exist; the hash is taken when the stamp is written, right after the run."""
from __future__ import annotations

import ast
import functools
import hashlib
import json
import os
import pathlib
import re
import sys
import time
from collections.abc import Iterable

from .. import fi, recorded

#: The notebook metadata key of the stamp.
KEY = "fabriclab"
FORMAT = 1
PACKAGE = pathlib.Path(__file__).resolve().parents[1]
ROOT = PACKAGE.parent
#: Files that modules load, by what marks a loader: the cffi extension's sources (a module imports it), the
#: modeled provider's (a module names its library) and the package's recorded data (a module uses DATA_DIR).
EXTENSION = "fabriclab._fabric"
LOADED = {EXTENSION: ("native", ("*.c", "*.h", "build_ffi.py")),
          "libsim-fi": ("native/sim", ("*.c", "*.h")),
          "DATA_DIR": ("fabriclab/data", ("*.json",))}
FIX = "make lessons"  # re-executes every notebook and stamps it
_DOTTED = re.compile(r"fabriclab(?:\.\w+)+")
_SCRIPT = re.compile(r"""["']([\w./-]+\.py)["']""")
_RUN_AS_MODULE = re.compile(r"""-m["']?\s*,?\s*["']?(fabriclab(?:\.\w+)*)""")


def _module_file(name: str) -> pathlib.Path | None:
    """The file of fabriclab module ``name`` (a package's ``__init__.py``), or None if it is not one."""
    parts = name.split(".")
    if parts[0] != PACKAGE.name:
        return None
    base = PACKAGE.joinpath(*parts[1:])
    for path in (base.with_suffix(".py"), base / "__init__.py"):
        if path.is_file():
            return path
    return None


def _imported(tree: ast.AST, package: str | None) -> set[str]:
    """Every module name an ``import`` anywhere in ``tree`` may load (``from a import b``: a, and a.b in case b
    is a module), relative imports resolved against ``package``; and every string that is a dotted fabriclab
    name, for modules loaded by name (``importlib``, ``python -m`` in a subprocess: the CLI's table, a
    stage's target)."""
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and _DOTTED.fullmatch(node.value):
            out.add(node.value)
        elif isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level and package:
                anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            out.add(base)
            out.update(f"{base}.{alias.name}" for alias in node.names)
    return out


def _with_parents(name: str) -> list[str]:
    """A module and the packages above it, whose ``__init__`` runs first."""
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts) + 1)]


def _package_of(name: str, path: pathlib.Path) -> str:
    return name if path.name == "__init__.py" else name.rpartition(".")[0]


def modules_closure(roots: Iterable[str]) -> dict[str, pathlib.Path]:
    """The fabriclab modules ``roots`` name and all they import, transitively: name → file."""
    seen: dict[str, pathlib.Path] = {}
    todo = [parent for root in roots for parent in _with_parents(root)]
    while todo:
        name = todo.pop()
        path = _module_file(name)
        if name in seen or path is None:
            continue
        seen[name] = path
        for found in _module_imports(path, _package_of(name, path), path.stat().st_mtime_ns):
            todo.extend(_with_parents(found))
    return seen


@functools.lru_cache(maxsize=None)
def _module_imports(path: pathlib.Path, package: str, mtime_ns: int) -> frozenset[str]:
    """``_imported`` of a module's file, parsed once per version of it (``mtime_ns``: a test checks every
    notebook, and they import mostly the same modules)."""
    return frozenset(_imported(ast.parse(path.read_text(), str(path)), package))


def _cell_code(cell: dict) -> str:
    source = cell.get("source", "")
    return "".join(source) if isinstance(source, list) else source


def _python_of(code: str) -> str:
    """A cell's code with IPython's magics and shell lines commented out, so that ``ast`` can read it."""
    return "\n".join("#" + line if line.lstrip().startswith(("%", "!")) else line for line in code.splitlines())


def notebook_modules(notebook: dict) -> set[str]:
    """The fabriclab modules a notebook's code cells import, or run as ``python -m MODULE`` (a shell line, or a
    command list)."""
    names: set[str] = set()
    for cell in notebook.get("cells", []):
        if cell.get("cell_type") != "code":
            continue
        code = _cell_code(cell)
        try:
            names |= _imported(ast.parse(_python_of(code)), None)
        except SyntaxError:
            pass  # a cell ast cannot read is still hashed as text below; its imports are found by the regex
        for module in _RUN_AS_MODULE.findall(code):
            names |= {module, f"{module}.__main__"}
    return {name for name in names if name.split(".")[0] == PACKAGE.name}


def notebook_scripts(notebook: dict) -> list[pathlib.Path]:
    """The checkout's scripts outside the package that a notebook's cells name in a string ("kv_cache_transfer.py",
    "examples/x.py"): a cell runs them, by path or through importlib."""
    named = {m for cell in notebook.get("cells", []) if cell.get("cell_type") == "code"
             for m in _SCRIPT.findall(_cell_code(cell))}
    folders = [f for f in ROOT.iterdir() if f.is_dir() and f != PACKAGE and f.name not in ("build", "native")
               and not f.name.startswith(".")]
    scripts = (p for folder in folders for p in folder.glob("*.py"))
    return sorted(p for p in scripts if any(p.relative_to(ROOT).as_posix() in (n, f"{p.parent.name}/{n}")
                                            or p.name == n for n in named))


def _loaded_files(modules: dict[str, pathlib.Path]) -> list[pathlib.Path]:
    """The files these modules load (LOADED): the sources of the extension when one imports it, of the modeled
    provider when one names its library, the recorded data when one reads it."""
    imports: set[str] = set()
    texts = [path.read_text() for path in modules.values()]
    for name, path in modules.items():
        imports |= _module_imports(path, _package_of(name, path), path.stat().st_mtime_ns)
    out: list[pathlib.Path] = []
    for marker, (folder, patterns) in LOADED.items():
        if marker in imports or any(marker in text for text in texts):
            directory = ROOT / folder
            if not directory.is_dir():
                raise fi.UsageError(f"{directory} does not exist: checking a notebook's sources needs fabriclab's "
                                    "source checkout (pip install -e . from a clone), not an installed wheel")
            out += sorted(p for pattern in patterns for p in directory.glob(pattern))
    return out


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def source_hashes(notebook: dict) -> dict[str, str]:
    """SHA-256 of everything ``notebook`` depends on: its code cells (under ``<code cells>``), then each file
    by its path in the checkout."""
    cells = "\n# ---- cell\n".join(_cell_code(c) for c in notebook.get("cells", []) if c.get("cell_type") == "code")
    hashes = {"<code cells>": _sha256(cells.encode())}
    scripts = notebook_scripts(notebook)
    roots = notebook_modules(notebook).union(*(_module_imports(p, "", p.stat().st_mtime_ns) for p in scripts))
    modules = modules_closure(roots)
    for path in scripts + sorted(set(modules.values())) + _loaded_files(modules):
        hashes[path.relative_to(ROOT).as_posix()] = _sha256(path.read_bytes())
    return hashes


def _digest(hashes: dict[str, str]) -> str:
    return _sha256(json.dumps(hashes, sort_keys=True).encode())


def stamp(path: str | os.PathLike) -> dict:
    """Write into the notebook at ``path`` what it was executed on and the hashes of its sources now (call it
    right after executing it); returns the stamp."""
    path = pathlib.Path(path)
    notebook = json.loads(path.read_text())
    hashes = source_hashes(notebook)
    record = {"format": FORMAT, "executed_on": recorded.machine(), "commit": recorded.commit(ROOT, hashes),
              "stamped": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
              "sources_sha256": _digest(hashes), "sources": hashes}
    notebook.setdefault("metadata", {})[KEY] = record
    # nbformat's own layout (one-space indent, a final newline), so a stamp changes only its own lines
    path.write_text(json.dumps(notebook, indent=1, ensure_ascii=False) + "\n")
    return record


def staleness(path: str | os.PathLike) -> str | None:
    """None when the notebook at ``path`` was stamped against the sources as they are now; otherwise why not,
    naming the notebook, what changed, and the fix."""
    path = pathlib.Path(path)
    notebook = json.loads(path.read_text())
    record = notebook.get("metadata", {}).get(KEY)
    shown = path.resolve().relative_to(ROOT) if path.resolve().is_relative_to(ROOT) else path
    fix = f"run `{FIX}` (or `{FIX} LESSONS={shown.as_posix()}` for this one) and commit the notebook"
    if not isinstance(record, dict) or record.get("format") != FORMAT:
        return f"{path.name} was never executed by `{FIX}` (no {KEY} stamp in its metadata): {fix}"
    then, now = record.get("sources", {}), source_hashes(notebook)
    if record.get("sources_sha256") == _digest(now) and then == now:
        return None
    changed = sorted(name for name in now.keys() & then.keys() if now[name] != then[name])
    added, gone = sorted(now.keys() - then.keys()), sorted(then.keys() - now.keys())
    what = "; ".join(f"{label}: {', '.join(names[:8])}{' …' if len(names) > 8 else ''}" for label, names in
                     (("changed", changed), ("now depends on", added), ("no longer depends on", gone)) if names)
    return (f"{path.name} was executed at {record.get('commit', '?')[:12]} against other code than this checkout's "
            f"({what or 'its stamp does not add up'}): its outputs are stale; {fix}")


def main(argv: list[str] | None = None) -> int:
    """``python -m fabriclab.course.provenance stamp|check NOTEBOOK...``"""
    args = sys.argv[1:] if argv is None else argv
    if len(args) < 2 or args[0] not in ("stamp", "check"):
        print("usage: python -m fabriclab.course.provenance stamp|check NOTEBOOK...", file=sys.stderr)
        return 2
    stale = 0
    for name in args[1:]:
        if args[0] == "stamp":
            record = stamp(name)
            print(f"stamped {name}: {len(record['sources'])} sources, sha256 {record['sources_sha256'][:12]}, "
                  f"{record['executed_on']['cores']} cores, commit {record['commit'][:12]}")
        else:
            why = staleness(name)
            stale += why is not None
            print(why or f"fresh: {name}")
    return 1 if stale else 0


if __name__ == "__main__":
    sys.exit(main())
