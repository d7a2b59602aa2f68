"""CUDA through cuda-python (``cuda.bindings``): which GPUs are here. Optional: without cuda-python or
without a GPU, ``devices()`` is empty and ``require_cuda()`` explains what is missing."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .fi import FabriclabError, UsageError


@dataclass(frozen=True)
class GpuDevice:
    index: int
    name: str
    pci: str  # domain:bus:device.function, lower case, as sysfs names it
    memory_bytes: int


# cuda-python has no type information: its driver module, and the values its calls return, are Any.

def _driver() -> Any:
    try:
        from cuda.bindings import driver  # cuda-python >= 12.6
    except ImportError:
        try:
            from cuda import cuda as driver  # older cuda-python
        except ImportError:
            return None
    return driver


class CudaError(FabriclabError, RuntimeError):
    """A CUDA call failed, or the GPU memory it works on is gone (freed by its owner)."""


def error_name(err: Any) -> str:
    """CUDA's name for a CUDA error code (``CUDA_ERROR_...``), or "unknown"."""
    try:
        name = _driver().cuGetErrorName(err)[1]
        return name.decode() if isinstance(name, bytes) else str(name)
    except Exception:  # the name is a nicety; the number is already in the message
        return "unknown"


def check(result: tuple[Any, ...], call: str) -> Any:
    """The value(s) of a cuda-python call's result (its error code first, then one value or several);
    CudaError naming the call and the error otherwise."""
    err, *rest = result
    if int(err) != 0:
        raise CudaError(f"{call} failed: CUDA error {int(err)} ({error_name(err)})")
    return rest[0] if len(rest) == 1 else rest


def cuda_status() -> str:
    """'ok', or why CUDA cannot be used here."""
    driver = _driver()
    if driver is None:
        return "cuda-python is not installed (pip install 'fabriclab[gpu]')"
    err, = driver.cuInit(0)
    if int(err) != 0:
        return f"no usable CUDA driver or GPU (cuInit returned {int(err)})"
    count = check(driver.cuDeviceGetCount(), "cuDeviceGetCount")
    return "ok" if count else "no CUDA GPU found"


def require_cuda() -> Any:
    """The cuda-python driver module, initialised; UsageError naming what is missing otherwise."""
    status = cuda_status()
    if status != "ok":
        raise UsageError(f"GPU memory was asked for, but {status}; use --memory host")
    return _driver()


_PRIMARY: dict[int, Any] = {}  # device -> its primary context, retained once


def primary_context(device: int, current: bool = True) -> Any:
    """The primary context of CUDA ``device`` (torch's and cupy's), retained once for the life of the process
    (never released: the allocations and streams made in it live as long), and made current on the calling
    thread unless ``current`` is False. UsageError for a device that does not exist."""
    d = require_cuda()
    context = _PRIMARY.get(device)
    if context is None:
        count = check(d.cuDeviceGetCount(), "cuDeviceGetCount")
        if not 0 <= device < count:
            raise UsageError(f"CUDA device {device} does not exist (this machine has {count})")
        context = _PRIMARY.setdefault(device, check(d.cuDevicePrimaryCtxRetain(check(d.cuDeviceGet(device),
                                                                                     "cuDeviceGet")),
                                                    "cuDevicePrimaryCtxRetain"))
    if current:
        check(d.cuCtxSetCurrent(context), "cuCtxSetCurrent")
    return context


def devices() -> list[GpuDevice]:
    """The CUDA GPUs of this machine (none without cuda-python or a driver)."""
    if cuda_status() != "ok":
        return []
    driver = _driver()
    out = []
    for index in range(check(driver.cuDeviceGetCount(), "cuDeviceGetCount")):
        dev = check(driver.cuDeviceGet(index), "cuDeviceGet")
        name = check(driver.cuDeviceGetName(64, dev), "cuDeviceGetName")
        name = name.split(b"\0", 1)[0].decode() if isinstance(name, bytes) else str(name)
        pci = check(driver.cuDeviceGetPCIBusId(32, dev), "cuDeviceGetPCIBusId")
        pci = pci.split(b"\0", 1)[0].decode() if isinstance(pci, bytes) else str(pci)
        memory = check(driver.cuDeviceTotalMem(dev), "cuDeviceTotalMem")
        out.append(GpuDevice(index, name, pci.lower(), int(memory)))
    return out
