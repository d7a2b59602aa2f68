"""The library stands on its own core: importing ``fabriclab.engine``, and using an Engine, loads no stage of
the course, no course module and no tool (each checked in a fresh interpreter, where nothing else loaded
them first)."""
import json
import subprocess
import sys

import pytest

from fabriclab import fi

STAGES = ("unidirectional", "bidirectional", "rdma_write", "opqueue", "multi_nic", "threaded", "batched")
COURSE_AND_TOOLS = ("lesson", "figures", "tour", "course", "bench", "testbed", "peers", "apidoc", "tools", "cli",
                    "__main__")
OFF_LIMITS = tuple(f"fabriclab.{name}" for name in STAGES + COURSE_AND_TOOLS)

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
