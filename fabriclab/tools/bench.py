"""One benchmark harness for every stage from chapter 6 on, in the spirit of fabtests: the same options,
the same columns and the same formula for all stages (Gbps = bytes × 8 / elapsed / 1e9), byte-exact
verification by the target on by default, and a ceiling measured in the same run — what this machine's
cores copy per second, as many threads as the run's, each its own slice of the same bytes (memcpy_rate)
— so a reader without a 100 Gbps NIC still gets a "% of line rate" that means something.

    python -m fabriclab bench --stage opqueue --page-size 64K --total 256M [--json]
    python -m fabriclab bench --stage batched --nics 4 --threads 2 --sweep 4K,16K,64K,256K,1M

Its options are the stages' own, declared once by the stage that introduces each (``batched.add_batch_options``
takes them all), plus the harness's; ``BenchConfig`` has a field of the same name and default for each.
"""
from __future__ import annotations

import argparse
import contextlib
import glob
import json
import os
import shlex
import sys
import time
from dataclasses import asdict, dataclass, field, fields

import numpy as np

from .. import batched, cli, fi, gpu, memory, multi_nic, nics, opqueue, rdma_write, threaded
from .peers import ServerProcess

#: stage name → its writer class
STAGES = {
    "rdma_write": rdma_write.Writer,
    "opqueue": opqueue.QueuedWriter,
    "multi_nic": multi_nic.MultiNicWriter,
    "threaded": threaded.ThreadedWriter,
    "batched": batched.BatchedWriter,
}
# The multi-NIC target serves every stage: it is chapter 6's target plus NIC sets.
TARGET_MODULE = "fabriclab.multi_nic"

#: The article's progression: chapter, what it adds, stage, switches that differ from "all on".
PROGRESSION = [
    ("7", "operation queue, one NIC", "opqueue", {}),
    ("9", "one thread, all NICs", "multi_nic", {"warmup": False}),
    ("10", "+ warm-up", "multi_nic", {}),
    ("11", "a thread per group", "threaded", {"pin": False, "shard": False}),
    ("12", "+ pinned to cores", "threaded", {"shard": False}),
    ("13", "+ sharded counters", "threaded", {"pad": False}),
    ("13+", "+ one cache line each", "threaded", {}),
    ("14", "batches of 16", "batched", {"lazy": False}),
    ("15", "+ lazy posting", "batched", {}),
    ("15+", "+ FI_MORE", "batched", {"fi_more": True}),
]


def size_list(text: str) -> list[int]:
    """argparse type for --sweep: page sizes separated by commas (4K,64K,1M)."""
    return [cli.positive_size(size) for size in text.split(",")]


def add_arguments(p) -> None:
    """Every stage's options (each stage declares its own) and the harness's."""
    cli.add_fabric_options(p)
    batched.add_batch_options(p)
    # A bench run starts its own target and may move gigabytes through emulated NICs on a busy host.
    p.set_defaults(timeout=30.0)
    harness = p.add_argument_group("the harness")
    harness.add_argument("--stage", default="opqueue", help=f"one of {', '.join(STAGES)} (default %(default)s)")
    runs = harness.add_mutually_exclusive_group()
    runs.add_argument("--sweep", type=size_list, metavar="SIZES",
                      help="run the stage once per page size, e.g. 4K,16K,64K,256K,1M (the same --total each)")
    runs.add_argument("--progression", action="store_true",
                      help="run chapters 7, 9-15 one after the other (each with its own techniques only; "
                           "--threads is the number of GPU groups in every chapter)")
    runs.add_argument("--api", action="store_true",
                      help="the same workload through fabriclab.Engine.write_pages and the stage-15 path, with the "
                           "Python cost per write_pages call")
    runs.add_argument("--defaults", action="store_true",
                      help="Engine() with its defaults against a sweep of Engine(nics=, threads=): two processes, "
                           "1024 x 64K and 64 x 1M pages, contiguous and permuted, plus the 8-thread memcpy ceiling")
    harness.add_argument("--rounds", type=int, default=3,
                         help="--api and --progression: interleaved runs of each path or chapter, compared by "
                              "their medians and min-max (default %(default)s)")
    harness.add_argument("--no-verify", dest="verify", action="store_false",
                         help="skip the target's byte-exact check (pure speed)")
    harness.add_argument("--server-domain", default=None,
                         help="the target's domains when they differ from --domain (e.g. the other namespace's links)")
    harness.add_argument("--server-launcher", default="",
                         help='command prefix that starts the target, e.g. "ip netns exec fabriclab-a"')
    harness.add_argument("--line-rate", dest="line_rate_bps", type=cli.bits_per_second, default=0.0, metavar="RATE",
                         help="the links' aggregate rate (e.g. 3.2G, 100mbit): prints the %% of it that landed")
    harness.add_argument("--json", action="store_true",
                         help="print one JSON object per result, the last on the last line")


def _option_defaults() -> dict:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return vars(parser.parse_args([]))


#: Every option's default, as the command line has it: BenchConfig's defaults, so that the two cannot drift.
DEFAULTS = _option_defaults()


@dataclass
class BenchConfig:
    """One run's settings: a field for each of the command line's options that shape a run (``--page-size``
    is ``page_size``), with the same default and meaning. The stage writers read their options from it as
    from parsed arguments (``options_from_args``)."""
    stage: str = DEFAULTS["stage"]
    provider: str | None = DEFAULTS["provider"]
    domain: str | None = DEFAULTS["domain"]
    fabric: str | None = DEFAULTS["fabric"]  # both sides use it: it is $FABRICLAB_FABRIC while the bench runs
    timeout: float = DEFAULTS["timeout"]
    page_size: int = DEFAULTS["page_size"]
    total: int = DEFAULTS["total"]
    memory: str = DEFAULTS["memory"]
    in_flight: int = DEFAULTS["in_flight"]
    nics: int | None = DEFAULTS["nics"]
    groups: int = DEFAULTS["groups"]
    warmup: bool = DEFAULTS["warmup"]
    link_timeout: float | None = DEFAULTS["link_timeout"]  # a link silent this long is failed over (None: timeout/3)
    count_writes: bool = DEFAULTS["count_writes"]  # the target counts every write (the checking mode)
    threads: int = DEFAULTS["threads"]
    pin: bool = DEFAULTS["pin"]
    shard: bool = DEFAULTS["shard"]
    pad: bool = DEFAULTS["pad"]
    batch: int = DEFAULTS["batch"]
    lazy: bool = DEFAULTS["lazy"]
    fi_more: bool = DEFAULTS["fi_more"]
    verify: bool = DEFAULTS["verify"]
    server_domain: str | None = DEFAULTS["server_domain"]  # the target's domains if not the same (two namespaces)
    server_launcher: str = DEFAULTS["server_launcher"]  # the target's command prefix: "ip netns exec fabriclab-a"
    line_rate_bps: float = DEFAULTS["line_rate_bps"]  # the links' aggregate when known (a shaped testbed)

    @classmethod
    def from_args(cls, args) -> "BenchConfig":
        return cls(**{f.name: getattr(args, f.name) for f in fields(cls)})

    def writer_options(self) -> dict:
        """Constructor options of this stage's writer: each stage maps its own options and its ancestors'."""
        return STAGES[self.stage].options_from_args(self)

    @property
    def control_domain(self) -> str | None:
        return (self.domain or "").split(",")[0] or None

    def check(self) -> None:
        if self.stage not in STAGES:
            raise fi.UsageError(f"unknown stage {self.stage!r}; choose one of {', '.join(STAGES)}")
        if self.in_flight <= 0:
            raise fi.UsageError(f"pages in flight must be at least 1, got {self.in_flight}")
        if self.memory not in memory.MEMORY_KINDS:
            raise fi.UsageError(f"unknown memory kind {self.memory!r}; choose one of {', '.join(memory.MEMORY_KINDS)}")


@dataclass
class BenchResult:
    stage: str
    provider: str
    domain: str
    memory: str
    page_size: int
    in_flight: int
    writes: int
    total_bytes: int
    elapsed_s: float
    gbps: float
    mops: float
    cpu_ns_per_op: float
    eagain: int
    verified: bool | None
    landed: int
    memcpy_gbps: float
    ratio_to_memcpy: float
    nics: int = 1
    emulated_nics: int = 0
    threads: int = 1
    landed_gbps: float = 0.0  # the same bytes over the time the target saw them land (first to last)
    paths: dict = field(default_factory=dict)
    per_nic: list = field(default_factory=list)
    label: str = ""
    duplicates: int = 0  # writes that landed twice after a link failure (counted once in landed)
    modeled: bool = False  # measured on modeled NICs (provider sim, docs/model.md): the model's Gbps, not a wire's
    line_gbps: float = 0.0  # the NICs' aggregate link speed as the provider reports it (0: not reported)
    runs_gbps: list = field(default_factory=list)  # every interleaved run of this configuration (progression)
    memcpy_method: str = ""  # how memcpy_gbps was measured (memcpy_rate)
    groups: int = 1  # GPU groups the writer's threads drive
    target_threads: int = 1  # threads the target polled with
    cores: int = 0  # cores this process may use (os.sched_getaffinity): writer and target threads share them
    counted: bool = True  # the target counted every write (checking mode), else only each NIC's last

    COLUMNS = ("stage", "provider", "memory", "nics", "threads w+t", "page", "in flight", "bytes", "elapsed s",
               "Gbps", "% of line", "Mops/s", "ns CPU/op", "verified")

    def row(self) -> tuple:
        nics = f"{self.nics}" + (f" ({self.emulated_nics} emu)" if self.emulated_nics else "")
        gbps = f"{self.gbps:.2f}"
        if len(self.runs_gbps) > 1:
            gbps += f" ({min(self.runs_gbps):.1f}-{max(self.runs_gbps):.1f})"
        return (self.label or self.stage, self.provider + (" (modeled)" if self.modeled else ""), self.memory, nics,
                f"{self.threads}+{self.target_threads}", cli.format_size(self.page_size), str(self.in_flight),
                cli.format_size(self.total_bytes), f"{self.elapsed_s:.3f}", gbps,
                f"{self.gbps / self.line_gbps * 100:.1f}" if self.line_gbps else "-", f"{self.mops:.3f}",
                f"{self.cpu_ns_per_op:.0f}", str(self.verified))


#: The least a memcpy ceiling copies: at least twice the last-level cache as well (last_level_cache_bytes),
#: so that it streams from memory like a transfer of gigabytes rather than from cache.
COPY_FLOOR_BYTES = 64 << 20


def last_level_cache_bytes() -> int:
    """This machine's last-level caches, every instance counted once (sysfs); 0 where sysfs does not say."""
    instances: dict[str, int] = {}
    deepest = 0
    for cache in glob.glob("/sys/devices/system/cpu/cpu[0-9]*/cache/index[0-9]*"):
        try:
            with open(f"{cache}/level") as f:
                level = int(f.read())
            with open(f"{cache}/size") as f:
                size = cli.positive_size(f.read().strip())
            with open(f"{cache}/shared_cpu_list") as f:
                shared = f.read().strip()
        except (OSError, ValueError, argparse.ArgumentTypeError):
            continue
        if level > deepest:
            deepest, instances = level, {}
        if level == deepest:
            instances[shared] = size
    return sum(instances.values())


def memcpy_rate(nbytes: int, threads: int = 1, repeats: int = 3) -> dict:
    """What the CPU copies per second, the way two processes on one host move bytes over shm (one copy per
    byte, several threads on disjoint buffers): ``threads`` C threads (native/copyrate.c), each pinned to a
    core of its own where there are enough and copying its own slice of ``nbytes`` (at least
    COPY_FLOOR_BYTES and twice the last-level cache; at most 256 MiB a thread), allocated and touched by
    that thread beforehand, all started together ``repeats`` times. Returns {"gbps": the best repeat,
    "runs": every repeat's Gbps, "method": how it was measured, in words}."""
    from .. import _native
    total = max(nbytes, COPY_FLOOR_BYTES, 2 * last_level_cache_bytes())
    per_thread = max(1, min(total // threads, 256 << 20))
    allowed = sorted(os.sched_getaffinity(0))
    cores = [c for c in allowed if c != 0] + [c for c in allowed if c == 0]  # core 0 last, as worker_cores
    runs = _native.memcpy_rate(threads, per_thread, repeats, cores)
    if runs is None:
        raise fi.UsageError(f"the memcpy ceiling could not run {threads} threads x {cli.format_size(per_thread)} "
                            f"(too many threads, or not enough memory): use fewer threads or a smaller size")
    pinned = "each on its own core" if threads <= len(cores) else f"sharing {len(cores)} cores"
    return {"gbps": max(runs), "runs": runs,
            "method": f"C memcpy, {threads} pthread{'s' if threads > 1 else ''} {pinned}, each copying its own "
                      f"warmed {cli.format_size(per_thread)}, started together; best of {repeats}"}


def memcpy_gbps(nbytes: int, threads: int = 1, repeats: int = 3) -> float:
    """memcpy_rate's best repeat, in Gbps."""
    return memcpy_rate(nbytes, threads, repeats)["gbps"]


def format_table(results: list[BenchResult]) -> str:
    cells = [BenchResult.COLUMNS] + [r.row() for r in results]
    widths = [max(len(c[i]) for c in cells) for i in range(len(BenchResult.COLUMNS))]
    lines = ["  ".join(v.rjust(w) if i >= 3 else v.ljust(w) for i, (v, w) in enumerate(zip(row, widths)))
             for row in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


class _ProgressBar:
    """tqdm when it is installed and output is a terminal; appears only on runs longer than ~2 s."""

    def __init__(self, total: int, enabled: bool):
        self.bar = None
        if enabled and sys.stderr.isatty():
            try:
                from tqdm import tqdm
                self.bar = tqdm(total=total, unit="write", delay=2.0, leave=False, file=sys.stderr)
            except ImportError:
                pass
        self.done = 0

    def update(self, completed: int) -> None:
        if self.bar is not None and completed - self.done >= 256:
            self.bar.update(completed - self.done)
            self.done = completed

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


class Bench:
    """A target server process plus a local endpoint; ``run(config)`` measures one configuration.
    Reuse one Bench for a sweep: the server and endpoints stay up between runs."""

    def __init__(self, provider: str | None = None, domain: str | None = None, memory_kind: str = "host",
                 timeout: float = 30.0, launcher=(), echo: bool = False, server_domain: str | None = None):
        self.provider = provider or fi.default_provider()
        self.domain = domain
        self.memory = memory_kind
        self.timeout = timeout
        args = ["--provider", self.provider, "--memory", memory_kind, "--timeout", str(timeout)]
        if server_domain or domain:
            args += ["--domain", server_domain or domain]
        if isinstance(launcher, str):
            launcher = shlex.split(launcher)
        self.server = ServerProcess(TARGET_MODULE, args, launcher=launcher, echo=echo)
        # One writer per stage, each on its own endpoint (a writer owns its completion queue), made anew
        # when its options change.
        self._writers: dict[str, tuple[dict, rdma_write.Writer]] = {}
        self._memcpy: dict[tuple, dict] = {}  # (bytes, threads) -> memcpy_rate

    @classmethod
    def for_config(cls, config: BenchConfig) -> "Bench":
        if config.fabric:
            cli.fabric_name(config.fabric)  # this process's NIC sets and the server it starts ask for it
        return cls(config.provider, config.domain, config.memory, config.timeout, config.server_launcher,
                   server_domain=config.server_domain)

    def _writer(self, config: BenchConfig) -> rdma_write.Writer:
        options = config.writer_options()
        known = self._writers.get(config.stage)
        if known is not None and known[0] == options:
            return known[1]
        if known is not None:
            self._close_writer(known[1])
        cls = STAGES[config.stage]
        stack = memory.open_endpoint(self.provider, config.control_domain, self.memory)
        try:
            writer = cls(stack, self.server.address, self.timeout, **options)
        except BaseException:
            stack.close()
            raise
        self._writers[config.stage] = (options, writer)
        return writer

    def _close_writer(self, writer: rdma_write.Writer) -> None:
        try:
            writer.release()
            if self.server.running:
                writer.close()
        except fi.FabricError:
            pass
        writer.stack.close()

    def run(self, config: BenchConfig, progress: bool = False, label: str = "") -> BenchResult:
        config.check()
        if config.memory != self.memory:
            raise fi.UsageError(f"this Bench was opened for {self.memory} memory, not {config.memory}")
        plan = rdma_write.PagePlan.for_total(config.page_size, config.total)
        writer = self._writer(config)
        paths = writer.prepare(plan, config.memory)
        bar = _ProgressBar(plan.writes, progress)
        writer.on_progress = bar.update
        try:
            # chapter 10's warm-up, one untimed write per NIC: the engine stages' writers do it in C (their
            # warmup option); chapters 6 and 7 have one endpoint, so one write.
            stats = writer.transfer(warmup=1 if config.warmup else 0)
        except fi.FabricError:
            self.server.check_alive()
            raise
        finally:
            bar.close()
            writer.on_progress = None
        report = writer.finish(verify=config.verify)
        writer.release()
        threads = getattr(stats, "threads", 1)
        if (plan.buffer_bytes, threads) not in self._memcpy:
            self._memcpy[plan.buffer_bytes, threads] = memcpy_rate(plan.buffer_bytes, threads, 5)
        ceiling = self._memcpy[plan.buffer_bytes, threads]["gbps"]
        path = paths["local"] if paths["local"] == paths["remote_path"] else f"{paths['local']}->{paths['remote_path']}"
        info = writer.stack.info
        nics = getattr(stats, "nics", 1)
        link_bps = info.nic.link_speed_bps if info.nic and info.nic.link_speed_bps else 0
        return BenchResult(
            stage=config.stage, provider=writer.stack.info.provider, domain=config.domain or writer.stack.info.domain,
            memory=path, page_size=plan.page_size, in_flight=config.in_flight if config.stage != "rdma_write" else 1,
            writes=stats.writes, total_bytes=stats.bytes, elapsed_s=stats.elapsed_s, gbps=stats.gbps, mops=stats.mops,
            cpu_ns_per_op=stats.cpu_ns_per_op, eagain=stats.eagain, verified=report.verified, landed=report.arrivals,
            memcpy_gbps=ceiling, ratio_to_memcpy=stats.gbps / ceiling if ceiling else 0.0,
            memcpy_method=self._memcpy[plan.buffer_bytes, threads]["method"],
            nics=getattr(stats, "nics", 1), emulated_nics=getattr(stats, "emulated_nics", 0), threads=threads,
            landed_gbps=stats.bytes * 8 / report.landed_s / 1e9 if report.landed_s > 0 else 0.0,
            paths=paths, per_nic=getattr(stats, "per_nic", []), label=label, duplicates=report.duplicates,
            modeled=info.modeled, line_gbps=nics * link_bps / 1e9, runs_gbps=[stats.gbps],
            groups=getattr(stats, "groups", 1), target_threads=report.target_threads,
            cores=len(os.sched_getaffinity(0)), counted=report.counted)

    def close(self) -> None:
        for _, writer in self._writers.values():
            self._close_writer(writer)
        self._writers.clear()
        self.server.stop()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False


def run(config: BenchConfig | None = None, progress: bool = False, **kw) -> BenchResult:
    """One benchmark run with its own target server: ``run(page_size=1 << 20, total=1 << 30)``."""
    config = config or BenchConfig(**kw)
    config.check()
    with Bench.for_config(config) as bench:
        return bench.run(config, progress)


def sweep(page_sizes, in_flights, **kw) -> list[BenchResult]:
    """Every page size × pages in flight, through one target server (``--sweep SIZES``: the given depth)."""
    base = BenchConfig(**kw)
    base.check()
    out = []
    with Bench.for_config(base) as bench:
        for page in page_sizes:
            for depth in in_flights:
                out.append(bench.run(BenchConfig(**{**asdict(base), "page_size": page, "in_flight": depth})))
    return out


def progression(chapters=None, rounds: int = 3, **kw) -> list[BenchResult]:
    """The article's chapters 7 and 9-15 (plus this project's extra steps) through one target, each with
    only its chapter's techniques on, interleaved: ``rounds`` passes over all chapters, so that a slow
    moment of the host hits every chapter alike. Each chapter's result is its median run (Gbps), with every
    run's Gbps in ``runs_gbps``. ``chapters`` picks some ("9", "15", ...). ``threads`` is the number of
    GPU groups in every chapter: in the article chapter 9's one thread walks the same groups that chapter
    11 gives a thread each."""
    base = BenchConfig(**kw)
    base.check()
    if rounds <= 0:
        raise fi.UsageError(f"--rounds must be at least 1, got {rounds}")
    steps = [step for step in PROGRESSION if chapters is None or step[0] in chapters]
    runs: list[list[BenchResult]] = [[] for _ in steps]
    with Bench.for_config(base) as bench:
        for _ in range(rounds):
            for (chapter, what, stage, overrides), done in zip(steps, runs):
                config = BenchConfig(**{**asdict(base), "stage": stage, "groups": base.threads, **overrides})
                done.append(bench.run(config, label=f"{chapter} {what}"))
    out = []
    for done in runs:
        median = sorted(done, key=lambda r: r.gbps)[(len(done) - 1) // 2]
        median.runs_gbps = [r.gbps for r in done]
        median.verified = all(r.verified for r in done) if median.verified is not None else None
        out.append(median)
    return out


def compare_steps(results: list[BenchResult]) -> list[str]:
    """Each step against the one before: a gain or a loss only when the two runs' ranges (min-max of the
    interleaved runs) do not overlap; otherwise noise."""
    lines = []
    for before, after in zip(results, results[1:]):
        ratio = after.gbps / before.gbps if before.gbps else float("inf")
        lines.append(f"  {before.label} -> {after.label}: x{ratio:.2f}, "
                     f"{verdict(before.runs_gbps, after.runs_gbps)}")
    return lines


def verdict(before, after) -> str:
    """"gain" or "loss" from the runs ``before`` to the runs ``after`` only when their ranges (min-max) do
    not overlap; otherwise "noise (ranges overlap)"."""
    return "gain" if min(after) > max(before) else "loss" if max(after) < min(before) else "noise (ranges overlap)"


def gpu_copy(host: np.ndarray):
    """``host``'s bytes in GPU memory, as ``Engine.register`` takes them: a torch CUDA tensor when torch is
    importable and sees a GPU, else cuda-python device memory (memory.CudaBuffer). Without CUDA, UsageError
    naming what is missing."""
    gpu.require_cuda()  # the Engine needs cuda-python either way: it asks the driver where the memory lives
    try:
        import torch
    except ImportError:
        torch = None
    if torch is not None and torch.cuda.is_available():
        return torch.from_numpy(host).to("cuda")
    buffer = memory.CudaBuffer(host.size)
    buffer.write(host)
    return buffer


def _api_target_region(engine, size: int, memory_kind: str):
    """The target's region and what the bench prints of it ({"path", "why"}). GPU memory where the engine
    can make it a target (its descriptor() says so), else host memory, with the reason."""
    fallback = ""
    if memory_kind == "cuda":
        region = engine.register(gpu_copy(np.zeros(size, dtype=np.uint8)))
        try:
            region.descriptor()
            return region, {"path": region.path, "why": region.why}
        except fi.UsageError as exc:
            region.close()
            fallback = f"GPU memory cannot be a target here ({exc}): the target is host memory"
    region = engine.register(np.zeros(size, dtype=np.uint8))
    return region, {"path": region.path, "why": fallback}


def api_target() -> None:
    """The far side of ``--api``: an Engine with one buffer; swaps (address, descriptor, its region's path
    as JSON) over the bootstrap socket, serves until its standard input closes, then prints its engine's
    staging figures as one JSON line. Arguments: provider domains nics threads bytes memory (``-`` for
    none: the Engine's default)."""
    from .. import bootstrap
    from ..engine import Engine
    provider, domains, nics, threads, size, memory_kind = sys.argv[1:7]
    # unpinned, like the stage-15 target: two engines pinned on one host would share the same cores
    with Engine(None if provider == "-" else provider, domains=None if domains == "-" else domains,
                nics=None if nics == "-" else int(nics), threads=None if threads == "-" else int(threads),
                pin=False, gpu=memory_kind == "cuda") as engine:
        region, path = _api_target_region(engine, int(size), memory_kind)
        with bootstrap.Rendezvous() as rendezvous:
            print(rendezvous.port, flush=True)
            rendezvous.exchange(bootstrap.pack(engine.address, region.descriptor(), json.dumps(path).encode()))
        sys.stdin.read()
        print(json.dumps(engine.stats()["staging"]), flush=True)


@contextlib.contextmanager
def _api_peer(provider, domain, layout, size: int, memory_kind: str = "host"):
    """api_target in another process with ``layout`` ((nics, threads), either None for the default; None:
    both defaults); yields a dict with its "address", "descriptor" and "target" ({"path", "why"} of its
    region), to which "target_staging" (its engine's staging figures) is added once the block is left."""
    import subprocess
    from .. import bootstrap
    nics, threads = layout or (None, None)
    target = subprocess.Popen([sys.executable, "-c", "from fabriclab.tools.bench import api_target; api_target()",
                               provider or "-", domain or "-", "-" if nics is None else str(nics),
                               "-" if threads is None else str(threads), str(size), memory_kind],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        port = int(target.stdout.readline())
        address, descriptor, path = bootstrap.unpack(bootstrap.exchange(port, b"bench"))
        peer = {"address": address, "descriptor": descriptor, "target": json.loads(path)}
        yield peer
    finally:
        try:
            report = target.communicate(timeout=30)[0].splitlines()  # closes its standard input: it ends
        except subprocess.TimeoutExpired:
            target.kill()
            report = target.communicate()[0].splitlines()
    peer["target_staging"] = json.loads(report[-1]) if report else {}


@contextlib.contextmanager
def _running_on(cores):
    """Run the calling thread on ``cores`` (when there are any) for the block: as a user of the engine
    should, so that it never preempts a worker that polls a NIC."""
    before = os.sched_getaffinity(0)
    if cores and cores != before:
        os.sched_setaffinity(0, cores)
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


def api_comparison(config: BenchConfig, calls=(1, 16, 256), batch_pages: int = 256, outstanding: int = 8,
                   rounds: int = 3) -> dict:
    """The same workload through ``Engine.write_pages`` (pages in calls of ``batch_pages``, up to
    ``outstanding`` calls in flight) and through the stage-15 path (``batched``), alternating ``rounds``
    times and compared by their medians (one run of each swings by 10-20 % on a busy host), plus the
    Python cost of one ``write_pages`` call of 1, 16 and 256 pages.

    With ``config.memory == "cuda"`` the Engine's source is GPU memory (gpu_copy) and so is its target
    where the target engine can take GPU memory as a target (else host memory, and the result says why);
    "source" and "target" say the path each region took (``Region.path``/``why``), "staging" and
    "target_staging" both engines' ``stats()["staging"]`` after the last round."""
    config.check()
    if rounds <= 0:
        raise fi.UsageError(f"--rounds must be at least 1, got {rounds}")
    if config.memory == "cuda":
        gpu.require_cuda()  # before any process starts: no CUDA here, and the error says what to install
    raw_runs, api_runs, overhead = [], [], {}
    for _ in range(rounds):
        raw = run(BenchConfig(**{**asdict(config), "stage": "batched", "verify": False}))
        raw_runs.append(raw.gbps)
        measured = _api_round(config, raw.provider, () if overhead else calls, batch_pages, outstanding)
        api_runs.append(measured["gbps"])
        overhead = overhead or measured["us_per_call"]
    raw_gbps, api_gbps = float(np.median(raw_runs)), float(np.median(api_runs))
    return {"raw_gbps": raw_gbps, "api_gbps": api_gbps, "ratio": api_gbps / raw_gbps if raw_gbps else 0.0,
            "raw_runs": raw_runs, "api_runs": api_runs, "us_per_call": overhead,
            "page_size": config.page_size, "threads": config.threads, "nics": raw.nics, "provider": raw.provider,
            "caller_cores": measured["caller_cores"], "memory": config.memory, "raw_memory": raw.memory,
            "source": measured["source"], "target": measured["target"], "staging": measured["staging"],
            "target_staging": measured["target_staging"]}


def _api_round(config: BenchConfig, provider: str, calls, batch_pages: int, outstanding: int) -> dict:
    """One timed pass through the Engine (a fresh target process and engine, so that neither idles beside
    the raw runs): Gbps, the Python µs per call for each size in ``calls``, the calling thread's cores, the
    path of each region and both engines' staging figures."""
    from ..engine import Engine
    plan = rdma_write.PagePlan.for_total(config.page_size, config.total)
    cuda = config.memory == "cuda"
    with _api_peer(provider, config.domain, (config.nics, config.threads), plan.buffer_bytes,
                   config.memory) as target:
        address, descriptor = target["address"], target["descriptor"]
        with Engine(provider, domains=config.domain, nics=config.nics, threads=config.threads, pin=config.pin,
                    batch=config.batch, fi_more=config.fi_more, timeout=config.timeout,
                    in_flight=config.in_flight, gpu=cuda) as engine, _running_on(engine.housekeeping_cores):
            caller_cores = sorted(os.sched_getaffinity(0))
            source = np.frombuffer(np.random.default_rng(1).bytes(plan.buffer_bytes), dtype=np.uint8).copy()
            region = engine.register(gpu_copy(source) if cuda else source)
            peer = engine.connect(address)
            whole = plan.buffer_bytes // plan.page_size
            pages = np.arange(plan.writes) % whole
            peer.write_pages(region, pages[:min(whole, 64)], descriptor, pages[:min(whole, 64)],
                             plan.page_size).result()  # warm-up
            in_flight = []
            t0 = time.perf_counter()
            for start in range(0, pages.size, batch_pages):
                chunk = pages[start:start + batch_pages]
                in_flight.append(peer.write_pages(region, chunk, descriptor, chunk, plan.page_size))
                if len(in_flight) >= outstanding:
                    in_flight.pop(0).result()
            for t in in_flight:
                t.result()
            gbps = pages.size * plan.page_size * 8 / (time.perf_counter() - t0) / 1e9
            overhead = {}
            for n in calls:
                chunk = pages[:min(n, whole)]
                spent, transfers = 0.0, []
                for _ in range(50):
                    c0 = time.perf_counter()
                    transfers.append(peer.write_pages(region, chunk, descriptor, chunk, plan.page_size))
                    spent += time.perf_counter() - c0
                    if len(transfers) >= outstanding:
                        transfers.pop(0).result()
                for t in transfers:
                    t.result()
                overhead[n] = spent / 50 * 1e6
            staging = engine.stats()["staging"]
    return {"gbps": gbps, "us_per_call": overhead, "caller_cores": caller_cores,
            "source": {"path": region.path, "why": region.why}, "target": target["target"], "staging": staging,
            "target_staging": target["target_staging"]}


def format_api(r: dict) -> str:
    """api_comparison's result in words: both paths' Gbps, the Python cost per call and, for GPU memory,
    the path each region took and what went through the staging pools."""
    lines = [f"{r['provider']}, {r['nics']} NICs, {r['threads']} thread(s), {cli.format_size(r['page_size'])} pages, "
             f"{r['memory']} memory: stage-15 path {r['raw_gbps']:.2f} Gbps, Engine.write_pages {r['api_gbps']:.2f} "
             f"Gbps ({r['ratio'] * 100:.1f} % of it); medians of {len(r['raw_runs'])} alternating runs "
             f"(stage 15: {', '.join(f'{g:.1f}' for g in r['raw_runs'])}; Engine: "
             f"{', '.join(f'{g:.1f}' for g in r['api_runs'])}); the calling thread ran on cores "
             f"{','.join(map(str, r['caller_cores']))}",
             "Python cost per write_pages call: " + ", ".join(f"{n} page(s) {us:.1f} us"
                                                            for n, us in r["us_per_call"].items())]
    if r["memory"] == "cuda":
        for side in ("source", "target"):
            path = r[side]
            lines.append(f"Engine {side} region: {path['path']}" + (f" ({path['why']})" if path["why"] else ""))
        lines.append(f"stage-15 path memory: {r['raw_memory']}")
        for side, staging in (("source", r["staging"]), ("target", r["target_staging"])):
            lines.append(f"staging on the {side} side: {describe_staging(staging)}")
    return "\n".join(lines)


def describe_staging(staging: dict) -> str:
    """An engine's ``stats()["staging"]`` in words."""
    if not staging:
        return "not reported"
    said = []
    if staging["allocated"]:  # writes from GPU memory: GPU -> pinned chunks -> the NICs
        said.append(f"sent {cli.format_size(staging['staged_bytes'])} in {staging['staged_chunks']} chunks through "
                    f"a pool of {cli.format_size(staging['pool_bytes'])} ({cli.format_size(staging['chunk_bytes'])} "
                    f"chunks), {_copy_rate(staging['staged_bytes'], staging['copy_seconds'])}, "
                    f"{staging['jobs_waiting']} job(s) waiting")
    if staging.get("landing_allocated"):  # writes into GPU memory: the NICs -> pinned lanes -> GPU
        said.append(f"landed {cli.format_size(staging['landed_bytes'])} in {staging['landed_lanes']} lanes of a pool "
                    f"of {cli.format_size(staging['landing_pool_bytes'])} ({staging['lanes']} lanes), "
                    f"{_copy_rate(staging['landed_bytes'], staging['landing_copy_seconds'])}")
    return "; ".join(said) or f"nothing staged (pool of {cli.format_size(staging['pool_bytes'])} not allocated)"


def _copy_rate(nbytes: int, seconds: float) -> str:
    return f"{seconds:.3f} s copying ({nbytes / seconds / 1e9 if seconds else 0.0:.1f} GB/s)"


# The shapes of issue 15's benchmark: (pages per transfer, page size), each bytes-equal (64 MiB a transfer).
DEFAULTS_SHAPES = ((1024, 64 << 10), (64, 1 << 20))


def layout_sweep(cores: int) -> list[tuple[int, int]]:
    """The (nics, threads) the defaults are compared with: 1, 2, 4, 8 threads as the cores allow, each with
    one and with two NIC slots per thread."""
    return [(per * t, t) for t in (1, 2, 4, 8) if t <= cores for per in (1, 2)]


def defaults_comparison(provider: str | None, domain: str | None = None, layouts=None, shapes=DEFAULTS_SHAPES,
                        transfers: int = 20, warmup: int = 2, timeout: float = 60.0, rounds: int = 3,
                        memory_kind: str = "host") -> dict:
    """Engine() with its defaults against ``layouts`` ((nics, threads) pairs; default layout_sweep), each
    writer and its target in two processes with the same layout: per shape, ``warmup`` then ``transfers``
    timed transfers of every page, one at a time, with pages contiguous and permuted on the target. The
    layouts take turns ``rounds`` times; GB/s per (layout, shape, order) is the median of the rounds (with
    their spread), next to the writes a transfer became; plus the 8-thread memcpy ceiling (memcpy_rate of a
    transfer's bytes, once a round: its median, in GB/s). ``memory_kind`` "cuda": both sides' buffers are GPU
    memory (direct or staged: "paths" says which)."""
    if memory_kind == "cuda":
        gpu.require_cuda()  # before any process starts: no CUDA here, and the error says what to install
    layouts = [None] + list(layout_sweep(len(os.sched_getaffinity(0))) if layouts is None else layouts)
    runs, chosen, ceilings = [[] for _ in layouts], {}, []
    largest = max(n * size for n, size in shapes)
    for r in range(rounds):
        # each round starts one layout further on: no layout always runs first (after an idle spell) or last
        for i in [(r + k) % len(layouts) for k in range(len(layouts))]:
            runs[i].append(_defaults_round(provider, domain, layouts[i], shapes, transfers, warmup, timeout, chosen,
                                           memory_kind))
        ceilings.append(memcpy_rate(largest, threads=8, repeats=5))
    rows = []
    for layout, measured in zip(layouts, runs):
        cases = measured[0]["gbs"]
        rows.append({"layout": "defaults" if layout is None else f"nics={layout[0]} threads={layout[1]}",
                     "gbs": {c: float(np.median([m["gbs"][c] for m in measured])) for c in cases},
                     "runs": {c: [m["gbs"][c] for m in measured] for c in cases},
                     "writes": measured[-1]["writes"]})
    pages, size = shapes[0]
    return {"provider": provider, "memory": memory_kind, "paths": chosen.pop("paths"), "rows": rows, "defaults": chosen,
            "memcpy_8_threads_gbs": float(np.median([c["gbps"] for c in ceilings])) / 8,
            "memcpy_8_threads_runs_gbs": [c["gbps"] / 8 for c in ceilings], "memcpy_method": ceilings[-1]["method"],
            "against_ceiling": f"{pages}x{cli.format_size(size)} permuted", "rounds": rounds,
            "cores": len(os.sched_getaffinity(0))}


def _defaults_round(provider, domain, layout, shapes, transfers: int, warmup: int, timeout: float,
                    chosen: dict, memory_kind: str) -> dict:
    """One layout's turn in defaults_comparison (a fresh target process and engine); fills ``chosen`` with
    what the defaults picked and ``chosen["paths"]`` with the memory paths of both sides."""
    from ..engine import Engine
    row = {"gbs": {}, "writes": {}}
    region_bytes = max(n * size for n, size in shapes)
    with _api_peer(provider, domain, layout, region_bytes, memory_kind) as target:
        address, descriptor = target["address"], target["descriptor"]
        nics, threads = layout or (None, None)
        with Engine(provider, domains=domain, nics=nics, threads=threads, timeout=timeout,
                    gpu=memory_kind == "cuda") as engine, _running_on(engine.housekeeping_cores):
            if layout is None:
                chosen.update(nics=engine.nics, threads=engine.threads, repr=repr(engine))
            peer = engine.connect(address)
            source = np.frombuffer(np.random.default_rng(1).bytes(region_bytes), dtype=np.uint8).copy()
            region = engine.register(gpu_copy(source) if memory_kind == "cuda" else source)
            chosen["paths"] = {"source": region.path, "target": target["target"]["path"]}
            for pages, size in shapes:
                for order in ("contiguous", "permuted"):
                    src = np.arange(pages)
                    dst = src if order == "contiguous" else np.random.default_rng(pages).permutation(pages)
                    for _ in range(warmup):
                        peer.write_pages(region, src, descriptor, dst, size).result()
                    t0 = time.perf_counter()
                    for _ in range(transfers):
                        done = peer.write_pages(region, src, descriptor, dst, size)
                        done.result()
                    key = f"{pages}x{cli.format_size(size)} {order}"
                    row["gbs"][key] = transfers * pages * size / (time.perf_counter() - t0) / 1e9
                    row["writes"][key] = done.writes
    return row


def format_defaults(result: dict) -> str:
    """The table of defaults_comparison: GB/s per layout and case, the defaults as % of the best layout per
    case, and the first shape's permuted case (64K pages) as % of the 8-thread memcpy ceiling."""
    cases = list(result["rows"][0]["gbs"])
    width = max(len(r["layout"]) for r in result["rows"])
    lines = [f"{'layout':<{width}}  " + "  ".join(f"{c:>22}" for c in cases) + "   (GB/s; writes per transfer)"]
    for r in result["rows"]:
        lines.append(f"{r['layout']:<{width}}  " + "  ".join(f"{r['gbs'][c]:>15.2f} ({r['writes'][c]:>4})"
                                                              for c in cases))
    defaults = result["rows"][0]
    best = {c: max(r["gbs"][c] for r in result["rows"][1:] or result["rows"]) for c in cases}
    lines.append(f"{'defaults % of best':<{width}}  " + "  ".join(f"{defaults['gbs'][c] / best[c] * 100:>21.0f}%"
                                                                 for c in cases))
    chosen = result["defaults"]
    same = next((r for r in result["rows"][1:]
                 if r["layout"] == f"nics={chosen.get('nics')} threads={chosen.get('threads')}"), None)
    if same is not None:  # the same NIC slots, threads, groups and cores (tests/test_layout.py checks it)
        lines.append(f"defaults against {same['layout']}, the same layout: " + ", ".join(
            f"{c} x{defaults['gbs'][c] / same['gbs'][c]:.2f} {verdict(same['runs'][c], defaults['runs'][c])}"
            for c in cases))
    permuted = result["against_ceiling"]
    ceiling = result["memcpy_8_threads_gbs"]
    spread = result["memcpy_8_threads_runs_gbs"]
    lines.append(f"memcpy ceiling (8 threads): {ceiling:.2f} GB/s ({min(spread):.1f}-{max(spread):.1f}); {permuted} "
                 f"with defaults {defaults['gbs'][permuted] / ceiling * 100:.0f} % of it, best layout "
                 f"{best[permuted] / ceiling * 100:.0f} %")
    lines.append(f"memcpy measured as: {result['memcpy_method']}, once a round")
    if result["memory"] == "cuda":
        lines.append(f"GPU memory on both sides: the source {result['paths']['source']}, the target "
                     f"{result['paths']['target']} (the memcpy ceiling is host memory's)")
    lines.append(f"medians of {result['rounds']} rounds, layouts taking turns; defaults here ({result['cores']} "
                 f"cores): {result['defaults'].get('repr', '')}")
    return "\n".join(lines)


def cores_used(results: list[BenchResult]) -> str:
    """What the "threads w+t" column means, in words: each writer and target thread polls a core of its own,
    on the cores this process may use; and how the target knew the run complete."""
    cores = max(r.cores for r in results)
    groups = sorted({r.groups for r in results})
    how = ("counting every write" if all(r.counted for r in results) else
           "waiting for each NIC's last write (as the article's receiver)" if not any(r.counted for r in results)
           else "counting every write in some runs, only each NIC's last in others")
    return (f"threads w+t: writer threads + target threads, each polling a core of its own, on the {cores} core(s) "
            f"this process may use; {', '.join(map(str, groups))} GPU group(s); the target verified each run "
            f"{how}")


def print_results(results: list[BenchResult], as_json: bool, line_rate_bps: float = 0.0) -> None:
    if any(r.modeled for r in results):
        print("MODELED figures: NICs of the sim provider (docs/model.md); Gbps and % of line are the model's "
              "line, the CPU cost is this machine's")
    print(cores_used(results))
    if any(len(r.runs_gbps) > 1 for r in results):
        print(f"Gbps: median of {len(results[0].runs_gbps)} interleaved runs (min-max)")
    print(format_table(results))
    if any(len(r.runs_gbps) > 1 for r in results) and len(results) > 1:
        print("step by step:")
        print("\n".join(compare_steps(results)))
    for r in results:
        if line_rate_bps:
            print(f"line rate {line_rate_bps / 1e9:g} Gbps: {r.label or r.stage} landed at {r.landed_gbps:.3f} Gbps = "
                  f"{r.landed_gbps * 1e9 / line_rate_bps * 100:.1f} % of it (posted at {r.gbps:.3f} Gbps)")
        if r.modeled:
            continue  # no byte is copied on the model: a memcpy ceiling says nothing about it
        ceiling = (f"memcpy ceiling ({r.threads} thread{'s' if r.threads > 1 else ''}, same bytes): "
                   f"{r.memcpy_gbps:.2f} Gbps; {r.label or r.stage} with {cli.format_size(r.page_size)} pages ran at "
                   f"{r.ratio_to_memcpy * 100:.1f} % of it")
        print(ceiling)
        print(f"  memcpy measured as: {r.memcpy_method}")
        if r.emulated_nics:
            print(f"  {r.emulated_nics} of {r.nics} NICs are emulated (endpoints sharing a domain)")
        if len(r.per_nic) > 1:
            split = ", ".join(f"{n['nic']}:{n['bytes'] * 8 / r.elapsed_s / 1e9:.2f}" for n in r.per_nic[:32]) \
                if r.elapsed_s else ""
            print(f"  per-NIC Gbps: {split}")
        for n in r.per_nic:
            if n.get("down"):
                print(f"  link down: NIC {n['nic']} ({n['domain']}): {n['down']}; {n['resent']} of its writes were "
                      f"sent again over the other links")
        if r.duplicates:
            print(f"  {r.duplicates} write(s) landed twice (sent again after a link failure); counted once")
        why = r.paths.get("local_why") or r.paths.get("remote_why")
        if why:
            print(f"  GPU memory was staged through pinned host memory: {why}")
    if as_json:
        for r in results:
            print(json.dumps(asdict(r)))


def main(args) -> int:
    switched = nics.measure_the_nics()  # before libfabric starts: bench measures NICs, never a same-host detour
    config = BenchConfig.from_args(args)
    provider = config.provider or fi.default_provider()
    if switched and provider.split(";")[0] in nics.SAME_HOST_SHM_SWITCHES:
        print(f"bench: {switched}, so a server on this host is reached through the NICs, not shared memory",
              file=sys.stderr)
    if args.defaults:
        result = defaults_comparison(config.provider, config.domain, timeout=config.timeout, rounds=args.rounds,
                                     memory_kind=config.memory)
        print(format_defaults(result))
        if args.json:
            print(json.dumps(result))
        return 0
    if args.api:
        r = api_comparison(config, rounds=args.rounds)
        print(format_api(r))
        if args.json:
            print(json.dumps(r))
        return 0
    if args.progression or config.stage in ("threaded", "batched"):
        print(f"threads: {threaded.writer_threads(config.threads)[1]}"
              + ("; chapters 9-10: 1 writer thread walks the groups" if args.progression else ""), flush=True)
    if args.progression:
        results = progression(rounds=args.rounds, **asdict(config))
    elif args.sweep:
        results = sweep(args.sweep, [config.in_flight], **asdict(config))
    else:
        results = [run(config, progress=not args.json)]
    print_results(results, args.json, config.line_rate_bps)
    return 0 if all(r.verified in (True, None) for r in results) else 1
