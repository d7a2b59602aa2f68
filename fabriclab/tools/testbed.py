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
import fcntl
import ipaddress
import json
import os
import re
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

from .. import cli, fi
from . import netns
from .netns import LOSS_CHAIN, SIDES, ContainmentError, TestbedError, TestbedUnavailable
from .reaper import end_processes
from .testbed_checks import TestbedChecks
from .testbed_traffic import TestbedTraffic

__all__ = ["Testbed", "Link", "TestbedError", "TestbedUnavailable", "ContainmentError", "available", "netem_available",
           "require_available", "try_up", "link_rate", "format_rate", "parse_loss", "format_loss", "parse_delay",
           "add_arguments", "cli_main", "print_status"]

PROVIDER = "tcp;ofi_rxm"
DEFAULT_PREFIX = "fabriclab"
DEFAULT_LINKS = 32
DEFAULT_RATE = "100mbit"
DEFAULT_MTU = 9000  # jumbo frames, as EFA (fi_info: MTU 8760); also a sixth of the packets to carry on few cores
MAX_LINKS = 254
STATE_DIR = Path("/run/fabriclab")
NETNS_DIR = Path("/var/run/netns")  # where iproute2 keeps named namespaces (/run/netns on current systems)
FALLBACK_NOTE = "the lessons fall back to the shm provider (one host, no links to shape)"
TBF_LATENCY_MS = 25
_PREFIX_RX = re.compile(r"^[a-z0-9][a-z0-9_.-]{0,39}$")
_IFNAME_RX = re.compile(r"^fl(\d+)([ab])$")


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
        return self.server_if if netns.side(side) == "server" else self.client_if

    def address(self, side: str) -> str:
        return self.server_addr if netns.side(side) == "server" else self.client_addr

    @property
    def network(self) -> ipaddress.IPv4Network:
        return ipaddress.ip_network(f"{self.server_addr}/{self.prefixlen}", strict=False)


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
        netns.run(["ip", "netns", "add", probe])
    except TestbedError as exc:
        return False, f"cannot create a network namespace: {exc}"
    try:
        netns.run(["ip", "-n", probe, "link", "add", "p0", "type", "veth", "peer", "name", "p1"])
        netns.run(["tc", "-n", probe, "qdisc", "add", "dev", "p0", "root", "tbf", "rate", "100mbit", "burst", "32kb",
                   "latency", "25ms"])
        if need_loss:
            netns.run(["ip", "netns", "exec", probe, "iptables", "-w", "-A", "INPUT", "-i", "p0", "-m", "statistic",
                       "--mode", "random", "--probability", "0.001", "-j", "DROP"])
    except TestbedError as exc:
        return False, f"namespaces work but veth/tbf{'/iptables' if need_loss else ''} do not: {exc}"
    finally:
        netns.run(["ip", "netns", "del", probe], check=False)
    return True, "network namespaces, veth pairs and tc tbf work here"


def netem_available() -> tuple[bool, str]:
    """Whether this kernel has netem (for ``delay``), tried on a veth in a throw-away namespace."""
    _require_privileges()
    probe = f"{DEFAULT_PREFIX}-probe-{os.getpid()}"
    netns.run(["ip", "netns", "add", probe])
    try:
        netns.run(["ip", "-n", probe, "link", "add", "p0", "type", "veth", "peer", "name", "p1"])
        netns.run(["tc", "-n", probe, "qdisc", "add", "dev", "p0", "root", "netem", "delay", "1ms"])
    except TestbedError as exc:
        return False, str(exc)
    finally:
        netns.run(["ip", "netns", "del", probe], check=False)
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


class Testbed(TestbedTraffic, TestbedChecks):
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
        return self.server_ns if netns.side(side) == "server" else self.client_ns

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
                        netns.run(["ip", "netns", "add", ns])
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
            netns.run(["ip", "-n", ns, "link", "set", "lo", "up"])
            # No IPv6: the testbed's only addresses are 169.254/16 (and 127.0.0.1 on lo).
            netns.run(["ip", "netns", "exec", ns, "sh", "-c",
                       "for f in /proc/sys/net/ipv6/conf/default/disable_ipv6 "
                       "/proc/sys/net/ipv6/conf/all/disable_ipv6; do [ -w $f ] && echo 1 > $f; done; true"],
                      check=False)
        present = {m.group(1) for m in (_IFNAME_RX.match(n) for n in netns.veth_names(self.server_ns)) if m}
        wanted = {str(link.index) for link in self.links}
        for index in sorted(present - wanted, key=int):  # a smaller testbed than before: drop the extra links
            netns.run(["ip", "-n", self.server_ns, "link", "del", f"fl{index}a"])
        batch = [f"link add {link.server_if} netns {self.server_ns} type veth peer name {link.client_if} "
                 f"netns {self.client_ns}" for link in self.links if str(link.index) not in present]
        if batch:
            netns.run(["ip", "-batch", "-"], input="\n".join(batch) + "\n")
        for side in SIDES:
            ns = self.namespace(side)
            cmds = []
            for link in self.links:
                dev = link.ifname(side)
                cmds.append(f"addr replace {link.address(side)}/{link.prefixlen} dev {dev}")
                cmds.append(f"link set {dev} mtu {self.mtu} up")
            netns.run(["ip", "-n", ns, "-batch", "-"], input="\n".join(cmds) + "\n")
            # One skb per wire packet (no 64 KB GSO bursts): loss then hits MTU-sized packets, as on a wire,
            # and tbf meters packets rather than bursts. Older iproute2 without the option: left as is.
            netns.run(["ip", "-force", "-n", ns, "-batch", "-"], check=False,
                      input="".join(f"link set dev {link.ifname(side)} gso_max_segs 1\n" for link in self.links))
            self._shape(ns, [link.ifname(side) for link in self.links])
        if self.loss > 0 or netns.has_loss_chain(self.server_ns) or netns.has_loss_chain(self.client_ns):
            self.set_loss(self.loss)

    def _shape(self, ns: str, devs: list[str]) -> None:
        netns.run(["tc", "-force", "-n", ns, "-batch", "-"], check=False,
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
        netns.run(["tc", "-n", ns, "-batch", "-"], input="\n".join(cmds) + "\n")

    def set_loss(self, loss: str | float, link: int | None = None) -> None:
        """Drop packets at random with probability ``loss`` on every link (or on one), in both directions."""
        p = parse_loss(loss)
        self._require_up()
        chosen = self.links if link is None else [self.link(link)]
        if p > 0 and shutil.which("iptables") is None:
            raise TestbedUnavailable("random loss needs iptables (its statistic match), not found on PATH")
        for side in SIDES:
            ns = self.namespace(side)
            if p == 0 and not netns.has_loss_chain(ns):
                continue
            mine = {l.ifname(side) for l in self.links}
            current = {dev: prob for dev, prob in netns.loss_rules(ns).items() if dev in mine}
            for l in chosen:
                current[l.ifname(side)] = p
            ipt = ["ip", "netns", "exec", ns, "iptables", "-w"]
            if not netns.has_loss_chain(ns):
                netns.run([*ipt, "-N", LOSS_CHAIN])
            if netns.run([*ipt, "-C", "INPUT", "-j", LOSS_CHAIN], check=False).returncode != 0:
                netns.run([*ipt, "-I", "INPUT", "-j", LOSS_CHAIN])
            netns.run([*ipt, "-F", LOSS_CHAIN])
            for dev, prob in sorted(current.items()):
                if prob > 0:
                    netns.run([*ipt, "-A", LOSS_CHAIN, "-i", dev, "-m", "statistic", "--mode", "random",
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
        sides = SIDES if side == "both" else (netns.side(side),)
        self._require_up()
        for s in sides:
            netns.run(["ip", "-n", self.namespace(s), "link", "set", link.ifname(s), state])

    def bench_command(self, *options) -> list[str]:
        """``python -m fabriclab bench`` over every link, one NIC per link: the writer runs in the client
        namespace (this command), the target is started in the server namespace. ``options`` add the
        stage, sizes and threads."""
        return [*self.launcher("client"), sys.executable, "-m", "fabriclab", "bench", "--provider", self.provider,
                "--domain", ",".join(link.client_if for link in self.links),
                "--server-domain", ",".join(link.server_if for link in self.links),
                "--server-launcher", " ".join(self.launcher("server")), "--nics", str(len(self.links)),
                *map(str, options)]

    def _require_up(self) -> None:
        _require_privileges()
        if not self.exists():
            raise TestbedError(f"testbed {self.prefix!r} is not up (namespaces {self.server_ns}, {self.client_ns})")

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
        end_processes(ns, inode)
        netns.run(["ip", "netns", "del", ns])
        # Whoever opened the namespace before its name went can still enter it: end those too, now that no
        # one new can open it, so nothing runs on in a namespace without a name.
        end_processes(ns, inode)


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
