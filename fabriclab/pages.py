"""Page lists as ``Peer.write_pages`` takes them: checked (integers only, never truncated), tested for
overlap and for pages named twice, and joined into runs of pages contiguous on both sides."""
from __future__ import annotations

from typing import Any

import numpy as np

from . import fi
from .errors import OutOfRange

_INT64_MAX = 2 ** 63 - 1


def as_pages(values: Any, side: str) -> np.ndarray:
    """Page numbers as int64, refusing floats (never truncated) and numbers int64 cannot hold."""
    array = np.asarray(values)
    if array.dtype == object:  # Python integers beyond what numpy holds, or mixed objects
        pages = [fi.integer(v, f"{side} page") for v in array.reshape(-1)]
        too_big = next((v for v in pages if abs(v) > _INT64_MAX), None)
        if too_big is not None:
            raise OutOfRange(f"{side} page {too_big} is outside any region")
        return np.asarray(pages, dtype=np.int64)
    if array.size and array.dtype.kind not in "iu":
        raise fi.UsageError(f"{side} pages must be integers, got {array.dtype} values such as {array.reshape(-1)[0]!r}")
    if array.size and array.dtype.kind == "u" and array.max() > _INT64_MAX:
        raise OutOfRange(f"{side} page {int(array.max())} is outside any region")
    return array.astype(np.int64).reshape(-1)


def first_overlap(sources: np.ndarray, destinations: np.ndarray, size: int) -> tuple[int, int] | None:
    """(i, j) such that ``size`` bytes from sources[i] and from destinations[j] share a byte; None if no pair
    does. Sorted once: for each source, only the last destination starting before its end can overlap it."""
    order = np.argsort(destinations, kind="stable")
    starts = destinations[order]
    last = np.searchsorted(starts, sources + size, side="left") - 1
    hit = (last >= 0) & (starts[np.maximum(last, 0)] > sources - size)
    if not hit.any():
        return None
    i = int(np.argmax(hit))
    return i, int(order[last[i]])


_SHORT = 64  # page lists up to this long are checked with a set of Python ints: faster than numpy's sort


def first_repeat(pages: np.ndarray) -> int | None:
    """A page the list names more than once, or None. A single page costs no numpy work."""
    if pages.size < 2:
        return None
    if pages.size <= _SHORT:
        seen: set[int] = set()
        for page in pages.tolist():
            if page in seen:
                return int(page)
            seen.add(page)
        return None
    ordered = np.sort(pages)
    repeated = ordered[1:][ordered[1:] == ordered[:-1]]
    return int(repeated[0]) if repeated.size else None


def coalesce_pages(src: np.ndarray, dst: np.ndarray, most: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Page lists as runs: (first source page, first destination page, pages) of each run of pages that are
    consecutive on both sides, at most ``most`` pages a run. A permuted list stays one page per run."""
    n = src.size
    starts_run = np.ones(n, dtype=bool)
    starts_run[1:] = (np.diff(src) != 1) | (np.diff(dst) != 1)
    starts = np.flatnonzero(starts_run)
    lengths = np.diff(np.append(starts, n))
    pieces = -(-lengths // most)  # runs longer than ``most`` split into pieces of ``most`` (the last shorter)
    run = np.repeat(np.arange(starts.size), pieces)
    within = (np.arange(run.size) - np.repeat(np.cumsum(pieces) - pieces, pieces)) * most
    first = starts[run] + within
    return src[first], dst[first], np.minimum(most, lengths[run] - within).astype(np.uint64)
