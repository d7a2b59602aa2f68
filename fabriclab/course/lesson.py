"""Helpers shared by the lesson notebooks.

* ``show_source(obj)`` / ``show_diff(old, new)``: a stage's code, and what changed since the previous
  stage, straight from the modules (the library is the single source of truth; notebooks never copy code).
  In IPython they render as Markdown code blocks, elsewhere they are printed.
* ``fabric()`` / ``stage_args()``: which provider and domain a lesson runs on (IP-based providers are
  pinned to the loopback interface: a lesson never sends traffic off this host).
* ``LocalPair``: two endpoints in one process, for small demonstrations of posting and completing
  operations without a second process, with a ``Trace`` of when each operation was posted and completed.
* Chapters 9-15 (lesson 09 explains them): ``project_file``/``show_c`` (the engine's C), ``interleaved``
  runs with ``spread``/``verdict`` (median, min-max, noise), per-write counters (``cq_reads_per_write``,
  ``passes_per_write``, ``writemsg_calls_per_write``), each chapter's mechanism (``nic_scaling`` 09,
  ``first_write_latency`` 10, ``thread_scaling`` 11, ``pinning``/``MigrationWatch`` 12,
  ``counter_update_ns`` 13, ``batch_sweep`` 14, ``lazy_sweep`` 15) and ``progression`` beside the article.
"""
from __future__ import annotations

import difflib
import inspect
import pathlib
import textwrap
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from .. import fi

# Providers that run over IP: a lesson pins them to the loopback interface.


# ------------------------------------------------------------------------------------- showing code


def in_ipython() -> bool:
    """True inside a Jupyter kernel or an IPython shell (where rich display works)."""
    try:
        from IPython import get_ipython
    except ImportError:
        return False
    return get_ipython() is not None


def _where(obj) -> str:
    """'fabriclab/unidirectional.py: Sender.send' for an object whose source we can find."""
    try:
        path = pathlib.Path(inspect.getsourcefile(obj) or "?")
    except TypeError:
        return repr(obj)
    package = pathlib.Path(__file__).resolve().parents[1]  # the fabriclab package, wherever it was checked out
    try:
        shown = "fabriclab/" + path.resolve().relative_to(package).as_posix()
    except ValueError:
        shown = path.name
    name = getattr(obj, "__qualname__", None) or getattr(obj, "__name__", "")
    return f"{shown}: {name}" if name and not inspect.ismodule(obj) else shown


def source(obj) -> str:
    """The source text of a module, class, function or method (dedented); a str is returned as is."""
    if isinstance(obj, str):
        return obj
    return textwrap.dedent(inspect.getsource(obj))


def label(obj) -> str:
    """How an object is named in headings and diff headers."""
    return "text" if isinstance(obj, str) else _where(obj)


def diff(old, new, context: int = 3, names: tuple[str, str] | None = None) -> str:
    """Unified diff from ``old``'s source to ``new``'s (each an object, or a str taken as the text);
    ``names`` overrides the two headers."""
    old_text, new_text = source(old), source(new)
    old_name, new_name = names or (label(old), label(new))
    lines = difflib.unified_diff(old_text.splitlines(), new_text.splitlines(), fromfile=old_name,
                                 tofile=new_name, n=context, lineterm="")
    return "\n".join(lines)


def _fence(text: str) -> str:
    """A backtick fence longer than any run of backticks inside ``text``."""
    longest, run = 0, 0
    for ch in text:
        run = run + 1 if ch == "`" else 0
        longest = max(longest, run)
    return "`" * max(3, longest + 1)


def show_code(text: str, language: str = "python", title: str | None = None) -> None:
    """Display ``text`` as a code block: Markdown in IPython, plain text elsewhere."""
    if in_ipython():
        from IPython.display import Markdown, display
        fence = _fence(text)
        heading = f"**{title}**\n\n" if title else ""
        display(Markdown(f"{heading}{fence}{language}\n{text.rstrip()}\n{fence}"))
    else:
        if title:
            print(f"--- {title}")
        print(text.rstrip())


def show_source(obj, title: str | None = None) -> None:
    """Show the source of a module, class, function or method, headed by where it lives."""
    show_code(source(obj), "python", title or label(obj))


def show_diff(old, new, context: int = 3, title: str | None = None, names: tuple[str, str] | None = None) -> None:
    """Show what changed from ``old`` to ``new`` (e.g. one stage's ``serve`` and the next one's)."""
    old_name, new_name = names or (label(old), label(new))
    text = diff(old, new, context, (old_name, new_name))
    show_code(text or f"(no differences between {old_name} and {new_name})", "diff",
              title or f"{old_name} → {new_name}")


# ------------------------------------------------------------------------------- choosing a fabric

#: (provider, domain) for a lesson on this host; written once, in the binding, for the examples too.
fabric = fi.same_host_fabric


def stage_args(provider: str, domain: str | None = None) -> list[str]:
    """The ``--provider``/``--domain`` options that make a stage's server use the same fabric."""
    return ["--provider", provider] + (["--domain", domain] if domain else [])


# ------------------------------------------------------------------------ two endpoints, one process


@dataclass
class Op:
    """One posted operation as the trace saw it (times from time.perf_counter, in seconds)."""
    token: Any
    side: str            # "receiver" or "sender"
    kind: str            # "recv", "send", "write"
    length: int
    posted: float        # the post call was entered
    returned: float      # the post call returned (the operation is now the provider's)
    refusals: int = 0    # how many times the provider answered -FI_EAGAIN first
    completed: float | None = None  # the completion was read from the queue
    completion_length: int | None = None


@dataclass
class Trace:
    """Posts and completions, keyed by the token each operation carries, and the polls that found them
    (``polls``: (start, end, completions) of every poll that read at least one completion)."""
    ops: dict = field(default_factory=dict)
    polls: list = field(default_factory=list)

    def posted(self, op: Op) -> None:
        if op.token in self.ops:
            raise fi.UsageError(f"token {op.token!r} is already in flight: give every operation its own")
        self.ops[op.token] = op

    def completed(self, token, when: float, length: int) -> None:
        op = self.ops.get(token)
        if op is not None:
            op.completed, op.completion_length = when, length

    @property
    def pending(self) -> list[Op]:
        return [op for op in self.ops.values() if op.completed is None]

    def clear(self) -> None:
        self.ops.clear()
        self.polls.clear()

    def rows(self) -> list[Op]:
        return sorted(self.ops.values(), key=lambda op: op.posted)


class LocalPair:
    """Two endpoints on one fabric in this process: ``receiver`` and ``sender``, which knows the
    receiver's address. Each has one registered buffer of ``size`` bytes.

    Nobody else polls here, and software providers only make progress while someone polls, so every
    method that waits polls *both* completion queues. ``trace`` records when each operation was posted
    and when its completion was read.
    """

    def __init__(self, provider: str | None = None, domain: str | None = None, size: int = 1 << 20,
                 timeout: float = fi.DEFAULT_TIMEOUT):
        if domain is None:
            provider, domain = fabric(provider)  # IP-based providers stay on the loopback interface
        self.timeout = timeout
        self.receiver = fi.open_endpoint(provider, domain)
        try:
            self.sender = fi.open_endpoint(provider, domain)
            # Zero-filled explicitly so every page is touched now, not during the first transfer.
            self.inbox = np.empty(size, dtype=np.uint8)
            self.outbox = np.empty(size, dtype=np.uint8)
            self.inbox.fill(0)
            self.outbox.fill(0)
            self.inbox_mr = self.receiver.register(self.inbox)
            self.outbox_mr = self.sender.register(self.outbox)
            self.dest = self.sender.av.insert(self.receiver.ep.address())
        except BaseException:
            self.close()
            raise
        self.info = self.sender.info
        self.trace = Trace()

    # -- polling

    def poll(self) -> int:
        """Read both completion queues once; returns how many completions of traced operations arrived."""
        now = time.perf_counter
        start = now()
        seen = 0
        for stack in (self.receiver, self.sender):
            for c in stack.cq.poll():
                if c.token is not None:
                    self.trace.completed(c.token, now(), c.length)
                    seen += 1
        if seen:
            self.trace.polls.append((start, now(), seen))
        return seen

    def wait(self, done: Callable[[], bool] | None = None, timeout: float | None = None) -> None:
        """Poll until ``done()`` (default: nothing traced is pending); FabricTimeout after ``timeout``."""
        done = done or (lambda: not self.trace.pending)
        timeout = self.timeout if timeout is None else timeout
        deadline = time.monotonic() + timeout
        while not done():
            self.poll()
            if time.monotonic() > deadline:
                raise fi.FabricTimeout(f"{len(self.trace.pending)} operation(s) completing", timeout)

    # -- posting

    def _post(self, attempt: Callable[[], bool], token, side: str, kind: str, length: int,
              retry: bool = True) -> bool:
        """Post with ``attempt`` (a try_post_* call); on -FI_EAGAIN poll and retry, unless ``retry`` is
        False, in which case return False and record nothing."""
        start = time.perf_counter()
        refusals = 0
        deadline = time.monotonic() + self.timeout
        while not attempt():
            if not retry:
                return False
            refusals += 1
            self.poll()
            if time.monotonic() > deadline:
                raise fi.FabricTimeout(f"posting a {kind}", self.timeout, "the provider kept answering -FI_EAGAIN")
        self.trace.posted(Op(token, side, kind, length, start, time.perf_counter(), refusals))
        return True

    def post_recv(self, token, length: int | None = None, offset: int = 0, retry: bool = True) -> bool:
        """The receiver posts a receive of up to ``length`` bytes (default: the rest of its buffer)."""
        length = self.inbox.size - offset if length is None else length
        return self._post(lambda: self.receiver.ep.try_post_recv(self.inbox_mr, offset, length, token),
                          token, "receiver", "recv", length, retry)

    def post_send(self, token, length: int, offset: int = 0, retry: bool = True) -> bool:
        """The sender posts a send of ``length`` bytes of its buffer from ``offset``."""
        return self._post(lambda: self.sender.ep.try_post_send(self.outbox_mr, offset, length, self.dest, token),
                          token, "sender", "send", length, retry)

    def post_write(self, token, length: int, offset: int = 0, remote_offset: int = 0,
                   retry: bool = True) -> bool:
        """The sender RDMA-writes ``length`` bytes into the receiver's buffer (one-sided: the receiver
        posts nothing and sees no completion)."""
        remote = self.inbox_mr.remote()
        return self._post(lambda: self.sender.ep.try_post_write(self.outbox_mr, offset, length, self.dest, remote,
                                                                remote_offset, token),
                          token, "sender", "write", length, retry)

    # -- a tiny fi_rma_bw

    def write_bandwidth(self, size: int, window: int = 64, count: int = 1000) -> float:
        """Bytes per second of ``count`` RDMA writes of ``size`` bytes, ``window`` of them in flight
        (like fabtests' fi_rma_bw, but both ends share this one thread). Untraced."""
        if not 0 < size <= min(self.outbox.size, self.inbox.size):
            raise fi.UsageError(f"{size}-byte writes do not fit the pair's {self.outbox.size}-byte buffers")
        slots = max(1, min(window, self.outbox.size // size, self.inbox.size // size))
        remote = self.inbox_mr.remote()
        posted = done = 0
        start = time.perf_counter()
        deadline = time.monotonic() + self.timeout
        while done < count:
            while posted < count and posted - done < window:
                slot = posted % slots
                if not self.sender.ep.try_post_write(self.outbox_mr, slot * size, size, self.dest, remote,
                                                     slot * size, ("bw", posted)):
                    break
                posted += 1
            self.receiver.cq.poll()
            done += len(self.sender.cq.poll())
            if time.monotonic() > deadline:
                raise fi.FabricTimeout(f"{count} writes of {size} bytes", self.timeout)
        return size * count / (time.perf_counter() - start)

    # -- lifetime

    def close(self) -> None:
        for name in ("sender", "receiver"):
            stack = getattr(self, name, None)
            if stack is not None:
                stack.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False


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
    """Runs inside write pages cyclically over REGION_BYTES (the stages size their region by the total,
    up to rdma_write.DEFAULT_BUFFER_LIMIT)."""

    def __enter__(self):
        from .. import rdma_write
        self.module, self.saved = rdma_write, rdma_write.DEFAULT_BUFFER_LIMIT
        rdma_write.DEFAULT_BUFFER_LIMIT = REGION_BYTES

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
    with _SmallRegion(), bench.Bench(provider, domain) as target:
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
    if la > hb or lb > ha:
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
    ``by_thread``: tid → the last count seen. A thread's moves after the last sample before it ended are
    not seen. Needs a kernel with scheduler statistics (``available``)."""

    def __init__(self, interval: float = 0.005):
        import threading
        self.interval = interval
        self.by_thread: dict[int, int] = {}
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
                    for line in (task / "sched").read_text().splitlines():
                        if line.startswith("se.nr_migrations"):
                            self.by_thread[int(task.name)] = int(line.split(":")[1])
                except (FileNotFoundError, ProcessLookupError, ValueError):
                    continue  # the thread ended between listing and reading
            self._stop.wait(self.interval)

    @property
    def total(self) -> int:
        return sum(self.by_thread.values())

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        return False


def _own_tid() -> int:
    import threading
    return threading.get_native_id()


def pinning(bench, rounds: int = 3, provider: str | None = None, **setup) -> dict:
    """Chapters 11 (not pinned) and 12 (pinned), interleaved: label → list of (BenchResult, migrations of
    its writer threads)."""
    provider, domain = fabric(provider)
    base = {**ENGINE_SETUP, "provider": provider, "domain": domain, "stage": "threaded", "shard": False, **setup}
    out = {"not pinned": [], "pinned": []}
    with _SmallRegion(), bench.Bench(provider, domain) as target:
        for _ in range(rounds):
            for label, pin in (("not pinned", False), ("pinned", True)):
                with MigrationWatch() as watch:
                    r = target.run(bench.BenchConfig(**{**base, "pin": pin}), label=label)
                out[label].append((r, watch.total))
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
    from .._fabric import ffi, lib
    cores = sorted(os.sched_getaffinity(0))[:threads]
    pinned = ffi.new("int[]", cores)
    overlap = ffi.new("double *")
    out = CounterRounds(COUNTER_LAYOUTS)
    for _ in range(rounds):
        for name, layout in COUNTER_LAYOUTS.items():
            best = (-1.0, 0.0)
            for _ in range(max(1, tries)):
                ns = lib.fl_counter_bench(getattr(lib, layout), threads, updates, pinned, len(cores), overlap)
                if ns < 0:
                    raise fi.UsageError(f"counter benchmark refused {threads} threads x {updates} updates")
                if overlap[0] > best[0]:
                    best = (overlap[0], ns)
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


# ---- the reader's figure beside the article's (lessons 09-15)

def progression(bench, chapters, rounds: int = 3, context=(), provider: str | None = None, **changes):
    """Run these chapters of tools.bench.PROGRESSION ``rounds`` times, interleaved (a fresh target each
    round), after the ``context`` chapters (earlier ones, there to complete the chart) once. Returns each
    chapter's median run (by Gbps), all runs, and for each thread count the memcpy ceiling: the median
    memcpy of the same bytes with that many threads."""
    provider, domain = fabric(provider)
    setup = {**ENGINE_SETUP, "provider": provider, "domain": domain, **changes}
    with _SmallRegion():
        runs = list(bench.progression(chapters=list(context), **setup)) if context else []
        for _ in range(rounds):
            runs += bench.progression(chapters=list(chapters), **setup)
    chosen, memcpy = {}, {}
    for chapter in dict.fromkeys(r.label.split()[0] for r in runs):
        mine = sorted((r for r in runs if r.label.split()[0] == chapter), key=lambda r: r.gbps)
        chosen[chapter] = mine[len(mine) // 2]
    for r in runs:
        memcpy.setdefault(r.threads, []).append(r.memcpy_gbps)
    ceiling = {threads: float(np.median(values)) for threads, values in memcpy.items()}
    return chosen, runs, ceiling


def article(chapter: str):
    """The article's (Gbps, percent of its line rate) for a chapter, or None for this project's extras."""
    from .tour import ARTICLE_GBPS
    if not chapter.isdigit() or int(chapter) not in ARTICLE_GBPS:
        return None
    gbps, line = ARTICLE_GBPS[int(chapter)]
    return gbps, 100 * gbps / line


def percents(chosen: dict, ceiling: dict) -> dict:
    """Each chapter's run as a percentage of the memcpy ceiling for its number of threads."""
    return {chapter: 100 * r.gbps / ceiling[r.threads] for chapter, r in chosen.items()}


def progression_table(chosen: dict, ceiling: dict, runs: list) -> None:
    """One row per chapter: runs, NIC slots (emulated ones counted), threads, the median run's Gbps with
    the min-max of all its runs, writes per second, refusals per write and share of the memcpy ceiling;
    then the article's figures."""
    import os
    share = percents(chosen, ceiling)
    print(f"{'chapter':<27}{'runs':>5}{'NICs':>10}{'threads':>8}{'Gbps (min-max)':>20}{'Mops/s':>8}"
          f"{'EAGAIN/write':>13}{'% memcpy':>10}  | article: Gbps  % of line rate")
    for chapter, r in chosen.items():
        rates = [x.gbps for x in runs if x.label == r.label]
        nics = f"{r.nics} ({r.emulated_nics} emu)" if r.emulated_nics else str(r.nics)
        theirs = article(chapter)
        ref = f"{theirs[0]:14.1f}  {theirs[1]:5.1f} %" if theirs else "  (not in the article)"
        gbps = f"{r.gbps:.2f} ({min(rates):.1f}-{max(rates):.1f})"
        print(f"{r.label:<27}{len(rates):>5}{nics:>10}{r.threads:>8}{gbps:>20}{r.mops:8.3f}"
              f"{r.eagain / max(1, r.writes):13.2f}{share[chapter]:9.1f} %  |{ref}")
    print("memcpy ceiling (same bytes, median):",
          ", ".join(f"{g:.1f} Gbps with {t} thread{'s' if t > 1 else ''}" for t, g in sorted(ceiling.items())))
    print(f"cores this process may use: {len(os.sched_getaffinity(0))}")


# ---- lessons 13-16 on the modeled p5 (provider sim, docs/model.md)

#: Lessons 13-15's runs on the modeled NICs: 16 of them (1600 Gbps, about 3 million 64 KiB writes a second,
#: more than one thread feeds, so the writer's CPU per write decides), 512 MiB per run.
MODEL_SETUP = dict(nics=16, threads=2, page_size=64 << 10, total=512 << 20)
#: The model moves no payload by default, so a small region (pages written again and again) only shortens
#: the untimed set-up and the target's check.
MODEL_REGION_BYTES = 4 << 20


class ModelRegion:
    """While open, ``interleaved`` runs (and the sweeps built on it) cycle over MODEL_REGION_BYTES instead of
    REGION_BYTES: ``with lesson.ModelRegion(): lesson.batch_sweep(bench, provider="sim", ...)``."""

    def __enter__(self) -> "ModelRegion":
        global REGION_BYTES
        self.saved, REGION_BYTES = REGION_BYTES, MODEL_REGION_BYTES
        return self

    def __exit__(self, *exc: object) -> None:
        global REGION_BYTES
        REGION_BYTES = self.saved


def chapter_runs(bench: Any, chapters: list[str], rounds: int = 3, provider: str | None = "sim", **setup: Any) -> dict:
    """Chapters of tools.bench.PROGRESSION ("12", "13+", ...), each with only its own techniques on, run in
    turn ``rounds`` times through one target (``interleaved``), on MODEL_SETUP and ``setup``: chapter → runs.
    As in ``bench --progression``, every chapter drives ``threads`` GPU groups (one thread walks them all in
    chapters 9 and 10)."""
    steps = {step[0]: step for step in bench.PROGRESSION}
    unknown = [c for c in chapters if c not in steps]
    if unknown:
        raise fi.UsageError(f"no chapter {', '.join(unknown)} in the progression; choose from {', '.join(steps)}")
    setup = {**MODEL_SETUP, **setup}
    variants = {c: {"stage": steps[c][2], "groups": setup["threads"], **steps[c][3]} for c in chapters}
    with ModelRegion():
        return interleaved(bench, variants, rounds, provider, **setup)


def medians(results: dict[Any, list]) -> dict:
    """label → the median run of its runs, by Gbps (the run that speaks for the label in a table)."""
    return {label: sorted(runs, key=lambda r: r.gbps)[(len(runs) - 1) // 2] for label, runs in results.items()}


def wall_ns_per_write(r: Any) -> float:
    """ns each writer thread spent per write it made: the run's time × its writer threads / its writes."""
    return r.elapsed_s * r.threads / max(1, r.writes) * 1e9


def on_cpu_share(r: Any) -> float:
    """The share of the run's time its writer threads were on a CPU: the writer process's CPU time per
    write (``cpu_ns_per_op``, warm-up and start included) over ``wall_ns_per_write``. Near 1: the threads
    had their cores; well below: they waited for a core (the target, the notebook, other processes)."""
    return r.cpu_ns_per_op / max(1e-9, wall_ns_per_write(r))


def percent_of_line(r: Any) -> float:
    """A run's Gbps as a percentage of its NICs' aggregate link speed (the model reports 100 Gbps each)."""
    return 100 * r.gbps / r.line_gbps if r.line_gbps else float("nan")


def fact(statement: str, holds: bool) -> None:
    """Print a relation a lesson's prose states, as checked on this run's numbers: ``statement`` says what
    was compared and with what tolerance. The printed line is the same on every machine where it holds, so
    a re-executed notebook that no longer shows it differs from the committed one."""
    print(f"{statement}: {bool(holds)}")


def check(predicted: float, measured: float, tolerance: float = 0.5, what: str = "") -> bool:
    """An exercise's answer against the measurement: True when ``predicted`` is within ``tolerance``
    (a share of ``measured``: 0.5 is ±50 %) of it. Prints both."""
    if not tolerance > 0:
        raise fi.UsageError(f"the tolerance is a positive share of the measurement (0.5 for ±50 %), got {tolerance}")
    ok = abs(predicted - measured) <= tolerance * abs(measured)
    print(f"{what + ': ' if what else ''}predicted {_figure(predicted)}, measured {_figure(measured)}: "
          + ("within" if ok else "outside") + f" ±{tolerance:.0%}")
    return ok


@dataclass
class LoopCounts:
    """What ``posting_loop`` did for ``writes`` writes: passes of its loop, completion-queue reads, calls to
    post a write (``fi_writemsg``), how many of them the provider refused (-FI_EAGAIN), the most writes it
    had in flight at once, and the seconds from the first post to the last completion."""
    writes: int
    passes: int = 0
    polls: int = 0
    calls: int = 0
    refused: int = 0
    most_in_flight: int = 0
    seconds: float = 0.0

    def per_write(self, name: str) -> float:
        return getattr(self, name) / max(1, self.writes)


def posting_loop(pair: "LocalPair", writes: int, batch: int = 16, lazy: bool = False, size: int = 1 << 20,
                 ring: int = 64) -> LoopCounts:
    """Chapters 14 and 15's posting loop, in Python against one endpoint pair (``LocalPair``), as the
    article wrote it: no count of writes in flight, so a refusal (-FI_EAGAIN) is the only sign that the
    provider's queue is full. Each pass reads the completion queues and, where that made room (or nothing is
    in flight), posts from the head of the pending queue until the provider refuses; then it adds up to
    ``batch`` writes of ``size`` bytes to the pending queue, which holds at most ``ring`` (as the engine's
    ring). Before chapter 15 (``lazy`` False) every added write also tries to post at once."""
    import collections
    count = LoopCounts(writes)
    pending: collections.deque = collections.deque()
    done = added = posted = 0

    def post_pending() -> None:
        nonlocal posted
        while pending:
            count.calls += 1
            if not pair.post_write(("loop", pending[0]), size, retry=False):
                count.refused += 1  # -FI_EAGAIN: the head stays, and everything behind it
                return
            pending.popleft()
            posted += 1
            count.most_in_flight = max(count.most_in_flight, posted - done)

    start = time.perf_counter()
    deadline = time.monotonic() + pair.timeout
    while done < writes:
        count.passes += 1
        count.polls += 1
        got = pair.poll()
        done += got
        if got or posted == done:
            post_pending()  # right after the completions made room: chapter 15's only post
        for _ in range(min(batch, writes - added, ring - len(pending))):
            pending.append(added)
            added += 1
            if not lazy:
                post_pending()  # chapters 14 and before: every added write tries the provider at once
        if time.monotonic() > deadline:
            raise fi.FabricTimeout(f"{writes - done} of {writes} writes completing", pair.timeout)
    count.seconds = time.perf_counter() - start
    pair.trace.clear()
    return count
