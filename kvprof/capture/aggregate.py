"""The aggregate tier's user side: drains the probes' maps (layers/lib/aggregate.h) as
issue-slot rows. `agg` counts every block and io_uring request per issue slot, completion
second, device, layer and op; `busy` each device's time with a request in flight, per slot and
the second it was accounted in. A key is taken and deleted once its second is SETTLE_S over (no
probe writes to it any more, so no update is lost), every key at the end. The rows carry no
phase: the recorder folds them by the windows (kvprof/analysis/fold.py)."""
from __future__ import annotations

import ctypes
import errno
import os
import time

import numpy as np

from kvprof.capture.layout import Code, Struct
from kvprof.schema import AGG_ROW, BUSY_ROW, SLOT_NS
from kvprof.schema import AGG_SLOTS as HIST_SLOTS

NS_PER_S = 1_000_000_000
# Seconds a completion second must be over before it is taken: probes that read the clock
# in it finish within microseconds (block and io_uring tracepoints run with preemption off).
SETTLE_S = 2
# Entries read per batch syscall.
CHUNK = 1024

# struct kvprof_agg_key / _val and kvprof_busy_key / _val, as numpy reads them (LAYOUTS).
AGG_KEY = np.dtype([("slot", "<u8"), ("sec", "<u4"), ("dev", "<u4"), ("layer", "u1"),
                    ("op", "u1"), ("pad", "V6")])
AGG_VAL = np.dtype([("bytes", "<u8"), ("queue_ns", "<u8"),
                    ("service_ns", "<u8"), ("first_inv", "<u8"), ("last", "<u8"),
                    ("size", "<u4", HIST_SLOTS), ("queue", "<u4", HIST_SLOTS),
                    ("service", "<u4", HIST_SLOTS)])
BUSY_KEY = np.dtype([("slot", "<u8"), ("sec", "<u4"), ("dev", "<u4"), ("run", "<u4"),
                     ("pad", "<u4")])
BUSY_VAL = np.dtype([("ns", "<u8"), ("first_inv", "<u8"), ("last", "<u8")])
# Checked field by field against the maps' types at load (kvprof/capture/layout.py).
AGGREGATE_C = "kvprof/layers/lib/aggregate.h"
LAYOUTS = (Struct("kvprof_agg_key", AGG_KEY, __name__, "agg", "Key", c_file=AGGREGATE_C),
           Struct("kvprof_agg_val", AGG_VAL, __name__, "agg", c_file=AGGREGATE_C),
           Struct("kvprof_busy_key", BUSY_KEY, __name__, "busy", "Key", c_file=AGGREGATE_C),
           Struct("kvprof_busy_val", BUSY_VAL, __name__, "busy", c_file=AGGREGATE_C))
CODES = (Code("KVPROF_SLOT_NS", SLOT_NS, "kvprof.schema", AGGREGATE_C),
         Code("KVPROF_AGG_SLOTS", HIST_SLOTS, "kvprof.schema", AGGREGATE_C))


def _dump(table, key_dtype: np.dtype, val_dtype: np.dtype) -> tuple[np.ndarray, np.ndarray]:
    """Every key of a hash map and its value, in a few batch syscalls rather than two per key
    (bcc's lookup batch sizes its buffer by the map's maximum entries)."""
    from bcc.libbcc import lib  # capture's own import of bcc: loaded by the time we run

    keys = np.zeros(CHUNK, key_dtype)
    vals = np.zeros(CHUNK, val_dtype)
    token = ctypes.c_uint32(0)
    got_k, got_v = [], []
    first = True
    while True:
        n = ctypes.c_uint32(CHUNK)
        res = lib.bpf_lookup_batch(table.map_fd, None if first else ctypes.byref(token),
                                   ctypes.byref(token), keys.ctypes.data, vals.ctypes.data,
                                   ctypes.byref(n))
        err = ctypes.get_errno()
        got_k.append(keys[:n.value].copy())
        got_v.append(vals[:n.value].copy())
        if res != 0:
            if err == errno.ENOENT:
                break
            raise OSError(err, f"reading the aggregate map: {os.strerror(err)}")
        first = False
    return np.concatenate(got_k), np.concatenate(got_v)


def _delete(table, keys: np.ndarray) -> None:
    from bcc.libbcc import lib

    if not len(keys):
        return
    keys = np.ascontiguousarray(keys)
    n = ctypes.c_uint32(len(keys))
    if lib.bpf_delete_batch(table.map_fd, keys.ctypes.data, ctypes.byref(n)) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"clearing the aggregate map: {os.strerror(err)}")


def _agg_rows(keys: np.ndarray, vals: np.ndarray) -> np.ndarray:
    out = np.zeros(len(keys), AGG_ROW)
    for f in ("slot", "sec", "dev", "layer", "op"):
        out[f] = keys[f]
    for f in ("bytes", "queue_ns", "service_ns", "size", "queue", "service"):
        out[f] = vals[f]
    out["ios"] = vals["size"].sum(axis=1)  # every request is in the size histogram
    # The probes leave requests without queue time out of the queue histogram (slot 0).
    out["queue"][:, 0] = out["ios"] - out["queue"][:, 1:].sum(axis=1)
    out["first"] = SLOT_NS - vals["first_inv"].astype(np.int64)
    out["last"] = vals["last"]
    return out


def _busy_rows(keys: np.ndarray, vals: np.ndarray) -> np.ndarray:
    out = np.zeros(len(keys), BUSY_ROW)
    for f in ("slot", "sec", "dev", "run"):
        out[f] = keys[f]
    out["ns"] = vals["ns"]
    out["first"] = SLOT_NS - vals["first_inv"].astype(np.int64)
    out["last"] = vals["last"]
    return out


class AggregateReader:
    def __init__(self, bpf):
        self._agg = bpf["agg"]
        self._busy = bpf["busy"]
        # Requests taken so far, by layer code: what the session counted, every one (the
        # event tier's rows may be a sample, or none with --no-events).
        self.counted: dict[int, int] = {}

    def take(self, final: bool = False) -> dict[str, np.ndarray]:
        """The keys whose second is over (all of them when `final`) leave the maps as
        `agg` and `busy` slot rows; those still counting are read as they stand, as
        `agg_open` and `busy_open` (the recorder folds them for live views and puts each
        flush's in place of the last: a recording killed at any moment keeps its counts up
        to its last flush)."""
        cutoff = None if final else (time.monotonic_ns() // NS_PER_S) - SETTLE_S
        out: dict[str, np.ndarray] = {}
        for name, table, kd, vd, rows in (("agg", self._agg, AGG_KEY, AGG_VAL, _agg_rows),
                                          ("busy", self._busy, BUSY_KEY, BUSY_VAL,
                                           _busy_rows)):
            keys, vals = _dump(table, kd, vd)
            over = np.ones(len(keys), bool) if cutoff is None else keys["sec"] <= cutoff
            _delete(table, keys[over])
            out[name] = rows(keys[over], vals[over])
            out[f"{name}_open"] = rows(keys[~over], vals[~over])
        agg = out["agg"]
        for code in np.unique(agg["layer"]):
            n = int(agg["ios"][agg["layer"] == code].sum())
            self.counted[int(code)] = self.counted.get(int(code), 0) + n
        return out
