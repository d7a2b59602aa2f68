"""The native engine (``native/core.c``, ``course.c``, ``service.c``) as Python drives it.

:class:`NativeEngine` wraps one ``fl_engine`` over a :class:`~fabriclab.nics.NicSet`. ``fabriclab.Engine`` runs
it as a service through the methods of its second half; the course's stages (``fabriclab.multi_nic`` and after)
run its write loop with :func:`write_run` and its target loop through a :class:`NativeTarget`. Neither touches
the cffi struct or ``lib`` itself: this module is the one place that knows the native engine's layout.
"""
from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from . import fi, memory
from ._fabric import ffi, lib
from .nics import NicSet

if TYPE_CHECKING:
    from .config import EngineConfig

RING_CAPACITY = 4096  # pending writes per NIC (fl_nic.ring)
MAX_NICS, MAX_THREADS = lib.FL_MAX_NICS, lib.FL_MAX_THREADS
# How long fabriclab waits for one of its threads (an engine's workers and reaper, the landing and staging
# threads, a course target loop) to leave a provider call before it takes the thread for stuck and leaves
# it, with everything it may touch, alive for the life of the process: native/service.h (fl_service_stop)
# says why, and is where the figure is set (FL_STOP_TIMEOUT_S, fl_engine_free's own wait).
WORKER_EXIT_TIMEOUT: float = lib.FL_STOP_TIMEOUT_S
MAX_BATCH = 1 << 16  # writes enqueued per pass: far more than any queue takes at once
NO_IMM = lib.FL_NO_IMM  # the immediate data of a write whose caller gave none (targets still see traffic)
NO_TRANSFER = lib.FL_NO_TRANSFER  # a request whose writes each name their transfer (Routes.batch)
# A caller's immediate data fits the low FL_IMM_VALUE_BITS bits; the bits above carry how many pages a write
# moves (minus one), so a coalesced write counts as its pages at the target: at most MAX_PAGES_PER_WRITE.
MAX_IMM = (1 << lib.FL_IMM_VALUE_BITS) - 2
MAX_PAGES_PER_WRITE = 1 << (32 - lib.FL_IMM_VALUE_BITS)
# Writes into a staged target's landing lane carry LANDING_VALUE in the value bits (never a caller's) and the
# lane above them; the target counts each lane on its own (fabriclab.landing). Lane MAX_LANES would be NO_IMM.
LANDING_VALUE = lib.FL_LANDING_VALUE
MAX_LANES = (NO_IMM >> lib.FL_IMM_VALUE_BITS)


# fl_imm_await / fl_imm_credit (native/imm.h): counted; every slot of the table held; arrivals of the value were
# not counted (the table was full when they came); not a caller's value
IMM_OK, IMM_FULL, IMM_LOST, IMM_BAD = lib.FL_IMM_OK, lib.FL_IMM_FULL, lib.FL_IMM_LOST, lib.FL_IMM_BAD
MAX_IMM_COUNT = lib.FL_IMM_MAX_COUNT  # the most pages of one value the engine counts


def lane_imm(lane: int) -> int:
    """The immediate data of writes into landing lane ``lane``."""
    return int((lane << lib.FL_IMM_VALUE_BITS) | LANDING_VALUE)
# per transfer id, in the array attach_transfers returns: writes still to finish, the first error
# (negative), writes given up on that the provider may still be reading, and callers looking for its end
TRANSFER_FIELDS = lib.FL_TRANSFER_FIELDS
WAIT_BATCH = 1024  # finished transfer ids one wait() hands back at most
# Native engines that threads stuck inside a provider call still use (fl_service_stop left them
# allocated): kept for the life of the process, with the arrays the C engine counts into.
_STRANDED: list["NativeEngine"] = []

_ROUTE_FIELDS = ("desc", "dest", "remote_base", "rkey")
#: numpy's view of native/core.h's fl_route (one NIC slot's way to a peer's region), offsets taken from the
#: compiled struct: a request's routes are an array of these, one per NIC slot.
ROUTE_DTYPE = np.dtype({"names": list(_ROUTE_FIELDS), "formats": ["<u8"] * len(_ROUTE_FIELDS),
                        "offsets": [ffi.offsetof("fl_route", f) for f in _ROUTE_FIELDS],
                        "itemsize": ffi.sizeof("fl_route")})


def route_descriptors(registrations: list[memory.Registration]) -> list[int]:
    """Each registration's local memory descriptor (fi_mr_desc) as a route's ``desc`` holds it: an integer."""
    return [int(ffi.cast("uintptr_t", r.mr.desc)) for r in registrations]


class Routes:
    """How a pair (local region, peer's region) is written, as the native engine reads it: per NIC slot our
    descriptor, the peer's address, base and key (``array``, ROUTE_DTYPE), and the slots the local region's
    writes leave through (``nic_order``, uint16 slot numbers; None: every slot in turn). Made once per pair;
    every transfer that uses it keeps it alive (the workers move writes to other NICs through it)."""

    __slots__ = ("array", "nic_order", "_c", "_order_c")

    def __init__(self, array: np.ndarray, nic_order: np.ndarray | None = None) -> None:
        if nic_order is not None and (not nic_order.size or int(nic_order.max()) >= array.size):
            raise fi.UsageError(f"NIC order {list(nic_order)} must name slots below {array.size}")
        self.array, self.nic_order = array, nic_order
        self._c = ffi.from_buffer("fl_route[]", array)
        self._order_c = ffi.NULL if nic_order is None else ffi.from_buffer("uint16_t[]", nic_order)

    def request(self, local_base: int, src: np.ndarray | list[int], dst: np.ndarray | list[int],
                stride: int, lengths: np.ndarray | list[int] | int, imm: int, first_nic: int,
                pages_in_imm: bool = False) -> Request:
        """A request of ``len(src)`` writes: write i moves ``lengths[i]`` bytes (``lengths`` bytes when it is one
        integer) from ``local_base + src[i] * stride`` to ``dst[i] * stride`` of the peer's region, over NIC
        slot ``(first_nic + i) % nics`` (or the slot ``nic_order`` names there) through these routes.
        Every write carries ``imm`` (NO_IMM when the caller gave none); with ``pages_in_imm``, also how many
        pages (``lengths[i] // stride``) it moves, which the target counts. A few writes may come as lists of
        Python ints (no numpy work)."""
        uniform = isinstance(lengths, (int, np.integer))
        if isinstance(src, list):
            src_c, dst_c = ffi.new("int64_t[]", src), ffi.new("int64_t[]", dst)
            lengths_c = ffi.NULL if uniform else ffi.new("uint64_t[]", lengths)
        else:
            src, dst = np.ascontiguousarray(src, dtype=np.int64), np.ascontiguousarray(dst, dtype=np.int64)
            src_c, dst_c = ffi.from_buffer("int64_t[]", src), ffi.from_buffer("int64_t[]", dst)
            lengths_c = ffi.NULL if uniform else ffi.from_buffer("uint64_t[]",
                                                                  np.ascontiguousarray(lengths, np.uint64))
        c = ffi.new("fl_request *")
        c.routes, c.local_base, c.src, c.dst, c.stride = self._c, local_base, src_c, dst_c, stride
        c.lengths, c.length, c.count, c.imm = lengths_c, lengths if uniform else 0, len(src), imm
        c.first_nic, c.pages_in_imm, c.nic_order = first_nic, int(pages_in_imm), self._order_c
        c.nic_count = 0 if self.nic_order is None else self.nic_order.size
        return Request(c, (src_c, dst_c, lengths_c, self))

    def batch(self, local_base: int, src: list[int], dst: list[int], stride: int, lengths: list[int],
              transfers: list[int], imms: list[int], first_nic: int) -> Request:
        """A request of the writes of several transfers (Peer.write_batch): as :meth:`request` with
        ``pages_in_imm``, write i counted against transfer id ``transfers[i]`` and carrying ``imms[i]``."""
        request = self.request(local_base, src, dst, stride, lengths, NO_IMM, first_nic, pages_in_imm=True)
        transfers_c, imms_c = ffi.new("uint32_t[]", transfers), ffi.new("uint64_t[]", imms)
        request._c.transfers, request._c.imms = transfers_c, imms_c
        request._keep += (transfers_c, imms_c)
        return request


class Request:
    """One request as the service takes it (made by :meth:`Routes.request`). The native struct points
    into the arrays it was made from, so it keeps them alive."""

    __slots__ = ("_c", "_keep")

    def __init__(self, c: Any, keep: tuple[Any, ...]):
        self._c, self._keep = c, keep


class NativeEngine:
    """An fl_engine over a NicSet: fills one fl_nic per slot and runs the C loops in a Python thread,
    so that Ctrl-C (KeyboardInterrupt) stops the engine and the interpreter stays usable."""

    def __init__(self, nics: NicSet, registrations: list[memory.Registration] | None = None):
        self.nics = nics
        self._ptr = lib.fl_engine_new(len(nics.slots), RING_CAPACITY)
        if self._ptr == ffi.NULL:
            raise MemoryError("fl_engine_new")
        for slot in nics.slots:
            n = self._ptr.nics[slot.index]
            n.ep = slot.ep._ptr
            n.cq = slot.cq._ptr
            n.max_in_flight = max(1, slot.info.tx_size)
            n.cq_data_size = slot.info.cq_data_size
            if registrations:
                n.desc = registrations[slot.index].mr.desc

    def use_staging(self, registration: memory.Registration, outbound: bool) -> None:
        """Have the C threads copy each page between the GPU and the registered pinned copy."""
        if registration.staging is None:
            return
        hooks = registration.staging_hooks(outbound)
        c = self._ptr.course
        c.stage_device_base, c.stage_host_base = hooks["device"], hooks["host"]
        c.stage_copy = ffi.cast("int (*)(uint64_t, uint64_t, size_t)", hooks["copy"])
        c.stage_set_context = ffi.cast("int (*)(void *)", hooks["set_context"])
        c.stage_context = ffi.cast("void *", hooks["context"])

    def set_peer(self, index: int, dest: int, remote: fi.RemoteRegion) -> None:
        n = self._ptr.nics[index]
        n.dest = dest
        n.remote_base = remote.base
        n.rkey = remote.key

    def nic(self, index: int) -> Any:
        return self._ptr.nics[index]

    def limit_in_flight(self, writes: int) -> None:
        """At most ``writes`` writes in flight on each NIC (never more than its provider's tx queue takes)."""
        for slot in self.nics.slots:
            n = self._ptr.nics[slot.index]
            n.max_in_flight = min(n.max_in_flight, writes)

    def run(self, call: Callable[..., int], *args: Any, timeout: float, tick: Callable[[], None] | None = None) -> None:
        """Run a blocking engine call (the GIL is released inside it) in a thread; raise on its error.
        However the wait ends (Ctrl-C included, even during the thread's start), the engine is told to
        stop and its threads are joined before this returns, so it is never freed under them. ``tick``,
        if given, is called every 50 ms of the wait (the course's writers tell their target they live)."""
        result: dict[str, int] = {}
        launched, finished = threading.Event(), threading.Event()

        def body() -> None:
            launched.set()
            try:
                result["rc"] = call(self._ptr, *args)
            finally:
                finished.set()

        self._ptr.stop = 0
        self._running: tuple[threading.Event, threading.Event] | None = (launched, finished)
        try:
            threading.Thread(target=body, daemon=True).start()
            while not finished.wait(0.05):
                if tick is not None:
                    tick()
        finally:
            self._join_worker()
        if result.get("rc", -1) != 0:
            raise fi.FabricError("fabriclab engine", result.get("rc", -lib.FI_EIO), message=f"engine: {self.error}")

    @property
    def error(self) -> str:
        """Why the engine's last run or service failed (empty when it did not)."""
        return str(ffi.string(self._ptr.error).decode(errors="replace"))

    def _join_worker(self) -> None:
        running = getattr(self, "_running", None)
        if running is None:
            return
        launched, finished = running
        if not launched.wait(1.0):
            self._running = None  # the thread never came to life
            return
        while not finished.is_set():
            self._ptr.stop = 1
            try:
                finished.wait(0.1)
            except KeyboardInterrupt:
                pass  # already stopping
        self._running = None

    def counters(self) -> list[dict[str, Any]]:
        out = []
        for slot in self.nics.slots:
            n = self._ptr.nics[slot.index]
            out.append({"nic": slot.index, "domain": slot.domain_name, "emulated": slot.emulated, "group": n.group,
                        "bytes": int(n.bytes), "writes": int(n.writes), "completions": int(n.completions),
                        "eagain": int(n.eagain), "cq_polls": int(n.cq_polls), "errors": int(n.errors),
                        "arrivals": int(n.arrivals), "more_flushes": int(n.more_flushes),
                        "passes": int(n.passes),
                        "down": ffi.string(n.down_why).decode(errors="replace"),
                        "resent": int(n.resent), "unreported": int(n.unreported), "retried": int(n.retried),
                        "renewals": int(n.renewals)})
        return out

    def close(self) -> int:
        """Free the native engine (stopping its service first). Returns 0, or how many threads were stuck in it
        (see :meth:`stop_service`): then it stays allocated, and so does what it points into, for the life
        of the process."""
        left = 0
        if self._ptr is not None and self._ptr != ffi.NULL:
            self._join_worker()
            left = lib.fl_engine_free(self._ptr)
            if left:
                _STRANDED.append(self)
        self._ptr = None
        return left

    # ------------------------------------------------------------------- the service (fabriclab.Engine)

    def attach_transfers(self, transfers: int) -> np.ndarray:
        """Room for ``transfers`` transfer ids: TRANSFER_FIELDS int64 counters each, which the worker threads
        update and the caller reads and sets (an id's writes before it hands them over). Returns that array,
        kept alive here as long as the engine that writes into it."""
        self._transfers = np.zeros(TRANSFER_FIELDS * transfers, dtype=np.int64)
        self._ptr.service.transfers = ffi.cast("int64_t *", self._transfers.ctypes.data)
        self._ptr.service.transfer_capacity = transfers
        return self._transfers

    def attach_immediates(self, most: int) -> None:
        """Count arriving immediate data, for :meth:`take_immediates`: at most ``most`` values at once, each
        awaited (:meth:`await_immediates`) or holding arrivals not taken yet."""
        rc = lib.fl_imm_attach(self._ptr, most)
        if rc:
            raise fi.FabricError("fl_imm_attach", rc)

    def start_service(self, config: EngineConfig, threads: int, cores: list[int], groups: list[int]) -> None:
        """Start ``threads`` worker threads (NIC slot i belongs to worker ``groups[i]``), each pinned to
        ``cores[t]`` when cores are given. They post lazily, ``config.batch`` writes from their inbox per NIC
        per pass; ``config.link_timeout_s`` seconds without a completion on a NIC with writes in flight marks
        the paths of those writes down (0: never). Attach the transfers first. The one place an EngineConfig
        becomes the C engine's fl_service_config."""
        for slot in self.nics.slots:
            self._ptr.nics[slot.index].group = groups[slot.index]
        cfg = ffi.new("fl_service_config *")
        cfg.threads, cfg.batch, cfg.fi_more = threads, config.batch, int(config.fi_more)
        cfg.timeout_s = config.timeout
        cfg.link_timeout_s = config.link_timeout_s
        cfg.pin = int(bool(cores))
        for i, core in enumerate(cores):
            cfg.cores[i] = core
        self._finished = ffi.new("uint32_t[]", WAIT_BATCH)
        e = self._ptr
        e.stop = 0
        if lib.fl_service_start(e, cfg) != 0:
            raise fi.FabricError("fl_service_start", e.error_code, message=self.error)

    def submit(self, request: Request, transfer: int, start: int = 0) -> int:
        """Queue writes ``[start, count)`` of ``request``, counted against transfer id ``transfer``, to the
        worker threads. Returns how many were taken: fewer when their inboxes are full (submit the rest
        later)."""
        request._c.transfer = transfer
        return int(lib.fl_service_submit(self._ptr, request._c, start))

    def release_writes(self, transfer: int, writes: int) -> None:
        """``writes`` of ``transfer`` will never be handed over (their submission was given up): count them
        as finished, so that the transfer can finish."""
        lib.fl_transfer_release(self._ptr, transfer, writes)

    def wait(self, timeout: float) -> list[int] | None:
        """Up to ``timeout`` seconds (without the GIL) for transfers to finish; their ids (at most
        WAIT_BATCH). Returns early, empty, on :meth:`wake` or when immediate data arrives while watched;
        None when notices were lost (more waited than the queue holds): look at every transfer then.
        One waiting thread at a time."""
        got = lib.fl_service_wait(self._ptr, self._finished, WAIT_BATCH, timeout)
        return None if got < 0 else ffi.unpack(self._finished, got)

    def wait_transfer(self, transfer: int, seconds: float) -> bool:
        """Look, on the calling thread and without the GIL, up to ``seconds`` for transfer id ``transfer`` to
        finish (every write reported): True once it did. While a caller looks, its end does not wake
        :meth:`wait`'s thread: a True answer leaves the settling to the caller."""
        return bool(lib.fl_transfer_wait(self._ptr, transfer, seconds))

    def wake(self) -> None:
        """End the current :meth:`wait` now: something other than a transfer needs the waiter's attention."""
        lib.fl_service_wake(self._ptr)

    def watch_immediates(self, on: bool) -> None:
        """While on, an arrival of immediate data ends :meth:`wait` (someone waits for such arrivals)."""
        self._ptr.service.imm_watch = int(on)

    def await_immediates(self, imm: int, report_lost: bool) -> int:
        """Keep counting ``imm`` (arrivals before and after) until as many :meth:`release_immediates`: IMM_OK, or
        IMM_FULL (not awaited: every value the table holds is awaited; one holding arrivals nobody awaits gives
        its place up, the oldest first). With
        ``report_lost``, IMM_LOST (not awaited) when arrivals of ``imm`` came while the table was full: said once."""
        return int(lib.fl_imm_await(self._ptr, imm, int(report_lost)))

    def release_immediates(self, imm: int) -> None:
        lib.fl_imm_release(self._ptr, imm)

    def take_immediates(self, imm: int, count: int) -> bool:
        """If at least ``count`` pages carrying ``imm`` have arrived, consume ``count`` of them: True."""
        return bool(lib.fl_imm_take(self._ptr, imm, count))

    def credit_immediates(self, imm: int, count: int) -> int:
        """Count ``count`` more pages of ``imm`` (a staged target has copied them to their place): IMM_OK, or
        IMM_LOST (not counted, and ``imm`` marked lost: every value the table holds was awaited)."""
        return int(lib.fl_imm_credit(self._ptr, imm, count))

    def take_lane(self, lane: int, count: int) -> bool:
        """If at least ``count`` writes into landing lane ``lane`` have arrived, consume them: True."""
        return bool(lib.fl_lane_take(self._ptr, lane, count))

    def drain_lane(self, lane: int) -> int:
        """Consume every write into landing lane ``lane`` counted so far; how many there were."""
        return int(lib.fl_lane_drain(self._ptr, lane))

    def expire_immediates(self, age: float) -> int:
        """Drop the arrivals of values nobody has awaited for ``age`` seconds: how many values."""
        return int(lib.fl_imm_expire(self._ptr, min(int(age * 1e9), 2 ** 64 - 1)))

    def immediates_usage(self) -> dict[str, int]:
        """The count of immediate data: values holding a slot now, the most that may, arrivals not counted
        (every slot awaited), values marked lost not yet reported, the last value lost, values whose arrivals
        nobody awaited were dropped (pushed out by newer ones, or expired) and the last of those."""
        usage = ffi.new("fl_imm_usage *")
        lib.fl_imm_usage_get(self._ptr, usage)
        return {"values": int(usage.values), "most": int(usage.most), "lost": int(usage.lost),
                "lost_values": int(usage.lost_values), "last_lost": int(usage.last_lost),
                "dropped": int(usage.dropped), "last_dropped": int(usage.last_dropped)}

    @property
    def stopping(self) -> bool:
        """The engine was told to stop, or a worker failed: nothing more will be taken."""
        return bool(self._ptr.stop)

    def unreported_writes(self, index: int) -> int:
        """Writes NIC slot ``index`` gave up on (sent again elsewhere) that the provider never reported on
        the slot's current endpoint: an endpoint stuck behind them is renewed (:meth:`renew_nic`)."""
        return int(self._ptr.nics[index].unreported_here)

    def idle_nics(self) -> list[int]:
        """The NIC slots whose current endpoint has nothing inside the provider: no write posted and not
        reported, none given up on, none waiting in the ring to be posted again (a post refused with
        -FI_EAGAIN may have left something with the peer: shm sends it this endpoint's name first). Asked
        once the workers stopped: nothing changes it then."""
        nics = [self._ptr.nics[i] for i in range(len(self.nics.slots))]
        return [i for i, n in enumerate(nics) if n.in_flight == 0 and n.unreported_here == 0 and n.ring_head == n.ring_tail]

    def renewal_waiting(self, index: int) -> bool:
        """A fresh endpoint handed to NIC slot ``index`` still waits for its worker to swap it in."""
        return bool(self._ptr.nics[index].next_ep != ffi.NULL)

    def park_worker(self, index: int, timeout: float) -> bool:
        """Have the worker that owns NIC slot ``index`` sleep, touching none of its NICs, until
        :meth:`unpark_worker`: a provider may progress an endpoint bound to a CQ as soon as it is bound (shm
        does, and crashes on one not enabled yet), so a fresh endpoint is opened only while its worker is
        parked. False when it did not park within ``timeout`` seconds, or the engine stops."""
        return bool(lib.fl_worker_park(self._ptr, index, timeout))

    def unpark_worker(self, index: int) -> None:
        lib.fl_worker_unpark(self._ptr, index)

    def renew_nic(self, index: int, endpoint: fi.Endpoint) -> bool:
        """Hand NIC slot ``index`` a fresh endpoint (its domain, bound to its CQ and AV, enabled), swapped in by
        its worker at the next :meth:`revive`. The caller keeps the old endpoint open (late completions, and
        peers writing to its address). False when one is already waiting: the caller keeps ``endpoint``."""
        return bool(lib.fl_nic_renew(self._ptr, index, endpoint._ptr))

    def revive(self) -> None:
        """Every worker forgets the paths it had marked dead and swaps in the endpoints handed over with
        :meth:`renew_nic`, on its own thread, before it posts anything submitted after this."""
        lib.fl_service_revive(self._ptr)

    def stop_service(self, timeout: float) -> int:
        """Stop the worker threads and join them; what they had not finished stays unfinished. Waits at most
        ``timeout`` seconds: returns 0, or how many threads were still inside the engine then (stuck in a
        provider call: WORKER_EXIT_TIMEOUT says why). Those are left running at idle priority, and the native
        engine is then not freed while they are there."""
        return int(lib.fl_service_stop(self._ptr, timeout))


# ------------------------------------------------------------- the course's write runs and their target


@dataclass(frozen=True)
class RunFigures:
    """What one write run measured: its timed writes and bytes over ``elapsed_s`` (the warm-up left out), and
    how many of its writes carried immediate data (each NIC's last, or all in the checking mode). ``model``:
    on the modeled host (the sim provider in modeled time), what it charged the run's threads (MODEL_COUNTS,
    summed over them; native/sim/fi_sim_ext.h), and ``elapsed_s`` is then modeled time; else empty."""

    writes: int
    bytes: int
    elapsed_s: float
    marked: int
    model: dict[str, int] = field(default_factory=dict)


#: struct fi_sim_counts' fields (native/sim/fi_sim_ext.h): what the modeled host charged a run's threads.
MODEL_COUNTS = ("posts", "doorbells", "futile_posts", "cq_reads", "empty_reads", "entries", "far_accesses",
                "line_moves", "migrations", "app_ns", "provider_ns", "host_ns", "idle_ns")


#: fl_run_config's fields (native/course.h) that a stage's switches and sizes set.
RUN_FIELDS = ("threads", "groups", "warmup", "pin", "shard", "pad", "batch", "lazy", "fi_more", "mark_last",
              "total_writes", "page_size", "buffer_bytes", "local_base", "timeout_s", "link_timeout_s")


class RunConfig:
    """One write run's fl_run_config (native/course.h), checked: ``fields`` sets every name of RUN_FIELDS (a
    stage's switches and sizes), ``cores`` the core of each thread where ``fields["pin"]``, ``model_cores``
    its core on the modeled host (the sim provider's p5) then."""

    __slots__ = ("_c", "threads", "groups")

    def __init__(self, fields: dict[str, Any], cores: list[int], model_cores: Sequence[int] = ()):
        missing = set(RUN_FIELDS) - set(fields)
        if missing:
            raise fi.UsageError(f"a write run needs {sorted(missing)}")
        if fields["threads"] > MAX_THREADS:
            raise fi.UsageError(f"at most {MAX_THREADS} threads")
        self._c = ffi.new("fl_run_config *")
        for key in RUN_FIELDS:
            setattr(self._c, key, fields[key])
        for i, core in enumerate(cores[:MAX_THREADS]):
            self._c.cores[i] = core
        for i in range(MAX_THREADS):
            self._c.model_cores[i] = model_cores[i] if i < len(model_cores) else -1
        self.threads, self.groups = int(fields["threads"]), int(fields["groups"])


def write_run(engine: NativeEngine, config: RunConfig, tick: Callable[[], None] | None = None) -> RunFigures:
    """Run one timed write run (native/course.c's fl_write_run) over ``engine``'s NICs. Blocks until the run
    ends (Ctrl-C stops it); raises FabricError when it failed. ``tick``: see :meth:`NativeEngine.run`."""
    engine.run(lib.fl_write_run, config._c, timeout=config._c.timeout_s, tick=tick)
    c = engine._ptr.course
    model = {name: int(getattr(c.model, name)) for name in MODEL_COUNTS} if c.modeled else {}
    return RunFigures(int(c.timed_writes), int(c.timed_bytes), float(c.elapsed_s), int(c.marked_writes), model)


class NativeTarget:
    """The course's target loop (native/course.c's fl_target_run) over a :class:`NativeEngine`: one thread
    polling every NIC, counting what lands into arrays this object keeps alive as long as the engine (a loop
    that never stopped may still write into them). ``pages`` counters when ``counting`` (the checking mode:
    every write carries its number), else only the marked writes are counted (``marks_only``)."""

    def __init__(self, engine: NativeEngine, counting: bool, pages: int, page_size: int, buffer_bytes: int,
                 writes: int):
        self.engine = engine
        self.marks_only = not counting
        self.capacity = writes  # the writes the run was prepared for
        self.counts = np.zeros(pages if counting else 0, dtype=np.uint32)
        # one bit per write of the run: a write sent again after a link failure is counted once
        self.seen = np.zeros((writes + 63) // 64, dtype=np.uint64)
        c = engine._ptr.course
        engine._ptr.stop = 0
        c.marks_only = int(not counting)
        c.page_counts = ffi.cast("uint32_t *", self.counts.ctypes.data) if counting else ffi.NULL
        c.seen_writes = ffi.cast("uint64_t *", self.seen.ctypes.data) if self.seen.size else ffi.NULL
        c.seen_capacity = writes
        c.duplicates = 0
        c.pages = pages
        c.target_page_size, c.target_buffer_bytes = page_size, buffer_bytes
        c.expected_arrivals = 2 ** 64 - 1
        c.arrivals = c.first_arrival_ns = c.last_arrival_ns = c.writer_heard_ns = 0

    def run(self, core: int, timeout: float) -> int:
        """The loop itself, on the calling thread (pinned to ``core`` unless it is negative), until the run is
        complete, :meth:`stop`, or the writer was silent for ``timeout`` seconds mid-run: 0, or a negative error
        code (:attr:`NativeEngine.error`). Where the provider moves writes only while the target polls
        (FI_PROGRESS_MANUAL), the loop never sleeps during a run. A loop stuck inside a provider call for
        ``timeout`` seconds also ends the run with an error, its thread left behind (:attr:`stranded`)."""
        manual = self.engine.nics.slots[0].info.data_progress == lib.FI_PROGRESS_MANUAL
        return int(lib.fl_target_run(self.engine._ptr, core, int(manual), timeout))

    def stop(self) -> None:
        self.engine._ptr.stop = 1

    @property
    def stranded(self) -> bool:
        """The loop's thread was given up on, stuck in a provider call (:meth:`run` returned the run's error
        meanwhile): it may still use the engine, its NICs and the memory they registered, so none of them may be
        closed or freed, for the life of the process."""
        return bool(self.engine._ptr.course.target_stranded > 0)

    def writer_heard(self) -> None:
        """The writer said it is writing: the loop's silence clock restarts."""
        self.engine._ptr.course.writer_heard_ns = lib.fl_now_ns()

    def expect(self, arrivals: int) -> None:
        """The run is complete once ``arrivals`` writes (marked writes with :attr:`marks_only`) have landed."""
        self.engine._ptr.course.expected_arrivals = arrivals

    @property
    def arrivals(self) -> int:
        return int(self.engine._ptr.course.arrivals)

    @property
    def duplicates(self) -> int:
        """Arrivals of a write that had landed before (sent again after a link failure)."""
        return int(self.engine._ptr.course.duplicates)

    @property
    def landed_s(self) -> float:
        """From the first write landing (or, counting marks only, the writer's first word) to the last."""
        c = self.engine._ptr.course
        return float((c.last_arrival_ns - c.first_arrival_ns) / 1e9)


# ------------------------------------------------------------------- the lessons' and the bench's C benchmarks


def memcpy_rate(threads: int, bytes_per_thread: int, repeats: int, cores: list[int]) -> list[float] | None:
    """native/copyrate.c: ``threads`` C threads, pinned in turn to ``cores``, each copying its own
    ``bytes_per_thread``, all started together ``repeats`` times: each repeat's Gbps, or None when it could not
    run (too many threads, or not enough memory)."""
    runs = ffi.new("double[]", repeats)
    if lib.fl_memcpy_rate(threads, bytes_per_thread, repeats, ffi.new("int[]", cores), len(cores), runs) != 0:
        return None
    return list(runs)


def counter_update_ns(layout: str, threads: int, updates: int, cores: list[int]) -> tuple[float, float]:
    """native/sharing.c: (ns per counter update, overlap) with ``threads`` threads pinned in turn to ``cores``,
    started together from a barrier, each updating ``updates`` times, the counters laid out as ``layout``
    (FL_SHARED_ATOMIC, FL_PACKED_SLOTS or FL_PADDED_SLOTS); overlap is the share of the run in which every
    thread was updating on a CPU. ns is negative when refused."""
    overlap = ffi.new("double *")
    ns = lib.fl_counter_bench(getattr(lib, layout), threads, updates, ffi.new("int[]", cores), len(cores), overlap)
    return ns, overlap[0]


class GateSlots:
    """native/gate.c over shared memory (``buffer``, a writable mmap both sides map): the gate of slot i at
    byte i * GATE_BYTES. Each call is one atomic step; ``fabriclab.ipc`` says what the gates are for."""

    BYTES = lib.FL_GATE_BYTES

    def __init__(self, buffer: Any) -> None:
        self._base = ffi.from_buffer(buffer)  # keeps ``buffer`` alive
        self.slots = len(self._base) // self.BYTES

    def _slot(self, slot: int) -> Any:
        if not 0 <= slot < self.slots:
            raise IndexError(f"gate slot {slot} outside 0..{self.slots - 1}")
        return self._base + slot * self.BYTES

    def open(self, slot: int, key: int) -> None:
        lib.fl_gate_open(self._slot(slot), key)

    def enter(self, slot: int, key: int) -> bool:
        """Whether the gate let the caller in (open, for ``key``): then it must :meth:`leave`."""
        return bool(lib.fl_gate_enter(self._slot(slot), key) == lib.FL_GATE_PASSED)

    def leave(self, slot: int) -> None:
        lib.fl_gate_leave(self._slot(slot))

    def shut(self, slot: int) -> int:
        """Shut the gate; how many are still inside."""
        return int(lib.fl_gate_shut(self._slot(slot)))

    def inside(self, slot: int) -> int:
        return int(lib.fl_gate_inside(self._slot(slot)))

    def close(self) -> None:
        """Let go of the buffer (its owner may close it then); no call may follow."""
        ffi.release(self._base)
        self.slots = 0
