"""Transfers as the caller holds them: :class:`Transfer` (a future that can also be awaited), the
:class:`TransferResult` it resolves to, and :class:`Safety`, the moment its writes stop reading the local
buffer. Done-callbacks run on a thread of their own (:class:`_Callbacks`), never on the engine's."""
from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import math
import numbers
import os
import queue
import threading
import time
import warnings
from collections.abc import Callable, Generator
from dataclasses import dataclass
from typing import Any

from . import fi


@dataclass(frozen=True)
class TransferResult:
    """What a finished transfer returns: it is complete, so the buffer is safe to reuse."""
    bytes: int
    writes: int
    elapsed_s: float
    buffer_safe: bool = True
    pages: int = 0  # what the peer's expect() counts for it: pages of write_pages, pieces of write


class Safety:
    """When the last write of a transfer stops reading the local buffer; or that nobody will know (the
    engine closed first). Its event exists only once someone waits (most transfers are never asked)."""

    _guard = threading.Lock()  # held for a few steps only: whether a waiter's event exists yet

    __slots__ = ("_state", "_event", "_default_timeout")

    def __init__(self, default_timeout: float) -> None:
        self._state: bool | None = None  # True: safe; False: the engine closed before the provider reported all
        self._event: threading.Event | None = None
        self._default_timeout = default_timeout

    def settle(self, safe: bool) -> None:
        with Safety._guard:
            if self._state is not None:
                return
            self._state = safe
            event = self._event
        if event is not None:
            event.set()

    @property
    def safe(self) -> bool:
        return self._state is True

    def wait(self, timeout: float | None) -> bool:
        timeout = fi.seconds(timeout, "timeout", self._default_timeout)
        with Safety._guard:
            if self._state is None and self._event is None:
                self._event = threading.Event()
            event = self._event
        if self._state is None and event is not None:
            event.wait(timeout)
        return self._state is True


class _Callbacks:
    """Runs futures' done-callbacks on one thread of their own, so that a callback that blocks (on another
    transfer's result, say) never stalls the engine that resolves futures. Warns once about a callback
    that runs longer than SLOW_CALLBACK_S: the callbacks after it wait."""

    SLOW_CALLBACK_S = 1.0

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._queue: queue.SimpleQueue[tuple[Callable[[Any], object], Any]] | None = None
        self._pid: int | None = None
        self._warned = False

    def run(self, fn: Callable[[Any], object], future: concurrent.futures.Future[Any]) -> None:
        with self._lock:
            if self._queue is None or self._pid != os.getpid():  # first use, or stayed in the parent of a fork
                self._queue, self._pid = queue.SimpleQueue(), os.getpid()
                threading.Thread(target=self._loop, args=(self._queue,), name="fabriclab-callbacks",
                                 daemon=True).start()
            self._queue.put((fn, future))

    def _loop(self, calls: queue.SimpleQueue[tuple[Callable[[Any], object], Any]]) -> None:
        while True:
            fn, future = calls.get()
            started = time.monotonic()
            try:
                fn(future)
            except Exception:  # as concurrent.futures does: a failing callback is logged, never fatal
                logging.getLogger("fabriclab").exception("a transfer's done-callback raised")
            took = time.monotonic() - started
            if took > self.SLOW_CALLBACK_S and not self._warned:
                self._warned = True
                warnings.warn(f"a transfer's done-callback ran for {took:.1f} s; callbacks run one at a time on "
                              "their own thread, so the others waited: hand long work to your own thread",
                              RuntimeWarning, stacklevel=1)


_CALLBACKS = _Callbacks()


class AwaitableFuture(concurrent.futures.Future):  # type: ignore[type-arg]
    """A ``concurrent.futures.Future`` that can also be awaited under asyncio. Its done-callbacks run on
    their own thread, never on the engine's. ``result(timeout)`` and ``exception(timeout)``: None or inf
    waits until it is done (it has a deadline of its own), 0 polls; nan, negatives and non-numbers are
    refused (the standard Future raises an empty TimeoutError at once for them, or OverflowError for inf)."""

    def result(self, timeout: float | None = None) -> Any:
        return super().result(_wait_limit(timeout))

    def exception(self, timeout: float | None = None) -> BaseException | None:
        return super().exception(_wait_limit(timeout))

    def add_done_callback(self, fn: Callable[[Any], object]) -> None:
        super().add_done_callback(lambda future: _CALLBACKS.run(fn, future))

    def __await__(self) -> Generator[Any, None, Any]:
        return asyncio.wrap_future(self).__await__()


def _wait_limit(timeout: Any) -> float | None:
    if timeout is None or isinstance(timeout, numbers.Real) and not isinstance(timeout, bool) and timeout == math.inf:
        return None
    if isinstance(timeout, bool) or not isinstance(timeout, numbers.Real) or not float(timeout) >= 0:
        raise fi.UsageError(f"timeout must be None (wait until done), 0 (poll) or seconds to wait, got {timeout!r}")
    return float(timeout)


# How long a caller waiting for a transfer looks for its end on its own thread before it sleeps until the
# engine's reaper tells it: about what a few small writes take, so that one waited for costs no hand-over
# between threads, while a long transfer's caller soon sleeps instead of spinning.
FINISH_HERE_S = 0.002


class Transfer(AwaitableFuture):
    """The future of a TransferResult: wait with result(), add callbacks, or await it under asyncio.

    A transfer cannot be cancelled once submitted (its writes are in the NICs' queues): ``cancel()``
    returns False. ``wait_safe(timeout)`` waits until no write of it can read the local buffer.
    ``writes``: how many writes it became (contiguous pages coalesced); ``pages``: how many the peer's
    ``Engine.expect`` counts for it (one per page of write_pages, whatever the coalescing)."""

    def __init__(self, writes: int, nbytes: int, deadline: float, safety: Safety, pages: int | None = None) -> None:
        super().__init__()
        self.writes, self.bytes, self.deadline = writes, nbytes, deadline
        self.pages = writes if pages is None else pages
        self.started = time.perf_counter()
        self._safety = safety
        self._peer_process: tuple[int, int, int] | None = None  # Peer.process of its peer, where known
        # a path that can finish the transfer on the waiting thread (the NICs' counters, the GPU copy's event)
        # sets this: result() and exception() call it first with how long they may look (seconds), and save
        # a hand-over between threads
        self._finish_here: Callable[[float], None] | None = None
        self.set_running_or_notify_cancel()  # running: cancel() refuses instead of lying

    def _wait_here(self, timeout: float | None) -> float | None:
        """Let the path finish the transfer on this thread, for up to FINISH_HERE_S of ``timeout`` (the cuda-ipc
        path waits for its copy whole); returns what is left of ``timeout`` for the ordinary wait."""
        if self._finish_here is None or self.done() or timeout == 0:
            return timeout
        started = time.monotonic()
        self._finish_here(FINISH_HERE_S if timeout is None else min(timeout, FINISH_HERE_S))
        return None if timeout is None else max(0.0, timeout - (time.monotonic() - started))

    def result(self, timeout: float | None = None) -> TransferResult:
        """The :class:`TransferResult`, once every write completed (raises the transfer's failure)."""
        result: TransferResult = super().result(self._wait_here(_wait_limit(timeout)))
        return result

    def exception(self, timeout: float | None = None) -> BaseException | None:
        """The transfer's failure (None once it succeeded), as ``concurrent.futures.Future.exception``."""
        return super().exception(self._wait_here(_wait_limit(timeout)))

    def wait_safe(self, timeout: float | None = None) -> bool:
        """True once no write of this transfer can still read the local buffer (False if ``timeout``
        seconds, default 30, pass first, or the engine closed before the provider reported them)."""
        return self._safety.wait(timeout)

    def _succeed(self) -> None:
        """Every write completed: resolve to a TransferResult timed from the submission (unless another thread
        of the engine resolved it first)."""
        with contextlib.suppress(concurrent.futures.InvalidStateError):
            self.set_result(TransferResult(self.bytes, self.writes, time.perf_counter() - self.started,
                                           pages=self.pages))

    def _fail(self, failure: BaseException) -> None:
        """Fail it with ``failure``, unless another thread of the engine resolved it first."""
        with contextlib.suppress(concurrent.futures.InvalidStateError):
            self.set_exception(failure)
