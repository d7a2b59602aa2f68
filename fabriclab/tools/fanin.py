"""Many writers into one target (prefill workers into one decode worker): N writer processes, each its own
``Engine``, write one-page transfers into one target engine at once; the target counts every page with
``expect`` and checks each writer's pages byte for byte at the end.

    python -m fabriclab fanin --provider shm --writers 4 --pages 20000

Prints pages/s in all and per writer, Gbps (bytes × 8 / elapsed / 1e9) and the cores the run had. Every
engine starts its default workers (up to 8) without knowing of the others; idle ones rest (native/resting.c).
Before they did, shm — whose target must progress each write — collapsed as writers were added (16 cores,
8 writers: 6k pages/s; now 39k; README, "Several engines on one host"). Each writer waits for one transfer
before it submits the next unless ``--per-call`` puts several pages in one call.

Every page is checked, on the modeled NICs too (``--provider sim`` turns their payload mode on,
FABRICLAB_SIM_PAYLOAD=1). A run whose buffers would not fit the memory left, or that could not be checked,
is refused before anything starts, in one line.
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

import numpy as np

from .. import Engine, bootstrap, cli, fi, measure

SLOTS = 16  # pages of the target region each writer cycles through (more when a call holds more pages)
PAYLOAD = "FABRICLAB_SIM_PAYLOAD"  # the modeled NICs (sim) move the bytes only with it set to 1


class FaninFailed(fi.FabriclabError, RuntimeError):
    """A writer process failed, or a page did not land byte for byte."""


def _slots(per_call: int) -> int:
    """Pages of the target region each writer cycles through: a call never names one twice."""
    return max(SLOTS, per_call)


def _writer(provider: str, packed_hex: str, index: int, pages: int, per_call: int, page: int,
            threads: int | None) -> None:
    """One writer process: connects, says "ready", waits for "go" on stdin, writes, says "wrote N in S"."""
    address, descriptor = bootstrap.unpack(bytes.fromhex(packed_hex))
    slots = _slots(per_call)
    with Engine(provider, threads=threads, pin=False) as engine:
        source = engine.register(np.full(slots * page, index + 1, dtype=np.uint8))
        peer = engine.connect(address)
        print("ready", flush=True)
        sys.stdin.readline()
        started, done = time.perf_counter(), 0
        while done < pages:
            n = min(per_call, pages - done)
            offsets = [(done + k) % slots for k in range(n)]
            peer.write_pages(source, offsets, descriptor, [index * slots + o for o in offsets], page,
                             imm=index + 1).result(60)
            done += n
        print(f"wrote {done} in {time.perf_counter() - started:.6f}", flush=True)


def available_memory() -> int:
    """Bytes of memory this machine can still give (MemAvailable), or all it has where /proc says nothing."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def check_run(provider: str, writers: int, per_call: int, page: int) -> None:
    """UsageError, before any engine opens, for a run that cannot be made or checked here: buffers larger than
    the memory left, or modeled NICs that move no bytes (nothing to check them by)."""
    need, have = 2 * writers * _slots(per_call) * page, available_memory()  # the target's, and each writer's
    if need > have * 3 // 4:
        raise fi.UsageError(
            f"{writers} writer(s) with pages of {cli.format_size(page)} need {need / 2**30:,.1f} GiB of memory (each "
            f"writer cycles through {_slots(per_call)} pages, held in the target and in the writer), and this "
            f"machine has {have / 2**30:,.1f} GiB available: use a smaller --page-size, fewer --writers or a smaller "
            "--per-call")
    if not fi.getinfo(provider)[0].moves_payload:
        raise fi.UsageError(
            f"fanin checks every page byte for byte, and the modeled NICs (sim) move bytes only with {PAYLOAD}=1 set "
            f"before libfabric starts in the process (now {os.environ.get(PAYLOAD)!r}): run with {PAYLOAD}=1 "
            f"(`python -m fabriclab fanin --provider sim` sets it unless told {PAYLOAD}=0)")


def run(provider: str, writers: int, pages: int, per_call: int = 1, page: int = 4096,
        threads: int | None = None, timeout: float = 600.0) -> dict:
    """Runs one fan-in and returns its figures; FaninFailed for a failed writer or a wrong byte, UsageError
    for a run that cannot be made or checked here (``check_run``)."""
    check_run(provider, writers, per_call, page)
    slots = _slots(per_call)
    with Engine(provider, threads=threads, pin=False) as target:
        buffer = np.zeros(writers * slots * page, dtype=np.uint8)
        region = target.register(buffer)
        packed = bootstrap.pack(target.address, region.descriptor()).hex()
        procs = [subprocess.Popen([sys.executable, "-m", "fabriclab.tools.fanin", "--writer", provider, packed,
                                   str(i), str(pages), str(per_call), str(page), str(threads or 0)],
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
                 for i in range(writers)]
        try:
            for i, p in enumerate(procs):
                if p.stdout.readline().strip() != "ready":
                    raise FaninFailed(f"writer {i} failed to connect (its error is above)")
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
            failed = _end_writers(procs)
        if failed:
            raise FaninFailed(f"writer(s) {', '.join(failed)} failed (their errors are above)")
        blocks = buffer.reshape(writers, slots * page)
        for i in range(writers):
            written = min(pages, slots) * page
            if not (blocks[i, :written] == i + 1).all():
                raise FaninFailed(f"writer {i}'s pages are not byte-exact in the target")
    total = writers * pages
    return {"provider": provider, "writers": writers, "pages": total, "page_bytes": page, "per_call": per_call,
            "threads": threads, "cores": len(os.sched_getaffinity(0)), "seconds": elapsed,
            "pages_per_s": total / elapsed, "gbps": measure.gbps(total * page, elapsed),
            "writer_pages_per_s": statistics.median(pages / s for s in own)}


def _end_writers(procs: list[subprocess.Popen]) -> list[str]:
    """Tell every writer to end (stdin closed), and kill one still running 30 s later: those that failed."""
    failed = []
    for i, p in enumerate(procs):
        p.stdin.close()
        try:
            code = p.wait(30)
        except subprocess.TimeoutExpired:
            p.kill()
            code = p.wait()
        if code != 0:
            failed.append(f"{i} (exit status {code})")
    return failed


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
    if args.provider == fi.MODELED_PROVIDER:
        os.environ.setdefault(PAYLOAD, "1")  # the pages are checked byte for byte: the model must move them
    r = run(args.provider, args.writers, args.pages, args.per_call, args.page_size, args.threads)
    print(f"{r['provider']}: {r['writers']} writers x {args.pages} pages of {r['page_bytes']} B "
          f"({r['per_call']} a call), {r['cores']} cores: {r['pages_per_s']:,.0f} pages/s in all "
          f"({r['gbps']:.2f} Gbps), {r['writer_pages_per_s']:,.0f} pages/s per writer (median), "
          f"{r['seconds']:.2f} s; every page counted, byte-exact")
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["--writer"]:
        prov, hexed, idx, n, per, size, thr = sys.argv[2:9]
        # its failure is one line on stderr; run() names the writer
        cli.run(lambda _: _writer(prov, hexed, int(idx), int(n), int(per), int(size), int(thr) or None))
