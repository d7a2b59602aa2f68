"""A peer process for the API tests: an Engine with one registered buffer that waits for writes.

    python tests/api_peer.py PROVIDER DOMAIN SIZE [--hex] [--staged-host [--small-pool]] [--threads=N]
prints its bootstrap port, swaps (address, descriptor) with the test over it, then answers commands
read from stdin, one per line: "expect IMM COUNT TIMEOUT" -> "landed COUNT sha256=..." (or "timeout"),
"expect-each FIRST LAST TIMEOUT" (one page carrying each value of FIRST..LAST-1) -> "landed N sha256=...",
"digest", "count BYTE" -> how many bytes of the buffer hold that value, "stats KEY" -> engine.stats()[KEY] as
JSON, "close-region" (closes the
region, waits until it is deregistered, registers a fresh zeroed buffer of the same size and answers
with its descriptor in hex: later digests are of that buffer). DOMAIN may name several NICs,
comma-separated. With --staged-host the buffer is a staged target in host memory (Engine._register_staged_host:
writes land in the engine's lanes and are copied into place before they count); --small-pool makes its landing pool 4
lanes of two 64 KiB pages, leased for 30 s (the engine's timeout; else 10 s, or --timeout=S). With --hex it prints the packed (address,
descriptor) as one hex line instead of a port: a test outside the peer's network namespace cannot reach
the peer's loopback, but it can always read the peer's stdout."""
import hashlib
import json
import sys
import time

import numpy as np

from fabriclab import Engine, TransferTimeout, bootstrap

provider, domain, size = sys.argv[1], sys.argv[2], int(sys.argv[3])
bootstrap_as_hex = "--hex" in sys.argv[4:]
staged = "--staged-host" in sys.argv[4:]
pool = (dict(staging_bytes=8 << 16, staging_chunk_bytes=2 << 16, timeout=30) if "--small-pool" in sys.argv[4:]
        else dict(timeout=next((float(a.split("=", 1)[1]) for a in sys.argv[4:] if a.startswith("--timeout=")), 10)))
threads = next((int(a.split("=", 1)[1]) for a in sys.argv[4:] if a.startswith("--threads=")), None)
with Engine(provider, domains=None if domain == "-" else domain, threads=threads, pin=False, **pool) as engine:
    buffer = np.zeros(size, dtype=np.uint8)
    region = engine._register_staged_host(buffer) if staged else engine.register(buffer)
    if bootstrap_as_hex:
        print(bootstrap.pack(engine.address, region.descriptor()).hex(), flush=True)
    else:
        with bootstrap.Rendezvous() as rendezvous:
            print(rendezvous.port, flush=True)
            rendezvous.exchange(bootstrap.pack(engine.address, region.descriptor()))
    for line in sys.stdin:
        words = line.split()
        if words[0] == "expect":
            try:
                engine.expect(int(words[1]), int(words[2]), timeout=float(words[3])).result()
                print(f"landed {words[2]} sha256={hashlib.sha256(buffer).hexdigest()}", flush=True)
            except TransferTimeout:
                print("timeout", flush=True)
        elif words[0] == "expect-each":
            waits = [engine.expect(imm, 1, timeout=float(words[3])) for imm in range(int(words[1]), int(words[2]))]
            try:
                print(f"landed {sum(w.result() for w in waits)} sha256={hashlib.sha256(buffer).hexdigest()}",
                      flush=True)
            except TransferTimeout:
                print("timeout", flush=True)
        elif words[0] == "digest":
            print(f"sha256={hashlib.sha256(buffer).hexdigest()}", flush=True)
        elif words[0] == "stats":
            print(json.dumps(engine.stats()[words[1]]), flush=True)
        elif words[0] == "count":
            print(int(np.count_nonzero(buffer == int(words[1]))), flush=True)
        elif words[0] == "close-region":
            old = region.registrations
            region.close()
            deadline = time.monotonic() + 10
            while not all(r.mr.closed for r in old) and time.monotonic() < deadline:
                time.sleep(0.01)  # the engine deregisters a closed region in the background
            buffer = np.zeros(size, dtype=np.uint8)
            region = engine.register(buffer)
            print(region.descriptor().hex(), flush=True)
