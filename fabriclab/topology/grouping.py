"""Which NICs go with which GPU, and which cores drive them: the closeness of two PCI devices on the
``nvidia-smi topo -m`` scale (``pci_link``) and the groups proposed from it (``plan_groups``)."""
from __future__ import annotations

from collections import Counter
from typing import Iterable

from .model import LINKS, UNKNOWN, Gpu, Group, Nic, NumaNode, PciDevice


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

