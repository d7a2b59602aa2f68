"""Copying a staged target's landed lanes into place (``fabriclab.landing``): the pages a FILLED names, each
checked against the region and the lane, as copies; and the copiers that make them, with memmove (host
memory, the tests' switch) or cuMemcpyHtoDAsync (GPU memory). The copiers add checked offsets only."""
from __future__ import annotations

import collections
import ctypes
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np

from . import gpu, staging
from ._native import WORKER_EXIT_TIMEOUT
from .control import BadMessage

if TYPE_CHECKING:
    from .landing_target import TargetRegion

Copies = tuple[np.ndarray, np.ndarray, np.ndarray]  # a lane's copies: (lane offset, destination, length) each


def lane_copies(entries: np.ndarray) -> Copies:
    """A lane's pages (packed one after another in the lane, FILLED's (destination, length) entries) as
    copies (lane offset, destination, length), neighbouring pages joined (staging.copy_runs)."""
    lengths = entries["length"].astype(np.int64)
    in_lane = np.concatenate(([0], np.cumsum(lengths)[:-1]))
    return staging.copy_runs(in_lane, entries["dst"].astype(np.int64), lengths)


def checked_copies(entries: np.ndarray, region: TargetRegion, lane_bytes: int) -> Copies:
    """:func:`lane_copies` of FILLED's pages once each is checked, as the unsigned numbers they are on the
    wire, to lie inside ``region`` (a landing.TargetRegion) and, packed, inside the lane: the copiers add
    these offsets and nothing else. BadMessage names the first page that does not."""
    dst, lengths = entries["dst"], entries["length"].astype(np.uint64)
    end = np.uint64(region.length)
    outside = (dst > end) | (lengths > end - np.minimum(dst, end))  # dst + length > end, never wrapping
    if outside.any():
        i = int(np.flatnonzero(outside)[0])
        raise BadMessage(f"page {i}, bytes [{int(dst[i])}, {int(dst[i]) + int(lengths[i])}), is outside region "
                         f"{region.region_id} ({region.length} bytes)")
    if int(lengths.sum()) > lane_bytes:
        raise BadMessage(f"its pages hold {int(lengths.sum())} bytes, more than a lane's {lane_bytes}")
    return lane_copies(entries)


class HostCopier:
    """Copies landed pages with memmove: host-memory staged targets (a private switch the tests use to run
    the whole protocol without a GPU; see Engine._register_staged_host). As CudaCopier's copies run on
    the GPU's copy engines, these run on a thread of their own, in the order started: the landing thread
    goes on serving (granting, reading FILLED, answering) while a lane is copied; ``copied()``, if given, is
    called (on the copying thread) after each lane."""

    def __init__(self, copied: Callable[[], object] | None = None) -> None:
        self.seconds = 0.0
        self.on_copied = copied
        self.cond = threading.Condition()
        self.waiting: collections.deque[tuple[int, int, int, Copies]] = collections.deque()
        self.copied: set[int] = set()
        self.closed = False
        self.thread = threading.Thread(target=self._run, name="fabriclab-landing-copy", daemon=True)
        self.thread.start()

    def start(self, lane: int, source: int, destination: int, copies: Copies) -> None:
        """Copy ``copies`` (checked_copies: offsets inside the lane and the region) from the lane at
        ``source`` to the region at ``destination``."""
        with self.cond:
            self.copied.discard(lane)
            self.waiting.append((lane, source, destination, copies))
            self.cond.notify()

    def finished(self, lane: int) -> bool:
        with self.cond:
            return lane in self.copied

    def close(self) -> None:
        """Once the copies started are done (they write into regions kept in use until they finish)."""
        with self.cond:
            self.closed = True
            self.cond.notify()
        self.thread.join(WORKER_EXIT_TIMEOUT)  # memmoves of at most a pool's bytes: done long before

    def _run(self) -> None:
        while True:
            with self.cond:
                while not self.waiting and not self.closed:
                    self.cond.wait()
                if not self.waiting:
                    return
                lane, source, destination, copies = self.waiting.popleft()
            started = time.perf_counter()
            for src, dst, length in zip(*(part.tolist() for part in copies)):
                ctypes.memmove(destination + dst, source + src, length)
            with self.cond:
                self.seconds += time.perf_counter() - started
                self.copied.add(lane)
            if self.on_copied is not None:
                self.on_copied()


class CudaCopier:
    """Copies landed pages host → GPU ``device`` with cuMemcpyHtoDAsync, in that device's primary context (the
    lanes are portable pinned memory: any device reads them), one CUDA stream per lane modulo
    staging.COPY_STREAMS, an event per lane saying when its copies are done. A lane's pages were joined
    where they continue each other (lane_copies): one copy call per run, not per page."""

    def __init__(self, lanes: int, device: int) -> None:
        d = self.driver = gpu.require_cuda()
        self.context = gpu.primary_context(device)
        self.streams = [gpu.check(d.cuStreamCreate(1), "cuStreamCreate") for _ in range(staging.COPY_STREAMS)]
        self.started = [gpu.check(d.cuEventCreate(0), "cuEventCreate") for _ in range(lanes)]
        self.copied = [gpu.check(d.cuEventCreate(0), "cuEventCreate") for _ in range(lanes)]
        self.seconds = 0.0

    def start(self, lane: int, source: int, destination: int, copies: Copies) -> None:
        """As HostCopier.start, on the lane's stream: ``copies`` are checked_copies' offsets, nothing else."""
        d = self.driver
        d.cuCtxSetCurrent(self.context)
        stream = self.streams[lane % len(self.streams)]
        gpu.check(d.cuEventRecord(self.started[lane], stream), "cuEventRecord")
        try:
            for src, dst, length in zip(*(part.tolist() for part in copies)):
                gpu.check(d.cuMemcpyHtoDAsync(destination + dst, source + src, length, stream), "cuMemcpyHtoDAsync")
            gpu.check(d.cuEventRecord(self.copied[lane], stream), "cuEventRecord")
        except gpu.CudaError:
            d.cuStreamSynchronize(stream)  # nothing of ours may still read the lane
            raise

    def finished(self, lane: int) -> bool:
        """Whether lane ``lane``'s copies are done; CudaError if they failed."""
        d = self.driver
        err, = d.cuEventQuery(self.copied[lane])
        if int(err) == int(d.CUresult.CUDA_ERROR_NOT_READY):
            return False
        gpu.check((err,), "copying a landing lane to the GPU")
        err, ms = d.cuEventElapsedTime(self.started[lane], self.copied[lane])
        if int(err) == 0:
            self.seconds += ms / 1000.0
        return True

    def close(self) -> None:
        d = self.driver
        for stream in self.streams:
            d.cuStreamSynchronize(stream)
            d.cuStreamDestroy(stream)
        for event in self.started + self.copied:
            d.cuEventDestroy(event)
