"""Per-phase storage numbers from a session store. Reads only; every view shows what this returns.

An I/O belongs to the window that contains its issue time; time covered by no window is
`idle`. Overlapping windows are flattened first: the more exact source wins, and among equals
the later-starting window.
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass

import duckdb
import numpy as np
import pyarrow as pa

from kvprof import schema
from kvprof.iocache import IoCache, Rows
from kvprof.store import SessionInfo, phase_windows, session_info

QUANTILES = (("p50", 0.5), ("p90", 0.9), ("p99", 0.99), ("p999", 0.999))
MAIN_OPS = ("read", "write")


def flatten(windows: pa.Table, t0: int, t1: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Disjoint (start, end, phase) pieces covering [t0, t1) exactly, gaps labelled idle."""
    rows = [
        (max(s, t0), min(e, t1), p, schema.SOURCE_RANK.get(src, 0))
        for s, e, p, src in zip(windows["start_ns"].to_pylist(), windows["end_ns"].to_pylist(),
                                windows["phase"].to_pylist(), windows["source"].to_pylist())
        if min(e, t1) > max(s, t0)
    ]
    rows.sort(key=lambda r: r[0])
    bounds = sorted({t0, t1, *(r[0] for r in rows), *(r[1] for r in rows)})
    starts, ends, phases = [], [], []
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


def busy_islands(start: np.ndarray, end: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Union of [start, end) intervals as sorted disjoint islands."""
    if len(start) == 0:
        return np.empty(0, np.int64), np.empty(0, np.int64)
    order = np.argsort(start, kind="stable")
    s, e = start[order], end[order]
    run = np.maximum.accumulate(e)
    brk = s[1:] > run[:-1]
    return s[np.r_[True, brk]], run[np.r_[brk, True]]


def busy_islands_ordered(start: np.ndarray, end: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """busy_islands without the sort, for intervals listed in issue order (start <= issue <=
    end). A gap in the union splits the list into a prefix ending before it and a suffix
    starting after it, so islands break where the suffix's earliest start passes the
    prefix's latest end."""
    if len(start) == 0:
        return np.empty(0, np.int64), np.empty(0, np.int64)
    run = np.maximum.accumulate(end)
    suffix_min = np.minimum.accumulate(start[::-1])[::-1]
    brk = suffix_min[1:] > run[:-1]
    return suffix_min[np.r_[True, brk]], run[np.r_[brk, True]]


def busy_between(isl_s: np.ndarray, isl_e: np.ndarray, a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Busy ns inside each [a, b), from a cumulative busy-time function over the islands."""
    if len(isl_s) == 0:
        return np.zeros(len(a), np.int64)
    lengths = isl_e - isl_s
    cum = np.concatenate([[0], np.cumsum(lengths)])

    def upto(t: np.ndarray) -> np.ndarray:
        k = np.searchsorted(isl_s, t, side="right") - 1
        kk = np.clip(k, 0, None)
        within = np.minimum(np.maximum(t - isl_s[kk], 0), lengths[kk])
        return np.where(k >= 0, cum[kk] + within, 0)

    return upto(b) - upto(a)


def _op_entry(bytes_: int, ios: int, time_s: float) -> dict:
    return {
        "bytes": int(bytes_),
        "ios": int(ios),
        "bandwidth_bytes_per_s": bytes_ / time_s if time_s > 0 else 0.0,
        "iops": ios / time_s if time_s > 0 else 0.0,
        "latency_us": {k: None for k, _ in QUANTILES},
        "queue_us": {k: None for k, _ in QUANTILES},
        "device_us": {k: None for k, _ in QUANTILES},
        "size_hist": {},
        "latency_hist_us": {},
    }


@dataclass(frozen=True)
class Filters:
    """Which I/O a view counts: one device, one process (tgid), or all."""
    device: str | None = None
    tgid: int | None = None

    def sql(self) -> str:
        conds = []
        if self.device is not None:
            conds.append("dev_name = '" + self.device.replace("'", "''") + "'")
        if self.tgid is not None:
            conds.append(f"tgid = {int(self.tgid)}")
        return " AND ".join(conds)

    def label(self) -> str:
        parts = [f"dev {self.device}" if self.device else "", f"pid {self.tgid}" if self.tgid
                 is not None else ""]
        return ", ".join(p for p in parts if p) or "all I/O"


def summarize(con: duckdb.DuckDBPyConnection, t0: int | None = None,
              t1: int | None = None, filters: Filters = Filters(),
              cache: IoCache | None = None) -> dict:
    """The report as a dict; its shape is documented in the README and kept stable.

    With a `cache` that holds the window (the live dashboard's), the I/O rows come from it
    instead of SQL; the numbers are the same either way."""
    info = session_info(con)
    t0 = info.start_ns if t0 is None else t0
    t1 = info.end_ns if t1 is None else t1
    windows = phase_windows(con)
    ws, we, wp = flatten(windows, t0, t1)
    durations = (we - ws).astype(np.float64)
    total_s = max(t1 - t0, 0) / 1e9

    phases: dict[str, dict] = {}
    for p in schema.PHASES:
        sel = wp == p
        time_s = float(durations[sel].sum()) / 1e9
        phases[p] = {
            "time_s": time_s,
            "time_share_pct": 100.0 * time_s / total_s if total_s > 0 else 0.0,
            "windows": int(sel.sum()),
            "block": {op: _op_entry(0, 0, time_s) for op in MAIN_OPS},
            "io_uring": {op: _op_entry(0, 0, time_s) for op in MAIN_OPS},
        }

    if cache is not None and cache.covers(t0):
        # The whole session also counts rows issued outside its bounds, as the SQL does.
        whole = t0 == info.start_ns and t1 == info.end_ns
        lo, hi = (np.iinfo(np.int64).min, np.iinfo(np.int64).max) if whole else (t0, t1)
        rows = cache.rows(lo, hi, filters.device, filters.tgid)
        stats = _stats_of_rows(rows, ws, wp)
        spans = _block_spans_of_rows(rows, cache.dev_names)
    else:
        bounds = _bounds(info, t0, t1, filters)
        stats = _stats_sql(con, bounds, ws, wp)
        spans = _block_spans_sql(con, bounds)
    for p, layer, op, ios, nbytes, lat, queue, dev, sizes, lats in stats:
        entry = phases[p][layer].setdefault(op, _op_entry(0, 0, phases[p]["time_s"]))
        entry.update(_op_entry(nbytes or 0, ios, phases[p]["time_s"]))
        for key, vals in (("latency_us", lat), ("queue_us", queue), ("device_us", dev)):
            entry[key] = {k: float(v) for (k, _), v in zip(QUANTILES, vals)}
        for key, hist in (("size_hist", sizes), ("latency_hist_us", lats)):
            entry[key] = {str(int(b)): int(n) for b, n in sorted(dict(hist).items())}

    _idle(info, phases, ws, we, wp, *spans)
    lost = {k: int(v) for k, v in info.lost.items()}
    return {
        "session": {
            "id": info.session_id,
            "host": info.host,
            "kernel": info.kernel,
            "kvprof_version": info.kvprof_version,
            "start_wall_ns": info.start_wall_ns + (t0 - info.start_ns),
            "duration_s": total_s,
            "status": info.status,
            "devices": [d["name"] for d in info.devices],
            "lost_events": sum(lost.values()),
            "lost_by_reason": lost,
            "phase_sources": ["marks", *(s["source"] for s in info.sources)],
            "source_problems": {s["source"]: s["problems"] for s in info.sources
                                if s["problems"]},
        },
        "phases": phases,
    }


def _bounds(info: SessionInfo, t0: int, t1: int, filters: Filters) -> str:
    """WHERE clause picking the window's I/O by issue time, and the filter."""
    conds = [] if (t0 == info.start_ns and t1 == info.end_ns) else \
        [f"issue_ns >= {int(t0)} AND issue_ns < {int(t1)}"]
    if filters.sql():
        conds.append(f"({filters.sql()})")
    return ("WHERE " + " AND ".join(conds)) if conds else ""


def _stats_sql(con, bounds: str, ws, wp) -> list[tuple]:
    """Per (phase, layer, op): ios, bytes, quantiles of total/queue/device time, histograms."""
    # Window lookup table for the ASOF join. The first piece reaches back to the start of
    # time so an I/O issued between attaching and the session's first timestamp still lands.
    lookup_start = ws.copy()
    if len(lookup_start):
        lookup_start[0] = np.iinfo(np.int64).min
    con.register("_kv_windows", pa.table({"w_start": lookup_start, "w_phase": wp.astype(str)}))
    try:
        con.execute(f"""
            CREATE OR REPLACE TEMP VIEW _kv_io AS
            SELECT io.*, w.w_phase AS phase,
                   complete_ns - CASE WHEN insert_ns > 0 THEN insert_ns ELSE issue_ns END
                       AS total_ns,
                   CASE WHEN insert_ns > 0 THEN issue_ns - insert_ns ELSE 0 END AS queue_ns,
                   complete_ns - issue_ns AS device_ns
            FROM (SELECT * FROM io {bounds}) io
            ASOF JOIN _kv_windows w ON io.issue_ns >= w.w_start""")
        qs = "[" + ", ".join(str(q) for _, q in QUANTILES) + "]"
        # One pass over the joined rows: counts, exact quantiles and both log2 histograms.
        return con.execute(f"""
            SELECT phase, layer, op, count(*), sum(bytes)::UBIGINT,
                   quantile_cont(total_ns / 1e3, {qs}), quantile_cont(queue_ns / 1e3, {qs}),
                   quantile_cont(device_ns / 1e3, {qs}),
                   histogram(2 ** floor(log2(greatest(bytes, 1)))::UBIGINT),
                   histogram(2 ** floor(log2(greatest(total_ns / 1e3, 1)))::UBIGINT)
            FROM _kv_io GROUP BY ALL""").fetchall()
    finally:
        con.unregister("_kv_windows")


def _quantiles_us(ns: np.ndarray) -> list[float]:
    """quantile_cont of ns / 1e3: linear between the order statistics around (n-1)*q. The
    division is monotonic, so the order statistics are picked on the integers."""
    n = len(ns)
    pos = [(n - 1) * q for _, q in QUANTILES]
    kth = sorted({int(np.floor(r)) for r in pos} | {int(np.ceil(r)) for r in pos})
    part = np.partition(ns, kth)
    out = []
    for r in pos:
        lo, hi = int(np.floor(r)), int(np.ceil(r))
        a, b = part[lo] / 1e3, part[hi] / 1e3
        out.append(float(a + (r - lo) * (b - a)))
    return out


def _log2_bucket(values: np.ndarray) -> np.ndarray:
    """floor(log2(max(v, 1))), exactly: frexp's exponent has no rounding to go wrong."""
    return np.frexp(np.maximum(values, 1))[1].astype(np.int64) - 1


def _stats_of_rows(rows: Rows, ws, wp) -> list[tuple]:
    """What _stats_sql returns, from cached rows already in issue order."""
    if len(rows) == 0:
        return []
    phase_code = np.array([schema.PHASES.index(p) for p in wp], np.int16)[rows.pieces(ws)]
    nl, nops = len(schema.LAYERS), len(schema.OPS)
    key = (phase_code * nl + rows.layer) * nops + rows.op
    order = np.argsort(key, kind="stable")  # small ints: a radix sort
    key = key[order]
    first = np.flatnonzero(np.r_[True, key[1:] != key[:-1]])
    ends = np.r_[first[1:], len(key)]
    start, issue, complete = rows.start[order], rows.issue[order], rows.complete[order]
    total, queue, device = complete - start, issue - start, complete - issue
    nbytes = rows.bytes[order]
    # Both log2 histograms of every group in one bincount each: row -> (group, bucket).
    nb = 64
    size_h = np.bincount(key.astype(np.int64) * nb + _log2_bucket(nbytes),
                         minlength=(key[-1] + 1) * nb).reshape(-1, nb)
    lat_h = np.bincount(key.astype(np.int64) * nb + _log2_bucket(total / 1e3),
                        minlength=(key[-1] + 1) * nb).reshape(-1, nb)
    out = []
    for a, b in zip(first, ends):
        k = int(key[a])
        p, rest = divmod(k, nl * nops)
        layer, op = divmod(rest, nops)
        hists = [{2 ** int(u): int(h[k, u]) for u in np.flatnonzero(h[k])}
                 for h in (size_h, lat_h)]
        out.append((schema.PHASES[p], schema.LAYERS[layer], schema.OPS[op], int(b - a),
                    int(nbytes[a:b].sum()), _quantiles_us(total[a:b]),
                    _quantiles_us(queue[a:b]), _quantiles_us(device[a:b]), *hists))
    return out


def _block_spans_sql(con, bounds: str):
    """(start, end, device code, device names, in issue order?) of the window's block rows."""
    tbl = con.sql(f"""
        SELECT dev_name, CASE WHEN insert_ns > 0 THEN insert_ns ELSE issue_ns END AS s,
               complete_ns AS e
        FROM (SELECT * FROM io {bounds}) WHERE layer = 'block'""").to_arrow_table()
    # Device names as dictionary codes: comparing small ints, not a million Python strings.
    enc = tbl["dev_name"].combine_chunks().dictionary_encode()
    codes = enc.indices.to_numpy(zero_copy_only=False)
    return tbl["s"].to_numpy(), tbl["e"].to_numpy(), codes, enc.dictionary.to_pylist(), False


def _block_spans_of_rows(rows: Rows, dev_names: list[str]):
    block = rows.layer == schema.LAYERS.index(schema.LAYER_BLOCK)
    return rows.start[block], rows.complete[block], rows.dev[block], dev_names, True


def _idle(info: SessionInfo, phases: dict, ws, we, wp, s, e, codes, names,
          issue_ordered: bool) -> None:
    """Per phase, the share of its time with no block request in flight: per device and on
    all traced devices together. In flight = from insert (or issue, when the request skipped
    the queue) to completion, the span the kernel's io_ticks also covers."""
    code_of = {name: i for i, name in enumerate(names)}
    # Device codes are small ints (-1: none): which occur, by counting.
    present = np.flatnonzero(np.bincount(codes.astype(np.int64) + 1)) - 1
    devices = [d["name"] for d in info.devices] or sorted(names[c] for c in present if c >= 0)
    islands = busy_islands_ordered if issue_ordered else busy_islands

    def idle_pct(mask) -> dict[str, float | None]:
        isl_s, isl_e = islands(s[mask], e[mask])
        busy = busy_between(isl_s, isl_e, ws, we)
        out = {}
        for p in schema.PHASES:
            sel = wp == p
            t = float((we[sel] - ws[sel]).sum())
            out[p] = 100.0 * (1 - float(busy[sel].sum()) / t) if t > 0 else None
        return out

    overall = idle_pct(np.ones(len(s), bool))
    # One device holding every row (the usual case) has the overall figures.
    per_dev = {d: overall if len(present) == 1 and code_of.get(d) == present[0]
               else idle_pct(codes == code_of.get(d, -2)) for d in devices}
    for p in schema.PHASES:
        phases[p]["block"]["time_idle_pct"] = overall[p]
        phases[p]["block"]["devices"] = {d: {"time_idle_pct": per_dev[d][p]} for d in devices}
