"""Chapters 6-7 and the bench harness: one-sided writes land exactly once, byte-exact; bad input is
refused before any post; a dead target is an error within the timeout."""
import argparse
import dataclasses
import gc
import json
import subprocess
import sys
import time

import pytest

from fabriclab import batched, fi, gpu, memory, multi_nic, opqueue, rdma_write, threaded
from fabriclab.tools import bench
from fabriclab.tools.peers import start_server
from conftest import open_fds, provider_args, shared_target

# total bytes, page size: 1 byte, whole pages, and totals that are not a multiple of the page
TRANSFERS = [(1, 1), (4096, 4096), (65536, 4096), (1 << 20, 65536), (3 * 65536 + 123, 65536), (1 << 20, 1 << 20)]


target = shared_target("fabriclab.rdma_write", "--timeout", "5")


@pytest.mark.parametrize("writer_class", [rdma_write.Writer, opqueue.QueuedWriter])
def test_every_page_lands_exactly_once(target, writer_class):
    fabric, server = target
    with memory.open_endpoint(*fabric, "host") as stack, writer_class(stack, server.address_hex, timeout=5) as writer:
        for total, page in TRANSFERS:
            plan = rdma_write.PagePlan.for_total(page, total)
            paths = writer.prepare(plan, "host", seed=total)
            assert paths["local"] == paths["remote_path"] == "host"
            stats = writer.transfer()
            report = writer.finish()
            assert stats.bytes == total and stats.writes == plan.pages
            assert report.arrivals == plan.pages
            assert report.distinct_pages == plan.pages
            assert report.min_per_page == report.max_per_page == 1
            assert report.verified is True, report.mismatched_pages
    # the with-block closed the writer (goodbye, source and registration given back) and its stack
    assert stack.closed and writer.registration is None and writer.source is None


def test_repeated_pages_are_counted_per_page(target):
    fabric, server = target
    with memory.open_endpoint(*fabric, "host") as stack:
        writer = opqueue.QueuedWriter(stack, server.address_hex, timeout=5, in_flight=8)
        plan = rdma_write.PagePlan.for_total(4096, 5 * 16 * 4096, buffer_bytes=16 * 4096)
        writer.prepare(plan)
        writer.transfer(warmup=3)
        report = writer.finish()
        assert report.arrivals == 5 * 16 + 3
        assert (report.min_per_page, report.max_per_page) == (5, 6)
        assert report.verified is True


def test_bad_input_is_refused_before_any_post(target):
    fabric, server = target
    with memory.open_endpoint(*fabric, "host") as stack:
        writer = opqueue.QueuedWriter(stack, server.address_hex, timeout=5)
        with pytest.raises(fi.UsageError, match="prepare"):
            writer.transfer()
        writer.prepare(rdma_write.PagePlan.for_total(4096, 8 * 4096))
        region = writer.remote
        outstanding = stack.cq.outstanding  # the mailbox's posted receives
        with pytest.raises(fi.UsageError, match="falls outside the peer's 32768-byte region"):
            stack.ep.try_post_write(writer.registration.mr, 0, 4096, writer.server_addr, region, 30000, "x")
        wrong_key = bytearray(region.pack())
        wrong_key[16] ^= 0xFF
        with pytest.raises(fi.UsageError, match="wrong key"):
            fi.RemoteRegion.unpack(bytes(wrong_key))
        with pytest.raises(fi.UsageError, match="missing remote region descriptor"):
            fi.RemoteRegion.unpack(b"")
        with pytest.raises(fi.UsageError, match="truncated"):
            fi.RemoteRegion.unpack(region.pack()[:20])
        assert stack.cq.outstanding == outstanding  # nothing was posted
        with pytest.raises(fi.UsageError, match="pages in flight must be at least 1"):
            opqueue.QueuedWriter(stack, server.address_hex, in_flight=0)
    with pytest.raises(fi.UsageError, match="page size 8192 is larger than the 4096-byte buffer"):
        rdma_write.PagePlan.for_total(8192, 4096)
    with pytest.raises(fi.UsageError, match="total bytes must be positive"):
        rdma_write.PagePlan.for_total(4096, 0)


def test_target_killed_mid_transfer(fabric):
    gc.collect()
    before = open_fds()
    with start_server("fabriclab.rdma_write", *provider_args(*fabric)) as server:
        with memory.open_endpoint(*fabric, "host") as stack, \
                opqueue.QueuedWriter(stack, server.address_hex, timeout=2.0, in_flight=16) as writer:
            writer.prepare(rdma_write.PagePlan.for_total(4096, 64 << 20, buffer_bytes=1 << 20))

            def kill_once(completed):
                if server.running:
                    server.kill()

            writer.on_progress = kill_once
            start = time.monotonic()
            with pytest.raises(fi.FabricError):
                writer.transfer()
                writer.finish()
            assert time.monotonic() - start < 15
    gc.collect()
    assert open_fds() <= before + 2


def test_bench_json_has_the_promised_keys(fabric):
    provider, domain = fabric
    result = subprocess.run([sys.executable, "-m", "fabriclab", "bench", *provider_args(provider, domain),
                             "--page-size", "64K", "--total", "8M", "--json"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    row = json.loads(result.stdout.strip().splitlines()[-1])
    for key in ("stage", "provider", "memory", "page_size", "total_bytes", "elapsed_s", "gbps", "mops", "verified",
                "memcpy_gbps", "ratio_to_memcpy", "cpu_ns_per_op", "in_flight"):
        assert key in row
    assert row["verified"] is True and row["total_bytes"] == 8 << 20 and row["provider"] == provider
    assert "memcpy ceiling" in result.stdout


def test_bench_sweep_reuses_one_target():
    results = bench.sweep([4096, 65536], [1, 16], total=1 << 20, warmup=False)
    assert [(r.page_size, r.in_flight) for r in results] == [(4096, 1), (4096, 16), (65536, 1), (65536, 16)]
    assert all(r.verified for r in results)


def test_bench_sweep_from_the_command_line():
    if "shm" not in fi.available_providers():
        pytest.skip("provider shm is not available here")
    result = subprocess.run([sys.executable, "-m", "fabriclab", "bench", "--sweep", "4K,64K", "--total", "1M",
                             "--stage", "opqueue", "--provider", "shm", "--json"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    rows = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    assert [(r["page_size"], r["total_bytes"], r["stage"]) for r in rows] == [(4096, 1 << 20, "opqueue"),
                                                                                (65536, 1 << 20, "opqueue")]
    assert all(r["verified"] is True for r in rows)
    lines = result.stdout.splitlines()
    rows = [line for line in lines if line.startswith("opqueue ")]
    assert sum(line.startswith("stage ") for line in lines) == 1 and len(rows) == 2  # one table, a row per size
    assert " 4 KiB " in rows[0] and " 64 KiB " in rows[1]


def test_bench_progression_with_more_groups_than_nics_emulates_a_slot_per_group():
    """--threads 2 over shm's one domain stopped chapter 9 with "2 GPU groups need at least as many NICs, got 1"
    (so did --stage threaded and batched): without --nics every chapter from 9 on takes a slot per GPU group,
    the extra one emulated and said so."""
    if "shm" not in fi.available_providers():
        pytest.skip("provider shm is not available here")
    result = subprocess.run([sys.executable, "-m", "fabriclab", "bench", "--progression", "--threads", "2",
                             "--provider", "shm", "--total", "8M", "--rounds", "1", "--json"],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result
    rows = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    assert [r["label"].split()[0] for r in rows] == [step[0] for step in bench.PROGRESSION]
    assert all(r["verified"] is True for r in rows)
    assert (rows[0]["nics"], rows[0]["emulated_nics"]) == (1, 0)  # chapter 7: one NIC, no groups
    assert all((r["nics"], r["emulated_nics"], r["groups"]) == (2, 1, 2) for r in rows[1:])
    assert "2 (1 emu)" in result.stdout


def stage_options(parser: argparse.ArgumentParser) -> dict[str, tuple[str, object]]:
    """--option -> (dest, default) for every option of a parser, its help aside."""
    return {option: (action.dest, action.default) for action in parser._actions
            for option in action.option_strings if action.dest != "help"}


def connect_parser(stage) -> argparse.ArgumentParser:
    subparsers = next(a for a in stage.build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return subparsers.choices["connect"]


def bench_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    return parser


# The bench's own defaults, where it differs from the stages on purpose.
BENCH_DEFAULTS = {"timeout": 30.0}


@pytest.mark.parametrize("stage", [rdma_write, opqueue, multi_nic, threaded, batched],
                         ids=lambda m: m.__name__.split(".")[-1])
def test_bench_takes_every_stage_option_as_the_stage_does(stage):
    """Every option of a stage's connect is the bench's too: same dest, same default (the final stage's,
    which has every option), and a field of the same name in BenchConfig."""
    ours, theirs = stage_options(connect_parser(stage)), stage_options(bench_parser())
    final = stage_options(connect_parser(batched))
    for option, (dest, _) in ours.items():
        assert option in theirs, f"bench lacks {stage.__name__}'s {option}"
        assert theirs[option][0] == dest, option
        assert theirs[option][1] == BENCH_DEFAULTS.get(dest, final[option][1]), option
        assert dest in {f.name for f in dataclasses.fields(bench.BenchConfig)}, dest


def test_bench_and_stage_give_the_writer_the_same_options():
    argv = ["--page-size", "4K", "--in-flight", "8", "--nics", "3", "--no-warmup", "--link-timeout", "0",
            "--threads", "2", "--no-pad", "--batch", "5", "--fi-more"]
    stage_args = connect_parser(batched).parse_args([*argv, "00"])
    config = bench.BenchConfig.from_args(bench_parser().parse_args([*argv, "--stage", "batched"]))
    assert config.writer_options() == batched.BatchedWriter.options_from_args(stage_args)
    assert config.writer_options()["warmup"] is False and config.page_size == 4096
    assert bench.BenchConfig() == bench.BenchConfig.from_args(bench_parser().parse_args([]))


def test_threads_set_the_groups_from_chapter_11_on():
    with pytest.raises(fi.UsageError, match="--threads sets the groups"):
        bench.BenchConfig(stage="threaded", groups=4, threads=2).writer_options()
    assert bench.BenchConfig(stage="threaded", threads=2).writer_options()["groups"] == 2
    assert bench.BenchConfig(stage="multi_nic", groups=2).writer_options()["groups"] == 2


@pytest.mark.parametrize("args, message", [
    (["--stage", "nope"], "unknown stage 'nope'"),
    (["--in-flight", "0"], "pages in flight must be at least 1"),
    (["--sweep", "4K,big"], "'big' is not a size"),
    (["--sweep", "4K", "--progression"], "not allowed with argument --sweep"),
    (["--line-rate", "fast"], "'fast' is not a rate in bits per second"),
    (["--page-size", "1M", "--total", "4K"], "larger than the 4096-byte buffer"),
])
def test_bench_cli_bad_input(args, message):
    result = subprocess.run([sys.executable, "-m", "fabriclab", "bench", *args], capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 2
    assert message in result.stderr and "Traceback" not in result.stderr


def test_cuda_memory_without_cuda_is_a_clear_error():
    if gpu.cuda_status() == "ok":
        pytest.skip("this machine has CUDA")
    with pytest.raises(fi.UsageError, match="GPU memory was asked for"):
        memory.allocate("cuda", 4096)


@pytest.mark.gpu
@pytest.mark.skipif(gpu.cuda_status() != "ok", reason=f"needs CUDA: {gpu.cuda_status()}")
@pytest.mark.parametrize("provider, domain", [("shm", None), ("tcp;ofi_rxm", "lo")])
def test_write_into_remote_gpu_memory(provider, domain):
    with start_server("fabriclab.rdma_write", "--provider", provider, *(["--domain", domain] if domain else []),
                      "--memory", "cuda") as server:
        with memory.open_endpoint(provider, domain, "cuda") as stack, \
                opqueue.QueuedWriter(stack, server.address_hex, timeout=10, in_flight=16) as writer:
            plan = rdma_write.PagePlan.for_total(65536, 8 << 20)
            paths = writer.prepare(plan, "cuda")
            assert paths["local"] in ("cuda-direct", "cuda-staged")
            assert paths["remote_path"] in ("cuda-direct", "cuda-staged")
            print(f"{provider}: GPU paths {paths}")
            writer.transfer()
            report = writer.finish()
            assert report.verified is True and report.arrivals == plan.pages
