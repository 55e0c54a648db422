"""Pure parts of correlation and the marker protocol, against hand-worked answers."""
from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
import pytest

from kvprof import schema
from kvprof.analysis.fold import _flatten_disjoint, _flatten_sweep, flatten
from kvprof.analysis.intervals import busy_between, busy_islands
from kvprof.commands.demo import SAMPLE_DIR
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


# -- the mean number of requests in flight while busy (Little's law) ----------------------------

def _sweep_busy(begin: list[int], end: list[int], pieces: list[tuple[int, int, str]]
                ) -> dict[str, int]:
    """Per phase, the ns with at least one [begin, end) interval open inside its pieces: a
    plain sweep over every edge, apart from correlate's islands."""
    edges = sorted({*begin, *end, *(a for a, _, _ in pieces), *(b for _, b, _ in pieces)})
    opened: dict[int, int] = {}
    for t in begin:
        opened[t] = opened.get(t, 0) + 1
    for t in end:
        opened[t] = opened.get(t, 0) - 1
    out: dict[str, int] = {}
    n = 0
    for a, b in zip(edges, edges[1:]):
        n += opened.get(a, 0)
        if n <= 0:
            continue
        for s, e, p in pieces:
            if s <= a and b <= e:
                out[p] = out.get(p, 0) + b - a
    return out


@pytest.mark.parametrize("seed", [1, 2])
def test_inflight_mean_is_the_summed_device_time_over_the_busy_time(tmp_path, seed):
    """Block requests of 1 to 6 readers at a time, each at QD1 (some through a scheduler's
    queue, some on a second device), in the sample's phase windows: per phase and device, the
    report's `inflight_mean` is the requests' summed time in flight, from insert (or issue)
    to completion (grouped by the window holding their issue time, in DuckDB), over the time
    some request was in flight
    (a sweep over every edge); SQL and the dashboard's row cache say the same."""
    import shutil

    import duckdb

    from kvprof.store.session import open_replay, session_info
    from tests.helpers import report_both_ways

    shutil.copytree(SAMPLE_DIR, tmp_path / "s")
    db = tmp_path / "s" / "session.duckdb"
    rng = np.random.default_rng(seed)
    with duckdb.connect(str(db)) as con:
        t0, t1 = con.execute("SELECT min(start_ns), max(end_ns) FROM phase").fetchone()
        rows: dict[str, list] = {k: [] for k in ("insert_ns", "issue_ns", "complete_ns",
                                                 "dev_name", "op", "bytes")}
        # Stretches of 1..6 readers, each issuing its next request when the last completes.
        t = t0 - 5_000_000
        while t < t1:
            stretch = int(rng.integers(2_000_000, 40_000_000))
            for _ in range(int(rng.integers(1, 7))):
                s = t + int(rng.integers(0, 500_000))
                while s < t + stretch:
                    queued = int(rng.integers(0, 30_000)) if rng.random() < 0.3 else 0
                    d = int(rng.integers(100_000, 3_000_000))
                    rows["insert_ns"].append(s if queued else 0)
                    rows["issue_ns"].append(s + queued)
                    rows["complete_ns"].append(s + queued + d)
                    rows["dev_name"].append("loop1" if rng.random() < 0.2 else "loop0")
                    rows["op"].append("read" if rng.random() < 0.7 else "write")
                    rows["bytes"].append(256 << 10)
                    s += queued + d + int(rng.integers(0, 50_000))
            t += stretch + int(rng.integers(0, 30_000_000))
        synthetic = pa.table(rows)  # noqa: F841 - DuckDB reads it by name (FROM synthetic)
        con.execute("DELETE FROM io WHERE layer = 'block'")
        # Traced on both devices (a session traced on one holds no other's requests).
        con.execute("UPDATE session SET devices = ?", [json.dumps(
            [{"name": f"loop{m}", "major": 7, "minor": m} for m in (0, 1)])])
        con.execute("""INSERT INTO io BY NAME
                       SELECT 'block' AS layer, op, insert_ns, issue_ns, complete_ns, dev_name,
                              bytes, 7::UINTEGER AS dev_major,
                              right(dev_name, 1)::UINTEGER AS dev_minor,
                              0::UBIGINT AS sector, 1::UINTEGER AS pid, 1::UINTEGER AS tgid,
                              'reader' AS comm, 0 AS error FROM synthetic""")
        issued = con.execute("""
            SELECT coalesce(w.phase, 'idle'), io.dev_name,
                   sum(complete_ns - CASE WHEN insert_ns > 0 THEN insert_ns ELSE issue_ns END)
            FROM io LEFT JOIN phase w ON io.issue_ns >= w.start_ns AND io.issue_ns < w.end_ns
            WHERE io.layer = 'block' GROUP BY ALL""").fetchall()
        windows = con.execute("SELECT start_ns, end_ns, phase FROM phase ORDER BY 1").fetchall()
    con = open_replay(tmp_path / "s")
    try:
        info = session_info(con)
        report = report_both_ways(con)
    finally:
        con.close()
    # The session's time in phase pieces: its windows, idle between them.
    pieces, at = [], info.start_ns
    for s, e, p in windows:
        pieces += [(at, s, "idle"), (s, e, p)]
        at = e
    pieces.append((at, info.end_ns, "idle"))
    begin = [i or s for i, s in zip(rows["insert_ns"], rows["issue_ns"])]
    for dev in (None, "loop0", "loop1"):
        mine = [k for k, d in enumerate(rows["dev_name"]) if dev in (None, d)]
        busy = _sweep_busy([begin[k] for k in mine], [rows["complete_ns"][k] for k in mine],
                           pieces)
        for p in ("prefill", "decode", "idle"):
            spent = sum(ns for q, d, ns in issued if q == p and dev in (None, d))
            block = report["phases"][p]["block"]
            got = block["inflight_mean"] if dev is None else \
                block["devices"][dev]["inflight_mean"]
            assert got == pytest.approx(spent / busy[p], rel=1e-12), (seed, dev, p)
            if dev is None:
                print(f"seed {seed} {p}: {spent / 1e9:.3f} s in the device over "
                      f"{busy[p] / 1e9:.3f} s busy = {got:.3f} in flight")
    # Stretches of up to six readers at a time: neither one at a time nor more than six.
    assert 1.2 < report["phases"]["decode"]["block"]["inflight_mean"] < 6
    assert report["phases"]["mixed"]["block"]["inflight_mean"] is None


def test_inflight_mean_from_the_aggregate_tier_where_events_are_missing():
    """The exact section's per device: its block requests' summed queue and service time
    (from insert, as the busy word counts) over its busy time (io_uring's service time is
    not the device's); all devices together only for one device, as time idle."""
    from types import SimpleNamespace

    from kvprof.analysis.correlate import _exact, _idle_from_exact
    from kvprof.analysis.rowsource import AggRow, BusyRow, Pieces, ViewFilter

    def agg(phase, layer, dev, service_ms, queue_ms=0):
        hist = [0] * 40
        hist[21] = 10
        return AggRow(phase, layer, "read", 10, 10 << 18, queue_ms * 1_000_000,
                      service_ms * 1_000_000, hist, hist, hist, False, dev)

    rows = [agg("decode", "block", "sda", 300), agg("decode", "block", "sda", 100),
            agg("decode", "io_uring", "sda", 900), agg("decode", "block", "sdb", 40, 10),
            agg("prefill", "block", "sda", 80)]
    busy = [BusyRow("decode", "sda", 200_000_000), BusyRow("decode", "sdb", 50_000_000),
            BusyRow("prefill", "sda", 80_000_000), BusyRow("idle", "sda", 10_000_000)]
    source = SimpleNamespace(aggregate=lambda *a: (rows, busy))
    info = SimpleNamespace(config={"aggregate": True, "aggregate_slot_ns": 4_000_000})
    times = {p: 1.0 for p in schema.PHASES}
    empty = np.empty(0, np.int64)
    exact = _exact(source, times, Pieces(empty, empty, empty, 0, 1, 0, True), ViewFilter(),
                   info)
    devs = exact["phases"]["decode"]["devices"]
    assert devs["sda"]["inflight_mean"] == pytest.approx(2.0)  # 400 ms over 200 ms
    assert devs["sdb"]["inflight_mean"] == pytest.approx(1.0)
    assert exact["phases"]["prefill"]["devices"]["sda"]["inflight_mean"] == pytest.approx(1.0)
    # Busy with nothing issued in the phase: no figure.
    assert exact["phases"]["idle"]["devices"]["sda"]["inflight_mean"] is None
    idle = _idle_from_exact({p: (None, None, {}) for p in schema.PHASES}, exact)
    assert idle["prefill"][:2] == (92.0, pytest.approx(1.0))
    assert idle["decode"][:2] == (None, None)  # two devices: their union is unknown
    assert idle["decode"][2]["sdb"] == {"time_idle_pct": 95.0, "inflight_mean": 1.0}


def test_an_engine_counted_by_its_plugin_and_its_metrics_is_counted_once():
    """The plugin and the scrape count one vLLM's tokens alike: the plugin's are taken, its
    means first, and another engine's tokens are added."""
    from kvprof.analysis.correlate import _engine

    moved = [("vllm-plugin:prompt_tokens_total", '{"sender": "a"}', 700.0),
             ("vllm:prompt_tokens_total", "{}", 690.0),  # (scraped a little before the end)
             ("sglang:prompt_tokens_total", "{}", 50.0),
             ("vllm-plugin:time_to_first_token_seconds_sum", "{}", 2.0),
             ("vllm-plugin:time_to_first_token_seconds_count", "{}", 4.0),
             ("vllm:time_to_first_token_seconds_sum", "{}", 9.0),
             ("vllm:time_to_first_token_seconds_count", "{}", 4.0)]
    engine = _engine(moved, 10.0)
    assert engine["prompt_tokens"] == 750.0
    assert engine["ttft_s"] == 0.5
    assert engine["generation_tokens"] is None


class _Scraped:
    """A session whose connector hits only a scrape counted: (previous scrape, scrape, hits)."""

    def __init__(self, steps):
        self.steps = steps

    def counter_steps(self, names, t0, t1):
        return [] if all(n in schema.MARK_SERIES for n in names) else self.steps


def test_scraped_hits_are_shared_among_an_intervals_prompt_phases_and_the_rest_is_unsure():
    from kvprof.analysis.correlate import _hits_by_phase

    ws, we, wp = flatten(windows((10, 20, "prefill", "manual"), (20, 40, "decode", "manual"),
                                 (50, 60, "mixed", "manual"), (70, 80, "decode", "manual")),
                         0, 100)
    # 0-30: prefill and decode (and idle): all 100 to prefill, sure. 30-65: decode and mixed:
    # all 60 to mixed, sure. 0-100 again: prefill 10 ns, mixed 10: 40 each, unsure. 85-95:
    # no window: idle, sure.
    steps = [(0, 30, 100.0), (30, 65, 60.0), (0, 100, 80.0), (85, 95, 5.0)]
    got, unsure = _hits_by_phase(_Scraped(steps), 0, 100, ws, we, wp)
    assert got == {"prefill": 140.0, "mixed": 100.0, "idle": 5.0} and unsure == 80.0
    # Only decode in the interval: its share by time, decode and idle: unsure.
    got, unsure = _hits_by_phase(_Scraped([(60, 90, 30.0)]), 0, 100, ws, we, wp)
    assert got == {"decode": 10.0, "idle": 20.0} and unsure == 30.0
    assert _hits_by_phase(_Scraped([]), 0, 100, ws, we, wp) == ({}, None)


def test_rows_find_their_phase_by_time_bucket_as_by_the_asof_join(monkeypatch):
    """The report's biggest query finds each row's phase piece by a hash join on time
    buckets (rowsource.Buckets) rather than the ASOF join: on pieces of very unequal length
    (some buckets where several begin, sent to the ASOF join, and some where one does), rows
    before, inside and after them, and rows at the pieces' very starts, it gives what the
    ASOF join alone gives, count for count and quantile for quantile."""
    import duckdb

    from kvprof.analysis import rowsource
    from kvprof.analysis.rowsource import Pieces, SqlRows

    rng = np.random.default_rng(7)
    n = 500
    lengths = np.where(rng.random(n) < 0.2, rng.integers(1, 10_000, n),
                       rng.integers(1_000_000, 5_000_000, n))
    start = 10**12 + np.concatenate([[0], np.cumsum(lengths)[:-1]])
    phase = rng.choice(["prefill", "decode", "idle"], n)
    pieces = Pieces(start=start, end=start + lengths, phase=phase, t0=int(start[0]),
                    t1=int(start[-1] + lengths[-1]), origin=int(start[0]))
    issue = np.concatenate([start, rng.integers(start[0] - 10**7, pieces.t1 + 10**7, 30_000)])
    queued = np.where(rng.random(len(issue)) < 0.5, rng.integers(1, 50_000, len(issue)), 0)
    rows = pa.table({  # noqa: F841 - DuckDB reads it by name
        "layer": rng.choice(["block", "io_uring"], len(issue)),
        "op": rng.choice(["read", "write"], len(issue)),
        "bytes": rng.integers(0, 1 << 20, len(issue)).astype(np.uint64),
        "insert_ns": np.where(queued > 0, issue - queued, 0),
        "issue_ns": issue, "complete_ns": issue + rng.integers(1_000, 5_000_000, len(issue))})
    con = duckdb.connect()
    con.execute("CREATE TABLE io AS SELECT * FROM rows")
    # A row without an issue time is in no phase, either way.
    con.execute("INSERT INTO io VALUES ('block', 'read', 4096, 0, NULL, 5)")
    multi = rowsource._buckets(pieces).table["k_multi"].to_pylist()
    assert any(multi) and not all(multi)
    views = (("", []), ("bytes >= ? AND op = ?", [1 << 19, "read"]))
    got = [SqlRows(con.cursor())._stats(pieces, *v) for v in views]
    monkeypatch.setattr(rowsource, "_buckets", lambda p: None)
    want = [SqlRows(con.cursor())._stats(pieces, *v) for v in views]
    assert sum(r[3] for r in want[0]) == len(issue)
    for g, w in zip(got, want):
        assert sorted(g, key=str) == sorted(w, key=str)
