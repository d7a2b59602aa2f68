"""Chapters 14–15 — batch posting, then lazy posting: the final stage, the engine.

Until chapter 13 a thread posted one write per group per pass and every pass first polled all its
NICs' completion queues, tying the posting rate to the polling rate. Chapter 14 enqueues up to ``batch``
writes per pass (16 in the article). But each enqueue still tried to post at once: when the head of a
NIC's queue was refused (-FI_EAGAIN), every following enqueue tried and failed again. Chapter 15 only
enqueues, and posts from the completion loop right after a NIC's queue has been drained, when room has
just been made.

One step beyond the article, ``fi_more`` sets FI_MORE on all but the last write of each run posted to a
NIC, telling the provider more is coming so it can ring the NIC's doorbell once per run. The flush
rule: a run always ends in a write without FI_MORE — when the run is complete, when the NIC's queue runs
dry, and when the provider refuses the next write (-FI_EAGAIN) right after an FI_MORE write, in which
case that write is posted again without FI_MORE, reaping completions in between, until it is taken.
Runs are at most 16 writes, far below any provider's queue, so the flush always fits. (NIXL shipped an
FI_MORE hang on EFA and turned it off; this rule is what prevents one.)

    python -m fabriclab.multi_nic serve
    python -m fabriclab.batched connect ADDR --nics 8 --threads 4 [--batch 16] [--no-lazy] [--fi-more]
"""
from __future__ import annotations

from . import cli, fi, multi_nic, threaded
from ._native import MAX_BATCH
from .threaded import ThreadedWriter

DEFAULT_BATCH = 16


class BatchedWriter(ThreadedWriter):
    """ThreadedWriter posting up to ``batch`` writes per pass, lazily; optionally with FI_MORE."""

    stage = "batched"

    def __init__(self, stack, server_address, timeout=fi.DEFAULT_TIMEOUT, *, batch: int = DEFAULT_BATCH,
                 lazy: bool = True, fi_more: bool = False, **kw):
        if batch <= 0:
            raise fi.UsageError(f"batch must be at least 1, got {batch}")
        super().__init__(stack, server_address, timeout, **kw)
        self.batch, self.lazy, self.fi_more = batch, lazy, fi_more

    @classmethod
    def options_from_args(cls, args) -> dict:
        """Chapters 11-13's options plus this stage's own."""
        return {**super().options_from_args(args), "batch": args.batch, "lazy": args.lazy, "fi_more": args.fi_more}

    def switches(self) -> dict:
        return {**super().switches(), "batch": self.batch, "lazy": int(self.lazy), "fi_more": int(self.fi_more)}


def add_batch_options(parser) -> None:
    """Chapters 11-13's options plus posting's (chapters 14-15): every stage's, as the final stage takes all."""
    threaded.add_thread_options(parser)
    options = parser.add_argument_group("posting (chapters 14-15)")
    options.add_argument("--batch", type=cli.count("writes enqueued per pass", MAX_BATCH), default=DEFAULT_BATCH,
                         help="writes enqueued per pass (default %(default)s)")
    options.add_argument("--no-lazy", dest="lazy", action="store_false", help="chapter 14: post on every enqueue")
    options.add_argument("--fi-more", action="store_true", help="FI_MORE on all but the last write of each run")


def build_parser():
    return multi_nic.build_parser(add_batch_options, __doc__)


def main(argv=None) -> int:
    return multi_nic.main(argv, BatchedWriter, build_parser())


if __name__ == "__main__":
    cli.run(main)
