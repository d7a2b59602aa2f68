"""What an ``Engine`` runs (private machinery behind ``fabriclab.engine``): its NICs, the native engine with
its worker threads, and the book of what is in flight with its reaper thread (``fabriclab.completions``).
Endpoint renewal is ``fabriclab.renewal``; transfers from staged regions and into staged targets are
``fabriclab.staged``. A :class:`Service` holds no reference to its Engine, so a dropped Engine is collected,
and its finalizer closes the service."""
from __future__ import annotations

import concurrent.futures
import functools
import logging
import os
import threading
import time
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from . import _native, fi, landing, shmclean, staged, staging
from .ipc_writer import IpcPath
from ._native import WORKER_EXIT_TIMEOUT
from .completions import TRANSFER_SLOTS, Completions, RegionState
from .config import EngineConfig
from .errors import PeerLost, TransferTimeout, closed_here
from .nics import (Layout, NicSet, PeerEntries, default_layout, discover_topology, group_nics, topology_groups_holding,
                   worker_cores)
from .renewal import Renewal
from .transfer import AwaitableFuture, Safety, Transfer
from .wire import PeerRegion

if TYPE_CHECKING:
    from .engine import Peer, Region

__all__ = ["Service", "RegionState", "CLOSED_HERE", "DEFAULT_STRIPE", "IMM_VALUES", "TRANSFER_SLOTS"]

# Immediate values an engine counts at once: each awaited by an expect() or holding pages that arrived and
# were not taken yet (a value's slot is given back once its count is taken and nothing awaits it): as many as
# one writer engine can have transfers in flight, so a writer with one value per transfer never fills it.
IMM_VALUES = TRANSFER_SLOTS
DEFAULT_STRIPE = 1 << 20
# How long Region.close waits for transfers still running before it says so (a log warning): a healthy
# transfer of a few MiB is done in milliseconds; one waiting this long may wait out the whole timeout.
CLOSE_NOTICE_S = 1.0
# How long the interpreter's exit waits for an engine's close already running on another thread (a dropped
# engine's closer): its joins of stuck threads give up after WORKER_EXIT_TIMEOUT each.
EXIT_WAIT_S = 4 * WORKER_EXIT_TIMEOUT
# Services closed while threads were stuck in their native engine: whatever those threads may still touch
# (NICs, registrations, buffers of unfinished transfers, the staging pool) stays open for the life of the
# process, since nobody can tell when, if ever, they let go of it.
_STRANDED_SERVICES: list[Service] = []
# The ids of the engines closed in this process. Their addresses are refused by connect() and their Peers take
# no more writes: a libfabric endpoint closed in this process can crash the process when its address is used
# again (shm keeps it in its list of this process's endpoints for ever: fabriclab._inprocess says more).
CLOSED_HERE: set[int] = set()
log = logging.getLogger("fabriclab")
_ENTRIES_ADVICE = ("each holds a peer engine this engine has a Peer to, open or with transfers still running: close "
                   "the Peers you no longer write to (Peer.close(), or drop them), and their entries are removed")


def open_nics(config: EngineConfig) -> tuple[NicSet, Layout, Any]:
    """The NIC slots of an engine, the layout the host suggests (``nics.default_layout``) and its topology:
    with the provider's single domain, one emulated slot per thread the layout asks for."""
    gpu = config.gpu
    if gpu is None:
        from . import gpu as cuda
        gpu = cuda.cuda_status() == "ok"
    # Regions that killed shm endpoints left behind hold memory until someone removes them: those of this pid
    # namespace's engines that their owner records prove stale (shmclean), never a region of another.
    reclaimed = shmclean.reclaim_stale_shm_regions()
    if reclaimed:
        log.info(shmclean.describe(reclaimed))
    # With GPUs, ask for FI_HMEM so CUDA arrays can be registered (where the provider offers it).
    memory_kind = "cuda" if gpu else "host"
    domains = None if config.domains is None else list(config.domains)
    nics = NicSet(config.provider, config.nics, domains, memory_kind)
    try:
        topology = discover_topology(str(nics.provider))
        real = [s.domain_name for s in nics.slots if not s.emulated]
        layout = default_layout(nics.real_nics, topology_groups_holding(real, topology), len(os.sched_getaffinity(0)))
        wanted = max(layout.nics, config.threads or 0)
        if config.nics is None and wanted > len(nics.slots):  # one domain: emulated slots, one per thread
            nics.close()
            nics = NicSet(config.provider, wanted, domains, memory_kind)
    except BaseException:
        nics.close()
        raise
    return nics, layout, topology


def _entries_needed(service: Service, deep: bool) -> set[tuple[int, int]]:
    """(NIC slot, fi_addr) of the address-vector entries still in use (nics.PeerEntries): writes posted use
    theirs, and every Peer not closed, or with a transfer still running, its own. ``deep``: a Peer whose
    peer's process, on this host, is gone is closed first (PeerLost for its later writes)."""
    with service.lock:
        needed = {(i, int(dest)) for _, _, routes in service.book.in_use.values() for i, dest in
                  enumerate(routes.array["dest"])}
    for peer in list(service.peers):
        if deep and not peer.closed and peer.process and shmclean.process_is_gone(*peer.process):
            peer._gone = f"the peer's process (pid {peer.process[1]}, on this host) is gone"
            peer.closed = True
        if peer._needs_entries():
            needed.update(enumerate(peer.fi_addrs))
    return needed


def _stop_at_exit(service: Service) -> bool:
    """At exit (fi.stop_first_at_exit): close, or wait for another thread's close; whether our threads let go."""
    service.close()
    return service.pid != os.getpid() or service._shut.wait(EXIT_WAIT_S)


def hand_over(service: Service, request: _native.Request, tid: int, count: int, taken: int, deadline: float,
              give_up: Callable[[int, str], BaseException]) -> None:
    """Queue writes ``[taken, count)`` of ``request`` (counted against ``tid``, or against the ids its writes
    name: a batch) as the workers' inboxes make room, until ``deadline``. Then ``give_up(taken, why)``, under
    the lock, counts the writes never handed over as finished (they never will), fails what they belonged
    to and returns the failure, which is raised."""
    while taken < count:
        time.sleep(0.0002)
        with service.lock:  # close() frees the native engine under this lock, once it is closed
            if not service.closed:
                taken += service.native.submit(request, tid, taken)
        if taken < count and (time.monotonic() > deadline or service.closed or service.native.stopping):
            why = "the engine was closed" if service.closed else "the engine's queues stayed full"
            with service.lock:
                failure = give_up(taken, why)
            raise failure


def fail_unqueued(service: Service, left: dict[int, tuple[Transfer, int]], why: str) -> BaseException:
    """Writes never handed over to the workers (``left``: per transfer id, its transfer and how many) count as
    finished, as they never will, and their transfers fail; returns the first failure. The caller holds the
    lock."""
    failures = []
    for tid, (transfer, writes) in left.items():
        if not service.closed:
            service.native.release_writes(tid, writes)
        failures.append(TransferTimeout(f"{why}; {writes} of {transfer.writes} writes not queued",
                                        buffer_safe=writes == transfer.writes, safety=transfer._safety))
        transfer._fail(failures[-1])  # unless close() failed it already
    return failures[0]


class Service:
    """Everything an Engine runs (see the module docstring), built from its :class:`EngineConfig`."""

    def __init__(self, config: EngineConfig, engine_id: int) -> None:
        self.pid = os.getpid()
        self.config, self.engine_id = config, engine_id
        self.timeout, self.link_timeout = config.timeout, config.link_timeout_s
        self.staging_sizes = (config.staging_bytes, config.staging_chunk_bytes)
        self.lock = threading.Lock()
        self.closed = False
        self._closed_by_reaper = False
        self.final_stats: dict[str, Any] | None = None
        self.nics, self.layout, topology = open_nics(config)
        self.provider, self.emulated = str(self.nics.provider), self.nics.emulated
        try:
            self.native = _native.NativeEngine(self.nics)
            self.book = Completions(self.native, self.lock, self.link_timeout, self.timeout)
            self.native.attach_immediates(IMM_VALUES)
            if config.in_flight is not None:
                self.native.limit_in_flight(config.in_flight)
            self.threads = config.threads or min(self.layout.threads, len(self.nics.slots))
            if self.threads > len(self.nics.slots):
                raise fi.UsageError(f"threads must be between 1 and the number of NICs ({len(self.nics.slots)}), "
                                    f"got {self.threads}")
            given = {"nics": config.nics is not None, "threads": config.threads is not None}
            self.chosen = {**{k: "given" if v else "default" for k, v in given.items()},
                           "why": self.layout.why if not all(given.values()) else "given by the caller"}
            self.groups = group_nics([s.domain_name for s in self.nics.slots], self.threads, topology)
            self.worker_cores = worker_cores(self.threads, self.provider, groups=self.groups) if config.pin else []
            self.native.start_service(config, self.threads, self.worker_cores, list(self.groups.of_slot))
        except BaseException:
            if hasattr(self, "native"):
                self.native.close()  # the C engine's memory (no worker runs: the service did not start)
            self.nics.close()
            raise
        self.peers: weakref.WeakSet[Peer] = weakref.WeakSet()
        # a proxy: a cycle through the service kept 20 KiB of each closed engine (the lifecycle leak test)
        self.entries = PeerEntries(self.nics.slots, functools.partial(_entries_needed, weakref.proxy(self)),
                                   _ENTRIES_ADVICE)
        self.renewal = Renewal(self.nics, self.groups, self.native, min(self.timeout, WORKER_EXIT_TIMEOUT))
        self.max_msg_size = min(s.info.max_msg_size for s in self.nics.slots)
        self.submitted = {"transfers": 0, "pages": 0, "writes": 0}  # pages: as asked; writes: after coalescing
        # Busy workers poll without pause; any other busy thread landing on their cores stalls a NIC.
        self.housekeeping_cores = frozenset(os.sched_getaffinity(0)) - frozenset(self.worker_cores)
        self.stager: staging.Stager | None = None  # started at the first staged region
        self.landing: landing.Landing | None = None  # started at the first staged target, or write into one
        self.ipc = IpcPath(self)  # same-host GPU peers (fabriclab.ipc_writer)
        self.held_by_dead_writers: list[Any] = []  # memory of regions a CUDA IPC writer died copying into
        self.book.start(self.housekeeping_cores if self.worker_cores else None, self._finish_on_reaper)
        self._shut = threading.Event()  # _shut_down is over: no thread of ours is in a NIC or channel
        fi.stop_first_at_exit(self, _stop_at_exit)

    # ------------------------------------------------------------------------------ for the Engine

    def layout_summary(self) -> dict[str, Any]:
        """What the engine drives and why: NIC slots and threads, each ``"default"`` (nics.default_layout
        chose it for this host) or ``"given"``; the worker group of every slot (nics.group_nics); and the
        configuration it was built from."""
        return {**self.chosen, "groups": list(self.groups.of_slot), "config": self.config.as_dict()}

    def check_open(self) -> None:
        if self.pid != os.getpid():
            raise fi.UsageError(f"this Engine was created in process {self.pid}, before fork(); its threads and "
                                "NICs stayed with that process: create a new Engine in this one")
        if self.closed:
            raise fi.UsageError("the engine is closed")

    def revive_paths(self) -> None:
        """See :meth:`fabriclab.renewal.Renewal.revive_paths`."""
        self.renewal.revive_paths()

    def expect(self, imm: int, count: int, timeout: float) -> concurrent.futures.Future[int]:
        future: AwaitableFuture = AwaitableFuture()
        deadline = time.monotonic() + timeout
        with self.lock:  # the native engine is freed under it, once closed
            self.check_open()
            status = self.native.await_immediates(imm, report_lost=True)
            if status == _native.IMM_OK:
                self.book.expect(imm, count, future, deadline)
        if status != _native.IMM_OK:
            usage = self.native.immediates_usage()
            if status == _native.IMM_LOST:
                raise fi.UsageError(
                    f"pages carrying imm {imm} arrived while every one of the immediate values this engine counts at "
                    f"once ({usage['most']}) was awaited by an expect(): they were not counted, so expect({imm}, "
                    f"{count}) could never complete. Keep fewer expect()s waiting at once (the value counts again "
                    "from here)")
            raise fi.UsageError(
                f"expect({imm}, {count}) cannot be counted: this engine counts at most {usage['most']} immediate "
                f"values at once, and every one is awaited by an expect() (or a staged target's copy). Wait for some "
                "expectations to finish before adding more")
        self.native.watch_immediates(True)
        self.native.wake()
        return future

    def stats(self) -> dict[str, Any]:
        if self.final_stats is not None:
            return self.final_stats
        self.check_open()
        pending, unsafe, expecting = self.book.pending()
        per_nic = self.native.counters()
        self.renewal.annotate(per_nic)
        return self._snapshot(per_nic, pending, unsafe, expecting)

    def _snapshot(self, per_nic: list[dict[str, Any]], pending: int = 0, unsafe: int = 0, expecting: int = 0,
                  stranded: int | None = None) -> dict[str, Any]:
        """The stats of the engine: open (``stranded`` None), or closed with ``stranded`` threads stuck."""
        return {"provider": self.provider, "nics": len(self.nics.slots), "emulated_nics": self.emulated,
                "threads": self.threads, "layout": self.layout_summary(), "submitted": dict(self.submitted),
                "transfers_in_flight": pending, "abandoned_in_flight": unsafe,
                "expectations": expecting, "immediates": self.native.immediates_usage(), "per_nic": per_nic,
                "peer_entries": self.entries.stats(),
                "staging": staged.stats(self), "cuda_ipc": self.ipc.stats(), "closed": stranded is not None, "stranded_threads": stranded or 0}

    def pages_per_write(self, pages: int, page_size: int) -> int:
        """The most pages one write of a transfer of ``pages`` pages may carry: enough writes that every
        NIC slot gets one (a transfer of a few large writes would leave NICs idle), none above
        DEFAULT_STRIPE bytes (at 1 MiB a write's posting cost is already small next to its copy or wire
        time, and Peer.write stripes at the same size), nor the provider's max_msg_size, nor what the
        immediate data can count (MAX_PAGES_PER_WRITE)."""
        every_nic = pages // len(self.nics.slots)
        largest = min(DEFAULT_STRIPE, self.max_msg_size) // page_size
        return max(1, min(every_nic, largest, int(_native.MAX_PAGES_PER_WRITE)))

    def submit(self, peer: Peer, region: Region, remote: PeerRegion, src: np.ndarray | list[int],
               dst: np.ndarray | list[int], stride: int, lengths: np.ndarray | list[int] | int, imm: int | None,
               timeout: float | None, pages: int | None = None) -> Transfer:
        """Hand one request to the native engine (it builds the writes and stripes them over the NICs) and
        track its future. Write i moves lengths[i] (or ``lengths`` bytes) from src[i] * stride of the
        region to dst[i] * stride of the peer's. A few writes may come as lists of Python ints."""
        wire_imm, seconds = self.admit(peer, region, imm, timeout)
        if self.through_nics(peer, region, remote):
            return self.post(peer, region, remote, src, dst, stride, lengths, wire_imm, seconds, pages)
        # the GPU's copies and the staged paths take arrays
        starts, ends = np.asarray(src, dtype=np.int64) * stride, np.asarray(dst, dtype=np.int64) * stride
        sizes = lengths if isinstance(lengths, int) else np.asarray(lengths, dtype=np.uint64)
        if remote.ipc is not None and self.ipc.route(peer, region, remote)[0]:
            return self.ipc.submit(peer, region, remote, starts.astype(np.uint64), ends.astype(np.uint64), sizes,
                                   wire_imm, seconds, starts.size if pages is None else pages)
        if remote.landing is not None:
            return staged.submit_landing(self, peer, region, remote, starts, ends, sizes, wire_imm, seconds)
        return staged.submit_staged(self, peer, region, remote, starts, ends, sizes, wire_imm, seconds)

    def through_nics(self, peer: Peer, region: Region, remote: PeerRegion) -> bool:
        """Whether writes from ``region`` into ``remote`` go through the NICs as they are (:meth:`post`)."""
        ipc = remote.ipc is not None and self.ipc.route(peer, region, remote)[0]  # cuda-ipc, staging: not
        return not (ipc or remote.landing is not None or region.staged)

    def admit(self, peer: Peer, region: Region, imm: int | None, timeout: float | None) -> tuple[int, float]:
        """Check that a transfer from ``region`` to ``peer`` may start; its immediate data as it goes on the
        wire (NO_IMM where the caller gave none) and its timeout in seconds."""
        self.check_open()
        region._check_open()
        if peer.closed:
            if peer._gone:
                raise PeerLost(f"{peer._gone}: its Peer was closed", buffer_safe=True)
            raise fi.UsageError("that peer was closed; connect again")
        if peer.id in CLOSED_HERE:
            raise closed_here("the peer engine")
        if region.engine._service is not self:
            raise fi.UsageError("that region was registered with another engine")
        if region.path == "host-staged":
            raise fi.UsageError(f"region {region.id} is host memory staged on purpose (a test switch): a target only")
        wire_imm = _native.NO_IMM if imm is None else fi.integer(imm, "imm", 0, _native.MAX_IMM)
        return wire_imm, fi.seconds(timeout, "timeout", self.timeout)

    def count_submitted(self, transfer: Transfer) -> None:
        """Count a transfer in ``stats()["submitted"]``; the caller holds the lock."""
        self.submitted["transfers"] += 1
        self.submitted["pages"] += transfer.pages
        self.submitted["writes"] += transfer.writes

    def post(self, peer: Peer, region: Region, remote: PeerRegion, src: np.ndarray | list[int],
             dst: np.ndarray | list[int], stride: int, lengths: np.ndarray | list[int] | int, imm: int, timeout: float,
             pages: int | None = None) -> Transfer:
        """:meth:`submit` of a region registered with the NICs, its input checked: ``imm`` as it goes on the
        wire (NO_IMM, a caller's value, or a landing lane's). A few writes may come as lists of ints."""
        n = len(src)
        nbytes = n * lengths if isinstance(lengths, int) else int(np.sum(lengths))
        deadline = time.monotonic() + timeout
        transfer = Transfer(n, nbytes, deadline, Safety(self.timeout), pages)
        transfer._peer_process = peer.process
        routes = peer._routes_to(region, remote)
        # Every write carries immediate data (a reserved value when the caller gave none), so the peer's
        # worker threads see traffic arrive and keep polling: software providers need the target to poll.
        request = routes.request(region.pointer, src, dst, stride, lengths, imm, peer._next_nic,
                                 pages_in_imm=pages is not None)
        peer._next_nic = (peer._next_nic + n) % len(peer.fi_addrs)
        taken = 0
        with self.lock:  # close() frees the native engine under this lock, once it is closed
            tid = self.book.track(transfer, region._state, routes)
            self.count_submitted(transfer)
            if not self.closed:
                taken = self.native.submit(request, tid, 0)
        transfer._finish_here = functools.partial(self.book.finish_here, tid, transfer)
        if taken < n:
            hand_over(self, request, tid, n, taken, deadline,
                      lambda taken, why: fail_unqueued(self, {tid: (transfer, n - taken)}, why))
        return transfer

    def start_staging(self) -> staging.PinnedPool:
        """The staging pool and its thread (at the first staged region); the Engine registers the pool."""
        return staged.start_staging(self)

    def start_landing(self) -> landing.Landing:
        """The landing thread and its control channel (at the first staged target, or the first write into a
        peer's)."""
        return staged.start_landing(self)

    def close_region(self, state: RegionState, timeout: float, region_id: int) -> None:
        """Wait up to ``timeout`` for what may still complete with the region (transfers not yet resolved, and
        staging and landing copies), then retire it: the reaper fails what is left with RegionClosed and
        deregisters it once no write can touch it. Transfers that already failed are not waited for: writes
        the engine gave up on may never be reported (into a dead peer), and their registration is kept anyway."""
        if self.pid != os.getpid():
            return  # the registrations belong to the parent of a fork
        start = time.monotonic()
        deadline, told = start + timeout, False
        while time.monotonic() < deadline and not self.closed:
            with self.lock:
                running = self.book.still_running(state)
            if running <= 0:
                break
            if not told and time.monotonic() - start > CLOSE_NOTICE_S:
                told = True
                log.warning("closing region %d: %d transfer(s) using it are still running (no completion and no "
                            "error yet: their peer may be stopped, slow, or gone without the provider saying so); "
                            "waiting up to %.1f s more, then they fail with RegionClosed. Region.close(timeout=...) "
                            "bounds this wait", region_id, running, deadline - time.monotonic())
            time.sleep(0.001)
        if not self.closed:  # else closing the engine deregistered everything
            self.book.retire(state)  # the reaper fails what is left with RegionClosed

    @staticmethod
    def close_collected(service: Service) -> None:
        """The Engine was collected (or the interpreter exits): close its service. Collection happens on
        whatever thread allocates at that moment, so the close (joining threads, closing NICs) goes to a
        thread of its own: a Ctrl-C meant for that thread must not land in a long finalizer, where Python
        drops it. At exit (the main thread already stopped) it closes here and now."""
        if threading.main_thread().is_alive():
            threading.Thread(target=service.close, name="fabriclab-engine-closer", daemon=True).start()
        else:
            service.close()

    def close(self) -> None:
        """Stop everything (``Engine.close()``, or the Engine's collection or the interpreter's exit)."""
        if self.closed:
            return
        self.closed = self.book.closed = True
        if self.pid != os.getpid():
            return  # after fork(): the threads, NICs and shared memory are the parent's, not ours to close
        CLOSED_HERE.add(self.engine_id)
        reaper = self.book.thread
        if threading.current_thread() is reaper:  # collected on the reaper thread: it finishes the job
            self._closed_by_reaper = True
            return
        self.native.wake()
        if reaper is not None:
            reaper.join(WORKER_EXIT_TIMEOUT)
        self._shut_down()

    # ------------------------------------------------------------------------------------ internals

    def _finish_on_reaper(self) -> None:
        if self._closed_by_reaper:
            self._shut_down()

    def _shut_down(self) -> None:
        try:
            self._stop_and_close()
        finally:
            self._shut.set()

    def _stop_and_close(self) -> None:
        self.ipc.close()  # its copies are waited for; their counts leave through the landing thread
        staged.stop(self)  # fails staged and landing jobs; copies into staged targets are waited for
        stranded = self.native.stop_service(WORKER_EXIT_TIMEOUT)
        if not stranded:
            # their endpoints' regions need not outlive them for the engines of this process they wrote to
            for index in self.native.idle_nics():
                self.nics.slots[index].ep.declare_idle()
        self.final_stats = self._snapshot(self.native.counters(), stranded=stranded)
        with self.lock:
            # a stuck worker may still read these transfers' buffers and routes: they stay alive with us
            unfinished = self.book.fail_all()
            # the reaper calls into the native engine too: one that did not stop (this is not it) keeps it alive
            reaper = self.book.thread
            reaper_running = reaper is not None and reaper.is_alive() and threading.current_thread() is not reaper
            left = max(stranded, 1) if reaper_running else self.native.close()
        if left:
            self.stranded = (unfinished, self.stager)
            _STRANDED_SERVICES.append(self)
            self.nics.keep_open()
            log.warning(
                "the engine closed with %d thread(s) that did not stop within %g s (stuck inside the %s provider; "
                "why: native/service.h, fl_service_stop): its NICs, registrations and staging memory stay open "
                "until this process exits", left, WORKER_EXIT_TIMEOUT, self.provider)
            return
        self.nics.close()
        staged.release_pools(self)  # no NIC has them registered any more
