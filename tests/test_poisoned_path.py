"""A write the peer cannot take (into a region it closed) poisons nothing: it fails with a TransferError
that does not claim the peer is gone, and after ``connect`` again the same peer, and a peer started after
the failure, get writes through, byte-exact. Between real processes, over every provider here (issue 12,
finding 4: on shm such a write never completes and stalls its endpoint for good, so ``connect`` renews
that endpoint; on tcp the peer drops the connection and the first write after ``connect`` met the old one)."""
import hashlib
import time

import numpy as np
import pytest

from fabriclab import Engine, TransferError
from helpers import PAGE, PeerProcess, pages_of


def digest(buffer) -> str:
    return hashlib.sha256(buffer).hexdigest()


def test_a_write_into_a_closed_region_does_not_poison_the_path(fabric):
    with Engine(fabric[0], domains=fabric[1], pin=False, timeout=3) as engine:  # link_timeout: 1 s
        first = PeerProcess(fabric, 4 * PAGE)
        try:
            data = pages_of(12, 4)
            region = engine.register(data)
            old_peer = engine.connect(first.address)
            old_peer.write_pages(region, [0], first.descriptor, [0], PAGE, imm=1).result(10)
            assert first.ask("expect 1 1 10").startswith("landed 1 ")

            fresh_descriptor = bytes.fromhex(first.ask("close-region"))
            start = time.monotonic()
            with pytest.raises(TransferError) as failed:
                old_peer.write_pages(region, [1], first.descriptor, [1], PAGE).result(10)
            assert time.monotonic() - start < 8
            assert "peer is gone" not in str(failed.value)  # it is not: it closed a region
            stuck = sum(n.get("unreported", 0) for n in engine.stats()["per_nic"])
            address_before = engine.address

            # connect again: every later write goes through, through a fresh Peer and the old one alike
            peer = engine.connect(first.address)
            want = np.zeros(4 * PAGE, dtype=np.uint8)
            for i, through in enumerate((peer, old_peer, peer)):
                page = i + 1
                through.write_pages(region, [page], fresh_descriptor, [page], PAGE, imm=20 + i).result(10)
                want[page * PAGE:(page + 1) * PAGE] = data[page * PAGE:(page + 1) * PAGE]
                assert first.ask(f"expect {20 + i} 1 10") == f"landed 1 sha256={digest(want)}"
            per_nic = engine.stats()["per_nic"]
            if stuck:  # writes the provider never reported: their endpoints were renewed
                assert sum(n["renewals"] for n in per_nic) >= 1 and engine.address != address_before

            # a peer started after the failure is reached too
            late = PeerProcess(fabric, 2 * PAGE)
            try:
                engine.connect(late.address).write_pages(region, [0, 1], late.descriptor, [0, 1], PAGE,
                                                         imm=7).result(10)
                assert late.ask("expect 7 2 10") == f"landed 2 sha256={digest(data[:2 * PAGE])}"
            finally:
                late.close()
        finally:
            first.close()
