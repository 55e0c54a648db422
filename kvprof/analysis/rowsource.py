"""Where correlate's I/O rows come from: the session store (SQL) or the live row cache.

Correlate asks either the same few questions (`RowSource`) over phase pieces (`fold.flatten`'s
disjoint spans), a time range and a view filter. `SqlRows` answers with DuckDB queries over the
store (the report, exports, any recorded session); `LiveRows` from the dashboard's row cache
and per-second rollup (iocache.py, rollup.py) where they hold the span, else through its
`SqlRows`. tests/unit/test_live_cache.py holds both to the same numbers."""
from __future__ import annotations

import functools
import json
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_for
from dataclasses import dataclass
from typing import Any, NamedTuple

import duckdb
import numpy as np
import pyarrow as pa

from kvprof import schema
from kvprof.analysis import rollup
from kvprof.analysis.fold import phase_codes
from kvprof.analysis.intervals import busy_islands, busy_islands_ordered
from kvprof.analysis.iocache import IoCache
from kvprof.analysis.rollup import GRID_NS, Rollup
from kvprof.store.session import (
    Reader,
    SessionInfo,
    missing_columns,
    phase_windows,
    session_info,
    weighted_bytes,
)

NS = 1_000_000_000
# A view switched while its SQL still runs: the feed catches this and builds the new view.
Interrupted = duckdb.InterruptException

Islands = tuple[np.ndarray, np.ndarray]
IslandsOf = Callable[[str | None], Islands]
# phase -> the summed device time (issue to completion, ns) of the block requests issued in
# it, of one device or of all (None)
DeviceTimeOf = Callable[[str | None], dict[str, int]]


@dataclass(frozen=True)
class ViewFilter:
    """Which I/O a view counts: one device, one process (tgid), or all."""
    device: str | None = None
    tgid: int | None = None

    def label(self) -> str:
        parts = [f"dev {self.device}" if self.device else "", f"pid {self.tgid}" if self.tgid
                 is not None else ""]
        return ", ".join(p for p in parts if p) or "all I/O"


@dataclass(frozen=True)
class Pieces:
    """Disjoint phase pieces in time order; `t0` cuts them: the view is [t0, end of the last
    piece), and pieces before t0 feed only `over_time`'s timeline (reaching further back)
    and a whole view's rows issued before t0. `whole`: the view is the whole session, which
    also counts rows issued outside its bounds (between attaching and the first timestamp,
    or completing after the end): its pieces are fold.flatten_whole's."""
    start: np.ndarray
    end: np.ndarray
    phase: np.ndarray
    t0: int
    t1: int
    origin: int  # the session's start: grid seconds count from it
    whole: bool = False


# The answers' rows, named: SQL and the row cache return them positionally, and correlate
# reads them by name.
class StatRow(NamedTuple):
    """One (phase, layer, op) of `per_phase`."""
    phase: str
    layer: str
    op: str
    ios: int
    bytes: int | None  # None: no sized request (only flushes)
    latency_us: list[float]  # schema.QUANTILES of total, queue and device time
    queue_us: list[float]
    device_us: list[float]
    size_hist: dict | None  # log2 bucket low bound -> requests
    latency_hist: dict | None


class CacheRow(NamedTuple):
    """One (phase, cache, op, O_DIRECT) of `per_cache`."""
    phase: str
    cache: str
    op: str
    direct: bool
    ios: int
    bytes: int
    device_bytes: int  # what the calls had the device read (0 for writes)
    busy_ns: int  # of the (phase, cache, op)'s time in flight, the part these calls added


class WritebackRow(NamedTuple):
    """One (phase, cache) of `writeback`; phase and cache None for writeback no traced
    write explains."""
    phase: str | None
    cache: str | None
    ios: int
    bytes: int
    elsewhere_bytes: int | None


class AggRow(NamedTuple):
    """One aggregate-tier second of one (phase, layer, op, device) of `aggregate`."""
    phase: str
    layer: str
    op: str
    ios: int
    bytes: int
    queue_ns: int
    service_ns: int
    size_hist: list[int]  # log2 slots (schema.IO_AGG)
    queue_hist: list[int]
    service_hist: list[int]
    cut: bool | None  # its issue slot cut by a window edge; None before schema 15
    device: str


class BusyRow(NamedTuple):
    phase: str
    device: str
    busy_ns: int


class GpuMeans(NamedTuple):
    """`gpu`: means over the samples of a range."""
    gpus: int
    samples: int
    util_pct: float | None
    mem_util_pct: float | None
    sm_active_pct: float | None
    power_w: float | None
    pcie_rx_bytes_per_s: float | None
    pcie_tx_bytes_per_s: float | None
    session_samples: int  # of the whole session


def named(row_type: Any, rows: list[tuple]) -> list:
    return [row_type._make(r) for r in rows]


@dataclass(frozen=True)
class PerPhase:
    stats: list[StatRow]
    islands_of: IslandsOf  # busy islands of all traced devices (None) or of one
    devices: list[str]     # devices the view's block rows went to
    # Beside the islands, what requests in flight while they last add up to (Little's law:
    # the mean number in flight while busy is this over the busy time).
    device_time_of: DeviceTimeOf


@dataclass(frozen=True)
class OverTime:
    cell_bytes: dict[tuple[str, str, str], np.ndarray]  # bytes per grid second from t0's
    layers_seen: np.ndarray  # (layer,) bool: rows of that layer in the timeline's span
    bin_bytes: np.ndarray    # (device layer, bin) bytes issued in each timeline bin
    recent: int              # rows issued in the last second before t1
    devices: list[str]       # every device of the window's rows, whatever the filter
    processes: tuple[tuple[int, str], ...]  # the window's busiest (tgid, comm), whatever the filter


class RowSource:
    """What correlate asks of the rows, answered alike by `SqlRows` and `LiveRows`: the session
    row and phase windows, figures per phase and over time, GPU means, and the rest below."""

    def info(self) -> SessionInfo:
        raise NotImplementedError

    def windows(self, t0: int | None = None, t1: int | None = None) -> pa.Table:
        raise NotImplementedError

    def per_phase(self, pieces: Pieces, view: ViewFilter) -> PerPhase:
        """Per (phase, layer, op): counts, bytes, exact quantiles of total, queue and device
        time, log2 histograms of size and latency; the busy islands idle time is read from and
        the block requests' summed device time per phase (with the islands, the mean number in
        flight while busy); the devices the rows went to."""
        raise NotImplementedError

    def weighted_quantiles(self, pieces: Pieces, view: ViewFilter
                           ) -> dict[tuple[str, str, str], tuple[list[float | None], ...]]:
        """Per (phase, device layer, op), total, queue and device time quantiles in µs with
        each row weighed by its sample_weight: for spans the event tier sampled at more than
        one rate. Estimates from 1/WEIGHTED_STEPS-octave buckets (within 2.2 %)."""
        raise NotImplementedError

    def per_cache(self, pieces: Pieces, view: ViewFilter) -> list[CacheRow]:
        """Syscall reads and writes per (phase, cache, op, O_DIRECT): calls, bytes done, and
        the bytes of the block reads the calling thread issued while in the call (what the
        page cache did not hold; readahead included)."""
        raise NotImplementedError

    def bins(self, pieces: Pieces, bin_ns: int, nbins: int) -> list[tuple]:
        """The device layers' requests per (bin, phase, layer, op): requests and bytes (each
        row weighed by its sample_weight), by issue time in bins of `bin_ns` from pieces.t0,
        rows before the first bin or after the last counted in it (as the whole-session
        report counts them)."""
        raise NotImplementedError

    def gpu_bins(self, t0: int, bin_ns: int, nbins: int) -> list[tuple]:
        """Per bin: mean GPU and SM utilisation over the samples in it (all GPUs)."""
        raise NotImplementedError

    def gds_calls(self, pieces: Pieces, view: ViewFilter) -> list[tuple]:
        """cuFile calls per (phase, probe): DMA (cufio_gds_*) or compat POSIX (cufio_px_*)."""
        raise NotImplementedError

    def writeback(self, pieces: Pieces, view: ViewFilter) -> list[WritebackRow]:
        """The bios flush threads wrote back (the writeback table), each with the phase and
        cache of the last buffered syscall write to its inode before it: per (phase, cache)
        bios, bytes and the bytes issued while another phase ran; phase and cache are None
        for writeback no traced write explains."""
        raise NotImplementedError

    def over_time(self, pieces: Pieces, view: ViewFilter, c0: int, ncells: int,
                  edges: np.ndarray) -> OverTime:
        """Bytes per (phase, layer, op) and grid second and per layer and timeline bin, I/O of
        the last second, the window's devices and busiest processes. `c0`, `ncells`: the grid
        seconds from the one holding t0; `edges`: the timeline's bin edges (the first may lie
        before the session and before the pieces)."""
        raise NotImplementedError

    def gpu(self, t0: int, t1: int) -> GpuMeans | None:
        """(GPUs, samples, mean util, mem util, SM active, power, PCIe rx, tx, samples of the
        whole session) over samples in [t0, t1); None when the session has no gpu table."""
        raise NotImplementedError

    def processes(self) -> list[dict]:
        """The session's processes: tgid, comm, role (kvprof/roles.py) and command line."""
        raise NotImplementedError

    def aggregate(self, t0: int, t1: int, whole: bool, device: str | None
                  ) -> tuple[list[AggRow], list[BusyRow]] | None:
        """The aggregate tier's seconds in [t0, t1) (all of them for the whole session):
        (phase, layer, op, ios, bytes, queue ns, service ns, size, queue and service log2
        histograms, cut, device) and per device (phase, device, busy ns); None for a session
        recorded without it."""
        raise NotImplementedError

    def engine_counters(self, t0: int, t1: int) -> list[tuple[str, str, float]]:
        """Per engine counter series of schema.ENGINE_SERIES: (name, labels, how far it moved
        in [t0, t1)), from its last value before t0 (else its first in the span) to its last
        in the span. A series that went back (an engine restart) is left out."""
        raise NotImplementedError

    def engine_last(self, names: list[str], t1: int) -> list[tuple[str, str, str, float]]:
        """Per engine and series of `names`, its row last stored before t1: (engine, name,
        labels as JSON, value)."""
        raise NotImplementedError

    def counter_steps(self, names: list[str], t0: int, t1: int
                      ) -> list[tuple[int, int, float]]:
        """(the series' previous row's ts, ts, how far it moved since) for each row in
        [t0, t1) of the counter series `names`, per label set; a series that went back is
        left out."""
        raise NotImplementedError

    def phase_tokens(self, t0: int, t1: int) -> list[tuple[str, str, float, float]]:
        """Per phase and source, the prefill and decode tokens of the windows in [t0, t1),
        each window's counts prorated by the share of it inside."""
        raise NotImplementedError

    def window_sources(self, t0: int, t1: int) -> list[tuple[str, str, int]]:
        """Who made the phase windows in [t0, t1), as stored: (source, engine, windows)."""
        raise NotImplementedError

    def sampling(self, t0: int, t1: int) -> list[int]:
        """The event tier's sampling shifts in effect during [t0, t1) (schema.EVENT_SAMPLING),
        in order; empty for a session without device-layer events or recorded before it."""
        raise NotImplementedError

    def refresh(self) -> None:
        """Take in rows stored since the last call (a live cache); nothing for SQL."""

    def interrupt(self) -> None:
        """Stop a query running in another thread: it raises `Interrupted` there."""

    def close(self) -> None:
        """Let go of the cursor."""


# -- SQL over the store ------------------------------------------------------------------------

def _where(view: ViewFilter, prefix: str = "") -> tuple[str, list]:
    """Conditions (joined by AND, or empty) and their parameters for the view's filter."""
    conds: list[str] = []
    params: list = []
    if view.device is not None:
        conds.append(f"{prefix}dev_name = ?")
        params.append(view.device)
    if view.tgid is not None:
        conds.append(f"{prefix}tgid = ?")
        params.append(int(view.tgid))
    return " AND ".join(conds), params


def _in_view(pieces: Pieces, view: ViewFilter, time_column: str = "issue_ns"
             ) -> tuple[str, list]:
    """`_where` plus the view's time bounds, which the whole session does without."""
    cond, params = _where(view)
    if pieces.whole:
        return cond, params
    return (_and(f"{time_column} >= ? AND {time_column} < ?", cond),
            [int(pieces.t0), int(pieces.t1), *params])


# When a block request began to be in flight: its insert into a scheduler queue, or its issue
# when it skipped the queue.
_BEGIN = "CASE WHEN insert_ns > 0 THEN insert_ns ELSE issue_ns END"


# A row's latency in its parts (ns): from insert (or issue when it skipped the scheduler
# queue) to completion, insert to issue, issue to completion.
_TIMES = f"""complete_ns - {_BEGIN} AS total_ns,
            CASE WHEN insert_ns > 0 THEN issue_ns - insert_ns ELSE 0 END AS queue_ns,
            complete_ns - issue_ns AS device_ns"""
WEIGHTED_STEPS = 16  # buckets per octave for weighted quantiles


def _weighted_q(hist: dict[int, int]) -> list[float | None]:
    """schema.QUANTILES of a weighted histogram of bucket -> weight (bucket b holds
    [2^(b/STEPS), 2^((b+1)/STEPS)) ns, -1 holds 0), as the bucket's geometric middle in µs."""
    keys = sorted(hist)
    cum = np.cumsum([hist[k] for k in keys])
    total = cum[-1] if len(cum) else 0
    out: list[float | None] = []
    for _, q in schema.QUANTILES:
        if not total:
            out.append(None)
            continue
        b = keys[int(np.searchsorted(cum, q * total))]
        out.append(0.0 if b < 0 else 2 ** ((b + 0.5) / WEIGHTED_STEPS) / 1e3)
    return out


_SIZELESS = 255  # per_phase's size "power of two" of a request without data


def _split_hist(joint: dict | None) -> tuple[dict[int, int], dict[int, int]]:
    """per_phase's histogram by (size power of two, latency power of two) as StatRow's two,
    each by the bucket's low bound."""
    size: dict[int, int] = {}
    latency: dict[int, int] = {}
    for key, n in (joint or {}).items():
        s, lat = divmod(int(key), 256)
        if s != _SIZELESS:
            size[2 ** s] = size.get(2 ** s, 0) + int(n)
        latency[2 ** lat] = latency.get(2 ** lat, 0) + int(n)
    return size, latency


def _and(*conds: str) -> str:
    return " AND ".join(c for c in conds if c)


def _lookup(pieces: Pieces) -> pa.Table:
    """Window lookup table for the ASOF join. The first piece reaches back to the start of
    time so an I/O issued between attaching and the session's first timestamp still lands."""
    start = pieces.start.copy()
    if len(start):
        start[0] = np.iinfo(np.int64).min
    # The phase also as its index in schema.PHASES, for queries that group millions of rows
    # by it (an integer key groups faster than a string; _PHASE_OF maps it back).
    return pa.table({"w_start": start, "w_end": pieces.end, "w_phase": pieces.phase.astype(str),
                     "w_code": phase_codes(pieces.phase)})


class Buckets(NamedTuple):
    """_lookup's pieces by time buckets of one width, for a hash join in place of the ASOF
    join: a row finds its bucket by division (`k_b`: (issue_ns - base) // width, clamped to
    [0, last]), where the ASOF join sorts every row by time (0.97 s of the report's 2.3 at
    10 M rows, benchmarks/report_scale.py). A bucket holds the phase code at its start
    (`k_lo`) and, where a piece begins inside it, that start (`k_cut`) and the code from there
    (`k_hi`); where more than one begins (`k_multi`), its rows take the ASOF join after all."""
    table: pa.Table
    width: int
    base: int  # the first bucket's start
    last: int  # the last bucket's number


def _buckets(pieces: Pieces) -> Buckets | None:
    """About two buckets a piece, over the span of the pieces' starts and one bucket either
    side (rows beyond are clamped into those, wholly in the first or last piece). None with
    a single piece."""
    start = pieces.start.astype(np.int64)
    codes = phase_codes(pieces.phase).astype(np.int64)
    cuts = start[1:]  # (the first piece reaches back to the start of time: _lookup)
    if not len(cuts):
        return None
    width = max(1, int(cuts[-1] - cuts[0]) // (2 * len(cuts)))
    lo, hi = int(cuts[0] // width) - 1, int(cuts[-1] // width) + 1
    begin = np.arange(lo, hi + 1, dtype=np.int64) * width
    # The piece holding each bucket's start, and the pieces beginning inside the bucket.
    at = np.clip(np.searchsorted(start, begin, side="right") - 1, 0, len(start) - 1)
    first = np.searchsorted(cuts, begin, side="right")
    inside = np.searchsorted(cuts, begin + width, side="left") - first
    first = np.minimum(first, len(cuts) - 1)
    return Buckets(pa.table({
        "k_b": np.arange(hi - lo + 1, dtype=np.int64),
        "k_lo": codes[at],
        "k_cut": np.where(inside > 0, cuts[first], np.iinfo(np.int64).max),
        "k_hi": np.where(inside > 0, codes[first + 1], codes[at]),
        "k_multi": inside > 1}), width, lo * width, hi - lo)


# A phase code (_lookup's w_code) to its name, in SQL.
_PHASE_OF = "[" + ", ".join(f"'{p}'" for p in schema.PHASES) + "]"


class SqlRows(RowSource):
    """DuckDB queries over one session's tables, through one cursor (one thread; a second
    cursor fetches the busy islands beside per_phase's query)."""

    def __init__(self, cur: duckdb.DuckDBPyConnection):
        self.cur = cur
        # A second cursor and one thread for it, made when first needed: work beside the
        # main cursor's query, one piece at a time (a cursor runs one query at a time).
        self._side_cur: duckdb.DuckDBPyConnection | None = None
        self._side_pool: ThreadPoolExecutor | None = None

    def info(self) -> SessionInfo:
        return session_info(self.cur)

    def windows(self, t0: int | None = None, t1: int | None = None) -> pa.Table:
        return phase_windows(self.cur, t0, t1)

    def processes(self) -> list[dict]:
        try:
            return self.cur.sql("SELECT tgid, comm, role, cmdline FROM process ORDER BY tgid"
                                ).to_arrow_table().to_pylist()
        except duckdb.CatalogException:
            return []  # recorded before process roles

    def aggregate(self, t0: int, t1: int, whole: bool, device: str | None
                  ) -> tuple[list[AggRow], list[BusyRow]] | None:
        conds: list[str] = []
        params: list = []
        if not whole:
            # Whole seconds: a second belongs to the range its start lies in.
            conds.append("ts_ns >= ? AND ts_ns < ?")
            params += [int(t0), int(t1)]
        if device is not None:
            conds.append("dev_name = ?")
            params.append(device)
        where = ("WHERE " + " AND ".join(conds)) if conds else ""
        # The settled seconds and those still counting at the last flush (a live or killed
        # recording's; sessions before schema 14 have only the first).
        # Sessions before schema 15 have no boundary column: their phase came from marks.
        for agg_t, busy_t, edge in (("(FROM io_agg UNION ALL FROM io_agg_open)",
                                     "(FROM device_busy UNION ALL FROM device_busy_open)",
                                     "boundary"),
                                    ("(FROM io_agg UNION ALL FROM io_agg_open)",
                                     "(FROM device_busy UNION ALL FROM device_busy_open)",
                                     "NULL"),
                                    ("io_agg", "device_busy", "NULL")):
            try:
                agg = self.cur.execute(f"""
                    SELECT phase, layer, op, ios, bytes, queue_ns, service_ns, size_hist,
                           queue_hist, service_hist, {edge}, dev_name FROM {agg_t} {where}""",
                                       params).fetchall()
                busy = self.cur.execute(f"""
                    SELECT phase, dev_name, sum(busy_ns)::UBIGINT FROM {busy_t} {where}
                    GROUP BY ALL ORDER BY ALL""", params).fetchall()
            except (duckdb.CatalogException, duckdb.BinderException):
                continue
            return named(AggRow, agg), named(BusyRow, busy)
        return None  # recorded before the aggregate tier

    def engine_counters(self, t0: int, t1: int) -> list[tuple[str, str, float]]:
        names = sorted(schema.ENGINE_SERIES)
        try:
            rows = self.cur.execute(f"""
                SELECT name, labels,
                       coalesce(arg_max(value, ts_ns) FILTER (WHERE ts_ns < ?),
                                arg_min(value, ts_ns) FILTER (WHERE ts_ns >= ?)) AS base,
                       arg_max(value, ts_ns) AS last,
                       bool_or(ts_ns >= ? AND value < prev) AS went_back
                FROM (SELECT *, lag(value) OVER (PARTITION BY name, labels ORDER BY ts_ns)
                                AS prev
                      FROM engine_metric
                      WHERE name IN ({", ".join("?" for _ in names)}) AND ts_ns < ?)
                GROUP BY name, labels""", [int(t0), int(t0), int(t0), *names, int(t1)]
                                    ).fetchall()
        except duckdb.CatalogException:
            return []
        return [(n, labels, float(last - base)) for n, labels, base, last, back in rows
                if not back and base is not None]

    def counter_steps(self, names: list[str], t0: int, t1: int
                      ) -> list[tuple[int, int, float]]:
        if not names:
            return []
        try:
            return [(int(a), int(b), float(d)) for a, b, d in self.cur.execute(f"""
                SELECT prev_ts, ts_ns, value - prev FROM (
                    SELECT ts_ns, value,
                           lag(value) OVER (PARTITION BY name, labels ORDER BY ts_ns) AS prev,
                           lag(ts_ns) OVER (PARTITION BY name, labels ORDER BY ts_ns)
                               AS prev_ts
                    FROM engine_metric WHERE name IN ({", ".join("?" for _ in names)})
                      AND ts_ns < ?)
                WHERE ts_ns >= ? AND value > prev ORDER BY ts_ns""",
                [*names, int(t1), int(t0)]).fetchall()]
        except duckdb.CatalogException:
            return []

    def engine_last(self, names: list[str], t1: int) -> list[tuple[str, str, str, float]]:
        try:
            return [(e, n, labels, float(v)) for e, n, labels, v in self.cur.execute(
                "SELECT engine, name, arg_max(labels, ts_ns), arg_max(value, ts_ns) "
                "FROM engine_metric WHERE list_contains(?, name) AND ts_ns < ? "
                "GROUP BY ALL ORDER BY ALL", [list(names), int(t1)]).fetchall()]
        except duckdb.CatalogException:
            return []

    def window_sources(self, t0: int, t1: int) -> list[tuple[str, str, int]]:
        return [(src, engine or "", int(n)) for src, engine, n in self.cur.execute(
            "SELECT source, engine, count(*) FROM phase WHERE end_ns > ? AND start_ns < ? "
            "GROUP BY ALL ORDER BY 3 DESC, 1, 2", [int(t0), int(t1)]).fetchall()]

    def phase_tokens(self, t0: int, t1: int) -> list[tuple[str, str, float, float]]:
        part = "(least(end_ns, ?) - greatest(start_ns, ?))::DOUBLE / (end_ns - start_ns)"
        query = f"""
            SELECT phase, source, sum(coalesce(prefill_tokens, 0) * {part}),
                   sum(coalesce(decode_tokens, 0) * {part})
            FROM {{}} WHERE end_ns > ? AND start_ns < ? AND end_ns > start_ns
            GROUP BY phase, source"""
        params = [int(t1), int(t0)] * 2 + [int(t0), int(t1)]
        try:
            return self.cur.execute(
                f"SELECT phase, source, sum(p), sum(d) FROM ({query.format('phase')} UNION ALL "
                f"{query.format('phase_open')}) t(phase, source, p, d) GROUP BY ALL",
                params * 2).fetchall()
        except duckdb.CatalogException:
            return self.cur.execute(query.format("phase"), params).fetchall()

    def sampling(self, t0: int, t1: int) -> list[int]:
        try:
            rows = self.cur.execute("""
                SELECT shift FROM event_sampling
                WHERE ts_ns >= coalesce((SELECT max(ts_ns) FROM event_sampling
                                         WHERE ts_ns <= ?), -9223372036854775807)
                  AND ts_ns < ?
                ORDER BY ts_ns""", [int(t0), int(t1)]).fetchall()
        except duckdb.CatalogException:
            return []  # recorded before sampling
        return [int(r[0]) for r in rows]

    def row_count(self) -> int:
        return self.cur.execute("SELECT count(*) FROM io").fetchall()[0][0]

    def interrupt(self) -> None:
        self.cur.interrupt()
        if self._side_cur is not None:
            self._side_cur.interrupt()

    def close(self) -> None:
        if self._side_pool is not None:
            self._side_pool.shutdown()
        if self._side_cur is not None:
            self._side_cur.close()
        self.cur.close()

    def _joined(self, pieces: Pieces, sql: str, params: list,
                buckets: Buckets | None = None) -> list[tuple]:
        """Run `sql`, which reads `_kv_windows` for the pieces' lookup table (and
        `_kv_buckets` for `buckets`' table)."""
        self.cur.register("_kv_windows", _lookup(pieces))
        if buckets is not None:
            self.cur.register("_kv_buckets", buckets.table)
        try:
            return self.cur.execute(sql, params).fetchall()
        finally:
            self.cur.unregister("_kv_windows")
            if buckets is not None:
                self.cur.unregister("_kv_buckets")

    def per_phase(self, pieces: Pieces, view: ViewFilter) -> PerPhase:
        cond, params = _in_view(pieces, view)
        # The busy islands of all the view's block requests (time idle %, always asked for)
        # are fetched and sorted on a second cursor while the query below runs, which would
        # otherwise leave part of a CPU idle.
        side, pool = self._side()
        every = pool.submit(self._fetch_islands, side, pieces.t0, pieces.t1, view, None)
        try:
            stats = self._stats(pieces, cond, params)
            if any(0 < queued < ios for _, layer, _, ios, _, _, _, _, queued, _, _ in stats
                   if layer == "block"):
                stats = self._stats(pieces, cond, params, every_block_row=True)
        except BaseException:
            side.interrupt()  # (not left behind to work for no one)
            wait_for([every])
            raise
        rows = []
        block_ns: dict[str, int] = {}  # phase -> the block requests' summed device time
        for phase, layer, op, ios, nbytes, total_ns, queue_ns, device_ns, queued, joint, \
                summed in stats:
            if layer == "block":
                block_ns[phase] = block_ns.get(phase, 0) + int(summed or 0)
            total = [v / 1e3 for v in total_ns]
            if layer == "block" and queued:
                queue, device = [v / 1e3 for v in queue_ns], [v / 1e3 for v in device_ns]
            else:
                queue, device = [0.0] * len(total), total
            rows.append(StatRow(phase, layer, op, ios, nbytes, total, queue, device,
                                *_split_hist(joint)))
        islands_of, present, names = self._islands(pieces.t0, pieces.t1, view, pieces.whole,
                                                   any(r.layer == "block" for r in rows),
                                                   every)

        @functools.cache
        def by_device() -> dict[str, dict[str, int]]:
            # (asked only where the view's block requests went to several devices)
            out: dict[str, dict[str, int]] = {}
            for phase, dev, summed in self._joined(pieces, f"""
                    SELECT w.w_phase, io.dev_name, sum(greatest(io.complete_ns - io.b, 0)
                                                       )::BIGINT
                    FROM (SELECT issue_ns, complete_ns, dev_name, {_BEGIN} AS b FROM io
                          WHERE {_and("layer = 'block'", cond)}) io
                    ASOF JOIN _kv_windows w ON io.issue_ns >= w.w_start
                    GROUP BY ALL""", params):
                out.setdefault(dev, {})[phase] = int(summed or 0)
            return out

        def device_time_of(device: str | None) -> dict[str, int]:
            if device is None or names == [device]:
                return block_ns
            return by_device().get(device, {})
        return PerPhase(rows, islands_of, present, device_time_of)

    def _stats(self, pieces: Pieces, cond: str, params: list,
               every_block_row: bool = False) -> list[tuple]:
        """per_phase's one pass over the joined rows: counts, exact quantiles and both log2
        histograms. Queue and device time quantiles are selected among the block requests
        that waited in a scheduler queue: where none did (no scheduler, as on NVMe and loop
        devices) queue time is 0 and device time the total, where all did they are all the
        requests; a group with both takes a second pass over every block row
        (`every_block_row`)."""
        qs = "[" + ", ".join(str(q) for _, q in schema.QUANTILES) + "]"
        queued = "layer = 'block'" + ("" if every_block_row else " AND insert_ns > 0")
        rows = f"SELECT * FROM io {'WHERE ' + cond if cond else ''}"
        k = _buckets(pieces)
        if k is None:
            coded = f"""SELECT io.*, w.w_code AS code FROM ({rows}) io
                        ASOF JOIN _kv_windows w ON io.issue_ns >= w.w_start"""
        else:
            # Each row's phase by its time bucket (Buckets); a bucket where more than one
            # piece begins sends its rows to the ASOF join.
            coded = f"""
                WITH r AS (
                    SELECT io.*, k.* FROM ({rows}) io JOIN _kv_buckets k
                      ON io.issue_ns IS NOT NULL AND k.k_b =
                         least(greatest(io.issue_ns - {k.base}, 0) // {k.width}, {k.last}))
                SELECT r.* EXCLUDE (k_b, k_lo, k_cut, k_hi, k_multi),
                       CASE WHEN r.issue_ns >= r.k_cut THEN r.k_hi ELSE r.k_lo END AS code
                FROM r WHERE NOT r.k_multi
                UNION ALL BY NAME
                SELECT r.* EXCLUDE (k_b, k_lo, k_cut, k_hi, k_multi), w.w_code AS code
                FROM (SELECT * FROM r WHERE r.k_multi) r
                ASOF JOIN _kv_windows w ON r.issue_ns >= w.w_start"""
        return self._joined(pieces, f"""
            WITH io AS (SELECT *, {_TIMES} FROM ({coded}))
            SELECT {_PHASE_OF}[code + 1], * EXCLUDE (code) FROM (
                SELECT code, layer, op, count(*), sum(bytes)::UBIGINT,
                       -- Of the integer ns, made µs below: selecting among integers is
                       -- cheaper than among doubles made per row (0.2 s of 2.1 at 10 M rows).
                       quantile_cont(total_ns, {qs}),
                       -- Only the block layer has a queue (no other probe sets insert_ns),
                       -- and only where a scheduler queued (above): elsewhere queue time
                       -- is 0 and device time the total, set by per_phase rather than
                       -- sorted for.
                       quantile_cont(queue_ns, {qs}) FILTER (WHERE {queued}),
                       quantile_cont(device_ns, {qs}) FILTER (WHERE {queued}),
                       count(*) FILTER (WHERE {queued}),
                       -- Both log2 histograms in one, by (size's power of two, latency's):
                       -- split below. The size's is of requests that carry data (SIZELESS:
                       -- a flush has none, and the exact tier's slot 0 is left out too).
                       histogram(((CASE WHEN bytes > 0 THEN floor(log2(bytes))
                                   ELSE {_SIZELESS} END) * 256
                                  + floor(log2(greatest(total_ns / 1e3, 1))))::USMALLINT),
                       -- What the requests' time in flight adds up to, from their insert
                       -- (or issue) as the busy islands count it (block: the mean number
                       -- in flight while busy).
                       sum(greatest(total_ns, 0))::BIGINT
                FROM io GROUP BY code, layer, op)""", params, k)

    def weighted_quantiles(self, pieces: Pieces, view: ViewFilter
                           ) -> dict[tuple[str, str, str], tuple[list[float | None], ...]]:
        if "sample_weight" in missing_columns(self.cur, "io"):
            return {}
        cond, params = _in_view(pieces, view)
        step = WEIGHTED_STEPS
        buckets = ", ".join(
            f"CASE WHEN {c} > 0 THEN floor(log2({c}) * {step})::INTEGER ELSE -1 END"
            for c in ("total_ns", "queue_ns", "device_ns"))
        rows = self._joined(pieces, f"""
            WITH io AS (
                SELECT io.layer, io.op, coalesce(io.sample_weight, 1) AS w,
                       w.w_phase AS phase,
                       {_TIMES}
                FROM (SELECT * FROM io WHERE {_and("layer IN ('block', 'io_uring')", cond)}) io
                ASOF JOIN _kv_windows w ON io.issue_ns >= w.w_start)
            SELECT phase, layer, op, {buckets}, sum(w)::UBIGINT FROM io GROUP BY ALL""",
                            params)
        acc: dict[tuple[str, str, str], list[dict[int, int]]] = {}
        for phase, layer, op, bt, bq, bd, w in rows:
            hists = acc.setdefault((phase, layer, op), [{}, {}, {}])
            for h, b in zip(hists, (bt, bq, bd)):
                h[b] = h.get(b, 0) + int(w)
        return {k: (_weighted_q(t), _weighted_q(q), _weighted_q(d))
                for k, (t, q, d) in acc.items()}

    def per_cache(self, pieces: Pieces, view: ViewFilter) -> list[CacheRow]:
        if "cache" in missing_columns(self.cur, "io"):
            return []  # recorded before the syscall layer
        cond, params = _in_view(pieces, view)
        # What a buffered read fetched is counted in the kernel as the call puts pages into
        # the page cache (fetched_bytes). Where a session has no such count: a thread is in
        # one call at a time, so a block read it issued while in a read call belongs to that
        # call, matched by thread and time (O_DIRECT reads are matched so too).
        fetched = ("NULL::UBIGINT" if "fetched_bytes" in missing_columns(self.cur, "io")
                   else "io.fetched_bytes")
        return named(CacheRow, self._joined(pieces, f"""
            WITH s AS (
                SELECT io.pid, io.issue_ns, io.complete_ns, io.bytes, io.op,
                       {fetched} AS fetched, coalesce(io.cache, 'other') AS cache,
                       (io.flags & {schema.FLAG_DIRECT}) <> 0 AS direct, w.w_phase AS phase,
                       -- Time with a call in flight, per (phase, cache, op): in issue order,
                       -- the part of each call past the latest end before it.
                       greatest(0, io.complete_ns - greatest(io.issue_ns, coalesce(
                           max(io.complete_ns) OVER (
                               PARTITION BY w.w_phase, coalesce(io.cache, 'other'), io.op
                               ORDER BY io.issue_ns, io.complete_ns
                               ROWS BETWEEN UNBOUNDED PRECEDING AND 1 PRECEDING),
                           io.issue_ns))) AS busy
                FROM (SELECT * FROM io WHERE {_and("layer = 'syscall'",
                                                   "op IN ('read', 'write')", cond)}) io
                ASOF JOIN _kv_windows w ON io.issue_ns >= w.w_start),
            dev AS (
                SELECT s.pid, s.issue_ns, sum(b.bytes) AS bytes
                FROM s JOIN (SELECT pid, issue_ns, {weighted_bytes(self.cur)} AS bytes FROM io
                             WHERE layer = 'block' AND op = 'read') b
                  ON b.pid = s.pid AND b.issue_ns >= s.issue_ns AND b.issue_ns < s.complete_ns
                WHERE s.op = 'read' AND (s.fetched IS NULL OR s.direct) GROUP BY ALL)
            SELECT s.phase, s.cache, s.op, s.direct, count(*), sum(s.bytes)::UBIGINT,
                   coalesce(sum(CASE WHEN s.fetched IS NOT NULL AND NOT s.direct
                                     THEN s.fetched ELSE dev.bytes END), 0)::UBIGINT,
                   sum(s.busy)::BIGINT
            FROM s LEFT JOIN dev ON dev.pid = s.pid AND dev.issue_ns = s.issue_ns
            GROUP BY ALL ORDER BY ALL""", params))

    def writeback(self, pieces: Pieces, view: ViewFilter) -> list[WritebackRow]:
        if "inode" in missing_columns(self.cur, "io"):
            return []  # recorded before writeback attribution
        # The flush threads are nobody's process: only a device view narrows them.
        cond, params = _in_view(pieces, ViewFilter(device=view.device), "ts_ns")
        # "By file and time": the page a flush thread writes was dirtied by some earlier
        # buffered write to the file; the latest one before the writeback names the phase.
        return named(WritebackRow, self._joined(pieces, f"""
            WITH w AS (
                SELECT io.inode, io.issue_ns, coalesce(io.cache, 'other') AS cache,
                       k.w_phase AS phase
                FROM (SELECT inode, issue_ns, cache FROM io
                      WHERE layer = 'syscall' AND op = 'write' AND inode IS NOT NULL
                        AND (flags & {schema.FLAG_DIRECT}) = 0) io
                ASOF JOIN _kv_windows k ON io.issue_ns >= k.w_start),
            wb AS (SELECT b.inode, b.ts_ns AS issue_ns, b.bytes, k.w_phase AS landed
                   FROM (SELECT inode, ts_ns, bytes FROM writeback
                         {"WHERE " + cond if cond else ""}) b
                   ASOF JOIN _kv_windows k ON b.ts_ns >= k.w_start)
            SELECT w.phase, w.cache, count(*), sum(wb.bytes)::UBIGINT,
                   coalesce(sum(wb.bytes) FILTER (WHERE wb.landed <> w.phase), 0)::UBIGINT
            FROM wb ASOF LEFT JOIN w ON wb.inode = w.inode AND wb.issue_ns >= w.issue_ns
            GROUP BY ALL ORDER BY ALL""", params))

    def bins(self, pieces: Pieces, bin_ns: int, nbins: int) -> list[tuple]:
        weight = ("1" if "sample_weight" in missing_columns(self.cur, "io")
                  else "coalesce(sample_weight, 1)")
        layers = ", ".join(f"'{x}'" for x in schema.DEVICE_LAYERS)
        return self._joined(pieces, f"""
            SELECT least(greatest((io.issue_ns - ?) // ?, 0), ?) AS bin, w.w_phase,
                   io.layer, io.op, sum(io.weight)::UBIGINT, sum(io.bytes * io.weight)::UBIGINT
            FROM (SELECT issue_ns, layer, op, bytes, {weight} AS weight FROM io
                  WHERE layer IN ({layers})) io
            ASOF JOIN _kv_windows w ON io.issue_ns >= w.w_start
            GROUP BY ALL ORDER BY ALL""", [int(pieces.t0), int(bin_ns), int(nbins - 1)])

    def gpu_bins(self, t0: int, bin_ns: int, nbins: int) -> list[tuple]:
        try:
            return self.cur.execute("""
                SELECT (ts_ns - ?) // ? AS bin, avg(gpu_util_pct), avg(sm_active_pct)
                FROM gpu WHERE ts_ns >= ? AND ts_ns < ? GROUP BY ALL ORDER BY ALL""",
                [int(t0), int(bin_ns), int(t0), int(t0) + int(bin_ns) * int(nbins)]).fetchall()
        except duckdb.CatalogException:
            return []

    def block_requests(self, pieces: Pieces) -> pa.Table:
        """Every block request's phase (the window holding its issue time, the report's rule),
        device, op, offset in bytes, size and issue time, in issue order: what a replay
        issues (`kvprof export --fio-iolog`); sample_weight: the requests each row stands for;
        piece_end: when the piece of window holding it ends."""
        weight = ("1" if "sample_weight" in missing_columns(self.cur, "io")
                  else "coalesce(sample_weight, 1)")
        self.cur.register("_kv_windows", _lookup(pieces))
        try:
            return self.cur.sql(f"""
                SELECT w.w_phase AS phase, io.dev_name, io.op,
                       -- (a flush names no sector: all ones, read as 0 here)
                       CASE WHEN io.sector < 36028797018963968 THEN io.sector * 512
                            ELSE 0 END AS offset,
                       io.bytes, io.issue_ns, io.sample_weight, w.w_end AS piece_end
                FROM (SELECT dev_name, op, sector, bytes, issue_ns,
                             {weight}::UINTEGER AS sample_weight FROM io
                      WHERE layer = 'block') io
                ASOF JOIN _kv_windows w ON io.issue_ns >= w.w_start
                ORDER BY io.issue_ns""").to_arrow_table()
        finally:
            self.cur.unregister("_kv_windows")

    def file_calls(self, pieces: Pieces) -> pa.Table:
        """Every syscall-layer read, write, fsync and fdatasync on a file, in issue order: what
        a replay on a filesystem issues. Phase (the report's rule), file (inode, else path),
        path, KV cache, op, syscall, O_DIRECT, offset, bytes done and asked, bytes put into the
        page cache (NULL: unknown), issue and completion time, thread. Empty writes and failed
        calls are left out; a read at a file's end (0 bytes) is a call the engine made, kept.
        No rows for a session without the layer or recorded before file offsets."""
        if {"file_offset", "inode", "fetched_bytes"} & set(missing_columns(self.cur, "io")):
            return pa.table({})
        self.cur.register("_kv_windows", _lookup(pieces))
        try:
            return self.cur.sql(f"""
                SELECT w.w_phase AS phase, coalesce(io.inode::VARCHAR, io.path) AS file,
                       io.path, io.cache, io.op, io.syscall,
                       (io.flags & {schema.FLAG_DIRECT}) <> 0 AS direct,
                       io.file_offset AS offset, io.bytes, io.bytes_asked AS asked,
                       io.fetched_bytes AS fetched, io.issue_ns, io.complete_ns,
                       io.pid AS tid
                FROM (SELECT * FROM io WHERE layer = 'syscall' AND error = 0
                      AND (op = 'flush' OR (op IN ('read', 'write') AND file_offset IS NOT NULL
                                            AND (op = 'read' OR bytes > 0)))) io
                ASOF JOIN _kv_windows w ON io.issue_ns >= w.w_start
                ORDER BY io.issue_ns""").to_arrow_table()
        finally:
            self.cur.unregister("_kv_windows")

    def gds_calls(self, pieces: Pieces, view: ViewFilter) -> list[tuple]:
        cond, params = _in_view(pieces, view)
        return self._joined(pieces, f"""
            SELECT w.w_phase, io.syscall, count(*)
            FROM (SELECT issue_ns, syscall FROM io
                  WHERE {_and("layer = 'gds'", cond)}) io
            ASOF JOIN _kv_windows w ON io.issue_ns >= w.w_start
            GROUP BY ALL ORDER BY ALL""", params)

    def _fetch_islands(self, cur: duckdb.DuckDBPyConnection, t0: int, t1: int,
                       view: ViewFilter, device: str | None) -> Islands:
        """Busy islands from the block requests (of `device`, or all) in flight at any time
        in [t0, t1), also those issued before t0. Fetched without the device names: a column
        of millions of strings costs more to fetch than the two times."""
        cond, params = _where(view)
        where = _and("layer = 'block'", "complete_ns > ?", f"{_BEGIN} < ?", cond,
                     "dev_name = ?" if device is not None else "")
        tbl = cur.sql(f"SELECT {_BEGIN} AS s, complete_ns AS e FROM io WHERE {where}",
                      params=[int(t0), int(t1), *params,
                              *([device] if device is not None else [])]).to_arrow_table()
        return busy_islands(tbl["s"].to_numpy(), tbl["e"].to_numpy())

    def _side(self) -> tuple[duckdb.DuckDBPyConnection, ThreadPoolExecutor]:
        if self._side_cur is None or self._side_pool is None:
            self._side_cur = self.cur.cursor()
            self._side_pool = ThreadPoolExecutor(1, thread_name_prefix="kvprof-side")
        return self._side_cur, self._side_pool

    def _islands(self, t0: int, t1: int, view: ViewFilter, whole: bool, any_block: bool,
                 every: Future[Islands]):
        """Busy islands per device (`every`: those of all devices, being fetched), the
        devices the window's block requests went to, and the devices of the view's block
        requests in flight in it (one: its islands are all the view's). `any_block`: the view
        has block requests."""
        cond, params = _where(view)
        where = _and("layer = 'block'", "complete_ns > ?", f"{_BEGIN} < ?", cond)
        args = [int(t0), int(t1), *params]
        sessions = self.cur.execute("SELECT devices FROM session").fetchall()
        traced = ([d["name"] for d in json.loads(sessions[0][0] or "[]")]
                  if len(sessions) == 1 else [])
        if whole and len(traced) == 1 and view.device in (None, traced[0]):
            # Recorded on one device (-d), a session holds no other's block requests: the
            # whole view needs no scan for its devices. (Not a fleet's sessions, each on its
            # own.)
            names = present = traced if any_block else []
        else:
            devices = self.cur.execute(f"""
                SELECT dev_name, bool_or(issue_ns >= ? AND issue_ns < ?) FROM io
                WHERE {where} GROUP BY dev_name""", [int(t0), int(t1), *args]).fetchall()
            names = [d for d, _ in devices]
            present = sorted(d for d, inside in devices if inside or whole)

        # Each device's rows fetched when asked for.
        @functools.cache
        def islands(device: str | None) -> Islands:
            if device is None:
                return every.result()
            return self._fetch_islands(self.cur, t0, t1, view, device)

        def islands_of(device: str | None) -> Islands:
            # (one device's rows are all the rows: computed once)
            return islands(None if names == [device] else device)
        return islands_of, present, names

    def over_time(self, pieces: Pieces, view: ViewFilter, c0: int, ncells: int,
                  edges: np.ndarray) -> OverTime:
        t0, t1, origin = int(pieces.t0), int(pieces.t1), int(pieces.origin)
        cond, params = _where(view)
        cells: dict[tuple[str, str, str], np.ndarray] = {}
        if len(pieces.start):
            rows = self._joined(pieces, f"""
                SELECT w.w_phase, io.layer, io.op, (io.issue_ns - ?) // {GRID_NS} - ?,
                       sum(io.bytes)::UBIGINT
                FROM (SELECT layer, op, issue_ns, {weighted_bytes(self.cur)} AS bytes FROM io
                      WHERE {_and("issue_ns >= ? AND issue_ns < ?", cond)}) io
                ASOF JOIN _kv_windows w ON io.issue_ns >= w.w_start
                GROUP BY ALL""", [origin, int(c0), t0, t1, *params])
            for phase, layer, op, b, nbytes in rows:
                arr = cells.setdefault((phase, layer, op), np.zeros(ncells, np.int64))
                if 0 <= b < ncells:
                    arr[int(b)] += int(nbytes or 0)

        lo, bin_ns, nbins = int(edges[0]), int(edges[1] - edges[0]), len(edges) - 1
        seen = np.zeros(len(schema.LAYERS), bool)
        bins = np.zeros((len(schema.DEVICE_LAYERS), nbins), np.int64)
        for layer, b, nbytes in self.cur.execute(f"""
                SELECT layer, (issue_ns - ?) // ?, sum({weighted_bytes(self.cur)})::UBIGINT
                FROM io
                WHERE {_and("issue_ns >= ? AND issue_ns < ?", cond)} GROUP BY ALL""",
                                                 [lo, bin_ns, lo, t1, *params]).fetchall():
            if layer in schema.LAYERS:
                seen[schema.LAYERS.index(layer)] = True
                if layer in schema.DEVICE_LAYERS and 0 <= b < nbins:
                    bins[schema.LAYERS.index(layer), int(b)] += int(nbytes or 0)

        recent = self.cur.execute(
            f"SELECT count(*) FROM io WHERE {_and('issue_ns >= ? AND issue_ns < ?', cond)}",
            [t1 - NS, t1, *params]).fetchall()[0][0]
        # The device and process choices list every I/O of the window, not the filtered.
        devices = [r[0] for r in self.cur.execute(
            "SELECT DISTINCT dev_name FROM io WHERE issue_ns >= ? AND issue_ns < ? "
            "AND dev_name <> '' ORDER BY 1", [t0, t1]).fetchall()]
        procs = tuple((int(t), str(c)) for t, c, _ in self.cur.execute("""
            SELECT tgid, min(comm), count(*) FROM io
            WHERE issue_ns >= ? AND issue_ns < ? GROUP BY tgid ORDER BY 3 DESC, 1
            LIMIT 10""", [t0, t1]).fetchall())
        return OverTime(cells, seen, bins, int(recent), devices, procs)

    def gpu(self, t0: int, t1: int) -> GpuMeans | None:
        w = "(WHERE ts_ns >= $1 AND ts_ns < $2)"  # this range's samples
        try:
            return GpuMeans._make(self.cur.execute(f"""
                SELECT count(DISTINCT gpu) FILTER {w}, count(*) FILTER {w},
                       avg(gpu_util_pct) FILTER {w}, avg(mem_util_pct) FILTER {w},
                       avg(sm_active_pct) FILTER {w}, avg(power_w) FILTER {w},
                       avg(pcie_rx_bytes_per_s) FILTER {w}, avg(pcie_tx_bytes_per_s) FILTER {w},
                       count(*)
                FROM gpu""", [int(t0), int(t1)]).fetchall()[0])
        except duckdb.CatalogException:
            return None


# -- the live row cache --------------------------------------------------------------------------

def feed_cache() -> Rollup:
    """The dashboard feed's row cache: as many rows as its bound allows (at 100k events/s,
    70 s: the 60 s window and a margin); a view reaching further back is computed with SQL."""
    return Rollup(IoCache())


class LiveRows(RowSource):
    """The row cache and its rollup where they hold the span asked about, else `sql`."""

    def __init__(self, sql: SqlRows, live: Rollup):
        self.sql, self.live, self.cache = sql, live, live.cache

    def info(self) -> SessionInfo:
        return self.sql.info()

    def windows(self, t0: int | None = None, t1: int | None = None) -> pa.Table:
        return self.sql.windows(t0, t1)

    def gpu(self, t0: int, t1: int) -> GpuMeans | None:
        return self.sql.gpu(t0, t1)

    def processes(self) -> list[dict]:
        return self.sql.processes()

    def aggregate(self, t0: int, t1: int, whole: bool, device: str | None
                  ) -> tuple[list[AggRow], list[BusyRow]] | None:
        return self.sql.aggregate(t0, t1, whole, device)

    def sampling(self, t0: int, t1: int) -> list[int]:
        return self.sql.sampling(t0, t1)

    def engine_counters(self, t0: int, t1: int) -> list[tuple[str, str, float]]:
        return self.sql.engine_counters(t0, t1)

    def engine_last(self, names: list[str], t1: int) -> list[tuple[str, str, str, float]]:
        return self.sql.engine_last(names, t1)

    def counter_steps(self, names: list[str], t0: int, t1: int
                      ) -> list[tuple[int, int, float]]:
        return self.sql.counter_steps(names, t0, t1)

    def window_sources(self, t0: int, t1: int) -> list[tuple[str, str, int]]:
        return self.sql.window_sources(t0, t1)

    def phase_tokens(self, t0: int, t1: int) -> list[tuple[str, str, float, float]]:
        return self.sql.phase_tokens(t0, t1)

    def weighted_quantiles(self, pieces: Pieces, view: ViewFilter
                           ) -> dict[tuple[str, str, str], tuple[list[float | None], ...]]:
        return self.sql.weighted_quantiles(pieces, view)

    def per_cache(self, pieces: Pieces, view: ViewFilter) -> list[CacheRow]:
        # The row cache keeps no paths: syscall rows are few beside block rows, SQL it is.
        return self.sql.per_cache(pieces, view)

    def writeback(self, pieces: Pieces, view: ViewFilter) -> list[WritebackRow]:
        return self.sql.writeback(pieces, view)

    def gds_calls(self, pieces: Pieces, view: ViewFilter) -> list[tuple]:
        return self.sql.gds_calls(pieces, view)

    def bins(self, pieces: Pieces, bin_ns: int, nbins: int) -> list[tuple]:
        return self.sql.bins(pieces, bin_ns, nbins)

    def gpu_bins(self, t0: int, bin_ns: int, nbins: int) -> list[tuple]:
        return self.sql.gpu_bins(t0, bin_ns, nbins)

    def interrupt(self) -> None:
        self.sql.interrupt()

    def close(self) -> None:
        self.sql.close()

    def refresh(self) -> None:
        self.cache.refresh(self.sql.cur)

    def per_phase(self, pieces: Pieces, view: ViewFilter) -> PerPhase:
        if not self.cache.covers(pieces.t0):
            return self.sql.per_phase(pieces, view)
        units = self.live.units(pieces.start, pieces.end, pieces.phase, pieces.origin,
                                view.device, view.tgid, unbounded=pieces.whole)
        islands_of = self._islands(view)

        def device_time_of(device: str | None) -> dict[str, int]:
            return rollup.device_time(units, None if device is None
                                      else self.cache.device_code(device))
        return PerPhase(named(StatRow, rollup.stats(units)), islands_of,
                        rollup.devices(units, self.cache), device_time_of)

    def _islands(self, view: ViewFilter) -> IslandsOf:
        """The cache's maintained islands, or for a process filter the process's block rows
        (the cache holds every row that can reach into the window)."""
        cache = self.cache
        if view.tgid is None:
            def kept(device: str | None) -> Islands:
                if device is None or view.device is None or device == view.device:
                    return cache.islands(device if device is not None else view.device)
                return np.empty(0, np.int64), np.empty(0, np.int64)
            return kept
        rows = cache.slice(0, len(cache), view.device, view.tgid)
        block = rows.layer == rollup.BLOCK

        def of_process(device: str | None) -> Islands:
            mine = block if device is None else block & (rows.dev == cache.device_code(device))
            return busy_islands_ordered(rows.start[mine], rows.complete[mine])
        return of_process

    def over_time(self, pieces: Pieces, view: ViewFilter, c0: int, ncells: int,
                  edges: np.ndarray) -> OverTime:
        lo = int(pieces.start[0]) if len(pieces.start) else pieces.t0
        if not self.cache.covers(lo):
            return self.sql.over_time(pieces, view, c0, ncells, edges)
        t0, t1, origin, cache = pieces.t0, pieces.t1, pieces.origin, self.cache
        units = self.live.units(pieces.start, pieces.end, pieces.phase, origin, view.device,
                                view.tgid, cuts=(t0,))
        cells = rollup.bytes_by_cell([u for u in units if u.start >= t0], c0, ncells)
        cut = np.minimum(edges, t1)
        if view == ViewFilter():
            bins = cache.layer_bytes(cut)
        else:
            r = cache.rows(int(cut[0]), t1, view.device, view.tgid)
            at = np.searchsorted(r.issue, cut, side="left")
            bins = np.vstack([np.diff(np.concatenate([[0], np.cumsum(
                np.where(r.layer == lay, r.bytes, 0))])[at])
                for lay in range(len(schema.DEVICE_LAYERS))])
        recent = len(cache.rows(t1 - NS, t1, view.device, view.tgid))
        plain = units if view == ViewFilter() else self.live.units(
            pieces.start, pieces.end, pieces.phase, origin, cuts=(t0,))
        plain = [u for u in plain if u.start >= t0]
        return OverTime(cells, rollup.layers_seen(units), bins, recent,
                        rollup.devices(plain, cache), rollup.busiest(plain, cache))


def for_feed(reader: Reader, live: bool) -> RowSource:
    """The dashboard feed's source, on its own cursor: the row cache in front of SQL, or SQL
    alone for a replay too large to hold (every view from SQL, none read twice)."""
    sql = SqlRows(reader.cursor())
    cache = feed_cache()
    if not live and sql.row_count() > cache.cache.max_rows:
        return sql
    return LiveRows(sql, cache)
