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
  start time in clock ticks after boot). /dev/shm is world-writable, so a name proves nothing: a record is
  believed only when it is a regular file (not a link) owned by the uid it names, and it speaks only for
  regions of that uid owned by that uid (anyone else could have made it). A region ``<pid>:<uid>:<index>`` is
  reclaimed only when a believed record made in this pid namespace names its pid and uid, that process is
  gone (no such pid, or the pid now belongs to a process that started at another time), and no process that
  has the pid may have made the region or uses it: in this namespace the pid's present process, and where
  every process is visible (see ``clean``) every process of another namespace with that pid there too (a
  region's name does not say its namespace, and a record that names this namespace may have been made in
  another). A process "may have made" a region when it started before the region was last modified (give or
  take ``START_SLACK_S``), maps it or holds it open; a region last modified before the recorded process
  started is not its either. The record goes with its regions; closing the NICs removes it. Records of other
  pid namespaces and regions no record covers are left alone, silently.
* ``python -m fabriclab clean`` also judges regions no record covers (course stages, other libfabric programs,
  engines of pid namespaces that ended), but only where it sees every owner: in the host's (initial) pid
  namespace, with a /proc of its own that hides no process. There every process's pid in its own namespace
  is known (NSpid), and a region is stale when no process has its pid in any namespace, or none that has may
  have made it (as above). Elsewhere ``clean`` lists such regions as left, says why, and removes them only
  with ``--force``.

Files are checked to be shm regions: a name of the shape above and the creator's pid in the region's header
(or 0, when it died before finishing the header). This module imports nothing from the course stages: the
Engine, ``info``, ``clean`` and ``doctor`` all use it.

Each call (an Engine start, ``info``, ``clean``) lists the directory once and reads each process's open files
at most once, so its cost grows with the number of files in it, whatever was planted there, not with its
square. Names are matched whole (a name with a trailing newline is no region's nor record's).
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
_REGION_NAME = re.compile(r"(?P<pid>[1-9][0-9]*):(?P<uid>[0-9]+):(?P<index>[0-9]+)")  # fullmatch: whole name
# struct smr_region begins with version, reserved, flags, then the creator's pid, written last ("set last to
# signal full initialization to peers" in libfabric's smr_create).
_REGION_HEADER = struct.Struct("=BBHi")
_RECORD_PREFIX = "fabriclab-engine."
_RECORD_NAME = re.compile(r"fabriclab-engine\.pidns(?P<ns>[0-9]+)\.pid(?P<pid>[1-9][0-9]*)\.uid(?P<uid>[0-9]+)"
                          r"\.start(?P<start>[0-9]+)")  # fullmatch, like _REGION_NAME
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
    return [region for record in _Judge(Path(shm_dir)).gone_engines() for region in record.stale]


def reclaim_stale_shm_regions(dry_run: bool = False, shm_dir: str | Path = SHM_DIR) -> list[StaleRegion]:
    """Remove the regions of fabriclab engines of this pid namespace whose process is gone, and their records;
    returns the regions removed (with ``dry_run``, those that would be). Never raises for a region it cannot
    judge or remove: it leaves it."""
    return _Judge(Path(shm_dir)).reclaim(dry_run)


def clean_shm_regions(dry_run: bool = False, force: bool = False, shm_dir: str | Path = SHM_DIR) -> Cleaning:
    """What ``python -m fabriclab clean`` does: the automatic reclamation, then the regions no record of this
    namespace covers, judged where every owner is visible (left, with the reason, elsewhere unless ``force``)."""
    judge = _Judge(Path(shm_dir))
    done = Cleaning(removed=judge.reclaim(dry_run), blind=_why_owners_are_hidden())
    taken = {r.path for r in done.removed}

    def verdict(path: Path) -> StaleRegion | None:
        return _region(path, judge.unowned_verdict)

    for path in judge.region_paths():
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
    if not done.blind and not dry_run:
        judge.unlink_records_of_gone_owners()
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
    listing = _Judge(Path(shm_dir))
    others = {r.ns for r in listing.records if r.ns != here}
    if others:
        signs.append(f"records of fabriclab engines of {len(others)} other pid namespace(s)")
    if here is not None and here != _INITIAL_NAMESPACE["pid"]:
        if _namespace("ipc") == _INITIAL_NAMESPACE["ipc"]:
            signs.append("this process has a pid namespace of its own but the host's IPC namespace (a container "
                         "run with --ipc=host), whose /dev/shm is usually the host's")
        unseen = sorted({pid for pid, _ in listing.regions if not Path(f"/proc/{pid}").exists()})
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
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
        try:
            info = os.fstat(fd)
        finally:
            os.close(fd)
    except OSError:
        return None
    # A file of this name that another user made first is not believed (_believed): no record, then.
    return str(path) if stat.S_ISREG(info.st_mode) and info.st_uid == os.getuid() else None


@dataclass
class _Record:
    path: str
    ns: int
    pid: int
    uid: int
    start: int  # clock ticks after boot
    stale: list[StaleRegion] = field(default_factory=list)


def _believed(entry: os.DirEntry[str]) -> _Record | None:
    """The owner record ``entry`` is, if its name is one's and the file is a regular file (lstat: not a link)
    owned by the uid the name states: in a world-writable /dev/shm anyone can make a file of any name, but only
    that uid (or root) one that it owns."""
    match = _RECORD_NAME.fullmatch(entry.name)
    if match is None:
        return None
    ns, pid, uid, start = (int(match[k]) for k in ("ns", "pid", "uid", "start"))
    try:
        info = entry.stat(follow_symlinks=False)
    except OSError:  # gone meanwhile
        return None
    if not stat.S_ISREG(info.st_mode) or info.st_uid != uid:
        return None
    return _Record(entry.path, ns, pid, uid, start)


def _recorded_owner_alive(record: _Record) -> bool:
    started = _start_ticks(record.pid)
    return started is not None and started in (record.start, _UNREADABLE)


def _unlink_record(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:  # gone already (another cleaner), or another user's (sticky /dev/shm)
        pass


# ----------------------------------------------------------------------------------------- judging


class _Judge:
    """The judgements of one call (an Engine start, ``info``, ``clean``) over one listing of the shm directory:
    the directory is listed once, its regions indexed by the (pid, uid) they name, and each process's open
    files read at most once, so that the cost grows with the number of files there, not with its square,
    whatever was planted there."""

    def __init__(self, shm_dir: Path) -> None:
        self.dir = shm_dir
        self.records: list[_Record] = []  # the owner records believed (_believed)
        self.regions: dict[tuple[int, int], list[str]] = {}  # region names by the (pid, uid) they state
        self._owners: dict[int, list[int]] | None = None
        self._owners_read = False
        self._files: dict[int, frozenset[tuple[int, int]] | None] = {}
        try:
            with os.scandir(shm_dir) as listing:
                entries = sorted(listing, key=lambda e: e.name)
        except OSError:  # no /dev/shm here: nothing can have been left in it
            entries = []
        for entry in entries:
            region = _REGION_NAME.fullmatch(entry.name)
            if region is not None:
                self.regions.setdefault((int(region["pid"]), int(region["uid"])), []).append(entry.name)
            elif (record := _believed(entry)) is not None:
                self.records.append(record)

    def region_paths(self) -> list[Path]:
        return sorted(self.dir / name for names in self.regions.values() for name in names)

    def gone_engines(self) -> list[_Record]:
        """This pid namespace's records whose process is gone, each with its stale regions. None at all where
        /proc is not this namespace's: every pid read there would be another namespace's."""
        here = _namespace("pid")
        if here is None or not _proc_is_ours():
            return []
        gone = [r for r in self.records if r.ns == here and not _recorded_owner_alive(r)]
        judged: set[tuple[int, int]] = set()
        for record in sorted(gone, key=lambda r: r.start):
            # Regions of one pid and uid are judged once, under its earliest gone engine: a later one's verdict
            # differs only in taking fewer (those last modified before it started are not its).
            if (record.pid, record.uid) not in judged:
                judged.add((record.pid, record.uid))
                regions = (self.dir / n for n in self.regions.get((record.pid, record.uid), []))
                record.stale = [r for r in map(self.judge_by(record), regions) if r is not None]
        return gone

    def reclaim(self, dry_run: bool) -> list[StaleRegion]:
        """Remove the gone engines' stale regions (unless ``dry_run``), and each record once none is left."""
        removed = []
        for record in self.gone_engines():
            if dry_run:
                removed += record.stale
                continue
            # Judged again right before each unlink: the file may have been reclaimed by someone else or reused
            # by a new endpoint of the same name since the scan.
            judge = self.judge_by(record)
            removed += [r for r in (_unlink(r.path, judge) for r in record.stale) if r is not None]
            if not [r for r in record.stale if judge(Path(r.path)) is not None]:
                _unlink_record(record.path)  # it has done its job (a region it could not remove keeps it)
        return removed

    def judge_by(self, record: _Record) -> Callable[[Path], StaleRegion | None]:
        """What judges a region named after ``record``'s gone engine: the region if it is stale, else None."""
        return lambda path: _region(path, lambda pid, info: self.recorded_verdict(record, info))

    def recorded_verdict(self, record: _Record, info: os.stat_result) -> str | None:
        """Why a region named after a gone recorded engine is stale, or None when it may be someone else's."""
        if info.st_uid != record.uid:
            return None  # a record speaks only for its own uid's files (anyone may make one of a name)
        if _last_modified(info) < _ticks_to_time(record.start) - START_SLACK_S:
            return None  # last modified before that engine started: someone else's
        if self.may_be_maker(record.pid, info) or self._made_elsewhere(record, info):
            return None
        if _start_ticks(record.pid) is None:
            return f"pid {record.pid} is gone"
        return (f"pid {record.pid} is another process (not the engine that made the region: it started after the "
                "region was last modified, and it does not map it)")

    def _made_elsewhere(self, record: _Record, info: os.stat_result) -> bool:
        """Whether a process of another pid namespace whose pid there is the record's may have made the region
        (a region's name does not say its pid namespace); where not every process is visible, none is seen."""
        owners = self.owners()
        return owners is not None and any(_namespace("pid", p) != record.ns and self.may_be_maker(p, info)
                                          for p in owners.get(record.pid, []))

    def unowned_verdict(self, pid: int, info: os.stat_result) -> str | None:
        """Why a region named after ``pid`` has no owner left: judged among every process whose pid in its own
        namespace is ``pid``, where every process is visible, else among this namespace's."""
        owners = self.owners()
        where = "in any pid namespace on this host" if owners is not None else "in this pid namespace"
        if owners is None:
            owners = {pid: [pid]} if _start_ticks(pid) is not None else {}
        candidates = owners.get(pid, [])
        if not candidates:
            return f"no process has pid {pid} {where}"
        if any(self.may_be_maker(p, info) for p in candidates):
            return None
        return (f"pid {pid} {where} is another process (started more than {START_SLACK_S:g} s after the region was "
                "last modified, and does not map it)")

    def may_be_maker(self, pid: int, info: os.stat_result) -> bool:
        """Whether the process /proc shows as ``pid`` may have made the region ``info`` describes, or uses it:
        it started before the region was last modified (a process cannot have made a file before it started),
        or it maps the region or holds it open; True when that cannot be read, False when there is no such
        process (it ended meanwhile)."""
        started = _start_ticks(pid)
        if started is None:
            return False
        if started == _UNREADABLE or _ticks_to_time(started) <= _last_modified(info) + START_SLACK_S:
            return True
        if pid not in self._files:
            self._files[pid] = _files_in_use(pid)
        files = self._files[pid]
        return files is None or (info.st_dev, info.st_ino) in files

    def owners(self) -> dict[int, list[int]] | None:
        """Every process by its pid in its own pid namespace (read when first needed), or None where this
        process cannot see every process (_why_owners_are_hidden)."""
        if not self._owners_read:
            self._owners = None if _why_owners_are_hidden() else _pids_in_every_namespace()
            self._owners_read = True
        return self._owners

    def unlink_records_of_gone_owners(self) -> None:
        """Where every process is visible: the records (of any pid namespace) whose process is gone and whose
        regions are gone too (an engine SIGKILLed in a container that then ended leaves one)."""
        owners = self.owners() or {}
        left = {key for key, names in self.regions.items() if any(os.path.lexists(self.dir / n) for n in names)}
        for record in self.records:
            alive = any(_start_ticks(p) in (record.start, _UNREADABLE) and _namespace("pid", p) in (record.ns, None)
                        for p in owners.get(record.pid, []))
            if not alive and (record.pid, record.uid) not in left:
                _unlink_record(record.path)


def _region(path: Path, why_stale: Callable[[int, os.stat_result], str | None]) -> StaleRegion | None:
    """The region at ``path`` if it is a shm-provider region and ``why_stale(pid, stat)`` gives a reason."""
    match = _REGION_NAME.fullmatch(path.name)
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


def _last_modified(info: os.stat_result) -> float:
    return max(info.st_mtime_ns, info.st_ctime_ns) / 1e9


def _files_in_use(pid: int) -> frozenset[tuple[int, int]] | None:
    """The (device, inode) of every file ``pid`` maps or holds open; None when that cannot be read (no
    permission), so that a region is never removed on a guess; empty when the process ended meanwhile."""
    # By device and inode, not by name: the path seen here may differ from the owner's (a mount namespace,
    # /proc/PID/root/...), and a region unlinked meanwhile shows as "(deleted)".
    files = set()
    try:
        with open(f"/proc/{pid}/maps") as maps:
            for line in maps:
                fields = line.split(maxsplit=5)
                if len(fields) >= 5 and fields[4] != "0":
                    major, minor = fields[3].split(":")
                    files.add((os.makedev(int(major, 16), int(minor, 16)), int(fields[4])))
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                target = os.stat(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            files.add((target.st_dev, target.st_ino))
    except FileNotFoundError:
        return frozenset()
    except (OSError, ValueError):
        return None
    return frozenset(files)


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
