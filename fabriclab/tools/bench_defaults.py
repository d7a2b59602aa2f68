"""``bench --defaults``: ``Engine()`` with its defaults against a sweep of ``Engine(nics=, threads=)``, each
writer and its target in two processes, plus the 8-thread memcpy ceiling (issue 15's benchmark)."""
from __future__ import annotations

import os
import time

import numpy as np

from .. import cli, gpu
from ..measure import gbps
from .bench_ceiling import memcpy_rate
from .bench_target import api_peer, gpu_copy, running_on

# The shapes of issue 15's benchmark: (pages per transfer, page size), each bytes-equal (64 MiB a transfer).
DEFAULTS_SHAPES = ((1024, 64 << 10), (64, 1 << 20))


def layout_sweep(cores: int) -> list[tuple[int, int]]:
    """The (nics, threads) the defaults are compared with: 1, 2, 4, 8 threads as the cores allow, each with
    one and with two NIC slots per thread."""
    return [(per * t, t) for t in (1, 2, 4, 8) if t <= cores for per in (1, 2)]


def defaults_comparison(provider: str | None, domain: str | None = None, layouts=None, shapes=DEFAULTS_SHAPES,
                        transfers: int = 20, warmup: int = 2, timeout: float = 60.0, rounds: int = 3,
                        memory_kind: str = "host", gpu_ipc: bool = True) -> dict:
    """Engine() with its defaults against ``layouts`` ((nics, threads) pairs; default layout_sweep), each
    writer and its target in two processes with the same layout: per shape, ``warmup`` then ``transfers``
    timed transfers of every page, one at a time, with pages contiguous and permuted on the target. The
    layouts take turns ``rounds`` times; GB/s per (layout, shape, order) is the median of the rounds (with
    their spread), next to the writes a transfer became; plus the 8-thread memcpy ceiling (memcpy_rate of a
    transfer's bytes, once a round: its median, in GB/s). ``memory_kind`` "cuda": both sides' buffers are GPU
    memory (direct or staged: "paths" says which, and how the writes went: "cuda-ipc" where the GPU copied them,
    unless ``gpu_ipc`` is False)."""
    if memory_kind == "cuda":
        gpu.require_cuda()  # before any process starts: no CUDA here, and the error says what to install
    layouts = [None] + list(layout_sweep(len(os.sched_getaffinity(0))) if layouts is None else layouts)
    runs, chosen, ceilings = [[] for _ in layouts], {}, []
    largest = max(n * size for n, size in shapes)
    for r in range(rounds):
        # each round starts one layout further on: no layout always runs first (after an idle spell) or last
        for i in [(r + k) % len(layouts) for k in range(len(layouts))]:
            runs[i].append(_defaults_round(provider, domain, layouts[i], shapes, transfers, warmup, timeout, chosen,
                                           memory_kind, gpu_ipc))
        ceilings.append(memcpy_rate(largest, threads=8, repeats=5))
    rows = []
    for layout, measured in zip(layouts, runs):
        cases = measured[0]["gbs"]
        rows.append({"layout": "defaults" if layout is None else f"nics={layout[0]} threads={layout[1]}",
                     "gbs": {c: float(np.median([m["gbs"][c] for m in measured])) for c in cases},
                     "runs": {c: [m["gbs"][c] for m in measured] for c in cases},
                     "writes": measured[-1]["writes"]})
    pages, size = shapes[0]
    return {"provider": provider, "memory": memory_kind, "paths": chosen.pop("paths"), "rows": rows, "defaults": chosen,
            "memcpy_8_threads_gbs": float(np.median([c["gbps"] for c in ceilings])) / 8,
            "memcpy_8_threads_runs_gbs": [c["gbps"] / 8 for c in ceilings], "memcpy_method": ceilings[-1]["method"],
            "against_ceiling": f"{pages}x{cli.format_size(size)} permuted", "rounds": rounds,
            "cores": len(os.sched_getaffinity(0))}


def _defaults_round(provider, domain, layout, shapes, transfers: int, warmup: int, timeout: float,
                    chosen: dict, memory_kind: str, gpu_ipc: bool) -> dict:
    """One layout's turn in defaults_comparison (a fresh target process and engine); fills ``chosen`` with
    what the defaults picked and ``chosen["paths"]`` with the memory paths of both sides."""
    from ..engine import Engine
    row = {"gbs": {}, "writes": {}}
    region_bytes = max(n * size for n, size in shapes)
    with api_peer(provider, domain, layout, region_bytes, memory_kind) as target:
        address, descriptor = target["address"], target["descriptor"]
        nics, threads = layout or (None, None)
        with Engine(provider, domains=domain, nics=nics, threads=threads, timeout=timeout,
                    gpu=memory_kind == "cuda", gpu_ipc=gpu_ipc) as engine, running_on(engine.housekeeping_cores):
            if layout is None:
                chosen.update(nics=engine.nics, threads=engine.threads, repr=repr(engine))
            peer = engine.connect(address)
            source = np.frombuffer(np.random.default_rng(1).bytes(region_bytes), dtype=np.uint8).copy()
            region = engine.register(gpu_copy(source) if memory_kind == "cuda" else source)
            route, why = peer.route(region, descriptor)
            chosen["paths"] = {"source": region.path, "target": target["target"]["path"], "writes": route,
                               "writes_why": why}
            for pages, size in shapes:
                for order in ("contiguous", "permuted"):
                    src = np.arange(pages)
                    dst = src if order == "contiguous" else np.random.default_rng(pages).permutation(pages)
                    for _ in range(warmup):
                        peer.write_pages(region, src, descriptor, dst, size).result()
                    t0 = time.perf_counter()
                    for _ in range(transfers):
                        done = peer.write_pages(region, src, descriptor, dst, size)
                        done.result()
                    key = f"{pages}x{cli.format_size(size)} {order}"
                    row["gbs"][key] = gbps(transfers * pages * size, time.perf_counter() - t0) / 8  # GB/s
                    row["writes"][key] = done.writes
    return row
