#!/usr/bin/env python3
"""Throughput of the landing protocol without a GPU: host memory written into a host-memory staged target
(``Engine._register_staged_host``: the lanes, REQUEST/GRANT/FILLED/COPIED, copied into place with memmove),
a writer and its target in two processes, one transfer at a time (the shapes of ``bench --defaults``).

    .venv/bin/python scripts/bench_landing.py [--provider shm] [--rounds 5] [--code DIR ...]

Each ``--code DIR`` is a checkout whose ``fabriclab`` package is imported (a copy of an earlier commit, to
compare before and after); the checkouts take turns round after round (interleaved), each round a fresh
pair of processes. Per shape and checkout it prints the median GB/s of the rounds with their spread, the CPU
seconds both processes spent per GB moved (on a host of few cores, the copies and the polling threads of
both sides share them), and the one-thread memcpy ceiling of this machine measured between rounds (the
target's copy is one memmove per lane run on one thread). ``--plain`` registers the target as plain host
memory instead: the writes alone, for reference. Every round checks the target's bytes against the
source's (byte-exact)."""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import resource
import subprocess
import sys
import time

SHAPES = ((64, 1 << 20), (1024, 64 << 10))  # (pages, page bytes): 64 MiB a transfer


def target(provider: str, size: int, plain: bool) -> None:
    """The far side: a staged host target of ``size`` bytes; prints (address, descriptor) as hex, then
    answers "digest" with the sha256 of its buffer, until its standard input closes."""
    import numpy as np
    from fabriclab import Engine, bootstrap
    with Engine(provider, pin=False) as engine:
        buffer = np.zeros(size, np.uint8)
        region = engine.register(buffer) if plain else engine._register_staged_host(buffer)
        print(bootstrap.pack(engine.address, region.descriptor()).hex(), flush=True)
        for line in sys.stdin:
            if line.strip() == "digest":
                print(hashlib.sha256(buffer).hexdigest(), flush=True)
            elif line.strip() == "cpu":
                print(_cpu_seconds(), flush=True)
        print(json.dumps(engine.stats()["staging"]), flush=True)


def _cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def writer(provider: str, transfers: int, warmup: int, plain: bool) -> None:
    """One round: a target process, then each shape contiguous and permuted; prints a JSON line of GB/s."""
    import numpy as np
    from fabriclab import Engine, bootstrap
    size = max(n * s for n, s in SHAPES)
    far = subprocess.Popen([sys.executable, __file__, "--target", "--provider", provider, "--size", str(size)] + ["--plain"] * plain,
                           stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    result: dict = {}
    try:
        address, descriptor = bootstrap.unpack(bytes.fromhex(far.stdout.readline().strip()))
        with Engine(provider, timeout=30) as engine:
            peer = engine.connect(address)
            source = np.frombuffer(np.random.default_rng(1).bytes(size), np.uint8).copy()
            region = engine.register(source)
            for pages, page in SHAPES:
                for order in ("contiguous", "permuted"):
                    src = np.arange(pages)
                    dst = src if order == "contiguous" else np.random.default_rng(pages).permutation(pages)
                    for _ in range(warmup):
                        peer.write_pages(region, src, descriptor, dst, page).result(timeout=60)
                    far.stdin.write("cpu\n")
                    far.stdin.flush()
                    cpu = _cpu_seconds() + float(far.stdout.readline())
                    started = time.perf_counter()
                    for _ in range(transfers):
                        peer.write_pages(region, src, descriptor, dst, page).result(timeout=60)
                    seconds = time.perf_counter() - started
                    far.stdin.write("cpu\n")
                    far.stdin.flush()
                    cpu = _cpu_seconds() + float(far.stdout.readline()) - cpu
                    expected = np.empty_like(source)
                    expected.reshape(-1, page)[dst] = source.reshape(-1, page)[src]
                    far.stdin.write("digest\n")
                    far.stdin.flush()
                    if far.stdout.readline().strip() != hashlib.sha256(expected).hexdigest():
                        raise SystemExit(f"{pages}x{page} {order}: the target's bytes differ from the source's")
                    case = f"{pages}x{page >> 10}KiB {order}"
                    result[case] = transfers * pages * page / seconds / 1e9
                    result[f"{case} cpu"] = cpu / (transfers * pages * page / 1e9)
    finally:
        far.stdin.close()
        far.wait(30)
    print(json.dumps(result), flush=True)


def memcpy_ceiling() -> float:
    """GB/s of one thread's memcpy of a 64 MiB transfer (the target copies each lane with one memmove per run)."""
    from fabriclab.tools.bench_ceiling import memcpy_rate
    return memcpy_rate(64 << 20, threads=1, repeats=5)["gbps"] / 8


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--provider", default="shm")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--transfers", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--code", action="append", help="checkout whose fabriclab to run (repeat to compare)")
    parser.add_argument("--plain", action="store_true",
                        help="a target registered as plain host memory instead: the writes alone, for reference")
    parser.add_argument("--target", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--round", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--size", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.target:
        return target(args.provider, args.size, args.plain)
    if args.round:
        return writer(args.provider, args.transfers, args.warmup, args.plain)
    codes = args.code or [os.path.dirname(os.path.dirname(os.path.abspath(__file__)))]
    runs: dict[str, dict[str, list[float]]] = {code: {} for code in codes}
    ceilings = []
    for r in range(args.rounds):
        for code in codes[r % len(codes):] + codes[:r % len(codes)]:  # no checkout always first
            env = dict(os.environ, PYTHONPATH=code)
            out = subprocess.run([sys.executable, __file__, "--round", "--provider", args.provider, "--transfers",
                                  str(args.transfers), "--warmup", str(args.warmup)] + ["--plain"] * args.plain, env=env, capture_output=True,
                                 text=True, timeout=600)
            if out.returncode:
                raise SystemExit(f"round {r} of {code} failed:\n{out.stderr[-3000:]}")
            for case, gbs in json.loads(out.stdout.splitlines()[-1]).items():
                runs[code].setdefault(case, []).append(gbs)
        ceilings.append(memcpy_ceiling())
    import numpy as np
    print(f"provider {args.provider}, {os.cpu_count()} cores, {args.rounds} rounds of {args.transfers} transfers "
          f"after {args.warmup}, 64 MiB a transfer; GB/s median (min-max)")
    for code in codes:
        print(code)
        for case, values in runs[code].items():
            if not case.endswith(" cpu"):
                cpu = runs[code][f"{case} cpu"]
                print(f"  {case:24} {np.median(values):6.2f} ({min(values):.2f}-{max(values):.2f}) GB/s   "
                      f"{np.median(cpu):5.3f} ({min(cpu):.3f}-{max(cpu):.3f}) CPU s/GB")
    print(f"memcpy ceiling, 1 thread: {np.median(ceilings):.2f} GB/s ({min(ceilings):.2f}-{max(ceilings):.2f})")


if __name__ == "__main__":
    main()
