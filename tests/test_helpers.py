"""tests/helpers.py's Child: a silent, dead or stuck child fails the test within its deadline, saying what was
awaited and what the child wrote to stderr (issue 24: PeerProcess.readline() could hang until pytest's 300 s)."""
import signal
import time

import pytest

from helpers import Child, PeerProcess, python

SILENT = "import sys, time; print('about to go quiet', file=sys.stderr, flush=True); time.sleep(60)"


def test_a_silent_child_fails_the_read_in_time_with_its_stderr():
    with Child(python("-c", SILENT)) as child:
        started = time.monotonic()
        with pytest.raises(AssertionError, match="(?s)no bootstrap port within 1 s.*about to go quiet"):
            child.line(1, "bootstrap port")
        assert time.monotonic() - started < 5
    assert child.poll() == -signal.SIGKILL  # leaving the block killed it


def test_a_child_that_dies_fails_the_read_and_the_send_with_its_exit_status():
    child = Child(python("-c", "import sys; sys.exit('no such provider: nope')"))
    with pytest.raises(AssertionError, match="(?s)the process ended \\(exit status 1;.*no such provider: nope"):
        child.line(30, "bootstrap port")
    with pytest.raises(AssertionError, match="cannot send 'expect 1 1 1': the process ended"):
        for _ in range(100):  # the pipe may take a write or two before it breaks
            child.send("expect 1 1 1")
    assert child.close() == 1


def test_a_child_stuck_after_end_of_input_is_killed_and_named():
    child = Child(python("-c", "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(60)"))
    with pytest.raises(AssertionError, match="still running after 0.5 s"):
        child.close(timeout=0.5)
    assert child.poll() == -signal.SIGKILL


def test_a_stopped_peer_fails_the_question_in_time_and_still_closes(fabric):
    """The old PeerProcess.ask read its answer with a bare readline: a peer that never answers (stopped here,
    as a test that SIGSTOPs one and then fails leaves it) held the run until pytest's 300 s timeout."""
    peer = PeerProcess(fabric, 4096)
    try:
        peer.signal(signal.SIGSTOP)
        started = time.monotonic()
        with pytest.raises(AssertionError, match="no answer to 'digest' within 2 s"):
            peer.ask("digest", timeout=2)
        assert time.monotonic() - started < 5
    finally:
        assert peer.close() == 0  # continued, then ended by the end of its input


def test_a_peer_that_cannot_start_says_why():
    with pytest.raises(AssertionError, match="(?s)no bootstrap port: the process ended.*no-such-provider"):
        PeerProcess(("no-such-provider", None), 4096)
