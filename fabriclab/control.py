"""The control channel of staged targets (``fabriclab.landing``): its messages, read and checked, and the
endpoint that carries them.

Every message is untrusted input, whoever claims to send it. :func:`read` checks what a message can say
about itself (its kind, its length against its counts, each field's range, as unsigned) and raises
:class:`BadMessage` naming the problem; the landing thread then checks it against what its sender was
granted. A message that fails is dropped on its own (the others read with it are served) and counted in
:class:`Rejected`, which logs the first from each sender and then every tenfold count, never a line per
message. Messages:

    REQUEST  writer -> target   lanes wanted for a transfer, the region's key (from its descriptor), and
                                the writer's control address
    GRANT    target -> writer   these lanes are yours
    FILLED   writer -> target   lane L holds these pages (in order), for these offsets, counted under imm
    RELEASE  writer -> target   lane L is yours again, unfilled (the transfer failed or ended early)
    COPIED   target -> writer   lane L's pages are in place and counted
    REFUSED  target -> writer   the transfer cannot land (region closed, CUDA failed, ...): why
    ALIVE    writer -> target   these transfers of mine still run (every HEARTBEAT_S, while they do)

A message's head names its sender's engine id and the writer's job: a random 64-bit number, so that no one
but the writer and its target can speak for a transfer.
"""
from __future__ import annotations

import collections
import logging
import os
import struct
import threading
import time

import numpy as np

from . import _native, fi

MESSAGE_BYTES = 64 << 10   # the largest control message (a FILLED names up to ~5000 pages)
RECEIVES = 64              # control messages that can wait to be read
SENDS = 64                 # control messages that can be on their way at once
NO_LANE = 0xFFFF
TEXT_CHARS = 400           # of a REFUSED's reason, at most (it ends up in the writer's exception)

REQUEST, GRANT, FILLED, RELEASE, COPIED, REFUSED, ALIVE = range(1, 8)
HEAD = struct.Struct("<BQQ")           # kind, sender's engine id, the writer's job
REQUEST_BODY = struct.Struct("<IQIH")  # region id, region key, lanes wanted, control address length (address follows)
FILLED_BODY = struct.Struct("<IHII")   # region id, lane, imm, pages (entries follow)
PAGE_ENTRY = struct.Struct("<QI")      # FILLED: a page's destination offset in the region and its length
PAGE_ENTRIES = np.dtype([("dst", "<u8"), ("length", "<u4")])
FILLED_HEAD = HEAD.size + FILLED_BODY.size
LANE = struct.Struct("<H")
REFUSED_BODY = struct.Struct("<HB")    # lane (NO_LANE: the whole transfer), why (index in WHY; text follows)
JOB = struct.Struct("<Q")              # ALIVE: the writer's jobs, one after another
ALIVE_JOBS = 512                       # jobs one ALIVE names at most (4 KiB: fits any provider's messages)
WHY = ("closed", "cuda", "timeout", "invalid")  # staging.FAILURES' names (and "invalid": a message refused)

log = logging.getLogger("fabriclab")


class BadMessage(fi.FabriclabError):
    """A control message that is malformed, or asks what its sender was not granted: it is dropped."""


# ----------------------------------------------------------------------------------- reading


def read(message: bytes) -> tuple[int, int, int, tuple]:
    """(kind, sender's engine id, job, the kind's fields) of a control message, its shape checked."""
    if len(message) < HEAD.size:
        raise BadMessage(f"{len(message)} bytes, shorter than any control message ({HEAD.size})")
    kind, sender, job = HEAD.unpack_from(message)
    reader = _READERS.get(kind)
    if reader is None:
        raise BadMessage(f"unknown kind {kind}")
    if not sender & 1 or sender >> 63:
        raise BadMessage(f"sender {sender:#x} is not an engine id")
    if (job == 0) != (kind == ALIVE):
        raise BadMessage(f"job number {job} with kind {kind}")
    return kind, sender, job, reader(message[HEAD.size:])


def _request(body: bytes) -> tuple:
    if len(body) < REQUEST_BODY.size:
        raise BadMessage(f"REQUEST of {len(body)} bytes is truncated")
    region_id, key, wanted, size = REQUEST_BODY.unpack_from(body)
    if size == 0 or len(body) != REQUEST_BODY.size + size:
        raise BadMessage(f"REQUEST says its address has {size} bytes, but {len(body) - REQUEST_BODY.size} follow")
    if wanted == 0:
        raise BadMessage("REQUEST for no lanes")
    return region_id, key, wanted, body[REQUEST_BODY.size:]


def _grant(body: bytes) -> tuple:
    if not body or len(body) % LANE.size:
        raise BadMessage(f"GRANT of {len(body)} bytes is not a list of lanes")
    lanes = [int(lane) for lane in np.frombuffer(body, "<u2")]
    if len(set(lanes)) != len(lanes):
        raise BadMessage("GRANT names a lane twice")
    return (lanes,)


def _filled(body: bytes) -> tuple:
    if len(body) < FILLED_BODY.size:
        raise BadMessage(f"FILLED of {len(body)} bytes is truncated")
    region_id, lane, imm, pages = FILLED_BODY.unpack_from(body)
    if pages == 0:
        raise BadMessage("FILLED names no page")
    if len(body) != FILLED_BODY.size + pages * PAGE_ENTRY.size:
        raise BadMessage(f"FILLED says it names {pages} pages, but {len(body) - FILLED_BODY.size} bytes of "
                         f"{PAGE_ENTRY.size}-byte entries follow")
    if imm > _native.MAX_IMM and imm != _native.NO_IMM:
        raise BadMessage(f"FILLED's immediate data {imm:#x} is none a caller can give")
    entries = np.frombuffer(body, PAGE_ENTRIES, pages, FILLED_BODY.size).copy()
    if not entries["length"].all():
        raise BadMessage("FILLED names a page of 0 bytes")
    return region_id, lane, imm, entries


def _lane(body: bytes) -> tuple:
    if len(body) != LANE.size:
        raise BadMessage(f"a lane's message of {len(body)} bytes, not {LANE.size}")
    return LANE.unpack(body)


def _refused(body: bytes) -> tuple:
    if len(body) < REFUSED_BODY.size:
        raise BadMessage(f"REFUSED of {len(body)} bytes is truncated")
    lane, why = REFUSED_BODY.unpack_from(body)
    if why >= len(WHY):
        raise BadMessage(f"REFUSED for unknown reason {why}")
    return lane, WHY[why], body[REFUSED_BODY.size:].decode(errors="replace")[:TEXT_CHARS]


def _alive(body: bytes) -> tuple:
    if not body or len(body) % JOB.size:
        raise BadMessage(f"ALIVE of {len(body)} bytes is not a list of jobs")
    return ([int(job) for job in np.frombuffer(body, "<u8")],)


def alive(sender: int, jobs: list[int]) -> list[bytes]:
    """The ALIVE messages naming ``jobs``."""
    return [HEAD.pack(ALIVE, sender, 0) + np.asarray(jobs[first:first + ALIVE_JOBS], "<u8").tobytes()
            for first in range(0, len(jobs), ALIVE_JOBS)]


_READERS = {REQUEST: _request, GRANT: _grant, FILLED: _filled, RELEASE: _lane, COPIED: _lane, REFUSED: _refused,
            ALIVE: _alive}


class Rejected:
    """Control messages dropped, counted per sender: the first from each is logged, then the 10th, 100th...
    with the count, so a flood of them is a few lines. Senders the landing thread has no business with
    share one count (a forger can claim any id)."""

    SENDERS = 256  # senders counted apart at most

    def __init__(self):
        self.total = 0
        self.by_sender: dict[str, int] = {}

    def note(self, sender: str, problem: str) -> None:
        self.total += 1
        if sender not in self.by_sender and len(self.by_sender) >= self.SENDERS:
            sender = "other senders"
        count = self.by_sender[sender] = self.by_sender.get(sender, 0) + 1
        if str(count).rstrip("0") == "1":
            log.warning("dropped a control message from %s: %s (%d so far from there; stats()['staging']"
                        "['bad_control_messages'] counts them all, and this log again at each tenfold count)",
                        sender, problem, count)


# ---------------------------------------------------------------------------------- the channel


class ControlChannel:
    """One endpoint for small messages, beside the engine's NICs (own fabric and domain, of the provider
    and domain of the engine's first NIC, as fi_getinfo offers them), read by one thread (``progress``).

    Messages wait per destination: one that takes nothing (a peer gone, whose provider keeps answering
    EAGAIN) holds up no other, and is reported failed once it took nothing for ``unreachable_s``. Where the
    provider is FI_THREAD_SAFE a sender thread of the channel's own posts them, so that a send that never
    returns (shm spins for ever on a lock its killed peer held) stops no one else: after WEDGED_S its
    destination is reported failed, the thread is left to the provider at idle priority, a fresh one
    takes over, and the endpoint is never closed (the stuck call still uses it)."""

    WEDGED_S = 2.0

    def __init__(self, provider: str, domain: str | None, unreachable_s: float = 30.0):
        self.stack = fi.EndpointStack(fi.getinfo(provider, domain)[0])
        try:
            self.message_bytes = min(MESSAGE_BYTES, self.stack.info.max_msg_size)
            self.received = np.zeros(RECEIVES * self.message_bytes, np.uint8)
            self.sending = np.zeros(SENDS * self.message_bytes, np.uint8)
            self.received_mr = self.stack.register(self.received)
            self.sending_mr = self.stack.register(self.sending)
            for slot in range(RECEIVES):
                self._repost(slot)
        except BaseException:
            self.stack.close()
            raise
        self.address = self.stack.ep.address().to_bytes()
        self.unreachable_s = unreachable_s
        self.free_sends = collections.deque(range(SENDS))
        self.lock = threading.Lock()  # outbox, stuck and failed: the sender thread's too
        self.outbox: dict[int, collections.deque[bytes]] = {}
        self.stuck: dict[int, float] = {}  # destination -> since when it takes nothing
        self.failed: list[int] = []        # destinations found unreachable by the sender
        self.known: dict[bytes, int] = {}
        self.calling: tuple[int, int, float] | None = None  # (generation, destination, since) in a send call
        self.generation = 0                            # a sender thread serves while it is current
        self.stranded: list[threading.Thread] = []
        self.wake = threading.Event()
        self.sender = None
        if self.stack.info.threading == fi.lib.FI_THREAD_SAFE:
            self._start_sender()

    @property
    def can_send(self) -> bool:
        """Whether messages wait for a destination that still takes them (the reader has work to poll)."""
        with self.lock:
            return any(dest not in self.stuck for dest in self.outbox)

    def peer(self, address: bytes) -> int:
        """The fi_addr of a peer's control endpoint (inserted once)."""
        dest = self.known.get(address)
        if dest is None:
            dest = self.known[address] = self.stack.av.insert(fi.Address.from_bytes(address))
        return dest

    def send(self, dest: int, message: bytes) -> None:
        if len(message) > self.message_bytes:
            raise fi.UsageError(f"control message of {len(message)} bytes exceeds {self.message_bytes}")
        with self.lock:
            self.outbox.setdefault(dest, collections.deque()).append(message)
        self.wake.set()

    def forget(self, dest: int) -> None:
        """Drop what waits to go to ``dest`` (a peer found gone)."""
        with self.lock:
            self._forget(dest)

    def _forget(self, dest: int) -> None:
        self.outbox.pop(dest, None)
        self.stuck.pop(dest, None)

    def progress(self) -> tuple[list[bytes], list[int]]:
        """Read what arrived (and post what waits, where no sender thread does): (messages received,
        peers found unreachable)."""
        if self.sender is None:
            self._post(self.generation)
        else:
            self._watch()
        received, failed = [], []
        while True:
            try:
                completions = self.stack.cq.poll()
            except fi.FabricError as exc:
                token = exc.token
                if token and token[0] == "send":
                    self._sent(token[1])
                    failed.append(token[2])
                elif token and token[0] == "recv":
                    self._repost(token[1])
                continue
            if not completions:
                break
            for c in completions:
                if c.token and c.token[0] == "recv":
                    offset = c.token[1] * self.message_bytes
                    received.append(self.received[offset:offset + c.length].tobytes())
                    self._repost(c.token[1])
                elif c.token and c.token[0] == "send":
                    self._sent(c.token[1])
        with self.lock:
            failed += self.failed
            self.failed = []
        for dest in failed:
            self.forget(dest)
        return received, failed

    def _sent(self, slot: int) -> None:
        self.free_sends.append(slot)
        self.wake.set()

    def _post(self, generation: int) -> bool:
        """Post what waits while send slots are free, a destination after another; whether any went."""
        went = False
        with self.lock:
            dests = list(self.outbox)
        for dest in dests:
            while True:
                with self.lock:
                    queue = self.outbox.get(dest)
                    if not queue or not self.free_sends or generation != self.generation:
                        break
                    message, slot = queue[0], self.free_sends.popleft()
                offset = slot * self.message_bytes
                self.sending[offset:offset + len(message)] = np.frombuffer(message, np.uint8)
                self.calling = (generation, dest, time.monotonic())
                try:
                    posted = self.stack.ep.try_post_send(self.sending_mr, offset, len(message), dest,
                                                         ("send", slot, dest))
                except fi.FabricError:
                    posted = None
                with self.lock:
                    if generation != self.generation:
                        return went  # taken for wedged meanwhile: the slot stays with the call
                    self.calling = None
                    if not posted:
                        self.free_sends.appendleft(slot)
                        since = self.stuck.setdefault(dest, time.monotonic())
                        if posted is None or time.monotonic() - since > self.unreachable_s:
                            self.failed.append(dest)
                            self._forget(dest)
                        break
                    self.stuck.pop(dest, None)
                    queue.popleft()
                    if not queue:
                        del self.outbox[dest]
                went = True
        return went

    def _start_sender(self) -> None:
        self.sender = threading.Thread(target=self._send_loop, args=(self.generation,),
                                       name="fabriclab-control-send", daemon=True)
        self.sender.start()

    def _send_loop(self, generation: int) -> None:
        while generation == self.generation:
            self.wake.clear()
            if not self._post(generation):
                with self.lock:
                    waiting = bool(self.outbox)
                self.wake.wait(0.001 if waiting else 0.1)  # EAGAIN: try again soon

    def _watch(self) -> None:
        """A send call that has not returned for WEDGED_S never will: its destination is unreachable, its
        thread is left to the provider (at idle priority: a spin burns only idle time), a fresh one sends."""
        with self.lock:
            calling = self.calling
            if calling is None or calling[0] != self.generation or time.monotonic() - calling[2] < self.WEDGED_S:
                return
            self.generation += 1
            self.failed.append(calling[1])
            self._forget(calling[1])
        stuck = self.sender
        self.stranded.append(stuck)
        try:
            os.setpriority(os.PRIO_PROCESS, stuck.native_id, 19)
        except OSError:
            pass  # not allowed here: it spins at its priority
        log.warning("a control message to a peer has not left in %.0f s (the provider is stuck on the peer, which "
                    "is taken for gone); a fresh thread sends the others", self.WEDGED_S)
        self._start_sender()

    def _repost(self, slot: int) -> None:
        self.stack.ep.post_recv(self.received_mr, slot * self.message_bytes, self.message_bytes, ("recv", slot))

    def close(self) -> None:
        """Stop the sender and close the endpoint, unless a send call still runs on it (kept open, and with it
        the memory it reads, for the life of the process)."""
        with self.lock:
            self.generation += 1
        self.wake.set()
        if self.sender is not None:
            self.sender.join(1.0)
        if any(t.is_alive() for t in self.stranded + [self.sender] if t is not None):
            self.stack.fabric.keep_open()
            _KEPT.append(self)
            return
        self.stack.close()


_KEPT: list[ControlChannel] = []  # channels a stuck send call still uses: never closed, never collected
