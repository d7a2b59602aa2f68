"""Prefill -> decode: move one request's KV-cache blocks from one process's cache into another's.

    python examples/kv_cache_transfer.py                 # GPU memory where there is a GPU, else host memory
    python examples/kv_cache_transfer.py --memory cuda   # GPU memory (torch, cupy or cuda-python) or fail
    python examples/kv_cache_transfer.py --memory host   # host memory (numpy)
    python examples/kv_cache_transfer.py --provider "tcp;ofi_rxm"

Both sides hold a KV cache shaped (layers, blocks, block_bytes): one page of ``block_bytes`` per
(layer, block) pair, holding the keys and values of one block of tokens for one layer (K and V are folded
into the block here). A finished prefill owns ``--request-blocks`` blocks scattered through its cache; the
decode side has given the request blocks of its own, scattered elsewhere. Page ``layer * blocks + block``
of one cache is therefore written to page ``layer * blocks + block'`` of the other, for every layer, with
one ``Peer.write_pages`` call that carries an immediate value (``imm``). The decode side waits on
``Engine.expect(imm, count)`` (no polling, no ordering), then checks the whole cache byte for byte: the
request's blocks equal the prefill's, every other block is still zero.

This script is the prefill side. It starts the decode side itself (the same file with ``--role decode``)
and swaps engine addresses and region descriptors with it over ``fabriclab.bootstrap`` -- a small TCP
helper for demos; any channel that moves bytes will do. Exit status 0 means byte-exact. On a machine with
a CUDA GPU both caches are GPU tensors (torch, else cupy, else bare cuda-python), and the engine moves them
NIC <-> GPU directly where the provider registers GPU memory (FI_HMEM), else staged through pinned host
memory; each side prints which. Without a GPU the caches are host arrays, and the script says why;
``--memory cuda`` makes that an error (exit status 1 before anything is sent).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys

import numpy as np

from fabriclab import Engine, TransferError, bootstrap, fi, gpu, memory
from fabriclab.cli import positive_seconds, positive_size

SUCCESS = "kv_cache_transfer: OK"


# ------------------------------------------------------------------------------------ small helpers


def cache_contents(args) -> np.ndarray:
    """The prefill's whole KV cache, a pure function of the seed (the decode side recomputes it to check)."""
    rng = np.random.default_rng(args.seed)
    n = args.layers * args.blocks * args.block_bytes
    return np.frombuffer(rng.bytes(n), dtype=np.uint8).reshape(args.layers, args.blocks, args.block_bytes)


def block_tables(args) -> tuple[np.ndarray, np.ndarray]:
    """Which blocks the request occupies in the prefill's cache, and which the decode side gave it."""
    rng = np.random.default_rng(args.seed + 1)
    src = rng.choice(args.blocks, size=args.request_blocks, replace=False)
    dst = rng.choice(args.blocks, size=args.request_blocks, replace=False)
    return src, dst


def pages(table: np.ndarray, args) -> np.ndarray:
    """Page numbers of the (layer, block) pairs of a block table, layer by layer."""
    return (np.arange(args.layers)[:, None] * args.blocks + table[None, :]).reshape(-1)


class DeviceArray:
    """GPU memory from cuda-python (``fabriclab.memory.CudaBuffer``) shown to the engine through
    ``__cuda_array_interface__``, for machines with cuda-python but neither cupy nor torch."""

    def __init__(self, shape):
        self.shape = tuple(shape)
        self.buffer = memory.CudaBuffer(int(np.prod(self.shape)))
        self.device = 0

    @property
    def __cuda_array_interface__(self):
        return {"shape": self.shape, "typestr": "|u1", "data": (self.buffer.pointer, False), "version": 3}


class Memory:
    """Where a cache lives: host (numpy) or GPU (torch, cupy, or bare cuda-python: the first that works).
    ``auto``: the GPU where one is usable, else host memory (``fallback`` says why)."""

    def __init__(self, kind: str):
        self.kind, self.lib, self.module, self.fallback = kind, None, None, ""
        if kind == "host":
            return
        self.lib, self.module, why = gpu_library()
        if self.lib is None and kind == "auto":
            self.kind, self.fallback = "host", why
        elif self.lib is None:
            raise SystemExit(f"--memory cuda needs a CUDA GPU and torch, cupy or cuda-python to allocate its memory; "
                             f"none is usable here ({why}). Run with --memory host.")
        else:
            self.kind = "cuda"

    def zeros(self, shape):
        if self.kind == "host":
            cache = np.empty(shape, dtype=np.uint8)
            cache.fill(0)  # touch every page now, not during the transfer
            return cache
        if self.lib == "cupy":
            return self.module.zeros(shape, dtype=self.module.uint8)
        if self.lib == "torch":
            return self.module.zeros(shape, dtype=self.module.uint8, device="cuda")
        cache = DeviceArray(shape)
        cache.buffer.write(np.zeros(cache.buffer.length, dtype=np.uint8))
        return cache

    def upload(self, cache, host: np.ndarray) -> None:
        if self.kind == "host":
            cache[...] = host
        elif self.lib == "cupy":
            cache.set(host)
        elif self.lib == "torch":
            cache.copy_(self.module.from_numpy(np.array(host)))  # writable copy (torch warns on read-only arrays)
        else:
            cache.buffer.write(host.reshape(-1))

    def download(self, cache) -> np.ndarray:
        if self.kind == "host":
            return cache
        if self.lib == "cupy":
            return self.module.asnumpy(cache)
        if self.lib == "torch":
            return cache.cpu().numpy()
        return cache.buffer.read().reshape(cache.shape)


def gpu_library():
    """(name, module, "") of the first usable way to allocate GPU memory, or (None, None, why none is)."""
    why = []
    for name in ("torch", "cupy"):
        try:
            module = __import__(name)
            usable = module.cuda.is_available() if name == "torch" else module.cuda.runtime.getDeviceCount() > 0
        except Exception as exc:  # not installed, or no driver/GPU behind it
            why.append(f"{name}: {type(exc).__name__}: {exc}".splitlines()[0])
            continue
        if usable:
            return name, module, ""
        why.append(f"{name}: imports but sees no CUDA device")
    status = gpu.cuda_status()
    if status == "ok":
        return "cuda-python", None, ""
    return None, None, "; ".join(why + [f"cuda-python: {status}"])


def open_engine(args) -> Engine:
    provider, domain = fi.same_host_fabric(args.provider)  # tcp stays on the loopback interface
    return Engine(provider, domains=args.domain or domain, nics=args.nics, threads=args.threads, pin=args.pin,
                  timeout=args.timeout)


def register(engine: Engine, cache, mem: Memory):
    try:
        return engine.register(cache)
    except fi.UsageError as exc:
        if mem.kind == "cuda":
            raise SystemExit(f"--memory cuda: the engine cannot register GPU memory here: {exc}") from None
        raise


# ------------------------------------------------------------------------------------------- decode


def decode(args) -> int:
    mem = Memory(args.memory)
    shape = (args.layers, args.blocks, args.block_bytes)
    with open_engine(args) as engine:
        cache = mem.zeros(shape)
        region = register(engine, cache, mem)
        # Join: our address and where to write; the reply is the plan (which blocks, which imm, how often).
        plan = json.loads(bootstrap.exchange(args.port, bootstrap.pack(engine.address, region.descriptor()),
                                             timeout=args.timeout))
        writes = args.layers * args.request_blocks
        arrived = [engine.expect(plan["imm"] + r, writes) for r in range(plan["rounds"])]
        for future in arrived:
            future.result()  # TransferTimeout after the engine's deadline if writes go missing
        got = mem.download(cache)
        want = np.zeros(shape, dtype=np.uint8)
        src, dst = block_tables(args)
        want[:, dst] = cache_contents(args)[:, src]
        exact = np.array_equal(got, want)
        bad = 0 if exact else int(np.count_nonzero(np.any(got != want, axis=2)))
        digest = hashlib.sha256(np.ascontiguousarray(got[:, dst])).hexdigest()[:16]
        report = {"exact": exact, "bad_pages": bad, "digest": digest}
        print(f"[decode] cache in {region.path} memory; {plan['rounds']} x {writes} writes with imm "
              f"{plan['imm']}.. arrived; "
              f"{'byte-exact' if exact else f'{bad} pages differ'} (request blocks sha256 {digest}...)", flush=True)
        bootstrap.exchange(args.port, bootstrap.pack(b"done", json.dumps(report).encode()), timeout=args.timeout)
        region.close()
    return 0 if exact else 1


# ------------------------------------------------------------------------------------------ prefill


def child_command(args, port: int, memory_kind: str) -> list[str]:
    command = [sys.executable, os.path.abspath(__file__), "--role", "decode", "--port", str(port),
               "--memory", memory_kind]
    for name in ("layers", "blocks", "block_bytes", "request_blocks", "seed", "timeout"):
        command += [f"--{name.replace('_', '-')}", str(getattr(args, name))]
    for name in ("provider", "domain", "nics", "threads"):
        if getattr(args, name) is not None:
            command += [f"--{name}", str(getattr(args, name))]
    return command + (["--pin"] if args.pin else [])


def prefill(args) -> int:
    mem = Memory(args.memory)
    shape = (args.layers, args.blocks, args.block_bytes)
    src, dst = block_tables(args)
    total = args.layers * args.request_blocks * args.block_bytes
    with open_engine(args) as engine, bootstrap.Rendezvous(timeout=args.timeout) as rendezvous:
        cache = mem.zeros(shape)
        mem.upload(cache, cache_contents(args))
        region = register(engine, cache, mem)
        where = mem.kind if mem.lib is None else f"{mem.kind}, {mem.lib}, {region.path}"
        if mem.fallback:
            where += f"; no GPU here: {mem.fallback}"
        print(f"[prefill] {engine.provider}, {engine.nics} NIC(s), {engine.threads} thread(s); KV cache "
              f"{args.layers} layers x {args.blocks} blocks x {args.block_bytes} B = {np.prod(shape) / 2**20:.0f} MiB "
              f"({where}); request: {args.request_blocks} blocks = {total / 2**20:.1f} MiB, "
              f"{args.layers * args.request_blocks} pages", flush=True)
        child = subprocess.Popen(child_command(args, rendezvous.port, mem.kind))
        try:
            plan = {"imm": args.imm, "rounds": args.rounds}
            address, descriptor = bootstrap.unpack(rendezvous.exchange(json.dumps(plan).encode()))
            peer = engine.connect(address)
            route, why = peer.route(region, descriptor)
            print(f"[prefill] writes go {route}" + (f" (not cuda-ipc: {why})" if why else ""), flush=True)
            rates = []
            for r in range(args.rounds):
                done = peer.write_pages(region, pages(src, args), descriptor, pages(dst, args), args.block_bytes,
                                        imm=args.imm + r)
                result = done.result()  # TransferTimeout / PeerLost, each saying whether `cache` is reusable
                rates.append(result.bytes * 8 / result.elapsed_s / 1e9)
            tag, report = bootstrap.unpack(rendezvous.exchange(b"bye"))
            report = json.loads(report)
            status = child.wait(args.timeout)
        except BaseException:
            child.kill()
            child.wait()
            raise
        stats = engine.stats()
    per_nic = ", ".join(f"nic{n['nic']} {n['writes']} writes" for n in stats["per_nic"])
    print(f"[prefill] per NIC: {per_nic}")
    if status != 0 or tag != b"done" or not report["exact"]:
        print(f"kv_cache_transfer: FAILED (decode exit {status}, {report.get('bad_pages')} pages differ)")
        return 1
    print(f"{SUCCESS}: {args.rounds} x {total / 2**20:.1f} MiB ({args.layers} layers x {args.request_blocks} "
          f"blocks of {args.block_bytes} B) prefill -> decode byte-exact; best {max(rates):.2f} Gbps, "
          f"median {float(np.median(rates)):.2f} Gbps")
    return 0


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--role", choices=("prefill", "decode"), default="prefill",
                   help="prefill (default) starts the decode side itself")
    p.add_argument("--port", type=int, help="(decode) the prefill's bootstrap port")
    p.add_argument("--provider", help="libfabric provider (default: $FABRICLAB_PROVIDER, else the best here)")
    p.add_argument("--domain", help="NIC/domain (tcp: default lo)")
    p.add_argument("--nics", type=int, help="NIC slots (default: every domain; more adds emulated ones)")
    p.add_argument("--threads", type=int, help="engine worker threads (default: from the topology)")
    p.add_argument("--pin", action="store_true", help="pin worker threads (off: this demo runs two engines on "
                                                      "one host)")
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--blocks", type=int, default=64, help="blocks per layer in each cache")
    p.add_argument("--block-bytes", type=positive_size, default=64 << 10, help="bytes per (layer, block) page")
    p.add_argument("--request-blocks", type=int, default=24, help="blocks of the request moved")
    p.add_argument("--rounds", type=int, default=5, help="transfers of the request (best/median Gbps)")
    p.add_argument("--imm", type=int, default=1000, help="immediate value of round 0 (round r: imm + r)")
    p.add_argument("--seed", type=int, default=17)
    p.add_argument("--memory", choices=("auto", "host", "cuda"), default="auto",
                   help="where both caches live: auto (default) = the GPU where there is one, else host")
    p.add_argument("--timeout", type=positive_seconds, default=30.0, help="deadline of every transfer and wait, seconds")
    args = p.parse_args(argv)
    if not 0 < args.request_blocks <= args.blocks:
        p.error("--request-blocks must be between 1 and --blocks")
    if args.role == "decode" and args.port is None:
        p.error("--role decode needs --port (the prefill starts it with one)")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    return decode(args) if args.role == "decode" else prefill(args)


if __name__ == "__main__":
    try:
        sys.exit(main())
    except (TransferError, fi.FabricError, fi.UsageError) as exc:
        print(f"kv_cache_transfer: FAILED: {type(exc).__name__}: {exc}", file=sys.stderr)
        sys.exit(1)
