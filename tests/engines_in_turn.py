"""Target engines in turn, one after another in this process (targets restarting), for the tests of a writer
that reaches many targets in its life.

    python tests/engines_in_turn.py PROVIDER DOMAIN COUNT
For each of COUNT engines in turn: opens it (one NIC, no pinning) with a registered one-page buffer, prints
bootstrap.pack(address, descriptor) as hex, and waits for a line on stdin: "expect IMM" -> waits up to 10 s
for one page carrying IMM and answers "landed" (or "timeout"), then closes the engine; anything else just
closes it. Prints "done" after the last."""
import sys

import numpy as np

from fabriclab import Engine, TransferTimeout, bootstrap

provider, domain, count = sys.argv[1], sys.argv[2], int(sys.argv[3])
for _ in range(count):
    with Engine(provider, domains=None if domain == "-" else domain, nics=1, pin=False, timeout=10) as engine:
        region = engine.register(np.zeros(65536, np.uint8))
        print(bootstrap.pack(engine.address, region.descriptor()).hex(), flush=True)
        words = sys.stdin.readline().split()
        if words and words[0] == "expect":
            try:
                engine.expect(int(words[1]), 1, timeout=10).result()
                print("landed", flush=True)
            except TransferTimeout:
                print("timeout", flush=True)
print("done", flush=True)
