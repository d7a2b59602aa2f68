"""Staged targets for ``fabriclab.Engine``: peers write into GPU memory the provider cannot register.

A staged target region (``Region.path == "cuda-staged"``) is never registered with the NICs. Its engine
keeps a bounded pool of page-locked host memory cut into *landing lanes* (the staging pool's sizes: a lane
is a staging chunk), registered with every NIC, and the region's descriptor names that pool instead of the
region. A writer asks the target for lanes, writes its pages into them (one write per page, through the
engine's NICs as any write), and says what it wrote where; the target copies each lane's pages to their
place in the region (``cuMemcpyHtoDAsync`` on CUDA streams) and only then counts them for ``expect`` and
tells the writer, whose transfer resolves on that word. A lane goes back to the pool once copied, so a
transfer larger than the pool streams through it, and several writers share it: lanes go round the writers
waiting, each up to an equal share, and a transfer that holds lanes without filling them loses them within
landing_target.FILL_S (how, and the other bounds on what one writer may hold: landing_target).

The words go over a small control channel per engine (``fabriclab.control``: the messages, each checked
as untrusted input, and the endpoint): one more endpoint of the same provider and domain as the engine's
first NIC, serviced by the engine's landing thread. Its address travels in the staged region's descriptor,
so an engine that never has a staged target opens none. FILLED is sent once the writer's writes completed,
which on some providers says only that they left; the target starts copying once the writes themselves
have arrived: each write into lane L carries immediate data of its own (``_native.lane_imm(L)``), counted
by the engine's workers apart from callers' values.

The steps overlap: a writer writes into a few lanes at a time, in order (landing_writer.WRITE_AHEAD), and
says FILLED for each as soon as its writes are done, while the target copies the lanes filled before (on
CUDA streams, or a thread of its own for host memory) and grants freed lanes to the requests waiting; the
landing thread wakes at once for its own events (a job, a lane's writes done, a lane copied) and polls the
control endpoint every POLL_S for the peers' words. So the slowest step sets the pace, not their sum.

A writer may land only where a descriptor it holds allows: asking for lanes takes the region's key (in its
descriptor), a lane is granted for one region, and a FILLED counts only from the writer the lane is leased
to (a transfer is named by a random 64-bit number only it and the target know), for that region, with
every page inside the region and the lane. A writer that breaks a rule has its transfer refused.

Lanes are leased: a lane not filled and copied within the target engine's timeout returns to the pool, and
with it everything of that transfer (its other lanes, the lanes it still waits for); so does every lane of a
transfer that filled none of its lanes for FILL_S, or whose writes into a lane did not arrive within FILL_S
of its FILLED. A writer that is gone
is dropped sooner: one whose control endpoint cannot be reached, or that went silent (writers name their
running transfers to each target every HEARTBEAT_S; SILENT_S without a word and its requests and lanes go).
Pages of a writer that still writes into a lane after losing it could mix with the next writer's: a writer
whose landing thread did not run for STALL_S (stopped, starved) fails the transfers that still had lanes
to write into instead; keep writers' timeouts at most the target's (the timings are ``fabriclab.control``'s).

One landing thread per engine serves both halves: :mod:`fabriclab.landing_target` (the lanes, as a target)
and :mod:`fabriclab.landing_writer` (jobs into peers' staged targets).
"""

from __future__ import annotations

import collections
import secrets
import threading
import time
from collections.abc import Callable
from typing import Any

from . import _native, control, fi, staging
from .control import BadMessage
from .errors import StagingFailed
from .landing_target import LandingTarget, TargetRegion
from .landing_writer import LandingJob, LandingWriter
from .nics import PeerEntries

__all__ = ["Landing", "LandingJob", "TargetRegion", "max_lanes"]

# How often the landing thread polls its control endpoint when it has nothing to do: software providers carry
# a peer's words (GRANT, FILLED, COPIED) only when polled, and nothing else says they came. Its own events (a
# job submitted, a lane's writes done, a lane copied to host memory) wake it at once.
POLL_S = 0.0001         # while transfers run through it, or did lately
IDLE_S = 0.05           # ... "lately"
IDLE_POLL_S = 0.001     # otherwise: the first word of a peer after a quiet spell waits up to this long


def max_lanes(pool_bytes: int, lane_bytes: int) -> tuple[int, int]:
    """(lanes, bytes) of a landing pool: the staging pool's layout, at most MAX_LANES lanes (a lane's number
    rides in the immediate data of its writes)."""
    lanes, _ = staging.pool_layout(pool_bytes, lane_bytes)
    lanes = min(lanes, _native.MAX_LANES)
    return lanes, lanes * lane_bytes


class Landing:
    """The landing thread of one engine, with its control channel: it grants and copies lanes as a target
    (``target``, once the engine has a staged target) and runs writers' jobs into peers' staged targets
    (``writer``). ``failure_type(message, buffer_safe, why, cause)`` makes a failed job's exception."""

    def __init__(self, provider: str, domain: str, engine_id: int, native: _native.NativeEngine,
                 failure_type: Callable[..., BaseException], lease_s: float, entries: PeerEntries) -> None:
        self.channel = control.ControlChannel(provider, domain, unreachable_s=lease_s)
        self.engine_id = engine_id
        self.entries = entries  # the engine's: its writers' NIC addresses entered there (PeerEntries.reached_by)
        self.tidied = time.monotonic()
        self.lock = threading.Lock()
        self.closed = False
        self.closing = threading.Event()  # set with ``closed``: the watcher's wait ends at once
        self.rejected = control.Rejected()
        self.peers: dict[int, int] = {}  # engines it serves or writes to -> how many transfers
        self.wake = threading.Event()  # something for the thread to do: a job, its writes done, a lane copied
        self.target = LandingTarget(self.channel, engine_id, native, self.lock, self._count_peer, lease_s, self.wake,
                                    entries.reached_by)
        # a REQUEST names this engine's NICs only where the provider keeps state for each peer that writes (its
        # targets run the same provider): they enter them (PeerEntries.reached_by)
        nic_addresses = [slot.ep.address().to_bytes() for slot in entries.slots
                         if slot.av.maps_peers][:control.NIC_ADDRESSES]
        self.writer = LandingWriter(self.channel, engine_id, self._count_peer, failure_type, self.wake, nic_addresses)
        self.channel.in_use = lambda: self.target.dests() | self.writer.dests()
        self.handlers: dict[int, Callable[..., None]] = {
            control.REQUEST: self.target.requested, control.FILLED: self.target.filled,
            control.RELEASE: self.target.released, control.ALIVE: self.target.alive,
            control.GRANT: self.writer.granted, control.COPIED: self.writer.copied,
            control.REFUSED: self.writer.refused}
        self.new_jobs: collections.deque[LandingJob] = collections.deque()
        self.outgoing: collections.deque[tuple[bytes, bytes]] = collections.deque()  # send_soon's (address, message)
        self.last_busy = self.last_loop = time.monotonic()
        self.thread = self._start()
        self.watcher = threading.Thread(target=self._watch, name="fabriclab-landing-watch", daemon=True)
        self.watcher.start()

    @property
    def address(self) -> bytes:
        """The control endpoint's address (in staged targets' descriptors)."""
        return self.channel.address

    @property
    def pool(self) -> staging.PinnedPool | None:
        """The landing lanes' pool, once the engine has a staged target."""
        return self.target.pool

    # ------------------------------------------------------------------------- from other threads

    def submit(self, job: LandingJob) -> None:
        job.split()
        job.number = secrets.randbits(64) or 1  # only the writer and its target know it
        if self.channel.dead:
            raise StagingFailed("this engine's control endpoint is stuck in the provider (a read of its completion "
                                "queue never returned), so no staged transfer can be arranged: open a new Engine",
                                buffer_safe=True)
        with self.lock:
            if self.closed:
                raise fi.UsageError("the engine is closed")
            self.new_jobs.append(job)
        self.wake.set()

    def send_soon(self, address: bytes, message: bytes) -> None:
        """Have the landing thread send ``message`` to the control endpoint at ``address`` (from any thread;
        no reply is awaited: a peer that cannot be reached is dropped as any)."""
        self.outgoing.append((address, message))
        self.wake.set()

    def stats(self) -> dict[str, Any]:
        return {"landed_bytes": self.target.landed_bytes, "landed_lanes": self.target.landed_lanes,
                "landing_copy_seconds": round(self.target.copy_seconds(), 6), "landing_jobs": len(self.writer.jobs),
                "bad_control_messages": self.rejected.total, "control_threads_stranded": self.channel.stranded,
                "control_peers": len(self.channel.known), "control_peers_removed": self.channel.removed}

    def close(self, timeout: float = _native.WORKER_EXIT_TIMEOUT) -> None:
        with self.lock:
            self.closed = True
        self.closing.set()
        self.thread.join(timeout)
        self.watcher.join(1.0)
        self.writer.close(list(self.new_jobs))
        if not self.thread.is_alive():
            self.target.close()
            self.channel.close()
            return
        # a thread stuck in a provider call (the watcher stops with the engine) is given up on here as the
        # watcher would: when the call returns it touches nothing, so the lanes' copiers close. Stuck or only
        # slow, it may still be in the channel: never closed, or its lock would hold up the closer for good
        # (at the latest, the process's exit)
        if self.channel.supersede() or self.channel.dead:
            self.target.close()
        self.channel.abandon()

    # --------------------------------------------------------------------------------- the thread

    def _start(self) -> threading.Thread:
        thread = threading.Thread(target=self._run, name="fabriclab-landing", daemon=True)
        thread.start()
        return thread

    def _watch(self) -> None:
        """A landing thread stuck in a send that never returns (ControlChannel.wedged) is replaced: the
        peer it sends to is taken for gone, and the others are served on. One stuck reading the channel's
        completion queue is not: a new one would be stuck the same way (the channel is dead)."""
        while not self.closing.wait(0.25):
            if self.channel.wedged() and self.channel.supersede() and not self.channel.dead:
                self.thread = self._start()  # a send to one peer was stuck: the others are served on

    def _run(self) -> None:
        staging.quick_timers()  # waits of POLL_S, not POLL_S + 50 us
        while not self.closed:
            now = time.monotonic()
            if now - self.last_loop > control.STALL_S:
                self._stalled(now - self.last_loop)
            self.last_loop = now
            self.wake.clear()  # a wake from here on ends the wait below
            try:
                busy = self._serve()
            except control.Superseded:
                return  # another thread serves now: this one was taken for stuck in a send
            except Exception:  # a bug of ours: say so, keep serving
                control.log.exception("the landing thread hit an error; it goes on")
                busy = False
            now = time.monotonic()
            if self.entries.reaching and now - self.tidied > control.QUIET_S:  # writers' entries, once gone, go
                self.tidied = now
                self.entries.trim()
            if busy:
                self.last_busy = now
            elif self.writer.jobs or self.target.clients or now - self.last_busy < IDLE_S:
                self.wake.wait(POLL_S)
            else:
                self.wake.wait(IDLE_POLL_S)

    def _serve(self) -> bool:
        busy = self._exchange()
        while self.outgoing:
            address, message = self.outgoing.popleft()
            try:
                self.channel.send(self.channel.peer(address), message)
            except fi.FabriclabError as exc:  # an address that fits no endpoint here: the message cannot go
                control.log.warning("a control message could not be sent: %s", exc)
            busy = True
        with self.lock:
            new, self.new_jobs = list(self.new_jobs), collections.deque()
        busy |= self.writer.start(new)
        busy |= self.target.work()
        busy |= self.writer.work()
        if self.channel.can_send:  # the words just said (GRANT, FILLED, COPIED) go before the writes are posted
            busy |= self._exchange()
        busy |= self.writer.write()
        return busy or self.channel.can_send

    def _exchange(self) -> bool:
        """Send what waits to be sent, serve what arrived: whether anything did."""
        messages, failed = self.channel.progress()
        for message in messages:
            self._dispatch(message)
        for dest in failed:  # a control endpoint that takes no more messages: its writers and targets are gone
            self.target.unreachable(dest)
            self.writer.unreachable(dest)
        return bool(messages)

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
        """The thread did not run for ``gap`` s (its process stopped, or starved of CPU). As a target, it heard
        nobody meanwhile; as a writer, its targets may have taken it for gone (see the halves' ``stalled``)."""
        self.target.stalled(time.monotonic())
        self.writer.stalled(gap)
