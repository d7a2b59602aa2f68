"""The writer side of tests/test_sim_faults.py: `drive` posts operations and polls until every one has
completed (or a deadline passes), counting how each ended; run as a script it writes into a
tests/sim_peer.py target in another process and SIGKILLs that target partway.

    python tests/sim_fault_writer.py ADDRESS REGION TARGET_PID WRITES SIZE KILL_AFTER
writes WRITES writes of SIZE bytes with immediate data into the target, kills TARGET_PID once KILL_AFTER of
them completed, and prints one JSON line: {"ok": n, "errors": {code: n}, "missing": n, "twice": n, "s": s}.
The model's rate (FABRICLAB_SIM_GBPS) comes from the environment, so the script runs in a process of its own.
"""
import collections
import json
import os
import signal
import sys
import time
from typing import Callable

import numpy as np

from fabriclab import fi

NIC = "rdmap16s0-rdm"


class Tally:
    """How each posted operation ended: once with success, once with an error, or not (yet)."""

    def __init__(self, expected: int):
        self.expected = expected
        self.posted = 0
        self.ok: collections.Counter = collections.Counter()
        self.errors: dict = {}
        self.details: dict = {}
        self.error_codes: collections.Counter = collections.Counter()
        self.twice = 0

    def done(self, token, code: int | None = None, detail: str = "") -> None:
        if token in self.ok or token in self.errors:
            self.twice += 1
        if code is None:
            self.ok[token] += 1
        else:
            self.errors[token] = code
            self.details[token] = detail
            self.error_codes[fi.errno_name(code)] += 1

    @property
    def finished(self) -> int:
        return len(self.ok) + len(self.errors)

    def summary(self) -> dict:
        return {"ok": len(self.ok), "errors": dict(self.error_codes), "missing": self.expected - self.finished,
                "twice": self.twice}


def drive(stacks: list, try_post: Callable[[int], bool], total: int, expected: int | None = None,
          timeout: float = 30.0, after_poll: Callable[[Tally], None] = lambda tally: None) -> Tally:
    """Post operations 0..total-1 with try_post(i) (False: -FI_EAGAIN, tried again after a poll) and poll
    every stack's CQ until `expected` completions with a token (default: one per post) came, or `timeout`
    passed. Tokens are the operation numbers (others, such as receives', are the caller's)."""
    tally, deadline = Tally(total if expected is None else expected), time.monotonic() + timeout
    while tally.finished < tally.expected and time.monotonic() < deadline:
        while tally.posted < total and try_post(tally.posted):
            tally.posted += 1
        for stack in stacks:
            try:
                for c in stack.cq.poll():
                    if c.token is not None:
                        tally.done(c.token)
            except fi.FabricError as exc:
                tally.done(exc.token, exc.errno, exc.detail)
        after_poll(tally)
    return tally


def main() -> None:
    address, region, target_pid, writes, size, kill_after = sys.argv[1:7]
    writes, size, kill_after = int(writes), int(size), int(kill_after)
    with fi.EndpointStack(fi.getinfo("sim", NIC)[0]) as stack:
        dest = stack.av.insert(fi.Address.parse(address))
        remote = fi.RemoteRegion.unpack(bytes.fromhex(region))
        mr = stack.register(np.ones(size, dtype=np.uint8))
        slots = remote.length // size
        killed = []

        def kill_partway(tally: Tally) -> None:
            if not killed and len(tally.ok) >= kill_after:
                os.kill(int(target_pid), signal.SIGKILL)
                killed.append(time.monotonic())

        started = time.monotonic()
        tally = drive([stack], lambda i: stack.ep.try_post_write(mr, 0, size, dest, remote, (i % slots) * size, i,
                                                                 data=i), writes, after_poll=kill_partway)
        print(json.dumps({**tally.summary(), "s": time.monotonic() - started, "killed": bool(killed)}), flush=True)


if __name__ == "__main__":
    main()
