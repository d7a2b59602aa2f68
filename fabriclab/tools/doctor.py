"""``python -m fabriclab doctor``: what a p5 user (or anyone) runs first. Each item says what was found, a
verdict — ``ok``, ``slow`` (works, but not at the speed the course's figures assume) or ``will fail`` —
and, where it is not ok, the fix.

Items: libfabric (version, the library file), the provider chosen and why, the fabric its NICs come from,
the NICs (PCI place, link speed, which GPU and NUMA node they serve), immediate data (``cq_data_size``),
queue depths, the GPU memory path (direct registration or staged through pinned host memory), whether a
peer on the same host would take a shared-memory detour, the GPU <-> NIC grouping and the cores the engine
would pin, and (only when it can tell) a /dev/shm shared with other pid namespaces, where libfabric's shm
regions of live processes look ownerless. ``--recorded p5.48xlarge`` checks a recorded machine's layout instead (only what a recording
holds: no libfabric is asked then). Lesson 01 runs it; lesson 08 explains the grouping.
"""
from __future__ import annotations

import argparse
import json
import os
from dataclasses import asdict, dataclass

from .. import cli, fi, gpu, nics, shmclean, topology

OK, SLOW, FAIL = "ok", "slow", "will fail"
HARDWARE_PROVIDERS = ("efa", "verbs")
#: Fewer transmit slots than this caps the writes one NIC keeps in flight below what the stages post.
USEFUL_TX_DEPTH = 64


@dataclass
class Check:
    """One line of the report: the item, what was found, the verdict and (unless ok) the fix."""
    item: str
    found: str
    verdict: str = OK
    fix: str = ""


def libfabric_file() -> str:
    """The libfabric shared object this process loaded (from /proc/self/maps), or a note why unknown."""
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                path = line.split()[-1]
                if "/libfabric.so" in path:
                    return path
    except OSError:
        pass
    return "(path unknown)"


def check_libfabric() -> Check:
    return Check("libfabric", f"{fi.library_version()} from {libfabric_file()}")


def check_provider(provider: str | None) -> tuple[Check, str]:
    available = fi.available_providers()
    if provider:
        why = "named with --provider"
    elif os.environ.get("FABRICLAB_PROVIDER"):
        why = "named by $FABRICLAB_PROVIDER"
    else:
        why = f"the first offered of fabriclab's order {' > '.join(fi.PREFERRED_PROVIDERS)}"
    chosen = provider or fi.default_provider()
    found = f"{chosen}: {why}; all offered here: {', '.join(available) or 'none'}"
    if chosen in HARDWARE_PROVIDERS:
        return Check("provider", found), chosen
    return Check("provider", found, SLOW,
                 "a software provider moves bytes with the CPU: right for the course on any box, not for NIC "
                 "figures; on a p5 install the EFA software (it puts libfabric under /opt/amazon/efa) so efa is "
                 "chosen"), chosen


def check_fabric(listed: list[fi.Info], nics: list[fi.Info]) -> Check:
    """``listed``: every entry of the provider; ``nics``: the ones fabriclab drives (fi.domains)."""
    fabrics = list(dict.fromkeys(i.fabric for i in listed))
    if not nics:
        return Check("fabric", f"offered: {', '.join(fabrics)}; none with {fi.IMMEDIATE_DATA_BYTES}-byte immediate "
                               "data", FAIL, "use a provider or fabric whose cq_data_size is at least "
                                             f"{fi.IMMEDIATE_DATA_BYTES} (efa RDM's is)")
    used = nics[0].fabric
    why = ("named by --fabric or $FABRICLAB_FABRIC" if os.environ.get("FABRICLAB_FABRIC")
           else "named like the provider" if used == nics[0].provider else "the first listed")
    found = f"{used} ({why})" + (f"; also offered: {', '.join(f for f in fabrics if f != used)}"
                                 if len(fabrics) > 1 else "")
    if used == "efa-direct":
        return Check("fabric", found, SLOW,
                     "efa-direct limits sends to one MTU and has no shared-memory path or emulated protocols; use "
                     "the RDM fabric (--fabric efa, or unset FABRICLAB_FABRIC)")
    return Check("fabric", found)


def check_nics(domains: list[fi.Info]) -> Check:
    parts = []
    for info in domains[:8]:
        nic = info.nic
        extra = ""
        if nic is not None and (nic.pci or nic.link_speed_bps):
            extra = " [" + ", ".join(x for x in (nic.pci and f"pci {nic.pci}",
                                                 nic.link_speed_bps and f"{nic.link_speed_bps / 1e9:g} Gbps") if x) + "]"
        parts.append(info.domain + extra)
    listed = ", ".join(parts) + (f", … ({len(domains)} in all)" if len(domains) > 8 else "")
    found = f"{len(domains)} domain(s): {listed}"
    if len(domains) == 1 and domains[0].provider not in HARDWARE_PROVIDERS:
        found += "; asking for more NICs gives emulated ones (endpoints sharing this one)"
    return Check("NICs", found)


def check_immediate_data(info: fi.Info) -> Check:
    found = f"cq_data_size {info.cq_data_size} bytes"
    if info.cq_data_size < fi.IMMEDIATE_DATA_BYTES:
        return Check("immediate data", found, FAIL,
                     f"writes carry a {fi.IMMEDIATE_DATA_BYTES}-byte immediate; use a provider or fabric that offers "
                     "it (efa RDM does)")
    return Check("immediate data", found)


def check_queue_depths(info: fi.Info) -> Check:
    found = f"tx {info.tx_size}, rx {info.rx_size} entries per endpoint"
    if info.tx_size < USEFUL_TX_DEPTH:
        return Check("queue depths", found, SLOW,
                     f"fewer than {USEFUL_TX_DEPTH} writes can be in flight per NIC; raise the provider's tx size "
                     "(e.g. FI_<PROVIDER>_TX_SIZE) or add NICs")
    return Check("queue depths", found)


def check_gpu_memory(provider: str) -> Check:
    status = gpu.cuda_status()
    if status != "ok":
        return Check("GPU memory", f"no CUDA here ({status}): host memory only")
    devices = gpu.devices()
    info = fi.getinfo(provider, hmem=None)[0]
    found = f"{len(devices)} GPU(s); provider {provider} {'offers' if info.hmem else 'does not offer'} FI_HMEM"
    fix = ("GPUDirect RDMA needs a provider with FI_HMEM that moves GPU memory without the CUDA API (efa on p5, "
           "with the EFA installer's libfabric and nvidia-peermem or dmabuf)")
    if not info.hmem:
        return Check("GPU memory", found + ": GPU memory is staged through pinned host memory", SLOW, fix)
    with fi.EndpointStack(info) as stack:  # the endpoint answers the CUDA-API question (fi.gpu_direct_verdict)
        direct, why = stack.ep.gpu_direct, stack.ep.gpu_direct_why
    if direct:
        return Check("GPU memory", f"{found}; {why}: GPU memory is registered with the NIC (direct)")
    if direct is None:
        return Check("GPU memory", f"{found}; {why}: direct if the registration succeeds (not checked further)")
    return Check("GPU memory", f"{found}, but {why}: GPU memory is staged through pinned host memory", SLOW, fix)


def check_gpu_ipc() -> Check:
    """Whether GPU memory of this host's processes can be copied GPU to GPU (the engine's cuda-ipc path)."""
    if gpu.cuda_status() != "ok":
        return Check("GPU peers on this host", "no CUDA here: no cuda-ipc path")
    from .. import ipc, memory
    devices = gpu.devices()
    probe = memory.CudaBuffer(1 << 20)
    try:
        ipc.export(probe.pointer, probe.length, 0)
    except gpu.CudaError as exc:
        return Check("GPU peers on this host", f"CUDA IPC does not export here ({exc}): GPU -> GPU writes between "
                     "processes go through the NICs or the staged path", SLOW,
                     "run the processes with CUDA IPC allowed (same container or --ipc=host)")
    finally:
        probe.close()
    d = gpu.require_cuda()
    pairs = [(a.index, b.index) for a in devices for b in devices if a.index != b.index]
    peer = [p for p in pairs if gpu.check(d.cuDeviceCanAccessPeer(*(gpu.check(d.cuDeviceGet(i), "cuDeviceGet")
                                                                     for i in p)), "cuDeviceCanAccessPeer")]
    between = (f"; peer access between {len(peer)} of {len(pairs)} ordered GPU pairs" if pairs else
               "; one GPU: peers share it")
    return Check("GPU peers on this host", "CUDA IPC handles export: GPU -> GPU writes between processes of this "
                 "host are copied by the GPU (cuda-ipc; each peer's memory is opened at its first write, "
                 f"Peer.route says so){between}")


def check_same_host_path(provider: str) -> Check:
    path = nics.same_host_path(provider, same_host=True)
    switch = nics.SAME_HOST_SHM_SWITCHES.get(provider.split(";")[0])
    if provider == "shm":
        return Check("same-host peers", "the shm provider: every peer is on this host, reached by shared memory")
    if switch is None:
        return Check("same-host peers", f"{provider} reaches a peer on this host through {path}")
    if path == "the NICs":
        return Check("same-host peers", f"{switch}={os.environ[switch]}: peers on this host are reached through the NICs")
    return Check("same-host peers", f"{provider} reaches a peer on this host through shared memory, not the NICs", SLOW,
                 f"to measure the NICs between two processes on one host, set {switch}=0 (bench and the lessons do)")


def check_shared_shm() -> list[Check]:
    """/dev/shm shared across pid namespaces (containers run with --ipc=host and their own pids), when it
    shows: what removes which regions then (shmclean). No item when nothing shows it."""
    found = shmclean.shared_pid_namespaces()
    return [Check("/dev/shm", found)] if found else []


def check_grouping(topo: topology.Topology) -> list[Check]:
    """The GPU <-> NIC groups (chapter 8) and the cores proposed for the threads that drive them."""
    if not topo.gpus:
        return [Check("GPU <-> NIC groups", f"no GPUs: {len(topo.nics)} NIC(s) in {len(topo.groups)} group(s) by "
                                            "index"),
                Check("cores to pin", "; ".join(f"group {i}: {topology.format_cpulist(g.cores) or '-'}"
                                                for i, g in enumerate(topo.groups)))]
    far = [g for g in topo.groups if g.link in ("NODE", "SYS")]
    lonely = [g for g in topo.groups if g.gpu is not None and not g.nics]
    found = "; ".join(f"cuda:{g.gpu} -> {len(g.nics)} NIC(s) ({g.link or '?'})" for g in topo.groups[:8])
    if len(topo.groups) > 8:
        found += f"; … ({len(topo.groups)} groups)"
    grouping = Check("GPU <-> NIC groups", found)
    if lonely:
        grouping = Check("GPU <-> NIC groups", found, SLOW,
                         f"{len(lonely)} GPU(s) have no NIC of their own; their pages cross the host's PCIe fabric")
    elif far:
        grouping = Check("GPU <-> NIC groups", found, SLOW,
                         "some GPUs reach their NICs only across a socket or host bridge (NODE/SYS): pages take the "
                         "long way")
    cores = Check("cores to pin", "; ".join(f"cuda:{g.gpu}: {topology.format_cpulist(g.cores) or '-'}"
                                           for g in topo.groups[:8]) + ("; …" if len(topo.groups) > 8 else ""))
    return [grouping, cores]


def diagnose(provider: str | None = None) -> list[Check]:
    """Every check, on this machine."""
    checks = [check_libfabric()]
    chosen_check, chosen = check_provider(provider)
    checks.append(chosen_check)
    listed = fi.getinfo(chosen, cq_data_size=0)  # every entry, those short of immediate data too
    try:
        nics = fi.domains(chosen)
    except fi.UsageError:  # no fabric with enough immediate data: reported by the checks below
        nics = []
    shown = nics or fi.domains(chosen, cq_data_size=0)
    checks += [check_fabric(listed, nics), check_nics(shown), check_immediate_data(shown[0]),
               check_queue_depths(shown[0]), check_gpu_memory(chosen), check_gpu_ipc(), check_same_host_path(chosen)]
    checks += check_shared_shm()
    checks += check_grouping(topology.Topology.discover(provider=chosen))
    return checks


def diagnose_recorded(name: str) -> list[Check]:
    """What a recorded machine's layout tells: its NICs, their grouping with the GPUs, the cores."""
    try:
        topo = topology.Topology.load(name)
    except (OSError, ValueError) as exc:
        raise fi.UsageError(str(exc)) from None
    speeds = {n.link_speed_bps for n in topo.nics if n.link_speed_bps}
    total = sum(n.link_speed_bps or 0 for n in topo.nics)
    nics = Check("NICs", f"{len(topo.nics)} {topo.provider or ''} NIC(s)"
                         + (f" of {', '.join(f'{s / 1e9:g}' for s in sorted(speeds))} Gbps = {total / 1e9:g} Gbps"
                            if speeds else ""))
    return [Check("recording", f"{topo.title}: libfabric, GPU memory path and same-host path are not recorded; run "
                               "doctor on the machine itself for those")] + [nics] + check_grouping(topo)


def verdict_line(checks: list[Check]) -> str:
    worst = FAIL if any(c.verdict == FAIL for c in checks) else SLOW if any(c.verdict == SLOW for c in checks) else OK
    counts = {v: sum(c.verdict == v for c in checks) for v in (OK, SLOW, FAIL)}
    return f"verdict: {worst} ({counts[OK]} ok, {counts[SLOW]} slow, {counts[FAIL]} will fail)"


def format_report(checks: list[Check]) -> str:
    width = max(len(c.item) for c in checks)
    lines = []
    for c in checks:
        lines.append(f"{c.item:<{width}}  {c.verdict:<9}  {c.found}")
        if c.fix:
            lines.append(f"{'':<{width}}  {'':<9}  fix: {c.fix}")
    lines.append(verdict_line(checks))
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--provider", default=None, help="check this provider (default: the one fabriclab would pick)")
    parser.add_argument("--fabric", type=cli.fabric_name, default=None, metavar="NAME",
                        help="check this fabric of the provider (default: $FABRICLAB_FABRIC, else the one named "
                             "like the provider)")
    parser.add_argument("--recorded", metavar="NAME", default=None,
                        help=f"check a recorded machine's layout ({', '.join(topology.recorded_names())})")
    parser.add_argument("--json", action="store_true", help="one JSON object: the checks and the verdict")


def main(args) -> int:
    checks = diagnose_recorded(args.recorded) if args.recorded else diagnose(args.provider)
    if args.json:
        print(json.dumps({"checks": [asdict(c) for c in checks], "verdict": verdict_line(checks)}))
    else:
        print(format_report(checks))
    return 1 if any(c.verdict == FAIL for c in checks) else 0
