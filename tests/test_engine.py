"""The native engine behind chapters 9-15: correctness across NICs x threads x batches, FI_MORE's flush
rule, a dead target, Ctrl-C, and bad arguments."""
import gc
import os
import signal
import threading
import time

import pytest

from fabriclab import batched, fi, gpu, memory, multi_nic, rdma_write, threaded
from fabriclab.tools.peers import start_server
from conftest import open_fds, provider_args, shared_target


target = shared_target("fabriclab.multi_nic", "--timeout", "10")


def writer_for(fabric, server, cls=batched.BatchedWriter, **options):
    stack = memory.open_endpoint(fabric[0], fabric[1], "host")
    try:
        return cls(stack, server.address_hex, 10, domains=fabric[1], **options)
    except BaseException:
        stack.close()
        raise


def transfer_once(writer, total, page):
    plan = rdma_write.PagePlan.for_total(page, total)
    writer.prepare(plan)
    stats = writer.transfer()
    report = writer.finish()
    writer.release()
    return plan, stats, report


CASES = [  # stage class, options, total bytes, page size
    (multi_nic.MultiNicWriter, dict(nics=1, warmup=False), 1 << 20, 4096),
    (multi_nic.MultiNicWriter, dict(nics=3, groups=3, warmup=False), 3 * 65536 + 100, 65536),
    (threaded.ThreadedWriter, dict(nics=4, threads=2, warmup=False, pin=False, shard=False), 1 << 20, 4096),
    (threaded.ThreadedWriter, dict(nics=4, threads=2, warmup=False, pad=False), 2 << 20, 65536),
    (batched.BatchedWriter, dict(nics=4, threads=2, warmup=False, lazy=False, batch=5), 1 << 20, 4096),
    (batched.BatchedWriter, dict(nics=2, threads=1, warmup=False, batch=16), (1 << 20) + 1, 65536),
    (batched.BatchedWriter, dict(nics=4, threads=2, warmup=False, batch=16, fi_more=True), 2 << 20, 4096),
]


def test_a_pinned_writer_leaves_the_target_other_cores(target):
    """Pinned writer threads and a busy-polling target on one host must not share cores: the writer names
    the cores its threads leave free, and a target short of them runs unpinned."""
    fabric, server = target
    with writer_for(fabric, server, threaded.ThreadedWriter, nics=2, threads=1, warmup=False) as writer:
        plan, stats, report = transfer_once(writer, 1 << 20, 65536)
        assert report.verified is True and report.arrivals == plan.pages
        allowed = sorted(os.sched_getaffinity(0))
        mine, theirs = writer.worker_cores(1), writer.target_cores(len(allowed) - 1)
        assert theirs == [c for c in allowed if c not in mine]
        assert writer.target_cores(len(allowed)) == []  # not enough free cores: unpinned
    with writer_for(fabric, server, threaded.ThreadedWriter, nics=2, threads=1, pin=False) as writer:
        assert writer.target_cores(1) == []  # an unpinned writer leaves the target to the scheduler


@pytest.mark.parametrize("cls, options, total, page", CASES, ids=[f"{c[0].stage}-{i}" for i, c in enumerate(CASES)])
def test_every_page_lands_exactly_once(target, cls, options, total, page):
    fabric, server = target
    with writer_for(fabric, server, cls, count_writes=True, **options) as writer:  # the checking mode counts each
        plan, stats, report = transfer_once(writer, total, page)
        assert stats.writes == plan.pages and stats.bytes == total
        assert report.arrivals == plan.pages == report.distinct_pages
        assert report.min_per_page == report.max_per_page == 1
        assert report.verified is True, report.mismatched_pages
        per_nic = stats.per_nic
        assert len(per_nic) == options["nics"]
        assert sum(n["completions"] for n in per_nic) == plan.pages
        assert all(n["writes"] > 0 for n in per_nic)  # the work really was spread over every NIC
        if fabric[0] == "shm" and options["nics"] > 1:
            assert stats.emulated_nics == options["nics"] - 1


def test_warm_up_writes_one_page_per_nic_before_timing(target):
    fabric, server = target
    with writer_for(fabric, server, nics=3, threads=1, warmup=True) as writer:
        plan, stats, report = transfer_once(writer, 64 * 4096, 4096)
        assert stats.writes == plan.pages
        # the warm-up writes complete (one per NIC) but are numbered past the run, so the target skips them
        assert sum(n["completions"] for n in stats.per_nic) == plan.pages + 3
        assert report.arrivals == plan.pages and report.duplicates == 0 and report.verified is True


def test_fi_more_runs_always_end_without_fi_more(target):
    """A tight in-flight cap makes runs end early, at odd lengths, again and again: the transfer must
    still finish (a run left open under FI_MORE would stall) and land byte-exact."""
    fabric, server = target
    for in_flight, batch in ((3, 16), (1, 4), (7, 5)):
        with writer_for(fabric, server, nics=2, threads=1, warmup=False, fi_more=True, batch=batch,
                            in_flight=in_flight) as writer:
            plan, stats, report = transfer_once(writer, 300 * 4096 + 17, 4096)
            assert report.verified is True and report.arrivals == plan.pages


def test_target_killed_mid_transfer(fabric):
    gc.collect()
    fds, threads = open_fds(), threading.active_count()  # the module's shared target has a reader thread here
    with start_server("fabriclab.multi_nic", *provider_args(*fabric)) as server:
        with writer_for(fabric, server, nics=2, threads=1, in_flight=8) as writer:
            writer.timeout = 2.0
            writer.prepare(rdma_write.PagePlan.for_total(65536, 64 << 30, buffer_bytes=1 << 20))
            threading.Timer(0.5, server.kill).start()
            start = time.monotonic()
            with pytest.raises(fi.FabricError) as err:
                writer.transfer()
            assert time.monotonic() - start < 20
            assert "engine" in str(err.value)
    gc.collect()
    assert open_fds() <= fds + 2
    assert threading.active_count() <= threads  # the engine's threads were joined


def test_keyboard_interrupt_stops_the_engine_and_python_goes_on(target):
    fabric, server = target
    with writer_for(fabric, server, nics=2, threads=1) as writer:
        writer.prepare(rdma_write.PagePlan.for_total(65536, 1 << 40, buffer_bytes=1 << 20))
        # Ctrl-C as an interactive session has it: a test run started in the background (a CI runner,
        # `make test &`) inherits SIGINT ignored, and would never see the KeyboardInterrupt
        previous = signal.signal(signal.SIGINT, signal.default_int_handler)
        try:
            threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGINT)).start()
            with pytest.raises(KeyboardInterrupt):
                writer.transfer()
        finally:
            signal.signal(signal.SIGINT, previous)
        writer.release()
        plan, stats, report = transfer_once(writer, 1 << 20, 65536)  # the same writer still works
        assert report.verified is True


@pytest.mark.parametrize("options, message", [
    (dict(nics=0), "number of NICs must be at least 1"),
    (dict(threads=0), "threads must be at least 1"),
    (dict(threads=(os.cpu_count() or 1) + 1), "more than this machine's"),
    (dict(batch=0), "batch must be at least 1"),
    (dict(in_flight=0), "pages in flight must be at least 1"),
])
def test_bad_arguments(target, options, message):
    fabric, server = target
    with pytest.raises(fi.UsageError, match=message):
        writer_for(fabric, server, **options)


def test_more_groups_than_nics_is_refused(target):
    fabric, server = target
    with writer_for(fabric, server, nics=1, threads=2, pin=False) as writer:
        with pytest.raises(fi.UsageError, match="2 GPU groups need at least as many NICs"):
            writer.prepare(rdma_write.PagePlan.for_total(4096, 1 << 20))


@pytest.mark.gpu
@pytest.mark.skipif(gpu.cuda_status() != "ok", reason=f"needs CUDA: {gpu.cuda_status()}")
def test_engine_writes_gpu_memory_into_gpu_memory():
    with start_server("fabriclab.multi_nic", "--provider", "shm", "--memory", "cuda") as server:
        with memory.open_endpoint("shm", None, "cuda") as stack, \
                batched.BatchedWriter(stack, server.address_hex, 10, nics=4, threads=2, warmup=False) as writer:
            plan = rdma_write.PagePlan.for_total(65536, 16 << 20)
            paths = writer.prepare(plan, "cuda")
            print(f"engine GPU paths: {paths}")
            assert paths["local"] in ("cuda-direct", "cuda-staged")
            writer.transfer()
            report = writer.finish()
            assert report.verified is True and report.arrivals == plan.pages, report
