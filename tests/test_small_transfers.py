"""Small transfers (issue 33): a few pages as Python ints take the same checks and land the same bytes as arrays,
a caller waiting on result() finishes its transfer on its own thread, and many threads settling at once lose
nothing."""
import hashlib
import threading
import time

import numpy as np
import pytest

from fabriclab import Engine, OutOfRange, TransferTimeout, _native, completions, fi
from fabriclab.completions import TRANSFER_SLOTS
from helpers import PAGE, PeerProcess, pages_of


@pytest.fixture
def engine(fabric):
    with Engine(fabric[0], domains=fabric[1], pin=False, timeout=10) as e:
        yield e


@pytest.fixture
def target(fabric):
    peer_proc = PeerProcess(fabric, 32 * PAGE)
    yield peer_proc
    peer_proc.close()


# A short list of ints, a tuple, one int, and the same pages as numpy arrays: each form goes its own way
# (few_pages: Python ints; as_pages: numpy) and must come out the same.
FORMS = {"list": list, "tuple": tuple, "array": np.array}


@pytest.mark.parametrize("form", FORMS)
def test_a_few_pages_land_and_coalesce_as_arrays_do(fabric, engine, target, form):
    data = pages_of(3, 8)
    region = engine.register(data)
    peer = engine.connect(target.address)
    src, dst = [0, 1, 2, 5], [10, 11, 12, 3]  # a run of three, then one page: the run is joined where it may be
    as_arrays = peer.write_pages(region, np.array(src), target.descriptor, np.array(dst), PAGE, imm=9).result(10)
    done = peer.write_pages(region, FORMS[form](src), target.descriptor, FORMS[form](dst), PAGE, imm=9).result(10)
    assert (done.writes, done.pages, done.bytes) == (as_arrays.writes, as_arrays.pages, as_arrays.bytes)
    assert done.pages == 4 and done.writes <= 4
    want = np.zeros(32 * PAGE, dtype=np.uint8)
    for s, d in zip(src, dst):
        want[d * PAGE:(d + 1) * PAGE] = data[s * PAGE:(s + 1) * PAGE]
    assert target.ask("expect 9 8 10") == f"landed 8 sha256={hashlib.sha256(want).hexdigest()}"
    one = peer.write_pages(region, 7, target.descriptor, 31, PAGE).result(10)  # one int a side
    assert (one.writes, one.pages) == (1, 1)


@pytest.mark.parametrize("form", FORMS)
def test_a_few_pages_are_refused_as_arrays_are(fabric, engine, target, form):
    region = engine.register(pages_of(4, 8))
    peer = engine.connect(target.address)
    pages = FORMS[form]

    def refused(src, dst, error):
        with pytest.raises(error) as info:
            peer.write_pages(region, pages(src), target.descriptor, pages(dst), PAGE)
        return str(info.value)

    assert "local page 8 is outside the 8 whole" in refused([1, 8], [0, 1], OutOfRange)
    assert "local page -1 is outside" in refused([-1], [0], OutOfRange)
    assert "remote page 32 is outside the 32 whole" in refused([0], [32], OutOfRange)
    assert "both written to destination page 4" in refused([0, 1], [4, 4], fi.UsageError)
    assert "2 source pages but 1 destination pages" in refused([0, 1], [4], fi.UsageError)
    assert "0 source pages" in refused([], [], fi.UsageError)
    with pytest.raises(fi.UsageError, match="must be integers"):
        peer.write_pages(region, [True], target.descriptor, [0], PAGE)  # a bool is no page number
    with pytest.raises(OutOfRange):
        peer.write_pages(region, [2 ** 70], target.descriptor, [0], PAGE)


def test_a_caller_waiting_finishes_its_transfer_on_its_own_thread(fabric, engine, target, monkeypatch):
    """result() looks for the end itself (fl_transfer_wait) and settles it there, without waking the reaper.
    One in 50 is enough to show it happens: under load a look may time out, and the reaper then settles it."""
    region = engine.register(pages_of(5, 8))
    peer = engine.connect(target.address)
    book = engine._service.book
    settled_by: list[str] = []
    settle = book._settle
    monkeypatch.setattr(book, "_settle", lambda tid: (settled_by.append(threading.current_thread().name),
                                                      settle(tid))[1])
    for i in range(50):
        assert peer.write_pages(region, [i % 8], target.descriptor, [i % 32], PAGE).result(10).writes == 1
    assert threading.current_thread().name in settled_by, settled_by[:5]


def test_many_threads_waiting_and_the_reaper_settle_each_transfer_once(fabric, engine, target):
    """Threads that each wait on every transfer of a shared list (and the reaper) race to settle them: every
    future resolves once, with its own result, and every transfer id comes back."""
    region = engine.register(pages_of(6, 8))
    peer = engine.connect(target.address)
    transfers = [peer.write_pages(region, [i % 8], target.descriptor, [i % 32], PAGE) for i in range(400)]
    results, errors = [], []

    def wait_all():
        try:
            results.append([t.result(10).bytes for t in transfers])
        except BaseException as exc:  # noqa: BLE001 - any failure is the test's finding
            errors.append(exc)

    threads = [threading.Thread(target=wait_all) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors and len(results) == 6 and all(r == [PAGE] * 400 for r in results)
    assert all(t.wait_safe(10) for t in transfers)
    book = engine._service.book
    with engine._service.lock:
        assert not book.in_use and len(book.free_ids) == TRANSFER_SLOTS


def test_a_batch_of_ten_thousand_one_page_requests_each_counted_by_its_value(fabric, engine, target):
    """write_batch: one call, a Transfer per request, each request's own immediate value; the peer counts a page
    for each of the 10,000 values. Request i writes page i % 32 from page i % 8 (transfers run in no order
    among themselves, so each destination page always gets the same bytes)."""
    data = pages_of(7, 8)
    region = engine.register(data)
    peer = engine.connect(target.address)
    requests = [([i % 32 % 8], [i % 32], i) for i in range(10_000)]
    transfers = peer.write_batch(region, requests, target.descriptor, PAGE)
    assert len(transfers) == 10_000 and all(t.result(30).pages == 1 for t in transfers)
    want = np.zeros(32 * PAGE, dtype=np.uint8)
    for d in range(32):
        want[d * PAGE:(d + 1) * PAGE] = data[d % 8 * PAGE:(d % 8 + 1) * PAGE]
    assert target.ask("expect-each 0 10000 30") == f"landed 10000 sha256={hashlib.sha256(want).hexdigest()}"


def test_a_batch_with_one_bad_request_moves_nothing(fabric, engine, target):
    region = engine.register(pages_of(8, 8))
    peer = engine.connect(target.address)
    submitted = engine.stats()["submitted"]["transfers"]
    for bad, error, says in ((([0], [1]), ([1], [99])), OutOfRange, "request 1: remote page 99"), \
                            ((([0], [1], 2), ([1], [2], -1)), fi.UsageError, "request 1: imm"), \
                            ((([0], [1]), [1, 2]), fi.UsageError, "request 1 must be"):
        with pytest.raises(error, match=says):
            peer.write_batch(region, bad, target.descriptor, PAGE)
    assert engine.stats()["submitted"]["transfers"] == submitted  # nothing went
    assert peer.write_batch(region, [], target.descriptor, PAGE) == []


def test_closing_a_peer_with_transfers_in_flight_keeps_their_entries(fabric, engine, target):
    """Peer.close() trims the address vectors while transfers still use the peer's entries (their routes say
    which): the transfers in flight still complete."""
    region = engine.register(pages_of(9, 8))
    peer = engine.connect(target.address)
    transfers = peer.write_batch(region, [([i % 8], [i % 32]) for i in range(300)], target.descriptor, PAGE)
    peer.close()
    assert all(t.result(10).writes == 1 for t in transfers)


def test_a_batch_the_queues_cannot_take_fails_only_the_transfers_left_out(fabric, target):
    """With the only worker parked, a batch of more writes than its inbox holds (65,536) queues what fits; by
    the deadline the transfers left out fail as not queued (buffer-safe: none of their writes was), those
    queued by their deadline or, once the worker runs, not at all. Every transfer id comes back."""
    with Engine(fabric[0], domains=fabric[1], pin=False, timeout=10, threads=1, nics=1) as engine:
        region = engine.register(pages_of(10, 8))
        peer = engine.connect(target.address)
        native = engine._service.native
        assert native.park_worker(0, 5)
        try:  # two writes a request (pages swapped: no run), 70,000 writes in all
            transfers = peer.write_batch(region, [([0, 1], [2 * (i % 256) + 1, 2 * (i % 256)]) for i in range(35_000)],
                                         target.descriptor, 4096, timeout=0.5)
        finally:
            native.unpark_worker(0)
        failures = [t.exception(10) for t in transfers]
        left_out = [f for f in failures if f is not None and "not queued" in str(f)]
        assert 0 < len(left_out) < len(transfers) and all(isinstance(f, TransferTimeout) for f in left_out)
        assert sum(not f.buffer_safe for f in left_out) <= 1  # at most one straddles the last write queued
        assert all(f is None or isinstance(f, TransferTimeout) for f in failures)
        assert all(t.wait_safe(10) for t in transfers)
        book = engine._service.book
        deadline = time.monotonic() + 10
        while book.in_use and time.monotonic() < deadline:
            time.sleep(0.05)  # the reaper frees each id once the provider reported its writes
        with engine._service.lock:
            assert not book.in_use and len(book.free_ids) == TRANSFER_SLOTS


def test_notices_lost_to_a_full_queue_still_settle_every_transfer(fabric, target, monkeypatch):
    """A caller that settles its own transfer frees the id at once, so the reaper's queue of notices (two per id)
    can hold more notices than ids when the reaper falls behind. With 4 ids (8 notices) and the reaper held up,
    one transfer nobody waits for (X) is followed by 10 that callers settle: the queue fills. X must still be
    settled (its callback runs) once the reaper goes on: the engine looks at every transfer when notices were
    lost, instead of overwriting the oldest."""
    monkeypatch.setattr(completions, "TRANSFER_SLOTS", 4)
    with Engine(fabric[0], domains=fabric[1], pin=False, timeout=30) as engine:
        region = engine.register(pages_of(11, 8))
        peer = engine.connect(target.address)
        book = engine._service.book
        gate, settle = threading.Event(), book._settle

        def held_on_the_reaper(tid):
            if threading.current_thread().name == "fabriclab-engine-reaper":
                gate.wait(20)
            settle(tid)

        monkeypatch.setattr(book, "_settle", held_on_the_reaper)

        def finished(transfer):  # its last write reported, nobody looking: the reaper gets a notice
            at = _native.TRANSFER_FIELDS * next(t for t, e in book.in_use.items() if e[0] is transfer)
            deadline = time.monotonic() + 10
            while book.transfers[at] > 0 and time.monotonic() < deadline:
                time.sleep(0.001)
            time.sleep(0.005)

        first = peer.write_pages(region, [0], target.descriptor, [0], PAGE)
        finished(first)  # the reaper takes its notice and is held up settling it
        called = threading.Event()
        lonely = peer.write_pages(region, [1], target.descriptor, [1], PAGE)
        lonely.add_done_callback(lambda _: called.set())
        finished(lonely)
        for i in range(10):
            transfer = peer.write_pages(region, [2], target.descriptor, [2 + i], PAGE)
            finished(transfer)
            assert transfer.result(10).writes == 1  # settled here, its id freed at once
        gate.set()
        assert called.wait(10) and lonely.result(0).writes == 1 and first.result(10).writes == 1
