"""``Peer.write_batch`` down the NICs' path: the writes of many transfers handed to the native engine as one
request, each write naming its transfer and immediate data (``native/service.h``, ``fl_request``), so that a
batch takes one look at the workers' inboxes, and wakes each worker once, instead of once per transfer."""
from __future__ import annotations

import collections
import functools
import time
from typing import TYPE_CHECKING, Any

from . import _native
from .errors import TransferError, TransferTimeout
from .service import fail_unqueued, hand_over
from .transfer import Safety, Transfer

if TYPE_CHECKING:
    from .engine import Peer, Region
    from .service import Service
    from .wire import PeerRegion

# One transfer of a batch: its writes' first source pages, first destination pages and bytes (one number when
# all have the same), the pages it moves, and its immediate data as it goes on the wire.
BatchItem = tuple[Any, Any, Any, int, int]


def post_batch(service: Service, peer: Peer, region: Region, remote: PeerRegion, items: list[BatchItem],
               page_size: int, timeout: float) -> list[Transfer]:
    """A Transfer per item, every write of every item in one native request (their inputs checked, the pair
    on the NICs' path). Refused whole (TransferError, nothing submitted) where the engine has not that many
    transfer ids free. Writes the workers' inboxes could not take by the deadline fail their transfers
    (TransferTimeout, in each one's future); the others run on."""
    deadline = time.monotonic() + timeout
    routes = peer._routes_to(region, remote)
    transfers: list[Transfer] = []
    firsts_src: list[int] = []
    firsts_dst: list[int] = []
    sizes: list[int] = []
    imms: list[int] = []
    for src, dst, lengths, pages, imm in items:
        writes = len(src)
        each = [lengths] * writes if isinstance(lengths, int) else [int(x) for x in lengths]
        transfer = Transfer(writes, sum(each), deadline, Safety(service.timeout), pages)
        transfer._peer_process = peer.process
        transfers.append(transfer)
        firsts_src += src if isinstance(src, list) else src.tolist()
        firsts_dst += dst if isinstance(dst, list) else dst.tolist()
        sizes += each
        imms += [imm] * writes
    with service.lock:
        if len(service.book.free_ids) < len(transfers):
            raise TransferError(f"too many transfers in flight for a batch of {len(transfers)}", buffer_safe=True)
        tids = [service.book.track(transfer, region._state, routes) for transfer in transfers]
        for transfer in transfers:
            service.count_submitted(transfer)
    owners = [tid for tid, transfer in zip(tids, transfers) for _ in range(transfer.writes)]
    request = routes.batch(region.pointer, firsts_src, firsts_dst, page_size, sizes, owners, imms, peer._next_nic)
    peer._next_nic = (peer._next_nic + len(owners)) % len(peer.fi_addrs)
    with service.lock:
        taken = service.native.submit(request, _native.NO_TRANSFER, 0) if not service.closed else 0
    for tid, transfer in zip(tids, transfers):
        transfer._finish_here = functools.partial(service.book.finish_here, tid, transfer)
    if taken < len(owners):
        by_id = dict(zip(tids, transfers))
        try:
            hand_over(service, request, _native.NO_TRANSFER, len(owners), taken, deadline,
                      lambda taken, why: fail_unqueued(service, {tid: (by_id[tid], n) for tid, n in
                                                                 collections.Counter(owners[taken:]).items()}, why))
        except TransferTimeout:
            pass  # the transfers whose writes were not all queued carry it; the others run on
    return transfers
