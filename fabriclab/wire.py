"""The engine's wire format: what peers hand each other, one encode/decode pair per object.

* an engine address (:func:`encode_address` / :func:`decode_address`): engine id, every NIC's fi address,
  the host it runs on and its process there (so that a peer on that host can tell when it is gone);
* a region descriptor (:func:`encode_region` / :func:`decode_region`): engine id, region id, length, and
  (base, key) per NIC;
* a staged target's descriptor (:func:`encode_landing` / :func:`decode_landing`): the same head naming its
  landing lanes' bases and keys, then the lanes' region, a lane's size, the largest control message, the
  region's key and the control endpoint's address (``fabriclab.landing``);
* either may end with a GPU region's CUDA IPC section (:class:`IpcRoute`, ``fabriclab.ipc``): what a writer
  on the same host needs to copy into it with its GPU.

Each is magic-tagged and CRC32-sealed. Anything decoded here came from a peer: it is untrusted, and every
way it can be wrong is an :class:`~fabriclab.errors.InvalidDescriptor` naming what is wrong."""
from __future__ import annotations

import dataclasses
import struct
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

from . import fi
from .errors import InvalidDescriptor, bad_address
from .nics import host_identity
from .shmclean import this_process

ADDRESS_MAGIC, REGION_MAGIC, LANDING_MAGIC = b"FLEN", b"FLRG", b"FLRL"  # engine, region, staged target
_REGION_HEAD = struct.Struct("<QIQH")  # engine id, region id, length, NIC count
_NIC_KEY = struct.Struct("<QQ")  # a NIC's base and key
_ADDRESS_HEAD = struct.Struct("<QH")  # engine id, NIC count
_SIZE = struct.Struct("<H")  # a NIC address's length
_PROCESS = struct.Struct("<QIQ")  # the engine's process: pid namespace inode, pid, start ticks (shmclean)
# lanes' region id, their length, lane bytes, message bytes, the region's key, address length
_LANDING_TAIL = struct.Struct("<IQIIQH")
# CUDA IPC: marker, allocation handle, region offset in it, allocation bytes, gate (pid, fd, token, slot), region
# key, control address length (the address follows)
_IPC = struct.Struct("<4s64sQQIIQIQH")
_IPC_MARK = b"IPC1"


def seal(body: bytes) -> bytes:
    """``body`` with its CRC32 appended."""
    return body + struct.pack("<I", zlib.crc32(body))


def unseal(data: object, magic: bytes, what: str) -> bytes:
    """The body of sealed ``data`` tagged ``magic``, checked: InvalidDescriptor saying what is wrong (for an
    engine address, one that speaks of no buffer)."""
    invalid: Callable[[str], InvalidDescriptor] = bad_address if magic == ADDRESS_MAGIC else InvalidDescriptor
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise invalid(f"{what} must be bytes, not {type(data).__name__}")
    data = bytes(data)
    if len(data) < 12 or data[:4] != magic:
        raise invalid(f"not a fabriclab {what} (truncated or from something else)")
    body, crc = data[:-4], struct.unpack("<I", data[-4:])[0]
    if zlib.crc32(body) != crc:
        raise invalid(f"{what} is corrupt or truncated: its checksum does not match")
    return body


# ----------------------------------------------------------------------------------- engine address


class PeerAddress(NamedTuple):
    """An engine address, decoded: the engine's id, each NIC's fi address, its host's identity and its process
    there (pid namespace inode, pid, start ticks: ``shmclean.this_process``)."""
    engine_id: int
    nics: list[fi.Address]
    host: bytes
    process: tuple[int, int, int]


def encode_address(engine_id: int, nics: Sequence[bytes]) -> bytes:
    """An engine address: ``engine_id``, each NIC's raw fi address, this host's identity and this process."""
    body = ADDRESS_MAGIC + _ADDRESS_HEAD.pack(engine_id, len(nics))
    body += b"".join(_SIZE.pack(len(raw)) + raw for raw in nics)
    return seal(body + host_identity() + _PROCESS.pack(*this_process()))


def decode_address(address: object) -> PeerAddress:
    """An engine address (of an engine on any host); InvalidDescriptor for anything else."""
    body = unseal(address, ADDRESS_MAGIC, "engine address")
    if len(body) < 4 + _ADDRESS_HEAD.size:
        raise bad_address("engine address is truncated: it has no NIC count")
    engine_id, n = _ADDRESS_HEAD.unpack_from(body, 4)
    offset, addresses = 4 + _ADDRESS_HEAD.size, []
    for i in range(n):
        if offset + _SIZE.size > len(body):
            raise bad_address("engine address is truncated")
        size = _SIZE.unpack_from(body, offset)[0]
        raw = body[offset + 2:offset + 2 + size]
        if size == 0 or len(raw) != size:
            raise bad_address(f"engine address is malformed: NIC entry {i} is {'empty' if size == 0 else 'cut short'}")
        try:
            addresses.append(fi.Address.from_bytes(raw))
        except fi.UsageError as exc:
            raise bad_address(f"engine address is malformed: NIC entry {i}: {exc}") from None
        offset += 2 + size
    host = len(host_identity())
    if offset + host + _PROCESS.size != len(body) or not addresses:
        raise bad_address("engine address is truncated or malformed")
    process = _PROCESS.unpack_from(body, offset + host)
    return PeerAddress(engine_id, addresses, body[offset:offset + host], process)


# ---------------------------------------------------------------------------------- region descriptors


@dataclass(frozen=True)
class LandingRoute:
    """How to write into a peer's staged target: its landing lanes (a region of their own), a lane's size,
    the largest control message it takes, the region's key (asking for lanes takes it) and the control
    endpoint's address (fabriclab.landing)."""
    lanes: PeerRegion
    lane_bytes: int
    message_bytes: int
    key: int
    address: bytes


@dataclass(frozen=True)
class IpcRoute:
    """How a writer on the target's host copies into a GPU region with its own GPU (``fabriclab.ipc``): the
    CUDA IPC handle of the allocation holding the region, the region's offset in it and the allocation's
    size, the gate (the target process's pid, the fd of its gate memory there, that memory's token, the
    region's slot), the region's key, and the control endpoint that counts the pages (``address``)."""
    handle: bytes
    offset: int
    alloc_bytes: int
    gate_pid: int
    gate_fd: int
    gate_token: int
    gate_slot: int
    key: int
    address: bytes


def _encode_ipc(ipc: IpcRoute | None) -> bytes:
    if ipc is None:
        return b""
    return _IPC.pack(_IPC_MARK, ipc.handle, ipc.offset, ipc.alloc_bytes, ipc.gate_pid, ipc.gate_fd, ipc.gate_token,
                     ipc.gate_slot, ipc.key, len(ipc.address)) + ipc.address


def _decode_ipc(section: bytes, length: int) -> IpcRoute | None:
    """A descriptor's IPC section (empty: none), checked against the region's ``length``."""
    if not section:
        return None
    if len(section) < _IPC.size or section[:4] != _IPC_MARK:
        raise InvalidDescriptor("region descriptor has trailing bytes that are no CUDA IPC section")
    _, *fields, size = _IPC.unpack_from(section)
    handle, offset, alloc_bytes, gate_pid, gate_fd, gate_token, gate_slot, key = fields
    route = IpcRoute(handle, offset, alloc_bytes, gate_pid, gate_fd, gate_token, gate_slot, key, section[_IPC.size:])
    if len(route.address) != size or not size:
        raise InvalidDescriptor("the CUDA IPC section of the region descriptor is truncated")
    if route.offset + length > route.alloc_bytes:
        raise InvalidDescriptor(f"the CUDA IPC section puts the region ({length} bytes at offset {route.offset}) "
                                f"outside its allocation of {route.alloc_bytes} bytes")
    if not route.gate_slot:
        raise InvalidDescriptor("the CUDA IPC section of the region descriptor is malformed")
    return route


@dataclass(frozen=True)
class PeerRegion:
    """A peer's region as its descriptor tells it (not ``fi.RemoteRegion``, one NIC's view of one
    registration): its engine, id and length, and each NIC's base and key."""
    engine_id: int
    region_id: int
    length: int
    bases: tuple[int, ...]
    keys: tuple[int, ...]
    landing: LandingRoute | None = None  # a staged target: the bases and keys are its landing lanes'
    ipc: IpcRoute | None = None  # a GPU region a writer on its host may copy into through CUDA IPC


def _head(magic: bytes, engine_id: int, region_id: int, length: int, bases: Sequence[int],
          keys: Sequence[int]) -> bytes:
    return (magic + _REGION_HEAD.pack(engine_id, region_id, length, len(keys))
            + b"".join(_NIC_KEY.pack(b, k) for b, k in zip(bases, keys)))


def encode_region(engine_id: int, region_id: int, length: int, bases: Sequence[int], keys: Sequence[int],
                  ipc: IpcRoute | None = None) -> bytes:
    """A region descriptor: where each NIC of engine ``engine_id`` lets peers write region ``region_id`` (and,
    for a GPU region, how a writer on its host copies into it: ``ipc``)."""
    return seal(_head(REGION_MAGIC, engine_id, region_id, length, bases, keys) + _encode_ipc(ipc))


def _read_head(body: bytes, staged: bool) -> tuple[PeerRegion, bytes]:
    """The region a descriptor's body names, and what follows the NICs' bases and keys."""
    head = _REGION_HEAD.size
    if len(body) < 4 + head:
        raise InvalidDescriptor("region descriptor is truncated")
    engine_id, region_id, length, n = _REGION_HEAD.unpack_from(body, 4)
    end = 4 + head + _NIC_KEY.size * n
    tail = body[end:]
    if n == 0 or len(body) < end or (staged and len(tail) < _LANDING_TAIL.size):
        raise InvalidDescriptor("region descriptor is truncated or has a wrong NIC count")
    pairs = [_NIC_KEY.unpack_from(body, 4 + head + _NIC_KEY.size * i) for i in range(n)]
    return PeerRegion(engine_id, region_id, length, tuple(p[0] for p in pairs), tuple(p[1] for p in pairs)), tail


def decode_region(descriptor: object) -> PeerRegion:
    """A region descriptor, plain or a staged target's (:func:`decode_landing`), checked."""
    if isinstance(descriptor, (bytes, bytearray, memoryview)) and bytes(descriptor[:4]) == LANDING_MAGIC:
        return decode_landing(descriptor)
    region, tail = _read_head(unseal(descriptor, REGION_MAGIC, "region descriptor"), staged=False)
    ipc = _decode_ipc(tail, region.length)
    return region if ipc is None else dataclasses.replace(region, ipc=ipc)


def encode_landing(engine_id: int, region_id: int, length: int, lanes: PeerRegion, lane_bytes: int,
                   message_bytes: int, key: int, address: bytes, ipc: IpcRoute | None = None) -> bytes:
    """A staged target's descriptor: region ``region_id`` of ``length`` bytes, written through ``lanes``
    (this engine's landing lanes, as a region), ``lane_bytes`` a lane; its control endpoint at ``address``
    takes messages of ``message_bytes``; asking for lanes takes ``key``; ``ipc`` as for encode_region."""
    body = _head(LANDING_MAGIC, engine_id, region_id, length, lanes.bases, lanes.keys)
    body += _LANDING_TAIL.pack(lanes.region_id, lanes.length, lane_bytes, message_bytes, key, len(address)) + address
    return seal(body + _encode_ipc(ipc))


def decode_landing(descriptor: object) -> PeerRegion:
    """A staged target's descriptor, checked: the region, with its :class:`LandingRoute`."""
    region, tail = _read_head(unseal(descriptor, LANDING_MAGIC, "region descriptor"), staged=True)
    lanes_id, lanes_length, lane_bytes, message_bytes, key, size = _LANDING_TAIL.unpack_from(tail)
    address = tail[_LANDING_TAIL.size:_LANDING_TAIL.size + size]
    if len(address) != size or not size or not lane_bytes or message_bytes < 64:
        raise InvalidDescriptor("staged region descriptor is truncated or malformed")
    ipc = _decode_ipc(tail[_LANDING_TAIL.size + size:], region.length)
    lanes = PeerRegion(region.engine_id, lanes_id, lanes_length, region.bases, region.keys)
    return PeerRegion(region.engine_id, region.region_id, region.length, region.bases, region.keys,
                      LandingRoute(lanes, lane_bytes, message_bytes, key, address), ipc)
