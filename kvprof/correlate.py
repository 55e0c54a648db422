"""Per-phase storage numbers from a session store. Reads only; every view shows what this returns.

An I/O belongs to the window that contains its issue time; time covered by no window is
`idle`. Overlapping windows are flattened first: the more exact source wins, and among equals
the later-starting window. A phase's idle time is its time with no block request in flight,
also counting requests issued before the window began.

The rows come from SQL (the report, exports, any view of a recorded session), or from the live
dashboard's row cache and its rollup (kvprof/rollup.py) when those hold the window: two ways
to the same numbers, held equal by tests/test_live_cache.py.
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass

import duckdb
import numpy as np
import pyarrow as pa

from kvprof import rollup, schema
from kvprof.intervals import busy_between, busy_islands, busy_islands_ordered
from kvprof.iocache import IoCache
from kvprof.rollup import Rollup
from kvprof.store import SessionInfo, phase_windows, session_info

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


def _op_entry(bytes_: int, ios: int, time_s: float) -> dict:
    return {
        "bytes": int(bytes_),
        "ios": int(ios),
        "bandwidth_bytes_per_s": bytes_ / time_s if time_s > 0 else 0.0,
        "iops": ios / time_s if time_s > 0 else 0.0,
        "latency_us": {k: None for k, _ in schema.QUANTILES},
        "queue_us": {k: None for k, _ in schema.QUANTILES},
        "device_us": {k: None for k, _ in schema.QUANTILES},
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
              live: Rollup | None = None, info: SessionInfo | None = None,
              windows: pa.Table | None = None) -> dict:
    """The report as a dict; its shape is documented in the README and kept stable.

    With `live` (the live dashboard's row cache and its rollup) holding the window,
    the I/O rows come from it instead of SQL; the numbers are the same either way. `info`,
    `windows`: the session row and phase windows when the caller has just read them."""
    info = info or session_info(con)
    t0 = info.start_ns if t0 is None else t0
    t1 = info.end_ns if t1 is None else t1
    windows = phase_windows(con) if windows is None else windows
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

    if live is not None and live.cache.covers(t0):
        # The whole session also counts rows issued outside its bounds, as the SQL does.
        whole = t0 == info.start_ns and t1 == info.end_ns
        units = live.units(ws, we, wp, info.start_ns, filters.device, filters.tgid,
                            unbounded=whole)
        stats = rollup.stats(units)
        islands_of, present = _islands_cached(live.cache, filters, units)
    else:
        stats = _stats_sql(con, _bounds(info, t0, t1, filters), ws, wp)
        islands_of, present = _islands_sql(con, info, t0, t1, filters)
    for p, layer, op, ios, nbytes, lat, queue, dev, sizes, lats in stats:
        entry = phases[p][layer].setdefault(op, _op_entry(0, 0, phases[p]["time_s"]))
        entry.update(_op_entry(nbytes or 0, ios, phases[p]["time_s"]))
        for key, vals in (("latency_us", lat), ("queue_us", queue), ("device_us", dev)):
            entry[key] = {k: float(v) for (k, _), v in zip(schema.QUANTILES, vals)}
        for key, hist in (("size_hist", sizes), ("latency_hist_us", lats)):
            entry[key] = {str(int(b)): int(n) for b, n in sorted(dict(hist).items())}

    _idle(phases, ws, we, wp, [d["name"] for d in info.devices] or present, islands_of)
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
        qs = "[" + ", ".join(str(q) for _, q in schema.QUANTILES) + "]"
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


def _islands_sql(con, info: SessionInfo, t0: int, t1: int, filters: Filters):
    """Busy islands from the block requests in flight at any time in [t0, t1), also those
    issued before t0, and the devices the window's block requests went to."""
    conds = ["layer = 'block'", "complete_ns > " + str(int(t0)),
             f"CASE WHEN insert_ns > 0 THEN insert_ns ELSE issue_ns END < {int(t1)}"]
    if filters.sql():
        conds.append(f"({filters.sql()})")
    tbl = con.sql(f"""
        SELECT dev_name, CASE WHEN insert_ns > 0 THEN insert_ns ELSE issue_ns END AS s,
               complete_ns AS e, issue_ns >= {int(t0)} AND issue_ns < {int(t1)} AS inside
        FROM io WHERE {" AND ".join(conds)}""").to_arrow_table()
    # Device names as dictionary codes: comparing small ints, not a million Python strings.
    enc = tbl["dev_name"].combine_chunks().dictionary_encode()
    codes = enc.indices.to_numpy(zero_copy_only=False)
    names = enc.dictionary.to_pylist()
    s, e = tbl["s"].to_numpy(), tbl["e"].to_numpy()
    inside = tbl["inside"].to_numpy(zero_copy_only=False)
    whole = t0 == info.start_ns and t1 == info.end_ns
    present = sorted({names[c] for c in np.unique(codes[inside | whole])})

    def islands_of(device: str | None):
        if device is None:
            return busy_islands(s, e)
        mine = codes == (names.index(device) if device in names else -1)
        return busy_islands(s[mine], e[mine])
    return islands_of, present


def _islands_cached(cache: IoCache, filters: Filters, units: list):
    """The same from the cache: its maintained islands, or for a process filter the
    process's block rows (the cache holds every row that can reach into the window)."""
    present = rollup.devices(units, cache)
    if filters.tgid is None:
        def islands_of(device: str | None):
            if device is None or filters.device is None or device == filters.device:
                return cache.islands(device if device is not None else filters.device)
            return np.empty(0, np.int64), np.empty(0, np.int64)
        return islands_of, present
    rows = cache.slice(0, len(cache), filters.device, filters.tgid)
    block = rows.layer == rollup.BLOCK

    def islands_of(device: str | None):
        mine = block if device is None else block & (rows.dev == cache.device_code(device))
        return busy_islands_ordered(rows.start[mine], rows.complete[mine])
    return islands_of, present


def _idle(phases: dict, ws, we, wp, devices: list[str], islands_of) -> None:
    """Per phase, the share of its time with no block request in flight: per device and on
    all traced devices together. In flight = from insert (or issue, when the request skipped
    the queue) to completion, the span the kernel's io_ticks also covers."""
    def idle_pct(device: str | None) -> dict[str, float | None]:
        isl_s, isl_e = islands_of(device)
        busy = busy_between(isl_s, isl_e, ws, we)
        out = {}
        for p in schema.PHASES:
            sel = wp == p
            t = float((we[sel] - ws[sel]).sum())
            out[p] = 100.0 * (1 - float(busy[sel].sum()) / t) if t > 0 else None
        return out

    overall = idle_pct(None)
    per_dev = {d: idle_pct(d) for d in devices}
    for p in schema.PHASES:
        phases[p]["block"]["time_idle_pct"] = overall[p]
        phases[p]["block"]["devices"] = {d: {"time_idle_pct": per_dev[d][p]} for d in devices}
