"""`kvprof record`: capture + phase marks -> session store, until Ctrl-C, SIGTERM or --duration."""
from __future__ import annotations

import errno
import json
import os
import platform
import shutil
import signal
import socket
import sys
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING

import duckdb
import pyarrow as pa

from kvprof import __version__, caches, calibrate, privileges, schema, system
from kvprof.devices import Device, queue_limits, resolve
from kvprof.fold import SLOT_NS, WindowBook
from kvprof.errors import EX_IOERR, EX_UNAVAILABLE, EX_USAGE, KvprofError
from kvprof.markers import socket_path
from kvprof.phases import registry
from kvprof.sampling import row as sampling_row
from kvprof.store import DB_FILE, Store, recorder_identity, segment_path, segments

if TYPE_CHECKING:
    from kvprof.capture.ebpf import CaptureFilter

FLUSH_INTERVAL_S = 0.25
RESERVE_BYTES = 4 << 20
LOST_EVERY = 4  # flushes between updates of the session row's loss counts


@dataclass
class RecordOptions:
    out: str | None = None
    devices: list[str] = field(default_factory=list)
    pids: list[int] = field(default_factory=list)
    cgroups: list[str] = field(default_factory=list)
    layers: tuple[str, ...] = ("block", "io_uring")
    duration_s: float | None = None
    socket: str | None = None
    phases: list[str] = field(default_factory=list)  # --phases specs; empty = auto
    caches: list[str] = field(default_factory=list)  # --cache NAME=GLOB, before the built-ins
    # Per-I/O rows of the device layers (block, io_uring); without them only the aggregate
    # tier counts those layers (--no-events).
    events: bool = True
    max_size: int | None = None  # bytes on disk at which the recording ends (--max-size)
    # Seconds the aggregate tier waits for the phase sources' windows before folding a
    # second for good (and the Prometheus endpoint before publishing it): the vLLM plugin
    # sends a step's window up to ~1 s after it, a scrape's carve one interval later.
    settle_s: int = 5
    # Bytes on disk at which the recording goes on in a new segment file (--roll); with
    # max_size, the oldest segments are deleted to stay under it instead of ending.
    roll: int | None = None
    # Device-layer rows a second the event tier keeps before it samples (--event-rate); 0:
    # every one.
    event_rate: int = 50_000
    # [ADDR:]PORT to serve the exact totals as Prometheus metrics on (--prometheus).
    prometheus: str | None = None
    # The marker socket's permissions (--socket-mode, --socket-group) and the users whose
    # marks are taken (--allow-sender; empty: whoever the permissions let send).
    socket_mode: int = 0o660
    socket_group: str | None = None
    allow_senders: list[str] = field(default_factory=list)
    # Give up, once attached, the privileges the recording no longer needs
    # (kvprof.privileges). Only for a process of its own: what the caller does afterwards
    # in this thread runs without them too (the CLI sets it; --keep-privileges does not).
    drop_privileges: bool = False


def default_out() -> Path:
    return Path(datetime.now().strftime("kvprof-%Y%m%d-%H%M%S"))


def resolve_filters(opts: RecordOptions) -> CaptureFilter:
    from kvprof.capture.ebpf import CaptureFilter

    devices = tuple(dict.fromkeys(resolve(d) for d in opts.devices))
    for pid in opts.pids:
        if not Path(f"/proc/{pid}").exists():
            raise KvprofError(f"no process with pid {pid}", EX_USAGE)
    cgroup_ids = []
    for cg in opts.cgroups:
        p = Path(cg) if cg.startswith("/sys/fs/cgroup") else Path("/sys/fs/cgroup") / cg.lstrip("/")
        if not p.is_dir():
            raise KvprofError(f"no cgroup at {p} (cgroup v2 path expected)", EX_USAGE)
        cgroup_ids.append(os.stat(p).st_ino)
    return CaptureFilter(devices=devices, tgids=tuple(opts.pids),
                         cgroup_ids=tuple(cgroup_ids))


class StopFlag:
    """Set by SIGINT/SIGTERM, so a signal ends the recording cleanly at the next flush."""

    def __init__(self) -> None:
        self.event = threading.Event()
        self._old: dict = {}

    def install(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        for sig in (signal.SIGINT, signal.SIGTERM):
            self._old[sig] = signal.signal(sig, lambda *_: self.event.set())

    def restore(self) -> None:
        for sig, old in self._old.items():
            signal.signal(sig, old)


def record(opts: RecordOptions, log: Callable[[str], None] | None = None,
           stop: threading.Event | None = None,
           on_start: Callable[[Store], None] | None = None,
           on_flush: Callable[[], None] | None = None) -> Path:
    """Record one session and return its directory. `on_start` gets the store once the
    probes are attached and the session row exists (`kvprof top` reads it live through its
    own cursor); it must not keep using the store after `stop` is set."""
    log = log or (lambda s: print(s, file=sys.stderr, flush=True))
    system.require_privilege()
    system.ensure_tracefs()
    system.require_headers()
    filters = resolve_filters(opts)
    cache_rules = caches.parse(opts.caches)
    for layer in opts.layers:
        # (gds attaches to USDT probes in a library, not to tracepoints.)
        missing = [t for t in system.TRACEPOINTS.get(layer, ())
                   if not system.tracepoint_available(t)]
        if missing:
            raise KvprofError(f"this kernel lacks tracepoints {', '.join(missing)}; "
                              f"record without that layer", EX_USAGE)

    from kvprof.capture.bccload import bcc_version
    from kvprof.capture.ebpf import Capture
    from kvprof.phases.marks import MarkServer, group_id, user_id

    flag = StopFlag()
    if stop is None:
        flag.install()
        stop = flag.event
    out = Path(opts.out) if opts.out else default_out()
    fresh_dir = not out.exists()
    # Claim the marker socket first: a second recorder on the same socket fails before it
    # leaves an empty session directory behind.
    marks = MarkServer(socket_path(opts.socket), opts.socket_mode,
                       None if opts.socket_group is None else group_id(opts.socket_group),
                       tuple(user_id(u) for u in opts.allow_senders))
    try:
        Store.check_new(out)  # (outside the cleanup below: it may refuse a kept session)
    except BaseException:
        marks.stop(time.monotonic_ns())
        raise
    exporter = None
    store = None
    capture = None
    started = False
    sources: list = []
    try:
        if opts.prometheus is not None:
            # Bound before anything attaches: a taken port fails without leaving a session.
            from kvprof.exporter import Exporter

            exporter = Exporter({})
            exporter.bind(opts.prometheus)
        # Marks are taken while the probes compile (the thread holds no privilege).
        marks.start()
        for spec in registry.resolve_specs(opts.phases, log):
            try:
                sources.append((spec, registry.build(spec)))
            except KvprofError as e:
                if opts.phases:  # asked for by name: say so and stop
                    raise
                log(f"kvprof: phase source {spec} not used: {e}")
        capture = Capture(opts.layers, filters, cache_rules=cache_rules,
                          device_events=opts.events, event_rate=opts.event_rate)
        if opts.drop_privileges:
            # Before any other thread starts (DuckDB's workers, the sources', the drain's):
            # each copies what this one holds when it starts.
            try:
                kept = privileges.drop(privileges.needed(opts.layers), capture.usable)
            except OSError as e:  # a sandbox that forbids capset or prctl
                log(f"kvprof: privileges could not be dropped ({e}); recording with them")
            else:
                if threading.current_thread() is threading.main_thread():
                    held = privileges.holders()
                    if held:
                        log(f"kvprof: threads started before attaching keep privileges: "
                            f"{', '.join(held)}")
                log(f"kvprof: probes attached; privileges dropped (kept: {kept})")
        store = Store.create(out, live=on_start is not None)
        book = WindowBook(opts.settle_s)
        start_ns = time.monotonic_ns()
        offset = time.time_ns() - time.monotonic_ns()
        row = {
            "session_id": uuid.uuid4().hex[:12],
            "host": socket.gethostname(),
            "kernel": platform.release(),
            "kvprof_version": __version__,
            "bcc_version": bcc_version(),
            "start_wall_ns": start_ns + offset,
            "start_ns": start_ns,
            "end_ns": None,
            "clock_offset_ns": offset,
            "devices": _devices_json(filters.devices),
            "config": json.dumps({"layers": list(opts.layers), "devices": opts.devices,
                                  "pids": opts.pids, "cgroups": opts.cgroups,
                                  "socket": str(marks.path),
                                  "phase_sources": ["marks", *(str(sp) for sp, _ in sources)],
                                  "caches": [[r.name, r.glob] for r in cache_rules],
                                  "device_events": opts.events,
                                  "event_rate": opts.event_rate if opts.events else None,
                                  "aggregate": capture.aggregate is not None,
                                  "aggregate_slot_ns": SLOT_NS,
                                  "settle_s": opts.settle_s,
                                  "recorder": recorder_identity()}),
            "lost": "{}",
            "sources": "[]",
            "status": "recording",
        }
        store.write_session(row)
        if opts.events and set(opts.layers) & {"block", "io_uring"}:
            store.append("event_sampling", sampling_row(start_ns, 0))
        capture.start()
        started = True
        for _, src in sources:
            src.start()
        if exporter is not None:
            exporter.start()
        if on_start is not None:
            on_start(store)
        where = []
        if set(opts.layers) & {"block", "io_uring"}:
            where.append(", ".join(d.name for d in filters.devices) or "all block devices")
        if filters.tgids or filters.cgroup_ids:
            where.append(", ".join([*(f"pid {t}" for t in filters.tgids),
                                    *(f"cgroup {c}" for c in opts.cgroups)]))
        if exporter is not None:
            exporter.info = {"version": __version__, "kernel": row["kernel"],
                             "host": row["host"], "session": row["session_id"]}
            exporter.settled_ns = start_ns
            log(f"Prometheus metrics on http://{opts.prometheus.rpartition(':')[0] or '*'}:"
                f"{exporter.port}/metrics")
        log(f"Tracing {'+'.join(opts.layers)} I/O on {'; '.join(where) or 'all processes'}; "
            f"marks on {marks.path}; session {out}. Hit Ctrl-C to end.")
        feeds = (marks, *(s for _, s in sources))
        deadline = None if opts.duration_s is None else time.monotonic() + opts.duration_s
        flushes = 0
        segment, segment_start = 0, start_ns

        def write_row() -> None:
            # Each segment's row starts where the segment does (store._open_segments).
            store.write_session({**row, "start_ns": segment_start,
                                 "start_wall_ns": segment_start + offset})

        reserve = _reserve(out)
        try:
            while not stop.is_set():
                timeout = FLUSH_INTERVAL_S
                if deadline is not None:
                    timeout = min(timeout, max(0.0, deadline - time.monotonic()))
                if stop.wait(timeout) or (deadline is not None and time.monotonic() >= deadline):
                    break
                now = _drain(store, capture, feeds, book, exporter)
                flushes += 1
                if on_flush is not None:
                    on_flush()  # a live view shows the flush now, not at its next tick
                row["end_ns"] = now
                if opts.roll is not None and \
                        _disk_bytes(out, segment_path(out, segment)) >= opts.roll:
                    row.update(lost=json.dumps(capture.lost() | marks.counts() | book.counts()))
                    write_row()
                    store.close()
                    store = None
                    segment, segment_start = segment + 1, now
                    store = Store.create(out, segment, live=on_start is not None)
                    write_row()
                    if capture.sampler.max_rate:
                        store.append("event_sampling",
                                     sampling_row(now, capture.sampler.shift))
                    if opts.max_size is not None:
                        _prune(out, opts.max_size, log)
                    continue
                if opts.roll is None and opts.max_size is not None and \
                        _disk_bytes(out) >= opts.max_size:
                    log(f"kvprof: the session reached --max-size ({opts.max_size >> 20} MiB); "
                        "ending the recording")
                    break
                if flushes % LOST_EVERY == 0:  # live views show losses while they happen
                    lost = capture.lost() | marks.counts() | book.counts()
                    if exporter is not None:
                        exporter.lost(lost)
                    row.update(lost=json.dumps(lost))
                    write_row()
                else:
                    store.mark_end(now)
            capture.stop()
            end_ns = time.monotonic_ns()
            for src in feeds:
                src.stop(end_ns)
            _drain(store, capture, feeds, book, exporter, closed=True)
            lost = capture.lost() | marks.counts() | book.counts()
            row.update(end_ns=end_ns, status="complete", lost=json.dumps(lost),
                       sources=json.dumps([{"source": str(sp), **_status(src)}
                                           for sp, src in sources]),
                       devices=_devices_json(filters.devices or tuple(capture.seen_devices())))
            write_row()
        except (duckdb.Error, OSError) as e:
            if not _disk_full(e, out):
                raise
            # What was committed before stays; the session row says how it ended.
            _end_on_full_disk(store, out, reserve, row["end_ns"], log)
            store = None
            raise KvprofError(f"the disk holding {out} is full: recording stopped; what was "
                              "recorded up to the last flush stays readable (status 'disk "
                              "full')", EX_IOERR) from None
        _drop(reserve)
        log(f"Recorded {capture.events_total} I/Os in {(end_ns - start_ns) / 1e9:.1f} s; "
            f"lost {sum(lost.values())}. Report: kvprof report {out}")
        return out
    finally:
        # Whatever happened, what was captured so far stays readable.
        if not marks._stop.is_set():
            marks.stop(time.monotonic_ns())
        if capture is not None and not capture._stop.is_set():
            capture.stop()
        for _, src in sources:
            if not src.stopping:
                src.stop(time.monotonic_ns())
        if store is not None:
            store.close()
        if exporter is not None:
            exporter.close()
        flag.restore()
        if not started:
            # Nothing was recorded: there is nothing to keep, at most an empty store.
            (out / DB_FILE).unlink(missing_ok=True)
            if fresh_dir:
                shutil.rmtree(out, ignore_errors=True)


def _reserve(out: Path) -> Path | None:
    """A few MiB set aside in the session directory, freed when its disk fills up so that
    the session row can still say how the recording ended."""
    path = out / ".kvprof-reserve"
    try:
        with open(path, "wb") as f:
            f.write(bytes(RESERVE_BYTES))
            f.flush()
            os.fsync(f.fileno())
    except OSError:
        path.unlink(missing_ok=True)
        return None
    return path


def _drop(reserve: Path | None) -> None:
    if reserve is not None:
        reserve.unlink(missing_ok=True)


# Free bytes below which a fatal write error counts as the disk filling up: DuckDB may
# report only that an earlier write failed (its database "invalidated"), after deleting the
# temporary files it spilled a flush to, which gives back up to its memory limit.
NEARLY_FULL_BYTES = RESERVE_BYTES + (64 << 20)


def _disk_full(e: BaseException, out: Path) -> bool:
    if isinstance(e, OSError) and e.errno == errno.ENOSPC:
        return True
    if "No space left on device" in str(e):
        return True
    fatal = isinstance(e, duckdb.Error) and any(
        word in str(e) for word in ("invalidated", "FATAL", "IO Error"))
    try:
        free = shutil.disk_usage(out).free
    except OSError:
        return False
    return free < RESERVE_BYTES or (fatal and free < NEARLY_FULL_BYTES)


def _end_on_full_disk(store: Store | None, out: Path, reserve: Path | None,
                      last_flush_ns: int | None, log) -> None:
    """The writer's connection is dead after a failed write: free the reserve, reopen the
    newest segment and record the status 'disk full', ending at the last flush."""
    if store is not None:
        try:
            store.con.close()
        except duckdb.Error:
            pass
    _drop(reserve)
    try:
        con = duckdb.connect(str(segments(out)[-1]))
        try:
            # Committed to the write-ahead log, which readers replay: no checkpoint, which
            # would need more room than the reserve gives back.
            con.execute("UPDATE session SET status = 'disk full', "
                        "end_ns = greatest(coalesce(?, start_ns), start_ns)", [last_flush_ns])
        finally:
            con.close()
    except (duckdb.Error, IndexError) as e:
        first = (str(e).splitlines() or [type(e).__name__])[0]
        log(f"kvprof: the session row could not say how the recording ended: {first}")


def _drain(store: Store, capture, feeds: tuple, book: WindowBook,
           exporter=None, closed: bool = False) -> int:
    """Move what capture and the phase sources collected into the store (and the Prometheus
    exporter's totals); return the time the open windows were cut at. `closed`: the sources
    have stopped, no window is open. The aggregate tier's settled slots are folded by the
    windows the sources have sent by now (the same rule as the events'), so they wait
    `settle_s` for late windows; those still counting are folded as things stand."""
    def keep(table: str, rows) -> None:
        if rows is None:
            return
        store.append(table, rows)
        if exporter is not None:
            exporter.rows(table, rows)

    def name(dev: int) -> str:
        return capture.device(dev).name

    taken = capture.take()
    slots = taken.pop("aggregate", None)
    # One transaction: killed at any moment, the session holds every flush before, whole,
    # and the open tables never overlap the closed ones.
    with store.transaction():
        for table, rows in taken.items():
            if table in schema.OPEN_TABLES:
                store.replace(table, rows)  # the exporter counts only what is settled
            else:
                keep(table, rows)
        for src in feeds:
            for table, rows in src.take().items():
                keep(table, rows)
                if table == "phase":
                    book.add(rows)
        now = time.monotonic_ns()
        # Open windows are rewritten at every flush so live views see the phase in progress.
        opened = [] if closed else [r for src in feeds for r in src.open_rows(now)]
        store.replace("phase_open", pa.Table.from_pylist(opened, schema=schema.PHASE_OPEN)
                      if opened else None)
        book.set_open(opened)
        if slots is not None:
            agg, busy, until = book.settle(slots["agg"], slots["busy"], now, name, closed)
            keep("io_agg", agg)
            keep("device_busy", busy)
            if exporter is not None:
                # The phases' time over the span the settled rows cover, for idle ratios
                # over the same span as their busy time.
                exporter.settled(book.phase_time(exporter.settled_ns, until), until)
            # The exporter counts only what is settled.
            agg, busy = book.provisional(slots["agg_open"], slots["busy_open"], name)
            store.replace("io_agg_open", agg)
            store.replace("device_busy_open", busy)
            book.prune(now)
    if exporter is not None:
        exporter.open_windows(opened)
    return now


def _disk_bytes(out: Path, only: Path | None = None) -> int:
    """What the session (or one segment of it) takes on disk now: its DuckDB files and
    write-ahead logs."""
    total = 0
    for db in [only] if only is not None else segments(out):
        for f in (db, db.with_name(db.name + ".wal")):
            try:
                total += f.stat().st_blocks * 512
            except OSError:
                pass
    return total


def _prune(out: Path, max_size: int, log) -> None:
    """Delete the oldest segments (never the one being written) while the session takes more
    than max_size: a recorder left attached keeps the most recent stretch."""
    parts = segments(out)
    while len(parts) > 1 and _disk_bytes(out) > max_size:
        oldest = parts.pop(0)
        oldest.unlink(missing_ok=True)
        oldest.with_name(oldest.name + ".wal").unlink(missing_ok=True)
        log(f"kvprof: --max-size: deleted the oldest segment {oldest.name}")


def _status(src) -> dict:
    """What went wrong with a phase source, for the session row."""
    return {"problems": src.counts(), "last_error": src.last_error}


def _devices_json(devs: tuple[Device, ...]) -> str:
    """The traced devices, each with its lasting name (model and serial) and, where `kvprof
    calibrate` measured it, its calibration, carried in the session for its reports."""
    out = []
    for d in devs:
        key = calibrate.identity(d)["key"]
        entry = {"name": d.name, "major": d.major, "minor": d.minor, "key": key,
                 "limits": queue_limits(d)}
        found = calibrate.load(key)
        if found is not None:
            entry["calibration"] = found
        out.append(entry)
    return json.dumps(out)


ATTACH_TIMEOUT_S = 60.0


class BackgroundRecorder:
    """`record()` in a thread, for views that run next to it (the dashboard, the demo).
    Stopped by its own event, so it installs no signal handlers; hands over the store once
    the probes are attached; an error in the thread is raised again in the caller's."""

    def __init__(self, opts: RecordOptions):
        self.opts = opts
        self.stop = threading.Event()
        self.ready = threading.Event()
        self.store: Store | None = None
        self.error: BaseException | None = None
        self.log: list[str] = []
        self.on_flush: Callable[[], None] | None = None  # called after each flush
        self._thread = threading.Thread(target=self._run, name="kvprof-record", daemon=True)

    def _started(self, store: Store) -> None:
        self.store = store
        self.ready.set()

    def _flushed(self) -> None:
        if self.on_flush is not None:
            self.on_flush()

    def _run(self) -> None:
        try:
            record(self.opts, log=self.log.append, stop=self.stop, on_start=self._started,
                   on_flush=self._flushed)
        except BaseException as e:  # noqa: BLE001 - handed to the caller's thread
            self.error = e
        finally:
            self.ready.set()

    def start(self) -> None:
        self._thread.start()
        try:
            attached = self.ready.wait(ATTACH_TIMEOUT_S)
        except BaseException:
            # Ctrl-C while the probes load: no recorder may go on in the background.
            self.stop.set()
            self._thread.join(ATTACH_TIMEOUT_S)
            raise
        if not attached:
            self.finish(ATTACH_TIMEOUT_S)
            raise KvprofError(f"the recorder did not attach within {ATTACH_TIMEOUT_S:.0f} s",
                              EX_UNAVAILABLE)
        self._raise()

    def finish(self, timeout: float | None = None) -> None:
        """Stop, wait (at most `timeout` on an error path) and raise what the thread raised."""
        self.stop.set()
        self._thread.join(timeout)
        self._raise()

    def _raise(self) -> None:
        if self.error is not None:
            err, self.error = self.error, None
            raise err
