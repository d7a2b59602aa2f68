"""What the shm provider's address vectors need so that an entry can be removed and its place reused.

shm (libfabric 1.17 to 1.22) gives each peer of an address vector one of 256 slots, and each endpoint keeps
per slot, in its own region in /dev/shm, the handshake with that peer: its own id in the peer's table
(``smr_peer_data[slot].addr.id``, -1 until the peer answered its name) and whether it sent its name. A
first send to a slot without a handshake sends the endpoint's name first; later ones go straight to the peer
under that id. fi_av_remove frees the slot but leaves the handshake behind (smr_unmap_from_endpoint reads
the peer's id after smr_map_del has already cleared it, and returns), so the next peer given that slot is
written to at once, under the id the removed peer had given: it takes the writer for whoever holds that id
in its own table, and a write larger than an inject buffer (4 KiB) makes it read and answer that one's
region, or an unmapped one: the target died of SIGSEGV in a test here. :func:`reset_handshakes` does what
the provider meant to: it marks the slot's handshake as never made, in the region of every endpoint bound
to the vector, so the next peer in that slot is sent the name first.

Only a region laid out as this module knows is touched (:data:`_LAYOUTS`: shm's region version 4, as
libfabric 1.17 and 1.18 lay it out; each checked against the region's own name, process and size); on any
other, :func:`slot_of` finds nothing and the entry is never removed (its slot stays taken).

A name with no region behind it is worse: shm inserts it (the peer may start later) but leaves its slot
marked free, so the next peer inserted shares it, and removing either entry unmaps the other's region.
:func:`region_exists` lets the address vector refuse such a name first."""
from __future__ import annotations

import mmap
import os
import struct

import numpy as np

PREFIX = b"fi_shm://"
PEERS = 256  # SMR_MAX_PEERS: the slots of an address vector
# struct smr_peer_data: the peer's name (SMR_NAME_MAX), this endpoint's id in its table, SAR status, name sent
_PEER_DATA = np.dtype([("name", "S256"), ("id", "<i8"), ("sar_status", "<u4"), ("name_sent", "<u4")])
# struct smr_region, version 4: where total_size, peer_data_offset and name_offset are (1.17 has cmd_cnt and
# sar_cnt before the offsets, 1.18 not); the version byte is first, the pid at byte 4
_VERSION = 4
_LAYOUTS = ((40, 96, 104), (40, 80, 88))
_SIZE = struct.Struct("<Q")


def region_name(raw: bytes) -> str | None:
    """The /dev/shm name of an shm address (``fi_shm://NAME``), or None for another kind of shm address."""
    raw = raw.rstrip(b"\0")
    if not raw.startswith(PREFIX) or b"/" in raw[len(PREFIX):]:
        return None
    return raw[len(PREFIX):].decode(errors="replace")


def region_exists(raw: bytes) -> bool:
    """Whether an shm address names a region in /dev/shm (True for a kind of address this module does not
    know: nothing is refused on a guess)."""
    name = region_name(raw)
    return name is None or bool(name) and os.path.isfile(f"/dev/shm/{name}")


class _Region:
    """This process's view of one endpoint's region, its peer data checked where it is (``peers``: None
    where the region is gone, or not laid out as this module knows)."""

    def __init__(self, endpoint_name: bytes) -> None:
        self.peers: np.ndarray | None = None
        self.map: mmap.mmap | None = None
        name = region_name(endpoint_name)
        try:
            fd = os.open(f"/dev/shm/{name}", os.O_RDWR) if name else -1
        except OSError:
            fd = -1  # the endpoint is closed, its region gone
        if fd < 0:
            return
        try:
            size = os.fstat(fd).st_size
            self.map = mmap.mmap(fd, size) if size > 4096 else None
        finally:
            os.close(fd)
        ours = self.map is not None and struct.unpack_from("<i", self.map, 4)[0] == os.getpid()  # its pid field
        if self.map is not None and ours and self.map[0] == _VERSION:
            self.peers = self._peer_data(self.map, size, str(name).encode() + b"\0")

    @staticmethod
    def _peer_data(region: mmap.mmap, size: int, name: bytes) -> np.ndarray | None:
        """The peer data of a region of one of the known layouts whose name, size and extent agree."""
        for total, peer_data, name_at in _LAYOUTS:
            if _SIZE.unpack_from(region, total)[0] != size:
                continue
            offset, named = _SIZE.unpack_from(region, peer_data)[0], _SIZE.unpack_from(region, name_at)[0]
            if (named + len(name) <= size and region[named:named + len(name)] == name
                    and offset + PEERS * _PEER_DATA.itemsize <= size):
                return np.frombuffer(region, _PEER_DATA, PEERS, offset)
        return None

    def close(self) -> None:
        self.peers = None  # the view first: a mmap with views into it cannot close
        if self.map is not None:
            self.map.close()


def slot_of(endpoint_names: list[bytes], raw: bytes) -> int | None:
    """The slot of the address vector that holds the peer ``raw``, as the regions of its endpoints say
    (None where none of them is laid out as this module knows, or none names the peer: shm then never
    mapped it, and removing it is not safe)."""
    wanted = raw.rstrip(b"\0")
    for endpoint in endpoint_names:
        region = _Region(endpoint)
        try:
            if region.peers is not None:
                found = np.flatnonzero(region.peers["name"] == wanted)
                if found.size == 1:
                    return int(found[0])
        finally:
            region.close()
    return None


def reset_handshakes(endpoint_names: list[bytes], slot: int) -> None:
    """Mark ``slot``'s handshake as never made in the region of each endpoint (after fi_av_remove freed it)."""
    for endpoint in endpoint_names:
        region = _Region(endpoint)
        try:
            if region.peers is not None:
                region.peers["id"][slot] = -1
                region.peers["name_sent"][slot] = 0
        finally:
            region.close()
