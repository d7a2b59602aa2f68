"""A signal delivered to one process never crashes another (issue 12, finding 2).

libfabric's shm provider installs handlers for SIGINT, SIGTERM, SIGSEGV and SIGBUS that delete the
process's /dev/shm region and then chain to the previous handler. Python turns SIGINT into
KeyboardInterrupt, so the process lived on without its region, and the next peer it wrote to mapped the
vanished region and crashed. fabriclab.fi gives those signals back to their previous handlers. Real
processes, real signals."""
import os
import signal
import subprocess
import sys

import pytest

from fabriclab import fi, shmclean
from helpers import API_PEER, Child, python, regions_of

HERE = os.path.dirname(__file__)
WRITER = os.path.join(HERE, "interrupted_writer.py")
PAGE = 4096  # interrupted_writer.py's page size

pytestmark = pytest.mark.skipif("shm" not in fi.available_providers(), reason="needs libfabric's shm provider")


def start_target(pages):
    """tests/api_peer.py over shm: returns the process and its bootstrap port (its address not yet swapped)."""
    target = Child(python(API_PEER, "shm", "-", pages * PAGE))
    return target, int(target.line())


def start_writer():
    writer = Child(python(WRITER))
    ready = writer.line()
    assert ready.startswith("ready "), ready
    return writer, int(ready.split()[1])


def posted(writer):
    """The writer's "posted sha256=..." answer: the digest a target as large as the write must end with."""
    answer = writer.line()
    assert answer.startswith("posted sha256="), answer
    return answer.split("=", 1)[1]


def assert_landed(target, imm, pages, digest):
    """The target answers (a dead one fails Child.ask with its exit status: negative, the signal that killed it)
    that every page landed."""
    assert target.ask(f"expect {imm} {pages} 10") == f"landed {pages} sha256={digest}"


def test_ctrl_c_leaves_the_region_and_a_new_peer_survives():
    writer, pid = start_writer()
    target = None
    try:
        assert regions_of(pid), "the writer's engine has no shm region"
        writer.signal(signal.SIGINT)
        assert writer.line() == "interrupted"
        assert regions_of(pid), "Ctrl-C deleted the live writer's /dev/shm region"
        target, port = start_target(4)
        writer.send(f"connect {port}")
        assert writer.line() == "connected"
        writer.send("write 5 4")
        digest = posted(writer)
        assert writer.line() == "wrote"
        assert_landed(target, 5, 4, digest)
        assert target.proc.poll() is None
    finally:
        for p in (writer, target):
            if p is not None:
                p.close(timeout=20, check=False)


def test_stopped_target_survives_an_interrupted_writer():
    """The issue's scenario: the target stopped, the writer Ctrl-C'd mid-write, the target continued."""
    target, port = start_target(4)
    writer = None
    try:
        writer, _ = start_writer()
        writer.send(f"connect {port}")
        assert writer.line() == "connected"
        target.signal(signal.SIGSTOP)
        writer.send("write 6 4")
        digest = posted(writer)
        writer.signal(signal.SIGINT)
        assert writer.line() == "interrupted"
        target.signal(signal.SIGCONT)  # it now reads the writer's first message, naming the writer's region
        assert_landed(target, 6, 4, digest)
        assert target.proc.poll() is None
    finally:
        for p in (target, writer):
            if p is not None:
                p.close(timeout=20, check=False)


def test_sigterm_still_terminates():
    writer, pid = start_writer()
    try:
        writer.signal(signal.SIGTERM)
        assert writer.proc.wait(20) == -signal.SIGTERM
    finally:
        writer.close(timeout=20, check=False)
        shmclean.reclaim_stale_shm_regions()  # dying of a signal leaves the region and the owner record


def test_the_provider_handlers_are_given_back_at_the_sigaction_level():
    """Python's signal.getsignal cannot see a C library's handler: compare the sigactions themselves."""
    script = """
import signal
from fabriclab import fi
from fabriclab._fabric import ffi, lib
signals = ffi.new("int[]", [int(s) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGSEGV, signal.SIGBUS)])
snapshot = lib.fl_signals_snapshot(signals, 4)
with fi.open_endpoint("shm"):
    print(lib.fl_signals_changed(snapshot, ffi.NULL, 0))
    print(" ".join(sorted(s.name for s in fi.signals_given_back())))
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=True)
    changed, given_back = out.stdout.splitlines()
    assert changed == "0"
    assert {"SIGINT", "SIGTERM"} <= set(given_back.split())
