"""Staged targets against hostile writers (issue 21): every field of every control message is checked against
what its sender was granted, a malformed message is dropped on its own (logged once per sender, counted), and
a writer that is gone never starves the others. The forged messages go through real control endpoints: a
writer engine whose FILLED messages are rewritten on their way out (``tamper_filled``), and
tests/forging_peer.py, a process speaking the protocol by hand. Staged targets here are in host memory
(Engine._register_staged_host), so they run anywhere."""
import logging
import os
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from fabriclab import TransferError, TransferTimeout, bootstrap, control, landing_target
from fabriclab.errors import StagingFailed
from fabriclab.wire import decode_region, seal as _seal, unseal as _unseal
from helpers import LINE_TIMEOUT, Child, PeerProcess, kill_outside_shm_locks, python
from test_staging import PAGE, WRITER, staged_target, writer_engine

FORGER = os.path.join(os.path.dirname(__file__), "forging_peer.py")


def tamper_filled(engine, rewrite):
    """Rewrite every FILLED ``engine`` sends as a writer: ``rewrite(region_id, lane, imm, entries)`` gives
    them back changed. All else stays real: the engine's writes, its control endpoint, the target's answers."""
    lander = engine._service.start_landing()
    send = lander.writer._to_target

    def forged(job, kind, body):
        if kind == control.FILLED:
            region_id, lane, imm, pages = control.FILLED_BODY.unpack_from(body)
            entries = np.frombuffer(body, control.PAGE_ENTRIES, pages, control.FILLED_BODY.size).copy()
            region_id, lane, imm, entries = rewrite(region_id, lane, imm, entries)
            body = control.FILLED_BODY.pack(region_id, lane, imm, entries.size) + entries.tobytes()
        send(job, kind, body)

    lander.writer._to_target = forged


def destination(dst):
    """A rewrite sending a lane's first page to byte ``dst`` (as the uint64 on the wire)."""
    def rewrite(region_id, lane, imm, entries):
        entries["dst"][0] = dst
        return region_id, lane, imm, entries
    return rewrite


def honest_write(writer, descriptor, address, value, pages, imm, timeout=20):
    peer = writer.connect(address)
    source = writer.register(np.full(len(pages) * PAGE, value, np.uint8))
    return peer.write_pages(source, np.arange(len(pages)), descriptor, pages, PAGE, imm=imm).result(timeout)


def test_a_filled_destination_that_wraps_below_the_region_writes_nothing_and_fails_the_transfer(fabric):
    """FILLED's destination 2**64 - 65536 was -65536 as int64: the page landed in the 64 KiB before the
    region and the transfer said OK. Now nothing is copied, the canary holds, the writer's transfer fails."""
    with staged_target(fabric) as target, writer_engine(fabric) as writer, writer_engine(fabric) as honest:
        memory = np.zeros(9 * PAGE, np.uint8)
        memory[:PAGE] = 0xAB  # the canary: the page before the region
        region = target._register_staged_host(memory[PAGE:])
        descriptor = region.descriptor()
        tamper_filled(writer, destination(2 ** 64 - PAGE))
        with pytest.raises(TransferError, match="outside region"):
            honest_write(writer, descriptor, target.address, 9, [0, 1], imm=3)
        assert np.all(memory[:PAGE] == 0xAB) and not np.any(memory[PAGE:])
        assert honest_write(honest, descriptor, target.address, 5, [2, 3], imm=4).pages == 2  # serves on
        assert target.expect(4, 2).result(10) == 2 and np.all(memory[3 * PAGE:5 * PAGE] == 5)
        assert target.stats()["staging"]["bad_control_messages"] >= 1


@pytest.mark.parametrize("dst", [2 ** 64 - (1 << 40), 1 << 40, 2 ** 63], ids=["far-below", "far-beyond", "2**63"])
def test_a_filled_destination_far_outside_the_region_never_crashes_the_target(fabric, dst):
    """Far destinations crashed the target process in its copier (segmentation fault)."""
    target = PeerProcess(fabric, 16 * PAGE, "--staged-host")
    try:
        with writer_engine(fabric) as writer, writer_engine(fabric) as honest:
            tamper_filled(writer, destination(dst))
            with pytest.raises(TransferError, match="outside region"):
                honest_write(writer, target.descriptor, target.address, 9, [0], imm=3)
            assert honest_write(honest, target.descriptor, target.address, 5, [4], imm=4).pages == 1
            assert target.ask("expect 4 1 10").startswith("landed 1 ")
            assert target.ask("count 9") == "0" and target.ask("count 5") == str(PAGE)
    finally:
        target.kill()


def another_regions_descriptor(descriptor, region_id):
    """``descriptor`` (a staged target's) with another region id, sealed again: what a writer holding one
    region's descriptor can make of it for a region it was never given."""
    body = bytearray(_unseal(descriptor, descriptor[:4], "region descriptor"))
    body[12:16] = region_id.to_bytes(4, "little")  # after the magic and the engine id
    return _seal(bytes(body))


def test_a_writer_lands_only_in_the_region_its_descriptor_names(fabric):
    """FILLED naming another staged region id landed there; so did a descriptor of another region made
    from one's own. Neither lands now: the lanes are granted for one region, and asking for lanes takes
    the region's key, which only its descriptor holds."""
    with staged_target(fabric) as target, writer_engine(fabric) as writer, writer_engine(fabric) as forger:
        given, other = np.zeros(4 * PAGE, np.uint8), np.zeros(4 * PAGE, np.uint8)
        descriptor = target._register_staged_host(given).descriptor()
        secret = target._register_staged_host(other)
        secret.descriptor()  # it is served: its descriptor went to someone else
        tamper_filled(forger, lambda region_id, lane, imm, entries: (secret.id, lane, imm, entries))
        with pytest.raises(TransferError):
            honest_write(forger, descriptor, target.address, 9, [0, 1], imm=3)
        forged = another_regions_descriptor(descriptor, secret.id)
        assert decode_region(forged).region_id == secret.id
        with pytest.raises(TransferError):
            honest_write(writer, forged, target.address, 7, [0, 1], imm=3, timeout=5)
        assert not np.any(other) and not np.any(given)
        assert honest_write(writer, descriptor, target.address, 7, [0, 1], imm=5).pages == 2
        assert target.expect(5, 2).result(10) == 2 and np.all(given[:2 * PAGE] == 7)


def forging_peer(fabric, descriptor, rate, *mode):
    """tests/forging_peer.py sending to the staged target of ``descriptor``, once its endpoint is open."""
    address = decode_region(descriptor).landing.address
    forger = Child(python(FORGER, fabric[0], fabric[1] or "-", address.hex(), rate, *mode))
    assert forger.line(LINE_TIMEOUT, "ready from the forger") == "ready"
    return forger


def stop(process):
    """End a forger cleanly (see tests/forging_peer.py), or kill it if it does not end within 10 s."""
    process.signal(signal.SIGTERM)
    try:
        process.proc.wait(10)
    except subprocess.TimeoutExpired:
        process.proc.kill()
        process.proc.wait(10)


def test_filled_for_a_lane_leased_to_another_writer_is_never_taken(fabric):
    """A forger claiming to be an honest writer (its engine id is in every descriptor it hands out) sends
    FILLED for that writer's first jobs and every lane, pointing their pages elsewhere. Job numbers were
    1, 2, 3...: the forged FILLED took the honest lanes' pages, and the honest transfers said OK. Now a lane
    is taken only from the writer it is leased to: every honest page lands where it was written."""
    with staged_target(fabric) as target, writer_engine(fabric) as writer:
        landed = np.zeros(16 * PAGE, np.uint8)
        region = target._register_staged_host(landed)
        descriptor = region.descriptor()
        forger = forging_peer(fabric, descriptor, 3000, "spoof", str(writer.id), str(region.id), "6", str(12 * PAGE))
        try:
            peer = writer.connect(target.address)
            data = np.random.default_rng(3).integers(1, 256, 8 * PAGE, dtype=np.uint8)
            source = writer.register(data)
            for _ in range(40):
                landed[:8 * PAGE] = 0
                assert peer.write_pages(source, np.arange(8), descriptor, np.arange(8), PAGE,
                                        imm=6).result(20).pages == 8
                assert target.expect(6, 8).result(10) == 8
                assert np.array_equal(landed[:8 * PAGE], data)
            assert not np.any(landed[8 * PAGE:])
        finally:
            stop(forger)


def test_garbage_at_a_high_rate_never_fails_an_honest_transfer(fabric, caplog):
    """Malformed control messages of every shape, ~1000 a second, while 200 honest transfers land: each
    message is handled on its own (one bad message dropped the honest ones read with it), and the log says
    so once per sender, not once per message."""
    caplog.set_level(logging.INFO, logger="fabriclab")
    with staged_target(fabric) as target, writer_engine(fabric) as writer:
        landed = np.zeros(16 * PAGE, np.uint8)
        descriptor = target._register_staged_host(landed).descriptor()
        forger = forging_peer(fabric, descriptor, 1000, "garbage")
        try:
            peer = writer.connect(target.address)
            source = writer.register(np.full(PAGE, 3, np.uint8))
            for i in range(200):
                assert peer.write_pages(source, [0], descriptor, [i % 16], PAGE, imm=8).result(10).pages == 1
            assert target.expect(8, 200).result(10) == 200
        finally:
            stop(forger)
        bad = target.stats()["staging"]["bad_control_messages"]
    lines = [r for r in caplog.records if r.name.startswith("fabriclab")]
    assert bad > 100 and len(lines) <= 20, [r.getMessage() for r in lines[:5]]


def test_a_killed_writer_never_starves_the_next_one(fabric):
    """Writer A streams transfers of 100 lanes (it asks for them all, takes each lane that frees) and is
    SIGKILLed: its request stayed first in the queue and took every lane its expired leases gave back, so
    writer B's one page waited past its deadline. Now a writer that stops speaking loses its requests and
    lanes within seconds, far inside the target's lease (30 s here), and B lands. The target is a process of
    its own. A is killed outside shm's locks (helpers.kill_outside_shm_locks): one killed inside them wedges
    the queue it held for good (libfabric 1.17), a limit of the provider this test does not measure."""
    target = PeerProcess(fabric, 200 * PAGE, "--staged-host", "--small-pool")
    try:
        packed = bootstrap.pack(target.address, target.descriptor).hex()
        greedy = subprocess.Popen([sys.executable, WRITER, fabric[0], fabric[1] or "-", packed, "100000", "4", "200"],
                                  stdout=subprocess.PIPE, text=True)
        try:
            assert target.ask("expect 4 2 30").startswith("landed 2 ")  # its first lane landed; it holds the rest
        finally:
            kill_outside_shm_locks(greedy, [target.proc.pid])  # SIGKILL: the writer that stops speaking mid-transfer
            greedy.wait(10)
        with writer_engine(fabric, timeout=10) as survivor:
            assert honest_write(survivor, target.descriptor, target.address, 5, [199], imm=5, timeout=10).pages == 1
        assert target.ask("expect 5 1 10").startswith("landed 1 ") and target.ask("count 5") == str(PAGE)
    finally:
        target.kill()


class _Stuck:
    """``inner`` (a real endpoint or completion queue) whose method ``call`` does not return until ``release``
    is set: a provider call stuck for good, as shm's are on a queue whose owner was SIGKILLed holding its
    lock. Everything else is the real object's."""

    def __init__(self, inner, call, release):
        self._inner, self._call, self._release = inner, call, release

    def __getattr__(self, name):
        method = getattr(self._inner, name)
        if name != self._call:
            return method

        def stuck(*args):
            self._release.wait()
            return method(*args)
        return stuck


def test_closing_a_target_whose_landing_thread_is_stuck_in_a_send_still_closes_its_copiers(fabric):
    """The landing thread is inside a send call that never returns when the engine closes (the watcher, which
    would give up on it after 2 s, stops with the engine). Close gave up on the thread and skipped closing the
    lanes' copiers, so their thread stayed for the life of the process. Now close gives up on the send as the
    watcher would, closes the copiers, and the stuck thread, once its call returns, ends touching nothing."""
    release = threading.Event()
    target = staged_target(fabric)
    try:
        landed = np.zeros(4 * PAGE, np.uint8)
        region = target._register_staged_host(landed)
        with writer_engine(fabric) as writer:  # one staged write, so the target has a copier
            honest_write(writer, region.descriptor(), target.address, 7, [0], imm=1)
        lander = target._service.landing
        copier = lander.target.copiers["host"]
        channel = lander.channel
        channel.stack.ep = _Stuck(channel.stack.ep, "try_post_send", release)
        lander.send_soon(lander.address, control.HEAD.pack(control.ALIVE, 1, 1))
        deadline = time.monotonic() + 10
        while channel.calling is None and time.monotonic() < deadline:
            time.sleep(0.01)
        assert channel.calling is not None, "the landing thread never entered the send"
        stuck = lander.thread
        time.sleep(channel.WEDGED_S)  # as long as the watcher would wait: then it is wedged
    finally:
        target.close()
    assert stuck.is_alive() and not copier.thread.is_alive()
    release.set()
    stuck.join(5)
    assert not stuck.is_alive(), "the stuck thread did not end once its call returned"


def test_a_control_queue_stuck_in_a_read_fails_staged_transfers_and_never_blocks_close(fabric):
    """The landing thread's read of the control endpoint's completion queue never returns. The watcher gives up
    on it and starts no second thread (it would be stuck the same way); new staged transfers fail at once,
    saying why; close returns, closes the lanes' copiers and leaves the endpoint open for good (closing it would
    wait for the lock the stuck read holds: a process that hung at its exit showed this)."""
    release = threading.Event()
    target = staged_target(fabric)
    try:
        region = target._register_staged_host(np.zeros(4 * PAGE, np.uint8))
        with writer_engine(fabric) as writer:
            honest_write(writer, region.descriptor(), target.address, 7, [0], imm=1)
            lander = target._service.landing
            copier = lander.target.copiers["host"]
            lander.channel.stack.cq = _Stuck(lander.channel.stack.cq, "poll", release)
            stuck = lander.thread
            deadline = time.monotonic() + lander.channel.WEDGED_S + 10
            while not lander.channel.dead and time.monotonic() < deadline:
                time.sleep(0.05)
            assert lander.channel.dead, "the watcher never gave up on the stuck read"
            time.sleep(0.5)
            assert lander.thread is stuck and lander.channel.stranded == 1, "a second landing thread was started"
            with staged_target(fabric) as other:  # the stuck engine as a writer to another staged target
                elsewhere = other._register_staged_host(np.zeros(PAGE, np.uint8)).descriptor()
                with pytest.raises(StagingFailed, match="stuck in the provider"):
                    target.connect(other.address).write_pages(target.register(np.ones(PAGE, np.uint8)), [0],
                                                              elsewhere, [0], PAGE).result(10)
    finally:
        target.close()
    assert not copier.thread.is_alive() and lander.channel in control._KEPT
    release.set()
    stuck.join(5)
    assert not stuck.is_alive()


# ------------------------------------------------------------------- lanes hogged (issue 31, item 5)


@pytest.mark.parametrize("requests", [1, 100], ids=["one-request", "100-requests"])
def test_a_writer_holding_every_lane_and_filling_none_never_starves_an_honest_one(fabric, requests):
    """A writer holding the region's descriptor (tests/forging_peer.py) asks for 2**32 - 1 lanes in ``requests``
    transfers, keeps them alive every 0.25 s and never fills a lane. It held every lane for a whole lease (the
    target's timeout, 30 s here), and each of its queued requests one lease more: an honest one-page write with
    a 20 s deadline failed. Now a transfer that fills none of the lanes it holds for FILL_S loses them, the
    lanes go round the writers waiting (one sender, one turn), and a writer may run REQUESTS_PER_SENDER
    transfers at a target at once: the honest page lands within FILL_S and some."""
    with staged_target(fabric, timeout=30) as target, writer_engine(fabric, timeout=20) as honest:
        landed = np.zeros(4 * PAGE, np.uint8)
        region = target._register_staged_host(landed)
        descriptor = region.descriptor()
        hog = forging_peer(fabric, descriptor, 1, "hog", str(region.id), str(decode_region(descriptor).landing.key),
                           str(requests))
        try:
            said = hog_said(hog, "holds 4")  # every lane of the pool
            started = time.monotonic()
            assert honest_write(honest, descriptor, target.address, 7, [3], imm=2, timeout=20).pages == 1
            took = time.monotonic() - started
            print(f"\nthe honest page landed {took:.1f} s after the hog held every lane ({requests} request(s))")
            assert target.expect(2, 1).result(10) == 1 and np.all(landed[3 * PAGE:] == 7)
            assert hog.poll() is None  # it still asks all along
            # the hog hears why it lost its lanes before the honest writer got one, but reads it on its own time
            said += hog_said(hog, "refused", "was not filled")
        finally:
            stop(hog)
        said += hog_said(hog, "held")
    assert took < landing_target.FILL_S + 5, f"the honest page took {took:.1f} s"
    assert "held 4" in said and any("was not filled" in line for line in said), said
    too_many = [line for line in said if f"at most {control.REQUESTS_PER_SENDER} transfers" in line]
    assert len(too_many) == max(requests - control.REQUESTS_PER_SENDER, 0), said


def hog_said(hog, until, saying=""):
    """The lines tests/forging_peer.py's hog prints from here up to one that starts with ``until`` (and holds
    ``saying``)."""
    said = [hog.line(LINE_TIMEOUT, f"the hog's {until!r}")]
    while not (said[-1].startswith(until) and saying in said[-1]):
        said.append(hog.line(LINE_TIMEOUT, f"the hog's {until!r}"))
    return said


def test_a_writer_with_more_transfers_at_a_target_than_it_may_run_there_lands_them_all(fabric):
    """A target runs at most REQUESTS_PER_SENDER transfers of one writer at once and refuses more; a writer
    with 150 one-page transfers into it at once holds the others back until one ends, so none is refused."""
    with staged_target(fabric) as target, writer_engine(fabric, timeout=60) as writer:
        region = target._register_staged_host(np.zeros(16 * PAGE, np.uint8))
        descriptor, peer = region.descriptor(), writer.connect(target.address)
        source = writer.register(np.full(PAGE, 5, np.uint8))
        transfers = [peer.write_pages(source, [0], descriptor, [i % 16], PAGE, imm=9) for i in range(150)]
        assert [t.result(60).pages for t in transfers] == [1] * 150
        assert target.expect(9, 150).result(10) == 150


def test_transfers_that_failed_at_the_writer_are_not_counted_against_its_next_ones(fabric):
    """REQUESTS_PER_SENDER transfers fail at the writer (their deadline passes while a hog holds every lane);
    the target still runs them until it takes them for gone (SILENT_S without an ALIVE naming them). The
    writer's next transfers wait for that instead of asking at once, so the target does not refuse them."""
    with staged_target(fabric, timeout=30) as target, writer_engine(fabric, timeout=30) as writer:
        region = target._register_staged_host(np.zeros(16 * PAGE, np.uint8))
        descriptor = region.descriptor()
        hog = forging_peer(fabric, descriptor, 1, "hog", str(region.id), str(decode_region(descriptor).landing.key),
                           "1")
        try:
            hog_said(hog, "holds 4")
            peer, source = writer.connect(target.address), writer.register(np.full(PAGE, 5, np.uint8))
            doomed = [peer.write_pages(source, [0], descriptor, [i % 16], PAGE, imm=9, timeout=0.5)
                      for i in range(control.REQUESTS_PER_SENDER)]
            for transfer in doomed:
                with pytest.raises(TransferTimeout):
                    transfer.result(10)
            after = [peer.write_pages(source, [0], descriptor, [i], PAGE, imm=10, timeout=25) for i in range(8)]
            assert [t.result(30).pages for t in after] == [1] * 8
        finally:
            stop(hog)
