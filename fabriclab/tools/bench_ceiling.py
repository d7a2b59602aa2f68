"""The bench's ceiling, measured in the same run: what this machine's cores copy per second, as many
threads as the run's, each its own slice of the same bytes, so that a reader without a 100 Gbps NIC still
gets a "% of line rate" that means something."""
from __future__ import annotations

import argparse
import glob
import os

from .. import cli, fi


#: The least a memcpy ceiling copies: at least twice the last-level cache as well (last_level_cache_bytes),
#: so that it streams from memory like a transfer of gigabytes rather than from cache.
COPY_FLOOR_BYTES = 64 << 20


def last_level_cache_bytes() -> int:
    """This machine's last-level caches, every instance counted once (sysfs); 0 where sysfs does not say."""
    instances: dict[str, int] = {}
    deepest = 0
    for cache in glob.glob("/sys/devices/system/cpu/cpu[0-9]*/cache/index[0-9]*"):
        try:
            with open(f"{cache}/level") as f:
                level = int(f.read())
            with open(f"{cache}/size") as f:
                size = cli.positive_size(f.read().strip())
            with open(f"{cache}/shared_cpu_list") as f:
                shared = f.read().strip()
        except (OSError, ValueError, argparse.ArgumentTypeError):
            continue
        if level > deepest:
            deepest, instances = level, {}
        if level == deepest:
            instances[shared] = size
    return sum(instances.values())


def memcpy_rate(nbytes: int, threads: int = 1, repeats: int = 3) -> dict:
    """What the CPU copies per second, the way two processes on one host move bytes over shm (one copy per
    byte, several threads on disjoint buffers): ``threads`` C threads (native/copyrate.c), each pinned to a
    core of its own where there are enough and copying its own slice of ``nbytes`` (at least
    COPY_FLOOR_BYTES and twice the last-level cache; at most 256 MiB a thread), allocated and touched by
    that thread beforehand, all started together ``repeats`` times. Returns {"gbps": the best repeat,
    "runs": every repeat's Gbps, "method": how it was measured, in words}."""
    from .. import _native
    total = max(nbytes, COPY_FLOOR_BYTES, 2 * last_level_cache_bytes())
    per_thread = max(1, min(total // threads, 256 << 20))
    allowed = sorted(os.sched_getaffinity(0))
    cores = [c for c in allowed if c != 0] + [c for c in allowed if c == 0]  # core 0 last, as worker_cores
    runs = _native.memcpy_rate(threads, per_thread, repeats, cores)
    if runs is None:
        raise fi.UsageError(f"the memcpy ceiling could not run {threads} threads x {cli.format_size(per_thread)} "
                            f"(too many threads, or not enough memory): use fewer threads or a smaller size")
    pinned = "each on its own core" if threads <= len(cores) else f"sharing {len(cores)} cores"
    return {"gbps": max(runs), "runs": runs,
            "method": f"C memcpy, {threads} pthread{'s' if threads > 1 else ''} {pinned}, each copying its own "
                      f"warmed {cli.format_size(per_thread)}, started together; best of {repeats}"}


def memcpy_gbps(nbytes: int, threads: int = 1, repeats: int = 3) -> float:
    """memcpy_rate's best repeat, in Gbps."""
    return memcpy_rate(nbytes, threads, repeats)["gbps"]
