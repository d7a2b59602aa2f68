"""A writer process for tests/test_course_target.py: a stage writer in a process of its own (so that it can
be SIGKILLed mid-run, or run the modeled NICs in payload mode, which libfabric reads once per process).

    python tests/course_writer.py PROVIDER DOMAIN ADDRESS THREADS GROUPS NICS TOTAL ROUNDS [count]
THREADS 0: chapter 9's MultiNicWriter (one thread walking GROUPS groups), else a BatchedWriter with THREADS
threads over GROUPS groups. ROUNDS transfers of TOTAL bytes in 4 KiB pages; "count": the checking mode.
Prints "prepared" before each transfer starts, then one JSON line for it: {"report": the target's Report,
"writes", "threads", "marks_sent": the writer's marked writes, "of_slot": each NIC's group}."""
import dataclasses
import json
import sys

from fabriclab import batched, fi, memory, multi_nic, rdma_write

provider, domain, address, threads, groups, nics, total, rounds = sys.argv[1:9]
domain = None if domain == "-" else domain
threads, groups, nics, total, rounds = int(threads), int(groups), int(nics), int(total), int(rounds)
count = sys.argv[9:] == ["count"]
if provider == fi.MODELED_PROVIDER:
    fi.load_modeled_provider()

stack = memory.open_endpoint(provider, domain, "host")
options = dict(domains=domain, nics=nics, groups=groups, warmup=True, **({"count_writes": True} if count else {}))
if threads:
    writer = batched.BatchedWriter(stack, address, 10, threads=threads, **options)
else:
    writer = multi_nic.MultiNicWriter(stack, address, 10, **options)
with writer:
    for r in range(rounds):
        writer.prepare(rdma_write.PagePlan.for_total(4096, total, buffer_bytes=min(total, 1 << 20)), seed=r + 1)
        print("prepared", flush=True)
        stats = writer.transfer()
        report = writer.finish()
        print(json.dumps({"report": dataclasses.asdict(report), "writes": stats.writes, "threads": stats.threads,
                          "marks_sent": getattr(writer, "marks", None), "of_slot": list(writer.nic_groups.of_slot)}),
              flush=True)
        writer.release()
stack.close()
