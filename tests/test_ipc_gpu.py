"""The CUDA IPC path on a GPU (fabriclab.ipc, fabriclab.ipc_writer): torch CUDA tensors on both sides, in two
processes and in one, byte-exact with permuted pages; a target that frees its memory; a target killed
mid-transfer; the path turned off. Marked ``gpu``: skipped (saying so) where there is no CUDA GPU and torch."""
import dataclasses
import hashlib
import os
import signal
import time

import numpy as np
import pytest

from fabriclab import Engine, InvalidDescriptor, PeerLost, RegionClosed, bootstrap, gpu, memory, wire
from helpers import Child, python

torch = pytest.importorskip("torch") if gpu.cuda_status() == "ok" else None
pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(gpu.cuda_status() != "ok" or torch is None or not torch.cuda.is_available(),
                                 reason="needs a CUDA GPU and torch")]
HERE = os.path.dirname(os.path.abspath(__file__))
KiB, MiB = 1 << 10, 1 << 20


def source_pages(seed, nbytes, device=0):
    g = torch.Generator(device=f"cuda:{device}").manual_seed(seed)
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device=f"cuda:{device}", generator=g)


def expected_after(source, src, dst, page, nbytes):
    host, out = source.cpu().numpy(), np.zeros(nbytes, np.uint8)
    for s, d in zip(src, dst):
        out[d * page:(d + 1) * page] = host[s * page:(s + 1) * page]
    return hashlib.sha256(out).hexdigest()


class Target(Child):
    def __init__(self, size, offset=4096, *options):
        super().__init__(python(os.path.join(HERE, "ipc_peer.py"), size, offset, *options))
        self.address, self.descriptor = bootstrap.unpack(bytes.fromhex(self.line()))


@pytest.fixture
def writer():
    with Engine("shm", pin=False, timeout=10) as engine:
        yield engine


@pytest.mark.parametrize("pages,page,permuted", [(1024, 64 * KiB, True), (64, MiB, False), (64, MiB, True)])
def test_two_processes_copy_through_cuda_ipc_byte_exact(writer, pages, page, permuted):
    nbytes = pages * page
    with Target(nbytes) as target:
        assert target.ask("offered") == "True"
        source = source_pages(pages, nbytes)
        region = writer.register(source)
        peer = writer.connect(target.address)
        assert peer.route(region, target.descriptor) == ("cuda-ipc", "")
        src = np.arange(pages)
        dst = np.random.default_rng(pages).permutation(pages) if permuted else src
        for imm in (5, 6):  # the second reuses the opened allocation and the route
            result = peer.write_pages(region, src, target.descriptor, dst, page, imm=imm).result(30)
            assert result.pages == pages and result.bytes == nbytes
            expect = expected_after(source, src, dst, page, nbytes)
            assert target.ask(f"expect {imm} {pages} 20") == f"landed {pages} sha256={expect}"
        stats = writer.stats()["cuda_ipc"]
        assert stats["transfers"] == 2 and stats["launches"] == 2 and stats["bytes"] == 2 * nbytes
        assert result.writes == pages  # one copy a page, all in one launch


def forged(descriptor, length, alloc_bytes):
    """``descriptor`` (a plain GPU region's, sealed anew) claiming ``length`` bytes in an allocation of
    ``alloc_bytes``: what a hostile or confused target could hand a writer."""
    r = wire.decode_region(descriptor)
    return wire.encode_region(r.engine_id, r.region_id, length, r.bases, r.keys,
                              dataclasses.replace(r.ipc, alloc_bytes=alloc_bytes))


def test_a_descriptor_claiming_more_than_the_opened_allocation_is_refused_and_the_gpu_stays_usable(writer):
    """Issue 31, item 12: the region is checked against the allocation that actually opened here
    (cuMemGetAddressRange), not the size the descriptor claims; a copy past the mapping would kill this
    process's CUDA context."""
    pages, page = 2, MiB
    with Target(pages * page) as target:
        source = source_pages(21, 64 * page)
        region = writer.register(source)
        peer = writer.connect(target.address)
        lie = forged(target.descriptor, 64 * page, 128 * 64 * page)
        with pytest.raises(InvalidDescriptor, match="outside the allocation that opened here"):
            peer.write_pages(region, np.arange(64), lie, np.arange(64), page, imm=3).result(30)
        with pytest.raises(InvalidDescriptor):
            peer.route(region, lie)
        # the honest descriptor still works, and this process's CUDA context with it
        peer.write_pages(region, np.arange(pages), target.descriptor, np.arange(pages), page, imm=4).result(30)
        expect = expected_after(source, np.arange(pages), np.arange(pages), page, pages * page)
        assert target.ask(f"expect 4 {pages} 20") == f"landed {pages} sha256={expect}"
        torch.cuda.synchronize()
        assert writer.stats()["cuda_ipc"]["transfers"] == 1


def test_a_descriptor_claiming_more_than_a_region_of_this_process_is_refused(writer):
    with Engine("shm", pin=False, timeout=10) as target_engine:
        target = torch.zeros(2 * MiB, dtype=torch.uint8, device="cuda")
        target_region = target_engine.register(target)
        descriptor = target_region.descriptor()
        region = writer.register(source_pages(22, 64 * MiB))
        peer = writer.connect(target_engine.address)
        with pytest.raises(InvalidDescriptor, match="claims"):
            peer.write_pages(region, np.arange(64), forged(descriptor, 64 * MiB, 128 * MiB), np.arange(64), MiB)
        assert peer.route(region, descriptor) == ("cuda-ipc", "")  # the honest one still takes the path
        torch.cuda.synchronize()


def test_byte_ranges_with_stripes_through_cuda_ipc(writer):
    """Peer.write: a byte range at odd offsets, cut in stripes (the last shorter), counted per stripe."""
    nbytes = 8 * MiB + 12345
    with Target(16 * MiB) as target:
        source = source_pages(13, nbytes)
        region = writer.register(source)
        peer = writer.connect(target.address)
        result = peer.write(region, target.descriptor, src_offset=3, dst_offset=5, length=nbytes - 3,
                            stripe_bytes=MiB, imm=8).result(30)
        assert result.writes == -(-(nbytes - 3) // MiB) and result.bytes == nbytes - 3
        expected = np.zeros(16 * MiB, np.uint8)
        expected[5:5 + nbytes - 3] = source.cpu().numpy()[3:]
        digest = hashlib.sha256(expected).hexdigest()
        assert target.ask(f"expect 8 {result.writes} 20") == f"landed {result.writes} sha256={digest}"


def test_engines_of_one_process_copy_directly(writer):
    n, page = 256, 64 * KiB
    with Engine("shm", pin=False, timeout=10) as target_engine:
        whole = torch.zeros(n * page + 8192, dtype=torch.uint8, device="cuda")
        target = whole[4096:4096 + n * page]
        target_region = target_engine.register(target)
        descriptor = target_region.descriptor()
        source = source_pages(3, n * page)
        region = writer.register(source)
        peer = writer.connect(target_engine.address)
        assert peer.route(region, descriptor)[0] == "cuda-ipc"
        dst = np.random.default_rng(1).permutation(n)
        counted = target_engine.expect(9, n)
        peer.write_pages(region, np.arange(n), descriptor, dst, page, imm=9).result(30)
        assert counted.result(10) == n
        torch.cuda.synchronize()
        expect = expected_after(source, np.arange(n), dst, page, n * page)
        assert hashlib.sha256(target.cpu().numpy().tobytes()).hexdigest() == expect
        assert int(whole[:4096].sum()) == 0 and int(whole[4096 + n * page:].sum()) == 0


def test_raw_cuda_python_memory_takes_the_path_too(writer):
    n, page = 16, 64 * KiB
    with Engine("shm", pin=False, timeout=10) as target_engine:
        target = memory.CudaBuffer(n * page)
        target_region = target_engine.register(target)
        descriptor = target_region.descriptor()
        source = memory.CudaBuffer(n * page)
        data = np.random.default_rng(4).integers(0, 256, n * page, dtype=np.uint8)
        source.write(data)
        peer = writer.connect(target_engine.address)
        region = writer.register(source)
        assert peer.route(region, descriptor)[0] == "cuda-ipc"
        peer.write_pages(region, np.arange(n), descriptor, np.arange(n)[::-1], page).result(30)
        assert np.array_equal(target.read().reshape(n, page), data.reshape(n, page)[::-1])


@pytest.mark.parametrize("side", ["writer", "target"])
def test_gpu_ipc_off_takes_the_staged_path_and_says_why(side):
    n, page = 32, 64 * KiB
    with Engine("shm", pin=False, timeout=10, gpu_ipc=side != "writer") as writer, \
            Target(n * page, 4096, *(["--no-ipc"] if side == "target" else [])) as target:
        if side == "target":
            assert target.ask("offered").startswith("False")
        source = source_pages(7, n * page)
        region = writer.register(source)
        peer = writer.connect(target.address)
        path, why = peer.route(region, target.descriptor)
        assert path == region.path != "cuda-ipc" and ("gpu_ipc=False" in why if side == "writer" else
                                                      "offers no CUDA IPC" in why)
        dst = np.random.default_rng(2).permutation(n)
        peer.write_pages(region, np.arange(n), target.descriptor, dst, page, imm=3).result(60)
        expect = expected_after(source, np.arange(n), dst, page, n * page)
        assert target.ask(f"expect 3 {n} 20") == f"landed {n} sha256={expect}"
        assert writer.stats()["cuda_ipc"]["transfers"] == 0


def test_a_closed_and_freed_target_refuses_writes_typed(writer):
    n, page = 64, 64 * KiB
    with Target(n * page) as target:
        source = source_pages(8, n * page)
        region = writer.register(source)
        peer = writer.connect(target.address)
        peer.write_pages(region, np.arange(n), target.descriptor, np.arange(n), page).result(30)
        assert target.ask("close-region", timeout=30) == "closed"
        with pytest.raises(RegionClosed) as closed:
            peer.write_pages(region, np.arange(n), target.descriptor, np.arange(n), page).result(30)
        assert closed.value.buffer_safe
        assert target.ask("filler") == "filler-ok"  # the memory handed on was never written


def test_a_closed_target_engine_shuts_its_regions(writer):
    """The target's engine closes (its process and memory stay): later copies into its regions are refused."""
    n, page = 16, 64 * KiB
    with Target(n * page) as target:
        region = writer.register(source_pages(12, n * page))
        peer = writer.connect(target.address)
        peer.write_pages(region, np.arange(n), target.descriptor, np.arange(n), page).result(30)
        assert target.ask("close-engine", timeout=30) == "engine-closed"
        with pytest.raises(RegionClosed):
            peer.write_pages(region, np.arange(n), target.descriptor, np.arange(n), page).result(30)


def test_a_target_killed_mid_transfer_fails_typed(writer):
    n, page = 64, MiB
    target = Target(n * page)
    try:
        source = source_pages(9, n * page)
        region = writer.register(source)
        peer = writer.connect(target.address)
        futures, failure = [], None
        deadline = time.monotonic() + 30
        while failure is None and time.monotonic() < deadline:
            futures.append(peer.write_pages(region, np.arange(n), target.descriptor, np.arange(n), page, imm=1))
            if len(futures) == 20:
                target.signal(signal.SIGKILL)
            if len(futures) > 8:
                error = futures[-8].exception(30)
                failure = error if error is not None else None
        assert isinstance(failure, PeerLost) and failure.buffer_safe, failure
        for future in futures:
            future.exception(30)  # every one ends, one way or the other
        assert float(source[:16].float().sum()) >= 0  # this process's CUDA context still works
    finally:
        target.kill()
    stats = writer.stats()["cuda_ipc"]
    assert stats["in_flight"] == 0 and stats["routes"] == 0  # the dead peer's routes (and mapping) are gone


@pytest.mark.skipif(torch is None or torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_two_gpus_copy_between_devices_or_say_why(writer):
    """The writer's memory on GPU 1, the target's on GPU 0: the copy runs on GPU 1 into GPU 0's memory (peer
    access, NVLink or PCIe) where the devices allow it; elsewhere the route says why and the staged path runs."""
    n, page = 256, 64 * KiB
    with Target(n * page, 4096, "--device=0") as target:
        source = source_pages(11, n * page, device=1)
        region = writer.register(source)
        assert region.device == 1
        peer = writer.connect(target.address)
        path, why = peer.route(region, target.descriptor)
        print(f"GPU 1 -> GPU 0: {path} {why}")
        d = gpu.require_cuda()
        can = gpu.check(d.cuDeviceCanAccessPeer(gpu.check(d.cuDeviceGet(1), "get"), gpu.check(d.cuDeviceGet(0), "get")),
                        "cuDeviceCanAccessPeer")
        assert (path == "cuda-ipc") == bool(can), why
        dst = np.random.default_rng(3).permutation(n)
        peer.write_pages(region, np.arange(n), target.descriptor, dst, page, imm=4).result(60)
        expect = expected_after(source, np.arange(n), dst, page, n * page)
        assert target.ask(f"expect 4 {n} 20") == f"landed {n} sha256={expect}"
