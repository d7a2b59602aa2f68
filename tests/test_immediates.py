"""Engine.expect's count of immediate data (issue 21, item 3): a value holds a place only while it is awaited or
holds pages nobody took, so an engine counts any number of distinct values over its life; a count that cannot
be kept is an error someone sees, never a silent loss. Real engines, real writes."""
import gc
import logging
import os
import time

import numpy as np
import pytest

from fabriclab import Engine, TransferTimeout, UsageError, _native, bootstrap
from fabriclab import service as engine_module
from helpers import Child, python

PAGE = 4096
# The soak's distinct values: 72,000 in the suite (more than the table's 65,536 places);
# FABRICLAB_SOAK_VALUES=1000000 for the full soak.
SOAK_VALUES = int(os.environ.get("FABRICLAB_SOAK_VALUES", 72_000))


class Pair:
    """A writer and a target engine in this process, a one-page region each, the writer connected."""

    def __init__(self, provider, domain=None, timeout=30):
        self.writer = Engine(provider, domains=domain, pin=False, timeout=timeout)
        self.target = Engine(provider, domains=domain, pin=False, timeout=timeout)
        self.src = self.writer.register(np.ones(PAGE, np.uint8))
        self.dst = self.target.register(np.zeros(PAGE, np.uint8))  # kept: a dropped region closes
        self.descriptor = self.dst.descriptor()
        self.peer = self.writer.connect(self.target.address)

    def write(self, imm):
        return self.peer.write_pages(self.src, [0], self.descriptor, [0], PAGE, imm=imm)

    def counted(self) -> dict:
        return self.target.stats()["immediates"]

    def close(self):
        self.writer.close()
        self.target.close()


@pytest.fixture
def pair(fabric):
    p = Pair(*fabric)
    yield p
    p.close()


def write_and_expect(pair, values, batch=256):
    """One write per value (imm = the value, as a request id is), each expected: every other expect() made
    before its write, the others after it landed (the count waits for them)."""
    values = list(values)
    for first in range(0, len(values), batch):
        chunk = values[first:first + batch]
        early = {v: pair.target.expect(v, 1) for v in chunk if v % 2}
        for transfer in [pair.write(v) for v in chunk]:
            transfer.result(30)
        late = {v: pair.target.expect(v, 1) for v in chunk if v % 2 == 0}
        for v, expected in {**early, **late}.items():
            assert expected.result(30) == 1, v


def test_one_value_per_request_beyond_4096_requests(pair):
    """The 4097th request's expect() used to time out: the table never gave a slot back. Here 6,000 values are
    counted at once (3,000 expect()s wait, then 6,000 writes land), then 6,000 more in batches."""
    write_and_expect(pair, range(6000), batch=6000)
    write_and_expect(pair, range(6000, 12000))
    assert pair.counted()["values"] == 0 and pair.counted()["lost"] == 0


def eventually(condition, timeout=10.0):
    """A writer's completion can come before the target has counted the arrival: wait for what must follow."""
    deadline = time.monotonic() + timeout
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.01)
    return condition()


def test_pages_that_arrive_before_their_expect_are_kept_until_taken(pair):
    pair.write(7).result(30)
    pair.write(7).result(30)
    assert eventually(lambda: sum(n["arrivals"] for n in pair.target.stats()["per_nic"]) == 2)
    assert eventually(lambda: pair.counted()["values"] == 1)  # the place of a value nobody awaits yet
    time.sleep(0.5)
    assert pair.target.expect(7, 1).result(10) == 1
    assert pair.counted()["values"] == 1  # one page still waits to be taken
    assert pair.target.expect(7, 1).result(10) == 1
    assert pair.counted()["values"] == 0  # taken, nothing awaits it: its place is free


def test_a_full_count_fails_the_expect_and_says_what_it_could_not_count(monkeypatch, caplog):
    """Every place awaited: an expect() beyond it is refused, pages of a value that arrive then are reported (a
    warning, the count in stats, the value's next expect() raising), never dropped in silence; once the
    expectations end, their places serve new ones. (Values nobody awaits never fill it: see the flood below.)"""
    monkeypatch.setattr(engine_module, "IMM_VALUES", 4)
    pair = Pair("shm")
    try:
        waiting = [pair.target.expect(v, 1) for v in range(4)]  # every place awaited
        with pytest.raises(UsageError, match="expect\\(100, 1\\) cannot be counted.* at most 4 immediate values.* "
                                             "every one is awaited"):
            pair.target.expect(100, 1)
        with caplog.at_level(logging.WARNING, logger="fabriclab"):
            pair.write(9).result(30)  # no place left: its page cannot be counted
            assert eventually(lambda: "could not be counted" in caplog.text)
        assert "1 arrival(s) of immediate data could not be counted (the last carried imm 9)" in caplog.text
        assert pair.counted()["lost"] == 1
        for v in range(4):
            pair.write(v).result(30)
        assert [w.result(10) for w in waiting] == [1] * 4
        with pytest.raises(UsageError, match="pages carrying imm 9 arrived .* were not counted"):
            pair.target.expect(9, 1)
        again = pair.target.expect(9, 1)  # said once: the value counts again from here
        pair.write(9).result(30)
        assert again.result(10) == 1
        assert pair.counted() == {"values": 0, "most": 4, "lost": 1, "lost_values": 0, "last_lost": 9, "dropped": 0,
                                  "last_dropped": 0}
    finally:
        pair.close()


def test_expect_counts_at_most_what_the_table_holds():
    with Engine("shm", pin=False) as target:
        with pytest.raises(UsageError, match="count"):
            target.expect(1, 2 ** 40)


def resident_kib() -> int:
    """This process's resident memory now (not its high-water mark), after a collection."""
    gc.collect()
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") // 1024


def test_soak_of_distinct_values_keeps_the_count_and_memory_flat():
    """SOAK_VALUES one-page writes over shm, each with its own immediate value, each expected: every count
    exact, no place held at the end, memory flat from the first tenth on."""
    pair = Pair("shm")
    try:
        tenth = SOAK_VALUES // 10
        write_and_expect(pair, range(tenth))
        rss = resident_kib()
        started = time.monotonic()
        write_and_expect(pair, range(tenth, SOAK_VALUES))
        elapsed = time.monotonic() - started
        assert pair.counted() == {"values": 0, "most": engine_module.IMM_VALUES, "lost": 0, "lost_values": 0,
                                  "last_lost": 0, "dropped": 0, "last_dropped": 0}
        grown = resident_kib() - rss
        assert grown < 32 * 1024, f"{grown} KiB more after {SOAK_VALUES - tenth} values"
        print(f"\n{SOAK_VALUES - tenth} distinct values written and expected in {elapsed:.1f} s "
              f"({(SOAK_VALUES - tenth) / elapsed:.0f}/s, shm, this machine); resident memory grew {grown} KiB")
    finally:
        pair.close()


# ------------------------------------------------------------------ values nobody expects (issue 31, item 6)

WRITER = os.path.join(os.path.dirname(__file__), "hostile_writer.py")


def flood(fabric, target, region, first, values):
    """tests/hostile_writer.py writing one page with each of ``values`` distinct immediate values (``first``,
    ``first + 1``, ...) into ``region`` of ``target``, none of them expected; its last line."""
    packed = bootstrap.pack(target.address, region.descriptor()).hex()
    with Child(python(WRITER, fabric[0], fabric[1] or "-", packed, values, f"{first}+")) as writer:
        line = writer.line(120, "the flood's end")
        assert line == f"wrote {values}", line
        assert writer.wait() == 0
    return line


def test_a_flood_of_values_nobody_expects_never_locks_out_expect(fabric, monkeypatch):
    """A writer process sends one page with each of 4 x IMM_VALUES distinct values nobody expects. The table
    was full for good: every new expect() raised UsageError and honest pages were lost. Now the pages nobody
    expects give their places to newer ones (the oldest first): after the flood honest expect()s work, an
    honest page counts whether it lands before or after its expect(), and nothing was marked lost."""
    monkeypatch.setattr(engine_module, "IMM_VALUES", 1024)
    with Engine(fabric[0], domains=fabric[1], pin=False) as target, \
            Engine(fabric[0], domains=fabric[1], pin=False) as honest:
        region = target.register(np.zeros(16 * 65536, np.uint8))
        flood(fabric, target, region, 1 << 20, 4096)
        peer, src = honest.connect(target.address), honest.register(np.ones(65536, np.uint8))
        descriptor = region.descriptor()
        early = [target.expect(v, 1, timeout=30) for v in range(50)]  # honest expect()s, then their pages
        for v in range(60):
            peer.write_pages(src, [0], descriptor, [v % 16], 65536, imm=v).result(30)
        assert [f.result(30) for f in early] == [1] * 50
        assert [target.expect(v, 1).result(10) for v in range(50, 60)] == [1] * 10  # landed before, kept
        counted = target.stats()["immediates"]
        assert counted["values"] == 1024 - 50 and counted["dropped"] == 4096 - 1024 + 50, counted
        assert counted["lost"] == 0 and counted["lost_values"] == 0


def test_late_pages_of_expects_that_timed_out_do_not_stay(fabric):
    """50 expect()s time out, then their pages land (a writer process): each late page held a place for ever,
    so a service with a value per request and now and then a timeout slowly filled the table. Now a value's
    pages that nobody expects for the engine's timeout (2 s here) are dropped: the table is empty again."""
    with Engine(fabric[0], domains=fabric[1], pin=False, timeout=2) as target:
        region = target.register(np.zeros(16 * 65536, np.uint8))
        for v in range(5000, 5050):
            with pytest.raises(TransferTimeout):
                target.expect(v, 1, timeout=0.01).result(5)
        assert target.stats()["immediates"]["values"] == 0  # a timed-out expect() gave its place back
        flood(fabric, target, region, 5000, 50)  # the 50 late pages
        assert eventually(lambda: target.stats()["immediates"]["values"] == 0, timeout=10), \
            target.stats()["immediates"]
        counted = target.stats()["immediates"]
        assert counted["dropped"] == 50 and counted["lost"] == 0, counted
        assert target.expect(5000, 1, timeout=0.2).exception(5) is not None  # dropped, not kept for a later expect()


def test_the_default_table_gives_the_places_of_values_nobody_expects_to_new_ones():
    """The real table (IMM_VALUES places): arrivals of IMM_VALUES + 100 distinct values nobody expects (through
    the native count, as a staged target's copies arrive) push out the oldest 100; expect() still works, and an
    arrival is lost only when every place is awaited."""
    with Engine("shm", pin=False) as target:
        native, most = target._service.native, engine_module.IMM_VALUES
        statuses = {native.credit_immediates(v, 1) for v in range(1 << 20, (1 << 20) + most + 100)}
        assert statuses == {_native.IMM_OK}
        counted = target.stats()["immediates"]
        assert counted["values"] == most and counted["dropped"] == 100 and counted["lost"] == 0, counted
        assert not target.expect(7, 1, timeout=30).done()  # its place: the oldest value nobody expects
        assert target.stats()["immediates"]["dropped"] == 101
        assert native.credit_immediates((1 << 20) + 101, 1) == _native.IMM_OK  # one more page of a value kept
        assert target.expect((1 << 20) + 101, 2).result(10) == 2
