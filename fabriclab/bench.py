"""One benchmark harness for every stage from chapter 6 on, in the spirit of fabtests: the same options,
the same columns and the same formula for all stages (Gbps = bytes × 8 / elapsed / 1e9), byte-exact
verification by the target on by default, and a ceiling measured in the same run — the time one memcpy
of the same bytes takes on this machine — so a reader without a 100 Gbps NIC still gets a "% of line
rate" that means something.

    python -m fabriclab bench --stage opqueue --page-size 64K --total 256M [--json]
"""
from __future__ import annotations

import json
import sys
import time
from dataclasses import asdict, dataclass, field

import numpy as np

from . import cli, fi, memory, opqueue, rdma_write
from .peers import ServerProcess

#: stage name → (module, writer class, chapter)
STAGES = {
    "rdma_write": (rdma_write, rdma_write.Writer, 6),
    "opqueue": (opqueue, opqueue.QueuedWriter, 7),
}
TARGET_MODULE = "fabriclab.rdma_write"


@dataclass
class BenchConfig:
    stage: str = "opqueue"
    provider: str | None = None
    domain: str | None = None
    page_size: int = 64 << 10
    total: int = 256 << 20
    in_flight: int = opqueue.DEFAULT_IN_FLIGHT
    memory: str = "host"
    warmup: int = 16
    verify: bool = True
    timeout: float = 30.0

    def check(self) -> None:
        if self.stage not in STAGES:
            raise fi.UsageError(f"unknown stage {self.stage!r}; choose one of {', '.join(STAGES)}")
        if self.in_flight <= 0:
            raise fi.UsageError(f"pages in flight must be at least 1, got {self.in_flight}")
        if self.warmup < 0:
            raise fi.UsageError(f"warm-up writes cannot be negative, got {self.warmup}")
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
    paths: dict = field(default_factory=dict)

    COLUMNS = ("stage", "provider", "memory", "page", "in flight", "bytes", "elapsed s", "Gbps", "Mops/s",
               "ns CPU/op", "verified")

    def row(self) -> tuple:
        return (self.stage, self.provider, self.memory, _size(self.page_size), str(self.in_flight),
                _size(self.total_bytes), f"{self.elapsed_s:.3f}", f"{self.gbps:.2f}", f"{self.mops:.3f}",
                f"{self.cpu_ns_per_op:.0f}", str(self.verified))


def _size(n: int) -> str:
    for unit, shift in (("G", 30), ("M", 20), ("K", 10)):
        if n >= 1 << shift and n % (1 << shift) == 0:
            return f"{n >> shift}{unit}"
    return str(n)


def memcpy_gbps(nbytes: int, repeats: int = 3) -> float:
    """Best of ``repeats`` single-threaded copies of ``nbytes`` (capped at 256 MiB), in Gbps."""
    n = max(1, min(nbytes, 256 << 20))
    src = np.ones(n, dtype=np.uint8)
    dst = np.empty_like(src)
    np.copyto(dst, src)  # fault the pages in before timing
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - t0)
    return n * 8 / best / 1e9


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
                 timeout: float = 30.0, launcher=(), echo: bool = False):
        self.provider = provider or fi.default_provider()
        self.domain = domain
        self.memory = memory_kind
        self.timeout = timeout
        args = ["--provider", self.provider, "--memory", memory_kind, "--timeout", str(timeout)]
        if domain:
            args += ["--domain", domain]
        self.server = ServerProcess(TARGET_MODULE, args, launcher=launcher, echo=echo)
        # One endpoint and writer per stage: a writer owns its endpoint's completion queue.
        self._writers: dict[str, rdma_write.Writer] = {}
        self._memcpy: dict[int, float] = {}

    def _writer(self, config: BenchConfig) -> rdma_write.Writer:
        writer = self._writers.get(config.stage)
        if writer is None:
            _, cls, _ = STAGES[config.stage]
            stack = memory.open_endpoint(self.provider, self.domain, self.memory)
            try:
                writer = cls(stack, self.server.address, self.timeout)
            except BaseException:
                stack.close()
                raise
            self._writers[config.stage] = writer
        if hasattr(writer, "queue"):
            writer.in_flight = config.in_flight
        return writer

    def run(self, config: BenchConfig, progress: bool = False) -> BenchResult:
        config.check()
        if config.memory != self.memory:
            raise fi.UsageError(f"this Bench was opened for {self.memory} memory, not {config.memory}")
        plan = rdma_write.PagePlan.for_total(config.page_size, config.total)
        writer = self._writer(config)
        paths = writer.prepare(plan, config.memory)
        bar = _ProgressBar(plan.writes, progress)
        writer.on_progress = bar.update
        try:
            stats = writer.transfer(warmup=config.warmup)
        except fi.FabricError:
            self.server.check_alive()
            raise
        finally:
            bar.close()
            writer.on_progress = None
        report = writer.finish(verify=config.verify)
        writer.release()
        ceiling = self._memcpy.setdefault(plan.buffer_bytes, memcpy_gbps(plan.buffer_bytes))
        path = paths["local"] if paths["local"] == paths["remote_path"] else f"{paths['local']}->{paths['remote_path']}"
        return BenchResult(
            stage=config.stage, provider=writer.stack.info.provider, domain=writer.stack.info.domain, memory=path,
            page_size=plan.page_size, in_flight=getattr(writer, "in_flight", 1), writes=stats.writes,
            total_bytes=stats.bytes, elapsed_s=stats.elapsed_s, gbps=stats.gbps, mops=stats.mops,
            cpu_ns_per_op=stats.cpu_ns_per_op, eagain=stats.eagain, verified=report.verified,
            landed=report.arrivals, memcpy_gbps=ceiling, ratio_to_memcpy=stats.gbps / ceiling, paths=paths)

    def close(self) -> None:
        for writer in self._writers.values():
            try:
                if self.server.running:
                    writer.close()
            except fi.FabricError:
                pass
            writer.stack.close()
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
    with Bench(config.provider, config.domain, config.memory, config.timeout) as bench:
        return bench.run(config, progress)


def sweep(page_sizes, in_flights, **kw) -> list[BenchResult]:
    """Every page size × pages in flight, through one target server."""
    base = BenchConfig(**kw)
    base.check()
    out = []
    with Bench(base.provider, base.domain, base.memory, base.timeout) as bench:
        for page in page_sizes:
            for depth in in_flights:
                out.append(bench.run(BenchConfig(**{**asdict(base), "page_size": page, "in_flight": depth})))
    return out


def add_arguments(p) -> None:
    cli.add_fabric_options(p)
    p.set_defaults(timeout=30.0)
    p.add_argument("--stage", default="opqueue", help=f"one of {', '.join(STAGES)} (default opqueue)")
    p.add_argument("--page-size", type=cli.positive_size, default=64 << 10, help="bytes per write (default 64K)")
    p.add_argument("--total", type=cli.positive_size, default=256 << 20, help="bytes to move (default 256M)")
    p.add_argument("--in-flight", type=int, default=opqueue.DEFAULT_IN_FLIGHT, help="pages in flight (default 64)")
    p.add_argument("--memory", default="host", choices=memory.MEMORY_KINDS, help="host or cuda memory")
    p.add_argument("--warmup", type=int, default=16, help="untimed writes before timing (default 16)")
    p.add_argument("--no-verify", dest="verify", action="store_false",
                   help="skip the target's byte-exact check (pure speed)")
    p.add_argument("--json", action="store_true", help="print one JSON object as the last line")


def main(args) -> int:
    config = BenchConfig(args.stage, args.provider, args.domain, args.page_size, args.total, args.in_flight,
                         args.memory, args.warmup, args.verify, args.timeout)
    result = run(config, progress=not args.json)
    print(format_table([result]))
    print(f"memcpy ceiling (1 thread, same bytes): {result.memcpy_gbps:.2f} Gbps; this transfer ran at "
          f"{result.ratio_to_memcpy * 100:.1f} % of it")
    if result.paths.get("local_why") or result.paths.get("remote_why"):
        print(f"GPU memory was staged through pinned host memory: {result.paths.get('local_why') or result.paths.get('remote_why')}")
    if args.json:
        print(json.dumps(asdict(result)))
    return 0 if result.verified in (True, None) else 1
