"""The writing side of tests/test_testbed_engine.py, run in the testbed's client namespace: an Engine
over the client ends of the links, writing into a tests/api_peer.py peer in the server namespace.

    python tests/testbed_engine_writer.py ROLE PEER_HEX DOMAINS ARGS...

PEER_HEX is the line the peer printed (its packed address and region descriptor), DOMAINS the client
ends of the links, comma-separated. Each role prints what the test asserts on:

    until-lost TIMEOUT       16 MiB transfers back to back, two in flight, until one fails: "flowing"
                             once the first has landed, then "lost: TYPE buffer_safe=B: MESSAGE" (any
                             TransferError) and "closed cleanly in S s"; exit 0 only then
    random-pages MIB IMM [LINK_TIMEOUT]
                             MIB MiB of random 64 KiB pages to a random permutation of the peer's pages:
                             "wrote N pages (W writes), B bytes in S s = G Gbps sha256=D" (D: what the peer must hold),
                             then "down DOMAIN: WHY; resent N" for each NIC that was failed over
    cycles COUNT WARMUP IMM  WARMUP, then COUNT times: open an engine, connect, write one page, close the
                             peer, region and engine; "cycles C in S s = R/s fds A -> B rss A -> B KiB
                             untrimmed A -> B KiB maxrss A -> B KiB", measured after the warm-up and after
                             the COUNT cycles (rss: with freed heap handed back to the kernel)
"""
import collections
import ctypes
import gc
import hashlib
import os
import resource
import sys
import time

import numpy as np

from fabriclab import Engine, TransferError, bootstrap

PROVIDER = "tcp;ofi_rxm"
PAGE = 65536
HANG_GRACE_S = 10  # past the engine's own deadline, a future that is still not done is a hang
M_ARENA_MAX, M_MMAP_THRESHOLD, M_TRIM_THRESHOLD = -8, -3, -1  # mallopt's parameters (glibc malloc.h)


def until_lost(address, descriptor, domains, timeout):
    pages = range((16 << 20) // PAGE)
    data = np.random.default_rng(1).integers(0, 256, size=len(pages) * PAGE, dtype=np.uint8)
    with Engine(PROVIDER, domains=domains, pin=False, timeout=timeout) as engine:
        region = engine.register(data)
        peer = engine.connect(address)
        peer.write_pages(region, pages, descriptor, pages, PAGE).result(timeout + HANG_GRACE_S)
        print("flowing", flush=True)
        # Two in flight, so the peer always dies with a write on the wire rather than between transfers.
        in_flight = collections.deque()
        give_up = time.monotonic() + 120
        try:
            while time.monotonic() < give_up:
                while len(in_flight) < 2:
                    in_flight.append(peer.write_pages(region, pages, descriptor, pages, PAGE))
                in_flight.popleft().result(timeout + HANG_GRACE_S)
            sys.exit("the peer never went away: every transfer succeeded for 120 s")
        except TransferError as lost:  # the test judges the type: PeerLost or TransferTimeout are right
            print(f"lost: {type(lost).__name__} buffer_safe={lost.buffer_safe}: {lost}", flush=True)
        except TimeoutError:
            sys.exit(f"hang: a transfer was neither done nor failed {HANG_GRACE_S} s past its {timeout} s deadline")
        for transfer in in_flight:  # the other one fails too; the engine must still close after both
            transfer.exception(timeout + HANG_GRACE_S)
        started = time.monotonic()
    print(f"closed cleanly in {time.monotonic() - started:.2f} s", flush=True)


def random_pages(address, descriptor, domains, mib, imm, link_timeout=None):
    rng = np.random.default_rng(2)
    count = (mib << 20) // PAGE
    data = rng.integers(0, 256, size=count * PAGE, dtype=np.uint8)
    destination = rng.permutation(count)
    landed = np.empty_like(data)
    landed.reshape(count, PAGE)[destination] = data.reshape(count, PAGE)
    with Engine(PROVIDER, domains=domains, pin=False, timeout=60, link_timeout=link_timeout) as engine:
        region = engine.register(data)
        peer = engine.connect(address)
        result = peer.write_pages(region, range(count), descriptor, destination, PAGE, imm=imm).result(
            60 + HANG_GRACE_S)
        gbps = result.bytes * 8 / result.elapsed_s / 1e9
        print(f"wrote {result.pages} pages ({result.writes} writes), {result.bytes} bytes in {result.elapsed_s:.3f} s = {gbps:.3f} Gbps "
              f"sha256={hashlib.sha256(landed).hexdigest()}", flush=True)
        for nic in engine.stats()["per_nic"]:
            if nic["down"]:
                print(f"down {nic['domain']}: {nic['down']}; resent {nic['resent']}", flush=True)


def open_fds():
    return len(os.listdir("/proc/self/fd"))


def rss_kib():
    return int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE") // 1024


def max_rss_kib():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def cycles(address, descriptor, domains, count, warmup, imm):
    page = np.full(PAGE, 0x5A, dtype=np.uint8)
    # Each engine's tcp;ofi_rxm endpoints allocate and free some 300 MiB of pools, which glibc keeps: RSS is
    # read after malloc_trim hands freed heap back, and with a single arena, since malloc_trim leaves the
    # top of each worker thread's own arena (tens of MiB) resident.
    # Left to itself glibc may also map and unmap those pools anew for every engine, or hand the top of the
    # heap back, and every next engine faults them in again (a few times slower per cycle): pools come from
    # the heap, and only malloc_trim below trims it.
    libc = ctypes.CDLL(None)
    libc.mallopt(M_ARENA_MAX, 1)
    libc.mallopt(M_MMAP_THRESHOLD, 32 << 20)
    libc.mallopt(M_TRIM_THRESHOLD, 1 << 30)

    def one_cycle():
        with Engine(PROVIDER, domains=domains, pin=False, timeout=10) as engine:
            region = engine.register(page)
            peer = engine.connect(address)
            peer.write_pages(region, [0], descriptor, [0], PAGE, imm=imm).result(10 + HANG_GRACE_S)
            peer.close()
            region.close()

    def memory_kib():
        """RSS as it is, then with freed heap handed back."""
        gc.collect()
        as_is = rss_kib()
        libc.malloc_trim(0)
        return as_is, rss_kib()

    for _ in range(warmup):
        one_cycle()
    fds, (untrimmed, rss), max_rss = open_fds(), memory_kib(), max_rss_kib()
    started = time.perf_counter()
    for _ in range(count):
        one_cycle()
    elapsed = time.perf_counter() - started
    fds_after, (untrimmed_after, rss_after) = open_fds(), memory_kib()
    print(f"cycles {count} in {elapsed:.1f} s = {count / elapsed:.1f}/s fds {fds} -> {fds_after} "
          f"rss {rss} -> {rss_after} KiB untrimmed {untrimmed} -> {untrimmed_after} KiB "
          f"maxrss {max_rss} -> {max_rss_kib()} KiB", flush=True)


ROLES = {"until-lost": (until_lost, float), "random-pages": (random_pages, int, int, float),
         "cycles": (cycles, int, int, int)}

if __name__ == "__main__":
    role, peer_hex, domains, *args = sys.argv[1:]
    function, *types = ROLES[role]
    peer_address, peer_descriptor = bootstrap.unpack(bytes.fromhex(peer_hex))
    function(peer_address, peer_descriptor, domains, *(kind(arg) for kind, arg in zip(types, args)))
