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
from ._native import MAX_NICS, WORKER_EXIT_TIMEOUT, NativeEngine, NativeTarget, RunConfig, write_run
from .nics import NicGroups, NicSet, article_cores, discover_topology, group_nics, release_nics, worker_cores
from .rdma_write import PagePlan, Report, Writer, WriteStats

PREPARE_NICS, REGIONS = 10, 11


# -------------------------------------------------------------------------------------------- target

#: The writer's word during a run, answered by nothing: it is writing (as the run starts, then every
#: HEARTBEAT_S), and the run is over (every write completed on its side), with what the target must see.
RUNNING, RUN_OVER = 13, 14
HEARTBEAT_S = 0.5  # well below any target's timeout: a writer silent for that long is taken for dead
# Target loops that did not stop within WORKER_EXIT_TIMEOUT when told (stuck inside a provider call; why:
# native/service.h, at fl_service_stop), with everything they may still touch: kept for the life of the process,
# never freed under them.
_STUCK_LOOPS: list = []


class MultiNicTarget(rdma_write.Target):
    """Chapter 6's target, grown a NIC set: it registers the region on every slot, and the native target
    loop (native/course.c) runs in the background from PREPARE until the run is complete: the article's
    receiver, ONE thread polling every NIC's completion queue, backing off when idle.

    What proves a run complete. As in the article, the writer marks only each NIC's last write with
    immediate data; "every NIC's last write landed" proves the run complete only where a NIC's writes land
    in order (fi_getinfo's msg_order with FI_ORDER_WAW or FI_ORDER_RMA_WAW: tcp here; not EFA's RDM, shm
    or sim). So the writer also asks for FI_DELIVERY_COMPLETE on every write (a completion then means the
    bytes are in the target's memory; no provider here promises that by default: fi_getinfo's op_flags
    are empty) and says RUN_OVER only after all its completions; the run ends when that word and every
    mark have come. The bytes are then checked once, byte for byte (where the provider moves them).
    A writer that asks for ``count_writes`` (the checking mode) sends every write's number: each is
    counted once and per page. A writer silent for ``timeout`` seconds mid-run ends the run with an error."""

    CONTROL_PAYLOAD = 256 << 10  # an address and a region key per NIC slot, up to FL_MAX_NICS of them

    def __init__(self, stack, provider, domains, slots=8, timeout=fi.DEFAULT_TIMEOUT):
        super().__init__(stack, slots, timeout)
        self.provider, self.domains = provider, domains
        self.nicset: NicSet | None = None
        self.engine: NativeEngine | None = None
        self.loop: NativeTarget | None = None
        self.registrations: list[memory.Registration] = []
        self.plan: PagePlan | None = None
        self.writer: int | None = None  # the client whose run this is
        self._loop: threading.Thread | None = None
        self._loop_rc = 0

    def prepare_nics(self, request: dict, client: int) -> bytes:
        self.release()
        plan = PagePlan(request["page_size"], request["buffer_bytes"], 0)
        self.plan, self.seed, self.writer = plan, request["seed"], client
        self.buffer = memory.allocate(request["memory"], plan.buffer_bytes)
        self.buffer.write(np.zeros(plan.buffer_bytes, np.uint8))
        self.nicset = NicSet(self.provider, request["nics"], self.domains, request["memory"])
        self.registrations = self.nicset.register(self.buffer)
        self.engine = NativeEngine(self.nicset, self.registrations)
        self.engine.use_staging(self.registrations[0], outbound=False)
        for slot, address in zip(self.nicset.slots, request["addresses"]):
            dest = slot.av.insert(fi.Address.parse(address))
            self.engine.set_peer(slot.index, dest, fi.RemoteRegion(0, 0, 0))
        counting = bool(request.get("count_writes", True))  # a writer that does not say numbers every write
        self.loop = NativeTarget(self.engine, counting, plan.pages, plan.page_size, plan.buffer_bytes,
                                 request.get("writes", 0))
        allowed = os.sched_getaffinity(0)
        core = next((c for c in request.get("target_cores", ()) if isinstance(c, int) and c in allowed), -1)
        info = self.nicset.slots[0].info
        self._loop_rc = 0
        self._loop = threading.Thread(target=self._run_loop, args=(core,), daemon=True)
        self._loop.start()
        proof = "counting every write" if counting else "waiting for each NIC's last write: " + (
            "writes land in order per NIC here (fi_getinfo's msg_order), so that alone would prove the run"
            if info.orders_writes else "writes may land out of order here (fi_getinfo's msg_order), so the run "
            "also needs the writer's word, said after its delivery-complete completions")
        print(f"prepared {plan.buffer_bytes} bytes over {self.nicset.describe()}; 1 target thread"
              + (f" pinned to core {core}" if core >= 0 else "") + f"; {proof}", flush=True)
        regions = [{"address": a, "region": r.mr.remote().pack().hex()}
                   for a, r in zip(self.nicset.addresses(), self.registrations)]
        return json.dumps({"slots": regions, "path": self.registrations[0].path,
                           "emulated": self.nicset.emulated}).encode()

    @property
    def prepared(self) -> NativeTarget:
        """The run prepared here (a writer's PREPARE_NICS); a UsageError naming the fix when there is none."""
        if self.loop is None:
            raise fi.UsageError("no run is prepared here: the writer prepares one (prepare()) before it writes")
        return self.loop

    def _run_loop(self, core: int) -> None:
        self._loop_rc = self.prepared.run(core, self.timeout)
        if self._loop_rc:  # nobody may ask for this run's report (its writer may be gone): say it here
            print(f"target: the run failed: {self.engine.error}", flush=True)

    def expect(self, request: dict) -> tuple[int, int]:
        """The run's writes and what proves it complete, from the writer's word (untrusted: checked): every
        write in the checking mode, else the marked last writes. The target's silence clock restarts."""
        loop = self.prepared
        capacity = loop.capacity
        for key in ("writes", "marks") if loop.marks_only else ("writes",):
            value = request.get(key)
            if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= capacity:
                raise fi.UsageError(f"the run's {key} must be a whole number from 0 to the {capacity} writes "
                                    f"prepared, got {value!r}")
        writes = request["writes"]
        expected = request["marks"] if loop.marks_only else writes
        loop.writer_heard()
        loop.expect(expected)
        return writes, expected

    def finish_nics(self, request: dict) -> Report:
        writes, expected = self.expect(request)
        self._loop.join(self.timeout + 2)
        if self._loop.is_alive():
            self.prepared.stop()
            self._loop.join(5)
        arrivals = self.prepared.arrivals
        complete = arrivals >= expected and not self._loop_rc
        verified, mismatched = None, []
        if request.get("verify"):
            want = rdma_write.source_data(self.seed, self.buffer.length)
            # modeled NICs outside payload mode move no bytes: then what is checked is that every write landed
            got = self.buffer.read() if self.stack.info.moves_payload else want
            if not np.array_equal(got, want):
                ps = self.plan.page_size
                mismatched = [p for p in range(self.plan.pages)
                              if not np.array_equal(got[p * ps:(p + 1) * ps], want[p * ps:(p + 1) * ps])][:20]
            verified = complete and not mismatched
        why = self.engine.error if self._loop_rc else ""
        landed_s, duplicates = self.prepared.landed_s, self.prepared.duplicates
        counts = self.prepared.counts
        if counts.size:
            return Report(arrivals, int(np.count_nonzero(counts)), int(counts.min()), int(counts.max()), verified,
                          mismatched, self.registrations[0].path, why, landed_s, duplicates)
        return Report(writes if complete else 0, 0, 0, 0, verified, mismatched, self.registrations[0].path, why,
                      landed_s, duplicates, counted=False, marks=arrivals)

    def release(self) -> None:
        if self._loop is not None and self._loop.is_alive():
            self.loop.stop()
            self._loop.join(WORKER_EXIT_TIMEOUT + 1)  # the loop gives up on a stuck thread by WORKER_EXIT_TIMEOUT
        if self._loop is not None and (self._loop.is_alive() or self.loop.stranded):
            print("target: the last run's thread is stuck in a provider call and was left behind: its NICs and "
                  "memory stay allocated", flush=True)
            _STUCK_LOOPS.append((self._loop, self.engine, self.loop, self.registrations, self.nicset, self.buffer))
            self.nicset.keep_open()  # not even closed at exit: the stuck thread may still read them
            self.engine, self.registrations, self.nicset, self.buffer = None, [], None, None
        self._loop, self.loop = None, None
        release_nics(self)
        super().release()

    def handle(self, m: bidirectional.Message) -> None:
        if m.kind in (RUNNING, RUN_OVER, rdma_write.DONE) and self.engine is not None and m.client != self.writer:
            raise fi.UsageError(f"writer {m.client} has no run here: the run prepared is writer {self.writer}'s")
        if m.kind == PREPARE_NICS:
            reply = self.prepare_nics(_request(m), m.client)
            self.mailbox.send(self.clients[m.client], REGIONS, m.client, m.seq, reply)
        elif m.kind == RUNNING and self.engine is not None:
            self.prepared.writer_heard()
        elif m.kind == RUN_OVER and self.engine is not None:
            self.expect(_request(m))
        elif m.kind == rdma_write.DONE and self.engine is not None:
            report = self.finish_nics(_request(m))
            print(f"report: {report.arrivals} writes landed" + (f" on {report.distinct_pages} pages" if report.counted
                  else f" ({report.marks} marked last writes seen)") + f", verified {report.verified}", flush=True)
            self.mailbox.send(self.clients[m.client], rdma_write.REPORT, m.client, m.seq,
                              json.dumps(asdict(report)).encode())
        else:
            super().handle(m)


def _request(m: bidirectional.Message) -> dict:
    """A writer's JSON request (untrusted: anything else is refused, the target goes on serving)."""
    try:
        request = json.loads(bytes(m.payload))
    except ValueError as exc:
        raise fi.UsageError(f"a request that is not JSON: {exc}") from None
    if not isinstance(request, dict):
        raise fi.UsageError(f"a request must be a JSON object, got {type(request).__name__}")
    return request


# -------------------------------------------------------------------------------------------- writer


@dataclass
class EngineStats(WriteStats):
    nics: int = 1
    emulated_nics: int = 0
    threads: int = 1
    groups: int = 1
    per_nic: list = field(default_factory=list)
    model: dict = field(default_factory=dict)  # the modeled host's counts (RunFigures.model), else empty


class MultiNicWriter(Writer):
    """Chapter 7's writer spread over NIC slots, its hot loop in C: one thread, one write per group
    per pass (chapter 9), an untimed write per NIC first when ``warmup`` (chapter 10).

    As in the article, only each NIC's last write of a run carries immediate data, and the target waits
    for those (MultiNicTarget says why that alone would not prove the run complete, and what does: every
    write asks for FI_DELIVERY_COMPLETE, and the writer says RUN_OVER after its last completion). While it
    writes it tells the target so every HEARTBEAT_S, so that a writer that dies is told from a long run.
    ``count_writes``: the checking mode, every write carrying its number for the target to count."""

    stage = "multi_nic"

    def __init__(self, stack: fi.EndpointStack, server_address, timeout: float = fi.DEFAULT_TIMEOUT, *,
                 nics: int | None = None, domains=None, groups: int = 1, warmup: bool = True,
                 in_flight: int | None = None, cores: list[int] | None = None, link_timeout: float | None = None,
                 count_writes: bool = False):
        if nics is not None and nics <= 0:
            raise fi.UsageError(f"the number of NICs must be at least 1, got {nics}")
        if groups <= 0:
            raise fi.UsageError(f"the number of GPU groups must be at least 1, got {groups}")
        if in_flight is not None and in_flight <= 0:
            raise fi.UsageError(f"pages in flight must be at least 1, got {in_flight}")
        super().__init__(stack, server_address, timeout)
        self.nic_count, self.domains, self.groups, self.warmup = nics, domains, groups, warmup
        self.in_flight = in_flight
        self.cores = cores
        self.count_writes = count_writes
        self.sizing = f"1 writer thread for {groups} GPU group(s) (chapters 9-10) + 1 target thread"
        self.marks = 0  # writes of the last run that carried immediate data (each NIC's last, or all)
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
                "groups": args.groups, "warmup": args.warmup, "link_timeout": args.link_timeout,
                "count_writes": args.count_writes}

    # -- the chapter switches: later stages extend this
    def switches(self) -> dict:
        return {"threads": 1, "groups": self.groups, "warmup": int(bool(self.warmup)), "pin": 0, "shard": 0,
                "pad": 0, "batch": 1, "lazy": 0, "fi_more": 0, "mark_last": int(not self.count_writes)}

    @property
    def threads(self) -> int:
        return self.switches()["threads"]

    def prepare(self, plan: PagePlan, memory_kind: str = "host", seed: int = 1) -> dict:
        self.release()
        groups = self.switches()["groups"]
        # Without --nics every domain, and a slot per GPU group at least: each group drives NICs of its own, so
        # on one domain (shm, tcp) the extra slots are emulated, as Engine() emulates a slot per thread there.
        self.nicset = NicSet(self.stack.info.provider, self.nic_count, self.domains, memory_kind, at_least=groups)
        if groups > len(self.nicset.slots):
            raise fi.UsageError(f"{groups} GPU groups need at least as many NICs, got {len(self.nicset.slots)}: "
                                f"give --nics {groups} or more, or leave --nics out (a slot per group, emulated "
                                "beyond this machine's NICs)")
        # each GPU with its own NICs (fabriclab.topology), so that a thread pinned beside a GPU drives that GPU's
        self.nic_groups = group_nics([s.domain_name for s in self.nicset.slots], groups,
                                     discover_topology(self.nicset.provider))
        request = {"page_size": plan.page_size, "buffer_bytes": plan.buffer_bytes, "memory": memory_kind,
                   "seed": seed, "nics": len(self.nicset.slots), "addresses": self.nicset.addresses(),
                   "writes": plan.writes, "count_writes": self.count_writes, "target_cores": self.target_cores(1)}
        reply = json.loads(self._call(PREPARE_NICS, request, REGIONS))
        self.plan, self.writes_issued, self.marks = plan, 0, 0
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

    def config(self, writes: int) -> RunConfig:
        switches = self.switches()
        staging = self.registrations[0].staging
        # what the NIC reads: the pinned copy when staged
        sizes = {"total_writes": writes, "page_size": self.plan.page_size, "buffer_bytes": self.plan.buffer_bytes,
                 "local_base": (staging or self.source).pointer, "timeout_s": self.timeout,
                 "link_timeout_s": self.link_timeout}
        threads = switches["threads"]
        cores = self.worker_cores(threads) if switches["pin"] else []
        return RunConfig({**switches, **sizes}, cores, article_cores(threads) if switches["pin"] else [])

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
        if self.writes_issued:
            raise fi.UsageError("this plan was written already, and the target's run ended with it: call prepare() "
                                "again before the next transfer")
        cfg = self.config(self.plan.writes)
        cpu0 = time.process_time()
        heard = [time.monotonic()]
        self._tell(RUNNING)

        def heartbeat():
            if time.monotonic() - heard[0] >= HEARTBEAT_S:
                heard[0] = time.monotonic()
                self._tell(RUNNING)

        run = write_run(self.engine, cfg, tick=heartbeat)
        cpu = time.process_time() - cpu0
        self.writes_issued = self.plan.writes  # warm-up writes are numbered past these; the target skips them
        self.marks = run.marked
        self._tell(RUN_OVER, self.run_summary())  # every write has completed, each delivered (FI_DELIVERY_COMPLETE)
        return EngineStats(run.writes, run.bytes, run.elapsed_s, cpu,
                           sum(int(self.engine.nic(i).eagain) for i in range(len(self.nicset.slots))),
                           nics=len(self.nicset.slots), emulated_nics=self.nicset.emulated, threads=cfg.threads,
                           groups=cfg.groups, per_nic=self.engine.counters(), model=run.model)

    def run_summary(self) -> dict:
        """What the target must see land: the run's writes, and the marked last writes among them."""
        return {"writes": self.writes_issued, "marks": self.marks}

    def _tell(self, kind: int, what: dict | None = None) -> None:
        """Word to the target that wants no answer. A heartbeat is skipped while every send slot is busy;
        a control channel that fails is left to the run's own completions (or finish) to report."""
        payload = json.dumps(what).encode() if what is not None else b""
        try:
            if kind == RUNNING:
                self.mailbox.try_send(self.server_addr, kind, self.client_id, next(self._seq), payload)
            else:
                self.mailbox.send(self.server_addr, kind, self.client_id, next(self._seq), payload)
        except fi.FabricError:
            pass

    def release(self) -> None:
        release_nics(self)
        super().release()


# ----------------------------------------------------------------------------------------------- CLI


def serve(args, stop: cli.StopSignal) -> int:
    return rdma_write.serve_target(lambda stack: MultiNicTarget(stack, stack.info.provider, args.domain,
                                                                timeout=args.timeout), args, stop)


def writer_from_args(cls, stack, args) -> MultiNicWriter:
    writer = cls(stack, args.address, args.timeout, **cls.options_from_args(args))
    print(f"threads: {writer.sizing}", flush=True)
    return writer


def add_engine_options(parser) -> None:
    """Chapter 7's options plus the NIC set's, the warm-up and failover."""
    opqueue.add_queue_options(parser)
    options = parser.add_argument_group("NICs and warm-up (chapters 9-10 on)")
    options.add_argument("--nics", default=None,
                         help="NIC slots (default: every domain, and at least one per GPU group; more = emulated)",
                         type=cli.count("NIC slots", MAX_NICS, "slots beyond this machine's NICs are emulated: "
                                        "endpoints sharing a domain"))
    options.add_argument("--groups", type=cli.count("GPU groups", MAX_NICS, "each drives NICs of its own"),
                         default=1,
                         help="GPU groups the NICs are split into, all walked by one thread (default %(default)s; "
                              "from chapter 11 on --threads sets them, a thread each)")
    options.add_argument("--count-writes", action="store_true",
                         help="the checking mode: every write carries its number and the target counts each "
                              "(default: as the article, only each NIC's last write is marked)")
    # One write per NIC is what the C engine's warm-up does (fl_run_config.warmup is a switch), hence no count.
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
