"""How late a replay issued what was due, and how long each phase took against the recording."""
from __future__ import annotations

import numpy as np

from kvprof.phases.replayed import in_shifted_pieces
from kvprof.replay.plan import FilePlan, Plan


def lag(p: Plan | FilePlan, issued_ns: np.ndarray, issued_bytes: np.ndarray,
        issued_write: np.ndarray, speed: float, start_ns: int,
        shifted: tuple[np.ndarray, np.ndarray] | None = None) -> dict[str, dict[str, float]]:
    """Per phase, how late the candidate issued requests against the schedule (the first
    due at `start_ns`, when the new session's windows were moved to), in seconds: for each
    planned request, when the replay had issued as many bytes of its kind (reads; writes and
    syncs) as the plan had by then (bytes rather than the k-th request: a device may merge or
    split them; by kind, so that a write the new session lacks is not matched to a later
    read), against when it was due. `shifted` (bounds, edges of a shifting replay,
    Gate.shift): a request was due at its offset from its piece's start."""
    if len(issued_ns) == 0:
        return {}
    planned_write = (np.asarray(p.kind) != 0 if isinstance(p, FilePlan)
                     else np.array([o == "write" for o in p.op], bool))
    went = np.zeros(len(p.size), np.int64)
    for w in (False, True):
        mine = planned_write == w
        theirs = np.asarray(issued_write, bool) == w
        if not theirs.any():  # (none of the kind recorded: against all requests)
            theirs = np.ones(len(issued_ns), bool)
        order = np.argsort(issued_ns[theirs], kind="stable")
        at = issued_ns[theirs][order]
        done = np.cumsum(issued_bytes[theirs][order])
        k = np.minimum(np.searchsorted(done, np.cumsum(np.asarray(p.size)[mine]),
                                       side="left"), len(at) - 1)
        went[mine] = at[k]
    due = start_ns + (p.issue_ns - p.t0) / speed
    if shifted is not None:
        due = in_shifted_pieces(p.issue_ns, np.asarray(p.segment, np.int64), *shifted,
                                start_ns, p.t0, speed)
    late = np.maximum(went - due, 0) / 1e9
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
