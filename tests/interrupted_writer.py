"""A writer process for the signal tests: an Engine over shm that lives through Ctrl-C.

    python tests/interrupted_writer.py
prints "ready PID", then answers commands read from stdin, one per line:
"connect PORT" -> swaps (address, descriptor) with tests/api_peer.py over its bootstrap PORT, connects to it,
prints "connected"; "write IMM PAGES" -> writes PAGES pages to the peer connected last, with immediate data
IMM, prints "posted sha256=DIGEST" (of the pages written) once they are submitted and "wrote" once they
completed.
A SIGINT at any time is caught as KeyboardInterrupt and answered with "interrupted", as an interactive
program that survives Ctrl-C would; the process then goes on reading commands."""
import hashlib
import os
import signal
import sys

import numpy as np

from fabriclab import Engine, bootstrap

PAGE = 4096
# Python turns SIGINT into KeyboardInterrupt only when it was not ignored at start; a background job of a
# non-interactive shell (a CI runner, `make test &`) starts with it ignored.
signal.signal(signal.SIGINT, signal.default_int_handler)

with Engine("shm", pin=False, timeout=10) as engine:
    data = np.arange(64 * PAGE, dtype=np.uint32).astype(np.uint8)
    region = engine.register(data)
    announced = False
    while True:
        try:
            if not announced:  # inside the try: a SIGINT may land while the line is being written
                announced = True
                print(f"ready {os.getpid()}", flush=True)
            line = sys.stdin.readline()
            if not line:
                break
            words = line.split()
            if words[0] == "connect":
                address, descriptor = bootstrap.unpack(bootstrap.exchange(int(words[1]), b"writer"))
                peer = engine.connect(address)
                print("connected", flush=True)
            elif words[0] == "write":
                imm, pages = int(words[1]), int(words[2])
                done = peer.write_pages(region, range(pages), descriptor, range(pages), PAGE, imm=imm)
                print(f"posted sha256={hashlib.sha256(data[:pages * PAGE]).hexdigest()}", flush=True)
                done.result(30)
                print("wrote", flush=True)
        except KeyboardInterrupt:
            print("interrupted", flush=True)
