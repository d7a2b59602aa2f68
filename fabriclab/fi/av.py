"""Addresses: ``Address`` (an endpoint's address as fabriclab passes it between processes, checked) and
fi_av_open's ``AddressVector`` (peers' addresses to fi_addr_t handles, inserted and removed)."""
from __future__ import annotations

import socket
import string
import struct
from dataclasses import dataclass
from typing import TYPE_CHECKING

from .. import _inprocess
from . import _smr
from ._core import Resource
from .constants import _ADDR_FORMAT_NAMES, ffi, lib
from .errors import FabricError, UsageError, check
from .info import Info

if TYPE_CHECKING:
    from .fabric import Domain


_ADDR_MAGIC = b"FLAD"
_ADDR_HEADER = struct.Struct("<4sBBIQH")  # magic, version, provider name length, format, max message, raw len


@dataclass(frozen=True)
class Address:
    """An endpoint's address as fabriclab passes it between processes: the provider's raw address plus
    what a peer needs to check it fits (provider, address format) and, optionally, the largest message
    the endpoint has posted receives for. Printed and parsed as one hex line."""
    provider: str
    addr_format: int
    raw: bytes
    max_message: int = 0

    VERSION = 1

    def to_bytes(self) -> bytes:
        prov = self.provider.encode()
        return _ADDR_HEADER.pack(_ADDR_MAGIC, self.VERSION, len(prov), self.addr_format, self.max_message,
                                 len(self.raw)) + prov + self.raw

    def hex(self) -> str:
        return self.to_bytes().hex()

    @classmethod
    def from_bytes(cls, data: bytes) -> "Address":
        if len(data) < _ADDR_HEADER.size:
            raise UsageError(f"truncated address: {len(data)} bytes, a fabriclab address has at least "
                             f"{_ADDR_HEADER.size} (copy the whole line the server printed)")
        magic, version, prov_len, fmt, max_message, raw_len = _ADDR_HEADER.unpack_from(data)
        if magic != _ADDR_MAGIC:
            raise UsageError("not a fabriclab address (it should be the hex line the server printed)")
        if version != cls.VERSION:
            raise UsageError(f"address version {version} is not understood by this fabriclab (expects {cls.VERSION})")
        need = _ADDR_HEADER.size + prov_len + raw_len
        if len(data) != need:
            raise UsageError(f"{'truncated' if len(data) < need else 'over-long'} address: {len(data)} bytes, "
                             f"expected {need} (copy the whole line the server printed)")
        prov = data[_ADDR_HEADER.size:_ADDR_HEADER.size + prov_len]
        try:
            provider = prov.decode()
        except UnicodeDecodeError:
            raise UsageError("malformed address: provider name is not text") from None
        addr = cls(provider, fmt, bytes(data[_ADDR_HEADER.size + prov_len:]), max_message)
        addr.check_format()
        return addr

    @classmethod
    def parse(cls, text: "str | bytes | Address") -> "Address":
        """Parse the hex line a server printed; every problem is a UsageError naming it."""
        if isinstance(text, Address):
            return text
        if isinstance(text, (bytes, bytearray)):
            return cls.from_bytes(bytes(text))
        if not isinstance(text, str):
            raise UsageError(f"an address is a hex string, not {type(text).__name__}")
        text = text.strip()
        if not text:
            raise UsageError("empty address: pass the hex line the server printed")
        bad = next((c for c in text if c not in string.hexdigits), None)
        if bad is not None:
            raise UsageError(f"malformed address: {bad!r} is not a hexadecimal digit")
        if len(text) % 2:
            raise UsageError("malformed address: odd number of hex digits (truncated when copied?)")
        return cls.from_bytes(bytes.fromhex(text))

    def check_format(self) -> None:
        """Check the raw address against its declared format (length, family, text)."""
        raw, fmt = self.raw, self.addr_format
        if not raw:
            raise UsageError("malformed address: the provider address is empty")
        if fmt == lib.FI_SOCKADDR_IN:
            if len(raw) < 16 or struct.unpack_from("<H", raw)[0] != socket.AF_INET:
                raise UsageError("malformed address: not an IPv4 socket address (FI_SOCKADDR_IN)")
        elif fmt == lib.FI_SOCKADDR_IN6:
            if len(raw) < 28 or struct.unpack_from("<H", raw)[0] != socket.AF_INET6:
                raise UsageError("malformed address: not an IPv6 socket address (FI_SOCKADDR_IN6)")
        elif fmt == lib.FI_ADDR_STR:
            body = raw.rstrip(b"\0")
            if not body or any(b < 0x20 or b > 0x7e for b in body):
                raise UsageError("malformed address: FI_ADDR_STR address is not printable text")

    def check_compatible(self, info: Info) -> None:
        if self.provider != info.provider:
            raise UsageError(f"address is for provider {self.provider!r} but this endpoint uses "
                             f"{info.provider!r}: start both sides with the same --provider")
        if self.addr_format != info.addr_format:
            raise UsageError(f"address format {_ADDR_FORMAT_NAMES.get(self.addr_format, self.addr_format)} does "
                             f"not match the local endpoint's {info.addr_format_name} (different domain or "
                             "address family on the two sides?)")

    def describe(self) -> str:
        fmt = _ADDR_FORMAT_NAMES.get(self.addr_format, str(self.addr_format))
        if self.addr_format == lib.FI_SOCKADDR_IN:
            port, ip = struct.unpack_from(">H4s", self.raw, 2)
            where = f"{socket.inet_ntoa(ip)}:{port}"
        elif self.addr_format == lib.FI_ADDR_STR:
            where = self.raw.rstrip(b"\0").decode(errors="replace")
        else:
            where = self.raw.hex()
        return f"{self.provider} {fmt} {where}"


class AddressVectorFull(FabricError):
    """fi_av_insert refused another peer: the address vector already holds ``held`` peers, the most its
    provider takes (``most``: fi_info's domain_attr.ep_cnt, 256 for shm), or the most its owner keeps. Peers
    no longer needed must be removed first; the message says how, where the owner knows."""

    def __init__(self, held: int, most: int, provider: str, advice: str = "") -> None:
        super().__init__("fi_av_insert", lib.FI_ENOMEM, message=(
            f"the address vector holds {held} peers, the most it takes ({provider}: {most}), so no other peer "
            f"can be added{': ' + advice if advice else ''}"))
        self.held, self.most = held, most


class AddressVector(Resource):
    """fi_av_open: maps peers' raw addresses to fi_addr_t handles. ``entries`` holds those inserted and not
    removed. On shm, an address naming no endpoint is refused (shm would take it into a slot it still
    counts as free), and an entry is removed only where it is safe to reuse its slot (``fabriclab.fi._smr``)."""

    def __init__(self, domain: Domain):
        super().__init__(domain)
        attr = ffi.new("struct fi_av_attr *")
        attr.type = domain.info.ptr.domain_attr.av_type
        out = ffi.new("struct fid_av **")
        check(lib.fi_av_open(domain._ptr, attr, out, ffi.NULL), "fi_av_open")
        self._opened(out[0])
        self.info = domain.info
        #: the most peers the provider says it takes (fi_info's domain_attr.ep_cnt; shm: 256 per vector)
        self.most = int(domain.info.ptr.domain_attr.ep_cnt) or 1 << 20
        self.entries: dict[int, bytes] = {}  # fi_addr -> the raw address inserted
        self._shm = domain.info.provider == "shm"
        self._endpoint_names: list[bytes] = []  # of the endpoints bound to it (shm keeps a handshake in each)

    @property
    def maps_peers(self) -> bool:
        """Whether the provider keeps state of its own for every peer that sends to an endpoint of this vector,
        inserted or not, and frees it only at fi_av_remove: shm gives the peer one of ``most`` slots and maps
        its region (~4 MiB of /dev/shm memory, held even once the peer's process is gone). An owner that peers
        come and go to should insert them, as it learns their addresses, and remove each once ``peer_gone``."""
        return self._shm

    def peer_gone(self, raw: bytes) -> bool:
        """Whether the endpoint behind an address is proven gone, so that it sends nothing more: on shm, no
        region of that name is left in /dev/shm (closed, or its process's regions reclaimed). False where that
        cannot be told."""
        return self._shm and not _smr.region_exists(raw)

    def bound(self, endpoint_name: bytes) -> None:
        """An endpoint named ``endpoint_name`` was bound to this address vector (fabriclab.fi.Endpoint)."""
        self._endpoint_names.append(endpoint_name)

    def insert(self, address: "Address | bytes") -> int:
        """Insert one peer; returns its fi_addr_t. A bytes argument is taken as this provider's raw format.
        AddressVectorFull when the provider takes no more peers."""
        self._require_open()
        raw = address.raw if isinstance(address, Address) else bytes(address)
        if isinstance(address, Address):
            address.check_compatible(self.info)
        if self._shm and not _smr.region_exists(raw):
            raise FabricError("fi_av_insert", lib.FI_EHOSTUNREACH, message=(
                f"no shm endpoint {_smr.region_name(raw)!r} on this host: its process ended (or the address is "
                "made up, or from another host or /dev/shm)"))
        out = ffi.new("fi_addr_t *")
        n = lib.fi_av_insert(self._ptr, raw, 1, out, 0, ffi.NULL)
        if n != 1:
            if len(self.entries) >= self.most:
                raise AddressVectorFull(len(self.entries), self.most, self.info.provider)
            raise FabricError("fi_av_insert", n if n < 0 else lib.FI_EINVAL,
                              message=None if n < 0 else "fi_av_insert rejected the address")
        _inprocess.address_inserted(self._native, raw)  # an endpoint of this process: it waits for us to close
        self.entries[int(out[0])] = raw
        return int(out[0])

    def remove(self, fi_addr: int) -> bool:
        """Remove a peer's entry (nothing may still be posted to it): True once removed. False where shm's
        slot could not be made safe to reuse: the entry then stays, and holds its slot for good."""
        self._require_open()
        raw = self.entries.get(fi_addr)
        slot = None
        if self._shm:
            slot = None if raw is None else _smr.slot_of(self._endpoint_names, raw)
            if slot is None:
                return False
        addrs = ffi.new("fi_addr_t[1]", [fi_addr])
        check(lib.fi_av_remove(self._ptr, addrs, 1, 0), "fi_av_remove")
        self.entries.pop(fi_addr, None)
        if slot is not None:
            _smr.reset_handshakes(self._endpoint_names, slot)
        return True
