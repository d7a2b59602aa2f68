"""fi_cq_open: completion queues (``CompletionQueue``), their entries (``Completion``) and the contexts that
keep each posted operation alive until its completion is read."""
from __future__ import annotations

import collections
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, NoReturn

from ._core import CData, Resource, cstr
from .constants import ffi, lib
from .errors import FabricError, FabricTimeout, check

if TYPE_CHECKING:
    from .fabric import Domain
    from .mr import MemoryRegion


@dataclass
class Completion:
    """One completion queue entry. ``token`` is what the poster passed (None for remote writes' data)."""
    token: Any
    flags: int
    length: int
    data: int

    @property
    def is_remote_write(self) -> bool:
        return bool(self.flags & lib.FI_REMOTE_WRITE)

    @property
    def has_data(self) -> bool:
        return bool(self.flags & lib.FI_REMOTE_CQ_DATA)


#: The sim provider's extension that holds its modeled clock (FI__SIM_HOST_OPS, native/sim/fi_sim_ext.h).
_SIM_HOST_OPS = b"fabriclab_sim_host_v1"


class CompletionQueue(Resource):
    """fi_cq_open with FI_CQ_FORMAT_DATA. Keeps each posted operation's context alive until it completes.

    ``poll`` returns completions; an error entry raises FabricError with fi_cq_strerror's text and the
    failed operation's token.
    """

    BATCH = 16

    def __init__(self, domain: Domain, size: int = 0):
        super().__init__(domain)
        attr = ffi.new("struct fi_cq_attr *")
        attr.size = size
        attr.format = lib.FI_CQ_FORMAT_DATA
        attr.wait_obj = lib.FI_WAIT_NONE
        out = ffi.new("struct fid_cq **")
        check(lib.fi_cq_open(domain._ptr, attr, out, ffi.NULL), "fi_cq_open")
        self._opened(out[0])
        self._entries = ffi.new("struct fi_cq_data_entry[]", self.BATCH)
        self._err = ffi.new("struct fi_cq_err_entry *")
        self._errbuf = ffi.new("char[]", 256)
        self._inflight: dict[int, tuple[CData, Any, MemoryRegion | None]] = {}  # context, token, memory
        self._backlog: collections.deque[Completion] = collections.deque()
        self.polls = 0

    def modeled_clock(self) -> Callable[[], int] | None:
        """The modeled host's clock of the calling thread, in ns, where the provider has one (the sim provider
        in modeled time, docs/model.md: native/sim/fi_sim_ext.h), else None (its time is the wall clock)."""
        ops = ffi.new("void **")
        if lib.fi_open_ops(ffi.cast("struct fid *", self._ptr), _SIM_HOST_OPS, 0, ops, ffi.NULL) != 0:
            return None
        host = ffi.cast("struct fi_sim_host_ops *", ops[0])
        return lambda: int(host.now_ns())

    def new_context(self, token: Any, mr: MemoryRegion | None = None) -> CData:
        """A fresh operation context (big enough for FI_CONTEXT and FI_CONTEXT2) tied to ``token``; it holds
        ``mr``, the operation's memory, until the completion is read: a region dropped by the caller while
        the provider still uses it is not deregistered (closed when collected) before then."""
        ctx = ffi.new("struct fi_context2 *")
        self._inflight[int(ffi.cast("uintptr_t", ctx))] = (ctx, token, mr)
        return ctx

    def forget_context(self, ctx: CData) -> None:
        """Undo new_context for an operation that was never posted (e.g. the post returned -FI_EAGAIN)."""
        self._inflight.pop(int(ffi.cast("uintptr_t", ctx)), None)

    @property
    def outstanding(self) -> int:
        """Operations posted through this queue whose completion has not been read yet."""
        return len(self._inflight)

    def _token(self, op_context: CData) -> Any:
        if op_context == ffi.NULL:
            return None
        ctx = self._inflight.pop(int(ffi.cast("uintptr_t", op_context)), None)
        return ctx[1] if ctx else None

    def poll(self, max_entries: int = BATCH) -> list[Completion]:
        """Read up to max_entries completions without blocking (this also drives software progress)."""
        self._require_open()
        if self._backlog:
            return [self._backlog.popleft() for _ in range(min(max_entries, len(self._backlog)))]
        self.polls += 1
        n = lib.fi_cq_read(self._ptr, self._entries, min(max_entries, self.BATCH))
        if n == -lib.FI_EAGAIN:
            return []
        if n == -lib.FI_EAVAIL:
            self._raise_error_entry()
        check(n, "fi_cq_read")
        e = self._entries
        return [Completion(self._token(e[i].op_context), int(e[i].flags), int(e[i].len), int(e[i].data))
                for i in range(n)]

    def progress(self) -> None:
        """Drive progress while keeping completions for the next poll (used while retrying -FI_EAGAIN)."""
        if not self._backlog:
            self._backlog.extend(self.poll())

    def _raise_error_entry(self) -> NoReturn:
        rc = lib.fi_cq_readerr(self._ptr, fresh_error_entry(self._err), 0)
        if rc < 0:
            raise FabricError("fi_cq_readerr", rc)
        err = self._err
        detail = lib.fi_cq_strerror(self._ptr, err.prov_errno, err.err_data, self._errbuf, len(self._errbuf))
        text = cstr(detail) or ""
        token = self._token(err.op_context)
        raise FabricError("completion", err.err, detail=text, token=token)

    def wait(self, done: Callable[[], bool], timeout: float, what: str,
             on_completion: Callable[[Completion], None], hint: str = "") -> None:
        """Poll until ``done()`` is true, handing each completion to ``on_completion``; FabricTimeout
        after ``timeout`` seconds. Spins while busy, then backs off gently so an idle peer does not burn
        a core (software providers only progress while someone polls)."""
        deadline = time.monotonic() + timeout
        idle_since = time.monotonic()
        while not done():
            got = self.poll()
            for c in got:
                on_completion(c)
            now = time.monotonic()
            if got:
                idle_since = now
            elif now > deadline:
                raise FabricTimeout(what, timeout, hint)
            elif now - idle_since > 0.05:
                time.sleep(0.0002)

    def _release(self) -> None:
        self._inflight.clear()
        self._backlog.clear()


def fresh_error_entry(entry: CData) -> CData:
    """The reused fi_cq_err_entry, ready for the next fi_cq_readerr: a provider may hand back error data of
    its own (efa does), into its own buffer when err_data_size is 0; a stale size and pointer left by the
    previous entry would have it write through them."""
    entry.err_data, entry.err_data_size = ffi.NULL, 0
    return entry
