"""The marker protocol's receiving end: datagrams in, phase windows out (docs/phases.md).

Marks of one (source, engine) form back-to-back windows (`idle` only closes); complete windows
are taken as they come. The socket is a door into a root process: mode 0660, each sender's
kernel-vouched credentials (SO_PASSCRED) checked against --allow-sender and kept with its windows,
a flood bounded (MAX_ENGINES, MAX_PENDING). What is malformed, refused or over a bound is counted
and dropped; recording goes on. Holes in a sender's numbers count as `marks_undelivered`."""
from __future__ import annotations

import dataclasses
import errno
import grp
import json
import os
import pwd
import select
import socket
import stat
import struct
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa

from kvprof import privileges, schema
from kvprof.errors import EX_USAGE, KvprofError
from kvprof.markers import MAX_DATAGRAM, WIRE_VERSION
from kvprof.wakeup import Wakeup

MAX_ENGINE_LEN = 128
MAX_SID_LEN = 32
# A flood of marks (made-up engine names, complete windows) must not grow memory: engines
# with an open window, and windows waiting for the next flush (every 250 ms).
MAX_ENGINES = 1024
MAX_PENDING = 100_000
DEFAULT_MODE = 0o660
_UCRED = struct.Struct("iII")  # struct ucred: pid, uid, gid


@dataclass(frozen=True)
class Mark:
    phase: str
    engine: str
    source: str
    ts_ns: int | None = None  # a transition
    start_ns: int | None = None  # or a complete window
    end_ns: int | None = None
    prefill_tokens: int | None = None
    decode_tokens: int | None = None
    sender_pid: int | None = None  # the kernel's word for who sent it (SCM_CREDENTIALS)
    sender_uid: int | None = None
    sid: str | None = None  # the sending Marker, and its message number (gaps are losses)
    seq: int | None = None
    unsent: int = 0  # marks the sender could not make before this one, in all
    # How far the engine's own counters moved in this window: (series, amount), the series
    # among schema.MARK_SERIES.
    counters: tuple[tuple[str, float], ...] = ()


def _int(msg: dict, key: str, required: bool) -> int | None:
    v = msg.get(key)
    if v is None and not required:
        return None
    if not isinstance(v, int) or isinstance(v, bool) or v < 0 or v >= 1 << 63:
        raise ValueError(f"{key} must be a non-negative integer")
    return v


def _load(data: bytes) -> dict:
    if len(data) > MAX_DATAGRAM:
        raise ValueError("datagram too large")
    try:
        msg = json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"not JSON: {e}") from None
    except RecursionError:
        raise ValueError("not JSON: nested too deep") from None
    if not isinstance(msg, dict):
        raise ValueError("not a JSON object")
    return msg


def _counters(given: object) -> tuple[tuple[str, float], ...]:
    if not isinstance(given, dict) or len(given) > len(schema.MARK_SERIES):
        raise ValueError("bad counters")
    out = []
    for name, v in given.items():
        if name not in schema.MARK_SERIES:
            raise ValueError(f"unknown counter {name!r}")
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v < 1e15:
            raise ValueError(f"counter {name} must be a finite non-negative number")
        out.append((name, float(v)))
    return tuple(sorted(out))


def _parse(msg: object) -> Mark:
    if not isinstance(msg, dict):
        raise ValueError("not a JSON object")
    if msg.get("v") != WIRE_VERSION:
        raise ValueError(f"unsupported version {msg.get('v')!r}")
    phase = msg.get("phase")
    if not isinstance(phase, str) or phase not in schema.PHASES:
        raise ValueError(f"unknown phase {phase!r}")
    engine = msg.get("engine", "")
    source = msg.get("source", "manual")
    if not isinstance(engine, str) or len(engine) > MAX_ENGINE_LEN:
        raise ValueError("bad engine")
    if not isinstance(source, str) or source not in schema.SOURCE_RANK:
        raise ValueError(f"unknown source {source!r}")
    sid = msg.get("sid")
    if sid is not None and (not isinstance(sid, str) or len(sid) > MAX_SID_LEN):
        raise ValueError("bad sid")
    common: dict[str, Any] = dict(
        phase=phase, engine=engine, source=source,
        prefill_tokens=_int(msg, "prefill_tokens", False),
        decode_tokens=_int(msg, "decode_tokens", False),
        sid=sid, seq=_int(msg, "seq", False), unsent=_int(msg, "unsent", False) or 0)
    if "counters" in msg:
        common["counters"] = _counters(msg["counters"])
    if "ts_ns" in msg:
        return Mark(ts_ns=_int(msg, "ts_ns", True), **common)
    start, end = _int(msg, "start_ns", True), _int(msg, "end_ns", True)
    if end <= start:  # type: ignore[operator]
        raise ValueError("end_ns must be after start_ns")
    return Mark(start_ns=start, end_ns=end, **common)


def decode(data: bytes) -> Mark:
    """Parse one single-message datagram; ValueError says why it is malformed."""
    return _parse(_load(data))


def decode_all(data: bytes) -> list[Mark]:
    """Parse a datagram holding one message or a batch (`{"v": 1, "batch": [...]}`, what a
    sender's backlog sends). All or nothing: one bad message makes the datagram malformed."""
    msg = _load(data)
    if "batch" not in msg:
        return [_parse(msg)]
    batch = msg["batch"]
    if msg.get("v") != WIRE_VERSION or not isinstance(batch, list) or not batch:
        raise ValueError("bad batch")
    return [_parse(m) for m in batch]


class SenderSequences:
    """What each sender numbered but this receiver never got (the holes in its sequence
    between the first and the last message seen), and what it says it could not send at all
    meanwhile (its `unsent` count, which every message carries). A sender is its Marker's id
    under the kernel's pid, so a forged id cannot hide another process's holes."""

    def __init__(self) -> None:
        # first seq, last seq, messages seen, unsent at the first, unsent at the last
        self._seen: dict[tuple[int | None, str], list[int]] = {}
        self.untracked = 0

    def add(self, pid: int | None, m: Mark) -> None:
        if m.sid is None or m.seq is None:
            return
        key = (pid, m.sid)
        s = self._seen.get(key)
        if s is None:
            if len(self._seen) >= MAX_ENGINES:
                self.untracked += 1
                return
            self._seen[key] = [m.seq, m.seq, 1, m.unsent, m.unsent]
            return
        if m.seq < s[0]:
            s[0], s[3] = m.seq, m.unsent
        if m.seq > s[1]:
            s[1], s[4] = m.seq, m.unsent
        s[2] += 1

    def lost(self) -> int:
        return sum(max(0, s[1] - s[0] + 1 - s[2]) for s in self._seen.values())

    def unsent(self) -> int:
        return sum(max(0, s[4] - s[3]) for s in self._seen.values())


class WindowBuilder:
    """Turns marks into closed phase rows. Not thread-safe: one owner feeds it."""

    def __init__(self) -> None:
        self.rows: list[dict] = []
        # Each engine's current phase: since when, and the mark (a transition) that began it.
        self.open: dict[tuple[str, str], tuple[int, Mark]] = {}
        self.out_of_order = 0
        self.dropped = 0  # past MAX_ENGINES or MAX_PENDING

    def _row(self, m: Mark, start: int, end: int) -> dict:
        return {"start_ns": start, "end_ns": end, "phase": m.phase, "source": m.source,
                "engine": m.engine, "gpu": None, "prefill_tokens": m.prefill_tokens,
                "decode_tokens": m.decode_tokens, "confidence": 1.0,
                "sender_pid": m.sender_pid, "sender_uid": m.sender_uid}

    def add(self, m: Mark) -> bool:
        """Take a mark; True when it switched its engine's current phase."""
        if len(self.rows) >= MAX_PENDING:
            self.dropped += 1
            return False
        if m.ts_ns is None:
            if m.phase != "idle":
                self.rows.append(self._row(m, m.start_ns, m.end_ns))  # type: ignore[arg-type]
            return False
        key = (m.source, m.engine)
        if key not in self.open and m.phase != "idle" and len(self.open) >= MAX_ENGINES:
            self.dropped += 1
            return False
        prev = self.open.get(key)
        if prev is not None:
            since, began = prev
            if m.ts_ns < since:
                self.out_of_order += 1
                return False
            if m.ts_ns > since:
                self.rows.append(self._row(began, since, m.ts_ns))
            del self.open[key]
        if m.phase != "idle":
            self.open[key] = (m.ts_ns, m)
        return True

    def open_rows(self, now_ns: int) -> list[dict]:
        """The open windows as rows ending now (not consumed: they go on)."""
        return [self._row(m, since, now_ns) for since, m in self.open.values()
                if now_ns > since]

    def close_all(self, end_ns: int) -> None:
        for since, m in self.open.values():
            if end_ns > since:
                self.rows.append(self._row(m, since, end_ns))
        self.open.clear()

    def take(self) -> pa.Table | None:
        rows, self.rows = self.rows, []
        return pa.Table.from_pylist(rows, schema=schema.PHASE) if rows else None


class CounterBook:
    """The engine counters that windows carry, as `engine_metric` rows: each sender's running
    total per series, a row at the end of every window that moved it, and a zero at the start
    of the first, so that a session's figures hold every step it received. Not thread-safe:
    one owner feeds it."""

    def __init__(self) -> None:
        self._totals: dict[tuple[int | None, str, str, str], float] = {}
        self.rows: list[dict] = []
        self.dropped = 0  # past MAX_ENGINES senders or MAX_PENDING rows

    def add(self, m: Mark) -> None:
        if not m.counters:
            return
        if len(self.rows) + 2 * len(m.counters) > MAX_PENDING or \
                len(self._totals) + len(m.counters) > MAX_ENGINES * len(schema.MARK_SERIES):
            self.dropped += 1
            return
        start = m.ts_ns if m.ts_ns is not None else m.start_ns
        end = m.ts_ns if m.ts_ns is not None else m.end_ns
        labels = json.dumps({"sender": m.sid or ""})
        for name, amount in m.counters:
            key = (m.sender_pid, m.sid or "", m.engine, name)
            if key not in self._totals:
                self._totals[key] = 0.0
                self.rows.append({"ts_ns": start, "engine": m.engine, "name": name,
                                  "labels": labels, "value": 0.0})
            self._totals[key] += amount
            self.rows.append({"ts_ns": end, "engine": m.engine, "name": name,
                              "labels": labels, "value": self._totals[key]})

    def take(self) -> pa.Table | None:
        rows, self.rows = self.rows, []
        return pa.Table.from_pylist(rows, schema=schema.ENGINE_METRIC) if rows else None


def _claim(path: Path) -> None:
    """Remove a stale socket left by a dead recorder; refuse to steal a live one."""
    try:
        st = path.lstat()
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(st.st_mode):
        raise KvprofError(f"marker socket path {path} exists and is not a socket", EX_USAGE)
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    try:
        probe.connect(str(path))
    except OSError as e:
        if e.errno in (errno.ECONNREFUSED, errno.ENOENT):
            path.unlink(missing_ok=True)
            return
        raise KvprofError(f"marker socket {path}: {e.strerror}", EX_USAGE) from None
    finally:
        probe.close()
    raise KvprofError(f"another kvprof is already listening on {path}; pick another with "
                      "--socket", EX_USAGE)


def group_id(spec: str) -> int:
    """A group by name or number, or a one-line error."""
    try:
        return int(spec) if spec.isdigit() else grp.getgrnam(spec).gr_gid
    except KeyError:
        raise KvprofError(f"--socket-group {spec!r}: no such group", EX_USAGE) from None


def user_id(spec: str) -> int:
    """A user by name or number, or a one-line error."""
    try:
        return int(spec) if spec.isdigit() else pwd.getpwnam(spec).pw_uid
    except KeyError:
        raise KvprofError(f"--allow-sender {spec!r}: no such user", EX_USAGE) from None


class MarkServer:
    """Receives marks in a thread; the recorder takes closed windows with `take()`.
    `mode`, `gid`: the socket file's permissions and group; `allow`: the uids whose marks
    are taken (root's always; empty: whoever the file's permissions let send)."""

    def __init__(self, path: str, mode: int = DEFAULT_MODE, gid: int | None = None,
                 allow: tuple[int, ...] = ()):
        self.path = Path(path)
        self.allow = frozenset(allow) | {0} if allow else frozenset()
        self.builder = WindowBuilder()
        self.senders = SenderSequences()
        self.counters = CounterBook()
        self.received = 0
        self.malformed = 0
        self.refused = 0
        self._lock = threading.Lock()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        _claim(self.path)
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        try:
            self.sock.bind(str(self.path))
        except OSError as e:
            raise KvprofError(f"cannot listen for marks on {self.path}: {e.strerror}",
                              EX_USAGE) from None
        # Owner and one group only by default: any local user able to write here could
        # steer a root profiler's session. Engines running as another user are given the
        # group (--socket-group) or a wider mode on purpose (--socket-mode).
        try:
            os.chmod(self.path, mode)
            if gid is not None:
                os.chown(self.path, -1, gid)
        except OSError as e:
            self.sock.close()
            self.path.unlink(missing_ok=True)
            raise KvprofError(f"marker socket {self.path}: {e.strerror}", EX_USAGE) from None
        # The kernel attaches each sender's pid, uid and gid (it checks them: no forging).
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
        # Waits for a mark or for stop(), never on a timer: a recorder left attached to an
        # idle server wakes for nothing.
        self.sock.setblocking(False)
        self._stop = Wakeup()
        self._thread = threading.Thread(target=self._loop, name="kvprof-marks", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _recv(self) -> tuple[bytes, tuple[int, int] | None]:
        """One datagram (MAX_DATAGRAM + 1 bytes at most: longer ones read as too large) and
        its sender's (pid, uid)."""
        data, anc, _flags, _ = self.sock.recvmsg(MAX_DATAGRAM + 1,
                                                 socket.CMSG_SPACE(_UCRED.size))
        for level, kind, payload in anc:
            if level == socket.SOL_SOCKET and kind == socket.SCM_CREDENTIALS and \
                    len(payload) >= _UCRED.size:
                pid, uid, _gid = _UCRED.unpack_from(payload)
                return data, (pid, uid)
        return data, None

    def _loop(self) -> None:
        # This thread parses what other users send: whatever the recorder holds, it keeps
        # only what writing the probes' phase map takes (nothing since Linux 6.5), and drops
        # the rest itself, as it starts before the probes attach.
        try:
            privileges.drop_for_map_writer()
        except OSError:
            pass  # (a sandbox that forbids capset: nothing to give up there)
        while not self._stop.is_set():
            try:
                sock = self.sock.fileno()
                ready, _, _ = select.select([sock, self._stop.fileno()], [], [])
                if sock not in ready:
                    continue  # stop()
                data, cred = self._recv()
            except (BlockingIOError, InterruptedError):
                continue
            except (OSError, ValueError):
                break
            self._handle(data, cred)

    def _handle(self, data: bytes, cred: tuple[int, int] | None = None) -> None:
        with self._lock:
            self.received += 1
            if self.allow and (cred is None or cred[1] not in self.allow):
                self.refused += 1
                return
            try:
                marks = decode_all(data)
            except Exception:  # noqa: BLE001 - any input: this thread must outlive it
                self.malformed += 1
                return
            for m in marks:
                if cred is not None:
                    m = dataclasses.replace(m, sender_pid=cred[0], sender_uid=cred[1])
                self.senders.add(m.sender_pid, m)
                self.builder.add(m)
                self.counters.add(m)

    def take(self) -> dict[str, pa.Table]:
        with self._lock:
            tables = {"phase": self.builder.take(), "engine_metric": self.counters.take()}
        return {name: rows for name, rows in tables.items() if rows is not None}

    def open_rows(self, now_ns: int) -> list[dict]:
        with self._lock:
            return self.builder.open_rows(now_ns)

    def counts(self) -> dict[str, int]:
        with self._lock:
            return {"marks_malformed": self.malformed,
                    "marks_out_of_order": self.builder.out_of_order,
                    "marks_refused": self.refused,
                    "marks_dropped": self.builder.dropped + self.counters.dropped,
                    "marks_undelivered": self.senders.lost(),
                    "marks_unsent": self.senders.unsent()}

    @property
    def stopping(self) -> bool:
        """Whether stop() has been called (its windows are closed once, as a phase source's)."""
        return self._stop.is_set()

    def stop(self, end_ns: int) -> None:
        """Stop listening and close every open window at end_ns."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
        self._stop.close()
        # Marks already queued on the socket still count.
        while True:
            try:
                data, cred = self._recv()
            except OSError:
                break
            self._handle(data, cred)
        self.sock.close()
        self.path.unlink(missing_ok=True)
        with self._lock:
            self.builder.close_all(end_ns)
