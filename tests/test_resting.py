"""Idle engines rest (native/service.c): a worker with nothing to do naps instead of holding a core, wakes at
once for a write handed to it, and still polls its NICs so that writes into it land (software providers
move an incoming write only when the target polls). Between processes, over shm and tcp."""
import hashlib
import os
import time

import numpy as np
import pytest

from fabriclab import Engine
from helpers import PAGE, PeerProcess, pages_of

THREADS = 2


def cpu_seconds(pid: int) -> float:
    """User plus system CPU time of every thread of process ``pid`` so far."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@pytest.fixture
def writer(fabric):
    with Engine(fabric[0], domains=fabric[1], nics=THREADS, threads=THREADS, pin=False, timeout=10) as e:
        yield e


def test_writes_after_quiet_gaps_complete_and_land(fabric, writer):
    """Both sides rest through each gap; each write is handed to a resting writer worker and lands in a target
    whose workers rest too."""
    target = PeerProcess(fabric, 8 * PAGE)
    try:
        data = pages_of(3, 8)
        region = writer.register(data)
        peer = writer.connect(target.address)
        for i, gap in enumerate([0.0, 0.001, 0.02, 0.15, 0.4, 1.0, 0.15]):
            time.sleep(gap)
            result = peer.write_pages(region, [i], target.descriptor, [i], PAGE, imm=40 + i).result(timeout=10)
            assert result.writes == 1 and result.buffer_safe
            assert target.ask(f"expect {40 + i} 1 10").startswith("landed 1 ")
        want = np.zeros(8 * PAGE, dtype=np.uint8)
        want[:7 * PAGE] = data[:7 * PAGE]
        assert target.ask("digest") == f"sha256={hashlib.sha256(want).hexdigest()}"
    finally:
        target.close()


def test_a_stream_after_a_quiet_gap_lands_whole(fabric, writer):
    """Many pages over every NIC, into a target quiet for long: nothing is lost while its workers wake."""
    target = PeerProcess(fabric, 64 * PAGE)
    try:
        data = pages_of(4, 64)
        region = writer.register(data)
        peer = writer.connect(target.address)
        time.sleep(0.5)
        assert peer.write_pages(region, range(64), target.descriptor, range(64), PAGE, imm=9).result(10).writes >= 1
        assert target.ask("expect 9 64 10") == f"landed 64 sha256={hashlib.sha256(data).hexdigest()}"
    finally:
        target.close()


def test_idle_engines_leave_the_cores(fabric, writer):
    """Connected and quiet for a second, neither the writer (this process) nor the target (another process)
    keeps a core busy. Before workers rested, each idle worker polled without a pause: a whole core each on
    a quiet host (and still 0.1-0.2 s a second for two workers on a 2-core box loaded 5x over). Two resting
    workers and the reaper take about 0.02 s a second: the bound, 0.05 s a second for either process, is generous."""
    target = PeerProcess(fabric, 4 * PAGE, f"--threads={THREADS}")
    try:
        region = writer.register(pages_of(5, 4))
        peer = writer.connect(target.address)
        peer.write_pages(region, range(4), target.descriptor, range(4), PAGE, imm=1).result(timeout=10)
        assert target.ask("expect 1 4 10").startswith("landed 4 ")
        time.sleep(0.1)  # past the spinning that follows work
        # over 2 s: CPU time comes in 10 ms ticks, and 5 of them in one second is the bound itself
        mine, theirs = cpu_seconds(os.getpid()), cpu_seconds(target.proc.pid)
        time.sleep(2.0)
        mine, theirs = cpu_seconds(os.getpid()) - mine, cpu_seconds(target.proc.pid) - theirs
        assert mine < 0.1 and theirs < 0.1, f"CPU seconds over 2 s idle: writer {mine:.2f}, target {theirs:.2f}"
        # and the rested engines still work
        peer.write_pages(region, [0], target.descriptor, [0], PAGE, imm=2).result(timeout=10)
        assert target.ask("expect 2 1 10").startswith("landed 1 ")
    finally:
        target.close()


def test_an_engine_with_resting_workers_closes_promptly(fabric):
    with Engine(fabric[0], domains=fabric[1], nics=THREADS, threads=THREADS, pin=False, timeout=10) as e:
        time.sleep(0.5)
        started = time.monotonic()
        e.close()
        assert time.monotonic() - started < 5


def test_small_transfers_start_at_an_awake_worker_within_the_regions_nics(fabric):
    """A transfer of fewer writes than NICs starts at a NIC whose worker is awake, never outside the NICs the
    region leaves through (Region.nic_slots: set by hand, as tests/test_api.py does), and every page lands."""
    target = PeerProcess(fabric, 64 * PAGE)
    try:
        with Engine(fabric[0], domains=fabric[1], nics=4, threads=2, pin=False, timeout=10) as engine:
            data = pages_of(6, 64)
            region = engine.register(data)
            region.nic_slots, region._nic_order = [1, 3], np.array([1, 3], dtype=np.uint16)
            peer = engine.connect(target.address)
            for i in range(40):
                if i % 10 == 9:
                    time.sleep(0.05)  # every worker at rest: the transfer starts where it was told
                peer.write_pages(region, [i], target.descriptor, [i], PAGE, imm=7).result(timeout=10)
            want = np.zeros(64 * PAGE, dtype=np.uint8)
            want[:40 * PAGE] = data[:40 * PAGE]
            assert target.ask("expect 7 40 10") == f"landed 40 sha256={hashlib.sha256(want).hexdigest()}"
            writes = [n["writes"] for n in engine.stats()["per_nic"]]
            assert writes[0] == writes[2] == 0 and writes[1] + writes[3] == 40, writes
    finally:
        target.close()
