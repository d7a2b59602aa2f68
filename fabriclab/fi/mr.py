"""Memory registration: fi_mr_regattr's ``MemoryRegion`` (this side's memory, registered as the domain's
mr_mode asks) and ``RemoteRegion`` (a peer's registered memory as seen from here, checksummed for the wire)."""
from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ._core import CData, Resource
from .constants import ACCESS_ALL, ffi, lib
from .errors import UsageError, check

if TYPE_CHECKING:
    from .endpoint import Endpoint
    from .fabric import Domain


class MemoryRegion(Resource):
    """fi_mr_regattr over a writable buffer (numpy array, bytearray, memoryview) or a raw pointer.

    Registration follows the domain's mr_mode: a key of the caller's choosing unless FI_MR_PROV_KEY,
    binding to an endpoint under FI_MR_ENDPOINT, and remote addresses that are virtual addresses under
    FI_MR_VIRT_ADDR or offsets otherwise (``remote_base``).
    """

    def __init__(self, domain: Domain, buffer: object = None, *, pointer: int | None = None,
                 length: int | None = None, iface: int = lib.FI_HMEM_SYSTEM, device: int = 0,
                 access: int = ACCESS_ALL, endpoint: Endpoint | None = None, keepalive: Any = None) -> None:
        super().__init__(domain)
        try:
            self._register(domain, buffer, pointer, length, iface, device, access, endpoint, keepalive)
        except BaseException:
            self.close()
            raise

    def _register(self, domain: Domain, buffer: object, pointer: int | None, length: int | None, iface: int,
                  device: int, access: int, endpoint: Endpoint | None, keepalive: Any) -> None:
        if buffer is not None:
            written = bool(access & (lib.FI_RECV | lib.FI_READ | lib.FI_REMOTE_WRITE))  # else only read from
            try:
                self._view = ffi.from_buffer(buffer, require_writable=written)
            except (TypeError, BufferError, ValueError) as exc:
                raise UsageError(f"cannot register {type(buffer).__name__} for writing into: needs a writable "
                                 f"buffer (numpy array, bytearray, memoryview) ({exc})") from None
            self.address = int(ffi.cast("uintptr_t", self._view))
            self.length = len(self._view)
        else:
            if pointer is None or length is None:
                raise UsageError("register a buffer, or give both pointer= and length=")
            self._view = None
            self.address, self.length = int(pointer), int(length)
        if self.length <= 0:
            raise UsageError("cannot register an empty buffer")
        self.buffer = buffer
        self.iface = iface
        self._keepalive = keepalive
        self.info = domain.info
        iov = ffi.new("struct iovec *")
        iov.iov_base = ffi.cast("void *", self.address)
        iov.iov_len = self.length
        attr = ffi.new("struct fi_mr_attr *")
        attr.mr_iov = iov
        attr.iov_count = 1
        attr.access = access
        attr.requested_key = 0 if self.info.prov_key else next(domain._next_key)
        attr.iface = iface
        if iface != lib.FI_HMEM_SYSTEM:
            attr.device.cuda = device
        out = ffi.new("struct fid_mr **")
        check(lib.fi_mr_regattr(domain._ptr, attr, 0, out), f"fi_mr_regattr({self.length} bytes)")
        self._opened(out[0])
        if self.info.mr_endpoint:
            if endpoint is None:
                raise UsageError(f"provider {self.info.provider} binds memory to an endpoint (FI_MR_ENDPOINT): "
                                 "pass endpoint=")
            check(lib.fi_mr_bind(self._ptr, ffi.addressof(endpoint._ptr[0], "fid"), 0), "fi_mr_bind")
            check(lib.fi_mr_enable(self._ptr), "fi_mr_enable")
        self.desc = lib.fi_mr_desc(self._ptr)
        self.key = int(lib.fi_mr_key(self._ptr))

    @property
    def remote_base(self) -> int:
        """What a peer writes to for offset 0: our virtual address under FI_MR_VIRT_ADDR, else 0."""
        return self.address if self.info.virt_addr else 0

    def remote(self) -> "RemoteRegion":
        """What a peer needs to write here: base address (per FI_MR_VIRT_ADDR), length and key."""
        self._require_open()  # a peer told of a closed or inherited registration would write elsewhere
        return RemoteRegion(self.remote_base, self.length, self.key)

    def pointer(self, offset: int = 0) -> CData:
        """A ``void *`` to ``offset`` bytes into the region."""
        return ffi.cast("void *", self.address + offset)

    def check_range(self, offset: int, length: int, what: str = "local buffer") -> None:
        """Every post checks its buffer here: in range, and registered in this process and still open."""
        self._require_open()
        if offset < 0 or length < 0 or offset + length > self.length:
            raise UsageError(f"{what}: bytes [{offset}, {offset + length}) fall outside the "
                             f"{self.length}-byte registered region")

    def _release(self) -> None:
        self._view = None
        self.buffer = None
        self._keepalive = None


@dataclass(frozen=True)
class RemoteRegion:
    """A peer's registered memory as seen from here: where offset 0 is, how long it is, its key.

    Packed for the wire with a CRC, so a descriptor that was truncated or altered on the way (a wrong
    key, a wrong length) is rejected before any write is posted with it."""
    base: int
    length: int
    key: int

    FORMAT = struct.Struct("<QQQI")
    SIZE = FORMAT.size

    def pack(self) -> bytes:
        fields = struct.pack("<QQQ", self.base, self.length, self.key)
        return fields + struct.pack("<I", zlib.crc32(fields))

    @classmethod
    def unpack(cls, data: bytes) -> "RemoteRegion":
        if data is None or len(data) == 0:
            raise UsageError("missing remote region descriptor (no key): ask the peer for its region first")
        if len(data) != cls.SIZE:
            raise UsageError(f"remote region descriptor has {len(data)} bytes, expected {cls.SIZE} (truncated?)")
        base, length, key, crc = cls.FORMAT.unpack(data)
        if zlib.crc32(data[:24]) != crc:
            raise UsageError("remote region descriptor is corrupt (wrong key or length?): its checksum does not "
                             "match; use the descriptor exactly as the peer sent it")
        return cls(base, length, key)

    def check_range(self, offset: int, length: int) -> None:
        if offset < 0 or length <= 0 or offset + length > self.length:
            raise UsageError(f"write of {length} bytes at remote offset {offset} falls outside the peer's "
                             f"{self.length}-byte region")
