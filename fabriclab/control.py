"""The control channel of staged targets (``fabriclab.landing``): its messages, read and checked, and the
endpoint that carries them.

Every message is untrusted input, whoever claims to send it. :func:`read` checks what a message can say
about itself (its kind, its length against its counts, each field's range, as unsigned) and raises
:class:`BadMessage` naming the problem; the landing thread then checks it against what its sender was
granted. A message that fails is dropped on its own (the others read with it are served) and counted in
:class:`Rejected`, which logs the first from each sender and then every tenfold count, never a line per
message. Messages:

    REQUEST  writer -> target   lanes wanted for a transfer, the region's key (from its descriptor), the
                                writer's control address and its NICs' (where the target's provider keeps
                                state for each peer that writes into it, the target inserts them so as to
                                remove them once the writer is gone: nics.PeerEntries.reached_by)
    GRANT    target -> writer   these lanes are yours
    FILLED   writer -> target   lane L holds these pages (in order), for these offsets, counted under imm
    RELEASE  writer -> target   lane L is yours again, unfilled (the transfer failed or ended early)
    COPIED   target -> writer   lane L's pages are in place and counted
    REFUSED  target -> writer   the transfer cannot land (region closed, CUDA failed, ...): why
    ALIVE    writer -> target   these transfers of mine still run (every HEARTBEAT_S, while they do)
    COPIED_IN writer -> target  my GPU copied these pages into your region through CUDA IPC: count them
                                under imm (``fabriclab.ipc``; the region's key from its descriptor)

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
from collections.abc import Callable
from typing import Any

import numpy as np

from . import _native, fi

MESSAGE_BYTES = 64 << 10   # the largest control message (a FILLED names up to ~5000 pages)
RECEIVES = 64              # control messages that can wait to be read
READS = 4 * RECEIVES       # messages one progress call reads at most: a flood never stops the rest
SENDS = 64                 # control messages that can be on their way at once
NO_LANE = 0xFFFF
TEXT_CHARS = 400           # of a REFUSED's reason, at most (it ends up in the writer's exception)
# The protocol's timing, which writers and targets both keep to:
HEARTBEAT_S = 0.25  # a writer names its running transfers to each target this often
SILENT_S = 3.0      # a writer not heard from this long is gone: its requests and lanes are dropped
STALL_S = 2.0       # a landing thread that did not run this long may have lost its lanes (< SILENT_S - HEARTBEAT_S)
# The peers' control addresses a channel keeps in its address vector (ControlChannel.trim):
PEERS_MOST = 1024   # at most (fewer where the provider takes fewer: shm's 256), every one in use
PEERS_KEPT = 16     # idle ones kept for a peer that comes back (a writer between transfers): on shm each maps its
                    # peer's region, which holds ~4 MiB of /dev/shm memory even once its process is gone
QUIET_S = SILENT_S  # an idle peer is removed once unused this long
_FULL = (f"each is a peer with a transfer running or a message on its way (an idle one is removed after {QUIET_S:g} "
         "s); wait for some transfers to end")

REQUEST, GRANT, FILLED, RELEASE, COPIED, REFUSED, ALIVE, COPIED_IN = range(1, 9)
HEAD = struct.Struct("<BQQ")           # kind, sender's engine id, the writer's job
REQUEST_BODY = struct.Struct("<IQIHB")  # region id, region key, lanes wanted, control address length, NIC addresses
                                       # (the control address follows, then each NIC address: ADDRESS_LENGTH, bytes)
ADDRESS_LENGTH = struct.Struct("<H")
NIC_ADDRESSES = 64                     # a REQUEST names at most this many NIC addresses of its writer
NIC_ADDRESS_BYTES = 320                # each at most this long (fi.Address: shm's name, SMR_NAME_MAX, and a head)
FILLED_BODY = struct.Struct("<IHII")   # region id, lane, imm, pages (entries follow)
PAGE_ENTRY = struct.Struct("<QI")      # FILLED: a page's destination offset in the region and its length
PAGE_ENTRIES = np.dtype([("dst", "<u8"), ("length", "<u4")])
FILLED_HEAD = HEAD.size + FILLED_BODY.size
LANE = struct.Struct("<H")
REFUSED_BODY = struct.Struct("<HB")    # lane (NO_LANE: the whole transfer), why (index in WHY; text follows)
JOB = struct.Struct("<Q")              # ALIVE: the writer's jobs, one after another
COPIED_IN_BODY = struct.Struct("<IQIQQ")  # region id, region key, imm, pages, bytes
ALIVE_JOBS = 512                       # jobs one ALIVE names at most (4 KiB: fits any provider's messages)
REQUESTS_PER_SENDER = 64               # transfers a writer runs at once at one target (landing_target refuses more)
WHY = ("closed", "cuda", "timeout", "invalid", "engine")  # staging.FAILURES' names ("invalid": a message refused)

log = logging.getLogger("fabriclab")


class BadMessage(fi.FabriclabError):
    """A control message that is malformed, or asks what its sender was not granted: it is dropped."""


# ----------------------------------------------------------------------------------- reading


def read(message: bytes) -> tuple[int, int, int, tuple[Any, ...]]:
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


def request_body(region_id: int, key: int, wanted: int, address: bytes, nic_addresses: list[bytes]) -> bytes:
    """A REQUEST's body: the region and its key, lanes wanted, the writer's control and NIC addresses."""
    return (REQUEST_BODY.pack(region_id, key, wanted, len(address), len(nic_addresses)) + address
            + b"".join(ADDRESS_LENGTH.pack(len(a)) + a for a in nic_addresses))


def _request(body: bytes) -> tuple[Any, ...]:
    if len(body) < REQUEST_BODY.size:
        raise BadMessage(f"REQUEST of {len(body)} bytes is truncated")
    region_id, key, wanted, size, count = REQUEST_BODY.unpack_from(body)
    if size == 0 or len(body) < REQUEST_BODY.size + size:
        raise BadMessage(f"REQUEST says its address has {size} bytes, but {len(body) - REQUEST_BODY.size} follow")
    if wanted == 0:
        raise BadMessage("REQUEST for no lanes")
    if count > NIC_ADDRESSES:
        raise BadMessage(f"REQUEST names {count} NIC addresses, more than {NIC_ADDRESSES}")
    at = REQUEST_BODY.size + size
    nic_addresses = []
    for n in range(count):
        length = ADDRESS_LENGTH.unpack_from(body, at)[0] if at + ADDRESS_LENGTH.size <= len(body) else -1
        at += ADDRESS_LENGTH.size
        if not 0 < length <= NIC_ADDRESS_BYTES or at + length > len(body):
            raise BadMessage(f"REQUEST's NIC address {n} is truncated, or not 1 to {NIC_ADDRESS_BYTES} bytes long")
        nic_addresses.append(body[at:at + length])
        at += length
    if at != len(body):
        raise BadMessage(f"REQUEST has {len(body) - at} bytes after its last address")
    return region_id, key, wanted, body[REQUEST_BODY.size:REQUEST_BODY.size + size], nic_addresses


def _grant(body: bytes) -> tuple[Any, ...]:
    if not body or len(body) % LANE.size:
        raise BadMessage(f"GRANT of {len(body)} bytes is not a list of lanes")
    lanes = [int(lane) for lane in np.frombuffer(body, "<u2")]
    if len(set(lanes)) != len(lanes):
        raise BadMessage("GRANT names a lane twice")
    return (lanes,)


def _filled(body: bytes) -> tuple[Any, ...]:
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


def _lane(body: bytes) -> tuple[Any, ...]:
    if len(body) != LANE.size:
        raise BadMessage(f"a lane's message of {len(body)} bytes, not {LANE.size}")
    return LANE.unpack(body)


def _refused(body: bytes) -> tuple[Any, ...]:
    if len(body) < REFUSED_BODY.size:
        raise BadMessage(f"REFUSED of {len(body)} bytes is truncated")
    lane, why = REFUSED_BODY.unpack_from(body)
    if why >= len(WHY):
        raise BadMessage(f"REFUSED for unknown reason {why}")
    return lane, WHY[why], body[REFUSED_BODY.size:].decode(errors="replace")[:TEXT_CHARS]


def _alive(body: bytes) -> tuple[Any, ...]:
    if not body or len(body) % JOB.size:
        raise BadMessage(f"ALIVE of {len(body)} bytes is not a list of jobs")
    return ([int(job) for job in np.frombuffer(body, "<u8")],)


def _copied_in(body: bytes) -> tuple[Any, ...]:
    if len(body) != COPIED_IN_BODY.size:
        raise BadMessage(f"COPIED_IN of {len(body)} bytes, not {COPIED_IN_BODY.size}")
    region_id, key, imm, pages, nbytes = COPIED_IN_BODY.unpack(body)
    if imm > _native.MAX_IMM and imm != _native.NO_IMM:
        raise BadMessage(f"COPIED_IN's immediate data {imm:#x} is none a caller can give")
    if not 0 < pages <= min(nbytes, _native.MAX_IMM_COUNT):
        raise BadMessage(f"COPIED_IN of {pages} pages in {nbytes} bytes")
    return region_id, key, imm, pages, nbytes


def copied_in(sender: int, job: int, region_id: int, key: int, imm: int, pages: int, nbytes: int) -> bytes:
    """The COPIED_IN message of a writer's transfer ``job``."""
    return HEAD.pack(COPIED_IN, sender, job) + COPIED_IN_BODY.pack(region_id, key, imm, pages, nbytes)


def alive(sender: int, jobs: list[int]) -> list[bytes]:
    """The ALIVE messages naming ``jobs``."""
    return [HEAD.pack(ALIVE, sender, 0) + np.asarray(jobs[first:first + ALIVE_JOBS], "<u8").tobytes()
            for first in range(0, len(jobs), ALIVE_JOBS)]


_READERS = {REQUEST: _request, GRANT: _grant, FILLED: _filled, RELEASE: _lane, COPIED: _lane, REFUSED: _refused,
            ALIVE: _alive, COPIED_IN: _copied_in}


class Rejected:
    """Control messages dropped, counted per sender: the first from each is logged, then the 10th, 100th...
    with the count, so a flood of them is a few lines. Senders the landing thread has no business with
    share one count (a forger can claim any id)."""

    SENDERS = 256  # senders counted apart at most

    def __init__(self) -> None:
        self.total = 0
        self.by_sender: dict[str, int] = {}

    def note(self, sender: str, problem: str, error: BaseException | None = None) -> None:
        """Count a message dropped for ``problem`` (``error``: an exception whose traceback the log shows)."""
        self.total += 1
        if sender not in self.by_sender and len(self.by_sender) >= self.SENDERS:
            sender = "other senders"
        count = self.by_sender[sender] = self.by_sender.get(sender, 0) + 1
        if str(count).rstrip("0") == "1":
            log.warning("dropped a control message from %s: %s (%d so far from there; stats()['staging']"
                        "['bad_control_messages'] counts them all, and this log again at each tenfold count)",
                        sender, problem, count, exc_info=error)


# ---------------------------------------------------------------------------------- the channel


class Superseded(Exception):
    """Raised in a thread whose send call outlived WEDGED_S, when the call returns after all: another
    thread serves the channel now, this one must stop."""


class ControlChannel:
    """One endpoint for small messages, beside the engine's NICs (own fabric and domain, of the provider
    and domain of the engine's first NIC, as fi_getinfo offers them), served by one thread at a time.

    Messages wait per destination: one that takes nothing (a peer gone, whose provider keeps answering
    EAGAIN) holds up no other, and is reported failed once it took nothing for ``unreachable_s``. A call
    into the provider that never returns (stuck; why: native/service.h, at fl_service_stop) is seen by
    ``wedged``: ``supersede`` then leaves the stuck thread to the provider at idle priority. A stuck send
    is one peer's: its destination is reported failed, and another thread may serve the channel. A stuck
    read of the completion queue is the channel's own queue: ``dead`` says so, and nothing can serve it
    again. Either way the endpoint is never closed (the stuck call still uses it, and closing it would wait
    for the lock that call holds, at the latest at the process's exit).

    Peers' addresses are inserted into the address vector as they are first sent to, and removed once no
    longer needed (``trim``), so that writers and targets coming and going never fill it (shm's holds 256)."""

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
        self.outbox: dict[int, collections.deque[bytes]] = {}
        self.stuck: dict[int, float] = {}  # destination -> since when it takes nothing
        self.known: collections.OrderedDict[bytes, int] = collections.OrderedDict()  # least recently used first
        self.address_of: dict[int, bytes] = {}
        self.last_used: dict[int, float] = {}
        self.on_the_way: dict[int, int] = {}  # destination -> sends posted and not completed
        self.gone: set[int] = set()  # destinations found unreachable: removed once idle
        self.kept: set[int] = set()  # destinations never removed: a stuck send may still use them
        #: the destinations the owner still needs (transfers to or from them), asked by ``trim``
        self.in_use: Callable[[], set[int]] = set
        self.most = min(self.stack.av.most, PEERS_MOST)
        self.removed = 0
        self.trimmed = time.monotonic()
        self.lock = threading.Lock()  # the send in progress, against supersede() from a watching thread
        self.calling: tuple[int, int | None, float, int] | None = None  # (generation, destination or None for
        # the completion queue's read, since, thread)
        self.generation = 0
        self.failed: list[int] = []  # destinations supersede() gave up on
        self.stranded = 0            # threads left in a provider call
        self.dead = False            # a read of the completion queue was left stuck: the channel serves no more

    @property
    def can_send(self) -> bool:
        """Whether messages wait for a destination that still takes them."""
        return any(dest not in self.stuck for dest in self.outbox)

    def peer(self, address: bytes) -> int:
        """The fi_addr of a peer's control endpoint: inserted at first, the same while it stays (``trim``).
        AddressVectorFull when ``most`` peers are still in use."""
        dest = self.known.get(address)
        if dest is None:
            if len(self.known) >= self.most:
                self.trim(room=1)
            if len(self.known) >= self.most:
                raise fi.AddressVectorFull(len(self.known), self.most, self.stack.info.provider, _FULL)
            try:
                dest = self.stack.av.insert(fi.Address.from_bytes(address))
            except fi.AddressVectorFull as exc:
                raise fi.AddressVectorFull(exc.held, exc.most, self.stack.info.provider, _FULL) from None
            self.known[address], self.address_of[dest] = dest, address
        else:
            self.known.move_to_end(address)
        self.last_used[dest] = time.monotonic()
        return dest

    def known_dest(self, address: bytes | None) -> int | None:
        """The fi_addr of a peer's control endpoint while it is in the address vector (None once removed)."""
        return None if address is None else self.known.get(address)

    def send(self, dest: int, message: bytes) -> None:
        if len(message) > self.message_bytes:
            raise fi.UsageError(f"control message of {len(message)} bytes exceeds {self.message_bytes}")
        if dest in self.address_of:  # else removed: nothing reaches that peer any more
            self.outbox.setdefault(dest, collections.deque()).append(message)

    def forget(self, dest: int) -> None:
        """Drop what waits to go to ``dest`` (a peer found gone); its entry goes once idle (``trim``)."""
        self.outbox.pop(dest, None)
        self.stuck.pop(dest, None)
        self.gone.add(dest)

    def trim(self, room: int = 0) -> None:
        """Remove from the address vector the peers no longer needed: every one found gone, and the least
        recently used beyond PEERS_KEPT (``room`` more, for an insert). Only an idle one goes: no transfer
        of the owner's names it (``in_use``), no message of ours waits for it or is on its way, it was not
        used for QUIET_S, and no stuck send may still use it. The wait is shm's: a peer removed from a
        target's vector, given the slot again, must have stopped sending under the handshake it had
        (fabriclab.fi._smr), and a writer ends its transfer's messages within a beat of being refused."""
        now = self.trimmed = time.monotonic()
        busy = self.in_use() | set(self.outbox) | set(self.on_the_way) | self.kept
        excess = len(self.known) - PEERS_KEPT + room
        for address, dest in list(self.known.items()):  # least recently used first
            if (excess <= 0 and dest not in self.gone) or dest in busy or now - self.last_used[dest] < QUIET_S:
                continue
            excess -= 1
            if not self.stack.av.remove(dest):
                self.kept.add(dest)  # its slot cannot be reused safely (fabriclab.fi._smr): it stays
                continue
            self.removed += 1
            del self.known[address], self.address_of[dest], self.last_used[dest]
            self.gone.discard(dest)

    def progress(self) -> tuple[list[bytes], list[int]]:
        """Post what waits to be sent, read what arrived: (messages received, peers found unreachable)."""
        with self.lock:
            failed, self.failed = self.failed, []
        failed += [dest for dest in list(self.outbox) if not self._post(dest)]
        received: list[bytes] = []
        while len(received) < READS:
            try:
                completions = self._read()
            except fi.FabricError as exc:
                token = exc.token
                if token and token[0] == "send":
                    self._sent(token)
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
                    self._sent(c.token)
        for dest in failed:
            self.forget(dest)
        if time.monotonic() - self.trimmed > HEARTBEAT_S:
            self.trim()
        return received, failed

    def _sent(self, token: tuple[str, int, int]) -> None:
        """A send completed (or failed): its slot is free, its destination has one less on its way."""
        _, slot, dest = token
        self.free_sends.append(slot)
        left = self.on_the_way.pop(dest, 1) - 1
        if left:
            self.on_the_way[dest] = left

    def _read(self) -> list[fi.Completion]:
        """One read of the completion queue, seen by ``wedged`` while it runs."""
        generation = self.generation
        self.calling = (generation, None, time.monotonic(), threading.get_native_id())
        try:
            return self.stack.cq.poll()
        finally:
            self._returned(generation)

    def _returned(self, generation: int) -> None:
        """A provider call of this thread returned: Superseded if it was given up on meanwhile."""
        with self.lock:
            if generation != self.generation:
                raise Superseded()
            self.calling = None

    def _post(self, dest: int) -> bool:
        """Post what waits for ``dest`` while send slots are free; False if ``dest`` cannot be reached."""
        queue = self.outbox[dest]
        generation = self.generation
        while queue and self.free_sends:
            message, slot = queue[0], self.free_sends[0]
            offset = slot * self.message_bytes
            self.sending[offset:offset + len(message)] = np.frombuffer(message, np.uint8)
            self.calling = (generation, dest, time.monotonic(), threading.get_native_id())
            try:
                posted = self.stack.ep.try_post_send(self.sending_mr, offset, len(message), dest, ("send", slot, dest))
            except fi.FabricError:
                posted = None
            self._returned(generation)  # Superseded: the slot stays with the call
            if not posted:
                return posted is not None and (
                    time.monotonic() - self.stuck.setdefault(dest, time.monotonic()) < self.unreachable_s)
            self.stuck.pop(dest, None)
            self.on_the_way[dest] = self.on_the_way.get(dest, 0) + 1
            queue.popleft()
            self.free_sends.popleft()
        if not queue:
            del self.outbox[dest]
        return True

    def wedged(self) -> bool:
        """Whether a send call has been running for WEDGED_S (from any thread)."""
        calling = self.calling
        return calling is not None and calling[0] == self.generation and time.monotonic() - calling[2] > self.WEDGED_S

    def supersede(self) -> bool:
        """Give up on the wedged call (from another thread than the one in it; False if it returned
        meanwhile): its thread is left at idle priority, and raises Superseded if the call ever returns. A
        send: what waits for its destination is dropped and the destination reported failed at the next
        ``progress``, and another thread may serve the channel. A read: the channel is ``dead``."""
        with self.lock:
            calling = self.calling
            if calling is None or not self.wedged():
                return False
            _, dest, _, thread = calling
            self.generation += 1
            self.calling = None
            if dest is None:
                self.dead = True
            else:
                self.forget(dest)  # its thread is stuck, the next one not started: no one else uses the outbox
                self.failed.append(dest)
                self.kept.add(dest)  # the stuck call still uses its entry
            self.stranded += 1
        try:
            os.setpriority(os.PRIO_PROCESS, thread, 19)  # a spin burns only idle time
        except OSError:
            pass  # not allowed here: it spins at its priority
        if dest is None:
            log.warning("reading the control endpoint's completion queue has not returned in %.0f s (the provider "
                        "is stuck, as shm is on a queue whose peer died holding its lock): staged transfers of this "
                        "engine fail from now on; open a new Engine", self.WEDGED_S)
        else:
            log.warning("a control message to a peer has not left in %.0f s (the provider is stuck on the peer, "
                        "which is taken for gone); another thread serves the control channel", self.WEDGED_S)
        return True

    def _repost(self, slot: int) -> None:
        self.stack.ep.post_recv(self.received_mr, slot * self.message_bytes, self.message_bytes, ("recv", slot))

    def close(self) -> None:
        """Close the endpoint, unless a call left stranded still runs on it: then it is ``abandon``ed."""
        if self.stranded:
            self.abandon()
            return
        self.stack.close()

    def abandon(self) -> None:
        """Leave the endpoint open, with the memory it reads, for the life of the process, never closed: for a
        thread that may still be inside (or come back into) a provider call on it."""
        self.stack.fabric.keep_open()
        _KEPT.append(self)


_KEPT: list[ControlChannel] = []  # channels a stuck call may still use: never closed, never collected
