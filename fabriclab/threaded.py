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

import argparse
import os
from typing import Any

from . import cli, fi, multi_nic, nics
from ._native import MAX_THREADS
from .multi_nic import MultiNicWriter


#: The target's threads (multi_nic.MultiNicTarget): one polls every NIC, as the article's receiver did.
TARGET_THREADS = 1
#: The article's writer threads: one per GPU of a p5.
ARTICLE_THREADS = 8


def writer_threads(groups: int | None = None, provider: str | None = None) -> tuple[int, str]:
    """How many writer threads drive ``groups`` GPU groups (None: as many groups as fit, at most the
    article's 8) so that they and the target's thread never outnumber the cores this process may use
    (os.sched_getaffinity; the course's target runs on this host, and each of these threads polls without
    rest): a thread per group while the cores last, then groups share threads. On the modeled host
    (``provider`` sim, nics.modeled_host) a thread per group, the article's 8 by default, whatever the
    cores here: its time is each thread's own CPU time. Returns (threads, why)."""
    cores = len(os.sched_getaffinity(0))
    if nics.modeled_host(provider):
        groups = ARTICLE_THREADS if groups is None else groups
        return groups, (f"{groups} writer thread(s) for {groups} GPU group(s) + {TARGET_THREADS} target thread on "
                        f"the modeled p5 (modeled time: each thread's own CPU time, so the {cores} core(s) here "
                        "bound neither the threads nor the figures)")
    room = max(1, cores - TARGET_THREADS)
    groups = min(room, ARTICLE_THREADS) if groups is None else groups
    threads = min(groups, room)
    why = (f"{cores} core(s) here: {cores - TARGET_THREADS} for writer threads, {TARGET_THREADS} for the target's"
           if cores > TARGET_THREADS else f"{cores} core here, which the writer's thread and the target's share")
    if threads < groups:
        why += f"; {groups} GPU groups share them"
    elif threads < ARTICLE_THREADS and threads == room:
        why += f" (the article's {ARTICLE_THREADS} GPU threads would need {ARTICLE_THREADS + TARGET_THREADS})"
    return threads, f"{threads} writer thread(s) for {groups} GPU group(s) + {TARGET_THREADS} target thread: {why}"


class ThreadedWriter(MultiNicWriter):
    """MultiNicWriter with ``threads`` worker threads driving ``groups`` GPU groups (as many as the threads
    unless given: a thread per group; more groups are dealt to the threads). ``sizing`` says so in words.
    From the command line and the bench (options_from_args) --threads sets the groups and writer_threads
    the threads, so that they and the target's thread fit this machine's cores."""

    stage = "threaded"

    def __init__(self, stack: fi.EndpointStack, server_address: str | bytes | fi.Address,
                 timeout: float = fi.DEFAULT_TIMEOUT, *, threads: int = 1, pin: bool = True, shard: bool = True,
                 pad: bool = True, **kw: Any) -> None:
        if threads <= 0:
            raise fi.UsageError(f"threads must be at least 1, got {threads}")
        provider = stack.info.provider
        if threads > (os.cpu_count() or 1) and not nics.modeled_host(provider):
            raise fi.UsageError(f"{threads} threads is more than this machine's {os.cpu_count()} cores")
        kw.setdefault("groups", threads)
        if kw["groups"] < threads:
            raise fi.UsageError(f"{threads} threads need at least as many GPU groups to drive, got {kw['groups']}")
        super().__init__(stack, server_address, timeout, **kw)
        fit, why = writer_threads(self.groups, provider)
        self.sizing = why if fit == threads else (
            f"{threads} writer thread(s) for {self.groups} GPU group(s), as asked, + {TARGET_THREADS} target thread "
            f"on the {len(os.sched_getaffinity(0))} core(s) this process may use")
        self.thread_count, self.pin, self.shard, self.pad = threads, pin, shard, pad

    @classmethod
    def options_from_args(cls, args: argparse.Namespace) -> dict[str, Any]:
        """Chapters 9-10's options with --threads as the number of GPU groups, driven by as many threads as
        fit beside the target's (writer_threads), plus this stage's own."""
        provider = args.provider or fi.default_provider()
        groups = args.threads if args.threads is not None else writer_threads(None, provider)[0]
        if args.groups not in (1, groups):  # 1: --groups' default, i.e. not given
            raise fi.UsageError(f"--groups {args.groups} with --threads {groups}: from chapter 11 on every "
                                "GPU group has a thread of its own, so --threads sets the groups; drop --groups")
        return {**super().options_from_args(args), "groups": groups, "threads": writer_threads(groups, provider)[0],
                "pin": args.pin, "shard": args.shard, "pad": args.pad}

    def switches(self) -> dict[str, Any]:
        return {**super().switches(), "threads": self.thread_count, "groups": self.groups,
                "pin": int(self.pin), "shard": int(self.shard), "pad": int(self.shard and self.pad)}


def add_thread_options(parser: argparse.ArgumentParser) -> None:
    """Chapters 9-10's options plus the worker threads' (chapters 11-13)."""
    multi_nic.add_engine_options(parser)
    options = parser.add_argument_group("threads (chapters 11-13 on)")
    options.add_argument("--threads", default=None,
                         type=cli.count("threads", MAX_THREADS, "the engine's limit"),
                         help="GPU groups, each with a worker thread while the cores last: writer threads and the "
                              f"target's never outnumber the cores this process may use (default: {writer_threads()[0]} "
                              f"here; on the modeled p5, --provider sim, the article's {ARTICLE_THREADS})")
    options.add_argument("--no-pin", dest="pin", action="store_false", help="chapter 11: let the OS place threads")
    options.add_argument("--no-shard", dest="shard", action="store_false",
                         help="chapters 11-12: shared atomic counters")
    options.add_argument("--no-pad", dest="pad", action="store_false",
                         help="chapter 13 as the article: per-thread counters packed into one cache line")


def build_parser() -> argparse.ArgumentParser:
    # multi_nic is not type-checked yet (fabriclab/_native.py's split, issue 24): drop the ignore once it is
    parser: argparse.ArgumentParser = multi_nic.build_parser(  # type: ignore[no-untyped-call]
        add_thread_options, __doc__)
    return parser


def main(argv: list[str] | None = None) -> int:
    return multi_nic.main(argv, ThreadedWriter, build_parser())


if __name__ == "__main__":
    cli.run(main)
