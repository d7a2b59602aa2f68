"""A small, optional way to swap bytes (engine addresses, region descriptors) between two processes
over a TCP socket — for demos and tests. The engine itself never needs it: send those bytes any way
you like (your RPC, a file, a key-value store).

    # process A                                   # process B
    with Rendezvous() as r:                       peer_bytes = exchange(port, my_bytes)
        print(r.port)                             
        peer_bytes = r.exchange(my_bytes)

Binds to 127.0.0.1 unless told otherwise; every wait has a timeout.
"""
from __future__ import annotations

import socket
import struct

from . import fi

_LENGTH = struct.Struct("<I")
MAX_MESSAGE = 64 << 20


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
    return b"".join(_LENGTH.pack(len(p)) + bytes(p) for p in parts)


def unpack(data: bytes) -> list[bytes]:
    """The byte strings ``pack`` put together."""
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

    def __init__(self, host: str = "127.0.0.1", port: int = 0, timeout: float = 30.0):
        self.timeout = timeout
        self._listener = socket.create_server((host, port))
        self._listener.settimeout(timeout)
        self.host, self.port = self._listener.getsockname()[:2]

    def exchange(self, payload: bytes) -> bytes:
        """Wait for the next peer (``fi.FabricTimeout`` after ``timeout`` seconds), receive its bytes, send it
        ``payload``; returns its bytes."""
        try:
            conn, _ = self._listener.accept()
        except socket.timeout:
            raise fi.FabricTimeout("a peer connecting to the bootstrap socket", self.timeout) from None
        with conn:
            conn.settimeout(self.timeout)
            theirs = _recv(conn)
            _send(conn, bytes(payload))
            return theirs

    def close(self) -> None:
        """Stop listening."""
        self._listener.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False


def exchange(port: int, payload: bytes, host: str = "127.0.0.1", timeout: float = 30.0) -> bytes:
    """The connecting side: send our bytes to a Rendezvous, return theirs."""
    with socket.create_connection((host, port), timeout=timeout) as sock:
        sock.settimeout(timeout)
        _send(sock, bytes(payload))
        return _recv(sock)
