"""What the dashboard shows at one moment, as frozen data built off the UI thread.

`build_snapshot` asks correlate for the frame of the chosen window (every number: the window's
report, rates, timeline, GPU means, recent activity) and assembles a `Snapshot`; widgets only
render the newest one, so they never see a half-built state. `SnapshotFeed` is the one
background thread that rebuilds it on an interval from its own row source (the row cache in
front of SQL). Nothing here imports textual or duckdb."""
from __future__ import annotations

import dataclasses
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

from kvprof import schema
from kvprof.analysis import correlate
from kvprof.analysis.rowsource import GpuMeans, Interrupted, RowSource, ViewFilter, for_feed
from kvprof.store.session import Reader
from kvprof.summary import DeviceLayer, Summary
from kvprof.summary import PhaseStats as PhaseReport
from kvprof.units import engine_parts
from kvprof.views.findings import findings

NS = 1_000_000_000
WINDOWS_S: tuple[float | None, ...] = (10.0, 60.0, None)  # None: the whole session
TIMELINE_S = 60.0
TIMELINE_BINS = 60


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
    # The mean number of block requests in flight while the device was busy (about 1: one
    # at a time); None without block requests.
    inflight_mean: float | None = None
    # The share of the device's calibrated capability left unused (`kvprof calibrate`);
    # None where the device was not calibrated.
    capacity_idle_pct: float | None = None
    # What the application asked of its files (the syscall layer), mean bytes/s, and the
    # share of its buffered reads the page cache served; 0 / None without that layer.
    app_read: float = 0.0
    app_write: float = 0.0
    page_cache_hit_pct: float | None = None
    # Per KV cache, busiest first: (name, read bytes/s, write bytes/s, read hit share).
    caches: tuple[tuple[str, float, float, float | None], ...] = ()


@dataclass(frozen=True)
class Bin:
    start_ns: int
    phase: str | None  # the phase covering most of the bin; None before/after the session
    bytes: int


@dataclass(frozen=True)
class Snapshot:
    host: str
    devices: tuple[str, ...]
    sources: tuple[str, ...]  # who made the windows (else what the recording listened to)
    status: str
    start_ns: int
    now_ns: int
    t0_ns: int
    t1_ns: int
    window_s: float | None
    filters: ViewFilter
    events_per_s: float
    lost_events: int
    phases: tuple[PhaseStats, ...]
    timeline: tuple[Bin, ...]
    bin_ns: int
    gpu: GpuMeans | None  # correlate's means over the window
    gpu_note: str
    findings: tuple[str, ...]
    notes: tuple[str, ...]
    device_choices: tuple[str, ...]
    process_choices: tuple[tuple[int, str], ...]
    build_s: float
    # The report dict for exactly [t0_ns, t1_ns) and the filters, for tests and export.
    summary: Summary = field(compare=False, repr=False)

    @property
    def session_s(self) -> float:
        return (self.now_ns - self.start_ns) / 1e9

    def phase(self, name: str) -> PhaseStats:
        return next(p for p in self.phases if p.phase == name)


def _hist(d: dict) -> tuple[tuple[int, int], ...]:
    return tuple(sorted((int(k), int(v)) for k, v in d.items()))


def _merge_hists(*hs: dict) -> dict:
    out: dict = {}
    for h in hs:
        for k, v in h.items():
            out[k] = out.get(k, 0) + v
    return out


def _phase_stats(p: str, ph: PhaseReport, rates: dict) -> PhaseStats:
    layer: DeviceLayer = rates["layer"]
    rd, wr = ph[layer]["read"], ph[layer]["write"]
    # Latency quantiles of the busier op: one number pair per panel, the one that matters.
    main = rd if rd["ios"] >= wr["ios"] else wr
    return PhaseStats(
        phase=p, layer=layer, time_s=ph["time_s"], time_share_pct=ph["time_share_pct"],
        ios=rd["ios"] + wr["ios"], read=Rate(*rates["read"]), write=Rate(*rates["write"]),
        iops=rd["iops"] + wr["iops"],
        p50_us=main["latency_us"]["p50"], p99_us=main["latency_us"]["p99"],
        latency_hist_us=_hist(_merge_hists(rd["latency_hist_us"], wr["latency_hist_us"])),
        size_hist=_hist(_merge_hists(rd["size_hist"], wr["size_hist"])),
        idle_pct=ph["block"]["time_idle_pct"] if layer == "block" else None,
        inflight_mean=ph["block"]["inflight_mean"] if layer == "block" else None,
        capacity_idle_pct=ph["block"]["capacity_idle_pct"],
        app_read=ph["syscall"]["read"]["bandwidth_bytes_per_s"],
        app_write=ph["syscall"]["write"]["bandwidth_bytes_per_s"],
        page_cache_hit_pct=ph["syscall"].get("page_cache_hit_pct"),
        caches=tuple(sorted(
            ((name, c["read"]["bandwidth_bytes_per_s"], c["write"]["bandwidth_bytes_per_s"],
              c["read"]["page_cache_hit_pct"]) for name, c in ph.get("caches", {}).items()),
            key=lambda c: (-(c[1] + c[2]), c[0]))))


def build_snapshot(rows: RowSource, window_s: float | None, now_ns: int,
                   filters: ViewFilter = ViewFilter()) -> Snapshot:
    """The dashboard's data for the window ending at `now_ns` (session clock)."""
    started = time.perf_counter()
    f = correlate.frame(rows, window_s, now_ns, filters, TIMELINE_S, TIMELINE_BINS)
    phases = tuple(_phase_stats(p, f.summary["phases"][p], f.rates[p]) for p in schema.PHASES)
    notes = []
    if not f.windows:
        notes.append("no phase windows in view: all time counts as idle (send `kvprof mark` "
                     "or use --phases)")
    if not any(p.ios for p in phases):
        notes.append(f"no I/O in this window ({filters.label()})")
    engine = engine_parts(f.summary["engine"])
    if engine:
        notes.append("engine: " + ", ".join(engine))
    s = f.summary["session"]
    return Snapshot(
        host=s["host"], devices=tuple(s["devices"]), sources=tuple(
            f"{w['source']}" + (f" {w['engine']}" if w["engine"] else "")
            for w in s.get("window_sources", [])) or tuple(s["phase_sources"]),
        status=s["status"], start_ns=f.info.start_ns, now_ns=f.t1, t0_ns=f.t0, t1_ns=f.t1,
        window_s=window_s, filters=filters, events_per_s=float(f.recent),
        lost_events=s["lost_events"], phases=phases,
        timeline=tuple(Bin(*b) for b in f.timeline), bin_ns=f.bin_ns,
        gpu=f.gpu, gpu_note=f.gpu_note,
        findings=tuple(x.text for x in findings(f.summary)), notes=tuple(notes),
        device_choices=tuple(f.devices), process_choices=f.processes,
        build_s=time.perf_counter() - started, summary=f.summary)


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
            if self.end_ns is None:  # live
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
            if self.playing and self.end_ns is not None and self._pos >= self.end_ns:
                self._pos = self.start_ns  # play again from the start
            return self.playing

    def seek(self, delta_ns: int) -> None:
        with self._lock:
            self._advance()
            hi = self._mono() if self.end_ns is None else self.end_ns
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
    filters: ViewFilter = ViewFilter()


class SnapshotFeed:
    """One thread: build a snapshot from its own row source, hand it over, wait, repeat.
    Builds never overlap, so a slow one only delays (skips) frames; `wake()` asks for one
    now."""

    def __init__(self, session: Reader, clock: Clock,
                 deliver: Callable[[Snapshot], None], on_error: Callable[[str], None],
                 interval_s: float = 0.5, request: ViewRequest = ViewRequest()):
        self._session, self.clock, self.interval_s = session, clock, interval_s
        self._deliver, self._on_error = deliver, on_error
        self.request = request  # replaced whole by the UI thread: a plain attribute swap
        self._building: ViewRequest | None = None  # the view being built, if any
        self._rows: RowSource | None = None
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
        if building is not None and building != request and self._rows is not None:
            self._rows.interrupt()
        self._wake.set()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(30)

    def _run(self) -> None:
        rows = self._rows = for_feed(self._session, live=self.clock.live)
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
                    rows.refresh()
                    snap = build_snapshot(rows, req.window_s, now, req.filters)
                    # The frame's cost: reading the new rows and building.
                    snap = dataclasses.replace(snap, build_s=time.perf_counter() - began)
                except Interrupted:
                    last = None  # another view was asked for: build that one now
                    continue
                except Exception as e:  # noqa: BLE001 - shown on screen, never a crash
                    self._on_error(f"{type(e).__name__}: {(str(e).splitlines() or [''])[0]}")
                else:
                    # Another view asked for while this one was built between two queries
                    # (the interrupt only stops a running one): build that one instead.
                    if self.request != req:
                        last = None
                        continue
                    if not self._stop.is_set():
                        self._deliver(snap)
                finally:
                    self._building = None
                self._wake.wait(self.interval_s)
        finally:
            rows.close()
