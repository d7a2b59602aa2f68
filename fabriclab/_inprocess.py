"""Endpoints of one process that are each other's peers, and the order in which they may really close.

libfabric's shm provider (1.17, and its later versions alike) maps a peer's region into the process when the
peer's address is inserted into an address vector, except when the peer is an endpoint of the same process:
then the address vector keeps that endpoint's own mapping (smr_map_to_region finds its name in the
process-wide list of endpoint names). Closing that endpoint unmaps the region (smr_free), and the next thing
the other endpoint does with its peer reads unmapped memory: a write posted to it (the peer's lock, in
smr_generic_rma), the completion of a write the peer answered (its command count), inserting its address
again (the list of names is never pruned). The process dies of a segfault. Two fabriclab.Engines of one
process writing to each other, or the lessons' LocalPair, are such pairs.

It goes the other way too: the first post to a peer sends it this endpoint's name, and the peer then holds
this endpoint's region the same way, and writes into it as it answers this endpoint's commands (the answer
to a write still queued when this endpoint closed lands in unmapped memory).

So an endpoint is closed in libfabric (fi_close) only once (1) every address vector of another resource tree
of this process that holds its address is closed, with the endpoints bound to it, and (2) every endpoint of
this process whose address its own address vector holds is closed, unless its owner declared it idle (no
operation of it is still inside the provider: nothing of its is left for a peer to answer). Until then the
endpoint is closed for Python (every call refuses) and left open in libfabric, unused, along with what it
needs (the queues it is bound to, its domain and fabric): what a peer of this process still posts to it
stalls, as it would into an endpoint whose process exited, and fails at its deadline. The last of them to
close closes the rest. This is the order libfabric asks for anyway (an object closes when nothing uses it
any more) and costs every provider nothing but memory held a while longer: a target closed first is held
until its writers close, a writer closed with writes still inside the provider until its targets close.

A tree is not its own peer: its objects close children first, newest first, with nothing posted in between.
fabriclab.fi calls this module; it holds the libfabric objects' ``_Native`` records, never the Resources.
"""
from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Iterable

if TYPE_CHECKING:
    from .fi._core import _Native as Node  # a libfabric object's record: endpoint, queue, address vector...

_lock = threading.Lock()
_endpoints: dict[bytes, Node] = {}  # raw address -> the open endpoint of this process that has it
_addresses: dict[Node, bytes] = {}  # and back
_holders: dict[Node, set[Node]] = {}  # endpoint -> address vectors of other trees that hold its address
_holds: dict[Node, set[Node]] = {}  # and back
_users: dict[Node, list[Node]] = {}  # completion queue or address vector -> the endpoints bound to it
_bound: dict[Node, tuple[Node, ...]] = {}  # and back
_idle: set[Node] = set()  # endpoints whose owner said no operation of theirs is still inside the provider
_deferred: list[Node] = []  # closed for Python, left open in libfabric until ready()


def _root(node: Node) -> Node:
    while node.parent is not None:
        node = node.parent
    return node


def endpoint_opened(endpoint: Node, address: bytes, bound_to: Iterable[Node]) -> None:
    """An endpoint of this process was opened with ``address``, bound to the queues ``bound_to``."""
    with _lock:
        _endpoints[address] = endpoint
        _addresses[endpoint] = address
        _bound[endpoint] = tuple(bound_to)
        for node in bound_to:
            _users.setdefault(node, []).append(endpoint)


def declare_idle(endpoint: Node) -> None:
    """No operation posted on ``endpoint`` is still inside the provider: its close need not wait for the
    peers of this process it wrote to (condition 2 above)."""
    with _lock:
        _idle.add(endpoint)


def address_inserted(av: Node, address: bytes) -> None:
    """``av`` took ``address``: when it is an open endpoint of this process (of another tree), that endpoint
    stays open in libfabric until ``av`` is done with it."""
    with _lock:
        endpoint = _endpoints.get(address)
        if endpoint is None or endpoint.pid != av.pid or _root(endpoint) is _root(av):
            return
        _holders.setdefault(endpoint, set()).add(av)
        _holds.setdefault(av, set()).add(endpoint)


def _done(av: Node) -> bool:
    """Nothing can use ``av`` any more: it and every endpoint bound to it are closed (for Python)."""
    return av.closed and all(endpoint.closed for endpoint in _users.get(av, ()))


def _ready(node: Node) -> bool:
    """``node`` may be closed in libfabric: no holder of its address can use it, no peer of this process it
    wrote to can still answer it, and nothing left open under it or bound to it waits for either."""
    return (all(child.fid is None for child in node.children)
            and not any(user.closed and user.fid is not None for user in _users.get(node, ()))
            and all(_done(av) for av in _holders.get(node, ()))
            and (node in _idle or all(peer.closed for av in _bound.get(node, ()) for peer in _holds.get(av, ()))))


def close_now(node: Node) -> bool:
    """Called as ``node`` (closed for Python) is about to be closed in libfabric: True to go ahead; False
    when it must wait (it is then kept, and handed back by a later ``closed`` call)."""
    with _lock:
        if _ready(node):
            return True
        _deferred.append(node)
        return False


def closed(node: Node) -> list[Node]:
    """``node`` was closed in libfabric: forget it. Returns the waiting objects that may close now (each is
    to be closed, and reported here in turn)."""
    with _lock:
        address = _addresses.pop(node, None)
        if address is not None and _endpoints.get(address) is node:
            del _endpoints[address]
        _holders.pop(node, None)
        _users.pop(node, None)
        _bound.pop(node, None)
        _idle.discard(node)
        for endpoint in _holds.pop(node, ()):
            _holders.get(endpoint, set()).discard(node)
        if not _deferred:
            return []
        ready = [n for n in _deferred if _ready(n)]
        _deferred[:] = [n for n in _deferred if n not in ready]
        return ready


def after_fork_in_child() -> None:
    """The parent's objects are not this process's to close (fabriclab.fi only forgets them): forget them here too."""
    global _lock
    _lock = threading.Lock()
    for table in (_endpoints, _addresses, _holders, _holds, _users, _bound, _idle):
        table.clear()
    _deferred.clear()
