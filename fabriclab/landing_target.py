"""The target half of ``fabriclab.landing``: the landing lanes of one engine, granted to writers' transfers in
the order asked for, leased, and copied into their staged target regions once their writes arrived (every
message of a writer checked as untrusted input: a writer lands only where a descriptor it holds allows)."""
from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from . import _native, control, fi, gpu, staging
from .control import NO_LANE, BadMessage
from .completions import RegionState
from .lanecopy import Copies, CudaCopier, HostCopier, checked_copies



@dataclass(eq=False)
class TargetRegion:
    """A staged target region as the landing thread sees it: where its memory is, the key its descriptor
    holds (asking for lanes takes it), and its engine state (``in_use`` keeps Region.close waiting while a
    copy writes into it)."""
    region_id: int
    kind: str      # "cuda" or "host": which copier
    pointer: int
    length: int
    state: RegionState  # the engine's
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
    lanes: set[int] = field(default_factory=set)


@dataclass(eq=False)
class _Lane:
    number: int
    owner: _Client | None = None
    lease_ends: float = 0.0
    region: TargetRegion | None = None
    imm: int = 0
    pages: int = 0
    copies: Copies | None = None  # FILLED's pages as checked_copies, once filled
    copier: HostCopier | CudaCopier | None = None  # copying with it, once the pages have arrived
    holds_count: bool = False    # holds imm's place in the engine's count until the lane is free


class LandingTarget:
    """The lanes of one engine as a staged target (run on its landing thread, ``fabriclab.landing.Landing``):
    grants them, leases them, copies the pages written into them to their place, and answers the writers."""

    def __init__(self, channel: control.ControlChannel, engine_id: int, native: _native.NativeEngine,
                 lock: threading.Lock, count_peer: Callable[[int, int], None], lease_s: float,
                 wake: threading.Event) -> None:
        self.channel, self.engine_id, self.native, self.lock, self.wake = channel, engine_id, native, lock, wake
        self._count_peer, self.lease_s = count_peer, lease_s
        self.pool: staging.PinnedPool | None = None
        self.lanes: list[_Lane] = []
        self.free: collections.deque[int] = collections.deque()
        self.clients: dict[tuple[int, int], _Client] = {}
        self.requests: collections.deque[_Client] = collections.deque()  # waiting for lanes, in order
        self.regions: dict[int, TargetRegion] = {}
        self.copiers: dict[str, HostCopier | CudaCopier] = {}
        self.landed_bytes = self.landed_lanes = 0
        self.last_sweep = time.monotonic()

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

    # -------------------------------------------------------------------------- on the landing thread

    def stalled(self, now: float) -> None:
        """The landing thread did not run for a while: it heard nobody meanwhile, so its writers get control.SILENT_S
        from ``now``."""
        for client in self.clients.values():
            client.heard = now

    def unreachable(self, dest: int) -> None:
        """A control endpoint that takes no more messages: its writers are gone."""
        for client in [c for c in self.clients.values() if c.dest == dest]:
            self._drop(client)

    def dests(self) -> set[int]:
        """The writers' control endpoints this half still answers."""
        return {client.dest for client in self.clients.values()}

    def copy_seconds(self) -> float:
        return float(sum(c.seconds for c in self.copiers.values()))

    def close(self) -> None:
        for copier in self.copiers.values():
            copier.close()

    def _reply(self, client: _Client, kind: int, body: bytes) -> None:
        self.channel.send(client.dest, control.HEAD.pack(kind, self.engine_id, client.job) + body)

    def _refuse(self, client: _Client, why: str, text: str) -> None:
        self._reply(client, control.REFUSED, control.REFUSED_BODY.pack(NO_LANE, control.WHY.index(why))
                    + text.encode()[:control.TEXT_CHARS])

    def requested(self, writer: int, job: int, region_id: int, key: int, wanted: int, address: bytes) -> None:
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

    def filled(self, writer: int, job: int, region_id: int, number: int, imm: int, entries: np.ndarray) -> None:
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
                assert self.pool is not None  # a lane was leased: the lanes are open
                lane.copies = checked_copies(entries, region, self.pool.chunk_bytes)
        except BadMessage as exc:
            self._drop(client, ("invalid", f"lane {number}'s FILLED is not allowed: {exc}"))
            raise
        if region is None:
            self._drop(client, ("closed", f"region {region_id} was closed while the transfer landed"))
            return
        lane.region, lane.imm, lane.pages = region, imm, entries.size

    def released(self, writer: int, job: int, number: int) -> None:
        _, lane = self._holding(writer, job, number)
        if lane.copies is not None:
            raise BadMessage(f"RELEASE of lane {number}, which it filled")
        self._free_lane(lane)

    def alive(self, writer: int, _job: int, jobs: list[int]) -> None:
        now = time.monotonic()
        for job in jobs:
            client = self.clients.get((writer, job))
            if client is not None:  # else a transfer that just ended, or one whose REQUEST is on its way
                client.heard = now

    def _free_lane(self, lane: _Lane) -> None:
        """Back to the pool; arrivals of its writes counted and not taken are dropped. The owner's transfer
        ends once it holds no lane and waits for none."""
        client = lane.owner
        assert client is not None  # only a leased lane goes back
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

    def _copier(self, device: int | None) -> HostCopier | CudaCopier:
        """The copier into host memory (``device`` None), or into GPU ``device``'s memory (in its context)."""
        kind = "host" if device is None else f"cuda:{device}"
        copier = self.copiers.get(kind)
        if copier is None:
            copier = self.copiers[kind] = HostCopier(self.wake.set) if device is None else CudaCopier(
                len(self.lanes), device)
        return copier

    def work(self) -> bool:
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
        if now - self.last_sweep > control.HEARTBEAT_S:
            self.last_sweep = now
            for client in [c for c in self.clients.values() if now - c.heard > control.SILENT_S]:
                self._drop(client, ("timeout", f"the writer said nothing for {now - client.heard:.1f} s: taken for "
                                               "gone, its transfer was dropped"))
                busy = True
        return busy

    def _start_copy(self, lane: _Lane) -> None:
        owner, region, copies, pool = lane.owner, lane.region, lane.copies, self.pool
        assert owner is not None and region is not None and copies is not None and pool is not None  # filled
        if region.state.closed:
            self._drop(owner, ("closed", f"region {region.region_id} was closed while the transfer landed"))
            return
        why = self._hold_count(lane)
        if why:
            self._drop(owner, ("engine", why))
            return
        try:
            # the device holding the region (which raises if its owner freed it)
            device = staging.pointer_device(region.pointer, region.length) if region.kind == "cuda" else None
            copier = self._copier(device)
            region.state.in_use += 1
            try:
                copier.start(lane.number, pool.pointer + lane.number * pool.chunk_bytes, region.pointer, copies)
            except BaseException:
                region.state.in_use -= 1
                raise
        except gpu.CudaError as exc:
            self._drop(owner, ("cuda", f"the target could not copy to its GPU memory: {exc}"))
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
        owner, region, copies, copier, number = lane.owner, lane.region, lane.copies, lane.copier, lane.number
        assert owner is not None and region is not None and copies is not None and copier is not None  # copying
        try:
            if not copier.finished(number):
                return False
        except gpu.CudaError as exc:
            region.state.in_use -= 1
            lane.copier = None  # done with it: the lane goes back with the others
            self._drop(owner, ("cuda", f"the target could not copy to its GPU memory: {exc}"))
            return True
        if lane.holds_count:  # its place is held: this counts (or, past FL_IMM_MAX_COUNT, marks imm lost)
            self.native.credit_immediates(lane.imm, lane.pages)
        region.state.in_use -= 1
        self.native.wake()
        self.landed_bytes += int(copies[2].sum())
        self.landed_lanes += 1
        self._free_lane(lane)
        self._reply(owner, control.COPIED, control.LANE.pack(number))
        return True

