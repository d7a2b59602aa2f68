"""Lessons 09-16's measuring helpers: interleaved runs of the engine's chapters, medians and spreads,
per-write counters, each chapter's mechanism, checked facts and predictions, and the reader's figure beside
the article's and beside a recording. ``fabriclab.course.lesson`` re-exports every name, so a
notebook writes ``lesson.fact(...)``.
"""
from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
from typing import Any, NamedTuple

import numpy as np

from .. import fi, measure, nics, recorded, threaded
from .showing import LocalPair, fabric, show_code

# --------------------------------------------------------------- chapters 9-15: the engine, measured
# Lesson 09 explains these; lessons 09 to 15 use them. Every figure comes from a real run through
# tools.bench (a target process, real bytes on the default provider), or from the engine's C benchmark.
# The course does not import the tools (they sit beside it, tests/test_layers.py), so a lesson passes the
# bench module in: ``lesson.nic_scaling(bench)``.

#: Lessons 09-15's runs: 4 NIC slots, 2 GPU groups, 64 KiB pages as in the article, 64 MiB per run.
ENGINE_SETUP = dict(nics=4, threads=2, page_size=64 << 10, total=64 << 20)
#: Every run's pages cycle over a region this large (as the article writes the same 1000 pages again and
#: again); a small region keeps the untimed set-up and the target's byte check short.
REGION_BYTES = 32 << 20
#: The modeled p5 (docs/model.md): 32 NICs of 100 Gbps whose DMA costs the host nothing.
MODEL = fi.MODELED_PROVIDER
#: Runs on the model move no payload by default, so there a smaller region (pages written again and again)
#: only shortens the untimed set-up and the target's check.
MODEL_REGION_BYTES = 4 << 20
#: Lessons 13-15's runs on the model: the article's 32 NICs (3200 Gbps) and, in modeled time, its 8 GPU
#: groups (chapter_runs), 512 MiB per run.
MODEL_SETUP = {**{k: v for k, v in ENGINE_SETUP.items() if k != "threads"}, "nics": 32, "total": 512 << 20}
#: The engine's C sources a lesson quotes from: the course's loops first, then the core under them.
NATIVE_C = ("course.c", "core.c", "core_internal.h", "sharing.c")


def project_file(*parts: str) -> pathlib.Path:
    """A file or folder of this project's checkout, such as ``project_file("native", "core.c")`` or
    ``project_file("examples")``. The lessons quote the C engine and run the examples from there."""
    root = pathlib.Path(__file__).resolve().parents[2]
    path = root.joinpath(*parts)
    if not path.exists():
        raise fi.UsageError(f"{path} does not exist: the lessons need fabriclab's source checkout "
                            "(pip install -e . from a clone), not an installed wheel")
    return path


def c_excerpt(first: str, through: str | None = None, until: str | None = None) -> tuple[str, str]:
    """(title, text) of a piece of the engine's C: from the first of NATIVE_C that holds ``first``, the line
    holding ``first`` (with the comment right above it) to the line holding ``until``, or else to the end
    of the function or struct that holds ``through`` (or ``first``)."""
    native = project_file("native")
    path = next((native / name for name in NATIVE_C if first in (native / name).read_text()), None)
    if path is None:
        raise LookupError(f"{first!r} is in none of {NATIVE_C} under {native}: the lesson needs updating")
    lines = path.read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if first in line)
    while start > 0 and lines[start - 1].lstrip().startswith(("/*", "*")):
        start -= 1
    if until is not None:
        end = next(i for i in range(start, len(lines)) if until in lines[i])
    else:
        end = next(i for i in range(start, len(lines)) if (through or first) in lines[i])
        if not lines[end].rstrip().endswith(";"):
            end = next(i for i in range(end, len(lines)) if lines[i].startswith("}"))
    return f"native/{path.name}, lines {start + 1}-{end + 1}", "\n".join(lines[start:end + 1])


def show_c(first: str, through: str | None = None, until: str | None = None) -> None:
    """Show a piece of the engine's C source (see ``c_excerpt``)."""
    title, text = c_excerpt(first, through, until)
    show_code(text, "c", title)


class _SmallRegion:
    """Runs inside write pages cyclically over REGION_BYTES, or MODEL_REGION_BYTES on the model (the
    stages size their region by the total, up to rdma_write.DEFAULT_BUFFER_LIMIT)."""

    def __init__(self, provider: str | None) -> None:
        self.region = MODEL_REGION_BYTES if provider == MODEL else REGION_BYTES

    def __enter__(self):
        from .. import rdma_write
        self.module, self.saved = rdma_write, rdma_write.DEFAULT_BUFFER_LIMIT
        rdma_write.DEFAULT_BUFFER_LIMIT = self.region

    def __exit__(self, *exc):
        self.module.DEFAULT_BUFFER_LIMIT = self.saved
        return False


def interleaved(bench, variants: dict, rounds: int = 3, provider: str | None = None, **setup) -> dict:
    """Run each variant (label → BenchConfig fields, over ENGINE_SETUP and ``setup``) ``rounds`` times,
    A B C A B C ..., through one target, so that slow spells of a shared machine fall on every variant
    alike. Returns label → list of tools.bench.BenchResult."""
    provider, domain = fabric(provider)
    base = {**ENGINE_SETUP, "provider": provider, "domain": domain, **setup}
    out = {label: [] for label in variants}
    with _SmallRegion(provider), bench.Bench(provider, domain) as target:
        for _ in range(rounds):
            for label, fields in variants.items():
                config = bench.BenchConfig(**{**base, **fields})
                out[label].append(target.run(config, label=label))
    return out


def spread(values) -> tuple[float, float, float]:
    """(median, min, max) of some measurements."""
    values = sorted(values)
    return float(np.median(values)), values[0], values[-1]


def _figure(x: float) -> str:
    """A measured figure at a sensible precision: 27,364 or 3.42."""
    return f"{x:,.0f}" if abs(x) >= 100 else f"{x:.3g}"


def verdict(a, b, names: tuple[str, str] = ("A", "B"), unit: str = "") -> str:
    """Compare two lists of measurements by median and min-max: a difference is only called one when the
    two ranges do not overlap; otherwise it is noise."""
    (ma, la, ha), (mb, lb, hb) = spread(a), spread(b)
    shown = (f"{names[0]} {_figure(ma)} ({_figure(la)}-{_figure(ha)}){unit}, "
             f"{names[1]} {_figure(mb)} ({_figure(lb)}-{_figure(hb)}){unit}: ")
    if measure.verdict((la, ha), (lb, hb)) != measure.NOISE:  # the one rule, bench's too
        return shown + f"{names[1]} / {names[0]} = {mb / ma:.2f}x, outside the spread"
    return shown + "the ranges overlap: noise"


# What a run's per-NIC counters say per accepted write (NativeEngine.counters: the C engine counts per NIC).

def accepted_writes(r) -> int:
    """Writes the provider accepted (fi_writemsg returned 0), warm-up writes included."""
    return sum(n["writes"] for n in r.per_nic)


def cq_reads_per_write(r) -> float:
    """fi_cq_read calls per accepted write (lesson 09: one thread reads every NIC's queue each pass)."""
    return sum(n["cq_polls"] for n in r.per_nic) / max(1, accepted_writes(r))


def passes_per_write(r) -> float:
    """Passes of the worker loops per accepted write (lesson 14). Each pass of a thread visits every NIC
    it owns once, and the C engine counts the visits per NIC; the NICs are spread evenly over the threads."""
    visits = sum(n["passes"] for n in r.per_nic)
    return visits * r.threads / max(1, r.nics) / max(1, accepted_writes(r))


def writemsg_calls_per_write(r) -> float:
    """fi_writemsg calls per accepted write (lesson 15): every call is accepted, refused (-FI_EAGAIN) or
    an error."""
    calls = sum(n["writes"] + n["eagain"] + n["errors"] for n in r.per_nic)
    return calls / max(1, accepted_writes(r))


def eagain_per_write(r) -> float:
    """-FI_EAGAIN answers per accepted write (lessons 14 and 15)."""
    return sum(n["eagain"] for n in r.per_nic) / max(1, accepted_writes(r))


def writes_per_second(r) -> float:
    return r.mops * 1e6


def per_variant(results: dict, metric) -> dict:
    """label → [metric(run) for each run]: what figures.spread_panels draws."""
    return {label: [metric(r) for r in runs] for label, runs in results.items()}


def every_write_counted(results) -> bool:
    """Every run verified by its target: all its writes landed (counted one by one in the checking mode,
    proved by the run's last writes and the writer's word otherwise: multi_nic.MultiNicTarget), none
    twice, every byte as sent."""
    return all(r.verified and r.landed == r.writes and not r.duplicates for r in results)


# ---- lesson 09: writes/s one thread sustains against the NICs it services

def nic_scaling(bench, nic_counts=(1, 2, 4, 8), rounds: int = 3, provider: str | None = None, **setup) -> dict:
    """Chapter 9's loop (one thread, one group, warm-up off) over 1, 2, 4, 8 NIC slots: label → runs."""
    variants = {n: {"stage": "multi_nic", "nics": n, "threads": 1, "groups": 1, "warmup": False}
                for n in nic_counts}
    return interleaved(bench, variants, rounds, provider, **setup)


# ---- lesson 10: the first write on each NIC against a warmed-up one

def first_write_latency(nics: int = 4, warm: int = 20, size: int = 64 << 10, provider: str | None = None,
                        domain: str | None = None) -> list[tuple[float, list[float]]]:
    """For each of ``nics`` fresh endpoint pairs (a NIC slot and its peer, as in chapter 9): µs from posting
    the first RDMA write to reading its completion, and the same for the ``warm`` writes after it.
    One write in flight at a time, both sides polled by this thread (LocalPair)."""
    out = []
    for _ in range(nics):
        with LocalPair(provider, domain, size=size) as pair:
            times = []
            for k in range(warm + 1):
                pair.post_write(("w", k), size)
                pair.wait()
                op = pair.trace.ops[("w", k)]
                times.append((op.completed - op.posted) * 1e6)
            out.append((times[0], times[1:]))
    return out


def first_contact_on_the_model(latency_us: float, nics: int = 4, warm: int = 20) -> list[tuple[float, list[float]]]:
    """first_write_latency on the modeled p5 with a one-way latency of ``latency_us`` (the model's
    FABRICLAB_SIM_LATENCY_US), in a process of its own (the provider reads its settings when it starts). On the
    model a write's time is modeled time, which counts this Python loop's own time too: a latency much longer
    than that makes the first write's handshake (two latencies) stand out from it."""
    code = ("import json; from fabriclab.course import lesson; "
            f"print(json.dumps(lesson.first_write_latency(nics={nics}, warm={warm}, provider={MODEL!r})))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "FABRICLAB_SIM_LATENCY_US": str(latency_us)})
    if done.returncode != 0:
        raise fi.FabricError(f"first writes on the model failed: {done.stderr.strip()[-500:]}")
    return [(first, list(rest)) for first, rest in json.loads(done.stdout.splitlines()[-1])]


# ---- lesson 11: writes/s against threads

def thread_scaling(bench, thread_counts=None, rounds: int = 3, provider: str | None = None, **setup) -> dict:
    """Chapter 11's stage (a thread per group, not pinned, shared atomics) with 1, 2, 4, ... threads (by
    default every power of two up to this machine's cores, at most 8) over the same NIC slots:
    label → runs."""
    import os
    if thread_counts is None:
        thread_counts = [t for t in (1, 2, 4, 8) if t <= (os.cpu_count() or 1)]
    variants = {t: {"stage": "threaded", "threads": t, "groups": t, "pin": False, "shard": False}
                for t in thread_counts}
    return interleaved(bench, variants, rounds, provider, **setup)


# ---- lesson 12: thread migrations, pinned or not

WRITER_THREAD_NAME = "fl-writer"  # course.c names its writer threads so


class MigrationWatch:
    """Samples ``nr_migrations`` (``/proc/self/task/<tid>/sched``: how often the scheduler moved a thread to
    another CPU) of this process's engine writer threads every ``interval`` seconds while it is open.
    ``by_thread``: tid → the last count seen; ``at_pin``: tid → the count at the first sample that found the
    thread allowed on one CPU only (pinned: the move onto that CPU happens inside the pinning call, so it is
    counted there, and a thread may have been moved before, while it started). A thread's moves after the
    last sample before it ended are not seen. Needs a kernel with scheduler statistics (``available``)."""

    def __init__(self, interval: float = 0.005):
        import threading
        self.interval = interval
        self.by_thread: dict[int, int] = {}
        self.at_pin: dict[int, int] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    @staticmethod
    def available() -> bool:
        return pathlib.Path(f"/proc/self/task/{_own_tid()}/sched").exists()

    def _sample(self) -> None:
        tasks = pathlib.Path("/proc/self/task")
        while not self._stop.is_set():
            for task in tasks.iterdir():
                try:
                    if (task / "comm").read_text().strip() != WRITER_THREAD_NAME:
                        continue
                    tid, count = int(task.name), _migrations(task)
                    self.by_thread[tid] = count
                    if tid not in self.at_pin and len(os.sched_getaffinity(tid)) == 1:
                        self.at_pin[tid] = count
                except (FileNotFoundError, ProcessLookupError, ValueError, OSError):
                    continue  # the thread ended between listing and reading
            self._stop.wait(self.interval)

    @property
    def total(self) -> int:
        return sum(self.by_thread.values())

    @property
    def after_pinning(self) -> int:
        """Moves of the pinned threads after they were pinned (the kernel allows none)."""
        return sum(self.by_thread[tid] - count for tid, count in self.at_pin.items())

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        return False


def _migrations(task: pathlib.Path) -> int:
    for line in (task / "sched").read_text().splitlines():
        if line.startswith("se.nr_migrations"):
            return int(line.split(":")[1])
    raise ValueError(f"no se.nr_migrations in {task / 'sched'}")


def _own_tid() -> int:
    import threading
    return threading.get_native_id()


class PinRun(NamedTuple):
    result: Any  # bench.BenchResult
    moves: int  # the writer threads' migrations during the run
    after_pinning: int  # those that came after a thread had pinned itself


def pinning(bench, rounds: int = 3, provider: str | None = None, **setup) -> dict:
    """Chapters 11 (not pinned) and 12 (pinned), interleaved: label → list of ``PinRun`` (the BenchResult,
    its writer threads' migrations, and those of them that came after the threads were pinned)."""
    provider, domain = fabric(provider)
    base = {**ENGINE_SETUP, "provider": provider, "domain": domain, "stage": "threaded", "shard": False, **setup}
    out = {"not pinned": [], "pinned": []}
    with _SmallRegion(provider), bench.Bench(provider, domain) as target:
        for _ in range(rounds):
            for label, pin in (("not pinned", False), ("pinned", True)):
                with MigrationWatch() as watch:
                    r = target.run(bench.BenchConfig(**{**base, "pin": pin}), label=label)
                out[label].append(PinRun(r, watch.total, watch.after_pinning))
    return out


# ---- lesson 13: ns per counter update: a shared atomic, slots in one cache line, padded slots

COUNTER_LAYOUTS = {"shared atomic (ch 11-12)": "FL_SHARED_ATOMIC", "slots in one line (ch 13)": "FL_PACKED_SLOTS",
                   "a line each (13+)": "FL_PADDED_SLOTS"}


class CounterRounds(dict):
    """layout → ns per update of each round (what ``counter_update_ns`` returns), with ``overlap``: layout →
    the share of each round in which every thread was updating at once, on a CPU (native/sharing.c)."""

    def __init__(self, layouts: dict[str, str]) -> None:
        super().__init__({name: [] for name in layouts})
        self.overlap: dict[str, list[float]] = {name: [] for name in layouts}


def counter_update_ns(threads: int = 2, updates: int = 2_000_000, rounds: int = 5, min_overlap: float = 0.9,
                      tries: int = 5) -> CounterRounds:
    """The engine's C benchmark (native/sharing.c): ``threads`` threads, each pinned to its own allowed
    core where there are enough, start together from a barrier and update their counter ``updates`` times;
    layouts interleaved ``rounds`` times. False sharing costs only while the threads update at the same
    time, so a round whose threads overlapped for less than ``min_overlap`` of it (one was off its core:
    a busy machine, or more threads than cores) is run again, up to ``tries`` times, and the best-overlapped
    attempt is kept. Returns layout → list of ns per update, with each kept round's overlap in ``.overlap``."""
    import os
    from .. import _native
    cores = sorted(os.sched_getaffinity(0))[:threads]
    out = CounterRounds(COUNTER_LAYOUTS)
    for _ in range(rounds):
        for name, layout in COUNTER_LAYOUTS.items():
            best = (-1.0, 0.0)
            for _ in range(max(1, tries)):
                ns, overlap = _native.counter_update_ns(layout, threads, updates, cores)
                if ns < 0:
                    raise fi.UsageError(f"counter benchmark refused {threads} threads x {updates} updates")
                if overlap > best[0]:
                    best = (overlap, ns)
                if best[0] >= min_overlap:
                    break
            out.overlap[name].append(best[0])
            out[name].append(best[1])
    return out


# ---- lesson 14: CPU, CQ reads and passes per write against the batch size

def batch_sweep(bench, batches=(1, 4, 16, 64), rounds: int = 3, provider: str | None = None, **setup) -> dict:
    """Chapter 14's stage (eager posting) with ``batch`` writes added per group per pass, one thread over
    the NIC slots (so the writer has a core to itself beside the target's): label → runs."""
    variants = {b: {"stage": "batched", "batch": b, "lazy": False, "threads": 1, "groups": 1} for b in batches}
    return interleaved(bench, variants, rounds, provider, **setup)


# ---- lesson 15: fi_writemsg calls and refusals per accepted write, eager against lazy, and FI_MORE

def lazy_sweep(bench, rounds: int = 3, provider: str | None = None, batch: int = 16, **setup) -> dict:
    """Chapter 14 (eager), 15 (lazy) and 15+ (lazy with FI_MORE), one thread, ``batch`` writes added per
    pass: label → runs."""
    variants = {"14 eager": {"lazy": False}, "15 lazy": {"lazy": True}, "15+ FI_MORE": {"lazy": True, "fi_more": True}}
    common = {"stage": "batched", "batch": batch, "threads": 1, "groups": 1}
    return interleaved(bench, {k: {**common, **v} for k, v in variants.items()}, rounds, provider, **setup)


# ---- the article's figures beside the reader's (lessons 09-16)

def article(chapter: str):
    """The article's (Gbps, percent of its line rate) for a chapter, or None for this project's extras."""
    from .tour import ARTICLE_GBPS
    if not chapter.isdigit() or int(chapter) not in ARTICLE_GBPS:
        return None
    gbps, line = ARTICLE_GBPS[int(chapter)]
    return gbps, 100 * gbps / line


# ---- a recorded progression (fabriclab.recorded) beside the reader's

def beside_recorded(measured: dict[str, float], measured_label: str,
                    recording: recorded.Recording | None = None, **options: Any) -> Any:
    """course.figures.progression_bars (a matplotlib Figure) of the reader's percentages with the
    recording's beside them, labelled "recorded" with its cores and provider, after printing where it was
    recorded; without a recording shipped it prints that and draws the reader's alone. ``measured`` must be the recording's
    measure (``Chapter.percent``: % of the line on the model, as lesson 16 draws it), or the bars compare
    nothing. ``options`` go to figures.progression_bars."""
    from . import figures
    recording = recording if recording is not None else recorded.shipped()
    if recording is None:
        print(f"no recording is shipped with this fabriclab; {recorded.HOW}")
        return figures.progression_bars(measured, measured_label=measured_label, **options)
    print(recording.describe())
    return figures.progression_bars(measured, measured_label=measured_label, recorded=recording.percents(),
                                    recorded_label=recording.label, **options)


# ------------------------------------------------ lessons 09-12: checked facts, chapters on the model
# A lesson states a measured relation only through ``fact`` (the relation, its tolerance, and whether it held,
# printed plainly so that a re-execution that contradicts the prose fails nbval), or says with ``not_shown``
# why this machine cannot show it. ``check`` scores an exercise's prediction against a measurement.

#: Runs on the model move 1 GiB (16,384 writes of 64 KiB): long enough for a scheduler's time slices to
#: average out, short enough for a lesson of several dozen runs.
MODEL_TOTAL = 1 << 30


def numa_nodes() -> int:
    """NUMA nodes of this machine (sysfs; 1 where it does not say)."""
    return max(1, len(list(pathlib.Path("/sys/devices/system/node").glob("node[0-9]*"))))


def box(provider: str | None = None) -> str:
    """What a measurement ran on, in words: cores this process may use, NUMA nodes and the provider."""
    import os
    cores = len(os.sched_getaffinity(0))
    where = f"{cores} core(s) this process may use, {numa_nodes()} NUMA node(s)"
    return where + (f", provider {provider}" + (" (modeled)" if provider == MODEL else "") if provider else "")


def fact(claim: str, holds: bool, tolerance: str) -> None:
    """Print a measured relation as a checked fact: what is claimed, within what tolerance, and whether it held
    (nbval compares the line; nothing is returned, so a cell ending in a fact echoes no stray ``True``)."""
    print(f"{'holds' if holds else 'DOES NOT HOLD'}: {claim} [tolerance: {tolerance}]")


def not_shown(claim: str, why: str) -> None:
    """Say that this machine cannot show a relation, and why (its cores, its provider)."""
    print(f"not shown here: {claim}; {why}")


def check(what: str, predicted: float, measured: float, within: float = 0.25, absolute: bool = False) -> bool:
    """An exercise's prediction against what was measured: right when it is within ``within`` of it
    (relative: 0.25 is ±25 %; with ``absolute``, in the measurement's own unit, for counts that may be 0).
    Prints both and returns whether the prediction was right."""
    try:
        predicted, measured, within = float(predicted), float(measured), float(within)
    except (TypeError, ValueError):
        raise fi.UsageError(f"{what}: the prediction must be a number; put yours in place of {predicted!r}") from None
    if not (np.isfinite(predicted) and np.isfinite(measured) and np.isfinite(within)
            and (within > 0 or absolute and within == 0)):
        raise fi.UsageError(f"{what}: prediction {predicted!r}, measurement {measured!r} and tolerance {within!r} "
                            "must be finite numbers, the tolerance positive (0 only with absolute=True, for counts)")
    off = abs(predicted - measured) if absolute else abs(predicted - measured) / max(abs(measured), 1e-12)
    right = off <= within
    shown = (lambda x: _figure(x)) if absolute else (lambda x: f"{x:.0%}")
    print(f"{what}: predicted {_figure(predicted)}, measured {_figure(measured)} -> "
          f"{'right' if right else 'wrong'}: off by {shown(off)}, right within {shown(within)}")
    return right


def relation(what: str, value: float, reference: float, against: str, within: float = 0.2) -> str:
    """``what`` as a multiple of ``against`` in words chosen by the numbers: "within 20 % of" it, or above
    or below it by more, so the sentence a lesson prints never says more than its run showed."""
    ratio = value / reference if reference else float("inf")
    margin = f"{within * 100:.0f} %"
    if abs(ratio - 1) <= within:
        word = f"within {margin} of {against}"
    else:
        word = f"{'above' if ratio > 1 else 'below'} {against} by more than {margin}"
    return f"{what}: {_figure(value)} = {_figure(ratio)} x {against} ({_figure(reference)}): {word}"


def chapter_runs(bench, chapters, rounds: int = 3, provider: str | None = None, **setup) -> dict:
    """Chapters of tools.bench.PROGRESSION ("12", "13+", ...; each with only its own techniques on,
    ``threads`` as the GPU groups of every chapter as bench.progression has it) as variants of one
    interleaved run through one target, on ENGINE_SETUP and ``setup`` (lessons 13-15 pass MODEL_SETUP):
    chapter → runs. On the modeled host (nics.modeled_host) the article's 8 GPU groups unless ``threads``
    says otherwise: its figures are modeled time, which this box's cores do not bound."""
    if nics.modeled_host(provider) and "threads" not in setup:  # a group needs a NIC of its own
        setup = {**setup, "threads": min(threaded.ARTICLE_THREADS, {**ENGINE_SETUP, **setup}["nics"])}
    groups = {**ENGINE_SETUP, **setup}["threads"]
    wanted = [str(c) for c in chapters]
    variants = {chapter: {"stage": stage, "groups": groups, **overrides}
                for chapter, _, stage, overrides in bench.PROGRESSION if chapter in wanted}
    missing = set(wanted) - set(variants)
    if missing:
        raise fi.UsageError(f"no chapter {', '.join(sorted(missing))} in bench.PROGRESSION; choose from "
                            + ", ".join(step[0] for step in bench.PROGRESSION))
    return interleaved(bench, variants, rounds, provider, **setup)


def share_of_line(r) -> float:
    """A run's Gbps as a percentage of its NICs' aggregate line rate (the model reports 100 Gbps a NIC),
    or of the memcpy ceiling where the provider reports no line rate (shm, tcp)."""
    return 100 * r.gbps / r.line_gbps if r.line_gbps else 100 * r.ratio_to_memcpy


def median_of(runs, metric) -> float:
    """The median of ``metric`` over some runs."""
    return spread(metric(r) for r in runs)[0]


def wall_ns_per_write(r) -> float:
    """ns each writer thread spent per write it made: the run's time × its writer threads / its writes."""
    return r.elapsed_s * r.threads / max(1, r.writes) * 1e9


def on_cpu_share(r) -> float:
    """The share of the run's time its writer threads were on a CPU: the writer process's CPU time per
    write (``cpu_ns_per_op``, warm-up and start included) over ``wall_ns_per_write``. Near 1: the threads
    had their cores; well below: they waited for a core (the target, the notebook, other processes)."""
    return r.cpu_ns_per_op / max(1e-9, wall_ns_per_write(r))


def chapter_table(results: dict) -> None:
    """One row per chapter of chapter_runs: Gbps median (min-max), % of the line (or of memcpy), writes
    per second, writer threads for its GPU groups and target threads, beside the article's figure; and where
    the time went (medians): in modeled time (the sim provider's host) each thread's own CPU time and the
    modeled costs per write, else the writer's CPU per write and its share of the run on a CPU."""
    for chapter, runs in results.items():
        r = runs[0]  # what every run of a chapter shares: its threads, groups and line
        gbps, share = spread(x.gbps for x in runs), spread(share_of_line(x) for x in runs)
        theirs = article(chapter)
        ref = f"article {theirs[0]:7.1f} Gbps = {theirs[1]:4.1f} %" if theirs else "(not in the article)"
        of = "of line" if r.line_gbps else "of memcpy"
        if r.model:  # modeled time: the thread's own time and the model's per write, summed over the threads
            own, calls, host = (median_of(runs, lambda x, k=k: measure.model_per_write(x)[k])
                                for k in ("app ns", "provider ns", "host ns"))
            went = f"per write {own:,.0f} ns own + {calls:,.0f} ns calls + {host:,.0f} ns host (modeled)"
        else:
            went = (f"{median_of(runs, lambda x: x.cpu_ns_per_op):,.0f} ns CPU/write, on a CPU "
                    f"{median_of(runs, on_cpu_share):.0%}")
        print(f"ch {chapter:<4}{gbps[0]:8.1f} Gbps ({gbps[1]:.1f}-{gbps[2]:.1f}) = {share[0]:5.1f} % {of} "
              f"({share[1]:.1f}-{share[2]:.1f}); {median_of(runs, lambda x: x.mops):.3f} M writes/s, {went}; "
              f"{r.threads} writer thread(s) for {r.groups} group(s) + {r.target_threads} target thread | {ref}")


def model_count(runs, column: str) -> float:
    """The median run's count per write in one of the modeled host's columns (fabriclab.measure.MODEL_COLUMNS:
    "CQ reads", "far socket", "line moves", "doorbells", "futile posts", ...; "migrations" per run)."""
    return median_of(runs, lambda r: measure.model_per_write(r)[column])


def model_table(results: dict) -> None:
    """What the modeled p5 host charged each chapter of chapter_runs, per write (its median run): the
    chapter's mechanism in counts, and its time split into the thread's own CPU time and the modeled
    costs (docs/model.md, "Modeled time")."""
    medians = [sorted(runs, key=lambda r: r.gbps)[(len(runs) - 1) // 2] for runs in results.values()]
    print(measure.format_model([r for r in medians if r.model]))


def progression_chart(results: dict, current: str, title: str, measured_label: str):
    """figures.progression_bars of chapter_runs' results (each chapter's median % of line, or of memcpy),
    with a bar from the min to the max of its runs on each measured bar."""
    from . import figures
    names = sorted(set(results) | {str(c) for c in range(9, 16)}, key=figures._chapter_key)
    shares = {c: spread(share_of_line(r) for r in runs) for c, runs in results.items()}
    fig = figures.progression_bars({c: s[0] for c, s in shares.items()}, current=current, chapters=names,
                                   measured_label=measured_label + " (median; bars: min to max)", title=title)
    ax = fig.axes[0]
    for i, name in enumerate(names):
        if name in shares:
            median, low, high = shares[name]
            ax.errorbar(i + 0.19, median, yerr=[[median - low], [high - median]], color="black", capsize=3, lw=1)
    return fig


def thread_migrations() -> int:
    """How often the scheduler has moved the calling thread to another CPU (``se.nr_migrations`` of
    /proc/thread-self/sched); -1 where the kernel keeps no scheduler statistics."""
    try:
        text = pathlib.Path("/proc/thread-self/sched").read_text()
    except OSError:
        return -1
    return next((int(line.split(":")[1]) for line in text.splitlines() if line.startswith("se.nr_migrations")), -1)


#: A noisy neighbour's program: busy for a few milliseconds, asleep for one, forever (until it is stopped).
_NEIGHBOUR = ("import sys, time\nwork, rest = float(sys.argv[1]), float(sys.argv[2])\nwhile True:\n"
              "    t = time.perf_counter()\n    while time.perf_counter() - t < work:\n        pass\n"
              "    time.sleep(rest)\n")


class NoisyNeighbour:
    """While open, a process that alternates ``work_ms`` of busy work with ``rest_ms`` asleep, as a shared
    machine's other jobs do: its wake-ups give the scheduler reasons to move threads (lesson 12). Stopped,
    by its own pid, on exit."""

    def __init__(self, work_ms: float = 2.0, rest_ms: float = 1.0):
        if not (work_ms > 0 and rest_ms > 0 and np.isfinite(work_ms) and np.isfinite(rest_ms)):
            raise fi.UsageError(f"work_ms and rest_ms must be positive milliseconds, got {work_ms!r}, {rest_ms!r}")
        self.work_ms, self.rest_ms = work_ms, rest_ms
        self.process = None

    def __enter__(self):
        import subprocess
        import sys
        self.process = subprocess.Popen([sys.executable, "-c", _NEIGHBOUR, str(self.work_ms / 1e3),
                                         str(self.rest_ms / 1e3)])
        return self

    def __exit__(self, *exc):
        self.process.kill()
        self.process.wait(timeout=10)
        return False


def model_total(gbps: float, seconds: float) -> int:
    """Bytes a run on the model should move to last about ``seconds`` at ``gbps`` (whole 64 KiB pages,
    between MODEL_TOTAL and 256 GiB)."""
    if not (gbps > 0 and seconds > 0):
        raise fi.UsageError(f"gbps and seconds must be positive, got {gbps!r}, {seconds!r}")
    pages = int(gbps * 1e9 / 8 * seconds) // ENGINE_SETUP["page_size"]
    return min(max(pages * ENGINE_SETUP["page_size"], MODEL_TOTAL), 256 << 30)
