"""Reclaim the shared-memory regions libfabric's shm provider leaves in /dev/shm when a process ends without
closing its endpoints (SIGKILL, a crash, the OOM killer).

Every shm endpoint is a file ``/dev/shm/<pid>:<uid>:<index>`` (16 MiB on a default endpoint, much of it
touched and therefore held in memory) that the provider unlinks when the endpoint closes. Nothing unlinks it
after a SIGKILL, and libfabric only reuses such a file when a new endpoint happens to get the same name.

That name is libfabric's, not fabriclab's: any libfabric program on the host makes such files, and its pid is
a pid in the creator's pid namespace. Where /dev/shm is shared across pid namespaces (containers run with
``--ipc=host`` and pids of their own, so that CUDA IPC and shared memory work between them), a live owner in
another namespace looks gone from this one. So there are two levels:

* Automatic (every Engine start, ``python -m fabriclab info``): only what is proven stale *and* fabriclab's.
  While a process has NICs open through ``nics.NicSet`` (every Engine, and the course's engine stages) it keeps
  an owner record beside its regions, an empty file
  ``fabriclab-engine.pidns<inode>.pid<pid>.uid<uid>.start<ticks>`` (its pid namespace, pid, real uid and
  start time in clock ticks after boot). A region ``<pid>:<uid>:<index>`` is reclaimed only when a record made
  in this pid namespace names its pid and uid and that process is gone: no such pid, or the pid now belongs to
  a process that started at another time and neither maps the region nor holds it open (a region last modified
  before the recorded process started is not its either). The record goes with its regions; closing the
  NICs removes it. Records of other pid namespaces and regions no record covers are left alone, silently.
* ``python -m fabriclab clean`` also judges regions no record covers (course stages, other libfabric programs,
  engines of pid namespaces that ended), but only where it sees every owner: in the host's (initial) pid
  namespace, with a /proc of its own that hides no process. There every process's pid in its own namespace
  is known (NSpid), and a region is stale when no process has its pid in any namespace, or each that has is
  another process: it started more than ``START_SLACK_S`` after the region was last modified (a process
  cannot have made a file before it started) *and* it neither maps the region nor holds it open. Elsewhere
  ``clean`` lists such regions as left, says why, and removes them only with ``--force``.

Files are checked to be shm regions: a name of the shape above and the creator's pid in the region's header
(or 0, when it died before finishing the header). This module imports nothing from the course stages: the
Engine, ``info``, ``clean`` and ``doctor`` all use it.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import stat
import struct
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

SHM_DIR = Path("/dev/shm")
#: a process is taken for another process than the region's creator only when it started this much later
#: than the region was last modified (process start times are known to a clock tick, file times to the ns)
START_SLACK_S = 1.0
# The shm provider names an endpoint's region after getpid(), getuid() and the endpoint's index in the process.
_REGION_NAME = re.compile(r"^(?P<pid>[1-9][0-9]*):(?P<uid>[0-9]+):(?P<index>[0-9]+)$")
# struct smr_region begins with version, reserved, flags, then the creator's pid, written last ("set last to
# signal full initialization to peers" in libfabric's smr_create).
_REGION_HEADER = struct.Struct("=BBHi")
_RECORD_PREFIX = "fabriclab-engine."
_RECORD_NAME = re.compile(r"^fabriclab-engine\.pidns(?P<ns>[0-9]+)\.pid(?P<pid>[1-9][0-9]*)\.uid(?P<uid>[0-9]+)"
                          r"\.start(?P<start>[0-9]+)$")
# The kernel's fixed inode numbers of the initial pid and IPC namespaces (PROC_PID_INIT_INO, PROC_IPC_INIT_INO).
_INITIAL_NAMESPACE = {"pid": 0xEFFFFFFC, "ipc": 0xEFFFFFFF}


@dataclass(frozen=True)
class StaleRegion:
    """One region whose owner is gone (or, in ``Cleaning.left``, looks gone from here): where it is, the pid in
    its name, the memory it held, and why."""
    path: str
    pid: int
    bytes: int  # memory the region holds (tmpfs pages); freed once no process maps it any more
    reason: str


@dataclass
class Cleaning:
    """What ``clean`` did: the regions removed (or, dry, to be removed), those it left because their owners
    may be alive where it cannot see, and why it cannot see them ("" when it sees every owner)."""
    removed: list[StaleRegion] = field(default_factory=list)
    left: list[StaleRegion] = field(default_factory=list)
    blind: str = ""


def find_stale_shm_regions(shm_dir: str | Path = SHM_DIR) -> list[StaleRegion]:
    """The regions in ``shm_dir`` that automatic reclamation takes (see the module's notes); removes nothing."""
    return [region for record in _records_of_gone_engines(Path(shm_dir)) for region in record.stale]


def reclaim_stale_shm_regions(dry_run: bool = False, shm_dir: str | Path = SHM_DIR) -> list[StaleRegion]:
    """Remove the regions of fabriclab engines of this pid namespace whose process is gone, and their records;
    returns the regions removed (with ``dry_run``, those that would be). Never raises for a region it cannot
    judge or remove: it leaves it."""
    removed = []
    for record in _records_of_gone_engines(Path(shm_dir)):
        if dry_run:
            removed += record.stale
            continue
        # Judged again right before each unlink: the file may have been reclaimed by someone else or reused by
        # a new endpoint of the same name since the scan.
        removed += [r for r in (_unlink(r.path, record.judge) for r in record.stale) if r is not None]
        if not [r for r in record.stale if record.judge(Path(r.path)) is not None]:
            _unlink_record(record.path)  # it has done its job (a region it could not remove keeps it)
    return removed


def clean_shm_regions(dry_run: bool = False, force: bool = False, shm_dir: str | Path = SHM_DIR) -> Cleaning:
    """What ``python -m fabriclab clean`` does: the automatic reclamation, then the regions no record of this
    namespace covers, judged where every owner is visible (left, with the reason, elsewhere unless ``force``)."""
    shm_dir = Path(shm_dir)
    done = Cleaning(removed=reclaim_stale_shm_regions(dry_run, shm_dir), blind=_why_owners_are_hidden())
    taken = {r.path for r in done.removed}
    owners = None if done.blind else _pids_in_every_namespace()

    def verdict(path: Path) -> StaleRegion | None:
        return _region(path, lambda pid, info: _why_unowned(pid, info, owners))

    for path in _region_paths(shm_dir):
        region = None if str(path) in taken else verdict(path)
        if region is None:
            continue
        if done.blind and not force:
            done.left.append(region)
        elif dry_run:
            done.removed.append(region)
        else:
            region = _unlink(region.path, verdict)
            done.removed += [region] if region is not None else []
    if owners is not None and not dry_run:
        _unlink_records_of_gone_owners(shm_dir, owners)
    return done


def describe(regions: list[StaleRegion], dry_run: bool = False) -> str:
    """One line: how many stale regions were (or would be) reclaimed, the memory, and the dead pids."""
    if not regions:
        return "no stale shm regions"
    return f"{'would reclaim' if dry_run else 'reclaimed'} {_count(regions)} left by {_pids(regions)}"


def shared_pid_namespaces(shm_dir: str | Path = SHM_DIR) -> str | None:
    """What shows that ``shm_dir`` is shared with processes of other pid namespaces, or None when nothing does."""
    here = _namespace("pid")
    signs = []
    others = {r.ns for r in _records(Path(shm_dir)) if r.ns != here}
    if others:
        signs.append(f"records of fabriclab engines of {len(others)} other pid namespace(s)")
    if here is not None and here != _INITIAL_NAMESPACE["pid"]:
        if _namespace("ipc") == _INITIAL_NAMESPACE["ipc"]:
            signs.append("this process has a pid namespace of its own but the host's IPC namespace (a container "
                         "run with --ipc=host), whose /dev/shm is usually the host's")
        unseen = sorted({int(m["pid"]) for m in map(_REGION_NAME.match, _names(Path(shm_dir)))
                         if m and not Path(f"/proc/{m['pid']}").exists()})
        if unseen:
            signs.append(f"{len(unseen)} shm region owner(s) not visible here (pid {_short_list(unseen)})")
    if not signs:
        return None
    clean = ("`clean` here leaves the others unless --force" if _why_owners_are_hidden()
             else "`clean` here sees every process and judges the others too")
    return (f"shared across pid namespaces: {'; '.join(signs)}. fabriclab reclaims by itself only regions of its "
            f"own engines that died in this pid namespace; {clean}")


# ----------------------------------------------------------------------------------------- owner records

_hold_lock = threading.Lock()
_hold: dict[str, Any] = {"pid": 0, "users": 0, "path": None}  # path: str | None


def hold_owner_record() -> None:
    """Called by each NIC set before it opens endpoints: the first of the process writes the process's owner
    record (see the module's notes). Without /dev/shm, or without the right to write there, there is no
    record: the NICs work, and nothing reclaims their regions automatically."""
    with _hold_lock:
        if _hold["pid"] != os.getpid():  # a fork()ed child: the records held are its parent's
            _hold.update(pid=os.getpid(), users=0, path=None)
        if _hold["users"] == 0:
            _hold["path"] = _write_record()
        _hold["users"] += 1


def release_owner_record() -> None:
    """Called by each NIC set once closed (its regions with it): the last one removes the record."""
    with _hold_lock:
        if _hold["pid"] != os.getpid() or _hold["users"] == 0:
            return
        _hold["users"] -= 1
        if _hold["users"] == 0 and _hold["path"] is not None:
            _unlink_record(_hold["path"])
            _hold["path"] = None


def _write_record() -> str | None:
    ns, start = _namespace("pid"), _start_ticks(os.getpid())
    if ns is None or start is None or start < 0:
        return None
    path = SHM_DIR / f"{_RECORD_PREFIX}pidns{ns}.pid{os.getpid()}.uid{os.getuid()}.start{start}"
    try:
        os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644))
    except OSError:
        return None
    return str(path)


@dataclass
class _Record:
    path: str
    ns: int
    pid: int
    uid: int
    start: int  # clock ticks after boot
    stale: list[StaleRegion] = field(default_factory=list)

    def judge(self, path: Path) -> StaleRegion | None:
        """The region at ``path`` if it is this gone engine's and stale."""
        return _region(path, lambda pid, info: _recorded_verdict(info, self))


def _records(shm_dir: Path) -> list[_Record]:
    found = []
    for name in _names(shm_dir):
        match = _RECORD_NAME.match(name)
        if match:
            ns, pid, uid, start = (int(match[k]) for k in ("ns", "pid", "uid", "start"))
            found.append(_Record(str(shm_dir / name), ns, pid, uid, start))
    return found


def _records_of_gone_engines(shm_dir: Path) -> list[_Record]:
    """This pid namespace's records whose process is gone, each with its stale regions. None at all where
    /proc is not this namespace's: every pid read there would be another namespace's."""
    here = _namespace("pid")
    if here is None or not _proc_is_ours():
        return []
    gone = []
    names = _names(shm_dir)
    for record in _records(shm_dir):
        if record.ns != here or _recorded_owner_alive(record):
            continue
        regions = (record.judge(shm_dir / n) for n in names if n.startswith(f"{record.pid}:{record.uid}:"))
        record.stale = [r for r in regions if r is not None]
        gone.append(record)
    return gone


def _recorded_owner_alive(record: _Record) -> bool:
    started = _start_ticks(record.pid)
    return started is not None and started in (record.start, _UNREADABLE)


def _recorded_verdict(info: os.stat_result, record: _Record) -> str | None:
    """Why a region named after a gone recorded engine is stale, or None when it may not be that engine's."""
    if max(info.st_mtime_ns, info.st_ctime_ns) / 1e9 < _ticks_to_time(record.start) - START_SLACK_S:
        return None  # last modified before that engine started: someone else's
    started = _start_ticks(record.pid)
    if started is None:
        return f"pid {record.pid} is gone"
    if started in (record.start, _UNREADABLE) or _process_uses(record.pid, info):
        return None
    return f"pid {record.pid} is another process (not the engine that made the region, and it does not map it)"


def _unlink_records_of_gone_owners(shm_dir: Path, owners: dict[int, list[int]]) -> None:
    """Where every process is visible: the records (of any pid namespace) whose process is gone and whose
    regions are gone too (an engine SIGKILLed in a container that then ended leaves one)."""
    names = set(_names(shm_dir))
    for record in _records(shm_dir):
        alive = any(_start_ticks(p) in (record.start, _UNREADABLE) and _namespace("pid", p) in (record.ns, None)
                    for p in owners.get(record.pid, []))
        if not alive and not any(n.startswith(f"{record.pid}:{record.uid}:") for n in names):
            _unlink_record(record.path)


def _unlink_record(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:  # gone already (another cleaner), or another user's (sticky /dev/shm)
        pass


# ----------------------------------------------------------------------------------------- judging


def _names(shm_dir: Path) -> list[str]:
    try:
        return sorted(os.listdir(shm_dir))
    except OSError:  # no /dev/shm here: nothing can have been left in it
        return []


def _region_paths(shm_dir: Path) -> list[Path]:
    return [shm_dir / name for name in _names(shm_dir) if _REGION_NAME.match(name)]


def _region(path: Path, why_stale: Callable[[int, os.stat_result], str | None]) -> StaleRegion | None:
    """The region at ``path`` if it is a shm-provider region and ``why_stale(pid, stat)`` gives a reason."""
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
    reason = why_stale(pid, info)
    if reason is None:
        return None
    return StaleRegion(str(path), pid, info.st_blocks * 512, reason)


def _unlink(path: str, verdict: Callable[[Path], StaleRegion | None]) -> StaleRegion | None:
    """Unlink the region at ``path`` if ``verdict(Path)`` still finds it stale; the region removed, or None."""
    again = verdict(Path(path))
    if again is None:
        return None
    try:
        os.unlink(again.path)
    except OSError:  # gone already (another cleaner), or not ours to remove (another user's, sticky /dev/shm)
        return None
    return again


def _why_unowned(pid: int, info: os.stat_result, owners: dict[int, list[int]] | None) -> str | None:
    """Why a region named after ``pid`` has no owner left: judged among every process whose pid in its own
    namespace is ``pid`` (``owners``, where every process is visible), else among this namespace's."""
    where = "in any pid namespace on this host" if owners is not None else "in this pid namespace"
    if owners is None:
        owners = {pid: [pid]} if _start_ticks(pid) is not None else {}
    candidates = owners.get(pid, [])
    if not candidates:
        return f"no process has pid {pid} {where}"
    last_modified = max(info.st_mtime_ns, info.st_ctime_ns) / 1e9
    for host_pid in candidates:
        started = _start_ticks(host_pid)
        if started is None:
            continue  # it ended meanwhile
        if started == _UNREADABLE or _ticks_to_time(started) <= last_modified + START_SLACK_S:
            return None  # the process may well be the creator
        if _process_uses(host_pid, info):
            return None
    return (f"pid {pid} {where} is another process (started more than {START_SLACK_S:g} s after the region was "
            "last modified, and does not map it)")


def _why_owners_are_hidden() -> str:
    """Why this process cannot see every process that may own a region in /dev/shm ("" when it can)."""
    ns = _namespace("pid")
    if not _proc_is_ours():
        return "/proc here is not this pid namespace's, so no pid read in it means anything here"
    if ns is None:
        return "the pid namespace of this process cannot be read (/proc/self/ns/pid)"
    if ns != _INITIAL_NAMESPACE["pid"]:
        return (f"this process is in a pid namespace of its own (pid:[{ns}]), not the host's: processes of other "
                "pid namespaces sharing /dev/shm (containers run with --ipc=host) are invisible here")
    if os.geteuid() != 0 and re.search(r" - proc \S+ \S*hidepid=(?!0\b|off\b)", _proc_mount()):
        return "/proc hides other users' processes (hidepid) from this user"
    if "\nNSpid:" not in _read(f"/proc/{os.getpid()}/status"):
        return "this kernel does not show each process's pid in its own pid namespace (NSpid, Linux 4.1+)"
    return ""


def _pids_in_every_namespace() -> dict[int, list[int]]:
    """Every process, by its pid in its own pid namespace (the last NSpid): the /proc pids holding each."""
    by_pid: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            line = re.search(r"\nNSpid:\s*([0-9\s]+)", _read(f"/proc/{entry}/status"))
            if line:
                by_pid.setdefault(int(line[1].split()[-1]), []).append(int(entry))
    return by_pid


def _namespace(kind: str, pid: int | str = "self") -> int | None:
    """The inode of a process's namespace of this kind; None when it cannot be read."""
    try:
        return int(os.readlink(f"/proc/{pid}/ns/{kind}").split("[", 1)[1].rstrip("]"))
    except (OSError, IndexError, ValueError):
        return None


def _proc_is_ours() -> bool:
    """Whether /proc shows this pid namespace (unshare --pid without --mount-proc keeps the parent's)."""
    try:
        return os.readlink("/proc/self") == str(os.getpid())
    except OSError:
        return False


def _proc_mount() -> str:
    return next((line for line in _read("/proc/self/mountinfo").splitlines() if line.split()[4:5] == ["/proc"]), "")


def _read(path: str) -> str:
    try:
        return Path(path).read_text()
    except (OSError, UnicodeDecodeError):
        return ""


# What a start time that cannot be read counts as: the process may be anyone, a region's creator included.
_UNREADABLE = -1


def _stat(pid: int) -> tuple[str, int] | None:
    """``pid``'s state letter and start time (clock ticks after boot) from /proc; None when there is no such
    pid, ("?", _UNREADABLE) when it cannot be read."""
    try:
        stat_line = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return None
    except OSError:
        return "?", _UNREADABLE
    try:
        # the command name in parentheses may hold spaces and parentheses: fields count from the last ')'
        fields = stat_line.rsplit(")", 1)[1].split()
        return fields[0], int(fields[19])
    except (IndexError, ValueError):
        return "?", _UNREADABLE


def _start_ticks(pid: int) -> int | None:
    """When ``pid`` started, in clock ticks after boot; None when there is no such pid."""
    stat = _stat(pid)
    return None if stat is None else stat[1]


def this_process() -> tuple[int, int, int]:
    """(pid namespace inode, pid, start in clock ticks after boot) of this process; 0 for what cannot be read.
    What a peer on this host needs to tell later that this process is gone (:func:`process_is_gone`)."""
    start = _start_ticks(os.getpid())
    return _namespace("pid") or 0, os.getpid(), start if start and start > 0 else 0


def process_is_gone(namespace: int, pid: int, start: int) -> bool:
    """Whether the process :func:`this_process` described (in another process of this host) is proven gone:
    its pid namespace is ours (else its pid means nothing here) and so is /proc, and no process has its pid, or
    the one that has it is a zombie (killed, not yet reaped) or started at another time. False when in doubt."""
    if not namespace or not start or namespace != _namespace("pid") or not _proc_is_ours():
        return False
    stat = _stat(pid)
    if stat is None:
        return True
    state, started = stat
    return started != _UNREADABLE and (state in ("Z", "X") or started != start)


def _ticks_to_time(ticks: int) -> float:
    """A start time in clock ticks after boot, in seconds since the epoch (the file-time clock)."""
    return time.time() - (time.clock_gettime(time.CLOCK_BOOTTIME) - ticks / os.sysconf("SC_CLK_TCK"))


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


def _count(regions: list[StaleRegion], what: str = "stale shm region") -> str:
    return f"{len(regions)} {what}{'s' if len(regions) > 1 else ''} ({_mib(sum(r.bytes for r in regions))})"


def _pids(regions: list[StaleRegion]) -> str:
    pids = sorted({r.pid for r in regions})
    return f"pid{'s' if len(pids) > 1 else ''} {', '.join(map(str, pids))}"


def _short_list(numbers: list[int]) -> str:
    return ", ".join(map(str, numbers[:8])) + (f", … ({len(numbers)} in all)" if len(numbers) > 8 else "")


# --------------------------------------------------------------------------------------------- CLI


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dry-run", action="store_true", help="list the stale regions, remove nothing")
    p.add_argument("--force", action="store_true",
                   help="also remove the regions whose owners this process cannot see (run in a pid namespace of "
                        "its own, e.g. a container): RISK: if /dev/shm is shared with other pid namespaces "
                        "(containers run with --ipc=host), a live owner there looks gone from here, and removing "
                        "its region cuts it off from every new peer for good (their writes time out)")
    p.add_argument("--json", action="store_true", help="one JSON object: the regions, the bytes freed, those left")


def main(args: argparse.Namespace) -> int:
    done = clean_shm_regions(dry_run=args.dry_run, force=args.force)
    if args.json:
        print(json.dumps({"dry_run": args.dry_run, "force": args.force, "regions": [vars(r) for r in done.removed],
                          "bytes": sum(r.bytes for r in done.removed), "left": [vars(r) for r in done.left],
                          "why_left": done.blind}))
        return 0
    for r in done.removed:
        print(f"{'would remove' if args.dry_run else 'removed'} {r.path} ({_mib(r.bytes)}): {r.reason}")
    for r in done.left:
        print(f"left {r.path} ({_mib(r.bytes)}): {r.reason}, but its owner may be alive in another pid namespace")
    print(describe(done.removed, args.dry_run))
    if done.left:
        print(f"left {_count(done.left, 'shm region')} named after {_pids(done.left)}, whose owners may be alive where "
              f"this process cannot see: {done.blind}. Run `clean` where every owner is visible (on the host), or "
              "add --force if no other pid namespace shares this /dev/shm")
    return 0
