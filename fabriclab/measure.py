"""The one formula and the one verdict every figure the project prints goes through, as in fabtests:
Gbps = bytes × 8 / elapsed / 1e9, and two sets of interleaved runs differ only when their ranges (min-max)
do not overlap. The stages, the bench, the fan-in tool and the lessons all use these, so a figure means the
same thing wherever it is printed."""
from __future__ import annotations

from typing import Iterable

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
