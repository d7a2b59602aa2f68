"""The service's staged paths (``fabriclab.service``): transfers from GPU memory the NICs cannot register,
copied through the staging pool (``fabriclab.staging``), and transfers into a peer's staged target, through
its landing lanes (``fabriclab.landing``). Each resolves its caller's Transfer once the stager or the
landing thread says the whole transfer is done."""
from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from . import control, fi, landing, staging
from .completions import RegionState
from .errors import StagingFailed, as_the_callers, staging_failure
from .transfer import Safety, Transfer
from .wire import PeerRegion

if TYPE_CHECKING:
    from .engine import Peer, Region
    from .service import Service


def start_staging(service: Service) -> staging.PinnedPool:
    """The staging pool and its thread (at the first staged region); the Engine registers the pool."""
    if service.stager is None:
        pool = staging.PinnedPool(*service.staging_sizes)
        service.stager = staging.Stager(pool, staging_failure)
    return service.stager.pool


def start_landing(service: Service) -> landing.Landing:
    """The landing thread and its control channel (at the first staged target, the first write into a
    peer's, or the first GPU region offered to CUDA IPC peers)."""
    with service.lock:
        if service.landing is None:
            service.check_open()
            slot = service.nics.slots[0]
            service.landing = landing.Landing(service.provider, slot.domain_name, service.engine_id, service.native,
                                              staging_failure, lease_s=service.timeout, entries=service.entries)
            service.landing.handlers[control.COPIED_IN] = service.ipc.copied_in.message  # fabriclab.ipc
        return service.landing


def _lengths(count: int, lengths: np.ndarray | int) -> np.ndarray:
    return np.full(count, lengths, dtype=np.uint64) if np.isscalar(lengths) else np.asarray(lengths, np.uint64)


def _check_source(region: Region) -> None:
    """A staged region's GPU memory is still there (its owner may have freed it)."""
    try:
        staging.pointer_device(region.pointer, region.length)
    except staging.StagingError as exc:
        raise StagingFailed(f"region {region.id} cannot be staged: {exc}", buffer_safe=True) from None


def finisher(service: Service, transfer: Transfer, state: RegionState,
              settle_unsafe: bool) -> Callable[[BaseException | None, bool], None]:
    """The ``done(error, safe)`` a stager or landing job calls once: the region is no longer read, and the
    transfer resolves. ``settle_unsafe``: an unsafe end is final (else the job says later when it is safe)."""
    def done(error: BaseException | None, safe: bool) -> None:
        with service.lock:
            state.in_use -= 1
        if error is None:
            transfer._succeed()
        elif not transfer.done():
            transfer.set_exception(as_the_callers(error, safe, transfer._safety))
        if safe or settle_unsafe:
            transfer._safety.settle(safe)
    return done


def submit_staged(service: Service, peer: Peer, region: Region, remote: PeerRegion, src: np.ndarray,
                  dst: np.ndarray, lengths: np.ndarray | int, imm: int, timeout: float) -> Transfer:
    """A transfer from a staged region, write i moving lengths[i] bytes from byte src[i] to byte dst[i]: the
    stager copies it into the pool chunk by chunk and hands each chunk's writes (one per write asked for,
    from the pool) to :meth:`Service.post`."""
    _check_source(region)
    stager = service.stager
    assert stager is not None  # started when the region was registered
    sizes = _lengths(src.size, lengths)
    stager.check_fits(int(sizes.max()))
    deadline = time.monotonic() + timeout
    transfer = Transfer(src.size, int(sizes.sum()), deadline, Safety(service.timeout))
    pool_region, state, device = region.engine._pool_region, region._state, region.device
    assert pool_region is not None and device is not None  # a staged region is GPU memory, the pool registered
    with service.lock:
        state.in_use += 1

    def send(pool_src: np.ndarray, pool_dst: np.ndarray, pool_lengths: np.ndarray) -> Transfer:
        service.check_open()
        return service.post(peer, pool_region, remote, pool_src, pool_dst, 1, pool_lengths, imm,
                            max(deadline - time.monotonic(), 1e-3))

    stager.submit(staging.StagedJob(region.pointer, region.length, device, src, dst, sizes, deadline, send,
                                    finisher(service, transfer, state, settle_unsafe=True),
                                    lambda: not state.closed))
    return transfer


def submit_landing(service: Service, peer: Peer, region: Region, remote: PeerRegion, src: np.ndarray,
                   dst: np.ndarray, lengths: np.ndarray | int, imm: int, timeout: float) -> Transfer:
    """A transfer into a peer's staged target (bytes as :func:`submit_staged`): the landing thread gets lanes
    from the target, writes each lane's pages into them (from the region, or through the staging pool when
    the region is staged itself) and resolves the transfer once the target says every page is in place."""
    route = remote.landing
    assert route is not None
    n = src.size
    sizes = _lengths(n, lengths)
    largest = int(sizes.max())
    if largest > route.lane_bytes:
        raise fi.UsageError(f"a write of {largest} bytes does not fit the target's landing lanes of "
                            f"{route.lane_bytes} bytes: use smaller pages or stripe_bytes, or give the target "
                            "a larger Engine(staging_chunk_bytes=...)")
    if region.staged:
        assert service.stager is not None
        service.stager.check_fits(largest)
        _check_source(region)
    lander = start_landing(service)
    message_bytes = min(route.message_bytes, lander.channel.message_bytes)
    max_pages = (message_bytes - control.FILLED_HEAD) // control.PAGE_ENTRY.size
    deadline = time.monotonic() + timeout
    transfer = Transfer(n, int(sizes.sum()), deadline, Safety(service.timeout), pages=n)
    state = region._state
    with service.lock:
        state.in_use += 1
        service.count_submitted(transfer)

    def post(src_bytes: np.ndarray, lane_offsets: np.ndarray, lane_lengths: np.ndarray, lane_imm: int,
             left: float) -> Transfer:
        service.check_open()
        if region.staged:
            return submit_staged(service, peer, region, route.lanes, src_bytes, lane_offsets, lane_lengths,
                                 lane_imm, left)
        return service.post(peer, region, route.lanes, src_bytes, lane_offsets, 1, lane_lengths, lane_imm, left)

    lander.submit(landing.LandingJob(route.address, remote.region_id, route.lane_bytes, max_pages, src, dst, sizes,
                                     imm, deadline, post, finisher(service, transfer, state, settle_unsafe=False),
                                     transfer._safety.settle, region_key=route.key, target_id=remote.engine_id,
                                     lanes=route.lanes.length // route.lane_bytes))
    return transfer


def stats(service: Service) -> dict[str, Any]:
    """The staging pool and the landing lanes: their sizes, and what went through them (zeros until a
    region is staged, or a staged target written into)."""
    if service.stager is not None:
        pool_stats = service.stager.stats()
    else:
        _, pool = staging.pool_layout(*service.staging_sizes)
        pool_stats = {"pool_bytes": pool, "chunk_bytes": service.staging_sizes[1], "allocated": False,
                      "staged_bytes": 0, "staged_chunks": 0, "copy_seconds": 0.0, "jobs_waiting": 0}
    lanes, pool = landing.max_lanes(*service.staging_sizes)
    lander = service.landing
    landed = lander.stats() if lander is not None else {
        "landed_bytes": 0, "landed_lanes": 0, "landing_copy_seconds": 0.0, "landing_jobs": 0,
        "bad_control_messages": 0, "control_threads_stranded": 0, "control_peers": 0, "control_peers_removed": 0}
    return {**pool_stats, "landing_pool_bytes": pool, "lanes": lanes,
            "landing_allocated": lander is not None and lander.pool is not None, **landed}


def stop(service: Service) -> None:
    """The engine closes: the landing thread fails writers' jobs (copies into staged targets are waited for);
    the stager fails what it had not handed over (its chunks' writes are failed with the engine's)."""
    if service.landing is not None:
        service.landing.close()
    if service.stager is not None:
        service.stager.close()


def release_pools(service: Service) -> None:
    """Free the staging pool and the landing lanes, once no NIC has them registered."""
    if service.stager is not None:
        service.stager.pool.close()
    if service.landing is not None and service.landing.pool is not None:
        service.landing.pool.close()
