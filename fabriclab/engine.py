"""``fabriclab.Engine`` — the final stage as a library.

The same native engine as chapters 9–15 (``native/engine.c``), run as a service: pinned worker threads,
one set of NICs per thread, batched and lazy posting, striping across NICs. Python hands it writes and
gets back futures.

    from fabriclab import Engine
    with Engine() as engine:                        # NICs and cores from fabriclab.topology
        region = engine.register(kv_cache)          # numpy, bytearray, torch/cupy (CUDA: FI_HMEM)
        send_to_peer(engine.address, region.descriptor())   # any way you like: bytes
        peer = engine.connect(peer_address)         # any time, in any order; no world
        done = peer.write_pages(region, [0, 1, 2], peer_region, [7, 8, 9], page_size=65536, imm=42)
        done.result()                               # or: await done; or done.add_done_callback(...)
    # on the peer:  engine.expect(42, 3).result()   # three writes carrying 42 have landed

Every transfer has a deadline (``Engine(timeout=...)`` or per call). Failures are typed —
:class:`PeerLost`, :class:`TransferTimeout`, :class:`RegionClosed`, :class:`InvalidDescriptor`,
:class:`OutOfRange` — and each says whether the local buffer is safe to reuse (``buffer_safe``).
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import errno
import itertools
import os
import secrets
import struct
import threading
import time
import weakref
import zlib
from dataclasses import dataclass

import numpy as np

from . import fi, multi_nic
from ._fabric import ffi, lib

__all__ = ["Engine", "Region", "Peer", "Transfer", "TransferResult", "TransferError", "PeerLost",
           "TransferTimeout", "RegionClosed", "InvalidDescriptor", "OutOfRange"]

TRANSFER_SLOTS = 1 << 16
IMM_SLOTS = 1 << 12
DEFAULT_STRIPE = 1 << 20


# ------------------------------------------------------------------------------------------- errors


class TransferError(RuntimeError):
    """A transfer could not finish. ``buffer_safe``: no write of it can still read the local buffer."""

    def __init__(self, message: str, buffer_safe: bool):
        super().__init__(f"{message} (local buffer {'is' if buffer_safe else 'is NOT yet'} safe to reuse)")
        self.buffer_safe = buffer_safe


class PeerLost(TransferError):
    """The peer went away (process gone, connection refused or reset)."""


class TransferTimeout(TransferError, TimeoutError):
    """The deadline passed before every write completed (or before the expected writes arrived)."""


class RegionClosed(TransferError):
    """The region was closed before or while the transfer used it."""


class InvalidDescriptor(TransferError, ValueError):
    """A region descriptor or engine address that is forged, truncated, or for another engine."""

    def __init__(self, message: str):
        super().__init__(message, buffer_safe=True)


class OutOfRange(TransferError, IndexError):
    """Offsets or pages outside a region; refused before anything was posted."""

    def __init__(self, message: str):
        super().__init__(message, buffer_safe=True)


_PEER_GONE = {errno.ECONNREFUSED, errno.ECONNRESET, errno.EHOSTUNREACH, errno.ENOTCONN, errno.EPIPE,
              errno.ESRCH, errno.ECONNABORTED, errno.EIO, errno.ENETUNREACH, errno.EHOSTDOWN, errno.ECANCELED}


# ---------------------------------------------------------------------------------------- results


@dataclass(frozen=True)
class TransferResult:
    """What a finished transfer returns: it is complete, so the buffer is safe to reuse."""
    bytes: int
    writes: int
    elapsed_s: float
    buffer_safe: bool = True


class _AwaitableFuture(concurrent.futures.Future):
    """A ``concurrent.futures.Future`` that can also be awaited under asyncio."""

    def __await__(self):
        return asyncio.wrap_future(self).__await__()


class Transfer(_AwaitableFuture):
    """The future of a TransferResult: wait with result(), add callbacks, or await it under asyncio."""

    def __init__(self, writes: int, nbytes: int, deadline: float):
        super().__init__()
        self.writes, self.bytes, self.deadline = writes, nbytes, deadline
        self.started = time.perf_counter()


# ------------------------------------------------------------------------------------------ wiring

_ADDRESS_MAGIC, _REGION_MAGIC = b"FLEN", b"FLRG"


def _seal(body: bytes) -> bytes:
    return body + struct.pack("<I", zlib.crc32(body))


def _unseal(data, magic: bytes, what: str) -> bytes:
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise InvalidDescriptor(f"{what} must be bytes, not {type(data).__name__}")
    data = bytes(data)
    if len(data) < 12 or data[:4] != magic:
        raise InvalidDescriptor(f"not a fabriclab {what} (truncated or from something else)")
    body, crc = data[:-4], struct.unpack("<I", data[-4:])[0]
    if zlib.crc32(body) != crc:
        raise InvalidDescriptor(f"{what} is corrupt or truncated: its checksum does not match")
    return body


def _buffer_view(obj):
    """(kind, pointer, length, device, keepalive) of any buffer-protocol, CUDA-array or DLPack object."""
    cai = getattr(obj, "__cuda_array_interface__", None)
    if cai is not None:
        pointer = int(cai["data"][0])
        shape = cai.get("shape", ())
        itemsize = np.dtype(cai["typestr"]).itemsize
        if cai.get("strides") not in (None, ()) and cai["strides"] != tuple(
                int(np.prod(shape[i + 1:])) * itemsize for i in range(len(shape))):
            raise fi.UsageError("register a contiguous CUDA array")
        length = int(np.prod(shape)) * itemsize if shape else itemsize
        device = getattr(obj, "device", None)
        device = getattr(device, "index", None) or getattr(device, "id", None) or 0
        return "cuda", pointer, length, int(device), obj
    try:
        view = memoryview(obj)
    except TypeError:
        if hasattr(obj, "__dlpack__"):
            array = np.from_dlpack(obj)  # host DLPack tensors; CUDA ones carry __cuda_array_interface__
            view = memoryview(array)
        else:
            raise fi.UsageError(f"cannot register {type(obj).__name__}: it has no buffer protocol, "
                                "__cuda_array_interface__ or __dlpack__") from None
    if view.readonly:
        raise fi.UsageError(f"cannot register a read-only {type(obj).__name__}: the peer writes into it")
    if not view.c_contiguous:
        raise fi.UsageError("register a contiguous buffer")
    array = np.frombuffer(view.cast("B"), dtype=np.uint8)
    if array.size == 0:
        raise fi.UsageError("cannot register an empty buffer")
    return "host", array.ctypes.data, array.size, 0, (obj, array)


class _HostView:
    kind = "host"

    def __init__(self, array):
        self.array, self.pointer, self.length = array, array.ctypes.data, array.size


class _CudaView:
    kind = "cuda"

    def __init__(self, pointer, length, device, owner):
        self.pointer, self.length, self.device, self.owner = pointer, length, device, owner


# --------------------------------------------------------------------------------------- regions


class Region:
    """Memory registered with every NIC of an engine. ``descriptor()`` is what a peer needs to write here."""

    _ids = itertools.count(1)

    def __init__(self, engine: "Engine", obj):
        kind, pointer, length, device, keep = _buffer_view(obj)
        view = _HostView(keep[1]) if kind == "host" else _CudaView(pointer, length, device, keep)
        self.engine, self.kind, self.address, self.length = engine, kind, pointer, length
        self.id = next(self._ids)
        self._keep = keep
        self.registrations = engine._nics.register(view)
        if any(r.staging is not None for r in self.registrations):
            for r in multi_nic.unique_registrations(self.registrations):
                r.close()
            raise fi.UsageError(f"provider {engine.provider} cannot register GPU memory here "
                                f"({self.registrations[0].why}); the engine API needs FI_HMEM — use host memory")
        self.descs = [int(ffi.cast("uintptr_t", r.mr.desc)) for r in self.registrations]
        self._descs = np.asarray(self.descs, dtype=np.uint64)
        self.keys = [r.mr.key for r in self.registrations]
        self.bases = [r.mr.remote_base for r in self.registrations]
        self.in_use = 0
        self.closed = False

    def descriptor(self) -> bytes:
        """Bytes for the peer: engine id, region id, length, and (base, key) per NIC. Checksummed."""
        self._check_open()
        body = _REGION_MAGIC + struct.pack("<QIQH", self.engine.id, self.id, self.length, len(self.keys))
        body += b"".join(struct.pack("<QQ", b, k) for b, k in zip(self.bases, self.keys))
        return _seal(body)

    def _check_open(self) -> None:
        if self.closed:
            raise RegionClosed(f"region {self.id} is closed", buffer_safe=True)

    def close(self, timeout: float | None = None) -> None:
        """Deregister. Transfers still using the region are waited for (up to ``timeout``, default the
        engine's), then failed with RegionClosed; the registration itself stays until the NIC is done."""
        if self.closed:
            return
        self.closed = True
        self.engine._close_region(self, self.engine.timeout if timeout is None else timeout)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False

    def __repr__(self) -> str:
        return f"<Region {self.id} {self.kind} {self.length} bytes{' closed' if self.closed else ''}>"


@dataclass(frozen=True)
class RemoteRegion:
    engine_id: int
    region_id: int
    length: int
    bases: tuple
    keys: tuple

    @classmethod
    def parse(cls, descriptor) -> "RemoteRegion":
        body = _unseal(descriptor, _REGION_MAGIC, "region descriptor")
        head = struct.calcsize("<QIQH")
        if len(body) < 4 + head:
            raise InvalidDescriptor("region descriptor is truncated")
        engine_id, region_id, length, n = struct.unpack_from("<QIQH", body, 4)
        if len(body) != 4 + head + 16 * n or n == 0:
            raise InvalidDescriptor("region descriptor is truncated or has a wrong NIC count")
        pairs = [struct.unpack_from("<QQ", body, 4 + head + 16 * i) for i in range(n)]
        return cls(engine_id, region_id, length, tuple(p[0] for p in pairs), tuple(p[1] for p in pairs))


# ------------------------------------------------------------------------------------------- peers


class Peer:
    """Another engine, reached through every one of our NICs. Writes are striped across them."""

    def __init__(self, engine: "Engine", address):
        body = _unseal(address, _ADDRESS_MAGIC, "engine address")
        engine_id, n = struct.unpack_from("<QH", body, 4)
        offset, addresses = 4 + 10, []
        for _ in range(n):
            if offset + 2 > len(body):
                raise InvalidDescriptor("engine address is truncated")
            size = struct.unpack_from("<H", body, offset)[0]
            addresses.append(fi.Address.from_bytes(body[offset + 2:offset + 2 + size]))
            offset += 2 + size
        if offset != len(body) or not addresses:
            raise InvalidDescriptor("engine address is truncated or malformed")
        self.engine, self.id, self.nics = engine, engine_id, len(addresses)
        # our NIC i talks to the peer's NIC i (modulo its count): the peer's key for it is keys[i % n]
        self.remote_slot = [i % n for i in range(len(engine._nics.slots))]
        self.fi_addrs = []
        for slot in engine._nics.slots:
            address = addresses[self.remote_slot[slot.index]]
            known = engine._av_entries.get((slot.index, address.raw))
            try:
                self.fi_addrs.append(known if known is not None else slot.av.insert(address))
            except fi.UsageError as exc:
                raise InvalidDescriptor(f"engine address does not fit this engine: {exc}") from None
            engine._av_entries[(slot.index, address.raw)] = self.fi_addrs[-1]
        self.closed = False
        self._next_nic = 0
        self._parsed: dict[bytes, RemoteRegion] = {}
        self._routes: dict[tuple, np.ndarray] = {}
        self._fi_addrs = np.asarray(self.fi_addrs, dtype=np.uint64)
        self._remote_slots = np.asarray(self.remote_slot, dtype=np.int64)

    def _routes_to(self, region: Region, remote: RemoteRegion) -> np.ndarray:
        """Per NIC: our descriptor of ``region``, the peer's address and its base and key for ``remote`` —
        what the engine needs to post a write, or to move it to another NIC. Kept alive by every transfer
        that uses it."""
        key = (region.id, remote.region_id)
        routes = self._routes.get(key)
        if routes is None:
            routes = np.empty(len(self.fi_addrs), dtype=_route_dtype())
            routes["desc"] = region._descs
            routes["dest"] = self._fi_addrs
            routes["remote_base"] = np.asarray(remote.bases, dtype=np.uint64)[self._remote_slots]
            routes["rkey"] = np.asarray(remote.keys, dtype=np.uint64)[self._remote_slots]
            if len(self._routes) >= 256:
                self._routes.clear()
            self._routes[key] = routes
        return routes

    def _remote(self, descriptor) -> RemoteRegion:
        if isinstance(descriptor, RemoteRegion):
            remote = descriptor
        else:
            remote = self._parsed.get(descriptor) if isinstance(descriptor, bytes) else None
            if remote is None:
                remote = RemoteRegion.parse(descriptor)
                if len(self._parsed) < 1024:
                    self._parsed[bytes(descriptor)] = remote
        if remote.engine_id != self.id:
            raise InvalidDescriptor("that region belongs to another engine than this peer")
        if len(remote.keys) != self.nics:
            raise InvalidDescriptor(f"region descriptor lists {len(remote.keys)} NICs, the peer has {self.nics}")
        return remote

    def write(self, local_region: Region, remote_descriptor, *, src_offset: int = 0, dst_offset: int = 0,
              length: int | None = None, imm: int | None = None, timeout: float | None = None,
              stripe_bytes: int = DEFAULT_STRIPE) -> Transfer:
        """Write ``length`` bytes (default: the rest of the local region) from ``src_offset`` of
        ``local_region`` to ``dst_offset`` of the peer's region, split into ``stripe_bytes`` pieces over
        the NICs. With ``imm``, every piece carries it (``Transfer.writes`` pieces: the peer expects that
        many)."""
        remote = self._remote(remote_descriptor)
        length = local_region.length - src_offset if length is None else length
        if length <= 0 or src_offset < 0 or dst_offset < 0 or src_offset + length > local_region.length:
            raise OutOfRange(f"local bytes [{src_offset}, {src_offset + length}) are outside the "
                             f"{local_region.length}-byte region")
        if dst_offset + length > remote.length:
            raise OutOfRange(f"remote bytes [{dst_offset}, {dst_offset + length}) are outside the peer's "
                             f"{remote.length}-byte region")
        if stripe_bytes <= 0:
            raise fi.UsageError("stripe_bytes must be positive")
        starts = np.arange(0, length, stripe_bytes, dtype=np.int64)
        lengths = np.minimum(stripe_bytes, length - starts).astype(np.uint64)
        return self.engine._submit(self, local_region, remote, src_offset + starts, dst_offset + starts, 1,
                                   lengths, imm, timeout)

    def write_pages(self, local_region: Region, src_pages, remote_descriptor, dst_pages, page_size: int,
                    imm: int | None = None, timeout: float | None = None) -> Transfer:
        """Write page ``src_pages[i]`` of the local region to page ``dst_pages[i]`` of the peer's, one
        write per page, striped over the NICs, batched and posted lazily by the engine's threads."""
        remote = self._remote(remote_descriptor)
        src = np.asarray(src_pages, dtype=np.int64).reshape(-1)
        dst = np.asarray(dst_pages, dtype=np.int64).reshape(-1)
        if page_size <= 0:
            raise fi.UsageError(f"page_size must be positive, got {page_size}")
        if src.size != dst.size or src.size == 0:
            raise fi.UsageError(f"{src.size} source pages but {dst.size} destination pages")
        for pages, region_length, side in ((src, local_region.length, "local"), (dst, remote.length, "remote")):
            last = region_length // page_size
            if pages.min() < 0 or pages.max() >= last:
                bad = pages[(pages < 0) | (pages >= last)][0]
                raise OutOfRange(f"{side} page {bad} is outside the {last} whole {page_size}-byte pages of the "
                                 f"{side} region")
        return self.engine._submit(self, local_region, remote, src, dst, page_size, page_size, imm, timeout)

    def close(self) -> None:
        """No more writes through this Peer; the peer (or its restarted self) may connect again later.
        Its addresses stay in the address vectors, reused if they come back: removing and re-inserting
        entries is where some providers (shm in libfabric 1.17) lose track of a peer."""
        self.closed = True

    def __repr__(self) -> str:
        return f"<Peer {self.id:#x} over {self.nics} NIC(s){' closed' if self.closed else ''}>"


# ------------------------------------------------------------------------------------------ engine

_ROUTE_FIELDS = ("desc", "dest", "remote_base", "rkey")


def _route_dtype() -> np.dtype:
    """numpy's view of native/engine.h's fl_route, offsets taken from the compiled struct."""
    return np.dtype({"names": list(_ROUTE_FIELDS), "formats": ["<u8"] * len(_ROUTE_FIELDS),
                     "offsets": [ffi.offsetof("fl_route", f) for f in _ROUTE_FIELDS],
                     "itemsize": ffi.sizeof("fl_route")})


class Engine:
    """The transfer engine. See the module docstring for a tour.

    ``provider``/``domains``/``nics`` pick the NICs (default: every domain of the best provider;
    ``nics`` above the real count adds emulated NICs); ``threads`` worker threads (default: one per
    topology group that has NICs, at most the NIC count), pinned to the cores fabriclab.topology
    proposes (two pinned engines on one host would share those cores: give one ``pin=False``);
    ``timeout`` is every transfer's default deadline in seconds; a NIC with writes in flight and no
    completion for ``link_timeout`` seconds (default a third of ``timeout``; 0: never) no longer reaches
    those writes' peers: they go over the other NICs (failover; ``stats()`` names the NIC) and fail with
    PeerLost when no NIC reaches the peer; ``gpu`` (default: when CUDA is here)
    opens the NICs able to register GPU memory (on shm that variant moves host memory more slowly: say
    ``gpu=False`` when you only move host memory).

    Pinned workers poll their NICs without rest, so keep your own busy threads off their cores:
    ``os.sched_setaffinity(0, engine.housekeeping_cores)`` (the engine's own reaper thread runs there).
    """

    def __init__(self, provider: str | None = None, *, nics: int | None = None, domains=None,
                 threads: int | None = None, pin: bool = True, batch: int = 16, fi_more: bool = False,
                 timeout: float = 30.0, in_flight: int | None = None, gpu: bool | None = None,
                 link_timeout: float | None = None):
        if timeout <= 0:
            raise fi.UsageError("timeout must be positive")
        link_timeout = timeout / 3 if link_timeout is None else link_timeout
        if link_timeout < 0:
            raise fi.UsageError(f"link_timeout must be 0 (no failover) or positive, got {link_timeout}")
        self.timeout = timeout
        self.id = secrets.randbits(63) | 1
        self._lock = threading.Lock()
        self._closed = False
        if gpu is None:
            from . import gpu as cuda
            gpu = cuda.cuda_status() == "ok"
        # With GPUs, ask for FI_HMEM so CUDA arrays can be registered (where the provider offers it).
        self._nics = multi_nic.NicSet(provider, nics, domains, "cuda" if gpu else "host")
        self.provider = self._nics.provider
        try:
            self._native = multi_nic.NativeEngine(self._nics)
            e = self._native._ptr
            self._transfers = np.zeros(2 * TRANSFER_SLOTS, dtype=np.int64)
            self._imm_keys = np.zeros(IMM_SLOTS, dtype=np.uint64)
            self._imm_counts = np.zeros(IMM_SLOTS, dtype=np.uint64)
            e.transfers = ffi.cast("int64_t *", self._transfers.ctypes.data)
            e.transfer_capacity = TRANSFER_SLOTS
            e.imm_keys = ffi.cast("uint64_t *", self._imm_keys.ctypes.data)
            e.imm_counts = ffi.cast("uint64_t *", self._imm_counts.ctypes.data)
            e.imm_capacity = IMM_SLOTS
            if in_flight is not None:
                if in_flight <= 0:
                    raise fi.UsageError(f"in_flight must be at least 1, got {in_flight}")
                for slot in self._nics.slots:
                    e.nics[slot.index].max_in_flight = min(e.nics[slot.index].max_in_flight, in_flight)
            self.threads = threads or self._default_threads()
            if not 1 <= self.threads <= len(self._nics.slots):
                raise fi.UsageError(f"threads must be between 1 and the number of NICs ({len(self._nics.slots)}), "
                                    f"got {self.threads}")
            cfg = ffi.new("fl_config *")
            cfg.threads, cfg.groups, cfg.batch, cfg.lazy, cfg.fi_more = self.threads, self.threads, batch, 1, int(fi_more)
            cfg.timeout_s = timeout
            cfg.link_timeout_s = link_timeout
            cfg.pin = int(pin)
            self.worker_cores = multi_nic.worker_cores(self.threads, self.provider) if pin else []
            for i, core in enumerate(self.worker_cores):
                cfg.cores[i] = core
            e.stop = 0
            if lib.fl_service_start(e, cfg) != 0:
                raise fi.FabricError("fl_service_start", e.error_code, message=ffi.string(e.error).decode())
        except BaseException:
            self._nics.close()
            raise
        self._av_entries: dict[tuple, int] = {}  # (our NIC slot, peer's raw address) -> fi_addr
        # A transfer id is free again only once the native engine has reported it finished (every write
        # completed or failed), never earlier: the engine may still count writes against it.
        self._free_ids = list(range(TRANSFER_SLOTS - 1, -1, -1))
        self._pending: dict[int, tuple[Transfer, Region, np.ndarray]] = {}
        self._zombies: dict[int, tuple[Region, np.ndarray]] = {}  # failed, writes still in flight
        self._expectations: list[tuple[int, int, concurrent.futures.Future, float]] = []
        self._retired_regions: list[Region] = []
        self._next_deadline = float("inf")  # the earliest deadline the reaper has to look at
        # The workers poll without rest; any other busy thread landing on their cores stalls a NIC.
        self.housekeeping_cores = frozenset(os.sched_getaffinity(0)) - frozenset(self.worker_cores)
        self._reaper = threading.Thread(target=self._reap, name="fabriclab-engine-reaper", daemon=True)
        self._reaper.start()
        self._finalizer = weakref.finalize(self, Engine._close_at_exit, weakref.ref(self))

    def _default_threads(self) -> int:
        from . import topology
        try:
            groups = [g for g in topology.Topology.discover(provider=self.provider).groups if g.nics]
        except Exception:  # topology is advice only
            groups = []
        return max(1, min(len(groups) or 1, len(self._nics.slots), os.cpu_count() or 1))

    # -------------------------------------------------------------------------------- public API

    @property
    def address(self) -> bytes:
        """This engine's address (every NIC's), for a peer's ``connect``. Checksummed bytes."""
        body = _ADDRESS_MAGIC + struct.pack("<QH", self.id, len(self._nics.slots))
        for slot in self._nics.slots:
            raw = slot.ep.address().to_bytes()
            body += struct.pack("<H", len(raw)) + raw
        return _seal(body)

    @property
    def nics(self) -> int:
        """How many NIC slots this engine drives (real ones plus emulated ones)."""
        return len(self._nics.slots)

    @property
    def emulated_nics(self) -> int:
        """How many of the NIC slots are emulated: extra endpoints sharing a real domain."""
        return self._nics.emulated

    def register(self, buffer) -> Region:
        """Register any buffer-protocol object (numpy, bytearray, ...), CUDA array (cupy, torch: through
        ``__cuda_array_interface__``) or DLPack host tensor with every NIC."""
        self._check_open()
        return Region(self, buffer)

    def connect(self, address) -> Peer:
        """A peer, from the bytes of its ``Engine.address``. Any time, in any order; no world."""
        self._check_open()
        peer = Peer(self, address)
        self._native._ptr.revive_epoch += 1  # a restarted peer may be behind paths marked dead
        return peer

    def expect(self, imm: int, count: int, timeout: float | None = None) -> concurrent.futures.Future:
        """A future that completes when ``count`` writes carrying ``imm`` have landed here (counted, never
        ordered; arrivals before the call count too, and are consumed by it)."""
        self._check_open()
        if count <= 0:
            raise fi.UsageError(f"count must be at least 1, got {count}")
        future = _AwaitableFuture()
        deadline = time.monotonic() + (self.timeout if timeout is None else timeout)
        with self._lock:
            self._expectations.append((int(imm), int(count), future, deadline))
            self._next_deadline = min(self._next_deadline, deadline)
        self._native._ptr.imm_watch = 1
        lib.fl_service_wake(self._native._ptr)
        return future

    def stats(self) -> dict:
        """A snapshot: per-NIC counters (bytes, writes, completions, EAGAINs, CQ polls, errors, arrivals)
        and what is in flight."""
        with self._lock:
            pending, zombies, expecting = len(self._pending), len(self._zombies), len(self._expectations)
        return {"provider": self.provider, "nics": self.nics, "emulated_nics": self.emulated_nics,
                "threads": self.threads, "transfers_in_flight": pending, "abandoned_in_flight": zombies,
                "expectations": expecting, "per_nic": self._native.counters()}

    def close(self) -> None:
        """Stop the worker threads, fail what is still pending, and close every NIC."""
        if self._closed:
            return
        self._closed = True
        lib.fl_service_wake(self._native._ptr)
        self._reaper.join(5)
        lib.fl_service_stop(self._native._ptr)
        with self._lock:
            for transfer, region, _ in self._pending.values():
                if not transfer.done():
                    transfer.set_exception(TransferError("the engine was closed", buffer_safe=True))
                region.in_use -= 1
            self._pending.clear()
            for _, _, future, _ in self._expectations:
                if not future.done():
                    future.set_exception(TransferError("the engine was closed", buffer_safe=True))
            self._expectations.clear()
        self._native.close()
        self._nics.close()
        self._finalizer.detach()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False

    @staticmethod
    def _close_at_exit(ref):
        engine = ref()
        if engine is not None:
            engine.close()

    # ------------------------------------------------------------------------------- internals

    def _check_open(self) -> None:
        if self._closed:
            raise fi.UsageError("the engine is closed")

    def _submit(self, peer: Peer, region: Region, remote: RemoteRegion, src, dst, stride: int, lengths, imm,
                timeout) -> Transfer:
        """Hand one request to the native engine (it builds the writes and stripes them over the NICs) and
        track its future. Write i moves lengths[i] (or ``lengths`` bytes) from src[i] * stride of the
        region to dst[i] * stride of the peer's."""
        self._check_open()
        region._check_open()
        if peer.closed:
            raise fi.UsageError("that peer was closed; connect again")
        if region.engine is not self:
            raise fi.UsageError("that region was registered with another engine")
        if imm is not None and not 0 <= int(imm) < lib.FL_NO_IMM:
            raise fi.UsageError(f"imm must be below 2**32 - 1 (EFA carries 32 bits; the top value is reserved), "
                                f"got {imm}")
        n = src.size
        uniform = np.isscalar(lengths)
        nbytes = n * lengths if uniform else int(lengths.sum())
        deadline = time.monotonic() + (self.timeout if timeout is None else timeout)
        transfer = Transfer(n, nbytes, deadline)
        routes = peer._routes_to(region, remote)
        src, dst = np.ascontiguousarray(src, dtype=np.int64), np.ascontiguousarray(dst, dtype=np.int64)
        src_c, dst_c = ffi.from_buffer("int64_t[]", src), ffi.from_buffer("int64_t[]", dst)
        lengths_c = ffi.NULL if uniform else ffi.from_buffer("uint64_t[]", np.ascontiguousarray(lengths, np.uint64))
        request = ffi.new("fl_request *", {
            "routes": ffi.from_buffer("fl_route[]", routes), "local_base": region.address, "src": src_c,
            "dst": dst_c, "stride": stride, "lengths": lengths_c, "length": lengths if uniform else 0, "count": n,
            # Every write carries immediate data (a reserved value when the caller gave none), so the peer's
            # worker threads see traffic arrive and keep polling: software providers need the target to poll.
            "imm": lib.FL_NO_IMM if imm is None else int(imm), "first_nic": peer._next_nic})
        peer._next_nic = (peer._next_nic + n) % len(peer.fi_addrs)
        with self._lock:
            if not self._free_ids:
                raise TransferError("too many transfers in flight", buffer_safe=True)
            tid = self._free_ids.pop()
            self._transfers[2 * tid] = n
            self._transfers[2 * tid + 1] = 0
            self._pending[tid] = (transfer, region, routes)
            region.in_use += 1
            if deadline < self._next_deadline:
                self._next_deadline = deadline
                lib.fl_service_wake(self._native._ptr)
        request.transfer = tid
        taken = 0
        while taken < n:
            taken += lib.fl_service_submit(self._native._ptr, request, taken)
            if taken < n:
                if time.monotonic() > deadline or self._native._ptr.stop:
                    with self._lock:
                        self._pending.pop(tid, None)
                        self._zombies[tid] = (region, routes)
                        region.in_use -= 1
                    # writes never handed over will never complete: the engine counts them as finished
                    lib.fl_transfer_release(self._native._ptr, tid, n - taken)
                    raise TransferTimeout(f"the engine's queues stayed full; {n - taken} of {n} writes not queued",
                                          buffer_safe=taken == 0)
                time.sleep(0.0002)
        return transfer

    def _reap(self) -> None:
        """Resolve futures as the native engine reports transfers finished (it wakes this thread, which
        waits without the GIL); enforce deadlines; count expected immediate data."""
        finished = ffi.new("uint32_t[]", 1024)
        e = self._native._ptr
        if self.worker_cores and self.housekeeping_cores:
            os.sched_setaffinity(0, self.housekeeping_cores)  # this thread only
        while not self._closed:
            with self._lock:
                busy = self._pending or self._expectations or self._zombies
                wait = min(max(self._next_deadline - time.monotonic(), 0.0), 0.05) if busy else 0.05
            got = lib.fl_service_wait(e, finished, len(finished), wait)
            for tid in finished[0:got]:
                with self._lock:
                    entry = self._pending.pop(tid, None)
                    self._zombies.pop(tid, None)
                if entry is not None:
                    transfer, region, _ = entry
                    self._finish(transfer, region, 0, int(self._transfers[2 * tid + 1]))
                with self._lock:
                    self._free_ids.append(tid)
            now = time.monotonic()
            with self._lock:
                rescan = now >= self._next_deadline
                expectations = list(self._expectations) if self._expectations else ()
            if rescan:
                self._expire(now)
            for item in expectations:
                imm, count, future, deadline = item
                done = lib.fl_imm_take(e, imm, count)
                if done or now > deadline or future.cancelled():
                    with self._lock:
                        if item in self._expectations:
                            self._expectations.remove(item)
                        if not self._expectations:
                            e.imm_watch = 0
                    if done:
                        future.set_result(count)
                    elif not future.cancelled():
                        future.set_exception(TransferTimeout(f"{count} writes carrying imm {imm} did not all "
                                                             "arrive in time", buffer_safe=True))
            self._retire_regions()

    def _expire(self, now: float) -> None:
        """Fail pending transfers whose deadline passed or whose region was closed; their ids wait (as
        zombies) until the engine reports their last write finished."""
        with self._lock:
            pending = list(self._pending.items())
            expectations = [x[3] for x in self._expectations]
        earliest = float("inf")
        for tid, (transfer, region, routes) in pending:
            if now > transfer.deadline or region.closed:
                with self._lock:
                    if self._pending.pop(tid, None) is None:
                        continue  # finished meanwhile
                    self._zombies[tid] = (region, routes)
                self._finish(transfer, region, int(self._transfers[2 * tid]), int(self._transfers[2 * tid + 1]),
                             expired=True)
            else:
                earliest = min(earliest, transfer.deadline)
        with self._lock:
            self._next_deadline = min([earliest, *expectations])

    def _finish(self, transfer, region, remaining, error, expired=False) -> None:
        with self._lock:
            region.in_use -= 1
        safe = remaining <= 0
        if transfer.cancelled():
            pass
        elif error:
            code = -error
            text = f"{errno.errorcode.get(code, code)}: {os.strerror(code) if code < 4096 else ''}".strip()
            kind = PeerLost if code in _PEER_GONE else TransferError
            what = ("no NIC reaches the peer any more (each path failed or stalled: peer gone or every link down)"
                    if code == errno.EHOSTUNREACH else f"a write of the transfer failed ({text})")
            transfer.set_exception(kind(what, buffer_safe=safe))
        elif expired and region.closed:
            transfer.set_exception(RegionClosed("the region was closed while the transfer used it", buffer_safe=safe))
        elif expired:
            transfer.set_exception(TransferTimeout(f"{remaining} of {transfer.writes} writes had not completed "
                                                   "by the deadline (peer gone or stalled?)", buffer_safe=safe))
        else:
            transfer.set_result(TransferResult(transfer.bytes, transfer.writes, time.perf_counter() - transfer.started))

    def _close_region(self, region: Region, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while region.in_use > 0 and time.monotonic() < deadline and not self._closed:
            time.sleep(0.001)
        with self._lock:
            self._retired_regions.append(region)
            self._next_deadline = 0.0  # the reaper fails what is left with RegionClosed
        lib.fl_service_wake(self._native._ptr)

    def _retire_regions(self) -> None:
        """Deregister closed regions once no write can still touch them."""
        with self._lock:
            busy = {id(r) for r, _ in self._zombies.values()} | {id(r) for _, r, _ in self._pending.values()}
            ready = [r for r in self._retired_regions if id(r) not in busy]
            self._retired_regions = [r for r in self._retired_regions if id(r) in busy]
        for region in ready:
            for reg in multi_nic.unique_registrations(region.registrations):
                reg.close()

