"""Load the probes, drain the ring buffer on a timer, hand out Arrow batches of the io table."""
from __future__ import annotations

import ctypes
import threading
import time
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import numpy as np
import pyarrow as pa

from kvprof import schema
from kvprof.capture.ringbuf import RingReader
from kvprof.devices import Device, by_number
from kvprof.errors import EX_UNAVAILABLE, KvprofError

# Mirrors struct kvprof_io in probes/kvprof.h.
EVENT_DTYPE = np.dtype(
    [
        ("insert_ns", "<u8"),
        ("issue_ns", "<u8"),
        ("complete_ns", "<u8"),
        ("sector", "<u8"),
        ("cgroup_id", "<u8"),
        ("ctx", "<u8"),
        ("bytes", "<u4"),
        ("dev", "<u4"),
        ("pid", "<u4"),
        ("tgid", "<u4"),
        ("error", "<i4"),
        ("flags", "<u2"),
        ("op", "u1"),
        ("layer", "u1"),
        ("opcode", "u1"),
        ("pad", "V7"),
        ("comm", "S16"),
    ]
)
assert EVENT_DTYPE.itemsize == 96

HEADER = "kvprof.h"
PROBE_FILES = {"block": "block.bpf.c", "io_uring": "io_uring.bpf.c"}
COUNTER_NAMES = {0: "ringbuf_full", 1: "block_unmatched_completion"}
DRAIN_INTERVAL_S = 0.02


def probe_dir() -> Path:
    return Path(str(resources.files("kvprof.probes")))


@dataclass(frozen=True)
class Filters:
    devices: tuple[Device, ...] = ()
    tgids: tuple[int, ...] = ()
    cgroup_ids: tuple[int, ...] = ()


@dataclass(frozen=True)
class ProbeProgram:
    """The exact C text and compiler flags capture loads; `--ebpf` prints these."""

    text: str
    cflags: tuple[str, ...]


def build_program(layers: tuple[str, ...], filters: Filters,
                  ringbuf_pages: int = 1024) -> ProbeProgram:
    d = probe_dir()
    # bcc rewrites map calls (events.ringbuf_output, ...) only in the main text, not in
    # #included files, so the shared header is placed in front of the probes instead.
    parts = [(d / HEADER).read_text()]
    for layer in layers:
        parts.append((d / PROBE_FILES[layer]).read_text().replace(f'#include "{HEADER}"\n', ""))
    text = "\n".join(parts)
    cflags = [f"-DKVPROF_RINGBUF_PAGES={int(ringbuf_pages)}"]
    if filters.devices:
        cflags.append("-DKVPROF_FILTER_DEV")
    if filters.tgids:
        cflags.append("-DKVPROF_FILTER_TGID")
    if filters.cgroup_ids:
        cflags.append("-DKVPROF_FILTER_CGROUP")
    return ProbeProgram(text, tuple(cflags))


class Capture:
    """Attached probes plus a drain thread. Batches accumulate until `take()`."""

    def __init__(self, layers: tuple[str, ...], filters: Filters, ringbuf_pages: int = 1024):
        from kvprof.capture.bccload import load_bcc

        self.bcc = load_bcc()
        self.layers = layers
        self.filters = filters
        self.program = build_program(layers, filters, ringbuf_pages)
        try:
            self.bpf = self.bcc.BPF(text=self.program.text, cflags=list(self.program.cflags))
        except Exception as e:  # noqa: BLE001 - bcc raises bare Exception on compile/load
            raise KvprofError(f"loading the BPF probes failed: {e}", EX_UNAVAILABLE) from None
        self._fill_filters()
        self._batches: list[np.ndarray] = []
        self._stop = threading.Event()
        self._dev_names: dict[int, Device] = {d.kernel_dev: d for d in filters.devices}
        self.events_total = 0
        events = self.bpf["events"]
        self._ring = RingReader(events.map_fd, int(events.max_entries), EVENT_DTYPE)
        self._thread = threading.Thread(target=self._drain_loop, name="kvprof-drain", daemon=True)

    def _fill_filters(self) -> None:
        one = ctypes.c_uint8(1)
        if self.filters.devices:
            t = self.bpf["dev_filter"]
            for d in self.filters.devices:
                t[ctypes.c_uint32(d.kernel_dev)] = one
        if self.filters.tgids:
            t = self.bpf["tgid_filter"]
            for p in self.filters.tgids:
                t[ctypes.c_uint32(p)] = one
        if self.filters.cgroup_ids:
            t = self.bpf["cgroup_filter"]
            for c in self.filters.cgroup_ids:
                t[ctypes.c_uint64(c)] = one

    def start(self) -> None:
        self._thread.start()

    def _drain(self) -> None:
        ev = self._ring.drain()
        if len(ev):
            self._batches.append(ev)

    def _drain_loop(self) -> None:
        while not self._stop.is_set():
            self._drain()
            time.sleep(DRAIN_INTERVAL_S)

    def stop(self) -> None:
        """Detach and drain what is left; no event emitted before detaching is lost."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
        # Let in-flight requests complete so their events are emitted before detaching.
        time.sleep(0.05)
        self._drain()
        self._lost_final = self.lost()
        self._ring.close()
        self.bpf.cleanup()

    def lost(self) -> dict[str, int]:
        if getattr(self, "_lost_final", None) is not None:
            return dict(self._lost_final)
        counters = self.bpf["counters"]
        out = {}
        for idx, name in COUNTER_NAMES.items():
            out[name] = int(sum(counters.getvalue(ctypes.c_int(idx))))
        return out

    def take(self) -> pa.RecordBatch | None:
        # Swapping the list is atomic under the GIL; the drain thread appends to the new one.
        batches, self._batches = self._batches, []
        if not batches:
            return None
        ev = np.concatenate(batches)
        self.events_total += len(ev)
        return self.to_batch(ev)

    def device(self, kernel_dev: int) -> Device:
        d = self._dev_names.get(kernel_dev)
        if d is None:
            d = by_number(kernel_dev >> 20, kernel_dev & ((1 << 20) - 1))
            self._dev_names[kernel_dev] = d
        return d

    def seen_devices(self) -> list[Device]:
        return list(self._dev_names.values())

    def to_batch(self, ev: np.ndarray) -> pa.RecordBatch:
        is_block = ev["layer"] == 0
        devs = ev["dev"]
        uniq, inv = np.unique(devs, return_inverse=True)
        names = [self.device(int(u)).name if u else "" for u in uniq]
        dev_name = pa.DictionaryArray.from_arrays(
            pa.array(inv.astype(np.int32)), pa.array(names, pa.string())).cast(pa.string())
        null_if_uring = pa.array(~is_block)  # mask: True = NULL
        ops = np.array(schema.OPS, dtype=object)[np.minimum(ev["op"], len(schema.OPS) - 1)]
        layers = np.array(schema.LAYERS, dtype=object)[ev["layer"]]
        cols = {
            "layer": pa.array(layers, pa.string()),
            "op": pa.array(ops, pa.string()),
            "flags": pa.array(ev["flags"] & 0x7FFF, pa.uint16()),
            "insert_ns": pa.array(ev["insert_ns"].astype(np.int64)),
            "issue_ns": pa.array(ev["issue_ns"].astype(np.int64)),
            "complete_ns": pa.array(ev["complete_ns"].astype(np.int64)),
            "dev_major": pa.array((devs >> 20).astype(np.uint32), mask=~is_block),
            "dev_minor": pa.array((devs & 0xFFFFF).astype(np.uint32), mask=~is_block),
            "dev_name": _mask(dev_name, null_if_uring),
            "sector": pa.array(ev["sector"], pa.uint64(), mask=~is_block),
            "bytes": pa.array(ev["bytes"].astype(np.uint64)),
            "pid": pa.array(ev["pid"]),
            "tgid": pa.array(ev["tgid"]),
            "comm": pa.array([c.decode("latin-1") for c in ev["comm"].tolist()], pa.string()),
            "cgroup_id": pa.array(ev["cgroup_id"]),
            "error": pa.array(ev["error"]),
            "uring_opcode": pa.array(ev["opcode"], pa.uint8(), mask=is_block),
            "uring_ctx": pa.array(ev["ctx"], pa.uint64(), mask=is_block),
        }
        return pa.RecordBatch.from_arrays([cols[f.name] for f in schema.IO], schema=schema.IO)


def _mask(arr: pa.Array, mask: pa.Array) -> pa.Array:
    import pyarrow.compute as pc

    return pc.if_else(mask, pa.scalar(None, arr.type), arr)
