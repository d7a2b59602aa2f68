"""fi_endpoint: an ``Endpoint`` bound to its completion queue and address vector, and its posts (receive,
send, RDMA write), each in a form that returns on -FI_EAGAIN and one that retries until a deadline."""
from __future__ import annotations

import errno as _errno
import time
from typing import TYPE_CHECKING, Any, Callable

from .. import _inprocess
from ._core import CData, Resource, keeping_signal_handlers
from .av import Address, AddressVector
from .constants import DEFAULT_TIMEOUT, api_version, ffi, fi_version, lib
from .cq import CompletionQueue
from .errors import FabricError, FabricTimeout, UsageError, check, errno_name
from .mr import MemoryRegion, RemoteRegion

if TYPE_CHECKING:
    from .fabric import Domain


def gpu_direct_verdict(provider: str, rc: int) -> tuple[bool | None, str]:
    """What fi_setopt(FI_OPT_CUDA_API_PERMITTED, false)'s return code says about GPUDirect RDMA (see
    Endpoint._forbid_cuda_api): 0 yes; -FI_EOPNOTSUPP no (the provider needs the CUDA API to move GPU
    memory); -FI_EINVAL no (no CUDA library or device); anything else, the provider does not say."""
    if rc == 0:
        return True, f"{provider} moves GPU memory without the CUDA API (GPUDirect RDMA)"
    if rc == -lib.FI_EOPNOTSUPP:
        return False, f"{provider} moves GPU memory only through the CUDA API (no GPUDirect RDMA: no dmabuf or " \
                      "nvidia-peermem)"
    if rc == -lib.FI_EINVAL:
        return False, f"{provider} sees no CUDA library or device"
    return None, f"{provider} does not answer the CUDA-API question ({errno_name(-rc)})"


class Endpoint(Resource):
    """fi_endpoint bound to a completion queue (transmit and receive) and an address vector, enabled."""

    def __init__(self, domain: Domain, cq: CompletionQueue, av: AddressVector):
        super().__init__(domain)
        self.info = domain.info
        self.cq = cq
        self.av = av
        out = ffi.new("struct fid_ep **")
        check(keeping_signal_handlers(lib.fi_endpoint, domain._ptr, self.info.ptr, out, ffi.NULL), "fi_endpoint")
        self._opened(out[0])
        check(lib.fi_ep_bind(self._ptr, cq._fid(), lib.FI_TRANSMIT | lib.FI_RECV), "fi_ep_bind(cq)")
        check(lib.fi_ep_bind(self._ptr, av._fid(), 0), "fi_ep_bind(av)")
        self.gpu_direct, self.gpu_direct_why = self._forbid_cuda_api() if self.info.hmem else (None, "")
        rc = keeping_signal_handlers(lib.fi_enable, self._ptr)
        if rc == -_errno.EBUSY:
            # shm: a region left in /dev/shm by a killed process whose pid has come round again; the
            # failed enable removes it, so a second try succeeds
            rc = keeping_signal_handlers(lib.fi_enable, self._ptr)
        check(rc, "fi_enable")
        _inprocess.endpoint_opened(self._native, self.name, (cq._native, av._native))
        av.bound(self.name)
        self._msg = ffi.new("struct fi_msg_rma *")
        self._iov = ffi.new("struct iovec *")
        self._rma_iov = ffi.new("struct fi_rma_iov *")
        self._desc = ffi.new("void *[1]")
        self._msg.msg_iov = self._iov
        self._msg.desc = self._desc
        self._msg.iov_count = 1
        self._msg.rma_iov = self._rma_iov
        self._msg.rma_iov_count = 1

    def _forbid_cuda_api(self) -> tuple[bool | None, str]:
        """Whether GPU memory moves by GPUDirect RDMA on this endpoint: (True, ""), (False, why) or (None,
        why) where the provider does not say. Asked before fi_enable by forbidding the endpoint the CUDA
        API (FI_OPT_CUDA_API_PERMITTED, libfabric >= 1.18): a provider whose GPU support is cudaMemcpy
        through bounce buffers refuses, and GPU memory then goes through fabriclab's staged path, said as
        such, instead of a "direct" path that is a hidden copy (efa RDM without dmabuf or nvidia-peermem)."""
        if lib.FL_OPT_CUDA_API_PERMITTED < 0 or api_version() < fi_version(1, 18):
            return None, f"libfabric API {api_version() >> 16}.{api_version() & 0xFFFF} predates the CUDA-API check"
        permitted = ffi.new("bool *", False)
        rc = lib.fi_setopt(ffi.addressof(self._ptr[0], "fid"), lib.FI_OPT_ENDPOINT, lib.FL_OPT_CUDA_API_PERMITTED,
                           permitted, ffi.sizeof("bool"))
        return gpu_direct_verdict(self.info.provider, rc)

    @property
    def name(self) -> bytes:
        """The raw provider address of this endpoint (fi_getname)."""
        self._require_open()
        size = ffi.new("size_t *", 256)
        buf = ffi.new("char[]", 256)
        rc = lib.fi_getname(ffi.addressof(self._ptr[0], "fid"), buf, size)
        if rc == -lib.FI_ETOOSMALL:
            buf = ffi.new("char[]", size[0])
            rc = lib.fi_getname(ffi.addressof(self._ptr[0], "fid"), buf, size)
        check(rc, "fi_getname")
        raw: bytes = ffi.buffer(buf, size[0])[:]
        return raw

    def address(self, max_message: int = 0) -> Address:
        """This endpoint's address as a peer is given it (see Address)."""
        return Address(self.info.provider, self.info.addr_format, self.name, max_message)

    def declare_idle(self) -> None:
        """Say that no operation posted on this endpoint is still inside the provider (each reported its
        completion): its close then need not wait for the endpoints of this process it wrote to
        (fabriclab._inprocess says why it otherwise does)."""
        _inprocess.declare_idle(self._native)

    # Each post comes in two forms: try_post_* returns False on -FI_EAGAIN (the caller decides when to
    # retry) and post_* progresses this endpoint's completion queue and retries until its deadline. With
    # both peers in one process, use try_post_* and poll both queues: software providers also need the
    # peer to make progress before they accept the first message to it.

    def try_post_recv(self, mr: MemoryRegion, offset: int, length: int, token: Any,
                      source: int | None = None) -> bool:
        mr.check_range(offset, length)
        ctx = self.cq.new_context(token, mr)
        rc = lib.fi_recv(self._ptr, mr.pointer(offset), length, mr.desc,
                         lib.FI_ADDR_UNSPEC if source is None else source, ctx)
        return self._posted(rc, ctx, "fi_recv")

    def try_post_send(self, mr: MemoryRegion, offset: int, length: int, dest: int, token: Any) -> bool:
        mr.check_range(offset, length)
        if length > self.info.max_msg_size:
            raise UsageError(f"message of {length} bytes exceeds provider {self.info.provider}'s maximum of "
                             f"{self.info.max_msg_size} bytes")
        ctx = self.cq.new_context(token, mr)
        rc = lib.fi_send(self._ptr, mr.pointer(offset), length, mr.desc, dest, ctx)
        return self._posted(rc, ctx, "fi_send")

    def try_post_write(self, mr: MemoryRegion, offset: int, length: int, dest: int, remote: RemoteRegion,
                       remote_offset: int, token: Any, data: int | None = None, more: bool = False) -> bool:
        """RDMA WRITE ``length`` bytes at ``offset`` of ``mr`` into ``remote`` at ``remote_offset``;
        with ``data`` the target reads a completion carrying it (FI_REMOTE_CQ_DATA)."""
        mr.check_range(offset, length)
        remote.check_range(remote_offset, length)
        if data is not None and not 0 <= data < (1 << (8 * self.info.cq_data_size)):
            raise UsageError(f"immediate data {data} does not fit the provider's {self.info.cq_data_size}-byte "
                             "completion data")
        ctx = self.cq.new_context(token, mr)
        self._iov.iov_base = mr.pointer(offset)
        self._iov.iov_len = length
        self._desc[0] = mr.desc
        self._rma_iov.addr = remote.base + remote_offset
        self._rma_iov.len = length
        self._rma_iov.key = remote.key
        self._msg.addr = dest
        self._msg.context = ctx
        flags = lib.FI_COMPLETION
        if data is not None:
            self._msg.data = data
            flags |= lib.FI_REMOTE_CQ_DATA
        if more:
            flags |= lib.FI_MORE
        rc = lib.fi_writemsg(self._ptr, self._msg, flags)
        return self._posted(rc, ctx, "fi_writemsg")

    def _posted(self, rc: int, ctx: CData, call: str) -> bool:
        if rc == 0:
            return True
        self.cq.forget_context(ctx)
        if rc == -lib.FI_EAGAIN:
            return False
        raise FabricError(call, rc)

    def _retry(self, attempt: Callable[[], bool], what: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not attempt():
            self.cq.progress()
            if time.monotonic() > deadline:
                raise FabricTimeout(f"posting {what}", timeout, "the provider kept answering -FI_EAGAIN")

    def post_recv(self, mr: MemoryRegion, offset: int, length: int, token: Any, source: int | None = None,
                  timeout: float = DEFAULT_TIMEOUT) -> None:
        self._retry(lambda: self.try_post_recv(mr, offset, length, token, source), "a receive", timeout)

    def post_send(self, mr: MemoryRegion, offset: int, length: int, dest: int, token: Any,
                  timeout: float = DEFAULT_TIMEOUT) -> None:
        self._retry(lambda: self.try_post_send(mr, offset, length, dest, token), "a send", timeout)

    def post_write(self, mr: MemoryRegion, offset: int, length: int, dest: int, remote: RemoteRegion,
                   remote_offset: int, token: Any, data: int | None = None,
                   timeout: float = DEFAULT_TIMEOUT) -> None:
        self._retry(lambda: self.try_post_write(mr, offset, length, dest, remote, remote_offset, token, data),
                    "a write", timeout)
