"""``fabriclab.Engine`` — the final stage as a library.

The same native engine core as chapters 9–15 (``native/core.c``), run as a service (``native/service.c``):
pinned worker threads, one set of NICs per thread, batched and lazy posting, striping across NICs. Python
hands it writes and gets back futures.

    from fabriclab import Engine
    with Engine() as engine:                        # NICs and cores from fabriclab.topology
        region = engine.register(kv_cache)          # numpy, bytearray, torch/cupy (CUDA: FI_HMEM)
        send_to_peer(engine.address, region.descriptor())   # any way you like: bytes
        peer = engine.connect(peer_address)         # any time, in any order; no world
        done = peer.write_pages(region, [0, 1, 2], peer_region, [7, 8, 9], page_size=65536, imm=42)
        done.result()                               # or: await done; or done.add_done_callback(...)
    # on the peer:  engine.expect(42, 3).result()   # three pages carrying 42 have landed

Every transfer has a deadline (``Engine(timeout=...)`` or per call). Failures are typed —
:class:`PeerLost`, :class:`TransferTimeout`, :class:`RegionClosed`, :class:`InvalidDescriptor`,
:class:`OutOfRange` — and each says whether the local buffer is safe to reuse (``buffer_safe``).
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import errno
import itertools
import logging
import math
import numbers
import os
import queue
import re
import secrets
import struct
import threading
import time
import warnings
import weakref
import zlib
from dataclasses import dataclass

import numpy as np

from . import _native, control, fi, landing, memory, shmclean, staging
from .nics import (NicSet, NicSlot, default_layout, discover_topology, group_nics, host_identity, same_host_path,
                   topology_groups_holding, unique_registrations, worker_cores)

FabriclabError, UsageError = fi.FabriclabError, fi.UsageError  # the error root, and bad input (exported)

__all__ = ["Engine", "Region", "Peer", "Transfer", "TransferResult", "FabriclabError", "UsageError", "TransferError",
           "PeerLost", "WriteRejected", "TransferTimeout", "RegionClosed", "InvalidDescriptor", "OutOfRange",
           "StagingFailed"]

TRANSFER_SLOTS = 1 << 16
MAX_RENEWALS = 64  # fresh endpoints per NIC slot: a peer that keeps stalling them cannot exhaust file descriptors
# Immediate values an engine counts at once: each awaited by an expect() or holding pages that arrived and
# were not taken yet (a value's slot is given back once its count is taken and nothing awaits it): as many as
# one writer engine can have transfers in flight, so a writer with one value per transfer never fills it.
IMM_VALUES = TRANSFER_SLOTS
DEFAULT_STRIPE = 1 << 20
LOST_WARNING_S = 10.0  # the most often the engine warns of immediate data it could not count
# How long Engine.close waits for its worker threads to leave the native engine. A healthy worker leaves
# within microseconds; one that has not by then is stuck inside a provider call (shm spins for ever on a
# lock its peer held when it was killed), and waiting longer would not help.
WORKER_EXIT_TIMEOUT = 5.0
# Services closed while threads were stuck in their native engine: whatever those threads may still touch
# (NICs, registrations, buffers of unfinished transfers, the staging pool) stays open for the life of the
# process, since nobody can tell when, if ever, they let go of it.
_STRANDED_SERVICES: list["_Service"] = []
# The ids of the engines closed in this process. Their addresses are refused by connect() and their Peers take
# no more writes: a libfabric endpoint closed in this process can crash the process when its address is used
# again (shm keeps it in its list of this process's endpoints for ever: fabriclab._inprocess says more).
_CLOSED_HERE: set[int] = set()


# ------------------------------------------------------------------------------------------- errors


class TransferError(fi.FabriclabError, RuntimeError):
    """A transfer could not finish. ``buffer_safe``: no write of it can still read the local buffer.

    When it is False, ``wait_safe(timeout)`` waits for the moment it becomes true (the provider reported
    every write the engine gave up on) and says whether it came. The message says it too, except where no
    local buffer was ever involved (``about_buffer=False``: ``Engine.connect``, ``Engine.expect``)."""

    def __init__(self, message: str, buffer_safe: bool, safety: "_Safety | None" = None, *, about_buffer: bool = True):
        note = f" (local buffer {'is' if buffer_safe else 'is NOT yet'} safe to reuse)" if about_buffer else ""
        super().__init__(message + note)
        self.buffer_safe = buffer_safe
        self._safety = safety

    def wait_safe(self, timeout: float | None = None) -> bool:
        """True once no write of the transfer can read the local buffer; False if ``timeout`` seconds
        (default 30) pass first or the engine was closed before the provider reported them."""
        if self.buffer_safe or self._safety is None:
            return self.buffer_safe
        return self._safety.wait(timeout)


def _as_the_callers(error: BaseException, safe: bool, safety: "_Safety") -> BaseException:
    """A staged transfer's failure as its caller sees it: the writes that failed read from the staging pool
    (or wrote into the peer's lanes), so the safety they report is the pool's, not the caller's buffer's.
    The same kind of error, whose ``buffer_safe`` and ``wait_safe`` are about the caller's buffer."""
    if not isinstance(error, TransferError) or error.buffer_safe == safe and error._safety is safety:
        return error
    try:
        mine = type(error)(str(error).rsplit(" (local buffer ", 1)[0], buffer_safe=safe, safety=safety)
    except TypeError:  # an error that is always safe (InvalidDescriptor, OutOfRange): nothing to say
        return error
    mine.__cause__ = error
    return mine


class PeerLost(TransferError):
    """No NIC reaches the peer any more: every path to it failed (connection refused, reset or dropped) or
    stopped completing writes. The message says which. Not proof that the peer is gone: a write it could
    not take (into a region it closed, with a stale descriptor) drops the connection on some providers
    (tcp) and stalls the path on others (shm). ``Engine.connect`` to the peer again revives its paths."""


class WriteRejected(TransferError):
    """The provider refused a write of the transfer (a key or range the peer does not accept, say): the
    peer may be fine; later writes with valid descriptors go through."""


class TransferTimeout(TransferError, TimeoutError):
    """The deadline passed before every write completed (or before the expected writes arrived)."""


class RegionClosed(TransferError):
    """The region was closed before or while the transfer used it."""


class InvalidDescriptor(TransferError, ValueError):
    """A region descriptor or engine address that is forged, truncated, or for another engine."""

    def __init__(self, message: str, *, about_buffer: bool = True):
        super().__init__(message, buffer_safe=True, about_buffer=about_buffer)


def _closed_here(what: str, about_buffer: bool = True) -> PeerLost:
    """For a write to (or connect() to) an engine closed in this process: nothing was posted."""
    return PeerLost(f"{what} was closed, in this process: nothing reaches it any more (connect to an open engine)",
                    buffer_safe=True, about_buffer=about_buffer)


def _bad_address(message: str) -> InvalidDescriptor:
    """What ``Engine.connect`` raises for an address it cannot use: no buffer is involved, none is mentioned."""
    return InvalidDescriptor(message, about_buffer=False)


class OutOfRange(TransferError, IndexError):
    """Offsets or pages outside a region; refused before anything was posted."""

    def __init__(self, message: str):
        super().__init__(message, buffer_safe=True)


class StagingFailed(TransferError):
    """The staged path (GPU memory through pinned host memory) failed: a CUDA call failed, or the GPU memory
    of the region is gone (freed by its owner). The writes of the transfer that had been handed to the NICs
    read the staging pool only, never the region."""


def _staging_failure(message: str, safe: bool, why: str, cause: BaseException | None = None) -> TransferError:
    """The exception of a staged transfer that failed (why: see staging.FAILURES, or "peer" where a staged
    target's control endpoint cannot be reached). ``cause``, the failure of one of its writes, gives its
    type, with the buffer safety of the whole transfer."""
    if isinstance(cause, TransferError) and type(cause).__init__ is TransferError.__init__:
        return type(cause)(message.split(" (local buffer ")[0], buffer_safe=safe)
    if why == "peer":
        return PeerLost(message, buffer_safe=safe)
    if why == "closed":
        return RegionClosed(message, buffer_safe=safe)
    if why == "timeout":
        return TransferTimeout(message, buffer_safe=safe)
    if why in ("engine", "invalid"):  # invalid: the target refused a control message of this engine's
        return TransferError(message, buffer_safe=safe)
    return StagingFailed(message, buffer_safe=safe)


_PEER_GONE = {errno.ECONNREFUSED, errno.ECONNRESET, errno.EHOSTUNREACH, errno.ENOTCONN, errno.EPIPE,
              errno.ESRCH, errno.ECONNABORTED, errno.EIO, errno.ENETUNREACH, errno.EHOSTDOWN, errno.ECANCELED}


# ------------------------------------------------------------------------------------ input checks


_integer = fi.integer  # every entry point's rule for integers


_INT64_MAX = 2 ** 63 - 1


def _pages(values, side: str) -> np.ndarray:
    """Page numbers as int64, refusing floats (never truncated) and numbers int64 cannot hold."""
    array = np.asarray(values)
    if array.dtype == object:  # Python integers beyond what numpy holds, or mixed objects
        pages = [_integer(v, f"{side} page") for v in array.reshape(-1)]
        too_big = next((v for v in pages if abs(v) > _INT64_MAX), None)
        if too_big is not None:
            raise OutOfRange(f"{side} page {too_big} is outside any region")
        return np.asarray(pages, dtype=np.int64)
    if array.size and array.dtype.kind not in "iu":
        raise fi.UsageError(f"{side} pages must be integers, got {array.dtype} values such as {array.reshape(-1)[0]!r}")
    if array.size and array.dtype.kind == "u" and array.max() > _INT64_MAX:
        raise OutOfRange(f"{side} page {int(array.max())} is outside any region")
    return array.astype(np.int64).reshape(-1)


def _first_overlap(sources: np.ndarray, destinations: np.ndarray, size: int) -> tuple[int, int] | None:
    """(i, j) such that ``size`` bytes from sources[i] and from destinations[j] share a byte; None if no pair
    does. Sorted once: for each source, only the last destination starting before its end can overlap it."""
    order = np.argsort(destinations, kind="stable")
    starts = destinations[order]
    last = np.searchsorted(starts, sources + size, side="left") - 1
    hit = (last >= 0) & (starts[np.maximum(last, 0)] > sources - size)
    if not hit.any():
        return None
    i = int(np.argmax(hit))
    return i, int(order[last[i]])


# ---------------------------------------------------------------------------------------- results


@dataclass(frozen=True)
class TransferResult:
    """What a finished transfer returns: it is complete, so the buffer is safe to reuse."""
    bytes: int
    writes: int
    elapsed_s: float
    buffer_safe: bool = True
    pages: int = 0  # what the peer's expect() counts for it: pages of write_pages, pieces of write


class _Safety:
    """When the last write of a transfer stops reading the local buffer; or that nobody will know (the
    engine closed first)."""

    def __init__(self, default_timeout: float):
        self._cond = threading.Condition()
        self._state = None  # True: safe; False: the engine closed before the provider reported every write
        self._default_timeout = default_timeout

    def settle(self, safe: bool) -> None:
        with self._cond:
            if self._state is None:
                self._state = safe
                self._cond.notify_all()

    @property
    def safe(self) -> bool:
        return self._state is True

    def wait(self, timeout: float | None) -> bool:
        timeout = fi.seconds(timeout, "timeout", self._default_timeout)
        with self._cond:
            self._cond.wait_for(lambda: self._state is not None, timeout)
            return self._state is True


class _Callbacks:
    """Runs futures' done-callbacks on one thread of their own, so that a callback that blocks (on another
    transfer's result, say) never stalls the engine that resolves futures. Warns once about a callback
    that runs longer than SLOW_CALLBACK_S: the callbacks after it wait."""

    SLOW_CALLBACK_S = 1.0

    def __init__(self):
        self._lock = threading.Lock()
        self._queue: queue.SimpleQueue | None = None
        self._pid = None
        self._warned = False

    def run(self, fn, future) -> None:
        with self._lock:
            if self._pid != os.getpid():  # first use, or the thread stayed behind in the parent of a fork
                self._queue, self._pid = queue.SimpleQueue(), os.getpid()
                threading.Thread(target=self._loop, args=(self._queue,), name="fabriclab-callbacks",
                                 daemon=True).start()
            self._queue.put((fn, future))

    def _loop(self, calls: queue.SimpleQueue) -> None:
        while True:
            fn, future = calls.get()
            started = time.monotonic()
            try:
                fn(future)
            except Exception:  # as concurrent.futures does: a failing callback is logged, never fatal
                logging.getLogger("fabriclab").exception("a transfer's done-callback raised")
            took = time.monotonic() - started
            if took > self.SLOW_CALLBACK_S and not self._warned:
                self._warned = True
                warnings.warn(f"a transfer's done-callback ran for {took:.1f} s; callbacks run one at a time on "
                              "their own thread, so the others waited: hand long work to your own thread",
                              RuntimeWarning, stacklevel=1)


_CALLBACKS = _Callbacks()


class _AwaitableFuture(concurrent.futures.Future):
    """A ``concurrent.futures.Future`` that can also be awaited under asyncio. Its done-callbacks run on
    their own thread, never on the engine's. ``result(timeout)`` and ``exception(timeout)``: None or inf
    waits until it is done (it has a deadline of its own), 0 polls; nan, negatives and non-numbers are
    refused (the standard Future raises an empty TimeoutError at once for them, or OverflowError for inf)."""

    def result(self, timeout: float | None = None):
        return super().result(_wait_limit(timeout))

    def exception(self, timeout: float | None = None):
        return super().exception(_wait_limit(timeout))

    def add_done_callback(self, fn) -> None:
        super().add_done_callback(lambda future: _CALLBACKS.run(fn, future))

    def __await__(self):
        return asyncio.wrap_future(self).__await__()


def _wait_limit(timeout) -> float | None:
    if timeout is None or isinstance(timeout, numbers.Real) and not isinstance(timeout, bool) and timeout == math.inf:
        return None
    if isinstance(timeout, bool) or not isinstance(timeout, numbers.Real) or not timeout >= 0:
        raise fi.UsageError(f"timeout must be None (wait until done), 0 (poll) or seconds to wait, got {timeout!r}")
    return float(timeout)


class Transfer(_AwaitableFuture):
    """The future of a TransferResult: wait with result(), add callbacks, or await it under asyncio.

    A transfer cannot be cancelled once submitted (its writes are in the NICs' queues): ``cancel()``
    returns False. ``wait_safe(timeout)`` waits until no write of it can read the local buffer.
    ``writes``: how many writes it became (contiguous pages coalesced); ``pages``: how many the peer's
    ``Engine.expect`` counts for it (one per page of write_pages, whatever the coalescing)."""

    def __init__(self, writes: int, nbytes: int, deadline: float, safety: _Safety, pages: int | None = None):
        super().__init__()
        self.writes, self.bytes, self.deadline = writes, nbytes, deadline
        self.pages = writes if pages is None else pages
        self.started = time.perf_counter()
        self._safety = safety
        self.set_running_or_notify_cancel()  # running: cancel() refuses instead of lying

    def wait_safe(self, timeout: float | None = None) -> bool:
        """True once no write of this transfer can still read the local buffer (False if ``timeout``
        seconds, default 30, pass first, or the engine closed before the provider reported them)."""
        return self._safety.wait(timeout)


# ------------------------------------------------------------------------------------------ wiring

_ADDRESS_MAGIC, _REGION_MAGIC, _LANDING_MAGIC = b"FLEN", b"FLRG", b"FLRL"  # engine, region, staged target


def _seal(body: bytes) -> bytes:
    return body + struct.pack("<I", zlib.crc32(body))


def _unseal(data, magic: bytes, what: str) -> bytes:
    invalid = _bad_address if magic == _ADDRESS_MAGIC else InvalidDescriptor
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise invalid(f"{what} must be bytes, not {type(data).__name__}")
    data = bytes(data)
    if len(data) < 12 or data[:4] != magic:
        raise invalid(f"not a fabriclab {what} (truncated or from something else)")
    body, crc = data[:-4], struct.unpack("<I", data[-4:])[0]
    if zlib.crc32(body) != crc:
        raise invalid(f"{what} is corrupt or truncated: its checksum does not match")
    return body


def _buffer_view(obj):
    """(kind, pointer, length, device, keepalive, readonly) of any buffer-protocol, CUDA-array or DLPack
    object."""
    cai = getattr(obj, "__cuda_array_interface__", None)
    if cai is not None:
        pointer = int(cai["data"][0])
        shape = cai.get("shape", ())
        itemsize = np.dtype(cai["typestr"]).itemsize
        if cai.get("strides") not in (None, ()) and cai["strides"] != tuple(
                int(np.prod(shape[i + 1:])) * itemsize for i in range(len(shape))):
            raise fi.UsageError("register a contiguous CUDA array")
        length = int(np.prod(shape)) * itemsize if shape else itemsize
        return "cuda", pointer, length, _claimed_device(obj), obj, bool(cai["data"][1])
    if type(obj).__name__ == "PyCapsule" or (hasattr(obj, "__dlpack__") and not _has_buffer(obj)):
        cuda = staging.dlpack_cuda(obj)  # None: a host tensor
        if cuda is not None:
            pointer, length, device, keep = cuda
            return "cuda", pointer, length, device, keep, False
    try:
        view = memoryview(obj)
    except TypeError:
        if hasattr(obj, "__dlpack__"):
            array = np.from_dlpack(obj)  # a host DLPack tensor
            view = memoryview(array)
        else:
            raise fi.UsageError(f"cannot register {type(obj).__name__}: it has no buffer protocol, "
                                "__cuda_array_interface__ or __dlpack__") from None
    if not view.c_contiguous:
        raise fi.UsageError("register a contiguous buffer")
    if _holds_references(obj, view):
        dtype = getattr(obj, "dtype", f"format {view.format!r}")
        raise fi.UsageError(f"cannot register this {type(obj).__name__} ({dtype}): its items hold references to "
                            "Python objects (dtype object, or a structured dtype with an object field at any depth), "
                            "pointers the interpreter owns; a peer's write over them crashes this process, and a "
                            "write of them sends addresses that mean nothing there. Register the data itself "
                            "instead: a numeric array, e.g. np.asarray(values, dtype=np.float64), or bytes")
    array = np.frombuffer(view.cast("B"), dtype=np.uint8)
    if array.size == 0:
        raise fi.UsageError("cannot register an empty buffer")
    return "host", array.ctypes.data, array.size, 0, (obj, array), view.readonly


def _holds_references(obj, view: memoryview) -> bool:
    """Whether a buffer's items are (or contain, at any depth) PyObject pointers: numpy says so of its dtypes
    (``hasobject``); any other exporter through its PEP 3118 format, where "O" is an object once the field
    names (between colons) are taken out."""
    dtype = getattr(obj, "dtype", None)
    if isinstance(dtype, np.dtype):
        return dtype.hasobject
    return "O" in re.sub(r":[^:]*:", "", view.format)


def _has_buffer(obj) -> bool:
    try:
        memoryview(obj)
        return True
    except TypeError:
        return False


def _claimed_device(obj) -> int | None:
    """The CUDA device an array says it lives on (torch: .device.index, cupy: .device.id), if it says."""
    device = getattr(obj, "device", None)
    for name in ("index", "id"):
        value = getattr(device, name, None)
        if isinstance(value, int):
            return value
    return None


class _HostView:
    kind = "host"

    def __init__(self, array):
        self.array, self.pointer, self.length = array, array.ctypes.data, array.size


class _CudaView:
    kind = "cuda"

    def __init__(self, pointer, length, device, owner):
        self.pointer, self.length, self.device, self.owner = pointer, length, device, owner


# --------------------------------------------------------------------------------------- regions


class _RegionState:
    """What the engine's service keeps of a region while transfers use it: its registrations and how many
    transfers may still read it. No reference back to the Engine, so a dropped Engine can be collected."""

    def __init__(self, registrations):
        self.registrations = registrations
        self.in_use = 0  # transfers whose writes may still read the region
        self.closed = False

    def deregister(self) -> None:
        for reg in unique_registrations(self.registrations):
            reg.close()


class Region:
    """Memory registered with every NIC of an engine. ``descriptor()`` is what a peer needs to write here.

    A read-only buffer (bytes, a read-only numpy array) is registered as a source only: it can be
    written from, and has no descriptor, since peers cannot write into it."""

    _ids = itertools.count(1)
    _live: "weakref.WeakValueDictionary[int, Region]" = weakref.WeakValueDictionary()  # ids are process-wide

    def __init__(self, engine: "Engine", obj, staged_host: bool = False):
        kind, pointer, length, device, keep, readonly = _buffer_view(obj)
        if kind == "cuda":
            device = _cuda_device(pointer, length, device)
        view = _HostView(keep[1]) if kind == "host" else _CudaView(pointer, length, device, keep)
        self.engine, self.kind, self.address, self.length = engine, kind, pointer, length
        self.device = device if kind == "cuda" else None
        self.readonly = readonly
        self.id = next(self._ids)
        Region._live[self.id] = self  # a write from memory of this process into it can be checked for overlap
        self._landing_key = secrets.randbits(64)  # a staged target's: in its descriptor, asked for with its lanes
        self._keep = keep
        self.path, self.why = "host" if kind == "host" else "cuda-direct", ""
        access = fi.ACCESS_SOURCE if readonly else fi.ACCESS_ALL  # read-only: a source only
        if staged_host:  # Engine._register_staged_host: a staged target in host memory, for tests
            registrations, self.path, self.why = [], "host-staged", "host memory staged on purpose (tests)"
        else:
            try:
                registrations = engine._service.nics.register(view, access=access, stage=False)
            except memory.DirectUnavailable as exc:
                # no FI_HMEM: the region stays unregistered; its transfers stream through the staging pool
                registrations, self.path, self.why = [], "cuda-staged", str(exc)
        self._state = _RegionState(registrations)
        self.descs = _native.route_descriptors(registrations)
        self._descs = np.asarray(self.descs, dtype=np.uint64)
        self.keys = [r.mr.key for r in registrations]
        self.bases = [r.mr.remote_base for r in registrations]
        service = engine._service
        #: the NIC slots this region's writes leave through: a GPU's own NICs (fabriclab.topology) for GPU
        #: memory registered directly, else every slot (host memory; staged GPU memory leaves from host chunks)
        self.nic_slots = service.groups.slots_of_gpu(self.device if self.path == "cuda-direct" else None)
        self._nic_order = (np.asarray(self.nic_slots, dtype=np.uint16)
                           if len(self.nic_slots) < len(service.nics.slots) else None)

    @property
    def staged(self) -> bool:
        """Whether transfers from this region go through the staging pool (``path == "cuda-staged"``)."""
        return self.path == "cuda-staged"

    @property
    def lands(self) -> bool:
        """Whether peers' writes into this region land in the engine's landing lanes first (staged target)."""
        return self.path in ("cuda-staged", "host-staged")

    @property
    def registrations(self):
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
        if self.lands:
            return self.engine._landing_descriptor(self)
        body = _REGION_MAGIC + struct.pack("<QIQH", self.engine.id, self.id, self.length, len(self.keys))
        body += b"".join(struct.pack("<QQ", b, k) for b, k in zip(self.bases, self.keys))
        return _seal(body)

    def _check_open(self) -> None:
        if self._state.closed:
            raise RegionClosed(f"region {self.id} is closed", buffer_safe=True)

    def close(self, timeout: float | None = None) -> None:
        """Deregister. Transfers still using the region are waited for (up to ``timeout``, default the
        engine's), then failed with RegionClosed; the registration itself stays until no write can touch
        the memory. Closing after the engine closed does nothing (the engine took its registrations)."""
        if self._state.closed:
            return
        timeout = fi.seconds(timeout, "timeout", self.engine.timeout)
        self._state.closed = True
        if self.lands and self.engine._service.landing is not None:
            self.engine._service.landing.remove_region(self.id)  # later pages for it are refused
        self.engine._service.close_region(self._state, timeout)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False

    def __repr__(self) -> str:
        flags = (" read-only" if self.readonly else "") + (" closed" if self.closed else "")
        near = f" through NIC slots {','.join(map(str, self.nic_slots))}" if self._nic_order is not None else ""
        return f"<Region {self.id} {self.path} {self.length} bytes{near}{flags}>"


def _cuda_device(pointer: int, length: int, claimed: int | None) -> int:
    """The device that holds CUDA memory, checked against what its owner says."""
    try:
        device = staging.pointer_device(pointer, length)
    except staging.StagingError as exc:
        raise fi.UsageError(f"cannot register that CUDA memory: {exc}") from None
    if claimed is not None and claimed != device:
        raise fi.UsageError(f"the array says it lives on CUDA device {claimed}, but its memory is on device {device}")
    return device


@dataclass(frozen=True)
class LandingRoute:
    """How to write into a peer's staged target: its landing lanes (a region of their own), a lane's size,
    the largest control message it takes, the region's key (asking for lanes takes it) and the control
    endpoint's address (fabriclab.landing)."""
    lanes: "RemoteRegion"
    lane_bytes: int
    message_bytes: int
    key: int
    address: bytes


# lanes' region id, their length, lane bytes, message bytes, the region's key, address length
_LANDING_TAIL = struct.Struct("<IQIIQH")


@dataclass(frozen=True)
class RemoteRegion:
    engine_id: int
    region_id: int
    length: int
    bases: tuple
    keys: tuple
    landing: LandingRoute | None = None  # a staged target: the bases and keys are its landing lanes'

    @classmethod
    def parse(cls, descriptor) -> "RemoteRegion":
        staged = isinstance(descriptor, (bytes, bytearray, memoryview)) and bytes(descriptor[:4]) == _LANDING_MAGIC
        body = _unseal(descriptor, _LANDING_MAGIC if staged else _REGION_MAGIC, "region descriptor")
        head = struct.calcsize("<QIQH")
        if len(body) < 4 + head:
            raise InvalidDescriptor("region descriptor is truncated")
        engine_id, region_id, length, n = struct.unpack_from("<QIQH", body, 4)
        end = 4 + head + 16 * n
        tail = body[end:]
        if n == 0 or len(body) < end or (tail if not staged else len(tail) < _LANDING_TAIL.size):
            raise InvalidDescriptor("region descriptor is truncated or has a wrong NIC count")
        pairs = [struct.unpack_from("<QQ", body, 4 + head + 16 * i) for i in range(n)]
        bases, keys = tuple(p[0] for p in pairs), tuple(p[1] for p in pairs)
        route = None
        if staged:
            lanes_id, lanes_length, lane_bytes, message_bytes, key, size = _LANDING_TAIL.unpack_from(tail)
            address = tail[_LANDING_TAIL.size:]
            if len(address) != size or not lane_bytes or message_bytes < 64:
                raise InvalidDescriptor("staged region descriptor is truncated or malformed")
            route = LandingRoute(cls(engine_id, lanes_id, lanes_length, bases, keys), lane_bytes, message_bytes,
                                 key, address)
        return cls(engine_id, region_id, length, bases, keys, route)


# ------------------------------------------------------------------------------------------- peers


def coalesce_pages(src: np.ndarray, dst: np.ndarray, most: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Page lists as runs: (first source page, first destination page, pages) of each run of pages that are
    consecutive on both sides, at most ``most`` pages a run. A permuted list stays one page per run."""
    n = src.size
    starts_run = np.ones(n, dtype=bool)
    starts_run[1:] = (np.diff(src) != 1) | (np.diff(dst) != 1)
    starts = np.flatnonzero(starts_run)
    lengths = np.diff(np.append(starts, n))
    pieces = -(-lengths // most)  # runs longer than ``most`` split into pieces of ``most`` (the last shorter)
    run = np.repeat(np.arange(starts.size), pieces)
    within = (np.arange(run.size) - np.repeat(np.cumsum(pieces) - pieces, pieces)) * most
    first = starts[run] + within
    return src[first], dst[first], np.minimum(most, lengths[run] - within).astype(np.uint64)


def _check_region(region) -> None:
    if not isinstance(region, Region):
        raise fi.UsageError(f"the local region must be a Region of this engine (Engine.register), got "
                            f"{type(region).__name__}")


def _refuse_overlap(local: Region, remote: RemoteRegion, src: np.ndarray, dst: np.ndarray, size: int,
                    pages: bool) -> None:
    """Refuse a transfer that reads bytes it also writes: its writes run in no order (RDMA promises none, and a
    run of pages is one copy), so what landed would depend on timing — pages 0..7 onto 1..8 of one region
    landed page 0 in all nine. ``src``, ``dst``: first pages (``pages``) or first bytes of ``size``-byte pieces.
    Only this process's memory can be seen: the peer is this engine (loopback) or another engine here."""
    target = Region._live.get(remote.region_id)
    if target is None or target.engine.id != remote.engine_id or target.kind != local.kind:
        return
    scale = size if pages else 1
    pair = _first_overlap(local.address + src * scale, target.address + dst * scale, size)
    if pair is None:
        return
    i, j = pair
    what = (f"source page {src[i]} and destination page {dst[j]}" if pages else
            f"source bytes [{src[i]}, {src[i] + size}) and destination bytes [{dst[j]}, {dst[j] + size})")
    regions = "one region" if target is local else f"regions {local.id} and {target.id}, which share memory,"
    raise fi.UsageError(f"{what} of {regions} overlap: the writes of a transfer run in no order, so what lands "
                        "would depend on timing. Copy through a second buffer, or split the transfer so that "
                        "none reads a byte another one still in flight writes")


def _parse_address(address) -> tuple[int, list, bytes]:
    """(engine id, per-NIC fi.Address, host identity) of an Engine.address; InvalidDescriptor for anything
    else."""
    body = _unseal(address, _ADDRESS_MAGIC, "engine address")
    if len(body) < 4 + 10:
        raise _bad_address("engine address is truncated: it has no NIC count")
    engine_id, n = struct.unpack_from("<QH", body, 4)
    offset, addresses = 4 + 10, []
    for i in range(n):
        if offset + 2 > len(body):
            raise _bad_address("engine address is truncated")
        size = struct.unpack_from("<H", body, offset)[0]
        raw = body[offset + 2:offset + 2 + size]
        if size == 0 or len(raw) != size:
            raise _bad_address(f"engine address is malformed: NIC entry {i} is {'empty' if size == 0 else 'cut short'}")
        try:
            addresses.append(fi.Address.from_bytes(raw))
        except fi.UsageError as exc:
            raise _bad_address(f"engine address is malformed: NIC entry {i}: {exc}") from None
        offset += 2 + size
    if offset + len(host_identity()) != len(body) or not addresses:
        raise _bad_address("engine address is truncated or malformed")
    return engine_id, addresses, body[offset:]


class Peer:
    """Another engine, reached through every one of our NICs. Writes are striped across them."""

    def __init__(self, engine: "Engine", address):
        engine_id, addresses, host = _parse_address(address)
        if engine_id in _CLOSED_HERE:
            raise _closed_here("the engine at that address", about_buffer=False)
        service = engine._service
        n = len(addresses)
        self.engine, self.id, self.nics = engine, engine_id, n
        #: how writes reach this peer: "the NICs", or shared memory where the provider takes a same-host detour
        self.path = same_host_path(service.nics.provider, host == host_identity())
        # our NIC i talks to the peer's NIC i (modulo its count): the peer's key for it is keys[i % n]
        self.remote_slot = [i % n for i in range(len(service.nics.slots))]
        self.fi_addrs = []
        for slot in service.nics.slots:
            address = addresses[self.remote_slot[slot.index]]
            known = service.av_entries.get((slot.index, address.raw))
            try:
                self.fi_addrs.append(known if known is not None else slot.av.insert(address))
            except fi.UsageError as exc:
                raise _bad_address(f"engine address does not fit this engine: {exc}") from None
            service.av_entries[(slot.index, address.raw)] = self.fi_addrs[-1]
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
            routes = np.empty(len(self.fi_addrs), dtype=_native.ROUTE_DTYPE)
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
        many). A zero-length write is refused (UsageError), as is a negative length: a length computed
        wrong is better noticed than skipped; leave the call out where there is nothing to write.
        Source and destination bytes must not overlap (a write within one region, or between regions that
        share memory): the writes of a transfer run in no order, so a UsageError refuses it where the
        destination is memory of this process; nobody can check it for memory of another."""
        remote = self._remote(remote_descriptor)
        _check_region(local_region)
        src_offset, dst_offset = _integer(src_offset, "src_offset"), _integer(dst_offset, "dst_offset")
        if length is not None and _integer(length, "length") == 0:
            raise fi.UsageError("length=0: a zero-length write moves nothing, and is refused so that a length "
                                "computed wrong is noticed; leave the call out where there is nothing to write")
        length = None if length is None else _integer(length, "length", 1)
        stripe_bytes = _integer(stripe_bytes, "stripe_bytes", 1)
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
        return self.engine._service.submit(self, local_region, remote, src_offset + starts, dst_offset + starts, 1,
                                           lengths, imm, timeout)

    def write_pages(self, local_region: Region, src_pages, remote_descriptor, dst_pages, page_size: int,
                    imm: int | None = None, timeout: float | None = None) -> Transfer:
        """Write page ``src_pages[i]`` of the local region to page ``dst_pages[i]`` of the peer's, striped
        over the NICs, batched and posted lazily by the engine's threads. Runs of pages contiguous on both
        sides go as one write each, of at most 1 MiB and leaving at least one write per NIC
        (``Transfer.writes`` says how many writes it became); with ``imm``, the peer's ``Engine.expect``
        still counts pages: each write carries how many it moves. No source page may overlap a
        destination page (pages moved within one region): see :meth:`write`."""
        remote = self._remote(remote_descriptor)
        _check_region(local_region)
        page_size = _integer(page_size, "page_size", 1)
        src, dst = _pages(src_pages, "local"), _pages(dst_pages, "remote")
        if src.size != dst.size or src.size == 0:
            raise fi.UsageError(f"{src.size} source pages but {dst.size} destination pages")
        for pages, region_length, side in ((src, local_region.length, "local"), (dst, remote.length, "remote")):
            last = region_length // page_size
            if pages.min() < 0 or pages.max() >= last:
                bad = pages[(pages < 0) | (pages >= last)][0]
                raise OutOfRange(f"{side} page {bad} is outside the {last} whole {page_size}-byte pages of the "
                                 f"{side} region")
        _refuse_overlap(local_region, remote, src, dst, page_size, pages=True)
        service = self.engine._service
        # a staged region's writes leave from pool chunks, and land in lanes, one per page: no runs to join
        most = 1 if local_region.staged or remote.landing else service.pages_per_write(src.size, page_size)
        src, dst, runs = coalesce_pages(src, dst, most)
        lengths = runs * np.uint64(page_size)
        if lengths.min() == lengths.max():  # one length for every write (a permuted list: one page each)
            lengths = int(lengths[0])
        return service.submit(self, local_region, remote, src, dst, page_size, lengths, imm, timeout,
                              pages=int(runs.sum()))

    def close(self) -> None:
        """No more writes through this Peer; the peer (or its restarted self) may connect again later.
        Its addresses stay in the address vectors, reused if they come back: removing and re-inserting
        entries is where some providers (shm in libfabric 1.17) lose track of a peer."""
        self.closed = True

    def __repr__(self) -> str:
        return f"<Peer {self.id:#x} over {self.nics} NIC(s) through {self.path}{' closed' if self.closed else ''}>"


# ------------------------------------------------------------------------------------------ engine


class Engine:
    """The transfer engine. See the module docstring for a tour.

    ``provider``/``domains``/``nics`` pick the NICs and ``threads`` the worker threads; left out, they
    suit the host (``fabriclab.nics.default_layout``): every real NIC and a thread per topology group
    (GPU) where there are several NICs; on a provider with one domain (shm, tcp on one interface) a thread
    per spare core (one core left to the caller; at most 8) and an emulated NIC slot per thread. ``nics``
    above the real count adds emulated NICs. The engine's repr and ``stats()`` (its "layout") say what was
    chosen. Each GPU's NICs go to one worker (``fabriclab.nics.group_nics``), pinned to a core
    fabriclab.topology proposes near them (two pinned engines on one host would share those cores: give
    one ``pin=False``);
    ``timeout`` is every transfer's default deadline in seconds; a NIC with writes in flight and no
    completion for ``link_timeout`` seconds (default a third of ``timeout``; 0: never) no longer reaches
    those writes' peers: they go over the other NICs (failover; ``stats()`` names the NIC) and fail with
    PeerLost when no NIC reaches the peer; ``gpu`` (default: when CUDA is here)
    opens the NICs able to register GPU memory (on shm that variant moves host memory more slowly: say
    ``gpu=False`` when you only move host memory).

    GPU memory (torch, cupy, numba, anything with ``__cuda_array_interface__``, CUDA DLPack tensors and
    capsules) is registered directly where the provider offers FI_HMEM (``Region.path == "cuda-direct"``);
    elsewhere transfers from it are staged (``"cuda-staged"``, see ``fabriclab.staging``): copied GPU →
    pinned host memory chunk by chunk on CUDA streams, each chunk written as soon as it is copied.
    ``staging_bytes`` (default 64 MiB) bounds the pinned pool of the engine, allocated at the first staged
    region; ``staging_chunk_bytes`` (default 4 MiB) is one copy's size, and the largest page or stripe a
    staged transfer can carry. A transfer larger than the pool streams through it. A staged region is a
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

    def __init__(self, provider: str | None = None, *, nics: int | None = None, domains=None,
                 threads: int | None = None, pin: bool = True, batch: int = 16, fi_more: bool = False,
                 timeout: float = 30.0, in_flight: int | None = None, gpu: bool | None = None,
                 link_timeout: float | None = None, staging_bytes: int = staging.DEFAULT_STAGING_BYTES,
                 staging_chunk_bytes: int = staging.DEFAULT_CHUNK_BYTES):
        self.timeout = fi.seconds(timeout, "timeout")
        link_timeout = fi.seconds(link_timeout, "link_timeout", self.timeout / 3, zero_means="failover off")
        options = {
            "nics": None if nics is None else _integer(nics, "nics", 1, _native.MAX_NICS),
            "threads": None if threads is None else _integer(threads, "threads", 1, _native.MAX_THREADS),
            "batch": _integer(batch, "batch", 1, _native.MAX_BATCH),
            "in_flight": None if in_flight is None else _integer(in_flight, "in_flight", 1)}
        self.id = secrets.randbits(63) | 1
        chunk = _integer(staging_chunk_bytes, "staging_chunk_bytes", 4096)
        pool = _integer(staging_bytes, "staging_bytes", 1)
        staging.pool_layout(pool, chunk)  # refuse a pool that cannot stream before opening any NIC
        self._service = _Service(provider, domains, pin, bool(fi_more), self.timeout, gpu, link_timeout, **options)
        self._service.staging_sizes = (pool, chunk)
        self._service.engine_id = self.id
        self._pool_region: Region | None = None  # the staging pool, registered at the first staged region
        self._lanes_region: Region | None = None  # the landing lanes, registered at the first staged target
        # the finalizer holds the service, never the engine: a dropped engine is collected, then closed
        self._finalizer = weakref.finalize(self, _Service.close_collected, self._service)

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
    def housekeeping_cores(self) -> frozenset:
        """The cores the workers leave free: run your own busy threads there."""
        return self._service.housekeeping_cores

    @property
    def address(self) -> bytes:
        """This engine's address (every NIC's), for a peer's ``connect``. Checksummed bytes.

        It can change: ``connect`` gives a NIC slot whose endpoint got stuck (writes the provider never
        reported) a fresh endpoint, and this then carries the fresh one's address. Older addresses keep
        working for writes into this engine (the old endpoints stay open until the engine closes)."""
        self._service.check_open()
        slots = self._service.nics.slots
        body = _ADDRESS_MAGIC + struct.pack("<QH", self.id, len(slots))
        for slot in slots:
            raw = slot.ep.address().to_bytes()
            body += struct.pack("<H", len(raw)) + raw
        return _seal(body + host_identity())

    @property
    def nics(self) -> int:
        """How many NIC slots this engine drives (real ones plus emulated ones)."""
        return len(self._service.nics.slots)

    @property
    def emulated_nics(self) -> int:
        """How many of the NIC slots are emulated: extra endpoints sharing a real domain."""
        return self._service.emulated

    def register(self, buffer) -> Region:
        """Register any buffer-protocol object (numpy, bytearray, ...), CUDA array (cupy, torch, numba:
        through ``__cuda_array_interface__``), DLPack tensor or capsule (host or CUDA) with every NIC. A
        read-only buffer can be written from but not into; one whose items hold references to Python objects
        (dtype object, or a structured dtype with such a field) is refused. ``Region.path`` says how: "host",
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

    def _register_staged_host(self, buffer) -> Region:
        """Private, for tests: register host memory as a staged *target* (``path == "host-staged"``), landing
        through the lanes and copied into place with memmove: the protocol of staged GPU targets, run
        where there is no GPU. Not a source of writes."""
        self._service.check_open()
        return Region(self, buffer, staged_host=True)

    def _landing_descriptor(self, region: Region) -> bytes:
        """The descriptor of a staged target: the landing lanes' bases and keys, a lane's size, and the
        control endpoint. Opens the lanes (and the landing thread) at the first staged target."""
        service = self._service
        landing_ = service.start_landing()
        with service.lock:
            if self._lanes_region is None:
                lanes, pool_bytes = landing.max_lanes(*service.staging_sizes)
                pool = staging.PinnedPool(pool_bytes, service.staging_sizes[1], pinned=region.kind == "cuda")
                try:
                    self._lanes_region = Region(self, pool.array)
                except BaseException:
                    pool.close()
                    raise
                landing_.open_lanes(pool)
        landing_.add_region(landing.TargetRegion(region.id, region.kind, region.address, region.length,
                                                 region._state, region._landing_key))
        lanes = self._lanes_region
        body = _LANDING_MAGIC + struct.pack("<QIQH", self.id, region.id, region.length, len(lanes.keys))
        body += b"".join(struct.pack("<QQ", b, k) for b, k in zip(lanes.bases, lanes.keys))
        address = landing_.address
        body += _LANDING_TAIL.pack(lanes.id, lanes.length, landing_.pool.chunk_bytes,
                                   landing_.channel.message_bytes, region._landing_key, len(address)) + address
        return _seal(body)

    def connect(self, address) -> Peer:
        """A peer, from the bytes of its ``Engine.address``. Any time, in any order; no world. Paths to
        peers that had been marked down get another chance (a restarted peer may be behind them), and
        Peers made earlier use them again. A NIC slot whose endpoint has writes the engine gave up on
        that the provider never reported (stuck behind them: shm never completes a write into a region
        its peer closed, nor any write after it on that endpoint) gets a fresh endpoint on the same
        domain, completion queue and address vector, at most MAX_RENEWALS times (not where the provider
        binds registrations to endpoints, FI_MR_ENDPOINT: ``stats()`` says so)."""
        self._service.check_open()
        peer = Peer(self, address)
        self._service.revive_paths()
        return peer

    def expect(self, imm: int, count: int, timeout: float | None = None) -> concurrent.futures.Future:
        """A future that completes when ``count`` pages carrying ``imm`` have landed here (counted, never
        ordered; arrivals before the call count too, and are consumed by it). A page is a page of
        :meth:`Peer.write_pages` (however the writer coalesced them) or a piece of :meth:`Peer.write`. ``imm`` is at most
        MAX_IMM (2**24 - 2), ``count`` at most 2**40 - 1.

        The engine counts at most IMM_VALUES values at once: those awaited, and those holding pages that
        arrived before (or after) their expect() and were not taken yet. A value frees its place once its count
        is taken and no expect() awaits it. Beyond that, expect() raises UsageError; and pages of a value that
        arrive then are not counted: the next expect() of that value raises UsageError saying so, and the engine
        logs a warning (``stats()["immediates"]["lost"]`` counts them)."""
        self._service.check_open()
        imm = _integer(imm, "imm", 0, _native.MAX_IMM)
        count = _integer(count, "count", 1, _native.MAX_IMM_COUNT)
        return self._service.expect(imm, count, fi.seconds(timeout, "timeout", self.timeout))

    def stats(self) -> dict:
        """A snapshot: per-NIC counters (bytes, writes, completions, EAGAINs, CQ polls, errors, arrivals;
        ``"unreported"``: writes given up on that the provider has not reported yet, ``"retried"``: writes
        posted once more after failing right after a revival, ``"renewals"``: fresh endpoints; ``"down"``:
        why paths were last marked down) and what is in flight; "layout": the NIC slots and threads and
        whether defaults chose them, the worker group of each slot; "submitted": transfers, pages asked
        for and the writes they became (contiguous pages coalesced); "immediates": the count behind
        :meth:`expect` (values holding a place now, the most that may, arrivals not counted because it was
        full, values of those not yet reported by an expect(), the last such value). After ``close()``, the last
        snapshot, with ``closed: True``."""
        return self._service.stats()

    def close(self) -> None:
        """Stop the worker threads, fail what is still pending, and close every NIC. A transfer still in
        flight fails with ``buffer_safe=False``: once the engine is gone nobody can tell when its writes
        stop reading the buffer (a shared-memory peer may still copy from it).

        Never blocks for long: a worker thread that has not stopped within WORKER_EXIT_TIMEOUT seconds is
        stuck inside the provider (shm spins for ever on a lock its peer held when it was killed). It is
        left running at idle priority, a warning says so (``stats()["stranded_threads"]`` counts it), and
        the NICs, registrations and staging pool it may still touch stay open until the process exits.

        Engines of this process that wrote to this one (or that it wrote to, with writes left unanswered) keep
        its endpoints open in libfabric, unused, until they close too (fabriclab._inprocess: shm crashes the
        process otherwise); writes and ``connect()`` to it from them are PeerLost from now on."""
        self._finalizer.detach()
        self._service.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False

    def __repr__(self) -> str:
        service = self._service
        state = "closed" if service.closed else f"{self.threads} thread(s)"
        chosen = [k for k in ("nics", "threads") if service.chosen[k] == "default"]
        why = f"; defaults for {' and '.join(chosen)}: {service.layout.why}" if chosen else ""
        return f"<Engine {self.provider} {self.nics} NIC(s) ({self.emulated_nics} emulated), {state}{why}>"


class _Service:
    """Everything an Engine runs: its NICs, the native engine with its worker threads, the reaper thread
    that resolves futures, and the book-keeping they share. It holds no reference to the Engine, so a
    dropped Engine is collected, and its finalizer closes this."""

    def __init__(self, provider, domains, pin, fi_more, timeout, gpu, link_timeout, *, nics, threads, batch,
                 in_flight):
        self.pid = os.getpid()
        self.timeout = timeout
        self.link_timeout = link_timeout
        self.lock = threading.Lock()
        self.closed = False
        self._closed_by_reaper = False
        self.final_stats: dict | None = None
        if gpu is None:
            from . import gpu as cuda
            gpu = cuda.cuda_status() == "ok"
        # Regions that killed shm endpoints left behind hold memory until someone removes them: those of this pid
        # namespace's engines that their owner records prove stale (shmclean), never a region of another.
        reclaimed = shmclean.reclaim_stale_shm_regions()
        if reclaimed:
            logging.getLogger("fabriclab").info(shmclean.describe(reclaimed))
        # With GPUs, ask for FI_HMEM so CUDA arrays can be registered (where the provider offers it).
        memory_kind = "cuda" if gpu else "host"
        self.nics = NicSet(provider, nics, domains, memory_kind)
        try:
            topology = discover_topology(self.nics.provider)
            real = [s.domain_name for s in self.nics.slots if not s.emulated]
            self.layout = default_layout(self.nics.real_nics, topology_groups_holding(real, topology),
                                         len(os.sched_getaffinity(0)))
            wanted = max(self.layout.nics, threads or 0)
            if nics is None and wanted > len(self.nics.slots):  # one domain: emulated slots, one per thread
                self.nics.close()
                self.nics = NicSet(provider, wanted, domains, memory_kind)
        except BaseException:
            self.nics.close()
            raise
        self.provider, self.emulated = self.nics.provider, self.nics.emulated
        try:
            self.native = _native.NativeEngine(self.nics)
            self.transfers = self.native.attach_transfers(TRANSFER_SLOTS)
            self.native.attach_immediates(IMM_VALUES)
            if in_flight is not None:
                self.native.limit_in_flight(in_flight)
            self.threads = threads or min(self.layout.threads, len(self.nics.slots))
            if self.threads > len(self.nics.slots):
                raise fi.UsageError(f"threads must be between 1 and the number of NICs ({len(self.nics.slots)}), "
                                    f"got {self.threads}")
            self.chosen = {"nics": "given" if nics is not None else "default",
                           "threads": "given" if threads is not None else "default",
                           "why": self.layout.why if nics is None or threads is None else "given by the caller"}
            self.groups = group_nics([s.domain_name for s in self.nics.slots], self.threads, topology)
            self.worker_cores = worker_cores(self.threads, self.provider, groups=self.groups) if pin else []
            self.native.start_service(self.threads, batch, fi_more, timeout, link_timeout, self.worker_cores,
                                      list(self.groups.of_slot))
        except BaseException:
            if hasattr(self, "native"):
                self.native.close()  # the C engine's memory (no worker runs: the service did not start)
            self.nics.close()
            raise
        self.av_entries: dict[tuple, int] = {}  # (our NIC slot, peer's raw address) -> fi_addr
        # endpoint renewal (revive_paths): one revival at a time; endpoints replaced stay open until the
        # engine closes (late completions, and peers writing to their addresses)
        self.revive_lock = threading.Lock()
        self.renewals = [0] * len(self.nics.slots)
        self.renewal_notes: dict[int, str] = {}
        self.replaced_endpoints: list[fi.Endpoint] = []
        # A transfer id is free again only once the native engine has reported every write of it finished
        # and none it gave up on still posted: until then the engine may count writes against it.
        self.free_ids = list(range(TRANSFER_SLOTS - 1, -1, -1))
        self.in_use: dict[int, tuple[Transfer, _RegionState, np.ndarray]] = {}
        self.expectations: list[tuple[int, int, concurrent.futures.Future, float]] = []
        self.lost_warned = (0, -LOST_WARNING_S)  # immediate data not counted, as last warned of; when
        self.retired_regions: list[_RegionState] = []
        self.next_deadline = float("inf")  # the earliest deadline the reaper has to look at
        self.max_msg_size = min(s.info.max_msg_size for s in self.nics.slots)
        self.submitted = {"transfers": 0, "pages": 0, "writes": 0}  # pages: as asked; writes: after coalescing
        # Busy workers poll without pause; any other busy thread landing on their cores stalls a NIC.
        self.housekeeping_cores = frozenset(os.sched_getaffinity(0)) - frozenset(self.worker_cores)
        self.stager: staging.Stager | None = None  # started at the first staged region
        self.landing: landing.Landing | None = None  # started at the first staged target, or write into one
        self.engine_id = 0  # the Engine's id (what its peers know it by), set by the Engine
        self.staging_sizes = (staging.DEFAULT_STAGING_BYTES, staging.DEFAULT_CHUNK_BYTES)
        self.reaper = threading.Thread(target=self._reap, name="fabriclab-engine-reaper", daemon=True)
        self.reaper.start()

    # ------------------------------------------------------------------------------ for the Engine

    def layout_summary(self) -> dict:
        """What the engine drives and why: NIC slots and threads, each ``"default"`` (nics.default_layout
        chose it for this host) or ``"given"``; the worker group of every slot (nics.group_nics)."""
        return {**self.chosen, "groups": list(self.groups.of_slot)}

    def check_open(self) -> None:
        if self.pid != os.getpid():
            raise fi.UsageError(f"this Engine was created in process {self.pid}, before fork(); its threads and "
                                "NICs stayed with that process: create a new Engine in this one")
        if self.closed:
            raise fi.UsageError("the engine is closed")

    def revive_paths(self) -> None:
        """Every worker forgets the paths it had marked dead; first, NIC slots whose endpoint has writes the
        engine gave up on that the provider never reported get a fresh endpoint, which each worker swaps in
        itself (fl_service_revive: never under a thread that posts)."""
        native = self.native
        with self.revive_lock:
            stuck: dict[int, list[tuple[NicSlot, int]]] = {}  # by worker
            for slot in self.nics.slots:
                unreported = native.unreported_writes(slot.index)
                if not unreported:
                    self.renewal_notes.pop(slot.index, None)
                elif not native.renewal_waiting(slot.index):
                    why = self._renewal_refused(slot)
                    if why:
                        self._note_stuck(slot, unreported, why)
                    else:
                        stuck.setdefault(self.groups.of_slot[slot.index], []).append((slot, unreported))
            for slots in stuck.values():
                # The slot's worker keeps off its NICs meanwhile: a provider may progress an endpoint bound to
                # a CQ as soon as it is bound (shm does, and crashes on one not enabled yet).
                if not native.park_worker(slots[0][0].index, min(self.timeout, 5.0)):
                    for slot, unreported in slots:
                        self._note_stuck(slot, unreported, "its worker thread could not be paused to renew it")
                    continue
                try:
                    for slot, unreported in slots:
                        self._renew(slot, unreported)
                finally:
                    native.unpark_worker(slots[0][0].index)
            native.revive()

    def _renewal_refused(self, slot: NicSlot) -> str | None:
        if slot.info.mr_endpoint:
            return ("the provider binds registrations to endpoints (FI_MR_ENDPOINT), so a fresh endpoint could not "
                    "use the regions")
        if self.renewals[slot.index] >= MAX_RENEWALS:
            return f"this slot had {MAX_RENEWALS} fresh endpoints already (a peer that keeps stalling them?)"
        return None

    def _note_stuck(self, slot: NicSlot, unreported: int, why: str) -> None:
        self.renewal_notes[slot.index] = (f"endpoint not renewed although {unreported} write(s) given up on were "
                                          f"never reported on it: {why}")

    def _renew(self, slot: NicSlot, unreported: int) -> None:
        """Open a fresh endpoint for ``slot`` on its domain, bound to its CQ and AV (fi_addrs stay valid, and
        the old endpoint's late completions still arrive), and hand it to the slot's worker, which swaps it in
        at the revival. The worker must be parked."""
        try:
            endpoint = fi.Endpoint(self.nics.domains[slot.domain_name], slot.cq, slot.av)
        except (fi.FabricError, fi.UsageError) as exc:
            self._note_stuck(slot, unreported, f"a fresh endpoint could not be opened ({exc})")
            return
        if not self.native.renew_nic(slot.index, endpoint):
            endpoint.close()  # one is already waiting for the worker
            return
        self.replaced_endpoints.append(slot.ep)
        slot.ep = endpoint  # Engine.address now carries the fresh endpoint's
        self.renewals[slot.index] += 1
        self.renewal_notes.pop(slot.index, None)

    def expect(self, imm: int, count: int, timeout: float) -> concurrent.futures.Future:
        future = _AwaitableFuture()
        deadline = time.monotonic() + timeout
        with self.lock:  # the native engine is freed under it, once closed
            self.check_open()
            status = self.native.await_immediates(imm, report_lost=True)
            if status == _native.IMM_OK:
                self.expectations.append((imm, count, future, deadline))
                self.next_deadline = min(self.next_deadline, deadline)
        if status != _native.IMM_OK:
            usage = self.native.immediates_usage()
            if status == _native.IMM_LOST:
                raise fi.UsageError(
                    f"pages carrying imm {imm} arrived while this engine already counted the most immediate values "
                    f"it counts at once ({usage['most']}, each awaited by an expect() or holding pages nobody took): "
                    f"they were not counted, so expect({imm}, {count}) could never complete. expect() every value "
                    "peers write into this engine (taking a value's count frees its place)")
            raise fi.UsageError(
                f"expect({imm}, {count}) cannot be counted: this engine counts at most {usage['most']} immediate "
                f"values at once, and {usage['values']} are awaited by an expect() or hold pages that arrived and "
                "were never taken. expect() the values peers write (taking a value's count frees its place), or "
                "wait for some expectations to finish before adding more")
        self.native.watch_immediates(True)
        self.native.wake()
        return future

    def stats(self) -> dict:
        if self.final_stats is not None:
            return self.final_stats
        self.check_open()
        with self.lock:
            pending = sum(not t.done() for t, _, _ in self.in_use.values())
            unsafe = len(self.in_use) - pending
            expecting = len(self.expectations)
        per_nic = self.native.counters()
        for entry in per_nic:
            note = self.renewal_notes.get(entry["nic"])
            if note:
                entry["down"] = f"{entry['down']}; {note}" if entry["down"] else note
        return {"provider": self.provider, "nics": len(self.nics.slots), "emulated_nics": self.emulated,
                "threads": self.threads, "layout": self.layout_summary(), "submitted": dict(self.submitted),
                "transfers_in_flight": pending, "abandoned_in_flight": unsafe,
                "expectations": expecting, "immediates": self.native.immediates_usage(), "per_nic": per_nic,
                "staging": self._staging_stats(), "closed": False, "stranded_threads": 0}

    def _staging_stats(self) -> dict:
        """The staging pool and the landing lanes: their sizes, and what went through them (zeros until a
        region is staged, or a staged target written into)."""
        if self.stager is not None:
            stats = self.stager.stats()
        else:
            _, pool = staging.pool_layout(*self.staging_sizes)
            stats = {"pool_bytes": pool, "chunk_bytes": self.staging_sizes[1], "allocated": False,
                     "staged_bytes": 0, "staged_chunks": 0, "copy_seconds": 0.0, "jobs_waiting": 0}
        lanes, pool = landing.max_lanes(*self.staging_sizes)
        landed = self.landing.stats() if self.landing is not None else {
            "landed_bytes": 0, "landed_lanes": 0, "landing_copy_seconds": 0.0, "landing_jobs": 0,
            "bad_control_messages": 0, "control_threads_stranded": 0}
        return {**stats, "landing_pool_bytes": pool, "lanes": lanes,
                "landing_allocated": self.landing is not None and self.landing.pool is not None, **landed}

    def pages_per_write(self, pages: int, page_size: int) -> int:
        """The most pages one write of a transfer of ``pages`` pages may carry: enough writes that every
        NIC slot gets one (a transfer of a few large writes would leave NICs idle), none above
        DEFAULT_STRIPE bytes (at 1 MiB a write's posting cost is already small next to its copy or wire
        time, and Peer.write stripes at the same size), nor the provider's max_msg_size, nor what the
        immediate data can count (MAX_PAGES_PER_WRITE)."""
        every_nic = pages // len(self.nics.slots)
        largest = min(DEFAULT_STRIPE, self.max_msg_size) // page_size
        return max(1, min(every_nic, largest, _native.MAX_PAGES_PER_WRITE))

    def submit(self, peer: Peer, region: Region, remote: RemoteRegion, src, dst, stride: int, lengths, imm,
               timeout, pages: int | None = None) -> Transfer:
        """Hand one request to the native engine (it builds the writes and stripes them over the NICs) and
        track its future. Write i moves lengths[i] (or ``lengths`` bytes) from src[i] * stride of the
        region to dst[i] * stride of the peer's."""
        self.check_open()
        region._check_open()
        if peer.closed:
            raise fi.UsageError("that peer was closed; connect again")
        if peer.id in _CLOSED_HERE:
            raise _closed_here("the peer engine")
        if region.engine._service is not self:
            raise fi.UsageError("that region was registered with another engine")
        imm = _native.NO_IMM if imm is None else _integer(imm, "imm", 0, _native.MAX_IMM)
        timeout = fi.seconds(timeout, "timeout", self.timeout)
        if region.path == "host-staged":
            raise fi.UsageError(f"region {region.id} is host memory staged on purpose (a test switch): a target only")
        if remote.landing is not None:
            return self._submit_landing(peer, region, remote, src, dst, stride, lengths, imm, timeout)
        if region.staged:
            return self._submit_staged(peer, region, remote, src, dst, stride, lengths, imm, timeout)
        return self._post(peer, region, remote, src, dst, stride, lengths, imm, timeout, pages)

    def _post(self, peer: Peer, region: Region, remote: RemoteRegion, src, dst, stride: int, lengths, imm: int,
              timeout: float, pages: int | None = None) -> Transfer:
        """:meth:`submit` of a region registered with the NICs, its input checked: ``imm`` as it goes on the
        wire (NO_IMM, a caller's value, or a landing lane's)."""
        n = src.size
        uniform = np.isscalar(lengths)
        nbytes = n * lengths if uniform else int(lengths.sum())
        deadline = time.monotonic() + timeout
        transfer = Transfer(n, nbytes, deadline, _Safety(self.timeout), pages)
        routes = peer._routes_to(region, remote)
        # Every write carries immediate data (a reserved value when the caller gave none), so the peer's
        # worker threads see traffic arrive and keep polling: software providers need the target to poll.
        request = self.native.request(routes, region.address, src, dst, stride, lengths, imm, peer._next_nic,
                                      pages_in_imm=pages is not None, nic_order=region._nic_order)
        peer._next_nic = (peer._next_nic + n) % len(peer.fi_addrs)
        state = region._state
        fields = _native.TRANSFER_FIELDS
        with self.lock:
            if not self.free_ids:
                raise TransferError("too many transfers in flight", buffer_safe=True)
            tid = self.free_ids.pop()
            self.transfers[fields * tid:fields * (tid + 1)] = (n, 0, 0)
            self.in_use[tid] = (transfer, state, routes)
            state.in_use += 1
            self.submitted["transfers"] += 1
            self.submitted["pages"] += transfer.pages
            self.submitted["writes"] += n
            if deadline < self.next_deadline:
                self.next_deadline = deadline
                self.native.wake()
        taken = 0
        while taken < n:
            with self.lock:  # close() frees the native engine under this lock, once it is closed
                if not self.closed:
                    taken += self.native.submit(request, tid, taken)
            if taken < n:
                if time.monotonic() > deadline or self.closed or self.native.stopping:
                    why = "the engine was closed" if self.closed else "the engine's queues stayed full"
                    failure = TransferTimeout(f"{why}; {n - taken} of {n} writes not queued",
                                              buffer_safe=taken == 0, safety=transfer._safety)
                    with self.lock:
                        if not self.closed:
                            # writes never handed over will never complete: the engine counts them as finished
                            self.native.release_writes(tid, n - taken)
                    if not transfer.done():  # close() may have failed it already
                        transfer.set_exception(failure)
                    raise failure
                time.sleep(0.0002)
        return transfer

    def start_staging(self) -> staging.PinnedPool:
        """The staging pool and its thread (at the first staged region); the Engine registers the pool."""
        if self.stager is None:
            pool = staging.PinnedPool(*self.staging_sizes)
            self.stager = staging.Stager(pool, _staging_failure)
        return self.stager.pool

    def _submit_staged(self, peer: Peer, region: Region, remote: RemoteRegion, src, dst, stride: int, lengths, imm,
                       timeout: float) -> Transfer:
        """A transfer from a staged region: the stager copies it into the pool chunk by chunk and hands each
        chunk's writes (one per write asked for, from the pool) to :meth:`submit`."""
        try:
            staging.pointer_device(region.address, region.length)
        except staging.StagingError as exc:
            raise StagingFailed(f"region {region.id} cannot be staged: {exc}", buffer_safe=True) from None
        n = src.size
        lengths = np.full(n, lengths, dtype=np.uint64) if np.isscalar(lengths) else np.asarray(lengths, np.uint64)
        self.stager.check_fits(int(lengths.max()))
        deadline = time.monotonic() + timeout
        transfer = Transfer(n, int(lengths.sum()), deadline, _Safety(self.timeout))
        pool_region, state = region.engine._pool_region, region._state
        with self.lock:
            state.in_use += 1

        def send(pool_src, pool_dst, pool_lengths):
            self.check_open()
            return self._post(peer, pool_region, remote, pool_src, pool_dst, 1, pool_lengths, imm,
                              max(deadline - time.monotonic(), 1e-3))

        def done(error, safe):
            with self.lock:
                state.in_use -= 1
            if error is None:
                transfer.set_result(TransferResult(transfer.bytes, transfer.writes,
                                                   time.perf_counter() - transfer.started))
            elif not transfer.done():
                transfer.set_exception(_as_the_callers(error, safe, transfer._safety))
            transfer._safety.settle(safe)

        self.stager.submit(staging.StagedJob(region.address, region.length, region.device,
                                             src.astype(np.int64) * stride, dst.astype(np.int64) * stride, lengths,
                                             deadline, send, done, lambda: not state.closed))
        return transfer

    def start_landing(self) -> landing.Landing:
        """The landing thread and its control channel (at the first staged target, or the first write into a
        peer's)."""
        with self.lock:
            if self.landing is None:
                self.check_open()
                slot = self.nics.slots[0]
                self.landing = landing.Landing(self.provider, slot.domain_name, self.engine_id, self.native,
                                               _staging_failure, lease_s=self.timeout)
            return self.landing

    def _submit_landing(self, peer: Peer, region: Region, remote: RemoteRegion, src, dst, stride: int, lengths,
                        imm: int, timeout: float) -> Transfer:
        """A transfer into a peer's staged target: the landing thread gets lanes from the target, writes
        each lane's pages into them (from the region, or through the staging pool when the region is staged
        itself) and resolves the transfer once the target says every page is in place."""
        route = remote.landing
        n = src.size
        lengths = np.full(n, lengths, dtype=np.uint64) if np.isscalar(lengths) else np.asarray(lengths, np.uint64)
        largest = int(lengths.max())
        if largest > route.lane_bytes:
            raise fi.UsageError(f"a write of {largest} bytes does not fit the target's landing lanes of "
                                f"{route.lane_bytes} bytes: use smaller pages or stripe_bytes, or give the target "
                                "a larger Engine(staging_chunk_bytes=...)")
        if region.staged:
            self.stager.check_fits(largest)
            try:
                staging.pointer_device(region.address, region.length)
            except staging.StagingError as exc:
                raise StagingFailed(f"region {region.id} cannot be staged: {exc}", buffer_safe=True) from None
        lander = self.start_landing()
        message_bytes = min(route.message_bytes, lander.channel.message_bytes)
        max_pages = (message_bytes - control.FILLED_HEAD) // control.PAGE_ENTRY.size
        deadline = time.monotonic() + timeout
        transfer = Transfer(n, int(lengths.sum()), deadline, _Safety(self.timeout), pages=n)
        state = region._state
        with self.lock:
            state.in_use += 1
            self.submitted["transfers"] += 1
            self.submitted["pages"] += n
            self.submitted["writes"] += n

        def post(src_bytes, lane_offsets, lane_lengths, lane_imm, left):
            self.check_open()
            if region.staged:
                return self._submit_staged(peer, region, route.lanes, src_bytes, lane_offsets, 1, lane_lengths,
                                           lane_imm, left)
            return self._post(peer, region, route.lanes, src_bytes, lane_offsets, 1, lane_lengths, lane_imm, left)

        def done(error, safe):
            with self.lock:
                state.in_use -= 1
            if error is None:
                transfer.set_result(TransferResult(transfer.bytes, n, time.perf_counter() - transfer.started,
                                                   pages=n))
            elif not transfer.done():
                transfer.set_exception(_as_the_callers(error, safe, transfer._safety))
            if safe:
                transfer._safety.settle(True)

        lander.submit(landing.LandingJob(route.address, remote.region_id, route.lane_bytes, max_pages,
                                         src.astype(np.int64) * stride, dst.astype(np.int64) * stride, lengths, imm,
                                         deadline, post, done, transfer._safety.settle, region_key=route.key,
                                         target_id=remote.engine_id,
                                         lanes=route.lanes.length // route.lane_bytes))
        return transfer

    def close_region(self, state: _RegionState, timeout: float) -> None:
        if self.pid != os.getpid():
            return  # the registrations belong to the parent of a fork
        deadline = time.monotonic() + timeout
        while state.in_use > 0 and time.monotonic() < deadline and not self.closed:
            time.sleep(0.001)
        if self.closed:
            return  # closing the engine deregistered everything
        with self.lock:
            self.retired_regions.append(state)
            self.next_deadline = 0.0  # the reaper fails what is left with RegionClosed
        self.native.wake()

    @staticmethod
    def close_collected(service: "_Service") -> None:
        """The Engine was collected (or the interpreter exits): close its service. Collection happens on
        whatever thread allocates at that moment, so the close (joining threads, closing NICs) goes to a
        thread of its own: a Ctrl-C meant for that thread must not land in a long finalizer, where Python
        drops it. At exit (the main thread already stopped) it closes here and now."""
        if threading.main_thread().is_alive():
            threading.Thread(target=service.close, name="fabriclab-engine-closer", daemon=True).start()
        else:
            service.close()

    def close(self) -> None:
        """Stop everything (``Engine.close()``, or the Engine's collection or the interpreter's exit)."""
        if self.closed:
            return
        self.closed = True
        if self.pid != os.getpid():
            return  # after fork(): the threads, NICs and shared memory are the parent's, not ours to close
        _CLOSED_HERE.add(self.engine_id)
        if threading.current_thread() is self.reaper:  # collected on the reaper thread: it finishes the job
            self._closed_by_reaper = True
            return
        self.native.wake()
        self.reaper.join(5)
        self._shut_down()

    # ------------------------------------------------------------------------------------ internals

    def _shut_down(self) -> None:
        if self.landing is not None:
            self.landing.close()  # fails writers' jobs; copies into staged targets are waited for
        if self.stager is not None:
            self.stager.close()  # fails what it had not handed over; its chunks' writes are failed below
        stranded = self.native.stop_service(WORKER_EXIT_TIMEOUT)
        if not stranded:
            # their endpoints' regions need not outlive them for the engines of this process they wrote to
            for index in self.native.idle_nics():
                self.nics.slots[index].ep.declare_idle()
        self.final_stats = {**self._snapshot_after_stop(), "closed": True, "stranded_threads": stranded}
        fields = _native.TRANSFER_FIELDS
        with self.lock:
            # a stuck worker may still read these transfers' buffers and routes: they stay alive with us
            unfinished = list(self.in_use.values())
            for tid, (transfer, state, _) in self.in_use.items():
                left, _, abandoned = (int(x) for x in self.transfers[fields * tid:fields * (tid + 1)])
                safe = left <= 0 and abandoned <= 0
                if not transfer.done():
                    transfer.set_exception(TransferError(f"the engine was closed with {left} of {transfer.writes} "
                                                         "writes of the transfer unfinished", buffer_safe=safe,
                                                         safety=transfer._safety))
                transfer._safety.settle(safe)
            self.in_use.clear()
            for _, _, future, _ in self.expectations:
                if not future.done():
                    future.set_exception(TransferError("the engine was closed", buffer_safe=True, about_buffer=False))
            self.expectations.clear()
            self.retired_regions.clear()
            # the reaper calls into the native engine too: one that did not stop (this is not it) keeps it alive
            reaper_running = self.reaper.is_alive() and threading.current_thread() is not self.reaper
            left = max(stranded, 1) if reaper_running else self.native.close()
        if left:
            self.stranded = (unfinished, self.stager)
            _STRANDED_SERVICES.append(self)
            self.nics.keep_open()
            logging.getLogger("fabriclab").warning(
                "the engine closed with %d thread(s) that did not stop within %g s (stuck inside the %s provider: "
                "shm spins for ever on a lock its peer held when it was killed): its NICs, registrations and "
                "staging memory stay open until this process exits", left, WORKER_EXIT_TIMEOUT, self.provider)
            return
        self.nics.close()
        if self.stager is not None:
            self.stager.pool.close()  # no NIC has it registered any more
        if self.landing is not None and self.landing.pool is not None:
            self.landing.pool.close()

    def _snapshot_after_stop(self) -> dict:
        return {"provider": self.provider, "nics": len(self.nics.slots), "emulated_nics": self.emulated,
                "threads": self.threads, "layout": self.layout_summary(), "submitted": dict(self.submitted),
                "transfers_in_flight": 0, "abandoned_in_flight": 0, "expectations": 0,
                "immediates": self.native.immediates_usage(), "per_nic": self.native.counters(),
                "staging": self._staging_stats()}

    def _reap(self) -> None:
        """Resolve futures as the native engine reports transfers finished (it wakes this thread, which
        waits without the GIL); enforce deadlines; count expected immediate data. Whatever goes wrong in
        one item fails that item's future: the thread itself never dies while the engine is open."""
        if self.worker_cores and self.housekeeping_cores:
            os.sched_setaffinity(0, self.housekeeping_cores)  # this thread only
        while not self.closed:
            try:
                with self.lock:
                    busy = self.in_use or self.expectations
                    wait = min(max(self.next_deadline - time.monotonic(), 0.0), 0.05) if busy else 0.05
                for tid in self.native.wait(wait):
                    self._guarded(self._settle, tid)
                now = time.monotonic()
                with self.lock:
                    rescan = now >= self.next_deadline
                    expectations = list(self.expectations)
                if rescan:
                    self._expire(now)
                for item in expectations:
                    self._guarded(self._check_expectation, item, now)
                self._retire_regions()
                self._warn_of_lost_counts(now)
            except Exception:  # a bug of ours: keep serving the other transfers, and say so
                logging.getLogger("fabriclab").exception("the engine's reaper hit an error; it goes on")
                time.sleep(0.01)
        if self._closed_by_reaper:
            self._shut_down()

    def _guarded(self, work, item, *args) -> None:
        """Run one item's work; if it fails, fail that item's future with the reason."""
        try:
            work(item, *args)
        except Exception as exc:
            expectation = isinstance(item, tuple)  # an expect(): it reads no buffer
            future = item[2] if expectation else self.in_use.get(item, (None,))[0]
            logging.getLogger("fabriclab").exception("the engine failed to account for a transfer")
            if future is not None and not future.done():
                future.set_exception(TransferError(f"the engine failed to account for this "
                                                   f"{'expectation' if expectation else 'transfer'}: {exc!r}",
                                                   buffer_safe=expectation, about_buffer=not expectation))

    def _counters(self, tid: int) -> tuple[int, int, int]:
        """(writes left, first error, abandoned writes still posted) of transfer id ``tid``."""
        fields = _native.TRANSFER_FIELDS
        left, error, abandoned = self.transfers[fields * tid:fields * (tid + 1)]
        return int(left), int(error), int(abandoned)

    def _settle(self, tid: int) -> None:
        """The engine reported transfer ``tid``: resolve its future once every write finished; free the id
        once, in addition, no write it gave up on is still posted (then the buffer is safe)."""
        with self.lock:
            entry = self.in_use.get(tid)
        if entry is None:
            return  # reported twice; already settled
        transfer, state, _ = entry
        left, error, abandoned = self._counters(tid)
        if left > 0:
            return
        if not transfer.done():
            self._resolve(transfer, state, error, safe=abandoned == 0)
        if abandoned == 0:
            with self.lock:
                self.in_use.pop(tid, None)
                state.in_use -= 1
                self.free_ids.append(tid)
            transfer._safety.settle(True)

    def _check_expectation(self, item, now: float) -> None:
        imm, count, future, deadline = item
        done = self.native.take_immediates(imm, count)
        if done or now > deadline or future.cancelled():
            with self.lock:
                if item not in self.expectations:
                    return  # already ended
                self.expectations.remove(item)
                if not self.expectations:
                    self.native.watch_immediates(False)
            self.native.release_immediates(imm)  # its value's place goes back once nothing else holds it
            if done:
                future.set_result(count)
            elif not future.cancelled():
                future.set_exception(TransferTimeout(f"{count} writes carrying imm {imm} did not all arrive in time",
                                                     buffer_safe=True, about_buffer=False))

    def _warn_of_lost_counts(self, now: float) -> None:
        """Say so when pages arrived that could not be counted (at most every LOST_WARNING_S seconds)."""
        if now < self.lost_warned[1] + LOST_WARNING_S:
            return
        usage = self.native.immediates_usage()
        if usage["lost"] > self.lost_warned[0]:
            logging.getLogger("fabriclab").warning(
                "%d arrival(s) of immediate data could not be counted (the last carried imm %d): this engine "
                "already counted the most values it counts at once (%d), each awaited by an expect() or holding "
                "pages nobody took. expect() of such a value raises UsageError; expect() every value peers write",
                usage["lost"] - self.lost_warned[0], usage["last_lost"], usage["most"])
            self.lost_warned = (usage["lost"], now)

    def _expire(self, now: float) -> None:
        """Fail pending transfers whose deadline passed or whose region was closed; their ids stay in use
        until the engine reports every write finished and none still posted."""
        with self.lock:
            pending = [(tid, entry) for tid, entry in self.in_use.items() if not entry[0].done()]
            expectations = [x[3] for x in self.expectations]
        earliest = float("inf")
        for tid, (transfer, state, _) in pending:
            if now > transfer.deadline or state.closed:
                left, error, abandoned = self._counters(tid)
                self._resolve(transfer, state, error, safe=left <= 0 and abandoned <= 0, expired=True, left=left)
            else:
                earliest = min(earliest, transfer.deadline)
        with self.lock:
            self.next_deadline = min([earliest, *expectations])

    def _resolve(self, transfer: Transfer, state: _RegionState, error: int, safe: bool, expired: bool = False,
                 left: int = 0) -> None:
        if transfer.done():
            return
        safety = transfer._safety
        if error:
            code = -error
            text = f"{errno.errorcode.get(code, code)}: {os.strerror(code) if code < 4096 else ''}".strip(": ")
            if code == errno.ETIMEDOUT and self.link_timeout > 0:  # the engine's own: a path stalled
                failure = PeerLost(f"no NIC reaches the peer any more: a write to it got no completion for "
                                   f"{self.link_timeout:g} s and no error, and no other path was left. The peer "
                                   "may well be alive: some providers (shm) never complete a write the peer cannot "
                                   "take (into a region it closed, with a stale descriptor) and stall the path "
                                   "behind it; else the peer is stopped or gone, or every link to it is down. "
                                   "Engine.connect() to it again revives the paths (and renews stuck endpoints)",
                                   buffer_safe=safe, safety=safety)
            elif code == errno.EHOSTUNREACH:
                failure = PeerLost("no NIC reaches the peer any more: every path to it failed with an error or "
                                   "had been marked down (the peer process may be gone, a link down, or the peer "
                                   "dropped the connection over a write it could not take — tcp drops it for a "
                                   "write into a closed region). Engine.connect() to it again revives the paths",
                                   buffer_safe=safe, safety=safety)
            elif code == errno.ENOSPC:
                failure = WriteRejected("the peer's endpoint takes writes from no more senders (ENOSPC): it already "
                                        "hears as many sending endpoints as its provider allows (sim: 256 sending "
                                        "endpoints, docs/model.md). Fewer writers into one peer, or close the ones "
                                        "that are done", buffer_safe=safe, safety=safety)
            elif code in _PEER_GONE:
                failure = PeerLost(f"the peer is gone: a write of the transfer failed with {text}", buffer_safe=safe,
                                   safety=safety)
            else:
                failure = WriteRejected(f"the provider refused a write of the transfer ({text}): check the "
                                        "descriptor and the range; the peer itself may be fine", buffer_safe=safe,
                                        safety=safety)
            transfer.set_exception(failure)
        elif expired and state.closed:
            transfer.set_exception(RegionClosed("the region was closed while the transfer used it", buffer_safe=safe,
                                                safety=safety))
        elif expired:
            transfer.set_exception(TransferTimeout(f"{left} of {transfer.writes} writes had not completed by the "
                                                   "deadline (peer gone or stalled?)", buffer_safe=safe, safety=safety))
        else:
            transfer.set_result(TransferResult(transfer.bytes, transfer.writes, time.perf_counter() - transfer.started,
                                               pages=transfer.pages))

    def _retire_regions(self) -> None:
        """Deregister closed regions once no write can still touch them."""
        with self.lock:
            ready = [r for r in self.retired_regions if r.in_use <= 0]
            self.retired_regions = [r for r in self.retired_regions if r.in_use > 0]
        for state in ready:
            state.deregister()
