"""The topology's plain data: GPUs, NICs, PCI devices as sysfs shows them, NUMA nodes and the groups the
multi-NIC engine drives (``fabriclab.topology`` is the front), and the closeness scale of ``nvidia-smi topo -m``."""
from __future__ import annotations

from dataclasses import dataclass

LINKS = ("PIX", "PXB", "PHB", "NODE", "SYS")
UNKNOWN = "?"


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

