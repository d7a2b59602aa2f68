"""A small p5 on one machine: two network namespaces joined by N veth pairs, each shaped with ``tc``.

libfabric's tcp provider lists every network interface as its own domain, exactly as EFA lists its
``rdmapXXs0`` devices, so a server in one namespace and a client in the other see N NICs each. 32 links
at 100 Mbit/s make 3.2 Gbit/s: the article's 3200 Gbps network at 1/1000 scale.

::

    with Testbed(links=4, rate="100mbit") as tb:          # needs root (or CAP_NET_ADMIN + CAP_SYS_ADMIN)
        server = tb.server("fabriclab.unidirectional", link=0)      # runs in tb.server_ns on fl0a
        done = tb.client("fabriclab.unidirectional", server.address_hex, link=0, args=["--size", "1M"])
        server.stop()

    python -m fabriclab testbed up --links 32 --rate 100mbit [--loss 0.1%]
    python -m fabriclab testbed status [--json]
    python -m fabriclab testbed link-down --link 3      # and link-up
    python -m fabriclab testbed down

Layout (link ``i`` counts from 0): namespace ``PREFIX-a`` (server side) holds ``fl<i>a`` with
169.254.<i+1>.1/24, namespace ``PREFIX-b`` (client side) holds ``fl<i>b`` with 169.254.<i+1>.2/24. One /24
per link keeps routing per link; 169.254.0.x and 169.254.255.x, which RFC 3927 reserves, are not used.
Each end's egress is shaped with tbf, so both directions run at the link rate. Links carry jumbo frames
(MTU 9000 by default; EFA reports 8760) one packet per skb (``gso_max_segs 1``), so loss and shaping act on
wire-sized packets. The namespaces have only ``lo`` and their veth ends, no default route and no IPv6, so
nothing can leave them.

The links are shaped, the CPU is not: every packet still costs the one kernel both namespaces share. On a
2-core machine, 32 plain TCP streams moved 2.1-2.4 Gbit/s in all (MTU 9000) of the 3.2 the links allow,
each link 67-100 Mbit/s; measure before reading a shortfall as the transfer engine's.

Random loss comes from iptables' statistic match inside each namespace (``-m statistic --mode random
--probability P -j DROP`` on the veth's input, both ends): the kernels here have no netem. Where a kernel
has netem, ``delay`` adds a fixed one-way delay per end.

``up`` records the namespaces it made (names and namespace inode numbers) in /run/fabriclab, and ``down``
removes only those, after ending any process still running inside them.
"""
from __future__ import annotations

import argparse
import contextlib
import errno
import fcntl
import ipaddress
import json
import os
import re
import select
import shutil
import signal
import socket
import struct
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from .. import cli, fi

PROVIDER = "tcp;ofi_rxm"
DEFAULT_PREFIX = "fabriclab"
DEFAULT_LINKS = 32
DEFAULT_RATE = "100mbit"
DEFAULT_MTU = 9000  # jumbo frames, as EFA (fi_info: MTU 8760); also a sixth of the packets to carry on few cores
MAX_LINKS = 254
LINK_LOCAL = ipaddress.ip_network("169.254.0.0/16")
LOOPBACK = ipaddress.ip_network("127.0.0.0/8")
STATE_DIR = Path("/run/fabriclab")
NETNS_DIR = Path("/var/run/netns")  # where iproute2 keeps named namespaces (/run/netns on current systems)
LOSS_CHAIN = "FABRICLAB-LOSS"
FALLBACK_NOTE = "the lessons fall back to the shm provider (one host, no links to shape)"
COMMAND_TIMEOUT = 30.0
END_GRACE_S = 2.0     # SIGTERM to SIGKILL, for processes left in a namespace that is being removed
END_TIMEOUT_S = 30.0  # a process not gone this long after SIGKILL is stuck in the kernel: an error, not a hang
TBF_LATENCY_MS = 25
SIDES = ("server", "client")
_PREFIX_RX = re.compile(r"^[a-z0-9][a-z0-9_.-]{0,39}$")
_IFNAME_RX = re.compile(r"^fl(\d+)([ab])$")


class TestbedError(fi.FabriclabError, RuntimeError):
    """Setting up, using or tearing down the testbed failed; the message names what and how to fix it."""
    __test__ = False


class TestbedUnavailable(TestbedError):
    """This machine (or this user) cannot make namespaces: no root, no iproute2, no netns support."""


class ContainmentError(TestbedError):
    """Something in the testbed could reach, or be, an address outside its own namespaces."""


# ------------------------------------------------------------------------------------------ parsing

def link_rate(rate: str | float | None) -> int | None:
    """A link's rate for tbf in bits per second (cli.parse_rate's notations: 100mbit, 1gbit, 500kbit,
    100M, a number), or None for an unshaped link: None, "none", "unlimited" or 0."""
    if rate is None or (isinstance(rate, str) and rate.strip().lower() in ("", "none", "unlimited")):
        return None
    bps = int(cli.parse_rate(rate))  # tc takes whole bits per second
    if bps == 0:
        return None
    if bps < 8000:
        raise fi.UsageError(f"rate {rate!r} is below 8 kbit/s, too slow for tbf to shape sensibly")
    return bps


def format_rate(bps: float | None) -> str:
    if not bps:
        return "unshaped"
    for scale, unit in ((1e12, "Tbit/s"), (1e9, "Gbit/s"), (1e6, "Mbit/s"), (1e3, "kbit/s")):
        if bps >= scale:
            return f"{bps / scale:.4g} {unit}"
    return f"{bps:.0f} bit/s"


def parse_loss(loss: str | float | None) -> float:
    """A drop probability from ``0.1%`` or ``0.001``; must be in [0, 1)."""
    if loss is None:
        return 0.0
    if isinstance(loss, str):
        text = loss.strip()
        try:
            value = float(text[:-1]) / 100 if text.endswith("%") else float(text)
        except ValueError:
            raise fi.UsageError(f"{loss!r} is not a loss rate (examples: 0.1%, 0.001)") from None
    else:
        value = float(loss)
    if not 0.0 <= value < 1.0:
        raise fi.UsageError(f"loss {loss!r} must be a probability in [0, 1) (or a percentage such as 0.1%)")
    return value


def format_loss(p: float) -> str:
    return f"{p * 100:.4g}%"


def parse_delay(delay: str | float | None) -> str | None:
    """A tc time (``5ms``, ``200us``) from text, or milliseconds from a number; None or 0 means no delay."""
    if delay is None or delay == 0 or delay == "":
        return None
    if isinstance(delay, (int, float)):
        if delay < 0:
            raise fi.UsageError(f"delay {delay!r} must not be negative")
        return f"{float(delay):g}ms"
    text = delay.strip().lower()
    if not re.fullmatch(r"[0-9]*\.?[0-9]+(us|ms|s)", text):
        raise fi.UsageError(f"{delay!r} is not a delay (examples: 5ms, 200us)")
    return text


# -------------------------------------------------------------------------------------------- links


@dataclass(frozen=True)
class Link:
    """One veth pair: ``server_if`` in the server namespace, ``client_if`` in the client namespace."""
    index: int
    server_if: str
    client_if: str
    server_addr: str
    client_addr: str
    prefixlen: int = 24

    @classmethod
    def make(cls, index: int) -> "Link":
        net = index + 1  # 169.254.0.0/24 is reserved (RFC 3927)
        return cls(index, f"fl{index}a", f"fl{index}b", f"169.254.{net}.1", f"169.254.{net}.2")

    def ifname(self, side: str) -> str:
        return self.server_if if _side(side) == "server" else self.client_if

    def address(self, side: str) -> str:
        return self.server_addr if _side(side) == "server" else self.client_addr

    @property
    def network(self) -> ipaddress.IPv4Network:
        return ipaddress.ip_network(f"{self.server_addr}/{self.prefixlen}", strict=False)


def _side(side: str) -> str:
    aliases = {"server": "server", "a": "server", "client": "client", "b": "client"}
    if side not in aliases:
        raise fi.UsageError(f"side must be 'server' or 'client', got {side!r}")
    return aliases[side]


# ----------------------------------------------------------------------------------- availability


def _have_net_admin() -> bool:
    """CAP_NET_ADMIN (links, qdiscs) and CAP_SYS_ADMIN (``ip netns`` mounts) in the effective set."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("CapEff:"):
                caps = int(line.split()[1], 16)
                return bool(caps & (1 << 12)) and bool(caps & (1 << 21))
    except (OSError, ValueError, IndexError):
        pass
    return os.geteuid() == 0


def _privilege_problem() -> str | None:
    if _have_net_admin():
        return None
    if os.geteuid() == 0:
        return ("the testbed needs CAP_NET_ADMIN and CAP_SYS_ADMIN, which this root process lacks (a restricted "
                "container? run it with those capabilities)")
    return (f"the testbed needs root or CAP_NET_ADMIN and CAP_SYS_ADMIN (running as uid {os.geteuid()} without "
            "them); try sudo")


def _require_privileges() -> None:
    problem = _privilege_problem()
    if problem:
        raise TestbedUnavailable(problem)


def _run(cmd: list[str], *, input: str | None = None, check: bool = True,
         timeout: float = COMMAND_TIMEOUT) -> subprocess.CompletedProcess:
    try:
        done = subprocess.run(cmd, input=input, capture_output=True, text=True, timeout=timeout)
    except FileNotFoundError:
        raise TestbedUnavailable(f"{cmd[0]} not found on PATH (install iproute2"
                                 f"{' and iptables' if cmd[0].startswith('iptables') else ''})") from None
    except subprocess.TimeoutExpired:
        raise TestbedError(f"`{' '.join(cmd)}` did not finish within {timeout:g} s") from None
    if check and done.returncode != 0:
        text = (done.stderr or done.stdout).strip().replace("\n", "; ")
        raise TestbedError(f"`{' '.join(cmd)}` failed: {text or f'exit status {done.returncode}'}")
    return done


def available(need_loss: bool = False) -> tuple[bool, str]:
    """Whether a testbed can be made here, and why not: privileges, iproute2 (and iptables when
    ``need_loss``), and a throw-away namespace with a shaped veth pair actually working."""
    if not sys.platform.startswith("linux"):
        return False, f"network namespaces need Linux (this is {sys.platform})"
    problem = _privilege_problem()
    if problem:
        return False, problem
    missing = [tool for tool in ("ip", "tc") + (("iptables",) if need_loss else ()) if shutil.which(tool) is None]
    if missing:
        what = "iproute2" if set(missing) & {"ip", "tc"} else "iptables"
        return False, f"{' and '.join(missing)} not found on PATH: install {what}"
    probe = f"{DEFAULT_PREFIX}-probe-{os.getpid()}"
    try:
        _run(["ip", "netns", "add", probe])
    except TestbedError as exc:
        return False, f"cannot create a network namespace: {exc}"
    try:
        _run(["ip", "-n", probe, "link", "add", "p0", "type", "veth", "peer", "name", "p1"])
        _run(["tc", "-n", probe, "qdisc", "add", "dev", "p0", "root", "tbf", "rate", "100mbit", "burst", "32kb",
              "latency", "25ms"])
        if need_loss:
            _run(["ip", "netns", "exec", probe, "iptables", "-w", "-A", "INPUT", "-i", "p0", "-m", "statistic",
                  "--mode", "random", "--probability", "0.001", "-j", "DROP"])
    except TestbedError as exc:
        return False, f"namespaces work but veth/tbf{'/iptables' if need_loss else ''} do not: {exc}"
    finally:
        _run(["ip", "netns", "del", probe], check=False)
    return True, "network namespaces, veth pairs and tc tbf work here"


def netem_available() -> tuple[bool, str]:
    """Whether this kernel has netem (for ``delay``), tried on a veth in a throw-away namespace."""
    _require_privileges()
    probe = f"{DEFAULT_PREFIX}-probe-{os.getpid()}"
    _run(["ip", "netns", "add", probe])
    try:
        _run(["ip", "-n", probe, "link", "add", "p0", "type", "veth", "peer", "name", "p1"])
        _run(["tc", "-n", probe, "qdisc", "add", "dev", "p0", "root", "netem", "delay", "1ms"])
    except TestbedError as exc:
        return False, str(exc)
    finally:
        _run(["ip", "netns", "del", probe], check=False)
    return True, "netem works here"


def require_available(need_loss: bool = False) -> None:
    ok, reason = available(need_loss)
    if not ok:
        raise TestbedUnavailable(reason)


def try_up(quiet: bool = False, **kw) -> "Testbed | None":
    """For the lessons: an up Testbed (``Testbed(**kw).up()``), or None after printing one line that says
    why not and that the lesson falls back to shm. Remember to ``down()`` what it returns."""
    try:
        return Testbed(**kw).up()
    except TestbedUnavailable as exc:
        if not quiet:
            print(f"no namespace testbed here: {exc}; {FALLBACK_NOTE}")
        return None


# ---------------------------------------------------------------------------------------- testbed


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


class Testbed:
    """Two namespaces (``server_ns``, ``client_ns``) joined by ``links`` veth pairs shaped to ``rate``.

    A context manager: ``up()`` on entry, ``down()`` on exit (also when the block raises). ``up`` is
    idempotent and converges an existing testbed of the same prefix to the asked-for links, rate and
    loss; ``down`` removes only namespaces this module made.
    """
    __test__ = False  # not a pytest class

    def __init__(self, links: int = DEFAULT_LINKS, rate: str | int | None = DEFAULT_RATE, loss: str | float = 0.0,
                 prefix: str = DEFAULT_PREFIX, delay: str | float | None = None, mtu: int = DEFAULT_MTU,
                 provider: str = PROVIDER):
        if not isinstance(links, int) or not 1 <= links <= MAX_LINKS:
            raise fi.UsageError(f"links must be a whole number from 1 to {MAX_LINKS}, got {links!r}")
        if not isinstance(prefix, str) or not _PREFIX_RX.match(prefix):
            raise fi.UsageError(f"prefix {prefix!r} must be 1-40 characters of a-z, 0-9, '.', '_', '-'")
        if not isinstance(mtu, int) or not 576 <= mtu <= 65535:
            raise fi.UsageError(f"mtu must be a whole number of bytes from 576 to 65535, got {mtu!r}")
        self.prefix = prefix
        self.mtu = mtu
        self.rate_bps = link_rate(rate)
        self.loss = parse_loss(loss)
        self.delay = parse_delay(delay)
        self.provider = provider
        self.links = [Link.make(i) for i in range(links)]
        self.server_ns = f"{prefix}-a"
        self.client_ns = f"{prefix}-b"

    # ------------------------------------------------------------------------------- description

    @classmethod
    def attach(cls, prefix: str = DEFAULT_PREFIX) -> "Testbed":
        """The testbed ``up`` made earlier (maybe by another process, e.g. the CLI), as it was configured."""
        state = _read_state(prefix)
        if not state:
            raise TestbedError(f"no testbed {prefix!r} is up (start one with: python -m fabriclab testbed up)")
        return cls(links=state["links"], rate=state["rate_bps"], loss=state["loss"], prefix=prefix,
                   delay=state.get("delay"), mtu=state.get("mtu", DEFAULT_MTU))

    @property
    def namespaces(self) -> tuple[str, str]:
        return self.server_ns, self.client_ns

    def namespace(self, side: str) -> str:
        return self.server_ns if _side(side) == "server" else self.client_ns

    @property
    def line_rate_bps(self) -> int | None:
        """All links together (links x rate): 32 x 100 Mbit/s = 3.2 Gbit/s."""
        return None if self.rate_bps is None else self.rate_bps * len(self.links)

    def link(self, index: int) -> Link:
        if not isinstance(index, int) or not 0 <= index < len(self.links):
            raise fi.UsageError(f"link {index!r} does not exist: this testbed has links 0-{len(self.links) - 1}")
        return self.links[index]

    def launcher(self, side: str) -> list[str]:
        """Command prefix that runs a program inside one side's namespace (for ``ServerProcess(launcher=)``)."""
        return ["ip", "netns", "exec", self.namespace(side)]

    def stage_args(self, link: int = 0, side: str = "server") -> list[str]:
        """``--provider tcp;ofi_rxm --domain fl<i>a|b``: a stage's options for one NIC of the testbed."""
        return ["--provider", self.provider, "--domain", self.link(link).ifname(side)]

    def __repr__(self) -> str:
        return (f"Testbed(links={len(self.links)}, rate={format_rate(self.rate_bps)!r}, loss={self.loss:g}, "
                f"prefix={self.prefix!r})")

    # ----------------------------------------------------------------------------- up and down

    def up(self) -> "Testbed":
        """Create (or converge) the namespaces, links, shaping and loss; then check containment."""
        require_available(need_loss=self.loss > 0)
        if self.delay is not None:
            ok, why = netem_available()
            if not ok:
                raise TestbedError(f"this kernel has no netem, so delay is not available here (random loss is: it "
                                   f"comes from iptables); leave the delay out. tc said: {why}")
        with self._lock():
            state = _read_state(self.prefix) or {}
            owned = dict(state.get("namespaces", {}))
            made = []
            for ns in self.namespaces:
                inode = _netns_inode(ns)
                if inode is not None and owned.get(ns) != inode:
                    raise TestbedError(f"namespace {ns} exists but was not made by fabriclab's testbed; leaving it "
                                       f"alone (remove it with `ip netns del {ns}` or choose another --prefix)")
            try:
                for ns in self.namespaces:
                    if _netns_inode(ns) is None:
                        _run(["ip", "netns", "add", ns])
                        owned[ns] = _netns_inode(ns)
                        made.append(ns)
                        self._write_state(owned)  # recorded at once so down() can remove it whatever happens
                self._configure()
                self._write_state(owned)
                self.assert_contained()
            except BaseException:
                if made:  # undo what this call made; a testbed that was already up stays as it is
                    for ns in made:
                        self._delete_namespace(ns, owned[ns])
                        owned.pop(ns, None)
                    if owned:
                        self._write_state(owned)
                    else:
                        _state_path(self.prefix).unlink(missing_ok=True)
                raise
        return self

    def down(self) -> list[str]:
        """Remove this prefix's namespaces (and with them their links), ending processes still inside them.
        Only namespaces ``up`` recorded as its own are touched; returns the names removed."""
        _require_privileges()
        with self._lock():
            state = _read_state(self.prefix)
            if not state:
                return []
            removed = []
            for ns, inode in state.get("namespaces", {}).items():
                if _netns_inode(ns) != inode:  # gone already, or the same name on someone else's namespace
                    continue
                self._delete_namespace(ns, inode)
                removed.append(ns)
            _state_path(self.prefix).unlink(missing_ok=True)
            return removed

    def exists(self) -> bool:
        state = _read_state(self.prefix)
        if not state:
            return False
        owned = state.get("namespaces", {})
        return all(owned.get(ns) is not None and _netns_inode(ns) == owned[ns] for ns in self.namespaces)

    def __enter__(self) -> "Testbed":
        return self.up()

    def __exit__(self, exc_type, exc, tb) -> bool:
        try:
            self.down()
        except TestbedError as err:
            if exc_type is None:
                raise
            print(f"warning: testbed {self.prefix} not removed: {err}", file=sys.stderr)  # keep the first error
        return False

    # ------------------------------------------------------------------------------ configuration

    def _configure(self) -> None:
        for ns in self.namespaces:
            _run(["ip", "-n", ns, "link", "set", "lo", "up"])
            # No IPv6: the testbed's only addresses are 169.254/16 (and 127.0.0.1 on lo).
            _run(["ip", "netns", "exec", ns, "sh", "-c",
                  "for f in /proc/sys/net/ipv6/conf/default/disable_ipv6 /proc/sys/net/ipv6/conf/all/disable_ipv6; "
                  "do [ -w $f ] && echo 1 > $f; done; true"], check=False)
        present = {m.group(1) for m in (_IFNAME_RX.match(n) for n in _veth_names(self.server_ns)) if m}
        wanted = {str(link.index) for link in self.links}
        for index in sorted(present - wanted, key=int):  # a smaller testbed than before: drop the extra links
            _run(["ip", "-n", self.server_ns, "link", "del", f"fl{index}a"])
        batch = [f"link add {link.server_if} netns {self.server_ns} type veth peer name {link.client_if} "
                 f"netns {self.client_ns}" for link in self.links if str(link.index) not in present]
        if batch:
            _run(["ip", "-batch", "-"], input="\n".join(batch) + "\n")
        for side in SIDES:
            ns = self.namespace(side)
            cmds = []
            for link in self.links:
                dev = link.ifname(side)
                cmds.append(f"addr replace {link.address(side)}/{link.prefixlen} dev {dev}")
                cmds.append(f"link set {dev} mtu {self.mtu} up")
            _run(["ip", "-n", ns, "-batch", "-"], input="\n".join(cmds) + "\n")
            # One skb per wire packet (no 64 KB GSO bursts): loss then hits MTU-sized packets, as on a wire,
            # and tbf meters packets rather than bursts. Older iproute2 without the option: left as is.
            _run(["ip", "-force", "-n", ns, "-batch", "-"], check=False,
                 input="".join(f"link set dev {link.ifname(side)} gso_max_segs 1\n" for link in self.links))
            self._shape(ns, [link.ifname(side) for link in self.links])
        if self.loss > 0 or _has_loss_chain(self.server_ns) or _has_loss_chain(self.client_ns):
            self.set_loss(self.loss)

    def _shape(self, ns: str, devs: list[str]) -> None:
        _run(["tc", "-force", "-n", ns, "-batch", "-"], check=False,
             input="".join(f"qdisc del dev {dev} root\n" for dev in devs))
        if self.rate_bps is None and self.delay is None:
            return
        cmds = []
        for dev in devs:
            tbf = ""
            if self.rate_bps is not None:
                burst = max(16 * 1024, self.rate_bps // 8 // 250)  # 4 ms at line rate, at least 16 KiB
                tbf = f"tbf rate {self.rate_bps}bit burst {burst} latency {TBF_LATENCY_MS}ms"
            if self.delay is None:
                cmds.append(f"qdisc add dev {dev} root handle 1: {tbf}")
            else:
                cmds.append(f"qdisc add dev {dev} root handle 1: netem delay {self.delay}")
                if tbf:
                    cmds.append(f"qdisc add dev {dev} parent 1:1 handle 10: {tbf}")
        _run(["tc", "-n", ns, "-batch", "-"], input="\n".join(cmds) + "\n")

    def set_loss(self, loss: str | float, link: int | None = None) -> None:
        """Drop packets at random with probability ``loss`` on every link (or on one), in both directions."""
        p = parse_loss(loss)
        self._require_up()
        chosen = self.links if link is None else [self.link(link)]
        if p > 0 and shutil.which("iptables") is None:
            raise TestbedUnavailable("random loss needs iptables (its statistic match), not found on PATH")
        for side in SIDES:
            ns = self.namespace(side)
            if p == 0 and not _has_loss_chain(ns):
                continue
            mine = {l.ifname(side) for l in self.links}
            current = {dev: prob for dev, prob in _loss_rules(ns).items() if dev in mine}
            for l in chosen:
                current[l.ifname(side)] = p
            ipt = ["ip", "netns", "exec", ns, "iptables", "-w"]
            if not _has_loss_chain(ns):
                _run([*ipt, "-N", LOSS_CHAIN])
            if _run([*ipt, "-C", "INPUT", "-j", LOSS_CHAIN], check=False).returncode != 0:
                _run([*ipt, "-I", "INPUT", "-j", LOSS_CHAIN])
            _run([*ipt, "-F", LOSS_CHAIN])
            for dev, prob in sorted(current.items()):
                if prob > 0:
                    _run([*ipt, "-A", LOSS_CHAIN, "-i", dev, "-m", "statistic", "--mode", "random",
                          "--probability", f"{prob:.6g}", "-j", "DROP"])
        if link is None:
            self.loss = p
        with contextlib.suppress(OSError, TestbedError):
            if self.exists():
                self._write_state(_read_state(self.prefix)["namespaces"])

    def link_down(self, index: int, side: str = "both") -> None:
        """``ip link set … down`` on one link (both ends by default): a NIC failure."""
        self._set_link(index, side, "down")

    def link_up(self, index: int, side: str = "both") -> None:
        """Bring a link back (addresses, routes and shaping are kept while it is down)."""
        self._set_link(index, side, "up")

    def _set_link(self, index: int, side: str, state: str) -> None:
        link = self.link(index)
        sides = SIDES if side == "both" else (_side(side),)
        self._require_up()
        for s in sides:
            _run(["ip", "-n", self.namespace(s), "link", "set", link.ifname(s), state])

    def bench_command(self, *options) -> list[str]:
        """``python -m fabriclab bench`` over every link, one NIC per link: the writer runs in the client
        namespace (this command), the target is started in the server namespace. ``options`` add the
        stage, sizes and threads."""
        return [*self.launcher("client"), sys.executable, "-m", "fabriclab", "bench", "--provider", self.provider,
                "--domain", ",".join(link.client_if for link in self.links),
                "--server-domain", ",".join(link.server_if for link in self.links),
                "--server-launcher", " ".join(self.launcher("server")), "--nics", str(len(self.links)),
                *map(str, options)]

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

    def counters(self, index: int) -> dict:
        """Bytes and packets each end of one link has sent and received (``ip -s link``): which links a
        transfer actually used, and how much went over each."""
        link = self.link(index)
        out = {}
        for side in SIDES:
            info = _ip_json(self.namespace(side), "-s", "link", "show", "dev", link.ifname(side))[0]
            stats = info.get("stats64", {})
            out[side] = {d: {k: stats.get(d, {}).get(k, 0) for k in ("bytes", "packets", "dropped")}
                         for d in ("rx", "tx")}
        return out

    def _require_up(self) -> None:
        _require_privileges()
        if not self.exists():
            raise TestbedError(f"testbed {self.prefix!r} is not up (namespaces {self.server_ns}, {self.client_ns})")

    # ------------------------------------------------------------------------------------- status

    def status(self) -> dict:
        """What the kernel says: namespaces, each link's names, addresses, state, rate and loss."""
        out = {"prefix": self.prefix, "up": self.exists(),
               "namespaces": {"server": self.server_ns, "client": self.client_ns},
               "provider": self.provider, "links": [], "rate_bps": self.rate_bps,
               "line_rate_bps": self.line_rate_bps, "loss": self.loss, "delay": self.delay, "mtu": self.mtu}
        if not out["up"]:
            return out
        _require_privileges()
        sides = {}
        for side in SIDES:
            ns = self.namespace(side)
            links = {d["ifname"]: d for d in _ip_json(ns, "link", "show")}
            addrs = {d["ifname"]: [a["local"] for a in d.get("addr_info", []) if a.get("family") == "inet"]
                     for d in _ip_json(ns, "-4", "addr", "show")}
            sides[side] = (links, addrs, _qdiscs(ns), _loss_rules(ns))
        rates = set()
        for link in self.links:
            row = {"index": link.index}
            for side in SIDES:
                links, addrs, qdiscs, loss = sides[side]
                dev = link.ifname(side)
                info = links.get(dev)
                q = qdiscs.get(dev, {})
                row[side] = {"ifname": dev, "address": link.address(side), "present": info is not None,
                             "addresses": addrs.get(dev, []),
                             "state": None if info is None else _link_state(info),
                             "mtu": None if info is None else info.get("mtu"),
                             "rate_bps": q.get("rate_bps"), "delay": q.get("delay"), "loss": loss.get(dev, 0.0)}
                rates.add(q.get("rate_bps"))
            out["links"].append(row)
        if len(rates) == 1:
            out["rate_bps"] = rates.pop()
            out["line_rate_bps"] = None if out["rate_bps"] is None else out["rate_bps"] * len(self.links)
        losses = {row[s]["loss"] for row in out["links"] for s in SIDES}
        out["loss"] = losses.pop() if len(losses) == 1 else sorted(losses)
        return out

    # -------------------------------------------------------------------------------- containment

    def assert_contained(self) -> None:
        """Check that nothing in the testbed can reach anything outside it: each namespace holds only
        ``lo`` and its veth ends, each veth's peer is the matching end in the other testbed namespace,
        every address is 169.254/16 (127.0.0.1 on lo) and there is no default or other outside route.
        Raises ContainmentError listing every problem."""
        problems = []
        self._require_up()
        ids = {}
        for side in SIDES:
            ns = self.namespace(side)
            other = self.namespace("client" if side == "server" else "server")
            ids[side] = {d["ifname"]: d for d in _ip_json(ns, "-d", "link", "show")}
            nsids = {str(d.get("nsid")): d.get("name") for d in _ip_json(ns, "netns", "list-id")}
            expected = {link.ifname(side): link for link in self.links}
            for name, info in ids[side].items():
                if name == "lo":
                    continue
                if name not in expected:
                    problems.append(f"{ns}: unexpected interface {name}")
                    continue
                kind = info.get("linkinfo", {}).get("info_kind")
                if kind != "veth":
                    problems.append(f"{ns}: {name} is {kind or 'not a veth'}, expected a veth end")
                peer_ns = nsids.get(str(info.get("link_netnsid")))
                if peer_ns != other:
                    problems.append(f"{ns}: {name}'s peer is in namespace {peer_ns or 'unknown/host'}, not {other}")
            for name in expected:
                if name not in ids[side]:
                    problems.append(f"{ns}: link {name} is missing")
            for dev in _ip_json(ns, "addr", "show"):
                name = dev["ifname"]
                for a in dev.get("addr_info", []):
                    ip = ipaddress.ip_address(a["local"])
                    if name == "lo":
                        ok = ip.is_loopback
                    elif ip.version == 4:
                        link = expected.get(name)
                        ok = ip in LINK_LOCAL and link is not None and str(ip) == link.address(side)
                    else:
                        ok = ip.is_link_local
                    if not ok:
                        problems.append(f"{ns}: address {ip} on {name} is not the testbed's")
            for family in ("-4", "-6"):
                # (a kernel without IPv6 has no -6 routes to show: that query may fail, and that is fine)
                for r in _ip_json(ns, family, "route", "show", "table", "all", check=family == "-4"):
                    dst = r.get("dst", "")
                    if dst == "default" or r.get("gateway") or r.get("via"):
                        via = f" via {r['gateway']}" if r.get("gateway") else ""
                        problems.append(f"{ns}: route {dst}{via} leads outside the testbed")
                        continue
                    try:
                        net = ipaddress.ip_network(dst, strict=False)
                    except ValueError:
                        problems.append(f"{ns}: route {dst!r} not understood")
                        continue
                    if net.version == 4:
                        ok = net.subnet_of(LINK_LOCAL) or net.subnet_of(LOOPBACK)
                    else:
                        ok = any(net.subnet_of(ipaddress.ip_network(n)) for n in ("fe80::/10", "ff00::/8", "::1/128"))
                    if not ok:
                        problems.append(f"{ns}: route to {dst} leads outside the testbed")
        for link in self.links:  # each pair joins end i in one namespace to end i in the other
            a, b = ids["server"].get(link.server_if), ids["client"].get(link.client_if)
            if a and b and (a.get("link_index") != b.get("ifindex") or b.get("link_index") != a.get("ifindex")):
                problems.append(f"{link.server_if} and {link.client_if} are not each other's peer")
        if problems:
            raise ContainmentError("testbed is not self-contained: " + "; ".join(problems))

    def check_peer(self, address, side: str = "server", link: int | None = None) -> str:
        """Check that a fabriclab address (hex line, bytes or fi.Address) is one of this testbed's own
        addresses on ``side`` (and ``link`` when given); returns its IP. Anything else is a ContainmentError:
        the testbed never sends traffic outside its namespaces."""
        addr = fi.Address.parse(address)
        raw = addr.raw
        if len(raw) < 8 or struct.unpack_from("<H", raw)[0] != socket.AF_INET:
            raise ContainmentError(f"address {addr.describe()} is not an IPv4 socket address; the testbed only "
                                   f"carries {self.provider} over IPv4")
        ip = socket.inet_ntoa(raw[4:8])
        links = self.links if link is None else [self.link(link)]
        allowed = {l.address(side) for l in links}
        if ip not in allowed:
            where = f"link {link}" if link is not None else f"the testbed's {_side(side)} side"
            raise ContainmentError(f"address {ip} is not on {where} ({', '.join(sorted(allowed))}); refusing to "
                                   "send traffic outside the testbed's namespaces")
        return ip

    # --------------------------------------------------------------------------------- traffic

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

    # ----------------------------------------------------------------------------------- helpers

    @contextlib.contextmanager
    def _lock(self):
        """One up/down at a time (across processes): a lock on the state folder itself, so no lock file."""
        try:
            STATE_DIR.mkdir(parents=True, exist_ok=True)
            fd = os.open(STATE_DIR, os.O_RDONLY | os.O_DIRECTORY)
        except OSError as exc:
            raise TestbedUnavailable(f"cannot use {STATE_DIR}: {exc.strerror}") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)

    def _write_state(self, owned: dict) -> None:
        STATE_DIR.mkdir(parents=True, exist_ok=True)
        state = {"prefix": self.prefix, "namespaces": owned, "links": len(self.links), "rate_bps": self.rate_bps,
                 "loss": self.loss, "delay": self.delay, "mtu": self.mtu, "provider": self.provider,
                 "server_ns": self.server_ns, "client_ns": self.client_ns}
        path = _state_path(self.prefix)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(state, indent=1))
        tmp.replace(path)

    def _delete_namespace(self, ns: str, inode: int) -> None:
        _end_processes(ns, inode)
        _run(["ip", "netns", "del", ns])
        # Whoever opened the namespace before its name went can still enter it: end those too, now that no
        # one new can open it, so nothing runs on in a namespace without a name.
        _end_processes(ns, inode)


def _state_path(prefix: str) -> Path:
    return STATE_DIR / f"testbed-{prefix}.json"


def _read_state(prefix: str) -> dict | None:
    try:
        return json.loads(_state_path(prefix).read_text())
    except (OSError, ValueError):
        return None


def _netns_inode(ns: str) -> int | None:
    try:
        return os.stat(NETNS_DIR / ns).st_ino
    except OSError:
        return None


def _ip_json(ns: str, *args: str, check: bool = True) -> list[dict]:
    done = _run(["ip", "-j", "-n", ns, *args], check=check)
    text = done.stdout.strip() if done.returncode == 0 else ""
    return json.loads(text) if text else []


def _veth_names(ns: str) -> list[str]:
    return [d["ifname"] for d in _ip_json(ns, "link", "show", "type", "veth")]


def _link_state(info: dict) -> str:
    flags = info.get("flags", [])
    if "UP" not in flags:
        return "down"
    if "NO-CARRIER" in flags or "LOWER_UP" not in flags:
        return "no-carrier"
    return "up"


def _qdiscs(ns: str) -> dict[str, dict]:
    out: dict[str, dict] = {}
    done = _run(["tc", "-j", "-n", ns, "qdisc", "show"], check=False)
    for q in json.loads(done.stdout or "[]") if done.returncode == 0 else []:
        dev = out.setdefault(q.get("dev"), {})
        opts = q.get("options", {})
        if q.get("kind") == "tbf" and "rate" in opts:
            dev["rate_bps"] = int(opts["rate"]) * 8  # tc -j reports bytes per second
        if q.get("kind") == "netem":
            delay = opts.get("delay", {})
            dev["delay"] = delay.get("delay") if isinstance(delay, dict) else delay
    return out


def _has_loss_chain(ns: str) -> bool:
    if shutil.which("iptables") is None:
        return False
    return _run(["ip", "netns", "exec", ns, "iptables", "-w", "-S", LOSS_CHAIN], check=False).returncode == 0


def _loss_rules(ns: str) -> dict[str, float]:
    if shutil.which("iptables") is None:
        return {}
    done = _run(["ip", "netns", "exec", ns, "iptables", "-w", "-S", LOSS_CHAIN], check=False)
    out = {}
    for line in done.stdout.splitlines():
        m = re.search(r"-i (\S+) .*--probability ([0-9.eE+-]+)", line)
        if m:
            out[m.group(1)] = round(float(m.group(2)), 6)
    return out


def _end_processes(ns: str, inode: int) -> None:
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
        pids = _pids_in_namespace(inode) - spare
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


def _pids_in_namespace(inode: int) -> set[int]:
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


# ------------------------------------------------------------------------------------------- CLI


ACTIONS = ("up", "down", "status", "link-down", "link-up")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("action", choices=ACTIONS, help="what to do (status: what is there now)")
    p.add_argument("--links", type=int, default=None, help=f"veth pairs for up (default {DEFAULT_LINKS})")
    p.add_argument("--rate", default=None, help=f"rate per link and direction for up, e.g. 100mbit, 1gbit, none "
                                               f"(default {DEFAULT_RATE})")
    p.add_argument("--loss", default=None, help="random loss per link and direction for up, e.g. 0.1%% or 0.001 "
                                               "(default 0)")
    p.add_argument("--delay", default=None, help="one-way delay per end, e.g. 5ms (needs netem in the kernel)")
    p.add_argument("--mtu", type=int, default=None, help=f"MTU of every link for up (default {DEFAULT_MTU})")
    p.add_argument("--link", type=int, default=None, help="link index for link-down / link-up")
    p.add_argument("--side", choices=("both", "server", "client"), default="both",
                   help="which end link-down / link-up acts on (default both)")
    p.add_argument("--prefix", default=DEFAULT_PREFIX, help="namespace name prefix (default %(default)s)")
    p.add_argument("--json", action="store_true", help="print the status as one JSON object")


def print_status(st: dict) -> None:
    ns = st["namespaces"]
    if not st["up"]:
        print(f"testbed {st['prefix']}: down (no namespaces {ns['server']}, {ns['client']} made by fabriclab)")
        return
    n = len(st["links"])
    loss = st["loss"]
    loss_text = format_loss(loss) if isinstance(loss, float) else "mixed"
    print(f"testbed {st['prefix']}: up, {n} links x {format_rate(st['rate_bps'])} = "
          f"{format_rate(st['line_rate_bps'])}, loss {loss_text}, MTU {st['mtu']}"
          f"{', delay ' + st['delay'] if st.get('delay') else ''}")
    print(f"  server namespace {ns['server']}, client namespace {ns['client']}; provider {st['provider']}, "
          "one domain per link")
    print(f"  {'link':<5}{'server end':<24}{'client end':<24}{'rate':<14}{'state':<18}loss")
    for row in st["links"]:
        s, c = row["server"], row["client"]
        state = s["state"] if s["state"] == c["state"] else f"{s['state']}/{c['state']}"
        loss = s["loss"] if s["loss"] == c["loss"] else max(s["loss"], c["loss"])
        rate = s["rate_bps"] if s["rate_bps"] == c["rate_bps"] else None
        print(f"  {row['index']:<5}{s['ifname'] + ' ' + s['address']:<24}{c['ifname'] + ' ' + c['address']:<24}"
              f"{format_rate(rate):<14}{state or 'missing':<18}{format_loss(loss)}")


def cli_main(args) -> int:
    """``python -m fabriclab testbed ACTION``; errors are one line (TestbedError → exit 1)."""
    try:
        return _cli(args)
    except TestbedUnavailable as exc:
        print(f"error: testbed unavailable: {exc} ({FALLBACK_NOTE})", file=sys.stderr)
        return 1
    except TestbedError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1


def _cli(args) -> int:
    if args.action == "up":
        tb = Testbed(links=DEFAULT_LINKS if args.links is None else args.links,
                     rate=DEFAULT_RATE if args.rate is None else args.rate, loss=args.loss or 0.0,
                     prefix=args.prefix, delay=args.delay, mtu=DEFAULT_MTU if args.mtu is None else args.mtu)
        tb.up()
        _print(tb.status(), args.json)
        return 0
    if args.action == "down":
        if _read_state(args.prefix) is None:
            print(f"testbed {args.prefix}: nothing to remove")
            return 0
        removed = Testbed.attach(args.prefix).down()
        print(f"testbed {args.prefix}: removed {', '.join(removed) if removed else 'nothing (already gone)'}")
        return 0
    if args.action == "status":
        if _read_state(args.prefix) is None:
            tb = Testbed(links=1, rate=None, prefix=args.prefix)
            st = tb.status()
            st["links"], st["line_rate_bps"] = [], None
            _print(st, args.json)
            return 0
        _print(Testbed.attach(args.prefix).status(), args.json)
        return 0
    if args.link is None:
        raise fi.UsageError(f"{args.action} needs --link INDEX")
    tb = Testbed.attach(args.prefix)
    (tb.link_down if args.action == "link-down" else tb.link_up)(args.link, args.side)
    _print(tb.status(), args.json)
    return 0


def _print(st: dict, as_json: bool) -> None:
    if as_json:
        print(json.dumps(st))
    else:
        print_status(st)
