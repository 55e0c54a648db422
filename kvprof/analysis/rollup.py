"""Aggregates of the row cache per unit of time, merged into any window's exact numbers.

A unit is one phase within one grid second: its rows never change phase or second, so its
aggregates are built once and reused until a row arrives late into it or its windows move (its
key names their bounds); a refresh builds only the newest units and the one the window's start
cuts. Counts, bytes, histograms add up; for a quantile (exact, as SQL's quantile_cont) the units'
counts per fine bucket (monotone in the value) locate it, and only that bucket is partitioned."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvprof import schema
from kvprof.analysis.iocache import IoCache, Rows

GRID_NS = 1_000_000_000
NL, NOPS = len(schema.LAYERS), len(schema.OPS)
NGROUPS = NL * NOPS  # (layer, op) pairs
LOG2_BINS = 64
FINE_BITS = 5  # 32 fine buckets per octave: a rank's bucket holds a few % of the values
# Bucket 0: negative values; 1 .. 2**FINE_BITS: the values 0 .. 2**FINE_BITS - 1 exactly.
NFINE = 1 + ((63 - FINE_BITS + 1) << FINE_BITS)
BLOCK = schema.LAYERS.index(schema.LAYER_BLOCK)
IO_URING = schema.LAYERS.index(schema.LAYER_IO_URING)
_MIN, _MAX = np.iinfo(np.int64).min, np.iinfo(np.int64).max
# Units the memo keeps after their last use, in refreshes: enough to flip between windows.
_KEEP_UNUSED = 16


def log2_bucket(values: np.ndarray) -> np.ndarray:
    """floor(log2(max(v, 1))), exactly: frexp's exponent has no rounding to go wrong."""
    return np.frexp(np.maximum(values, 1))[1].astype(np.int64) - 1


def fine_bucket(ns: np.ndarray) -> np.ndarray:
    """A bucket index that never decreases with the value: 0 for negative values (a clock
    step), then the value itself below 2**FINE_BITS, then 2**FINE_BITS steps per octave."""
    v = np.maximum(ns, 0)
    e = np.frexp(v.astype(np.float64))[1].astype(np.int64) - 1
    shift = np.maximum(e - FINE_BITS, 0)
    sub = (v >> shift) & ((1 << FINE_BITS) - 1)
    b = np.where(v < (1 << FINE_BITS), v, ((e - FINE_BITS + 1) << FINE_BITS) + sub)
    return np.where(ns < 0, 0, b + 1)


@dataclass(frozen=True)
class Unit:
    """Aggregates of the rows of one phase issued within one grid second (between `start`
    and `end`, in that phase's windows there)."""
    start: int
    end: int
    phase: str
    cell: int         # grid second the unit lies in
    rows_seen: int    # unfiltered cached rows in its windows when built: the memo's check
    ios: np.ndarray   # per group
    bytes: np.ndarray
    size_h: np.ndarray  # (group, log2 bucket) counts
    lat_h: np.ndarray
    # Per metric (total, queue, device ns): values ordered by (group, fine bucket); the
    # (group, bucket) keys that occur, ascending; where each key's run starts, and the end.
    values: tuple[np.ndarray, ...]
    keys: tuple[np.ndarray, ...]
    bounds: tuple[np.ndarray, ...]
    procs: np.ndarray  # rows per process code
    devs: np.ndarray   # rows per device code + 1 (0: no device)
    block_ns: np.ndarray  # the block rows' summed device time (ns) per device code + 1


def _build(r: Rows, start: int, end: int, phase: str, cell: int, seen: int) -> Unit:
    g = r.layer.astype(np.int64) * NOPS + r.op
    ios = np.bincount(g, minlength=NGROUPS)
    # Float weights are exact below 2**53 bytes, far above a second of any device.
    nbytes = np.bincount(g, weights=r.bytes, minlength=NGROUPS).astype(np.int64)
    total = r.complete - r.start
    # Sizes of requests that carry data only (a flush has none), as in SqlRows.
    size_h = np.bincount(g * LOG2_BINS + log2_bucket(r.bytes), weights=r.bytes > 0,
                         minlength=NGROUPS * LOG2_BINS).astype(np.int64)
    size_h = size_h.reshape(NGROUPS, LOG2_BINS)
    lat_h = np.bincount(g * LOG2_BINS + log2_bucket(total / 1e3),
                        minlength=NGROUPS * LOG2_BINS).reshape(NGROUPS, LOG2_BINS)
    values, keys, bounds = [], [], []
    for v in (total, r.issue - r.start, r.complete - r.issue):
        key = (g * NFINE + fine_bucket(v)).astype(np.uint16)  # < 2**16: a radix sort
        order = np.argsort(key, kind="stable")
        values.append(v[order])
        key = key[order]
        first = np.flatnonzero(np.r_[True, key[1:] != key[:-1]]) if len(key) else \
            np.empty(0, np.int64)
        keys.append(key[first])
        bounds.append(np.r_[first, len(key)].astype(np.int32))
    dev = r.dev.astype(np.int64) + 1
    # Float weights are exact below 2**53 ns (104 days) of device time a second.
    block_ns = np.bincount(dev, weights=np.where(r.layer == BLOCK, np.maximum(
        r.complete - r.start, 0), 0)).astype(np.int64)
    return Unit(start, end, phase, cell, seen, ios, nbytes, size_h, lat_h, tuple(values),
                tuple(keys), tuple(bounds), np.bincount(r.proc), np.bincount(dev), block_ns)


assert NGROUPS * NFINE <= 1 << 16, "(group, bucket) keys must fit 16 bits"


class Rollup:
    """The memo of units for one cache; used by the cache's thread only."""

    def __init__(self, cache: IoCache):
        self.cache = cache
        self._memo: dict[tuple, tuple[int, Unit]] = {}
        self._gen = 0
        self.rows_built = 0  # rows aggregated into units so far: for tests

    def units(self, ws: np.ndarray, we: np.ndarray, wp: np.ndarray, origin: int,
              device: str | None = None, tgid: int | None = None, cuts: tuple = (),
              unbounded: bool = False) -> list[Unit]:
        """Units covering the pieces (ws, we, wp), split at every grid second from `origin`
        and at `cuts`. `unbounded`: the first unit reaches back to the start of time and the
        last one on forever, as the whole-session report counts every row."""
        self._gen += 1
        issue = self.cache.col("issue")
        cut_at = sorted(cuts)
        seg_s: list[int] = []
        seg_e: list[int] = []
        seg_p: list[str] = []
        for s, e, p in zip(ws.tolist(), we.tolist(), wp.tolist()):
            first = origin + (s - origin) // GRID_NS * GRID_NS
            edges = sorted({s, *range(first + GRID_NS, e, GRID_NS), e,
                            *(c for c in cut_at if s < c < e)})
            seg_s += edges[:-1]
            seg_e += edges[1:]
            seg_p += [p] * (len(edges) - 1)
        if not seg_s:
            return []
        starts = np.array(seg_s, np.int64)
        ends = np.array(seg_e, np.int64)
        cells = ((starts - origin) // GRID_NS).tolist()
        sides = np.searchsorted(np.array(cut_at, np.int64), starts, side="right").tolist()
        if unbounded:
            starts[0], ends[-1] = _MIN, _MAX
        i0 = np.searchsorted(issue, starts, side="left").tolist()
        i1 = np.searchsorted(issue, ends, side="left").tolist()
        # One unit per (grid second, side of the cuts, phase): however many windows an
        # engine marks per second, a second holds at most one unit per phase.
        groups: dict[tuple, list[int]] = {}
        for i, group in enumerate(zip(cells, sides, seg_p)):
            groups.setdefault(group, []).append(i)
        out = []
        for (c, _, p), idx in groups.items():
            segs = tuple((int(starts[i]), int(ends[i])) for i in idx)
            key = (p, segs, device, tgid)
            ranges = [(i0[i], i1[i]) for i in idx]
            seen = sum(b - a for a, b in ranges)
            hit = self._memo.get(key)
            if hit is None or hit[1].rows_seen != seen:
                rows = self.cache.take(ranges, device, tgid)
                hit = (self._gen, _build(rows, segs[0][0], segs[-1][1], p, c, seen))
                self.rows_built += len(rows)
            self._memo[key] = (self._gen, hit[1])
            out.append(hit[1])
        for key in [k for k, (g, u) in self._memo.items()
                    if g < self._gen - _KEEP_UNUSED or u.end <= self.cache.lo_ns]:
            del self._memo[key]
        return out


class _Runs:
    """One metric's (group, bucket) runs over a phase's units, side by side."""

    def __init__(self, units: list[Unit], m: int):
        self.units, self.m = units, m
        self.keys = np.concatenate([u.keys[m] for u in units]).astype(np.int64)
        self.starts = np.concatenate([u.bounds[m][:-1] for u in units])
        self.lens = np.concatenate([np.diff(u.bounds[m]) for u in units])
        self.unit = np.repeat(np.arange(len(units)), [len(u.keys[m]) for u in units])
        self.counts = np.bincount(self.keys, weights=self.lens,
                                  minlength=NGROUPS * NFINE).reshape(NGROUPS, NFINE)

    def bucket_values(self, key: int) -> np.ndarray:
        hits = np.flatnonzero(self.keys == key).tolist()
        return np.concatenate([self.units[self.unit[h]].values[self.m][
            self.starts[h]:self.starts[h] + self.lens[h]] for h in hits])

    def quantiles_us(self, g: int, n: int) -> list[float]:
        """quantile_cont of the metric (ns) over group g, in µs: linear between the order
        statistics around (n-1)*q."""
        cum = np.concatenate([[0], np.cumsum(self.counts[g])]).astype(np.int64)
        pos = [(n - 1) * q for _, q in schema.QUANTILES]
        ranks = sorted({int(np.floor(r)) for r in pos} | {int(np.ceil(r)) for r in pos})
        buckets = (np.searchsorted(cum, ranks, side="right") - 1).tolist()
        value: dict[int, int] = {}
        for b in sorted(set(buckets)):
            want = [k for k, kb in zip(ranks, buckets) if kb == b]
            if 1 <= b <= 1 << FINE_BITS:  # these buckets hold one value each
                value.update({k: b - 1 for k in want})
                continue
            local = [k - int(cum[b]) for k in want]
            part = np.partition(self.bucket_values(g * NFINE + b), local)
            value.update({k: int(part[i]) for k, i in zip(want, local)})
        out = []
        for r in pos:
            # In ns, then µs, as the SQL (quantile_cont of the integers, divided after).
            lo, hi = int(np.floor(r)), int(np.ceil(r))
            a, b = float(value[lo]), float(value[hi])
            out.append((a + (b - a) * (r - lo)) / 1e3)
        return out


def stats(units: list[Unit]) -> list[tuple]:
    """Per (phase, layer, op) with rows: what `rowsource.SqlRows.per_phase` returns for the
    same rows."""
    out = []
    for p in schema.PHASES:
        mine = [u for u in units if u.phase == p]
        if not mine:
            continue
        ios = np.sum([u.ios for u in mine], axis=0)
        if not ios.any():
            continue
        runs = [_Runs(mine, m) for m in range(3)]
        size_h = np.sum([u.size_h for u in mine], axis=0)
        lat_h = np.sum([u.lat_h for u in mine], axis=0)
        for g in np.flatnonzero(ios).tolist():
            n = int(ios[g])
            layer, op = divmod(g, NOPS)
            hists = [{2 ** int(b): int(h[g, b]) for b in np.flatnonzero(h[g])}
                     for h in (size_h, lat_h)]
            out.append((p, schema.LAYERS[layer], schema.OPS[op], n,
                        int(sum(int(u.bytes[g]) for u in mine)),
                        *(r.quantiles_us(g, n) for r in runs), *hists))
    return out


def device_time(units: list[Unit], code: int | None = None) -> dict[str, int]:
    """Phase -> the block rows' summed device time (ns), of the device with that code in
    the dev column or of all (None): what `rowsource.PerPhase.device_time_of` answers."""
    out: dict[str, int] = {}
    for u in units:
        if code is None:
            ns = int(u.block_ns.sum())
        else:
            ns = int(u.block_ns[code + 1]) if 0 <= code + 1 < len(u.block_ns) else 0
        if ns:
            out[u.phase] = out.get(u.phase, 0) + ns
    return out


def bytes_by_cell(units: list[Unit], c0: int, ncells: int) -> dict:
    """(phase, layer, op) -> bytes per grid second, from second c0 on."""
    out: dict[tuple[str, str, str], np.ndarray] = {}
    for u in units:
        for g in np.flatnonzero(u.ios).tolist():
            layer, op = divmod(g, NOPS)
            arr = out.setdefault((u.phase, schema.LAYERS[layer], schema.OPS[op]),
                                 np.zeros(ncells, np.int64))
            if 0 <= u.cell - c0 < ncells:
                arr[u.cell - c0] += int(u.bytes[g])
    return out


def layers_seen(units: list[Unit]) -> np.ndarray:
    """Which layers have rows in the units."""
    return np.sum([u.ios for u in units], axis=0).reshape(NL, NOPS).sum(axis=1) > 0 \
        if units else np.zeros(NL, bool)


def devices(units: list[Unit], cache: IoCache) -> list[str]:
    """Names of the devices the units' rows went to."""
    devs = np.zeros(len(cache.dev_names) + 1, np.int64)
    for u in units:
        devs[:len(u.devs)] += u.devs
    return sorted(n for n in (cache.dev_names[c - 1] for c in np.flatnonzero(devs) if c) if n)


def busiest(units: list[Unit], cache: IoCache, top: int = 10) -> tuple[tuple[int, str], ...]:
    """The processes with most rows in the units: (tgid, comm), most first."""
    procs = np.zeros(len(cache.tgids), np.int64)
    for u in units:
        procs[:len(u.procs)] += u.procs
    best = sorted((-int(procs[c]), cache.tgids[c]) for c in np.flatnonzero(procs))[:top]
    return tuple((t, cache.comm.get(t, "")) for _, t in best)
