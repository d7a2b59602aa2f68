"""Ending every process of a network namespace that is being removed (the testbed's ``down``): those inside
it and those holding it open to enter it, through pidfds, until none is left; a process stuck in the kernel
is an error that names it, never a hang."""
from __future__ import annotations

import contextlib
import errno
import os
import select
import signal
import time
from pathlib import Path

from .netns import TestbedError, TestbedUnavailable

END_GRACE_S = 2.0     # SIGTERM to SIGKILL, for processes left in a namespace that is being removed
END_TIMEOUT_S = 30.0  # a process not gone this long after SIGKILL is stuck in the kernel: an error, not a hang


def end_processes(ns: str, inode: int) -> None:
    """End every process inside namespace ``ns`` (known by its ``inode``, which outlives the name) or holding
    it open to enter it, this process and its ancestors excepted; return only once each one is gone.

    SIGTERM, SIGKILL after ``END_GRACE_S``, then a wait on each process's pidfd until it has exited, and
    again from the top until no process is left: one that entered while the others were ending (an
    ``ip netns exec`` that had opened the namespace but not yet entered it) is found on the next round.
    Nothing here depends on how fast a loaded machine runs; a process that survives SIGKILL for
    ``END_TIMEOUT_S`` (stuck in the kernel) is a TestbedError naming it."""
    spare = _ancestors()
    deadline = time.monotonic() + END_TIMEOUT_S
    while True:
        pids = pids_in_namespace(inode) - spare
        if not pids:
            return
        if time.monotonic() > deadline:
            raise TestbedError(f"processes kept entering namespace {ns} for {END_TIMEOUT_S:g} s while it was being "
                               f"removed (the last: {', '.join(map(_describe_process, sorted(pids)))}); stop "
                               "whatever starts them, then run `python -m fabriclab testbed down` again")
        survivors = _end_and_wait(pids, inode, deadline)
        if survivors:
            raise TestbedError(f"processes in namespace {ns} did not end within {END_TIMEOUT_S:g} s of SIGTERM "
                               f"and SIGKILL: {', '.join(map(_describe_process, survivors))} (stuck in the kernel?); "
                               f"the namespace stays: run `python -m fabriclab testbed down` again once they are gone")


def pids_in_namespace(inode: int) -> set[int]:
    pids = (int(entry.name) for entry in os.scandir("/proc") if entry.name.isdigit())
    return {pid for pid in pids if _in_namespace(pid, inode)}


def _in_namespace(pid: int, inode: int) -> bool:
    """Whether any thread of ``pid`` is in the network namespace ``inode``, or the process holds it open (the
    moment between an ``ip netns exec`` opening the namespace and entering it)."""
    # Compared with stat, not readlink: a namespace opened through its /run/netns name reads back as that
    # path, one entered as net:[inode]; both stat to the namespace's own (device, inode).
    wanted = (os.stat("/proc/self/ns/net").st_dev, inode)
    try:
        return (any(_file_id(f"/proc/{pid}/task/{tid}/ns/net") == wanted for tid in os.listdir(f"/proc/{pid}/task"))
                or any(_file_id(f"/proc/{pid}/fd/{fd}") == wanted for fd in os.listdir(f"/proc/{pid}/fd")))
    except OSError:  # it ended meanwhile
        return False


def _file_id(path: str) -> tuple[int, int] | None:
    try:
        info = os.stat(path)
    except OSError:
        return None
    return info.st_dev, info.st_ino


def _end_and_wait(pids: set[int], inode: int, deadline: float) -> list[int]:
    """SIGTERM ``pids``, SIGKILL those left after ``END_GRACE_S``; returns those still running at ``deadline``.
    Signals go through pidfds, so a pid that ends and is reused by an unrelated process is never signalled."""
    handles = {}
    try:
        for pid in pids:
            try:
                fd = os.pidfd_open(pid)
            except ProcessLookupError:
                continue  # gone already
            except OSError as exc:
                if exc.errno == errno.ENOSYS:
                    raise TestbedUnavailable("ending the testbed's processes needs pidfds (Linux 5.3 or later)") \
                        from None
                raise
            handles[pid] = fd
            # Opened after the scan: make sure the pid still names a process of the namespace, not a newcomer.
            if not _in_namespace(pid, inode):
                os.close(handles.pop(pid))
        alive = sorted(handles)
        grace_ends = min(time.monotonic() + END_GRACE_S, deadline)
        for sig, until in ((signal.SIGTERM, grace_ends), (signal.SIGKILL, deadline)):
            for pid in alive:
                with contextlib.suppress(ProcessLookupError):
                    signal.pidfd_send_signal(handles[pid], sig)
            alive = _wait_for_exit({pid: handles[pid] for pid in alive}, until)
            if not alive:
                break
        return alive
    finally:
        for fd in handles.values():
            os.close(fd)


def _wait_for_exit(handles: dict[int, int], until: float) -> list[int]:
    """Wait until every process behind the pidfds in ``handles`` has exited (its pidfd turns readable), or
    ``until``; returns the pids still running."""
    alive = dict(handles)
    poller = select.poll()
    for fd in alive.values():
        poller.register(fd, select.POLLIN)
    while alive:
        left = until - time.monotonic()
        if left <= 0:
            break
        for fd, _ in poller.poll(left * 1000):
            poller.unregister(fd)
            alive = {pid: f for pid, f in alive.items() if f != fd}
    return sorted(alive)


def _describe_process(pid: int) -> str:
    try:
        status = dict(line.split(":\t", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines()
                      if ":\t" in line)
        return f"pid {pid} ({status.get('Name', '?')}, state {status.get('State', '?')})"
    except OSError:
        return f"pid {pid}"


def _ancestors() -> set[int]:
    out, pid = set(), os.getpid()
    while pid > 1 and pid not in out:
        out.add(pid)
        try:
            pid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            break
    return out
