"""One recording, from attaching the probes to the session's last row (`Recorder`,
`record`)."""
from __future__ import annotations

import json
import platform
import shutil
import socket
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import duckdb

from kvprof import __version__, caches, calibration, privileges, schema, system
from kvprof.analysis.fold import WindowBook
from kvprof.capture.nvml import nvml_available
from kvprof.capture.sampling import row as sampling_row
from kvprof.devices import Device, queue_limits
from kvprof.errors import EX_IOERR, EX_USAGE, KvprofError
from kvprof.markers import socket_path
from kvprof.phases import registry
from kvprof.recorder.drain import drain
from kvprof.recorder.options import RecordOptions, default_out, resolve_filters
from kvprof.recorder.space import (
    disk_bytes,
    disk_full,
    drop_reserve,
    end_on_full_disk,
    prune,
    reserve_space,
)
from kvprof.recorder.stop import Stop, StopFlag
from kvprof.schema import SLOT_NS
from kvprof.store.session import DB_FILE, Store, recorder_identity, segment_path

if TYPE_CHECKING:
    from kvprof.capture.ebpf import Capture, CaptureFilter
    from kvprof.phases.mark_server import MarkServer
    from kvprof.views.prometheus import Exporter


# Seconds between flushes into the store. A flush costs the recorder a fixed amount of DuckDB
# work whatever it carries, so a recording nobody watches flushes half as often as one a live
# view reads (`kvprof top`); 0.5 s still keeps a killed recording's loss under a second.
FLUSH_INTERVAL_S = 0.5
LIVE_FLUSH_INTERVAL_S = 0.25
LOST_EVERY = 4  # flushes between updates of the session row's loss counts


@dataclass(frozen=True)
class _Attached:
    """The parts `open()` made that the later steps (`run`, `flush`, `roll`, `finish`) use,
    set together once all exist. `close()` asks instead of the recorder's own `marks` and
    `capture`, one by one: it also runs after an `open()` that stopped part way."""

    filters: CaptureFilter
    marks: MarkServer
    capture: Capture


class Recorder:
    """One recording, in steps: `open()` checks the host, attaches the probes and writes the
    session row; `flush()` moves one drain into the store; `roll()` goes on in the next
    segment; `finish()` stops capture and says how the session ended. `close()` is the one
    way out, whichever way the recording ends (a usual stop, a signal, a full disk, an
    error): it stops what still runs and closes the store, which keeps every flush committed
    so far. `stop`: the event that ends the recording; without one, SIGINT and SIGTERM set
    the recorder's own, from `open()` until `close()`."""

    def __init__(self, opts: RecordOptions, log: Callable[[str], None] | None = None,
                 stop: threading.Event | None = None, live: bool = False):
        self.opts = opts
        self.log = log or (lambda s: print(s, file=sys.stderr, flush=True))
        self._flag = StopFlag()
        # Without an event of the caller's, the flag's: open() has signals set it.
        self.stop: Stop = stop if stop is not None else self._flag
        self.live = live  # the store is read while it is written (`kvprof top`)
        self.out = Path(opts.out) if opts.out else default_out()
        self._attached: _Attached | None = None
        self.marks: MarkServer | None = None
        self.capture: Capture | None = None
        self.sources: list = []  # (spec, source)
        self.exporter: Exporter | None = None
        self.store: Store | None = None
        self.book = WindowBook(opts.settle_s)
        self.row: dict = {}
        self.started = False  # capture runs: from here on the session is kept
        # Set once Store.check_new accepted the directory: until then it may be a kept
        # session that close() must leave as it is.
        self._claimed = False
        self._fresh_dir = False
        self._reserve: Path | None = None
        self._flushes = 0
        self._segment = 0
        self._segment_start = 0
        self._offset = 0
        self._closed = False

    def __enter__(self) -> Recorder:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def _parts(self) -> _Attached:
        # Only the steps after open() read it.
        assert self._attached is not None, "Recorder.open() has not run"
        return self._attached

    @property
    def _store(self) -> Store:
        # None only before open() made it and once close() or a full disk ended the
        # recording, after which no step but close() runs.
        assert self.store is not None, "the recorder has no open store"
        return self.store

    @property
    def _feeds(self) -> tuple:
        return (self._parts.marks, *(s for _, s in self.sources))

    def _preflight(self) -> tuple[CaptureFilter, tuple[caches.Rule, ...]]:
        """Everything that can refuse the recording before anything is made or claimed."""
        system.require_privilege()
        system.ensure_tracefs()
        system.require_headers()
        filters = resolve_filters(self.opts)
        cache_rules = caches.parse(self.opts.caches)
        for layer in self.opts.layers:
            # (gds attaches to USDT probes in a library, not to tracepoints.)
            missing = [t for t in system.TRACEPOINTS.get(layer, ())
                       if not system.tracepoint_available(t)]
            if missing:
                raise KvprofError(f"this kernel lacks tracepoints {', '.join(missing)}; "
                                  f"record without that layer", EX_USAGE)
        return filters, cache_rules

    def open(self, on_start: Callable[[Store], None] | None = None) -> None:
        """Preflight, claim the marker socket and the session directory, attach the probes,
        write the session row and start capture, the phase sources and the exporter.
        `on_start` gets the store once all that is done."""
        opts = self.opts
        filters, cache_rules = self._preflight()

        from kvprof.capture.bccload import bcc_version
        from kvprof.capture.ebpf import Capture
        from kvprof.phases.mark_server import MarkServer, group_id, user_id

        if self.stop is self._flag:
            self._flag.install()
        self._fresh_dir = not self.out.exists()
        # Claim the marker socket first: a second recorder on the same socket fails before it
        # leaves an empty session directory behind.
        self.marks = marks = MarkServer(
            socket_path(opts.socket), opts.socket_mode,
            None if opts.socket_group is None else group_id(opts.socket_group),
            tuple(user_id(u) for u in opts.allow_senders))
        Store.check_new(self.out)
        self._claimed = True
        metrics_host = None
        if opts.prometheus is not None:
            # Bound before anything attaches: a taken port fails without leaving a session.
            from kvprof.views.prometheus import Exporter

            self.exporter = Exporter({})
            self.exporter.bind(opts.prometheus)
            metrics_host = opts.prometheus.rpartition(":")[0] or "*"
        # Marks are taken while the probes compile (the thread holds no privilege).
        marks.start()
        for spec in registry.resolve_specs(opts.phases, _gpu_present, self.log):
            try:
                self.sources.append((spec, registry.build(spec)))
            except KvprofError as e:
                if opts.phases:  # asked for by name: say so and stop
                    raise
                self.log(f"kvprof: phase source {spec} not used: {e}")
        self.sources.extend((src.name, src) for src in opts.feeds)
        self.capture = capture = Capture(opts.layers, filters, cache_rules=cache_rules,
                                         device_events=opts.events,
                                         event_rate=opts.event_rate,
                                         uring_raw=opts.io_uring_raw)
        self._attached = _Attached(filters, marks, capture)
        if opts.drop_privileges:
            self._drop_privileges(capture)
        self.store = store = Store.create(self.out, live=self.live)
        start_ns = time.monotonic_ns()
        self._offset = offset = time.time_ns() - time.monotonic_ns()
        self._segment_start = start_ns
        self.row = {
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
                                  "phase_sources": ["marks",
                                                    *(str(sp) for sp, _ in self.sources)],
                                  "caches": [[r.name, r.glob] for r in cache_rules],
                                  "device_events": opts.events,
                                  # Where io_uring requests to raw block devices (O_DIRECT)
                                  # are counted: "block" (and how many: io_uring_on_block,
                                  # brought up to date with the losses), "io_uring" too, or
                                  # nowhere (None: io_uring not traced).
                                  "io_uring_raw_devices":
                                      "block" if capture.raw_to_block else
                                      "io_uring" if "io_uring" in opts.layers else None,
                                  "event_rate": opts.event_rate if opts.events else None,
                                  "aggregate": capture.aggregate is not None,
                                  "aggregate_slot_ns": SLOT_NS,
                                  "settle_s": opts.settle_s,
                                  "recorder": recorder_identity()}),
            "lost": "{}",
            "sources": "[]",
            "status": "recording",
        }
        store.write_session(self.row)
        device_layers = set(opts.layers) & set(schema.DEVICE_LAYERS)
        if opts.events and device_layers:
            store.append("event_sampling", sampling_row(start_ns, 0))
        capture.start()
        self.started = True
        for _, src in self.sources:
            src.start()
        if self.exporter is not None:
            self.exporter.start()
        if on_start is not None:
            on_start(store)
        where = []
        if device_layers:
            where.append(", ".join(d.name for d in filters.devices) or "all block devices")
        if filters.tgids or filters.cgroup_ids:
            where.append(", ".join([*(f"pid {t}" for t in filters.tgids),
                                    *(f"cgroup {c}" for c in opts.cgroups)]))
        if self.exporter is not None:
            self.exporter.info = {"version": __version__, "kernel": self.row["kernel"],
                                  "host": self.row["host"], "session": self.row["session_id"]}
            self.exporter.settled_ns = start_ns
            self.log(f"Prometheus metrics on http://{metrics_host}:{self.exporter.port}/metrics")
        self.log(f"Tracing {'+'.join(opts.layers)} I/O on {'; '.join(where) or 'all processes'}; "
                 f"marks on {marks.path}; session {self.out}. Hit Ctrl-C to end.")
        self._reserve = reserve_space(self.out)

    def _drop_privileges(self, capture: Capture) -> None:
        # Before any other thread starts (DuckDB's workers, the sources', the drain's): each
        # copies what this one holds when it starts.
        try:
            kept = privileges.drop(privileges.needed(self.opts.layers), capture.usable)
        except OSError as e:  # a sandbox that forbids capset or prctl
            self.log(f"kvprof: privileges could not be dropped ({e}); recording with them")
            return
        if threading.current_thread() is threading.main_thread():
            held = privileges.holders()
            if held:
                self.log(f"kvprof: threads started before attaching keep privileges: "
                         f"{', '.join(held)}")
        self.log(f"kvprof: probes attached; privileges dropped (kept: {kept})")

    def run(self, on_flush: Callable[[], None] | None = None) -> None:
        """Flush every FLUSH_INTERVAL_S until `stop` is set, --duration is up or the session
        reaches --max-size, rolling segments on the way; `on_flush` is called after each."""
        opts = self.opts
        deadline = None if opts.duration_s is None else time.monotonic() + opts.duration_s
        interval = LIVE_FLUSH_INTERVAL_S if self.live else FLUSH_INTERVAL_S
        while not self.stop.is_set():
            timeout = interval
            if deadline is not None:
                timeout = min(timeout, max(0.0, deadline - time.monotonic()))
            if self.stop.wait(timeout) or \
                    (deadline is not None and time.monotonic() >= deadline):
                break
            now = self.flush()
            if on_flush is not None:
                on_flush()  # a live view shows the flush now, not at its next tick
            if opts.roll is not None and \
                    disk_bytes(self.out, segment_path(self.out, self._segment)) >= opts.roll:
                self.roll(now)
                continue
            if opts.roll is None and opts.max_size is not None and \
                    disk_bytes(self.out) >= opts.max_size:
                self.log(f"kvprof: the session reached --max-size ({opts.max_size >> 20} MiB); "
                         "ending the recording")
                break

    def flush(self) -> int:
        """One drain of what capture and the phase sources collected into the store, and the
        session row brought up to it, in one transaction (a commit costs the recorder more
        than most of what it writes); returns the time the open windows were cut at, where
        the session now ends."""
        with self._writing(), self._store.transaction():
            now = drain(self._store, self._parts.capture, self._feeds, self.book, self.exporter)
            self._flushes += 1
            self.row["end_ns"] = now
            self._update_session(now)
        return now

    def roll(self, now: int) -> None:
        """Close this segment with the session row as it stands and go on in the next, from
        `now`; with --max-size, delete the oldest segments to stay under it."""
        with self._writing():
            self._counts_to_row(self._lost())
            self._write_row()
            self._store.close()
            self.store = None
            self._segment, self._segment_start = self._segment + 1, now
            self.store = store = Store.create(self.out, self._segment, live=self.live)
            self._write_row()
            sampler = self._parts.capture.sampler
            if sampler.max_rate:
                store.append("event_sampling", sampling_row(now, sampler.shift))
            if self.opts.max_size is not None:
                prune(self.out, self.opts.max_size, self.log)

    def _update_session(self, now: int) -> None:
        """The session row after a flush: where it ends, and every LOST_EVERY flushes what was
        lost, so live views show losses while they happen."""
        with self._writing():
            if self._flushes % LOST_EVERY == 0:
                lost = self._lost()
                if self.exporter is not None:
                    self.exporter.lost(lost)
                self._counts_to_row(lost)
                self._write_row()
            else:
                self._store.mark_end(now)

    def finish(self) -> None:
        """Stop capture and the phase sources, flush what they still held and mark the
        session complete with its losses and the sources' problems."""
        parts = self._parts
        capture = parts.capture
        with self._writing():
            # The sources' last readings come first (a scrape is stamped at its receipt), so
            # the session holds what the engine counted up to its end.
            for _, src in self.sources:
                src.halt()
            # The session ends where tracing starts to stop: detaching takes up to seconds,
            # in which the phase sources would go on counting what the probes no longer see.
            end_ns = time.monotonic_ns()
            capture.stop()
            for src in self._feeds:
                src.stop(end_ns)
            drain(self._store, capture, self._feeds, self.book, self.exporter, closed=True)
            lost = self._lost()
            self._counts_to_row(lost)
            self.row.update(end_ns=end_ns, status="complete",
                            sources=json.dumps([{"source": str(sp), **_status(src)}
                                                for sp, src in self.sources]),
                            devices=_devices_json(parts.filters.devices
                                                  or tuple(capture.seen_devices())))
            self._write_row()
        drop_reserve(self._reserve)
        self._reserve = None
        self.log(f"{_recorded(capture.counted(), capture.events_total)} in "
                 f"{(end_ns - self.row['start_ns']) / 1e9:.1f} s; lost {sum(lost.values())}. "
                 f"Report: kvprof report {self.out}")

    def close(self) -> None:
        """Release everything, on every way out: stop the marks, capture and sources that
        still run, close the store (committing what it holds), the exporter and the signal
        handlers, and, when capture never started, remove the empty session. Each step runs
        even when one before it failed; the first failure is raised after the last step."""
        if self._closed:
            return
        self._closed = True
        failures: list[Exception] = []

        def attempt(step: Callable[[], object]) -> None:
            try:
                step()
            except Exception as e:  # noqa: BLE001 - raised once the other steps ran
                failures.append(e)

        # Stopped before the store closes: nothing is still being taken while it does.
        marks = self.marks
        if marks is not None and not marks.stopping:
            attempt(lambda: marks.stop(time.monotonic_ns()))
        if self.capture is not None and not self.capture.stopping:
            attempt(self.capture.stop)
        for _, src in self.sources:
            if not src.ended:
                # No `src=src` binding needed: attempt() calls it in this iteration.
                attempt(lambda: src.stop(time.monotonic_ns()))
        if self.store is not None:
            store, self.store = self.store, None
            attempt(store.close)
        if self.exporter is not None:
            attempt(self.exporter.close)
        # (A full disk's path dropped it already, to write the status.)
        attempt(lambda: drop_reserve(self._reserve))
        self._reserve = None
        attempt(self._flag.restore)
        if self._claimed and not self.started:
            # Nothing was recorded: there is nothing to keep, at most an empty store.
            attempt(lambda: (self.out / DB_FILE).unlink(missing_ok=True))
            if self._fresh_dir:
                shutil.rmtree(self.out, ignore_errors=True)
        if failures:
            raise failures[0]

    @contextmanager
    def _writing(self) -> Iterator[None]:
        """Around what writes the session: a full disk ends the recording there, with what
        was committed before kept and the session row saying how it ended."""
        try:
            yield
        except (duckdb.Error, OSError) as e:
            if not disk_full(e, self.out):
                raise
            # The store's connection is dead: close() must not checkpoint it.
            store, self.store = self.store, None
            end_on_full_disk(store, self.out, self._reserve, self.row["end_ns"], self.log)
            self._reserve = None
            raise KvprofError(f"the disk holding {self.out} is full: recording stopped; what "
                              "was recorded up to the last flush stays readable (status 'disk "
                              "full')", EX_IOERR) from None

    def _counts_to_row(self, lost: dict[str, int]) -> None:
        """The session row brought up to what capture counted: the losses, and in its config
        the io_uring requests left to the block layer."""
        self.row["lost"] = json.dumps(lost)
        n = self._parts.capture.on_block()
        if n is not None:
            self.row["config"] = json.dumps({**json.loads(self.row["config"]),
                                             "io_uring_on_block": n})

    def _lost(self) -> dict[str, int]:
        parts = self._parts
        return parts.capture.lost() | parts.marks.counts() | self.book.counts()

    def _write_row(self) -> None:
        # Each segment's row starts where the segment does (store._open_segments).
        self._store.write_session({**self.row, "start_ns": self._segment_start,
                                  "start_wall_ns": self._segment_start + self._offset})


def record(opts: RecordOptions, log: Callable[[str], None] | None = None,
           stop: threading.Event | None = None,
           on_start: Callable[[Store], None] | None = None,
           on_flush: Callable[[], None] | None = None) -> Path:
    """Record one session and return its directory. `on_start` gets the store once the
    probes are attached and the session row exists (`kvprof top` reads it live through its
    own cursor); it must not keep using the store after `stop` is set."""
    with Recorder(opts, log, stop, live=on_start is not None) as recorder:
        recorder.open(on_start)
        recorder.run(on_flush)
        recorder.finish()
    return recorder.out

def _recorded(counted: dict[str, int], rows: int) -> str:
    """The closing line's count: the requests the aggregate tier counted per device layer
    (every one) and the event rows kept, which past --event-rate are a sample and with
    --no-events none; without a device layer, the rows alone."""
    if not counted:
        return f"Recorded {rows} I/Os"
    each = ", ".join(f"{n} {layer}" for layer, n in counted.items())
    return f"Counted {each} requests; kept {rows} event rows"

def _status(src) -> dict:
    """What went wrong with a phase source, and its pace where that changes, for the session
    row."""
    return {"problems": src.counts(), "last_error": src.last_error, **src.pace()}


def _devices_json(devs: tuple[Device, ...]) -> str:
    """The traced devices, each with its lasting name (model and serial) and, where `kvprof
    calibrate` measured it, its calibration, carried in the session for its reports."""
    out = []
    for d in devs:
        key = calibration.identity(d)["key"]
        entry = {"name": d.name, "major": d.major, "minor": d.minor, "key": key,
                 "limits": queue_limits(d)}
        found = calibration.load(key)
        if found is not None:
            entry["calibration"] = found
        out.append(entry)
    return json.dumps(out)


def _gpu_present() -> bool:
    """A GPU that NVML can sample, as `kvprof doctor` finds it; without one this fails fast
    (no library, or no driver) and never raises."""
    status = nvml_available()
    return status.ok and status.gpus > 0
