"""Read a BPF ring buffer of fixed-size records straight from its memory map.

bcc's reader calls back into Python once per event. kvprof's probes only emit records of one
size and the kernel maps the data area twice in a row, so the records between the consumer and
producer positions are one plain array, wrapped or not: a drain is one numpy view and one store
of the consumer position, whatever the event rate."""
from __future__ import annotations

import mmap
import struct

import numpy as np

BUSY_BIT = 1 << 31
DISCARD_BIT = 1 << 30
HEADER = 8


class RingReader:
    """The records of the ring `map_fd` (data area `data_size` bytes, a power of two), read
    in place. Layout (kernel/bpf/ringbuf.c): page 0 holds consumer_pos (read-write); from page
    1 on, producer_pos on its own page, then the data area mapped twice. Each record starts
    with an 8-byte header {u32 len (bit 31 busy, bit 30 discard); u32 page offset}, padded to 8."""

    def __init__(self, map_fd: int, data_size: int, record_dtype: np.dtype):
        page = mmap.PAGESIZE
        if data_size <= 0 or data_size & (data_size - 1):
            raise ValueError("ring buffer size must be a power of two")
        self.size = data_size
        self.mask = data_size - 1
        self.rec_size = (record_dtype.itemsize + HEADER + 7) & ~7
        self.dtype = np.dtype([("len", "<u4"), ("pg_off", "<u4"), ("ev", record_dtype),
                               ("pad", f"V{self.rec_size - HEADER - record_dtype.itemsize}")])
        assert self.dtype.itemsize == self.rec_size
        self._cons = mmap.mmap(map_fd, page, mmap.MAP_SHARED,
                               mmap.PROT_READ | mmap.PROT_WRITE, offset=0)
        self._prod = mmap.mmap(map_fd, page + 2 * data_size, mmap.MAP_SHARED, mmap.PROT_READ,
                               offset=page)
        self._data_off = page

    def _positions(self) -> tuple[int, int]:
        (cons,) = struct.unpack_from("<Q", self._cons, 0)
        (prod,) = struct.unpack_from("<Q", self._prod, 0)
        return cons, prod

    def drain(self) -> np.ndarray:
        """Copy out every committed record and release its space to the kernel."""
        cons, prod = self._positions()
        n = (prod - cons) // self.rec_size
        if n <= 0:
            return np.empty(0, self.dtype["ev"])
        # Never read past one lap: the second mapping only covers one wrap.
        n = min(n, self.size // self.rec_size)
        recs = np.frombuffer(self._prod, dtype=self.dtype, count=n,
                             offset=self._data_off + (cons & self.mask))
        lens = recs["len"]
        busy = np.flatnonzero(lens & BUSY_BIT)
        if busy.size:
            # A producer has reserved this record but not committed it yet: stop before it.
            n = int(busy[0])
            recs, lens = recs[:n], lens[:n]
        # kvprof's probes never discard (they use ringbuf_output), but a discarded record
        # would still take its space, so skip it rather than read it.
        keep = (lens & DISCARD_BIT) == 0
        out = recs["ev"][keep].copy()
        if n:
            struct.pack_into("<Q", self._cons, 0, cons + n * self.rec_size)
        return out

    def close(self) -> None:
        self._cons.close()
        self._prod.close()
