"""Same-host GPU peers through CUDA IPC (``cuda-ipc``), the target's half: what a GPU region's descriptor
offers a writer on its host, the gates that keep writers out of a closed region, and the count of the pages
they copied in. The writer's half is ``fabriclab.ipc_writer``.

A GPU region's descriptor carries (``wire.IpcRoute``) the CUDA IPC handle of the allocation holding it (the
allocation's: torch's and cupy's caching allocators hand out pieces of larger ones), the region's offset in
that allocation, the device's UUID, the region's gate, the region's key and the engine's control endpoint. A
writer on the same host opens the allocation once, copies pages into it with its own GPU, and then tells the
target, over the control channel, how many pages carrying which immediate value it copied (COPIED_IN):
the target counts them for ``expect`` as it counts writes through the NICs. The bytes are in place before
the message leaves (the writer waits for its copy's event first).

Gates. Peers' writes through the NICs stop when a region is deregistered; a CUDA IPC mapping has no such
switch, and the memory of a closed region goes back to its owner (torch's cache hands it to the next
tensor). So each exported region has a gate in memory the engine shares with its writers (a memfd, opened by
writers as /proc/<pid>/fd/<fd>; it vanishes with the process): a writer passes it before each copy and leaves
it when the copy is done (native/gate.c: atomic, so that a writer either sees the gate shut or is seen
inside); ``Region.close`` shuts it and waits until no writer is inside. A writer that died inside (SIGKILL
mid-copy; its copy ends with its CUDA context) holds the slot: close then waits the engine's timeout, keeps
the region's memory referenced (never handed back while a copy may still write it) and warns.

Trust: a peer that can open the allocation can write anywhere in it; the gate and the key keep honest peers
right, as rkeys do on the NICs. Messages are still checked as untrusted input (``fabriclab.control``).
"""
from __future__ import annotations

import collections
import mmap
import os
import secrets
import struct
import threading
import time
from dataclasses import dataclass

from . import _native, fi, gpu
from .completions import RegionState
from .control import BadMessage

GATE_SLOTS = 4096  # regions one engine exports at once (slot 0 is the header)
_GATE_HEAD = struct.Struct("<8sQQ")  # magic, engine id, token
_GATE_MAGIC = b"FLGATES1"
_CU_IPC_HANDLE_BYTES = 64


@dataclass(frozen=True)
class Export:
    """What CUDA IPC needs of a GPU region: its allocation's handle, its offset there, the allocation's size."""
    handle: bytes
    offset: int
    alloc_bytes: int


def export(pointer: int, length: int, device: int) -> Export:
    """The CUDA IPC export of ``[pointer, pointer + length)`` on ``device``; CudaError saying why not (memory
    from cuMemCreate/VMM, such as torch's expandable segments, or managed memory, has no legacy IPC handle)."""
    d = gpu.require_cuda()
    gpu.primary_context(device)
    base, size = gpu.check(d.cuMemGetAddressRange(pointer), "cuMemGetAddressRange")
    handle = gpu.check(d.cuIpcGetMemHandle(base), "cuIpcGetMemHandle")
    raw = bytes(handle.reserved)
    assert len(raw) == _CU_IPC_HANDLE_BYTES, "CUipcMemHandle is 64 bytes"
    offset = pointer - int(base)
    if offset + length > int(size):
        raise gpu.CudaError(f"the region ({length} bytes) runs past its CUDA allocation")
    return Export(raw, offset, int(size))


class Gates:
    """The gate slots of one engine, in a memfd its writers map (:func:`open_gates`). Slot 0 is a header
    (magic, engine id, a random token the descriptors carry, so that a writer never takes another process's
    file for it)."""

    def __init__(self, engine_id: int) -> None:
        self.fd = os.memfd_create("fabriclab-gates", os.MFD_CLOEXEC)
        try:
            os.ftruncate(self.fd, GATE_SLOTS * _native.GateSlots.BYTES)
            self.memory = mmap.mmap(self.fd, GATE_SLOTS * _native.GateSlots.BYTES)
        except BaseException:
            os.close(self.fd)
            raise
        self.token = secrets.randbits(64) or 1
        _GATE_HEAD.pack_into(self.memory, 0, _GATE_MAGIC, engine_id, self.token)
        self.slots = _native.GateSlots(self.memory)
        self.lock = threading.Lock()
        self.free = collections.deque(range(1, GATE_SLOTS))
        self.held = 0  # slots a writer that died inside keeps

    def take(self, key: int) -> int:
        """A slot for a region of ``key``, its gate open; UsageError once GATE_SLOTS regions are exported."""
        with self.lock:
            if not self.free:
                raise fi.UsageError(f"this engine already offers {GATE_SLOTS - 1} GPU regions to CUDA IPC peers")
            slot = self.free.popleft()
        self.slots.open(slot, key)
        return slot

    def shut(self, slot: int, timeout: float) -> bool:
        """Shut ``slot``'s gate and wait (up to ``timeout`` s) until no writer is inside: True, and the slot is
        free again; False if writers stayed inside (the slot is kept)."""
        deadline = time.monotonic() + timeout
        inside = self.slots.shut(slot)
        while inside and time.monotonic() < deadline:
            time.sleep(0.0002)
            inside = self.slots.inside(slot)
        with self.lock:
            if inside:
                self.held += 1
                return False
            self.free.append(slot)
            return True

    def close(self) -> None:
        self.slots.close()
        self.memory.close()  # writers keep their own mappings of the memfd
        os.close(self.fd)


def open_gates(pid: int, fd: int, token: int, engine_id: int) -> _native.GateSlots:
    """A writer's view of a target's gates: its memfd through /proc. OSError or ValueError when it cannot be
    reached (another pid namespace, no /proc, a process that is not the target any more)."""
    path = f"/proc/{pid}/fd/{fd}"
    with open(path, "r+b", buffering=0) as file:
        if os.fstat(file.fileno()).st_size != GATE_SLOTS * _native.GateSlots.BYTES:
            raise ValueError(f"{path} is not a fabriclab gate file")
        memory = mmap.mmap(file.fileno(), GATE_SLOTS * _native.GateSlots.BYTES)
    magic, owner, found = _GATE_HEAD.unpack_from(memory, 0)
    if (magic, owner, found) != (_GATE_MAGIC, engine_id, token):
        memory.close()
        raise ValueError(f"{path} is not the gate file of engine {engine_id:#x}")
    return _native.GateSlots(memory)


@dataclass(eq=False)
class ExportedRegion:
    """A region peers may copy into: its key and engine state (closed ones count nothing)."""
    key: int
    state: RegionState


class CopiedIn:
    """The target's count of COPIED_IN messages (run on the landing thread): each one, from whoever claims
    to send it, counts only for an open exported region whose key it gives."""

    def __init__(self, native: _native.NativeEngine) -> None:
        self.native = native
        self.lock = threading.Lock()
        self.regions: dict[int, ExportedRegion] = {}
        self.pages = self.bytes = self.messages = 0

    def add(self, region_id: int, key: int, state: RegionState) -> None:
        with self.lock:
            self.regions[region_id] = ExportedRegion(key, state)

    def remove(self, region_id: int) -> None:
        with self.lock:
            self.regions.pop(region_id, None)

    def message(self, sender: int, job: int, region_id: int, key: int, imm: int, pages: int, nbytes: int) -> None:
        """Count ``pages`` of ``imm`` copied into region ``region_id`` (a control.COPIED_IN)."""
        with self.lock:
            region = self.regions.get(region_id)
        if region is None or region.state.closed:
            raise BadMessage(f"COPIED_IN for region {region_id}, which offers no CUDA IPC (closed, or never)")
        if key != region.key:
            raise BadMessage(f"COPIED_IN for region {region_id} with a key that is not its descriptor's")
        if imm != _native.NO_IMM:
            self.native.credit_immediates(imm, pages)  # a full count marks imm lost: its next expect() says so
        self.messages += 1
        self.pages += pages
        self.bytes += nbytes
        self.native.wake()

    def stats(self) -> dict[str, int]:
        return {"copied_in_messages": self.messages, "copied_in_pages": self.pages, "copied_in_bytes": self.bytes,
                "regions_offered": len(self.regions)}
