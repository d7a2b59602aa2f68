"""The modeled p5 host (docs/model.md, "Modeled time"): every cost it charges has a source, the docs list the
same table, and each chapter's mechanism shows in what the model charged a real run."""
import json
import os
import pathlib
import re
import subprocess
import sys

import pytest

from fabriclab import nics
from fabriclab.tools import bench
from fabriclab.measure import model_per_write

ROOT = pathlib.Path(__file__).resolve().parents[1]
ENTRY = re.compile(r'\[SIM_COST_(\w+)\] = \{"([^"]+)", (\d+), "(\w+)",\s*((?:"[^"]*"\s*)+)\}')


def cost_table() -> list[tuple[str, str, str, str, str]]:
    """(id, name, value, unit, source) of every entry of native/sim/sim_host.c's table."""
    text = (ROOT / "native/sim/sim_host.c").read_text()
    return [(i, name, value, unit, "".join(re.findall(r'"([^"]*)"', source)))
            for i, name, value, unit, source in ENTRY.findall(text)]


def test_every_cost_has_a_source_and_the_docs_list_it():
    enum = re.findall(r"^\s+SIM_COST_(\w+),", (ROOT / "native/sim/sim.h").read_text(), re.M)
    table = cost_table()
    assert sorted(i for i, *_ in table) == sorted(enum), "each SIM_COST_ id has one entry, parsed here"
    docs = (ROOT / "docs/model.md").read_text()
    for ident, name, value, unit, source in table:
        assert len(source) > 20 and "TODO" not in source, f"{ident}: no source written down"
        assert not re.search(r"chapters? (9|1[0-5])\b", source), f"{ident}: taken from a chapter the model predicts"
        assert f"| {name} | {value} {unit} | {source} |" in docs, f"{ident}: docs/model.md's table differs"


def run_chapters(chapters, **env):
    """bench --progression for some chapters, in a child process (the provider reads its environment once)."""
    code = ("import json, sys; from dataclasses import asdict; from fabriclab.tools import bench; "
            f"r = bench.progression(chapters={chapters!r}, rounds=1, provider='sim', nics=32, page_size=65536, "
            "total=128 << 20); print(json.dumps([asdict(x) for x in r]))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         env={**os.environ, **env}, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-2000:]
    return {r["label"].split()[0]: bench.BenchResult(**r) for r in json.loads(out.stdout.splitlines()[-1])}


@pytest.fixture(scope="module")
def chapters():
    return run_chapters(["9", "11", "12", "13", "13+", "15+"])


def test_each_chapter_shows_its_mechanism_in_what_the_model_charged(chapters):
    per = {ch: model_per_write(r) for ch, r in chapters.items()}
    # chapter 9: one thread reads its 32 queues and posts one write per GPU group: 4 reads a write
    assert per["9"]["CQ reads"] == pytest.approx(4, abs=0.3)
    # chapters 11-12 share one atomic line among 8 threads (post, completion, the look at the total)
    # (a thread counts as a sharer from its first access on: those before the others started move nothing)
    assert 2 <= per["11"]["line moves"] <= 4  # the look at the total is once a pass: a pass may bring no write
    # pinned near its NICs, no thread crosses to the other socket; unpinned, some do
    assert per["12"]["far socket"] == 0 and per["11"]["far socket"] > 0.2
    # the article's packed slots still share lines (two accesses a write, each moving the line once its
    # sharers have started); a line each shares none
    assert 1 <= per["13"]["line moves"] <= 2 and per["13+"]["line moves"] == 0
    # FI_MORE rings fewer doorbells than writes
    assert per["15+"]["doorbells"] < 0.9
    assert all(r.modeled and r.verified for r in chapters.values())


def test_wall_time_is_a_switch(monkeypatch):
    wall = run_chapters(["13+"], FABRICLAB_SIM_TIME="wall")["13+"]
    assert wall.verified and wall.model == {}
    monkeypatch.setenv("FABRICLAB_SIM_TIME", "wall")
    assert not nics.modeled_host("sim")
    monkeypatch.setenv("FABRICLAB_SIM_TIME", "modeled")
    assert nics.modeled_host("sim") and not nics.modeled_host("shm")


def test_the_modeled_host_is_the_recorded_p5():
    assert nics.article_cores(8) == [6, 18, 30, 42, 54, 66, 78, 90]
    topo = nics.modeled_topology("sim")
    assert [g.numa_node for g in topo.groups] == [0] * 4 + [1] * 4
    assert topo.groups[0].nics[:2] == ["rdmap16s0-rdm", "rdmap17s0-rdm"]


def test_the_python_binding_reads_the_modeled_clock():
    header = (ROOT / "native/sim/fi_sim_ext.h").read_text()
    from fabriclab.fi import cq
    assert f'#define FI_SIM_HOST_OPS "{cq._SIM_HOST_OPS.decode()}"' in header
    code = ("from fabriclab import fi\n"
            "stack = fi.EndpointStack(fi.getinfo('sim', 'rdmap16s0-rdm')[0])\n"
            "clock = stack.cq.modeled_clock()\n"
            "before = clock(); stack.cq.poll(); print(clock is not None and clock() > before)\n"
            "import time\n"  # a reading between calls counts the thread's own time since its last call
            "t1 = clock(); t0 = time.process_time()\n"
            "while time.process_time() - t0 < 0.002: pass\n"
            "print(clock() - t1 >= 1_000_000)\n")
    wall = code.split("before = ")[0] + "print(clock is not None)\n"
    for env, expected, run in (({}, "True\nTrue", code), ({"FABRICLAB_SIM_TIME": "wall"}, "False", wall)):
        out = subprocess.run([sys.executable, "-c", run], capture_output=True, text=True, timeout=60,
                             env={**os.environ, **env}, cwd=ROOT)
        assert out.stdout.strip() == expected, out.stderr[-1000:]
