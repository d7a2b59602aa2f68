"""A small, optional way to swap bytes (engine addresses, region descriptors) between two processes
over a TCP socket — for demos and tests. The engine itself never needs it: send those bytes any way
you like (your RPC, a file, a key-value store).

    # process A                                   # process B
    with Rendezvous() as r:                       peer_bytes = exchange(port, my_bytes)
        print(r.port)                             
        peer_bytes = r.exchange(my_bytes)

Binds to 127.0.0.1 unless told otherwise; each exchange ends within its timeout, whatever else connects (a
stray or silent connection, or one sending what no fabriclab peer sends, is dropped, and the exchange waits on
for a peer). Errors derive from ``fi.FabriclabError``: ``fi.FabricTimeout``, ``BootstrapError`` (nothing
listens, or the other side broke the connection), ``fi.UsageError``. Where a deployment already has a
torch.distributed store or an MPI communicator, ``allgather`` swaps the same bytes through it. Payloads are
bytes-like (bytes, bytearray, memoryview, a numpy array); anything else (text, a number, None) is a
UsageError, as are a rank or port that is no integer and a timeout that is not a finite positive number.
"""
from __future__ import annotations

import collections
import selectors
import socket
import struct
import time

from typing import Any, Literal

from . import fi

# A message on the socket: this magic, the payload's length, the payload. The magic tells a fabriclab peer
# from anything else that connects (a port scanner, a browser, a stray client of another service).
_MAGIC = b"FLbs"
_HEAD = struct.Struct("<4sI")
_LENGTH = struct.Struct("<I")
MAX_MESSAGE = 64 << 20
# Connections a Rendezvous reads at once: past this many, the one that has waited longest without a whole
# message is dropped (a flood of silent connections takes neither every descriptor nor the honest peer's turn).
MAX_PENDING = 64


class BootstrapError(fi.FabriclabError, ConnectionError):
    """The other side of a bootstrap exchange is not there, broke the connection, or sent what no fabriclab
    peer sends (the message says which)."""


def _bytes(value: object, what: str) -> bytes:
    """A bytes-like ``value`` as bytes; UsageError for anything else (bytes() would turn 3 into three zero
    bytes, and a str into a TypeError)."""
    try:
        return bytes(memoryview(value))  # type: ignore[arg-type]  # TypeError says it is no buffer
    except TypeError:
        hint = ": encode text first (.encode())" if isinstance(value, str) else ""
        raise fi.UsageError(f"{what} must be bytes (bytes, bytearray, memoryview), got {type(value).__name__}"
                            f"{hint}") from None


def _frame(payload: bytes) -> bytes:
    if len(payload) > MAX_MESSAGE:
        raise fi.UsageError(f"a bootstrap payload holds at most {MAX_MESSAGE} bytes, got {len(payload)}: swap "
                            "large data over the engine, and only addresses and descriptors here")
    return _HEAD.pack(_MAGIC, len(payload)) + payload


def _needed(data: bytearray, who: str) -> int:
    """How many more bytes make ``data`` a whole message (0: it is one); BootstrapError for what no fabriclab
    peer sends."""
    if not _MAGIC.startswith(bytes(data[:len(_MAGIC)])):
        raise BootstrapError(f"{who} sent {bytes(data[:len(_MAGIC)])!r} where a fabriclab bootstrap message starts "
                             f"with {_MAGIC!r}: not a fabriclab peer (or one of another version)")
    if len(data) < _HEAD.size:
        return _HEAD.size - len(data)
    size: int = _HEAD.unpack_from(data)[1]
    if size > MAX_MESSAGE:
        raise BootstrapError(f"{who} announced a bootstrap message of {size} bytes, more than {MAX_MESSAGE}: not a "
                             "fabriclab peer")
    return _HEAD.size + size - len(data)


def _left(deadline: float, what: str, timeout: float) -> float:
    """The seconds left before ``deadline``; FabricTimeout once none are."""
    left = deadline - time.monotonic()
    if left <= 0:
        raise fi.FabricTimeout(what, timeout)
    return left


def pack(*parts: bytes) -> bytes:
    """Several byte strings as one message (each length-prefixed): e.g. ``pack(engine.address,
    region.descriptor())``."""
    checked = [_bytes(p, "every part") for p in parts]
    return b"".join(_LENGTH.pack(len(p)) + p for p in checked)


def unpack(data: bytes) -> list[bytes]:
    """The byte strings ``pack`` put together."""
    data = _bytes(data, "a bootstrap message")
    parts, offset = [], 0
    while offset < len(data):
        if offset + _LENGTH.size > len(data):
            raise fi.UsageError("truncated bootstrap message")
        (n,) = _LENGTH.unpack_from(data, offset)
        if offset + _LENGTH.size + n > len(data):
            raise fi.UsageError("truncated bootstrap message")
        parts.append(bytes(data[offset + _LENGTH.size:offset + _LENGTH.size + n]))
        offset += _LENGTH.size + n
    return parts


class Rendezvous:
    """The listening side: ``exchange(payload)`` waits for one peer, receives its bytes, sends ours.

    Every connection is read at once, as its bytes come: one that closes early, stays silent, trickles, or
    sends what no fabriclab peer sends is dropped (``dropped`` counts them), and the exchange goes on waiting
    for a peer until its deadline. A peer whose message arrived while no exchange ran is answered by the
    next one, first come first served."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0, timeout: float = 30.0) -> None:
        self.timeout = fi.seconds(timeout, "timeout")
        port = fi.integer(port, "port", 0, 65535)
        try:
            self._listener = socket.create_server((host, port))
        except OSError as exc:
            raise BootstrapError(f"cannot listen on {host}:{port}: {exc.strerror or exc} (port 0 picks a free "
                                 "one)") from None
        self._listener.setblocking(False)
        self.host, self.port = self._listener.getsockname()[:2]
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._listener, selectors.EVENT_READ)
        # connections still sending -> (their bytes so far, when accepted, who); whole messages not answered yet
        self._reading: dict[socket.socket, tuple[bytearray, float, str]] = {}
        self._ready: collections.deque[tuple[socket.socket, bytes]] = collections.deque()
        #: connections dropped so far
        self.dropped = 0
        #: why the last one was
        self.last_dropped = ""

    def exchange(self, payload: bytes) -> bytes:
        """Wait for the next peer, receive its bytes, send it ``payload``; returns its bytes.
        ``fi.FabricTimeout`` when no peer's whole message came within ``timeout`` seconds of the call."""
        frame = _frame(_bytes(payload, "payload"))
        deadline = time.monotonic() + self.timeout
        while True:
            while self._ready:
                conn, theirs = self._ready.popleft()
                if self._reply(conn, frame, deadline):
                    return theirs
            left = deadline - time.monotonic()
            if left <= 0:
                dropped = f"{self.dropped} connection(s) dropped so far, the last: {self.last_dropped}"
                raise fi.FabricTimeout("a fabriclab peer sending its bytes to the bootstrap socket", self.timeout,
                                       dropped if self.dropped else "")
            for key, _ in self._selector.select(left):
                if key.fileobj is self._listener:
                    self._accept()
                else:
                    self._read(key.fileobj)  # type: ignore[arg-type]  # registered sockets only

    def _accept(self) -> None:
        try:
            conn, (host, port, *_) = self._listener.accept()
        except (BlockingIOError, ConnectionAbortedError):
            return  # gone again before we took it
        conn.setblocking(False)
        now = time.monotonic()
        for old, (_, since, who) in list(self._reading.items()):  # oldest first
            if now - since > self.timeout:
                self._drop(old, f"{who} sent no whole message within the timeout")
            elif len(self._reading) >= MAX_PENDING:
                self._drop(old, f"{who} was the oldest of {MAX_PENDING} connections without a whole message")
        self._reading[conn] = (bytearray(), now, f"a connection from {host}:{port}")
        self._selector.register(conn, selectors.EVENT_READ)

    def _read(self, conn: socket.socket) -> None:
        data, _, who = self._reading[conn]
        try:
            chunk = conn.recv(_needed(data, who))
            if not chunk:
                raise BootstrapError(f"{who} closed after {len(data)} bytes, before its whole message")
            data += chunk
            if _needed(data, who) == 0:
                self._selector.unregister(conn)
                del self._reading[conn]
                self._ready.append((conn, bytes(data[_HEAD.size:])))
        except BlockingIOError:
            pass
        except (BootstrapError, OSError) as exc:
            self._drop(conn, str(exc))

    def _drop(self, conn: socket.socket, why: str) -> None:
        self._selector.unregister(conn)
        del self._reading[conn]
        conn.close()
        self.dropped += 1
        self.last_dropped = why

    def _reply(self, conn: socket.socket, frame: bytes, deadline: float) -> bool:
        """Send our message to a peer whose whole message came; False if it is gone (or takes none in time)."""
        with conn:
            try:
                conn.settimeout(max(deadline - time.monotonic(), 1e-3))
                conn.sendall(frame)
                return True
            except OSError as exc:
                self.dropped += 1
                self.last_dropped = f"a peer took no reply: {exc}"
                return False

    def close(self) -> None:
        """Stop listening; drop the connections not answered."""
        for conn in [*self._reading, *(conn for conn, _ in self._ready)]:
            conn.close()
        self._reading.clear()
        self._ready.clear()
        self._selector.close()
        self._listener.close()

    def __enter__(self) -> Rendezvous:
        return self

    def __exit__(self, *exc: object) -> Literal[False]:
        self.close()
        return False


def exchange(port: int, payload: bytes, host: str = "127.0.0.1", timeout: float = 30.0) -> bytes:
    """The connecting side: send our bytes to a Rendezvous, return theirs, all within ``timeout`` seconds
    (``fi.FabricTimeout``); ``BootstrapError`` when nothing listens there, or the other side breaks the
    connection or answers what no Rendezvous sends."""
    payload, port = _bytes(payload, "payload"), fi.integer(port, "port", 1, 65535)
    timeout = fi.seconds(timeout, "timeout")
    frame, deadline, where = _frame(payload), time.monotonic() + timeout, f"the bootstrap socket at {host}:{port}"
    try:
        sock = socket.create_connection((host, port), timeout=timeout)
    except TimeoutError:
        raise fi.FabricTimeout(f"connecting to {where}", timeout) from None
    except OSError as exc:
        raise BootstrapError(f"cannot connect to {where}: {exc.strerror or exc} (is its Rendezvous listening?)") \
            from None
    with sock:
        reply = bytearray()
        try:
            sock.settimeout(_left(deadline, f"sending to {where}", timeout))
            sock.sendall(frame)
            while need := _needed(reply, where):
                sock.settimeout(_left(deadline, f"an answer from {where}", timeout))
                chunk = sock.recv(min(need, 1 << 20))
                if not chunk:
                    raise BootstrapError(f"{where} closed the connection after {len(reply)} bytes of its answer")
                reply += chunk
        except fi.FabriclabError:
            raise
        except TimeoutError:  # a send or receive that took what was left
            raise fi.FabricTimeout(f"an answer from {where}", timeout) from None
        except OSError as exc:
            raise BootstrapError(f"{where} broke the connection: {exc}") from None
        return bytes(reply[_HEAD.size:])


# ------------------------------------------------------------------- through a serving framework's own


def allgather(payload: bytes, *, store: Any = None, rank: int | None = None, world_size: int | None = None,
              comm: Any = None,
              key: str = "fabriclab", timeout: float = 30.0) -> list[bytes]:
    """Every rank's ``payload`` (e.g. ``pack(engine.address, region.descriptor())``), in rank order, through
    what a deployment already has, as serving frameworks exchange their own addresses:

    * ``store``: a torch.distributed Store (TCPStore, FileStore, ...; anything with set(key, bytes),
      get(key) returning bytes and optionally wait(keys, timedelta)), with this process's
      ``rank`` and the ``world_size``. Keys are ``{key}/{rank}``: use a fresh ``key`` per exchange.
    * ``comm``: an mpi4py communicator (its allgather).
    * neither: mpi4py's COMM_WORLD when mpi4py is installed.

    Neither torch nor mpi4py is a dependency: nothing is imported until used. Waits at most ``timeout``
    seconds for the other ranks (``fi.FabricTimeout``) where the store can wait."""
    payload, timeout = _bytes(payload, "payload"), fi.seconds(timeout, "timeout")
    if store is None:
        if comm is None:
            try:
                from mpi4py import MPI
            except ImportError:
                raise fi.UsageError("bootstrap.allgather needs store= (a torch.distributed Store, with rank= and "
                                    "world_size=) or comm= (an mpi4py communicator); mpi4py is not installed "
                                    "for a default COMM_WORLD") from None
            comm = MPI.COMM_WORLD
        return [_bytes(p, f"rank {r}'s payload from the communicator") for r, p in enumerate(comm.allgather(payload))]
    if rank is None or world_size is None:
        raise fi.UsageError(f"a store exchange needs rank and world_size with 0 <= rank < world_size, got rank "
                            f"{rank} of {world_size}")
    world_size = fi.integer(world_size, "world_size", 1)
    rank = fi.integer(rank, "rank", 0, world_size - 1)
    if not isinstance(key, str) or not key:
        raise fi.UsageError(f"key must be a non-empty str (the store's keys are KEY/RANK), got {key!r}")
    keys = [f"{key}/{r}" for r in range(world_size)]
    store.set(keys[rank], payload)
    if hasattr(store, "wait"):
        import datetime
        try:
            store.wait(keys, datetime.timedelta(seconds=timeout))
        except Exception as exc:  # torch raises its own DistStoreError/RuntimeError on timeout
            raise fi.FabricTimeout(f"all {world_size} ranks setting {key!r}/RANK in the store", timeout,
                                   f"{type(exc).__name__}: {exc}") from None
    values = [store.get(k) for k in keys]
    for k, value in zip(keys, values):
        if not isinstance(value, (bytes, bytearray, memoryview)):
            raise fi.UsageError(f"the store's value of {k!r} is {type(value).__name__}, not bytes: a store that "
                                "hands back what was set (torch.distributed's do) is needed")
    return [bytes(v) for v in values]
