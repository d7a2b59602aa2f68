"""A small, optional way to swap bytes (engine addresses, region descriptors) between two processes
over a TCP socket — for demos and tests. The engine itself never needs it: send those bytes any way
you like (your RPC, a file, a key-value store).

    # process A                                   # process B
    with Rendezvous() as r:                       peer_bytes = exchange(port, my_bytes)
        print(r.port)                             
        peer_bytes = r.exchange(my_bytes)

Binds to 127.0.0.1 unless told otherwise; every wait has a timeout. Where a deployment already has a
torch.distributed store or an MPI communicator, ``allgather`` swaps the same bytes through it. Payloads are
bytes-like (bytes, bytearray, memoryview, a numpy array); anything else (text, a number, None) is a
UsageError, as are a rank or port that is no integer and a timeout that is not a finite positive number.
"""
from __future__ import annotations

import socket
import struct

from typing import Any, Literal

from . import fi

_LENGTH = struct.Struct("<I")
MAX_MESSAGE = 64 << 20


def _bytes(value: object, what: str) -> bytes:
    """A bytes-like ``value`` as bytes; UsageError for anything else (bytes() would turn 3 into three zero
    bytes, and a str into a TypeError)."""
    try:
        return bytes(memoryview(value))  # type: ignore[arg-type]  # TypeError says it is no buffer
    except TypeError:
        hint = ": encode text first (.encode())" if isinstance(value, str) else ""
        raise fi.UsageError(f"{what} must be bytes (bytes, bytearray, memoryview), got {type(value).__name__}"
                            f"{hint}") from None


def _send(sock: socket.socket, payload: bytes) -> None:
    sock.sendall(_LENGTH.pack(len(payload)) + payload)


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    chunks, got = [], 0
    while got < n:
        chunk = sock.recv(min(n - got, 1 << 20))
        if not chunk:
            raise ConnectionError(f"the other side closed the connection after {got} of {n} bytes")
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


def _recv(sock: socket.socket) -> bytes:
    (size,) = _LENGTH.unpack(_recv_exact(sock, _LENGTH.size))
    if size > MAX_MESSAGE:
        raise fi.UsageError(f"bootstrap message of {size} bytes is larger than {MAX_MESSAGE}: not a fabriclab peer?")
    return _recv_exact(sock, size)


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
    """The listening side: ``exchange(payload)`` waits for one peer, receives its bytes, sends ours."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0, timeout: float = 30.0) -> None:
        self.timeout = fi.seconds(timeout, "timeout")
        self._listener = socket.create_server((host, fi.integer(port, "port", 0, 65535)))
        self._listener.settimeout(timeout)
        self.host, self.port = self._listener.getsockname()[:2]

    def exchange(self, payload: bytes) -> bytes:
        """Wait for the next peer (``fi.FabricTimeout`` after ``timeout`` seconds), receive its bytes, send it
        ``payload``; returns its bytes."""
        payload = _bytes(payload, "payload")
        try:
            conn, _ = self._listener.accept()
        except socket.timeout:
            raise fi.FabricTimeout("a peer connecting to the bootstrap socket", self.timeout) from None
        with conn:
            conn.settimeout(self.timeout)
            theirs = _recv(conn)
            _send(conn, payload)
            return theirs

    def close(self) -> None:
        """Stop listening."""
        self._listener.close()

    def __enter__(self) -> Rendezvous:
        return self

    def __exit__(self, *exc: object) -> Literal[False]:
        self.close()
        return False


def exchange(port: int, payload: bytes, host: str = "127.0.0.1", timeout: float = 30.0) -> bytes:
    """The connecting side: send our bytes to a Rendezvous, return theirs."""
    payload, port = _bytes(payload, "payload"), fi.integer(port, "port", 1, 65535)
    timeout = fi.seconds(timeout, "timeout")
    with socket.create_connection((host, port), timeout=timeout) as sock:
        sock.settimeout(timeout)
        _send(sock, payload)
        return _recv(sock)


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
