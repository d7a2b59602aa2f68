"""Chapters 9–10 — all the NICs, from one thread; then a warm-up before the clock starts.

Chapter 7 drove one NIC. A p5 has 32, four per GPU. Here each NIC slot gets its own endpoint,
completion queue and address vector (a ``fabriclab.nics.NicSet``, which the library uses too); the
source buffer is registered once per domain; the target answers with one (address, region key) pair
per slot. The hot loop moves into C (``native/course.c``, over the engine core in ``native/core.c``):
Python cannot post millions of writes per second. This stage's loop is the article's chapter 9: one
thread visits every GPU group in turn, polls that group's NICs, then posts *one* write. Chapter 10 adds
one untimed write per NIC before timing starts, so first-contact costs stay out of the figure.

Where the machine has fewer NICs (domains) than asked for, several endpoints share a domain: those are
"emulated NICs", always reported as such.

    python -m fabriclab.multi_nic serve
    python -m fabriclab.multi_nic connect ADDR --nics 4 --groups 2 --page-size 64K --total 1G
"""
from __future__ import annotations

import argparse
import json
import os
import threading
import time
from dataclasses import asdict, dataclass, field

import numpy as np

from . import bidirectional, cli, fi, memory, opqueue, rdma_write
from ._fabric import ffi, lib
from ._native import NativeEngine
from .nics import NicGroups, NicSet, discover_topology, group_nics, release_nics, worker_cores
from .rdma_write import PagePlan, Report, Writer, WriteStats

PREPARE_NICS, REGIONS = 10, 11


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
        allowed = os.sched_getaffinity(0)
        cores = [c for c in request.get("target_cores", ()) if c in allowed][:threads]
        cores = cores if len(cores) == threads else []
        self._loop = threading.Thread(target=self._run_loop, args=(threads, cores), daemon=True)
        self._loop.start()
        print(f"prepared {plan.buffer_bytes} bytes over {self.nicset.describe()}; {threads} target thread(s)"
              + (f" pinned to cores {','.join(map(str, cores))}" if cores else ""), flush=True)
        regions = [{"address": a, "region": r.mr.remote().pack().hex()}
                   for a, r in zip(self.nicset.addresses(), self.registrations)]
        return json.dumps({"slots": regions, "path": self.registrations[0].path,
                           "emulated": self.nicset.emulated}).encode()

    def _run_loop(self, threads: int, cores: list[int]) -> None:
        self._loop_rc = lib.fl_target_run(self.engine._ptr, threads, ffi.new("int[]", cores) if cores else ffi.NULL,
                                          int(bool(cores)), self.timeout)

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
            want = rdma_write.source_data(self.seed, self.buffer.length)
            # modeled NICs outside payload mode move no bytes: then each write's immediate data is what is checked
            got = self.buffer.read() if self.stack.info.moves_payload else want
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
        self.nic_groups: NicGroups | None = None

    @classmethod
    def options_from_args(cls, args) -> dict:
        """Constructor options from the command line (see add_engine_options) or a bench config: chapter 7's
        pages in flight (here per NIC), the domains, and this stage's own."""
        return {**opqueue.QueuedWriter.options_from_args(args), "domains": args.domain, "nics": args.nics,
                "groups": args.groups, "warmup": args.warmup, "link_timeout": args.link_timeout}

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
        # each GPU with its own NICs (fabriclab.topology), so that a thread pinned beside a GPU drives that GPU's
        self.nic_groups = group_nics([s.domain_name for s in self.nicset.slots], groups,
                                     discover_topology(self.nicset.provider))
        request = {"page_size": plan.page_size, "buffer_bytes": plan.buffer_bytes, "memory": memory_kind,
                   "seed": seed, "nics": len(self.nicset.slots), "addresses": self.nicset.addresses(),
                   "writes": plan.writes,
                   "target_threads": self.target_threads or self.threads,
                   "target_cores": self.target_cores(self.target_threads or self.threads)}
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
            self.engine.nic(slot.index).group = self.nic_groups.of_slot[slot.index]
        if self.in_flight:
            self.engine.limit_in_flight(self.in_flight)
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
        return worker_cores(threads, self.stack.info.provider, self.cores, self.nic_groups)

    def target_cores(self, threads: int) -> list[int]:
        """Where a pinned writer asks the target to pin its threads: cores the writer's threads leave free,
        or none (the target runs unpinned). On one host an unpinned target's busy-polling threads otherwise
        land beside pinned writers at the scheduler's whim, halving some of them in some runs only; a target
        on another host keeps the cores that exist there, or runs unpinned."""
        if not self.switches()["pin"]:
            return []
        taken = set(self.worker_cores(self.threads))
        free = [c for c in sorted(os.sched_getaffinity(0)) if c not in taken]
        return free[:threads] if len(free) >= threads else []

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


# ----------------------------------------------------------------------------------------------- CLI


def serve(args, stop: cli.StopSignal) -> int:
    return rdma_write.serve_target(lambda stack: MultiNicTarget(stack, stack.info.provider, args.domain,
                                                                timeout=args.timeout), args, stop)


def writer_from_args(cls, stack, args) -> MultiNicWriter:
    return cls(stack, args.address, args.timeout, **cls.options_from_args(args))


def add_engine_options(parser) -> None:
    """Chapter 7's options plus the NIC set's, the warm-up and failover."""
    opqueue.add_queue_options(parser)
    options = parser.add_argument_group("NICs and warm-up (chapters 9-10 on)")
    options.add_argument("--nics", default=None, help="NIC slots (default: every domain; more = emulated)",
                         type=cli.count("NIC slots", lib.FL_MAX_NICS, "slots beyond this machine's NICs are emulated: "
                                        "endpoints sharing a domain"))
    options.add_argument("--groups", type=cli.count("GPU groups", lib.FL_MAX_NICS, "each drives NICs of its own"),
                         default=1,
                         help="GPU groups the NICs are split into, all walked by one thread (default %(default)s; "
                              "from chapter 11 on --threads sets them, a thread each)")
    # One write per NIC is what the C engine's warm-up does (fl_config.warmup is a switch), hence no count.
    options.add_argument("--warmup", action=argparse.BooleanOptionalAction, default=True,
                         help="chapter 10, on by default: one untimed write through each NIC before the clock "
                              "starts (--no-warmup: chapter 9)")
    options.add_argument("--link-timeout", type=cli.seconds_or_off, default=None,
                         help="seconds without a completion before a NIC's link is declared down and its writes "
                              "re-sent over the group's other NICs (default: a third of --timeout; 0: never)")


def connect_with(cls, args) -> int:
    paths, stats, report, nics = rdma_write.run_writer(lambda stack: writer_from_args(cls, stack, args), args)
    print(f"{nics}\n{stats.writes} writes, {stats.bytes} bytes in {stats.elapsed_s:.3f} s = {stats.gbps:.2f} Gbps, "
          f"{stats.mops:.3f} Mops/s; landed {report.arrivals}, verified {report.verified}")
    return 0 if report.verified else 1


def build_parser(add_options=add_engine_options, module_doc=__doc__):
    return rdma_write.writer_parser(module_doc, add_options)


def main(argv=None, cls=MultiNicWriter, parser=None) -> int:
    """This stage's command line; the later stages' too, with their writer class and parser."""
    return cli.stage_main(parser or build_parser(), serve, lambda args: connect_with(cls, args), argv)


if __name__ == "__main__":
    cli.run(main)
