"""fork() with a live shm endpoint: the child can neither use nor close what the parent opened.

    python tests/forked_endpoint.py SERVER_ADDRESS
opens an endpoint over shm and forks. The child tries each use of the inherited objects and prints
"refused NAME" for each one refused with the fork UsageError (anything else ends it with status 1), opens
an endpoint of its own, then drops its copies every way there is (close(), garbage collection, interpreter
exit). The parent waits for it, prints "child exited STATUS" and "regions N" (its /dev/shm regions), sends
"after fork" to SERVER_ADDRESS (``python -m fabriclab.unidirectional serve --provider shm``) and prints "sent"."""
import gc
import glob
import os
import sys

import numpy as np

from fabriclab import fi
from fabriclab.unidirectional import Sender

server = fi.Address.parse(sys.argv[1])
stack = fi.open_endpoint("shm")
mr = stack.register(np.zeros(64, np.uint8))
parent = os.getpid()

child = os.fork()
if child == 0:
    uses = {
        "ep.address": lambda: stack.ep.address(),
        "ep.try_post_send": lambda: stack.ep.try_post_send(mr, 0, 8, 0, token="t"),
        "cq.poll": lambda: stack.cq.poll(),
        "av.insert": lambda: stack.av.insert(server),
        "mr.remote": lambda: mr.remote(),
        "register": lambda: stack.register(np.zeros(8, np.uint8)),
        "new CompletionQueue": lambda: fi.CompletionQueue(stack.domain),
    }
    for name, use in uses.items():
        try:
            use()
        except fi.UsageError as exc:
            if f"created in process {parent} before fork()" not in str(exc):
                print(f"wrong message for {name}: {exc}", flush=True)
                sys.exit(1)
            print(f"refused {name}", flush=True)
        else:
            print(f"allowed {name}", flush=True)
            sys.exit(1)
    if not (stack.ep.inherited and stack.ep.pid == parent and not stack.ep.closed):
        sys.exit(1)
    with fi.open_endpoint("shm") as own:  # the child's own objects work as anywhere
        own.ep.address()
        if own.ep.inherited:
            sys.exit(1)
    stack.ep.close()  # explicitly: forgets the endpoint, must not close the parent's
    del mr
    gc.collect()  # by collection: the memory region's finalizer
    sys.exit(0)  # at exit: the fabric's finalizer, with the domain, queue and address vector under it

_, status = os.waitpid(child, 0)
print(f"child exited {os.waitstatus_to_exitcode(status)}", flush=True)
print(f"regions {len(glob.glob(f'/dev/shm/{parent}:*'))}", flush=True)
Sender(stack, server, timeout=10).send(b"after fork")
print("sent", flush=True)
stack.close()
