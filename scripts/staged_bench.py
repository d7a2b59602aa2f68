"""Two processes, 1 MiB pages: host and torch CUDA sources (the latter staged where the provider lacks
FI_HMEM), interleaved, into a host buffer or, with ``--target-memory cuda``, a torch CUDA tensor (a staged
target there: pages land in the target's lanes and are copied to the GPU before they count).

    python scripts/staged_bench.py [--rounds 5] [--nics 8] [--threads 4] [--target-memory host|cuda]

Each round runs both sources once: 2 warm-up transfers then 20 of 64 pages × 1 MiB (random destination
pages), byte-exact checked at the end of the round. Prints each round's GB/s and the medians with their
spread. A figure, never a pass/fail."""
import argparse
import hashlib
import subprocess
import sys

import numpy as np

from fabriclab import Engine, bootstrap

PAGE, PAGES, TRANSFERS, WARMUP = 1 << 20, 64, 20, 2


def target(provider: str, nics: int, threads: int, memory: str) -> None:
    with Engine(provider, nics=nics, threads=threads, pin=False, gpu=memory == "cuda") as engine:
        if memory == "cuda":
            import torch
            tensor = torch.zeros(PAGES * PAGE, dtype=torch.uint8, device="cuda")
            region = engine.register(tensor)
            print(f"target path {region.path}", file=sys.stderr, flush=True)
        else:
            buffer = np.zeros(PAGES * PAGE, np.uint8)
            region = engine.register(buffer)
        with bootstrap.Rendezvous() as rendezvous:
            print(rendezvous.port, flush=True)
            rendezvous.exchange(bootstrap.pack(engine.address, region.descriptor()))
        for line in sys.stdin:
            imm, count = (int(w) for w in line.split())
            engine.expect(imm, count, timeout=60).result()
            landed = tensor.cpu().numpy() if memory == "cuda" else buffer
            print(hashlib.sha256(landed).hexdigest(), flush=True)


def main() -> None:
    import time
    import torch
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--nics", type=int, default=8)
    parser.add_argument("--threads", type=int, default=4)
    parser.add_argument("--provider", default="shm")
    parser.add_argument("--target-memory", choices=("host", "cuda"), default="host")
    args = parser.parse_args()
    peer = subprocess.Popen([sys.executable, __file__, "--target", args.provider, str(args.nics), str(args.threads),
                             args.target_memory],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    port = int(peer.stdout.readline())
    with Engine(args.provider, nics=args.nics, threads=args.threads, pin=False) as engine:
        address, descriptor = bootstrap.unpack(bootstrap.exchange(port, b"bench"))
        remote = engine.connect(address)
        data = np.random.default_rng(1).integers(0, 256, PAGES * PAGE, dtype=np.uint8)
        sources = {"host": engine.register(data.copy()),
                   "cuda": engine.register(torch.from_numpy(data.copy()).cuda())}
        print({k: r.path for k, r in sources.items()})
        figures = {k: [] for k in sources}
        imm = 100
        for r in range(args.rounds):
            for kind, region in sources.items():
                dst = np.random.default_rng(r).permutation(PAGES)
                for _ in range(WARMUP):
                    remote.write_pages(region, np.arange(PAGES), descriptor, dst, PAGE).result(60)
                started = time.perf_counter()
                futures = [remote.write_pages(region, np.arange(PAGES), descriptor, dst, PAGE, imm=imm)
                           for _ in range(TRANSFERS)]
                for f in futures:
                    f.result(120)
                elapsed = time.perf_counter() - started
                peer.stdin.write(f"{imm} {PAGES * TRANSFERS}\n")
                peer.stdin.flush()
                got = peer.stdout.readline().strip()
                expected = np.empty_like(data)
                expected.reshape(PAGES, PAGE)[dst] = data.reshape(PAGES, PAGE)
                exact = got == hashlib.sha256(expected).hexdigest()
                imm += 1
                gbs = PAGES * PAGE * TRANSFERS / elapsed / 1e9
                figures[kind].append(gbs)
                print(f"round {r} {kind}: {gbs:.2f} GB/s byte-exact={exact}", flush=True)
        for kind, runs in figures.items():
            print(f"{kind}: median {np.median(runs):.2f} GB/s, spread {min(runs):.2f}-{max(runs):.2f} over {len(runs)}")
        print("staging", engine.stats()["staging"])
    peer.stdin.close()
    peer.wait(20)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--target"]:
        target(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5])
    else:
        main()
