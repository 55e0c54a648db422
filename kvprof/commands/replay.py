"""`kvprof replay SESSION --on DEVICE_OR_DIR`: a recorded session's I/O issued again on
candidate storage, at its recorded times, while a new session is recorded there with the
recording's phase windows; `kvprof compare SESSION NEW` then sets one against the other.

What is issued, one of two layers:
- block (a device, or a directory without file calls to replay): every block request of the
  chosen phases (op, size, offset within its device's range), O_DIRECT, on the device or a
  scratch file; the candidate merges no requests meanwhile (queue/nomerges, put back after):
  the recorded ones were merged already. A session sampled past --event-rate is scaled up
  to its aggregate tier's counts (analysis/scaleup.py).
- syscall (a directory, where the session has the engine's file calls): every read, write,
  fsync and fdatasync on the KV caches' files (`--cache`), each recorded file a file of its
  own in a scratch folder, at the offset the call had, asking the bytes it asked,
  O_DIRECT where the engine's file was; files read before the replay writes them are laid
  down first, out of the page cache. Made by a process of its own, which the new session
  traces by pid (kvprof never traces its own files).

Both by JOBS threads per lane (reads, writes, syncs) that take the lane's calls in order,
each sleeping until its call's time. Block requests (and file calls with --open-loop) go out
at their times whether or not the ones before have completed (open loop, up to JOBS in
flight a lane), so latency is measured under the recorded arrivals. File calls by default
keep each recorded thread's order and pace (FilePlan.after/gap): a call waits for its
thread's call before it and the thread's own time after that, and each phase piece keeps
its recorded length after the one before (Gate.shift), so a slower candidate moves the rest
as it moves a closed-loop engine's steps. Either way the replay measures per phase how late
it issued each planned call's bytes against when that was due (in a shifting replay, at its
offset in its moved piece). Each call is issued in the phase it was recorded in: the first
call of a phase waits until every call of the one before has completed (Gate), which on a
slow candidate stretches that phase.

Not fio: fio 3.33 replaying an iolog waits for each line's time by spinning (one core per
job, which here is the CPU the candidate's I/O needs), and through one asynchronous queue
leaves up to its depth - 1 of the requests unissued while counting them done. `kvprof export
--fio-iolog` writes the block requests for fio, for those who replay with it.

The new session holds the recording's phase windows, moved to the replay's clock (its first
call at the recording's first), each phase from where the replay started it to where it
started the next (Gate), sent to its recorder as the replay decides them
(kvprof/phases/replayed.py): its report, exact tier and idle time per phase and `compare`
split the same way, each call in the phase it had in the recording; the replay says how long
each phase took against the recording (`phases`).

Safety: as `kvprof calibrate`: a directory gets scratch files (deleted afterwards), a raw
device that is mounted or held is refused, and one holding data is refused unless --force.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa

from kvprof.errors import EX_DATAERR, EX_USAGE, KvprofError
from kvprof.phases.replayed import UNKNOWN, in_shifted_pieces, new_edges
from kvprof.schema import SLOT_NS

JOBS = 8  # replaying threads per lane (reads, writes, syncs): the most in flight in each
LEAD_MAX_NS = 10_000_000_000


@dataclass
class Plan:
    """The requests to issue, in issue order: candidate offsets, sizes, ops, phases, the
    recorded issue times (ns) and phase pieces (Gate); `t0`: the first one's."""
    offset: np.ndarray
    size: np.ndarray
    op: list[str]
    phase: list[str]
    issue_ns: np.ndarray
    span: int  # bytes of the candidate the offsets reach
    segment: np.ndarray

    @property
    def t0(self) -> int:
        return int(self.issue_ns[0])


def pieces_of(issue_ns: np.ndarray, bounds: np.ndarray | None) -> np.ndarray:
    """Each issue time's phase piece: the number of `bounds` (where the recording's phase
    changes, Recorded.bounds) at or before it, as the recording's rule gave its phase."""
    if bounds is None:
        return np.zeros(len(issue_ns), np.int64)
    return np.searchsorted(bounds, issue_ns, side="right").astype(np.int64)


def plan(requests: pa.Table, phases: list[str], bounds: np.ndarray | None = None) -> Plan:
    """The recorded block requests of `phases` (all when empty) laid out for one candidate:
    each recorded device's range [lowest offset, highest end) placed after the previous
    one's. Requests with no data to move (flushes, empty writes) are left out."""
    phase = np.array(requests["phase"].to_pylist(), dtype=object)
    op = np.array(requests["op"].to_pylist(), dtype=object)
    size = requests["bytes"].to_numpy(zero_copy_only=False).astype(np.int64)
    keep = ((op == "read") | (op == "write")) & (size > 0)
    if phases:
        keep &= np.isin(phase, phases)
    dev = np.array(requests["dev_name"].to_pylist(), dtype=object)[keep]
    offset = requests["offset"].to_numpy(zero_copy_only=False).astype(np.int64)[keep]
    size = size[keep]
    out = np.zeros(len(offset), np.int64)
    base = 0
    for d in sorted(set(dev.tolist())):
        mine = dev == d
        lo, hi = int(offset[mine].min()), int((offset[mine] + size[mine]).max())
        out[mine] = offset[mine] - lo + base
        base += hi - lo
    issue = requests["issue_ns"].to_numpy(zero_copy_only=False).astype(np.int64)[keep]
    return Plan(out, size, op[keep].tolist(), phase[keep].tolist(), issue, base,
                pieces_of(issue, bounds))


class Gate:
    """Where each phase piece of the replay starts on its clock (`edges`, shared with the
    recorder's ReplayedWindows), decided as the replay goes, and the replaying threads held
    to it, so that every request is issued inside the piece of the phase it was recorded in.

    The recording's time is cut where its phase changes (`bounds`; piece j runs from
    bounds[j - 1] to bounds[j]); `segment[k]`: call k's piece, in issue order. Piece j starts
    once every call of the pieces before it has completed (the only moment the replaying
    process knows the kernel has issued them), and not before it was due: at the later of
    the two, so a piece the candidate is slow to serve stretches and the next one starts
    where it ended. A call goes out at its own time or at its piece's start, whichever is
    later. Where a call of the pieces before completed within the 4 ms issue slot
    (schema.SLOT_NS) the start falls in, the start moves to the next slot: no slot of the
    aggregate tier then holds requests of two phases, and it folds each request as the
    events do. The threads wait on a condition; those of one process share it (a file replay
    runs them in its own process, `edges` in a shared mapping).

    `shift` (a replay that keeps each recorded thread's order): a piece is due its recorded
    length after the previous one started, not at its time on the recording's clock, and its
    calls at their offsets from its start (`due_in`): a piece the candidate stretched moves
    every later one, as a step that waited longer for its loads moves the engine's next
    steps; ReplayedWindows maps the windows the same way."""

    def __init__(self, bounds: np.ndarray, segment: np.ndarray, edges: np.ndarray,
                 t0: int, speed: float, shift: bool = False) -> None:
        self.bounds = np.asarray(bounds, np.int64)
        self.edges = edges
        self.shift = shift
        self.left = np.bincount(np.asarray(segment, np.int64),
                                minlength=len(self.bounds) + 1).tolist()
        self.t0, self.speed = t0, speed
        self.aborted = False
        self._cond = threading.Condition()
        self._next = 1  # the first piece whose start is not decided
        self._latest = 0  # when the last call completed, of all completed so far
        self._due: list[int] = []

    def begin(self, start_ns: int) -> None:
        """The replay's first call is due at `start_ns`: the pieces up to the first with
        calls start when they were due."""
        self._start = start_ns
        self._due = [start_ns + d for d in _due(self.bounds, self.t0, self.speed)]
        with self._cond:
            self._advance()

    def due_in(self, j: int, issue_ns: int) -> int:
        """When a call recorded at issue_ns, of piece j (whose start is decided), is due in a
        shifting replay: at its offset from the piece's start."""
        return int(in_shifted_pieces(np.array([issue_ns], np.int64), np.array([j]),
                                     self.bounds, self.edges, self._start, self.t0,
                                     self.speed)[0])

    def _advance(self) -> None:
        while self._next < len(self.left) and self.left[self._next - 1] == 0:
            j = self._next
            due = (self.due_in(j - 1, int(self.bounds[j - 1])) if self.shift
                   else self._due[j - 1])
            at = max(due, int(self.edges[j - 1]), self._latest)
            if at % SLOT_NS and self._latest > at - at % SLOT_NS:
                at += SLOT_NS - at % SLOT_NS
            self.edges[j] = at
            self._next += 1
        self._cond.notify_all()

    def wait(self, j: int) -> int | None:
        """When piece j starts, once decided; None where the replay ended meanwhile."""
        with self._cond:
            while self.edges[j] == UNKNOWN and not self.aborted:
                self._cond.wait()
            return None if self.aborted else int(self.edges[j])

    def done(self, j: int, at_ns: int) -> None:
        """A call of piece j completed at `at_ns`."""
        with self._cond:
            self._latest = max(self._latest, at_ns)
            self.left[j] -= 1
            if self.left[j] == 0 and j == self._next - 1:
                self._advance()

    def abort(self) -> None:
        with self._cond:
            self.aborted = True
            self._cond.notify_all()


def _at_their_times(due: list[int], do: Callable[[int, memoryview], None],
                    sizes: np.ndarray, lanes: np.ndarray, jobs: int,
                    gate: Gate, segment: np.ndarray, after: np.ndarray | None = None,
                    gap: np.ndarray | None = None, speed: float = 1.0,
                    issue_ns: np.ndarray | None = None) -> Callable[[int], None]:
    """A runner that, given start_ns, calls do(k, buffer) for each k at start_ns + due[k]
    (monotonic ns), or at the start of its phase piece (`gate`, `segment[k]`) where that is
    later, and returns when all are done. Each lane (the calls with one `lanes` value: reads,
    writes, syncs) has `jobs` threads of its own, which take its calls in order and sleep
    until each is due: a call goes out at its time whether or not the ones before it have
    completed (open loop, up to `jobs` in flight a lane), and within a phase piece writes a
    slow candidate holds back hold back no reads, as an engine's store and load threads do
    not wait on each other; a call of the next piece waits until every call of the pieces
    before has completed (Gate), as it must to be issued in its own phase. With `after`
    (call k may not go out before call after[k] completed, and then only gap[k] ns later,
    at `speed`), the calls of one recorded thread keep its order and its pace: a thread of
    the engine waited for each call before it went on. A shifting gate (Gate.shift) places
    a call at its recorded offset in its piece (`issue_ns`: the recorded times). The threads
    sleep rather than spin (the candidate's I/O needs the CPU) and leave the GIL in the calls
    themselves; `sizes[k]`: the buffer call k needs. Everything is set up here, before the
    start (buffers, threads): a traced process replaying makes no other calls once it
    starts. The first OSError ends the replay."""
    import itertools
    import mmap
    import os

    errors: list[BaseException] = []
    data = os.urandom(max(int(sizes.max()), 4096))  # what writes carry: incompressible
    start = [0]
    seg = np.asarray(segment, np.int64).tolist()
    prev = [-1] * len(due) if after is None else np.asarray(after, np.int64).tolist()
    pause = [0] * len(due) if gap is None else (np.asarray(gap, np.float64) / speed
                                               ).astype(np.int64).tolist()
    # (no call waits on a later one, nor a piece on a later piece: the first call not done
    # can always go out, so the threads never wait on each other in a ring)
    assert all(j < k for k, j in enumerate(prev))
    assert all(a <= b for a, b in zip(seg, seg[1:]))
    ordered = any(j >= 0 for j in prev)
    rec = [] if issue_ns is None else np.asarray(issue_ns, np.int64).tolist()
    done_ns = [0] * len(due)
    completed = threading.Condition()

    def after_previous(k: int) -> int | None:
        """When call k may go out after its thread's previous call; None: stopping."""
        j = prev[k]
        with completed:
            while not done_ns[j] and not errors:
                completed.wait(0.5)
        return None if errors else done_ns[j] + pause[k]

    def work(mine: list[int], order: Iterator[int], view: memoryview) -> None:
        try:
            while not errors:
                n = next(order)
                if n >= len(mine):
                    return
                k = mine[n]
                at = start[0] + due[k]
                if seg[k]:
                    edge = gate.wait(seg[k])
                    if edge is None:
                        return
                    at = gate.due_in(seg[k], rec[k]) if gate.shift else max(at, edge)
                if prev[k] >= 0:
                    ready = after_previous(k)
                    if ready is None:
                        return
                    at = max(at, ready)
                while (wait := at - time.monotonic_ns()) > 0:
                    time.sleep(wait / 1e9)
                do(k, view)
                now = time.monotonic_ns()
                gate.done(seg[k], now)
                if ordered:
                    with completed:
                        done_ns[k] = now
                        completed.notify_all()
        except BaseException as e:  # noqa: BLE001 (raised in the caller's thread)
            errors.append(e)
            gate.abort()
            with completed:
                completed.notify_all()

    threads = []
    for lane in np.unique(lanes).tolist():
        ks = np.flatnonzero(lanes == lane)
        order = itertools.count()  # (next() on it is atomic under the GIL)
        bufsize = max(-(-int(sizes[ks].max()) // 4096) * 4096, 4096)
        for j in range(min(jobs, len(ks))):
            buf = mmap.mmap(-1, bufsize)  # page-aligned, as O_DIRECT needs
            buf.write(data[:bufsize])
            threads.append(threading.Thread(target=work, args=(ks.tolist(), order,
                                                               memoryview(buf)),
                                            name=f"kvprof-replay-{lane}-{j}", daemon=True))

    def run(start_ns: int) -> None:
        start[0] = start_ns
        gate.begin(start_ns)
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            e = errors[0]
            if not isinstance(e, OSError):
                raise e
            raise KvprofError(f"replaying on {e.filename or 'the candidate'}: {e.strerror}",
                              EX_DATAERR)
    return run


def _due(issue_ns: np.ndarray, t0: int, speed: float) -> list[int]:
    return ((issue_ns - t0) / speed).astype(np.int64).tolist()


def issue(p: Plan, path: str, speed: float, start_ns: int, gate: Gate,
          jobs: int = JOBS) -> None:
    """The plan's block requests on `path` (O_DIRECT), the first at `start_ns`, each in
    its phase piece (`gate`)."""
    import os

    fd = os.open(path, os.O_RDWR | os.O_DIRECT)
    offset, size = p.offset.tolist(), p.size.tolist()
    write = [o == "write" for o in p.op]

    def do(k: int, view: memoryview) -> None:
        try:
            if write[k]:
                os.pwritev(fd, [view[:size[k]]], offset[k])
            else:
                os.preadv(fd, [view[:size[k]]], offset[k])
        except OSError as e:
            e.filename = path
            raise

    try:
        _at_their_times(_due(p.issue_ns, p.t0, speed), do, p.size,
                        np.array(write, np.int8), jobs, gate, p.segment)(start_ns)
    finally:
        os.close(fd)


# -- file calls (the syscall layer), replayed on a filesystem ---------------------------------

KINDS = ("read", "write", "fsync", "fdatasync")


@dataclass
class FilePlan:
    """The file calls to make, in issue order: which file (an index into `paths`, the
    recorded path of each), KINDS index, O_DIRECT, offset, bytes (done: what `lag` counts),
    bytes to ask for (reads ask what the recording asked, writes write what it wrote),
    cold (a buffered read that put pages into the page cache in the recording), phase,
    recorded issue time; `lay_down`: per file read before the replay writes it, the bytes
    laid down before the replay (as far as its reads reached), so they read what the
    recording read. `segment`: each call's phase piece (Gate). `after`: the call the same
    recorded thread made before it (-1: none) and `gap`: the ns that thread took between
    that call's completion and this one's issue (its own work; -1 everywhere: an open-loop
    replay, each call at its time alone), so a
    thread's calls go out in its order, each after the one before completed, as the engine's
    thread waited for each."""
    file: np.ndarray
    paths: list[str]
    caches: list[str]  # each file's KV cache, as the recording labelled it
    kind: np.ndarray
    direct: np.ndarray
    offset: np.ndarray
    size: np.ndarray
    ask: np.ndarray
    cold: np.ndarray
    phase: list[str]
    issue_ns: np.ndarray
    lay_down: dict[int, int]
    segment: np.ndarray
    after: np.ndarray
    gap: np.ndarray

    @property
    def t0(self) -> int:
        return int(self.issue_ns[0])

    @property
    def threads(self) -> int:
        """How many recorded threads' orders the replay keeps (0: open loop)."""
        return int(((self.after < 0) & (self.gap >= 0)).sum())


def thread_order(tid: np.ndarray, issue_ns: np.ndarray, complete_ns: np.ndarray
                 ) -> tuple[np.ndarray, np.ndarray]:
    """Per call (in issue order), the index of the call its thread made before it (-1 for a
    thread's first) and the ns between that one's completion and this one's issue (0 where
    the clocks put it before: a call's issue is stamped before its completion is)."""
    after = np.full(len(tid), -1, np.int64)
    last: dict[int, int] = {}
    for k, t in enumerate(tid.tolist()):
        if t in last:
            after[k] = last[t]
        last[t] = k
    gap = np.zeros(len(tid), np.int64)
    has = after >= 0
    gap[has] = np.maximum(issue_ns[has] - complete_ns[after[has]], 0)
    gap[~has] = 0
    return after, gap


def file_plan(calls: pa.Table, phases: list[str], caches: list[str],
              bounds: np.ndarray | None = None, open_loop: bool = False) -> FilePlan:
    """The recorded file calls (SqlRows.file_calls) of `phases` on the files of `caches`
    (all when empty); each thread's calls in its order (`open_loop`: each at its time
    alone)."""
    import pyarrow.compute as pc

    if calls.num_rows and phases:
        calls = calls.filter(pc.is_in(calls["phase"], pa.array(phases)))
    if calls.num_rows and caches:
        calls = calls.filter(pc.is_in(calls["cache"], pa.array(caches)))
    key = calls["file"].to_pylist() if calls.num_rows else []
    ids: dict[str, int] = {}
    file = np.array([ids.setdefault(k, len(ids)) for k in key], np.int64)
    paths, labels = [""] * len(ids), ["other"] * len(ids)
    for f, path, cache in zip(file.tolist(), calls["path"].to_pylist() if key else [],
                              calls["cache"].to_pylist() if key else []):
        paths[f] = path or paths[f]
        labels[f] = cache or labels[f]
    op = calls["op"].to_pylist() if key else []
    syscall = calls["syscall"].to_pylist() if key else []
    kind = np.array([KINDS.index(o) if o in ("read", "write") else
                     KINDS.index("fdatasync" if s == "fdatasync" else "fsync")
                     for o, s in zip(op, syscall)], np.int8)

    def col(c: str, t: type) -> np.ndarray:
        return calls[c].to_numpy(zero_copy_only=False).astype(t) if key else np.zeros(0, t)

    offset = np.nan_to_num(col("offset", np.float64)).astype(np.int64)
    size = np.where(kind <= 1, col("bytes", np.int64), 0)
    # (a read asks what it asked, up to 64 MiB a call; where it was not known, what it got)
    asked = np.nan_to_num(col("asked", np.float64)).astype(np.int64)
    ask = np.where(kind == 0, np.minimum(np.maximum(asked, size), 64 << 20), size)
    cold = (kind == 0) & ~col("direct", bool) & (np.nan_to_num(col("fetched", np.float64)) > 0)
    lay_down: dict[int, int] = {}
    first_write: dict[int, int] = {}
    for k, (f, kd) in enumerate(zip(file.tolist(), kind.tolist())):
        if kd == 1:
            first_write.setdefault(f, k)
    for k in np.flatnonzero(kind == 0).tolist():
        f = int(file[k])
        if first_write.get(f, len(kind)) > k:  # read before the replay writes it
            lay_down[f] = max(lay_down.get(f, 0), int(offset[k] + size[k]))
    issue = col("issue_ns", np.int64)
    if open_loop or not key or "tid" not in calls.column_names:
        after, gap = np.full(len(issue), -1, np.int64), np.full(len(issue), -1, np.int64)
    else:
        after, gap = thread_order(col("tid", np.int64), issue, col("complete_ns", np.int64))
    return FilePlan(file, paths, labels, kind, col("direct", bool), offset, size, ask, cold,
                    calls["phase"].to_pylist() if key else [], issue, lay_down,
                    pieces_of(issue, bounds), after, gap)


def _name(root: Path, fp: FilePlan, f: int) -> Path:
    """Where the replay puts recorded file `f`: in a folder named after its KV cache, which
    the new session's --cache rule (_cache_rules) labels as the recording did."""
    return root / fp.caches[f] / f"file-{f}"


def _cache_rules(root: Path, fp: FilePlan) -> list[str]:
    return [f"{c}={root}/{c}/*" for c in sorted(set(fp.caches) - {"other"})]


def _folders(fp: FilePlan, root: Path) -> None:
    for c in set(fp.caches):
        (root / c).mkdir(exist_ok=True)


def lay_down(fp: FilePlan, root: Path) -> None:
    """The files read before the replay writes them, written with random data, synced and
    dropped from the page cache: their reads start cold, from the candidate."""
    import os

    chunk = os.urandom(1 << 20)
    for f, n in fp.lay_down.items():
        fd = os.open(_name(root, fp, f), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            left = -(-n // 4096) * 4096
            while left > 0:
                left -= os.write(fd, chunk[:min(left, len(chunk))])
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def issue_files(fp: FilePlan, root: Path, speed: float, gate: Gate, jobs: int = JOBS
                ) -> Callable[[int], None]:
    """A runner making the plan's file calls on files under `root`, the first at the
    start_ns it is given, each in its phase piece (`gate`; all set up before:
    _at_their_times): each recorded
    file a file of its own, opened at its first call (O_DIRECT where the recording's was),
    reads and writes at their offsets, fsyncs as fsyncs; at the end, each file written
    through the page cache synced (the kernel's writeback, which the engine left its pages
    to, happens in the new session then rather than when it did). A buffered read that
    missed the page cache in the recording has its range dropped from it first (where its
    pages are clean: dirty ones stay), so it goes to the candidate as it went to the
    device."""
    import os

    fds: dict[tuple[int, bool], int] = {}
    lock = threading.Lock()
    file, kind, direct = fp.file.tolist(), fp.kind.tolist(), fp.direct.tolist()
    offset, size, cold = fp.offset.tolist(), fp.ask.tolist(), fp.cold.tolist()

    def fd_of(f: int, d: bool) -> int:
        with lock:
            if (f, d) not in fds:
                fds[(f, d)] = os.open(_name(root, fp, f), os.O_RDWR | os.O_CREAT
                                      | (os.O_DIRECT if d else 0), 0o600)
            return fds[(f, d)]

    def do(k: int, view: memoryview) -> None:
        try:
            fd = fd_of(file[k], direct[k])
            if kind[k] == 0:
                if cold[k]:
                    os.posix_fadvise(fd, offset[k], size[k], os.POSIX_FADV_DONTNEED)
                os.preadv(fd, [view[:size[k]]], offset[k])
            elif kind[k] == 1:
                os.pwritev(fd, [view[:size[k]]], offset[k])
            elif kind[k] == 2:
                os.fsync(fd)
            else:
                os.fdatasync(fd)
        except OSError as e:
            e.filename = str(_name(root, fp, file[k]))
            raise

    replay = _at_their_times(_due(fp.issue_ns, fp.t0, speed), do, fp.ask,
                             np.minimum(fp.kind, 2), jobs, gate, fp.segment, fp.after,
                             fp.gap, speed, fp.issue_ns)

    def run(start_ns: int) -> None:
        try:
            replay(start_ns)
            # The buffered writes' pages, which the engine left to the kernel's writeback,
            # to the candidate now, while it is recorded: its files are deleted after.
            for (f, d), fd in fds.items():
                if not d:
                    os.fsync(fd)
        finally:
            for fd in fds.values():
                os.close(fd)
    return run


def child() -> None:
    """The process that makes the file calls (`python -c "...child()" PLAN ROOT SPEED
    EDGES`): of its own, so the new session traces its calls alone (by pid), not the
    recorder's writes to the session. Says `ready`, reads the start time (monotonic ns),
    replays, exits. Where each phase piece starts (Gate) it writes in EDGES, a file the
    replay maps too: shared memory, which its recorder reads without a call of ours."""
    import itertools  # noqa: F401 - loaded now: after `ready` its calls alone are traced
    import mmap
    import pickle

    plan_path, root, speed = sys.argv[1], Path(sys.argv[2]), float(sys.argv[3])
    with open(plan_path, "rb") as f:
        # (our own file, written by the replay that started us)
        fp, bounds = pickle.load(f)
    with open(sys.argv[4], "r+b") as f:
        shared = mmap.mmap(f.fileno(), 0)
    edges = np.frombuffer(shared, np.int64, len(bounds) + 1)
    run = issue_files(fp, root, speed, Gate(bounds, fp.segment, edges, fp.t0, speed,
                                            shift=fp.threads > 0))
    print("ready", flush=True)
    start = int(sys.stdin.readline())
    try:
        run(start)
    except KvprofError as e:
        print(e, file=sys.stderr)
        sys.exit(e.exit_code)


def lag(p: Plan | FilePlan, issued_ns: np.ndarray, issued_bytes: np.ndarray,
        speed: float, start_ns: int, shifted: tuple[np.ndarray, np.ndarray] | None = None
        ) -> dict[str, dict[str, float]]:
    """Per phase, how late the candidate issued requests against the schedule (the first
    due at `start_ns`, when the new session's windows were moved to), in seconds: for each
    planned request, when the replay had issued as many bytes as the plan had by then (bytes
    rather than the k-th request: a device may merge or split them), against when it was
    due. `shifted` (bounds, edges of a shifting replay, Gate.shift): a request was due at
    its offset from its piece's start."""
    if len(issued_ns) == 0:
        return {}
    order = np.argsort(issued_ns, kind="stable")
    at, done = issued_ns[order], np.cumsum(issued_bytes[order])
    k = np.minimum(np.searchsorted(done, np.cumsum(p.size), side="left"), len(at) - 1)
    due = start_ns + (p.issue_ns - p.t0) / speed
    if shifted is not None:
        due = in_shifted_pieces(p.issue_ns, np.asarray(p.segment, np.int64), *shifted,
                                start_ns, p.t0, speed)
    late = np.maximum(at[k] - due, 0) / 1e9
    phases = np.array(p.phase, dtype=object)
    out = {}
    for ph in sorted(set(p.phase)):
        d = late[phases == ph]
        out[ph] = {"p50_s": float(np.quantile(d, 0.5)), "p99_s": float(np.quantile(d, 0.99)),
                   "max_s": float(d.max()), "requests": int(len(d))}
    return out


def stretch(got, edges: np.ndarray, p: Plan | FilePlan, speed: float, start_ns: int,
            issued_ns: np.ndarray) -> dict[str, dict[str, float]]:
    """Per phase, its time from the first planned call to the last, in the recording
    (`recorded_s`, on its clock) and in the replay (`replayed_s`: from the first call's
    due time to the last replayed request's issue, under the pieces' starts the replay
    decided, `edges`), and by how much the replay's is longer (`stretched_s`, against
    recorded_s / speed): a phase whose requests the candidate let out late stretches until
    they are out; the next one, which began late, may be shorter than recorded."""
    phase = np.asarray(got.piece_phase, dtype=object)
    if not len(phase):
        return {}
    lo_ns, hi_ns = np.iinfo(np.int64).min, np.iinfo(np.int64).max
    t0, t1 = p.t0, int(p.issue_ns[-1])
    rec = (np.clip(np.append(got.bounds, hi_ns), t0, t1)
           - np.clip(np.insert(got.bounds, 0, lo_ns), t0, t1))
    # (every piece's start is decided once the replay is done; one that is not stays where
    # the piece before it starts)
    e = np.maximum.accumulate(np.asarray(edges, np.int64))
    end = max(int(issued_ns.max()) if len(issued_ns) else start_ns, start_ns)
    took = np.clip(np.append(e[1:], hi_ns), start_ns, end) - np.clip(e, start_ns, end)
    out = {}
    for ph in sorted(set(phase.tolist())):
        mine = phase == ph
        a, b = int(rec[mine].sum()) / 1e9, int(took[mine].sum()) / 1e9
        if a or b:
            out[ph] = {"recorded_s": a, "replayed_s": b, "stretched_s": b - a / speed}
    return out


@contextmanager
def _no_merges(dev: str) -> Iterator[None]:
    """The device merging no requests while the replay runs (queue/nomerges 2), put back
    after: the recorded requests are the ones the device got, merged already, and two of
    them issued close together by two threads must not become one."""
    knob = Path(f"/sys/block/{dev}/queue/nomerges")
    try:
        was = knob.read_text().strip()
        knob.write_text("2")
    except OSError:
        yield  # (a device without the knob, or a partition's: its disk's queue merges)
        return
    try:
        yield
    finally:
        knob.write_text(was)


def _progress(started: float, total_s: float, done: threading.Event) -> None:
    while not done.wait(1.0):
        el = time.monotonic() - started
        print(f"\rkvprof: replaying {el:5.0f} s of {total_s:.0f} s", end="", file=sys.stderr,
              flush=True)
    print(file=sys.stderr)


def _replayed(out: Path, under: Path | None = None) -> tuple[np.ndarray, np.ndarray]:
    """The issue times and sizes of the block reads and writes the new session holds, or
    with `under`, of the file reads and writes on the files there."""
    from kvprof.store.session import open_session

    where, params = "layer = 'block'", []
    if under is not None:
        where, params = "layer = 'syscall' AND starts_with(path, ?)", [f"{under}/"]
    con = open_session(out)
    try:
        got = con.execute(
            f"SELECT issue_ns, bytes FROM io WHERE {where} AND op IN ('read', 'write') "
            "AND bytes > 0 ORDER BY issue_ns", params).fetchnumpy()
        return np.asarray(got["issue_ns"], np.int64), np.asarray(got["bytes"], np.int64)
    finally:
        con.close()


def _recording_while(opts, windows, edges: np.ndarray, t0: int, last: int, lead_ns: int,
                     speed: float, go: Callable[[int], None], shift: bool = False) -> int:
    """Record the candidate (`opts`: the new session, `windows` among its feeds, sent where
    the replay puts each phase piece: `edges`) while go(start_ns) replays: the recording's
    t0 at start_ns, `lead_ns` after attaching. Returns start_ns."""
    from kvprof.recorder.recorder import Recorder

    attached = threading.Event()
    stop = threading.Event()
    errors: list[BaseException] = []

    def recording() -> None:
        try:
            # (a Recorder as `record` runs one, not live: nothing reads it meanwhile)
            with Recorder(opts, lambda line: None, stop) as recorder:
                recorder.open(lambda store: attached.set())
                recorder.run()
                recorder.finish()
        except BaseException as e:  # noqa: BLE001 (raised in the caller's thread)
            errors.append(e)
            attached.set()

    rec = threading.Thread(target=recording, name="kvprof-replay-record")
    rec.start()
    attached.wait()
    if errors:
        rec.join()
        raise errors[0]
    done = threading.Event()
    threading.Thread(target=_progress, args=(time.monotonic(), (last - t0) / speed / 1e9, done),
                     daemon=True).start()
    try:
        start = time.monotonic_ns() + lead_ns
        windows.schedule(start, t0, speed, edges, shift)
        go(start)
    finally:
        done.set()
        time.sleep(0.3)  # the last completions into the recording
        stop.set()
        rec.join()
    if errors:
        raise errors[0]
    return start


def replay(session: str, on: str, phases: list[str], speed: float, out: str | None,
           force: bool = False, layer: str | None = None, caches: list[str] | None = None,
           open_loop: bool = False) -> dict:
    from kvprof.commands.export import recorded
    from kvprof.recorder.options import default_out
    from kvprof.phases.replayed import ReplayedWindows

    if speed <= 0:
        raise KvprofError("--speed must be positive", EX_USAGE)
    got = recorded(session)
    on_dir = Path(on).is_dir()
    if layer is None:
        layer = "syscall" if on_dir and got.calls.num_rows else "block"
    dest = Path(out) if out else default_out()
    # The recording's windows sent as the replay places its phases, and no other source's
    # (phases=["marks"]: nothing discovered on this host).
    windows = ReplayedWindows(got.windows, got.bounds)
    if layer == "syscall":
        result = _replay_files(got, session, on, phases, speed, dest, windows, caches or [],
                               open_loop)
    else:
        result = _replay_block(got, session, on, phases, speed, dest, windows, force)
    return {"session": str(dest), "candidate": on, "layer": layer, "speed": speed, **result}


def _lead(p: Plan | FilePlan, start_ns: int, speed: float) -> int:
    """The first request as long after attaching as in the recording (up to LEAD_MAX_NS),
    so the windows that began before it fall inside the new session."""
    return int(min(p.t0 - start_ns, LEAD_MAX_NS) / speed)


def _replay_block(got, session: str, on: str, phases: list[str], speed: float, dest: Path,
                  windows, force: bool) -> dict:
    import shutil

    from kvprof.commands.calibrate import prepare
    from kvprof.recorder.options import RecordOptions

    p = plan(got.requests, phases, got.bounds)
    if len(p.issue_ns) == 0:
        why = (" (a --no-events session keeps none)" if not got.calls.num_rows else
               f"; it has file calls: replay them on a directory (--on DIR --layer syscall)")
        raise KvprofError(f"{session}: no block reads or writes recorded one by one"
                          + (f" in {', '.join(phases)}" if phases else "")
                          + why + ": nothing to replay", EX_DATAERR)
    said = got.say_scaled("the replay issues")
    if said:
        print(said, file=sys.stderr)
    target = prepare(on, p.span, force, verb="replay")
    tmp = Path(tempfile.mkdtemp(prefix="kvprof-replay-"))
    try:
        if target.size < p.span:
            raise KvprofError(f"{on} has {target.size >> 20} MiB; the recorded requests reach "
                              f"over {p.span >> 20} MiB", EX_USAGE)
        if target.device is None:
            raise KvprofError(f"{on} has no block device of its own to record", EX_USAGE)
        opts = RecordOptions(out=str(dest), devices=[target.device.name], event_rate=0,
                             socket=str(tmp / "marks.sock"), phases=["marks"],
                             feeds=[windows])
        edges = new_edges(len(got.bounds) + 1)
        gate = Gate(got.bounds, p.segment, edges, p.t0, speed)
        with _no_merges(target.device.name):
            start = _recording_while(opts, windows, edges, p.t0, int(p.issue_ns[-1]),
                                     _lead(p, got.start_ns, speed), speed,
                                     lambda start: issue(p, target.path, speed, start, gate))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        if target.scratch is not None:
            target.scratch.unlink(missing_ok=True)
    issued, sizes = _replayed(dest)
    return {"requests": len(p.issue_ns), "bytes": int(p.size.sum()),
            "replayed": int(len(issued)), "replayed_bytes": int(sizes.sum()),
            "lag": lag(p, issued, sizes, speed, start),
            "phases": stretch(got, edges, p, speed, start, issued),
            "scaled_up": None if got.scaled is None else [
                {"phase": ph, "device": dev, "op": op, "kept": kept, "issued": n}
                for (ph, dev, op), (kept, n) in sorted(got.scaled.groups.items())]}


def _replay_files(got, session: str, on: str, phases: list[str], speed: float, dest: Path,
                  windows, caches: list[str], open_loop: bool = False) -> dict:
    """The recording's file calls, made on files in a scratch directory under `on` by a
    process of its own, which the new session traces (syscall layer, by its pid) with the
    block requests it makes on the directory's device."""
    import mmap
    import os
    import pickle
    import shutil
    import subprocess

    from kvprof.caches import OTHER
    from kvprof.commands.calibrate import dir_device
    from kvprof.recorder.options import RecordOptions

    if not Path(on).is_dir():
        raise KvprofError(f"{on}: file calls replay on a filesystem: give a directory",
                          EX_USAGE)
    if not caches and got.calls.num_rows:
        # The KV caches' files where the session names any: a recording without -p follows
        # every process's files (the engine's model weights, Python's modules ...).
        found = sorted(set(got.calls["cache"].to_pylist()) - {None, OTHER})
        if found:
            caches = found
            others = sum(1 for c in got.calls["cache"].to_pylist() if c not in found)
            print(f"kvprof: replaying the file calls of {', '.join(found)}"
                  + (f"; {others} calls on other files left out (--cache NAME for each cache "
                     "to replay, `other` for the rest)" if others else ""), file=sys.stderr)
    fp = file_plan(got.calls, phases, caches, got.bounds, open_loop)
    if len(fp.issue_ns) == 0:
        raise KvprofError(f"{session}: no file reads, writes or syncs recorded (syscall layer, "
                          "with their offsets)" + (f" in {', '.join(phases)}" if phases else "")
                          + ": nothing to replay", EX_DATAERR)
    dev = dir_device(Path(on))
    if dev is None:
        raise KvprofError(f"{on} has no block device of its own to record", EX_USAGE)
    need = sum(fp.lay_down.values()) + int(fp.size[fp.kind == 1].sum())
    free = shutil.disk_usage(on).free
    if free < need + (64 << 20):
        raise KvprofError(f"{on} has {free >> 20} MiB free; the replay writes up to "
                          f"{need >> 20} MiB", EX_USAGE)
    root = Path(tempfile.mkdtemp(prefix=".kvprof-replay-", dir=on))
    tmp = Path(tempfile.mkdtemp(prefix="kvprof-replay-"))
    proc = None
    edges = None
    try:
        _folders(fp, root)
        lay_down(fp, root)
        with open(tmp / "plan.pickle", "wb") as f:
            pickle.dump((fp, got.bounds), f)
        # Where the child puts each phase piece (Gate), which the recorder's windows follow:
        # a file both map, so the child says it with no call the new session would trace.
        with open(tmp / "edges", "w+b") as g:
            g.truncate((len(got.bounds) + 1) * 8)
            shared = mmap.mmap(g.fileno(), 0)
        edges = new_edges(len(got.bounds) + 1, shared)
        proc = subprocess.Popen(
            [sys.executable, "-c", "from kvprof.commands.replay import child; child()",
             str(tmp / "plan.pickle"), str(root), repr(speed), str(tmp / "edges")],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        assert proc.stdin is not None and proc.stdout is not None
        if proc.stdout.readline().strip() != "ready":
            raise KvprofError(f"the replaying process did not start: {proc.communicate()[1]}",
                              EX_DATAERR)
        opts = RecordOptions(out=str(dest), devices=[dev.name], pids=[proc.pid],
                             layers=("block", "syscall"), event_rate=0,
                             caches=_cache_rules(root, fp),
                             socket=str(tmp / "marks.sock"), phases=["marks"],
                             feeds=[windows])

        def go(start: int) -> None:
            assert proc is not None
            _, err = proc.communicate(f"{start}\n")
            if proc.returncode:
                raise KvprofError(err.strip().splitlines()[-1] if err.strip() else
                                  f"the replaying process ended with {proc.returncode}",
                                  EX_DATAERR)

        start = _recording_while(opts, windows, edges, fp.t0, int(fp.issue_ns[-1]),
                                 _lead(fp, got.start_ns, speed), speed, go, fp.threads > 0)
        edges = edges.copy()
    finally:
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait()
        shutil.rmtree(root, ignore_errors=True)
        shutil.rmtree(tmp, ignore_errors=True)
    issued, sizes = _replayed(dest, root)
    return {"requests": len(fp.issue_ns), "bytes": int(fp.size.sum()),
            "files": len(fp.paths), "laid_down": {"files": len(fp.lay_down),
                                                  "bytes": sum(fp.lay_down.values())},
            "direct_calls": int(fp.direct.sum()), "syncs": int((fp.kind >= 2).sum()),
            "threads": fp.threads,
            "replayed": int(len(issued)), "replayed_bytes": int(sizes.sum()),
            "lag": lag(fp, issued, sizes, speed, start,
                       (got.bounds, edges) if fp.threads else None),
            "phases": stretch(got, edges, fp, speed, start, issued)}


def run(args: argparse.Namespace) -> int:
    result = replay(args.session, args.on, args.phase, args.speed, args.out, args.force,
                    args.layer, args.cache, args.open_loop)
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    what = "file calls" if result["layer"] == "syscall" else "requests"
    print(f"kvprof: replayed {result['requests']} {what} of {args.session} on {args.on} "
          f"(x{result['speed']:g}); new session {result['session']}")
    if result.get("threads"):
        print(f"  the {result['threads']} recorded threads' calls in their order, each after "
              "the one before it completed and the thread's own time between them: a call "
              "the candidate serves later moves the rest of its thread, as in the engine")
    for ph, lg in result["lag"].items():
        verdict = ("kept up" if lg["p99_s"] < 0.01 else
                   f"fell behind: p99 {lg['p99_s']:.2f} s, at most {lg['max_s']:.2f} s late")
        print(f"  {ph:8} {lg['requests']:>8} {what}  {verdict}")
    # Each call stays in the phase it was recorded in: a phase the candidate let its calls
    # out of late lasted until they were out.
    took = result["phases"]
    if took:
        print("  time per phase, recorded -> replayed: " + ", ".join(
            f"{ph} {t['recorded_s'] / result['speed']:.2f} -> {t['replayed_s']:.2f} s"
            + (f" ({t['stretched_s']:+.2f} s)" if abs(t["stretched_s"]) >= 0.005 else "")
            for ph, t in took.items()))
    print(f"kvprof: compare them with: kvprof compare {args.session} {result['session']}")
    return 0
