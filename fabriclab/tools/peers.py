"""Start a stage's server in another process — locally, over ssh, or under a launcher prefix such as
``ip netns exec NAME`` — read the address it prints, stream its log, and stop it cleanly.

Every stage's ``serve`` prints its endpoint address as the first line of standard output (one hex line)
and serves until its standard input closes or it is sent SIGTERM/SIGINT.
"""
from __future__ import annotations

import atexit
import collections
import os
import re
import shlex
import signal
import string
import subprocess
import sys
import threading
import time
import weakref

from ..fi import Address, FabriclabError

_live: "weakref.WeakSet[ServerProcess]" = weakref.WeakSet()


class ServerExited(FabriclabError, RuntimeError):
    """The server process ended (or never printed its address): carries its exit status and last lines."""

    def __init__(self, what: str, returncode: int | None, last_lines: list[str]):
        self.returncode = returncode
        self.last_lines = last_lines
        status = "still running" if returncode is None else _describe_status(returncode)
        tail = "\n  ".join(last_lines[-10:]) or "(no output)"
        super().__init__(f"{what}; server {status}; its last output:\n  {tail}")


def _describe_status(rc: int) -> str:
    if rc < 0:
        try:
            return f"killed by {signal.Signals(-rc).name}"
        except ValueError:
            return f"killed by signal {-rc}"
    return f"exited with status {rc}"


def _is_address_line(line: str) -> bool:
    return len(line) >= 16 and all(c in string.hexdigits for c in line)


class ServerProcess:
    """One server process. A context manager: leaving the block (also by an exception or a notebook
    interrupt) stops the server; servers still running at interpreter exit are stopped too.

    ``launcher`` is a command prefix (``["ip", "netns", "exec", "fabriclab-a"]``); ``ssh`` a host to
    run on (fabriclab must be importable there with ``remote_python``).
    """

    def __init__(self, module: str, args: list[str] | tuple = (), *, launcher: list[str] | tuple = (),
                 ssh: str | None = None, python: str | None = None, env: dict | None = None,
                 startup_timeout: float = 30.0, echo: bool = False, keep_lines: int = 2000):
        self.module = module
        self.echo = echo
        cmd = [python or (sys.executable if ssh is None else "python3"), "-u", "-m", module, "serve",
               "--until-stdin-closes", *map(str, args)]
        if ssh is not None:
            cmd = ["ssh", "-T", "-o", "BatchMode=yes", ssh, shlex.join(cmd)]
        self.command = [*map(str, launcher), *cmd]
        self._lines: collections.deque[str] = collections.deque(maxlen=keep_lines)
        self._new_line = threading.Condition()
        self._address_line: str | None = None
        self._count = 0  # lines logged so far; the deque keeps the newest
        self._cursor = 0  # first line wait_for_log has not looked at
        full_env = dict(os.environ, PYTHONUNBUFFERED="1")
        full_env.update(env or {})
        self.proc = subprocess.Popen(self.command, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True, bufsize=1, env=full_env,
                                     start_new_session=True)
        self._reader = threading.Thread(target=self._read, name=f"{module}-log", daemon=True)
        self._reader.start()
        _live.add(self)
        try:
            self._wait_for_address(startup_timeout)
        except BaseException:
            self.stop()
            raise

    def _read(self) -> None:
        for raw in self.proc.stdout:
            line = raw.rstrip("\n")
            with self._new_line:
                if self._address_line is None and _is_address_line(line):
                    self._address_line = line
                else:
                    self._lines.append(line)
                    self._count += 1
                    if self.echo:
                        print(f"[server] {line}", flush=True)
                self._new_line.notify_all()
        with self._new_line:
            self._new_line.notify_all()

    def _wait_for_address(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        with self._new_line:
            while self._address_line is None:
                if self.proc.poll() is not None and not self._reader.is_alive():
                    raise ServerExited(f"{self.module} stopped before printing its address",
                                       self.proc.returncode, list(self._lines))
                left = deadline - time.monotonic()
                if left <= 0:
                    raise ServerExited(f"{self.module} printed no address within {timeout:g} s", self.proc.poll(),
                                       list(self._lines))
                self._new_line.wait(min(left, 0.1))
        self.address = Address.parse(self._address_line)

    @property
    def address_hex(self) -> str:
        return self._address_line

    @property
    def log(self) -> list[str]:
        with self._new_line:
            return list(self._lines)

    @property
    def running(self) -> bool:
        return self.proc.poll() is None

    def check_alive(self) -> None:
        if self.proc.poll() is not None:
            self._reader.join(1.0)
            raise ServerExited(f"{self.module} is gone", self.proc.returncode, self.log)

    def skip_log(self) -> None:
        """Leave the lines logged so far to no later :meth:`wait_for_log`: a server that serves several runs,
        each waiting for lines of its own."""
        with self._new_line:
            self._cursor = self._count

    def wait_for_log(self, pattern: str, timeout: float = 10.0) -> re.Match:
        """Wait for the next log line matching the regular expression (lines matched or skipped by an
        earlier call are not looked at again)."""
        rx = re.compile(pattern)
        deadline = time.monotonic() + timeout
        with self._new_line:
            while True:
                first = self._count - len(self._lines)
                for index in range(max(self._cursor, first), self._count):
                    m = rx.search(self._lines[index - first])
                    if m:
                        self._cursor = index + 1
                        return m
                self._cursor = self._count
                if self.proc.poll() is not None and not self._reader.is_alive():
                    raise ServerExited(f"no log line matching {pattern!r}", self.proc.returncode, list(self._lines))
                left = deadline - time.monotonic()
                if left <= 0:
                    raise ServerExited(f"no log line matching {pattern!r} within {timeout:g} s", self.proc.poll(),
                                       list(self._lines))
                self._new_line.wait(min(left, 0.1))

    def kill(self) -> None:
        """SIGKILL the server (and anything its launcher started): the fault the tests inject."""
        self._signal(signal.SIGKILL)
        self.proc.wait(10)
        self._reader.join(2.0)

    def _signal(self, sig) -> None:
        try:
            os.killpg(self.proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass

    def stop(self, timeout: float = 5.0) -> int | None:
        """Close the server's stdin, then SIGTERM, then SIGKILL; returns its exit status."""
        if self.proc.poll() is None:
            try:
                self.proc.stdin.close()
            except OSError:
                pass
            try:
                self.proc.wait(min(timeout, 2.0))
            except subprocess.TimeoutExpired:
                self._signal(signal.SIGTERM)
                try:
                    self.proc.wait(timeout)
                except subprocess.TimeoutExpired:
                    self._signal(signal.SIGKILL)
                    self.proc.wait(5)
        self._reader.join(2.0)
        for stream in (self.proc.stdin, self.proc.stdout):
            try:
                stream.close()
            except OSError:
                pass
        _live.discard(self)
        return self.proc.returncode

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()
        return False

    def __repr__(self) -> str:
        state = "running" if self.running else _describe_status(self.proc.returncode)
        return f"<ServerProcess {self.module} pid={self.proc.pid} {state}>"


def start_server(module: str, *args, **kw) -> ServerProcess:
    """``start_server("fabriclab.bidirectional", "--provider", "shm")``: see ServerProcess."""
    return ServerProcess(module, args, **kw)


@atexit.register
def _stop_all() -> None:
    for server in list(_live):
        server.stop(timeout=2.0)
