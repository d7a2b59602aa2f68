"""Chapter 7 — an operation queue: many writes in flight.

Chapter 6 waited for each write to complete before posting the next, so the NIC sat idle for a round
trip per page. Here writes go into a queue; the queue posts from its head while fewer than ``depth`` are
in flight, and every completion it reaps makes room for the next. When the provider's own queues are
full it answers -FI_EAGAIN: the operation stays at the head of the queue and is tried again after the
next round of completions, never dropped and never spun on.

    python -m fabriclab.rdma_write serve
    python -m fabriclab.opqueue connect ADDR --page-size 64K --total 256M --in-flight 64
"""
from __future__ import annotations

import collections
import time
from typing import Callable

from . import cli, fi, rdma_write
from .rdma_write import Writer

DEFAULT_IN_FLIGHT = 64


class OperationQueue:
    """Pending operations, posted in order while fewer than ``depth`` are in flight.

    An operation is a callable that posts one thing and returns False when the provider said -FI_EAGAIN.
    ``completed()`` must be called for each of its completions (the dispatcher knows which are ours)."""

    def __init__(self, cq: fi.CompletionQueue, depth: int, dispatch: Callable[[fi.Completion], None]):
        if depth <= 0:
            raise fi.UsageError(f"pages in flight must be at least 1, got {depth}")
        self.cq = cq
        self.depth = depth
        self.dispatch = dispatch
        self.pending: collections.deque[Callable[[], bool]] = collections.deque()
        self.in_flight = 0
        self.eagain = 0

    def submit(self, operation: Callable[[], bool]) -> None:
        self.pending.append(operation)

    def completed(self) -> None:
        self.in_flight -= 1

    def progress(self) -> int:
        """Reap completions, then post from the head of the queue; returns how many completions came."""
        done = self.cq.poll()
        for c in done:
            self.dispatch(c)
        pending = self.pending
        while pending and self.in_flight < self.depth:
            if not pending[0]():
                self.eagain += 1
                break
            pending.popleft()
            self.in_flight += 1
        return len(done)


class QueuedWriter(Writer):
    """Chapter 6's writer with its writes going through an OperationQueue."""

    def __init__(self, stack: fi.EndpointStack, server_address, timeout: float = fi.DEFAULT_TIMEOUT,
                 in_flight: int = DEFAULT_IN_FLIGHT):
        if in_flight <= 0:
            raise fi.UsageError(f"pages in flight must be at least 1, got {in_flight}")
        super().__init__(stack, server_address, timeout)
        self.queue = OperationQueue(stack.cq, in_flight, self.mailbox._on_completion)

    @classmethod
    def options_from_args(cls, args) -> dict:
        """Constructor options from the command line (see add_queue_options) or a bench config."""
        return {**super().options_from_args(args), "in_flight": args.in_flight}

    @property
    def in_flight(self) -> int:
        return self.queue.depth

    @in_flight.setter
    def in_flight(self, depth: int) -> None:
        if depth <= 0:
            raise fi.UsageError(f"pages in flight must be at least 1, got {depth}")
        self.queue.depth = depth

    def _write_completed(self, c: fi.Completion) -> None:
        self.completed += 1
        self.queue.completed()

    def write_pages(self, first: int, count: int) -> None:
        """Keep the queue topped up from a counter and progress it until every write has completed."""
        self.writes_issued += count
        queue = self.queue
        target = self.completed + count
        next_write, end = first, first + count
        post = self.try_post_page
        last_change = time.monotonic()
        eagain_before = queue.eagain
        while self.completed < target:
            while next_write < end and len(queue.pending) < self.in_flight:
                queue.submit(lambda w=next_write: post(w))
                next_write += 1
            if queue.progress():
                last_change = time.monotonic()
                if self.on_progress is not None:
                    self.on_progress(self.completed)
            elif time.monotonic() - last_change > self.timeout:
                raise fi.FabricTimeout(f"completions for {target - self.completed} outstanding writes", self.timeout,
                                       "is the target still running?")
        self.eagain += queue.eagain - eagain_before


def connect(args) -> int:
    paths, stats, report, _ = rdma_write.run_writer(
        lambda stack: QueuedWriter(stack, args.address, args.timeout, **QueuedWriter.options_from_args(args)), args)
    print(f"{stats.writes} writes, {stats.bytes} bytes in {stats.elapsed_s:.3f} s = {stats.gbps:.2f} Gbps "
          f"({args.in_flight} in flight, {stats.eagain} EAGAIN); memory {paths['local']} -> {paths['remote_path']}; "
          f"landed {report.arrivals}, verified {report.verified}")
    return 0 if report.verified else 1


def add_queue_options(parser) -> None:
    """Chapter 6's options plus the queue's depth."""
    rdma_write.add_transfer_options(parser)
    options = parser.add_argument_group("operation queue (chapter 7 on)")
    options.add_argument("--in-flight", type=cli.count("pages in flight"), default=DEFAULT_IN_FLIGHT,
                         help="writes in flight (per NIC from chapter 9 on; default %(default)s)")
    # Writes in flight move bytes far faster than chapter 6's one at a time: the default run is longer.
    parser.set_defaults(total="256M")


def build_parser():
    return rdma_write.writer_parser(__doc__, add_queue_options)


def main(argv=None) -> int:
    return cli.stage_main(build_parser(), rdma_write.serve, connect, argv)


if __name__ == "__main__":
    cli.run(main)
