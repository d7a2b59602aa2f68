"""A GPU target for the CUDA IPC tests: an Engine with one torch CUDA region at an offset inside a larger
allocation (as torch's caching allocator hands them out), waiting for writes.

    python tests/ipc_peer.py SIZE OFFSET [--no-ipc] [--device=N] [--chunk=BYTES]
prints the packed (address, descriptor) as one hex line, then answers commands, one per line:
"expect IMM COUNT TIMEOUT" -> "landed COUNT sha256=..." (of the region's bytes) or "timeout"; "close-region"
(closes the region, frees its allocation and empties torch's cache, then fills a new allocation of the
same size with 7s) -> "closed"; "filler" -> "filler-ok" or "filler-bad" (whether that allocation still
holds only 7s); "close-engine" -> "engine-closed" (the process and its memory stay); "offered" -> "True"/"False" and the reason where not. --chunk sets the staging chunk (a landing lane), with 16
lanes."""
import hashlib
import sys

import torch

from fabriclab import Engine, TransferTimeout, bootstrap

size, offset = int(sys.argv[1]), int(sys.argv[2])
chunk = next((int(a.split("=", 1)[1]) for a in sys.argv[3:] if a.startswith("--chunk=")), None)
sizes = {} if chunk is None else {"staging_chunk_bytes": chunk, "staging_bytes": 16 * chunk}  # a landing lane each
with Engine("shm", pin=False, timeout=10, gpu_ipc="--no-ipc" not in sys.argv[3:], **sizes) as engine:
    device = next((a.split("=", 1)[1] for a in sys.argv[3:] if a.startswith("--device=")), "0")
    whole = torch.zeros(offset + size + 4096, dtype=torch.uint8, device=f"cuda:{device}")
    tensor = whole[offset:offset + size]
    region = engine.register(tensor)
    print(bootstrap.pack(engine.address, region.descriptor()).hex(), flush=True)
    filler = None
    for line in sys.stdin:
        words = line.split()
        if words[0] == "expect":
            try:
                engine.expect(int(words[1]), int(words[2]), timeout=float(words[3])).result()
                torch.cuda.synchronize()
                digest = hashlib.sha256(tensor.cpu().numpy().tobytes()).hexdigest()
                print(f"landed {words[2]} sha256={digest}", flush=True)
            except TransferTimeout:
                print("timeout", flush=True)
        elif words[0] == "close-region":
            region.close()
            del tensor, whole, region
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            filler = torch.full((offset + size + 4096,), 7, dtype=torch.uint8, device=f"cuda:{device}")
            print("closed", flush=True)
        elif words[0] == "filler":
            torch.cuda.synchronize()
            print("filler-ok" if bool((filler == 7).all()) else "filler-bad", flush=True)
        elif words[0] == "close-engine":
            engine.close()
            print("engine-closed", flush=True)
        elif words[0] == "offered":
            print(region.ipc_offered, region.ipc_why, flush=True)
