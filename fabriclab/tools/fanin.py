"""Many writers into one target (prefill workers into one decode worker): N writer processes, each its own
``Engine``, write one-page transfers into one target engine at once; the target counts every page with
``expect`` and checks each writer's pages byte for byte at the end.

    python -m fabriclab fanin --provider shm --writers 4 --pages 20000

Prints pages/s in all and per writer, Gbps (bytes × 8 / elapsed / 1e9) and the cores the run had. Every
engine starts its default workers (up to 8) without knowing of the others; idle ones rest (native/resting.c).
Before they did, shm — whose target must progress each write — collapsed as writers were added (16 cores,
8 writers: 6k pages/s; now 39k; README, "Several engines on one host"). Each writer waits for one transfer
before it submits the next unless ``--per-call`` puts several pages in one call.
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

import numpy as np

from .. import Engine, bootstrap, cli, measure

SLOTS = 16  # pages of the target region each writer cycles through


def _writer(provider: str, packed_hex: str, index: int, pages: int, per_call: int, page: int,
            threads: int | None) -> None:
    """One writer process: connects, says "ready", waits for "go" on stdin, writes, says "wrote N in S"."""
    address, descriptor = bootstrap.unpack(bytes.fromhex(packed_hex))
    with Engine(provider, threads=threads, pin=False) as engine:
        source = engine.register(np.full(SLOTS * page, index + 1, dtype=np.uint8))
        peer = engine.connect(address)
        print("ready", flush=True)
        sys.stdin.readline()
        started, done = time.perf_counter(), 0
        while done < pages:
            n = min(per_call, pages - done)
            offsets = [(done + k) % SLOTS for k in range(n)]
            peer.write_pages(source, offsets, descriptor, [index * SLOTS + o for o in offsets], page,
                             imm=index + 1).result(60)
            done += n
        print(f"wrote {done} in {time.perf_counter() - started:.6f}", flush=True)


def run(provider: str, writers: int, pages: int, per_call: int = 1, page: int = 4096,
        threads: int | None = None, timeout: float = 600.0) -> dict:
    """Runs one fan-in and returns its figures; raises on a lost page or a wrong byte."""
    with Engine(provider, threads=threads, pin=False) as target:
        buffer = np.zeros(writers * SLOTS * page, dtype=np.uint8)
        region = target.register(buffer)
        packed = bootstrap.pack(target.address, region.descriptor()).hex()
        procs = [subprocess.Popen([sys.executable, "-m", "fabriclab.tools.fanin", "--writer", provider, packed,
                                   str(i), str(pages), str(per_call), str(page), str(threads or 0)],
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
                 for i in range(writers)]
        try:
            for p in procs:
                if p.stdout.readline().strip() != "ready":
                    raise RuntimeError(f"a writer failed to connect (exit {p.wait(10)})")
            counted = [target.expect(i + 1, pages, timeout=timeout) for i in range(writers)]
            started = time.perf_counter()
            for p in procs:
                p.stdin.write("go\n")
                p.stdin.flush()
            for c in counted:
                c.result()
            elapsed = time.perf_counter() - started
            own = [float(p.stdout.readline().split()[-1]) for p in procs]
        finally:
            for p in procs:
                p.stdin.close()
                if p.wait(30) != 0:
                    raise RuntimeError(f"a writer exited with {p.returncode}")
        blocks = buffer.reshape(writers, SLOTS * page)
        for i in range(writers):
            written = min(pages, SLOTS) * page
            if not (blocks[i, :written] == i + 1).all():
                raise RuntimeError(f"writer {i}'s pages are not byte-exact in the target")
    total = writers * pages
    return {"provider": provider, "writers": writers, "pages": total, "page_bytes": page, "per_call": per_call,
            "threads": threads, "cores": len(os.sched_getaffinity(0)), "seconds": elapsed,
            "pages_per_s": total / elapsed, "gbps": measure.gbps(total * page, elapsed),
            "writer_pages_per_s": statistics.median(pages / s for s in own)}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--provider", type=cli.provider_name, default="shm", help="default %(default)s")
    p.add_argument("--writers", type=cli.count("writer processes", 256), default=4, help="default %(default)s")
    p.add_argument("--pages", type=cli.count("writes per writer", 10**8), default=10000,
                   help="one-page writes per writer (default %(default)s)")
    p.add_argument("--per-call", type=cli.count("pages per call", 1 << 16), default=1,
                   help="pages per write_pages call (default %(default)s)")
    p.add_argument("--page-size", type=cli.positive_size, default=4096, help="default %(default)s bytes")
    p.add_argument("--threads", type=cli.count("worker threads per engine", 256), default=None,
                   help="worker threads per engine (default: the engine's)")


def main(args) -> int:
    r = run(args.provider, args.writers, args.pages, args.per_call, args.page_size, args.threads)
    print(f"{r['provider']}: {r['writers']} writers x {args.pages} pages of {r['page_bytes']} B "
          f"({r['per_call']} a call), {r['cores']} cores: {r['pages_per_s']:,.0f} pages/s in all "
          f"({r['gbps']:.2f} Gbps), {r['writer_pages_per_s']:,.0f} pages/s per writer (median), "
          f"{r['seconds']:.2f} s; every page counted, byte-exact")
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["--writer"]:
        prov, hexed, idx, n, per, size, thr = sys.argv[2:9]
        _writer(prov, hexed, int(idx), int(n), int(per), int(size), int(thr) or None)
