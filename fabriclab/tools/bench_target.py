"""The far side of the benchmarks that go through ``fabriclab.Engine`` (``--api``, ``--defaults``): a target
engine in a process of its own (``api_target``, started by ``api_peer``), and the helpers both sides share:
``gpu_copy`` (bytes in GPU memory) and ``running_on`` (the calling thread on the engine's housekeeping
cores)."""
from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from typing import Any, Iterable, Iterator

import numpy as np

from .. import bootstrap, fi, gpu, memory


def gpu_copy(host: np.ndarray) -> Any:
    """``host``'s bytes in GPU memory, as ``Engine.register`` takes them: a torch CUDA tensor when torch is
    importable and sees a GPU, else cuda-python device memory (memory.CudaBuffer). Without CUDA, UsageError
    naming what is missing."""
    gpu.require_cuda()  # the Engine needs cuda-python either way: it asks the driver where the memory lives
    try:
        import torch
    except ImportError:
        torch = None
    if torch is not None and torch.cuda.is_available():
        return torch.from_numpy(host).to("cuda")
    buffer = memory.CudaBuffer(host.size)
    buffer.write(host)
    return buffer


def _api_target_region(engine, size: int, memory_kind: str):
    """The target's region and what the bench prints of it ({"path", "why"}). GPU memory where the engine
    can make it a target (its descriptor() says so), else host memory, with the reason."""
    fallback = ""
    if memory_kind == "cuda":
        region = engine.register(gpu_copy(np.zeros(size, dtype=np.uint8)))
        try:
            region.descriptor()
            return region, {"path": region.path, "why": region.why}
        except fi.UsageError as exc:
            region.close()
            fallback = f"GPU memory cannot be a target here ({exc}): the target is host memory"
    region = engine.register(np.zeros(size, dtype=np.uint8))
    return region, {"path": region.path, "why": fallback}


def api_target() -> None:
    """The far side of ``--api``: an Engine with one buffer; swaps (address, descriptor, its region's path
    as JSON) over the bootstrap socket, serves until its standard input closes, then prints its engine's
    staging figures as one JSON line. Arguments: provider domains nics threads bytes memory (``-`` for
    none: the Engine's default)."""
    from ..engine import Engine
    provider, domains, nics, threads, size, memory_kind = sys.argv[1:7]
    # unpinned, like the stage-15 target: two engines pinned on one host would share the same cores
    with Engine(None if provider == "-" else provider, domains=None if domains == "-" else domains,
                nics=None if nics == "-" else int(nics), threads=None if threads == "-" else int(threads),
                pin=False, gpu=memory_kind == "cuda") as engine:
        region, path = _api_target_region(engine, int(size), memory_kind)
        with bootstrap.Rendezvous() as rendezvous:
            print(rendezvous.port, flush=True)
            rendezvous.exchange(bootstrap.pack(engine.address, region.descriptor(), json.dumps(path).encode()))
        sys.stdin.read()
        print(json.dumps(engine.stats()["staging"]), flush=True)


@contextlib.contextmanager
def api_peer(provider: str | None, domain: str | None, layout: tuple[int | None, int | None] | None, size: int,
             memory_kind: str = "host") -> Iterator[dict]:
    """api_target in another process with ``layout`` ((nics, threads), either None for the default; None:
    both defaults); yields a dict with its "address", "descriptor" and "target" ({"path", "why"} of its
    region), to which "target_staging" (its engine's staging figures) is added once the block is left."""
    nics, threads = layout or (None, None)
    code = "from fabriclab.tools.bench_target import api_target; api_target()"
    target = subprocess.Popen([sys.executable, "-c", code, provider or "-", domain or "-",
                               "-" if nics is None else str(nics), "-" if threads is None else str(threads),
                               str(size), memory_kind],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        port = int(target.stdout.readline())
        address, descriptor, path = bootstrap.unpack(bootstrap.exchange(port, b"bench"))
        peer = {"address": address, "descriptor": descriptor, "target": json.loads(path)}
        yield peer
    finally:
        try:
            report = target.communicate(timeout=30)[0].splitlines()  # closes its standard input: it ends
        except subprocess.TimeoutExpired:
            target.kill()
            report = target.communicate()[0].splitlines()
    peer["target_staging"] = json.loads(report[-1]) if report else {}


@contextlib.contextmanager
def running_on(cores: Iterable[int] | None) -> Iterator[None]:
    """Run the calling thread on ``cores`` (when there are any) for the block: as a user of the engine
    should, so that it never preempts a worker that polls a NIC."""
    before = os.sched_getaffinity(0)
    if cores and cores != before:
        os.sched_setaffinity(0, cores)
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)
