#!/usr/bin/env python3
"""Peers coming and going, for as long as you like: a soak of the address-vector bookkeeping (issue 31).

    .venv/bin/python scripts/soak_peers.py --count 10000 [--provider shm] [--domain lo] [--only writers|targets]

writers: one staged target (host memory staged on purpose, ``Engine._register_staged_host``: the landing
protocol without a GPU) serves COUNT writers in turn, each a fresh Engine in a child process writing one page
through the target's landing lanes (REQUEST, GRANT, FILLED, COPIED over the control channel). targets: one
writer Engine reaches COUNT target engines in turn (a child process opens each, waits for one page, closes it);
the writer closes every other Peer and drops the rest unclosed. Each phase prints its progress every tenth
of the count (with this process's memory maps while its engine is open: shm maps every peer's region), then:
count, elapsed seconds, rate per second, and, before (after a first engine opened and closed) and after, this
process's open file descriptors, threads and memory maps, the files in /dev/shm (all, and those named after
this process or its children), and the engine's address-vector counts (control peers of the target; peer
entries of the writer). A failure stops the phase and says where. On shm the writers phase is refused where
the target would keep more than half the available memory mapped (every writer's region, ~4 MiB: README)."""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from typing import Any

PAGE = 65536


def _engine(args: argparse.Namespace, **options: Any) -> Any:
    from fabriclab import Engine
    return Engine(args.provider, domains=args.domain, pin=False, nics=1, gpu=False, timeout=10, **options)


def _child(args: argparse.Namespace, role: str, *extra: str) -> subprocess.Popen[str]:
    command = [sys.executable, __file__, "--role", role, "--count", str(args.count), "--provider", args.provider,
               *(["--domain", args.domain] if args.domain else []), *extra]
    child = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    _PIDS.add(child.pid)
    return child


_PIDS = {os.getpid()}  # this process and its children: their shm regions are named after them


def _maps() -> int:
    with open("/proc/self/maps") as maps:
        return sum(1 for _ in maps)


def _shared_kib() -> int:
    """Shared memory this process has touched and still maps (RssShmem: peers' shm regions among it)."""
    with open("/proc/self/status") as status:
        return next((int(line.split()[1]) for line in status if line.startswith("RssShmem:")), 0)


def _resources() -> dict[str, int]:
    """This process's file descriptors, threads and memory maps, and the files in /dev/shm (all of them, and
    those named after this process or its children)."""
    files = os.listdir("/dev/shm")
    ours = sum(1 for name in files if name.split(":")[0].isdigit() and int(name.split(":")[0]) in _PIDS)
    return {"fds": len(os.listdir("/proc/self/fd")), "threads": len(os.listdir("/proc/self/task")),
            "maps": _maps(), "rss_shmem_kib": _shared_kib(), "dev_shm_files": len(files), "dev_shm_ours": ours}


def _report(phase: str, done: int, started: float, before: dict[str, int], counts: dict[str, Any],
            failure: str = "") -> None:
    elapsed = time.monotonic() - started
    print(json.dumps({"phase": phase, "count": done, "elapsed_s": round(elapsed, 1),
                      "rate_per_s": round(done / elapsed, 1) if elapsed else 0.0, "before": before,
                      "after": _resources(), **counts, **({"failure": failure} if failure else {})}), flush=True)


def _shmem_mib() -> int:
    """The host's shared memory in use (/proc/meminfo Shmem: /dev/shm files, and unlinked ones still mapped)."""
    with open("/proc/meminfo") as meminfo:
        return next(int(line.split()[1]) >> 10 for line in meminfo if line.startswith("Shmem:"))


def _peer_regions() -> int:
    """The shm regions of other processes this process maps (its peers' endpoints, live or gone)."""
    with open("/proc/self/maps") as maps:
        return len({line.split(maxsplit=5)[5] for line in maps if "/dev/shm/" in line
                    and not line.split(maxsplit=5)[5].startswith(f"/dev/shm/{os.getpid()}:")})


def writers_phase(args: argparse.Namespace) -> bool:
    """One staged target, COUNT fresh writer engines in turn (a child process). On shm the target maps each
    writer's region while the writer lives (README): the progress lines say how many it maps."""
    import numpy as np
    from fabriclab import bootstrap
    before, started = _resources(), time.monotonic()
    with _engine(args) as target:
        buffer = np.zeros(16 * PAGE, np.uint8)
        region = target._register_staged_host(buffer)
        writers = _child(args, "writers", bootstrap.pack(target.address, region.descriptor()).hex())
        assert writers.stdout is not None
        done, failure = 0, ""
        for line in writers.stdout:
            if line.startswith("wrote"):
                done = int(line.split()[1])
                stats = target.stats()
                staging, entries = stats["staging"], stats["peer_entries"]
                print(f"  writers: {done} ({staging['control_peers']} control peers held, "
                      f"{staging['control_peers_removed']} removed; {entries['writers_reaching']} writers' NIC "
                      f"entries held, {entries['removed']} removed; {_peer_regions()} peers' regions, {_maps()} "
                      f"memory maps, {_shared_kib()} KiB of shared memory mapped; {_shmem_mib()} MiB of shared "
                      "memory on the host)", flush=True)
            else:
                failure = line.strip()
        writers.wait()
        writers.stdout.close()
        assert writers.stdin is not None
        writers.stdin.close()
        stats = target.stats()
        counts = {key: stats["staging"][key] for key in ("control_peers", "control_peers_removed",
                                                          "bad_control_messages")}
        counts.update(writers_reaching=stats["peer_entries"]["writers_reaching"],
                      entries_removed=stats["peer_entries"]["removed"], peers_regions_mapped=_peer_regions())
    _report("writers", done, started, before, counts, failure)
    return not failure and done == args.count


def targets_phase(args: argparse.Namespace) -> bool:
    """One writer engine, COUNT target engines in turn (a child process)."""
    import numpy as np
    from fabriclab import bootstrap
    before, started = _resources(), time.monotonic()
    done, failure = 0, ""
    with _engine(args) as writer:
        source = writer.register(np.ones(PAGE, np.uint8))
        targets = _child(args, "targets")
        assert targets.stdin is not None and targets.stdout is not None
        try:
            for i in range(args.count):
                address, descriptor = bootstrap.unpack(bytes.fromhex(targets.stdout.readline()))
                peer = writer.connect(address)
                peer.write_pages(source, [0], descriptor, [0], PAGE, imm=i % 1000).result(10)
                if i % 2:
                    peer.close()
                del peer
                targets.stdin.write(f"{i % 1000}\n")
                targets.stdin.flush()
                if targets.stdout.readline().strip() != "landed":
                    raise RuntimeError(f"target {i} did not see its page land")
                done = i + 1
                if done % max(args.count // 10, 1) == 0:
                    print(f"  targets: {done} ({writer.stats()['peer_entries']}; {_maps()} memory maps, "
                          f"{_shared_kib()} KiB of shared memory mapped)", flush=True)
        except Exception as exc:  # said in the report: the soak is over either way
            failure = f"target {done}: {type(exc).__name__}: {exc}"
        finally:
            targets.stdin.close()
            targets.wait(30)
            targets.stdout.close()
        counts = {"peer_entries": writer.stats()["peer_entries"]}
    _report("targets", done, started, before, counts, failure)
    return not failure


def writers_role(args: argparse.Namespace) -> None:
    """Child: COUNT fresh engines in turn, each writing one page into the packed target."""
    import numpy as np
    from fabriclab import bootstrap
    address, descriptor = bootstrap.unpack(bytes.fromhex(args.extra[0]))
    for i in range(args.count):
        try:
            with _engine(args) as writer:
                source = writer.register(np.full(PAGE, i % 251, np.uint8))
                writer.connect(address).write_pages(source, [0], descriptor, [i % 16], PAGE).result(10)
        except Exception as exc:  # the parent reports it
            print(f"writer {i}: {type(exc).__name__}: {exc}", flush=True)
            return
        if (i + 1) % max(args.count // 10, 1) == 0 or i + 1 == args.count:
            print(f"wrote {i + 1}", flush=True)


def targets_role(args: argparse.Namespace) -> None:
    """Child: COUNT target engines in turn; each prints (address, descriptor) and waits for one page."""
    import numpy as np
    from fabriclab import bootstrap
    for _ in range(args.count):
        with _engine(args) as target:
            region = target.register(np.zeros(PAGE, np.uint8))
            print(bootstrap.pack(target.address, region.descriptor()).hex(), flush=True)
            imm = sys.stdin.readline()
            if not imm:
                return
            target.expect(int(imm), 1, timeout=10).result()
            print("landed", flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--count", type=int, default=1000)
    parser.add_argument("--provider", default="shm")
    parser.add_argument("--domain", default=None)
    parser.add_argument("--only", choices=("writers", "targets"))
    parser.add_argument("--role", choices=("writers", "targets"), help=argparse.SUPPRESS)
    parser.add_argument("extra", nargs="*", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.role:
        (writers_role if args.role == "writers" else targets_role)(args)
        return 0
    with _engine(args):
        pass  # the libraries loaded, the provider started: what the phases leave is measured from here
    ok = True
    for phase in ("writers", "targets"):
        if args.only in (None, phase):
            ok &= (writers_phase if phase == "writers" else targets_phase)(args)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
