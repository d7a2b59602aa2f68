"""Chapter 4 — unidirectional send/recv.

The server opens an endpoint, registers a receive buffer, posts ``fi_recv`` into it and prints its
address. The client inserts that address into its address vector and posts one ``fi_send``. Neither side
blocks in libfabric: both post work and then poll their completion queue until the operation they posted
shows up there.

    python -m fabriclab.unidirectional serve
    python -m fabriclab.unidirectional connect <address> --message "hello"
"""
from __future__ import annotations

import contextlib
import hashlib
import math
import time

import numpy as np

from . import cli, fi

DEFAULT_MAX_MESSAGE = 16 << 20


def open_endpoint(provider: str | None = None, domain: str | None = None) -> fi.EndpointStack:
    """Fabric, domain, completion queue, address vector and an enabled endpoint on one NIC."""
    return fi.open_endpoint(provider, domain)


def check_size(size: int, what: str = "message") -> int:
    if not isinstance(size, (int, np.integer)) or size <= 0:
        raise fi.UsageError(f"{what} size must be a positive number of bytes, got {size!r}")
    return int(size)


def summarize(message) -> str:
    """One log line for a message: its size and a digest (so a test can check it byte for byte)."""
    data = memoryview(message).cast("B")
    preview = bytes(data[:32])
    text = preview.decode() if all(32 <= b < 127 for b in preview) else preview.hex()
    return f"received {len(data)} bytes sha256={hashlib.sha256(data).hexdigest()} first={text!r}"


class Receiver:
    """The receiving side: a registered buffer with a receive posted into it."""

    def __init__(self, stack: fi.EndpointStack, max_message: int = DEFAULT_MAX_MESSAGE):
        self.stack = stack
        self.max_message = check_size(max_message, "receive buffer")
        self.buffer = np.empty(self.max_message, dtype=np.uint8)
        self.mr = stack.register(self.buffer)
        self._posted = False

    @property
    def address(self) -> fi.Address:
        """This endpoint's address, advertising the largest message it can take."""
        return self.stack.ep.address(self.max_message)

    def receive(self, stop=None, timeout: float = math.inf) -> memoryview | None:
        """Wait for the next message; None if ``stop`` was set first. The view is valid until the next call."""
        if not self._posted:
            self.stack.ep.post_recv(self.mr, 0, self.max_message, token="recv")
            self._posted = True
        arrived: list[fi.Completion] = []
        self.stack.cq.wait(lambda: bool(arrived) or (stop is not None and stop.is_set()), timeout,
                           "a message from the client", arrived.append)
        if not arrived:
            return None
        self._posted = False
        return memoryview(self.buffer)[:arrived[0].length]


class ServerSilent(fi.FabricTimeout):
    """The server did not answer at its address within the deadline: most likely it is gone, and a server
    started again listens at a new address."""

    def __init__(self, server: fi.Address, timeout: float):
        # Its own sentence rather than FabricTimeout's "<what> did not happen within": what the provider kept
        # answering (-FI_EAGAIN over shm and tcp alike) says nothing to someone who gave a stale address.
        fi.FabricError.__init__(self, "connect", fi.lib.FI_ETIMEDOUT, message=(
            f"no answer from the server at {server.describe()} within {timeout:g} s: the server is probably gone; "
            "restart it and connect to the new address it prints"))
        self.timeout = timeout


class EndpointUser:
    """Something built on an endpoint stack it was given: ``close()`` gives back what it made, and leaving a
    ``with`` block closes it, then the stack (its one user)."""
    stack: fi.EndpointStack

    def close(self) -> None:
        raise NotImplementedError

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        try:
            self.close()
        finally:
            self.stack.close()
        return False


class Sender(EndpointUser):
    """The sending side: one server, known by the address it printed."""

    def __init__(self, stack: fi.EndpointStack, server_address, timeout: float = fi.DEFAULT_TIMEOUT):
        self.stack = stack
        self.timeout = timeout
        self.server = fi.Address.parse(server_address)
        self.server.check_compatible(stack.info)
        self.server_addr = stack.av.insert(self.server)
        self._buffer = np.empty(0, dtype=np.uint8)
        self._mr: fi.MemoryRegion | None = None

    @contextlib.contextmanager
    def server_must_answer(self):
        """Waits on the server inside this block that run out of time raise ServerSilent, which names the
        likely cause (the server is gone) and the fix."""
        try:
            yield
        except ServerSilent:
            raise
        except fi.FabricTimeout as exc:
            raise ServerSilent(self.server, self.timeout) from exc

    def _staging(self, size: int) -> np.ndarray:
        """A registered send buffer of at least ``size`` bytes, grown (re-registered) when too small."""
        if self._buffer.size < size:
            if self._mr is not None:
                self._mr.close()
            self._buffer = np.empty(size, dtype=np.uint8)
            self._mr = self.stack.register(self._buffer)
        return self._buffer[:size]

    def check_message(self, size: int) -> int:
        size = check_size(size)
        if size > self.stack.info.max_msg_size:
            raise fi.UsageError(f"message of {size} bytes exceeds provider {self.stack.info.provider}'s maximum "
                                f"of {self.stack.info.max_msg_size} bytes")
        if self.server.max_message and size > self.server.max_message:
            raise fi.UsageError(f"message of {size} bytes is larger than the server's {self.server.max_message}-byte "
                                "receive buffer (start the server with a larger --max-message)")
        return size

    def send(self, message) -> float:
        """Send one message and wait for its completion; returns the seconds it took."""
        data = np.frombuffer(memoryview(message).cast("B"), dtype=np.uint8) if not isinstance(message, np.ndarray) \
            else message.view(np.uint8).reshape(-1)
        size = self.check_message(data.size)
        self._staging(size)[:] = data
        start = time.perf_counter()
        done: list[fi.Completion] = []
        with self.server_must_answer():
            self.stack.ep.post_send(self._mr, 0, size, self.server_addr, token="send", timeout=self.timeout)
            self.stack.cq.wait(lambda: bool(done), self.timeout, "the send's completion", done.append)
        return time.perf_counter() - start

    def close(self) -> None:
        """Deregister what this sender registered; the endpoint stack it was given stays open."""
        if self._mr is not None:
            self._mr.close()
            self._mr = None


def serve(args, stop: cli.StopSignal) -> int:
    with open_endpoint(args.provider, args.domain) as stack:
        receiver = Receiver(stack, args.max_message)
        print(receiver.address.hex(), flush=True)
        print(f"serving on {stack.info.provider} domain {stack.info.domain}: {receiver.address.describe()}",
              flush=True)
        while True:
            message = receiver.receive(stop)
            if message is None:
                break
            print(summarize(message), flush=True)
    return 0


def connect(args) -> int:
    payload = args.message.encode() if args.message is not None else np.random.default_rng().integers(
        0, 256, size=args.size, dtype=np.uint8)
    with open_endpoint(args.provider, args.domain) as stack, Sender(stack, args.address, args.timeout) as sender:
        elapsed = sender.send(payload)
        print(f"sent {len(memoryview(payload).cast('B'))} bytes in {elapsed * 1e6:.1f} us "
              f"sha256={hashlib.sha256(payload).hexdigest()}")
    return 0


def build_parser():
    parser, serve_p, connect_p = cli.stage_parser(__doc__.splitlines()[0])
    serve_p.add_argument("--max-message", type=cli.positive_size, default=DEFAULT_MAX_MESSAGE,
                         help="receive buffer size in bytes (default 16M)")
    what = connect_p.add_mutually_exclusive_group()
    what.add_argument("--message", help="text to send")
    what.add_argument("--size", type=cli.positive_size, default=64, help="send this many random bytes")
    return parser


def main(argv=None) -> int:
    return cli.stage_main(build_parser(), serve, connect, argv)


if __name__ == "__main__":
    cli.run(main)
