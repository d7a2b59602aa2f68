"""Stale shm regions: processes SIGKILLed with an shm Engine open leave their /dev/shm regions; the cleaner
removes those and never a live process's.

Each test gets its own /dev/shm (a tmpfs in a private mount namespace): other test runs on this machine
start Engines, which reclaim stale regions, and must neither take this test's killed owner's region from
under it nor lose their own to it.
"""
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from fabriclab import shmclean

# An owner: an shm Engine, open until killed; "ready" once its region exists.
OWNER = "import fabriclab, time; e = fabriclab.Engine('shm', nics=1); print('ready', flush=True); time.sleep(120)"


@dataclass
class PrivateShm:
    dir: Path            # the private /dev/shm as this process sees it
    launcher: list[str]  # command prefix running a program with the private /dev/shm as its /dev/shm

    def start_owner(self) -> subprocess.Popen:
        owner = subprocess.Popen([*self.launcher, sys.executable, "-c", OWNER], stdout=subprocess.PIPE, text=True)
        assert owner.stdout.readline().strip() == "ready", "the shm Engine did not open"
        return owner

    def regions_of(self, pid: int) -> list[str]:
        return sorted(str(p) for p in self.dir.iterdir() if p.name.startswith(f"{pid}:"))

    def run(self, *argv: str) -> subprocess.CompletedProcess:
        return subprocess.run([*self.launcher, sys.executable, "-m", "fabriclab", *argv], capture_output=True,
                              text=True, timeout=60)


def kill(owner: subprocess.Popen) -> None:
    owner.send_signal(signal.SIGKILL)
    owner.wait(10)
    owner.stdout.close()


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
        kill(dead)
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
        kill(live)


def test_a_reused_pid_does_not_save_a_dead_owners_region(private_shm):
    dead = private_shm.start_owner()
    regions = private_shm.regions_of(dead.pid)
    kill(dead)
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
    kill(dead)
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
