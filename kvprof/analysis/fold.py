"""The one rule for the phase of an I/O, and the aggregate tier's issue slots folded by it.

An I/O belongs to the most exact window holding its issue time (`flatten`), however late the
window came. The aggregate tier counts requests per 4 ms issue slot (SLOT_NS, in
kvprof/layers/kvprof.h) with their earliest and latest issue; `fold` gives a slot the window
holding both, else the one holding most of that span, marked `boundary`: the most requests that
can sit on the wrong side of an edge (DESIGN.md, "Two capture tiers"). Busy time likewise."""
from __future__ import annotations

import heapq
from collections.abc import Callable

import numpy as np
import pyarrow as pa

from kvprof import schema
from kvprof.schema import AGG_ROW, BUSY_ROW, SLOT_NS
from kvprof.schema import AGG_SLOTS as HIST_SLOTS

NS_PER_S = 1_000_000_000


def phase_codes(phases: np.ndarray) -> np.ndarray:
    """Each phase name's index in schema.PHASES (small integers group and sort faster)."""
    codes = np.zeros(len(phases), np.int8)
    for i, p in enumerate(schema.PHASES):
        codes[phases == p] = i
    return codes


def flatten(windows: pa.Table, t0: int, t1: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Disjoint (start, end, phase) pieces covering [t0, t1) exactly, gaps labelled idle:
    where windows overlap, the more exact source's (schema.SOURCE_RANK), among equals the
    later-starting one."""
    fast = _flatten_disjoint(windows, t0, t1)
    return fast if fast is not None else _flatten_sweep(windows, t0, t1)


def flatten_whole(windows: pa.Table, t0: int, t1: int
                  ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """flatten for a view of the whole session, which counts every row, those issued between
    attaching and the session's first timestamp `t0` too: the pieces start before every
    window, so such a row lands in the window that held it (an engine step already running
    when the probes attached), not in whatever phase holds t0; a row before every window in
    the idle piece in front (row lookups reach the first piece back to the start of time)."""
    starts = windows["start_ns"].to_numpy(zero_copy_only=False)
    first = int(starts.min()) if len(starts) else t0
    return flatten(windows, min(t0, first) - 1, t1)


def _flatten_sweep(windows: pa.Table, t0: int, t1: int
                   ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """flatten for any windows: a sweep over their edges with a heap of those covering."""
    rows = [
        (max(s, t0), min(e, t1), p, schema.SOURCE_RANK.get(src, 0))
        for s, e, p, src in zip(windows["start_ns"].to_pylist(), windows["end_ns"].to_pylist(),
                                windows["phase"].to_pylist(), windows["source"].to_pylist())
        if min(e, t1) > max(s, t0)
    ]
    rows.sort(key=lambda r: r[0])
    bounds = sorted({t0, t1, *(r[0] for r in rows), *(r[1] for r in rows)})
    starts: list[int] = []
    ends: list[int] = []
    phases: list[str] = []
    heap: list = []  # (-rank, -start, end, phase): best covering window on top
    i = 0
    for a, b in zip(bounds, bounds[1:]):
        while i < len(rows) and rows[i][0] <= a:
            s, e, p, rank = rows[i]
            heapq.heappush(heap, (-rank, -s, e, p))
            i += 1
        # Lazy deletion: a window that ended is dropped once it reaches the top.
        while heap and heap[0][2] <= a:
            heapq.heappop(heap)
        phase = heap[0][3] if heap else "idle"
        if phases and phases[-1] == phase and ends[-1] == a:
            ends[-1] = b
        else:
            starts.append(a)
            ends.append(b)
            phases.append(phase)
    return np.array(starts, np.int64), np.array(ends, np.int64), np.array(phases, object)


def _flatten_disjoint(windows: pa.Table, t0: int, t1: int
                      ) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """flatten, in numpy, where no two windows overlap (one source, or sources taking turns:
    the usual session), far faster than the general sweep on many windows; None where some
    do, for that sweep."""
    if t1 < t0:
        return None
    s = np.maximum(windows["start_ns"].to_numpy(zero_copy_only=False).astype(np.int64), t0)
    e = np.minimum(windows["end_ns"].to_numpy(zero_copy_only=False).astype(np.int64), t1)
    p = np.asarray(windows["phase"].to_numpy(zero_copy_only=False), dtype=object)
    keep = e > s
    s, e, p = s[keep], e[keep], p[keep]
    order = np.argsort(s, kind="stable")
    s, e, p = s[order], e[order], p[order]
    if len(s) > 1 and not (e[:-1] <= s[1:]).all():
        return None
    # Each window preceded by the idle gap before it (empty where there is none), then the
    # gap after the last; empty pieces dropped, touching pieces of one phase merged.
    prev = np.concatenate(([t0], e)).astype(np.int64)
    starts = np.empty(2 * len(s) + 1, np.int64)
    ends = np.empty_like(starts)
    phases = np.empty(len(starts), object)
    starts[0:-1:2], ends[0:-1:2], phases[0:-1:2] = prev[:-1], s, "idle"
    starts[1::2], ends[1::2], phases[1::2] = s, e, p
    starts[-1], ends[-1], phases[-1] = prev[-1], t1, "idle"
    keep = ends > starts
    starts, ends, phases = starts[keep], ends[keep], phases[keep]
    if not len(starts):
        return starts, ends, phases
    new = np.ones(len(starts), bool)
    new[1:] = (phases[1:] != phases[:-1]) | (starts[1:] != ends[:-1])
    first = np.flatnonzero(new)
    last = np.append(first[1:] - 1, len(starts) - 1)
    return starts[first], ends[last], phases[first]


class Pieces:
    """flatten's pieces over a span, for lookups by time."""

    def __init__(self, windows: pa.Table, t0: int, t1: int):
        self.starts, self.ends, self.phases = flatten(windows, t0, t1)

    def index(self, t: np.ndarray) -> np.ndarray:
        return np.clip(np.searchsorted(self.starts, t, side="right") - 1, 0,
                       len(self.starts) - 1)

    def overlaps(self, a: int, b: int) -> dict[str, int]:
        """ns of [a, b) per phase."""
        out: dict[str, int] = {}
        for i in range(int(self.index(np.array([a]))[0]), len(self.starts)):
            if self.starts[i] >= b:
                break
            ov = int(min(b, self.ends[i]) - max(a, self.starts[i]))
            if ov > 0:
                out[self.phases[i]] = out.get(self.phases[i], 0) + ov
        return out


def _span(agg: np.ndarray, busy: np.ndarray) -> tuple[int, int]:
    lo, hi = [], []
    if len(agg):
        lo.append(int(agg["slot"].min()) * SLOT_NS)
        hi.append(int(agg["slot"].max() + 1) * SLOT_NS)
    if len(busy):
        lo.append(int(busy["slot"].min()) * SLOT_NS)
        hi.append(int((busy["slot"] + np.maximum(busy["run"], 1)).max()) * SLOT_NS)
    return (min(lo), max(hi)) if lo else (0, 0)


def fold(agg: np.ndarray, busy: np.ndarray, windows: pa.Table,
         device: Callable[[int], str]) -> tuple[pa.RecordBatch | None, pa.RecordBatch | None]:
    """Slot rows (AGG_ROW, BUSY_ROW) as io_agg and device_busy rows under `windows`."""
    if not len(agg) and not len(busy):
        return None, None
    pieces = Pieces(windows, *_span(agg, busy))
    return (_fold_agg(agg, pieces, device) if len(agg) else None,
            _fold_busy(busy, pieces, device) if len(busy) else None)


def _fold_agg(agg: np.ndarray, pieces: Pieces, device) -> pa.RecordBatch:
    base = agg["slot"].astype(np.int64) * SLOT_NS
    lo = base + agg["first"].astype(np.int64)
    hi = base + agg["last"].astype(np.int64)
    i_lo, i_hi = pieces.index(lo), pieces.index(hi)
    phase = pieces.phases[i_lo].copy()
    boundary = i_lo != i_hi
    for r in np.flatnonzero(boundary):
        # Most of the span between the slot's first and last issue (ties: the earlier).
        ov = pieces.overlaps(int(lo[r]), int(hi[r]) + 1)
        phase[r] = max(ov, key=lambda p: ov[p])
    codes = phase_codes(phase).astype(np.int64)
    key = np.stack([agg["sec"].astype(np.int64), codes, agg["layer"].astype(np.int64),
                    agg["op"].astype(np.int64), agg["dev"].astype(np.int64),
                    boundary.astype(np.int64)], axis=1)
    uniq, inv = np.unique(key, axis=0, return_inverse=True)
    inv = inv.reshape(-1)

    def total(field: str) -> np.ndarray:
        v = agg[field].astype(np.uint64)
        out = np.zeros((len(uniq),) + v.shape[1:], np.uint64)
        np.add.at(out, inv, v)
        return out

    sec, code, layer, op, dev, edge = (uniq[:, i] for i in range(6))
    none = layer != schema.LAYERS.index(schema.LAYER_BLOCK)
    cols = {
        "ts_ns": pa.array(sec * NS_PER_S),
        "phase": pa.array([schema.PHASES[c] for c in code], pa.string()),
        "layer": pa.array([schema.LAYERS[x] for x in layer], pa.string()),
        "op": pa.array([schema.OPS[min(o, len(schema.OPS) - 1)] for o in op], pa.string()),
        **_dev_cols(dev, none, device),
        "ios": pa.array(total("ios")),
        "bytes": pa.array(total("bytes")),
        "queue_ns": pa.array(total("queue_ns")),
        "service_ns": pa.array(total("service_ns")),
        "size_hist": _hist(total("size")),
        "queue_hist": _hist(total("queue")),
        "service_hist": _hist(total("service")),
        "boundary": pa.array(edge.astype(bool)),
    }
    return pa.RecordBatch.from_arrays([cols[f.name] for f in schema.IO_AGG],
                                      schema=schema.IO_AGG)


def _fold_busy(busy: np.ndarray, pieces: Pieces, device) -> pa.RecordBatch:
    """Busy time over the windows: exactly where one window holds a slot's busy pieces (or a
    run of whole slots), else shared by overlap."""
    base = busy["slot"].astype(np.int64) * SLOT_NS
    a = base + busy["first"].astype(np.int64)
    b = base + busy["last"].astype(np.int64)
    i_a, i_b = pieces.index(a), pieces.index(np.maximum(b - 1, a))
    # Most rows: pieces within one slot (so one second) that one window holds.
    whole = (busy["run"] == 0) & (i_a == i_b)
    secs = [base[whole] // NS_PER_S]
    phases = [pieces.phases[i_a[whole]]]
    devs = [busy["dev"][whole].astype(np.int64)]
    nss = [busy["ns"][whole].astype(np.int64)]
    for r in np.flatnonzero(~whole):
        row = busy[r]
        dev, ns = int(row["dev"]), int(row["ns"])
        parts: list[tuple[int, str, int]] = []
        if row["run"]:
            # One stretch from the slot's start on: laid over windows and seconds exactly.
            lo, hi = int(base[r]), int(base[r]) + ns
            while lo < hi:
                cut = min(hi, (lo // NS_PER_S + 1) * NS_PER_S)
                parts += [(lo // NS_PER_S, p, ov) for p, ov in pieces.overlaps(lo, cut).items()]
                lo = cut
        else:
            # Busy pieces between first and last that a window edge cuts: shared by the
            # windows' overlap of that span.
            ov = sorted(pieces.overlaps(int(a[r]), int(b[r])).items())
            span, given = sum(v for _, v in ov), 0
            for i, (p, part) in enumerate(ov):
                share = ns - given if i == len(ov) - 1 else ns * part // span
                given += share
                parts.append((int(base[r]) // NS_PER_S, p, share))
        for s, p, v in parts:
            secs.append(np.array([s]))
            phases.append(np.array([p], object))
            devs.append(np.array([dev]))
            nss.append(np.array([v]))
    sec_a, phase_a = np.concatenate(secs), np.concatenate(phases)
    dev_a, ns_a = np.concatenate(devs), np.concatenate(nss)
    codes = phase_codes(phase_a).astype(np.int64)
    uniq, inv = np.unique(np.stack([sec_a, codes, dev_a], axis=1), axis=0, return_inverse=True)
    total = np.zeros(len(uniq), np.uint64)
    np.add.at(total, inv.reshape(-1), ns_a.astype(np.uint64))
    keep = total > 0
    uniq, total = uniq[keep], total[keep]
    cols = {
        "ts_ns": pa.array(uniq[:, 0] * NS_PER_S),
        "phase": pa.array([schema.PHASES[c] for c in uniq[:, 1]], pa.string()),
        **_dev_cols(uniq[:, 2], np.zeros(len(uniq), bool), device),
        "busy_ns": pa.array(total),
    }
    return pa.RecordBatch.from_arrays([cols[f.name] for f in schema.DEVICE_BUSY],
                                      schema=schema.DEVICE_BUSY)


def _dev_cols(devs: np.ndarray, none: np.ndarray, device) -> dict[str, pa.Array]:
    d = np.asarray(devs, np.uint32)
    return {"dev_major": pa.array(d >> 20, mask=none),
            "dev_minor": pa.array(d & 0xFFFFF, mask=none),
            "dev_name": pa.array([None if n else device(int(x))
                                  for x, n in zip(d.tolist(), none.tolist())], pa.string())}


def _hist(rows: np.ndarray) -> pa.Array:
    flat = rows.reshape(-1).astype(np.uint32)
    return pa.ListArray.from_arrays(
        pa.array(np.arange(0, len(flat) + 1, HIST_SLOTS, dtype=np.int32)), pa.array(flat))


class WindowBook:
    """The windows the sources have sent (the closed ones of the last KEEP_NS, and the open
    ones as of the last flush), and the aggregate tier's slot rows taken from the kernel but
    not folded for good yet: those wait until their second is `settle_s` over, for the
    windows of sources that send them late."""

    KEEP_NS = 120 * NS_PER_S

    def __init__(self, settle_s: int = 5) -> None:
        self.settle_s = settle_s
        self._closed: list[pa.Table] = []
        self._open: pa.Table | None = None
        self._agg = np.zeros(0, AGG_ROW)
        self._busy = np.zeros(0, BUSY_ROW)
        self.folded_until = 0  # settled slots before this were folded
        self.late = 0  # windows that came after the time they cover had been folded
        # (start, phase, source) of the windows open when settled slots were folded: the
        # fold had them, up to the time it folded.
        self._folded_open: set[tuple[int, str, str]] = set()

    def add(self, rows: pa.Table) -> None:
        if not len(rows):
            return
        keys = zip(rows["start_ns"].to_pylist(), rows["phase"].to_pylist(),
                   rows["source"].to_pylist())
        for start, phase, source in keys:
            if start < self.folded_until and (start, phase, source) not in self._folded_open:
                self.late += 1
            self._folded_open.discard((start, phase, source))
        self._closed.append(rows.select(_COLS))

    def set_open(self, rows: list[dict]) -> None:
        self._open = pa.Table.from_pylist(rows).select(_COLS) if rows else None

    def table(self) -> pa.Table:
        parts = [*self._closed, *([self._open] if self._open is not None else [])]
        if not parts:
            return pa.table({c: pa.array([], schema.PHASE.field(c).type) for c in _COLS})
        return pa.concat_tables([p.cast(pa.schema([schema.PHASE.field(c) for c in _COLS]))
                                 for p in parts])

    def fold(self, agg: np.ndarray, busy: np.ndarray, device: Callable[[int], str],
             settled: bool) -> tuple[pa.RecordBatch | None, pa.RecordBatch | None]:
        out = fold(agg, busy, self.table(), device)
        if settled and (len(agg) or len(busy)):
            _, t1 = _span(agg, busy)
            self.folded_until = max(self.folded_until, t1)
            if self._open is not None:
                self._folded_open.update(zip(self._open["start_ns"].to_pylist(),
                                             self._open["phase"].to_pylist(),
                                             self._open["source"].to_pylist()))
        return out

    def settle(self, agg: np.ndarray, busy: np.ndarray, now_ns: int,
               device: Callable[[int], str], final: bool = False
               ) -> tuple[pa.RecordBatch | None, pa.RecordBatch | None, int]:
        """Take slot rows from the kernel and fold for good those whose second is
        `settle_s` over (all of them when `final`). Returns the folded rows and the time
        before which every request is in them."""
        self._agg = np.concatenate([self._agg, agg])
        self._busy = np.concatenate([self._busy, busy])
        last = None if final else now_ns // NS_PER_S - self.settle_s
        ready_a = np.ones(len(self._agg), bool) if last is None else self._agg["sec"] <= last
        ready_b = np.ones(len(self._busy), bool) if last is None else self._busy["sec"] <= last
        out = self.fold(self._agg[ready_a], self._busy[ready_b], device, settled=True)
        self._agg, self._busy = self._agg[~ready_a], self._busy[~ready_b]
        return (*out, now_ns if last is None else (last + 1) * NS_PER_S)

    def provisional(self, agg: np.ndarray, busy: np.ndarray, device: Callable[[int], str]
                    ) -> tuple[pa.RecordBatch | None, pa.RecordBatch | None]:
        """The rows not folded for good (those waiting and those the kernel still counts),
        folded by the windows known now: what live views and a killed recording show."""
        return self.fold(np.concatenate([self._agg, agg]), np.concatenate([self._busy, busy]),
                         device, settled=False)

    def phase_time(self, t0: int, t1: int) -> dict[str, int]:
        """ns of [t0, t1) per phase under the windows known now."""
        out = {p: 0 for p in schema.PHASES}
        if t1 > t0:
            pieces = Pieces(self.table(), t0, t1)
            for a, b, p in zip(pieces.starts, pieces.ends, pieces.phases):
                out[p] += int(b - a)
        return out

    def counts(self) -> dict[str, int]:
        """For the session's `lost`: windows whose time the aggregate tier had folded
        without them (record --settle was too short for their source)."""
        return {"phase_window_after_fold": self.late} if self.late else {}

    def prune(self, now_ns: int) -> None:
        """Forget closed windows that ended before what can still be folded."""
        t = pa.concat_tables(self._closed) if len(self._closed) > 1 else None
        if t is not None:
            self._closed = [t]
        if self._closed:
            keep = np.asarray(self._closed[0]["end_ns"]) >= now_ns - self.KEEP_NS
            if not keep.all():
                self._closed = [self._closed[0].filter(pa.array(keep))]


_COLS = ["start_ns", "end_ns", "phase", "source"]
