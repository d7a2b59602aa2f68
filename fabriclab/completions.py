"""The engine's book of what is in flight, and the reaper thread that settles it (``fabriclab.service``).

The native engine counts each transfer's writes into a shared array (``_native.TRANSFER_FIELDS`` per id) and
wakes the reaper when a transfer finished; the reaper resolves its future, enforces deadlines, counts
expected immediate data (and drops the pages nobody expected for the engine's timeout) and deregisters
closed regions once no write can touch them."""
from __future__ import annotations

import concurrent.futures
import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from . import _native, shmclean
from .errors import PeerLost, RegionClosed, TransferError, TransferTimeout, write_failure
from .nics import unique_registrations
from .transfer import Transfer

TRANSFER_SLOTS = 1 << 16
LOST_WARNING_S = 10.0  # the most often the engine warns of immediate data it could not count, or dropped
EXPIRE_S = 0.5  # how often the reaper drops the pages nobody expected for the engine's timeout
PEER_CHECK_S = 0.25  # how often the reaper looks whether the peers of running transfers are gone (a few /proc reads)
log = logging.getLogger("fabriclab")


class RegionState:
    """What the engine's service keeps of a region while transfers use it: its registrations and how many
    transfers may still read it. No reference back to the Engine, so a dropped Engine can be collected."""

    def __init__(self, registrations: list[Any]) -> None:
        self.registrations = registrations
        self.in_use = 0  # transfers whose writes may still read the region
        self.closed = False

    def deregister(self) -> None:
        for reg in unique_registrations(self.registrations):
            reg.close()


# An expect(): (imm, count, future, deadline)
Expectation = tuple[int, int, "concurrent.futures.Future[int]", float]


class Completions:
    """Transfers in flight (by transfer id), expectations of immediate data and regions waiting to be
    deregistered, under ``lock`` (the service's: the native engine is freed under it); and the reaper thread
    that settles them. Pages of a value nobody expects are kept ``unexpected_s`` (the engine's timeout) for an
    expect() to come. It holds no reference to the Engine."""

    def __init__(self, native: _native.NativeEngine, lock: threading.Lock, link_timeout: float,
                 unexpected_s: float) -> None:
        self.native, self.lock, self.link_timeout, self.unexpected_s = native, lock, link_timeout, unexpected_s
        self.transfers = native.attach_transfers(TRANSFER_SLOTS)
        # A transfer id is free again only once the native engine has reported every write of it finished
        # and none it gave up on still posted: until then the engine may count writes against it.
        self.free_ids = list(range(TRANSFER_SLOTS - 1, -1, -1))
        self.in_use: dict[int, tuple[Transfer, RegionState, _native.Routes]] = {}
        self.expectations: list[Expectation] = []
        # immediate data not counted and values dropped, as last warned of; when
        self.lost_warned = (0, 0, -LOST_WARNING_S)
        self.last_expiry = 0.0  # when the reaper last dropped the pages nobody expected for unexpected_s
        self.retired_regions: list[RegionState] = []
        self.next_deadline = float("inf")  # the earliest deadline the reaper has to look at
        self.peers_checked = 0.0  # when the reaper last looked for transfers to peers that are gone
        self.closed = False
        self.thread: threading.Thread | None = None

    def start(self, cores: frozenset[int] | None, finish: Callable[[], None]) -> None:
        """Start the reaper, on ``cores`` (None: where it is); ``finish()`` runs on it if it is told to stop
        from itself (the Engine collected on it)."""
        self.thread = threading.Thread(target=self._reap, args=(cores, finish), name="fabriclab-engine-reaper",
                                       daemon=True)
        self.thread.start()

    def counters(self, tid: int) -> tuple[int, int, int]:
        """(writes left, first error, abandoned writes still posted) of transfer id ``tid``."""
        at = _native.TRANSFER_FIELDS * tid
        left, error, abandoned = self.transfers[at:at + 3].tolist()
        return left, error, abandoned

    def track(self, transfer: Transfer, state: RegionState, routes: _native.Routes) -> int:
        """A transfer id for ``transfer`` (its writes counted from now); the caller holds the lock."""
        if not self.free_ids:
            raise TransferError("too many transfers in flight", buffer_safe=True)
        tid = self.free_ids.pop()
        fields = _native.TRANSFER_FIELDS
        self.transfers[fields * tid:fields * (tid + 1)] = (transfer.writes, 0, 0, 0)
        self.in_use[tid] = (transfer, state, routes)
        state.in_use += 1
        self.deadline(transfer.deadline)
        return tid

    def finish_here(self, tid: int, transfer: Transfer, seconds: float) -> None:
        """The caller waits for ``transfer`` (id ``tid``): look for its end on the caller's thread for up to
        ``seconds`` and settle it there, which saves waking the reaper and a hand-over between threads; where
        it has not ended by then, the reaper settles it as usual."""
        entry = self.in_use.get(tid)
        if entry is not None and entry[0] is transfer and self.native.wait_transfer(tid, seconds):
            self._settle(tid)

    def deadline(self, when: float) -> None:
        """The reaper looks again by ``when``; the caller holds the lock."""
        if when < self.next_deadline:
            self.next_deadline = when
            self.native.wake()

    def expect(self, imm: int, count: int, future: concurrent.futures.Future[int], deadline: float) -> None:
        """Count ``imm`` for ``future``; the caller holds the lock and awaited ``imm`` with the native engine."""
        self.expectations.append((imm, count, future, deadline))
        self.next_deadline = min(self.next_deadline, deadline)

    def still_running(self, state: RegionState) -> int:
        """How many of the transfers that hold ``state``'s region may still complete: those whose future has not
        resolved. A transfer that failed holds its id (and the region's registration) until the provider
        reports the writes the engine gave up on, which may be never (a write into a dead peer): it ended, and
        nobody waits for it but the registration. The caller holds the lock."""
        ended = sum(1 for transfer, used, _ in self.in_use.values() if used is state and transfer.done())
        return state.in_use - ended

    def retire(self, state: RegionState) -> None:
        """Deregister a closed region once no write can touch it; fail what still uses it with RegionClosed."""
        with self.lock:
            self.retired_regions.append(state)
            self.next_deadline = 0.0
        self.native.wake()

    def fail_all(self) -> list[tuple[Transfer, RegionState, _native.Routes]]:
        """The engine closed: fail every pending transfer and expectation (the caller holds the lock). Returns
        the transfers that were in flight: a stuck worker may still read their buffers and routes."""
        unfinished = list(self.in_use.values())
        for tid, (transfer, _, _) in self.in_use.items():
            left, _, abandoned = self.counters(tid)
            safe = left <= 0 and abandoned <= 0
            transfer._fail(TransferError(f"the engine was closed with {left} of {transfer.writes} writes of the "
                                         "transfer unfinished", buffer_safe=safe, safety=transfer._safety))
            transfer._safety.settle(safe)
        self.in_use.clear()
        for _, _, future, _ in self.expectations:
            if not future.done():
                future.set_exception(TransferError("the engine was closed", buffer_safe=True, about_buffer=False))
        self.expectations.clear()
        self.retired_regions.clear()
        return unfinished

    def pending(self) -> tuple[int, int, int]:
        """(transfers not done, done but with writes still posted, expectations)."""
        with self.lock:
            pending = sum(not t.done() for t, _, _ in self.in_use.values())
            return pending, len(self.in_use) - pending, len(self.expectations)

    # ------------------------------------------------------------------------------- the reaper

    def _reap(self, cores: frozenset[int] | None, finish: Callable[[], None]) -> None:
        """Resolve futures as the native engine reports transfers finished (it wakes this thread, which
        waits without the GIL); enforce deadlines; count expected immediate data. Whatever goes wrong in
        one item fails that item's future: the thread itself never dies while the engine is open."""
        if cores:
            os.sched_setaffinity(0, cores)  # this thread only
        while not self.closed:
            try:
                with self.lock:
                    busy = self.in_use or self.expectations
                    wait = min(max(self.next_deadline - time.monotonic(), 0.0), 0.05) if busy else 0.05
                finished = self.native.wait(wait)
                if finished is None:  # notices were lost: every transfer may have finished
                    with self.lock:
                        finished = list(self.in_use)
                for tid in finished:
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
                if now > self.last_expiry + EXPIRE_S:
                    self.last_expiry = now
                    self.native.expire_immediates(self.unexpected_s)
                self._warn_of_lost_counts(now)
                self._fail_for_gone_peers(now)
            except Exception:  # a bug of ours: keep serving the other transfers, and say so
                log.exception("the engine's reaper hit an error; it goes on")
                time.sleep(0.01)
        finish()

    def _guarded(self, work: Callable[..., None], item: Any, *args: Any) -> None:
        """Run one item's work; if it fails, fail that item's future with the reason."""
        try:
            work(item, *args)
        except Exception as exc:
            expectation = isinstance(item, tuple)  # an expect(): it reads no buffer
            future = item[2] if expectation else self.in_use.get(item, (None,))[0]
            log.exception("the engine failed to account for a transfer")
            if future is not None and not future.done():
                future.set_exception(TransferError(f"the engine failed to account for this "
                                                   f"{'expectation' if expectation else 'transfer'}: {exc!r}",
                                                   buffer_safe=expectation, about_buffer=not expectation))

    def _settle(self, tid: int) -> None:
        """Transfer ``tid`` was reported (to the reaper, or to a caller that looked for it): resolve its future
        once every write finished; free the id once, in addition, no write it gave up on is still posted (then
        the buffer is safe). Both threads may settle one id at once: the lock lets one free it."""
        with self.lock:
            entry = self.in_use.get(tid)
            if entry is None:
                return  # reported twice; already settled
            left, error, abandoned = self.counters(tid)
            if left > 0:
                return
            transfer, state, _ = entry
            free = abandoned == 0
            if free:
                del self.in_use[tid]
                state.in_use -= 1
                self.free_ids.append(tid)
        self._resolve(transfer, state, error, safe=free)
        if free:
            transfer._safety.settle(True)

    def _check_expectation(self, item: Expectation, now: float) -> None:
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
        """Say so when pages arrived that could not be counted, or were dropped because nobody expected them (at
        most every LOST_WARNING_S seconds)."""
        if now < self.lost_warned[2] + LOST_WARNING_S:
            return
        usage = self.native.immediates_usage()
        lost, dropped = usage["lost"] - self.lost_warned[0], usage["dropped"] - self.lost_warned[1]
        if lost:
            log.warning(
                "%d arrival(s) of immediate data could not be counted (the last carried imm %d): every one of the "
                "values this engine counts at once (%d) was awaited by an expect(). expect() of such a value raises "
                "UsageError; wait for some expectations to finish before adding more", lost, usage["last_lost"],
                usage["most"])
        if dropped:
            log.warning(
                "the pages of %d immediate value(s) that no expect() awaited were dropped (the last: imm %d): "
                "pages nobody expects are kept %g s (the engine's timeout), or until their place is needed for a "
                "newer value when all %d are taken. expect() every value peers write, in time",
                dropped, usage["last_dropped"], self.unexpected_s, usage["most"])
        if lost or dropped:
            self.lost_warned = (usage["lost"], usage["dropped"], now)

    def _fail_for_gone_peers(self, now: float) -> None:
        """Fail with PeerLost the running transfers whose peer, a process of this host, is gone (at most every
        PEER_CHECK_S seconds): no write to it can complete, and a provider may never say so (shm neither
        completes nor fails a write into a dead peer; a worker may even stay stuck inside it). Their ids, and
        their regions' registrations, stay held until the engine reports their writes (or closes)."""
        if now < self.peers_checked + PEER_CHECK_S:
            return
        self.peers_checked = now
        with self.lock:
            running = [(tid, t) for tid, (t, _, _) in self.in_use.items() if not t.done() and t._peer_process]
        gone: dict[tuple[int, int, int], bool] = {}
        for tid, transfer in running:
            process = transfer._peer_process
            assert process is not None  # selected above
            if process not in gone:
                gone[process] = shmclean.process_is_gone(*process)
            left = self.counters(tid)[0]
            if gone[process] and left > 0:
                transfer._fail(PeerLost(
                    f"the peer's process (pid {process[1]}, on this host) is gone: {left} of {transfer.writes} "
                    "writes of the transfer can never complete", buffer_safe=False, safety=transfer._safety))

    def _expire(self, now: float) -> None:
        """Fail pending transfers whose deadline passed or whose region was closed; their ids stay in use
        until the engine reports every write finished and none still posted."""
        with self.lock:
            pending = [(tid, entry) for tid, entry in self.in_use.items() if not entry[0].done()]
            expectations = [x[3] for x in self.expectations]
        earliest = float("inf")
        for tid, (transfer, state, _) in pending:
            if now > transfer.deadline or state.closed:
                left, error, abandoned = self.counters(tid)
                self._resolve(transfer, state, error, safe=left <= 0 and abandoned <= 0, expired=True, left=left)
            else:
                earliest = min(earliest, transfer.deadline)
        with self.lock:
            self.next_deadline = min([earliest, *expectations])

    def _resolve(self, transfer: Transfer, state: RegionState, error: int, safe: bool, expired: bool = False,
                 left: int = 0) -> None:
        if transfer.done():
            return
        safety = transfer._safety
        if error:
            transfer._fail(write_failure(error, self.link_timeout, safe, safety))
        elif expired and state.closed:
            transfer._fail(RegionClosed("the region was closed while the transfer used it", buffer_safe=safe,
                                        safety=safety))
        elif expired:
            transfer._fail(TransferTimeout(f"{left} of {transfer.writes} writes had not completed by the deadline "
                                           "(peer gone or stalled?)", buffer_safe=safe, safety=safety))
        else:
            transfer._succeed()

    def _retire_regions(self) -> None:
        """Deregister closed regions once no write can still touch them."""
        if not self.retired_regions:  # the common case, without the lock: a region retired now is seen next turn
            return
        with self.lock:
            ready = [r for r in self.retired_regions if r.in_use <= 0]
            self.retired_regions = [r for r in self.retired_regions if r.in_use > 0]
        for state in ready:
            state.deregister()
