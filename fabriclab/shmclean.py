"""Reclaim the shared-memory regions libfabric's shm provider leaves in /dev/shm when a process ends without
closing its endpoints (SIGKILL, a crash, the OOM killer).

Every shm endpoint is a file ``/dev/shm/<pid>:<uid>:<index>`` (16 MiB on a default endpoint, much of it
touched and therefore held in memory) that the provider unlinks when the endpoint closes. Nothing unlinks it
after a SIGKILL, and libfabric only reuses such a file when a new endpoint happens to get the same name.

A region is stale, and removed, only when its owner is known to be gone:

* the pid in its name does not exist, or
* that pid exists but belongs to another process: it started more than ``START_SLACK_S`` after the region
  was last modified (a process cannot have made a file before it started) *and* it neither maps the region
  nor holds it open (the owner always maps its region while the endpoint is open). Both must hold, so a clock
  stepped forward cannot make a live owner look like a stranger, and the window between libfabric creating
  the file and mapping it cannot make a creator look like one.

What this cannot see: pids are read in this process's pid namespace. Where /dev/shm is shared with
processes of another pid namespace (a container started with ``--ipc=host`` but its own pids), their
regions would look ownerless; run the cleaner where the owners are visible (the usual container has its
own /dev/shm along with its own pids). Files are also checked to be shm regions: a name of the shape
above and the creator's pid in the region's header (or 0, when it died before finishing the header).

This module imports nothing from the course stages: the Engine, ``info`` and ``clean`` all use it.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import stat
import struct
import time
from dataclasses import dataclass
from pathlib import Path

SHM_DIR = Path("/dev/shm")
#: a process is taken for another process than the region's creator only when it started this much later
#: than the region was last modified (process start times are known to a clock tick, file times to the ns)
START_SLACK_S = 1.0
# The shm provider names an endpoint's region after getpid(), getuid() and the endpoint's index in the process.
_REGION_NAME = re.compile(r"^(?P<pid>[1-9][0-9]*):(?P<uid>[0-9]+):(?P<index>[0-9]+)$")
# struct smr_region begins with version, reserved, flags, then the creator's pid, written last ("set last to
# signal full initialization to peers" in libfabric's smr_create).
_REGION_HEADER = struct.Struct("=BBHi")


@dataclass(frozen=True)
class StaleRegion:
    """One region whose owner is gone: where it is, the pid in its name, the memory it held, and why it is
    taken for stale."""
    path: str
    pid: int
    bytes: int  # memory the region holds (tmpfs pages); freed once no process maps it any more
    reason: str


def find_stale_shm_regions(shm_dir: str | Path = SHM_DIR) -> list[StaleRegion]:
    """The shm-provider regions in ``shm_dir`` whose owner is gone (see the module's notes); removes nothing."""
    found = []
    try:
        names = sorted(os.listdir(shm_dir))
    except OSError:  # no /dev/shm here: nothing can have been left in it
        return []
    for name in names:
        region = _stale_region(Path(shm_dir) / name)
        if region is not None:
            found.append(region)
    return found


def reclaim_stale_shm_regions(dry_run: bool = False, shm_dir: str | Path = SHM_DIR) -> list[StaleRegion]:
    """Remove the shm-provider regions in ``shm_dir`` whose owner is gone; returns those removed (with
    ``dry_run``, those that would be). Never raises for a region it cannot judge or remove: it leaves it."""
    removed = []
    for region in find_stale_shm_regions(shm_dir):
        if dry_run:
            removed.append(region)
            continue
        # Judged again right before the unlink: the file may have been reclaimed by someone else or reused
        # by a new endpoint of the same name since the scan.
        again = _stale_region(Path(region.path))
        if again is None:
            continue
        try:
            os.unlink(again.path)
        except OSError:  # gone already (another cleaner), or not ours to remove (another user's, sticky /dev/shm)
            continue
        removed.append(again)
    return removed


def describe(regions: list[StaleRegion], dry_run: bool = False) -> str:
    """One line: how many stale regions were (or would be) reclaimed, the memory, and the dead pids."""
    if not regions:
        return "no stale shm regions"
    pids = sorted({r.pid for r in regions})
    return (f"{'would reclaim' if dry_run else 'reclaimed'} {len(regions)} stale shm region"
            f"{'s' if len(regions) > 1 else ''} ({_mib(sum(r.bytes for r in regions))}) left by "
            f"pid{'s' if len(pids) > 1 else ''} {', '.join(map(str, pids))}")


# ----------------------------------------------------------------------------------------- judging


def _stale_region(path: Path) -> StaleRegion | None:
    """The region at ``path`` if it is a shm-provider region whose owner is gone, else None."""
    match = _REGION_NAME.match(path.name)
    if match is None:
        return None
    pid = int(match["pid"])
    try:
        # O_NOFOLLOW and O_NONBLOCK: /dev/shm is world-writable, so this may be a link or a fifo put there.
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            return None
        header = os.pread(fd, _REGION_HEADER.size, 0)
    except OSError:
        return None
    finally:
        os.close(fd)
    if len(header) == _REGION_HEADER.size and _REGION_HEADER.unpack(header)[3] not in (0, pid):
        return None  # not a region this module understands: leave it
    reason = _why_owner_is_gone(pid, info)
    if reason is None:
        return None
    return StaleRegion(str(path), pid, info.st_blocks * 512, reason)


def _why_owner_is_gone(pid: int, info: os.stat_result) -> str | None:
    started = _process_start_time(pid)
    if started is None:
        return f"pid {pid} is gone"
    last_modified = max(info.st_mtime_ns, info.st_ctime_ns) / 1e9
    if started <= last_modified + START_SLACK_S:
        return None  # the process may well be the creator
    if _process_uses(pid, info):
        return None
    return (f"pid {pid} is another process (started {started - last_modified:.0f} s after the region was last "
            f"modified, and does not map it)")


# What a start time that cannot be read counts as: so early that the process may be any region's creator.
_LONG_AGO = float("-inf")


def _process_start_time(pid: int) -> float | None:
    """When ``pid`` started, in seconds since the epoch (the file-time clock); None when there is no such pid."""
    try:
        stat_line = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return None
    except OSError:
        return _LONG_AGO
    try:
        # the command name in parentheses may hold spaces and parentheses: fields count from the last ')'
        ticks = int(stat_line.rsplit(")", 1)[1].split()[19])
    except (IndexError, ValueError):
        return _LONG_AGO
    since_start = time.clock_gettime(time.CLOCK_BOOTTIME) - ticks / os.sysconf("SC_CLK_TCK")
    return time.time() - since_start


def _process_uses(pid: int, info: os.stat_result) -> bool:
    """Whether ``pid`` maps the region's file or holds it open; True when that cannot be read (no
    permission), so a region is never removed on a guess."""
    # Compared by device and inode, not by name: the path seen here may differ from the owner's (a mount
    # namespace, /proc/PID/root/...), and a region unlinked meanwhile shows as "(deleted)".
    device = f"{os.major(info.st_dev):02x}:{os.minor(info.st_dev):02x}"
    try:
        with open(f"/proc/{pid}/maps") as maps:
            for line in maps:
                fields = line.split(maxsplit=5)
                if len(fields) >= 5 and fields[3] == device and int(fields[4]) == info.st_ino:
                    return True
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                target = os.stat(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if (target.st_dev, target.st_ino) == (info.st_dev, info.st_ino):
                return True
    except FileNotFoundError:
        return False  # it ended meanwhile
    except (OSError, ValueError):
        return True
    return False


def _mib(nbytes: int) -> str:
    return f"{nbytes / 2**20:.1f} MiB"


# --------------------------------------------------------------------------------------------- CLI


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dry-run", action="store_true", help="list the stale regions, remove nothing")
    p.add_argument("--json", action="store_true", help="one JSON object: the regions and the bytes freed")


def main(args) -> int:
    regions = reclaim_stale_shm_regions(dry_run=args.dry_run)
    if args.json:
        print(json.dumps({"dry_run": args.dry_run, "regions": [vars(r) for r in regions],
                          "bytes": sum(r.bytes for r in regions)}))
        return 0
    for r in regions:
        print(f"{'would remove' if args.dry_run else 'removed'} {r.path} ({_mib(r.bytes)}): {r.reason}")
    print(describe(regions, args.dry_run))
    return 0
