"""``bench --api``: the same workload through ``fabriclab.Engine.write_pages`` and through the stage-15
path (the harness's ``batched`` stage), alternating, plus the Python cost of one ``write_pages`` call."""
from __future__ import annotations

import os
import time
from dataclasses import asdict

import numpy as np

from .. import fi, gpu, rdma_write
from ..measure import gbps
from .bench_options import BenchConfig
from .bench_report import BenchResult
from .bench_target import api_peer, gpu_copy, running_on


def api_comparison(config: BenchConfig, calls=(1, 16, 256), batch_pages: int = 256, outstanding: int = 8,
                   rounds: int = 3, gpu_ipc: bool = True) -> dict:
    """The same workload through ``Engine.write_pages`` (pages in calls of ``batch_pages``, up to
    ``outstanding`` calls in flight) and through the stage-15 path (``batched``), alternating ``rounds``
    times and compared by their medians (one run of each swings by 10-20 % on a busy host), plus the
    Python cost of one ``write_pages`` call of 1, 16 and 256 pages and the small-transfer figures
    (``_small_transfers``: a page waited for, and ``write_batch``'s pages submitted a second).

    Both paths run one layout, the stage-15 path's (``config`` as ``bench --stage batched`` takes it):
    its NIC slots (``--nics``, else every domain and a slot per GPU group, emulated on one domain), its
    writer threads and its target's threads are the Engine's and its target engine's; "layout" says them.

    With ``config.memory == "cuda"`` the Engine's source is GPU memory (gpu_copy) and so is its target
    where the target engine can take GPU memory as a target (else host memory, and the result says why);
    "source" and "target" say the path each region took (``Region.path``/``why``), "staging" and
    "target_staging" both engines' ``stats()["staging"]`` after the last round."""
    config.check()
    if rounds <= 0:
        raise fi.UsageError(f"--rounds must be at least 1, got {rounds}")
    if config.memory == "cuda":
        gpu.require_cuda()  # before any process starts: no CUDA here, and the error says what to install
    from .bench import run  # the harness, whose front (bench.py) offers this comparison
    raw_runs, api_runs, overhead, small = [], [], {}, {}
    for _ in range(rounds):
        raw = run(BenchConfig(**{**asdict(config), "stage": "batched", "verify": False}))
        raw_runs.append(raw.gbps)
        measured = _api_round(config, raw, () if overhead else calls, batch_pages, outstanding, gpu_ipc)
        api_runs.append(measured["gbps"])
        overhead, small = overhead or measured["us_per_call"], small or measured["small"]
    raw_gbps, api_gbps = float(np.median(raw_runs)), float(np.median(api_runs))
    return {"raw_gbps": raw_gbps, "api_gbps": api_gbps, "ratio": api_gbps / raw_gbps if raw_gbps else 0.0,
            "raw_runs": raw_runs, "api_runs": api_runs, "us_per_call": overhead, "small": small,
            "page_size": config.page_size, "threads": raw.threads, "nics": raw.nics, "provider": raw.provider,
            "layout": _layout(config, raw, measured["engine_layout"]),
            "caller_cores": measured["caller_cores"], "memory": config.memory, "raw_memory": raw.memory,
            "source": measured["source"], "target": measured["target"], "staging": measured["staging"],
            "target_staging": measured["target_staging"], "writes": measured["writes"]}


def _small_transfers(peer, region, descriptor, page_size: int, whole: int, transfers: int = 2000,
                     batch: int = 2000) -> dict:
    """Small transfers through the Engine: one page written and waited for, ``transfers`` times (µs each, the
    median of 3 runs); and ``write_batch`` of ``batch`` requests of 1 and of 16 pages (pages submitted a second,
    the call alone, median of 3), each batch then waited for."""
    waited, submitted = [], {1: [], 16: []}
    for _ in range(3):
        t0 = time.perf_counter()
        for i in range(transfers):
            peer.write_pages(region, [i % whole], descriptor, [i % whole], page_size).result()
        waited.append((time.perf_counter() - t0) / transfers * 1e6)
        for pages in submitted:
            requests = [([(i * pages + k) % whole for k in range(pages)],) * 2 for i in range(batch)]
            t0 = time.perf_counter()
            done = peer.write_batch(region, requests, descriptor, page_size)
            submitted[pages].append(batch * pages / (time.perf_counter() - t0))
            for t in done:
                t.result()
    return {"us_waited": float(np.median(waited)), "transfers": transfers, "batch": batch,
            "pages_per_s": {pages: float(np.median(rates)) for pages, rates in submitted.items()}}


def _layout(config: BenchConfig, raw: BenchResult, engine: dict) -> dict:
    """The layout both paths ran (the stage-15 run ``raw``'s NIC slots and writer threads), what the Engine made of
    it and who chose it. The targets differ by design: the course's target is one thread (as the article's
    receiver), the Engine's target engine has the writer's threads (a worker per NIC group, as the library runs
    everywhere): on a provider that moves bytes only while both sides poll, one target thread would cap the
    Engine at what that thread can poll, and --api compares the two writers' costs, not two targets."""
    chosen = ("given by --nics" if config.nics is not None else
              f"by default (no --nics): every domain ({raw.nics - raw.emulated_nics} here), and a slot per GPU group "
              "at least")
    return {"nics": raw.nics, "emulated_nics": raw.emulated_nics, "groups": raw.groups, "threads": raw.threads,
            "target_threads": raw.target_threads, "engine_target_threads": raw.threads, "engine": engine,
            "chosen": chosen}


def _api_round(config: BenchConfig, raw: BenchResult, calls, batch_pages: int, outstanding: int,
               gpu_ipc: bool) -> dict:
    """One timed pass through the Engine (a fresh target process and engine, so that neither idles beside
    the raw runs) on the layout of the stage-15 run ``raw``: Gbps, the Python µs per call for each size in
    ``calls``, the calling thread's cores, the path of each region, both engines' staging figures and the
    Engine's NIC slots and threads ("engine_layout")."""
    from ..engine import Engine
    plan = rdma_write.PagePlan.for_total(config.page_size, config.total)
    cuda = config.memory == "cuda"
    with api_peer(raw.provider, config.domain, (raw.nics, raw.threads), plan.buffer_bytes,
                  config.memory) as target:
        address, descriptor = target["address"], target["descriptor"]
        with Engine(raw.provider, domains=config.domain, nics=raw.nics, threads=raw.threads, pin=config.pin,
                    batch=config.batch, fi_more=config.fi_more, timeout=config.timeout,
                    in_flight=config.in_flight, gpu=cuda, gpu_ipc=gpu_ipc) as engine, running_on(engine.housekeeping_cores):
            caller_cores = sorted(os.sched_getaffinity(0))
            source = np.frombuffer(np.random.default_rng(1).bytes(plan.buffer_bytes), dtype=np.uint8).copy()
            region = engine.register(gpu_copy(source) if cuda else source)
            peer = engine.connect(address)
            route = peer.route(region, descriptor)
            whole = plan.buffer_bytes // plan.page_size
            pages = np.arange(plan.writes) % whole
            peer.write_pages(region, pages[:min(whole, 64)], descriptor, pages[:min(whole, 64)],
                             plan.page_size).result()  # warm-up
            in_flight = []
            t0 = time.perf_counter()
            for start in range(0, pages.size, batch_pages):
                chunk = pages[start:start + batch_pages]
                in_flight.append(peer.write_pages(region, chunk, descriptor, chunk, plan.page_size))
                if len(in_flight) >= outstanding:
                    in_flight.pop(0).result()
            for t in in_flight:
                t.result()
            rate = gbps(pages.size * plan.page_size, time.perf_counter() - t0)
            overhead, small = {}, _small_transfers(peer, region, descriptor, plan.page_size, whole) if calls else {}
            for n in calls:
                chunk = pages[:min(n, whole)]
                spent, transfers = 0.0, []
                for _ in range(50):
                    c0 = time.perf_counter()
                    transfers.append(peer.write_pages(region, chunk, descriptor, chunk, plan.page_size))
                    spent += time.perf_counter() - c0
                    if len(transfers) >= outstanding:
                        transfers.pop(0).result()
                for t in transfers:
                    t.result()
                overhead[n] = spent / 50 * 1e6
            staging = engine.stats()["staging"]
            layout = {"nics": engine.nics, "emulated_nics": engine.emulated_nics, "threads": engine.threads}
    return {"engine_layout": layout, "gbps": rate, "us_per_call": overhead, "small": small, "caller_cores": caller_cores,
            "writes": {"path": route[0], "why": route[1]},
            "source": {"path": region.path, "why": region.why}, "target": target["target"], "staging": staging,
            "target_staging": target["target_staging"]}
