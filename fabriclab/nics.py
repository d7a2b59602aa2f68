"""The library core's NIC sets and worker placement: what ``fabriclab.Engine`` and the course's engine
stages (``fabriclab.multi_nic`` and after) open their NICs with and pin their threads by.

A :class:`NicSet` is ``count`` NIC slots, each an endpoint with its own completion queue and address
vector, over a provider's domains; slots beyond the real NICs share domains and are "emulated NICs"
(lesson 09, chapter 9, explains both). :func:`worker_cores` proposes the cores worker threads are pinned
to, near their NICs (lesson 12, chapter 12).
"""
from __future__ import annotations

import os
from dataclasses import dataclass

from . import fi, memory


@dataclass
class NicSlot:
    """One NIC as the engine sees it: an endpoint with its own completion queue and address vector."""
    index: int
    domain_name: str
    emulated: bool
    info: fi.Info
    cq: fi.CompletionQueue
    av: fi.AddressVector
    ep: fi.Endpoint


class NicSet:
    """``count`` NIC slots over a provider's domains (or the named ones), one fabric and domain per real
    NIC; slots beyond the real NICs share domains round-robin and are marked emulated. A context manager."""

    def __init__(self, provider: str | None, count: int | None = None, domains: list[str] | str | None = None,
                 memory_kind: str = "host"):
        if isinstance(domains, str):
            domains = [d for d in domains.split(",") if d]
        infos = fi.getinfo(provider, hmem=None if memory_kind == "cuda" else False)
        by_domain: dict[str, fi.Info] = {}
        for info in infos:
            by_domain.setdefault(info.domain, info)
        wanted = domains or [d for d in os.environ.get("FABRICLAB_DOMAIN", "").split(",") if d] or list(by_domain)
        missing = [d for d in wanted if d not in by_domain]
        if missing:
            raise fi.UsageError(f"provider {infos[0].provider!r} has no domain {', '.join(missing)}; its domains here: "
                                f"{', '.join(by_domain)}")
        count = len(wanted) if count is None else count
        if count <= 0:
            raise fi.UsageError(f"the number of NICs must be at least 1, got {count}")
        self.provider = infos[0].provider
        self.real_nics = len(wanted)
        self.fabrics: list[fi.Fabric] = []
        self.domains: dict[str, fi.Domain] = {}
        self.slots: list[NicSlot] = []
        try:
            for name in wanted[:count]:
                fabric = fi.Fabric(by_domain[name])
                self.fabrics.append(fabric)
                self.domains[name] = fi.Domain(fabric, by_domain[name])
            for i in range(count):
                name = wanted[i % len(wanted)]
                domain = self.domains[name]
                cq = fi.CompletionQueue(domain)
                av = fi.AddressVector(domain)
                ep = fi.Endpoint(domain, cq, av)
                self.slots.append(NicSlot(i, name, i >= len(wanted), domain.info, cq, av, ep))
        except BaseException:
            self.close()
            raise

    @property
    def emulated(self) -> int:
        return sum(s.emulated for s in self.slots)

    def describe(self) -> str:
        text = f"{len(self.slots)} NIC(s) on {self.provider}: {', '.join(s.domain_name for s in self.slots[:8])}"
        if len(self.slots) > 8:
            text += ", ..."
        if self.emulated:
            text += (f" ({self.emulated} emulated: this machine has {self.real_nics} real domain(s), so several "
                     "endpoints share one)")
        return text

    def register(self, buffer, access: int = fi.ACCESS_ALL, stage: bool = True) -> list[memory.Registration]:
        """The buffer registered once per domain (per endpoint where the provider binds memory to one), for
        for the uses ``access`` names (fi access flags; default every use). ``stage=False``: GPU memory that
        some domain cannot register directly raises memory.DirectUnavailable (nothing stays registered)."""
        per_domain: dict[str, memory.Registration] = {}
        out = []
        for slot in self.slots:
            bind = slot.info.mr_endpoint
            reg = None if bind else per_domain.get(slot.domain_name)
            if reg is None:
                stack = _SlotStack(self.domains[slot.domain_name], slot.ep)
                try:
                    reg = memory.register(stack, buffer, staging=out[0].staging if out else None, access=access,
                                          stage=stage)
                except memory.DirectUnavailable:
                    for done in unique_registrations(out):
                        done.close()
                    raise
                per_domain.setdefault(slot.domain_name, reg)
            out.append(reg)
        return out

    def addresses(self) -> list[str]:
        return [s.ep.address().hex() for s in self.slots]

    def close(self) -> None:
        for fabric in self.fabrics:
            fabric.close()
        self.fabrics.clear()

    @property
    def closed(self) -> bool:
        return not self.fabrics

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False


class _SlotStack:
    """What memory.register needs of an endpoint stack, for one slot."""

    def __init__(self, domain: fi.Domain, ep: fi.Endpoint):
        self.domain, self.ep, self.info = domain, ep, domain.info

    def register(self, buffer=None, **kw) -> fi.MemoryRegion:
        return fi.MemoryRegion(self.domain, buffer, endpoint=self.ep, **kw)


def release_nics(owner) -> None:
    """Close an owner's engine, registrations and NIC set, in that order (children before parents)."""
    if owner.engine is not None:
        owner.engine.close()
        owner.engine = None
    for reg in unique_registrations(owner.registrations):
        reg.close()
    owner.registrations = []
    if owner.nicset is not None:
        owner.nicset.close()
        owner.nicset = None


def unique_registrations(registrations: list[memory.Registration]) -> list[memory.Registration]:
    seen, out = set(), []
    for reg in registrations:
        if id(reg) not in seen:
            seen.add(id(reg))
            out.append(reg)
    return out


def worker_cores(threads: int, provider: str, cores: list[int] | None = None) -> list[int]:
    """Cores to pin worker threads to: given, or proposed by fabriclab.topology for the NICs' groups
    (then the rest of the allowed cores, core 0 last)."""
    allowed = sorted(os.sched_getaffinity(0))
    if cores:
        cores = list(cores)
    else:
        from . import topology
        groups = [[c for c in g.cores if c in allowed] for g in topology.Topology.discover(provider=provider).groups]
        groups = [g for g in groups if g]
        # thread t goes to group t % G (one thread per GPU group first), taking that group's cores in turn
        proposed = [g[i] for i in range(max(map(len, groups), default=0)) for g in groups if i < len(g)]
        cores = proposed + [c for c in allowed if c not in proposed]
    if threads > len(cores):
        raise fi.UsageError(f"{threads} pinned threads need as many cores, but only {len(cores)} are available "
                            f"({', '.join(map(str, cores))}); use fewer threads")
    return cores[:threads]
