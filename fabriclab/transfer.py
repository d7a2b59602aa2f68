"""Transfers as the caller holds them: :class:`Transfer` (a future that can also be awaited), the
:class:`TransferResult` it resolves to, and :class:`Safety`, the moment its writes stop reading the local
buffer. Done-callbacks run on a thread of their own (:class:`_Callbacks`), never on the engine's."""
from __future__ import annotations

import asyncio
import concurrent.futures
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
    engine closed first)."""

    def __init__(self, default_timeout: float) -> None:
        self._cond = threading.Condition()
        self._state: bool | None = None  # True: safe; False: the engine closed before the provider reported all
        self._default_timeout = default_timeout

    def settle(self, safe: bool) -> None:
        with self._cond:
            if self._state is None:
                self._state = safe
                self._cond.notify_all()

    @property
    def safe(self) -> bool:
        return self._state is True

    def wait(self, timeout: float | None) -> bool:
        timeout = fi.seconds(timeout, "timeout", self._default_timeout)
        with self._cond:
            self._cond.wait_for(lambda: self._state is not None, timeout)
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
        # a path that can finish the transfer on the waiting thread (the GPU copy's event) sets this: result()
        # and exception() call it first, and save a hand-over between threads
        self._finish_here: Callable[[], None] | None = None
        self.set_running_or_notify_cancel()  # running: cancel() refuses instead of lying

    def result(self, timeout: float | None = None) -> TransferResult:
        """The :class:`TransferResult`, once every write completed (raises the transfer's failure)."""
        if self._finish_here is not None and not self.done():
            self._finish_here()
        result: TransferResult = super().result(timeout)
        return result

    def exception(self, timeout: float | None = None) -> BaseException | None:
        """The transfer's failure (None once it succeeded), as ``concurrent.futures.Future.exception``."""
        if self._finish_here is not None and not self.done():
            self._finish_here()
        return super().exception(timeout)

    def wait_safe(self, timeout: float | None = None) -> bool:
        """True once no write of this transfer can still read the local buffer (False if ``timeout``
        seconds, default 30, pass first, or the engine closed before the provider reported them)."""
        return self._safety.wait(timeout)

    def _succeed(self) -> None:
        """Every write completed: resolve to a TransferResult timed from the submission."""
        self.set_result(TransferResult(self.bytes, self.writes, time.perf_counter() - self.started, pages=self.pages))
