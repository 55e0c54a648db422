"""Tell a running kvprof which inference phase this process is in.

    from kvprof.markers import mark, phase
    mark("prefill")                 # from now on: prefill
    with phase("decode"):           # one complete window, sent when the block ends
        ...

Each mark is one datagram on a Unix socket (KVPROF_SOCKET, default /run/kvprof/marks.sock)
carrying this process's CLOCK_MONOTONIC time, so the window is placed where it happened,
not where it was received. Sending never blocks and never raises: with no profiler
listening the mark is simply dropped. Imports only the standard library, so an engine can
import it on its hot path.
"""
from __future__ import annotations

import json
import os
import socket
import threading
import time
from contextlib import contextmanager
from typing import Iterator

ENV_SOCKET = "KVPROF_SOCKET"
DEFAULT_SOCKET = "/run/kvprof/marks.sock"
WIRE_VERSION = 1
MAX_DATAGRAM = 4096
PHASES = ("prefill", "decode", "mixed", "idle")


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
    """One non-blocking datagram socket, reused for every mark from this process."""

    def __init__(self, path: str | None = None, engine: str = "", source: str = "manual"):
        self.path = socket_path(path)
        self.engine = engine
        self.source = source
        self._sock: socket.socket | None = None
        self._lock = threading.Lock()
        self.last_error: int | None = None  # errno of the last send that failed

    def _send(self, msg: dict) -> bool:
        data = json.dumps(msg, separators=(",", ":")).encode()
        with self._lock:
            try:
                if self._sock is None:
                    self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
                    self._sock.setblocking(False)
                self._sock.sendto(data, self.path)
                self.last_error = None
                return True
            except OSError as e:
                self.last_error = e.errno
                # No listener, socket buffer full, or permission denied: the caller is an
                # inference server and must never stall or fail because of profiling.
                return False

    def _common(self, phase: str, engine: str | None, prefill_tokens: int | None,
                decode_tokens: int | None) -> dict:
        msg: dict = {"v": WIRE_VERSION, "phase": phase, "engine": self.engine if engine is None
                     else engine, "source": self.source}
        if prefill_tokens is not None:
            msg["prefill_tokens"] = int(prefill_tokens)
        if decode_tokens is not None:
            msg["decode_tokens"] = int(decode_tokens)
        return msg

    def mark(self, phase: str, ts_ns: int | None = None, engine: str | None = None,
             prefill_tokens: int | None = None, decode_tokens: int | None = None) -> bool:
        """A transition: from ts_ns (default now) on, this engine is in `phase`."""
        msg = self._common(phase, engine, prefill_tokens, decode_tokens)
        msg["ts_ns"] = time.monotonic_ns() if ts_ns is None else int(ts_ns)
        return self._send(msg)

    def window(self, phase: str, start_ns: int, end_ns: int, engine: str | None = None,
               prefill_tokens: int | None = None, decode_tokens: int | None = None) -> bool:
        """A complete window [start_ns, end_ns)."""
        msg = self._common(phase, engine, prefill_tokens, decode_tokens)
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
