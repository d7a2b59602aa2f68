"""Traffic through a testbed: a stage's server and client on one link, any command inside one side's
namespace, a plain TCP measurement of one link's shaping, and waiting for a transfer to be under way. A
mixin of ``testbed.Testbed``, which gives it ``link(index)``, ``launcher(side)``, ``stage_args``,
``assert_contained``, ``check_peer``, ``counters`` and ``_require_up()``."""
from __future__ import annotations

import os
import subprocess
import sys
import time

from .. import fi
from .netns import TestbedError

_SERVER_SCRIPT = r"""
import socket, sys, time
s = socket.socket()
s.bind((sys.argv[1], 0))
s.listen(1)
s.settimeout(float(sys.argv[2]))
print(s.getsockname()[1], flush=True)
c, _ = s.accept()
c.settimeout(float(sys.argv[2]))
n, first = 0, None
while True:
    b = c.recv(1 << 20)
    if not b:
        break
    if first is None:
        first = time.perf_counter()
    else:
        n += len(b)
end = time.perf_counter()
print(n, end - first if first else 0.0, flush=True)
"""

_CLIENT_SCRIPT = r"""
import socket, sys
c = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=float(sys.argv[5]),
                             source_address=(sys.argv[3], 0))
data = bytes(1 << 20)
left = int(sys.argv[4])
while left > 0:
    c.sendall(data[:min(left, len(data))])
    left -= len(data)
c.shutdown(socket.SHUT_WR)
c.recv(1)
"""


class TestbedTraffic:
    """``server``, ``client``, ``run``, ``measure`` and ``wait_for_traffic`` of a ``Testbed``."""
    __test__ = False  # not a pytest class

    def wait_for_traffic(self, index: int, nbytes: int, timeout: float = 60.0, running=None) -> None:
        """Return once ``nbytes`` more have reached the server end of link ``index``: a transfer is under way
        on it (the moment to inject a fault). A TestbedError when ``running`` (a Popen) ends first, or on
        the timeout."""
        start = self.counters(index)["server"]["rx"]["bytes"]
        deadline = time.monotonic() + timeout
        while self.counters(index)["server"]["rx"]["bytes"] - start < nbytes:
            if running is not None and running.poll() is not None:
                raise TestbedError(f"the transfer ended (exit {running.returncode}) before link {index} carried "
                                   f"{nbytes} bytes")
            if time.monotonic() > deadline:
                raise TestbedError(f"link {index} did not carry {nbytes} bytes within {timeout:g} s")
            time.sleep(0.02)

    def server(self, module: str, link: int = 0, args=(), **kw):
        """Start a stage's server in the server namespace on one link (``--provider tcp;ofi_rxm --domain
        fl<i>a``); checks containment first and that the address it printed is that link's."""
        from .peers import ServerProcess
        self.assert_contained()
        proc = ServerProcess(module, [*self.stage_args(link, "server"), *map(str, args)],
                             launcher=self.launcher("server"), **kw)
        try:
            self.check_peer(proc.address, "server", link)
        except BaseException:
            proc.stop()
            raise
        return proc

    def client(self, module: str, address, link: int = 0, args=(), timeout: float | None = 120.0,
               command: str = "connect", env: dict | None = None) -> subprocess.CompletedProcess:
        """Run a stage's client (``connect ADDRESS``) in the client namespace on one link; returns the
        finished process (stdout, stderr, returncode). The address must be the server's on that link."""
        self.check_peer(address, "server", link)
        hex_address = fi.Address.parse(address).hex()
        return self.run("client", [sys.executable, "-m", module, command, hex_address,
                                   *self.stage_args(link, "client"), *map(str, args)], timeout=timeout, env=env)

    def run(self, side: str, argv: list[str], timeout: float | None = 120.0, env: dict | None = None,
            **kw) -> subprocess.CompletedProcess:
        """Run a command inside one side's namespace and wait for it (output captured as text)."""
        self._require_up()
        full_env = dict(os.environ, PYTHONUNBUFFERED="1", **(env or {}))
        return subprocess.run([*self.launcher(side), *map(str, argv)], capture_output=True, text=True,
                              timeout=timeout, env=full_env, **kw)

    def measure(self, link: int = 0, nbytes: int = 4 << 20, timeout: float = 60.0) -> dict:
        """Push ``nbytes`` through one link with a plain TCP socket (client side to server side) and
        return what the receiver saw from its first chunk on (``bytes`` after that chunk, ``seconds`` until
        the end) and bits per second: the shaping, checked without libfabric."""
        l = self.link(link)
        self.assert_contained()
        srv = subprocess.Popen([*self.launcher("server"), sys.executable, "-c", _SERVER_SCRIPT, l.server_addr,
                                str(timeout)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            port = srv.stdout.readline().strip()
            if not port.isdigit():
                raise TestbedError(f"measurement server did not start: {srv.stderr.read().strip()}")
            done = self.run("client", [sys.executable, "-c", _CLIENT_SCRIPT, l.server_addr, port, l.client_addr,
                                       str(nbytes), str(timeout)], timeout=timeout)
            if done.returncode != 0:
                raise TestbedError(f"measurement client failed on link {link}: {done.stderr.strip()[-500:]}")
            out, err = srv.communicate(timeout=timeout)
            got, seconds = out.split()
        except BaseException:
            srv.kill()
            srv.wait()
            raise
        got, seconds = int(got), float(seconds)
        return {"link": link, "bytes": got, "seconds": seconds, "bps": got * 8 / seconds if seconds > 0 else None,
                "rate_bps": self.rate_bps}
