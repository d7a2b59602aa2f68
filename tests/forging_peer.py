"""A forging peer for the staged-target tests: it speaks the landing control protocol by hand, through a
real control endpoint of its own (fabriclab.control.ControlChannel), to a staged target's control address.

    python tests/forging_peer.py PROVIDER DOMAIN ADDRESS_HEX RATE garbage
    python tests/forging_peer.py PROVIDER DOMAIN ADDRESS_HEX RATE spoof WRITER_ID REGION_ID IMM DST
    python tests/forging_peer.py PROVIDER DOMAIN ADDRESS_HEX RATE hog REGION_ID KEY REQUESTS
    python tests/forging_peer.py PROVIDER DOMAIN ADDRESS_HEX RATE requests COUNT REGION_ID KEY [NICS]
ADDRESS_HEX is the target's control address (a staged descriptor's LandingRoute.address) as hex; RATE the
messages sent a second. garbage: malformed messages of every kind (1 byte, truncated, unknown kinds, wrong
lengths, fields out of range, a REQUEST with a guessed key), over and over. spoof: FILLED claiming to be
writer WRITER_ID, for each of its first 64 jobs and each lane, saying the lane holds one page for byte DST
of region REGION_ID under IMM. hog: a writer holding the region's descriptor (its id and KEY) that asks for
2**32 - 1 lanes in each of REQUESTS transfers (as one engine), names them in ALIVE every HEARTBEAT_S and never
fills a lane (RATE unused); it prints "holds N" whenever the number of lanes it holds changes, "refused TEXT"
for each transfer refused, and at SIGTERM "held N" (the most it held at once). requests: COUNT lane requests for region REGION_ID with its KEY (a descriptor's),
each once, each naming another made-up control address (shm: a region name nobody has; tcp: a loopback port this
process holds and never listens on); with NICS (comma-separated hex of fi.Address bytes: someone else's), each
from the forger's own control address instead. Each names as its NICs' addresses NICS, its control address
and a made-up shm name. Prints "ready" once its endpoint is open, then sends until SIGTERM
(requests: prints "sent" once all went, and waits), which ends it cleanly: its endpoint closed, so the target's
replies to it fail instead of spinning (on shm, a send to a process SIGKILLed while it held its queue's lock
spins for ever, stranding a thread of the tests' process)."""
import signal
import socket
import struct
import sys
import time

import numpy as np

from fabriclab import control, fi

H, FILLED, REQUEST = control.HEAD, control.FILLED_BODY, control.REQUEST_BODY
provider, domain, address, rate, mode = sys.argv[1], sys.argv[2], bytes.fromhex(sys.argv[3]), float(sys.argv[4]), \
    sys.argv[5]
ME = 0x5EED


def garbage(rng, mine):
    """One cycle of malformed messages, each of another shape (``mine``: the forger's own address)."""
    me, job = ME, int(rng.integers(1, 1 << 62))
    entry = control.PAGE_ENTRY.pack(0, 4096)
    return [
        b"\x03",
        H.pack(control.FILLED, me, job)[:9],
        H.pack(99, me, job) + b"\x00" * 8,
        H.pack(0, me, job),
        H.pack(control.REQUEST, me, job) + REQUEST.pack(1, 0, 1, 500, 0) + b"\x01" * 10,
        H.pack(control.REQUEST, me, job) + REQUEST.pack(1, 0, 0, 0, 0),
        H.pack(control.REQUEST, me, job) + REQUEST.pack(1, 0, 1, 16, 0) + rng.bytes(16),
        H.pack(control.REQUEST, me, job) + REQUEST.pack(1, 0, 1, len(mine), 200) + mine,
        H.pack(control.REQUEST, me, job) + REQUEST.pack(1, 0, 1, len(mine), 2) + mine + b"\x05\x00abc",
        H.pack(control.REQUEST, me, job) + control.request_body(1, 0, 1, mine, [b"x" * 400]),
        H.pack(control.REQUEST, me, job) + control.request_body(int(rng.integers(1, 4)), 99, 1, mine, []),
        H.pack(control.FILLED, me, job) + FILLED.pack(1, 0, 5, 1000) + entry,
        H.pack(control.FILLED, me, job) + FILLED.pack(1, 0, 5, 0),
        H.pack(control.FILLED, me, job) + FILLED.pack(1, 0, 5, 1) + entry,
        H.pack(control.FILLED, me, job) + FILLED.pack(1, 60000, 5, 1) + entry,
        H.pack(control.RELEASE, me, job) + b"\x00",
        H.pack(control.RELEASE, me, job) + control.LANE.pack(3),
        H.pack(control.GRANT, me, job) + b"\x00\x00\x01",
        H.pack(control.GRANT, me, job) + b"",
        H.pack(control.COPIED, me, job),
        H.pack(control.REFUSED, me, job) + control.REFUSED_BODY.pack(0, 200) + b"\xff\xfe",
        H.pack(control.REFUSED, me, job) + b"\x01",
        H.pack(control.ALIVE, me, 0) + b"\x01\x02\x03",
        H.pack(control.ALIVE, me, job) + control.JOB.pack(job),
        H.pack(int(rng.integers(0, 256)), int(rng.integers(0, 1 << 63)), job) + rng.bytes(int(rng.integers(0, 64))),
        rng.bytes(int(rng.integers(1, 40))),
    ]


def spoofed(writer, region, imm, dst):
    """FILLED as writer ``writer`` would send it for its jobs 1-64 (the numbers a writer's first jobs had),
    each lane of a pool of up to 16, redirecting the lane's first page to byte ``dst``."""
    body = control.PAGE_ENTRY.pack(dst, 65536)
    return [H.pack(control.FILLED, writer, job) + FILLED.pack(region, lane, imm, 1) + body
            for job in range(1, 65) for lane in range(16)]


def hog(region, key, requests):
    """Ask for every lane there is in ``requests`` transfers, keep them alive, fill none (see above)."""
    jobs = list(range(1, requests + 1))
    mine = channel.address
    for job in jobs:
        channel.send(target, H.pack(control.REQUEST, ME, job) + control.request_body(region, key, 2 ** 32 - 1, mine, []))
    held = dict.fromkeys(jobs, 0)  # job -> lanes it holds
    most, heartbeat = 0, 0.0
    while not stopping:
        if time.monotonic() - heartbeat > control.HEARTBEAT_S:
            heartbeat = time.monotonic()
            for message in control.alive(ME, jobs):
                channel.send(target, message)
        before = sum(held.values())
        for message in channel.progress()[0]:
            kind, _, job, fields = control.read(message)
            if kind == control.GRANT:
                held[job] += len(fields[0])
            elif kind == control.REFUSED:  # the whole transfer refused: its lanes went back
                held[job] = 0
                print(f"refused {fields[2]}", flush=True)
        if sum(held.values()) != before:
            most = max(most, sum(held.values()))
            print(f"holds {sum(held.values())}", flush=True)
        time.sleep(0.005)
    print(f"held {most}", flush=True)


def made_up(count, region, key, mine, nics=()):
    """REQUESTs for ``region`` with ``key``, each from a made-up control address like ``mine`` (the forger's),
    or with ``nics`` from ``mine``; each names ``nics``, its control address and a made-up shm name as its NICs'."""
    own = fi.Address.from_bytes(mine)
    if nics:
        raws = [own.raw] * count
    elif own.provider == "shm":
        raws = [f"fi_shm://made-up-{i}".encode() + b"\0" for i in range(count)]
    else:
        for _ in range(count):  # bound, never listening: a connection to it is refused at once
            held.append(socket.socket())
            held[-1].bind(("127.0.0.1", 0))
        raws = [own.raw[:2] + struct.pack(">H", s.getsockname()[1]) + own.raw[4:] for s in held]
    addresses = [fi.Address(own.provider, own.addr_format, raw).to_bytes() for raw in raws]
    nowhere = fi.Address(own.provider, own.addr_format, b"fi_shm://made-up-nic\0").to_bytes()  # (shm's format)
    return [H.pack(control.REQUEST, ME + 2 * i, 1 + i) + control.request_body(region, key, 1, a, [*nics, a, nowhere])
            for i, a in enumerate(addresses)]


channel = control.ControlChannel(provider, None if domain == "-" else domain)
target = channel.peer(address)
rng = np.random.default_rng(7)
held: list[socket.socket] = []
stopping = []
signal.signal(signal.SIGTERM, lambda *_: stopping.append(True))
if mode == "hog":
    print("ready", flush=True)
    hog(*(int(x) for x in sys.argv[6:9]))
    channel.close()
    sys.exit(0)
if mode == "requests":
    messages = made_up(*(int(x) for x in sys.argv[6:9]), channel.address,
                       [bytes.fromhex(h) for h in sys.argv[9].split(",")] if len(sys.argv) > 9 else ())
else:
    messages = garbage(rng, channel.address) if mode == "garbage" else spoofed(*(int(x) for x in sys.argv[6:10]))
print("ready", flush=True)
sent, started = 0, time.monotonic()
while not stopping:
    if mode == "requests" and sent == len(messages):
        print("sent", flush=True)
        while not stopping:
            channel.progress()
            time.sleep(0.001)
        break
    if mode == "garbage" and sent % len(messages) == 0:
        messages = garbage(rng, channel.address)
    channel.send(target, messages[sent % len(messages)])
    sent += 1
    channel.progress()
    while time.monotonic() - started < sent / rate:
        channel.progress()
        time.sleep(0.0005)
channel.close()
