"""What the kernel says about a testbed: its status, each link's counters, and the containment checks (nothing
in it can reach, or be, an address outside its two namespaces). A mixin of ``testbed.Testbed``, which gives
it ``links``, ``namespace(side)``, ``exists()``, ``link(index)`` and ``_require_up()``."""
from __future__ import annotations

import ipaddress
import socket
import struct

from .. import fi
from . import netns
from .netns import LINK_LOCAL, LOOPBACK, SIDES, ContainmentError


class TestbedChecks:
    """``status``, ``counters``, ``assert_contained`` and ``check_peer`` of a ``Testbed``."""
    __test__ = False  # not a pytest class

    def counters(self, index: int) -> dict:
        """Bytes and packets each end of one link has sent and received (``ip -s link``): which links a
        transfer actually used, and how much went over each."""
        link = self.link(index)
        out = {}
        for side in SIDES:
            info = netns.ip_json(self.namespace(side), "-s", "link", "show", "dev", link.ifname(side))[0]
            stats = info.get("stats64", {})
            out[side] = {d: {k: stats.get(d, {}).get(k, 0) for k in ("bytes", "packets", "dropped")}
                         for d in ("rx", "tx")}
        return out

    def status(self) -> dict:
        """What the kernel says: namespaces, each link's names, addresses, state, rate and loss."""
        out = {"prefix": self.prefix, "up": self.exists(),
               "namespaces": {"server": self.server_ns, "client": self.client_ns},
               "provider": self.provider, "links": [], "rate_bps": self.rate_bps,
               "line_rate_bps": self.line_rate_bps, "loss": self.loss, "delay": self.delay, "mtu": self.mtu}
        if not out["up"]:
            return out
        self._require_up()
        sides = {}
        for side in SIDES:
            ns = self.namespace(side)
            links = {d["ifname"]: d for d in netns.ip_json(ns, "link", "show")}
            addrs = {d["ifname"]: [a["local"] for a in d.get("addr_info", []) if a.get("family") == "inet"]
                     for d in netns.ip_json(ns, "-4", "addr", "show")}
            sides[side] = (links, addrs, netns.qdiscs(ns), netns.loss_rules(ns))
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
                             "state": None if info is None else netns.link_state(info),
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
            ids[side] = {d["ifname"]: d for d in netns.ip_json(ns, "-d", "link", "show")}
            nsids = {str(d.get("nsid")): d.get("name") for d in netns.ip_json(ns, "netns", "list-id")}
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
            for dev in netns.ip_json(ns, "addr", "show"):
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
                for r in netns.ip_json(ns, family, "route", "show", "table", "all", check=family == "-4"):
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
            where = f"link {link}" if link is not None else f"the testbed's {netns.side(side)} side"
            raise ContainmentError(f"address {ip} is not on {where} ({', '.join(sorted(allowed))}); refusing to "
                                   "send traffic outside the testbed's namespaces")
        return ip
