"""Pure parts of correlation and the marker protocol, against hand-worked answers."""
from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
import pytest

from kvprof import schema
from kvprof.analysis.fold import _flatten_disjoint, _flatten_sweep, flatten
from kvprof.analysis.intervals import busy_between, busy_islands
from kvprof.phases.mark_server import WindowBuilder, decode


def windows(*rows) -> pa.Table:
    return pa.table({"start_ns": [r[0] for r in rows], "end_ns": [r[1] for r in rows],
                     "phase": [r[2] for r in rows], "source": [r[3] for r in rows]})


def test_flatten_fills_gaps_with_idle_and_clips_to_session():
    s, e, p = flatten(windows((10, 20, "prefill", "manual"), (30, 50, "decode", "manual")), 0, 40)
    assert list(zip(s.tolist(), e.tolist(), p.tolist())) == [
        (0, 10, "idle"), (10, 20, "prefill"), (20, 30, "idle"), (30, 40, "decode")]


def test_flatten_more_exact_source_wins_and_then_the_later_window():
    w = windows((0, 100, "decode", "nvml"), (20, 40, "prefill", "metrics"),
                (30, 60, "mixed", "metrics"), (50, 55, "prefill", "hook"))
    s, e, p = flatten(w, 0, 100)
    assert list(zip(s.tolist(), e.tolist(), p.tolist())) == [
        (0, 20, "decode"), (20, 30, "prefill"), (30, 50, "mixed"), (50, 55, "prefill"),
        (55, 60, "mixed"), (60, 100, "decode")]


@pytest.mark.parametrize("seed", range(40))
def test_flatten_of_windows_that_take_turns_is_the_sweeps(seed):
    """The numpy path (windows that never overlap: the usual session) gives what the sweep
    over every edge gives: windows touching, apart, clipped by the span, one phase twice in a
    row, empty ones; and it declines windows that overlap."""
    rng = np.random.default_rng(seed)
    t, rows = 0, []
    for _ in range(rng.integers(0, 30)):
        t += int(rng.choice([0, 0, 1, 7]))  # touching, or a gap
        d = int(rng.choice([0, 1, 5, 20]))
        rows.append((t, t + d, str(rng.choice(["prefill", "decode", "mixed"])), "hook"))
        t += d
    rng.shuffle(rows)
    w = windows(*rows) if rows else windows((0, 0, "idle", "hook")).slice(0, 0)
    for t0, t1 in ((0, t + 3), (3, max(3, t - 4)), (5, 5)):
        fast = _flatten_disjoint(w, t0, t1)
        assert fast is not None
        slow = _flatten_sweep(w, t0, t1)
        assert [a.tolist() for a in fast] == [a.tolist() for a in slow], (rows, t0, t1)
    if len(rows) > 1:
        a, b = sorted(rows)[:2]
        if a[1] > a[0] and b[1] > b[0]:
            overlapping = windows(*rows, (a[0], b[1] + 1, "decode", "metrics"))
            assert _flatten_disjoint(overlapping, 0, t + 3) is None


def test_busy_islands_merge_overlapping_and_nested_intervals():
    s, e = busy_islands(np.array([5, 0, 20, 8]), np.array([10, 6, 30, 9]))
    assert s.tolist() == [0, 20] and e.tolist() == [10, 30]


def test_busy_islands_cover_exactly_the_instants_some_interval_covers():
    """Against a tick-by-tick count on random sets of intervals in random order (touching,
    nested, empty ones among them): islands are disjoint, in order, separated by real gaps,
    and cover every instant some interval covers and no other."""
    rng = np.random.default_rng(7)
    for _ in range(300):
        n = int(rng.integers(1, 40))
        s = rng.integers(0, 200, n)
        e = s + rng.integers(0, 30, n) * (rng.random(n) > 0.1)
        covered = np.zeros(240, bool)
        for a, b in zip(s, e):
            covered[a:b] = True
        isl_s, isl_e = busy_islands(s, e)
        got = np.zeros(240, bool)
        for a, b in zip(isl_s, isl_e):
            assert not got[a:b].any()
            got[a:b] = True
        assert (got == covered).all()
        assert (isl_s[1:] > isl_e[:-1]).all() and (isl_s <= isl_e).all()


def test_busy_between_counts_only_time_inside_each_range():
    s, e = np.array([0, 20]), np.array([10, 30])
    got = busy_between(s, e, np.array([0, 5, 10, 25, 40]), np.array([100, 25, 20, 26, 50]))
    assert got.tolist() == [20, 10, 0, 1, 0]


def test_decode_accepts_both_forms():
    m = decode(b'{"v":1,"phase":"decode","ts_ns":5,"engine":"e","decode_tokens":3}')
    assert (m.phase, m.ts_ns, m.engine, m.decode_tokens) == ("decode", 5, "e", 3)
    m = decode(json.dumps({"v": 1, "phase": "prefill", "start_ns": 1, "end_ns": 2}).encode())
    assert (m.start_ns, m.end_ns, m.source) == (1, 2, "manual")


@pytest.mark.parametrize("raw", [
    b"", b"null", b'{"v":1}', b'{"v":1,"phase":"decode"}', b'{"v":1,"phase":"x","ts_ns":1}',
    b'{"v":1,"phase":"decode","ts_ns":true}', b'{"v":1,"phase":"decode","ts_ns":1.5}',
    b'{"v":1,"phase":"decode","ts_ns":1,"source":"rumour"}', b"{" * 5000,
])
def test_decode_rejects_malformed(raw):
    with pytest.raises(ValueError):
        decode(raw)


def test_transitions_make_back_to_back_windows_per_engine():
    b = WindowBuilder()
    for raw in [b'{"v":1,"phase":"prefill","ts_ns":10,"engine":"a","prefill_tokens":7}',
                b'{"v":1,"phase":"decode","ts_ns":15,"engine":"b"}',
                b'{"v":1,"phase":"decode","ts_ns":20,"engine":"a"}',
                b'{"v":1,"phase":"idle","ts_ns":30,"engine":"a"}',
                b'{"v":1,"phase":"prefill","ts_ns":12,"engine":"b"}']:  # older than b's open
        b.add(decode(raw))
    b.close_all(40)
    rows = [(r["start_ns"], r["end_ns"], r["phase"], r["engine"], r["prefill_tokens"])
            for r in b.take().to_pylist()]
    assert rows == [(10, 20, "prefill", "a", 7), (20, 30, "decode", "a", None),
                    (15, 40, "decode", "b", None)]
    assert b.out_of_order == 1
    assert b.take() is None


def test_open_windows_are_shown_up_to_now_and_kept_open():
    b = WindowBuilder()
    b.add(decode(b'{"v":1,"phase":"decode","ts_ns":100,"engine":"e"}'))
    assert [(r["start_ns"], r["end_ns"], r["phase"]) for r in b.open_rows(250)] == \
        [(100, 250, "decode")]
    assert b.take() is None  # still open: nothing closed yet
    b.add(decode(b'{"v":1,"phase":"idle","ts_ns":300,"engine":"e"}'))
    assert b.open_rows(400) == []
    assert [(r["start_ns"], r["end_ns"]) for r in b.take().to_pylist()] == [(100, 300)]


def test_builder_rows_match_the_phase_schema():
    b = WindowBuilder()
    b.add(decode(b'{"v":1,"phase":"mixed","start_ns":1,"end_ns":9}'))
    assert b.take().schema == schema.PHASE
