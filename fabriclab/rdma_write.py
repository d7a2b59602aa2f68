"""Chapter 6 — one-sided RDMA WRITE, with immediate data.

Send/recv needs the receiver to post a buffer for every message. With RDMA WRITE the target registers a
region once and hands the writer three numbers (where offset 0 is, how long, the key); from then on the
writer places bytes straight into the target's memory and the target's CPU does nothing per byte. To let
the target know a write has landed, each write carries immediate data (here: the page index), which
arrives as a completion on the target's queue (FI_REMOTE_CQ_DATA).

The control messages (which region, which pages, "done", the target's report) still travel over
chapter 5's mailbox. Here the writer keeps exactly one write in flight; chapter 7 queues many.

    python -m fabriclab.rdma_write serve                     # the target
    python -m fabriclab.rdma_write connect ADDR --page-size 64K --total 16M
"""
from __future__ import annotations

import itertools
import json
import math
import time
from dataclasses import asdict, dataclass, field

import numpy as np

from . import bidirectional, cli, fi, measure, memory
from .bidirectional import Client, Mailbox
from .unidirectional import EndpointUser

PREPARE, REGION, DONE, REPORT = range(6, 10)
REFUSED = 12  # the target could not do what was asked; the payload says why
DEFAULT_BUFFER_LIMIT = 256 << 20


def source_data(seed: int, length: int) -> np.ndarray:
    """The bytes page i of a transfer must hold: random, reproducible from the seed on both sides."""
    return np.frombuffer(np.random.default_rng(seed).bytes(length), dtype=np.uint8)


@dataclass(frozen=True)
class PagePlan:
    """Which bytes move: ``writes`` writes of ``page_size`` cycling over a ``buffer_bytes`` region
    (the last page is shorter when the region is not a whole number of pages)."""
    page_size: int
    buffer_bytes: int
    writes: int

    @classmethod
    def for_total(cls, page_size: int, total_bytes: int, buffer_bytes: int | None = None) -> "PagePlan":
        page_size = int(page_size)
        total_bytes = int(total_bytes)
        if page_size <= 0:
            raise fi.UsageError(f"page size must be positive, got {page_size}")
        if total_bytes <= 0:
            raise fi.UsageError(f"total bytes must be positive, got {total_bytes}")
        if buffer_bytes is None:
            buffer_bytes = total_bytes if total_bytes <= DEFAULT_BUFFER_LIMIT else \
                max(page_size, DEFAULT_BUFFER_LIMIT // page_size * page_size)
        buffer_bytes = int(buffer_bytes)
        if page_size > buffer_bytes:
            raise fi.UsageError(f"page size {page_size} is larger than the {buffer_bytes}-byte buffer")
        plan = cls(page_size, buffer_bytes, 0)
        whole, rest = divmod(total_bytes, buffer_bytes)
        writes = whole * plan.pages + (math.ceil(rest / page_size) if rest else 0)
        return cls(page_size, buffer_bytes, writes)

    @property
    def pages(self) -> int:
        return math.ceil(self.buffer_bytes / self.page_size)

    def page_of(self, write: int) -> int:
        return write % self.pages

    def page_length(self, page: int) -> int:
        return min(self.page_size, self.buffer_bytes - page * self.page_size)

    @property
    def total_bytes(self) -> int:
        full, rest = divmod(self.writes, self.pages)
        return full * self.buffer_bytes + sum(self.page_length(p) for p in range(rest))


@dataclass
class Report:
    """What the target saw: remote-write completions, how often each page landed, byte-exact check.

    ``counted``: each write carried its number and was counted one by one (chapters 6-7, and the engine
    stages' checking mode); then ``arrivals`` are the distinct writes counted and the per-page figures
    are real. Otherwise (the engine stages as the article's receiver) only each NIC's last write was
    marked: ``marks`` of them landed, ``arrivals`` is the run's writes once the run was proved complete
    (multi_nic says how) and 0 if it was not, and the per-page figures are 0."""
    arrivals: int
    distinct_pages: int
    min_per_page: int
    max_per_page: int
    verified: bool | None
    mismatched_pages: list = field(default_factory=list)
    path: str = "host"
    why: str = ""
    landed_s: float = 0.0  # from the first write landing (or the run's start, marks only) to the last
    duplicates: int = 0  # writes that landed twice (sent again after a link failure), counted once above
    counted: bool = True
    marks: int = 0
    target_threads: int = 1  # threads the target polled with


class TargetMailbox(Mailbox):
    """The target's mailbox, which also counts the peer's writes by their immediate data."""

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self.counts: np.ndarray | None = None
        self.registration: memory.Registration | None = None
        self.plan: PagePlan | None = None
        self.arrivals = 0
        self.first_landed = self.last_landed = 0.0
        self.handlers[None] = self._landed

    def _landed(self, c: fi.Completion) -> None:
        if not c.has_data or self.counts is None:
            raise fi.UsageError(f"unexpected remote completion (flags {c.flags:#x}) before any region was prepared")
        page = c.data
        self.counts[page] += 1
        self.arrivals += 1
        self.last_landed = time.perf_counter()
        if self.arrivals == 1:
            self.first_landed = self.last_landed
        # The page's own length: providers need not fill in the length of a remote write's completion.
        self.registration.after_receive(page * self.plan.page_size, self.plan.page_length(page))


class Target(EndpointUser):
    """Serves writers: registers a region per PREPARE, counts what lands, verifies on DONE."""

    CONTROL_PAYLOAD = 4096  # largest control message; the multi-NIC target needs more

    def __init__(self, stack: fi.EndpointStack, slots: int = 8, timeout: float = fi.DEFAULT_TIMEOUT):
        self.stack = stack
        self.timeout = timeout
        self.mailbox = TargetMailbox(stack, slots, self.CONTROL_PAYLOAD, timeout)
        self.clients: dict[int, int] = {}
        self._next_client = itertools.count(1)
        self.buffer = None
        self.seed = 0

    def prepare(self, request: dict) -> bytes:
        self.release()
        plan = PagePlan(request["page_size"], request["buffer_bytes"], 0)
        self.seed = request["seed"]
        self.buffer = memory.allocate(request["memory"], plan.buffer_bytes)
        self.buffer.write(np.zeros(plan.buffer_bytes, np.uint8))
        box = self.mailbox
        box.registration = memory.register(self.stack, self.buffer)
        box.counts = np.zeros(plan.pages, dtype=np.int64)
        box.arrivals = 0
        box.plan = plan
        print(f"prepared {plan.buffer_bytes} bytes of {request['memory']} memory ({box.registration.path}) "
              f"as {plan.pages} pages of {plan.page_size}", flush=True)
        meta = {"path": box.registration.path, "why": box.registration.why}
        return box.registration.mr.remote().pack() + json.dumps(meta).encode()

    def finish(self, expected_writes: int, verify: bool) -> Report:
        box = self.mailbox
        try:
            self.stack.cq.wait(lambda: box.arrivals >= expected_writes, self.timeout,
                               f"{expected_writes} writes landing", box._on_completion)
        except fi.FabricTimeout:
            pass  # reported below as missing arrivals
        counts = box.counts
        verified, mismatched = None, []
        if verify:
            # modeled NICs outside payload mode move no bytes: then each write's immediate data is what is checked
            got = self.buffer.read() if self.stack.info.moves_payload else source_data(self.seed, self.buffer.length)
            want = source_data(self.seed, self.buffer.length)
            if not np.array_equal(got, want):
                ps = box.plan.page_size
                mismatched = [p for p in range(counts.size) if not np.array_equal(got[p * ps:(p + 1) * ps],
                                                                                  want[p * ps:(p + 1) * ps])][:20]
            verified = box.arrivals == expected_writes and not mismatched
        return Report(box.arrivals, int(np.count_nonzero(counts)), int(counts.min()), int(counts.max()), verified,
                      mismatched, box.registration.path, box.registration.why, box.last_landed - box.first_landed)

    def release(self) -> None:
        if self.mailbox.registration is not None:
            self.mailbox.registration.close()
            self.mailbox.registration = None
        if self.buffer is not None:
            self.buffer.close()
            self.buffer = None

    def close(self) -> None:
        """Release the target's regions (the with-block then closes its endpoint stack)."""
        self.release()

    @property
    def address(self) -> fi.Address:
        """The control endpoint's address, advertising the largest control message it takes."""
        return self.stack.ep.address(self.mailbox.slot_size)

    def serve(self, stop) -> None:
        """Handle writers' messages until ``stop``; a request that fails is answered with REFUSED and the
        reason, and the target goes on serving."""
        while not stop.is_set():
            for m in self.mailbox.receive(stop, timeout=math.inf):
                try:
                    self.handle(m)
                except (fi.UsageError, fi.FabricError, MemoryError) as exc:
                    print(f"refused {bidirectional.KIND_NAMES.get(m.kind, m.kind)} from writer {m.client}: {exc}",
                          flush=True)
                    if m.client in self.clients:
                        self.mailbox.send(self.clients[m.client], REFUSED, m.client, m.seq, str(exc).encode()[:2000])

    def handle(self, m: bidirectional.Message) -> None:
        box = self.mailbox
        if m.kind == bidirectional.HELLO:
            peer = fi.Address.from_bytes(bytes(m.payload))
            client = next(self._next_client)
            self.clients[client] = self.stack.av.insert(peer)
            box.send(self.clients[client], bidirectional.WELCOME, client, m.seq)
            print(f"writer {client} joined from {peer.describe()}", flush=True)
        elif m.kind == PREPARE:
            reply = self.prepare(json.loads(bytes(m.payload)))
            box.send(self.clients[m.client], REGION, m.client, m.seq, reply)
        elif m.kind == DONE:
            request = json.loads(bytes(m.payload))
            report = self.finish(request["writes"], request["verify"])
            print(f"report: {report.arrivals} writes landed on {report.distinct_pages} pages, "
                  f"verified {report.verified}", flush=True)
            box.send(self.clients[m.client], REPORT, m.client, m.seq, json.dumps(asdict(report)).encode())
        elif m.kind == bidirectional.BYE:
            self.stack.av.remove(self.clients.pop(m.client))
            print(f"writer {m.client} left", flush=True)


@dataclass
class WriteStats:
    """The writer's side of one transfer."""
    writes: int
    bytes: int
    elapsed_s: float
    cpu_s: float
    eagain: int = 0

    @property
    def gbps(self) -> float:
        return measure.gbps(self.bytes, self.elapsed_s)

    @property
    def mops(self) -> float:
        return self.writes / self.elapsed_s / 1e6 if self.elapsed_s > 0 else 0.0

    @property
    def cpu_ns_per_op(self) -> float:
        return self.cpu_s / self.writes * 1e9 if self.writes else 0.0


class Writer(Client):
    """Chapter 5's client, now writing straight into the target's memory.

    ``prepare`` asks the target for a region and registers the local source; ``write_pages`` moves the
    plan's pages, one write in flight at a time; ``finish`` asks the target what landed."""

    def __init__(self, stack: fi.EndpointStack, server_address, timeout: float = fi.DEFAULT_TIMEOUT):
        super().__init__(stack, server_address, timeout)
        self.handlers = self.mailbox.handlers
        self.handlers["write"] = self._write_completed
        self.completed = 0
        self.remote: fi.RemoteRegion | None = None
        self.plan: PagePlan | None = None
        self.source = None
        self.registration: memory.Registration | None = None
        self.eagain = 0
        self.writes_issued = 0  # since prepare(): what the target should count on finish()
        self._staged = -1  # the write whose page was last copied out of GPU memory
        self.on_progress = None  # called with the number of completed writes, now and then

    @classmethod
    def options_from_args(cls, args) -> dict:
        """Constructor options from the command line (or a bench config): chapter 6's writer has none; its
        transfer options go to ``prepare``. Each later stage adds its own."""
        return {}

    def _write_completed(self, c: fi.Completion) -> None:
        self.completed += 1

    def _call(self, kind: int, request: dict, reply_kind: int) -> bytes:
        """Send a control request and wait for its reply; the target's refusal becomes a UsageError."""
        seq = next(self._seq)
        self.mailbox.send(self.server_addr, kind, self.client_id, seq, json.dumps(request).encode())
        reply = self._next(lambda m: m.kind in (reply_kind, REFUSED) and m.seq == seq)
        if reply.kind == REFUSED:
            raise fi.UsageError(f"the target refused: {bytes(reply.payload).decode(errors='replace')}")
        return bytes(reply.payload)

    def prepare(self, plan: PagePlan, memory_kind: str = "host", seed: int = 1) -> dict:
        """Ask the target for a region of the plan's size; fill and register the local source."""
        self.release()
        reply = self._call(PREPARE, {"page_size": plan.page_size, "buffer_bytes": plan.buffer_bytes,
                                     "memory": memory_kind, "seed": seed}, REGION)
        self.remote = fi.RemoteRegion.unpack(reply[:fi.RemoteRegion.SIZE])
        if self.remote.length < plan.buffer_bytes:
            raise fi.UsageError(f"the target's region has {self.remote.length} bytes, the plan needs "
                                f"{plan.buffer_bytes}")
        self.plan = plan
        self.writes_issued = 0
        self._staged = -1
        self.source = memory.allocate(memory_kind, plan.buffer_bytes)
        self.source.write(source_data(seed, plan.buffer_bytes))
        self.registration = memory.register(self.stack, self.source)
        return {"local": self.registration.path, "local_why": self.registration.why,
                **{f"remote_{k}": v for k, v in json.loads(reply[fi.RemoteRegion.SIZE:]).items()}}

    def try_post_page(self, write: int) -> bool:
        """Post write number ``write`` (page ``write % pages``, immediate data = page index)."""
        plan = self.plan
        page = plan.page_of(write)
        offset = page * plan.page_size
        length = plan.page_length(page)
        if write != self._staged:  # a write retried after -FI_EAGAIN is already staged
            self.registration.before_send(offset, length)
            self._staged = write
        return self.stack.ep.try_post_write(self.registration.mr, offset, length, self.server_addr, self.remote,
                                            offset, ("write", write), data=page)

    def write_pages(self, first: int, count: int) -> None:
        """Chapter 6: post one write, wait for its completion, post the next."""
        self.writes_issued += count
        cq = self.stack.cq
        for write in range(first, first + count):
            target = self.completed + 1
            while not self.try_post_page(write):
                self.eagain += 1
                cq.progress()
            cq.wait(lambda: self.completed >= target, self.timeout, f"write {write}'s completion",
                    self.mailbox._on_completion, hint="is the target still running?")
            if self.on_progress is not None and write % 64 == 0:
                self.on_progress(self.completed)

    def _check_ready(self) -> None:
        if self.plan is None:
            raise fi.UsageError("call prepare() before writing: the target's region is not known yet")

    def transfer(self, warmup: int = 0) -> WriteStats:
        """Warm up with ``warmup`` writes (untimed), then write the whole plan and time it."""
        self._check_ready()
        if warmup:
            self.write_pages(0, min(warmup, self.plan.writes))
        self.completed = 0
        self.eagain = 0
        cpu0, t0 = time.process_time(), time.perf_counter()
        self.write_pages(0, self.plan.writes)
        elapsed, cpu = time.perf_counter() - t0, time.process_time() - cpu0
        return WriteStats(self.plan.writes, self.plan.total_bytes, elapsed, cpu, self.eagain)

    def finish(self, verify: bool = True) -> Report:
        """Tell the target how many writes to expect; it waits for them, checks the bytes and reports."""
        reply = self._call(DONE, {**self.run_summary(), "verify": verify}, REPORT)
        return Report(**json.loads(reply))

    def run_summary(self) -> dict:
        """What the target must see land since prepare(): here every write, each carrying its page."""
        return {"writes": self.writes_issued}

    def release(self) -> None:
        """Give back this transfer's source and registrations (prepare() makes new ones)."""
        if self.registration is not None:
            self.registration.close()
            self.registration = None
        if self.source is not None:
            self.source.close()
            self.source = None

    def close(self) -> None:
        """Release, then say goodbye (the target forgets this writer)."""
        try:
            self.release()
        finally:
            super().close()


def serve_target(make_target, args, stop) -> int:
    """Open the control endpoint, print its address line, serve writers until ``stop``."""
    control_domain = (args.domain or "").split(",")[0] or None
    with memory.open_endpoint(args.provider, control_domain, args.memory) as stack, make_target(stack) as target:
        print(target.address.hex(), flush=True)
        print(f"{type(target).__name__} on {stack.info.provider} domain {stack.info.domain}: "
              f"{stack.ep.address().describe()}", flush=True)
        target.serve(stop)
    return 0


def serve(args, stop: cli.StopSignal) -> int:
    return serve_target(lambda stack: Target(stack, timeout=args.timeout), args, stop)


def run_writer(make_writer, args):
    """One whole transfer from the command line: (writer's memory paths, WriteStats, Report)."""
    plan = PagePlan.for_total(args.page_size, args.total)
    control_domain = (args.domain or "").split(",")[0] or None
    with memory.open_endpoint(args.provider, control_domain, args.memory) as stack, make_writer(stack) as writer:
        paths = writer.prepare(plan, args.memory)
        stats = writer.transfer()
        report = writer.finish()
        description = writer.nicset.describe() if getattr(writer, "nicset", None) else ""
    return paths, stats, report, description


def connect(args) -> int:
    paths, stats, report, _ = run_writer(lambda stack: Writer(stack, args.address, args.timeout), args)
    print(f"{stats.writes} writes, {stats.bytes} bytes in {stats.elapsed_s:.3f} s = {stats.gbps:.2f} Gbps; "
          f"memory {paths['local']} -> {paths['remote_path']}; landed {report.arrivals}, verified {report.verified}")
    return 0 if report.verified else 1


def add_transfer_options(parser) -> None:
    """Chapter 6's writer options: how much to write, in what pages, from what memory."""
    options = parser.add_argument_group("transfer (chapter 6 on)")
    options.add_argument("--page-size", type=cli.positive_size, default="64K",
                         help="bytes per write (default %(default)s)")
    options.add_argument("--total", type=cli.positive_size, default="16M", help="bytes to move (default %(default)s)")
    options.add_argument("--memory", choices=memory.MEMORY_KINDS, default="host", help="host or cuda (GPU) memory")


def writer_parser(module_doc: str, add_writer_options=add_transfer_options):
    """The ``serve`` / ``connect ADDRESS`` command line of a writing stage: the target's memory kind on
    serve, the writer's options (this stage's and every earlier one's) on connect."""
    parser, serve_p, connect_p = cli.stage_parser(module_doc.splitlines()[0])
    serve_p.add_argument("--memory", choices=memory.MEMORY_KINDS, default="host",
                         help="ask for FI_HMEM when cuda memory will be written here")
    add_writer_options(connect_p)
    return parser


def build_parser():
    return writer_parser(__doc__)


def main(argv=None) -> int:
    return cli.stage_main(build_parser(), serve, connect, argv)


if __name__ == "__main__":
    cli.run(main)
