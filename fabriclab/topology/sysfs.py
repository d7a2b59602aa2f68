"""What sysfs says about a machine (PCI devices, their NUMA nodes, bridges and local CPUs; NUMA nodes and
physical cores), read below a root path so that tests can point it at a fake tree; and the CPU-list and
PCI-address notations."""
from __future__ import annotations

import os
import pathlib
import re
from typing import Iterable

from .model import NumaNode, PciDevice

_BDF = re.compile(r"^(?:([0-9a-fA-F]+):)?([0-9a-fA-F]{1,2}):([0-9a-fA-F]{1,2})\.([0-7])$")
_HOST_BRIDGE = re.compile(r"^pci[0-9a-fA-F]{4,}:[0-9a-fA-F]{2}$")


def normalize_pci(text: str | None) -> str | None:
    """``00000000:06:00.0`` (CUDA), ``06:00.0`` (lspci), ``0000:4F:00.0`` -> ``0000:06:00.0``; None if not
    a PCI address."""
    if not text:
        return None
    m = _BDF.match(text.strip())
    if not m:
        return None
    dom, bus, dev, fn = m.groups()
    return f"{int(dom or '0', 16):04x}:{int(bus, 16):02x}:{int(dev, 16):02x}.{fn}"


def parse_cpulist(text: str | None) -> list[int]:
    """``"0-3,8,10-11"`` -> ``[0, 1, 2, 3, 8, 10, 11]``; ``[]`` for empty or malformed text."""
    out: set[int] = set()
    try:
        for part in (text or "").strip().split(","):
            part = part.strip()
            if not part:
                continue
            lo, _, hi = part.partition("-")
            lo_i, hi_i = int(lo), int(hi or lo)
            if lo_i < 0 or hi_i < lo_i or hi_i - lo_i > 1 << 16:
                return []
            out.update(range(lo_i, hi_i + 1))
    except ValueError:
        return []
    return sorted(out)


def format_cpulist(cpus: Iterable[int]) -> str:
    """``[0, 1, 2, 3, 8]`` -> ``"0-3,8"`` (``"-"`` when empty)."""
    cpus = sorted(set(cpus))
    runs: list[str] = []
    i = 0
    while i < len(cpus):
        j = i
        while j + 1 < len(cpus) and cpus[j + 1] == cpus[j] + 1:
            j += 1
        runs.append(str(cpus[i]) if i == j else f"{cpus[i]}-{cpus[j]}")
        i = j + 1
    return ",".join(runs) or "-"


class Sysfs:
    """Reads the few sysfs files the topology needs, below ``root`` (``/`` for the running machine).

    Every read is forgiving: an unreadable or malformed file gives None or an empty list, never an error."""

    def __init__(self, root: str | os.PathLike = "/"):
        self.root = pathlib.Path(root)

    def path(self, *parts: str) -> pathlib.Path:
        return self.root.joinpath("sys", *parts)

    @staticmethod
    def read(path: pathlib.Path) -> str | None:
        try:
            return path.read_text().strip()
        except (OSError, UnicodeDecodeError, ValueError):
            return None

    def read_int(self, path: pathlib.Path) -> int | None:
        try:
            return int(self.read(path) or "")
        except ValueError:
            return None

    def pci_device(self, address: str) -> PciDevice:
        link = self.path("bus", "pci", "devices", address)
        if not os.path.lexists(link) or not link.exists():
            return PciDevice(address, None, [], [], None, found=False)
        try:
            parts = pathlib.PurePath(os.path.realpath(link)).parts
        except (OSError, ValueError):
            parts = ()
        host = next((p for p in parts if _HOST_BRIDGE.match(p)), None)
        chain = [normalize_pci(p) for p in parts if _BDF.match(p) and ":" in p.partition(":")[2]]
        chain = [c for c in chain if c]
        # everything above the device itself is a bridge (if the link's target has another name, the last
        # address in its path is that device)
        chain = chain[:chain.index(address)] if address in chain else chain[:-1]
        node = self.read_int(link / "numa_node")
        return PciDevice(address, node if node is not None and node >= 0 else None,
                         parse_cpulist(self.read(link / "local_cpulist")), chain, host)

    def numa_nodes(self, notes: list[str] | None = None) -> list[NumaNode]:
        nodes: list[tuple[int, list[int]]] = []
        base = self.path("devices", "system", "node")
        try:
            entries = sorted(os.listdir(base))
        except OSError:
            entries = []
        for entry in entries:
            m = re.fullmatch(r"node(\d+)", entry)
            if m:
                nodes.append((int(m.group(1)), parse_cpulist(self.read(base / entry / "cpulist"))))
        nodes = [(n, cpus) for n, cpus in sorted(nodes) if cpus]
        if not nodes:
            cpus = self.online_cpus()
            if notes is not None:
                notes.append("sysfs shows no NUMA nodes: the machine is taken as one NUMA node"
                             + ("" if cpus else " with no CPU information"))
            nodes = [(0, cpus)] if cpus else []
        return [NumaNode(n, cpus, self.physical_cores(cpus)) for n, cpus in nodes]

    def online_cpus(self) -> list[int]:
        cpus = parse_cpulist(self.read(self.path("devices", "system", "cpu", "online")))
        if cpus:
            return cpus
        try:
            names = os.listdir(self.path("devices", "system", "cpu"))
        except OSError:
            return []
        return sorted(int(m.group(1)) for m in map(re.compile(r"cpu(\d+)$").match, names) if m)

    def physical_cores(self, cpus: list[int]) -> list[int]:
        """One CPU per physical core among ``cpus``: the lowest of each set of hyperthread siblings."""
        within, reps = set(cpus), set()
        for cpu in cpus:
            topo = self.path("devices", "system", "cpu", f"cpu{cpu}", "topology")
            siblings = parse_cpulist(self.read(topo / "thread_siblings_list")) or \
                parse_cpulist(self.read(topo / "core_cpus_list"))
            reps.add(min((set(siblings) & within) | {cpu}))
        return sorted(reps)

    def net_device_pci(self, *names: str | None) -> str | None:
        """The PCI address behind a network or RDMA interface name (``eth0``, ``rdmap79s0``), if any: a veth,
        the loopback or shm has none. EFA domain names carry a ``-rdm``/``-dgrm`` suffix, tried without."""
        tried = []
        for name in names:
            if not name:
                continue
            tried += [name, re.sub(r"-(rdm|dgrm)$", "", name)]
        for name in dict.fromkeys(tried):
            if "/" in name or name in (".", ".."):
                continue
            for cls in ("net", "infiniband"):
                dev = self.path("class", cls, name, "device")
                if not os.path.lexists(dev):
                    continue
                try:
                    parts = pathlib.PurePath(os.path.realpath(dev)).parts
                except (OSError, ValueError):
                    continue
                found = [normalize_pci(p) for p in parts if _BDF.match(p) and ":" in p.partition(":")[2]]
                if found and found[-1]:
                    return found[-1]
        return None


def settle_numa(pci: dict[str, PciDevice], numa: list[NumaNode], notes: list[str]) -> None:
    """Fill in NUMA nodes sysfs leaves at -1: from the device's local CPUs when they lie within one node, or
    the only node of a one-node machine."""
    for dev in pci.values():
        if dev.numa_node is not None or not dev.found:
            continue
        guess = None
        if len(numa) == 1:
            guess = numa[0].node
        elif dev.local_cpus:
            holders = [n.node for n in numa if set(dev.local_cpus) <= set(n.cpus)]
            guess = holders[0] if len(holders) == 1 else None
        if guess is not None:
            dev.numa_node = guess
            notes.append(f"{dev.address}: sysfs gives no NUMA node; taken as node {guess}"
                         + (" (the only one)" if len(numa) == 1 else " (from its local CPUs)"))


def usable_cpus(allowed: Iterable[int] | None, numa: list[NumaNode]) -> list[int] | None:
    """The CPUs this process may use, or None when that is every CPU of the NUMA nodes (no restriction)."""
    if allowed is None:
        return None
    allowed = sorted(set(int(c) for c in allowed))
    every = sorted({c for n in numa for c in n.cpus})
    return None if set(every) <= set(allowed) else allowed

