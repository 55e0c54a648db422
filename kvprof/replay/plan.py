"""What a replay issues: the block requests (Plan) or file calls (FilePlan) of the chosen
phases, in the order and at the times recorded."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pyarrow as pa


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

KINDS = ("read", "write", "fsync", "fdatasync")


@dataclass
class FilePlan:
    """The file calls to make, in issue order, one entry a call in each array. `after` and
    `gap` keep each recorded thread's order: a call goes out once the call its thread made
    before it (`after`; -1: none) completed, `gap` ns later (the thread's own work between
    them; -1 everywhere: an open-loop replay, each call at its time alone), as the engine's
    thread waited for each."""
    file: np.ndarray  # an index into `paths`, the recorded path of each file
    paths: list[str]
    caches: list[str]  # each file's KV cache, as the recording labelled it
    kind: np.ndarray  # KINDS index
    direct: np.ndarray  # O_DIRECT
    offset: np.ndarray
    size: np.ndarray  # bytes done: what `lag` counts
    ask: np.ndarray  # bytes asked: reads what the recording asked, writes what it wrote
    # A buffered read that put pages into the page cache in the recording.
    cold: np.ndarray
    phase: list[str]
    issue_ns: np.ndarray
    # Per file read before the replay writes it: the bytes laid down first (as far as its
    # reads reached), so they read what the recording read.
    lay_down: dict[int, int]
    segment: np.ndarray  # each call's phase piece (Gate)
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


def due_offsets(issue_ns: np.ndarray, t0: int, speed: float) -> list[int]:
    """Each call's time after the first's (ns), at `speed`."""
    return ((issue_ns - t0) / speed).astype(np.int64).tolist()
