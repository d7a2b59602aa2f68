"""A writer process for the hostile-use tests:

    python tests/hostile_writer.py PROVIDER DOMAIN PACKED_HEX WRITES IMM [PAGES] [--fresh]
PACKED_HEX is bootstrap.pack(peer address, peer region descriptor) as hex. Call i writes PAGES pages (1
unless given) to pages i * PAGES, i * PAGES + 1, ... modulo max(16, PAGES) of the peer's region, with
immediate data IMM; IMM given as FIRST+ (say 1000+): call i carries FIRST + i, a value of its own, and up
to 256 calls run at once (a flood of distinct values). With --fresh, each call comes from a fresh Engine (one
NIC), opened and closed around it: writers coming and going. Prints "wrote N" when every write has
completed, or "failed after N: TYPE: MESSAGE" and exits 1."""
import contextlib
import sys

import numpy as np

from fabriclab import Engine, bootstrap

fresh = "--fresh" in sys.argv
args = [a for a in sys.argv if a != "--fresh"]
provider, domain, packed, writes = args[1], args[2], args[3], int(args[4])
distinct = args[5].endswith("+")
imm = int(args[5].rstrip("+"))
pages = int(args[6]) if len(args) > 6 else 1
address, descriptor = bootstrap.unpack(bytes.fromhex(packed))
PAGE = 65536


def writer(stack, nics=None):
    """An engine with its source region and its Peer, entered on ``stack``."""
    engine = stack.enter_context(Engine(provider, domains=None if domain == "-" else domain, nics=nics, pin=False,
                                        timeout=10))
    return engine.register(np.full(pages * PAGE, imm % 256, dtype=np.uint8)), engine.connect(address)


with contextlib.ExitStack() as lasting:
    region, peer = (None, None) if fresh else writer(lasting)
    done = 0
    try:
        running = []
        for i in range(writes):
            with contextlib.ExitStack() as call:
                if fresh:
                    region, peer = writer(call, nics=1)
                running.append(peer.write_pages(region, np.arange(pages), descriptor,
                                                (i * pages + np.arange(pages)) % max(16, pages), PAGE,
                                                imm=imm + i if distinct else imm))
                if fresh or len(running) == (256 if distinct else 1) or i == writes - 1:
                    for transfer in running:
                        transfer.result(10)
                        done += 1
                    running = []
    except Exception as exc:
        print(f"failed after {done}: {type(exc).__name__}: {exc}", flush=True)
        sys.exit(1)
    print(f"wrote {done}", flush=True)
