"""The writer half of ``fabriclab.landing``: transfers into peers' staged targets, run on the landing thread.
A job asks the target for lanes, writes a lane's worth of pages into each lane granted (through the engine's
NICs), says what it wrote where (FILLED), and resolves its caller's transfer once the target copied every
lane; it gives back what it no longer needs, and fails rather than write into lanes it may have lost.

A job writes into at most WRITE_AHEAD lanes at once, in order, and the next granted lane as soon as one is
filled: the engine spreads every posted write over its NICs, so lanes posted all at once would all finish
together at the end, and the target could copy none of them while the others are written. A few at a time,
each lane is filled (and copied by the target) while the next are written: the slowest step sets the pace.

A target runs at most control.REQUESTS_PER_SENDER transfers of one writer at once (landing_target): further
jobs into it wait here, in order, until one of those ends there (at once when the target said so, a COPIED
or a REFUSED; else once the target has surely taken it for gone, SILENT_S after this writer stopped naming
it), so a writer with many transfers in flight is never refused for that."""
from __future__ import annotations

import collections
import concurrent.futures
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from . import _native, control, fi
from .control import BadMessage
from .transfer import Transfer

ENDED_JOBS = 4096   # finished jobs a writer remembers, to give back lanes granted to them late
WRITE_AHEAD = 4     # lanes a job writes into at once (see above): enough to keep the NICs and the stager busy


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
    post: Callable[[np.ndarray, np.ndarray, np.ndarray, int, float], Transfer]
    done: Callable[[BaseException | None, bool], None]
    settle: Callable[[bool], None]
    region_key: int = 0
    target_id: int = 0
    lanes: int = 0
    target: int = -1        # the target's control fi_addr
    number: int = 0
    requested: bool = False  # it asked its target for lanes, and the target may still run it
    splits: collections.deque[tuple[int, int]] = field(default_factory=collections.deque)  # writes per lane
    granted: collections.deque[int] = field(default_factory=collections.deque)  # lanes held, not written yet
    in_flight: dict[int, list[Any]] = field(default_factory=dict)  # lane -> [first, end, Transfer, filled]
    posted: list[Transfer] = field(default_factory=list)  # every Transfer it posted (for buffer safety)
    error: BaseException | bool | None = None  # False once resolved
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


class LandingWriter:
    """The jobs of one engine into peers' staged targets (run on its landing thread,
    ``fabriclab.landing.Landing``). ``failure_type(message, buffer_safe, why, cause)`` makes a failed job's
    exception."""

    def __init__(self, channel: control.ControlChannel, engine_id: int, count_peer: Callable[[int, int], None],
                 failure_type: Callable[..., BaseException], wake: threading.Event, nic_addresses: list[bytes]) -> None:
        self.channel, self.engine_id, self._count_peer, self.failure_type = channel, engine_id, count_peer, failure_type
        self.wake, self.nic_addresses = wake, nic_addresses  # this engine's NICs: a REQUEST names them
        self.jobs: dict[int, LandingJob] = {}
        self.unsafe: list[LandingJob] = []  # failed jobs whose writes the provider has not all reported
        self.releasing: list[tuple[int, int, int, Transfer]] = []  # (target, job, lane, Transfer) once safe
        self.ended: collections.OrderedDict[int, bytes] = collections.OrderedDict()  # job -> target's address
        self.asking: collections.Counter[int] = collections.Counter()  # target -> jobs it may still run
        self.held_back: dict[int, collections.deque[LandingJob]] = {}  # target -> jobs waiting to ask, in order
        self.lingering: collections.deque[tuple[float, int]] = collections.deque()  # (when, target): a job ended
        # here without the target saying so, which it forgets by then
        self.last_heartbeat = time.monotonic()

    def start(self, jobs: list[LandingJob]) -> bool:
        """Jobs submitted since the last pass: each asks its target for lanes. Whether there were any."""
        for job in jobs:
            self.jobs[job.number] = job
            self._count_peer(job.target_id, 1)
            try:
                job.target = self.channel.peer(job.address)
            except fi.FabriclabError as exc:
                self._fail(job, f"the target's control address does not fit this engine: {exc}", "engine")
                continue
            self._ask(job)
        return bool(jobs)

    def _ask(self, job: LandingJob) -> None:
        """Ask ``job``'s target for lanes, or hold it back while the target runs REQUESTS_PER_SENDER of ours."""
        if self.asking[job.target] >= control.REQUESTS_PER_SENDER:
            self.held_back.setdefault(job.target, collections.deque()).append(job)
            return
        self.asking[job.target] += 1
        job.requested = True
        self._send_request(job)

    def _target_forgot(self, target: int) -> None:
        """A job of ours no longer runs at ``target``: the next one held back for it, still running, asks."""
        self.asking[target] -= 1
        if not self.asking[target]:
            del self.asking[target]
        waiting = self.held_back.get(target, collections.deque())
        while waiting:
            job = waiting.popleft()
            if self.jobs.get(job.number) is job:
                self._ask(job)
                break
        if not waiting:
            self.held_back.pop(target, None)

    def stalled(self, gap: float) -> None:
        """The landing thread did not run for ``gap`` s (its process stopped, or starved of CPU): its targets
        may have taken it for gone and given its lanes to others, so the transfers that still had lanes to
        write into fail rather than write into them."""
        for job in [j for j in self.jobs.values() if _writing(j)]:
            self._fail(job, f"this engine did not run for {gap:.1f} s (stopped, or starved of CPU): the target may "
                            "have given its landing lanes to other writers meanwhile, so the transfer stops rather "
                            "than write into them", "timeout")

    def unreachable(self, dest: int) -> None:
        """A control endpoint that takes no more messages: its targets are gone."""
        for job in [j for j in self.jobs.values() if j.target == dest]:
            self._fail(job, "the target's control endpoint cannot be reached (the peer is gone?)", "peer")

    def dests(self) -> set[int]:
        """The targets' control endpoints this half still sends to."""
        # a target a count of ours names (asking) keeps its entry until the count is settled
        return ({job.target for job in self.jobs.values()} | {release[0] for release in self.releasing}
                | set(self.asking))

    def close(self, pending: list[LandingJob]) -> None:
        """The engine closed: fail every job (``pending``: those not started yet too)."""
        for job in list(self.jobs.values()) + pending:
            self._fail(job, "the engine was closed before the transfer landed in the target's memory", "engine")
        for job in self.unsafe:
            job.settle(False)

    def _send_request(self, job: LandingJob) -> None:
        self._to_target(job, control.REQUEST, control.request_body(job.region_id, job.region_key, len(job.splits),
                                                                   self.channel.address, self.nic_addresses))

    def _to_target(self, job: LandingJob, kind: int, body: bytes) -> None:
        self.channel.send(job.target, control.HEAD.pack(kind, self.engine_id, job.number) + body)

    def _job(self, target: int, number: int) -> LandingJob | None:
        """The running job a target's message is about (None: one that ended), from that very target."""
        job = self.jobs.get(number)
        if job is not None and target != job.target_id:
            raise BadMessage(f"a message about job {number:#x} from engine {target:#x}, which is not its target")
        return job

    def granted(self, target: int, number: int, lanes: list[int]) -> None:
        job = self._job(target, number)
        if job is not None:
            wrong = [lane for lane in lanes if lane >= job.lanes or lane in job.in_flight or lane in job.granted]
            if wrong:
                raise BadMessage(f"GRANT of lane {wrong[0]}: the target has {job.lanes} lanes, and the job holds "
                                 f"{sorted(job.in_flight) + sorted(job.granted)}")
        for lane in lanes:
            if job is None or len(job.granted) >= len(job.splits):  # the job ended, or needs no more lanes
                dest = job.target if job is not None else self.channel.known_dest(self.ended.get(number))
                if dest is not None:  # else a job long gone, or its target's: its lease runs out there
                    self._release(dest, number, lane)
                continue
            job.granted.append(lane)

    def _wake(self, _: Any) -> None:
        self.wake.set()

    def _release(self, dest: int, number: int, lane: int) -> None:
        self.channel.send(dest, control.HEAD.pack(control.RELEASE, self.engine_id, number) + control.LANE.pack(lane))

    def write(self) -> bool:
        """Write the next lanes' pages into the lanes granted, while a job writes into fewer than WRITE_AHEAD:
        after ``work`` (its FILLED on their way first). Whether it wrote any."""
        wrote = False
        for job in list(self.jobs.values()):
            writing = sum(not entry[3] for entry in job.in_flight.values())
            if job.granted and writing < WRITE_AHEAD:
                self._write_granted(job, WRITE_AHEAD - writing)
                wrote = True
        return wrote

    def _write_granted(self, job: LandingJob, lanes: int) -> None:
        for _ in range(min(lanes, len(job.granted))):
            lane = job.granted.popleft()
            first, end = job.splits.popleft()
            lengths = job.lengths[first:end]
            offsets = lane * job.lane_bytes + np.concatenate(([0], np.cumsum(lengths[:-1].astype(np.int64))))
            try:
                sent = job.post(job.src[first:end], offsets, lengths, _native.lane_imm(lane),
                                max(job.deadline - time.monotonic(), 1e-3))
            except fi.FabriclabError as exc:
                self._release(job.target, job.number, lane)
                self._fail(job, None, "engine", cause=exc)
                return
            job.posted.append(sent)
            job.in_flight[lane] = [first, end, sent, False]
            # its FILLED goes as soon as the writes are done: the thread that resolves them wakes this one
            # (the base class's callbacks run there, AwaitableFuture's on a thread of their own)
            concurrent.futures.Future.add_done_callback(sent, self._wake)

    def copied(self, target: int, number: int, lane: int) -> None:
        job = self._job(target, number)
        if job is None:
            return
        entry = job.in_flight.get(lane)
        if entry is None or not entry[3]:
            raise BadMessage(f"COPIED for lane {lane}, which job {number:#x} did not fill")
        del job.in_flight[lane]
        if not job.splits and not job.in_flight:
            self._ended(job, forgotten=True)  # the target let it go before its last COPIED
            job.error = False  # resolved: no second resolution
            job.done(None, True)

    def refused(self, target: int, number: int, lane: int, why: str, text: str) -> None:
        job = self._job(target, number)
        if job is not None:
            self._fail(job, f"the target refused the transfer: {text}", why, forgotten=True)

    def work(self) -> bool:
        busy = False
        now = time.monotonic()
        for job in list(self.jobs.values()):
            if now > job.deadline:
                self._fail(job, "the deadline passed before every page landed in the target's memory (target "
                                "gone or stalled, or its landing lanes all taken?)", "timeout")
                continue
            if now - self.channel.stuck.get(job.target, now) > control.STALL_S and _writing(job):
                self._fail(job, f"no control message reached the target for {control.STALL_S:g} s: it may have taken "
                                "this writer for gone and given its landing lanes to others, so the transfer stops "
                                "rather than write into them", "peer")
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
        while self.lingering and self.lingering[0][0] <= now:
            self._target_forgot(self.lingering.popleft()[1])
        if self.jobs and now - self.last_heartbeat > control.HEARTBEAT_S:
            self.last_heartbeat = now
            self._heartbeat()
        still = []
        for target, number, lane, sent in self.releasing:
            if sent._safety.safe:
                self._release(target, number, lane)
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

    def _fail(self, job: LandingJob, message: str | None, why: str, cause: BaseException | None = None,
              forgotten: bool = False) -> None:
        """Fail the caller's transfer once; its lanes not filled go back to the target once their writes (if
        any) are reported. ``forgotten``: the target ended it (REFUSED)."""
        if job.error is not None:
            return
        self._ended(job, forgotten)
        safe = all(sent.done() and sent._safety.safe for sent in job.posted)
        job.error = self.failure_type(message or str(cause), safe, why, cause)
        job.splits.clear()
        for lane in job.granted:  # nothing written into it: back at once
            self._release(job.target, job.number, lane)
        job.granted.clear()
        for lane, (_, _, sent, filled) in list(job.in_flight.items()):
            if not filled:
                self.releasing.append((job.target, job.number, lane, sent))
        job.in_flight.clear()
        job.done(job.error, safe)
        if not safe:
            self.unsafe.append(job)

    def _ended(self, job: LandingJob, forgotten: bool = False) -> None:
        """The job is no longer running. Remember where its lanes came from: grants may still come for it,
        to give back. ``forgotten``: the target no longer runs it either (else it will, once this engine no
        longer names it in ALIVE: by SILENT_S and a sweep or two)."""
        if self.jobs.pop(job.number, None) is job:
            self._count_peer(job.target_id, -1)
        if job.requested:
            job.requested = False
            if forgotten:
                self._target_forgot(job.target)
            else:
                self.lingering.append((time.monotonic() + control.SILENT_S + 2 * control.HEARTBEAT_S, job.target))
        self.ended[job.number] = job.address
        while len(self.ended) > ENDED_JOBS:
            self.ended.popitem(last=False)
