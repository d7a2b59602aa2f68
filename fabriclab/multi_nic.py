"""Chapters 9–10 — all the NICs, from one thread; then a warm-up before the clock starts.

Chapter 7 drove one NIC. A p5 has 32, four per GPU. Here each NIC slot gets its own endpoint,
completion queue and address vector; the source buffer is registered once per domain; the target
answers with one (address, region key) pair per slot. The hot loop moves into C (``native/course.c``,
over the engine core in ``native/core.c``): Python cannot post millions of writes per second. This
stage's loop is the article's chapter 9: one thread visits every GPU group in turn, polls that group's
NICs, then posts *one* write. Chapter 10 adds one untimed write per NIC before timing starts, so
first-contact costs stay out of the figure.

Where the machine has fewer NICs (domains) than asked for, several endpoints share a domain: those are
"emulated NICs", always reported as such.

    python -m fabriclab.multi_nic serve
    python -m fabriclab.multi_nic connect ADDR --nics 4 --groups 2 --page-size 64K --total 1G
"""
from __future__ import annotations

import json
import os
import threading
import time
from dataclasses import asdict, dataclass, field

import numpy as np

from . import bidirectional, cli, fi, memory, rdma_write
from ._fabric import ffi, lib
from .rdma_write import PagePlan, Report, Writer, WriteStats

PREPARE_NICS, REGIONS = 10, 11
RING_CAPACITY = 4096


# ------------------------------------------------------------------------------------------- NIC slots


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

    def register(self, buffer, access: int = fi.ACCESS_ALL) -> list[memory.Registration]:
        """The buffer registered once per domain (per endpoint where the provider binds memory to one), for
        for the uses ``access`` names (fi access flags; default every use)."""
        per_domain: dict[str, memory.Registration] = {}
        out = []
        for slot in self.slots:
            bind = bool(slot.info.mr_mode & lib.FI_MR_ENDPOINT)
            reg = None if bind else per_domain.get(slot.domain_name)
            if reg is None:
                stack = _SlotStack(self.domains[slot.domain_name], slot.ep)
                reg = memory.register(stack, buffer, staging=out[0].staging if out else None, access=access)
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


# -------------------------------------------------------------------------------------------- engine


class NativeEngine:
    """An fl_engine over a NicSet: fills one fl_nic per slot and runs the C loops in a Python thread,
    so that Ctrl-C (KeyboardInterrupt) stops the engine and the interpreter stays usable."""

    def __init__(self, nics: NicSet, registrations: list[memory.Registration] | None = None):
        self.nics = nics
        self._ptr = lib.fl_engine_new(len(nics.slots), RING_CAPACITY)
        if self._ptr == ffi.NULL:
            raise MemoryError("fl_engine_new")
        for slot in nics.slots:
            n = self._ptr.nics[slot.index]
            n.ep = slot.ep._ptr
            n.cq = slot.cq._ptr
            n.max_in_flight = max(1, slot.info.tx_size)
            if registrations:
                n.desc = registrations[slot.index].mr.desc

    def use_staging(self, registration: memory.Registration, outbound: bool) -> None:
        """Have the C threads copy each page between the GPU and the registered pinned copy."""
        if registration.staging is None:
            return
        hooks = registration.staging_hooks(outbound)
        e = self._ptr
        e.stage_device_base, e.stage_host_base = hooks["device"], hooks["host"]
        e.stage_copy = ffi.cast("int (*)(uint64_t, uint64_t, size_t)", hooks["copy"])
        e.stage_set_context = ffi.cast("int (*)(void *)", hooks["set_context"])
        e.stage_context = ffi.cast("void *", hooks["context"])

    def set_peer(self, index: int, dest: int, remote: fi.RemoteRegion) -> None:
        n = self._ptr.nics[index]
        n.dest = dest
        n.remote_base = remote.base
        n.rkey = remote.key

    def nic(self, index: int):
        return self._ptr.nics[index]

    def run(self, call, *args, timeout: float) -> None:
        """Run a blocking engine call (the GIL is released inside it) in a thread; raise on its error.
        However the wait ends (Ctrl-C included, even during the thread's start), the engine is told to
        stop and its threads are joined before this returns, so it is never freed under them."""
        result = {}
        launched, finished = threading.Event(), threading.Event()

        def body():
            launched.set()
            try:
                result["rc"] = call(self._ptr, *args)
            finally:
                finished.set()

        self._ptr.stop = 0
        self._running = (launched, finished)
        try:
            threading.Thread(target=body, daemon=True).start()
            while not finished.wait(0.05):
                pass
        finally:
            self._join_worker()
        if result.get("rc", -1) != 0:
            raise fi.FabricError("fabriclab engine", result.get("rc", -lib.FI_EIO),
                                 message=f"engine: {ffi.string(self._ptr.error).decode(errors='replace')}")

    def _join_worker(self) -> None:
        running = getattr(self, "_running", None)
        if running is None:
            return
        launched, finished = running
        if not launched.wait(1.0):
            self._running = None  # the thread never came to life
            return
        while not finished.is_set():
            self._ptr.stop = 1
            try:
                finished.wait(0.1)
            except KeyboardInterrupt:
                pass  # already stopping
        self._running = None

    def counters(self) -> list[dict]:
        out = []
        for slot in self.nics.slots:
            n = self._ptr.nics[slot.index]
            out.append({"nic": slot.index, "domain": slot.domain_name, "emulated": slot.emulated, "group": n.group,
                        "bytes": int(n.bytes), "writes": int(n.writes), "completions": int(n.completions),
                        "eagain": int(n.eagain), "cq_polls": int(n.cq_polls), "errors": int(n.errors),
                        "arrivals": int(n.arrivals), "more_flushes": int(n.more_flushes),
                        "down": ffi.string(n.down_why).decode(errors="replace"),
                        "resent": int(n.resent), "unreported": int(n.unreported), "retried": int(n.retried),
                        "renewals": int(n.renewals)})
        return out

    def close(self) -> None:
        if self._ptr is not None and self._ptr != ffi.NULL:
            self._join_worker()
            lib.fl_engine_free(self._ptr)
        self._ptr = None


# -------------------------------------------------------------------------------------------- target


class MultiNicTarget(rdma_write.Target):
    """Chapter 6's target, grown a NIC set: it registers the region on every slot and counts arrivals
    with the native target loop, running in the background from PREPARE until DONE."""

    CONTROL_PAYLOAD = 256 << 10  # an address and a region key per NIC slot, up to FL_MAX_NICS of them

    def __init__(self, stack, provider, domains, slots=8, timeout=fi.DEFAULT_TIMEOUT):
        super().__init__(stack, slots, timeout)
        self.provider, self.domains = provider, domains
        self.nicset: NicSet | None = None
        self.engine: NativeEngine | None = None
        self.registrations: list[memory.Registration] = []
        self.counts: np.ndarray | None = None
        self.plan: PagePlan | None = None
        self._loop: threading.Thread | None = None
        self._loop_rc = 0

    def prepare_nics(self, request: dict) -> bytes:
        self.release()
        plan = PagePlan(request["page_size"], request["buffer_bytes"], 0)
        self.plan, self.seed = plan, request["seed"]
        self.buffer = memory.allocate(request["memory"], plan.buffer_bytes)
        self.buffer.write(np.zeros(plan.buffer_bytes, np.uint8))
        self.nicset = NicSet(self.provider, request["nics"], self.domains, request["memory"])
        self.registrations = self.nicset.register(self.buffer)
        self.engine = NativeEngine(self.nicset, self.registrations)
        self.engine.use_staging(self.registrations[0], outbound=False)
        for slot, address in zip(self.nicset.slots, request["addresses"]):
            dest = slot.av.insert(fi.Address.parse(address))
            self.engine.set_peer(slot.index, dest, fi.RemoteRegion(0, 0, 0))
        self.counts = np.zeros(plan.pages, dtype=np.uint32)
        # one bit per write of the run: a write sent again after a link failure is counted once
        self.seen = np.zeros((request.get("writes", 0) + 63) // 64, dtype=np.uint64)
        e = self.engine._ptr
        e.stop = 0
        e.page_counts = ffi.cast("uint32_t *", self.counts.ctypes.data)
        e.seen_writes = ffi.cast("uint64_t *", self.seen.ctypes.data) if self.seen.size else ffi.NULL
        e.seen_capacity = request.get("writes", 0)
        e.duplicates = 0
        e.pages = plan.pages
        e.target_page_size, e.target_buffer_bytes = plan.page_size, plan.buffer_bytes
        e.expected_arrivals = 2 ** 64 - 1
        e.arrivals = e.first_arrival_ns = e.last_arrival_ns = 0
        threads = max(1, min(request.get("target_threads", 1), len(self.nicset.slots)))
        self._loop = threading.Thread(target=self._run_loop, args=(threads,), daemon=True)
        self._loop.start()
        print(f"prepared {plan.buffer_bytes} bytes over {self.nicset.describe()}; {threads} target thread(s)",
              flush=True)
        regions = [{"address": a, "region": r.mr.remote().pack().hex()}
                   for a, r in zip(self.nicset.addresses(), self.registrations)]
        return json.dumps({"slots": regions, "path": self.registrations[0].path,
                           "emulated": self.nicset.emulated}).encode()

    def _run_loop(self, threads: int) -> None:
        self._loop_rc = lib.fl_target_run(self.engine._ptr, threads, ffi.NULL, 0, self.timeout)

    def finish_nics(self, expected: int, verify: bool) -> Report:
        e = self.engine._ptr
        e.expected_arrivals = expected
        self._loop.join(self.timeout + 2)
        if self._loop.is_alive():
            e.stop = 1
            self._loop.join(5)
        arrivals = int(e.arrivals)
        verified, mismatched = None, []
        if verify:
            got, want = self.buffer.read(), rdma_write.source_data(self.seed, self.buffer.length)
            if not np.array_equal(got, want):
                ps = self.plan.page_size
                mismatched = [p for p in range(self.plan.pages)
                              if not np.array_equal(got[p * ps:(p + 1) * ps], want[p * ps:(p + 1) * ps])][:20]
            verified = arrivals == expected and not mismatched
        why = ffi.string(e.error).decode(errors="replace") if self._loop_rc else ""
        return Report(arrivals, int(np.count_nonzero(self.counts)), int(self.counts.min()), int(self.counts.max()),
                      verified, mismatched, self.registrations[0].path, why,
                      (e.last_arrival_ns - e.first_arrival_ns) / 1e9, int(e.duplicates))

    def release(self) -> None:
        if self._loop is not None and self._loop.is_alive():
            self.engine._ptr.stop = 1
            self._loop.join(5)
        self._loop = None
        release_nics(self)
        super().release()

    def handle(self, m: bidirectional.Message) -> None:
        if m.kind == PREPARE_NICS:
            reply = self.prepare_nics(json.loads(bytes(m.payload)))
            self.mailbox.send(self.clients[m.client], REGIONS, m.client, m.seq, reply)
        elif m.kind == rdma_write.DONE and self.engine is not None:
            request = json.loads(bytes(m.payload))
            report = self.finish_nics(request["writes"], request["verify"])
            print(f"report: {report.arrivals} writes landed on {report.distinct_pages} pages, "
                  f"verified {report.verified}", flush=True)
            self.mailbox.send(self.clients[m.client], rdma_write.REPORT, m.client, m.seq,
                              json.dumps(asdict(report)).encode())
        else:
            super().handle(m)


# -------------------------------------------------------------------------------------------- writer


@dataclass
class EngineStats(WriteStats):
    nics: int = 1
    emulated_nics: int = 0
    threads: int = 1
    groups: int = 1
    per_nic: list = field(default_factory=list)


class MultiNicWriter(Writer):
    """Chapter 7's writer spread over NIC slots, its hot loop in C: one thread, one write per group
    per pass (chapter 9), an untimed write per NIC first when ``warmup`` (chapter 10)."""

    stage = "multi_nic"

    def __init__(self, stack: fi.EndpointStack, server_address, timeout: float = fi.DEFAULT_TIMEOUT, *,
                 nics: int | None = None, domains=None, groups: int = 1, warmup: bool = True,
                 in_flight: int | None = None, target_threads: int | None = None, cores: list[int] | None = None,
                 link_timeout: float | None = None):
        if nics is not None and nics <= 0:
            raise fi.UsageError(f"the number of NICs must be at least 1, got {nics}")
        if groups <= 0:
            raise fi.UsageError(f"the number of GPU groups must be at least 1, got {groups}")
        if in_flight is not None and in_flight <= 0:
            raise fi.UsageError(f"pages in flight must be at least 1, got {in_flight}")
        super().__init__(stack, server_address, timeout)
        self.nic_count, self.domains, self.groups, self.warmup = nics, domains, groups, warmup
        self.in_flight = in_flight
        self.target_threads = target_threads
        self.cores = cores
        # A link with writes in flight and no completion for this long is declared down and its writes
        # go over the group's other NICs; well below the timeout, after which the whole run fails.
        self.link_timeout = timeout / 3 if link_timeout is None else link_timeout
        if self.link_timeout < 0:
            raise fi.UsageError(f"link timeout must be 0 (never fail over) or positive, got {link_timeout}")
        self.nicset: NicSet | None = None
        self.engine: NativeEngine | None = None
        self.registrations: list[memory.Registration] = []

    @classmethod
    def options_from_args(cls, args) -> dict:
        """Constructor options from this stage's command-line switches (see add_engine_options)."""
        return {"groups": args.groups, "warmup": args.warmup, "link_timeout": args.link_timeout}

    # -- the chapter switches: later stages extend this
    def switches(self) -> dict:
        return {"threads": 1, "groups": self.groups, "warmup": int(bool(self.warmup)), "pin": 0, "shard": 0,
                "pad": 0, "batch": 1, "lazy": 0, "fi_more": 0}

    @property
    def threads(self) -> int:
        return self.switches()["threads"]

    def prepare(self, plan: PagePlan, memory_kind: str = "host", seed: int = 1) -> dict:
        self.release()
        self.nicset = NicSet(self.stack.info.provider, self.nic_count, self.domains, memory_kind)
        groups = self.switches()["groups"]
        if groups > len(self.nicset.slots):
            raise fi.UsageError(f"{groups} GPU groups need at least as many NICs, got {len(self.nicset.slots)}")
        request = {"page_size": plan.page_size, "buffer_bytes": plan.buffer_bytes, "memory": memory_kind,
                   "seed": seed, "nics": len(self.nicset.slots), "addresses": self.nicset.addresses(),
                   "writes": plan.writes,
                   "target_threads": self.target_threads or self.threads}
        reply = json.loads(self._call(PREPARE_NICS, request, REGIONS))
        self.plan, self.writes_issued = plan, 0
        self.source = memory.allocate(memory_kind, plan.buffer_bytes)
        self.source.write(rdma_write.source_data(seed, plan.buffer_bytes))
        self.registrations = self.nicset.register(self.source)
        self.engine = NativeEngine(self.nicset, self.registrations)
        self.engine.use_staging(self.registrations[0], outbound=True)
        for slot, remote in zip(self.nicset.slots, reply["slots"]):
            region = fi.RemoteRegion.unpack(bytes.fromhex(remote["region"]))
            if region.length < plan.buffer_bytes:
                raise fi.UsageError(f"the target's region has {region.length} bytes, the plan needs {plan.buffer_bytes}")
            dest = slot.av.insert(fi.Address.parse(remote["address"]))
            self.engine.set_peer(slot.index, dest, region)
            self.engine.nic(slot.index).group = slot.index % groups
            if self.in_flight:
                n = self.engine.nic(slot.index)
                n.max_in_flight = min(n.max_in_flight, self.in_flight)
        return {"local": self.registrations[0].path, "local_why": self.registrations[0].why,
                "remote_path": reply["path"], "remote_why": "", "emulated": self.nicset.emulated}

    def config(self, writes: int) -> "ffi.CData":
        cfg = ffi.new("fl_config *")
        for key, value in self.switches().items():
            setattr(cfg, key, value)
        if cfg.threads > lib.FL_MAX_THREADS:
            raise fi.UsageError(f"at most {lib.FL_MAX_THREADS} threads")
        cores = self.worker_cores(cfg.threads) if cfg.pin else []
        for i, core in enumerate(cores):
            cfg.cores[i] = core
        cfg.total_writes = writes
        cfg.page_size = self.plan.page_size
        cfg.buffer_bytes = self.plan.buffer_bytes
        staging = self.registrations[0].staging
        cfg.local_base = (staging or self.source).pointer  # what the NIC reads: the pinned copy when staged
        cfg.timeout_s = self.timeout
        cfg.link_timeout_s = self.link_timeout
        return cfg

    def worker_cores(self, threads: int) -> list[int]:
        return worker_cores(threads, self.stack.info.provider, self.cores)

    def transfer(self, warmup: int = 0) -> EngineStats:
        """Run the whole plan in the engine. ``warmup`` (writes) is ignored: chapter 10's warm-up is one
        write per NIC, switched by ``self.warmup``."""
        self._check_ready()
        cfg = self.config(self.plan.writes)
        cpu0 = time.process_time()
        self.engine.run(lib.fl_write_run, cfg, timeout=self.timeout)
        cpu = time.process_time() - cpu0
        e = self.engine._ptr
        self.writes_issued = self.plan.writes  # warm-up writes are numbered past these; the target skips them
        return EngineStats(int(e.timed_writes), int(e.timed_bytes), float(e.elapsed_s), cpu,
                           sum(int(self.engine.nic(i).eagain) for i in range(len(self.nicset.slots))),
                           nics=len(self.nicset.slots), emulated_nics=self.nicset.emulated, threads=cfg.threads,
                           groups=cfg.groups, per_nic=self.engine.counters())

    def release(self) -> None:
        release_nics(self)
        super().release()


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


# ----------------------------------------------------------------------------------------------- CLI


def serve(args, stop: cli.StopSignal) -> int:
    return rdma_write.serve_target(lambda stack: MultiNicTarget(stack, stack.info.provider, args.domain,
                                                                timeout=args.timeout), args, stop)


def writer_from_args(cls, stack, args) -> MultiNicWriter:
    return cls(stack, args.address, args.timeout, nics=args.nics, domains=args.domain, **cls.options_from_args(args))


def add_engine_options(parser) -> None:
    parser.add_argument("--nics", type=int, default=None, help="NIC slots (default: every domain; more = emulated)")
    parser.add_argument("--groups", type=int, default=1, help="GPU groups the NICs are split into (default 1)")
    parser.add_argument("--no-warmup", dest="warmup", action="store_false", help="chapter 9: no warm-up writes")
    parser.add_argument("--link-timeout", type=cli.seconds_or_off, default=None,
                        help="seconds without a completion before a NIC's link is declared down and its writes "
                             "re-sent over the others (default: a third of --timeout; 0: never)")


def connect_with(cls, args) -> int:
    paths, stats, report, nics = rdma_write.run_writer(lambda stack: writer_from_args(cls, stack, args), args)
    print(f"{nics}\n{stats.writes} writes, {stats.bytes} bytes in {stats.elapsed_s:.3f} s = {stats.gbps:.2f} Gbps, "
          f"{stats.mops:.3f} Mops/s; landed {report.arrivals}, verified {report.verified}")
    return 0 if report.verified else 1


def build_parser(add_options=add_engine_options):
    parser, serve_p, connect_p = cli.stage_parser(__doc__.splitlines()[1])
    serve_p.add_argument("--memory", choices=memory.MEMORY_KINDS, default="host",
                         help="ask for FI_HMEM when cuda memory will be written here")
    rdma_write.add_transfer_options(connect_p, total_default="256M")
    add_options(connect_p)
    return parser


def main(argv=None, cls=MultiNicWriter, add_options=add_engine_options) -> int:
    return cli.stage_main(build_parser(add_options), serve, lambda args: connect_with(cls, args), argv)


if __name__ == "__main__":
    cli.run(main)
