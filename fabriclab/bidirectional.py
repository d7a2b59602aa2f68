"""Chapter 5 — bidirectional send/recv.

Chapter 4's server could only listen: it never learned who sent a message. Here the client's first
message carries the client's own address, so the server can insert it into its address vector and answer.
Both sides keep several receives posted (one per slot of a "mailbox") so several requests can be in flight
at once, and every message starts with a small header saying what it is.

    python -m fabriclab.bidirectional serve
    python -m fabriclab.bidirectional connect <address> --count 100 --size 64K
"""
from __future__ import annotations

import collections
import hashlib
import itertools
import math
import struct
import time
from dataclasses import dataclass

import numpy as np

from . import cli, fi
from .unidirectional import DEFAULT_MAX_MESSAGE, Sender, check_size, open_endpoint

HEADER = struct.Struct("<IIQQ")  # kind, client id, sequence number, payload length
HELLO, WELCOME, REQUEST, REPLY, BYE = range(1, 6)
KIND_NAMES = {HELLO: "HELLO", WELCOME: "WELCOME", REQUEST: "REQUEST", REPLY: "REPLY", BYE: "BYE"}
DEFAULT_SLOTS = 8


@dataclass
class Message:
    kind: int
    client: int
    seq: int
    payload: memoryview  # valid until the mailbox is polled again


class Mailbox:
    """``slots`` receive buffers kept posted and ``slots`` send buffers, each a header plus
    ``max_payload`` bytes, registered once. Messages in both directions go through it."""

    def __init__(self, stack: fi.EndpointStack, slots: int, max_payload: int, timeout: float = fi.DEFAULT_TIMEOUT):
        if slots <= 0:
            raise fi.UsageError(f"messages in flight must be at least 1, got {slots}")
        self.stack = stack
        self.timeout = timeout
        self.max_payload = check_size(max_payload, "maximum payload")
        self.slot_size = HEADER.size + self.max_payload
        # zeros, not empty: touching every page now keeps first-use page faults out of the first messages
        self.inbox = np.zeros((slots, self.slot_size), dtype=np.uint8)
        self.outbox = np.zeros((slots, self.slot_size), dtype=np.uint8)
        self.inbox_mr = stack.register(self.inbox)
        self.outbox_mr = stack.register(self.outbox)
        self.free_outbox = list(range(slots))
        self._arrived: collections.deque[tuple[int, int]] = collections.deque()  # (slot, length)
        self._to_repost: list[int] = []
        # Completions are routed by the first element of their token; later stages add their own kinds
        # (their writes, and None for a peer's RDMA write that carries immediate data).
        self.handlers = {"in": self._received, "out": self._sent}
        for slot in range(slots):
            self._post_receive(slot)

    def _post_receive(self, slot: int) -> None:
        self.stack.ep.post_recv(self.inbox_mr, slot * self.slot_size, self.slot_size, ("in", slot))

    def _on_completion(self, c: fi.Completion) -> None:
        kind = c.token[0] if isinstance(c.token, tuple) else c.token
        handler = self.handlers.get(kind)
        if handler is None:
            raise fi.UsageError(f"completion for an operation nobody handles: {c.token!r}")
        handler(c)

    def _sent(self, c: fi.Completion) -> None:
        self.free_outbox.append(c.token[1])

    def _received(self, c: fi.Completion) -> None:
        self._arrived.append((c.token[1], c.length))

    def _pump(self) -> bool:
        got = self.stack.cq.poll()
        for c in got:
            self._on_completion(c)
        return bool(got)

    def send(self, dest: int, kind: int, client: int, seq: int, payload=b"") -> None:
        """Copy header and payload into a free send slot and post it (waiting for a slot if all are busy)."""
        data = np.frombuffer(memoryview(payload).cast("B"), dtype=np.uint8)
        if data.size > self.max_payload:
            raise fi.UsageError(f"payload of {data.size} bytes exceeds the {self.max_payload}-byte slots")
        if not self.free_outbox:
            self.stack.cq.wait(lambda: bool(self.free_outbox), self.timeout, "a free send slot",
                               self._on_completion, hint="the peer stopped taking messages")
        slot = self.free_outbox.pop()
        row = self.outbox[slot]
        row[:HEADER.size] = np.frombuffer(HEADER.pack(kind, client, seq, data.size), dtype=np.uint8)
        row[HEADER.size:HEADER.size + data.size] = data
        self.stack.ep.post_send(self.outbox_mr, slot * self.slot_size, HEADER.size + data.size, dest, ("out", slot),
                                timeout=self.timeout)

    def try_send(self, dest: int, kind: int, client: int, seq: int, payload=b"") -> bool:
        """Send now if a send slot is free once finished sends are reaped; False (nothing sent) if none
        is: for word that may be skipped, from a thread that must not wait."""
        if not self.free_outbox:
            self._pump()
        if not self.free_outbox:
            return False
        self.send(dest, kind, client, seq, payload)
        return True

    def receive(self, stop=None, timeout: float | None = None) -> list[Message]:
        """Messages that have arrived, waiting up to ``timeout`` for at least one (an empty list when
        ``stop`` was set first)."""
        for slot in self._to_repost:
            self._post_receive(slot)
        self._to_repost.clear()
        if not self._arrived:
            self._pump()
        if not self._arrived:
            self.stack.cq.wait(lambda: bool(self._arrived) or (stop is not None and stop.is_set()),
                               self.timeout if timeout is None else timeout, "a message from the peer",
                               self._on_completion, hint="is the peer still running?")
        out = []
        while self._arrived:
            slot, length = self._arrived.popleft()
            if length < HEADER.size:
                raise fi.UsageError(f"received a {length}-byte message, shorter than the {HEADER.size}-byte header")
            kind, client, seq, size = HEADER.unpack_from(self.inbox[slot])
            out.append(Message(kind, client, seq, memoryview(self.inbox[slot])[HEADER.size:HEADER.size + size]))
            self._to_repost.append(slot)
        return out

    def drain_sends(self) -> None:
        """Wait until every posted send has completed."""
        total = self.outbox.shape[0]
        self.stack.cq.wait(lambda: len(self.free_outbox) == total, self.timeout, "the last sends' completions",
                           self._on_completion)


class Client(Sender):
    """Chapter 4's sender, now also able to hear back: it introduces itself, then sends requests and
    collects the server's replies, up to ``in_flight`` at a time."""

    def __init__(self, stack: fi.EndpointStack, server_address, timeout: float = fi.DEFAULT_TIMEOUT,
                 in_flight: int = DEFAULT_SLOTS):
        super().__init__(stack, server_address, timeout)
        self.mailbox = Mailbox(stack, in_flight, self.server.max_message - HEADER.size
                               if self.server.max_message else DEFAULT_MAX_MESSAGE, timeout)
        self.max_payload = self.mailbox.max_payload
        with self.server_must_answer():  # the first contact: a stale address shows here
            self.mailbox.send(self.server_addr, HELLO, 0, 0, stack.ep.address().to_bytes())
            welcome = self._next(lambda m: m.kind == WELCOME)
        self.client_id = welcome.client
        self._seq = itertools.count(1)

    def _next(self, wanted) -> Message:
        while True:
            for m in self.mailbox.receive():
                if wanted(m):
                    return m

    def exchange(self, payloads) -> list[bytes]:
        """Send every payload as a request, keeping up to ``in_flight`` outstanding; return the replies in
        request order."""
        payloads = list(payloads)
        for p in payloads:
            self.check_payload(len(memoryview(p).cast("B")))
        first = next(self._seq)
        for _ in range(len(payloads) - 1):
            next(self._seq)
        replies: dict[int, bytes] = {}
        window = self.mailbox.inbox.shape[0]
        sent = 0
        while len(replies) < len(payloads):
            while sent < len(payloads) and sent - len(replies) < window:
                self.mailbox.send(self.server_addr, REQUEST, self.client_id, first + sent, payloads[sent])
                sent += 1
            for m in self.mailbox.receive():
                if m.kind == REPLY and first <= m.seq < first + len(payloads):
                    replies[m.seq - first] = bytes(m.payload)
        return [replies[i] for i in range(len(payloads))]

    def request(self, payload) -> bytes:
        return self.exchange([payload])[0]

    def check_payload(self, size: int) -> int:
        size = self.check_message(size + HEADER.size) - HEADER.size
        if size > self.max_payload:
            raise fi.UsageError(f"payload of {size} bytes exceeds the {self.max_payload}-byte limit")
        return size

    def close(self) -> None:
        """Say goodbye so the server forgets this client's address. Best effort: a server that is gone
        cannot take it (the wait is bounded by the timeout), and closing must still free this side."""
        try:
            if not self.stack.closed:
                self.mailbox.send(self.server_addr, BYE, self.client_id, 0)
                self.mailbox.drain_sends()
        except fi.FabricError:
            pass
        finally:
            super().close()


def serve(args, stop: cli.StopSignal) -> int:
    with open_endpoint(args.provider, args.domain) as stack:
        mailbox = Mailbox(stack, args.slots, args.max_message, args.timeout)
        print(stack.ep.address(HEADER.size + args.max_message).hex(), flush=True)
        print(f"serving on {stack.info.provider} domain {stack.info.domain}: {stack.ep.address().describe()}",
              flush=True)
        clients: dict[int, int] = {}
        next_id = itertools.count(1)
        while not stop.is_set():
            for m in mailbox.receive(stop, timeout=math.inf):
                if m.kind == HELLO:
                    peer = fi.Address.from_bytes(bytes(m.payload))
                    client = next(next_id)
                    clients[client] = stack.av.insert(peer)
                    mailbox.send(clients[client], WELCOME, client, m.seq)
                    print(f"client {client} joined from {peer.describe()}", flush=True)
                elif m.kind == REQUEST and m.client in clients:
                    mailbox.send(clients[m.client], REPLY, m.client, m.seq, m.payload)
                elif m.kind == BYE and m.client in clients:
                    stack.av.remove(clients.pop(m.client))
                    print(f"client {m.client} left", flush=True)
                else:
                    print(f"ignored {KIND_NAMES.get(m.kind, m.kind)} from unknown client {m.client}", flush=True)
    return 0


def connect(args) -> int:
    rng = np.random.default_rng()
    payloads = [rng.integers(0, 256, size=args.size, dtype=np.uint8) for _ in range(args.count)]
    with open_endpoint(args.provider, args.domain) as stack, \
            Client(stack, args.address, args.timeout, args.in_flight) as client:
        start = time.perf_counter()
        replies = client.exchange(payloads)
        elapsed = time.perf_counter() - start
    intact = all(r == p.tobytes() for r, p in zip(replies, payloads))
    digest = hashlib.sha256(b"".join(replies)).hexdigest()[:16]
    print(f"{len(replies)} round trips of {args.size} bytes in {elapsed * 1e3:.2f} ms "
          f"({elapsed / len(replies) * 1e6:.1f} us each), replies intact: {intact}, sha256 {digest}")
    return 0 if intact else 1


def build_parser():
    parser, serve_p, connect_p = cli.stage_parser(__doc__.splitlines()[0])
    serve_p.add_argument("--max-message", type=cli.positive_size, default=1 << 20,
                         help="largest request payload in bytes (default 1M)")
    serve_p.add_argument("--slots", type=int, default=DEFAULT_SLOTS, help="receives kept posted (default 8)")
    connect_p.add_argument("--count", type=int, default=16, help="requests to send (default 16)")
    connect_p.add_argument("--size", type=cli.positive_size, default=64, help="bytes per request (default 64)")
    connect_p.add_argument("--in-flight", type=int, default=DEFAULT_SLOTS, help="requests in flight (default 8)")
    return parser


def main(argv=None) -> int:
    return cli.stage_main(build_parser(), serve, connect, argv)


if __name__ == "__main__":
    cli.run(main)
