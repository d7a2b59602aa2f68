"""Staged targets for ``fabriclab.Engine``: peers write into GPU memory the provider cannot register.

A staged target region (``Region.path == "cuda-staged"``) is never registered with the NICs. Its engine
keeps a bounded pool of page-locked host memory cut into *landing lanes* (the staging pool's sizes: a lane
is a staging chunk), registered with every NIC, and the region's descriptor names that pool instead of the
region. A writer asks the target for lanes, writes its pages into them (one write per page, through the
engine's NICs as any write), and says what it wrote where; the target copies each lane's pages to their
place in the region (``cuMemcpyHtoDAsync`` on CUDA streams) and only then counts them for ``expect`` and
tells the writer, whose transfer resolves on that word. A lane goes back to the pool once copied, so a
transfer larger than the pool streams through it, and several writers share it (lanes are granted in the
order asked for).

The words go over a small control channel per engine (``ControlChannel``): one more endpoint of the same
provider and domain as the engine's first NIC, sending and receiving small messages, serviced by the
engine's landing thread. Its address travels in the staged region's descriptor, so an engine that never
has a staged target opens none. The words, each a message:

    REQUEST  writer -> target   lanes wanted for a transfer (with the writer's control address)
    GRANT    target -> writer   these lanes are yours
    FILLED   writer -> target   lane L holds these pages (in order), for these offsets, counted under imm
    RELEASE  writer -> target   lane L is yours again, unfilled (the transfer failed or ended early)
    COPIED   target -> writer   lane L's pages are in place and counted
    REFUSED  target -> writer   the transfer cannot land (region closed, CUDA failed): why

FILLED is sent once the writer's writes completed, which on some providers says only that they left; the
target starts copying once the writes themselves have arrived: each write into lane L carries immediate data
of its own (``_native.lane_imm(L)``), counted by the engine's workers apart from callers' values.

Lanes are leased: a lane granted to a writer that went away (never filled, never given back) returns to
the pool after the target engine's timeout. Pages of a writer that still writes into a lane after its
lease ran out could mix with the next writer's: keep writers' timeouts at most the target's.
"""
from __future__ import annotations

import collections
import ctypes
import itertools
import logging
import struct
import threading
import time
from dataclasses import dataclass, field

import numpy as np

from . import _native, fi, gpu, staging

MESSAGE_BYTES = 64 << 10   # the largest control message (a FILLED names up to ~5000 pages)
RECEIVES = 64              # control messages that can wait to be read
SENDS = 64                 # control messages that can be on their way at once
NO_LANE = 0xFFFF
ENDED_JOBS = 4096          # finished jobs a writer remembers, to give back lanes granted to them late
PAGE_ENTRY = struct.Struct("<QI")  # FILLED: a page's destination offset in the region and its length

_REQUEST, _GRANT, _FILLED, _RELEASE, _COPIED, _REFUSED = range(1, 7)
_HEAD = struct.Struct("<BQQ")  # kind, writer engine id, the writer's job number
_REQUEST_BODY = struct.Struct("<IIH")   # region id, lanes wanted, control address length (address follows)
_FILLED_BODY = struct.Struct("<IHII")   # region id, lane, imm, pages (entries follow)
FILLED_HEAD = _HEAD.size + _FILLED_BODY.size
_LANE = struct.Struct("<H")
_REFUSED_BODY = struct.Struct("<HB")     # lane (NO_LANE: the whole request), why (index in WHY; text follows)
WHY = ("closed", "cuda", "timeout", "engine")  # staging.FAILURES' names, as the writer's failure_type takes them


def max_lanes(pool_bytes: int, lane_bytes: int) -> tuple[int, int]:
    """(lanes, bytes) of a landing pool: the staging pool's layout, at most MAX_LANES lanes (a lane's number
    rides in the immediate data of its writes)."""
    lanes, _ = staging.pool_layout(pool_bytes, lane_bytes)
    lanes = min(lanes, _native.MAX_LANES)
    return lanes, lanes * lane_bytes


# ---------------------------------------------------------------------------------- the channel


class ControlChannel:
    """One endpoint for small messages, beside the engine's NICs (own fabric and domain, of the provider
    and domain of the engine's first NIC, as fi_getinfo offers them). Used by one thread only."""

    def __init__(self, provider: str, domain: str):
        self.stack = fi.EndpointStack(fi.getinfo(provider, domain)[0])
        try:
            self.message_bytes = min(MESSAGE_BYTES, self.stack.info.max_msg_size)
            self.received = np.zeros(RECEIVES * self.message_bytes, np.uint8)
            self.sending = np.zeros(SENDS * self.message_bytes, np.uint8)
            self.received_mr = self.stack.register(self.received)
            self.sending_mr = self.stack.register(self.sending)
            for slot in range(RECEIVES):
                self.stack.ep.post_recv(self.received_mr, slot * self.message_bytes, self.message_bytes,
                                        ("recv", slot))
        except BaseException:
            self.stack.close()
            raise
        self.address = self.stack.ep.address().to_bytes()
        self.free_sends = collections.deque(range(SENDS))
        self.outbox: collections.deque[tuple[int, bytes]] = collections.deque()
        self.known: dict[bytes, int] = {}

    def peer(self, address: bytes) -> int:
        """The fi_addr of a peer's control endpoint (inserted once)."""
        dest = self.known.get(address)
        if dest is None:
            dest = self.known[address] = self.stack.av.insert(fi.Address.from_bytes(address))
        return dest

    def send(self, dest: int, message: bytes) -> None:
        if len(message) > self.message_bytes:
            raise fi.UsageError(f"control message of {len(message)} bytes exceeds {self.message_bytes}")
        self.outbox.append((dest, message))

    def progress(self) -> tuple[list[bytes], list[int]]:
        """Post what waits to be sent, read what arrived: (messages received, peers a send to failed)."""
        while self.outbox and self.free_sends:
            dest, message = self.outbox[0]
            slot = self.free_sends[0]
            offset = slot * self.message_bytes
            self.sending[offset:offset + len(message)] = np.frombuffer(message, np.uint8)
            try:
                if not self.stack.ep.try_post_send(self.sending_mr, offset, len(message), dest, ("send", slot, dest)):
                    break
            except fi.FabricError:
                self.outbox.popleft()
                return [], [dest]
            self.outbox.popleft()
            self.free_sends.popleft()
        received, failed = [], []
        while True:
            try:
                completions = self.stack.cq.poll()
            except fi.FabricError as exc:
                token = exc.token
                if token and token[0] == "send":
                    self.free_sends.append(token[1])
                    failed.append(token[2])
                elif token and token[0] == "recv":
                    self._repost(token[1])
                continue
            if not completions:
                break
            for c in completions:
                if c.token and c.token[0] == "recv":
                    offset = c.token[1] * self.message_bytes
                    received.append(self.received[offset:offset + c.length].tobytes())
                    self._repost(c.token[1])
                elif c.token and c.token[0] == "send":
                    self.free_sends.append(c.token[1])
        return received, failed

    def _repost(self, slot: int) -> None:
        self.stack.ep.post_recv(self.received_mr, slot * self.message_bytes, self.message_bytes, ("recv", slot))

    def close(self) -> None:
        self.stack.close()


# ----------------------------------------------------------------------------------- the copiers


def lane_copies(entries: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A lane's pages (packed one after another in the lane, FILLED's (destination, length) entries) as
    copies (lane offset, destination, length), neighbouring pages joined (staging.copy_runs)."""
    lengths = entries["length"].astype(np.int64)
    in_lane = np.concatenate(([0], np.cumsum(lengths)[:-1]))
    return staging.copy_runs(in_lane, entries["dst"].astype(np.int64), lengths)


class HostCopier:
    """Copies landed pages with memmove: host-memory staged targets (a private switch the tests use to run
    the whole protocol without a GPU; see Engine._register_staged_host)."""

    def __init__(self):
        self.seconds = 0.0

    def start(self, lane: int, source: int, destination: int, entries: np.ndarray) -> None:
        started = time.perf_counter()
        for src, dst, length in zip(*lane_copies(entries)):
            ctypes.memmove(destination + int(dst), source + int(src), int(length))
        self.seconds += time.perf_counter() - started

    def finished(self, lane: int) -> bool:
        return True

    def close(self) -> None:
        pass


class CudaCopier:
    """Copies landed pages host → GPU with cuMemcpyHtoDAsync, one CUDA stream per lane modulo
    staging.COPY_STREAMS, an event per lane saying when its copies are done."""

    def __init__(self, lanes: int):
        d = self.driver = gpu.require_cuda()
        self.context = gpu._ok(d.cuDevicePrimaryCtxRetain(gpu._ok(d.cuDeviceGet(0), "cuDeviceGet")),
                               "cuDevicePrimaryCtxRetain")
        gpu._ok(d.cuCtxSetCurrent(self.context), "cuCtxSetCurrent")
        self.streams = [gpu._ok(d.cuStreamCreate(1), "cuStreamCreate") for _ in range(staging.COPY_STREAMS)]
        self.started = [gpu._ok(d.cuEventCreate(0), "cuEventCreate") for _ in range(lanes)]
        self.copied = [gpu._ok(d.cuEventCreate(0), "cuEventCreate") for _ in range(lanes)]
        self.seconds = 0.0

    def start(self, lane: int, source: int, destination: int, entries: np.ndarray) -> None:
        d = self.driver
        d.cuCtxSetCurrent(self.context)
        stream = self.streams[lane % len(self.streams)]
        gpu._ok(d.cuEventRecord(self.started[lane], stream), "cuEventRecord")
        try:
            for src, dst, length in zip(*lane_copies(entries)):
                gpu._ok(d.cuMemcpyHtoDAsync(destination + int(dst), source + int(src), int(length), stream),
                        "cuMemcpyHtoDAsync")
            gpu._ok(d.cuEventRecord(self.copied[lane], stream), "cuEventRecord")
        except gpu.CudaError:
            d.cuStreamSynchronize(stream)  # nothing of ours may still read the lane
            raise

    def finished(self, lane: int) -> bool:
        """Whether lane ``lane``'s copies are done; CudaError if they failed."""
        d = self.driver
        err, = d.cuEventQuery(self.copied[lane])
        if int(err) == int(d.CUresult.CUDA_ERROR_NOT_READY):
            return False
        gpu._ok((err,), "copying a landing lane to the GPU")
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


# -------------------------------------------------------------------------- the target's lanes


@dataclass(eq=False)
class TargetRegion:
    """A staged target region as the landing thread sees it: where its memory is, and its engine state
    (``in_use`` keeps Region.close waiting while a copy writes into it)."""
    region_id: int
    kind: str      # "cuda" or "host": which copier
    pointer: int
    length: int
    state: object  # engine._RegionState


@dataclass(eq=False)
class _Lane:
    number: int
    owner: tuple | None = None      # (writer id, job, writer's control fi_addr)
    lease_ends: float = 0.0
    region: TargetRegion | None = None
    imm: int = 0
    entries: np.ndarray | None = None  # FILLED's (destination, length) pages, once filled
    copier: object = None               # copying with it, once the pages have arrived
    holds_count: bool = False           # holds imm's place in the engine's count until the lane is free


@dataclass(eq=False)
class _Request:
    owner: tuple
    region_id: int
    wanted: int


# -------------------------------------------------------------------------------- writers' jobs


@dataclass(eq=False)  # identity: queues remove it, and numpy fields cannot be compared
class LandingJob:
    """One transfer into a staged target: write i moves lengths[i] bytes from byte src[i] of the local
    region to byte dst[i] of the target region. ``post(src, lane_offsets, lengths, imm, timeout)`` writes
    pages into the target's lane pool and returns their Transfer; ``done(error_or_None, safe)`` resolves
    the caller's transfer, ``settle()`` says its buffer is safe after a failure said it was not yet."""
    address: bytes          # the target's control endpoint (resolved to ``target`` by the landing thread)
    region_id: int
    lane_bytes: int
    max_pages: int          # pages one FILLED can name
    src: np.ndarray
    dst: np.ndarray
    lengths: np.ndarray
    imm: int
    deadline: float
    post: object
    done: object
    settle: object
    target: int = -1        # the target's control fi_addr
    number: int = 0
    splits: collections.deque = field(default_factory=collections.deque)  # (first, end) writes per lane
    in_flight: dict = field(default_factory=dict)  # lane -> [first, end, Transfer, filled]
    posted: list = field(default_factory=list)     # every Transfer it posted (for buffer safety)
    error: BaseException | None = None
    safe_said: bool = False

    def split(self) -> None:
        """Cut the writes into lanes' worth: whole writes, in order, at most lane_bytes and max_pages."""
        sizes = np.cumsum(self.lengths.astype(np.int64))
        first, n = 0, self.src.size
        while first < n:
            base = sizes[first - 1] if first else 0
            end = int(np.searchsorted(sizes, base + self.lane_bytes, side="right"))
            end = max(first + 1, min(end, first + self.max_pages))
            self.splits.append((first, end))
            first = end


class Landing:
    """The landing thread of one engine, with its control channel: it grants and copies lanes as a target
    (once the engine has a staged target) and runs writers' jobs into peers' staged targets."""

    def __init__(self, provider: str, domain: str, engine_id: int, native, failure_type, lease_s: float):
        self.channel = ControlChannel(provider, domain)
        self.engine_id = engine_id
        self.native = native
        self.failure_type = failure_type  # (message, buffer_safe, why) -> the caller's exception
        self.lease_s = lease_s
        self.lock = threading.Lock()
        self.closed = False
        # the target's side
        self.pool: staging.PinnedPool | None = None
        self.lanes: list[_Lane] = []
        self.free: collections.deque[int] = collections.deque()
        self.requests: collections.deque[_Request] = collections.deque()
        self.regions: dict[int, TargetRegion] = {}
        self.copiers: dict[str, object] = {}
        self.landed_bytes = self.landed_lanes = 0
        # the writer's side
        self.numbers = itertools.count(1)
        self.new_jobs: collections.deque[LandingJob] = collections.deque()
        self.jobs: dict[int, LandingJob] = {}
        self.unsafe: list[LandingJob] = []  # failed jobs whose writes the provider has not all reported
        self.releasing: list[tuple[int, int, int, object]] = []  # (target, job, lane, Transfer) once safe
        self.ended: collections.OrderedDict[int, int] = collections.OrderedDict()  # job -> target
        self.last_busy = time.monotonic()
        self.thread = threading.Thread(target=self._run, name="fabriclab-landing", daemon=True)
        self.thread.start()

    @property
    def address(self) -> bytes:
        return self.channel.address

    # ------------------------------------------------------------------------- from other threads

    def open_lanes(self, pool: staging.PinnedPool) -> None:
        """Serve ``pool`` (registered with every NIC by the engine) as landing lanes."""
        with self.lock:
            self.pool = pool
            self.lanes = [_Lane(i) for i in range(pool.chunks)]
            self.free.extend(range(pool.chunks))

    def add_region(self, region: TargetRegion) -> None:
        with self.lock:
            self.regions[region.region_id] = region

    def remove_region(self, region_id: int) -> None:
        with self.lock:
            self.regions.pop(region_id, None)

    def submit(self, job: LandingJob) -> None:
        job.split()
        with self.lock:
            if self.closed:
                raise fi.UsageError("the engine is closed")
            job.number = next(self.numbers)
            self.new_jobs.append(job)

    def stats(self) -> dict:
        copy_s = sum(c.seconds for c in self.copiers.values())
        return {"landed_bytes": self.landed_bytes, "landed_lanes": self.landed_lanes,
                "landing_copy_seconds": round(copy_s, 6), "landing_jobs": len(self.jobs)}

    def close(self, timeout: float = 5.0) -> None:
        with self.lock:
            self.closed = True
        self.thread.join(timeout)
        for job in list(self.jobs.values()) + list(self.new_jobs):
            self._fail(job, "the engine was closed before the transfer landed in the target's memory", "engine")
        for job in self.unsafe:
            job.settle(False)
        if not self.thread.is_alive():
            for copier in self.copiers.values():
                copier.close()
            self.channel.close()

    # --------------------------------------------------------------------------------- the thread

    def _run(self) -> None:
        while not self.closed:
            try:
                busy = self._serve()
            except Exception:  # a bug of ours: say so, keep serving
                logging.getLogger("fabriclab").exception("the landing thread hit an error; it goes on")
                busy = False
            now = time.monotonic()
            if busy:
                self.last_busy = now
            elif now - self.last_busy > 0.05:
                time.sleep(0.001)  # idle: software providers still need the control endpoint polled
            else:
                time.sleep(0.00002)

    def _serve(self) -> bool:
        messages, failed = self.channel.progress()
        busy = bool(messages)
        for message in messages:
            self._dispatch(message)
        for dest in failed:
            for job in [j for j in self.jobs.values() if j.target == dest]:
                self._fail(job, "the target's control endpoint cannot be reached (the peer is gone?)", "peer")
        with self.lock:
            new, self.new_jobs = list(self.new_jobs), collections.deque()
        for job in new:
            self.jobs[job.number] = job
            try:
                job.target = self.channel.peer(job.address)
            except fi.FabriclabError as exc:
                self._fail(job, f"the target's control address does not fit this engine: {exc}", "engine")
                continue
            self._send_request(job)
            busy = True
        busy |= self._target_work()
        busy |= self._writer_work()
        return busy or bool(self.channel.outbox)

    def _dispatch(self, message: bytes) -> None:
        kind, writer, job = _HEAD.unpack_from(message)
        body = message[_HEAD.size:]
        if kind == _REQUEST:
            region_id, wanted, size = _REQUEST_BODY.unpack_from(body)
            address = body[_REQUEST_BODY.size:_REQUEST_BODY.size + size]
            self._requested(_Request((writer, job, self.channel.peer(address)), region_id, wanted))
        elif kind == _FILLED:
            region_id, lane, imm, pages = _FILLED_BODY.unpack_from(body)
            entries = np.frombuffer(body, dtype=[("dst", "<u8"), ("length", "<u4")], count=pages,
                                    offset=_FILLED_BODY.size)
            self._filled(writer, job, region_id, lane, imm, entries)
        elif kind == _RELEASE:
            self._released(writer, job, _LANE.unpack_from(body)[0])
        elif kind == _GRANT:
            lanes = np.frombuffer(body, dtype="<u2")
            self._granted(job, [int(x) for x in lanes])
        elif kind == _COPIED:
            self._copied(job, _LANE.unpack_from(body)[0])
        elif kind == _REFUSED:
            lane, why = _REFUSED_BODY.unpack_from(body)
            self._refused(job, lane, WHY[why], body[_REFUSED_BODY.size:].decode(errors="replace"))

    # -------------------------------------------------------------------------- as the target

    def _reply(self, owner: tuple, kind: int, body: bytes) -> None:
        self.channel.send(owner[2], _HEAD.pack(kind, self.engine_id, owner[1]) + body)

    def _refuse(self, owner: tuple, lane: int, why: str, text: str) -> None:
        self._reply(owner, _REFUSED, _REFUSED_BODY.pack(lane, WHY.index(why)) + text.encode())

    def _requested(self, request: _Request) -> None:
        with self.lock:
            known = request.region_id in self.regions
        if not known or not self.lanes:
            self._refuse(request.owner, NO_LANE, "closed", f"region {request.region_id} is not a staged target of "
                                                           "this engine any more (closed by its owner)")
            return
        self.requests.append(request)

    def _grant(self) -> bool:
        granted = False
        now = time.monotonic()
        while self.free and self.requests:
            request = self.requests[0]
            take = min(len(self.free), request.wanted)
            lanes = [self.free.popleft() for _ in range(take)]
            for number in lanes:
                lane = self.lanes[number]
                lane.owner, lane.lease_ends, lane.entries, lane.copier = request.owner, now + self.lease_s, None, None
            self._reply(request.owner, _GRANT, np.asarray(lanes, "<u2").tobytes())
            request.wanted -= take
            if request.wanted == 0:
                self.requests.popleft()
            granted = True
        return granted

    def _owned(self, writer: int, job: int, number: int) -> _Lane | None:
        if number >= len(self.lanes):
            return None
        lane = self.lanes[number]
        return lane if lane.owner is not None and lane.owner[:2] == (writer, job) else None

    def _filled(self, writer, job, region_id, number, imm, entries) -> None:
        lane = self._owned(writer, job, number)
        if lane is None or lane.entries is not None:
            return  # a lane whose lease ran out (given to someone else since): nothing of it is copied
        with self.lock:
            region = self.regions.get(region_id)
        if region is None:
            self._free_lane(lane, refuse=("closed", f"region {region_id} was closed while the transfer landed"))
            return
        end = entries["dst"].astype(np.int64) + entries["length"]
        if entries.size == 0 or int(end.max()) > region.length or int(entries["length"].sum()) > self.pool.chunk_bytes:
            self._free_lane(lane, refuse=("closed", "the pages of the lane do not fit the region or the lane"))
            return
        lane.region, lane.imm, lane.entries = region, imm, entries.copy()

    def _released(self, writer, job, number) -> None:
        lane = self._owned(writer, job, number)
        if lane is not None:
            self._free_lane(lane)

    def _free_lane(self, lane: _Lane, refuse: tuple | None = None) -> None:
        """Back to the pool; arrivals of its writes counted and not taken are dropped."""
        if refuse is not None:
            self._refuse(lane.owner, lane.number, *refuse)
        self.native.drain_lane(lane.number)
        if lane.holds_count:
            self.native.release_immediates(lane.imm)
        lane.owner, lane.region, lane.entries, lane.copier, lane.holds_count = None, None, None, None, False
        self.free.append(lane.number)

    def _copier(self, kind: str):
        copier = self.copiers.get(kind)
        if copier is None:
            copier = self.copiers[kind] = CudaCopier(len(self.lanes)) if kind == "cuda" else HostCopier()
        return copier

    def _target_work(self) -> bool:
        busy = self._grant()
        now = time.monotonic()
        for lane in self.lanes:
            if lane.owner is None:
                continue
            if lane.copier is not None:
                busy |= self._finish_copy(lane)
            elif lane.entries is not None and self.native.take_lane(lane.number, lane.entries.size):
                self._start_copy(lane)
                busy = True
            elif now > lane.lease_ends:
                self._free_lane(lane, refuse=("timeout", f"lane {lane.number} was not filled within its lease of "
                                                         f"{self.lease_s:g} s"))
                busy = True
        return busy

    def _end_copy(self, lane: _Lane, refuse: tuple | None = None) -> None:
        """The lane's copy is over (done or failed), once: it writes into its region no more; back to the pool."""
        lane.region.state.in_use -= 1
        self._free_lane(lane, refuse)

    def _start_copy(self, lane: _Lane) -> None:
        region = lane.region
        if region.state.closed:
            self._free_lane(lane, refuse=("closed", f"region {region.region_id} was closed while the transfer "
                                                    "landed"))
            return
        why = self._hold_count(lane)
        if why:
            self._free_lane(lane, refuse=("engine", why))
            return
        try:
            copier = self._copier(region.kind)
            if region.kind == "cuda":
                staging.pointer_device(region.pointer, region.length)  # freed by its owner?
            region.state.in_use += 1
            try:
                copier.start(lane.number, self.pool.pointer + lane.number * self.pool.chunk_bytes, region.pointer,
                             lane.entries)
            except BaseException:
                region.state.in_use -= 1
                raise
        except gpu.CudaError as exc:
            self._free_lane(lane, refuse=("cuda", f"the target could not copy to its GPU memory: {exc}"))
            return
        lane.copier = copier

    def _hold_count(self, lane: _Lane) -> str | None:
        """Hold the place of the lane's imm (if any) in the engine's count until the lane is free, so that its
        pages, once copied, count for certain: why not, when that cannot be."""
        status = _native.IMM_OK if lane.imm == _native.NO_IMM else self.native.await_immediates(lane.imm, False)
        lane.holds_count = status == _native.IMM_OK and lane.imm != _native.NO_IMM
        if status == _native.IMM_BAD:
            return f"imm {lane.imm} is not a value the target counts (at most {_native.MAX_IMM})"
        return None if status == _native.IMM_OK else (
            f"the target cannot count imm {lane.imm}: it already counts the most immediate values it counts at once "
            f"({self.native.immediates_usage()['most']}), each awaited by an expect() or holding pages nobody took")

    def _finish_copy(self, lane: _Lane) -> bool:
        try:
            if not lane.copier.finished(lane.number):
                return False
        except gpu.CudaError as exc:
            self._end_copy(lane, refuse=("cuda", f"the target could not copy to its GPU memory: {exc}"))
            return True
        if lane.holds_count:  # its place is held: this counts (or, past FL_IMM_MAX_COUNT, marks imm lost)
            self.native.credit_immediates(lane.imm, lane.entries.size)
        self.native.wake()
        self.landed_bytes += int(lane.entries["length"].sum())
        self.landed_lanes += 1
        owner, number = lane.owner, lane.number
        self._end_copy(lane)
        self._reply(owner, _COPIED, _LANE.pack(number))
        return True

    # -------------------------------------------------------------------------- as a writer

    def _send_request(self, job: LandingJob) -> None:
        address = self.channel.address
        self.channel.send(job.target, _HEAD.pack(_REQUEST, self.engine_id, job.number)
                          + _REQUEST_BODY.pack(job.region_id, len(job.splits), len(address)) + address)

    def _to_target(self, job: LandingJob, kind: int, body: bytes) -> None:
        self.channel.send(job.target, _HEAD.pack(kind, self.engine_id, job.number) + body)

    def _granted(self, number: int, lanes: list[int]) -> None:
        job = self.jobs.get(number)
        for lane in lanes:
            if job is None or not job.splits:  # the job ended (failed, or needs no more lanes): give it back
                target = job.target if job is not None else self.ended.get(number)
                if target is not None:  # else a job long gone: its lease runs out at the target
                    self.channel.send(target, _HEAD.pack(_RELEASE, self.engine_id, number) + _LANE.pack(lane))
                continue
            first, end = job.splits.popleft()
            lengths = job.lengths[first:end]
            offsets = lane * job.lane_bytes + np.concatenate(([0], np.cumsum(lengths[:-1].astype(np.int64))))
            try:
                sent = job.post(job.src[first:end], offsets, lengths, _native.lane_imm(lane),
                                max(job.deadline - time.monotonic(), 1e-3))
            except fi.FabriclabError as exc:
                self._to_target(job, _RELEASE, _LANE.pack(lane))
                self._fail(job, None, "engine", cause=exc)
                job = None
                continue
            job.posted.append(sent)
            job.in_flight[lane] = [first, end, sent, False]

    def _copied(self, number: int, lane: int) -> None:
        job = self.jobs.get(number)
        if job is None:
            return
        job.in_flight.pop(lane, None)
        if not job.splits and not job.in_flight:
            del self.jobs[number]
            self._ended(job)
            job.error = False  # resolved: no second resolution
            job.done(None, True)

    def _refused(self, number: int, lane: int, why: str, text: str) -> None:
        job = self.jobs.get(number)
        if job is not None:
            self._fail(job, f"the target refused the transfer: {text}", why)

    def _writer_work(self) -> bool:
        busy = False
        now = time.monotonic()
        for job in list(self.jobs.values()):
            if now > job.deadline:
                self._fail(job, "the deadline passed before every page landed in the target's memory (target "
                                "gone or stalled, or its landing lanes all taken?)", "timeout")
                continue
            for lane, entry in list(job.in_flight.items()):
                first, end, sent, filled = entry
                if filled or not sent.done():
                    continue
                busy = True
                error = sent.exception()
                if error is not None:
                    self._fail(job, f"a write into the target's landing lanes failed: {error}", "engine", cause=error)
                    break
                entries = np.empty(end - first, dtype=[("dst", "<u8"), ("length", "<u4")])
                entries["dst"], entries["length"] = job.dst[first:end], job.lengths[first:end]
                self._to_target(job, _FILLED, _FILLED_BODY.pack(job.region_id, lane, job.imm, end - first)
                                + entries.tobytes())
                entry[3] = True
        still = []
        for target, number, lane, sent in self.releasing:
            if sent._safety.safe:
                self.channel.send(target, _HEAD.pack(_RELEASE, self.engine_id, number) + _LANE.pack(lane))
                busy = True
            else:
                still.append((target, number, lane, sent))
        self.releasing = still
        for job in list(self.unsafe):
            if all(sent._safety.safe for sent in job.posted):
                self.unsafe.remove(job)
                job.settle(True)
        return busy

    def _fail(self, job: LandingJob, message: str | None, why: str, cause: BaseException | None = None) -> None:
        """Fail the caller's transfer once; its lanes not filled go back to the target once their writes (if
        any) are reported."""
        if job.error is not None:
            return
        self.jobs.pop(job.number, None)
        self._ended(job)
        safe = all(sent.done() and sent._safety.safe for sent in job.posted)
        job.error = self.failure_type(message or str(cause), safe, why, cause)
        job.splits.clear()
        for lane, (_, _, sent, filled) in list(job.in_flight.items()):
            if not filled:
                self.releasing.append((job.target, job.number, lane, sent))
        job.in_flight.clear()
        job.done(job.error, safe)
        if not safe:
            self.unsafe.append(job)

    def _ended(self, job: LandingJob) -> None:
        """Remember where a finished job's lanes came from: grants may still come for it, to give back."""
        self.ended[job.number] = job.target
        while len(self.ended) > ENDED_JOBS:
            self.ended.popitem(last=False)
