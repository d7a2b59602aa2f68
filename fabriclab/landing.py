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

The words go over a small control channel per engine (``fabriclab.control``: the messages, each checked
as untrusted input, and the endpoint): one more endpoint of the same provider and domain as the engine's
first NIC, serviced by the engine's landing thread. Its address travels in the staged region's descriptor,
so an engine that never has a staged target opens none. FILLED is sent once the writer's writes completed,
which on some providers says only that they left; the target starts copying once the writes themselves
have arrived: each write into lane L carries immediate data of its own (``_native.lane_imm(L)``), counted
by the engine's workers apart from callers' values.

A writer may land only where a descriptor it holds allows: asking for lanes takes the region's key (in its
descriptor), a lane is granted for one region, and a FILLED counts only from the writer the lane is leased
to (a transfer is named by a random 64-bit number only it and the target know), for that region, with
every page inside the region and the lane. A writer that breaks a rule has its transfer refused.

Lanes are leased: a lane not filled and copied within the target engine's timeout returns to the pool, and
with it everything of that transfer (its other lanes, the lanes it still waits for). A writer that is gone
is dropped sooner: one whose control endpoint cannot be reached, or that went silent (writers name their
running transfers to each target every HEARTBEAT_S; SILENT_S without a word and its requests and lanes go).
Pages of a writer that still writes into a lane after losing it could mix with the next writer's: a writer
whose landing thread did not run for STALL_S (stopped, starved) fails the transfers that still had lanes
to write into instead; keep writers' timeouts at most the target's.
"""
from __future__ import annotations

import collections
import secrets
import threading
import time
from dataclasses import dataclass, field

import numpy as np

from . import _native, control, fi, gpu, staging
from .control import NO_LANE, BadMessage
from .lanecopy import CudaCopier, HostCopier, checked_copies

ENDED_JOBS = 4096   # finished jobs a writer remembers, to give back lanes granted to them late
HEARTBEAT_S = 0.25  # a writer names its running transfers to each target this often
SILENT_S = 3.0      # a writer not heard from this long is gone: its requests and lanes are dropped
STALL_S = 2.0       # a landing thread that did not run this long may have lost its lanes (< SILENT_S - HEARTBEAT_S)


def max_lanes(pool_bytes: int, lane_bytes: int) -> tuple[int, int]:
    """(lanes, bytes) of a landing pool: the staging pool's layout, at most MAX_LANES lanes (a lane's number
    rides in the immediate data of its writes)."""
    lanes, _ = staging.pool_layout(pool_bytes, lane_bytes)
    lanes = min(lanes, _native.MAX_LANES)
    return lanes, lanes * lane_bytes


# -------------------------------------------------------------------------- the target's lanes


@dataclass(eq=False)
class TargetRegion:
    """A staged target region as the landing thread sees it: where its memory is, the key its descriptor
    holds (asking for lanes takes it), and its engine state (``in_use`` keeps Region.close waiting while a
    copy writes into it)."""
    region_id: int
    kind: str      # "cuda" or "host": which copier
    pointer: int
    length: int
    state: object  # engine._RegionState
    key: int = 0


@dataclass(eq=False)
class _Client:
    """A writer's transfer as the target serves it: whose, where its control endpoint is, the region its
    lanes are for, how many more lanes it waits for and which it holds, when the writer last spoke."""
    writer: int
    job: int
    dest: int
    region_id: int
    wanted: int
    heard: float
    lanes: set = field(default_factory=set)


@dataclass(eq=False)
class _Lane:
    number: int
    owner: _Client | None = None
    lease_ends: float = 0.0
    region: TargetRegion | None = None
    imm: int = 0
    pages: int = 0
    copies: tuple | None = None  # FILLED's pages as checked_copies, once filled
    copier: object = None        # copying with it, once the pages have arrived
    holds_count: bool = False    # holds imm's place in the engine's count until the lane is free


# -------------------------------------------------------------------------------- writers' jobs


@dataclass(eq=False)  # identity: queues remove it, and numpy fields cannot be compared
class LandingJob:
    """One transfer into a staged target: write i moves lengths[i] bytes from byte src[i] of the local
    region to byte dst[i] of the target region. ``post(src, lane_offsets, lengths, imm, timeout)`` writes
    pages into the target's lane pool and returns their Transfer; ``done(error_or_None, safe)`` resolves
    the caller's transfer, ``settle()`` says its buffer is safe after a failure said it was not yet.
    ``region_key`` is the key in the region's descriptor, ``target_id`` the target engine's id, ``lanes``
    how many lanes its pool has."""
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
    region_key: int = 0
    target_id: int = 0
    lanes: int = 0
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


def _writing(job: LandingJob) -> bool:
    """Whether ``job`` may still write into a lane (it waits for lanes, or holds some it did not fill)."""
    return bool(job.splits) or not all(entry[3] for entry in job.in_flight.values())


class Landing:
    """The landing thread of one engine, with its control channel: it grants and copies lanes as a target
    (once the engine has a staged target) and runs writers' jobs into peers' staged targets."""

    def __init__(self, provider: str, domain: str, engine_id: int, native, failure_type, lease_s: float):
        self.channel = control.ControlChannel(provider, domain, unreachable_s=lease_s)
        self.engine_id = engine_id
        self.native = native
        self.failure_type = failure_type  # (message, buffer_safe, why) -> the caller's exception
        self.lease_s = lease_s
        self.lock = threading.Lock()
        self.closed = False
        self.rejected = control.Rejected()
        self.peers: dict[int, int] = {}  # engines it serves or writes to -> how many transfers
        self.handlers = {control.REQUEST: self._requested, control.FILLED: self._filled,
                         control.RELEASE: self._released, control.ALIVE: self._alive, control.GRANT: self._granted,
                         control.COPIED: self._copied, control.REFUSED: self._refused}
        # the target's side
        self.pool: staging.PinnedPool | None = None
        self.lanes: list[_Lane] = []
        self.free: collections.deque[int] = collections.deque()
        self.clients: dict[tuple[int, int], _Client] = {}
        self.requests: collections.deque[_Client] = collections.deque()  # waiting for lanes, in order
        self.regions: dict[int, TargetRegion] = {}
        self.copiers: dict[str, object] = {}
        self.landed_bytes = self.landed_lanes = 0
        # the writer's side
        self.new_jobs: collections.deque[LandingJob] = collections.deque()
        self.jobs: dict[int, LandingJob] = {}
        self.unsafe: list[LandingJob] = []  # failed jobs whose writes the provider has not all reported
        self.releasing: list[tuple[int, int, int, object]] = []  # (target, job, lane, Transfer) once safe
        self.ended: collections.OrderedDict[int, int] = collections.OrderedDict()  # job -> target
        self.last_busy = self.last_loop = self.last_sweep = self.last_heartbeat = time.monotonic()
        self.thread = self._start()
        self.watcher = threading.Thread(target=self._watch, name="fabriclab-landing-watch", daemon=True)
        self.watcher.start()

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
        job.number = secrets.randbits(64) or 1  # only the writer and its target know it
        with self.lock:
            if self.closed:
                raise fi.UsageError("the engine is closed")
            self.new_jobs.append(job)

    def stats(self) -> dict:
        copy_s = sum(c.seconds for c in self.copiers.values())
        return {"landed_bytes": self.landed_bytes, "landed_lanes": self.landed_lanes,
                "landing_copy_seconds": round(copy_s, 6), "landing_jobs": len(self.jobs),
                "bad_control_messages": self.rejected.total, "control_threads_stranded": self.channel.stranded}

    def close(self, timeout: float = 5.0) -> None:
        with self.lock:
            self.closed = True
        self.thread.join(timeout)
        self.watcher.join(1.0)
        for job in list(self.jobs.values()) + list(self.new_jobs):
            self._fail(job, "the engine was closed before the transfer landed in the target's memory", "engine")
        for job in self.unsafe:
            job.settle(False)
        if not self.thread.is_alive():
            for copier in self.copiers.values():
                copier.close()
            self.channel.close()

    # --------------------------------------------------------------------------------- the thread

    def _start(self) -> threading.Thread:
        thread = threading.Thread(target=self._run, name="fabriclab-landing", daemon=True)
        thread.start()
        return thread

    def _watch(self) -> None:
        """A landing thread stuck in a send that never returns (ControlChannel.wedged) is replaced: the
        peer it sends to is taken for gone, and the others are served on."""
        while not self.closed:
            time.sleep(0.25)
            if not self.closed and self.channel.wedged() and self.channel.supersede():
                self.thread = self._start()

    def _run(self) -> None:
        while not self.closed:
            now = time.monotonic()
            if now - self.last_loop > STALL_S:
                self._stalled(now - self.last_loop)
            self.last_loop = now
            try:
                busy = self._serve()
            except control.Superseded:
                return  # another thread serves now: this one was taken for stuck in a send
            except Exception:  # a bug of ours: say so, keep serving
                control.log.exception("the landing thread hit an error; it goes on")
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
            self._unreachable(dest)
        with self.lock:
            new, self.new_jobs = list(self.new_jobs), collections.deque()
        for job in new:
            self.jobs[job.number] = job
            self._count_peer(job.target_id, 1)
            try:
                job.target = self.channel.peer(job.address)
            except fi.FabriclabError as exc:
                self._fail(job, f"the target's control address does not fit this engine: {exc}", "engine")
                continue
            self._send_request(job)
            busy = True
        busy |= self._target_work()
        busy |= self._writer_work()
        return busy or self.channel.can_send

    def _dispatch(self, message: bytes) -> None:
        """Serve one message on its own: a bad one is dropped and counted, the others read with it are not."""
        sender = None
        try:
            kind, sender, job, fields = control.read(message)
            self.handlers[kind](sender, job, *fields)
        except BadMessage as exc:
            self.rejected.note(self._who(sender), str(exc))
        except Exception as exc:  # a bug of ours, met on this message: said (as often as bad ones), not fatal
            self.rejected.note(self._who(sender), f"serving it failed (a bug in fabriclab): {exc!r}", exc)

    def _who(self, sender: int | None) -> str:
        """A sender as Rejected counts it: an engine this thread serves or writes to, or anyone else."""
        return f"engine {sender:#x}" if sender in self.peers else "senders with no transfer here"

    def _count_peer(self, engine_id: int, change: int) -> None:
        left = self.peers.get(engine_id, 0) + change
        if left > 0:
            self.peers[engine_id] = left
        else:
            self.peers.pop(engine_id, None)

    def _stalled(self, gap: float) -> None:
        """The thread did not run for ``gap`` s (its process stopped, or starved of CPU). As a writer, its
        targets may have taken it for gone and given its lanes to others: the transfers that still had lanes
        to write into fail rather than write into them. As a target, it heard nobody meanwhile: its writers
        get SILENT_S from now."""
        now = time.monotonic()
        for client in self.clients.values():
            client.heard = now
        for job in [j for j in self.jobs.values() if _writing(j)]:
            self._fail(job, f"this engine did not run for {gap:.1f} s (stopped, or starved of CPU): the target may "
                            "have given its landing lanes to other writers meanwhile, so the transfer stops rather "
                            "than write into them", "timeout")

    def _unreachable(self, dest: int) -> None:
        """A control endpoint that takes no more messages: its writers are gone, its targets too."""
        for client in [c for c in self.clients.values() if c.dest == dest]:
            self._drop(client)
        for job in [j for j in self.jobs.values() if j.target == dest]:
            self._fail(job, "the target's control endpoint cannot be reached (the peer is gone?)", "peer")

    # -------------------------------------------------------------------------- as the target

    def _reply(self, client: _Client, kind: int, body: bytes) -> None:
        self.channel.send(client.dest, control.HEAD.pack(kind, self.engine_id, client.job) + body)

    def _refuse(self, client: _Client, why: str, text: str) -> None:
        self._reply(client, control.REFUSED, control.REFUSED_BODY.pack(NO_LANE, control.WHY.index(why))
                    + text.encode()[:control.TEXT_CHARS])

    def _requested(self, writer: int, job: int, region_id: int, key: int, wanted: int, address: bytes) -> None:
        if (writer, job) in self.clients:
            raise BadMessage(f"a second REQUEST for job {job:#x}")
        try:
            dest = self.channel.peer(address)
        except fi.FabriclabError as exc:
            raise BadMessage(f"REQUEST's control address does not fit this engine: {exc}") from None
        client = _Client(writer, job, dest, region_id, wanted, time.monotonic())
        with self.lock:
            region = self.regions.get(region_id)
        if region is None or not self.lanes:
            self._refuse(client, "closed", f"region {region_id} is not a staged target of this engine any more "
                                           "(closed by its owner)")
            return
        if key != region.key:
            self._refuse(client, "invalid", f"the key for region {region_id} does not match its descriptor's")
            raise BadMessage(f"REQUEST for region {region_id} with a key that is not its descriptor's")
        self.clients[writer, job] = client
        self._count_peer(writer, 1)
        self.requests.append(client)

    def _grant(self) -> bool:
        granted = False
        now = time.monotonic()
        while self.free and self.requests:
            client = self.requests[0]
            take = min(len(self.free), client.wanted)
            lanes = [self.free.popleft() for _ in range(take)]
            for number in lanes:
                lane = self.lanes[number]
                lane.owner, lane.lease_ends, lane.copies, lane.copier = client, now + self.lease_s, None, None
                client.lanes.add(number)
            self._reply(client, control.GRANT, np.asarray(lanes, "<u2").tobytes())
            client.wanted -= take
            if client.wanted == 0:
                self.requests.popleft()
            granted = True
        return granted

    def _holding(self, writer: int, job: int, number: int) -> tuple[_Client, _Lane]:
        """The client and lane a message about lane ``number`` may speak of: one leased to its sender."""
        client = self.clients.get((writer, job))
        if client is None or number not in client.lanes:
            raise BadMessage(f"lane {number} is not leased to job {job:#x} of engine {writer:#x} (its lease ran out?)")
        client.heard = time.monotonic()
        return client, self.lanes[number]

    def _filled(self, writer: int, job: int, region_id: int, number: int, imm: int, entries: np.ndarray) -> None:
        client, lane = self._holding(writer, job, number)
        with self.lock:
            region = self.regions.get(region_id)
        try:
            if lane.copies is not None:
                raise BadMessage(f"a second FILLED for lane {number}")
            if region_id != client.region_id:
                raise BadMessage(f"FILLED names region {region_id}, but lane {number} was granted for region "
                                 f"{client.region_id}")
            if region is not None:
                lane.copies = checked_copies(entries, region, self.pool.chunk_bytes)
        except BadMessage as exc:
            self._drop(client, ("invalid", f"lane {number}'s FILLED is not allowed: {exc}"))
            raise
        if region is None:
            self._drop(client, ("closed", f"region {region_id} was closed while the transfer landed"))
            return
        lane.region, lane.imm, lane.pages = region, imm, entries.size

    def _released(self, writer: int, job: int, number: int) -> None:
        _, lane = self._holding(writer, job, number)
        if lane.copies is not None:
            raise BadMessage(f"RELEASE of lane {number}, which it filled")
        self._free_lane(lane)

    def _alive(self, writer: int, _job: int, jobs: list[int]) -> None:
        now = time.monotonic()
        for job in jobs:
            client = self.clients.get((writer, job))
            if client is not None:  # else a transfer that just ended, or one whose REQUEST is on its way
                client.heard = now

    def _free_lane(self, lane: _Lane) -> None:
        """Back to the pool; arrivals of its writes counted and not taken are dropped. The owner's transfer
        ends once it holds no lane and waits for none."""
        client = lane.owner
        self.native.drain_lane(lane.number)
        if lane.holds_count:
            self.native.release_immediates(lane.imm)
        lane.owner, lane.region, lane.copies, lane.copier, lane.holds_count = None, None, None, None, False
        self.free.append(lane.number)
        client.lanes.discard(lane.number)
        if not client.lanes and not client.wanted:
            self._forget(client)

    def _forget(self, client: _Client) -> None:
        if self.clients.get((client.writer, client.job)) is client:
            del self.clients[client.writer, client.job]
            self._count_peer(client.writer, -1)

    def _drop(self, client: _Client, refuse: tuple[str, str] | None = None) -> None:
        """End a writer's transfer here, telling it ``refuse`` (why, text) if it may still listen: its request
        leaves the queue and its lanes come back (those being copied once their copy is done)."""
        if refuse is not None:
            self._refuse(client, *refuse)
        if client.wanted:
            client.wanted = 0
            self.requests.remove(client)
        for number in sorted(client.lanes):
            if self.lanes[number].copier is None:
                self._free_lane(self.lanes[number])
        self._forget(client)

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
            elif lane.copies is not None and self.native.take_lane(lane.number, lane.pages):
                self._start_copy(lane)
                busy = True
            elif now > lane.lease_ends:
                self._drop(lane.owner, ("timeout", f"lane {lane.number} was not filled within its lease of "
                                                   f"{self.lease_s:g} s"))
                busy = True
        if now - self.last_sweep > HEARTBEAT_S:
            self.last_sweep = now
            for client in [c for c in self.clients.values() if now - c.heard > SILENT_S]:
                self._drop(client, ("timeout", f"the writer said nothing for {now - client.heard:.1f} s: taken for "
                                               "gone, its transfer was dropped"))
                busy = True
        return busy

    def _start_copy(self, lane: _Lane) -> None:
        region = lane.region
        if region.state.closed:
            self._drop(lane.owner, ("closed", f"region {region.region_id} was closed while the transfer landed"))
            return
        why = self._hold_count(lane)
        if why:
            self._drop(lane.owner, ("engine", why))
            return
        try:
            copier = self._copier(region.kind)
            if region.kind == "cuda":
                staging.pointer_device(region.pointer, region.length)  # freed by its owner?
            region.state.in_use += 1
            try:
                copier.start(lane.number, self.pool.pointer + lane.number * self.pool.chunk_bytes, region.pointer,
                             lane.copies)
            except BaseException:
                region.state.in_use -= 1
                raise
        except gpu.CudaError as exc:
            self._drop(lane.owner, ("cuda", f"the target could not copy to its GPU memory: {exc}"))
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
            lane.region.state.in_use -= 1
            lane.copier = None  # done with it: the lane goes back with the others
            self._drop(lane.owner, ("cuda", f"the target could not copy to its GPU memory: {exc}"))
            return True
        if lane.holds_count:  # its place is held: this counts (or, past FL_IMM_MAX_COUNT, marks imm lost)
            self.native.credit_immediates(lane.imm, lane.pages)
        lane.region.state.in_use -= 1
        self.native.wake()
        self.landed_bytes += int(lane.copies[2].sum())
        self.landed_lanes += 1
        owner, number = lane.owner, lane.number
        self._free_lane(lane)
        self._reply(owner, control.COPIED, control.LANE.pack(number))
        return True

    # -------------------------------------------------------------------------- as a writer

    def _send_request(self, job: LandingJob) -> None:
        address = self.channel.address
        self._to_target(job, control.REQUEST, control.REQUEST_BODY.pack(job.region_id, job.region_key,
                                                                        len(job.splits), len(address)) + address)

    def _to_target(self, job: LandingJob, kind: int, body: bytes) -> None:
        self.channel.send(job.target, control.HEAD.pack(kind, self.engine_id, job.number) + body)

    def _job(self, target: int, number: int) -> LandingJob | None:
        """The running job a target's message is about (None: one that ended), from that very target."""
        job = self.jobs.get(number)
        if job is not None and target != job.target_id:
            raise BadMessage(f"a message about job {number:#x} from engine {target:#x}, which is not its target")
        return job

    def _granted(self, target: int, number: int, lanes: list[int]) -> None:
        job = self._job(target, number)
        if job is not None:
            wrong = [lane for lane in lanes if lane >= job.lanes or lane in job.in_flight]
            if wrong:
                raise BadMessage(f"GRANT of lane {wrong[0]}: the target has {job.lanes} lanes, and the job holds "
                                 f"{sorted(job.in_flight)}")
        for lane in lanes:
            if job is None or not job.splits:  # the job ended (failed, or needs no more lanes): give it back
                dest = job.target if job is not None else self.ended.get(number)
                if dest is not None:  # else a job long gone: its lease runs out at the target
                    self.channel.send(dest, control.HEAD.pack(control.RELEASE, self.engine_id, number)
                                      + control.LANE.pack(lane))
                continue
            first, end = job.splits.popleft()
            lengths = job.lengths[first:end]
            offsets = lane * job.lane_bytes + np.concatenate(([0], np.cumsum(lengths[:-1].astype(np.int64))))
            try:
                sent = job.post(job.src[first:end], offsets, lengths, _native.lane_imm(lane),
                                max(job.deadline - time.monotonic(), 1e-3))
            except fi.FabriclabError as exc:
                self._to_target(job, control.RELEASE, control.LANE.pack(lane))
                self._fail(job, None, "engine", cause=exc)
                job = None
                continue
            job.posted.append(sent)
            job.in_flight[lane] = [first, end, sent, False]

    def _copied(self, target: int, number: int, lane: int) -> None:
        job = self._job(target, number)
        if job is None:
            return
        entry = job.in_flight.get(lane)
        if entry is None or not entry[3]:
            raise BadMessage(f"COPIED for lane {lane}, which job {number:#x} did not fill")
        del job.in_flight[lane]
        if not job.splits and not job.in_flight:
            self._ended(job)
            job.error = False  # resolved: no second resolution
            job.done(None, True)

    def _refused(self, target: int, number: int, lane: int, why: str, text: str) -> None:
        job = self._job(target, number)
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
            if now - self.channel.stuck.get(job.target, now) > STALL_S and _writing(job):
                self._fail(job, f"no control message reached the target for {STALL_S:g} s: it may have taken this "
                                "writer for gone and given its landing lanes to others, so the transfer stops rather "
                                "than write into them", "peer")
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
                entries = np.empty(end - first, dtype=control.PAGE_ENTRIES)
                entries["dst"], entries["length"] = job.dst[first:end], job.lengths[first:end]
                self._to_target(job, control.FILLED, control.FILLED_BODY.pack(job.region_id, lane, job.imm,
                                                                              end - first) + entries.tobytes())
                entry[3] = True
        if self.jobs and now - self.last_heartbeat > HEARTBEAT_S:
            self.last_heartbeat = now
            self._heartbeat()
        still = []
        for target, number, lane, sent in self.releasing:
            if sent._safety.safe:
                self.channel.send(target, control.HEAD.pack(control.RELEASE, self.engine_id, number)
                                  + control.LANE.pack(lane))
                busy = True
            else:
                still.append((target, number, lane, sent))
        self.releasing = still
        for job in list(self.unsafe):
            if all(sent._safety.safe for sent in job.posted):
                self.unsafe.remove(job)
                job.settle(True)
        return busy

    def _heartbeat(self) -> None:
        """ALIVE to each target, naming the jobs still running into it: its writer is not gone."""
        running = collections.defaultdict(list)
        for job in self.jobs.values():
            running[job.target].append(job.number)
        for target, numbers in running.items():
            for message in control.alive(self.engine_id, numbers):
                self.channel.send(target, message)

    def _fail(self, job: LandingJob, message: str | None, why: str, cause: BaseException | None = None) -> None:
        """Fail the caller's transfer once; its lanes not filled go back to the target once their writes (if
        any) are reported."""
        if job.error is not None:
            return
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
        """The job is no longer running. Remember where its lanes came from: grants may still come for it,
        to give back."""
        if self.jobs.pop(job.number, None) is job:
            self._count_peer(job.target_id, -1)
        self.ended[job.number] = job.target
        while len(self.ended) > ENDED_JOBS:
            self.ended.popitem(last=False)
