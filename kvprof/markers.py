"""Tell a running kvprof which inference phase this process is in (docs/phases.md):
`mark("prefill")` from now on, `with phase("decode"): ...` one window sent as the block ends.

Each mark is one datagram on a Unix socket (KVPROF_SOCKET, default /run/kvprof/marks.sock)
carrying this process's CLOCK_MONOTONIC time, so the window is placed where it happened, not
where it was received. Sending never blocks and never raises (`Marker`). Imports only the
standard library, so an engine can import it on its hot path."""
from __future__ import annotations

import errno
import json
import os
import socket
import threading
import time
from collections import deque
from contextlib import contextmanager
from typing import Iterator, Mapping

ENV_SOCKET = "KVPROF_SOCKET"
DEFAULT_SOCKET = "/run/kvprof/marks.sock"
WIRE_VERSION = 1
MAX_DATAGRAM = 4096
PHASES = ("prefill", "decode", "mixed", "idle")
# Several messages in one datagram: {"v": 1, "batch": [message, ...]}.
_BATCH_HEAD = b'{"v":%d,"batch":' % WIRE_VERSION


def step_phase(prefill_tokens: int, decode_tokens: int) -> str:
    """A step's label: mixed when it carries both (chunked prefill), else the side it has."""
    if prefill_tokens and decode_tokens:
        return "mixed"
    if prefill_tokens:
        return "prefill"
    if decode_tokens:
        return "decode"
    return "idle"


def socket_path(path: str | None = None) -> str:
    return path or os.environ.get(ENV_SOCKET) or DEFAULT_SOCKET


class Marker:
    """One sender: a socket reused for every mark from this process, and a backlog.

    A mark is one non-blocking `sendto` on the caller's thread. When the receiver's queue is
    full (`net.unix.max_dgram_qlen` datagrams, 10 by default), it waits in a bounded backlog
    that a daemon thread sends, many to a datagram. What a listening receiver still misses is
    counted in `lost`, and each message's sender id and sequence put the holes in the session's
    loss counts too. With nobody listening messages are dropped uncounted: no session lost them."""

    backlog_max = 10_000

    def __init__(self, path: str | None = None, engine: str = "", source: str = "manual",
                 send_timeout_s: float = 1.0):
        self.path = socket_path(path)
        self.engine = engine
        self.source = source
        self.send_timeout_s = send_timeout_s
        # Distinct per sender, so the receiver keeps one sequence per Marker even when a
        # process has several.
        self.sid = os.urandom(6).hex()
        self.seq = 0
        self.lost = 0  # messages a listening receiver never got, as far as this side knows
        # What the caller had to mark and could not (e.g. an engine step with no timing):
        # carried in every message, so the receiver counts those too.
        self.unsent = 0
        self.last_error: int | None = None  # errno of the last send that failed
        self._sock: socket.socket | None = None
        self._lock = threading.Lock()
        self._backlog: deque[bytes] = deque()
        self._wake = threading.Condition(self._lock)
        self._sending = False  # the backlog thread holds messages not yet sent
        self._thread: threading.Thread | None = None

    def _send(self, msg: dict) -> bool:
        with self._lock:
            self.seq += 1
            msg["sid"], msg["seq"] = self.sid, self.seq
            if self.unsent:
                msg["unsent"] = self.unsent
            data = json.dumps(msg, separators=(",", ":")).encode()
            if self._backlog or self._sending:
                return self._queue(data)  # keep the order: behind what waits
            try:
                if self._sock is None:
                    self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
                    self._sock.setblocking(False)
                self._sock.sendto(data, self.path)
                self.last_error = None
                return True
            except OSError as e:
                self.last_error = e.errno
                if e.errno in (errno.EAGAIN, errno.ENOBUFS):
                    return self._queue(data)
                # No listener, or not allowed to send: the caller is an inference server
                # and must never stall or fail because of profiling.
                return False

    def _queue(self, data: bytes) -> bool:
        """Under the lock: hand a message to the backlog thread."""
        if len(self._backlog) >= self.backlog_max:
            self.lost += 1
            return False
        self._backlog.append(data)
        if self._thread is None:
            self._thread = threading.Thread(target=self._drain, name="kvprof-marker",
                                            daemon=True)
            self._thread.start()
        self._wake.notify()
        return True

    def _take_batch(self) -> list[bytes]:
        """Under the lock: as many waiting messages as one datagram holds."""
        batch: list[bytes] = []
        size = len(_BATCH_HEAD) + 2
        while self._backlog and size + len(self._backlog[0]) + 1 <= MAX_DATAGRAM:
            data = self._backlog.popleft()
            batch.append(data)
            size += len(data) + 1
        if not batch and self._backlog:  # (a message alone over the limit: sent as it is)
            batch.append(self._backlog.popleft())
        return batch

    def _send_waiting(self, sock: socket.socket, data: bytes) -> None:
        """Send, waiting up to send_timeout_s for room in the receiver's queue. poll() calls an
        unconnected datagram socket writable whatever that queue holds, so a timed send would
        spin a CPU of the engine's for as long as the receiver is stalled; the wait is a
        sleep instead, doubling from 1 ms to 50 ms."""
        deadline = time.monotonic() + self.send_timeout_s
        pause = 0.001
        while True:
            try:
                sock.sendto(data, self.path)
                return
            except OSError as e:
                if e.errno not in (errno.EAGAIN, errno.ENOBUFS) or time.monotonic() >= deadline:
                    raise
            time.sleep(pause)
            pause = min(2 * pause, 0.05)

    def _drain(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        sock.setblocking(False)
        while True:
            with self._lock:
                while not self._backlog:
                    self._sending = False
                    self._wake.wait()
                self._sending = True
                batch = self._take_batch()
            data = batch[0] if len(batch) == 1 else \
                _BATCH_HEAD + b"[" + b",".join(batch) + b"]}"
            try:
                self._send_waiting(sock, data)
            except OSError as e:
                with self._lock:
                    self.last_error = e.errno
                    if e.errno in (errno.ENOENT, errno.ECONNREFUSED):
                        self._backlog.clear()  # the receiver is gone: nobody to lose them
                    elif e.errno in (errno.EAGAIN, errno.ENOBUFS):
                        # Its queue stayed full for send_timeout_s: a receiver starved of
                        # CPU, still there. Sent again, in order; the backlog's bound is
                        # what counts losses, and this thread is not the engine's.
                        self._backlog.extendleft(reversed(batch))
                    else:
                        self.lost += len(batch)

    def skip(self) -> None:
        """Count one mark the caller could not make; the next message tells the receiver."""
        with self._lock:
            self.unsent += 1

    def flush(self, timeout_s: float = 5.0) -> bool:
        """Wait until the backlog is sent (or counted lost); True when it is empty."""
        deadline = time.monotonic() + timeout_s
        while True:
            with self._lock:
                if not self._backlog and not self._sending:
                    return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.005)

    def _common(self, phase: str, engine: str | None, prefill_tokens: int | None,
                decode_tokens: int | None, counters: Mapping[str, float] | None = None) -> dict:
        msg: dict = {"v": WIRE_VERSION, "phase": phase, "engine": self.engine if engine is None
                     else engine, "source": self.source}
        if prefill_tokens is not None:
            msg["prefill_tokens"] = int(prefill_tokens)
        if decode_tokens is not None:
            msg["decode_tokens"] = int(decode_tokens)
        if counters:
            msg["counters"] = dict(counters)
        return msg

    def mark(self, phase: str, ts_ns: int | None = None, engine: str | None = None,
             prefill_tokens: int | None = None, decode_tokens: int | None = None) -> bool:
        """A transition: from ts_ns (default now) on, this engine is in `phase`."""
        msg = self._common(phase, engine, prefill_tokens, decode_tokens)
        msg["ts_ns"] = time.monotonic_ns() if ts_ns is None else int(ts_ns)
        return self._send(msg)

    def window(self, phase: str, start_ns: int, end_ns: int, engine: str | None = None,
               prefill_tokens: int | None = None, decode_tokens: int | None = None,
               counters: Mapping[str, float] | None = None) -> bool:
        """A complete window [start_ns, end_ns). `counters`: how far the engine's own counters
        moved in it (series the registry lists for senders on this socket)."""
        msg = self._common(phase, engine, prefill_tokens, decode_tokens, counters)
        msg["start_ns"], msg["end_ns"] = int(start_ns), int(end_ns)
        return self._send(msg)

    @contextmanager
    def phase(self, phase: str, engine: str | None = None, prefill_tokens: int | None = None,
              decode_tokens: int | None = None) -> Iterator[None]:
        start = time.monotonic_ns()
        try:
            yield
        finally:
            self.window(phase, start, time.monotonic_ns(), engine, prefill_tokens, decode_tokens)

    def close(self) -> None:
        """Send what waits (briefly), then close the socket."""
        self.flush(timeout_s=self.send_timeout_s)
        with self._lock:
            if self._sock is not None:
                self._sock.close()
                self._sock = None


_default: Marker | None = None


def _marker() -> Marker:
    global _default
    if _default is None or _default.path != socket_path():
        _default = Marker()
    return _default


def mark(phase: str, **kw) -> bool:
    return _marker().mark(phase, **kw)


def window(phase: str, start_ns: int, end_ns: int, **kw) -> bool:
    return _marker().window(phase, start_ns, end_ns, **kw)


def phase(name: str, **kw):
    return _marker().phase(name, **kw)
