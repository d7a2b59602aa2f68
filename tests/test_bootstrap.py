"""bootstrap's socket exchange under hostile and broken peers (issue 31): whatever else connects to a
Rendezvous (a connection closed at once, a silent one, garbage, a message announcing gigabytes, a flood of
them, one trickling a byte at a time) is dropped, the honest peer is served, an exchange ends within its
timeout, and every error is a FabriclabError. Real sockets; the honest peers are processes of their own."""
import socket
import subprocess
import sys
import threading
import time

import pytest

from fabriclab import bootstrap, fi

HOST = "127.0.0.1"


def honest_peer(port, payload, timeout=20):
    """A process calling bootstrap.exchange; its stdout is the answer it got (repr) or its error."""
    code = ("import sys; from fabriclab import bootstrap\n"
            f"try: print(repr(bootstrap.exchange({port}, {payload!r}, timeout={timeout})))\n"
            "except Exception as exc: print(type(exc).__name__, exc)")
    return subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)


def connect(port, data=b""):
    sock = socket.create_connection((HOST, port), timeout=5)
    if data:
        sock.sendall(data)
    return sock


def trickle(sock, data, every):
    """Send ``data`` a byte at a time, ``every`` seconds apart, until the other side drops us."""
    for byte in data:
        try:
            sock.send(bytes([byte]))
        except OSError:
            return
        time.sleep(every)


def test_stray_silent_and_garbage_connections_are_dropped_and_the_honest_peer_is_served():
    with bootstrap.Rendezvous(timeout=20) as rendezvous:
        connect(rendezvous.port).close()  # connect-and-close: the ConnectionError
        silent = connect(rendezvous.port)  # the TimeoutError, after the whole timeout
        garbage = connect(rendezvous.port, b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        huge = connect(rendezvous.port, b"FLbs\xff\xff\xff\xff")  # announces 4 GiB
        half = connect(rendezvous.port, b"FLbs\x08\x00\x00\x00abc")
        half.close()  # closes after 3 of 8 bytes
        flood = [connect(rendezvous.port) for _ in range(bootstrap.MAX_PENDING + 8)]
        peer = honest_peer(rendezvous.port, b"honest")
        start = time.monotonic()
        assert rendezvous.exchange(b"mine") == b"honest"
        assert time.monotonic() - start < 15  # not after the silent connections' timeout
        assert peer.communicate(timeout=30)[0].strip() == "b'mine'"
        assert rendezvous.dropped >= 4
        assert len(rendezvous._reading) <= bootstrap.MAX_PENDING  # the flood holds a bounded number of sockets
        for sock in (silent, garbage, huge, *flood):
            sock.close()


def test_an_exchange_ends_within_its_timeout_whatever_connects():
    with bootstrap.Rendezvous(timeout=1) as rendezvous:
        # one byte every 0.8 s of a well-formed message: each byte within a receive's timeout (the issue: 8.2 s)
        sender = connect(rendezvous.port)
        threading.Thread(target=trickle, args=(sender, b"FLbs\x10\x00\x00\x00" + b"p" * 16, 0.8), daemon=True).start()
        silent = connect(rendezvous.port)
        start = time.monotonic()
        with pytest.raises(fi.FabricTimeout, match="did not happen within 1 s"):
            rendezvous.exchange(b"mine")
        assert time.monotonic() - start < 2.5
        sender.close()
        silent.close()


def test_a_message_that_arrives_between_exchanges_is_answered_by_the_next():
    with bootstrap.Rendezvous(timeout=20) as rendezvous:
        peers = [honest_peer(rendezvous.port, f"peer {i}".encode()) for i in range(3)]
        got = sorted(rendezvous.exchange(b"answer %d" % i) for i in range(3))
        assert got == [b"peer 0", b"peer 1", b"peer 2"]
        answers = sorted(peer.communicate(timeout=30)[0].strip() for peer in peers)
        assert answers == ["b'answer 0'", "b'answer 1'", "b'answer 2'"]


class BrokenListener:
    """A listening socket that answers each connection with ``behave(conn)`` on a thread of its own."""

    def __init__(self, behave):
        self.sock = socket.create_server((HOST, 0))
        self.port = self.sock.getsockname()[1]
        self.conns = []
        self.thread = threading.Thread(target=self._serve, args=(behave,), daemon=True)
        self.thread.start()

    def _serve(self, behave):
        conn, _ = self.sock.accept()
        self.conns.append(conn)
        behave(conn)

    def close(self):
        for conn in self.conns:
            conn.close()
        self.sock.close()


@pytest.mark.parametrize("behave, error, message", [
    (lambda conn: conn.close(), bootstrap.BootstrapError, "closed the connection after 0 bytes|broke the connection"),
    (lambda conn: None, fi.FabricTimeout, "did not happen within 1 s"),
    (lambda conn: conn.sendall(b"SSH-2.0-OpenSSH\r\n"), bootstrap.BootstrapError, "not a fabriclab peer"),
    (lambda conn: conn.sendall(b"FLbs\xff\xff\xff\x7f"), bootstrap.BootstrapError, "more than 67108864"),
    (lambda conn: trickle(conn, b"FLbs\x10\x00\x00\x00" + b"p" * 16, 0.8), fi.FabricTimeout, "within 1 s"),
], ids=["closes", "silent", "garbage", "huge", "trickles"])
def test_the_connecting_side_fails_within_its_timeout_with_fabriclab_errors(behave, error, message):
    listener = BrokenListener(behave)
    try:
        start = time.monotonic()
        with pytest.raises(error, match=message):
            bootstrap.exchange(listener.port, b"mine", timeout=1)
        assert time.monotonic() - start < 2.5
    finally:
        listener.close()


def test_nothing_listening_and_a_port_in_use_are_fabriclab_errors():
    with bootstrap.Rendezvous() as rendezvous:
        port = rendezvous.port
        with pytest.raises(bootstrap.BootstrapError, match=f"cannot listen on 127.0.0.1:{port}"):
            bootstrap.Rendezvous(port=port)
    with pytest.raises(bootstrap.BootstrapError, match=f"cannot connect to the bootstrap socket at 127.0.0.1:{port}"):
        bootstrap.exchange(port, b"mine", timeout=1)
    with pytest.raises(fi.UsageError, match="at most 67108864 bytes"):
        bootstrap.exchange(port, bytes(bootstrap.MAX_MESSAGE + 1))
