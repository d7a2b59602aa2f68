"""The binding's errors and input checks: FabriclabError (the root of every error fabriclab raises),
FabricError for a failed libfabric call, FabricTimeout, UsageError for bad input; ``check`` for return codes."""
from __future__ import annotations

import errno as _errno
import math
import numbers
import operator
from typing import Any, SupportsIndex, cast

from .constants import _ERRNO_NAMES, ffi, lib


class FabriclabError(Exception):
    """The root of every error fabriclab raises on purpose (libfabric failures, bad input, failed
    transfers, the testbed's): ``except fabriclab.FabriclabError`` catches them all, and nothing else."""


class FabricError(FabriclabError, RuntimeError):
    """A libfabric call failed: carries the call, the errno (positive) and its name, and libfabric's text.

    ``detail`` holds provider-specific text (``fi_cq_strerror``) for errors read from a completion queue,
    ``token`` the caller's token of the operation that failed, when there is one.
    """

    def __init__(self, call: str, code: int, detail: str = "", token: Any = None,
                 message: str | None = None) -> None:
        self.call = call
        self.errno = abs(int(code))
        self.errno_name = errno_name(self.errno)
        self.strerror = ffi.string(lib.fi_strerror(self.errno)).decode(errors="replace")
        self.detail = detail
        self.token = token
        text = message or f"{call} failed: {self.errno_name} ({self.strerror})"
        if detail:
            text += f": {detail}"
        self.text = text
        super().__init__(text)

    def __str__(self) -> str:
        return self.text


# TimeoutError is an OSError, whose errno typeshed declares "int | None"; a FabricError's is always an int.
class FabricTimeout(FabricError, TimeoutError):  # type: ignore[misc]
    """A wait ran out of time: the peer is gone, stalled, or never answered."""

    def __init__(self, what: str, timeout: float, hint: str = "") -> None:
        msg = f"{what} did not happen within {timeout:g} s"
        if hint:
            msg += f" ({hint})"
        super().__init__(what, lib.FI_ETIMEDOUT, message=msg)
        self.timeout = timeout


class UsageError(FabriclabError, ValueError):
    """Bad input detected before any libfabric call: the message names the problem and the fix."""


def integer(value: object, name: str, minimum: int | None = None, maximum: int | None = None) -> int:
    """An integer (numpy's too); never a bool (numpy's either: named, not imported, since it is no int
    subclass) or a float, which would be silently truncated."""
    if type(value).__name__ in ("bool", "bool_"):
        raise UsageError(f"{name} must be an integer, got {value!r}")
    try:
        index = operator.index(cast(SupportsIndex, value))
    except TypeError:
        raise UsageError(f"{name} must be an integer, got {value!r}") from None
    if minimum is not None and index < minimum or maximum is not None and index > maximum:
        bounds = f"at least {minimum}" if maximum is None else f"between {minimum} and {maximum}"
        raise UsageError(f"{name} must be {bounds}, got {index}")
    return index


def seconds(value: object, name: str, default: float | None = None, zero_means: str | None = None) -> float:
    """A number of seconds for a deadline: finite and larger than zero (``None``: the default). Zero or
    less would fail every wait at once, nan never compares, inf turns a dead peer into a hang. With
    ``zero_means``, 0 is allowed too ("failover off", say)."""
    if value is None and default is not None:
        return default
    if isinstance(value, numbers.Real) and not isinstance(value, bool):
        if float(value) == 0 and zero_means:
            return 0.0
        if math.isfinite(value) and float(value) > 0:
            return float(value)
    raise UsageError(f"{name} must be a finite number larger than zero"
                     f"{f', or 0 to turn {zero_means}' if zero_means else ''}, got {value!r}")


def errno_name(code: int) -> str:
    """libfabric's name for an error number (FI_E...), else the C library's (E...)."""
    code = abs(int(code))
    fi_name = _ERRNO_NAMES.get(code)
    if fi_name:
        return fi_name
    return _errno.errorcode.get(code, f"errno {code}")


def check(rc: int, call: str) -> int:
    """``rc`` when it is not negative; FabricError naming ``call`` otherwise."""
    if rc < 0:
        raise FabricError(call, rc)
    return rc
