"""The bench's one printer: ``BenchResult`` (a stage run's figures) and its table, the lines printed under
it, and the words for the ``--api`` and ``--defaults`` comparisons. Every rate goes through
``measure.gbps`` and every comparison of interleaved runs through ``measure.verdict``."""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field

from .. import cli
from ..measure import format_model, gbps, verdict


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
    model: dict = field(default_factory=dict)  # the modeled host's counts for the run (RunFigures.model)

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


def format_table(results: list[BenchResult]) -> str:
    return cli.table(BenchResult.COLUMNS, [r.row() for r in results], 3)


def compare_steps(results: list[BenchResult]) -> list[str]:
    """Each step against the one before: a gain or a loss only when the two runs' ranges (min-max of the
    interleaved runs) do not overlap; otherwise noise."""
    lines = []
    for before, after in zip(results, results[1:]):
        ratio = after.gbps / before.gbps if before.gbps else float("inf")
        lines.append(f"  {before.label} -> {after.label}: x{ratio:.2f}, "
                     f"{verdict(before.runs_gbps, after.runs_gbps)}")
    return lines


def cores_used(results: list[BenchResult]) -> str:
    """What the "threads w+t" column means, in words: each writer and target thread polls a core of its own,
    on the cores this process may use; and how the target knew the run complete."""
    cores = max(r.cores for r in results)
    groups = sorted({r.groups for r in results})
    how = ("counting every write" if all(r.counted for r in results) else
           "waiting for each NIC's last write (as the article's receiver)" if not any(r.counted for r in results)
           else "counting every write in some runs, only each NIC's last in others")
    where = ("each on a core of the modeled p5 (modeled time: each thread's own CPU time, whatever the "
             f"{cores} core(s) here)" if any(r.model for r in results) else
             f"each polling a core of its own, on the {cores} core(s) this process may use")
    return (f"threads w+t: writer threads + target threads, {where}; {', '.join(map(str, groups))} GPU group(s); "
            f"the target verified each run {how}")


def print_results(results: list[BenchResult], as_json: bool, line_rate_bps: float = 0.0) -> None:
    if any(r.modeled for r in results):
        print("MODELED figures: NICs and host of the sim provider (docs/model.md); "
              + ("elapsed s, Gbps and % of line are modeled time on the modeled p5; ns CPU/op is this machine's"
                 if any(r.model for r in results) else
                 "Gbps and % of line are the model's line on the wall clock (FABRICLAB_SIM_TIME=wall), the CPU "
                 "cost is this machine's"))
    print(cores_used(results))
    if any(len(r.runs_gbps) > 1 for r in results):
        print(f"Gbps: median of {len(results[0].runs_gbps)} interleaved runs (min-max)")
    print(format_table(results))
    if any(len(r.runs_gbps) > 1 for r in results) and len(results) > 1:
        print("step by step:")
        print("\n".join(compare_steps(results)))
    if any(r.model for r in results):
        print("what the modeled p5 host charged, per write (docs/model.md):")
        print(format_model(results))
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
            split = ", ".join(f"{n['nic']}:{gbps(n['bytes'], r.elapsed_s):.2f}" for n in r.per_nic[:32]) \
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


def format_api(r: dict) -> str:
    """api_comparison's result in words: both paths' Gbps, the Python cost per call, the layout both ran and,
    for GPU memory, the path each region took and what went through the staging pools."""
    lines = [f"{r['provider']}, {cli.format_size(r['page_size'])} pages, "
             f"{r['memory']} memory: stage-15 path {r['raw_gbps']:.2f} Gbps, Engine.write_pages {r['api_gbps']:.2f} "
             f"Gbps ({r['ratio'] * 100:.1f} % of it); medians of {len(r['raw_runs'])} alternating runs "
             f"(stage 15: {', '.join(f'{g:.1f}' for g in r['raw_runs'])}; Engine: "
             f"{', '.join(f'{g:.1f}' for g in r['api_runs'])}); the calling thread ran on cores "
             f"{','.join(map(str, r['caller_cores']))}",
             "Python cost per write_pages call: " + ", ".join(f"{n} page(s) {us:.1f} us"
                                                            for n, us in r["us_per_call"].items()),
             *_describe_small(r["small"]),
             _describe_api_layout(r["layout"])]
    if r["memory"] == "cuda":
        for side in ("source", "target"):
            path = r[side]
            lines.append(f"Engine {side} region: {path['path']}" + (f" ({path['why']})" if path["why"] else ""))
        writes = r["writes"]
        lines.append(f"Engine writes went: {writes['path']}" + (f" (not cuda-ipc: {writes['why']})" if writes["why"]
                                                                  else ""))
        lines.append(f"stage-15 path memory: {r['raw_memory']}")
        for side, staging in (("source", r["staging"]), ("target", r["target_staging"])):
            lines.append(f"staging on the {side} side: {describe_staging(staging)}")
    return "\n".join(lines)


def _describe_small(small: dict) -> list[str]:
    """api_comparison's small-transfer figures in words (none where it measured none)."""
    if not small:
        return []
    rates = ", ".join(f"{rate / 1e6:.2f} M pages/s in requests of {pages} page(s)"
                      for pages, rate in small["pages_per_s"].items())
    return [f"one page written and waited for: {small['us_waited']:.1f} us each ({small['transfers']} transfers, "
            "median of 3 runs)",
            f"write_batch of {small['batch']} requests, the call alone: {rates} (median of 3)"]


def _describe_api_layout(layout: dict) -> str:
    """api_comparison's "layout" in words: the one both paths ran, emulated slots said as such."""
    emulated = layout["emulated_nics"]
    nics = f"{layout['nics']} NIC slot(s)" + (f" ({emulated} emulated: endpoints sharing a domain)" if emulated else "")
    return (f"layout of both paths: {nics}, {layout['threads']} writer thread(s) for {layout['groups']} GPU "
            f"group(s); target threads: {layout['target_threads']} (stage 15), {layout['engine_target_threads']} "
            f"(Engine); NIC slots {layout['chosen']}")


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
    return f"{seconds:.3f} s copying ({gbps(nbytes, seconds) / 8:.1f} GB/s)"


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
        paths = result["paths"]
        lines.append(f"GPU memory on both sides: the source {paths['source']}, the target {paths['target']}; the "
                     f"writes went {paths['writes']}" + (f" ({paths['writes_why']})" if paths["writes_why"] else "")
                     + " (the memcpy ceiling is host memory's)")
    lines.append(f"medians of {result['rounds']} rounds, layouts taking turns; defaults here ({result['cores']} "
                 f"cores): {result['defaults'].get('repr', '')}")
    return "\n".join(lines)
