"""bootstrap.allgather: engine addresses and region descriptors through a torch.distributed-style store (a
real in-process store with set/get/wait; torch's own TCPStore when torch is installed) or an MPI
communicator, with clear errors when neither is there."""
import datetime
import importlib.util
import threading

import numpy as np
import pytest

from fabriclab import Engine, bootstrap, fi


class DictStore:
    """A store with torch.distributed.Store's set/get/wait interface, shared by threads of one process."""

    def __init__(self):
        self._values, self._cond = {}, threading.Condition()

    def set(self, key, value):
        with self._cond:
            self._values[key] = value if isinstance(value, bytes) else str(value).encode()
            self._cond.notify_all()

    def get(self, key):
        with self._cond:
            self._cond.wait_for(lambda: key in self._values, 30)
            return self._values[key]

    def wait(self, keys, timeout=datetime.timedelta(seconds=30)):
        with self._cond:
            if not self._cond.wait_for(lambda: all(k in self._values for k in keys), timeout.total_seconds()):
                raise RuntimeError(f"wait timed out for {keys}")


def ranks(world, work):
    """Run work(rank) on ``world`` threads; their results in rank order (re-raising the first failure)."""
    results, errors = [None] * world, []

    def run(rank):
        try:
            results[rank] = work(rank)
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    if errors:
        raise errors[0]
    return results


def test_store_allgather_gives_every_rank_every_payload():
    store = DictStore()
    got = ranks(3, lambda r: bootstrap.allgather(f"rank {r}".encode(), store=store, rank=r, world_size=3))
    assert got == [[b"rank 0", b"rank 1", b"rank 2"]] * 3


def test_engines_connect_through_a_store(fabric):
    store, page = DictStore(), 4096
    with Engine(fabric[0], domains=fabric[1], pin=False, nics=2, threads=1) as a, \
            Engine(fabric[0], domains=fabric[1], pin=False, nics=1, threads=1) as b:
        buffers = [np.full(4 * page, 7, np.uint8), np.zeros(4 * page, np.uint8)]
        regions = [a.register(buffers[0]), b.register(buffers[1])]
        mine = [bootstrap.pack(e.address, r.descriptor()) for e, r in zip((a, b), regions)]
        views = ranks(2, lambda r: bootstrap.allgather(mine[r], store=store, rank=r, world_size=2, key="kv"))
        address, descriptor = bootstrap.unpack(views[0][1])  # rank 0's view of rank 1
        a.connect(address).write_pages(regions[0], [0, 1, 2, 3], descriptor, [0, 1, 2, 3], page, imm=3).result(10)
        assert b.expect(3, 4, timeout=10).result() == 4 and (buffers[1] == 7).all()


def test_a_missing_rank_times_out_clearly():
    with pytest.raises(fi.FabricTimeout, match="2 ranks"):
        bootstrap.allgather(b"alone", store=DictStore(), rank=0, world_size=2, timeout=0.2)


def test_bad_rank_and_no_transport_are_usage_errors():
    with pytest.raises(fi.UsageError, match="rank"):
        bootstrap.allgather(b"x", store=DictStore(), rank=2, world_size=2)
    if importlib.util.find_spec("mpi4py") is None:
        with pytest.raises(fi.UsageError, match="mpi4py"):
            bootstrap.allgather(b"x")


class TextStore(DictStore):
    """A store that hands values back decoded, as text."""

    def get(self, key):
        return super().get(key).decode()


def test_bad_types_are_usage_errors_that_name_the_fix():
    """Issue 21: rank=True was taken for rank 1; a str payload or store value and unpack(str) or unpack(None)
    raised a bare TypeError; an int payload became that many zero bytes; a nan timeout reached the store."""
    store = DictStore()
    for options, message in (({"rank": True, "world_size": 2}, "rank must be an integer, got True"),
                             ({"rank": 1.0, "world_size": 2}, "rank must be an integer, got 1.0"),
                             ({"rank": 0, "world_size": False}, "world_size must be an integer, got False"),
                             ({"rank": 0, "world_size": 1, "timeout": float("nan")}, "timeout must be a finite"),
                             ({"rank": 0, "world_size": 1, "key": 5}, "key must be a non-empty str")):
        with pytest.raises(fi.UsageError, match=message):
            bootstrap.allgather(b"x", store=store, **options)
    for payload in ("text", 3, None):
        with pytest.raises(fi.UsageError, match=f"payload must be bytes.*, got {type(payload).__name__}"):
            bootstrap.allgather(payload, store=store, rank=0, world_size=1)
    with pytest.raises(fi.UsageError, match="the store's value of 'text/0' is str, not bytes"):
        bootstrap.allgather(b"x", store=TextStore(), rank=0, world_size=1, key="text")
    with pytest.raises(fi.UsageError, match="encode text first"):
        bootstrap.pack(b"ok", "text")
    for data in ("abcdefgh", None, 5):
        with pytest.raises(fi.UsageError, match=f"a bootstrap message must be bytes.*, got {type(data).__name__}"):
            bootstrap.unpack(data)
    assert bootstrap.unpack(memoryview(bootstrap.pack(b"a", bytearray(b"bc")))) == [b"a", b"bc"]
    for bad in (lambda: bootstrap.Rendezvous(timeout=-1), lambda: bootstrap.exchange(-1, b"x"),
                lambda: bootstrap.exchange(True, b"x"), lambda: bootstrap.exchange(1, b"x", timeout=float("inf"))):
        with pytest.raises(fi.UsageError):
            bad()


class OneRankComm:
    """mpi4py's allgather on a communicator of one rank."""

    def allgather(self, obj):
        return [obj]


def test_communicator_allgather():
    assert bootstrap.allgather(b"me", comm=OneRankComm()) == [b"me"]


@pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="torch is not installed")
def test_torch_tcpstore():
    from torch.distributed import TCPStore
    server = TCPStore("127.0.0.1", 0, 2, True, timeout=datetime.timedelta(seconds=30), wait_for_workers=False)
    client = TCPStore("127.0.0.1", server.port, 2, False, timeout=datetime.timedelta(seconds=30))
    stores = [server, client]
    got = ranks(2, lambda r: bootstrap.allgather(bytes([r]) * 3, store=stores[r], rank=r, world_size=2))
    assert got == [[b"\0\0\0", b"\1\1\1"]] * 2
