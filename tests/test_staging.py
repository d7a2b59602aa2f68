"""GPU memory through fabriclab.Engine: the staged path (pinned pool) where the provider lacks FI_HMEM, the
direct path where it has it; staged targets (landing lanes, fabriclab.landing). Tests marked ``gpu`` need
torch with CUDA; the others run anywhere: there a staged target in host memory (Engine._register_staged_host,
copied with memmove) runs the landing protocol for real."""
import hashlib
import logging
import os
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from fabriclab import (Engine, PeerLost, RegionClosed, StagingFailed, TransferError, TransferTimeout, bootstrap, fi,
                       gpu, landing, lanecopy, memory, staging)
from fabriclab import service as engine_module
from fabriclab.nics import NicSet
from helpers import LINE_TIMEOUT, PeerProcess

WRITER = os.path.join(os.path.dirname(__file__), "hostile_writer.py")

MiB = 1 << 20


# ------------------------------------------------------------------------------- anywhere (no GPU)


@pytest.mark.parametrize("pool, chunk, chunks", [(64 * MiB, 4 * MiB, 16), (9 * MiB, 4 * MiB, 2), (8 * MiB, MiB, 8)])
def test_pool_layout_is_whole_chunks(pool, chunk, chunks):
    assert staging.pool_layout(pool, chunk) == (chunks, chunks * chunk)


@pytest.mark.parametrize("options, message", [
    (dict(staging_bytes=4 * MiB, staging_chunk_bytes=4 * MiB), "at least two staging chunks"),
    (dict(staging_chunk_bytes=100), "staging_chunk_bytes must be at least 4096"),
    (dict(staging_bytes=1.5), "staging_bytes must be an integer"),
])
def test_bad_staging_sizes_are_refused_before_any_nic_opens(options, message):
    with pytest.raises(fi.UsageError, match=message):
        Engine("shm", pin=False, gpu=False, **options)


def test_stats_report_the_staging_pool_before_it_is_needed():
    with Engine("shm", pin=False, gpu=False, staging_bytes=32 * MiB, staging_chunk_bytes=2 * MiB) as engine:
        pool = engine.stats()["staging"]
        assert pool["pool_bytes"] == 32 * MiB and pool["chunk_bytes"] == 2 * MiB
        assert pool["allocated"] is False and pool["staged_bytes"] == 0
        region = engine.register(np.zeros(4096, np.uint8))
        assert region.path == "host" and not region.staged


def test_gpu_memory_without_fi_hmem_is_not_registered_directly():
    """The decision the Engine takes for a CUDA region on a provider without FI_HMEM: no registration, no
    full pinned copy (memory.register's own fallback), but DirectUnavailable naming why."""
    class FakeCuda:
        kind, pointer, length, device = "cuda", 1 << 40, 1 << 20, 0

    with NicSet("shm", 1, None, "host") as nics:
        with pytest.raises(memory.DirectUnavailable, match="does not offer FI_HMEM"):
            nics.register(FakeCuda(), stage=False)


@pytest.mark.skipif(gpu.cuda_status() == "ok", reason="checks the message given where CUDA is missing")
def test_cuda_array_without_cuda_is_a_clear_error():
    class FakeCudaArray:
        __cuda_array_interface__ = {"shape": (4096,), "typestr": "|u1", "data": (1 << 40, False), "version": 3}

    with Engine("shm", pin=False, gpu=False) as engine:
        with pytest.raises(fi.UsageError, match="GPU memory was asked for"):
            engine.register(FakeCudaArray())


# ------------------------------------------------------------------- staged targets, in host memory

PAGE = 65536


def staged_target(fabric, **options):
    """A target engine with a small landing pool: 4 lanes of 2 pages."""
    options = {"staging_bytes": 8 * PAGE, "staging_chunk_bytes": 2 * PAGE, "timeout": 10, **options}
    return Engine(fabric[0], domains=fabric[1], pin=False, gpu=False, **options)


def writer_engine(fabric, timeout=10):
    return Engine(fabric[0], domains=fabric[1], pin=False, gpu=False, timeout=timeout)


def landed_as(data, src, dst, size):
    want = np.zeros(size, np.uint8)
    for s, d in zip(src, dst):
        want[d * PAGE:(d + 1) * PAGE] = data[s * PAGE:(s + 1) * PAGE]
    return want


def test_staged_target_lands_byte_exact_through_a_pool_eight_times_smaller(fabric):
    with staged_target(fabric) as target, writer_engine(fabric) as writer:
        landed = np.zeros(64 * PAGE, np.uint8)
        region = target._register_staged_host(landed)
        assert region.path == "host-staged" and region.lands and not region.staged
        data = np.random.default_rng(1).integers(0, 256, 64 * PAGE, dtype=np.uint8)
        peer = writer.connect(target.address)
        dst = np.random.default_rng(2).permutation(64)
        expected = target.expect(5, 64)
        result = peer.write_pages(writer.register(data), np.arange(64), region.descriptor(), dst, PAGE,
                                  imm=5).result(30)
        assert result.writes == 64 and result.pages == 64 and result.bytes == 64 * PAGE
        assert expected.result(10) == 64
        assert np.array_equal(landed, landed_as(data, np.arange(64), dst, landed.size))
        stats = target.stats()["staging"]
        assert stats["landing_pool_bytes"] == 8 * PAGE and stats["lanes"] == 4 and stats["landing_allocated"]
        assert stats["landed_bytes"] == 64 * PAGE and stats["landed_lanes"] == 32
        assert stats["allocated"] is False  # no pinned staging pool for sources: nothing here is a staged source
        # plain writes, striped: each piece is a page the target counts
        peer.write(writer.register(np.full(4 * PAGE, 7, np.uint8)), region.descriptor(), dst_offset=PAGE,
                   stripe_bytes=PAGE, imm=6).result(30)
        assert target.expect(6, 4).result(10) == 4 and np.all(landed[PAGE:5 * PAGE] == 7)


def test_two_writers_into_one_staged_target(fabric):
    with staged_target(fabric) as target, writer_engine(fabric) as first, writer_engine(fabric) as second:
        landed = np.zeros(64 * PAGE, np.uint8)
        descriptor = target._register_staged_host(landed).descriptor()
        results = {}

        def write(engine, imm, pages):
            data = np.full(32 * PAGE, imm, np.uint8)
            peer = engine.connect(target.address)
            for _ in range(3):  # the same pages again: each time all of them count
                results.setdefault(imm, []).append(
                    peer.write_pages(engine.register(data), np.arange(32), descriptor, pages, PAGE, imm=imm).result(30))

        threads = [threading.Thread(target=write, args=(first, 1, np.arange(0, 64, 2))),
                   threading.Thread(target=write, args=(second, 2, np.arange(1, 64, 2)))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert [len(results.get(imm, [])) for imm in (1, 2)] == [3, 3]
        assert target.expect(1, 96).result(10) == 96 and target.expect(2, 96).result(10) == 96
        pages = landed.reshape(64, PAGE)
        assert np.all(pages[0::2] == 1) and np.all(pages[1::2] == 2)


class GatedCopier(lanecopy.HostCopier):
    """Copies, but says the copy is finished only once the test opens the gate."""

    def __init__(self):
        super().__init__()
        self.gate = threading.Event()

    def finished(self, lane):
        return self.gate.is_set()


def test_pages_count_and_transfers_finish_only_once_copied(fabric):
    with staged_target(fabric) as target, writer_engine(fabric) as writer:
        landed = np.zeros(4 * PAGE, np.uint8)
        descriptor = target._register_staged_host(landed).descriptor()
        copier = target._service.landing.target.copiers["host"] = GatedCopier()
        expected = target.expect(3, 2)
        peer = writer.connect(target.address)
        transfer = peer.write_pages(writer.register(np.full(2 * PAGE, 9, np.uint8)), [0, 1], descriptor, [3, 0],
                                    PAGE, imm=3)
        deadline = time.monotonic() + 10
        while target.stats()["staging"]["landed_lanes"] == 0 and not np.any(landed) and time.monotonic() < deadline:
            time.sleep(0.01)  # the pages arrived and were copied, but the copier has not said so
        time.sleep(0.3)
        assert np.all(landed.reshape(4, PAGE)[[0, 3]] == 9)
        assert not expected.done() and not transfer.done()
        copier.gate.set()
        assert transfer.result(10).pages == 2 and expected.result(10) == 2


def test_closed_staged_target_refuses_typed(fabric):
    with staged_target(fabric) as target, writer_engine(fabric) as writer:
        region = target._register_staged_host(np.zeros(4 * PAGE, np.uint8))
        descriptor = region.descriptor()
        region.close()
        peer = writer.connect(target.address)
        with pytest.raises(RegionClosed) as failed:
            peer.write_pages(writer.register(np.ones(PAGE, np.uint8)), [0], descriptor, [0], PAGE).result(20)
        assert failed.value.buffer_safe
        with pytest.raises(fi.UsageError, match="does not fit the target's landing lanes"):
            peer.write_pages(writer.register(np.ones(4 * PAGE, np.uint8)), [0], descriptor, [0], 4 * PAGE)
        with pytest.raises(fi.UsageError, match="a target only"):
            peer.write_pages(writer._register_staged_host(np.ones(PAGE, np.uint8)), [0], descriptor, [0], PAGE)


def test_killed_staged_target_fails_the_writer_typed(fabric):
    """A target that died: its lanes are never granted, and the writer's transfers fail typed at their
    deadline, having written nothing (so the buffer is safe)."""
    target = PeerProcess(fabric, 256 * PAGE, "--staged-host")
    try:
        with writer_engine(fabric, timeout=3) as writer:
            peer = writer.connect(target.address)
            region = writer.register(np.ones(256 * PAGE, np.uint8))
            assert peer.write_pages(region, np.arange(8), target.descriptor, np.arange(8), PAGE,
                                    imm=1).result(30).pages == 8
            assert target.ask("expect 1 8 10").startswith("landed 8 ")
            target.kill()
            started = time.monotonic()
            transfers = [peer.write_pages(region, np.arange(256), target.descriptor, np.arange(256), PAGE, imm=2)
                         for _ in range(4)]
            for transfer in transfers:
                with pytest.raises((PeerLost, TransferTimeout)) as failed:
                    transfer.result(30)
                assert failed.value.buffer_safe
            assert time.monotonic() - started < 30
    finally:
        target.kill()


def writer_process_writing(fabric, target, landed):
    """``landed`` as a staged target of ``target``, and tests/hostile_writer.py in another process writing
    pages of 4s into its pages 0-15 one transfer at a time, once 20 have landed: (descriptor, process)."""
    descriptor = target._register_staged_host(landed).descriptor()
    packed = bootstrap.pack(target.address, descriptor).hex()
    writer = subprocess.Popen([sys.executable, WRITER, fabric[0], fabric[1] or "-", packed, "100000", "4"],
                              stdout=subprocess.PIPE, text=True)
    try:
        # A process that starts in seconds (LINE_TIMEOUT), not within the target's timeout: these tests make that
        # short, as it is the lease their lanes are held for, and a loaded box takes longer to start Python.
        assert target.expect(4, 20, timeout=LINE_TIMEOUT).result(LINE_TIMEOUT + 10) == 20  # it writes
    except BaseException:
        writer.kill()
        writer.wait(10)
        raise
    return descriptor, writer


def test_killed_writer_leaves_the_staged_target_serving(fabric):
    """A writer killed while it holds lanes: the target's expect fails typed at its deadline, the lanes come
    back when their lease (the target's timeout) runs out, and other writers land again."""
    with staged_target(fabric, timeout=3) as target, writer_engine(fabric) as survivor:
        landed = np.zeros(16 * PAGE, np.uint8)
        descriptor, killed = writer_process_writing(fabric, target, landed)
        try:
            killed.kill()
            killed.wait(10)
        finally:
            killed.kill()
        with pytest.raises(TransferTimeout):
            target.expect(4, 10 ** 6, timeout=1).result(10)
        peer = survivor.connect(target.address)
        result = peer.write_pages(survivor.register(np.full(8 * PAGE, 5, np.uint8)), np.arange(8), descriptor,
                                  np.arange(8, 16), PAGE, imm=5).result(30)
        assert result.pages == 8 and target.expect(5, 8).result(10) == 8
        assert np.all(landed[8 * PAGE:] == 5)


def test_a_writer_stopped_past_its_lease_never_mixes_into_the_next_owners_lanes(fabric):
    """SIGSTOP a writer mid-stream for longer than the target's lease (its lanes go to others), then SIGCONT
    it while another writer streams: every page of the other writer lands as it wrote it."""
    with staged_target(fabric, timeout=2) as target, writer_engine(fabric) as survivor:
        landed = np.zeros(32 * PAGE, np.uint8)
        descriptor, stopped = writer_process_writing(fabric, target, landed)  # into pages 0-15
        try:
            stopped.send_signal(signal.SIGSTOP)
            time.sleep(3)  # past the lease: lanes it held go back to the pool
            peer = survivor.connect(target.address)
            region = survivor.register(np.full(16 * PAGE, 5, np.uint8))
            stopped.send_signal(signal.SIGCONT)
            for _ in range(20):
                landed[16 * PAGE:] = 0
                peer.write_pages(region, np.arange(16), descriptor, np.arange(16, 32), PAGE, imm=5).result(30)
                assert target.expect(5, 16).result(10) == 16
                assert np.all(landed[16 * PAGE:] == 5)
        finally:
            stopped.kill()
            stopped.wait(10)


def write_one_value_each(target, peer, src, descriptor, values, batch=32):
    """One one-page transfer per value (imm = the value, as a request id is) into a staged target's pages,
    each expected (every other expect() before its write)."""
    for first in range(0, len(values), batch):
        chunk = values[first:first + batch]
        early = [target.expect(v, 1) for v in chunk if v % 2]
        for transfer in [peer.write_pages(src, [0], descriptor, [v % 16], PAGE, imm=v) for v in chunk]:
            assert transfer.result(30).pages == 1
        late = [target.expect(v, 1) for v in chunk if v % 2 == 0]
        assert [e.result(30) for e in early + late] == [1] * len(chunk)


def test_a_staged_target_counts_one_value_per_request_beyond_4096(fabric, caplog):
    """Issue 21, item 3: with imm = request id, the 4093rd transfer into a staged target timed out, its landing
    thread looped on "the table of awaited immediate data is full" (thousands of logged errors) and the
    region's in_use went negative, so that Region.close stopped waiting for copies."""
    with staged_target(fabric, staging_bytes=16 * PAGE, staging_chunk_bytes=PAGE) as target, \
            writer_engine(fabric) as writer, caplog.at_level(logging.ERROR, logger="fabriclab"):
        region = target._register_staged_host(np.zeros(16 * PAGE, np.uint8))
        peer = writer.connect(target.address)
        src, descriptor = writer.register(np.full(PAGE, 3, np.uint8)), region.descriptor()
        lowest = 0
        for first in range(0, 5000, 500):
            write_one_value_each(target, peer, src, descriptor, list(range(first, first + 500)))
            lowest = min(lowest, region._state.in_use)
        assert lowest == 0 and region._state.in_use == 0
        assert target.stats()["immediates"]["values"] == 0
        plain = target.register(np.zeros(PAGE, np.uint8))  # the target serves plain regions as before
        assert peer.write_pages(src, [0], plain.descriptor(), [0], PAGE, imm=7).result(30).pages == 1
        assert target.expect(7, 1).result(10) == 1
        assert "hit an error" not in caplog.text


def test_a_staged_target_whose_count_is_full_refuses_the_write_and_stays_whole(fabric, monkeypatch, caplog):
    """A value the target cannot count (every place awaited by an expect()) fails the writer's transfer with the
    reason before anything is copied, never loops, never loses a count; once values are taken their places
    serve new ones, and writes without a value land all along."""
    monkeypatch.setattr(engine_module, "IMM_VALUES", 2)
    with staged_target(fabric) as target, writer_engine(fabric) as writer, \
            caplog.at_level(logging.ERROR, logger="fabriclab"):
        landed = np.zeros(4 * PAGE, np.uint8)
        region = target._register_staged_host(landed)
        peer = writer.connect(target.address)
        src, descriptor = writer.register(np.full(PAGE, 3, np.uint8)), region.descriptor()
        waiting = [target.expect(imm, 1, timeout=60) for imm in (0, 1)]  # every place awaited
        with pytest.raises(TransferError, match="cannot count imm 2: .* at once \\(2\\)") as refused:
            peer.write_pages(src, [0], descriptor, [2], PAGE, imm=2).result(30)
        assert refused.value.buffer_safe and not landed[2 * PAGE:3 * PAGE].any()  # refused before any copy
        assert peer.write_pages(src, [0], descriptor, [3], PAGE).result(30).pages == 1  # no value: lands
        assert region._state.in_use == 0 and target.stats()["immediates"]["lost"] == 0
        for imm in (0, 1):
            peer.write_pages(src, [0], descriptor, [imm], PAGE, imm=imm).result(30)
        assert [w.result(10) for w in waiting] == [1, 1]  # their places come back
        peer.write_pages(src, [0], descriptor, [2], PAGE, imm=2).result(30)
        assert target.expect(2, 1).result(10) == 1
        assert np.all(landed == 3) and target.stats()["immediates"]["values"] == 0
        assert "hit an error" not in caplog.text


# ------------------------------------------------------------------------------------- with a GPU

torch = pytest.importorskip("torch") if gpu.cuda_status() == "ok" else None
needs_torch_cuda = pytest.mark.skipif(gpu.cuda_status() != "ok" or torch is None or not torch.cuda.is_available(),
                                      reason="needs torch with CUDA")


def gpu_pages(seed, n, page):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randint(0, 256, (n * page,), dtype=torch.uint8, device="cuda", generator=g)


def sha(tensor) -> str:
    """SHA-256 of a torch tensor's bytes (wherever it lives) or of a numpy array's."""
    host = tensor.cpu().numpy() if hasattr(tensor, "cpu") else tensor
    return hashlib.sha256(host.tobytes()).hexdigest()


@pytest.fixture
def gpu_engine():
    with Engine("shm", pin=False, timeout=20, staging_bytes=8 * MiB, staging_chunk_bytes=MiB, gpu_ipc=False) as engine:
        yield engine


def expect_landing(peer_proc, imm, count, timeout=30):
    return peer_proc.ask(f"expect {imm} {count} {timeout}")


@pytest.mark.gpu
@needs_torch_cuda
@pytest.mark.parametrize("permuted", [False, True])
def test_torch_cuda_source_lands_byte_exact(gpu_engine, permuted):
    n, page = 32, MiB  # 32 MiB through an 8 MiB pool: streams through it four times over
    peer_proc = PeerProcess(("shm", None), n * page)
    try:
        source = gpu_pages(1, n, page)
        before = sha(source)
        region = gpu_engine.register(source)
        print(f"path {region.path}: {region.why}")
        assert region.path in ("cuda-direct", "cuda-staged")
        peer = gpu_engine.connect(peer_proc.address)
        src = np.arange(n)
        dst = np.random.default_rng(2).permutation(n) if permuted else src
        result = peer.write_pages(region, src, peer_proc.descriptor, dst, page, imm=7).result(60)
        assert result.writes == n and result.bytes == n * page
        expected = np.empty(n * page, np.uint8)
        host = source.cpu().numpy()
        for s, d in zip(src, dst):
            expected[d * page:(d + 1) * page] = host[s * page:(s + 1) * page]
        assert expect_landing(peer_proc, 7, n) == f"landed {n} sha256={hashlib.sha256(expected).hexdigest()}"
        assert sha(source) == before  # the source is only read
        stats = gpu_engine.stats()["staging"]
        print(stats)
        if region.staged:
            assert stats["staged_bytes"] == n * page and stats["staged_chunks"] == n and stats["copy_seconds"] > 0
            assert stats["pool_bytes"] == 8 * MiB
    finally:
        peer_proc.close()


@pytest.mark.gpu
@needs_torch_cuda
@pytest.mark.parametrize("source_memory", ["cuda", "host"])
def test_torch_cuda_target_lands_byte_exact(gpu_engine, source_memory):
    """GPU → GPU (and host → GPU): a staged target copies each lane to the GPU before the pages count and
    the writer's transfer resolves. 32 pages of 1 MiB through 8 lanes of 1 MiB, to permuted pages."""
    n, page = 32, MiB
    with Engine("shm", pin=False, timeout=20, staging_bytes=8 * MiB, staging_chunk_bytes=MiB) as target_engine:
        target = torch.zeros(n * page, dtype=torch.uint8, device="cuda")
        target_region = target_engine.register(target)
        print(f"target path {target_region.path}: {target_region.why}")
        source = gpu_pages(4, n, page)
        expected_host = source.cpu().numpy()
        if source_memory == "host":
            source = expected_host.copy()
        before = sha(source)
        region = gpu_engine.register(source)
        peer = gpu_engine.connect(target_engine.address)
        dst = np.random.default_rng(5).permutation(n)
        counted = target_engine.expect(11, n)
        result = peer.write_pages(region, np.arange(n), target_region.descriptor(), dst, page, imm=11).result(60)
        assert result.pages == n and result.bytes == n * page
        assert counted.result(30) == n
        torch.cuda.synchronize()
        expected = np.empty(n * page, np.uint8)
        expected.reshape(n, page)[dst] = expected_host.reshape(n, page)
        assert sha(target) == hashlib.sha256(expected).hexdigest()
        assert sha(source) == before
        stats = target_engine.stats()["staging"]
        print(stats)
        if target_region.lands:
            assert stats["landed_bytes"] == n * page and stats["landing_pool_bytes"] == 8 * MiB
            assert stats["landing_copy_seconds"] > 0


def owned_by(buffer):
    """An array over ``buffer``'s GPU memory that does not keep it alive: freeing the buffer frees the memory
    under a registered region, as an owner that drops its tensor would."""
    class Owned:
        __cuda_array_interface__ = {"shape": (buffer.length,), "typestr": "|u1", "data": (buffer.pointer, False),
                                    "version": 3}

    return Owned()


@pytest.mark.gpu
@needs_torch_cuda
def test_gpu_target_freed_by_its_owner_fails_the_writer_typed(gpu_engine):
    buffer = memory.CudaBuffer(2 * MiB)
    with Engine("shm", pin=False, timeout=20, staging_bytes=8 * MiB, staging_chunk_bytes=MiB) as target_engine:
        target_region = target_engine.register(owned_by(buffer))
        if not target_region.lands:
            pytest.skip("direct registration pins the memory: freeing it under the NIC is the provider's business")
        descriptor = target_region.descriptor()
        buffer.close()
        peer = gpu_engine.connect(target_engine.address)
        with pytest.raises(StagingFailed, match="could not copy to its GPU memory") as failed:
            peer.write_pages(gpu_engine.register(np.ones(MiB, np.uint8)), [0], descriptor, [0], MiB).result(30)
        assert failed.value.buffer_safe


@pytest.mark.gpu
@needs_torch_cuda
def test_killed_peer_mid_transfer_fails_typed_and_buffer_safe():
    """Engine.close returns (within WORKER_EXIT_TIMEOUT) even when a worker is stuck inside shm, spinning
    on the lock its killed peer held; test_hostile's killed-peer test covers the same with host memory."""
    n, page = 256, MiB
    peer_proc = PeerProcess(("shm", None), n * page)
    with Engine("shm", pin=False, timeout=10, link_timeout=2, staging_bytes=8 * MiB,
                staging_chunk_bytes=MiB) as engine:
        source = gpu_pages(3, n, page)
        before = sha(source)
        region = engine.register(source)
        peer = engine.connect(peer_proc.address)
        transfers = [peer.write_pages(region, np.arange(n), peer_proc.descriptor, np.arange(n), page, imm=9)
                     for _ in range(4)]
        time.sleep(0.05)
        peer_proc.kill()
        failures = []
        for transfer in transfers:
            try:
                transfer.result(60)
            except TransferError as exc:
                failures.append(exc)
        assert failures, "a transfer into a killed peer reported success for all of its 1 GiB"
        for exc in failures:
            assert exc.wait_safe(30), exc
        assert sha(source) == before
        del source  # the region keeps the tensor alive: closing it hands it back
        region.close()


@pytest.mark.gpu
@needs_torch_cuda
def test_bad_gpu_inputs(gpu_engine):
    with pytest.raises(fi.UsageError, match="one contiguous block of memory"):
        gpu_engine.register(torch.zeros((64, 64), dtype=torch.uint8, device="cuda")[:, ::2])
    with pytest.raises(fi.UsageError, match="one contiguous block of memory"):  # through DLPack
        gpu_engine.register(torch.zeros((64, 64), dtype=torch.uint8, device="cuda")[:, ::2].__dlpack__())
    transposed = torch.zeros((64, 64), dtype=torch.uint8, device="cuda").t()  # one block, in Fortran order
    assert gpu_engine.register(transposed).length == 64 * 64
    assert gpu_engine.register(transposed.__dlpack__()).length == 64 * 64
    # a CUDA DLPack capsule is taken as it is
    capsule_region = gpu_engine.register(torch.ones(MiB, dtype=torch.uint8, device="cuda").__dlpack__())
    assert capsule_region.kind == "cuda"
    region = gpu_engine.register(torch.zeros(4 * MiB, dtype=torch.uint8, device="cuda"))
    if region.staged:
        peer_proc = PeerProcess(("shm", None), 4 * MiB)
        try:
            peer = gpu_engine.connect(peer_proc.address)
            with pytest.raises(fi.UsageError, match="does not fit a staging chunk"):
                peer.write_pages(region, [0], peer_proc.descriptor, [0], 2 * MiB)
            region.close()
            with pytest.raises(RegionClosed):
                peer.write_pages(region, [0], peer_proc.descriptor, [0], MiB)
        finally:
            peer_proc.close()


@pytest.mark.gpu
@needs_torch_cuda
def test_gpu_memory_freed_by_its_owner_is_refused(gpu_engine):
    buffer = memory.CudaBuffer(2 * MiB)
    region = gpu_engine.register(owned_by(buffer))
    if not region.staged:
        pytest.skip("direct registration pins the memory: freeing it under the NIC is the provider's business")
    peer_proc = PeerProcess(("shm", None), 2 * MiB)
    try:
        peer = gpu_engine.connect(peer_proc.address)
        buffer.close()
        with pytest.raises(StagingFailed, match="not live CUDA memory"):
            peer.write_pages(region, [0], peer_proc.descriptor, [0], MiB)
    finally:
        peer_proc.close()


def test_queued_jobs_are_told_apart_by_identity_not_by_their_arrays():
    """The stager and the landing thread drop finished jobs from their queues with list.remove; two jobs
    with equal fields are still two jobs, and numpy fields must never be compared (it raised in the stager
    once, on the GPU machine, leaving a killed peer's transfer unsettled)."""
    pages = np.arange(4, dtype=np.int64)
    fields = dict(pointer=0, length=4, device=0, src=pages, dst=pages, lengths=np.ones(4, np.uint64), deadline=0.0,
                  send=None, done=None, is_open=None)
    first, second = staging.StagedJob(**fields), staging.StagedJob(**fields)
    queue = [first, second]
    queue.remove(second)
    assert queue == [first] and queue[0] is first
    landing_fields = dict(address=b"", region_id=1, lane_bytes=4, max_pages=4, src=pages, dst=pages,
                          lengths=np.ones(4, np.uint64), imm=0, deadline=0.0, post=None, done=None, settle=None)
    jobs = [landing.LandingJob(**landing_fields), landing.LandingJob(**landing_fields)]
    jobs.remove(jobs[1])
    assert len(jobs) == 1


def test_a_staged_transfers_failure_speaks_of_the_callers_buffer_not_the_pools():
    """Writes of a staged transfer read from the pool: when the peer dies, the pool chunk is not yet safe,
    but the caller's GPU buffer is (only finished copies read it). The caller gets the same kind of error,
    safe, with the pool's error as its cause (a killed peer on the GPU machine showed wait_safe False)."""
    from fabriclab.errors import InvalidDescriptor, PeerLost, as_the_callers as _as_the_callers
    from fabriclab.transfer import Safety as _Safety
    pool_safety, callers = _Safety(1), _Safety(1)
    lost = PeerLost("no NIC reaches the peer any more", buffer_safe=False, safety=pool_safety)
    mine = _as_the_callers(lost, True, callers)
    assert type(mine) is PeerLost and mine.buffer_safe and mine.wait_safe(0.1) and mine.__cause__ is lost
    assert str(mine) == "no NIC reaches the peer any more (local buffer is safe to reuse)"
    later = _as_the_callers(lost, False, callers)  # a target's lanes: safe once the writes are reported
    assert not later.buffer_safe and not later.wait_safe(0.05)
    callers.settle(True)
    assert later.wait_safe(0.05)
    forged = InvalidDescriptor("forged")
    assert _as_the_callers(forged, True, callers) is forged


def test_copies_join_pages_that_continue_each_other_on_both_sides():
    src, dst, lengths = staging.copy_runs([0, 10, 20, 50, 60], [100, 110, 120, 0, 200], [10, 10, 10, 10, 10])
    assert src.tolist() == [0, 50, 60] and dst.tolist() == [100, 0, 200] and lengths.tolist() == [30, 10, 10]
    assert [a.size for a in staging.copy_runs([], [], [])] == [0, 0, 0]
    entries = np.array([(4096, 4096), (8192, 4096), (0, 4096)], dtype=[("dst", "<u8"), ("length", "<u4")])
    lane, region, sizes = lanecopy.lane_copies(entries)  # pages packed in the lane, in FILLED's order
    assert lane.tolist() == [0, 8192] and region.tolist() == [4096, 0] and sizes.tolist() == [8192, 4096]
