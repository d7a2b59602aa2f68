"""Same-host GPU peers through CUDA IPC (``cuda-ipc``): an engine's path, both halves. The protocol, the gates
and the target's count are ``fabriclab.ipc``; this module offers regions (target) and copies into peers'
(writer).

A writer takes the path for a (local region, peer region) pair when both are GPU memory, the peer runs on
this host and offered the region (its descriptor has an IPC section), and the allocation opens here (CUDA
IPC handle opened on the local region's device, peer access enabled where the devices differ) and the gate
maps: tried once per pair, the answer kept (``Peer.route`` says which path and why). A transfer then is one
copy-kernel launch on the local device (``fabriclab.gpucopy``: every page, contiguous runs joined) between
passing the region's gate and leaving it; the completer thread waits for the launch's event, leaves the
gate, tells the target what to count (COPIED_IN, through the landing thread's control channel) and resolves
the transfer. The caller's data must be ready on the GPU when it calls (its own stream synchronized), as for
every path.

Opened allocations are shared by the engines of a process (CUDA maps one once per process) and closed once
no route uses them; a closed peer region or a peer process found gone drops its routes."""
from __future__ import annotations

import collections
import logging
import os
import secrets
import threading
import time
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from . import _native, control, fi, gpu, gpucopy, ipc, shmclean
from .errors import InvalidDescriptor, PeerLost, RegionClosed, StagingFailed
from .staged import finisher
from .transfer import Safety, Transfer
from .wire import IpcRoute, PeerRegion

if TYPE_CHECKING:
    from .engine import Peer, Region
    from .service import Service

_CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS = 1
log = logging.getLogger("fabriclab")
_MAPPINGS: dict[tuple[int, bytes], list[int]] = {}  # (device, handle) -> [base, routes using it]
_MAPPINGS_LOCK = threading.Lock()


def _map(device: int, handle: bytes) -> int:
    """The base address here of a peer's allocation (opened on ``device`` at its first use); CudaError if it
    will not open (another container or IPC namespace, no peer access between the devices, ...)."""
    with _MAPPINGS_LOCK:
        known = _MAPPINGS.get((device, handle))
        if known is None:
            d = gpu.require_cuda()
            gpu.primary_context(device)
            raw = d.CUipcMemHandle()
            raw.reserved = handle
            base = gpu.check(d.cuIpcOpenMemHandle(raw, _CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS), "cuIpcOpenMemHandle")
            known = _MAPPINGS[(device, handle)] = [int(base), 0]
        known[1] += 1
        return known[0]


def _unmap(device: int, handle: bytes) -> None:
    with _MAPPINGS_LOCK:
        known = _MAPPINGS.get((device, handle))
        if known is None:
            return
        known[1] -= 1
        if known[1] == 0:
            del _MAPPINGS[(device, handle)]
            d = gpu.require_cuda()
            d.cuIpcCloseMemHandle(known[0])


def _check_mapping(device: int, base: int, offered: IpcRoute, length: int) -> None:
    """InvalidDescriptor unless the region a descriptor names (``length`` bytes at ``offered.offset``) lies in
    the allocation that opened at ``base``. The descriptor's own ``alloc_bytes`` is the sender's word: a copy
    sized by it alone could run past the mapping, which kills this process's CUDA context (or, where the
    address past it is mapped, writes this process's own memory)."""
    d = gpu.require_cuda()
    gpu.primary_context(device)
    start, size = gpu.check(d.cuMemGetAddressRange(base), "cuMemGetAddressRange")
    if int(start) != base or offered.offset + length > int(size):
        raise InvalidDescriptor(f"the CUDA IPC section puts the region ({length} bytes at offset {offered.offset}) "
                                f"outside the allocation that opened here ({int(size)} bytes at "
                                f"{int(start) - base:+d} from its handle's base): a forged or stale descriptor")


PEER_CHECK_S = 0.25  # how often a route's peer process is looked up in /proc (a gone one fails its copies)


@dataclass(eq=False)
class _Route:
    """A (local region, peer region) pair the GPU copies between: the peer region's address here, its gate,
    where its count goes. ``mapped``: the allocation this route opened (None: the peer is this process)."""
    device: int
    base: int
    gates: _native.GateSlots
    slot: int
    key: int
    dest: bytes
    peer_engine: int
    peer_process: tuple[int, int, int] | None
    mapped: bytes | None
    checked: float = 0.0  # when the peer process was last found alive

    def peer_gone(self) -> bool:
        """Whether the peer's process is found gone (looked up at most every PEER_CHECK_S)."""
        now = time.monotonic()
        if self.peer_process is None or now - self.checked < PEER_CHECK_S:
            return False
        if shmclean.process_is_gone(*self.peer_process):
            return True
        self.checked = now
        return False


@dataclass(eq=False)
class _Copy:
    launch: gpucopy.Launch
    copier: gpucopy.Copier
    route: _Route
    transfer: Transfer
    done: Any  # staged.finisher's done(error, safe)
    message: bytes | None
    claimed: bool = False  # finished by the completer thread or by a thread waiting for the transfer


class IpcPath:
    """One engine's CUDA IPC path: the regions it offers (target half) and its routes and copies into peers'
    (writer half, with the completer thread started at the first copy)."""

    def __init__(self, service: Service) -> None:
        self.service = weakref.proxy(service)  # the service holds this: no cycle that only the GC could break
        self.enabled = service.config.gpu_ipc
        self.lock = threading.Lock()
        self.gates: ipc.Gates | None = None
        self.offered: dict[int, int] = {}  # region id -> its gate slot, while open
        self.copied_in = ipc.CopiedIn(service.native)
        self.routes: dict[tuple[int, int, int], _Route | str] = {}
        self.gate_files: dict[tuple[int, int, int], _native.GateSlots] = {}
        self.copiers: dict[int, gpucopy.Copier] = {}
        self.pending: collections.deque[_Copy] = collections.deque()
        self.wakeup = threading.Condition(self.lock)
        self.thread: threading.Thread | None = None
        self.closed = False
        self.counts = {"transfers": 0, "pages": 0, "bytes": 0, "launches": 0}

    # ------------------------------------------------------------------------------- target half

    def offer(self, region: Region) -> IpcRoute | None:
        """The IPC section of GPU region ``region``'s descriptor (exported and gated at its first
        descriptor); None, with ``region.ipc_why`` saying why, where it is not offered."""
        if region._ipc is not None or region.kind != "cuda" or not self.enabled or region.ipc_why:
            return region._ipc
        assert region.device is not None  # GPU memory
        try:
            export = ipc.export(region.pointer, region.length, region.device)
            lander = self.service.start_landing()
            with self.lock:
                if self.gates is None:
                    self.gates = ipc.Gates(self.service.engine_id)
                gates = self.gates
            slot = gates.take(region._landing_key)
        except (fi.FabriclabError, OSError) as exc:
            region.ipc_why = f"not offered to CUDA IPC peers: {exc}"
            return None
        self.copied_in.add(region.id, region._landing_key, region._state)
        region._ipc = IpcRoute(export.handle, export.offset, export.alloc_bytes, os.getpid(), gates.fd, gates.token,
                               slot, region._landing_key, lander.address)
        with self.lock:
            self.offered[region.id] = slot
        return region._ipc

    def withdraw(self, region: Region, timeout: float) -> bool:
        """Region ``region`` closes: its gate shuts, and writers inside are waited for (up to ``timeout``).
        False if some stayed inside (a writer that died mid-copy): its memory must then stay referenced."""
        self.copied_in.remove(region.id)
        with self.lock:
            slot = self.offered.pop(region.id, None)
        if slot is None or self.gates is None:
            return True
        return self.gates.shut(slot, timeout)

    # ------------------------------------------------------------------------------- writer half

    def route(self, peer: Peer, local: Region, remote: PeerRegion) -> tuple[str, str]:
        """("cuda-ipc", "") when writes from ``local`` into ``remote`` take this path, else ("", why not)."""
        found = self._route(peer, local, remote)
        return ("cuda-ipc", "") if isinstance(found, _Route) else ("", found)

    def _route(self, peer: Peer, local: Region, remote: PeerRegion) -> _Route | str:
        key = (local.id, remote.engine_id, remote.region_id)
        with self.lock:
            found = self.routes.get(key)
        if found is not None:
            return found
        found = self._open(peer, local, remote)
        with self.lock:
            if len(self.routes) >= 4096:
                self._drop_routes(lambda k: True)
            self.routes[key] = found
        return found

    def _open(self, peer: Peer, local: Region, remote: PeerRegion) -> _Route | str:
        """A route for the pair, or why there is none."""
        offered = remote.ipc
        why = ("this engine has gpu_ipc=False" if not self.enabled else
               "the source is host memory" if local.kind != "cuda" else
               "the peer region offers no CUDA IPC (host memory, gpu_ipc=False there, or its export failed: its "
               "Region.ipc_why says)" if offered is None else
               "the peer runs on another host" if not peer.same_host else "")
        if why:
            return why
        assert offered is not None and local.device is not None
        process = peer.process  # None: the peer runs in this process
        if process is not None and offered.gate_pid != process[1]:
            return f"the descriptor's gate names process {offered.gate_pid}, the peer's address {process[1]}"
        try:
            gates = self._gates(offered, remote.engine_id)
        except (OSError, ValueError) as exc:
            return f"the peer's gate cannot be opened from here (another pid namespace or container?): {exc}"
        if process is None:
            from .engine import Region  # the front, above this module: asked here only
            target = Region._of(remote)
            if target is None:
                return "the peer region is not in this process any more"
            if remote.length > target.length:
                raise InvalidDescriptor(f"the descriptor claims {remote.length} bytes of a region of {target.length}")
            return _Route(local.device, target.pointer, gates, offered.gate_slot, offered.key, offered.address,
                          remote.engine_id, None, None)
        try:
            base = _map(local.device, offered.handle)
        except gpu.CudaError as exc:
            return f"the peer's GPU memory does not open here: {exc}"
        try:
            _check_mapping(local.device, base, offered, remote.length)
        except BaseException:
            _unmap(local.device, offered.handle)
            raise
        return _Route(local.device, base + offered.offset, gates, offered.gate_slot, offered.key, offered.address,
                      remote.engine_id, peer.process, offered.handle)

    def _gates(self, offered: IpcRoute, engine_id: int) -> _native.GateSlots:
        where = (offered.gate_pid, offered.gate_fd, offered.gate_token)
        with self.lock:
            gates = self.gate_files.get(where)
        if gates is None:
            gates = ipc.open_gates(offered.gate_pid, offered.gate_fd, offered.gate_token, engine_id)
            with self.lock:
                self.gate_files[where] = gates
        return gates

    def submit(self, peer: Peer, local: Region, remote: PeerRegion, src: np.ndarray, dst: np.ndarray,
               lengths: np.ndarray | int, imm: int, timeout: float, pages: int) -> Transfer:
        """Copy ``lengths[i]`` (or ``lengths``) bytes from byte ``src[i]`` of ``local`` to byte ``dst[i]`` of
        ``remote`` with the GPU (:meth:`route` said yes), in one launch: ``Transfer.writes`` counts the copies
        asked for (the GPU takes pages whole, nothing is joined). The transfer resolves once the bytes are in
        the peer's memory."""
        route = self._route(peer, local, remote)
        assert isinstance(route, _Route)
        service = self.service
        deadline = time.monotonic() + timeout
        nbytes = src.size * lengths if isinstance(lengths, int) else int(lengths.sum())
        transfer = Transfer(src.size, nbytes, deadline, Safety(service.timeout), pages)
        if not route.gates.enter(route.slot, route.key):
            self._forget(lambda k: k[1:] == (remote.engine_id, remote.region_id))
            raise RegionClosed(f"the peer closed region {remote.region_id}", buffer_safe=True)
        try:
            copier = self._copier(route.device)
            launch = copier.copy(np.uint64(local.pointer) + src, np.uint64(route.base) + dst, lengths)
        except gpu.CudaError as exc:
            route.gates.leave(route.slot)
            raise StagingFailed(f"the GPU copy into the peer's memory failed to start: {exc}", buffer_safe=True) from None
        state = local._state
        if imm != _native.NO_IMM:
            service.start_landing()  # the control channel its COPIED_IN leaves through
        message = None if imm == _native.NO_IMM else control.copied_in(
            service.engine_id, secrets.randbits(64) | 1, remote.region_id, route.key, imm, pages, transfer.bytes)
        item = _Copy(launch, copier, route, transfer, finisher(service, transfer, state, True), message)
        transfer._finish_here = lambda _seconds: self._finish(item, waiter=True)  # it waits for the copy whole
        with self.lock:
            state.in_use += 1
            service.count_submitted(transfer)
            self.counts["transfers"] += 1
            self.counts["pages"] += pages
            self.pending.append(item)
            self._start()
            self.wakeup.notify()
        return transfer

    def _copier(self, device: int) -> gpucopy.Copier:
        with self.lock:
            copier = self.copiers.get(device)
            if copier is None:
                copier = self.copiers[device] = gpucopy.Copier(device)
            return copier

    def _start(self) -> None:
        if self.thread is None:
            self.thread = threading.Thread(target=self._complete, name="fabriclab-ipc", daemon=True)
            self.thread.start()

    def _complete(self) -> None:
        """The completer thread: each copy in order, once its event fired (unless a thread waiting for its
        transfer finished it first: Transfer.result)."""
        while True:
            with self.lock:
                while not self.pending and not self.closed:
                    self.wakeup.wait()
                if not self.pending:
                    return
                item = self.pending[0]
            if not item.claimed:
                self._finish(item)
            with self.lock:
                self.pending.popleft()

    def _finish(self, item: _Copy, waiter: bool = False) -> None:
        """Once ``item``'s copy is done: leave the gate, have the target count the pages, resolve the transfer.
        Whichever thread claims it first does it, once: a thread waiting for the transfer (``waiter``) claims
        it before it waits for the copy, so that it finishes the transfer itself with no hand-over between
        threads; the completer claims it once the copy is done."""
        if waiter and not self._claim(item):
            return  # the completer has it
        try:
            item.copier.finished(item.launch, wait=True)  # the GIL is released while it waits
            error: BaseException | None = None
        except gpu.CudaError as exc:
            error = StagingFailed(f"the GPU copy into the peer's memory failed: {exc}", buffer_safe=True)
        if not waiter and not self._claim(item):
            return
        item.route.gates.leave(item.route.slot)
        item.copier.release(item.launch)
        if error is None and item.route.peer_gone():
            self.forget_peer(item.route.peer_engine)
            error = PeerLost("the peer's process is gone", buffer_safe=True)
        lander = self.service.landing
        if error is None and item.message is not None and lander is not None:
            lander.send_soon(item.route.dest, item.message)
        with self.lock:
            self.counts["launches"] += 1
            self.counts["bytes"] += item.launch.bytes if error is None else 0
        item.done(error, True)

    def _claim(self, item: _Copy) -> bool:
        """Take ``item`` to finish it: False where another thread took it first."""
        with self.lock:
            if item.claimed:
                return False
            item.claimed = True
            return True

    def forget_peer(self, engine_id: int) -> None:
        """Drop the routes into a peer engine (found gone)."""
        self._forget(lambda k: k[1] == engine_id)

    def _forget(self, which: Any) -> None:
        with self.lock:
            self._drop_routes(which)

    def _drop_routes(self, which: Any) -> None:
        """Drop the routes whose key ``which`` takes (the lock held), closing allocations no route uses."""
        for key in [k for k in self.routes if which(k)]:
            route = self.routes.pop(key)
            if isinstance(route, _Route) and route.mapped is not None:
                _unmap(route.device, route.mapped)

    def stats(self) -> dict[str, Any]:
        with self.lock:
            routes = [r for r in self.routes.values() if isinstance(r, _Route)]
            counts = dict(self.counts)
        return {"enabled": self.enabled, **counts, "routes": len(routes), "in_flight": len(self.pending),
                **self.copied_in.stats(), "regions_held_by_dead_writers": self.gates.held if self.gates else 0}

    def close(self) -> None:
        """The engine closes: the gates of the regions it offered shut (writers inside are waited for, a
        while: their memory goes back to its owner once the engine is gone), its own copies in flight are
        waited for (a copy cannot be called back), then the routes, copiers and gates go."""
        with self.lock:
            offered, self.offered = list(self.offered.values()), {}
        deadline = time.monotonic() + _native.WORKER_EXIT_TIMEOUT
        if self.gates is not None and not all([self.gates.shut(slot, max(deadline - time.monotonic(), 0.0))
                                               for slot in offered]):
            log.warning("the engine closed with a CUDA IPC writer still copying into one of its regions (a writer "
                        "stopped or killed mid-copy): keep that memory until the writer is gone")
        with self.lock:
            self.closed = True
            self.wakeup.notify()
            thread = self.thread
        if thread is not None:
            thread.join(_native.WORKER_EXIT_TIMEOUT)
        with self.lock:
            self._drop_routes(lambda k: True)
            for copier in self.copiers.values():
                copier.close()
            self.copiers.clear()
        if self.gates is not None:
            self.gates.close()
