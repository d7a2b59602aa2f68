"""What ``Engine.register`` accepts, recognised: any buffer-protocol object (numpy, bytearray, ...), CUDA
array (``__cuda_array_interface__``: cupy, torch, numba) or DLPack tensor or capsule, host or CUDA, seen as
a :class:`HostView` or a :class:`CudaView`: where its bytes are, how many, and what keeps them alive."""
from __future__ import annotations

import re
from typing import Any, ClassVar, Literal

import numpy as np

from . import fi, staging


class HostView:
    """Host memory: the bytes as a uint8 array (which keeps ``owner``, the caller's object, alive)."""
    kind: ClassVar[Literal["host"]] = "host"

    def __init__(self, owner: object, array: np.ndarray, readonly: bool) -> None:
        self.owner, self.array, self.readonly = owner, array, readonly
        self.pointer: int = array.ctypes.data
        self.length: int = array.size


class CudaView:
    """CUDA memory of ``device``: ``owner`` (the caller's object, or what DLPack handed over) keeps it alive."""
    kind: ClassVar[Literal["cuda"]] = "cuda"

    def __init__(self, pointer: int, length: int, device: int, owner: object, readonly: bool) -> None:
        self.pointer, self.length, self.device, self.owner, self.readonly = pointer, length, device, owner, readonly


def view_of(obj: Any) -> HostView | CudaView:
    """The memory of any buffer-protocol, CUDA-array or DLPack object; UsageError for anything that cannot be
    registered (not one block of memory, empty, holding Python objects, CUDA memory on another device than it says)."""
    cai = getattr(obj, "__cuda_array_interface__", None)
    if cai is not None:
        pointer = int(cai["data"][0])
        shape = cai.get("shape", ())
        itemsize = np.dtype(cai["typestr"]).itemsize
        if cai.get("strides") not in (None, ()) and not staging.one_block(shape, cai["strides"], itemsize):
            raise fi.UsageError(staging.NOT_ONE_BLOCK.format(what="CUDA array"))
        length = int(np.prod(shape)) * itemsize if shape else itemsize
        return CudaView(pointer, length, _cuda_device(pointer, length, _claimed_device(obj)), obj,
                        bool(cai["data"][1]))
    if type(obj).__name__ == "PyCapsule" or (hasattr(obj, "__dlpack__") and not _has_buffer(obj)):
        cuda = staging.dlpack_cuda(obj)  # None: a host tensor
        if cuda is not None:
            pointer, length, device, keep = cuda
            return CudaView(pointer, length, _cuda_device(pointer, length, device), keep, False)
    try:
        view = memoryview(obj)
    except TypeError:
        if hasattr(obj, "__dlpack__"):
            view = np.from_dlpack(obj).data  # a host DLPack tensor
        else:
            raise fi.UsageError(f"cannot register {type(obj).__name__}: it has no buffer protocol, "
                                "__cuda_array_interface__ or __dlpack__") from None
    if _holds_references(obj, view):
        dtype = getattr(obj, "dtype", f"format {view.format!r}")
        raise fi.UsageError(f"cannot register this {type(obj).__name__} ({dtype}): its items hold references to "
                            "Python objects (dtype object, or a structured dtype with an object field at any depth), "
                            "pointers the interpreter owns; a peer's write over them crashes this process, and a "
                            "write of them sends addresses that mean nothing there. Register the data itself "
                            "instead: a numeric array, e.g. np.asarray(values, dtype=np.float64), or bytes")
    readonly = view.readonly
    if not view.c_contiguous:
        view = _in_memory_order(view)
    array = np.frombuffer(view.cast("B"), dtype=np.uint8)
    if array.size == 0:
        raise fi.UsageError("cannot register an empty buffer")
    return HostView(obj, array, readonly)


def _in_memory_order(view: memoryview) -> memoryview:
    """The same bytes as a C-contiguous view, for an array that is one block of memory in another axis order
    (Fortran order, a transpose): its axes sorted by stride. UsageError for one with gaps or repeats."""
    if view.strides is None or not staging.one_block(view.shape or (), view.strides, view.itemsize):
        raise fi.UsageError(staging.NOT_ONE_BLOCK.format(what="buffer"))
    array = np.asarray(view)
    return memoryview(array.transpose(sorted(range(array.ndim), key=lambda axis: -array.strides[axis])))


def _holds_references(obj: object, view: memoryview) -> bool:
    """Whether a buffer's items are (or contain, at any depth) PyObject pointers: numpy says so of its dtypes
    (``hasobject``); any other exporter through its PEP 3118 format, where "O" is an object once the field
    names (between colons) are taken out."""
    dtype = getattr(obj, "dtype", None)
    if isinstance(dtype, np.dtype):
        return bool(dtype.hasobject)
    return "O" in re.sub(r":[^:]*:", "", view.format)


def _has_buffer(obj: object) -> bool:
    try:
        memoryview(obj)  # type: ignore[arg-type]
        return True
    except TypeError:
        return False


def _claimed_device(obj: object) -> int | None:
    """The CUDA device an array says it lives on (torch: .device.index, cupy: .device.id), if it says."""
    device = getattr(obj, "device", None)
    for name in ("index", "id"):
        value = getattr(device, name, None)
        if isinstance(value, int):
            return value
    return None


def _cuda_device(pointer: int, length: int, claimed: int | None) -> int:
    """The device that holds CUDA memory, checked against what its owner says."""
    try:
        device = staging.pointer_device(pointer, length)
    except staging.StagingError as exc:
        raise fi.UsageError(f"cannot register that CUDA memory: {exc}") from None
    if claimed is not None and claimed != device:
        raise fi.UsageError(f"the array says it lives on CUDA device {claimed}, but its memory is on device {device}")
    return device
