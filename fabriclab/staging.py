"""GPU memory for ``fabriclab.Engine`` where the provider cannot register it (no FI_HMEM): the staged path.

A source region in GPU memory is never registered with the NICs. Each transfer from it streams through a
bounded pool of pinned host memory, cut into chunks: the stager thread copies a chunk's pages GPU → pinned
host on a CUDA stream, and the moment that copy's event fires it hands the chunk's writes to the engine,
while the next chunks are still being copied and earlier ones are still on the wire. A chunk goes back to
the pool once the provider has reported every write of it, so a transfer larger than the pool streams
through it. Each write of the caller becomes exactly one write on the wire (same destination, same
immediate data), so the peer's ``expect`` counts do not change.

Where the provider does offer FI_HMEM, GPU memory is registered as it is ("cuda-direct") and none of this
runs. The CUDA calls go through cuda-python's driver bindings (``fabriclab.gpu``).
"""
from __future__ import annotations

import collections
import ctypes
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from . import fi, gpu, memory
from ._native import WORKER_EXIT_TIMEOUT

if TYPE_CHECKING:
    from .transfer import Transfer

DEFAULT_STAGING_BYTES = 64 << 20  # the pinned pool of one engine: what staged writes may hold at once
DEFAULT_CHUNK_BYTES = 4 << 20     # one copy + one batch of writes; the pool holds pool // chunk of them
COPY_STREAMS = 4                  # chunks copied concurrently (one CUDA stream each, round robin)
FAILURES = ("cuda", "timeout", "closed", "engine")  # why a staged transfer failed, as Stager reports it

_CU_POINTER_ATTRIBUTE_CONTEXT = 1
_CU_POINTER_ATTRIBUTE_RANGE_START_ADDR = 11
_CU_POINTER_ATTRIBUTE_RANGE_SIZE = 12
_CU_MEMHOSTALLOC_PORTABLE = 1
_KDL_CUDA, _KDL_CUDA_HOST, _KDL_CUDA_MANAGED = 2, 3, 13


StagingError = gpu.CudaError  # a CUDA call of the staged path failed, or the GPU memory it copies is gone
_TIMER_SLACK_NS = 5000  # of a polling thread (stager, landing): Linux's default (50 us) would double short naps


def quick_timers() -> None:
    """The calling thread's timers (its sleeps and timed waits) fire within _TIMER_SLACK_NS of their time, on
    Linux; elsewhere nothing changes. For the threads that poll copies and control messages between naps."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(29, _TIMER_SLACK_NS, 0, 0, 0)  # PR_SET_TIMERSLACK, this thread
    except (OSError, AttributeError):
        pass


# ----------------------------------------------------------------------------------- CUDA memory


def pointer_device(pointer: int, length: int) -> int:
    """The CUDA device holding ``[pointer, pointer + length)``; StagingError if that is not live device
    memory (never allocated, freed by its owner, or shorter than ``length``)."""
    driver = gpu.require_cuda()
    attr = driver.CUpointer_attribute
    # the device through the allocation's context: cuda-python 13's DEVICE_ORDINAL attribute said 0 for memory
    # of GPU 1 (two-GPU machine, driver 13.0)
    err, context = driver.cuPointerGetAttribute(attr(_CU_POINTER_ATTRIBUTE_CONTEXT), pointer)
    if int(err) != 0:
        raise StagingError(f"{pointer:#x} is not live CUDA memory (freed by its owner?): CUDA error {int(err)} "
                           f"({gpu.error_name(err)})")
    gpu.check(driver.cuCtxPushCurrent(context), "cuCtxPushCurrent")
    try:
        device = gpu.check(driver.cuCtxGetDevice(), "cuCtxGetDevice")
    finally:
        driver.cuCtxPopCurrent()
    start = int(gpu.check(driver.cuPointerGetAttribute(attr(_CU_POINTER_ATTRIBUTE_RANGE_START_ADDR), pointer),
                       "cuPointerGetAttribute(range start)"))
    size = int(gpu.check(driver.cuPointerGetAttribute(attr(_CU_POINTER_ATTRIBUTE_RANGE_SIZE), pointer),
                      "cuPointerGetAttribute(range size)"))
    if pointer + length > start + size:
        raise StagingError(f"the CUDA allocation at {pointer:#x} holds {start + size - pointer} bytes from there, "
                           f"not {length} (freed and reallocated by its owner?)")
    return int(device)


class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class _DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _DLTensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("device", _DLDevice), ("ndim", ctypes.c_int32),
                ("dtype", _DLDataType), ("shape", ctypes.POINTER(ctypes.c_int64)),
                ("strides", ctypes.POINTER(ctypes.c_int64)), ("byte_offset", ctypes.c_uint64)]


def dlpack_cuda(obj: Any) -> tuple[int, int, int, Any] | None:
    """(pointer, length, device, keepalive) of a CUDA DLPack tensor or capsule; None when it lives on the
    host (numpy reads those). The capsule is kept, never consumed: its owner still frees the memory."""
    capsule = obj
    if hasattr(obj, "__dlpack__"):
        kind, _ = obj.__dlpack_device__() if hasattr(obj, "__dlpack_device__") else (None, None)
        if kind is not None and int(kind) not in (_KDL_CUDA, _KDL_CUDA_MANAGED):
            if int(kind) in (1, _KDL_CUDA_HOST):
                return None
            raise fi.UsageError(f"cannot register a DLPack tensor on device type {int(kind)}: only host and CUDA "
                                "memory can be registered")
        capsule = obj.__dlpack__()
    get = ctypes.pythonapi.PyCapsule_GetPointer
    get.restype, get.argtypes = ctypes.c_void_p, [ctypes.py_object, ctypes.c_char_p]
    valid = ctypes.pythonapi.PyCapsule_IsValid
    valid.restype, valid.argtypes = ctypes.c_int, [ctypes.py_object, ctypes.c_char_p]
    if type(capsule).__name__ != "PyCapsule" or not valid(capsule, b"dltensor"):
        raise fi.UsageError("not a DLPack capsule (or one that was already consumed)")
    tensor = _DLTensor.from_address(get(capsule, b"dltensor"))  # DLManagedTensor starts with its DLTensor
    if tensor.device.device_type in (1, _KDL_CUDA_HOST):
        return None
    if tensor.device.device_type not in (_KDL_CUDA, _KDL_CUDA_MANAGED):
        raise fi.UsageError(f"cannot register a DLPack tensor on device type {tensor.device.device_type}")
    shape = [tensor.shape[i] for i in range(tensor.ndim)]
    itemsize = max(1, tensor.dtype.bits * tensor.dtype.lanes // 8)
    if tensor.strides and not one_block(shape, [tensor.strides[i] * itemsize for i in range(tensor.ndim)], itemsize):
        raise fi.UsageError(NOT_ONE_BLOCK.format(what="CUDA tensor"))
    length = int(np.prod(shape)) * itemsize if shape else itemsize
    return (tensor.data or 0) + tensor.byte_offset, length, tensor.device.device_id, (obj, capsule)


NOT_ONE_BLOCK = ("register a {what} that is one contiguous block of memory (in any axis order: C, Fortran, "
                 "transposed); this one has gaps, repeats or runs backwards (a slice with a step, a broadcast, "
                 "[::-1]): a contiguous copy of it (np.ascontiguousarray, .contiguous()) is one")


def one_block(shape: list[int] | tuple[int, ...], strides: list[int] | tuple[int, ...], itemsize: int) -> bool:
    """Whether items of ``itemsize`` bytes at ``strides`` (bytes) fill one block of memory from the first
    item on, without gaps or repeats, in some axis order (C, Fortran, a transpose of either)."""
    expected = itemsize
    for size, stride in sorted(((n, st) for n, st in zip(shape, strides) if n != 1), key=lambda axis: axis[1]):
        if stride != expected:
            return False
        expected *= size
    return True


# -------------------------------------------------------------------------------------- the pool


def pool_layout(pool_bytes: int, chunk_bytes: int) -> tuple[int, int]:
    """(chunks, bytes) of a staging pool of at most ``pool_bytes`` in ``chunk_bytes`` chunks: whole chunks
    only, at least two (one copied while the other is on the wire)."""
    if chunk_bytes <= 0 or pool_bytes < 2 * chunk_bytes:
        raise fi.UsageError(f"the staging pool ({pool_bytes} bytes) must hold at least two staging chunks of "
                            f"{chunk_bytes} bytes: raise staging_bytes or lower staging_chunk_bytes")
    chunks = pool_bytes // chunk_bytes
    return chunks, chunks * chunk_bytes


class PinnedPool:
    """``pool_bytes`` of page-locked host memory (portable: any device copies into it), cut into chunks.
    ``pinned=False`` (tests without a GPU: fabriclab.landing's host-memory copier) takes plain page-aligned
    host memory instead, and no CUDA."""

    def __init__(self, pool_bytes: int, chunk_bytes: int, pinned: bool = True):
        self.chunks, self.length = pool_layout(pool_bytes, chunk_bytes)
        self.chunk_bytes = chunk_bytes
        self.driver: Any = None  # the CUDA driver (gpu.require_cuda), for pinned memory
        self.context: Any = None
        self._host: memory.HostBuffer | None = None
        self.array: np.ndarray | None
        if not pinned:
            self._host = memory.HostBuffer(self.length)
            self.pointer, self.array = self._host.pointer, self._host.array
            return
        driver = gpu.require_cuda()
        self.driver = driver
        self.context = gpu.primary_context(0)
        self.pointer = int(gpu.check(driver.cuMemHostAlloc(self.length, _CU_MEMHOSTALLOC_PORTABLE), "cuMemHostAlloc"))
        self.array = np.ctypeslib.as_array((ctypes.c_uint8 * self.length).from_address(self.pointer))

    def close(self) -> None:
        """Free the memory: only once no NIC has it registered any more."""
        if self.array is not None:
            self.array = None
            if self._host is not None:
                self._host.close()
            else:
                self.driver.cuMemFreeHost(self.pointer)


# ------------------------------------------------------------------------------------- the stager


def copy_runs(src: np.ndarray, dst: np.ndarray, lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Copies of ``lengths[i]`` bytes from ``src[i]`` to ``dst[i]`` (byte offsets), as fewer copies: pieces
    that continue the previous one on both sides join it. Each CUDA copy call costs microseconds of the
    staging thread, so a chunk of contiguous pages is one call, not one per page."""
    src, dst = np.asarray(src, np.int64), np.asarray(dst, np.int64)
    lengths = np.asarray(lengths, np.int64)
    if src.size == 0:
        return src, dst, lengths
    joins = (src[1:] == src[:-1] + lengths[:-1]) & (dst[1:] == dst[:-1] + lengths[:-1])
    starts = np.flatnonzero(np.concatenate(([True], ~joins)))
    return src[starts], dst[starts], np.add.reduceat(lengths, starts)


@dataclass(eq=False)  # identity: queues remove it, and numpy fields cannot be compared
class StagedJob:
    """One transfer from a staged region: write i moves lengths[i] bytes from byte src[i] of the GPU region
    to byte dst[i] of the peer's region. ``send(src, dst, lengths)`` hands writes from the pool (src: pool
    offsets) to the engine and returns their Transfer; ``done(error_or_None, safe)`` resolves the caller's."""
    pointer: int
    length: int
    device: int
    src: np.ndarray
    dst: np.ndarray
    lengths: np.ndarray
    deadline: float
    send: Callable[[np.ndarray, np.ndarray, np.ndarray], Transfer]
    done: Callable[[BaseException | None, bool], None]
    is_open: Callable[[], bool]
    next_write: int = 0
    error: BaseException | bool | None = None  # False once resolved


@dataclass(eq=False)
class _Chunk:
    slot: int
    job: StagedJob
    src: np.ndarray = field(default_factory=lambda: np.empty(0, np.int64))
    dst: np.ndarray = field(default_factory=lambda: np.empty(0, np.int64))
    lengths: np.ndarray = field(default_factory=lambda: np.empty(0, np.uint64))
    sent: Transfer | None = None  # the engine's Transfer of its writes, once the copy finished


def _sent(chunk: _Chunk) -> Transfer:
    """The writes of a chunk being sent (or lost): their Transfer, which every such chunk has."""
    assert chunk.sent is not None
    return chunk.sent


class Stager:
    """The staging thread of one engine: copies chunks GPU → pool on CUDA streams and hands each to the
    engine as soon as its copy is done, keeping copies and writes in flight at once."""

    def __init__(self, pool: PinnedPool, failure_type: Callable[..., BaseException]) -> None:
        self.pool = pool
        self.failure_type = failure_type  # (message, buffer_safe, why) -> the caller's exception; why: FAILURES
        d = pool.driver
        self.streams = [gpu.check(d.cuStreamCreate(1), "cuStreamCreate") for _ in range(COPY_STREAMS)]  # non-blocking
        self.started = [gpu.check(d.cuEventCreate(0), "cuEventCreate") for _ in range(pool.chunks)]
        self.copied = [gpu.check(d.cuEventCreate(0), "cuEventCreate") for _ in range(pool.chunks)]
        self.free = collections.deque(range(pool.chunks))
        self.jobs: collections.deque[StagedJob] = collections.deque()
        self.copying: collections.deque[_Chunk] = collections.deque()
        self.sending: list[_Chunk] = []
        self.lost: list[_Chunk] = []  # chunks of failed writes the provider has not reported: not reusable yet
        self.cond = threading.Condition()
        self.closed = False
        self.staged_bytes = 0
        self.staged_chunks = 0
        self.copy_seconds = 0.0
        self.thread = threading.Thread(target=self._run, name="fabriclab-stager", daemon=True)
        self.thread.start()

    def stats(self) -> dict[str, Any]:
        return {"pool_bytes": self.pool.length, "chunk_bytes": self.pool.chunk_bytes, "allocated": True,
                "staged_bytes": self.staged_bytes,
                "staged_chunks": self.staged_chunks, "copy_seconds": round(self.copy_seconds, 6),
                "jobs_waiting": len(self.jobs)}

    def check_fits(self, largest_write: int) -> None:
        if largest_write > self.pool.chunk_bytes:
            raise fi.UsageError(f"a staged write of {largest_write} bytes does not fit a staging chunk of "
                                f"{self.pool.chunk_bytes} bytes: use smaller pages or stripe_bytes, or a larger "
                                "Engine(staging_chunk_bytes=...)")

    def submit(self, job: StagedJob) -> None:
        with self.cond:
            if self.closed:
                raise fi.UsageError("the engine is closed")
            self.jobs.append(job)
            self.cond.notify()

    def close(self, timeout: float = WORKER_EXIT_TIMEOUT) -> None:
        with self.cond:
            self.closed = True
            self.cond.notify()
        self.thread.join(timeout)
        for job in list(self.jobs):
            self._fail(job, "the engine was closed before the staged transfer was copied", safe=True, why="closed")
        self.jobs.clear()
        d = self.pool.driver
        if not self.thread.is_alive():
            for event in self.started + self.copied:
                d.cuEventDestroy(event)
            for stream in self.streams:
                d.cuStreamDestroy(stream)

    # ------------------------------------------------------------------------------- the thread

    def _run(self) -> None:
        quick_timers()  # naps of 50 us between polls of the copies' events, not 100
        d = self.pool.driver
        d.cuCtxSetCurrent(self.pool.context)
        while True:
            with self.cond:
                if self.closed:
                    break
                if not (self.jobs or self.copying or self.sending):
                    self.cond.wait(0.05)
                    if not self.lost:
                        continue  # lost chunks are looked at again every 50 ms, no sooner
            try:
                busy = self._start_copies() | self._send_copied() | self._reclaim()
            except Exception as exc:  # a bug of ours: fail what is waiting, and keep serving
                logging.getLogger("fabriclab").exception("the stager hit an error; it goes on")
                for job in {id(c.job): c.job for c in self.copying}.values():
                    self._fail(job, f"the stager failed: {exc!r}", safe=False)
                for job in list(self.jobs):
                    self._fail(job, f"the stager failed: {exc!r}", safe=True)
                busy = False
            if not busy:
                time.sleep(0.00005)
        # closing: let copies finish (the caller's GPU memory must not be read after we report), fail the rest
        for chunk in list(self.copying):
            d.cuEventSynchronize(self.copied[chunk.slot])
            self._fail(chunk.job, "the engine was closed while the transfer was staged", safe=True, why="engine")
        for chunk in self.sending:
            self._fail(chunk.job, "the engine was closed while the transfer was staged", safe=True, why="engine")

    def _start_copies(self) -> bool:
        """Fill free chunks from the oldest job: its next writes, copied GPU → pool on one stream. Jobs
        waiting for a chunk still fail at their deadline (chunks of writes lost with a peer stay taken)."""
        started = False
        for job in list(self.jobs):
            if job.error is None and not self._job_alive(job):
                self.jobs.remove(job)
        while self.free and self.jobs:
            job = self.jobs[0]
            if job.error is None and not self._job_alive(job):
                self.jobs.popleft()
                continue
            n = job.src.size
            if job.next_write >= n:
                self.jobs.popleft()
                continue
            slot = self.free.popleft()
            chunk = _Chunk(slot, job)
            # as many whole writes as fit in the chunk (check_fits made sure one always does)
            sizes = np.cumsum(job.lengths[job.next_write:].astype(np.int64))
            take = max(1, int(np.searchsorted(sizes, self.pool.chunk_bytes, side="right")))
            end = job.next_write + take
            chunk.lengths = job.lengths[job.next_write:end]
            chunk.dst = job.dst[job.next_write:end]
            offsets = np.concatenate(([0], sizes[:take - 1])).astype(np.int64)
            chunk.src = slot * self.pool.chunk_bytes + offsets
            stream = self.streams[slot % len(self.streams)]
            d = self.pool.driver
            try:
                gpu.check(d.cuEventRecord(self.started[slot], stream), "cuEventRecord")
                for src, host, length in zip(*copy_runs(job.src[job.next_write:end], chunk.src, chunk.lengths)):
                    gpu.check(d.cuMemcpyDtoHAsync(self.pool.pointer + int(host), job.pointer + int(src), int(length),
                                               stream), "cuMemcpyDtoHAsync")
                gpu.check(d.cuEventRecord(self.copied[slot], stream), "cuEventRecord")
            except StagingError as exc:
                d.cuStreamSynchronize(stream)  # nothing of ours may still read the caller's memory
                self.free.append(slot)
                self._fail(job, str(exc), safe=True)
                continue
            job.next_write = end
            self.copying.append(chunk)
            started = True
        return started

    def _job_alive(self, job: StagedJob) -> bool:
        if time.monotonic() > job.deadline:
            self._fail(job, "the deadline passed while the transfer waited for staging memory", safe=True,
                       why="timeout")
            return False
        if not job.is_open():
            self._fail(job, "the region was closed while the transfer used it", safe=True, why="closed")
            return False
        return True

    def _send_copied(self) -> bool:
        """Hand every chunk whose copy finished (in order) to the engine."""
        d = self.pool.driver
        sent = False
        while self.copying:
            chunk = self.copying[0]
            err, = d.cuEventQuery(self.copied[chunk.slot])
            if int(err) == int(d.CUresult.CUDA_ERROR_NOT_READY):
                break
            self.copying.popleft()
            sent = True
            if int(err) != 0:
                self.free.append(chunk.slot)
                self._fail(chunk.job, f"copying GPU memory to the staging pool failed: CUDA error {int(err)} "
                                      f"({gpu.error_name(err)})", safe=True)
                continue
            err, ms = d.cuEventElapsedTime(self.started[chunk.slot], self.copied[chunk.slot])
            if int(err) == 0:
                self.copy_seconds += ms / 1000.0
            if chunk.job.error is not None:
                self.free.append(chunk.slot)
                continue
            try:
                chunk.sent = chunk.job.send(chunk.src, chunk.dst, chunk.lengths)
            except fi.FabriclabError as exc:
                self.free.append(chunk.slot)
                self._fail(chunk.job, None, safe=True, error=exc)
                continue
            self.staged_bytes += int(chunk.lengths.sum())
            self.staged_chunks += 1
            self.sending.append(chunk)
        return sent

    def _reclaim(self) -> bool:
        """Chunks whose writes all finished go back to the pool (once no write can read them); the job's
        last chunk resolves the caller's transfer."""
        reclaimed = False
        still = []
        for chunk in self.lost:
            if _sent(chunk)._safety.safe:
                self.free.append(chunk.slot)
                reclaimed = True
        self.lost = [c for c in self.lost if not _sent(c)._safety.safe]
        for chunk in self.sending:
            sent = _sent(chunk)
            if not sent.done():
                still.append(chunk)
                continue
            reclaimed = True
            error = sent.exception()
            if error is not None:
                self._fail(chunk.job, None, safe=True, error=error)
            if error is None or sent._safety.safe:
                self.free.append(chunk.slot)
            else:
                self.lost.append(chunk)  # the pool keeps it until the provider reports every write of it
                continue
            self._finish_if_done(chunk.job)
        self.sending = still
        return reclaimed

    def _finish_if_done(self, job: StagedJob) -> None:
        if job.error is not None or job.next_write < job.src.size:
            return
        if any(c.job is job for c in self.copying) or any(c.job is job and not _sent(c).done() for c in self.sending):
            return
        job.error = False  # resolved: no second resolution
        job.done(None, True)

    def _fail(self, job: StagedJob, message: str | None, safe: bool, error: BaseException | None = None,
              why: str = "cuda") -> None:
        """Fail the caller's transfer once. The caller's GPU memory is read by our copies only, and those are
        finished or synchronised when this runs: its buffer is safe whatever the writes on the wire do."""
        if job.error is not None:
            return
        if error is None:
            error = self.failure_type(message, safe, why)
        job.error = error
        job.next_write = job.src.size
        job.done(error, safe)

