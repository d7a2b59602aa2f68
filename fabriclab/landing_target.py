"""The target half of ``fabriclab.landing``: the landing lanes of one engine, granted to writers' transfers,
leased, and copied into their staged target regions once their writes arrived (every message of a writer
checked as untrusted input: a writer lands only where a descriptor it holds allows).

No writer can hold the lanes from the others, whatever it asks for (a sender is a writer's control endpoint):

- Lanes go round the senders waiting, one at a time each in turn (a sender's own requests in the order it
  asked), each sender up to an equal share of the pool among those waiting; a sender alone may take the
  whole pool. A request may ask for any number of lanes (a transfer larger than the pool streams through
  it), but holds at most its share at once and gets the rest as its lanes come back.
- A transfer holding lanes must fill one at least every FILL_S (from its last FILLED, or from being granted
  lanes while it held none unfilled), and a lane's writes must arrive within FILL_S of its FILLED; if not, it
  loses every lane and request (REFUSED, "timeout"). ALIVE keeps a waiting request queued and a silent writer
  from being taken for gone; it never lengthens a lane's time. A lane's lease (the engine's timeout) still
  bounds it from grant to copy.
- A sender runs at most control.REQUESTS_PER_SENDER transfers at once at a target: a REQUEST beyond that is
  refused (writers keep to it: landing_writer holds further transfers back until one ends).
So a writer that takes lanes and never fills them holds them FILL_S, not a lease, and never the share of a
sender waiting beside it; its queued requests wait their turn behind the other senders', not before. (Each
bound is per control endpoint: a local user who opens many endpoints, each a real one, counts as many.)"""
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

FILL_S = 5.0  # a transfer holding lanes fills one at least this often; a lane's writes arrive this soon after FILLED


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
    """A writer's transfer as the target serves it: whose, where its control endpoint is (its sender), the
    region its lanes are for, how many more lanes it waits for and which it holds, when the writer last spoke,
    and when the transfer last made progress (a FILLED, or lanes granted while it held none unfilled)."""
    writer: int
    job: int
    dest: int
    region_id: int
    wanted: int
    heard: float
    lanes: set[int] = field(default_factory=set)
    progress: float = 0.0


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


class _Senders:
    """The senders of a target's transfers (writers' control endpoints, by fi_addr): the requests of each
    waiting for lanes, in order, the senders in the order of their turns; how many lanes each holds, how many
    transfers each runs (the policy: the module's docstring)."""

    def __init__(self) -> None:
        self.waiting: dict[int, collections.deque[_Client]] = {}
        self.holding: collections.Counter[int] = collections.Counter()
        self.running: collections.Counter[int] = collections.Counter()

    def join(self, client: _Client) -> bool:
        """Queue a new transfer's request; False (not queued) when its sender runs REQUESTS_PER_SENDER here."""
        if self.running[client.dest] >= control.REQUESTS_PER_SENDER:
            return False
        self.running[client.dest] += 1
        self.waiting.setdefault(client.dest, collections.deque()).append(client)
        return True

    def turns(self, free: int, pool: int) -> list[_Client]:
        """The transfers that get the next ``free`` lanes of a ``pool``, in order (fewer when each sender
        waiting holds its share): a lane at a time to each sender waiting in turn (its oldest request first),
        each up to an equal share of the pool among them. Counted as theirs; a request served in full leaves."""
        served: list[_Client] = []
        while len(served) < free and self.waiting:
            share = -(-pool // len(self.waiting))
            turns = [dest for dest in self.waiting if self.holding[dest] < share][:free - len(served)]
            if not turns:
                break
            for dest in turns:
                queue = self.waiting.pop(dest)
                served.append(queue[0])
                self.holding[dest] += 1
                queue[0].wanted -= 1
                if not queue[0].wanted:
                    queue.popleft()
                if queue:
                    self.waiting[dest] = queue  # its next turn after the others'
        return served

    def unqueue(self, client: _Client) -> None:
        """A request that waited leaves the queue (its transfer was dropped)."""
        queue = self.waiting[client.dest]
        queue.remove(client)
        if not queue:
            del self.waiting[client.dest]

    def lane_back(self, dest: int) -> None:
        """A lane sender ``dest`` held is back in the pool."""
        _less(self.holding, dest)

    def ended(self, dest: int) -> None:
        """A transfer of sender ``dest`` no longer runs here."""
        _less(self.running, dest)


def _less(counter: collections.Counter[int], dest: int) -> None:
    """One less for sender ``dest``, which leaves ``counter`` at none."""
    counter[dest] -= 1
    if not counter[dest]:
        del counter[dest]


class LandingTarget:
    """The lanes of one engine as a staged target (run on its landing thread, ``fabriclab.landing.Landing``):
    grants them, leases them, copies the pages written into them to their place, and answers the writers."""

    def __init__(self, channel: control.ControlChannel, engine_id: int, native: _native.NativeEngine,
                 lock: threading.Lock, count_peer: Callable[[int, int], None], lease_s: float,
                 wake: threading.Event, reached_by: Callable[[list[bytes]], None]) -> None:
        self.channel, self.engine_id, self.native, self.lock, self.wake = channel, engine_id, native, lock, wake
        self.reached_by = reached_by  # a writer granted lanes writes through its NICs: PeerEntries.reached_by
        self._count_peer, self.lease_s, self.fill_s = count_peer, lease_s, min(FILL_S, lease_s)
        self.pool: staging.PinnedPool | None = None
        self.lanes: list[_Lane] = []
        self.free: collections.deque[int] = collections.deque()
        self.clients: dict[tuple[int, int], _Client] = {}
        self.senders = _Senders()
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
        from ``now``, and FILL_S to fill a lane, or for a lane's writes to arrive."""
        for client in self.clients.values():
            client.heard = client.progress = now
        for lane in self.lanes:
            if lane.copies is not None:
                lane.lease_ends = max(lane.lease_ends, now + self.fill_s)

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

    def requested(self, writer: int, job: int, region_id: int, key: int, wanted: int, address: bytes,
                  nic_addresses: list[bytes]) -> None:
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
        if not self.senders.join(client):
            self._refuse(client, "engine", f"a writer runs at most {control.REQUESTS_PER_SENDER} transfers at once "
                                           "at a staged target, and this one already runs that many here")
            return
        self.clients[writer, job] = client
        self._count_peer(writer, 1)
        self.reached_by(nic_addresses)

    def _grant(self) -> bool:
        """Free lanes to the transfers whose turn it is (_Senders.turns); one GRANT per transfer served."""
        grants: dict[_Client, list[int]] = {}
        now = time.monotonic()
        for client in self.senders.turns(len(self.free), len(self.lanes)):
            if all(self.lanes[n].copies is not None for n in client.lanes):
                client.progress = now  # its clock to fill a lane starts now
            lane = self.lanes[self.free.popleft()]
            lane.owner, lane.lease_ends, lane.copies, lane.copier = client, now + self.lease_s, None, None
            client.lanes.add(lane.number)
            grants.setdefault(client, []).append(lane.number)
        for client, lanes in grants.items():
            self._reply(client, control.GRANT, np.asarray(lanes, "<u2").tobytes())
        return bool(grants)

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
        client.progress = time.monotonic()
        lane.lease_ends = min(lane.lease_ends, client.progress + self.fill_s)  # its writes are on their way

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
        self.senders.lane_back(client.dest)
        if not client.lanes and not client.wanted:
            self._forget(client)

    def _forget(self, client: _Client) -> None:
        if self.clients.get((client.writer, client.job)) is client:
            del self.clients[client.writer, client.job]
            self._count_peer(client.writer, -1)
            self.senders.ended(client.dest)

    def _drop(self, client: _Client, refuse: tuple[str, str] | None = None) -> None:
        """End a writer's transfer here, telling it ``refuse`` (why, text) if it may still listen: its request
        leaves the queue and its lanes come back (those being copied once their copy is done)."""
        if refuse is not None:
            self._refuse(client, *refuse)
        if client.wanted:
            client.wanted = 0
            self.senders.unqueue(client)
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
            elif lane.copies is None and now > lane.owner.progress + self.fill_s:
                self._drop(lane.owner, ("timeout", f"lane {lane.number} was not filled: the transfer filled none of "
                                                   f"its lanes for {self.fill_s:g} s (a transfer holding lanes must "
                                                   f"fill one every {self.fill_s:g} s)"))
                busy = True
            elif now > lane.lease_ends:
                self._drop(lane.owner, ("timeout", f"lane {lane.number} was not filled within its lease of "
                                                   f"{self.lease_s:g} s" if lane.copies is None else
                                                   f"the writes into lane {lane.number} did not arrive within "
                                                   f"{self.fill_s:g} s of its FILLED"))
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
            f"the target cannot count imm {lane.imm}: every one of the immediate values it counts at once "
            f"({self.native.immediates_usage()['most']}) is awaited by an expect()")

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

