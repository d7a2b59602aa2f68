"""The one formula and the one verdict every figure the project prints goes through, as in fabtests:
Gbps = bytes × 8 / elapsed / 1e9, and two sets of interleaved runs differ only when their ranges (min-max)
do not overlap. The stages, the bench, the fan-in tool and the lessons all use these, so a figure means the
same thing wherever it is printed."""
from __future__ import annotations

from typing import Any, Iterable

from . import cli

#: What ``verdict`` calls two sets of runs whose ranges overlap.
NOISE = "noise (ranges overlap)"


def gbps(nbytes: float, seconds: float) -> float:
    """Gigabits per second: ``nbytes`` × 8 / ``seconds`` / 1e9; 0.0 when no time passed (nothing to divide
    by: a run too short to time, or none)."""
    return nbytes * 8 / seconds / 1e9 if seconds > 0 else 0.0


def verdict(before: Iterable[float], after: Iterable[float]) -> str:
    """"gain" or "loss" from the runs ``before`` to the runs ``after`` only when their ranges (min-max) do
    not overlap; otherwise NOISE: one run of each swings by 10-20 % on a busy host."""
    before, after = list(before), list(after)
    return "gain" if min(after) > max(before) else "loss" if max(after) < min(before) else NOISE


#: The modeled host's counts per write, as format_model shows them: (column, count).
MODEL_COLUMNS = (("CQ reads", "cq_reads"), ("empty", "empty_reads"), ("doorbells", "doorbells"),
                 ("futile posts", "futile_posts"), ("far socket", "far_accesses"), ("line moves", "line_moves"),
                 ("app ns", "app_ns"), ("provider ns", "provider_ns"), ("host ns", "host_ns"),
                 ("idle ns", "idle_ns"))


def model_per_write(r: Any) -> dict[str, float]:
    """The modeled host's counts of a run (``r.model``, _native.RunFigures.model) per accepted write
    (``r.writes``, the writes the run completed), by MODEL_COLUMNS' names, and the scheduler's moves for the
    whole run ("migrations")."""
    writes = max(1, r.writes)
    out = {column: r.model.get(key, 0) / writes for column, key in MODEL_COLUMNS}
    out["migrations"] = r.model.get("migrations", 0)
    return out


def format_model(results: Iterable[Any]) -> str:
    """One row per modeled run: what the modeled host charged per write, its time split into the thread's
    own CPU time (app), the provider calls' modeled costs, the host's (far socket, line moves, refills) and
    the polls of nothing skipped (idle), all summed over the run's threads."""
    rows = [(r.label or r.stage, *(f"{v:.2f}" if v < 100 else f"{v:.0f}" for v in model_per_write(r).values()))
            for r in results if r.model]
    return cli.table(("stage", *(column for column, _ in MODEL_COLUMNS), "migrations"), rows, 1)
