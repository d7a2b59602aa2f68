"""Stale shm regions: processes SIGKILLed with an shm Engine open leave their /dev/shm regions; the cleaner
removes those and never a live process's, not even one in a pid namespace it cannot see (issue 26: processes
in pid namespaces of their own, unshare --pid, share the test's /dev/shm as containers run with --ipc=host do).

Each test gets its own /dev/shm (a tmpfs in a private mount namespace): other test runs on this machine
start Engines, which reclaim stale regions, and must neither take this test's killed owner's region from
under it nor lose their own to it.
"""
import hashlib
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from fabriclab import bootstrap, shmclean
from helpers import LINE_TIMEOUT, PAGE, Child, PeerProcess

WRITER = str(Path(__file__).with_name("hostile_writer.py"))

# An owner: an shm Engine, open until killed; "ready" once its region exists.
OWNER = "import fabriclab, time; e = fabriclab.Engine('shm', nics=1); print('ready', flush=True); time.sleep(120)"


@dataclass
class PrivateShm:
    dir: Path            # the private /dev/shm as this process sees it
    launcher: list[str]  # command prefix running a program with the private /dev/shm as its /dev/shm

    def start_owner(self) -> Child:
        owner = Child([sys.executable, "-c", OWNER], launcher=self.launcher)
        assert owner.line(LINE_TIMEOUT, "ready from the owner") == "ready", "the shm Engine did not open"
        return owner

    def regions_of(self, pid: int) -> list[str]:
        return sorted(str(p) for p in self.dir.iterdir() if p.name.startswith(f"{pid}:"))

    def run(self, *argv: str, pid_namespace: bool = False) -> subprocess.CompletedProcess:
        """``python -m fabriclab ARGV``; with ``pid_namespace``, in a pid namespace of its own (same /dev/shm)."""
        return self.python("-m", "fabriclab", *argv, pid_namespace=pid_namespace)

    def python(self, *argv: str, pid_namespace: bool = False) -> subprocess.CompletedProcess:
        return subprocess.run([*self.launcher, *(CHILD_PID_NAMESPACE if pid_namespace else ()), sys.executable,
                               *argv], capture_output=True, text=True, timeout=120)

    def records(self) -> list[str]:
        return sorted(p.name for p in self.dir.iterdir() if p.name.startswith("fabriclab-engine."))


# A pid namespace of its own (and a /proc showing it); the mount namespace, and so /dev/shm, stay the caller's.
CHILD_PID_NAMESPACE = ["unshare", "--pid", "--fork", "--kill-child", "--mount-proc"]


@pytest.fixture
def private_shm():
    if os.geteuid() != 0:
        pytest.skip("a private /dev/shm needs root (a mount namespace and a tmpfs)")
    holder = subprocess.Popen(["unshare", "--mount", "--propagation", "private", "sh", "-c",
                               "mount -t tmpfs -o size=128m,mode=1777 fabriclab-test /dev/shm && echo ready && "
                               "exec sleep 600"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        if holder.stdout.readline().strip() != "ready":
            pytest.skip(f"no private /dev/shm here: {holder.stderr.read().strip()}")
        yield PrivateShm(Path(f"/proc/{holder.pid}/root/dev/shm"),
                         ["nsenter", "--mount", f"--target={holder.pid}", f"--wd={os.getcwd()}"])
    finally:
        holder.kill()
        holder.wait()
        holder.stdout.close()
        holder.stderr.close()


def test_a_killed_owners_region_is_reclaimed_and_a_live_ones_kept(private_shm):
    live, dead = private_shm.start_owner(), private_shm.start_owner()
    try:
        live_regions, dead_regions = private_shm.regions_of(live.pid), private_shm.regions_of(dead.pid)
        assert live_regions and dead_regions
        dead.kill()
        assert private_shm.regions_of(dead.pid) == dead_regions  # SIGKILL left it: nothing else removes it

        listed = shmclean.reclaim_stale_shm_regions(dry_run=True, shm_dir=private_shm.dir)
        assert [r.path for r in listed] == dead_regions
        assert private_shm.regions_of(dead.pid) == dead_regions  # a dry run removes nothing

        removed = shmclean.reclaim_stale_shm_regions(shm_dir=private_shm.dir)
        assert [r.path for r in removed] == dead_regions
        assert all(r.pid == dead.pid and r.bytes > 0 and r.reason == f"pid {dead.pid} is gone" for r in removed)
        assert private_shm.regions_of(dead.pid) == []
        assert private_shm.regions_of(live.pid) == live_regions and live.poll() is None
        assert shmclean.reclaim_stale_shm_regions(shm_dir=private_shm.dir) == []
    finally:
        live.kill()


def test_a_reused_pid_does_not_save_a_dead_owners_region(private_shm):
    dead = private_shm.start_owner()
    regions = private_shm.regions_of(dead.pid)
    dead.kill()
    time.sleep(shmclean.START_SLACK_S + 0.2)  # the newcomer must start clearly after the region was written
    newcomer = take_pid(dead.pid)
    try:
        # The pid is alive again, but in a process that started after the region and does not map it.
        removed = shmclean.reclaim_stale_shm_regions(shm_dir=private_shm.dir)
        assert [r.path for r in removed] == regions
        assert f"pid {dead.pid} is another process" in removed[0].reason
        assert newcomer.poll() is None
    finally:
        newcomer.kill()
        newcomer.wait()


def take_pid(pid: int) -> subprocess.Popen:
    """A new process with exactly this (free) pid: the kernel hands out ns_last_pid + 1 next, unless another
    process forks in between, so try a few times."""
    for _ in range(50):
        try:
            Path("/proc/sys/kernel/ns_last_pid").write_text(str(pid - 1))
        except OSError as exc:
            pytest.skip(f"cannot choose the next pid here: {exc}")
        proc = subprocess.Popen(["sleep", "60"])
        if proc.pid == pid:
            return proc
        proc.kill()
        proc.wait()
    pytest.skip(f"pid {pid} was not handed out again (a busy machine)")


def test_clean_and_info_commands(private_shm):
    dead = private_shm.start_owner()
    regions = private_shm.regions_of(dead.pid)
    dead.kill()
    region_name = Path(regions[0]).name

    done = private_shm.run("clean", "--dry-run")
    assert done.returncode == 0, done.stderr
    assert f"would remove /dev/shm/{region_name} " in done.stdout and f"pid {dead.pid} is gone" in done.stdout
    assert private_shm.regions_of(dead.pid) == regions

    done = private_shm.run("info")  # info reclaims too, and says so in one line
    assert done.returncode == 0, done.stderr
    assert "reclaimed 1 stale shm region" in done.stdout and f"pid {dead.pid}" in done.stdout
    assert private_shm.regions_of(dead.pid) == []

    done = private_shm.run("clean")
    assert done.returncode == 0 and done.stdout.strip() == "no stale shm regions"


# ------------------------------------------------------------------------------ pid namespaces sharing /dev/shm


@pytest.fixture
def shared_shm(private_shm):
    """A private /dev/shm that processes in pid namespaces of their own share (a container run with --ipc=host
    and its own pids does the same with the host's)."""
    done = subprocess.run([*private_shm.launcher, *CHILD_PID_NAMESPACE, "true"], capture_output=True, text=True,
                          timeout=30)
    if done.returncode != 0:
        pytest.skip(f"no pid namespace of its own here (unshare --pid needs root): {done.stderr.strip()}")
    return private_shm


def test_a_live_owner_in_another_pid_namespace_keeps_its_region_and_its_writes(shared_shm):
    """Issue 26: an Engine start, `info` and `clean` in a pid namespace of their own leave alone the region of a
    live engine they cannot see, and a later writer's pages still land in it byte-exact."""
    owner = PeerProcess(("shm", None), 16 * PAGE, launcher=shared_shm.launcher)
    try:
        regions = shared_shm.regions_of(owner.proc.pid)
        assert regions
        done = shared_shm.python("-c", "from fabriclab import Engine; Engine('shm').close()", pid_namespace=True)
        assert done.returncode == 0, done.stderr
        assert shared_shm.regions_of(owner.proc.pid) == regions
        done = shared_shm.run("info", pid_namespace=True)
        assert done.returncode == 0 and "reclaimed" not in done.stdout, done.stderr
        assert shared_shm.regions_of(owner.proc.pid) == regions
        for clean in (["clean", "--dry-run"], ["clean"]):
            done = shared_shm.run(*clean, pid_namespace=True)
            assert done.returncode == 0, done.stderr
            assert shared_shm.regions_of(owner.proc.pid) == regions
            assert "would remove" not in done.stdout and "removed" not in done.stdout
            assert f"left /dev/shm/{Path(regions[0]).name} " in done.stdout and "--force" in done.stdout
            assert "pid namespace of its own" in done.stdout
        done = shared_shm.run("doctor", "--json", "--provider", "shm", pid_namespace=True)
        shm_check = [c for c in json.loads(done.stdout)["checks"] if c["item"] == "/dev/shm"]
        assert shm_check and "shared across pid namespaces" in shm_check[0]["found"], done.stdout

        assert_a_new_writer_lands(shared_shm, owner)
        assert shared_shm.records()  # the live owner's, until it closes
    finally:
        owner.close()
    assert shared_shm.regions_of(owner.proc.pid) == [] and shared_shm.records() == []


def assert_a_new_writer_lands(shm: PrivateShm, owner: PeerProcess) -> None:
    """A writer that connects to ``owner`` now (it opens the owner's region by name) lands 16 pages there."""
    packed = bootstrap.pack(owner.address, owner.descriptor).hex()
    done = subprocess.run([*shm.launcher, sys.executable, WRITER, "shm", "-", packed, "16", "9"],
                          capture_output=True, text=True, timeout=60)
    assert done.stdout.strip() == "wrote 16", done.stdout + done.stderr
    want = hashlib.sha256(np.full(16 * PAGE, 9, dtype=np.uint8)).hexdigest()
    assert owner.ask("expect 9 16 10") == f"landed 16 sha256={want}"


def test_an_engine_start_reclaims_a_killed_engine_of_its_namespace_and_its_record(shared_shm):
    dead = shared_shm.start_owner()
    regions = shared_shm.regions_of(dead.pid)
    dead.kill()
    assert [r for r in shared_shm.records() if f".pid{dead.pid}." in r]  # SIGKILL left the record too
    done = shared_shm.python("-c", "from fabriclab import Engine; Engine('shm').close()")
    assert done.returncode == 0, done.stderr
    assert shared_shm.regions_of(dead.pid) == [] and shared_shm.records() == []
    assert regions


# In a pid namespace of its own: an owner SIGKILLed, then an Engine start; prints what the owner left before and
# after it, as JSON.
KILLED_THEN_START = """
import json, subprocess, sys
from pathlib import Path
from fabriclab import Engine
owner = subprocess.Popen([sys.executable, "-c", sys.argv[1]], stdout=subprocess.PIPE, text=True)
assert owner.stdout.readline().strip() == "ready"
owner.kill()
owner.wait()
def left():
    return sorted(p.name for p in Path("/dev/shm").iterdir() if p.name.startswith(f"{owner.pid}:")
                  or f".pid{owner.pid}." in p.name)
before = left()
Engine("shm", nics=1).close()
print(json.dumps([before, left()]))
"""


def test_an_engine_start_in_a_pid_namespace_of_its_own_reclaims_its_killed_engines(shared_shm):
    done = shared_shm.python("-c", KILLED_THEN_START, OWNER, pid_namespace=True)
    assert done.returncode == 0, done.stderr
    before, after = json.loads(done.stdout)
    assert [n for n in before if n.startswith("fabriclab-engine.")] and len(before) >= 2  # a region and the record
    assert after == []


def test_clean_in_a_pid_namespace_of_its_own_refuses_unless_forced(shared_shm):
    """An engine killed in a namespace that ended with it: its region's pid means nothing to a later namespace.
    `clean` there refuses it (--force would take it); `clean` in the host's namespace sees every process and
    takes the region and its record."""
    pid = unused_pid()
    # The namespace's init (sh) gives the engine the pid no process has anywhere, so only its death explains it.
    dead = Child(["sh", "-c", f'echo {pid - 1} > /proc/sys/kernel/ns_last_pid && "$0" -c "$1"; :', sys.executable,
                  OWNER], launcher=[*shared_shm.launcher, *CHILD_PID_NAMESPACE])
    assert dead.line(LINE_TIMEOUT, "ready from the owner") == "ready"
    dead.kill()  # unshare --kill-child takes the namespace's init, and the engine with it
    regions = shared_shm.regions_of(pid)
    assert regions and shared_shm.records()
    name = Path(regions[0]).name
    done = shared_shm.run("clean", pid_namespace=True)
    assert done.returncode == 0, done.stderr
    assert f"left /dev/shm/{name} " in done.stdout and "--force" in done.stdout
    assert shared_shm.regions_of(pid) == regions
    done = shared_shm.run("clean", "--force", "--dry-run", pid_namespace=True)
    assert done.returncode == 0 and f"would remove /dev/shm/{name} " in done.stdout, done.stderr
    assert shared_shm.regions_of(pid) == regions

    done = shared_shm.run("info")  # automatic reclamation: not a record of this namespace, so not its to take
    assert done.returncode == 0 and "reclaimed" not in done.stdout, done.stderr
    assert shared_shm.regions_of(pid) == regions
    done = shared_shm.run("clean")
    assert done.returncode == 0 and f"removed /dev/shm/{name} " in done.stdout, done.stderr
    assert f"no process has pid {pid} in any pid namespace" in done.stdout
    assert shared_shm.regions_of(pid) == [] and shared_shm.records() == []


def unused_pid() -> int:
    """A pid that no process has, in any pid namespace on this host."""
    used = shmclean._pids_in_every_namespace()
    pid_max = int(Path("/proc/sys/kernel/pid_max").read_text())
    return next(p for p in range(pid_max // 2, pid_max) if p not in used)


# Two engines in one process, then a fork()ed child with an engine of its own: "records N" after each step.
TWO_ENGINES = """
import os, sys
from pathlib import Path
from fabriclab import Engine
def records():
    print("records", len([p for p in Path("/dev/shm").iterdir() if p.name.startswith("fabriclab-engine.")]), flush=True)
first, second = Engine("shm", nics=1), Engine("shm", nics=1)
records()
first.close()
records()
child = os.fork()
if child == 0:
    Engine("shm", nics=1).close()
    os._exit(0)
os.waitpid(child, 0)
records()
second.close()
records()
"""


def test_the_record_lasts_as_long_as_the_process_has_an_engine_open(private_shm):
    done = private_shm.python("-c", TWO_ENGINES)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split("\n")[:-1] == ["records 1", "records 1", "records 1", "records 0"]


# ------------------------------------------------------------------------------ files anyone can plant (issue 31)

NOBODY = 65534  # an unprivileged uid


@pytest.mark.parametrize("forger, victim_pid", [
    # Another user names this namespace, the victim's pid (2: the namespace's second process) and uid 0: only
    # the record's owner (not the uid it names) gives it away; pid 2 here is another process (kthreadd).
    (NOBODY, 2),
    # The region's own uid names a pid that no process has here: only the process that has it in another pid
    # namespace (seen where every process is visible, NSpid) saves the region.
    (0, "unused")])
def test_a_forged_owner_record_never_gets_a_live_region_of_another_pid_namespace_removed(shared_shm, forger,
                                                                                        victim_pid):
    """Issue 31, finding 2: an engine in a pid namespace of its own shares /dev/shm; a file named like an owner
    record of this namespace for its pid and uid gets neither an Engine start, `info` nor `clean` here to remove
    its live region, and a new writer's pages still land in it."""
    if forger == 0 and shmclean._why_owners_are_hidden():
        pytest.skip(f"this process does not see every process: {shmclean._why_owners_are_hidden()}")
    pid = unused_pid() if victim_pid == "unused" else victim_pid
    # The namespace's init (sh) runs the victim as its next process: pid 2, or the pid chosen.
    choose = f"echo {pid - 1} > /proc/sys/kernel/ns_last_pid && " if pid != 2 else ""
    victim = PeerProcess(("shm", None), 16 * PAGE, launcher=[*shared_shm.launcher, *CHILD_PID_NAMESPACE, "sh", "-c",
                                                            f'{choose}"$@"; :', "sh"])
    try:
        regions = shared_shm.regions_of(pid)
        assert regions and all(Path(r).name.split(":")[1] == "0" for r in regions), os.listdir(shared_shm.dir)
        # Started at boot: gone (or another process) here, and before the region was made.
        start = 2 if shmclean._start_ticks(pid) == 1 else 1
        record = f"fabriclab-engine.pidns{shmclean._namespace('pid')}.pid{pid}.uid0.start{start}"
        subprocess.run([*shared_shm.launcher, "setpriv", f"--reuid={forger}", f"--regid={forger}", "--clear-groups",
                        "touch", f"/dev/shm/{record}"], check=True, timeout=30)
        assert record in shared_shm.records() and (shared_shm.dir / record).stat().st_uid == forger

        for argv in (["-c", "from fabriclab import Engine; Engine('shm').close()"], ["-m", "fabriclab", "info"],
                     ["-m", "fabriclab", "clean"]):
            done = shared_shm.python(*argv)
            assert done.returncode == 0, done.stderr
            assert "removed" not in done.stdout and "reclaimed" not in done.stdout, (argv, done.stdout)
            assert shared_shm.regions_of(pid) == regions, argv
        assert_a_new_writer_lands(shared_shm, victim)
    finally:
        victim.close()


def test_a_record_counts_only_as_a_regular_file_owned_by_the_uid_it_names(tmp_path):
    """Issue 31, finding 2, wherever not every process is visible: only the record's file tells who made it."""
    if os.geteuid() != 0:
        pytest.skip("making another user's files needs root")
    ns, gone = shmclean._namespace("pid"), 5_000_000  # past any pid_max: no process has it anywhere

    def region_and_record(pid: int, uid: int, owner: int, symlink: bool = False) -> None:
        (tmp_path / f"{pid}:{uid}:0").touch()  # root's
        record = tmp_path / f"fabriclab-engine.pidns{ns}.pid{pid}.uid{uid}.start1"
        if symlink:
            (tmp_path / "elsewhere").touch()
            record.symlink_to(tmp_path / "elsewhere")
        else:
            record.touch()
            os.chown(record, owner, owner)

    region_and_record(gone, 0, 0)  # the engine's own
    region_and_record(gone + 1, 0, NOBODY)  # another user's, naming uid 0
    region_and_record(gone + 2, 0, 0, symlink=True)  # a link to a file of uid 0
    region_and_record(gone + 3, NOBODY, NOBODY)  # another user's, naming itself: not for a region root owns
    assert [r.pid for r in shmclean.find_stale_shm_regions(tmp_path)] == [gone]


def test_a_name_with_a_trailing_newline_is_no_region(private_shm):
    """Issue 31, finding 10: libfabric never makes `<pid>:<uid>:<index>\\n`; `clean --force` leaves it."""
    odd = private_shm.dir / f"{unused_pid()}:0:0\n"
    odd.write_bytes(b"")
    done = private_shm.run("clean", "--force")
    assert done.returncode == 0, done.stderr
    assert odd.exists() and "removed" not in done.stdout, done.stdout


def plant(directory: Path, n: int) -> None:
    """``n`` files another user made: half owner records forged for uid 0, half owner records of its own with a
    region each, all of engines long gone (pids past any pid_max) of this pid namespace."""
    ns = shmclean._namespace("pid")
    for i in range(n):
        pid = 5_000_000 + i
        names = ([f"fabriclab-engine.pidns{ns}.pid{pid}.uid0.start1"] if i % 2 else
                 [f"fabriclab-engine.pidns{ns}.pid{pid}.uid{NOBODY}.start1", f"{pid}:{NOBODY}:0"])
        for name in names:
            (directory / name).touch()
            os.chown(directory / name, NOBODY, NOBODY)


def work_of_reclaiming(directory: Path) -> tuple[int, int]:
    """(directory listings, Python and builtin calls) that judging ``directory`` as an Engine start does (dry)."""
    listings = calls = 0

    def count(frame, event, arg):
        nonlocal listings, calls
        calls += event in ("call", "c_call")
        listings += event == "c_call" and arg in (os.listdir, os.scandir)

    sys.setprofile(count)
    try:
        shmclean.reclaim_stale_shm_regions(dry_run=True, shm_dir=directory)
    finally:
        sys.setprofile(None)
    return listings, calls


def test_planted_files_cost_an_engine_start_linear_work(tmp_path):
    """Issue 31, finding 7: each gone record scanned every name in /dev/shm, so N planted record-like files cost
    an Engine start N² work (18 s for 8,000). Counted, not timed: four times the files cost at most about four
    times the calls, and no more directory listings."""
    if os.geteuid() != 0:
        pytest.skip("planting another user's files needs root")
    small, big = tmp_path / "small", tmp_path / "big"
    small.mkdir()
    big.mkdir()
    plant(small, 500)
    plant(big, 2000)
    (small_listings, small_calls), (big_listings, big_calls) = work_of_reclaiming(small), work_of_reclaiming(big)
    assert big_listings == small_listings <= 2  # the directory's, and /proc's (every process's pids) once
    assert big_calls < 5 * small_calls, (small_calls, big_calls)  # linear: < 4x (a fixed part); quadratic: ~15x
    assert [r.pid for r in shmclean.find_stale_shm_regions(big)] == [5_000_000 + i for i in range(0, 2000, 2)]
