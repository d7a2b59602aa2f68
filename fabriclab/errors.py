"""The engine's typed failures (``fabriclab.TransferError`` and its kinds), and how the engine's layers turn
what went wrong into them: an errno of a write, a staged transfer's failure, an address that cannot be used.

Every failure says whether the local buffer of its transfer is safe to reuse (``buffer_safe``), and can
wait for the moment it becomes so (``wait_safe``)."""
from __future__ import annotations

import errno
import os
from typing import TYPE_CHECKING

from . import fi

if TYPE_CHECKING:
    from .transfer import Safety

FabriclabError, UsageError = fi.FabriclabError, fi.UsageError  # the error root, and bad input (exported)

# Errors of a write that say the peer cannot be reached (rather than that it refused the write).
_PEER_GONE = {errno.ECONNREFUSED, errno.ECONNRESET, errno.EHOSTUNREACH, errno.ENOTCONN, errno.EPIPE,
              errno.ESRCH, errno.ECONNABORTED, errno.EIO, errno.ENETUNREACH, errno.EHOSTDOWN, errno.ECANCELED}


class TransferError(fi.FabriclabError, RuntimeError):
    """A transfer could not finish. ``buffer_safe``: no write of it can still read the local buffer.

    When it is False, ``wait_safe(timeout)`` waits for the moment it becomes true (the provider reported
    every write the engine gave up on) and says whether it came. The message says it too, except where no
    local buffer was ever involved (``about_buffer=False``: ``Engine.connect``, ``Engine.expect``)."""

    def __init__(self, message: str, buffer_safe: bool, safety: Safety | None = None, *,
                 about_buffer: bool = True) -> None:
        note = f" (local buffer {'is' if buffer_safe else 'is NOT yet'} safe to reuse)" if about_buffer else ""
        super().__init__(message + note)
        self.buffer_safe = buffer_safe
        self._safety = safety

    def wait_safe(self, timeout: float | None = None) -> bool:
        """True once no write of the transfer can read the local buffer; False if ``timeout`` seconds
        (default 30) pass first or the engine was closed before the provider reported them."""
        if self.buffer_safe or self._safety is None:
            return self.buffer_safe
        return self._safety.wait(timeout)


class PeerLost(TransferError):
    """No NIC reaches the peer any more: every path to it failed (connection refused, reset or dropped) or
    stopped completing writes, or the peer's process, on this host, is gone. The message says which. Not proof that the peer is gone: a write it could
    not take (into a region it closed, with a stale descriptor) drops the connection on some providers
    (tcp) and stalls the path on others (shm). ``Engine.connect`` to the peer again revives its paths."""


class WriteRejected(TransferError):
    """The provider refused a write of the transfer (a key or range the peer does not accept, say): the
    peer may be fine; later writes with valid descriptors go through."""


class TransferTimeout(TransferError, TimeoutError):
    """The deadline passed before every write completed (or before the expected writes arrived)."""


class RegionClosed(TransferError):
    """The region was closed before or while the transfer used it."""


class InvalidDescriptor(TransferError, ValueError):
    """A region descriptor or engine address that is forged, truncated, or for another engine."""

    def __init__(self, message: str, *, about_buffer: bool = True) -> None:
        super().__init__(message, buffer_safe=True, about_buffer=about_buffer)


class OutOfRange(TransferError, IndexError):
    """Offsets or pages outside a region; refused before anything was posted."""

    def __init__(self, message: str) -> None:
        super().__init__(message, buffer_safe=True)


class StagingFailed(TransferError):
    """The staged path (GPU memory through pinned host memory) failed: a CUDA call failed, or the GPU memory
    of the region is gone (freed by its owner). The writes of the transfer that had been handed to the NICs
    read the staging pool only, never the region."""


def closed_here(what: str, about_buffer: bool = True) -> PeerLost:
    """For a write to (or connect() to) an engine closed in this process: nothing was posted."""
    return PeerLost(f"{what} was closed, in this process: nothing reaches it any more (connect to an open engine)",
                    buffer_safe=True, about_buffer=about_buffer)


def bad_address(message: str) -> InvalidDescriptor:
    """What ``Engine.connect`` raises for an address it cannot use: no buffer is involved, none is mentioned."""
    return InvalidDescriptor(message, about_buffer=False)


def as_the_callers(error: BaseException, safe: bool, safety: Safety) -> BaseException:
    """A staged transfer's failure as its caller sees it: the writes that failed read from the staging pool
    (or wrote into the peer's lanes), so the safety they report is the pool's, not the caller's buffer's.
    The same kind of error, whose ``buffer_safe`` and ``wait_safe`` are about the caller's buffer."""
    if not isinstance(error, TransferError) or error.buffer_safe == safe and error._safety is safety:
        return error
    try:
        mine = type(error)(str(error).rsplit(" (local buffer ", 1)[0], buffer_safe=safe, safety=safety)
    except TypeError:  # an error that is always safe (InvalidDescriptor, OutOfRange): nothing to say
        return error
    mine.__cause__ = error
    return mine


def staging_failure(message: str, safe: bool, why: str, cause: BaseException | None = None) -> TransferError:
    """The exception of a staged transfer that failed (why: see staging.FAILURES, or "peer" where a staged
    target's control endpoint cannot be reached). ``cause``, the failure of one of its writes, gives its
    type, with the buffer safety of the whole transfer."""
    if isinstance(cause, TransferError) and type(cause).__init__ is TransferError.__init__:
        return type(cause)(message.split(" (local buffer ")[0], buffer_safe=safe)
    if why == "peer":
        return PeerLost(message, buffer_safe=safe)
    if why == "closed":
        return RegionClosed(message, buffer_safe=safe)
    if why == "timeout":
        return TransferTimeout(message, buffer_safe=safe)
    if why in ("engine", "invalid"):  # invalid: the target refused a control message of this engine's
        return TransferError(message, buffer_safe=safe)
    return StagingFailed(message, buffer_safe=safe)


def write_failure(error: int, link_timeout: float, safe: bool, safety: Safety) -> TransferError:
    """The exception of a transfer one of whose writes failed with ``error`` (a negative errno, as the
    native engine records it); ``link_timeout``: the engine's, which names a path the engine itself gave up."""
    code = -error
    text = f"{errno.errorcode.get(code, code)}: {os.strerror(code) if code < 4096 else ''}".strip(": ")
    if code == errno.ETIMEDOUT and link_timeout > 0:  # the engine's own: a path stalled
        return PeerLost(f"no NIC reaches the peer any more: a write to it got no completion for {link_timeout:g} s "
                        "and no error, and no other path was left. The peer may well be alive: some providers (shm) "
                        "never complete a write the peer cannot take (into a region it closed, with a stale "
                        "descriptor) and stall the path behind it; else the peer is stopped or gone, or every link "
                        "to it is down. Engine.connect() to it again revives the paths (and renews stuck endpoints)",
                        buffer_safe=safe, safety=safety)
    if code == errno.EHOSTUNREACH:
        return PeerLost("no NIC reaches the peer any more: every path to it failed with an error or had been marked "
                        "down (the peer process may be gone, a link down, or the peer dropped the connection over a "
                        "write it could not take — tcp drops it for a write into a closed region). Engine.connect() "
                        "to it again revives the paths", buffer_safe=safe, safety=safety)
    if code == errno.ENOSPC:
        return WriteRejected("the peer's endpoint takes writes from no more senders (ENOSPC): it already hears as "
                             "many sending endpoints as its provider allows (sim: 256 sending endpoints, "
                             "docs/model.md). Fewer writers into one peer, or close the ones that are done",
                             buffer_safe=safe, safety=safety)
    if code in _PEER_GONE:
        return PeerLost(f"the peer is gone: a write of the transfer failed with {text}", buffer_safe=safe,
                        safety=safety)
    return WriteRejected(f"the provider refused a write of the transfer ({text}): check the descriptor and the "
                         "range; the peer itself may be fine", buffer_safe=safe, safety=safety)
