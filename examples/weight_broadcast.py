"""One writer pushes a weight buffer to peers that join while it runs (an RL trainer -> inference workers).

    python examples/weight_broadcast.py                      # 2 peers at the start, 1 more joins later
    python examples/weight_broadcast.py --peers 3 --late 2 --size 128M

The writer registers its weights once and keeps serving. Each peer is its own process with its own
``Engine``: it registers an empty buffer of the same size, sends the writer its engine address and region
descriptor (plain bytes), and waits on ``Engine.expect(imm, count)``. On each join the writer
``connect``s to that peer and starts ``Peer.write`` -- one striped write per ``--stripe`` bytes, spread
over the NICs -- without waiting for the pushes already in flight. There is no world to size up front:
the late peers are only started once the first pushes are under way. Every peer compares the sha256 of
what landed with the writer's and reports back; exit status 0 means every copy is byte-exact.

Joins and reports travel over ``fabriclab.bootstrap`` (a small TCP helper for demos); the engine itself
only ever needs the bytes.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import hashlib
import json
import os
import subprocess
import sys

import numpy as np

from fabriclab import Engine, TransferError, bootstrap, fi
from fabriclab.cli import positive_seconds, positive_size

SUCCESS = "weight_broadcast: OK"


def open_engine(args) -> Engine:
    provider, domain = fi.same_host_fabric(args.provider)  # tcp stays on the loopback interface
    return Engine(provider, domains=args.domain or domain, nics=args.nics, threads=args.threads, pin=False,
                  timeout=args.timeout)


# --------------------------------------------------------------------------------------------- peer


def peer_main(args) -> int:
    with open_engine(args) as engine:
        weights = np.zeros(args.size, dtype=np.uint8)
        region = engine.register(weights)
        plan = json.loads(bootstrap.exchange(args.port, bootstrap.pack(b"join", args.name.encode(), engine.address,
                                                             region.descriptor()), timeout=args.timeout))
        engine.expect(plan["imm"], plan["writes"]).result()  # TransferTimeout if they do not all land in time
        digest = hashlib.sha256(weights).hexdigest()
        ok = digest == plan["sha256"]
        print(f"[{args.name}] {plan['writes']} writes landed; sha256 {digest[:16]}... "
              f"{'matches' if ok else 'DIFFERS'}", flush=True)
        report = {"name": args.name, "ok": ok, "sha256": digest}
        bootstrap.exchange(args.port, bootstrap.pack(b"done", json.dumps(report).encode()), timeout=args.timeout)
        region.close()
    return 0 if ok else 1


# ------------------------------------------------------------------------------------------- writer


def start_peer(args, port: int, name: str) -> subprocess.Popen:
    command = [sys.executable, os.path.abspath(__file__), "--role", "peer", "--port", str(port), "--name", name,
               "--size", str(args.size), "--timeout", str(args.timeout)]
    for option in ("provider", "domain", "nics", "threads"):
        if getattr(args, option) is not None:
            command += [f"--{option}", str(getattr(args, option))]
    return subprocess.Popen(command)


def writer_main(args) -> int:
    weights = np.frombuffer(np.random.default_rng(args.seed).bytes(args.size), dtype=np.uint8).copy()
    writes = -(-args.size // args.stripe)
    plan = json.dumps({"imm": args.imm, "writes": writes, "sha256": hashlib.sha256(weights).hexdigest()}).encode()
    children: list[subprocess.Popen] = []
    pushes: dict[str, concurrent.futures.Future] = {}
    reports: dict[str, dict] = {}
    with open_engine(args) as engine, bootstrap.Rendezvous(timeout=args.timeout) as rendezvous:
        region = engine.register(weights)
        print(f"[writer] {engine.provider}, {engine.nics} NIC(s), {engine.threads} thread(s); weights "
              f"{args.size / 2**20:.1f} MiB as {writes} striped writes of up to {args.stripe} B; sha256 "
              f"{json.loads(plan)['sha256'][:16]}...", flush=True)
        try:
            children += [start_peer(args, rendezvous.port, f"peer{i + 1}") for i in range(args.peers)]
            total = args.peers + args.late
            while len(reports) < total:
                tag, *rest = bootstrap.unpack(rendezvous.exchange(plan))  # the next join or report, whoever comes first
                if tag == b"join":
                    name, address, descriptor = rest[0].decode(), rest[1], rest[2]
                    peer = engine.connect(address)
                    pushes[name] = peer.write(region, descriptor, imm=args.imm, stripe_bytes=args.stripe)
                    print(f"[writer] {name} joined; pushing ({len(pushes)} of {total} so far)", flush=True)
                    if len(pushes) == args.peers and args.late:
                        # the first pushes are in flight: now the late peers start, and join a running writer
                        children += [start_peer(args, rendezvous.port, f"late{args.peers + i + 1}")
                                     for i in range(args.late)]
                elif tag == b"done":
                    report = json.loads(rest[0])
                    reports[report["name"]] = report
            results = {name: push.result() for name, push in pushes.items()}  # each done: weights reusable
            codes = [child.wait(args.timeout) for child in children]
        except BaseException:
            for child in children:
                child.kill()
                child.wait()
            raise
        stats = engine.stats()
    per_nic = ", ".join(f"nic{n['nic']} {n['bytes'] / 2**20:.0f} MiB" for n in stats["per_nic"])
    print(f"[writer] per NIC: {per_nic}")
    for name, result in results.items():
        print(f"[writer] {name}: {result.bytes / 2**20:.1f} MiB in {result.elapsed_s * 1e3:.1f} ms "
              f"({result.bytes * 8 / result.elapsed_s / 1e9:.2f} Gbps)")
    bad = [n for n, r in reports.items() if not r["ok"]]
    if bad or any(codes):
        print(f"weight_broadcast: FAILED (digest differs at {bad or '-'}; peer exit codes {codes})")
        return 1
    print(f"{SUCCESS}: {args.size / 2**20:.1f} MiB to {total} peers ({args.late} joined while the writer ran), "
          f"every sha256 matches")
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--role", choices=("writer", "peer"), default="writer", help="writer (default) starts the peers")
    p.add_argument("--port", type=int, help="(peer) the writer's bootstrap port")
    p.add_argument("--name", default="peer", help="(peer) how the writer calls it")
    p.add_argument("--provider", help="libfabric provider (default: $FABRICLAB_PROVIDER, else the best here)")
    p.add_argument("--domain", help="NIC/domain (tcp: default lo)")
    p.add_argument("--nics", type=int, help="NIC slots (default: every domain; more adds emulated ones)")
    p.add_argument("--threads", type=int, help="engine worker threads (default: from the topology)")
    p.add_argument("--size", type=positive_size, default=32 << 20, help="weight bytes (default 32M)")
    p.add_argument("--stripe", type=positive_size, default=1 << 20, help="bytes per write (default 1M)")
    p.add_argument("--peers", type=int, default=2, help="peers started with the writer")
    p.add_argument("--late", type=int, default=1, help="peers started once the first pushes are in flight")
    p.add_argument("--imm", type=int, default=7)
    p.add_argument("--seed", type=int, default=3)
    p.add_argument("--timeout", type=positive_seconds, default=30.0, help="deadline of every transfer and wait, seconds")
    args = p.parse_args(argv)
    if args.role == "peer":
        if args.port is None:
            p.error("--role peer needs --port (the writer starts it with one)")
        return peer_main(args)
    if args.peers < 1 or args.late < 0:
        p.error("--peers must be at least 1 and --late at least 0")
    return writer_main(args)


if __name__ == "__main__":
    try:
        sys.exit(main())
    except (TransferError, fi.FabricError, fi.UsageError) as exc:
        print(f"weight_broadcast: FAILED: {type(exc).__name__}: {exc}", file=sys.stderr)
        sys.exit(1)
