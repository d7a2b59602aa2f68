"""Buffers the stages move data between: host memory (numpy) and GPU memory (cuda-python), and how each
is registered with a NIC.

GPU memory is registered directly (FI_HMEM with iface FI_HMEM_CUDA — GPUDirect RDMA on p5) when the
provider offers FI_HMEM, its endpoint moves GPU memory without the CUDA API (``Endpoint.gpu_direct``: a
provider copying through its own bounce buffers is no direct path) and the registration succeeds. Otherwise the data is staged through pinned host
memory: the NIC sees the pinned copy, and every page is copied between it and the GPU as it is sent or
as it lands. ``Registration.path`` says which of ``host``, ``cuda-direct``, ``cuda-staged`` ran.
"""
from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import Any, Literal, Protocol, TypeAlias, cast

import numpy as np

from . import fi, gpu

MEMORY_KINDS = ("host", "cuda")


def _host_array(pointer: int, length: int) -> np.ndarray:
    return np.ctypeslib.as_array((ctypes.c_uint8 * length).from_address(pointer))


class HostBuffer:
    """Page-aligned host memory as a numpy uint8 array."""
    kind: Literal["host"] = "host"
    device = 0

    def __init__(self, length: int):
        if length <= 0:
            raise fi.UsageError(f"buffer length must be positive, got {length}")
        self.length = int(length)
        raw = np.empty(self.length + 4096, dtype=np.uint8)
        start = (-raw.ctypes.data) % 4096
        self.array = raw[start:start + self.length]
        self.pointer = self.array.ctypes.data

    def write(self, data: np.ndarray, offset: int = 0) -> None:
        self.array[offset:offset + data.size] = data

    def read(self, offset: int = 0, length: int | None = None) -> np.ndarray:
        length = self.length - offset if length is None else length
        return self.array[offset:offset + length]

    def close(self) -> None:
        self.array = None  # type: ignore[assignment]  # the memory is let go: a use after close fails


class _Cuda:
    """The CUDA driver with the primary context of a device made current on this thread."""

    def __init__(self, device: int):
        self.driver = gpu.require_cuda()
        self.context = gpu.primary_context(device)
        self.device = gpu.check(self.driver.cuDeviceGet(device), "cuDeviceGet")

    def make_current(self) -> None:
        gpu.check(self.driver.cuCtxSetCurrent(self.context), "cuCtxSetCurrent")

    def call(self, name: str, *args: Any) -> Any:
        return gpu.check(getattr(self.driver, name)(*args), name)


class PinnedBuffer(HostBuffer):
    """Page-locked host memory from cuMemHostAlloc: what staged GPU transfers go through."""

    def __init__(self, length: int, device: int = 0):
        if length <= 0:
            raise fi.UsageError(f"buffer length must be positive, got {length}")
        self.cuda = _Cuda(device)
        self.length = int(length)
        self.pointer = int(self.cuda.call("cuMemHostAlloc", self.length, 0))
        self.array = _host_array(self.pointer, self.length)

    def close(self) -> None:
        if self.array is not None:
            self.array = None  # type: ignore[assignment]  # as HostBuffer.close
            self.cuda.call("cuMemFreeHost", self.pointer)


class CudaBuffer:
    """Device memory from cuMemAlloc (plain allocations, never managed memory)."""
    kind: Literal["cuda"] = "cuda"

    def __init__(self, length: int, device: int = 0):
        if length <= 0:
            raise fi.UsageError(f"buffer length must be positive, got {length}")
        self.cuda = _Cuda(device)
        self.device = device
        self.length = int(length)
        self.pointer = int(self.cuda.call("cuMemAlloc", self.length))
        self._open = True

    @property
    def __cuda_array_interface__(self) -> dict[str, Any]:
        """The buffer as a CUDA array of bytes: what ``fabriclab.Engine.register`` (and cupy, numba) take."""
        return {"shape": (self.length,), "typestr": "|u1", "data": (self.pointer, False), "version": 3}

    def write(self, data: np.ndarray, offset: int = 0) -> None:
        data = np.ascontiguousarray(data, dtype=np.uint8)
        self.cuda.call("cuMemcpyHtoD", self.pointer + offset, data.ctypes.data, data.size)

    def read(self, offset: int = 0, length: int | None = None) -> np.ndarray:
        length = self.length - offset if length is None else length
        out = np.empty(length, dtype=np.uint8)
        self.cuda.call("cuMemcpyDtoH", out.ctypes.data, self.pointer + offset, length)
        return out

    def copy_to(self, host: HostBuffer, offset: int, length: int) -> None:
        """Device → host at the same offset (the staged path's outbound copy)."""
        self.cuda.call("cuMemcpyDtoH", host.pointer + offset, self.pointer + offset, length)

    def copy_from(self, host: HostBuffer, offset: int, length: int) -> None:
        """Host → device at the same offset (the staged path's inbound copy)."""
        self.cuda.call("cuMemcpyHtoD", self.pointer + offset, host.pointer + offset, length)

    def close(self) -> None:
        if self._open:
            self._open = False
            self.cuda.call("cuMemFree", self.pointer)


#: The memory the stages move: host (numpy) or GPU (cuda-python).
Buffer: TypeAlias = HostBuffer | CudaBuffer


class HostMemory(Protocol):
    """Host memory as registration takes it: a HostBuffer, or any object with these (fabriclab.Engine's view
    of a caller's array)."""

    @property
    def kind(self) -> Literal["host"]: ...

    @property
    def array(self) -> np.ndarray: ...


class DeviceMemory(Protocol):
    """GPU memory as registration takes it: a CudaBuffer, or any object with these."""

    @property
    def kind(self) -> Literal["cuda"]: ...

    @property
    def pointer(self) -> int: ...

    @property
    def length(self) -> int: ...

    @property
    def device(self) -> int: ...


#: What ``register`` takes, told apart by ``kind``.
Memory: TypeAlias = HostMemory | DeviceMemory


def allocate(kind: str, length: int, device: int = 0) -> Buffer:
    """A buffer of ``length`` bytes of ``kind`` (one of MEMORY_KINDS), on GPU ``device`` for cuda."""
    if kind == "host":
        return HostBuffer(length)
    if kind == "cuda":
        return CudaBuffer(length, device)
    raise fi.UsageError(f"unknown memory kind {kind!r}; choose one of {', '.join(MEMORY_KINDS)}")


class DirectUnavailable(fi.UsageError):
    """This provider cannot register GPU memory directly (no FI_HMEM, or the registration failed)."""


@dataclass
class Registration:
    """A buffer registered with one endpoint's domain, and how: ``path`` is host, cuda-direct or
    cuda-staged; under cuda-staged, ``staging`` is the registered pinned copy and ``why`` says why
    direct registration was not used."""
    buffer: Memory
    mr: fi.MemoryRegion
    path: str
    staging: HostBuffer | None = None
    why: str = ""
    owns_staging: bool = True

    def before_send(self, offset: int, length: int) -> None:
        """Make [offset, offset+length) visible to the NIC before it is written out."""
        if self.staging is not None:  # only GPU memory is staged
            cast(CudaBuffer, self.buffer).copy_to(self.staging, offset, length)

    def after_receive(self, offset: int, length: int) -> None:
        """Move bytes that landed in the staging copy to where the user wants them."""
        if self.staging is not None:
            cast(CudaBuffer, self.buffer).copy_from(self.staging, offset, length)

    def staging_hooks(self, outbound: bool) -> dict[str, int | None]:
        """What the native engine needs to stage pages itself: the CUDA driver's copy function for this
        direction (device→host before sending, host→device on arrival), cuCtxSetCurrent and the context."""
        if self.staging is None:
            raise fi.UsageError(f"only a cuda-staged registration has staging hooks; this one is {self.path}")
        buffer = cast(CudaBuffer, self.buffer)  # only a CudaBuffer is staged (register, stage=True)
        cuda = ctypes.CDLL("libcuda.so.1")
        copy = cuda.cuMemcpyDtoH_v2 if outbound else cuda.cuMemcpyHtoD_v2
        return {"device": buffer.pointer, "host": self.staging.pointer,
                "copy": ctypes.cast(copy, ctypes.c_void_p).value,
                "set_context": ctypes.cast(cuda.cuCtxSetCurrent, ctypes.c_void_p).value,
                "context": int(buffer.cuda.context)}

    def close(self) -> None:
        self.mr.close()
        if self.staging is not None and self.owns_staging:
            self.staging.close()


class Stack(Protocol):
    """What registration needs of an endpoint's tree: an fi.EndpointStack, or nics' view of one NIC slot."""

    @property
    def info(self) -> fi.Info: ...

    @property
    def ep(self) -> fi.Endpoint: ...

    def register(self, buffer: object = None, **kw: Any) -> fi.MemoryRegion: ...


def register(stack: Stack, buffer: Memory, staging: HostBuffer | None = None,
             access: int = fi.ACCESS_ALL, stage: bool = True) -> Registration:
    """Register a HostBuffer or CudaBuffer with the endpoint's domain (see module docstring). A staged
    buffer registered on several domains passes the first registration's ``staging`` copy to the others.
    ``access``: what the memory may be used for (a read-only source: FI_WRITE | FI_SEND). ``stage=False``:
    GPU memory that cannot be registered directly raises DirectUnavailable instead of getting a full pinned
    copy (fabriclab.Engine stages through a bounded pool of its own)."""
    if buffer.kind == "host":
        return Registration(buffer, stack.register(buffer.array, access=access), "host")
    why = f"provider {stack.info.provider} does not offer FI_HMEM"
    if stack.ep.gpu_direct is False:  # FI_HMEM offered, but the copies would be the provider's cudaMemcpy
        why = stack.ep.gpu_direct_why
    elif stack.info.hmem:
        try:
            mr = stack.register(pointer=buffer.pointer, length=buffer.length, iface=fi.lib.FI_HMEM_CUDA,
                                device=buffer.device, keepalive=buffer, access=access)
            return Registration(buffer, mr, "cuda-direct")
        except fi.FabricError as exc:
            why = f"FI_HMEM registration failed: {exc}"
    if not stage:
        raise DirectUnavailable(why)
    owns = staging is None
    staging = staging or PinnedBuffer(buffer.length, buffer.device)
    return Registration(buffer, stack.register(staging.array, access=access), "cuda-staged", staging, why, owns)


def open_endpoint(provider: str | None, domain: str | None, memory: str) -> fi.EndpointStack:
    """An endpoint able to register ``memory``: with FI_HMEM when asking for GPU memory and offered."""
    if memory not in MEMORY_KINDS:
        raise fi.UsageError(f"unknown memory kind {memory!r}; choose one of {', '.join(MEMORY_KINDS)}")
    if memory == "cuda":
        gpu.require_cuda()
    return fi.EndpointStack(fi.getinfo(provider, domain, hmem=None if memory == "cuda" else False)[0])
