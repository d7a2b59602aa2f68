"""A writer process for the hostile-use tests: a long-lived Engine writing one page per call (or PAGES).

    python tests/hostile_writer.py PROVIDER DOMAIN PACKED_HEX WRITES IMM [PAGES]
PACKED_HEX is bootstrap.pack(peer address, peer region descriptor) as hex. Call i writes PAGES pages (1
unless given) to pages i * PAGES, i * PAGES + 1, ... modulo max(16, PAGES) of the peer's region, with
immediate data IMM; IMM given as FIRST+ (say 1000+): call i carries FIRST + i, a value of its own, and up
to 256 calls run at once (a flood of distinct values). Prints
"wrote N" when every write has completed, or "failed after N: TYPE: MESSAGE" and exits 1."""
import sys

import numpy as np

from fabriclab import Engine, bootstrap

provider, domain, packed, writes = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
distinct = sys.argv[5].endswith("+")
imm = int(sys.argv[5].rstrip("+"))
pages = int(sys.argv[6]) if len(sys.argv) > 6 else 1
address, descriptor = bootstrap.unpack(bytes.fromhex(packed))
PAGE = 65536
with Engine(provider, domains=None if domain == "-" else domain, pin=False, timeout=10) as engine:
    region = engine.register(np.full(pages * PAGE, imm % 256, dtype=np.uint8))
    peer = engine.connect(address)
    done = 0
    try:
        running = []
        for i in range(writes):
            running.append(peer.write_pages(region, np.arange(pages), descriptor,
                                            (i * pages + np.arange(pages)) % max(16, pages), PAGE,
                                            imm=imm + i if distinct else imm))
            if len(running) == (256 if distinct else 1) or i == writes - 1:
                for transfer in running:
                    transfer.result(10)
                    done += 1
                running = []
    except Exception as exc:
        print(f"failed after {done}: {type(exc).__name__}: {exc}", flush=True)
        sys.exit(1)
    print(f"wrote {done}", flush=True)
