"""Chapters 6-7 and the bench harness: one-sided writes land exactly once, byte-exact; bad input is
refused before any post; a dead target is an error within the timeout."""
import gc
import json
import subprocess
import sys
import time

import pytest

from fabriclab import fi, gpu, memory, opqueue, rdma_write
from fabriclab.tools import bench
from fabriclab.tools.peers import start_server
from conftest import open_fds, provider_args

# total bytes, page size: 1 byte, whole pages, and totals that are not a multiple of the page
TRANSFERS = [(1, 1), (4096, 4096), (65536, 4096), (1 << 20, 65536), (3 * 65536 + 123, 65536), (1 << 20, 1 << 20)]


@pytest.fixture
def target(fabric):
    with start_server("fabriclab.rdma_write", *provider_args(*fabric), "--timeout", "5") as server:
        yield fabric, server


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
    results = bench.sweep([4096, 65536], [1, 16], total=1 << 20, warmup=0)
    assert [(r.page_size, r.in_flight) for r in results] == [(4096, 1), (4096, 16), (65536, 1), (65536, 16)]
    assert all(r.verified for r in results)


@pytest.mark.parametrize("args, message", [
    (["--stage", "nope"], "unknown stage 'nope'"),
    (["--in-flight", "0"], "pages in flight must be at least 1"),
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
