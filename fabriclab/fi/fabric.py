"""fi_fabric and fi_domain: the root of a resource tree and one NIC under it, with shortcuts that open the
domain's objects (completion queue, address vector, endpoint, memory registration)."""
from __future__ import annotations

import itertools
from typing import Any

from ._core import Resource, keeping_signal_handlers
from .av import AddressVector
from .constants import ffi, lib
from .cq import CompletionQueue
from .endpoint import Endpoint
from .errors import check
from .info import Info
from .mr import MemoryRegion


class Fabric(Resource):
    """fi_fabric for an Info; the root of a resource tree (closed when collected, or at interpreter exit)."""

    def __init__(self, info: Info):
        super().__init__(None)
        self.info = info
        out = ffi.new("struct fid_fabric **")
        check(keeping_signal_handlers(lib.fi_fabric, info.ptr.fabric_attr, out, ffi.NULL), "fi_fabric")
        self._opened(out[0])

    def domain(self, info: Info | None = None) -> Domain:
        return Domain(self, info or self.info)


class Domain(Resource):
    """fi_domain: one NIC (or one software domain such as shm, or one network interface under tcp)."""

    def __init__(self, fabric: Fabric, info: Info | None = None):
        super().__init__(fabric)
        self.info = info or fabric.info
        out = ffi.new("struct fid_domain **")
        check(keeping_signal_handlers(lib.fi_domain, fabric._ptr, self.info.ptr, out, ffi.NULL),
              f"fi_domain({self.info.domain})")
        self._opened(out[0])
        self._next_key = itertools.count(1)

    def completion_queue(self, size: int = 0) -> CompletionQueue:
        return CompletionQueue(self, size)

    def address_vector(self) -> AddressVector:
        return AddressVector(self)

    def endpoint(self, cq: CompletionQueue, av: AddressVector) -> Endpoint:
        return Endpoint(self, cq, av)

    def register(self, buffer: object, **kw: Any) -> MemoryRegion:
        return MemoryRegion(self, buffer, **kw)
