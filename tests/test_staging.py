"""GPU memory through fabriclab.Engine: the staged path (pinned pool) where the provider lacks FI_HMEM, the
direct path where it has it. Tests marked ``gpu`` need torch with CUDA; the others run anywhere."""
import hashlib
import time

import numpy as np
import pytest

from fabriclab import Engine, RegionClosed, StagingFailed, TransferError, fi, gpu, memory, staging
from fabriclab.nics import NicSet
from test_api import PeerProcess

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


# ------------------------------------------------------------------------------------- with a GPU

torch = pytest.importorskip("torch") if gpu.cuda_status() == "ok" else None
needs_torch_cuda = pytest.mark.skipif(gpu.cuda_status() != "ok" or torch is None or not torch.cuda.is_available(),
                                      reason="needs torch with CUDA")


def gpu_pages(seed, n, page):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randint(0, 256, (n * page,), dtype=torch.uint8, device="cuda", generator=g)


def sha(tensor) -> str:
    return hashlib.sha256(tensor.cpu().numpy().tobytes()).hexdigest()


@pytest.fixture
def gpu_engine():
    with Engine("shm", pin=False, timeout=20, staging_bytes=8 * MiB, staging_chunk_bytes=MiB) as engine:
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
def test_gpu_target_is_direct_or_refused_clearly(gpu_engine):
    target = torch.zeros(4 * MiB, dtype=torch.uint8, device="cuda")
    region = gpu_engine.register(target)
    if region.staged:
        with pytest.raises(fi.UsageError, match="staged, and can be a source of writes, not a target"):
            region.descriptor()
    else:
        assert region.descriptor()


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
    with pytest.raises(fi.UsageError, match="contiguous"):
        gpu_engine.register(torch.zeros((64, 64), dtype=torch.uint8, device="cuda").t())
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

    class Owned:
        __cuda_array_interface__ = {"shape": (2 * MiB,), "typestr": "|u1", "data": (buffer.pointer, False),
                                    "version": 3}

    region = gpu_engine.register(Owned())
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
