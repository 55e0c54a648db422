"""The aggregate tier's user side: drains the probes' per-CPU maps into per-second rows.

The probes count every block and io_uring request into `agg` (per completion second, device,
phase, layer, op) and the time each device had a request in flight into `busy` (per second,
device, phase); see probes/kvprof.h. A second is taken, summed over CPUs and deleted once it
is SETTLE_S over: no probe writes to it any more, so deleting it cannot drop an update. At
the end (probes detached) every second is taken. The phase the probes count under is written
into `cur_phase` here, as marks arrive.
"""
from __future__ import annotations

import ctypes
import time
from collections.abc import Callable

import numpy as np
import pyarrow as pa

from kvprof import schema
from kvprof.devices import Device

SLOTS = 40  # KVPROF_AGG_SLOTS
NS_PER_S = 1_000_000_000
# Seconds a completion second must be over before it is taken: probes that read the clock
# in it finish within microseconds (block and io_uring tracepoints run with preemption off).
SETTLE_S = 2

# Mirrors struct kvprof_agg_val.
AGG_DTYPE = np.dtype([("ios", "<u8"), ("bytes", "<u8"), ("queue_ns", "<u8"),
                      ("service_ns", "<u8"), ("size", "<u4", SLOTS), ("queue", "<u4", SLOTS),
                      ("service", "<u4", SLOTS)])
assert AGG_DTYPE.itemsize == 512


def phase_code(phase: str) -> int:
    """The probes' phase byte: 0 before any mark, else schema.PHASES index + 1."""
    return schema.PHASES.index(phase) + 1


def phase_name(code: int) -> str:
    # No window yet is idle, as for the events (DESIGN.md: time in no window is idle).
    return schema.PHASES[code - 1] if 1 <= code <= len(schema.PHASES) else "idle"


class AggregateReader:
    def __init__(self, bpf, device: Callable[[int], Device]):
        self._agg = bpf["agg"]
        self._busy = bpf["busy"]
        self._phase = bpf["cur_phase"]
        self._device = device
        self._ncpu = self._agg.total_cpu

    def set_phase(self, phase: str) -> None:
        self._phase[ctypes.c_int(0)] = ctypes.c_uint32(phase_code(phase))

    def take(self, final: bool = False) -> dict[str, pa.RecordBatch | None]:
        """The seconds that are over (all of them when `final`) leave the maps as io_agg and
        device_busy rows. The seconds still counting are read as they stand, as io_agg_open
        and device_busy_open rows (None: none), which each flush puts in place of the last
        ones: a recording killed at any moment keeps its counts up to its last flush."""
        cutoff = None if final else (time.monotonic_ns() // NS_PER_S) - SETTLE_S
        out: dict[str, pa.RecordBatch | None] = {}
        for table, m, rows in (("io_agg", self._agg, self._agg_rows),
                               ("device_busy", self._busy, self._busy_rows)):
            keys = list(m.keys())
            over = [k for k in keys if cutoff is None or k.sec <= cutoff]
            counting = [k for k in keys if cutoff is not None and k.sec > cutoff]
            if over:
                out[table] = rows(over)
                for k in over:
                    del m[k]
            out[f"{table}_open"] = rows(counting) if counting else None
        return out

    def _agg_rows(self, keys: list) -> pa.RecordBatch:
        rows = []
        for k in keys:
            per_cpu = np.frombuffer(self._agg.getvalue(k), AGG_DTYPE, count=self._ncpu)
            rows.append((k.sec, k.dev, k.phase, k.layer, k.op, per_cpu["ios"].sum(),
                         per_cpu["bytes"].sum(), per_cpu["queue_ns"].sum(),
                         per_cpu["service_ns"].sum(), per_cpu["size"].sum(0),
                         per_cpu["queue"].sum(0), per_cpu["service"].sum(0)))
        sec, dev, phase, layer, op, ios, nbytes, qns, sns, size, queue, service = zip(*rows)
        block = np.array(layer) == schema.LAYERS.index(schema.LAYER_BLOCK)
        cols = {
            "ts_ns": pa.array(np.array(sec, np.int64) * NS_PER_S),
            "phase": pa.array([phase_name(p) for p in phase], pa.string()),
            "layer": pa.array([schema.LAYERS[x] for x in layer], pa.string()),
            "op": pa.array([schema.OPS[min(o, len(schema.OPS) - 1)] for o in op], pa.string()),
            **self._dev_cols(dev, ~block),
            "ios": pa.array(np.array(ios, np.uint64)),
            "bytes": pa.array(np.array(nbytes, np.uint64)),
            "queue_ns": pa.array(np.array(qns, np.uint64)),
            "service_ns": pa.array(np.array(sns, np.uint64)),
            "size_hist": _hist(size),
            "queue_hist": _hist(queue),
            "service_hist": _hist(service),
        }
        return pa.RecordBatch.from_arrays([cols[f.name] for f in schema.IO_AGG],
                                          schema=schema.IO_AGG)

    def _busy_rows(self, keys: list) -> pa.RecordBatch:
        sec, dev, phase, ns = zip(*((k.sec, k.dev, k.phase, sum(self._busy.getvalue(k)))
                                    for k in keys))
        cols = {
            "ts_ns": pa.array(np.array(sec, np.int64) * NS_PER_S),
            "phase": pa.array([phase_name(p) for p in phase], pa.string()),
            **self._dev_cols(dev, np.zeros(len(dev), bool)),
            "busy_ns": pa.array(np.array(ns, np.uint64)),
        }
        return pa.RecordBatch.from_arrays([cols[f.name] for f in schema.DEVICE_BUSY],
                                          schema=schema.DEVICE_BUSY)

    def _dev_cols(self, devs: tuple, none: np.ndarray) -> dict[str, pa.Array]:
        d = np.array(devs, np.uint32)
        return {"dev_major": pa.array(d >> 20, mask=none),
                "dev_minor": pa.array(d & 0xFFFFF, mask=none),
                "dev_name": pa.array([None if n else self._device(int(x)).name
                                      for x, n in zip(d.tolist(), none.tolist())], pa.string())}


def _hist(rows: tuple) -> pa.Array:
    flat = np.concatenate(rows).astype(np.uint32)
    return pa.ListArray.from_arrays(pa.array(np.arange(0, len(flat) + 1, SLOTS, dtype=np.int32)),
                                    pa.array(flat))
