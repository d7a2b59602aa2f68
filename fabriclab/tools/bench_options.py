"""The bench's option layer: every stage's options (each stage declares its own) and the harness's, and
``BenchConfig``, one run's settings, with a field of the same name and default for each option (the two
cannot drift: the defaults are read from the parser)."""
from __future__ import annotations

import argparse
from dataclasses import dataclass, fields

from .. import batched, cli, fi, memory, multi_nic, opqueue, rdma_write, threaded

#: stage name → its writer class
STAGES = {
    "rdma_write": rdma_write.Writer,
    "opqueue": opqueue.QueuedWriter,
    "multi_nic": multi_nic.MultiNicWriter,
    "threaded": threaded.ThreadedWriter,
    "batched": batched.BatchedWriter,
}


def size_list(text: str) -> list[int]:
    """argparse type for --sweep: page sizes separated by commas (4K,64K,1M)."""
    return [cli.positive_size(size) for size in text.split(",")]


def add_arguments(p) -> None:
    """Every stage's options (each stage declares its own) and the harness's."""
    cli.add_fabric_options(p)
    batched.add_batch_options(p)
    # A bench run starts its own target and may move gigabytes through emulated NICs on a busy host.
    p.set_defaults(timeout=30.0)
    harness = p.add_argument_group("the harness")
    harness.add_argument("--stage", default="opqueue", help=f"one of {', '.join(STAGES)} (default %(default)s)")
    runs = harness.add_mutually_exclusive_group()
    runs.add_argument("--sweep", type=size_list, metavar="SIZES",
                      help="run the stage once per page size, e.g. 4K,16K,64K,256K,1M (the same --total each)")
    runs.add_argument("--progression", action="store_true",
                      help="run chapters 7, 9-15 one after the other (each with its own techniques only; "
                           "--threads is the number of GPU groups in every chapter; 4 GiB per run unless --total "
                           "is given)")
    runs.add_argument("--api", action="store_true",
                      help="the same workload through fabriclab.Engine.write_pages and the stage-15 path, with the "
                           "Python cost per write_pages call")
    runs.add_argument("--defaults", action="store_true",
                      help="Engine() with its defaults against a sweep of Engine(nics=, threads=): two processes, "
                           "1024 x 64K and 64 x 1M pages, contiguous and permuted, plus the 8-thread memcpy ceiling")
    harness.add_argument("--rounds", type=int, default=3,
                         help="--api and --progression: interleaved runs of each path or chapter, compared by "
                              "their medians and min-max (default %(default)s)")
    harness.add_argument("--no-gpu-ipc", dest="gpu_ipc", action="store_false",
                         help="--api and --defaults with --memory cuda: the writing Engine(gpu_ipc=False), so that GPU "
                              "memory goes through the NICs or the staged path, not CUDA IPC")
    harness.add_argument("--no-verify", dest="verify", action="store_false",
                         help="skip the target's byte-exact check (pure speed)")
    harness.add_argument("--server-domain", default=None,
                         help="the target's domains when they differ from --domain (e.g. the other namespace's links)")
    harness.add_argument("--server-launcher", default="",
                         help='command prefix that starts the target, e.g. "ip netns exec fabriclab-a"')
    harness.add_argument("--line-rate", dest="line_rate_bps", type=cli.bits_per_second, default=0.0, metavar="RATE",
                         help="the links' aggregate rate (e.g. 3.2G, 100mbit): prints the %% of it that landed")
    harness.add_argument("--json", action="store_true",
                         help="print one JSON object per result, the last on the last line")
    harness.add_argument("--record", metavar="FILE", default=None,
                         help="--progression: also write the run as a recording (fabriclab.recorded): each run with "
                              "the machine it ran on and the command")


def _option_defaults() -> dict:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return vars(parser.parse_args([]))


#: Every option's default, as the command line has it: BenchConfig's defaults, so that the two cannot drift.
DEFAULTS = _option_defaults()


@dataclass
class BenchConfig:
    """One run's settings: a field for each of the command line's options that shape a run (``--page-size``
    is ``page_size``), with the same default and meaning. The stage writers read their options from it as
    from parsed arguments (``options_from_args``)."""
    stage: str = DEFAULTS["stage"]
    provider: str | None = DEFAULTS["provider"]
    domain: str | None = DEFAULTS["domain"]
    fabric: str | None = DEFAULTS["fabric"]  # both sides use it: it is $FABRICLAB_FABRIC while the bench runs
    timeout: float = DEFAULTS["timeout"]
    page_size: int = DEFAULTS["page_size"]
    total: int = DEFAULTS["total"]
    memory: str = DEFAULTS["memory"]
    in_flight: int = DEFAULTS["in_flight"]
    nics: int | None = DEFAULTS["nics"]
    groups: int = DEFAULTS["groups"]
    warmup: bool = DEFAULTS["warmup"]
    link_timeout: float | None = DEFAULTS["link_timeout"]  # a link silent this long is failed over (None: timeout/3)
    count_writes: bool = DEFAULTS["count_writes"]  # the target counts every write (the checking mode)
    threads: int | None = DEFAULTS["threads"]  # None: the stage decides (threaded.writer_threads)
    pin: bool = DEFAULTS["pin"]
    shard: bool = DEFAULTS["shard"]
    pad: bool = DEFAULTS["pad"]
    batch: int = DEFAULTS["batch"]
    lazy: bool = DEFAULTS["lazy"]
    fi_more: bool = DEFAULTS["fi_more"]
    verify: bool = DEFAULTS["verify"]
    server_domain: str | None = DEFAULTS["server_domain"]  # the target's domains if not the same (two namespaces)
    server_launcher: str = DEFAULTS["server_launcher"]  # the target's command prefix: "ip netns exec fabriclab-a"
    line_rate_bps: float = DEFAULTS["line_rate_bps"]  # the links' aggregate when known (a shaped testbed)

    @classmethod
    def from_args(cls, args) -> "BenchConfig":
        return cls(**{f.name: getattr(args, f.name) for f in fields(cls)})

    def writer_options(self) -> dict:
        """Constructor options of this stage's writer: each stage maps its own options and its ancestors'."""
        return STAGES[self.stage].options_from_args(self)

    @property
    def control_domain(self) -> str | None:
        return (self.domain or "").split(",")[0] or None

    def check(self) -> None:
        if self.stage not in STAGES:
            raise fi.UsageError(f"unknown stage {self.stage!r}; choose one of {', '.join(STAGES)}")
        if self.in_flight <= 0:
            raise fi.UsageError(f"pages in flight must be at least 1, got {self.in_flight}")
        if self.memory not in memory.MEMORY_KINDS:
            raise fi.UsageError(f"unknown memory kind {self.memory!r}; choose one of {', '.join(memory.MEMORY_KINDS)}")
