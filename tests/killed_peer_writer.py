"""A writer process for the killed-peer tests: queues large transfers into tests/api_peer.py, kills that
peer mid-transfer, then closes its Engine, and prints one JSON line saying how it went. It runs apart from
pytest because a provider may leave a worker thread spinning for ever (shm on a lock its killed peer held),
and only the end of the process ends such a thread.

    python tests/killed_peer_writer.py PROVIDER DOMAIN PAGES TRANSFERS SUBMITTERS wait|close|region|region-now
PAGES pages of 1 MiB per transfer, TRANSFERS transfers from each of SUBMITTERS threads; "wait" waits for
every transfer before closing, "close" closes while they are in flight, "region" waits for every transfer,
then closes the region (``Region.close()`` with the engine's timeout) before the engine, "region-now" closes
the region at once, its transfers in flight (the region modes' link timeout is the deadline). Prints {"close_s", "region_close_s" (null but in the region modes), "timeout" (the engine's), "stranded", "outcomes": [[type,
buffer_safe], ...] ("ok" for a success), "exit_timeout", "submitters_alive", "shm_left" (this
process's shm regions after the close)}."""
import json
import os
import sys
import threading
import time

import numpy as np

from fabriclab import Engine, TransferError, service as engine_module
from helpers import PeerProcess, regions_of

MiB = 1 << 20
provider, domain, pages, transfers, submitters, mode = sys.argv[1:7]
pages, transfers, submitters = int(pages), int(transfers), int(submitters)

peer_proc = PeerProcess((provider, None if domain == "-" else domain), pages * MiB)
TIMEOUT = 6.0
# the region modes: a link as slow as the deadline, so that no stall ends the transfers early: the peer's death must
LINK_TIMEOUT = TIMEOUT if mode.startswith("region") else 1.0
engine = Engine(provider, domains=None if domain == "-" else domain, pin=False, timeout=TIMEOUT,
                link_timeout=LINK_TIMEOUT, gpu=False)
region = engine.register(np.full(pages * MiB, 7, np.uint8))
peer = engine.connect(peer_proc.address)
futures, refused = [], []


def submit():
    for _ in range(transfers):
        try:
            futures.append(peer.write_pages(region, np.arange(pages), peer_proc.descriptor, np.arange(pages), MiB,
                                            imm=3))
        except TransferError as exc:  # refused while queueing (the engine closed meanwhile): typed too
            refused.append(exc)


threads = [threading.Thread(target=submit) for _ in range(submitters)]
for t in threads:
    t.start()
time.sleep(0.05)
peer_proc.kill()
if mode != "close":
    for t in threads:
        t.join()
    for future in futures if mode in ("wait", "region") else ():
        try:
            future.result(30)
        except TransferError:
            pass
region_close_s = None
if mode.startswith("region"):
    started = time.monotonic()
    region.close()
    region_close_s = time.monotonic() - started
started = time.monotonic()
engine.close()
close_s = time.monotonic() - started
for t in threads:
    t.join(30)
outcomes = []
for future in futures:
    error = future.exception(30)
    outcomes.append(["ok", True] if error is None else [type(error).__name__, error.buffer_safe])
outcomes += [[type(e).__name__, e.buffer_safe] for e in refused]
print(json.dumps({"close_s": close_s, "region_close_s": region_close_s, "timeout": TIMEOUT,
                  "stranded": engine.stats()["stranded_threads"], "outcomes": outcomes,
                  "exit_timeout": engine_module.WORKER_EXIT_TIMEOUT,
                  "submitters_alive": sum(t.is_alive() for t in threads), "shm_left": regions_of(os.getpid())}),
      flush=True)
