"""``fabriclab.Engine`` — the final stage as a library.

The same native engine core as chapters 9–15 (``native/core.c``), run as a service (``native/service.c``):
pinned worker threads, one set of NICs per thread, batched and lazy posting, striping across NICs. Python
hands it writes and gets back futures.

    from fabriclab import Engine
    with Engine() as engine:                        # NICs and cores from fabriclab.topology (or EngineConfig)
        region = engine.register(kv_cache)          # numpy, bytearray, torch/cupy (CUDA: FI_HMEM)
        send_to_peer(engine.address, region.descriptor())   # any way you like: bytes
        peer = engine.connect(peer_address)         # any time, in any order; no world
        done = peer.write_pages(region, [0, 1, 2], peer_region, [7, 8, 9], page_size=65536, imm=42)
        done.result()                               # or: await done; or done.add_done_callback(...)
    # on the peer:  engine.expect(42, 3).result()   # three pages carrying 42 have landed

This module is the public front; the machinery is private, one concern a module: ``config`` (EngineConfig),
``errors``, ``transfer`` (futures and results), ``wire`` (addresses and descriptors on the wire), ``buffers``
(what ``register`` accepts), ``pages``, and ``service`` (what an Engine runs) with ``completions``,
``renewal`` and ``staged``.

Every transfer has a deadline (``Engine(timeout=...)`` or per call). Failures are typed —
:class:`PeerLost`, :class:`TransferTimeout`, :class:`RegionClosed`, :class:`InvalidDescriptor`,
:class:`OutOfRange` — and each says whether the local buffer is safe to reuse (``buffer_safe``).
"""
from __future__ import annotations

import concurrent.futures
import itertools
import logging
import os
import secrets
import weakref
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np

from . import _native, fi, landing, memory, staging
from .buffers import HostView, view_of
from .completions import RegionState
from .config import EngineConfig, EngineOptions
from .errors import (FabriclabError, InvalidDescriptor, OutOfRange, PeerLost, RegionClosed, StagingFailed,
                     TransferError, TransferTimeout, UsageError, WriteRejected, bad_address, closed_here)
from .nics import host_identity, same_host_path
from .pages import checked_pages, first_overlap, page_runs
from .submit_batch import post_batch
from .service import CLOSED_HERE, DEFAULT_STRIPE, Service
from .transfer import Transfer, TransferResult
from .wire import IpcRoute, PeerRegion, decode_address, decode_region, encode_address, encode_landing, encode_region

if TYPE_CHECKING:
    from typing_extensions import Unpack  # typing.Unpack from Python 3.11 on; hints only, never run

__all__ = ["Engine", "EngineConfig", "Region", "Peer", "Transfer", "TransferResult", "FabriclabError", "UsageError",
           "TransferError", "PeerLost", "WriteRejected", "TransferTimeout", "RegionClosed", "InvalidDescriptor",
           "OutOfRange", "StagingFailed"]
log = logging.getLogger("fabriclab")


# --------------------------------------------------------------------------------------- regions


class Region:
    """Memory registered with every NIC of an engine. ``descriptor()`` is what a peer needs to write here.

    A read-only buffer (bytes, a read-only numpy array) is registered as a source only: it can be
    written from, and has no descriptor, since peers cannot write into it. ``pointer`` is where its bytes
    are in this process (host or GPU memory); ``path`` the token saying how transfers use it."""

    _ids = itertools.count(1)
    _live: ClassVar[weakref.WeakValueDictionary[int, Region]] = weakref.WeakValueDictionary()  # ids: process-wide

    def __init__(self, engine: Engine, obj: Any, staged_host: bool = False) -> None:
        view = view_of(obj)
        self.engine, self.kind, self.pointer, self.length = engine, view.kind, view.pointer, view.length
        self.device: int | None = None if isinstance(view, HostView) else view.device
        self.readonly = view.readonly
        self.id = next(self._ids)
        Region._live[self.id] = self  # a write from memory of this process into it can be checked for overlap
        self._landing_key = secrets.randbits(64)  # in its descriptor: asking for lanes, or counting IPC copies, takes it
        #: why the region is not offered to CUDA IPC peers ("" where it is, or is not GPU memory)
        self.ipc_why = ""
        self._ipc: IpcRoute | None = None  # its descriptor's CUDA IPC section, once made (fabriclab.ipc)
        self._keep = view
        self.path, self.why = "host" if self.kind == "host" else "cuda-direct", ""
        access = fi.ACCESS_SOURCE if self.readonly else fi.ACCESS_ALL  # read-only: a source only
        registrations: list[memory.Registration] = []
        service = engine._service
        if staged_host:  # Engine._register_staged_host: a staged target in host memory, for tests
            self.path, self.why = "host-staged", "host memory staged on purpose (tests)"
        else:
            try:
                registrations = service.nics.register(view, access=access, stage=False)
            except memory.DirectUnavailable as exc:
                # no FI_HMEM: the region stays unregistered; its transfers stream through the staging pool
                self.path, self.why = "cuda-staged", str(exc)
        self._state = RegionState(registrations)
        self.descs = _native.route_descriptors(registrations)
        self._descs = np.asarray(self.descs, dtype=np.uint64)
        self.keys = [r.mr.key for r in registrations]
        self.bases = [r.mr.remote_base for r in registrations]
        #: the NIC slots this region's writes leave through: a GPU's own NICs (fabriclab.topology) for GPU
        #: memory registered directly, else every slot (host memory; staged GPU memory leaves from host chunks)
        self.nic_slots = service.groups.slots_of_gpu(self.device if self.path == "cuda-direct" else None)
        self._nic_order = (np.asarray(self.nic_slots, dtype=np.uint16)
                           if len(self.nic_slots) < len(service.nics.slots) else None)

    @classmethod
    def _of(cls, remote: PeerRegion) -> Region | None:
        """The region a peer's descriptor names, where its engine runs in this process (else None)."""
        target = cls._live.get(remote.region_id)
        return target if target is not None and target.engine.id == remote.engine_id else None

    @property
    def staged(self) -> bool:
        """Whether transfers from this region go through the staging pool (``path == "cuda-staged"``)."""
        return self.path == "cuda-staged"

    @property
    def lands(self) -> bool:
        """Whether peers' writes into this region land in the engine's landing lanes first (staged target)."""
        return self.path in ("cuda-staged", "host-staged")

    @property
    def ipc_offered(self) -> bool:
        """Whether its descriptor offers it to GPU peers on this host (CUDA IPC; see ``ipc_why`` where not)."""
        return self._ipc is not None

    @property
    def registrations(self) -> list[memory.Registration]:
        """The region's registration with each NIC slot (one per domain, shared by its slots; none when
        staged)."""
        return self._state.registrations

    @property
    def closed(self) -> bool:
        """Whether ``close()`` was called (or the engine closed)."""
        return self._state.closed

    def descriptor(self) -> bytes:
        """Bytes for the peer: engine id, region id, length, and (base, key) per NIC. Checksummed."""
        self._check_open()
        if self.readonly:
            raise fi.UsageError(f"region {self.id} is read-only: it can be a source of writes, but peers cannot "
                                "write into it, so it has no descriptor; register a writable buffer")
        ipc = self.engine._service.ipc.offer(self)
        if self.lands:
            return self.engine._landing_descriptor(self, ipc)
        return encode_region(self.engine.id, self.id, self.length, self.bases, self.keys, ipc)

    def _check_open(self) -> None:
        if self._state.closed:
            raise RegionClosed(f"region {self.id} is closed", buffer_safe=True)

    def close(self, timeout: float | None = None) -> None:
        """Deregister. Transfers still running with the region are waited for (up to ``timeout``, default the
        engine's; a warning says so after a second), then failed with RegionClosed. Transfers to a peer whose
        process on this host is gone fail with PeerLost within a fraction of a second, and transfers that
        already failed (PeerLost, TransferTimeout) are not waited for, even where writes the engine gave up on were
        never reported (a dead peer's never are): the registration itself stays until no write can touch the
        memory, at the latest until the engine closes. Closing after the engine closed does nothing (the
        engine took its registrations)."""
        if self._state.closed:
            return
        seconds = fi.seconds(timeout, "timeout", self.engine.timeout)
        self._state.closed = True
        service = self.engine._service
        if self.lands and service.landing is not None:
            service.landing.target.remove_region(self.id)  # later pages for it are refused
        if not service.ipc.withdraw(self, seconds):
            service.held_by_dead_writers.append(self._keep)  # a copy may still write it: never handed back
            log.warning("region %d closed with a CUDA IPC writer still inside its gate after %g s (a writer that "
                        "died mid-copy): its memory stays referenced until the engine closes", self.id, seconds)
        service.close_region(self._state, seconds, self.id)

    def __enter__(self) -> Region:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        flags = (" read-only" if self.readonly else "") + (" closed" if self.closed else "")
        near = f" through NIC slots {','.join(map(str, self.nic_slots))}" if self._nic_order is not None else ""
        return f"<Region {self.id} {self.path} {self.length} bytes{near}{flags}>"


# ------------------------------------------------------------------------------------------- peers


def _check_region(region: object) -> None:
    if not isinstance(region, Region):
        raise fi.UsageError(f"the local region must be a Region of this engine (Engine.register), got "
                            f"{type(region).__name__}")


def _refuse_overlap(local: Region, remote: PeerRegion, src: np.ndarray | list[int], dst: np.ndarray | list[int],
                    size: int, pages: bool) -> None:
    """Refuse a transfer that reads bytes it also writes: its writes run in no order (RDMA promises none, and a
    run of pages is one copy), so what landed would depend on timing — pages 0..7 onto 1..8 of one region
    landed page 0 in all nine. ``src``, ``dst``: first pages (``pages``) or first bytes of ``size``-byte pieces.
    Only this process's memory can be seen: the peer is this engine (loopback) or another engine here."""
    target = Region._of(remote)
    if target is None or target.kind != local.kind:
        return
    scale = size if pages else 1
    src, dst = np.asarray(src, dtype=np.int64), np.asarray(dst, dtype=np.int64)
    pair = first_overlap(local.pointer + src * scale, target.pointer + dst * scale, size)
    if pair is None:
        return
    i, j = pair
    what = (f"source page {src[i]} and destination page {dst[j]}" if pages else
            f"source bytes [{src[i]}, {src[i] + size}) and destination bytes [{dst[j]}, {dst[j] + size})")
    regions = "one region" if target is local else f"regions {local.id} and {target.id}, which share memory,"
    raise fi.UsageError(f"{what} of {regions} overlap: the writes of a transfer run in no order, so what lands "
                        "would depend on timing. Copy through a second buffer, or split the transfer so that "
                        "none reads a byte another one still in flight writes")


class Peer:
    """Another engine, reached through every one of our NICs. Writes are striped across them."""

    def __init__(self, engine: Engine, address: bytes) -> None:
        engine_id, addresses, host, process = decode_address(address)
        if engine_id in CLOSED_HERE:
            raise closed_here("the engine at that address", about_buffer=False)
        service = engine._service
        n = len(addresses)
        self.engine, self.id, self.nics = engine, engine_id, n
        #: how writes reach this peer, in words: "the NICs", or shared memory where the provider takes a
        #: same-host detour
        #: whether the peer runs on this host (its address says so): GPU regions may then take CUDA IPC
        self.same_host = host == host_identity()
        self.transport = same_host_path(service.provider, self.same_host)
        #: the peer's process where it runs on this host (pid namespace, pid, start ticks): once it is gone, the
        #: engine fails the transfers still running to it (PeerLost) instead of letting them sit out their deadline
        self.process = process if self.same_host and process[1] != os.getpid() else None
        # our NIC i talks to the peer's NIC i (modulo its count): the peer's key for it is keys[i % n]
        self.remote_slot = [i % n for i in range(len(service.nics.slots))]
        self.fi_addrs: list[int] = []
        self.closed = False
        self._gone = ""  # why the engine closed this Peer itself (its peer's process is gone)
        self._running: list[Transfer] = []  # transfers submitted, maybe not done: they need its entries
        self._prune_at = 32  # the length of _running at which the finished ones are dropped
        for slot in service.nics.slots:
            try:
                self.fi_addrs.append(service.entries.entry(slot, addresses[self.remote_slot[slot.index]]))
            except fi.UsageError as exc:
                raise bad_address(f"engine address does not fit this engine: {exc}") from None
            except fi.FabricError as exc:
                if exc.errno != fi.lib.FI_EHOSTUNREACH:
                    raise  # the address vector is full (fi.AddressVectorFull says what to do), or worse
                raise PeerLost(f"cannot connect: {exc}", buffer_safe=True, about_buffer=False) from None
        service.peers.add(self)
        self._next_nic = 0
        self._parsed: dict[bytes, PeerRegion] = {}
        self._routes: dict[tuple[int, int], _native.Routes] = {}
        self._fi_addrs = np.asarray(self.fi_addrs, dtype=np.uint64)
        self._remote_slots = np.asarray(self.remote_slot, dtype=np.int64)

    def _routes_to(self, region: Region, remote: PeerRegion) -> _native.Routes:
        """Per NIC: our descriptor of ``region``, the peer's address and its base and key for ``remote`` —
        what the engine needs to post a write, or to move it to another NIC. Made once per pair; kept alive
        by every transfer that uses it."""
        key = (region.id, remote.region_id)
        routes = self._routes.get(key)
        if routes is None:
            array = np.empty(len(self.fi_addrs), dtype=_native.ROUTE_DTYPE)
            array["desc"] = region._descs
            array["dest"] = self._fi_addrs
            array["remote_base"] = np.asarray(remote.bases, dtype=np.uint64)[self._remote_slots]
            array["rkey"] = np.asarray(remote.keys, dtype=np.uint64)[self._remote_slots]
            routes = _native.Routes(array, region._nic_order)
            if len(self._routes) >= 256:
                self._routes.clear()
            self._routes[key] = routes
        return routes

    def _remote(self, descriptor: bytes | PeerRegion) -> PeerRegion:
        if isinstance(descriptor, PeerRegion):
            remote = descriptor
        else:
            known = self._parsed.get(descriptor) if isinstance(descriptor, bytes) else None
            remote = known if known is not None else decode_region(descriptor)
            if known is None and len(self._parsed) < 1024:
                self._parsed[bytes(descriptor)] = remote
        if remote.engine_id != self.id:
            raise InvalidDescriptor("that region belongs to another engine than this peer")
        if len(remote.keys) != self.nics:
            raise InvalidDescriptor(f"region descriptor lists {len(remote.keys)} NICs, the peer has {self.nics}")
        return remote

    def write(self, local_region: Region, remote_descriptor: bytes | PeerRegion, *, src_offset: int = 0,
              dst_offset: int = 0,
              length: int | None = None, imm: int | None = None, timeout: float | None = None,
              stripe_bytes: int = DEFAULT_STRIPE) -> Transfer:
        """Write ``length`` bytes (default: the rest of the local region) from ``src_offset`` of
        ``local_region`` to ``dst_offset`` of the peer's region, split into ``stripe_bytes`` pieces over
        the NICs. With ``imm``, every piece carries it (``Transfer.writes`` pieces: the peer expects that
        many). A zero-length write is refused (UsageError), as is a negative length: a length computed
        wrong is better noticed than skipped; leave the call out where there is nothing to write.
        Source and destination bytes must not overlap (a write within one region, or between regions that
        share memory): the writes of a transfer run in no order, so a UsageError refuses it where the
        destination is memory of this process; nobody can check it for memory of another."""
        remote = self._remote(remote_descriptor)
        _check_region(local_region)
        src_offset, dst_offset = fi.integer(src_offset, "src_offset"), fi.integer(dst_offset, "dst_offset")
        if length is not None and fi.integer(length, "length") == 0:
            raise fi.UsageError("length=0: a zero-length write moves nothing, and is refused so that a length "
                                "computed wrong is noticed; leave the call out where there is nothing to write")
        length = None if length is None else fi.integer(length, "length", 1)
        stripe_bytes = fi.integer(stripe_bytes, "stripe_bytes", 1)
        if not 0 <= src_offset < local_region.length:
            raise OutOfRange(f"src_offset {src_offset} is outside the {local_region.length}-byte local region")
        length = local_region.length - src_offset if length is None else length
        if src_offset + length > local_region.length:
            raise OutOfRange(f"local bytes [{src_offset}, {src_offset + length}) are outside the "
                             f"{local_region.length}-byte region")
        if dst_offset < 0 or dst_offset + length > remote.length:
            raise OutOfRange(f"remote bytes [{dst_offset}, {dst_offset + length}) are outside the peer's "
                             f"{remote.length}-byte region")
        _refuse_overlap(local_region, remote, np.array([src_offset]), np.array([dst_offset]), length, pages=False)
        starts = np.arange(0, length, stripe_bytes, dtype=np.int64)
        lengths = np.minimum(stripe_bytes, length - starts).astype(np.uint64)
        return self._track(self.engine._service.submit(self, local_region, remote, src_offset + starts,
                                                       dst_offset + starts, 1, lengths, imm, timeout))

    def write_pages(self, local_region: Region, src_pages: Any, remote_descriptor: bytes | PeerRegion,
                    dst_pages: Any, page_size: int, imm: int | None = None,
                    timeout: float | None = None) -> Transfer:
        """Write page ``src_pages[i]`` of the local region to page ``dst_pages[i]`` of the peer's, striped
        over the NICs, batched and posted lazily by the engine's threads. Runs of pages contiguous on both
        sides go as one write each, of at most 1 MiB and leaving at least one write per NIC
        (``Transfer.writes`` says how many writes it became; on the ``cuda-ipc`` path, one copy per page, all in
        one GPU launch: ``Peer.route``); with ``imm``, the peer's ``Engine.expect``
        still counts pages: each write carries how many it moves. No source page may overlap a
        destination page (pages moved within one region): see :meth:`write`; nor may a destination page
        be named twice (UsageError: the writes run in no order)."""
        remote = self._remote(remote_descriptor)
        _check_region(local_region)
        page_size = fi.integer(page_size, "page_size", 1)
        src, dst = self._checked(local_region, remote, src_pages, dst_pages, page_size)
        return self._submit_pages(local_region, remote, src, dst, page_size, imm, timeout)

    def write_batch(self, local_region: Region, requests: Sequence[tuple[Any, ...]],
                    remote_descriptor: bytes | PeerRegion, page_size: int,
                    timeout: float | None = None) -> list[Transfer]:
        """Many :meth:`write_pages` in one call, a Transfer each, in order: ``requests`` holds
        ``(src_pages, dst_pages)`` or ``(src_pages, dst_pages, imm)``. Every request is checked before any is
        submitted, so a bad one refuses the batch and nothing moves (its index is in the error). On the NICs'
        path the writes of all go to the engine as one request (each worker woken once); where the engine's
        queues stay full past the timeout, or it closes, the transfers whose writes were not all queued fail
        (their futures say so) and the others run on."""
        remote = self._remote(remote_descriptor)
        _check_region(local_region)
        page_size = fi.integer(page_size, "page_size", 1)
        checked = []
        for i, request in enumerate(requests):
            if not isinstance(request, tuple) or len(request) not in (2, 3):
                raise fi.UsageError(f"request {i} must be (src_pages, dst_pages) or (src_pages, dst_pages, imm), "
                                    f"got {type(request).__name__}")
            imm = request[2] if len(request) == 3 else None
            try:
                if imm is not None:
                    fi.integer(imm, "imm", 0, _native.MAX_IMM)
                checked.append((*self._checked(local_region, remote, request[0], request[1], page_size), imm))
            except FabriclabError as exc:
                raise type(exc)(f"request {i}: {exc}") from None
        service = self.engine._service
        _, seconds = service.admit(self, local_region, None, timeout)
        if not checked or not service.through_nics(self, local_region, remote):  # GPU copies, staging: one by one
            return [self._submit_pages(local_region, remote, src, dst, page_size, imm, timeout)
                    for src, dst, imm in checked]
        items = [(*page_runs(src, dst, service.pages_per_write(len(src), page_size), page_size),
                  _native.NO_IMM if imm is None else imm) for src, dst, imm in checked]
        return [self._track(t) for t in post_batch(service, self, local_region, remote, items, page_size, seconds)]

    def _checked(self, local_region: Region, remote: PeerRegion, src_pages: Any, dst_pages: Any,
                 page_size: int) -> tuple[Any, Any]:
        """The page lists of a write_pages, checked (pages.checked_pages), and no source page overlapping a
        destination page where both are memory of this process."""
        src, dst = checked_pages(src_pages, dst_pages, local_region.length, remote.length, page_size)
        _refuse_overlap(local_region, remote, src, dst, page_size, pages=True)
        return src, dst

    def _submit_pages(self, local_region: Region, remote: PeerRegion, src: Any, dst: Any, page_size: int,
                      imm: int | None, timeout: float | None) -> Transfer:
        """Submit checked page lists down the pair's path: the GPU's copy (cuda-ipc), or the NICs' writes."""
        service = self.engine._service
        if remote.ipc is not None and service.ipc.route(self, local_region, remote)[0]:  # the GPU copies pages whole
            return self._track(service.submit(self, local_region, remote, np.asarray(src), np.asarray(dst), page_size,
                                              page_size, imm, timeout))
        # a staged region's writes leave from pool chunks, and land in lanes, one per page: no runs to join
        most = 1 if local_region.staged or remote.landing else service.pages_per_write(len(src), page_size)
        firsts_src, firsts_dst, lengths, pages = page_runs(src, dst, most, page_size)
        return self._track(service.submit(self, local_region, remote, firsts_src, firsts_dst, page_size, lengths, imm,
                                          timeout, pages=pages))

    def route(self, local_region: Region, remote_descriptor: bytes | PeerRegion) -> tuple[str, str]:
        """How writes from ``local_region`` into the peer's region go: ("cuda-ipc", "") where the GPU copies
        them through CUDA IPC (both GPU memory, same host, the peer's memory opens here: tried once per pair),
        else (the local region's ``Region.path``, why not CUDA IPC)."""
        _check_region(local_region)
        path, why = self.engine._service.ipc.route(self, local_region, self._remote(remote_descriptor))
        return (path, "") if path else (local_region.path, why)

    def _track(self, transfer: Transfer) -> Transfer:
        """Note a transfer submitted through this Peer: its entries stay while one may still post writes."""
        if len(self._running) >= self._prune_at:  # drop the finished ones, at doubling lengths: O(1) a call
            self._running = [t for t in self._running if not t.done()]
            self._prune_at = max(32, 2 * len(self._running))
        self._running.append(transfer)
        return transfer

    def _needs_entries(self) -> bool:
        """Whether its peer's entries in the address vectors are still needed: open, or a transfer runs."""
        return not self.closed or any(not t.done() for t in self._running)

    def close(self) -> None:
        """No more writes through this Peer; the peer (or its restarted self) may connect again later. Its
        peer's entries in the address vectors are removed (fi_av_remove) once no other Peer to that engine and
        no transfer still needs them (at once where none does), as are those of a Peer dropped without
        closing: an engine that reaches peers coming and going never fills them (shm's hold 256 peers)."""
        self.closed = True
        service = self.engine._service
        if not service.closed:
            service.entries.trim()

    def __repr__(self) -> str:
        return f"<Peer {self.id:#x} over {self.nics} NIC(s) through {self.transport}{' closed' if self.closed else ''}>"


# ------------------------------------------------------------------------------------------ engine


class Engine:
    """The transfer engine. See the module docstring for a tour.

    Built from an :class:`EngineConfig` (what each value does is there): ``Engine(config=EngineConfig(...))``,
    or with its values as keywords, the shortcut: ``Engine("shm", nics=4, timeout=10)``. ``config`` holds it,
    validated; the repr and ``stats()`` (its "layout") say what it was and what the defaults chose.

    GPU memory (torch, cupy, numba, anything with ``__cuda_array_interface__``, CUDA DLPack tensors and
    capsules) is registered directly where the provider offers FI_HMEM (``Region.path == "cuda-direct"``);
    elsewhere transfers from it are staged (``"cuda-staged"``, see ``fabriclab.staging``): copied GPU →
    pinned host memory chunk by chunk on CUDA streams, each chunk written as soon as it is copied, through
    a pinned pool of ``EngineConfig.staging_bytes`` in chunks of ``EngineConfig.staging_chunk_bytes``,
    allocated at the first staged region. A transfer larger than the pool streams through it. A staged region is a
    target too (``fabriclab.landing``): its descriptor names a second pool of the same sizes, the *landing
    lanes* (one lane per chunk, at most 255), allocated at its first descriptor; peers' writes land there
    and are copied to the GPU before ``expect`` counts them and before the writer's transfer completes.
    ``stats()["staging"]`` counts staged and landed bytes and copy times.

    Workers poll their NICs without pause while they have work, and for a moment after (0.2 ms after
    their last write, 2 ms after a peer's write last landed in this engine); then they rest, napping and
    polling once per nap (20 us, growing to 1 ms as the quiet lasts). A write handed to a resting worker
    wakes it at once; a write *into* a quiet engine waits for its next poll on providers whose target
    moves the bytes (shm, tcp): after a quiet gap G, up to min((G - 2 ms) / 4, 1 ms) late, and the writes
    after it on time. Busy pinned workers own their cores, so keep your own busy threads off them:
    ``os.sched_setaffinity(0, engine.housekeeping_cores)`` (the engine's own reaper thread runs there).
    Done-callbacks of transfers run on a thread of their own, one at a time. An engine dropped without
    ``close()`` closes itself once collected. After fork() an engine belongs to the parent: the child
    makes its own.
    """

    def __init__(self, provider: str | None = None, *, config: EngineConfig | None = None,
                 **options: Unpack[EngineOptions]) -> None:
        if config is None:  # domains may come as a string or a list; EngineConfig makes them a tuple
            config = EngineConfig(provider, **options)  # type: ignore[arg-type]
        elif not isinstance(config, EngineConfig):
            raise fi.UsageError(f"config must be an EngineConfig, got {type(config).__name__}")
        elif provider is not None or options:
            raise fi.UsageError("give the engine either config=EngineConfig(...) or its values as keywords, not both: "
                                "dataclasses.replace(config, ...) makes a changed configuration")
        self.config = config
        self.timeout = config.timeout
        self.id = secrets.randbits(63) | 1
        self._service = Service(config, self.id)
        self._pool_region: Region | None = None  # the staging pool, registered at the first staged region
        self._lanes_region: Region | None = None  # the landing lanes, registered at the first staged target
        # the finalizer holds the service, never the engine: a dropped engine is collected, then closed. At
        # exit the service closes before any libfabric object does (fi.stop_first_at_exit), not in here
        self._finalizer = weakref.finalize(self, Service.close_collected, self._service)
        self._finalizer.atexit = False

    @property
    def provider(self) -> str:
        """The libfabric provider the NICs belong to (efa, shm, tcp;ofi_rxm, ...)."""
        return self._service.provider

    @property
    def threads(self) -> int:
        """How many worker threads drive the NICs."""
        return self._service.threads

    @property
    def worker_cores(self) -> list[int]:
        """The cores the worker threads are pinned to (empty with ``pin=False``)."""
        return self._service.worker_cores

    @property
    def housekeeping_cores(self) -> frozenset[int]:
        """The cores the workers leave free: run your own busy threads there."""
        return self._service.housekeeping_cores

    @property
    def address(self) -> bytes:
        """This engine's address (every NIC's), for a peer's ``connect``. Checksummed bytes.

        It can change: ``connect`` gives a NIC slot whose endpoint got stuck (writes the provider never
        reported) a fresh endpoint, and this then carries the fresh one's address. Older addresses keep
        working for writes into this engine (the old endpoints stay open until the engine closes)."""
        self._service.check_open()
        return encode_address(self.id, [slot.ep.address().to_bytes() for slot in self._service.nics.slots])

    @property
    def nics(self) -> int:
        """How many NIC slots this engine drives (real ones plus emulated ones)."""
        return len(self._service.nics.slots)

    @property
    def emulated_nics(self) -> int:
        """How many of the NIC slots are emulated: extra endpoints sharing a real domain."""
        return self._service.emulated

    def register(self, buffer: Any) -> Region:
        """Register any buffer-protocol object (numpy, bytearray, ...), CUDA array (cupy, torch, numba:
        through ``__cuda_array_interface__``), DLPack tensor or capsule (host or CUDA) with every NIC. A
        read-only buffer can be written from but not into; one whose items hold references to Python objects
        (dtype object, or a structured dtype with such a field) is refused, as is one that is not one block of
        memory (a slice with a step); one block in any axis order (C, Fortran, a transpose) is taken, its
        bytes (and pages) in memory order. ``Region.path`` says how: "host",
        "cuda-direct" (FI_HMEM) or "cuda-staged" (through the staging pool as a source, the landing lanes as a
        target)."""
        self._service.check_open()
        region = Region(self, buffer)
        if region.staged and self._pool_region is None:
            try:
                self._pool_region = Region(self, self._service.start_staging().array)
            except BaseException:
                region.close()
                raise
        return region

    def _register_staged_host(self, buffer: Any) -> Region:
        """Private, for tests: register host memory as a staged *target* (``path == "host-staged"``), landing
        through the lanes and copied into place with memmove: the protocol of staged GPU targets, run
        where there is no GPU. Not a source of writes."""
        self._service.check_open()
        return Region(self, buffer, staged_host=True)

    def _landing_descriptor(self, region: Region, ipc: IpcRoute | None) -> bytes:
        """The descriptor of a staged target: the landing lanes' bases and keys, a lane's size, and the
        control endpoint. Opens the lanes (and the landing thread) at the first staged target."""
        service = self._service
        lander = service.start_landing()
        with service.lock:
            if self._lanes_region is None:
                _, pool_bytes = landing.max_lanes(*service.staging_sizes)
                pool = staging.PinnedPool(pool_bytes, service.staging_sizes[1], pinned=region.kind == "cuda")
                try:
                    self._lanes_region = Region(self, pool.array)
                except BaseException:
                    pool.close()
                    raise
                lander.target.open_lanes(pool)
        lander.target.add_region(landing.TargetRegion(region.id, region.kind, region.pointer, region.length,
                                                        region._state, region._landing_key))
        lanes_region, lanes_pool = self._lanes_region, lander.pool
        assert lanes_region is not None and lanes_pool is not None  # opened above
        lanes = PeerRegion(self.id, lanes_region.id, lanes_region.length, tuple(lanes_region.bases),
                           tuple(lanes_region.keys))
        return encode_landing(self.id, region.id, region.length, lanes,
                              lanes_pool.chunk_bytes, lander.channel.message_bytes, region._landing_key,
                              lander.address, ipc)

    def connect(self, address: bytes) -> Peer:
        """A peer, from the bytes of its ``Engine.address``. Any time, in any order; no world. Paths to
        peers that had been marked down get another chance (a restarted peer may be behind them), and
        Peers made earlier use them again. A NIC slot whose endpoint has writes the engine gave up on
        that the provider never reported (stuck behind them: shm never completes a write into a region
        its peer closed, nor any write after it on that endpoint) gets a fresh endpoint on the same
        domain, completion queue and address vector, at most MAX_RENEWALS times (not where the provider
        binds registrations to endpoints, FI_MR_ENDPOINT: ``stats()`` says so). PeerLost where the peer is on
        shm and its endpoint is gone; fi.AddressVectorFull where the address vectors hold the most peers the
        provider takes (shm: 256), each one still needed by a Peer (see ``Peer.close``)."""
        self._service.check_open()
        peer = Peer(self, address)
        self._service.revive_paths()
        self._service.entries.trim()  # those of Peers closed or dropped since, once their transfers ended
        return peer

    def expect(self, imm: int, count: int, timeout: float | None = None) -> concurrent.futures.Future[int]:
        """A future that completes when ``count`` pages carrying ``imm`` have landed here (counted, never
        ordered; arrivals before the call count too, and are consumed by it). A page is a page of
        :meth:`Peer.write_pages` (however the writer coalesced them) or a piece of :meth:`Peer.write`. ``imm`` is at most
        MAX_IMM (2**24 - 2), ``count`` at most 2**40 - 1.

        The engine counts at most IMM_VALUES values at once: those awaited, and those holding pages that
        arrived before (or after) their expect() and were not taken yet. A value frees its place once its count
        is taken and no expect() awaits it. Pages nobody awaits are kept for an expect() to come for the engine's
        ``timeout``, or until their place is needed for a newer value (the oldest go first), then dropped, with
        a warning in the log (``stats()["immediates"]["dropped"]`` counts the values): a flood of values nobody
        expects, or the late pages of expect()s that timed out, never hold the count for good. Only when every
        place is awaited does expect() raise UsageError; pages of a value that arrive then are not counted: the
        next expect() of that value raises UsageError saying so, and the engine logs a warning
        (``stats()["immediates"]["lost"]`` counts them)."""
        self._service.check_open()
        imm = fi.integer(imm, "imm", 0, _native.MAX_IMM)
        count = fi.integer(count, "count", 1, _native.MAX_IMM_COUNT)
        return self._service.expect(imm, count, fi.seconds(timeout, "timeout", self.timeout))

    def stats(self) -> dict[str, Any]:
        """A snapshot: per-NIC counters (bytes, writes, completions, EAGAINs, CQ polls, errors, arrivals;
        ``"unreported"``: writes given up on that the provider has not reported yet, ``"retried"``: writes
        posted once more after failing right after a revival, ``"renewals"``: fresh endpoints; ``"down"``:
        why paths were last marked down) and what is in flight; "layout": the NIC slots and threads and
        whether defaults chose them, the worker group of each slot, and ``config``'s values ("config");
        "submitted": transfers, pages asked for and the writes they became (contiguous pages coalesced);
        "immediates": the count behind :meth:`expect` (values holding a place now, the most that may, arrivals
        not counted because every place was awaited, values of those not yet reported by an expect(), the last
        such value; values whose pages nobody expected were dropped, the last of those).
        After ``close()``, the last snapshot, with ``closed: True``."""
        return self._service.stats()

    def close(self) -> None:
        """Stop the worker threads, fail what is still pending, and close every NIC. A transfer still in
        flight fails with ``buffer_safe=False``: once the engine is gone nobody can tell when its writes
        stop reading the buffer (a shared-memory peer may still copy from it).

        Never blocks for long: a worker thread that has not stopped within WORKER_EXIT_TIMEOUT seconds is
        stuck inside a provider call (native/service.h, at fl_service_stop, says how and why). It is left
        running at idle priority, a warning says so (``stats()["stranded_threads"]`` counts it), and the NICs,
        registrations and staging pool it may still touch stay open until the process exits.

        Engines of this process that wrote to this one (or that it wrote to, with writes left unanswered) keep
        its endpoints open in libfabric, unused, until they close too (fabriclab._inprocess: shm crashes the
        process otherwise); writes and ``connect()`` to it from them are PeerLost from now on."""
        self._finalizer.detach()
        self._service.close()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        service = self._service
        state = "closed" if service.closed else f"{self.threads} thread(s)"
        chosen = [k for k in ("nics", "threads") if service.chosen[k] == "default"]
        why = f"; defaults for {' and '.join(chosen)}: {service.layout.why}" if chosen else ""
        return (f"<Engine {self.provider} {self.nics} NIC(s) ({self.emulated_nics} emulated), {state}{why}; "
                f"{self.config!r}>")


