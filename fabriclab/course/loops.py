"""Build-it-yourself loops against the modeled p5 (lessons 09-15's exercises): ``ModelNics``, a set of model
NICs in this process for writing a chapter's loop by hand, and ``posting_loop``, chapters 14 and 15's posting
loop as the article wrote it, counting its calls (``LoopCounts``). ``fabriclab.course.lesson`` re-exports them.
"""
from __future__ import annotations

import collections
import time
from dataclasses import dataclass
from typing import Callable

from .. import fi
from .chapters import MODEL
from .showing import LocalPair


class ModelNics:
    """``count`` NICs of the modeled p5 in this process, for writing a chapter's loop yourself: slot *i* is a
    writer endpoint and a target endpoint on model NIC *i* (lessons 09-12's build-it-yourself exercises).
    ``post(i)`` tries one write of ``page_size`` bytes on slot *i* (False when the NIC's queue refused it,
    -FI_EAGAIN); ``poll(i)`` reads slot *i*'s completion queue once and returns how many writes completed.
    Each slot keeps its own counts (``posted``, ``completed``, ``cq_reads``), so threads that own disjoint
    slots may drive them at once. ``measure(loop, writes)`` times ``loop(nics, writes)`` and checks that
    every write completed once. A context manager."""

    def __init__(self, count: int = 4, page_size: int = 64 << 10, timeout: float = 30.0):
        domains = [info.domain for info in fi.domains(MODEL)]
        if not 0 < count <= len(domains):
            raise fi.UsageError(f"the model has {len(domains)} NICs: ask for 1 to {len(domains)}, got {count}")
        if page_size <= 0:
            raise fi.UsageError(f"page_size must be positive, got {page_size}")
        self.count, self.page_size, self.timeout = count, page_size, timeout
        self.slots: list[LocalPair] = []
        try:
            for name in domains[:count]:
                self.slots.append(LocalPair(MODEL, name, size=page_size, timeout=timeout))
        except BaseException:
            self.close()
            raise
        nic = self.slots[0].info.nic
        self.line_gbps = count * (nic.link_speed_bps / 1e9 if nic and nic.link_speed_bps else 100.0)
        self._remote = [s.inbox_mr.remote() for s in self.slots]
        self.deadline = float("inf")
        self.reset()

    def reset(self) -> None:
        self.posted = [0] * self.count
        self.completed = [0] * self.count
        self.cq_reads = [0] * self.count

    def post(self, i: int) -> bool:
        """Try one write on slot ``i``; False if its queue is full (-FI_EAGAIN): poll, then try again."""
        s = self.slots[i]
        if not s.sender.ep.try_post_write(s.outbox_mr, 0, self.page_size, s.dest, self._remote[i], 0, i):
            return False
        self.posted[i] += 1
        return True

    def poll(self, i: int) -> int:
        """Read slot ``i``'s completion queue once (fi_cq_read): how many of its writes completed."""
        if time.monotonic() > self.deadline:
            raise fi.FabricTimeout(f"your loop's writes on {self.count} model NICs", self.timeout,
                                   f"{sum(self.completed)} of {sum(self.posted)} posted writes completed")
        self.cq_reads[i] += 1
        done = len(self.slots[i].sender.cq.poll())
        self.completed[i] += done
        return done

    def measure(self, loop: Callable[["ModelNics", int], None], writes: int) -> dict:
        """Run ``loop(self, writes)``, which must post ``writes`` writes and poll until all completed;
        returns seconds, writes_per_s, gbps, share (% of the NICs' line rate) and cq_reads_per_write."""
        if writes <= 0:
            raise fi.UsageError(f"writes must be at least 1, got {writes}")
        self.reset()
        self.deadline = time.monotonic() + self.timeout
        start = time.perf_counter()
        try:
            loop(self, writes)
        finally:
            self.deadline = float("inf")
        seconds = time.perf_counter() - start
        posted, completed = sum(self.posted), sum(self.completed)
        if posted != writes or completed != writes:
            raise fi.UsageError(f"the loop posted {posted} and saw {completed} complete, of {writes} writes: it "
                                "must post each write once and poll until every one has completed")
        gbps = writes * self.page_size * 8 / seconds / 1e9
        return {"seconds": seconds, "writes_per_s": writes / seconds, "gbps": gbps,
                "share": 100 * gbps / self.line_gbps, "cq_reads_per_write": sum(self.cq_reads) / writes}

    def close(self) -> None:
        for s in self.slots:
            s.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False



@dataclass
class LoopCounts:
    """What ``posting_loop`` did for ``writes`` writes: passes of its loop, completion-queue reads, calls to
    post a write (``fi_writemsg``), how many of them the provider refused (-FI_EAGAIN), the most writes it
    had in flight at once, and the seconds from the first post to the last completion."""
    writes: int
    passes: int = 0
    polls: int = 0
    calls: int = 0
    refused: int = 0
    most_in_flight: int = 0
    seconds: float = 0.0

    def per_write(self, name: str) -> float:
        return getattr(self, name) / max(1, self.writes)


def posting_loop(pair: LocalPair, writes: int, batch: int = 16, lazy: bool = False, size: int = 1 << 20,
                 ring: int = 64) -> LoopCounts:
    """Chapters 14 and 15's posting loop, in Python against one endpoint pair (``LocalPair``), as the
    article wrote it: no count of writes in flight, so a refusal (-FI_EAGAIN) is the only sign that the
    provider's queue is full. Each pass reads the completion queues and, where that made room (or nothing is
    in flight), posts from the head of the pending queue until the provider refuses; then it adds up to
    ``batch`` writes of ``size`` bytes to the pending queue, which holds at most ``ring`` (as the engine's
    ring). Before chapter 15 (``lazy`` False) every added write also tries to post at once."""
    count = LoopCounts(writes)
    pending: collections.deque = collections.deque()
    done = added = posted = 0

    def post_pending() -> None:
        nonlocal posted
        while pending:
            count.calls += 1
            if not pair.post_write(("loop", pending[0]), size, retry=False):
                count.refused += 1  # -FI_EAGAIN: the head stays, and everything behind it
                return
            pending.popleft()
            posted += 1
            count.most_in_flight = max(count.most_in_flight, posted - done)

    start = time.perf_counter()
    deadline = time.monotonic() + pair.timeout
    while done < writes:
        count.passes += 1
        count.polls += 1
        got = pair.poll()
        done += got
        if got or posted == done:
            post_pending()  # right after the completions made room: chapter 15's only post
        for _ in range(min(batch, writes - added, ring - len(pending))):
            pending.append(added)
            added += 1
            if not lazy:
                post_pending()  # chapters 14 and before: every added write tries the provider at once
        if time.monotonic() > deadline:
            raise fi.FabricTimeout(f"{writes - done} of {writes} writes completing", pair.timeout)
    count.seconds = time.perf_counter() - start
    pair.trace.clear()
    return count
