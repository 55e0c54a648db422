"""What the dashboard shows at one moment, as frozen data built off the UI thread.

`build_snapshot` reads the store (through the caller's own DuckDB cursor) and returns a
`Snapshot`: the summary of `correlate.summarize` for the chosen window, a per-bin timeline,
per-phase rates, GPU means and the findings. Widgets only render the newest snapshot, so
they never query DuckDB and never see a half-built state. `SnapshotFeed` is the one
background thread that rebuilds it on an interval, from its row cache and rollup when they
hold the span shown (see kvprof/rollup.py), else with SQL. Nothing here imports textual.
"""
from __future__ import annotations

import dataclasses
import math
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

import duckdb
import numpy as np
import pyarrow as pa

from kvprof import rollup, schema
from kvprof.correlate import Filters, flatten, summarize
from kvprof.findings import findings
from kvprof.intervals import busy_between
from kvprof.iocache import IoCache
from kvprof.rollup import GRID_NS, Rollup
from kvprof.store import phase_windows, session_info

NS = 1_000_000_000
WINDOWS_S: tuple[float | None, ...] = (10.0, 60.0, None)  # None: the whole session
TIMELINE_S = 60.0
TIMELINE_BINS = 60
# A phase must fill this share of a rate bin for that bin to count: bytes over 10 ms of
# phase time would read as an absurd rate.
MIN_BIN_SHARE = 0.2


@dataclass(frozen=True)
class Rate:
    """Bytes per second: in the latest second of the phase, over the window, best second."""
    now: float
    mean: float
    peak: float


@dataclass(frozen=True)
class PhaseStats:
    phase: str
    layer: str  # the layer the numbers come from: block, or io_uring when block saw none
    time_s: float
    time_share_pct: float
    ios: int
    read: Rate
    write: Rate
    iops: float
    p50_us: float | None
    p99_us: float | None
    latency_hist_us: tuple[tuple[int, int], ...]  # (log2 bucket lower bound, count)
    size_hist: tuple[tuple[int, int], ...]
    idle_pct: float | None


@dataclass(frozen=True)
class Bin:
    start_ns: int
    phase: str | None  # the phase covering most of the bin; None before/after the session
    bytes: int


@dataclass(frozen=True)
class GpuStats:
    gpus: int
    samples: int
    util_pct: float | None
    mem_util_pct: float | None
    sm_active_pct: float | None
    power_w: float | None
    pcie_rx_bytes_per_s: float | None
    pcie_tx_bytes_per_s: float | None


@dataclass(frozen=True)
class Snapshot:
    host: str
    devices: tuple[str, ...]
    sources: tuple[str, ...]
    status: str
    start_ns: int
    now_ns: int
    t0_ns: int
    t1_ns: int
    window_s: float | None
    filters: Filters
    events_per_s: float
    lost_events: int
    phases: tuple[PhaseStats, ...]
    timeline: tuple[Bin, ...]
    bin_ns: int
    gpu: GpuStats | None
    gpu_note: str
    findings: tuple[str, ...]
    notes: tuple[str, ...]
    device_choices: tuple[str, ...]
    process_choices: tuple[tuple[int, str], ...]
    build_s: float
    # The report dict for exactly [t0_ns, t1_ns) and the filters, for tests and export.
    summary: dict = field(compare=False, repr=False)

    @property
    def session_s(self) -> float:
        return (self.now_ns - self.start_ns) / 1e9

    def phase(self, name: str) -> PhaseStats:
        return next(p for p in self.phases if p.phase == name)


def window_bounds(start_ns: int, now_ns: int, window_s: float | None) -> tuple[int, int]:
    t1 = max(now_ns, start_ns)
    t0 = start_ns if window_s is None else max(start_ns, t1 - int(window_s * NS))
    return t0, t1


def _binned(cur, lookup: pa.Table, t0: int, t1: int, origin: int, c0: int, ncells: int,
            io_filter: str) -> dict[tuple[str, str, str], np.ndarray]:
    """(phase, layer, op) -> bytes per grid second from the one holding t0, I/O by issue
    time in [t0, t1)."""
    out: dict[tuple[str, str, str], np.ndarray] = {}
    if len(lookup) == 0:
        return out
    cond = f"issue_ns >= {t0} AND issue_ns < {t1}" + (f" AND ({io_filter})" if io_filter else "")
    cur.register("_kv_snap_windows", lookup)
    try:
        rows = cur.execute(f"""
            SELECT w.w_phase, io.layer, io.op, (io.issue_ns - {origin}) // {GRID_NS} - {c0},
                   sum(io.bytes)::UBIGINT
            FROM (SELECT layer, op, issue_ns, bytes FROM io WHERE {cond}) io
            ASOF JOIN _kv_snap_windows w ON io.issue_ns >= w.w_start
            GROUP BY ALL""").fetchall()
    finally:
        cur.unregister("_kv_snap_windows")
    for phase, layer, op, b, nbytes in rows:
        arr = out.setdefault((phase, layer, op), np.zeros(ncells, np.int64))
        if 0 <= b < ncells:
            arr[int(b)] += int(nbytes or 0)
    return out


def _timeline_bytes(cur, t0: int, t1: int, bin_ns: int, io_filter: str) -> np.ndarray:
    """Bytes per timeline bin. The device sees each byte once and io_uring rows repeat block
    ones, so block rows count, or io_uring rows when there are no block rows."""
    cond = f"issue_ns >= {t0} AND issue_ns < {t1}" + (f" AND ({io_filter})" if io_filter else "")
    rows = cur.execute(f"""
        SELECT layer, (issue_ns - {t0}) // {bin_ns} AS b, sum(bytes)::UBIGINT
        FROM io WHERE {cond} GROUP BY ALL""").fetchall()
    use = "block" if any(layer == "block" for layer, _, _ in rows) else "io_uring"
    total = np.zeros(TIMELINE_BINS, np.int64)
    for layer, b, nbytes in rows:
        if layer == use and 0 <= b < TIMELINE_BINS:
            total[int(b)] += int(nbytes or 0)
    return total


def _timeline_bytes_cached(cache: IoCache, units: list, edges: np.ndarray, t1: int,
                           filters: Filters) -> np.ndarray:
    """The same from the cache: by its running byte sums, or, filtered, from the rows."""
    seen = rollup.layers_seen(units)
    use = rollup.BLOCK if seen[rollup.BLOCK] else rollup.IO_URING
    cut = np.minimum(edges, t1)
    if filters == Filters():
        return cache.layer_bytes(cut)[use]
    r = cache.rows(int(cut[0]), t1, filters.device, filters.tgid)
    cum = np.concatenate([[0], np.cumsum(np.where(r.layer == use, r.bytes, 0))])
    return np.diff(cum[np.searchsorted(r.issue, cut, side="left")])


def _phase_time(ws, we, wp, edges: np.ndarray) -> dict[str, np.ndarray]:
    """Phase -> ns of that phase inside each bin; one phase's pieces are disjoint islands."""
    return {p: busy_between(ws[wp == p], we[wp == p], edges[:-1], edges[1:])
            for p in schema.PHASES}


def _hist(d: dict) -> tuple[tuple[int, int], ...]:
    return tuple(sorted((int(k), int(v)) for k, v in d.items()))


def _merge_hists(*hs: dict) -> dict:
    out: dict = {}
    for h in hs:
        for k, v in h.items():
            out[k] = out.get(k, 0) + v
    return out


def _phase_stats(p: str, ph: dict, per_bin: dict, ptime: np.ndarray) -> PhaseStats:
    layer = "block" if any(ph["block"][op]["ios"] for op in ("read", "write")) or not any(
        ph["io_uring"][op]["ios"] for op in ("read", "write")) else "io_uring"
    rd, wr = ph[layer]["read"], ph[layer]["write"]

    def rate(op: str, mean: float) -> Rate:
        nbytes = per_bin.get((p, layer, op))
        # A phase shorter than the bar (a 25 ms prefill) still gets a rate from its longest bins.
        ok = (ptime > 0) & (ptime >= min(MIN_BIN_SHARE * GRID_NS, 0.5 * ptime.max()))
        if nbytes is None or not ok.any():
            return Rate(0.0, mean, mean)
        r = np.where(ok, nbytes / np.maximum(ptime, 1) * NS, 0.0)
        last = int(np.flatnonzero(ok)[-1])
        return Rate(float(r[last]), mean, max(float(r.max()), mean))

    # Latency quantiles of the busier op: one number pair per panel, the one that matters.
    main = rd if rd["ios"] >= wr["ios"] else wr
    return PhaseStats(
        phase=p, layer=layer, time_s=ph["time_s"], time_share_pct=ph["time_share_pct"],
        ios=rd["ios"] + wr["ios"],
        read=rate("read", rd["bandwidth_bytes_per_s"]),
        write=rate("write", wr["bandwidth_bytes_per_s"]),
        iops=rd["iops"] + wr["iops"],
        p50_us=main["latency_us"]["p50"], p99_us=main["latency_us"]["p99"],
        latency_hist_us=_hist(_merge_hists(rd["latency_hist_us"], wr["latency_hist_us"])),
        size_hist=_hist(_merge_hists(rd["size_hist"], wr["size_hist"])),
        idle_pct=ph["block"]["time_idle_pct"] if layer == "block" else None)


def _gpu(cur, t0: int, t1: int) -> tuple[GpuStats | None, str]:
    w = f"(WHERE ts_ns >= {t0} AND ts_ns < {t1})"  # this window's samples
    try:
        row = cur.execute(f"""
            SELECT count(DISTINCT gpu) FILTER {w}, count(*) FILTER {w},
                   avg(gpu_util_pct) FILTER {w}, avg(mem_util_pct) FILTER {w},
                   avg(sm_active_pct) FILTER {w}, avg(power_w) FILTER {w},
                   avg(pcie_rx_bytes_per_s) FILTER {w}, avg(pcie_tx_bytes_per_s) FILTER {w},
                   count(*)
            FROM gpu""").fetchall()[0]
    except duckdb.CatalogException:
        return None, "no GPU data: this session was recorded before NVML support"
    if not row[1]:
        return None, ("no GPU samples in this window" if row[-1] else
                      "no GPU data: no NVML samples (no GPU, or not recorded with --phases nvml)")
    return GpuStats(int(row[0]), int(row[1]), *row[2:-1]), ""


def _recent_sql(cur, t0: int, t1: int, io_filter: str):
    """I/O in the last second, the window's devices (a live session grows without end) and
    its ten busiest processes."""
    cond = f"issue_ns >= {t1 - NS} AND issue_ns < {t1}" + (f" AND ({io_filter})"
                                                          if io_filter else "")
    recent = cur.execute(f"SELECT count(*) FROM io WHERE {cond}").fetchall()[0][0]
    devices = [r[0] for r in cur.execute(
        f"SELECT DISTINCT dev_name FROM io WHERE issue_ns >= {t0} AND issue_ns < {t1} "
        "AND dev_name <> '' ORDER BY 1").fetchall()]
    procs = tuple((int(t), str(c)) for t, c, _ in cur.execute(f"""
        SELECT tgid, any_value(comm), count(*) FROM io
        WHERE issue_ns >= {t0} AND issue_ns < {t1} GROUP BY tgid ORDER BY 3 DESC, 1
        LIMIT 10""").fetchall())
    return recent, devices, procs


def build_snapshot(con: duckdb.DuckDBPyConnection, window_s: float | None, now_ns: int,
                   filters: Filters = Filters(), live: Rollup | None = None) -> Snapshot:
    """The dashboard's data for the window ending at `now_ns` (session clock). With `live`
    (a row cache the caller refreshed, and its rollup) holding the span shown, the I/O rows
    come from it; otherwise from SQL. The numbers are the same."""
    started = time.perf_counter()
    info = session_info(con)
    origin = info.start_ns
    t0, t1 = window_bounds(origin, now_ns, window_s)
    io_filter = filters.sql()
    # Phase pieces over the whole span any grid below touches, for the bins and the joins.
    span_t0 = min(t0, t1 - int(TIMELINE_S * NS)) if window_s is not None else t0
    # Timeline: the last minute (early on partly before the session), or the whole session
    # when that is the window.
    bin_ns = max(1, math.ceil((t1 - span_t0) / TIMELINE_BINS))
    edges = span_t0 + np.arange(TIMELINE_BINS + 1, dtype=np.int64) * bin_ns
    lo = max(span_t0, origin)
    if live is not None and not live.cache.covers(lo):
        live = None  # the span reaches back past what the cache holds
    windows = phase_windows(con, lo, max(t1, origin + 1))
    summary = summarize(con, t0, t1, filters, live, info, windows)

    ws, we, wp = flatten(windows, lo, max(t1, origin + 1))
    # Per-second rates inside the window by phase: grid seconds, the outer two cut at t0, t1.
    c0 = (t0 - origin) // GRID_NS
    ncells = max(1, (max(t1 - 1, t0) - origin) // GRID_NS - c0 + 1)
    rate_edges = origin + (c0 + np.arange(ncells + 1, dtype=np.int64)) * GRID_NS
    rate_edges[0], rate_edges[-1] = t0, max(t1, t0)
    if live is None:
        lookup_start = ws.copy()
        if len(lookup_start):
            lookup_start[0] = np.iinfo(np.int64).min
        lookup = pa.table({"w_start": lookup_start, "w_phase": wp.astype(str)})
        per_bin = _binned(con, lookup, t0, t1, origin, c0, ncells, io_filter)
        total = _timeline_bytes(con, span_t0, t1, bin_ns, io_filter)
        recent, window_devices, procs = _recent_sql(con, t0, t1, io_filter)
    else:
        units = live.units(ws, we, wp, origin, filters.device, filters.tgid, cuts=(t0,))
        per_bin = rollup.bytes_by_cell([u for u in units if u.start >= t0], c0, ncells)
        total = _timeline_bytes_cached(live.cache, units, edges, t1, filters)
        recent = len(live.cache.rows(t1 - NS, t1, filters.device, filters.tgid))
        # The device and process choices list every I/O of the window, not the filtered.
        plain = units if filters == Filters() else live.units(ws, we, wp, origin, cuts=(t0,))
        plain = [u for u in plain if u.start >= t0]
        window_devices = rollup.devices(plain, live.cache)
        procs = rollup.busiest(plain, live.cache)
    ptime = _phase_time(ws, we, wp, rate_edges)
    phases = tuple(_phase_stats(p, summary["phases"][p], per_bin, ptime[p])
                   for p in schema.PHASES)

    tl_time = _phase_time(ws, we, wp, edges)
    stacked = np.vstack([tl_time[p] for p in schema.PHASES])
    timeline = []
    for i in range(TIMELINE_BINS):
        covered = edges[i + 1] > origin and edges[i] < t1 and stacked[:, i].sum() > 0
        phase = schema.PHASES[int(stacked[:, i].argmax())] if covered else None
        timeline.append(Bin(int(edges[i]), phase, int(total[i])))
    devices = tuple(dict.fromkeys([d["name"] for d in info.devices] + window_devices))
    gpu, gpu_note = _gpu(con, t0, t1)

    notes = []
    if not len(windows):
        notes.append("no phase windows in view: all time counts as idle (send `kvprof mark` "
                     "or use --phases)")
    if not any(p.ios for p in phases):
        notes.append(f"no I/O in this window ({filters.label()})")
    s = summary["session"]
    return Snapshot(
        host=s["host"], devices=tuple(s["devices"]), sources=tuple(s["phase_sources"]),
        status=s["status"], start_ns=info.start_ns, now_ns=t1, t0_ns=t0, t1_ns=t1,
        window_s=window_s, filters=filters, events_per_s=float(recent),
        lost_events=s["lost_events"], phases=phases, timeline=tuple(timeline), bin_ns=bin_ns,
        gpu=gpu, gpu_note=gpu_note, findings=tuple(findings(summary).values()),
        notes=tuple(notes), device_choices=devices, process_choices=procs,
        build_s=time.perf_counter() - started, summary=summary)


class Clock:
    """The session-time cursor. Live: follows CLOCK_MONOTONIC until paused. Replay: moves at
    `speed` while playing and stops at the end. Shared by the UI (which moves it) and the
    feed thread (which reads it), hence the lock."""

    def __init__(self, start_ns: int, end_ns: int | None, *, playing: bool,
                 position_ns: int | None = None,
                 mono: Callable[[], int] = time.monotonic_ns):
        self.start_ns, self.end_ns, self.live = start_ns, end_ns, end_ns is None
        self.speed = 1.0
        self._mono = mono
        self._lock = threading.Lock()
        self._pos = position_ns if position_ns is not None else (end_ns or mono())
        self._since = mono()
        self.playing = playing

    def _advance(self) -> None:
        now = self._mono()
        if self.playing:
            if self.live:
                self._pos = now
            else:
                self._pos += int((now - self._since) * self.speed)
                if self._pos >= self.end_ns:
                    self._pos, self.playing = self.end_ns, False
        self._since = now

    def now_ns(self) -> int:
        with self._lock:
            self._advance()
            return self._pos

    def toggle(self) -> bool:
        with self._lock:
            self._advance()
            self.playing = not self.playing
            if self.playing and not self.live and self._pos >= self.end_ns:
                self._pos = self.start_ns  # play again from the start
            return self.playing

    def seek(self, delta_ns: int) -> None:
        with self._lock:
            self._advance()
            hi = self._mono() if self.live else self.end_ns
            self._pos = min(max(self.start_ns, self._pos + delta_ns), hi)
            if self.live:
                self.playing = False  # scrubbing back in live means looking at the past

    def set_speed(self, speed: float) -> None:
        with self._lock:
            self._advance()
            self.speed = speed


@dataclass(frozen=True)
class ViewRequest:
    window_s: float | None = 60.0
    filters: Filters = Filters()


def feed_cache() -> Rollup:
    """The feed's row cache: as many rows as its bound allows (at 100k events/s, 70 s: the
    60 s window and a margin); a view reaching further back is computed with SQL."""
    return Rollup(IoCache())


class SnapshotFeed:
    """One thread: build a snapshot from its own cursor, hand it over, wait, repeat. Builds
    never overlap, so a slow one only delays (skips) frames; `wake()` asks for one now."""

    def __init__(self, con: duckdb.DuckDBPyConnection, clock: Clock,
                 deliver: Callable[[Snapshot], None], on_error: Callable[[str], None],
                 interval_s: float = 0.5, request: ViewRequest = ViewRequest()):
        self._con, self.clock, self.interval_s = con, clock, interval_s
        self._deliver, self._on_error = deliver, on_error
        self.request = request  # replaced whole by the UI thread: a plain attribute swap
        self._building: ViewRequest | None = None  # the view being built, if any
        self._cur: duckdb.DuckDBPyConnection | None = None
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvprof-snapshot", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def wake(self) -> None:
        self._wake.set()

    def ask(self, request: ViewRequest) -> None:
        """Show this view next. A build for another view still running in SQL (a long
        session's whole-session view) is interrupted rather than waited for."""
        self.request = request
        building = self._building
        if building is not None and building != request and self._cur is not None:
            self._cur.interrupt()
        self._wake.set()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(30)

    def _run(self) -> None:
        cur = self._cur = self._con.cursor()  # this thread's own connection to the session
        live: Rollup | None = feed_cache()
        if not self.clock.live and cur.execute("SELECT count(*) FROM io").fetchall()[0][0] \
                > live.cache.max_rows:
            live = None  # a replay too large to hold: every view from SQL, none read twice
        last = None
        try:
            while not self._stop.is_set():
                woken = self._wake.is_set()
                self._wake.clear()
                req, now = self.request, self.clock.now_ns()
                if (req, now) == last and not woken and not self.clock.live:
                    # A paused replay: the same view again would only burn CPU.
                    self._wake.wait(self.interval_s)
                    continue
                last = (req, now)
                try:
                    began = time.perf_counter()
                    self._building = req
                    if live is not None:
                        live.cache.refresh(cur)
                    snap = build_snapshot(cur, req.window_s, now, req.filters, live)
                    # The frame's cost: reading the new rows and building.
                    snap = dataclasses.replace(snap, build_s=time.perf_counter() - began)
                except duckdb.InterruptException:
                    last = None  # another view was asked for: build that one now
                    continue
                except Exception as e:  # noqa: BLE001 - shown on screen, never a crash
                    self._on_error(f"{type(e).__name__}: {(str(e).splitlines() or [''])[0]}")
                else:
                    if not self._stop.is_set():
                        self._deliver(snap)
                finally:
                    self._building = None
                self._wake.wait(self.interval_s)
        finally:
            cur.close()
