"""Where the GPUs, NICs and CPU cores of a machine sit relative to each other (chapter 8).

On a p5.48xlarge every H100 shares a PCIe switch with four EFA NICs, and every switch hangs off one of two
CPU sockets (NUMA nodes). Line rate needs each GPU's pages to leave through the NICs on its own switch, and
the threads that drive those NICs to run on cores of the same socket. This module finds that layout and
turns it into plain data the multi-NIC engine can use:

* ``Topology.discover()`` looks at the running machine: GPUs from cuda-python, NICs from ``fi_getinfo``
  (one per domain of a provider) and, for every PCI device among them, its NUMA node, local CPUs and chain
  of PCIe bridges from sysfs. Sysfs is read below one root path, so tests can point it at a fake tree.
* ``Topology.groups`` pairs each NIC with the GPU it is closest to on the PCIe tree and proposes worker
  cores for each group (the GPU's NUMA node, one CPU per physical core, core 0 left alone).
* ``Topology.load("p5.48xlarge")`` reads a recorded layout from ``fabriclab/data``; ``to_json()`` and
  ``from_json()`` round-trip everything, so ``python -m fabriclab topo --json > fabriclab/data/NAME.json``
  records the machine it runs on.
* ``draw(topology)`` draws the PCIe tree with matplotlib; ``format_table(topology)`` prints the groups.

Closeness follows the scale of ``nvidia-smi topo -m``, best first:

=====  ========================================================================
PIX    both devices hang off one PCIe switch (at most one bridge below the point where their paths meet)
PXB    they meet higher up, through several bridges, without reaching the host bridge
PHB    they meet only at the host bridge (the CPU's PCIe root complex)
NODE   different host bridges of the same NUMA node
SYS    different NUMA nodes: traffic crosses the link between the sockets
?      unknown: one side has no PCI address (shm, tcp on a veth) or sysfs does not show it
=====  ========================================================================
"""
from __future__ import annotations

import json
import os
import pathlib
import re
import textwrap
from collections import Counter
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Iterable

FORMAT = "fabriclab.topology/1"
DATA_DIR = pathlib.Path(__file__).resolve().with_name("data")
LINKS = ("PIX", "PXB", "PHB", "NODE", "SYS")
UNKNOWN = "?"
LIVE = "live"
RECORDED = "recorded"
THIS_MACHINE = "this machine"

_BDF = re.compile(r"^(?:([0-9a-fA-F]+):)?([0-9a-fA-F]{1,2}):([0-9a-fA-F]{1,2})\.([0-7])$")
_HOST_BRIDGE = re.compile(r"^pci[0-9a-fA-F]{4,}:[0-9a-fA-F]{2}$")


# ---------------------------------------------------------------------------------------- the data


@dataclass
class Gpu:
    """A CUDA device: its ordinal, name and PCI address (sysfs form ``dddd:bb:dd.f``, or None)."""
    index: int
    name: str
    pci: str | None
    memory_bytes: int | None = None

    @property
    def label(self) -> str:
        return f"cuda:{self.index}"


@dataclass
class Nic:
    """A libfabric domain seen as a NIC. ``pci`` is None for software domains (shm, tcp on a veth)."""
    domain: str
    provider: str | None
    pci: str | None = None
    link_speed_bps: int | None = None
    device: str | None = None  # the NIC's own name where libfabric gives one (rdmap79s0 for rdmap79s0-rdm)


@dataclass
class PciDevice:
    """What sysfs says about one PCI device. ``bridges`` runs from the root port down to the device's parent;
    ``host_bridge`` is the root complex (``pci0000:44``); ``found`` is False when sysfs has no such device."""
    address: str
    numa_node: int | None
    local_cpus: list[int]
    bridges: list[str]
    host_bridge: str | None
    found: bool = True


@dataclass
class NumaNode:
    """A NUMA node: all its CPUs, and ``cores``, one CPU per physical core (the lowest hyperthread)."""
    node: int
    cpus: list[int]
    cores: list[int]


@dataclass
class Group:
    """One unit of work for the multi-NIC engine: a GPU (its ordinal, or None on a machine without one), the
    NICs (domain names) its pages should leave through, their NUMA node, and the cores proposed for the
    threads that drive those NICs. ``link`` is the worst GPU-to-NIC closeness in the group (None without a
    GPU, ``?`` when unknown)."""
    gpu: int | None
    nics: list[str]
    numa_node: int | None
    cores: list[int]
    link: str | None = None


@dataclass(repr=False)
class Topology:
    machine: str
    source: str  # "live" (discovered here) or "recorded" (loaded from a file)
    provider: str | None
    gpus: list[Gpu]
    nics: list[Nic]
    pci: dict[str, PciDevice]
    numa_nodes: list[NumaNode]
    groups: list[Group]
    notes: list[str] = field(default_factory=list)
    allowed_cpus: list[int] | None = None  # the CPUs this process may run on, where fewer than all
    description: str = ""

    # ------------------------------------------------------------------------------- construction

    @classmethod
    def discover(cls, sysfs_root: str | os.PathLike = "/", gpus: Iterable | None = None,
                 nics: Iterable | None = None, provider: str | None = None, *, machine: str = THIS_MACHINE,
                 allowed_cpus: Iterable[int] | None = None) -> "Topology":
        """The layout of a machine whose sysfs lies below ``sysfs_root`` (``/sys`` for ``"/"``).

        ``gpus`` and ``nics`` default to discovery (cuda-python; ``fi.domains(provider)``, the provider
        defaulting to ``fi.default_provider()``); pass lists (of ``Gpu``/``Nic``, ``gpu.GpuDevice``,
        ``fi.Info`` or dicts) to describe another machine. ``allowed_cpus`` defaults to this process's CPU
        affinity when reading the live ``/sys``, else to every CPU.
        """
        notes: list[str] = []
        gpu_list = _discover_gpus(notes) if gpus is None else [_as_gpu(g) for g in gpus]
        if nics is None:
            nic_list, provider = _discover_nics(provider, notes)
        else:
            nic_list = [_as_nic(n, provider) for n in nics]
            provider = provider or next((n.provider for n in nic_list if n.provider), None)
        fs = Sysfs(sysfs_root)
        numa = fs.numa_nodes(notes)
        for nic in nic_list:
            if nic.pci is None:
                nic.pci = fs.net_device_pci(nic.device, nic.domain)
        pci: dict[str, PciDevice] = {}
        for addr in [g.pci for g in gpu_list] + [n.pci for n in nic_list]:
            if addr and addr not in pci:
                pci[addr] = fs.pci_device(addr)
        _settle_numa(pci, numa, notes)
        live = os.path.realpath(os.fspath(sysfs_root)) == "/"
        if allowed_cpus is None and live and hasattr(os, "sched_getaffinity"):
            allowed_cpus = os.sched_getaffinity(0)
        allowed = _restrict(allowed_cpus, numa)
        groups = plan_groups(gpu_list, nic_list, pci, numa, allowed, notes)
        what = (f"captured from the machine itself: GPUs from cuda-python, NICs from fi_getinfo (provider "
                f"{provider or 'none'}), PCI tree, NUMA nodes and cores from sysfs")
        return cls(machine, LIVE, provider, gpu_list, nic_list, pci, numa, groups, notes, allowed, what)

    capture = discover  # ``Topology.capture()``: this machine, as ``--json`` records it

    @classmethod
    def from_dict(cls, data: dict) -> "Topology":
        if not isinstance(data, dict) or "gpus" not in data or "nics" not in data:
            raise ValueError("not a fabriclab topology: expected an object with 'gpus' and 'nics'")
        if data.get("format", FORMAT) != FORMAT:
            raise ValueError(f"unsupported topology format {data.get('format')!r} (this fabriclab reads {FORMAT})")
        gpus = [_as_gpu(g) for g in data["gpus"]]
        nics = [_as_nic(n, data.get("provider")) for n in data["nics"]]
        pci = {addr: _build(PciDevice, dict(d, address=addr)) for addr, d in (data.get("pci") or {}).items()}
        numa = [_build(NumaNode, n) for n in data.get("numa_nodes") or []]
        allowed = data.get("allowed_cpus")
        notes = list(data.get("notes") or [])
        if data.get("groups") is None:
            groups = plan_groups(gpus, nics, pci, numa, allowed, notes)
        else:
            groups = [_build(Group, g) for g in data["groups"]]
        return cls(data.get("machine") or THIS_MACHINE, data.get("source") or RECORDED, data.get("provider"),
                   gpus, nics, pci, numa, groups, notes, allowed, data.get("description") or "")

    @classmethod
    def from_json(cls, text: str) -> "Topology":
        return cls.from_dict(json.loads(text))

    @classmethod
    def load(cls, name: str | os.PathLike) -> "Topology":
        """A recorded layout: a name from ``recorded_names()`` (``"p5.48xlarge"``) or a JSON file's path.
        Whatever the file says, the result is labelled ``recorded``."""
        path = DATA_DIR / f"{name}.json"
        if not path.is_file():
            path = pathlib.Path(name)
        if not path.is_file():
            raise FileNotFoundError(f"no recorded topology {str(name)!r}; recorded here: "
                                    f"{', '.join(recorded_names()) or 'none'}")
        topo = cls.from_json(path.read_text())
        topo.source = RECORDED
        if topo.machine in ("", THIS_MACHINE):
            topo.machine = path.stem
        return topo

    # ------------------------------------------------------------------------------------ output

    def to_dict(self) -> dict:
        out: dict[str, Any] = {"format": FORMAT}
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name == "pci":
                value = {addr: {k: v for k, v in asdict(d).items() if k != "address"} for addr, d in value.items()}
            elif isinstance(value, list):
                value = [asdict(v) if hasattr(v, "__dataclass_fields__") else v for v in value]
            out[f.name] = value
        return out

    def to_json(self, indent: int | None = 1) -> str:
        return _dumps(self.to_dict(), indent)

    # ----------------------------------------------------------------------------------- queries

    @property
    def recorded(self) -> bool:
        return self.source == RECORDED

    @property
    def title(self) -> str:
        return f"{self.machine} ({'recorded' if self.recorded else 'discovered here'})"

    def gpu(self, index: int) -> Gpu:
        for g in self.gpus:
            if g.index == index:
                return g
        raise KeyError(f"no GPU cuda:{index} in {self.title}")

    def nic(self, domain: str) -> Nic:
        for n in self.nics:
            if n.domain == domain:
                return n
        raise KeyError(f"no NIC {domain!r} in {self.title}")

    def group_for(self, gpu: int | None) -> Group:
        for g in self.groups:
            if g.gpu == gpu:
                return g
        raise KeyError(f"no group for GPU {gpu!r} in {self.title}")

    def link(self, gpu: int, nic: str) -> str:
        """The closeness (PIX ... SYS, or ?) between GPU ``gpu`` and the NIC of domain ``nic``."""
        return pci_link(self.pci.get(self.gpu(gpu).pci or ""), self.pci.get(self.nic(nic).pci or ""))

    def numa_node(self, node: int) -> NumaNode:
        for n in self.numa_nodes:
            if n.node == node:
                return n
        raise KeyError(f"no NUMA node {node} in {self.title}")

    def __repr__(self) -> str:
        return (f"<Topology {self.title}: {len(self.gpus)} GPUs, {len(self.nics)} NICs "
                f"({self.provider or 'no provider'}), {len(self.numa_nodes)} NUMA nodes, {len(self.groups)} groups>")

    def __str__(self) -> str:
        return format_table(self)


def recorded_names() -> list[str]:
    """The layouts shipped in ``fabriclab/data`` (files whose ``format`` is a topology's)."""
    names = []
    for path in sorted(DATA_DIR.glob("*.json")):
        try:
            if json.loads(path.read_text()).get("format") == FORMAT:
                names.append(path.stem)
        except (OSError, ValueError, AttributeError):
            continue
    return names


# -------------------------------------------------------------------------------------- sysfs


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


def _settle_numa(pci: dict[str, PciDevice], numa: list[NumaNode], notes: list[str]) -> None:
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


def _restrict(allowed: Iterable[int] | None, numa: list[NumaNode]) -> list[int] | None:
    if allowed is None:
        return None
    allowed = sorted(set(int(c) for c in allowed))
    every = sorted({c for n in numa for c in n.cpus})
    return None if set(every) <= set(allowed) else allowed


# ------------------------------------------------------------------------------------- grouping


def pci_link(a: PciDevice | None, b: PciDevice | None) -> str:
    """How close two PCI devices are, on the ``nvidia-smi topo -m`` scale (see the module's docstring)."""
    if a is None or b is None or not a.found or not b.found:
        return UNKNOWN
    if a.host_bridge is None or b.host_bridge is None or a.host_bridge != b.host_bridge:
        if a.numa_node is None or b.numa_node is None:
            return UNKNOWN if a.host_bridge is None or b.host_bridge is None else "SYS"
        return "NODE" if a.numa_node == b.numa_node else "SYS"
    common = 0
    for x, y in zip(a.bridges, b.bridges):
        if x != y:
            break
        common += 1
    if common == 0:
        return "PHB"
    return "PIX" if max(len(a.bridges), len(b.bridges)) - common <= 1 else "PXB"


def _rank(link: str) -> int:
    return LINKS.index(link) if link in LINKS else len(LINKS)


def _worst(links: Iterable[str]) -> str | None:
    links = list(links)
    if not links:
        return None
    return max(links, key=_rank)


def plan_groups(gpus: list[Gpu], nics: list[Nic], pci: dict[str, PciDevice], numa: list[NumaNode],
                allowed_cpus: Iterable[int] | None = None, notes: list[str] | None = None) -> list[Group]:
    """Group each NIC with its closest GPU and propose cores per group (see ``Topology.groups``).

    * With GPUs: one group per GPU, in CUDA order. A NIC joins the GPU it is closest to; among equally close
      GPUs (or when closeness is unknown) it joins the one with the fewest NICs so far, so NICs without a PCI
      address are dealt out evenly. NICs with a known closeness are placed first.
    * Without GPUs: one group per NUMA node of the NICs (NICs whose node is unknown form a group of their own).
    * Cores: the physical cores of each NUMA node are split into contiguous runs, one per group on that node,
      in group order; core 0 is dropped from a run unless it is the run's only core. A group whose NUMA node
      is unknown draws from every CPU. When a node has fewer cores than groups, groups share cores.
    """
    notes = notes if notes is not None else []
    dev = lambda addr: pci.get(addr) if addr else None  # noqa: E731
    groups: list[Group] = []
    if gpus:
        members: dict[int, list[Nic]] = {g.index: [] for g in gpus}
        links = {(g.index, n.domain): pci_link(dev(g.pci), dev(n.pci)) for g in gpus for n in nics}
        best = {n.domain: min((links[g.index, n.domain] for g in gpus), key=_rank) for n in nics}
        order = [n for n in nics if best[n.domain] != UNKNOWN] + [n for n in nics if best[n.domain] == UNKNOWN]
        for nic in order:
            closest = [g.index for g in gpus if _rank(links[g.index, nic.domain]) == _rank(best[nic.domain])]
            chosen = min(closest, key=lambda i: (len(members[i]), closest.index(i)))
            members[chosen].append(nic)
        for g in gpus:
            mine = sorted(members[g.index], key=nics.index)
            node = dev(g.pci).numa_node if dev(g.pci) else None
            if node is None:
                nic_nodes = [dev(n.pci).numa_node for n in mine if dev(n.pci) and dev(n.pci).numa_node is not None]
                node = Counter(nic_nodes).most_common(1)[0][0] if nic_nodes else None
            if node is None and len(numa) == 1:
                node = numa[0].node
            groups.append(Group(g.index, [n.domain for n in mine], node, [],
                                _worst(links[g.index, n.domain] for n in mine)))
        unplaced = [n.domain for n in nics if best[n.domain] == UNKNOWN]
        if unplaced and len(unplaced) == len(nics):
            notes.append(f"no NIC here has a known place on the PCIe tree ({', '.join(unplaced)}): there is no "
                         "affinity to follow, so the NICs are dealt out evenly over the GPUs")
        elif unplaced:
            notes.append(f"NICs without a known place on the PCIe tree, dealt out evenly: {', '.join(unplaced)}")
    elif nics:
        by_node: dict[int | None, list[str]] = {}
        for nic in nics:
            d = dev(nic.pci)
            node = d.numa_node if d else None
            if node is None and len(numa) == 1:
                node = numa[0].node
            by_node.setdefault(node, []).append(nic.domain)
        for node in sorted(by_node, key=lambda k: (k is None, k or 0)):
            groups.append(Group(None, by_node[node], node, [], None))
        notes.append("no GPU: NICs are grouped by NUMA node")
    _propose_cores(groups, numa, allowed_cpus, notes)
    return groups


def _split(pool: list[int], n: int) -> list[list[int]]:
    """``pool`` in ``n`` contiguous runs, sizes differing by at most one (longer runs first)."""
    if not pool:
        return [[] for _ in range(n)]
    if len(pool) < n:
        return [[pool[i % len(pool)]] for i in range(n)]
    size, extra = divmod(len(pool), n)
    runs, start = [], 0
    for i in range(n):
        end = start + size + (1 if i < extra else 0)
        runs.append(pool[start:end])
        start = end
    return runs


def _propose_cores(groups: list[Group], numa: list[NumaNode], allowed: Iterable[int] | None,
                   notes: list[str]) -> None:
    allowed_set = None if allowed is None else set(allowed)
    cores_of = {n.node: n.cores for n in numa}
    every = sorted({c for n in numa for c in n.cores})
    by_node: dict[int | None, list[Group]] = {}
    for g in groups:
        by_node.setdefault(g.numa_node if g.numa_node in cores_of else None, []).append(g)
    for node, members in by_node.items():
        pool = cores_of[node] if node is not None else every
        if allowed_set is not None:
            pool = [c for c in pool if c in allowed_set]
        if len(pool) < len(members):
            where = f"NUMA node {node}" if node is not None else "this machine"
            notes.append(f"{where} has {len(pool)} usable physical cores for {len(members)} groups: "
                         "groups share cores")
        for g, run in zip(members, _split(pool, len(members))):
            g.cores = [c for c in run if c != 0] if len(run) > 1 else list(run)


# -------------------------------------------------------------------------------- conversions


def _as_gpu(obj) -> Gpu:
    if isinstance(obj, Gpu):
        return Gpu(obj.index, obj.name, normalize_pci(obj.pci) or obj.pci, obj.memory_bytes)
    if isinstance(obj, dict):
        return Gpu(int(obj["index"]), str(obj.get("name") or ""), normalize_pci(obj.get("pci")),
                   obj.get("memory_bytes"))
    # gpu.GpuDevice or anything alike
    return Gpu(int(obj.index), str(getattr(obj, "name", "") or ""), normalize_pci(getattr(obj, "pci", None)),
               getattr(obj, "memory_bytes", None))


def _as_nic(obj, provider: str | None = None) -> Nic:
    if isinstance(obj, Nic):
        return Nic(obj.domain, obj.provider or provider, normalize_pci(obj.pci), obj.link_speed_bps, obj.device)
    if isinstance(obj, str):
        return Nic(obj, provider)
    if isinstance(obj, dict):
        return Nic(str(obj["domain"]), obj.get("provider") or provider, normalize_pci(obj.get("pci")),
                   obj.get("link_speed_bps"), obj.get("device"))
    # an fi.Info: domain and provider, and what its fi_nic says (software providers often say nothing)
    nic = getattr(obj, "nic", None)
    return Nic(str(obj.domain), getattr(obj, "provider", None) or provider,
               normalize_pci(getattr(nic, "pci", None)), getattr(nic, "link_speed_bps", None),
               getattr(nic, "name", None))


def _build(cls, data: dict):
    known = {f.name for f in fields(cls)}
    return cls(**{k: v for k, v in data.items() if k in known})


def _discover_gpus(notes: list[str]) -> list[Gpu]:
    try:
        from . import gpu
        found = gpu.devices()
        status = "ok" if found else gpu.cuda_status()
    except (ImportError, OSError, RuntimeError) as exc:
        notes.append(f"GPUs: none found ({exc})")
        return []
    if not found:
        notes.append(f"GPUs: none ({status})")
    return [_as_gpu(d) for d in found]


def _discover_nics(provider: str | None, notes: list[str]) -> tuple[list[Nic], str | None]:
    try:
        from . import fi
    except (ImportError, OSError) as exc:
        if provider:
            raise
        notes.append(f"NICs: none, libfabric cannot be loaded ({exc})")
        return [], None
    named = provider
    try:
        provider = provider or fi.default_provider()
        infos = fi.domains(provider)
    except fi.FabricError as exc:
        if named:
            raise
        notes.append(f"NICs: none ({exc})")
        return [], None
    return [_as_nic(i, provider) for i in infos], provider


def _dumps(obj, indent: int | None, level: int = 0) -> str:
    """JSON that reads well and diffs well: anything short on one line, lists of numbers always on one line,
    everything else one member per line."""
    compact = json.dumps(obj)
    if indent is None or len(compact) + indent * level <= 130 or not isinstance(obj, (dict, list)) \
            or (isinstance(obj, list) and all(isinstance(v, (int, float)) or v is None for v in obj)):
        return compact
    pad, inner = " " * (indent * level), " " * (indent * (level + 1))
    if isinstance(obj, dict):
        items = [f"{inner}{json.dumps(str(k))}: {_dumps(v, indent, level + 1)}" for k, v in obj.items()]
        return "{\n" + ",\n".join(items) + "\n" + pad + "}"
    return "[\n" + ",\n".join(inner + _dumps(v, indent, level + 1) for v in obj) + "\n" + pad + "]"


# ------------------------------------------------------------------------------------ showing it


def format_table(topo: Topology) -> str:
    """The groups as a table (GPU, its NICs, NUMA node, proposed cores), then NUMA nodes and notes."""
    lines = [f"{topo.title}: {len(topo.gpus)} GPU(s), {len(topo.nics)} NIC(s) "
             f"from provider {topo.provider or '-'}, {len(topo.numa_nodes)} NUMA node(s)"]
    if topo.recorded:
        text = f"recorded layout, not this machine{': ' + topo.description if topo.description else ''}"
        lines += textwrap.wrap(text, 110, subsequent_indent="  ")
    rows = [("GPU", "GPU PCI", "NUMA", "link", "NICs", "NIC PCI", "cores")]
    for g in topo.groups:
        gpu = topo.gpu(g.gpu) if g.gpu is not None else None
        nic_pcis = [topo.nic(n).pci or "-" for n in g.nics]
        rows.append((gpu.label if gpu else "(none)", (gpu.pci or "-") if gpu else "-",
                     "-" if g.numa_node is None else str(g.numa_node), g.link or "-",
                     " ".join(g.nics) or "(none)", _pci_span(nic_pcis), format_cpulist(g.cores)))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for i, row in enumerate(rows):
        lines.append("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip())
        if i == 0:
            lines.append("  ".join("-" * w for w in widths))
    if not topo.groups:
        lines.append("(no GPU and no NIC: nothing to group)")
    for n in topo.numa_nodes:
        lines.append(f"NUMA node {n.node}: CPUs {format_cpulist(n.cpus)}, {len(n.cores)} physical cores "
                     f"({format_cpulist(n.cores)})")
    if topo.allowed_cpus is not None:
        lines.append(f"this process may run on CPUs {format_cpulist(topo.allowed_cpus)} only")
    for gpu in topo.gpus:
        if gpu.name:
            lines.append(f"{gpu.label}: {gpu.name}")
            break
    lines += [f"note: {n}" for n in topo.notes]
    return "\n".join(lines)


def _pci_span(addrs: list[str]) -> str:
    if not addrs:
        return "-"
    if len(addrs) > 2 and "-" not in addrs:
        return f"{addrs[0]} .. {addrs[-1]}"
    return " ".join(addrs)


_COLORS = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#17becf",
           "#bcbd22", "#7f7f7f"]


def draw(topo: Topology, ax=None, *, labels: bool = True):
    """Draw the PCIe tree: CPU sockets (NUMA nodes) at the top, host bridges and PCIe bridges below them,
    GPUs (squares) and NICs (circles) as leaves, each group in its own colour. Devices without a PCI address
    stand apart on the right. Returns the matplotlib Figure (a new one when ``ax`` is None)."""
    from matplotlib.figure import Figure
    from matplotlib.lines import Line2D

    color_of: dict[tuple[str, Any], str] = {}
    for i, g in enumerate(topo.groups):
        c = _COLORS[i % len(_COLORS)]
        if g.gpu is not None:
            color_of["gpu", g.gpu] = c
        for n in g.nics:
            color_of["nic", n] = c

    # leaves: (kind, key, label, pci address or None)
    leaves = [("gpu", g.index, g.label, g.pci) for g in topo.gpus]
    leaves += [("nic", n.domain, n.device or n.domain, n.pci) for n in topo.nics]
    placed, loose = [], []
    for leaf in leaves:
        d = topo.pci.get(leaf[3] or "")
        (placed if d is not None and d.found and d.host_bridge else loose).append((leaf, d))

    # tree: path tuples (numa, host bridge, bridge, ...); leaves sorted by their path then address
    def node_of(d: PciDevice):
        return d.numa_node if d.numa_node is not None else "?"
    placed.sort(key=lambda ld: (str(node_of(ld[1])), ld[1].host_bridge, ld[1].bridges, ld[1].address))
    xs: dict[tuple, list[float]] = {}
    depth_of: dict[tuple, int] = {}
    leaf_pos = []
    x, last_top = 0.0, None
    for leaf, d in placed:
        top = node_of(d)
        if last_top is not None and top != last_top:
            x += 1.0  # a gap between sockets
        last_top = top
        path = (top, d.host_bridge, *d.bridges)
        for k in range(1, len(path) + 1):
            xs.setdefault(path[:k], []).append(x)
            depth_of[path[:k]] = k - 1
        leaf_pos.append((leaf, path, x, len(path)))
        x += 1.0
    for numa_node in topo.numa_nodes:  # sockets with no device below them still show
        if (numa_node.node,) not in xs:
            x += 1.0 if xs else 0.0
            xs[(numa_node.node,)], depth_of[(numa_node.node,)] = [x], 0
            x += 1.0
    loose_x0 = x + (1.0 if xs else 0.0)
    children = Counter(p[:-1] for p in xs if len(p) > 1) + Counter(path for _, path, _, _ in leaf_pos)

    n_leaves = len(placed) + len(loose)
    if ax is None:
        fig = Figure(figsize=(max(6.0, 0.36 * n_leaves + 2.5), 5.2), layout="constrained")
        ax = fig.add_subplot()
    else:
        fig = ax.figure
    many = n_leaves > 12
    pos = {p: (sum(v) / len(v), -depth_of[p]) for p, v in xs.items()}
    max_depth = max([d for *_, d in leaf_pos] + [2])

    for p, (px, py) in pos.items():
        if len(p) > 1:
            qx, qy = pos[p[:-1]]
            ax.plot([qx, px], [qy, py], color="#999999", lw=0.8, zorder=1)
    for leaf, path, lx, depth in leaf_pos:
        px, py = pos[path]
        ax.plot([px, lx], [py, -depth], color="#999999", lw=0.8, zorder=1)
    for p, (px, py) in pos.items():
        if len(p) == 1:
            node = topo.numa_node(p[0]) if p[0] != "?" and any(n.node == p[0] for n in topo.numa_nodes) else None
            text = (f"CPU socket / NUMA {p[0]}\ncores {format_cpulist(node.cores)}" if node
                    else f"NUMA node {p[0]}")
            ax.text(px, py, text, ha="center", va="center", fontsize=8, zorder=3,
                    bbox=dict(boxstyle="round", fc="#f3e6c8", ec="#8a6d3b"))
        elif len(p) == 2:
            ax.scatter([px], [py], marker="D", s=40, color="#555555", zorder=2)
            if labels:
                ax.annotate(p[1], (px, py), textcoords="offset points", xytext=(6, 0), fontsize=6, va="center")
        else:
            ax.scatter([px], [py], marker="o", s=18, color="#bbbbbb", edgecolors="#666666", zorder=2)
            text = "PCIe switch" if children[p] > 1 else ""
            if labels and not many:
                text = f"{p[-1][5:]} {text}".strip()
            if text:
                ax.annotate(text, (px, py), textcoords="offset points", xytext=(5, 0), fontsize=6, va="center",
                            style="italic" if children[p] > 1 else "normal")
    for (kind, key, label, addr), _, lx, depth in leaf_pos:
        label = label if many or not labels else f"{label}\n{addr[5:]}"
        _leaf(ax, lx, -depth, kind, label, color_of.get((kind, key), "#444444"), many)
    if loose:
        ax.text(loose_x0 + (len(loose) - 1) / 2, -1, "no PCI address:\nno place on the tree", ha="center",
                va="center", fontsize=8, bbox=dict(boxstyle="round", fc="#eeeeee", ec="#999999", ls="--"))
        for i, ((kind, key, label, _), _) in enumerate(loose):
            _leaf(ax, loose_x0 + i, -max_depth, kind, label, color_of.get((kind, key), "#444444"), many)

    ax.set_title(f"PCIe tree of {topo.title}", fontsize=10)
    ax.set_xlim(-1, max(loose_x0 + len(loose), x) + 0.5 if xs or loose else 1)
    ax.set_ylim(-max_depth - (2.4 if many else 1.0), 0.8)
    ax.axis("off")
    handles = [Line2D([], [], marker="s", ls="", color="#444444", label="GPU"),
               Line2D([], [], marker="o", ls="", color="#444444", label="NIC"),
               Line2D([], [], marker="D", ls="", color="#555555", label="host bridge"),
               Line2D([], [], marker="o", ls="", mfc="#bbbbbb", mec="#666666", label="PCIe bridge")]
    ax.legend(handles=handles, loc="lower right", fontsize=7, frameon=False, ncol=4)
    return fig


def _leaf(ax, x: float, y: float, kind: str, label: str, color: str, many: bool) -> None:
    ax.scatter([x], [y], marker="s" if kind == "gpu" else "o", s=110 if kind == "gpu" else 50, color=color,
               edgecolors="black", linewidths=0.6, zorder=3)
    ax.annotate(label, (x, y), textcoords="offset points", xytext=(0, -8), ha="center", va="top",
                rotation=90 if many else 0, fontsize=7 if many else 8)


# ------------------------------------------------------------------------------------ command line


def add_arguments(parser) -> None:
    parser.add_argument("--recorded", metavar="NAME", default=None,
                        help=f"show a recorded layout instead of this machine ({', '.join(recorded_names()) or 'none'})")
    parser.add_argument("--json", action="store_true", help="print the layout as one JSON object (loadable again)")
    parser.add_argument("--draw", metavar="FILE", default=None, type=drawing_file,
                        help="save a drawing of the PCIe tree (.png, .svg, .pdf)")
    parser.add_argument("--provider", default=None,
                        help="libfabric provider whose domains are the NICs (default: the best available)")
    parser.add_argument("--name", default=THIS_MACHINE, help="what to call this machine (default: %(default)s)")


def drawing_file(text: str) -> str:
    """argparse type for --draw: a file in a directory that exists and can be written, with a suffix naming a
    format matplotlib writes; refused before the machine is looked at."""
    import argparse
    path = pathlib.Path(text)
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{text!r}: is a directory: name a file in it, such as {path / 'pcie.svg'}")
    if not path.parent.is_dir():
        raise argparse.ArgumentTypeError(f"{text!r}: the directory {path.parent} does not exist: create it first")
    if not os.access(path.parent, os.W_OK):
        raise argparse.ArgumentTypeError(f"{text!r}: the directory {path.parent} is not writable")
    try:
        from matplotlib.backend_bases import FigureCanvasBase
    except ImportError:
        raise argparse.ArgumentTypeError("drawing needs matplotlib: pip install 'fabriclab[lab]'") from None
    others = sorted(set(FigureCanvasBase.get_supported_filetypes()) - {"png", "svg", "pdf"})
    if path.suffix[1:].lower() not in {"png", "svg", "pdf", *others}:
        raise argparse.ArgumentTypeError(f"{text!r}: {path.suffix!r} is not a format matplotlib writes: name a .png, "
                                         f".svg or .pdf file (or .{', .'.join(others)})")
    return text


def main(args) -> int:
    if args.recorded:
        try:
            topo = Topology.load(args.recorded)
        except (OSError, ValueError) as exc:
            from .fi import UsageError  # the command line prints these as one line
            raise UsageError(str(exc)) from None
    else:
        topo = Topology.discover(provider=args.provider, machine=args.name)
    if args.json:
        print(topo.to_json())
    else:
        print(format_table(topo))
    if args.draw:
        try:
            draw(topo).savefig(args.draw, dpi=150)
        except OSError as exc:  # checked when parsed; the disk or the directory may still say no
            from .fi import UsageError
            raise UsageError(f"cannot save the drawing to {args.draw}: {exc.strerror or exc}") from None
        if not args.json:
            print(f"drawing saved to {args.draw}")
    return 0
