"""`record --prometheus [ADDR:]PORT`: the recording's exact totals as Prometheus metrics.

Fed like the store at each drain (the aggregate tier's seconds, phase windows, loss counts), it
keeps running totals, rendered when scraped; they never go down (segments pruned by --max-size
take nothing away) and equal the report's `exact` section, phases folded per issue slot alike.
A second is published once folded for good, `record --settle` seconds after it. Labels are
bounded: never a pid, a file or a path. The metrics and their labels: docs/fleet.md."""
from __future__ import annotations

import socket
import socketserver
import threading
import time
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

import pyarrow as pa
from prometheus_client import make_wsgi_app
from prometheus_client.core import (
    CollectorRegistry,
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
)

from kvprof import schema
from kvprof.analysis.correlate import idle_pct
from kvprof.errors import EX_USAGE, KvprofError

# Latency buckets: the kernel's log2 slots of service time (slot i holds [2^(i-1), 2^i) ns),
# from 1 µs up; each bucket's bound is its slot's upper end, so every count is exact.
FIRST_SLOT = 10


class _Server(socketserver.ThreadingMixIn, WSGIServer):
    daemon_threads = True  # a scrape in progress does not hold up the end of a recording


class _Quiet(WSGIRequestHandler):
    def log_message(self, *args) -> None:
        pass  # a line per scrape would bury the recorder's own


def parse_listen(text: str) -> tuple[str, int]:
    """`PORT` (all addresses) or `ADDR:PORT`, `[v6]:PORT`."""
    addr, _, port = text.rpartition(":")
    addr = addr.strip("[]") or "0.0.0.0"
    try:
        n = int(port)
    except ValueError:
        n = -1
    if not 0 <= n <= 65535:
        raise KvprofError(f"--prometheus {text!r}: expected PORT or ADDR:PORT", EX_USAGE)
    return addr, n


class Exporter:
    """Running totals of one recording, rendered at each scrape."""

    def __init__(self, info: dict):
        self.info = info  # version, kernel, host, session
        self._lock = threading.Lock()
        self._io: dict[tuple, list] = {}  # (phase, op, layer, dev) -> [ios, bytes, ns, hist]
        self._busy: dict[tuple[str, str], int] = {}  # (phase, dev) -> ns
        self._closed: dict[tuple[str, str], int] = {}  # (phase, source) -> ns of closed windows
        self._open: dict[tuple[str, str], int] = {}  # the same of the open ones, last cut
        self._lost: dict[str, int] = {}
        # (cache, op) -> [calls, bytes, bytes the device supplied]: the KV cache files'
        # read and write calls (syscall layer), over the session.
        self._caches: dict[tuple[str, str], list[int]] = {}
        self._settled: dict[str, int] = {p: 0 for p in schema.PHASES}  # phase time folded
        self.settled_ns = time.monotonic_ns()  # ... up to here
        self.server: WSGIServer | None = None
        self._thread: threading.Thread | None = None
        self.port = 0

    def bind(self, listen: str) -> None:
        """Take the port (before the probes attach: a taken one fails first). Requests are
        served only from `start()`, whose threads start after the recorder has dropped its
        privileges (kvprof.privileges)."""
        addr, port = parse_listen(listen)
        registry = CollectorRegistry(auto_describe=False)
        registry.register(self)
        try:
            family, _, _, _, sockaddr = socket.getaddrinfo(
                addr, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
            server = type("_Server", (_Server,), {"address_family": family})
            self.server = make_server(str(sockaddr[0]), port, make_wsgi_app(registry), server,
                                      handler_class=_Quiet)
        except OSError as e:
            raise KvprofError(f"--prometheus {listen}: {e.strerror}", EX_USAGE) from None
        self.port = self.server.server_port

    def start(self) -> None:
        assert self.server is not None  # bind() made it or raised
        self._thread = threading.Thread(target=self.server.serve_forever,
                                        name="kvprof-prometheus", daemon=True)
        self._thread.start()

    def close(self) -> None:
        if self.server is not None:
            if self._thread is not None:  # shutdown() waits for a loop that must be running
                self.server.shutdown()
            self.server.server_close()
            self.server = None

    # -- fed by the recorder -------------------------------------------------------------------
    def rows(self, table: str, rows) -> None:
        if table == "io_agg":
            self._agg(rows)
        elif table == "device_busy":
            cols = pa.table(rows) if isinstance(rows, pa.RecordBatch) else rows
            with self._lock:
                for p, dev, ns in zip(*(_col(cols, c) for c in ("phase", "dev_name",
                                                                 "busy_ns"))):
                    key = (p, dev)
                    self._busy[key] = self._busy.get(key, 0) + int(ns)
        elif table == "io":
            self._files(rows)
        elif table == "phase":
            with self._lock:
                for r in _records(rows):
                    key = (r["phase"], r["source"])
                    self._closed[key] = self._closed.get(key, 0) + r["end_ns"] - r["start_ns"]

    def open_windows(self, rows: list[dict]) -> None:
        opened: dict[tuple[str, str], int] = {}
        for r in rows:
            key = (r["phase"], r["source"])
            opened[key] = opened.get(key, 0) + r["end_ns"] - r["start_ns"]
        with self._lock:
            self._open = opened

    def settled(self, phase_ns: dict[str, int], until_ns: int) -> None:
        """The phases' time from the last settled point to `until_ns`, which the io and busy
        rows fed so far cover."""
        with self._lock:
            for p, ns in phase_ns.items():
                self._settled[p] += ns
            self.settled_ns = max(self.settled_ns, until_ns)

    def lost(self, counts: dict[str, int]) -> None:
        with self._lock:
            self._lost = dict(counts)

    def _files(self, rows) -> None:
        """What a KV cache's files' calls did. Of a read, the device supplied all of it with
        O_DIRECT, else what the call put into the page cache (the kernel's count; reads of
        sessions without that count are left out of the device's share)."""
        cols = pa.table(rows) if isinstance(rows, pa.RecordBatch) else rows
        if "cache" not in cols.column_names:
            return
        names = ("layer", "op", "cache", "bytes", "flags", "fetched_bytes")
        with self._lock:
            for layer, op, cache, nbytes, flags, fetched in zip(*(_col(cols, c)
                                                                   for c in names)):
                if layer != "syscall" or not cache or op not in ("read", "write"):
                    continue
                acc = self._caches.setdefault((cache, op), [0, 0, 0])
                acc[0] += 1
                acc[1] += int(nbytes or 0)
                if op == "read":
                    acc[2] += int(nbytes or 0) if int(flags or 0) & schema.FLAG_DIRECT \
                        else int(fetched or 0)

    def _agg(self, rows) -> None:
        cols = pa.table(rows) if isinstance(rows, pa.RecordBatch) else rows
        names = ("phase", "op", "layer", "dev_name", "ios", "bytes", "service_ns",
                 "service_hist")
        with self._lock:
            for p, op, layer, dev, ios, nbytes, ns, hist in zip(*(_col(cols, c)
                                                                  for c in names)):
                acc = self._io.setdefault((p, op, layer, dev or ""), [0, 0, 0, None])
                acc[0] += int(ios)
                acc[1] += int(nbytes)
                acc[2] += int(ns)
                hist = list(hist or [])
                if acc[3] is None:
                    acc[3] = hist
                else:
                    if len(hist) > len(acc[3]):
                        acc[3] += [0] * (len(hist) - len(acc[3]))
                    for i, n in enumerate(hist):
                        acc[3][i] += int(n)

    # -- scraped -----------------------------------------------------------------------------
    def collect(self):
        with self._lock:
            io = {k: (v[0], v[1], v[2], list(v[3] or [])) for k, v in self._io.items()}
            busy, lost = dict(self._busy), dict(self._lost)
            phase_ns = {k: self._closed.get(k, 0) + self._open.get(k, 0)
                        for k in set(self._closed) | set(self._open)}
            settled = dict(self._settled)
            caches = {k: list(v) for k, v in self._caches.items()}
        labels = ["phase", "op", "layer", "device"]
        nbytes = CounterMetricFamily("kvprof_io_bytes", "Bytes of block and io_uring requests "
                                     "completed, per phase at issue (exact, in-kernel)",
                                     labels=labels)
        ops = CounterMetricFamily("kvprof_io_ops", "Block and io_uring requests completed, per "
                                  "phase at issue (exact, in-kernel)", labels=labels)
        lat = HistogramMetricFamily("kvprof_io_latency_seconds", "Device service time of the "
                                    "requests (block: issue to completion; io_uring: submit to "
                                    "completion), from the kernel's log2 histogram",
                                    labels=labels)
        for (p, op, layer, dev), (n, b, ns, hist) in sorted(io.items()):
            key = [p, op, layer, dev]
            nbytes.add_metric(key, b)
            ops.add_metric(key, n)
            # (the histogram's count is of the requests with a service time: a completion the
            # kernel never traced has none)
            lat.add_metric(key, _buckets(hist), sum_value=ns / 1e9)
        yield from (nbytes, ops, lat)
        b = CounterMetricFamily("kvprof_device_busy_seconds", "Time each block device had a "
                                "request in flight, per phase", labels=["phase", "device"])
        for (p, dev), ns in sorted(busy.items()):
            b.add_metric([p, dev], ns / 1e9)
        yield b
        ps = CounterMetricFamily("kvprof_phase_seconds", "Time in each phase, by the source "
                                 "that saw it", labels=["phase", "source"])
        for (p, src), ns in sorted(phase_ns.items()):
            ps.add_metric([p, src], ns / 1e9)
        yield ps
        idle = GaugeMetricFamily("kvprof_storage_idle_ratio", "Share of the phase's time with "
                                 "no block request in flight on the device (settled seconds)",
                                 labels=["phase", "device"])
        for dev in sorted({d for _, d in busy}):
            for p in schema.PHASES:
                pct = idle_pct(busy.get((p, dev), 0) / 1e9, settled[p] / 1e9)
                if pct is not None:
                    idle.add_metric([p, dev], pct / 100)
        yield idle
        calls = CounterMetricFamily("kvprof_kv_cache_calls", "Read and write calls on the "
                                    "KV cache files (syscall layer), by cache", labels=["cache",
                                                                                      "op"])
        cb = CounterMetricFamily("kvprof_kv_cache_bytes", "Bytes the KV cache files' read and "
                                 "write calls did, by cache: beside the engine's own count of "
                                 "its offload", labels=["cache", "op"])
        dev = CounterMetricFamily("kvprof_kv_cache_device_read_bytes", "Of the KV cache files' "
                                  "reads, the bytes the device supplied (the rest came from "
                                  "the page cache)", labels=["cache"])
        for (cache, op), (n, nb, from_dev) in sorted(caches.items()):
            calls.add_metric([cache, op], n)
            cb.add_metric([cache, op], nb)
            if op == "read":
                dev.add_metric([cache], from_dev)
        yield from (calls, cb, dev)
        lo = CounterMetricFamily("kvprof_events_lost", "Events kvprof could not record, by "
                                 "reason", labels=["reason"])
        for reason, n in sorted(lost.items()):
            lo.add_metric([reason], n)
        yield lo
        info = GaugeMetricFamily("kvprof_build_info", "kvprof's version and the host and "
                                 "session it records", labels=list(self.info))
        info.add_metric(list(self.info.values()), 1)
        yield info


def _buckets(hist: list[int]) -> list[tuple[str, int]]:
    """Cumulative (le, count) pairs from log2 slots: slot i counts values below 2^i ns."""
    out, cum = [], 0
    for i, n in enumerate(hist):
        cum += int(n)
        if i >= FIRST_SLOT:
            out.append((repr((1 << i) / 1e9), cum))
    out.append(("+Inf", cum))
    return out


def _col(table, name: str) -> list:
    return table.column(name).to_pylist()


def _records(rows) -> list[dict]:
    if isinstance(rows, (pa.Table, pa.RecordBatch)):
        return rows.to_pylist()
    return list(rows)
