"""What a run ran on, and a progression recorded with the machine it ran on.

``python -m fabriclab bench --progression ... --record FILE`` keeps each chapter's median and every
interleaved run, the machine it ran on (cores, CPU, providers, the commit) and the command, so that its
figures are never mistaken for the reader's or the article's; ``load()`` reads one back, and
``course.lesson.beside_recorded`` draws it, labelled "recorded", beside the reader's bars. A recording placed
in ``fabriclab/data/progression-NAME.json`` is found by ``shipped()``. None ships now: the modeled p5 runs in
modeled time (docs/model.md), so its figures are the same on a 2-core box and a 16-core one, which is what
the 16-core recording once stood in for (issue 23); a recording keeps a real provider's run (a testbed, EFA).

The format lives here, below both the bench that writes it and the course that draws it (tests/test_layers.py
keeps those two apart); ``machine()`` and ``commit()`` also stamp the executed notebooks (course.provenance).

    python -m fabriclab bench --progression --provider "tcp;ofi_rxm" --nics 8 --record progression-mine.json
"""
from __future__ import annotations

import json
import os
import pathlib
import platform
import subprocess
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from . import fi
from .topology import DATA_DIR

FORMAT = "fabriclab-progression/1"
PREFIX = "progression-"  # fabriclab/data/progression-NAME.json: beside the topologies, told apart by name
SOURCE_ROOT = pathlib.Path(__file__).resolve().parents[1]  # the checkout, when fabriclab runs from one
HOW = ("record one: python -m fabriclab bench --progression --provider PROVIDER --nics N --record FILE, and load it "
       "with fabriclab.recorded.load(FILE)")


def _git(root: pathlib.Path, *args: str) -> str:
    try:
        return subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, timeout=30,
                              check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def _cpu_model() -> str:
    try:
        for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine() -> dict[str, Any]:
    """What this process runs on: cores (the machine's, and those this process may use), CPU, OS, Python,
    libfabric and its providers, the default one and $FABRICLAB_PROVIDER."""
    return {"cores": os.cpu_count(), "cores_usable": len(os.sched_getaffinity(0)), "cpu": _cpu_model(),
            "system": f"{platform.system()} {platform.release()} {platform.machine()}",
            "python": platform.python_version(), "libfabric": fi.library_version(),
            "providers": fi.available_providers(), "default_provider": fi.default_provider(),
            "FABRICLAB_PROVIDER": os.environ.get("FABRICLAB_PROVIDER")}


def commit(root: pathlib.Path = SOURCE_ROOT, paths: Iterable[str] = ()) -> str:
    """The commit of the checkout at ``root``, with ``+changes`` when any of ``paths`` (relative to it) differs
    from it; "unknown" outside a git checkout."""
    head = _git(root, "rev-parse", "HEAD") or "unknown"
    files = [p for p in paths if not p.startswith("<")]
    return head + ("+changes" if files and _git(root, "status", "--porcelain", "--", *files) else "")


class NoRecording(fi.UsageError):
    """No recorded progression of that name is shipped (or the file is not one)."""


@dataclass(frozen=True)
class Chapter:
    """One chapter of a recorded progression: its median run and the Gbps of every interleaved run."""
    chapter: str  # "9", "13+", ...
    label: str  # "9 one thread, all NICs"
    gbps: float
    runs_gbps: list[float]
    line_gbps: float  # the NICs' aggregate line as the provider reports it (0: not reported)
    memcpy_gbps: float  # the memcpy ceiling of the same bytes with the writer's threads
    modeled: bool  # provider sim: the model's Gbps, not a wire's
    nics: int
    threads: int
    target_threads: int
    mops: float
    verified: bool | None

    @property
    def percent(self) -> float:
        """Percent of the line on the model (or wherever the line is known), else of the memcpy ceiling."""
        return 100.0 * self.gbps / (self.line_gbps if self.line_gbps else self.memcpy_gbps)


@dataclass(frozen=True)
class Recording:
    """A recorded progression: where and how it ran, and each chapter's figures."""
    name: str
    machine: dict[str, Any]
    commit: str
    recorded_at: str
    command: str
    settings: dict[str, Any]  # tools.bench.BenchConfig's fields as the run had them
    chapters: dict[str, Chapter]

    @property
    def label(self) -> str:
        """The legend's words: "recorded: 16 cores, sim (modeled)"."""
        modeled = bool(self.chapters) and all(c.modeled for c in self.chapters.values())
        return (f"recorded: {self.machine.get('cores_usable', '?')} cores, {self.machine.get('provider', '?')}"
                + (" (modeled)" if modeled else ""))

    def percents(self) -> dict[str, float]:
        """Chapter → percent, as ``Chapter.percent`` (of the line on the model)."""
        return {name: c.percent for name, c in self.chapters.items()}

    def describe(self) -> str:
        """Where, when and how it was recorded, and each chapter's median with the min-max of its runs."""
        m = self.machine
        lines = [f"{self.label} — {m.get('cores', '?')}-core {m.get('cpu', '?')}, recorded {self.recorded_at} at "
                 f"commit {self.commit[:12]}:", f"  {self.command}"]
        for c in self.chapters.values():
            lines.append(f"  {c.label:<27} {c.gbps:8.1f} Gbps ({min(c.runs_gbps):.0f}-{max(c.runs_gbps):.0f}, "
                         f"{len(c.runs_gbps)} runs) = {c.percent:5.1f} %, {c.threads}+{c.target_threads} threads")
        return "\n".join(lines)


def check_destination(path: str | os.PathLike[str]) -> pathlib.Path:
    """``path`` as a place a recording can be written, checked before minutes of runs are spent on it."""
    path = pathlib.Path(path)
    if path.suffix != ".json":
        raise fi.UsageError(f"--record {path}: a recording is a .json file (fabriclab/data/{PREFIX}NAME.json ships "
                            "it with the package)")
    if not path.parent.is_dir() or not os.access(path.parent, os.W_OK):
        raise fi.UsageError(f"--record {path}: cannot write into {path.parent or '.'} (no such folder, or not "
                            "writable)")
    return path


def _chapter(result: Any) -> Chapter:
    """A Chapter from a tools.bench.BenchResult of a progression."""
    return Chapter(chapter=result.label.split()[0], label=result.label, gbps=result.gbps,
                   runs_gbps=list(result.runs_gbps or [result.gbps]), line_gbps=result.line_gbps,
                   memcpy_gbps=result.memcpy_gbps, modeled=result.modeled, nics=result.nics, threads=result.threads,
                   target_threads=result.target_threads, mops=result.mops, verified=result.verified)


def write(path: str | os.PathLike[str], results: Sequence[Any], command: Sequence[str],
          settings: Mapping[str, Any]) -> Recording:
    """Record a progression (tools.bench.progression's results, run by ``command`` with ``settings``) at
    ``path``."""
    path = check_destination(path)
    if not results:
        raise fi.UsageError("nothing to record: the progression produced no results")
    where = {**machine(), "provider": results[0].provider}
    chapters = {c.chapter: c for c in map(_chapter, results)}
    recording = Recording(name=path.stem.removeprefix(PREFIX), machine=where, commit=commit(),
                          recorded_at=time.strftime("%Y-%m-%d", time.gmtime()), command=" ".join(command),
                          settings=dict(settings), chapters=chapters)
    body = {"format": FORMAT, **{k: v for k, v in asdict(recording).items() if k != "chapters"},
            "chapters": [asdict(c) for c in chapters.values()]}
    path.write_text(json.dumps(body, indent=1) + "\n")
    return recording


def names() -> list[str]:
    """The recordings shipped with this fabriclab: NAME of each fabriclab/data/progression-NAME.json."""
    return sorted(p.stem.removeprefix(PREFIX) for p in DATA_DIR.glob(f"{PREFIX}*.json"))


def load(name: str | os.PathLike[str] | None = None) -> Recording:
    """A shipped recording by name (the only one, or the first by name, when ``name`` is None), or a
    recording's file. NoRecording, saying how to make one, when there is none."""
    shipped = names()
    if name is None and not shipped:
        raise NoRecording(f"no recorded progression is shipped with this fabriclab ({DATA_DIR}/{PREFIX}*.json); "
                          f"{HOW}")
    path = DATA_DIR / f"{PREFIX}{shipped[0] if name is None else name}.json"
    if name is not None and not path.is_file():
        path = pathlib.Path(name)
    if not path.is_file():
        raise NoRecording(f"no recorded progression {str(name)!r}; shipped: {', '.join(shipped) or 'none'} ({HOW})")
    try:
        body = json.loads(path.read_text())
        if body.get("format") != FORMAT:
            raise NoRecording(f"{path} is not a recorded progression (format {body.get('format')!r}, not {FORMAT!r})")
        chapters = {c["chapter"]: Chapter(**c) for c in body["chapters"]}
        return Recording(name=body["name"], machine=body["machine"], commit=body["commit"],
                         recorded_at=body["recorded_at"], command=body["command"], settings=body["settings"],
                         chapters=chapters)
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise NoRecording(f"{path} cannot be read as a recorded progression ({type(exc).__name__}: {exc}); "
                          f"{HOW}") from None


def shipped(name: str | None = None) -> Recording | None:
    """The shipped recording (``load``), or None when none is shipped: a lesson then draws the reader's bars
    alone and says so."""
    try:
        return load(name)
    except NoRecording:
        return None
