"""Many copies in one CUDA launch: a list of (source, destination, length) copies between memories one GPU can
address (its own memory, a peer's memory opened through CUDA IPC, page-locked host memory) made by one kernel,
instead of one driver call per copy. A driver call costs microseconds of CPU; a thousand 64 KiB pages cost a
thousand of them, where the copy itself takes tens of microseconds.

The kernel (``_PTX``, PTX text the driver compiles for its GPU when first loaded, so that no CUDA compiler is
needed here) reads a table of copies, each cut into ``per`` pieces of PIECE_BYTES (the last one shorter); its
blocks take pieces in turn, and its threads copy 16 bytes at a time where source, destination and length
allow it, else a byte at a time. Copies of one length (pages) are cut by the kernel; copies of mixed lengths
are cut here first (:func:`pieces`), one piece an entry.
The table lives in page-locked host memory the kernel reads directly. One :class:`Copier` per device: copies
go on its streams round robin, each launch recorded by an event that :meth:`Copier.finished` queries."""
from __future__ import annotations

import ctypes
import threading
from dataclasses import dataclass
from typing import Any

import numpy as np

from . import gpu

PIECE_BYTES = 64 << 10   # one block's share of a copy at a time: a 1 MiB page is sixteen pieces
THREADS = 256            # per block
BLOCKS_PER_SM = 8        # resident blocks an SM takes at 256 threads each (2048 threads an SM)
STREAMS = 4
_ENTRY = np.dtype([("src", "<u8"), ("dst", "<u8"), ("length", "<u8")])
_CU_MEMHOSTALLOC_PORTABLE_DEVICEMAP = 0x1 | 0x2
_CU_EVENT_DISABLE_TIMING = 0x2
_CU_STREAM_NON_BLOCKING = 0x1

_PTX = r"""
.version 6.0
.target sm_60
.address_size 64

// fl_copy_table(table, count, per, piece): table[i] = {u64 src, u64 dst, u64 length}, cut into per pieces of
// piece bytes each; block b copies pieces b, b + grid, ... (piece v: entry v / per, bytes from (v % per) * piece)
.visible .entry fl_copy_table(.param .u64 p_table, .param .u64 p_count, .param .u64 p_per, .param .u64 p_piece)
{
    .reg .pred  %p<6>;
    .reg .b16   %h<2>;
    .reg .b32   %r<9>;
    .reg .b64   %rd<24>;

    ld.param.u64    %rd1, [p_table];
    ld.param.u64    %rd2, [p_count];
    ld.param.u64    %rd17, [p_per];
    ld.param.u64    %rd18, [p_piece];
    mul.lo.u64      %rd2, %rd2, %rd17;
    mov.u32         %r1, %ctaid.x;
    mov.u32         %r2, %nctaid.x;
    mov.u32         %r3, %tid.x;
    mov.u32         %r4, %ntid.x;
    cvt.u64.u32     %rd3, %r1;
    cvt.u64.u32     %rd4, %r2;
    cvt.u64.u32     %rd5, %r3;
    cvt.u64.u32     %rd6, %r4;
ENTRY:
    setp.ge.u64     %p1, %rd3, %rd2;
    @%p1 bra        DONE;
    div.u64         %rd19, %rd3, %rd17;
    rem.u64         %rd20, %rd3, %rd17;
    mul.lo.u64      %rd20, %rd20, %rd18;
    mul.lo.u64      %rd7, %rd19, 24;
    add.u64         %rd7, %rd1, %rd7;
    ld.u64          %rd8, [%rd7];
    ld.u64          %rd9, [%rd7+8];
    ld.u64          %rd10, [%rd7+16];
    setp.ge.u64     %p5, %rd20, %rd10;
    @%p5 bra        NEXT;
    sub.u64         %rd10, %rd10, %rd20;
    min.u64         %rd10, %rd10, %rd18;
    add.u64         %rd8, %rd8, %rd20;
    add.u64         %rd9, %rd9, %rd20;
    or.b64          %rd11, %rd8, %rd9;
    or.b64          %rd11, %rd11, %rd10;
    and.b64         %rd11, %rd11, 15;
    setp.ne.u64     %p2, %rd11, 0;
    mov.u64         %rd13, %rd5;
    @%p2 bra        BYTES;
    shr.u64         %rd12, %rd10, 4;
WORDS:
    setp.ge.u64     %p3, %rd13, %rd12;
    @%p3 bra        NEXT;
    shl.b64         %rd14, %rd13, 4;
    add.u64         %rd15, %rd8, %rd14;
    add.u64         %rd16, %rd9, %rd14;
    ld.v4.u32       {%r5, %r6, %r7, %r8}, [%rd15];
    st.v4.u32       [%rd16], {%r5, %r6, %r7, %r8};
    add.u64         %rd13, %rd13, %rd6;
    bra.uni         WORDS;
BYTES:
    setp.ge.u64     %p4, %rd13, %rd10;
    @%p4 bra        NEXT;
    add.u64         %rd15, %rd8, %rd13;
    add.u64         %rd16, %rd9, %rd13;
    ld.u8           %h1, [%rd15];
    st.u8           [%rd16], %h1;
    add.u64         %rd13, %rd13, %rd6;
    bra.uni         BYTES;
NEXT:
    add.u64         %rd3, %rd3, %rd4;
    bra.uni         ENTRY;
DONE:
    ret;
}
"""


def pieces(src: np.ndarray, dst: np.ndarray, lengths: np.ndarray, piece: int = PIECE_BYTES) -> np.ndarray:
    """The copies (``src[i]``, ``dst[i]``, ``lengths[i]`` bytes; addresses) as a table of pieces of at most
    ``piece`` bytes, in order: what the kernel reads."""
    lengths = np.asarray(lengths, np.uint64)
    if lengths.size and int(lengths.max()) <= piece:  # nothing to cut (pages of a piece or less)
        table = np.empty(lengths.size, _ENTRY)
        table["src"], table["dst"], table["length"] = src, dst, lengths
        return table
    counts = np.maximum((lengths + np.uint64(piece - 1)) // np.uint64(piece), 1).astype(np.int64)
    owner = np.repeat(np.arange(lengths.size), counts)
    first = np.concatenate(([0], np.cumsum(counts)[:-1]))
    within = (np.arange(owner.size) - first[owner]).astype(np.uint64) * np.uint64(piece)
    table = np.empty(owner.size, _ENTRY)
    table["src"] = np.asarray(src, np.uint64)[owner] + within
    table["dst"] = np.asarray(dst, np.uint64)[owner] + within
    table["length"] = np.minimum(lengths[owner] - within, np.uint64(piece))
    return table


@dataclass(eq=False)
class Launch:
    """One launch of the copy kernel: its event (done once it fired), the stream slot whose table it read, its
    bytes, and whether its owner is done with it (:meth:`Copier.release`)."""
    event: Any
    slot: int
    bytes: int
    released: bool = False


class Copier:
    """The copy kernel on one device (its primary context: torch's and cupy's), with STREAMS streams, a
    page-locked table per stream, and events. Thread-safe: one launch at a time."""

    def __init__(self, device: int) -> None:
        d = self.driver = gpu.require_cuda()
        self.device = device
        self.context = gpu.primary_context(device)
        self.lock = threading.Lock()
        self.module = gpu.check(d.cuModuleLoadData(_PTX.encode() + b"\0"), "cuModuleLoadData(copy kernel)")
        self.kernel = gpu.check(d.cuModuleGetFunction(self.module, b"fl_copy_table"), "cuModuleGetFunction")
        sms = gpu.check(d.cuDeviceGetAttribute(d.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT,
                                               gpu.check(d.cuDeviceGet(device), "cuDeviceGet")),
                        "cuDeviceGetAttribute")
        self.most_blocks = int(sms) * BLOCKS_PER_SM
        self.streams = [gpu.check(d.cuStreamCreate(_CU_STREAM_NON_BLOCKING), "cuStreamCreate")
                        for _ in range(STREAMS)]
        self.tables: list[tuple[int, int, int]] = [(0, 0, 0)] * STREAMS  # (pinned address, its device address, entries)
        self.last: list[Launch | None] = [None] * STREAMS  # each stream's last launch: its table is read until then
        self.spare_events: list[Any] = []
        self.next_stream = 0
        self.closed = False

    def _current(self) -> None:
        """Make the device's context current on the calling thread (every call: the caller may have switched
        devices since, as torch.cuda.set_device does)."""
        gpu.check(self.driver.cuCtxSetCurrent(self.context), "cuCtxSetCurrent")

    def _table(self, slot: int, entries: int) -> tuple[int, int]:
        """Stream ``slot``'s page-locked table, holding at least ``entries`` (its last launch is done): its
        address here and the kernel's."""
        address, device_address, held = self.tables[slot]
        if held >= entries:
            return address, device_address
        d = self.driver
        if address:
            gpu.check(d.cuMemFreeHost(address), "cuMemFreeHost")
        held = max(entries, 4096)
        address = int(gpu.check(d.cuMemHostAlloc(held * _ENTRY.itemsize, _CU_MEMHOSTALLOC_PORTABLE_DEVICEMAP),
                                "cuMemHostAlloc(copy table)"))
        device_address = int(gpu.check(d.cuMemHostGetDevicePointer(address, 0), "cuMemHostGetDevicePointer"))
        self.tables[slot] = (address, device_address, held)
        return address, device_address

    def _event(self) -> Any:
        if self.spare_events:
            return self.spare_events.pop()
        return gpu.check(self.driver.cuEventCreate(_CU_EVENT_DISABLE_TIMING), "cuEventCreate")

    def copy(self, src: np.ndarray, dst: np.ndarray, lengths: np.ndarray | int) -> Launch:
        """Start copying ``lengths[i]`` (or ``lengths``) bytes from address ``src[i]`` to ``dst[i]`` for every i
        (addresses this device can reach); the Launch says when it is done (:meth:`finished`). CudaError if CUDA
        refuses."""
        if isinstance(lengths, (int, np.integer)):  # one length: the kernel cuts each copy itself
            per = max(1, -(-int(lengths) // PIECE_BYTES))
            table = np.empty(src.size, _ENTRY)
            table["src"], table["dst"], table["length"] = src, dst, lengths
            nbytes = int(lengths) * src.size
        else:
            table, per = pieces(src, dst, lengths), 1
            nbytes = int(table["length"].sum())
        d = self.driver
        with self.lock:
            if self.closed:
                raise gpu.CudaError("the GPU copier is closed")
            self._current()
            slot = self.next_stream
            self.next_stream = (slot + 1) % STREAMS
            last = self.last[slot]
            if last is not None:  # its table is reused: the launch that read it must be done
                gpu.check(d.cuEventSynchronize(last.event), "cuEventSynchronize")
                if last.released:
                    self.spare_events.append(last.event)
            address, device_table = self._table(slot, table.size)
            ctypes.memmove(address, table.ctypes.data, table.nbytes)
            values = np.array([device_table, table.size, per, PIECE_BYTES], np.uint64)
            params = values.ctypes.data + np.arange(4, dtype=np.uint64) * np.uint64(8)  # a pointer to each value
            stream = self.streams[slot]
            gpu.check(d.cuLaunchKernel(self.kernel, min(table.size * per, self.most_blocks), 1, 1, THREADS, 1, 1, 0,
                                       stream, params.ctypes.data, 0), "cuLaunchKernel(copy kernel)")
            event = self._event()
            gpu.check(d.cuEventRecord(event, stream), "cuEventRecord")
            launch = self.last[slot] = Launch(event, slot, nbytes)
        return launch

    def finished(self, launch: Launch, wait: bool = False) -> bool:
        """Whether ``launch``'s copies are done (``wait``: once they are); CudaError if they failed."""
        d = self.driver
        if wait:
            gpu.check(d.cuEventSynchronize(launch.event), "copying on the GPU")
            return True
        err, = d.cuEventQuery(launch.event)
        if int(err) == int(d.CUresult.CUDA_ERROR_NOT_READY):
            return False
        gpu.check((err,), "copying on the GPU")
        return True

    def release(self, launch: Launch) -> None:
        """``launch`` is done and looked at: its event may be reused."""
        with self.lock:
            launch.released = True
            if self.last[launch.slot] is not launch:  # else its event goes back once the stream's next launch is made
                self.spare_events.append(launch.event)

    def close(self) -> None:
        """Wait for the launches, free the tables, streams, events and the kernel."""
        d = self.driver
        with self.lock:
            if self.closed:
                return
            self.closed = True
            self._current()
            for stream in self.streams:
                d.cuStreamSynchronize(stream)
                d.cuStreamDestroy(stream)
            for address, _, _ in self.tables:
                if address:
                    d.cuMemFreeHost(address)
            for event in self.spare_events + [launch.event for launch in self.last if launch is not None]:
                d.cuEventDestroy(event)
            d.cuModuleUnload(self.module)
