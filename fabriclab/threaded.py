"""Chapters 11–13 — one thread per GPU group, pinned near its NICs, with sharded state.

Chapter 9's single thread could not keep 32 NICs busy. Chapter 11 gives every GPU group its own thread
(each owns its NICs outright, so no NIC is shared), but the threads still bump shared atomic counters
and the operating system moves them between cores. Chapter 12 pins each thread to one core near its
NICs (from ``fabriclab.topology``); chapter 13 replaces the shared counters with one slot per thread.
The article's slots still share a cache line; ``pad`` goes one step further and gives each its own.

    python -m fabriclab.multi_nic serve
    python -m fabriclab.threaded connect ADDR --nics 8 --threads 4 [--no-pin] [--no-shard] [--no-pad]
"""
from __future__ import annotations

import os

from . import cli, fi, multi_nic
from ._fabric import lib
from .multi_nic import MultiNicWriter


class ThreadedWriter(MultiNicWriter):
    """MultiNicWriter with ``threads`` worker threads, one per GPU group."""

    stage = "threaded"

    def __init__(self, stack, server_address, timeout=fi.DEFAULT_TIMEOUT, *, threads: int = 1, pin: bool = True,
                 shard: bool = True, pad: bool = True, **kw):
        if threads <= 0:
            raise fi.UsageError(f"threads must be at least 1, got {threads}")
        if threads > os.cpu_count():
            raise fi.UsageError(f"{threads} threads is more than this machine's {os.cpu_count()} cores")
        kw.setdefault("groups", threads)
        super().__init__(stack, server_address, timeout, **kw)
        self.thread_count, self.pin, self.shard, self.pad = threads, pin, shard, pad

    @classmethod
    def options_from_args(cls, args) -> dict:
        """Chapters 9-10's options with --threads as the number of GPU groups, plus this stage's own."""
        if args.groups not in (1, args.threads):  # 1: --groups' default, i.e. not given
            raise fi.UsageError(f"--groups {args.groups} with --threads {args.threads}: from chapter 11 on every "
                                "GPU group has a thread of its own, so --threads sets the groups; drop --groups")
        return {**super().options_from_args(args), "groups": args.threads, "threads": args.threads,
                "pin": args.pin, "shard": args.shard, "pad": args.pad}

    def switches(self) -> dict:
        return {**super().switches(), "threads": self.thread_count, "groups": self.thread_count,
                "pin": int(self.pin), "shard": int(self.shard), "pad": int(self.shard and self.pad)}


def add_thread_options(parser) -> None:
    """Chapters 9-10's options plus the worker threads' (chapters 11-13)."""
    multi_nic.add_engine_options(parser)
    options = parser.add_argument_group("threads (chapters 11-13 on)")
    options.add_argument("--threads", default=1,
                         type=cli.count("threads", lambda: min(os.cpu_count() or 1, lib.FL_MAX_THREADS),
                                        "at most one per core of this machine: a worker thread polls without rest"),
                         help="worker threads, one per GPU group, at most one per core (default %(default)s)")
    options.add_argument("--no-pin", dest="pin", action="store_false", help="chapter 11: let the OS place threads")
    options.add_argument("--no-shard", dest="shard", action="store_false",
                         help="chapters 11-12: shared atomic counters")
    options.add_argument("--no-pad", dest="pad", action="store_false",
                         help="chapter 13 as the article: per-thread counters packed into one cache line")


def build_parser():
    return multi_nic.build_parser(add_thread_options, __doc__)


def main(argv=None) -> int:
    return multi_nic.main(argv, ThreadedWriter, build_parser())


if __name__ == "__main__":
    cli.run(main)
