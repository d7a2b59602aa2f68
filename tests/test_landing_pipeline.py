"""The landing protocol overlaps its steps (issue 25, the staged path near its ceiling): a writer's transfer
writes into a few lanes at a time, in order, so that the target copies the first lanes while the next are
written, rather than every lane's writes finishing together at the end. Staged targets in host memory
(Engine._register_staged_host), real engines and control endpoints, so these run anywhere."""
import threading

import numpy as np

from fabriclab import control, landing_writer
from test_staging import PAGE, landed_as, staged_target, writer_engine


def watch_lanes_written_at_once(engine):
    """The most lanes one job of ``engine`` had posted writes into, not all reported done, whenever it said
    FILLED; and the target's COPIED answers the writer had heard by then (every message stays real)."""
    lander = engine._service.start_landing()
    send, copied = lander.writer._to_target, lander.writer.copied
    seen = {"most": 0, "copied": 0, "filled": 0, "copied_before_last_filled": 0}

    def watched_send(job, kind, body):
        if kind == control.FILLED:
            seen["most"] = max(seen["most"], sum(not entry[3] for entry in job.in_flight.values()))
            seen["filled"] += 1
            seen["copied_before_last_filled"] = seen["copied"]
        send(job, kind, body)

    def watched_copied(target, number, lane):
        seen["copied"] += 1
        copied(target, number, lane)

    lander.writer._to_target = watched_send
    lander.writer.copied = lander.handlers[control.COPIED] = watched_copied
    return seen


def test_a_transfer_writes_a_few_lanes_at_a_time_and_they_are_copied_while_the_next_are_written(fabric):
    # 16 lanes of 2 pages; a transfer of 96 permuted pages needs 48 lanes: the pool three times over
    with staged_target(fabric, staging_bytes=32 * PAGE) as target, writer_engine(fabric) as writer:
        landed = np.zeros(96 * PAGE, np.uint8)
        region = target._register_staged_host(landed)
        seen = watch_lanes_written_at_once(writer)
        data = np.random.default_rng(3).integers(0, 256, 96 * PAGE, dtype=np.uint8)
        dst = np.random.default_rng(4).permutation(96)
        peer = writer.connect(target.address)
        expected = target.expect(7, 96)
        result = peer.write_pages(writer.register(data), np.arange(96), region.descriptor(), dst, PAGE,
                                  imm=7).result(30)
        assert result.pages == 96 and expected.result(10) == 96
        assert np.array_equal(landed, landed_as(data, np.arange(96), dst, landed.size))
        assert seen["filled"] == 48 and seen["copied"] == 48
        # never more lanes being written than the window, though 16 were free (granted at once) ...
        assert 1 <= seen["most"] <= landing_writer.WRITE_AHEAD
        # ... and the target copied lanes (and said so) while the writer still wrote the later ones
        assert seen["copied_before_last_filled"] > 0
        assert target.stats()["staging"]["landed_lanes"] == 48


def test_the_host_copier_copies_off_the_landing_thread(fabric):
    """A staged target's copies run beside its landing thread (as CUDA copies run on the GPU's engines), so it
    grants and reads FILLED while a lane is copied."""
    with staged_target(fabric) as target, writer_engine(fabric) as writer:
        landed = np.zeros(8 * PAGE, np.uint8)
        region = target._register_staged_host(landed)
        peer = writer.connect(target.address)
        peer.write_pages(writer.register(np.full(8 * PAGE, 5, np.uint8)), np.arange(8), region.descriptor(),
                         np.arange(8), PAGE).result(30)
        assert np.all(landed == 5)
        copier = target._service.landing.target.copiers["host"]
        assert copier.thread.is_alive() and copier.thread is not target._service.landing.thread
        assert copier.thread.name == "fabriclab-landing-copy"
    assert not copier.thread.is_alive()  # closed with its engine, once its copies were done
    assert "fabriclab-landing-copy" not in [t.name for t in threading.enumerate()]
