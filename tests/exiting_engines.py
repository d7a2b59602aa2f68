"""A script that ends with engines still open, one of them a staged target whose landing thread runs and a
transfer into it still in flight (issue 31: some such exits died of SIGSEGV in the landing thread's read of
its control channel, most printed hundreds of tracebacks). It runs apart from pytest because what it guards
against kills the process at its exit.

    python tests/exiting_engines.py PROVIDER DOMAIN HOW

HOW: ``end`` (the script just ends), ``raise`` (an uncaught exception ends it: exit status 1, its own
traceback only) or ``drop`` (the engines are dropped unclosed and collected, then the script ends while
their closers run).
"""
import gc
import sys

import numpy as np

from fabriclab import Engine

PAGE = 4096
provider, domain, how = sys.argv[1], None if sys.argv[2] == "-" else sys.argv[2], sys.argv[3]
options = {"domains": domain, "pin": False, "gpu": False, "timeout": 10}
# a small landing pool (4 lanes of 2 pages): the transfer below streams through it while the script ends
target = Engine(provider, staging_bytes=8 * PAGE, staging_chunk_bytes=2 * PAGE, **options)
writer = Engine(provider, **options)
landed = np.zeros(256 * PAGE, np.uint8)
region = target._register_staged_host(landed)
peer = writer.connect(target.address)
source = writer.register(np.full(256 * PAGE, 7, np.uint8))
peer.write_pages(source, np.arange(16), region.descriptor(), np.arange(16), PAGE).result(30)
assert np.all(landed[:16 * PAGE] == 7)
in_flight = peer.write_pages(source, np.arange(256), region.descriptor(), np.arange(256), PAGE)
print("landing", flush=True)
if how == "raise":
    raise RuntimeError("the script's own error")
if how == "drop":
    del target, writer, region, peer, source, in_flight
    gc.collect()
