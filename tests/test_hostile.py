"""fabriclab.Engine used as a careless or hostile user would (issue: the library under hostile use):
several writer engines into one target, a stopped target, a closed engine mid-transfer, bad arguments,
blocking callbacks, fork, dropped engines. Processes, signals and faults are real."""
import gc
import json
import math
import os
import signal
import struct
import subprocess
import sys
import threading
import time
import zlib

import numpy as np
import pytest

from fabriclab import Engine, InvalidDescriptor, OutOfRange, TransferError, bootstrap, fi
from conftest import open_fds
from helpers import PAGE, PeerProcess

WRITER = os.path.join(os.path.dirname(__file__), "hostile_writer.py")


def start_writer(fabric, peer_proc, writes, imm):
    packed = bootstrap.pack(peer_proc.address, peer_proc.descriptor).hex()
    return subprocess.Popen([sys.executable, WRITER, fabric[0], fabric[1] or "-", packed, str(writes), str(imm)],
                            stdout=subprocess.PIPE, text=True)


def test_several_writer_engines_into_one_target(fabric):
    """Many prefill engines into one decode engine: the target's CQ holds the peers' writes, whose
    completions carry no context of the target's (shm once took them for its own and crashed)."""
    target = PeerProcess(fabric, 16 * PAGE)
    try:
        writers = [start_writer(fabric, target, 300, imm) for imm in (1, 2)]
        for w in writers:
            assert w.communicate(timeout=120)[0].strip() == "wrote 300"
        # a long-lived engine here too, and a short-lived one beside it, in one process
        with Engine(fabric[0], domains=fabric[1], pin=False, timeout=10) as long_lived:
            region = long_lived.register(np.full(PAGE, 3, np.uint8))
            peer = long_lived.connect(target.address)
            peer.write_pages(region, [0], target.descriptor, [0], PAGE, imm=3).result(10)
            with Engine(fabric[0], domains=fabric[1], pin=False, timeout=10) as short_lived:
                other = short_lived.register(np.full(PAGE, 3, np.uint8))
                short_lived.connect(target.address).write_pages(other, [0], target.descriptor, [1], PAGE,
                                                                 imm=3).result(10)
            for i in range(50):
                peer.write_pages(region, [0], target.descriptor, [i % 16], PAGE, imm=3).result(10)
        for imm, count in ((1, 300), (2, 300), (3, 52)):
            assert target.ask(f"expect {imm} {count} 20").startswith(f"landed {count} ")
        assert target.proc.poll() is None
    finally:
        target.close()


@pytest.mark.parametrize("fi_more", [False, True], ids=["plain", "fi_more"])
def test_buffer_safe_is_said_only_when_no_write_can_read_the_buffer(fabric, fi_more):
    """A stopped target: the transfer fails, but its writes are still posted and the target reads them
    once it runs again; buffer_safe must stay False until they are reported (wait_safe). With FI_MORE,
    the stall is met while flushing a run of writes (which once took the service's NICs for a write
    run's and crashed)."""
    target = PeerProcess(fabric, 1024 * PAGE)
    try:
        with Engine(fabric[0], domains=fabric[1], pin=False, timeout=2, fi_more=fi_more) as engine:
            data = np.full(1024 * PAGE, 0x11, np.uint8)
            region = engine.register(data)
            peer = engine.connect(target.address)
            os.kill(target.proc.pid, signal.SIGSTOP)
            try:
                with pytest.raises(TransferError) as failed:
                    peer.write_pages(region, range(1024), target.descriptor, range(1024), PAGE).result(20)
                safe_at_failure = failed.value.buffer_safe
                if safe_at_failure:
                    data[:] = 0x22  # the engine promised that no write can read this any more
            finally:
                os.kill(target.proc.pid, signal.SIGCONT)
            if not safe_at_failure:
                assert failed.value.wait_safe(20)
                data[:] = 0x22
            time.sleep(1)  # let the target finish whatever it was still copying
            assert target.ask("count 34") == "0"  # 0x22 never reached the target
    finally:
        target.close()


def test_closing_the_engine_mid_transfer_does_not_claim_the_buffer_safe(fabric):
    target = PeerProcess(fabric, 1024 * PAGE)
    try:
        engine = Engine(fabric[0], domains=fabric[1], pin=False, timeout=10)
        region = engine.register(np.full(1024 * PAGE, 0x11, np.uint8))
        peer = engine.connect(target.address)
        os.kill(target.proc.pid, signal.SIGSTOP)
        try:
            transfer = peer.write_pages(region, range(1024), target.descriptor, range(1024), PAGE)
            time.sleep(0.3)
            engine.close()
            with pytest.raises(TransferError, match="closed") as failed:
                transfer.result(5)
            assert not failed.value.buffer_safe and not transfer.wait_safe(0.1)
            assert engine.stats()["closed"]
            region.close()  # after the engine: nothing left to do, no error
        finally:
            os.kill(target.proc.pid, signal.SIGCONT)
    finally:
        target.close()


def test_bad_expectations_are_refused_and_the_reaper_survives():
    with Engine("shm", pin=False, timeout=5) as a, Engine("shm", pin=False, timeout=5) as b:
        for imm, count in ((-1, 1), (2 ** 64, 1), (1, 2 ** 64 + 1), (1, 0), (1.5, 1), (1, True)):
            with pytest.raises(fi.UsageError):
                b.expect(imm, count)
        src, dst = a.register(np.ones(PAGE, np.uint8)), b.register(np.zeros(PAGE, np.uint8))
        landed = b.expect(9, 1)
        a.connect(b.address).write_pages(src, [0], dst.descriptor(), [0], PAGE, imm=9).result(5)
        assert landed.result(5) == 1
        assert b.expect(10, 1, timeout=0.2).exception(5) is not None  # deadlines still enforced


@pytest.mark.parametrize("bad", [math.nan, math.inf, -5, 0, "3", True])
def test_every_timeout_is_positive_and_finite(bad):
    with pytest.raises(fi.UsageError, match="timeout"):
        Engine("shm", pin=False, timeout=bad)
    if bad != 0:
        with pytest.raises(fi.UsageError, match="link_timeout"):
            Engine("shm", pin=False, link_timeout=bad)
    with Engine("shm", pin=False, timeout=5) as a, Engine("shm", pin=False, timeout=5) as b:
        src, dst = a.register(np.ones(PAGE, np.uint8)), b.register(np.zeros(PAGE, np.uint8))
        peer = a.connect(b.address)
        with pytest.raises(fi.UsageError, match="timeout"):
            peer.write_pages(src, [0], dst.descriptor(), [0], PAGE, timeout=bad)
        with pytest.raises(fi.UsageError, match="timeout"):
            b.expect(1, 1, timeout=bad)
        with pytest.raises(fi.UsageError, match="timeout"):
            dst.close(timeout=bad)


def test_no_failover_still_means_zero_and_writes_to_a_healthy_peer_succeed():
    with Engine("shm", pin=False, timeout=5, link_timeout=0) as a, Engine("shm", pin=False) as b:
        src, dst = a.register(np.ones(PAGE, np.uint8)), b.register(np.zeros(PAGE, np.uint8))
        a.connect(b.address).write_pages(src, [0], dst.descriptor(), [0], PAGE).result(5)


def test_a_blocking_callback_does_not_stall_the_engine():
    with Engine("shm", pin=False, timeout=10) as a, Engine("shm", pin=False, timeout=10) as b:
        src, dst = a.register(np.ones(4 * PAGE, np.uint8)), b.register(np.zeros(4 * PAGE, np.uint8))
        peer = a.connect(b.address)
        release, started, ran_on = threading.Event(), threading.Event(), []

        def blocking(future):
            ran_on.append(threading.current_thread().name)
            started.set()
            release.wait(10)

        first = peer.write_pages(src, [0], dst.descriptor(), [0], PAGE)
        first.add_done_callback(blocking)
        first.result(5)
        started.wait(5)  # the callback runs on a thread of its own, maybe after result() returned: let it block
        try:
            # the callback blocks; the engine still resolves the next transfers
            for page in (1, 2, 3):
                assert peer.write_pages(src, [page], dst.descriptor(), [page], PAGE).result(5).writes == 1
        finally:
            release.set()
        assert ran_on and ran_on[0] != "fabriclab-engine-reaper"


def test_a_transfer_cannot_be_cancelled_once_submitted():
    with Engine("shm", pin=False, timeout=5) as a, Engine("shm", pin=False) as b:
        src, dst = a.register(np.ones(PAGE, np.uint8)), b.register(np.zeros(PAGE, np.uint8))
        transfer = a.connect(b.address).write_pages(src, [0], dst.descriptor(), [0], PAGE)
        assert transfer.cancel() is False
        assert transfer.result(5).writes == 1


def test_after_fork_the_child_refuses_the_inherited_engine_and_makes_its_own():
    with Engine("shm", pin=False, timeout=5) as parent, Engine("shm", pin=False, timeout=5) as target:
        src, dst = parent.register(np.ones(PAGE, np.uint8)), target.register(np.zeros(PAGE, np.uint8))
        address, descriptor = target.address, dst.descriptor()
        pid = os.fork()
        if pid == 0:  # the child: report through the exit code only
            code = 0
            try:
                try:
                    parent.connect(address)
                    code = 10  # the inherited engine must refuse
                except fi.UsageError as exc:
                    code = 0 if "fork" in str(exc) else 11
                started = time.monotonic()
                parent.close()
                if time.monotonic() - started > 2:
                    code = code or 12
                with Engine("shm", pin=False, timeout=5) as own:
                    mine = own.register(np.full(PAGE, 7, np.uint8))
                    own.connect(address).write_pages(mine, [0], descriptor, [0], PAGE, imm=4).result(5)
            except BaseException:
                code = code or 13
            os._exit(code)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                break
            time.sleep(0.05)
        else:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            pytest.fail("the child hung")
        assert os.waitstatus_to_exitcode(status) == 0
        assert target.expect(4, 1).result(5) == 1
        parent.connect(address).write_pages(src, [0], descriptor, [0], PAGE).result(5)  # the parent's still works


def test_dropped_engines_close_themselves():
    def drop_one():
        engine = Engine("shm", pin=False)
        engine.register(np.zeros(PAGE, np.uint8))

    def engine_threads():
        return [t for t in threading.enumerate() if t.name.startswith("fabriclab-engine")]

    def settle():  # a collected engine is closed on a thread of its own: wait for those to finish
        gc.collect()
        deadline = time.monotonic() + 20
        while engine_threads() and time.monotonic() < deadline:
            time.sleep(0.05)

    mine = lambda: [n for n in os.listdir("/dev/shm") if n.startswith(f"{os.getpid()}:")]  # noqa: E731
    drop_one()
    settle()
    threads, fds, regions = threading.active_count(), open_fds(), len(mine())
    for _ in range(20):
        drop_one()
    settle()
    assert not engine_threads()
    assert threading.active_count() <= threads
    assert len(mine()) <= regions
    assert open_fds() <= fds


def _sealed_address(body: bytes) -> bytes:
    return body + struct.pack("<I", zlib.crc32(body))


def test_malformed_inputs_get_typed_errors():
    with Engine("shm", pin=False, timeout=5) as a, Engine("shm", pin=False) as b:
        src, dst = a.register(np.ones(4 * PAGE, np.uint8)), b.register(np.zeros(4 * PAGE, np.uint8))
        for address in (_sealed_address(b"FLEN\0\0\0\0"),  # a valid checksum over a short body
                        _sealed_address(b"FLEN" + struct.pack("<QH", 1, 1) + struct.pack("<H", 0))):  # empty NIC
            with pytest.raises(InvalidDescriptor):
                a.connect(address)
        peer = a.connect(b.address)
        for call in (lambda: peer.write_pages(src, [0], dst.descriptor(), [0], 4096.5),
                     lambda: peer.write_pages(src, [0.5], dst.descriptor(), [0], PAGE),
                     lambda: peer.write(src, dst.descriptor(), dst_offset=1.5, length=PAGE),
                     lambda: peer.write(src, dst.descriptor(), length=float(PAGE))):
            with pytest.raises(fi.UsageError, match="integer"):
                call()
        with pytest.raises(OutOfRange, match=str(2 ** 64 - 1)):
            peer.write_pages(src, [0], dst.descriptor(), np.array([2 ** 64 - 1], np.uint64), PAGE)
        with pytest.raises(OutOfRange, match=str(2 ** 70)):
            peer.write_pages(src, [0], dst.descriptor(), [2 ** 70], PAGE)
        for options in ({"batch": 0}, {"threads": 0}, {"nics": 0}, {"in_flight": 0}, {"threads": 1.5}):
            with pytest.raises(fi.UsageError):
                Engine("shm", pin=False, **options)
        # a read-only buffer is a fine source of writes
        a.connect(b.address).write_pages(a.register(bytes(PAGE)), [0], dst.descriptor(), [3], PAGE).result(5)
    assert a.stats()["closed"]  # the last snapshot, not an AttributeError
    src.close()  # after the engine closed: nothing to do



KILLED_PEER_WRITER = os.path.join(os.path.dirname(__file__), "killed_peer_writer.py")


@pytest.mark.parametrize("submitters, mode", [(1, "wait"), (3, "close")], ids=["wait-then-close", "close-in-flight"])
def test_close_never_blocks_after_the_peer_is_killed_mid_transfer(fabric, submitters, mode):
    """Large transfers queued, the peer SIGKILLed 50 ms in, then Engine.close(): it returns within its
    worker deadline even when a worker is stuck inside the provider (shm spins for ever on a lock its
    killed peer held), every transfer fails typed, and a transfer whose write may still be inside the
    provider never claims its buffer safe. In a process of its own: a stuck worker ends only with it."""
    proc = subprocess.run([sys.executable, KILLED_PEER_WRITER, fabric[0], fabric[1] or "-", "256",
                           "2", str(submitters), mode], capture_output=True, text=True, timeout=150,
                          cwd=os.path.dirname(__file__))
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    print(report["close_s"], report["stranded"], report["outcomes"])
    assert report["close_s"] < report["exit_timeout"] + 5
    assert report["submitters_alive"] == 0
    outcomes = report["outcomes"]
    assert len(outcomes) == 2 * submitters
    assert all(kind in ("ok", "PeerLost", "TransferTimeout", "TransferError") for kind, _ in outcomes), outcomes
    assert any(kind != "ok" for kind, _ in outcomes), "1 GiB into a killed peer all reported landed"
    if report["stranded"]:
        # the stuck worker is inside a write of some unfinished transfer: that one cannot be safe
        assert not all(safe for kind, safe in outcomes if kind != "ok"), outcomes


@pytest.mark.parametrize("mode", ["region", "region-now"], ids=["after-they-failed", "while-in-flight"])
def test_closing_a_region_after_its_peer_was_killed_does_not_sit_out_the_timeout(fabric, mode):
    """Transfers into a peer SIGKILLed mid-transfer fail typed; the region is closed after they failed, or at
    once. Writes into a dead peer can never finish (shm never reports them, and its worker may stay stuck
    inside the provider on a lock the peer held), so Region.close() must not wait for them (it waited the
    engine's whole timeout: lesson 17 passed timeout=0.5 to get round it): the engine sees the peer's process
    gone and fails them with PeerLost; their registration stays until the engine closes (a functional bound,
    half the timeout, not a speed figure). In a process of its own: a stuck worker ends only with it."""
    proc = subprocess.run([sys.executable, KILLED_PEER_WRITER, fabric[0], fabric[1] or "-", "256", "2", "1",
                           mode], capture_output=True, text=True, timeout=150, cwd=os.path.dirname(__file__))
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    print(report["region_close_s"], report["close_s"], report["stranded"], report["outcomes"])
    assert report["region_close_s"] < report["timeout"] / 2, report
    assert report["close_s"] < report["exit_timeout"] + 5
    assert report["submitters_alive"] == 0
    outcomes = report["outcomes"]
    assert len(outcomes) == 2
    assert all(kind in ("ok", "PeerLost", "TransferTimeout") for kind, _ in outcomes), outcomes
    assert any(kind != "ok" for kind, _ in outcomes), "512 MiB into a killed peer all reported landed"
    assert report["shm_left"] == [] or report["stranded"], "the writer left its shm regions behind"


CLOSED_TARGET_HERE = os.path.join(os.path.dirname(__file__), "closed_target_here.py")


def test_a_target_closed_in_this_process_is_never_a_segfault(fabric):
    """Writer and target in one process, one closed first (two engines, either writing into the other, the
    lessons' LocalPair): shm's address vector used the closed endpoint's own mapping, unmapped at its close,
    and the other's next post, completion, answer or insert segfaulted (target first: 4 runs in 5; writer
    first, the target answering the writer's queued writes: 4 runs of 20 rounds in 6). Now every write ends
    typed: pending ones fail (the writer's close or deadline), new ones and connect() are refused as PeerLost,
    and the regions leave /dev/shm once both closed. 20 rounds, in a process of its own."""
    proc = subprocess.run([sys.executable, CLOSED_TARGET_HERE, fabric[0], fabric[1] or "-", "20"],
                          capture_output=True, text=True, timeout=240, cwd=os.path.dirname(__file__))
    assert proc.returncode == 0, f"exit {proc.returncode}: {proc.stderr[-3000:]}"
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    outcomes = report["outcomes"]
    print(outcomes)
    assert outcomes["write_before_close"] == {"ok": 20}, outcomes
    assert outcomes["write_after_close"] == outcomes["connect_after_close"] == {"PeerLost": 20}
    # its receiver kept open for the sender (unprogressed): writes stall; a provider may also refuse them
    assert sum(outcomes["local_pair"].values()) == 20
    assert set(outcomes["local_pair"]) <= {"ok", "FabricError"}, outcomes["local_pair"]
    for case, count in (("target_first", 20), ("writer_first", 80), ("both_ways", 40)):
        assert sum(outcomes[case].values()) == count
        assert set(outcomes[case]) <= {"ok", "TransferError", "TransferTimeout", "PeerLost"}, outcomes[case]
    assert report["shm_left"] == []
