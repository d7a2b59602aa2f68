"""The CUDA IPC path's parts that need no GPU (fabriclab.ipc, the wire's IPC section, COPIED_IN): the gates
between processes (a writer either sees the gate shut or is waited for), forged descriptors and messages,
and the target's count of copied pages. tests/test_ipc_gpu.py runs the path itself on a GPU."""
import dataclasses
import mmap
import os
import signal
import struct
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from fabriclab import Engine, InvalidDescriptor, _native, control, ipc, wire
from fabriclab.completions import RegionState
from fabriclab.control import BadMessage

ROUTE = wire.IpcRoute(handle=bytes(range(64)), offset=4096, alloc_bytes=1 << 20, gate_pid=1234, gate_fd=7,
                      gate_token=99, gate_slot=3, key=0xABC, address=b"addr" * 8)


def test_descriptors_carry_the_ipc_section_both_kinds():
    plain = wire.decode_region(wire.encode_region(5, 9, 65536, [1, 2], [3, 4], ROUTE))
    assert plain.ipc == ROUTE and plain.landing is None and plain.keys == (3, 4)
    lanes = wire.PeerRegion(5, 10, 1 << 20, (7,), (8,))
    staged = wire.decode_region(wire.encode_landing(5, 9, 65536, lanes, 65536, 4096, 11, b"ctl", ROUTE))
    assert staged.ipc == ROUTE and staged.landing is not None and staged.landing.address == b"ctl"
    assert wire.decode_region(wire.encode_region(5, 9, 65536, [1], [3])).ipc is None


@pytest.mark.parametrize("forge", ["junk tail", "bad mark", "outside allocation", "short address", "slot zero",
                                   "huge offset"])
def test_forged_ipc_sections_are_invalid_descriptors(forge):
    route = ROUTE
    if forge == "outside allocation":
        route = dataclasses.replace(ROUTE, offset=(1 << 20) - 100)
    elif forge == "slot zero":
        route = dataclasses.replace(ROUTE, gate_slot=0)
    elif forge == "huge offset":
        route = dataclasses.replace(ROUTE, offset=(1 << 64) - 1)
    body = wire.encode_region(5, 9, 65536, [1], [3], route)[:-4]
    if forge == "junk tail":
        body = wire.encode_region(5, 9, 65536, [1], [3])[:-4] + b"xyz"
    elif forge == "bad mark":
        body = body.replace(b"IPC1", b"IPC2")
    elif forge == "short address":
        body = body[:-3]
    with pytest.raises(InvalidDescriptor):
        wire.decode_region(wire.seal(body))


# ------------------------------------------------------------------------------------------------ gates

WRITER = r"""
import sys, time
from fabriclab import ipc
pid, fd, token, engine, slot, key, mode = map(int, sys.argv[1:8])
gates = ipc.open_gates(pid, fd, token, engine)
print("open", flush=True)
if mode == 0:      # enter and stay inside until killed
    print("inside" if gates.enter(slot, key) else "shut", flush=True)
    time.sleep(600)
else:              # enter and leave in a loop, as copies do, until shut out
    entered = 0
    while True:
        if not gates.enter(slot, key):
            print("shut", entered, flush=True)
            break
        entered += 1
        gates.leave(slot)
"""


@pytest.fixture
def gates():
    """The gate slots of an engine of id 1, closed after the test."""
    made = ipc.Gates(1)
    yield made
    made.close()


def writer(gates, slot, key, mode, engine=1):
    return subprocess.Popen([sys.executable, "-c", WRITER, str(os.getpid()), str(gates.fd), str(gates.token),
                             str(engine), str(slot), str(key), str(mode)], stdout=subprocess.PIPE, text=True)


def test_gate_shut_waits_for_a_writer_inside_and_holds_a_dead_ones_slot(gates):
    slot = gates.take(42)
    child = writer(gates, slot, 42, 0)
    assert child.stdout.readline().strip() == "open"
    assert child.stdout.readline().strip() == "inside"
    assert gates.slots.inside(slot) == 1
    started = time.monotonic()
    assert not gates.shut(slot, 0.3)  # still inside: the slot is held, never given to another region
    assert time.monotonic() - started >= 0.3
    assert gates.held == 1 and slot not in gates.free
    child.send_signal(signal.SIGKILL)
    child.wait(10)
    assert not gates.slots.enter(slot, 42)  # shut stays shut


def test_gate_a_writer_never_passes_after_shut_returns(gates):
    """Dekker across processes: a writer loops enter/leave; once shut() returned True, no enter succeeds."""
    slot = gates.take(7)
    child = writer(gates, slot, 7, 1)
    assert child.stdout.readline().strip() == "open"
    time.sleep(0.2)
    assert gates.shut(slot, 5.0)
    inside_after = [gates.slots.inside(slot) for _ in range(1000)]
    words = child.stdout.readline().split()
    assert words[0] == "shut" and int(words[1]) > 0
    assert child.wait(10) == 0
    assert not any(inside_after)
    assert slot in gates.free


def test_gate_key_and_slot_reuse_shut_out_stale_writers(gates):
    slot = gates.take(1)
    assert gates.slots.enter(slot, 1) and not gates.slots.enter(slot, 2)
    gates.slots.leave(slot)
    assert gates.shut(slot, 1.0)
    again = [gates.take(k) for k in range(2, 2 + len(gates.free))]  # every free slot, the old one last
    assert again[-1] == slot
    assert not gates.slots.enter(slot, 1)  # the old region's key opens nothing
    with pytest.raises(Exception, match="already offers"):
        gates.take(99)


def test_gates_of_another_engine_or_process_are_refused():
    gates = ipc.Gates(5)
    try:
        with pytest.raises(ValueError, match="not the gate file"):
            ipc.open_gates(os.getpid(), gates.fd, gates.token + 1, 5)
        with pytest.raises(ValueError, match="not the gate file"):
            ipc.open_gates(os.getpid(), gates.fd, gates.token, 7)
        with pytest.raises(OSError):
            ipc.open_gates(os.getpid(), 987654, gates.token, 5)
        with open(os.devnull, "rb") as other:  # an fd that is no gate file
            with pytest.raises(ValueError, match="not a fabriclab gate file"):
                ipc.open_gates(os.getpid(), other.fileno(), gates.token, 5)
        assert ipc.open_gates(os.getpid(), gates.fd, gates.token, 5).slots == ipc.GATE_SLOTS
    finally:
        gates.close()


def test_gate_slots_refuse_indices_outside():
    slots = _native.GateSlots(mmap.mmap(-1, 4 * _native.GateSlots.BYTES))
    with pytest.raises(IndexError):
        slots.enter(4, 1)
    with pytest.raises(IndexError):
        slots.shut(-1)


def test_gates_under_threads_never_leak_a_passage(gates):
    """Many threads entering and leaving while the gate shuts: once shut() returned True, nobody is inside and
    nobody gets in; every thread sees the gate shut."""
    slot = gates.take(3)
    passed_after = []
    shut_done = threading.Event()

    def loop():
        while True:
            if not gates.slots.enter(slot, 3):
                return
            if shut_done.is_set():
                passed_after.append(1)
            gates.slots.leave(slot)

    threads = [threading.Thread(target=loop) for _ in range(4)]
    for t in threads:
        t.start()
    time.sleep(0.05)
    assert gates.shut(slot, 5.0)
    shut_done.set()
    for t in threads:
        t.join(10)
    assert not passed_after and gates.slots.inside(slot) == 0


# --------------------------------------------------------------------------------------- COPIED_IN


def test_copied_in_messages_are_checked():
    good = control.copied_in(3, 5, 9, 0xABC, 42, 16, 16 * 65536)
    assert control.read(good) == (control.COPIED_IN, 3, 5, (9, 0xABC, 42, 16, 16 * 65536))
    body = good[control.HEAD.size:]
    forged = {
        "truncated": good[:-1],
        "no pages": control.HEAD.pack(control.COPIED_IN, 3, 5) + struct.pack("<IQIQQ", 9, 1, 42, 0, 10),
        "more pages than bytes": control.HEAD.pack(control.COPIED_IN, 3, 5) + struct.pack("<IQIQQ", 9, 1, 42, 11, 10),
        "imm no caller gives": control.HEAD.pack(control.COPIED_IN, 3, 5) + struct.pack("<IQIQQ", 9, 1,
                                                                                         _native.MAX_IMM + 1, 1, 10),
        "no job": control.HEAD.pack(control.COPIED_IN, 3, 0) + body,
    }
    for what, message in forged.items():
        with pytest.raises(BadMessage):
            control.read(message)
            pytest.fail(what)


def test_copied_in_counts_for_expect_only_with_the_regions_key():
    with Engine("shm", pin=False, gpu=False, timeout=5) as engine:
        service = engine._service
        counter = service.ipc.copied_in
        state = RegionState([])
        counter.add(77, 0x5EC, state)
        counted = engine.expect(42, 24)
        counter.message(3, 1, 77, 0x5EC, 42, 16, 16 * 4096)
        with pytest.raises(BadMessage, match="key"):
            counter.message(3, 1, 77, 0x5ED, 42, 8, 8 * 4096)
        with pytest.raises(BadMessage, match="offers no CUDA IPC"):
            counter.message(3, 1, 78, 0x5EC, 42, 8, 8 * 4096)
        assert not counted.done()
        counter.message(3, 1, 77, 0x5EC, 42, 8, 8 * 4096)
        assert counted.result(5) == 24
        state.closed = True
        with pytest.raises(BadMessage, match="offers no CUDA IPC"):
            counter.message(3, 1, 77, 0x5EC, 42, 8, 8 * 4096)
        stats = engine.stats()["cuda_ipc"]
        assert stats["copied_in_pages"] == 24 and stats["copied_in_messages"] == 2


def test_host_memory_is_not_offered_and_routes_say_why():
    with Engine("shm", pin=False, gpu=False, timeout=5) as target, \
            Engine("shm", pin=False, gpu=False, timeout=5) as writer:
        region = target.register(np.zeros(65536, np.uint8))
        descriptor = region.descriptor()
        assert not region.ipc_offered and wire.decode_region(descriptor).ipc is None
        peer = writer.connect(target.address)
        local = writer.register(np.ones(65536, np.uint8))
        assert peer.same_host
        path, why = peer.route(local, descriptor)
        assert path == "host" and "host memory" in why
        with Engine("shm", pin=False, gpu=False, gpu_ipc=False, timeout=5) as off:
            assert off.stats()["cuda_ipc"]["enabled"] is False
            assert "gpu_ipc=False" in off.connect(target.address).route(off.register(np.ones(16, np.uint8)),
                                                                         descriptor)[1]
