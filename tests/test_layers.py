"""The package's layers (fabriclab/__init__.py names them): each module imports only from the layers
below it, a stage only from the stages before it; importing ``fabriclab.engine``, and using an Engine, loads
no stage, course module or tool, nor the command line (each checked in a fresh interpreter)."""
import ast
import json
import pathlib
import subprocess
import sys

import pytest

import fabriclab
from fabriclab import fi

PACKAGE = pathlib.Path(fabriclab.__file__).parent
BINDING = {"fi", "_fabric", "_inprocess"}
CORE = {"nics", "_native", "memory", "gpu", "staging", "landing", "landing_target", "landing_writer", "control",
        "gpucopy", "ipc", "ipc_writer",
        "lanecopy", "topology", "shmclean", "cli", "config", "errors", "transfer", "wire", "buffers", "pages",
        "completions", "renewal", "staged", "service", "submit_batch", "engine", "bootstrap", "measure", "recorded"}
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


# The library in a fresh interpreter: the stages, course, tools and command line stay unloaded.
COURSE_AND_TOOLS = ("lesson", "figures", "tour", "course", "bench", "testbed", "peers", "apidoc", "tools", "cli",
                    "__main__")
OFF_LIMITS = tuple(f"fabriclab.{name}" for name in STAGES + list(COURSE_AND_TOOLS))

REPORT = "import json, sys; print(json.dumps(sorted(m for m in sys.modules if m.startswith('fabriclab'))))"

# An engine on shm writes a page into its own region, announced by immediate data: the service's paths.
USE = """
import numpy as np
from fabriclab import Engine
with Engine("shm", nics=2, threads=1, pin=False, timeout=10) as engine:
    buffer = np.zeros(4 * 4096, np.uint8)
    buffer[:4096] = 7
    region = engine.register(buffer)
    peer = engine.connect(engine.address)
    arrived = engine.expect(5, 1)
    peer.write_pages(region, [0], region.descriptor(), [2], 4096, imm=5).result(10)
    arrived.result(10)
    assert (buffer[2 * 4096:3 * 4096] == 7).all()
    engine.stats()
"""


def loaded_modules(code: str) -> list[str]:
    run = subprocess.run([sys.executable, "-c", code + "\n" + REPORT], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    return json.loads(run.stdout.splitlines()[-1])


def off_limits(modules: list[str]) -> list[str]:
    return [m for m in modules if any(m == name or m.startswith(name + ".") for name in OFF_LIMITS)]


def test_importing_the_engine_loads_only_the_core():
    modules = loaded_modules("import fabriclab.engine")
    assert "fabriclab.engine" in modules and "fabriclab._native" in modules and "fabriclab.nics" in modules
    assert off_limits(modules) == []


def test_using_an_engine_loads_only_the_core():
    if "shm" not in fi.available_providers():
        pytest.skip("provider shm is not available here")
    assert off_limits(loaded_modules(USE)) == []
