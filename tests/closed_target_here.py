"""Writers and targets of ONE process, the target closed first (issue: two shm engines in one process, the
target closed while the writer's write was pending, and the writer's process died of a segfault). Runs every
case REPEAT times in this process, then prints one JSON line: how each case's writes ended (exception type
names, "ok"), and the shm regions of this process still in /dev/shm. It runs apart from pytest because what it
guards against kills the process.

    python tests/closed_target_here.py PROVIDER DOMAIN REPEAT [CASE ...]
"""
import collections
import json
import os
import sys
import time

import numpy as np

from fabriclab import Engine, fi
from fabriclab.course.lesson import LocalPair

provider, domain, repeat = sys.argv[1], None if sys.argv[2] == "-" else sys.argv[2], int(sys.argv[3])
outcomes: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
destinations = []


def engine() -> Engine:
    return Engine(provider, domains=domain, timeout=10, threads=1, pin=False, gpu=False)


def outcome(case: str, call) -> None:
    try:
        call()
        outcomes[case]["ok"] += 1
    except fi.FabriclabError as exc:
        outcomes[case][type(exc).__name__] += 1


def pair():
    writer, target = engine(), engine()
    source = writer.register(np.ones(4 << 12, np.uint8))
    destinations.append(target.register(np.zeros(4 << 12, np.uint8)))  # a region dropped is closed
    return writer, target, source, destinations[-1].descriptor()


def target_first():
    """The issue's pattern: a write submitted, the target closed at once, then the writer."""
    writer, target, source, descriptor = pair()
    transfer = writer.connect(target.address).write(source, descriptor)
    target.close()
    writer.close()
    outcome("target_first", lambda: transfer.result(5))


def writer_first():
    """The other order: the writer closed with writes queued, the target still answering what it holds of it."""
    writer, target, source, descriptor = pair()
    peer = writer.connect(target.address)
    transfers = [peer.write(source, descriptor, stripe_bytes=4096) for _ in range(4)]
    writer.close()
    time.sleep(0.02)
    target.close()
    for transfer in transfers:
        outcome("writer_first", lambda: transfer.result(5))


def write_after_close():
    """A write through a Peer made while the target was open, posted after it closed."""
    writer, target, source, descriptor = pair()
    peer = writer.connect(target.address)
    outcome("write_before_close", lambda: peer.write(source, descriptor).result(5))
    target.close()
    outcome("write_after_close", lambda: peer.write(source, descriptor).result(5))
    writer.close()


def connect_after_close():
    """connect() to the address of an engine of this process that is closed."""
    writer, target, source, descriptor = pair()
    address = target.address
    target.close()
    outcome("connect_after_close", lambda: writer.connect(address).write(source, descriptor).result(5))
    writer.close()


def both_ways():
    """Each engine writing into the other when the first closes: neither may wait for the other for ever."""
    a, b, source_a, descriptor_b = pair()
    source_b = b.register(np.ones(4 << 12, np.uint8))
    destinations.append(a.register(np.zeros(4 << 12, np.uint8)))
    descriptor_a = destinations[-1].descriptor()
    into_b = a.connect(b.address).write(source_a, descriptor_b)
    into_a = b.connect(a.address).write(source_b, descriptor_a)
    b.close()
    a.close()
    outcome("both_ways", lambda: into_b.result(5))
    outcome("both_ways", lambda: into_a.result(5))


def local_pair():
    """The lessons' in-process pair: its receiver closed under a write, then its sender used."""
    with LocalPair(provider, domain, size=1 << 16, timeout=0.3) as lp:
        remote = lp.inbox_mr.remote()
        lp.post_write("first", 4096)
        lp.receiver.close()

        def use_the_sender():
            for _ in range(50):
                lp.sender.ep.try_post_write(lp.outbox_mr, 0, 4096, lp.dest, remote, 0, "again")
                lp.sender.cq.poll()
        outcome("local_pair", use_the_sender)


cases = [globals()[name] for name in sys.argv[4:]] or [target_first, writer_first, write_after_close,
                                                        connect_after_close, both_ways, local_pair]
for _ in range(repeat):
    for case in cases:
        case()

mine = f"{os.getpid()}:"
left = [n for n in os.listdir("/dev/shm") if n.startswith(mine)] if os.path.isdir("/dev/shm") else []
print(json.dumps({"outcomes": outcomes, "shm_left": left}))
