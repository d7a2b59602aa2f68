"""The library core's NIC sets and worker placement: what ``fabriclab.Engine`` and the course's engine
stages (``fabriclab.multi_nic`` and after) open their NICs with and pin their threads by.

A :class:`NicSet` is ``count`` NIC slots, each an endpoint with its own completion queue and address
vector, over a provider's domains; slots beyond the real NICs share domains and are "emulated NICs"
(lesson 09, chapter 9, explains both). :func:`worker_cores` proposes the cores worker threads are pinned
to, near their NICs (lesson 12, chapter 12).
"""
from __future__ import annotations

import functools
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, Protocol

from . import fi, memory, shmclean

if TYPE_CHECKING:
    from .topology import Group, Topology


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
    NIC; slots beyond the real NICs share domains round-robin and are marked emulated. ``count`` None: every
    domain, and at least ``at_least`` slots (the course's stages ask for one per GPU group, which a provider
    with one domain can only give as emulated slots). A context manager."""

    def __init__(self, provider: str | None, count: int | None = None, domains: list[str] | str | None = None,
                 memory_kind: str = "host", at_least: int = 1) -> None:
        if isinstance(domains, str):
            domains = [d for d in domains.split(",") if d]
        # One fabric per NIC, chosen by name (fi.domains): on EFA the RDM fabric, not efa-direct listed first
        infos = fi.domains(provider, hmem=None if memory_kind == "cuda" else False)
        by_domain = {info.domain: info for info in infos}
        wanted = domains or [d for d in os.environ.get("FABRICLAB_DOMAIN", "").split(",") if d] or list(by_domain)
        missing = [d for d in wanted if d not in by_domain]
        if missing:
            raise fi.UsageError(f"provider {infos[0].provider!r} has no domain {', '.join(missing)}; its domains here: "
                                f"{', '.join(by_domain)}")
        count = max(len(wanted), at_least) if count is None else count
        if count <= 0:
            raise fi.UsageError(f"the number of NICs must be at least 1, got {count}")
        self.provider = infos[0].provider
        self.real_nics = len(wanted)
        self.fabrics: list[fi.Fabric] = []
        self.domains: dict[str, fi.Domain] = {}
        self.slots: list[NicSlot] = []
        # Before any endpoint (and its shm region) exists: the owner record that lets the next engine of this pid
        # namespace reclaim the regions if this process is killed (shmclean); given back once they are closed.
        shmclean.hold_owner_record()
        self._holds_record = True
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
        fabric = self.slots[0].info.fabric
        text = (f"{len(self.slots)} NIC(s) on {self.provider} (fabric {fabric}): "
                f"{', '.join(s.domain_name for s in self.slots[:8])}")
        if len(self.slots) > 8:
            text += ", ..."
        if self.emulated:
            text += (f" ({self.emulated} emulated: this machine has {self.real_nics} real domain(s), so several "
                     "endpoints share one)")
        return text

    def register(self, buffer: memory.Memory, access: int = fi.ACCESS_ALL,
                 stage: bool = True) -> list[memory.Registration]:
        """The buffer registered once per domain (per endpoint where the provider binds memory to one), for
        for the uses ``access`` names (fi access flags; default every use). ``stage=False``: GPU memory that
        some domain cannot register directly raises memory.DirectUnavailable (nothing stays registered)."""
        per_domain: dict[str, memory.Registration] = {}
        out: list[memory.Registration] = []
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
        if self._holds_record:
            self._holds_record = False
            shmclean.release_owner_record()

    def keep_open(self) -> None:
        """Never close these NICs, not even at interpreter exit: a thread stuck inside the provider may still
        use them (why: native/service.h, at fl_service_stop)."""
        for fabric in self.fabrics:
            fabric.keep_open()

    @property
    def closed(self) -> bool:
        return not self.fabrics

    def __enter__(self) -> NicSet:
        return self

    def __exit__(self, *exc: object) -> Literal[False]:
        self.close()
        return False


class PeerEntries:
    """The address-vector entries of an engine's NIC slots for its peers' NICs: inserted at the first Peer to
    a peer engine, shared by every Peer to it, removed (fi_av_remove) by ``trim`` once ``needed()`` no longer
    names them, so that an engine reaching peers that come and go never fills its address vectors (shm's
    hold 256). ``needed(deep)`` returns the (slot, fi_addr) pairs still in use; ``deep``: the vector is
    full, look harder (a peer of this host whose process is gone needs nothing).

    Peers that write into this engine are entered too, where the provider keeps state for each peer that
    reaches an endpoint (``fi.AddressVector.maps_peers``; shm maps its region into one of 256 slots and
    frees them only at fi_av_remove): a staged target learns its writers' NIC addresses from their REQUESTs
    (``reached_by``), and each such entry stays until the writer's endpoint is gone (``peer_gone``), never
    sooner, whoever named it: one removed while its endpoint could still write would have its next write
    read an unmapped region. A target serving writers that come and go thus keeps only the live ones'."""

    REACHED_ROOM = 16  # entries of a vector never taken by writers reaching this engine: kept for its own Peers
    RECLAIM_S = 3.0    # a full vector reclaims killed writers' regions (a scan of /dev/shm and /proc) this seldom

    def __init__(self, slots: list[NicSlot], needed: Callable[[bool], set[tuple[int, int]]], advice: str) -> None:
        self.slots, self.needed, self.advice = slots, needed, advice
        self.entries: dict[tuple[int, bytes], int] = {}  # (slot, peer's raw address) -> fi_addr
        self.kept: set[tuple[int, int]] = set()  # never removed: shm could not reuse the slot safely
        self.reaching: set[tuple[int, bytes]] = set()  # (slot, raw address) of writers reaching this engine
        self.removed = 0
        self.reclaimed = 0.0  # when a full vector last reclaimed killed writers' regions
        self.lock = threading.Lock()

    def reached_by(self, addresses: list[bytes]) -> None:
        """A writer that writes into this engine through NICs at ``addresses`` (each an fi.Address's bytes,
        untrusted): entered in the vectors that keep state for such peers, while there is room. Addresses
        that fit no slot, or name no endpoint, are left out (the writer's own writes then say what is wrong)."""
        peers = []
        for data in addresses:
            try:
                peers.append(fi.Address.from_bytes(data))
            except fi.FabriclabError:
                continue
        with self.lock:
            for slot in self.slots:
                if not slot.av.maps_peers:
                    continue
                for address in peers:
                    try:
                        address.check_compatible(slot.info)
                    except fi.FabriclabError:
                        continue
                    key = (slot.index, address.raw)
                    if key in self.entries:
                        self.reaching.add(key)
                        continue
                    if len(slot.av.entries) >= slot.av.most - self.REACHED_ROOM:
                        self._trim(True)
                    if len(slot.av.entries) >= slot.av.most - self.REACHED_ROOM:
                        break
                    try:
                        self.entries[key] = slot.av.insert(address)
                    except fi.FabriclabError:
                        continue
                    self.reaching.add(key)

    def entry(self, slot: NicSlot, address: fi.Address) -> int:
        """The fi_addr of ``address`` in ``slot``'s address vector (inserted at first): AddressVectorFull,
        saying what to do, where every entry is still needed."""
        with self.lock:
            key = (slot.index, address.raw)
            fi_addr = self.entries.get(key)
            if fi_addr is not None:
                return fi_addr
            for deep in (False, True):
                if len(slot.av.entries) >= slot.av.most:
                    self._trim(deep)
            try:
                fi_addr = self.entries[key] = slot.av.insert(address)
            except fi.AddressVectorFull as exc:
                raise fi.AddressVectorFull(exc.held, exc.most, self.slots[0].info.provider, self.advice) from None
            return fi_addr

    def trim(self) -> None:
        """Remove every entry no longer needed."""
        with self.lock:
            self._trim(False)

    def _trim(self, deep: bool) -> None:
        if deep and self.reaching and time.monotonic() - self.reclaimed > self.RECLAIM_S:
            self.reclaimed = time.monotonic()
            shmclean.reclaim_stale_shm_regions()  # killed writers' regions: gone once reclaimed
        self.reaching = {(i, raw) for i, raw in self.reaching if not self.slots[i].av.peer_gone(raw)}
        needed = self.needed(deep) | self.kept | {(i, self.entries[i, raw]) for i, raw in self.reaching}
        for (index, raw), fi_addr in list(self.entries.items()):
            if (index, fi_addr) in needed:
                continue
            if self.slots[index].av.remove(fi_addr):
                del self.entries[index, raw]
                self.removed += 1
            else:
                self.kept.add((index, fi_addr))

    def stats(self) -> dict[str, int]:
        """Entries held (all slots together), the most one slot's vector takes, entries removed so far, and
        those of writers reaching this engine (``reached_by``) among the held."""
        return {"entries": len(self.entries), "most": min(s.av.most for s in self.slots), "removed": self.removed,
                "writers_reaching": len(self.reaching)}


class _SlotStack:
    """What memory.register needs of an endpoint stack, for one slot."""

    def __init__(self, domain: fi.Domain, ep: fi.Endpoint) -> None:
        self.domain, self.ep, self.info = domain, ep, domain.info

    def register(self, buffer: object = None, **kw: Any) -> fi.MemoryRegion:
        return fi.MemoryRegion(self.domain, buffer, endpoint=self.ep, **kw)


#: Providers that reach a peer on their own host through shared memory rather than their NICs, and the
#: variable that turns that path off (read when libfabric starts the provider). efa RDM does, by default.
SAME_HOST_SHM_SWITCHES = {"efa": "FI_EFA_ENABLE_SHM_TRANSFER"}
_OFF = ("0", "false", "no", "off")


@functools.cache
def host_identity() -> bytes:
    """16 bytes naming this running host (its boot id): equal in two engines exactly when they share a host."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return bytes.fromhex(f.read().strip().replace("-", ""))[:16].ljust(16, b"\0")
    except (OSError, ValueError):
        return os.uname().nodename.encode()[:16].ljust(16, b"\0")


def same_host_path(provider: str, same_host: bool) -> str:
    """How writes reach a peer: through the NICs, or (same host) through a provider's shared-memory path."""
    if provider == "shm":
        return "shared memory (the shm provider)"
    switch = SAME_HOST_SHM_SWITCHES.get(provider.split(";")[0])
    if same_host and switch and os.environ.get(switch, "1").lower() not in _OFF:
        return f"shared memory ({provider} reaches a peer on its own host that way; {switch}=0 uses the NICs)"
    return "the NICs"


def measure_the_nics() -> str:
    """For benchmarks and lessons that mean to measure NICs: turn every provider's same-host shared-memory
    path off (unless the user set the switch), before libfabric starts the provider and for the peers this
    process starts. Returns what was set, to be printed ("" when nothing was)."""
    set_now = []
    for switch in SAME_HOST_SHM_SWITCHES.values():
        if switch not in os.environ:
            os.environ[switch] = "0"
            set_now.append(f"{switch}=0")
    return ", ".join(set_now)


class NicOwner(Protocol):
    """What release_nics closes: a course stage's engine (fabriclab._native), registrations and NIC set."""
    engine: Any
    registrations: list[memory.Registration]
    nicset: NicSet | None


def release_nics(owner: NicOwner) -> None:
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
    seen: set[int] = set()
    out: list[memory.Registration] = []
    for reg in registrations:
        if id(reg) not in seen:
            seen.add(id(reg))
            out.append(reg)
    return out


# ------------------------------------------------------------------------------ defaults and groups

#: Cores Engine() leaves to its caller by default: the caller's own threads (the one that submits
#: transfers, the reaper) need a core the polling workers never take.
CALLER_CORES = 1
#: At most this many worker threads (and emulated NIC slots) by default on a provider with one domain.
#: There every write is a memory copy by a core: two processes on one host (shm's only case) share the
#: memory bandwidth, which 8 copying threads already saturate on the hosts measured (issue 15: 1024 x 64 KiB
#: pages, 20-28 GB/s with 8 threads on a 16-core box); more threads only take cores from the peer.
ONE_DOMAIN_THREADS = 8


@dataclass(frozen=True)
class Layout:
    """How many NIC slots and worker threads an engine drives, and why (``Engine()``'s defaults)."""
    nics: int
    threads: int
    why: str


def default_layout(real_nics: int, topology_groups: int, usable_cores: int) -> Layout:
    """The NIC slots and worker threads ``Engine()`` picks when not told.

    ``real_nics``: domains the provider offers; ``topology_groups``: groups of fabriclab.topology that hold
    those NICs (one per GPU on a GPU host); ``usable_cores``: cores this process may run on
    (``os.sched_getaffinity``). A worker with work polls without pause, so at most ``usable_cores -
    CALLER_CORES`` of them: one engine busy on every NIC still leaves its caller a core. Engines of other
    processes are not counted: idle workers rest (native/resting.c), so several engines on one host take
    cores only while they have work.

    * Several real NICs (EFA): every real NIC, no emulated ones; one thread per topology group (each pinned
      beside its GPU, driving that GPU's NICs), at most one per NIC and per spare core.
    * One domain (shm, tcp on one interface): one NIC drives nothing in parallel, so one emulated NIC slot
      per worker thread, as many threads as spare cores, at most ONE_DOMAIN_THREADS.
    """
    spare = max(1, usable_cores - CALLER_CORES)
    if real_nics > 1:
        threads = max(1, min(topology_groups or 1, real_nics, spare))
        return Layout(real_nics, threads, f"{real_nics} real NICs in {topology_groups or 1} topology group(s), "
                                          f"a thread per group ({spare} spare core(s))")
    threads = min(spare, ONE_DOMAIN_THREADS)
    return Layout(threads, threads, f"one domain: a NIC slot per thread, a thread per spare core ({usable_cores} "
                                    f"usable, {CALLER_CORES} left to the caller, at most {ONE_DOMAIN_THREADS})")


@dataclass(frozen=True)
class NicGroups:
    """NIC slots split into worker groups by topology. ``of_slot[i]``: the group of slot i;
    ``gpu_of_slot[i]``: the GPU whose NICs slot i belongs to (None where unknown or without GPU);
    ``cores[g]``: the cores near group g's NICs (from fabriclab.topology; empty where it says nothing)."""
    of_slot: tuple[int, ...]
    gpu_of_slot: tuple[int | None, ...]
    cores: tuple[tuple[int, ...], ...]

    @property
    def count(self) -> int:
        return len(self.cores)

    def slots_of_gpu(self, gpu: int | None) -> list[int]:
        """The slots of the NICs of GPU ``gpu``, where it has some (else every slot): a GPU region leaves
        through these."""
        mine = [i for i, g in enumerate(self.gpu_of_slot) if gpu is not None and g == gpu]
        return mine or list(range(len(self.of_slot)))


def group_nics(domains: list[str], groups: int, topology: Topology | None = None) -> NicGroups:
    """Split NIC slots into ``groups`` worker groups, each GPU with its own NICs.

    ``domains[i]`` is slot i's domain (emulated slots name the real NIC they share, and follow it);
    ``topology`` a ``fabriclab.topology.Topology`` (None: it says nothing). The slots of each topology
    group (in the topology's order: one per GPU, or per NUMA node without GPUs) form a cluster; slots whose
    domain the topology does not know form one last cluster, in index order. With fewer groups than
    clusters, neighbouring clusters merge (GPUs 0-1, 2-3, ...: same socket on a p5); with more, each
    cluster gets groups in proportion to its slots and deals its slots over them in index order. Without
    topology this is index order: slot i in group i % groups.
    """
    if not 1 <= groups <= len(domains):
        raise fi.UsageError(f"{groups} groups need between 1 and {len(domains)} (the NIC slots) groups")
    topo_groups = list(topology.groups) if topology is not None else []
    home: dict[str, int] = {}  # domain -> its topology group
    for t, g in enumerate(topo_groups):
        for domain in g.nics:
            home.setdefault(domain, t)
    clusters: list[tuple[Group | None, list[int]]] = []  # (topology group or None, its slots)
    for t, g in enumerate(topo_groups):
        slots = [i for i, d in enumerate(domains) if home.get(d) == t]
        if slots:
            clusters.append((g, slots))
    unknown = [i for i, d in enumerate(domains) if d not in home]
    if unknown:
        clusters.append((None, unknown))
    shares = [1] * len(clusters) if groups >= len(clusters) else None
    of_slot = [0] * len(domains)
    members: list[list[Group | None]] = [[] for _ in range(groups)]  # topology groups each worker group covers
    if shares is None:
        for j, (group, slots) in enumerate(clusters):
            mine = j * groups // len(clusters)
            members[mine].append(group)
            for i in slots:
                of_slot[i] = mine
    else:
        for _ in range(groups - len(clusters)):  # the next group to the cluster with most slots per group
            j = max((j for j in range(len(clusters)) if shares[j] < len(clusters[j][1])),
                    key=lambda j: len(clusters[j][1]) / shares[j])
            shares[j] += 1
        first = 0
        for (group, slots), share in zip(clusters, shares):
            for k, i in enumerate(slots):
                of_slot[i] = first + k % share
            for mine in range(first, first + share):
                members[mine].append(group)
            first += share
    gpu_of = {t: g.gpu for t, g in enumerate(topo_groups)}
    cores = tuple(tuple(dict.fromkeys(c for g in covered if g is not None for c in g.cores)) for covered in members)
    return NicGroups(tuple(of_slot), tuple(gpu_of[home[d]] if d in home else None for d in domains), cores)


def topology_groups_holding(domains: list[str], topology: Topology | None) -> int:
    """How many of ``topology``'s groups hold one of ``domains`` (0 without topology)."""
    wanted = set(domains)
    return sum(any(d in wanted for d in g.nics) for g in topology.groups) if topology is not None else 0


def discover_topology(provider: str) -> Topology | None:
    """fabriclab.topology's view of this host for ``provider``'s NICs, or None when it cannot tell
    (topology is advice: grouping then falls back to index order). The modeled host's is the recorded p5's,
    its NICs renamed to the sim provider's (modeled_topology)."""
    from . import topology
    if modeled_host(provider):
        return modeled_topology(provider)
    try:
        return topology.Topology.discover(provider=provider)
    except Exception:  # sysfs or cuda-python missing or odd: advice only, never fatal
        return None


def modeled_topology(provider: str) -> Topology:
    """The modeled host (the sim provider, docs/model.md) is the recorded p5: its NIC i is the p5's NIC i in
    GPU order (4 per GPU: NICs 0-15 on socket 0, 16-31 on socket 1), whatever the sim names it."""
    from .topology import Topology

    p5 = Topology.load("p5.48xlarge").to_dict()
    recorded = [nic for group in p5["groups"] for nic in group["nics"]]
    rename = dict(zip(recorded, (info.domain for info in fi.domains(provider))))
    p5["nics"] = [dict(n, domain=rename[n["domain"]], provider=provider) for n in p5["nics"] if n["domain"] in rename]
    p5["groups"] = [dict(g, nics=[rename[d] for d in g["nics"] if d in rename]) for g in p5["groups"]]
    p5["provider"] = provider
    return Topology.from_dict(p5)


def modeled_host(provider: str | None) -> bool:
    """Whether ``provider`` runs on the modeled p5 host: the sim provider in modeled time (docs/model.md),
    where a run's time is each thread's own CPU time plus the p5's modeled costs, so that this machine's
    cores bound neither the threads nor the figures (FABRICLAB_SIM_TIME=wall turns it off)."""
    return (provider or "").split(";")[0] == "sim" and os.environ.get("FABRICLAB_SIM_TIME", "modeled") != "wall"


def article_cores(threads: int) -> list[int]:
    """Where chapter 12 pins thread t on the recorded p5: the core chapter 8 prefers for GPU group t % 8, the
    middle one (cpus[6]) of the 12 physical cores each GPU takes, in GPU order, from its NUMA node (6, 18,
    ..., 90). The modeled host (the sim provider) puts a pinned thread there."""
    from .topology import Topology  # the recorded layouts are read only when a pinned run asks

    p5 = Topology.load("p5.48xlarge")
    preferred: list[int] = []
    seen: dict[int, int] = {}
    for group in sorted(p5.groups, key=lambda g: g.gpu or 0):
        numa = group.numa_node or 0
        node = sorted(p5.numa_node(numa).cores)
        share = len(node) // sum(1 for g in p5.groups if (g.numa_node or 0) == numa)
        k = seen[numa] = seen.get(numa, -1) + 1
        preferred.append(node[k * share + share // 2])
    return [preferred[t % len(preferred)] for t in range(threads)]


def worker_cores(threads: int, provider: str, cores: list[int] | None = None,
                 groups: NicGroups | None = None) -> list[int]:
    """Cores to pin worker threads to: given, or thread t on a core near group t's NICs (``groups``, from
    group_nics; without it, the topology's groups in turn), then the rest of the allowed cores, core 0 last."""
    allowed = sorted(os.sched_getaffinity(0))
    if cores:
        cores = list(cores)
    else:
        spare = [c for c in allowed if c != 0] + [c for c in allowed if c == 0]
        if groups is None:
            topo = discover_topology(provider)
            near = [[c for c in g.cores if c in allowed] for g in (topo.groups if topo else [])]
            near = [g for g in near if g]
            # thread t goes to group t % G (one thread per GPU group first), taking that group's cores in turn
            proposed = [g[i] for i in range(max(map(len, near), default=0)) for g in near if i < len(g)]
        else:
            proposed = []
            for t in range(min(threads, len(allowed))):
                own = groups.cores[t] if t < groups.count else ()
                proposed.append(next((c for c in [*own, *spare] if c in allowed and c not in proposed)))
        cores = proposed + [c for c in spare if c not in proposed]
    if threads > len(cores) and modeled_host(provider):  # the modeled host pins them there (article_cores)
        cores = [cores[t % len(cores)] for t in range(threads)]
    if threads > len(cores):
        raise fi.UsageError(f"{threads} pinned threads need as many cores, but only {len(cores)} are available "
                            f"({', '.join(map(str, cores))}); use fewer threads")
    return cores[:threads]
