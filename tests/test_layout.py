"""Engine()'s defaults (nics.default_layout), NICs grouped by topology (nics.group_nics) in the Engine and the
stages, and coalesced page writes (engine.coalesce_pages) that the target still counts page by page."""
import os
import random

import numpy as np
import pytest

from fabriclab import Engine, batched, fi, memory, nics, rdma_write, service as engine_module
from fabriclab.pages import coalesce_pages
from fabriclab.gpu import cuda_status
from fabriclab.topology import Topology
from fabriclab.tools.peers import start_server
from conftest import provider_args

P5 = Topology.load("p5.48xlarge")
P5_DOMAINS = [n.domain for n in P5.nics]  # PCI order: four per GPU


# ------------------------------------------------------------------------------------- defaults


def pair(layout):
    return layout.nics, layout.threads


def test_one_domain_gets_a_slot_and_thread_per_spare_core():
    assert pair(nics.default_layout(1, 1, 16)) == (8, 8)  # at most ONE_DOMAIN_THREADS
    assert pair(nics.default_layout(1, 1, 5)) == (4, 4)  # one core left to the caller
    assert pair(nics.default_layout(1, 0, 2)) == (1, 1)
    assert pair(nics.default_layout(1, 1, 1)) == (1, 1)  # never zero


def test_several_real_nics_get_a_thread_per_topology_group():
    assert pair(nics.default_layout(32, 8, 192)) == (32, 8)
    assert pair(nics.default_layout(32, 8, 4)) == (32, 3)  # no more threads than spare cores
    assert pair(nics.default_layout(2, 0, 16)) == (2, 1)  # the topology says nothing: one thread
    assert "topology group" in nics.default_layout(32, 8, 192).why


def test_engine_defaults_say_what_they_chose(fabric):
    with Engine(fabric[0], domains=fabric[1], pin=False) as engine:
        spare = len(os.sched_getaffinity(0))
        want = nics.default_layout(1, 1, spare)
        assert (engine.nics, engine.threads) == (want.nics, want.threads)
        layout = engine.stats()["layout"]
        assert layout["nics"] == layout["threads"] == "default" and layout["why"] == want.why
        assert want.why in repr(engine)
    with Engine(fabric[0], domains=fabric[1], pin=False, nics=3, threads=2) as engine:
        assert (engine.nics, engine.threads) == (3, 2)
        assert engine.stats()["layout"]["nics"] == "given" and "defaults" not in repr(engine)
    with Engine(fabric[0], domains=fabric[1], pin=False, threads=3) as engine:
        assert engine.nics >= 3  # emulated slots for the threads asked for


def configuration(engine) -> dict:
    """Everything a layout sets in an engine: its NIC slots (each one's domain, emulated or not, worker group and
    writes in flight), its threads and the cores they are pinned to."""
    stats = engine.stats()
    return {"threads": engine.threads, "worker_cores": engine.worker_cores,
            "housekeeping_cores": engine.housekeeping_cores, "groups": stats["layout"]["groups"],
            "slots": [(n["domain"], n["emulated"], n["group"], engine._service.native.nic(n["nic"]).max_in_flight)
                      for n in stats["per_nic"]]}


@pytest.mark.parametrize("cores", [None, 16], ids=["this-host", "16-cores"])
def test_defaults_and_the_same_numbers_given_build_the_same_engine(fabric, monkeypatch, cores):
    """bench --defaults saw Engine() beat Engine(nics=8, threads=8) on a 16-core host: the two must differ in
    nothing but the words saying who chose. 16-cores: the host as that one looked (8 slots, 8 threads); on
    fewer real cores the pinning asked for simply does not take, and nothing here is timed."""
    if cores:
        monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(cores)))
    with Engine(fabric[0], domains=fabric[1], timeout=10) as chosen:
        defaults = configuration(chosen)
        numbers = {"nics": chosen.nics, "threads": chosen.threads}
    with Engine(fabric[0], domains=fabric[1], timeout=10, **numbers) as given:
        assert configuration(given) == defaults
        assert given.stats()["layout"]["nics"] == "given"
    if cores:
        assert numbers == {"nics": 8, "threads": 8}


# ------------------------------------------------------------------------------------- grouping


def test_p5_groups_each_gpu_with_its_own_nics_whatever_the_domain_order():
    shuffled = P5_DOMAINS[:]
    random.Random(15).shuffle(shuffled)
    for domains in (P5_DOMAINS, shuffled):
        groups = nics.group_nics(domains, 8, P5)
        for gpu in range(8):
            slots = groups.slots_of_gpu(gpu)
            assert sorted(domains[i] for i in slots) == sorted(P5.group_for(gpu).nics)
            assert {groups.of_slot[i] for i in slots} == {gpu}  # one worker drives them, pinned beside the GPU
            assert set(groups.cores[gpu]) <= set(P5.group_for(gpu).cores)


def test_p5_index_modulo_would_have_crossed_sockets():
    """What group_nics replaces: slot i % 8 put NICs of four GPUs (both sockets) under worker 0."""
    modulo = {P5_DOMAINS[i] for i in range(0, 32, 8)}
    owners = {g.gpu for g in P5.groups for d in g.nics if d in modulo}
    assert len(owners) > 1
    groups = nics.group_nics(P5_DOMAINS, 8, P5)
    assert len({groups.gpu_of_slot[i] for i in range(32) if groups.of_slot[i] == 0}) == 1


def test_emulated_slots_follow_their_real_nic_and_fewer_groups_merge_neighbours():
    groups = nics.group_nics(P5_DOMAINS * 2, 8, P5)  # 64 slots: slot 32 + i shares the domain of slot i
    assert groups.of_slot[32:] == groups.of_slot[:32]
    four = nics.group_nics(P5_DOMAINS, 4, P5)
    for gpu in range(8):
        assert {four.of_slot[i] for i in four.slots_of_gpu(gpu)} == {gpu // 2}  # GPUs 0-1, 2-3, ...


def test_more_groups_than_gpus_split_a_gpus_nics_and_unknown_domains_fall_back_to_index_order():
    sixteen = nics.group_nics(P5_DOMAINS, 16, P5)
    for gpu in range(8):
        assert len({sixteen.of_slot[i] for i in sixteen.slots_of_gpu(gpu)}) == 2
    assert nics.group_nics(["shm"] * 6, 4, None).of_slot == (0, 1, 2, 3, 0, 1)
    mixed = nics.group_nics(P5_DOMAINS[:4] + ["elsewhere"] * 2, 2, P5)
    assert mixed.of_slot == (0, 0, 0, 0, 1, 1) and mixed.slots_of_gpu(None) == list(range(6))
    with pytest.raises(nics.fi.UsageError):
        nics.group_nics(["shm"], 2, None)


def test_worker_cores_sit_beside_their_groups():
    groups = nics.group_nics(["shm"] * 4, 2, None)
    cores = nics.worker_cores(1, "shm", groups=groups)
    assert len(cores) == 1 and cores[0] in os.sched_getaffinity(0)


def test_engine_workers_own_the_nics_group_nics_gives_them(fabric, monkeypatch):
    """The native service drives slot i from worker groups.of_slot[i], not i % threads: a grouping that is
    not index order is honoured, and writes still land byte-exact."""
    def not_modulo(domains, groups, topology=None):
        return nics.NicGroups((0, 0, 1, 1), (None,) * 4, ((), ()))
    monkeypatch.setattr(engine_module, "group_nics", not_modulo)
    with Engine(fabric[0], domains=fabric[1], pin=False, nics=4, threads=2) as writer, \
            Engine(fabric[0], domains=fabric[1], pin=False, nics=1, threads=1) as target:
        assert [n["group"] for n in writer.stats()["per_nic"]] == [0, 0, 1, 1]
        moved_ok(writer, target, np.arange(16), np.arange(16), 4096)
        assert all(n["writes"] > 0 for n in writer.stats()["per_nic"])


def test_a_stage_groups_its_nics_with_group_nics(fabric):
    with start_server("fabriclab.multi_nic", *provider_args(*fabric), "--timeout", "10") as server:
        stack = memory.open_endpoint(fabric[0], fabric[1], "host")
        with batched.BatchedWriter(stack, server.address_hex, 10, domains=fabric[1], nics=4, threads=2,
                                   warmup=False) as writer:
            writer.prepare(rdma_write.PagePlan.for_total(4096, 1 << 20))
            want = nics.group_nics([s.domain_name for s in writer.nicset.slots], 2,
                                   nics.discover_topology(writer.nicset.provider))
            assert writer.nic_groups == want
            assert [writer.engine.nic(i).group for i in range(4)] == list(want.of_slot)
            writer.transfer()
            assert writer.finish().verified is True


# ------------------------------------------------------------------------------------ coalescing


def test_coalesce_pages_finds_runs_on_both_sides():
    src, dst, runs = coalesce_pages(np.arange(10), np.arange(10) + 5, 4)
    assert (src.tolist(), dst.tolist(), runs.tolist()) == ([0, 4, 8], [5, 9, 13], [4, 4, 2])
    src, dst, runs = coalesce_pages(np.array([0, 1, 2, 7]), np.array([3, 4, 9, 10]), 8)  # dst breaks after 1
    assert (src.tolist(), dst.tolist(), runs.tolist()) == ([0, 2, 7], [3, 9, 10], [2, 1, 1])
    perm = np.random.default_rng(3).permutation(64)
    assert coalesce_pages(perm, perm[::-1].copy(), 16)[2].max() == 1


def moved_ok(writer, target, src, dst, page, imm=11):
    """Write pages src -> dst between two engines; check the target counted every page and got the bytes."""
    data = np.random.default_rng(int(imm)).integers(0, 256, (int(src.max()) + 1) * page, dtype=np.uint8)
    buffer = np.zeros((int(dst.max()) + 1) * page, dtype=np.uint8)
    local, remote = writer.register(data), target.register(buffer)
    transfer = writer.connect(target.address).write_pages(local, src, remote.descriptor(), dst, page, imm=imm)
    result = transfer.result(10)
    assert target.expect(imm, src.size, timeout=10).result() == src.size  # pages, however many writes
    want = np.zeros_like(buffer)
    for s, d in zip(src, dst):
        want[d * page:(d + 1) * page] = data[s * page:(s + 1) * page]
    assert np.array_equal(buffer, want)
    assert result.pages == transfer.pages == src.size and result.writes == transfer.writes
    local.close()
    remote.close()
    return transfer.writes


@pytest.mark.parametrize("case", ["contiguous", "permuted", "mixed"])
def test_page_lists_become_as_few_writes_as_their_runs(fabric, case):
    pages, page = 256, 4096
    src = np.arange(pages)
    dst = {"contiguous": np.arange(pages) + 3,
           "permuted": np.random.default_rng(5).permutation(pages),
           "mixed": np.concatenate([np.arange(100, 200), np.arange(0, 100)[::-1], np.arange(200, 256)])}[case]
    with Engine(fabric[0], domains=fabric[1], pin=False, nics=4, threads=1) as writer, \
            Engine(fabric[0], domains=fabric[1], pin=False, nics=1, threads=1) as target:
        most = writer._service.pages_per_write(pages, page)
        expected = coalesce_pages(src, dst, most)[2].size
        writes = moved_ok(writer, target, src, dst, page)
        assert writes == expected
        if case == "contiguous":
            assert most == 64 and writes == 4  # one write per NIC: 256 pages / 4 NICs, 256 KiB each
        elif case == "mixed":
            assert writes == 2 + 100 + 1  # two runs of 100 and 56 pages (at most 64 each), 100 single pages
        stats = writer.stats()["submitted"]
        assert stats == {"transfers": 1, "pages": pages, "writes": writes}


def test_coalesced_writes_stay_under_the_stripe_and_max_msg_size(fabric):
    with Engine(fabric[0], domains=fabric[1], pin=False, nics=1, threads=1) as engine:
        service = engine._service
        assert service.pages_per_write(4096, 65536) == engine_module.DEFAULT_STRIPE // 65536
        assert service.pages_per_write(3, 65536) == 3
        assert service.pages_per_write(4, 4 << 20) == 1  # a page above the cap still goes, one per write
        assert service.pages_per_write(1 << 20, 1) <= min(service.max_msg_size, engine_module.DEFAULT_STRIPE)


def test_bench_defaults_prints_a_table_with_defaults_against_the_sweep(fabric):
    from fabriclab.tools.bench import defaults_comparison, format_defaults
    result = defaults_comparison(fabric[0], fabric[1], layouts=[(2, 1)], shapes=((16, 4096), (4, 65536)),
                                 transfers=2, warmup=1, rounds=1, timeout=20)
    assert [r["layout"] for r in result["rows"]] == ["defaults", "nics=2 threads=1"]
    assert result["rows"][1]["writes"]["16x4 KiB contiguous"] == 2  # 16 pages over 2 NICs: two writes
    assert result["rows"][1]["writes"]["4x64 KiB permuted"] >= 3
    table = format_defaults(result)
    assert "defaults % of best" in table and "memcpy ceiling" in table
    assert "pthreads" in result["memcpy_method"] and len(result["memcpy_8_threads_runs_gbs"]) == 1
    assert "memcpy measured as: C memcpy" in table
    assert result["memory"] == "host" and result["paths"] == {"source": "host", "target": "host", "writes": "host",
                                                                     "writes_why": "the source is host memory"}


@pytest.mark.gpu
@pytest.mark.skipif(cuda_status() != "ok", reason="needs CUDA")
def test_bench_defaults_moves_gpu_memory_on_both_sides(fabric):
    from fabriclab.tools.bench import defaults_comparison, format_defaults
    result = defaults_comparison(fabric[0], fabric[1], layouts=[(2, 1)], shapes=((4, 1 << 20),), transfers=2,
                                 warmup=1, rounds=1, timeout=20, memory_kind="cuda")
    assert result["paths"]["source"].startswith("cuda-") and result["paths"]["target"].startswith("cuda-")
    assert "GPU memory on both sides: the source cuda-" in format_defaults(result)


def test_bench_defaults_compares_the_defaults_with_the_same_layout_given(fabric):
    from fabriclab.tools.bench import defaults_comparison, format_defaults
    with Engine(fabric[0], domains=fabric[1], pin=False) as engine:
        same = (engine.nics, engine.threads)
    result = defaults_comparison(fabric[0], fabric[1], layouts=[same], shapes=((16, 4096),), transfers=2, warmup=1,
                                 rounds=2, timeout=20)
    assert all(len(runs) == 2 for row in result["rows"] for runs in row["runs"].values())
    assert f"defaults against nics={same[0]} threads={same[1]}, the same layout: 16x4 KiB contiguous x" \
        in format_defaults(result)


def test_memcpy_ceiling_runs_c_threads_started_together():
    from fabriclab.tools.bench import memcpy_gbps, memcpy_rate
    rate = memcpy_rate(1 << 20, threads=2, repeats=3)
    assert len(rate["runs"]) == 3 and rate["gbps"] == max(rate["runs"]) > 0
    assert "2 pthreads" in rate["method"] and "each copying its own warmed" in rate["method"]
    assert memcpy_gbps(1 << 20) > 0
    with pytest.raises(fi.UsageError, match="use fewer threads"):
        memcpy_rate(1 << 20, threads=5000)
