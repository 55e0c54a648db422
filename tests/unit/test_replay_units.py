"""kvprof replay's phase pieces without a device: where the Gate starts each piece, that its
threads hold every call inside its piece, what ReplayedWindows sends the recorder and when,
and the time per phase the replay reports."""
from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import numpy as np
import pyarrow as pa
import pytest

from kvprof.analysis.fold import flatten
from kvprof.phases.replayed import UNKNOWN, ReplayedWindows, new_edges
from kvprof.replay.gate import Gate
from kvprof.replay.issue import _at_their_times
from kvprof.replay.stats import stretch
from kvprof.schema import SLOT_NS

MS = 1_000_000


def _gate(bounds: list[int], segment: list[int]) -> Gate:
    return Gate(np.array(bounds, np.int64), np.array(segment), new_edges(len(bounds) + 1),
                0, 1.0)


def test_a_piece_starts_when_due_or_once_the_pieces_before_completed_on_a_slot_edge():
    start = 1000 * SLOT_NS
    g = _gate([10 * MS, 20 * MS, 30 * MS], [0, 0, 2])
    g.begin(start)
    assert g.edges[1] == UNKNOWN  # piece 0's calls are out
    g.done(0, start + 1 * MS)
    assert g.edges[1] == UNKNOWN
    # Both done long before piece 1 was due: it starts when due, and piece 1 has no calls,
    # so piece 2 does too.
    g.done(0, start + 2 * MS)
    assert g.edges[1] == start + 10 * MS and g.edges[2] == start + 20 * MS
    assert g.edges[3] == UNKNOWN
    # Piece 2's call completed after piece 3 was due: piece 3 starts at the next slot edge
    # (no 4 ms slot holds requests of both).
    g.done(2, start + 31 * MS + 5)
    assert g.edges[3] == start + 32 * MS


def test_completed_within_the_due_start_s_slot_moves_the_start_to_the_slot_s_end():
    start = 1000 * SLOT_NS
    g = _gate([9 * MS], [0])
    g.begin(start)
    g.done(0, start + 8 * MS + 1)  # before 9 ms, in the slot [8, 12) ms that holds it
    assert g.edges[1] == start + 12 * MS
    g = _gate([9 * MS], [0])
    g.begin(start)
    g.done(0, start + 8 * MS)  # the slot's very start: the call was issued before it
    assert g.edges[1] == start + 9 * MS


def test_the_threads_issue_no_call_before_its_piece_starts_nor_after_the_next():
    """Calls 2 ms each, 4 in flight a lane, two lanes, three pieces due 1 ms apart: the
    replay falls behind at once, and still every call starts in its own piece, after every
    call of the pieces before it completed."""
    rng = np.random.default_rng(1)
    issue = np.sort(rng.integers(0, 3 * MS, 60)).astype(np.int64)
    bounds = np.array([1 * MS, 2 * MS], np.int64)
    segment = np.searchsorted(bounds, issue, side="right")
    lanes = rng.integers(0, 2, 60).astype(np.int8)
    gate = Gate(bounds, segment, new_edges(3), 0, 1.0)
    spans = [(0, 0)] * 60
    lock = threading.Lock()

    def do(k: int, _view: memoryview) -> None:
        began = time.monotonic_ns()
        time.sleep(0.002)
        with lock:
            spans[k] = (began, time.monotonic_ns())

    run = _at_their_times(issue.tolist(), do, np.full(60, 4096), lanes, 4, gate, segment)
    start = time.monotonic_ns() + 20 * MS
    run(start)
    began = np.array([s[0] for s in spans])
    ended = np.array([s[1] for s in spans])
    assert (began >= start + issue).all()
    edges = np.append(gate.edges, np.iinfo(np.int64).max)
    for j in (1, 2):
        assert edges[j] > edges[j - 1]
        assert (ended[segment < j] <= edges[j]).all()
        assert (began[segment == j] >= edges[j]).all()
        assert (began[segment == j] < edges[j + 1]).all()
        assert edges[j] % SLOT_NS == 0 or ended[segment < j].max() <= edges[j] - edges[j] % SLOT_NS
    assert edges[2] - start > 2 * MS  # it did fall behind


def _windows(*rows: tuple[int, int, str, str]) -> pa.Table:
    return pa.table({"start_ns": [r[0] for r in rows], "end_ns": [r[1] for r in rows],
                     "phase": [r[2] for r in rows], "source": [r[3] for r in rows],
                     "prefill_tokens": pa.array([None] * len(rows), pa.int64()),
                     "decode_tokens": pa.array([None] * len(rows), pa.int64())})


def test_windows_follow_the_pieces_the_replay_decided_and_keep_what_flatten_makes_of_them():
    # Recording: prefill [0, 10) ms (hook), decode [10, 30) in two steps, and an NVML window
    # over all of it, which the hook's windows outrank. Its phase changes at 10 ms only.
    w = _windows((0, 10 * MS, "prefill", "hook"), (10 * MS, 20 * MS, "decode", "hook"),
                 (20 * MS, 30 * MS, "decode", "hook"), (-5 * MS, 40 * MS, "decode", "nvml"))
    bounds = np.array([10 * MS], np.int64)
    src = ReplayedWindows(w, bounds)
    edges = new_edges(2)
    start = time.monotonic_ns() + 3600 * 1000 * MS  # (so that take()'s now sends nothing)
    src.schedule(start, 0, 1.0, edges)
    # Prefill's calls still out at 25 ms: nothing ended yet, prefill goes on to now.
    now = start + 25 * MS
    assert src.take() == {}  # (the clock's now is far before `start`: nothing due)
    src._send(now, cut=False)
    assert src.take() == {}
    rows = src.open_rows(now)
    assert [(r["phase"], r["start_ns"] - start, r["end_ns"] - start) for r in rows] == [
        ("prefill", 0, 25 * MS), ("decode", -5 * MS, 25 * MS)]
    # Prefill's last call completed at 26 ms: decode starts at 28 ms (the slot's end),
    # its first step ends then too (squeezed to nothing: not sent), the second one when due.
    edges[1] = start + 28 * MS
    src._send(start + 29 * MS, cut=False)
    got = src.take()["phase"].to_pylist()
    assert [(r["phase"], r["start_ns"] - start, r["end_ns"] - start) for r in got] == [
        ("prefill", 0, 28 * MS)]
    src._send(start + 31 * MS, cut=False)
    got += src.take()["phase"].to_pylist()
    src.close(start + 35 * MS)
    got += src.take()["phase"].to_pylist()
    spans = [(r["phase"], r["source"], r["start_ns"] - start, r["end_ns"] - start) for r in got]
    assert spans == [("prefill", "hook", 0, 28 * MS), ("decode", "hook", 28 * MS, 30 * MS),
                     ("decode", "nvml", -5 * MS, 35 * MS)]
    # One rule: the replay's pieces are the recording's, prefill stretched to 28 ms.
    s, e, p = flatten(pa.Table.from_pylist(got), start - 5 * MS, start + 35 * MS)
    assert list(zip((s - start).tolist(), (e - start).tolist(), p.tolist())) == [
        (-5 * MS, 0, "decode"), (0, 28 * MS, "prefill"), (28 * MS, 35 * MS, "decode")]


def test_the_replay_says_how_long_each_phase_took_against_the_recording():
    got = SimpleNamespace(bounds=np.array([10 * MS, 20 * MS], np.int64),
                          piece_phase=np.array(["prefill", "decode", "idle"], object))
    p = SimpleNamespace(t0=2 * MS, issue_ns=np.array([2 * MS, 25 * MS], np.int64))
    start = 1000 * MS
    edges = np.array([UNKNOWN + 1, start + 16 * MS, start + 24 * MS], np.int64)
    took = stretch(got, edges, p, 1.0, start, np.array([start + 30 * MS]))
    want = {"prefill": (0.008, 0.016, 0.008), "decode": (0.010, 0.008, -0.002),
            "idle": (0.005, 0.006, 0.001)}
    assert took.keys() == want.keys()
    for ph, figures in want.items():
        t = took[ph]
        assert (t["recorded_s"], t["replayed_s"], t["stretched_s"]) == pytest.approx(figures)


def test_a_threads_calls_keep_its_order_and_pace_on_a_slower_candidate():
    """Two recorded threads, each making 10 calls of 0.1 ms with 1 ms of its own work
    between them, recorded on a fast device; replayed where each call takes 3 ms: a thread's
    call goes out only after its previous one completed, and its own 1 ms later (the engine's
    thread waits for its call, then works), so each thread's calls move by what the candidate
    added, while the other thread's are not held by them. Open loop (no order given) sends
    them at their recorded times, up to the lane's threads in flight."""
    from kvprof.replay.plan import thread_order

    tid = np.array([1, 2] * 10)
    issue = np.array([k * 1_100_000 + t * 50_000 for k in range(10) for t in (0, 1)],
                     np.int64)
    complete = issue + 100_000
    after, gap = thread_order(tid, issue, complete)
    assert after.tolist()[:4] == [-1, -1, 0, 1] and gap.tolist()[2:4] == [1_000_000] * 2
    spans = [(0, 0)] * 20
    lock = threading.Lock()

    def do(k: int, _view: memoryview) -> None:
        began = time.monotonic_ns()
        time.sleep(0.003)
        with lock:
            spans[k] = (began, time.monotonic_ns())

    segment = np.zeros(20, np.int64)
    for order in ((after, gap), (None, None)):
        gate = Gate(np.zeros(0, np.int64), segment, new_edges(1), 0, 1.0)
        run = _at_their_times(issue.tolist(), do, np.full(20, 4096), np.zeros(20, np.int8),
                              8, gate, segment, *order)
        start = time.monotonic_ns() + 20 * MS
        run(start)
        began = np.array([s[0] for s in spans])
        ended = np.array([s[1] for s in spans])
        if order[0] is not None:
            for k in range(2, 20):  # after its own previous call, and its 1 ms of work
                assert began[k] >= ended[k - 2] + 1_000_000, k
            # Each thread takes 10 x (3 ms + 1 ms) less the last work, not 10 x 1.1 ms.
            for t in (0, 1):
                assert ended[18 + t] - began[t] >= 39 * MS
        else:  # each at its recorded time: a thread's calls overlap its earlier ones
            assert any(began[k] < ended[k - 2] for k in range(2, 20))


def test_a_shifting_gate_keeps_each_pieces_length_and_moves_the_rest():
    """Pieces of 10 ms each; piece 0's one call completes 25 ms late: piece 1 starts then
    (at the next slot edge) and keeps its 10 ms, piece 2 follows it, and the windows
    ReplayedWindows sends sit at their offsets in the moved pieces."""
    start = 1000 * SLOT_NS
    bounds = np.array([10 * MS, 20 * MS], np.int64)
    edges = new_edges(3)
    g = Gate(bounds, np.array([0]), edges, 0, 1.0, shift=True)
    g.begin(start)
    g.done(0, start + 25 * MS)
    assert edges[1] == start + 28 * MS  # 25 ms is inside the slot [24, 28) ms
    assert edges[2] == start + 38 * MS  # piece 1's 10 ms, not its recorded 20 ms mark
    assert g.due_in(2, 23 * MS) == start + 41 * MS
    w = ReplayedWindows(pa.table({"start_ns": [0, 10 * MS, 20 * MS],
                                  "end_ns": [10 * MS, 20 * MS, 30 * MS],
                                  "phase": ["prefill", "decode", "prefill"],
                                  "source": ["hook"] * 3, "prefill_tokens": [1, 0, 1],
                                  "decode_tokens": [0, 1, 0]}), bounds)
    w.schedule(start, 0, 1.0, edges, shift=True)
    got, known = w.warp(np.array([5 * MS, 15 * MS, 25 * MS], np.int64))
    assert known.all()
    assert got.tolist() == [start + 5 * MS, start + 33 * MS, start + 43 * MS]


def test_a_calls_due_time_is_where_the_windows_put_its_piece():
    """The replaying threads' due time for a call (Gate.due_in, one call in integers) is the
    one ReplayedWindows maps the recording with (in_shifted_pieces, many at once)."""
    from kvprof.phases.replayed import in_shifted_pieces

    rng = np.random.default_rng(7)
    for speed in (1.0, 0.5, 3.0):
        bounds = np.sort(rng.integers(10**9, 2 * 10**9, 5))
        t0 = 10**9 - 12_345
        edges = new_edges(len(bounds) + 1, None)
        edges[:] = np.sort(rng.integers(5 * 10**9, 9 * 10**9, len(edges)))
        gate = Gate(bounds, np.zeros(1, np.int64), edges, t0, speed, shift=True)
        gate._start = 4 * 10**9 + 17
        t = rng.integers(t0, 2 * 10**9, 200)
        piece = np.searchsorted(bounds, t, side="right")
        want = in_shifted_pieces(t, piece, bounds, edges, gate._start, t0, speed)
        assert [gate.due_in(int(j), int(x)) for j, x in zip(piece, t)] == want.tolist()
