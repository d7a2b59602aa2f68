"""The machinery every libfabric object shares: the process that owns it (refreshed after fork()), the
signal handlers libfabric's providers replace and fabriclab gives back, the resource tree (``Resource``
over ``_Native``) that closes children before their parent and never closes what a child inherited, and
the order of closing at interpreter exit (``stop_first_at_exit``)."""
from __future__ import annotations

import atexit
import itertools
import os
import signal
import threading
import weakref
from types import TracebackType
from typing import Any, Callable, Literal, Protocol, TypeVar

from .. import _inprocess
from .constants import ffi, lib
from .errors import FabricError, UsageError

#: A cffi pointer or struct (``ffi.new``, a libfabric object): cffi's objects carry no static types.
CData = Any

# --------------------------------------------------------------------------------------------- signals

# Every signal a handler can be installed for: whichever a provider takes, it is given back.
_SIGNALS = sorted(int(s) for s in signal.valid_signals() if s not in (signal.SIGKILL, signal.SIGSTOP))
_signals_c = ffi.new("int[]", _SIGNALS)
_signals_lock = threading.Lock()
_given_back: set[int] = set()


def keeping_signal_handlers(call: Callable[..., int], *args: Any) -> int:
    """Make a libfabric call that may install signal handlers, then put back every handler it replaced.

    libfabric's shm provider, at the first fi_endpoint of a process (measured on 1.17 with
    native/signals.c; other providers and versions may do it when they initialise, so fi_getinfo,
    fi_fabric, fi_domain and fi_enable go through here too), installs handlers for SIGINT, SIGTERM, SIGSEGV
    and SIGBUS that delete the process's /dev/shm regions and then chain to the previous handler. Under
    Python SIGINT becomes KeyboardInterrupt and the process lives on without its region: the next peer
    it writes to maps the vanished region and crashes in fi_cq_read. With the previous handlers back,
    Ctrl-C is a KeyboardInterrupt that keeps the region, SIGTERM still terminates, and a process that dies
    of a signal leaves its region to ``fabriclab clean`` (and the next engine start) to reclaim. The lock
    keeps a concurrent call from snapshotting the provider's handlers as if they were the application's."""
    with _signals_lock:
        snapshot = lib.fl_signals_snapshot(_signals_c, len(_SIGNALS))
        if snapshot == ffi.NULL:
            raise MemoryError("fl_signals_snapshot")
        try:
            return call(*args)
        finally:
            restored = ffi.new("int[]", len(_SIGNALS))
            n = lib.fl_signals_restore(snapshot, restored, len(_SIGNALS))
            lib.fl_signals_free(snapshot)
            if n < 0:
                raise OSError(-n, f"sigaction could not give back the signal handlers libfabric replaced: "
                                  f"{os.strerror(-n)}")
            _given_back.update(restored[i] for i in range(n))


def signals_given_back() -> frozenset[signal.Signals]:
    """The signals whose handlers libfabric replaced in this process and fabriclab put back (on shm:
    SIGINT, SIGTERM, SIGSEGV, SIGBUS once the first endpoint is open; empty before)."""
    return frozenset(signal.Signals(s) for s in _given_back)


def cstr(ptr: CData) -> str | None:
    """A C string's text, or None for NULL."""
    return ffi.string(ptr).decode(errors="replace") if ptr != ffi.NULL else None


# ----------------------------------------------------------------------------------- resource tree

# The process running now, refreshed in a child after fork(): a libfabric object belongs to the process
# that opened it. Comparing with a variable, not calling os.getpid(), keeps a system call off every post.
_pid = os.getpid()


def _after_fork_in_child() -> None:
    global _pid, _signals_lock
    _pid = os.getpid()
    _signals_lock = threading.Lock()  # another thread of the parent may have held it at fork()
    _inprocess.after_fork_in_child()


os.register_at_fork(after_in_child=_after_fork_in_child)


class _Native:
    """The libfabric side of one Resource: its fid, the process that opened it, its children's _Native.

    Kept apart from the Resource so that a finalizer can close it without referring to the Resource (a
    finalizer holding its object keeps it alive for ever; one holding a weak reference finds it already
    dead at collection). A parent holds its children's _Native strongly and the children themselves
    weakly, while each child holds its parent: a dropped child is closed when collected, and a parent
    closes whatever is still open under it, newest first, even children being collected along with it.
    """

    __slots__ = ("kind", "fid", "pid", "closed", "children", "parent", "owner")

    def __init__(self, kind: str, parent: _Native | None, owner: Resource) -> None:
        self.kind = kind
        self.fid: CData = None  # struct fid * once opened
        self.pid = _pid
        self.closed = False
        self.children: list[_Native] = []
        self.parent = parent
        self.owner = weakref.ref(owner)
        if parent is not None:
            parent.children.append(self)

    def close(self) -> FabricError | None:
        """Close what is open under this object (newest first), then the object; the first failure.

        In a process other than the opener (a child after fork()) nothing is closed, only forgotten: the
        libfabric object is the opener's, and closing an inherited shm endpoint deletes the opener's
        /dev/shm region (its name is per process)."""
        if self.closed:
            return None
        self.closed = True
        first_error: FabricError | None = None
        for child in reversed(self.children[:]):  # each child unlinks itself from this list
            error = child.close()
            first_error = first_error or error
        if self.fid is not None and self.pid == _pid:
            if not _inprocess.close_now(self):
                return first_error  # an endpoint of this process still holds its address: closed later
            rc = lib.fi_close(self.fid)
            if rc < 0:
                first_error = first_error or FabricError(f"fi_close({self.kind})", rc)
        self._forget()
        return first_error

    def _forget(self) -> None:
        """The libfabric object is gone: off the parent's list; close what waited for it (fabriclab._inprocess)."""
        self.fid = None
        if self.parent is not None and self in self.parent.children:
            self.parent.children.remove(self)
        for waiting in _inprocess.closed(self) if self.pid == _pid else ():
            lib.fi_close(waiting.fid)  # closed for Python long ago: nobody is left to tell of a failure
            waiting._forget()

    def collect(self) -> None:
        """The finalizer: the Resource was garbage-collected (or the interpreter is exiting) unclosed."""
        self.close()  # nobody is left to tell of a failure

    def where(self) -> str:
        """Why the object cannot be used here, or '' when it can."""
        if self.closed:
            return f"{self.kind} is closed"
        if self.pid != _pid:
            return (f"this {self.kind} was created in process {self.pid} before fork(); open a new one in the "
                    f"child (process {_pid})")
        return ""


_R = TypeVar("_R", bound="Resource")


class Resource:
    """A libfabric object: a context manager that closes its children (newest first) before itself.

    A Resource nothing refers to any more is closed when garbage-collected; a root (Fabric) still open at
    interpreter exit is closed then, with everything under it. After fork(), the child's copies are
    ``inherited``: any use raises UsageError, and ``close()`` (or collection) only drops the Python side,
    never closing what belongs to the parent.
    """

    def __init__(self, parent: Resource | None) -> None:
        if parent is not None:
            problem = parent._native.where()
            if problem:
                raise UsageError(f"cannot create a {type(self).__name__} here: {problem}")
        self.parent = parent
        self._handle: CData = None  # the struct fid_* * libfabric returned
        self._native: _Native = _Native(type(self).__name__, parent._native if parent is not None else None, self)
        self._finalizer = weakref.finalize(self, self._native.collect)
        # At exit only roots close, each its whole tree, and only once every thread that may still use them
        # stopped (_close_at_exit): a child closed on its own could go before an engine still writing from it.
        self._finalizer.atexit = False
        if parent is None:
            _roots[next(_opened)] = self

    def _opened(self, ptr: CData) -> None:
        """Record the libfabric object just opened (a struct fid_* *)."""
        self._native.fid = ffi.addressof(ptr[0], "fid")
        self._handle = ptr

    @property
    def _ptr(self) -> CData:
        """The libfabric object, for calls on it: UsageError once closed, or in a child after fork()."""
        self._require_open()
        return self._handle

    @property
    def closed(self) -> bool:
        return self._native.closed

    @property
    def inherited(self) -> bool:
        """True in a child process that got this object through fork(): it belongs to the parent (``pid``)."""
        return self._native.pid != _pid

    @property
    def pid(self) -> int:
        """The process that opened this object."""
        return self._native.pid

    def _fid(self) -> CData:
        self._require_open()
        return self._native.fid

    def close(self) -> None:
        native = self._native
        if native.closed:
            return
        first_error: FabricError | None = None
        for child in reversed(self.children):  # live children also drop their Python side
            try:
                child.close()
            except FabricError as exc:
                first_error = first_error or exc
        error = native.close()  # what is left under it (children no longer referred to), then itself
        first_error = first_error or error
        self._finalizer.detach()
        self._handle = None
        self._release()
        if first_error is not None:
            raise first_error

    def keep_open(self) -> None:
        """Leave this object open for the life of the process, even at interpreter exit (only its root's
        finalizer closes anything then): as long as a reference to it lives, nothing closes it."""
        self._finalizer.detach()

    def _release(self) -> None:
        """Drop Python-side references once the libfabric object is gone."""

    def _require_open(self) -> None:
        native = self._native
        if native.closed or native.pid != _pid:
            raise UsageError(native.where())

    def __enter__(self: _R) -> _R:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> Literal[False]:
        close_keeping(self, exc)
        return False

    @property
    def children(self) -> list["Resource"]:
        """The open children still referred to from Python, oldest first."""
        return [c for c in (n.owner() for n in self._native.children if not n.closed) if c is not None]


# ------------------------------------------------------------------------------------ interpreter exit

# What is still open at interpreter exit closes in two steps of fabriclab's own, not in weakref.finalize's
# order (newest created first): an engine's control channel opens its fabric after the engine, at its first
# staged transfer, and was closed under the landing thread still reading it (tracebacks by the hundred, at
# times SIGSEGV in fi_cq_read). First every user of libfabric objects with threads of its own stops (newest
# first), then every root still open closes with its tree (newest first).
_users: dict[int, tuple[weakref.ref[Any], Callable[[Any], bool]]] = {}  # opening order -> (user, its stop)
_roots: weakref.WeakValueDictionary[int, Resource] = weakref.WeakValueDictionary()  # opening order -> root
_opened = itertools.count()
_U = TypeVar("_U")


def stop_first_at_exit(user: _U, stop: Callable[[_U], bool]) -> None:
    """At interpreter exit, while ``user`` lives (an Engine's service, whose threads call into libfabric
    objects), call ``stop(user)`` before any libfabric object closes, whatever was opened first. ``stop``
    returns once those threads are done with them: True, or False if some may still be inside them (then
    nothing is closed at exit: the process ends with them open)."""
    key = next(_opened)
    _users[key] = (weakref.ref(user, lambda _: _users.pop(key, None)), stop)


@atexit.register
def _close_at_exit() -> None:
    # copy(): in one step, where a collection (a user's weakref callback) could change the dict inside a loop
    users = [(ref(), stop) for _, (ref, stop) in sorted(_users.copy().items(), reverse=True)]
    let_go = [stop(user) for user, stop in users if user is not None]  # every one stops, even after one that could not
    if not all(let_go):
        return  # a thread may still be inside a libfabric call: closing under it could crash the process
    for opened in sorted(_roots.keys(), reverse=True):
        root = _roots.get(opened)
        if root is not None and root._finalizer.detach() is not None:  # else closed, or kept open
            root._native.collect()


class Closable(Protocol):
    def close(self) -> None: ...


def close_keeping(resource: Closable, pending: BaseException | None) -> None:
    """Close; when an exception is already on its way out, a failure to close (e.g. EBUSY after a
    timeout) must not replace it."""
    try:
        resource.close()
    except FabricError:
        if pending is None:
            raise
