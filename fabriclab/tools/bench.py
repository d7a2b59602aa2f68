"""One benchmark harness for every stage from chapter 6 on, in the spirit of fabtests: the same options,
the same columns and the same formula for all stages (Gbps = bytes × 8 / elapsed / 1e9, ``measure.gbps``),
byte-exact verification by the target on by default, and a ceiling measured in the same run — what this
machine's cores copy per second, as many threads as the run's, each its own slice of the same bytes
(memcpy_rate) — so a reader without a 100 Gbps NIC still gets a "% of line rate" that means something.

    python -m fabriclab bench --stage opqueue --page-size 64K --total 256M [--json]
    python -m fabriclab bench --stage batched --nics 4 --threads 2 --sweep 4K,16K,64K,256K,1M

Its options are the stages' own, declared once by the stage that introduces each (``batched.add_batch_options``
takes them all), plus the harness's; ``BenchConfig`` has a field of the same name and default for each.

This module is the front: the harness (``Bench``: a target process and the stage writers; ``run``,
``sweep``, ``progression``) and ``main``, over the option layer (bench_options), the one printer
(bench_report), the memcpy ceiling (bench_ceiling) and the two benchmarks through ``fabriclab.Engine``
(bench_api for ``--api``, bench_defaults for ``--defaults``; their target process is bench_target).
"""
from __future__ import annotations

import json
import os
import shlex
import sys
from dataclasses import asdict

from .. import cli, fi, memory, nics, rdma_write, recorded, threaded
from ..measure import gbps
from .bench_api import api_comparison
from .bench_ceiling import COPY_FLOOR_BYTES, last_level_cache_bytes, memcpy_gbps, memcpy_rate
from .bench_defaults import DEFAULTS_SHAPES, defaults_comparison, layout_sweep
from .bench_options import DEFAULTS, STAGES, BenchConfig, add_arguments, size_list
from .bench_report import (BenchResult, compare_steps, cores_used, describe_staging, format_api, format_defaults,
                           format_table, print_results)
from .bench_target import api_target, gpu_copy
from .peers import ServerProcess

__all__ = ["BenchConfig", "BenchResult", "Bench", "run", "sweep", "progression", "PROGRESSION", "PROGRESSION_TOTAL", "STAGES",
           "DEFAULTS", "TARGET_MODULE", "add_arguments", "size_list", "main", "format_table", "print_results",
           "cores_used", "compare_steps", "COPY_FLOOR_BYTES", "last_level_cache_bytes", "memcpy_rate", "memcpy_gbps",
           "api_comparison", "api_target", "gpu_copy", "format_api", "describe_staging", "DEFAULTS_SHAPES",
           "layout_sweep", "defaults_comparison", "format_defaults"]

# The multi-NIC target serves every stage: it is chapter 6's target plus NIC sets.
TARGET_MODULE = "fabriclab.multi_nic"

#: --progression's bytes per run unless --total says otherwise: on the model a 256 MiB run lasts a millisecond
#: or less, shorter than one scheduler slice, so a single lost slice halved a chapter's figure on a small box;
#: 4 GiB runs last about 0.1 s at 3200 Gbps and still cost the model no memory (it moves no payload).
PROGRESSION_TOTAL = 4 << 30

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
            landed_gbps=gbps(stats.bytes, report.landed_s),
            paths=paths, per_nic=getattr(stats, "per_nic", []), label=label, duplicates=report.duplicates,
            modeled=info.modeled, line_gbps=nics * link_bps / 1e9, runs_gbps=[stats.gbps],
            groups=getattr(stats, "groups", 1), target_threads=report.target_threads,
            cores=len(os.sched_getaffinity(0)), counted=report.counted, model=getattr(stats, "model", {}))

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
    groups = base.threads or threaded.writer_threads(None, base.provider or fi.default_provider())[0]
    groups = min(groups, base.nics or groups)  # a GPU group needs a NIC of its own
    with Bench.for_config(base) as bench:
        for _ in range(rounds):
            for (chapter, what, stage, overrides), done in zip(steps, runs):
                config = BenchConfig(**{**asdict(base), "stage": stage, "threads": groups, "groups": groups,
                                        **overrides})
                done.append(bench.run(config, label=f"{chapter} {what}"))
    out = []
    for done in runs:
        median = sorted(done, key=lambda r: r.gbps)[(len(done) - 1) // 2]
        median.runs_gbps = [r.gbps for r in done]
        median.verified = all(r.verified for r in done) if median.verified is not None else None
        out.append(median)
    return out


def main(args) -> int:
    switched = nics.measure_the_nics()  # before libfabric starts: bench measures NICs, never a same-host detour
    config = BenchConfig.from_args(args)
    if args.record is not None:  # checked before minutes of runs are spent on it
        if not args.progression:
            raise fi.UsageError("--record FILE records a progression: add --progression")
        recorded.check_destination(args.record)
    provider = config.provider or fi.default_provider()
    if switched and provider.split(";")[0] in nics.SAME_HOST_SHM_SWITCHES:
        print(f"bench: {switched}, so a server on this host is reached through the NICs, not shared memory",
              file=sys.stderr)
    if args.defaults:
        result = defaults_comparison(config.provider, config.domain, timeout=config.timeout, rounds=args.rounds,
                                     memory_kind=config.memory, gpu_ipc=args.gpu_ipc)
        print(format_defaults(result))
        if args.json:
            print(json.dumps(result))
        return 0
    if args.api:
        r = api_comparison(config, rounds=args.rounds, gpu_ipc=args.gpu_ipc)
        print(format_api(r))
        if args.json:
            print(json.dumps(r))
        return 0
    if args.progression or config.stage in ("threaded", "batched"):
        print(f"threads: {threaded.writer_threads(config.threads, config.provider or fi.default_provider())[1]}"
              + ("; chapters 9-10: 1 writer thread walks the groups" if args.progression else ""), flush=True)
    if args.progression:
        if config.total == DEFAULTS["total"]:
            config.total = PROGRESSION_TOTAL
            print(f"bytes per run: {cli.format_size(PROGRESSION_TOTAL)} (--total sets it)", flush=True)
        results = progression(rounds=args.rounds, **asdict(config))
    elif args.sweep:
        results = sweep(args.sweep, [config.in_flight], **asdict(config))
    else:
        results = [run(config, progress=not args.json)]
    print_results(results, args.json, config.line_rate_bps)
    if args.record is not None:
        recorded.write(args.record, results, ["python", "-m", "fabriclab", *sys.argv[1:]], asdict(config))
        print(f"recorded to {args.record}: {recorded.load(args.record).label}")
    return 0 if all(r.verified in (True, None) for r in results) else 1
