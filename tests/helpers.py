"""What several test files share: one child-process helper with a deadline on every read and wait, the
API tests' peer (tests/api_peer.py) built on it, and small probes of what a process left behind.

Every wait here has a deadline well below pytest's own (pyproject's 300 s), and a failure says what was
awaited and prints the tail of the child's stderr, so a silent peer fails its test in seconds with the
reason instead of hanging the run."""
from __future__ import annotations

import collections
import glob
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from typing import IO

import numpy as np

from fabriclab import bootstrap

HERE = os.path.dirname(os.path.abspath(__file__))
API_PEER = os.path.join(HERE, "api_peer.py")
PAGE = 65536  # the API tests' page size
LINE_TIMEOUT = 60.0  # a line a child prints on its own (its port, "ready", a result): it starts in seconds
ASK_TIMEOUT = 60.0  # above the longest "expect ... TIMEOUT" a test asks api_peer.py for (30 s)
EXIT_TIMEOUT = 10.0  # a child told to end (end of input, a signal) is gone by then
STDERR_LINES = 30  # the tail of a child's stderr a failure prints
_EOF = None  # what a pump puts in the queue when the child's stdout closes


class Child:
    """A process whose stdin takes commands and whose stdout answers a line at a time. Threads read its stdout
    and stderr as they come (a full pipe never blocks it, and no read here can block past its deadline); its
    stderr is also copied to this process's stderr, which pytest shows beside a failed test. Leaving a
    ``with`` block kills it if it still runs."""

    def __init__(self, argv: Sequence[str], *, launcher: Sequence[str] = (), env: dict[str, str] | None = None):
        """``argv`` runs as given (``python(...)`` builds one for a script); ``launcher`` is a command prefix
        it runs under (``ip netns exec NS``, ``nsenter``)."""
        self.argv = [*launcher, *map(str, argv)]
        self.proc = subprocess.Popen(self.argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     text=True, env=env)
        assert self.proc.stdin and self.proc.stdout and self.proc.stderr  # all three piped just above
        self.stdin: IO[str] = self.proc.stdin
        self._stdout: IO[str] = self.proc.stdout
        self._stderr: IO[str] = self.proc.stderr
        self.pid = self.proc.pid
        self._lines: queue.Queue[str | None] = queue.Queue()
        self._errors: collections.deque[str] = collections.deque(maxlen=STDERR_LINES)
        self._readers = [threading.Thread(target=self._pump_stdout, daemon=True),
                         threading.Thread(target=self._pump_stderr, daemon=True)]
        for reader in self._readers:
            reader.start()

    def _pump_stdout(self) -> None:
        for line in self._stdout:
            self._lines.put(line.rstrip("\n"))
        self._lines.put(_EOF)

    def _pump_stderr(self) -> None:
        for line in self._stderr:
            self._errors.append(line.rstrip("\n"))
            sys.stderr.write(f"[{self._name()} {self.pid}] {line}")

    def _name(self) -> str:
        """The script (or module) the child runs, for messages: its first argument ending in .py, or -m's."""
        for i, arg in enumerate(self.argv):
            if arg.endswith(".py") or (i and self.argv[i - 1] == "-m"):
                return os.path.basename(arg)
        return os.path.basename(self.argv[0])

    def stderr(self) -> str:
        """The last lines the child wrote to stderr."""
        return "\n".join(self._errors)

    def _failure(self, what: str) -> str:
        return f"{what} ({self._name()}, pid {self.pid}); its stderr ends:\n{self.stderr() or '(nothing)'}"

    def line(self, timeout: float = LINE_TIMEOUT, what: str = "a line") -> str:
        """The next line of its stdout, stripped; AssertionError after ``timeout`` seconds or at its end."""
        try:
            line = self._lines.get(timeout=timeout)
        except queue.Empty:
            raise AssertionError(self._failure(f"no {what} within {timeout:g} s")) from None
        if line is _EOF:
            self._lines.put(_EOF)  # every later read ends the same way
            code = self._reap()
            raise AssertionError(self._failure(f"no {what}: the process ended (exit status {code}; negative: "
                                               "the signal that killed it)"))
        return line.strip()

    def send(self, line: str) -> None:
        """One command line on its stdin; AssertionError if it can no longer read one."""
        try:
            self.stdin.write(line + "\n")
            self.stdin.flush()
        except (BrokenPipeError, ValueError):
            raise AssertionError(self._failure(f"cannot send {line!r}: the process ended "
                                               f"(exit status {self._reap()})")) from None

    def ask(self, command: str, timeout: float = ASK_TIMEOUT) -> str:
        """Send one command and return its one-line answer."""
        self.send(command)
        return self.line(timeout, f"answer to {command!r}")

    def signal(self, signum: int) -> None:
        self.proc.send_signal(signum)

    def poll(self) -> int | None:
        return self.proc.poll()

    def _reap(self) -> int | str:
        try:
            return self.proc.wait(EXIT_TIMEOUT)
        except subprocess.TimeoutExpired:
            return f"none: still running {EXIT_TIMEOUT:g} s after its stdout closed"

    def wait(self, timeout: float = EXIT_TIMEOUT) -> int:
        """Its exit status once it ends; AssertionError (it is left running) if not within ``timeout``."""
        try:
            code = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(self._failure(f"still running after {timeout:g} s")) from None
        for reader in self._readers:
            reader.join(EXIT_TIMEOUT)  # its last output is read before anyone looks at it
        return code

    def kill(self) -> int:
        """SIGKILL (if it still runs) and reap it."""
        if self.proc.poll() is None:
            self.proc.kill()
        return self.wait()

    def close(self, timeout: float = EXIT_TIMEOUT, check: bool = True) -> int:
        """End of input, which ends every helper script here cleanly (a stopped one is continued first). One
        still running after ``timeout`` is killed, and that is an AssertionError when ``check``."""
        if self.proc.poll() is None:
            try:
                self.proc.send_signal(signal.SIGCONT)  # a test that failed midway may have left it stopped
                self.stdin.close()
            except OSError:
                pass  # it ended meanwhile, or its stdin pipe broke: waiting says which
            try:
                return self.wait(timeout)
            except AssertionError:
                self.kill()
                if check:
                    raise
        elif not self.stdin.closed:
            try:
                self.stdin.close()
            except OSError:
                pass  # a child that died with input unread leaves a broken pipe to close
        return self.wait()

    def __enter__(self) -> Child:
        return self

    def __exit__(self, *exc: object) -> None:
        self.kill()


def python(script: str, *args: object) -> list[str]:
    """The command line running ``script`` (a path) with this test run's Python."""
    return [sys.executable, script, *map(str, args)]


class PeerProcess(Child):
    """tests/api_peer.py in another process: an engine with one buffer, waiting for writes; ``address`` and
    ``descriptor`` are its engine's, swapped over its bootstrap port."""

    def __init__(self, fabric: tuple[str, str | None], size: int, *options: str, launcher: Sequence[str] = ()):
        """``launcher``: a command prefix the peer runs under (nsenter into another /dev/shm, say)."""
        provider, domain = fabric
        super().__init__(python(API_PEER, provider, domain or "-", size, *options), launcher=launcher)
        try:
            port = int(self.line(LINE_TIMEOUT, "bootstrap port"))
            self.address, self.descriptor = bootstrap.unpack(bootstrap.exchange(port, b"hello"))
        except BaseException:
            self.kill()
            raise


def pages_of(seed: int, n: int) -> np.ndarray:
    """``n`` pages of random bytes, the same for the same seed."""
    return np.random.default_rng(seed).integers(0, 256, size=n * PAGE, dtype=np.uint8)


def regions_of(pid: int) -> list[str]:
    """The shm provider's regions in /dev/shm that process ``pid`` created."""
    return glob.glob(f"/dev/shm/{pid}:*")


SHM_LOCK_AT = 24  # struct smr_region (libfabric 1.17/1.18): version, flags, pid, caps, base_addr, then the spinlock


def shm_locks_held(pids: Sequence[int]) -> bool:
    """Whether a spinlock of any shm region of processes ``pids`` is held (the word is not 0)."""
    for path in [path for pid in pids for path in regions_of(pid)]:
        try:
            with open(path, "rb") as region:
                word = region.read(SHM_LOCK_AT + 4)[SHM_LOCK_AT:]
        except OSError:
            continue
        if len(word) == 4 and word != bytes(4):
            return True
    return False


def kill_outside_shm_locks(proc: subprocess.Popen[str] | subprocess.Popen[bytes], others: Sequence[int]) -> None:
    """SIGKILL ``proc`` at an instant when it holds no shm spinlock: of its own regions, or of the regions of
    ``others`` (its peers). libfabric 1.17's shm never recovers a lock whose holder died (every later send to
    that queue spins for good: README says so), which no library above it can undo; a test of what a killed
    peer leaves behind otherwise fails the rare time the kill lands inside the provider's few locked
    instructions. Stopped, a process holds what it held: looked at then, and resumed for a moment if it holds
    one."""
    for _ in range(1000):
        proc.send_signal(signal.SIGSTOP)
        deadline = time.monotonic() + 1.0
        try:
            with open(f"/proc/{proc.pid}/stat") as stat:  # wait until it is stopped (1 s at most)
                while stat.read().split(") ")[-1][:1] not in ("T", "Z", "X") and time.monotonic() < deadline:
                    stat.seek(0)
        except OSError:
            break
        if not shm_locks_held([proc.pid, *others]):
            break
        proc.send_signal(signal.SIGCONT)
    proc.kill()


def namespaces() -> list[str]:
    """Every network namespace ``ip netns`` lists."""
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=30).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]
