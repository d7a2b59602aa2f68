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
* ``format_table(topology)`` prints the groups; ``fabriclab.course.figures.pcie_tree(topology)`` draws the PCIe
  tree with matplotlib (the course's), and ``fabriclab.course.topo`` is the ``topo`` command.

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
import textwrap
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Iterable

from .grouping import pci_link, plan_groups
from .model import LINKS, UNKNOWN, Gpu, Group, Nic, NumaNode, PciDevice
from .sysfs import Sysfs, format_cpulist, normalize_pci, parse_cpulist, settle_numa, usable_cpus

__all__ = ["Topology", "Gpu", "Nic", "PciDevice", "NumaNode", "Group", "Sysfs", "recorded_names", "format_table",
           "plan_groups", "pci_link", "normalize_pci", "parse_cpulist", "format_cpulist", "LINKS", "UNKNOWN", "LIVE",
           "RECORDED", "THIS_MACHINE", "FORMAT", "DATA_DIR"]

FORMAT = "fabriclab.topology/1"
DATA_DIR = pathlib.Path(__file__).resolve().parent.with_name("data")  # fabriclab/data
LIVE = "live"
RECORDED = "recorded"
THIS_MACHINE = "this machine"


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
        settle_numa(pci, numa, notes)
        live = os.path.realpath(os.fspath(sysfs_root)) == "/"
        if allowed_cpus is None and live and hasattr(os, "sched_getaffinity"):
            allowed_cpus = os.sched_getaffinity(0)
        allowed = usable_cpus(allowed_cpus, numa)
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
        from .. import gpu
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
        from .. import fi
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

