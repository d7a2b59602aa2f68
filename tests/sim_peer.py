"""The far side of tests/test_sim.py: a sim endpoint in a process of its own. Prints its address and a
registered region's descriptor, then serves until its standard input closes (or it is killed)."""
import sys

import numpy as np

from fabriclab import fi

with fi.EndpointStack(fi.getinfo("sim", sys.argv[1])[0]) as stack:
    buffer = np.zeros(1 << 20, dtype=np.uint8)
    region = stack.register(buffer)
    print(stack.ep.address().hex(), region.remote().pack().hex(), flush=True)
    landed = []
    while len(landed) < int(sys.argv[2]):
        landed.extend(c.data for c in stack.cq.poll() if c.has_data)
    print(" ".join(map(str, landed)), int(buffer.astype(np.uint64).sum()), flush=True)
    sys.stdin.read()
