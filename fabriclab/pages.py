"""Page lists as ``Peer.write_pages`` takes them: checked (integers only, never truncated), tested for
overlap and for pages named twice, and joined into runs of pages contiguous on both sides. A short list of
Python ints stays one (:func:`few_pages`): for a few pages numpy's cost per call, microseconds, is most of
the work; the functions here take either form."""
from __future__ import annotations

from typing import Any

import numpy as np

from . import fi
from .errors import OutOfRange

_INT64_MAX = 2 ** 63 - 1


FEW = 16  # page lists up to this long, of Python ints, stay Python ints (the small-transfer path)


def few_pages(values: Any) -> list[int] | None:
    """``values`` as a list of Python ints where it is one int or a list or tuple of at most FEW ints; else None
    (:func:`as_pages` takes it: arrays, long lists, and anything to refuse)."""
    if type(values) is int:
        return [values]
    if type(values) in (list, tuple) and len(values) <= FEW and all(type(v) is int for v in values):
        return list(values)
    return None


def first_outside(pages: np.ndarray | list[int], last: int) -> int | None:
    """A page of the list outside [0, last), or None."""
    if isinstance(pages, list):
        return next((page for page in pages if not 0 <= page < last), None)
    if pages.min() >= 0 and pages.max() < last:
        return None
    return int(pages[(pages < 0) | (pages >= last)][0])


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


def first_repeat(pages: np.ndarray | list[int]) -> int | None:
    """A page the list names more than once, or None. A single page costs no numpy work."""
    if len(pages) < 2:
        return None
    if len(pages) <= _SHORT:
        seen: set[int] = set()
        for page in (pages if isinstance(pages, list) else pages.tolist()):
            if page in seen:
                return int(page)
            seen.add(page)
        return None
    ordered = np.sort(np.asarray(pages))
    repeated = ordered[1:][ordered[1:] == ordered[:-1]]
    return int(repeated[0]) if repeated.size else None


def coalesce_few(src: list[int], dst: list[int], most: int) -> tuple[list[int], list[int], list[int]]:
    """:func:`coalesce_pages` of lists of Python ints, in Python."""
    firsts_src: list[int] = []
    firsts_dst: list[int] = []
    runs: list[int] = []
    for s, d in zip(src, dst):
        if runs and runs[-1] < most and s == firsts_src[-1] + runs[-1] and d == firsts_dst[-1] + runs[-1]:
            runs[-1] += 1
        else:
            firsts_src.append(s)
            firsts_dst.append(d)
            runs.append(1)
    return firsts_src, firsts_dst, runs


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


def checked_pages(src_pages: Any, dst_pages: Any, local_length: int, remote_length: int,
                  page_size: int) -> tuple[np.ndarray, np.ndarray] | tuple[list[int], list[int]]:
    """``Peer.write_pages``'s page lists checked: as many on both sides, at least one, each a whole page of its
    region, no destination named twice. A few Python ints stay a list of ints (:func:`few_pages`)."""
    few_src, few_dst = few_pages(src_pages), few_pages(dst_pages)
    src: np.ndarray | list[int]
    dst: np.ndarray | list[int]
    if few_src is not None and few_dst is not None:
        src, dst = few_src, few_dst
    else:
        src, dst = as_pages(src_pages, "local"), as_pages(dst_pages, "remote")
    if len(src) != len(dst) or not len(src):
        raise fi.UsageError(f"{len(src)} source pages but {len(dst)} destination pages")
    for pages, region_length, side in ((src, local_length, "local"), (dst, remote_length, "remote")):
        last = region_length // page_size
        bad = first_outside(pages, last)
        if bad is not None:
            raise OutOfRange(f"{side} page {bad} is outside the {last} whole {page_size}-byte pages of the "
                             f"{side} region")
    repeated = first_repeat(dst)
    if repeated is not None:
        i, j = [k for k, page in enumerate(dst) if page == repeated][:2]
        raise fi.UsageError(f"source pages {src[i]} and {src[j]} are both written to destination page {repeated}: "
                            "the writes of a transfer run in no order, so which lands would depend on timing. "
                            "Name each destination page once (one transfer after the other where a page is "
                            "written twice)")
    return src, dst  # type: ignore[return-value]


def page_runs(src: np.ndarray | list[int], dst: np.ndarray | list[int], most: int,
              page_size: int) -> tuple[Any, Any, Any, int]:
    """The writes of a page list: (first source page, first destination page, bytes) of each run
    (:func:`coalesce_pages`), the bytes as one number where every write has the same, and how many pages."""
    if isinstance(src, list) and isinstance(dst, list):
        firsts_src, firsts_dst, runs = coalesce_few(src, dst, most)
        return firsts_src, firsts_dst, runs[0] * page_size if min(runs) == max(runs) else \
            [run * page_size for run in runs], sum(runs)
    starts_src, starts_dst, run_array = coalesce_pages(np.asarray(src), np.asarray(dst), most)
    lengths = run_array * np.uint64(page_size)
    return starts_src, starts_dst, int(lengths[0]) if lengths.min() == lengths.max() else lengths, int(run_array.sum())
