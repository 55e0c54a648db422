"""The dashboard's row cache and its rollup compute exactly what the SQL of `kvprof report`
computes, for any window and filter, while rows keep arriving in completion order; and they do
it incrementally (a refresh rebuilds only the units that changed)."""
from __future__ import annotations

import dataclasses

import duckdb
import numpy as np
import pyarrow as pa
import pytest

from kvprof import schema
from kvprof.analysis.correlate import summarize
from kvprof.analysis.intervals import busy_islands, busy_islands_ordered
from kvprof.analysis.iocache import IoCache
from kvprof.analysis.rollup import FINE_BITS, Rollup, fine_bucket
from kvprof.analysis.rowsource import LiveRows, SqlRows, ViewFilter
from kvprof.store.session import Reader, open_replay, session_info
from kvprof.views.snapshot import build_snapshot
from tests.helpers import assert_same_report
from tests.live.test_top import SAMPLE

NS = 1_000_000_000


def assert_same_snapshot(ours, ref) -> None:
    for f in dataclasses.fields(ref):
        if f.name == "build_s":
            continue
        a, b = getattr(ours, f.name), getattr(ref, f.name)
        if f.name in ("phases", "timeline"):
            a, b = [dataclasses.asdict(x) for x in a], [dataclasses.asdict(x) for x in b]
        assert_same_report(a, b, f.name)


def test_fine_buckets_never_decrease_and_are_exact_for_small_values():
    rng = np.random.default_rng(3)
    v = np.sort(np.concatenate([rng.integers(-1000, 1000, 5000),
                                rng.lognormal(12, 4, 20000).astype(np.int64),
                                [0, 1, 31, 32, 33, 2**40, 2**62]]))
    b = fine_bucket(v)
    assert (np.diff(b) >= 0).all()
    small = (v >= 0) & (v < 1 << FINE_BITS)
    assert (b[small] == v[small] + 1).all() and (b[v < 0] == 0).all()
    assert (b[v >= 1 << FINE_BITS] > 1 << FINE_BITS).all()


def test_islands_from_issue_order_equal_sorted_islands():
    rng = np.random.default_rng(5)
    for _ in range(50):
        n = int(rng.integers(1, 400))
        issue = np.sort(rng.integers(0, 10_000, n))
        start = issue - rng.integers(0, 300, n)
        end = issue + rng.integers(0, 200, n)
        a, b = busy_islands_ordered(start, end), busy_islands(start, end)
        assert np.array_equal(a[0], b[0]) and np.array_equal(a[1], b[1])


@pytest.fixture(scope="module")
def sample():
    con = open_replay(SAMPLE)
    yield con, session_info(con)
    con.close()


@pytest.mark.parametrize("window_s", [None, 60.0, 10.0, 1.0])
def test_cache_gives_the_report_of_the_sample(sample, window_s):
    con, info = sample
    live = Rollup(IoCache())
    assert live.cache.refresh(con) == con.execute("SELECT count(*) FROM io").fetchall()[0][0]
    dev = info.devices[0]["name"]
    fio = next(t for t, c in build_snapshot(SqlRows(con), None, info.end_ns).process_choices
               if c == "fio")
    for now in (info.end_ns, info.start_ns + (info.end_ns - info.start_ns) * 2 // 3):
        for f in (ViewFilter(), ViewFilter(device=dev), ViewFilter(tgid=fio),
                  ViewFilter(device="none")):
            ours = build_snapshot(LiveRows(SqlRows(con), live), window_s, now, f)
            assert_same_snapshot(ours, build_snapshot(SqlRows(con), window_s, now, f))
            assert_same_report(
                summarize(LiveRows(SqlRows(con), live), ours.t0_ns, ours.t1_ns, f),
                summarize(SqlRows(con), ours.t0_ns, ours.t1_ns, f))


class Session:
    """An in-memory session fed like the recorder feeds it: rows in completion order, a
    flush at a time; windows from two sources of different rank, some arriving late."""

    def __init__(self, seconds: int, rate: int, seed: int = 11):
        self.con = duckdb.connect(":memory:")
        for name in schema.TABLES:
            self.con.execute(schema.duckdb_ddl(name))
        rng = np.random.default_rng(seed)
        self.start = 100 * NS
        n = seconds * rate
        issue = self.start + np.sort(rng.integers(0, seconds * NS, n))
        # Mostly fast, some slow enough to stay in flight across seconds and windows.
        dev_ns = np.where(rng.random(n) < 0.01, rng.integers(NS // 10, 3 * NS // 2, n),
                          rng.lognormal(10, 1.5, n).astype(np.int64))
        queue = np.where(rng.random(n) < 0.3, 0, rng.lognormal(7, 2, n).astype(np.int64))
        block = rng.random(n) < 0.75
        op = rng.choice(["read", "write", "flush"], n, p=[0.6, 0.35, 0.05])
        dev = np.where(rng.random(n) < 0.7, "loop7", "zram3")
        self.io = pa.table({
            "layer": np.where(block, "block", "io_uring"),
            "op": op,
            "flags": np.zeros(n, np.uint16),
            "insert_ns": np.where(block & (queue > 0), issue - queue, 0),
            "issue_ns": issue,
            "complete_ns": issue + dev_ns,
            "dev_major": np.full(n, 7, np.uint32),
            "dev_minor": np.zeros(n, np.uint32),
            "dev_name": pa.array(np.where(block, dev, None)),
            "sector": np.zeros(n, np.uint64),
            "bytes": np.where(op == "flush", 0, rng.choice([4096, 65536, 1 << 20], n)
                              ).astype(np.uint64),
            "pid": np.full(n, 1, np.uint32),
            "tgid": rng.choice([10, 20, 30], n).astype(np.uint32),
            "comm": np.full(n, "engine"),
            "cgroup_id": np.zeros(n, np.uint64),
            "error": np.zeros(n, np.int32),
            "uring_opcode": np.zeros(n, np.uint8),
            "uring_ctx": np.zeros(n, np.uint64),
            "syscall": pa.nulls(n, pa.string()),
            "path": pa.nulls(n, pa.string()),
            "bytes_asked": pa.nulls(n, pa.uint64()),
            "cache": pa.nulls(n, pa.string()),
            "inode": pa.nulls(n, pa.uint64()),
            "sample_weight": pa.array(np.ones(n, np.uint32)),
            "fetched_bytes": pa.nulls(n, pa.uint64()),
            "file_offset": pa.nulls(n, pa.int64()),
        }, schema=schema.IO)
        self.io = pa.concat_tables([self.io, self._file_syscalls(seconds, rate // 8, seed)])
        # Stored in completion order, as the recorder stores them.
        self.io = self.io.take(np.argsort(self.io["complete_ns"].to_numpy(), kind="stable"))
        windows = []
        t = self.start
        while t < self.start + seconds * NS:  # hook marks: prefill, decode, a gap
            for phase, length in (("prefill", rng.integers(NS // 20, NS // 3)),
                                  ("decode", rng.integers(NS // 4, NS)), (None, NS // 10)):
                if phase:
                    windows.append((t, t + int(length), phase, "hook"))
                t += int(length)
        for s in range(self.start, self.start + seconds * NS, 3 * NS):  # coarser metrics
            windows.append((s, s + 2 * NS, "mixed", "metrics"))
        self.windows = sorted(windows)
        self.sent_io = 0
        self.sent_windows = 0
        self.con.register("_s", pa.Table.from_pylist([{
            "session_id": "t", "host": "h", "kernel": "", "kvprof_version": "",
            "bcc_version": "", "start_wall_ns": 0, "start_ns": self.start, "end_ns": None,
            "clock_offset_ns": 0, "devices": "[]", "config": "{}", "lost": "{}",
            "sources": "[]", "status": "recording"}], schema=schema.SESSION))
        self.con.execute("INSERT INTO session SELECT * FROM _s")

    def _file_syscalls(self, seconds: int, rate: int, seed: int) -> pa.Table:
        """An engine's own file I/O beside: buffered and O_DIRECT chunk-file calls of two
        KV caches, a few fsyncs (their own random stream: the block rows stay as they were)."""
        rng = np.random.default_rng(seed + 1)
        n = seconds * rate
        issue = self.start + np.sort(rng.integers(0, seconds * NS, n))
        op = rng.choice(["read", "write", "flush"], n, p=[0.6, 0.35, 0.05])
        nbytes = np.where(op == "flush", 0, rng.choice([4096, 65536, 1 << 20], n))
        cache = rng.choice(["lmcache-disk", "vllm-fs-tier"], n)
        return pa.table({
            "layer": np.full(n, "syscall"), "op": op,
            "flags": np.where(cache == "vllm-fs-tier", schema.FLAG_DIRECT, 0).astype(np.uint16),
            "insert_ns": np.zeros(n, np.int64), "issue_ns": issue,
            "complete_ns": issue + rng.lognormal(9, 1.5, n).astype(np.int64),
            "dev_major": pa.nulls(n, pa.uint32()), "dev_minor": pa.nulls(n, pa.uint32()),
            "dev_name": pa.nulls(n, pa.string()), "sector": pa.nulls(n, pa.uint64()),
            "bytes": nbytes.astype(np.uint64), "pid": np.full(n, 2, np.uint32),
            "tgid": rng.choice([10, 20], n).astype(np.uint32), "comm": np.full(n, "kv_io"),
            "cgroup_id": np.zeros(n, np.uint64), "error": np.zeros(n, np.int32),
            "uring_opcode": pa.nulls(n, pa.uint8()), "uring_ctx": pa.nulls(n, pa.uint64()),
            "syscall": np.where(op == "flush", "fsync", np.where(op == "read", "pread64",
                                                                  "pwrite64")),
            "path": np.char.add("/kv/", cache), "bytes_asked": nbytes.astype(np.uint64),
            "cache": cache,
            "inode": np.where(cache == "vllm-fs-tier", 12, 13).astype(np.uint64),
            "sample_weight": np.ones(n, np.uint32),
            # (none: a read's device bytes are its thread's block reads, as recorded before)
            "fetched_bytes": pa.nulls(n, pa.uint64()),
            "file_offset": pa.nulls(n, pa.int64()),
        }, schema=schema.IO)

    def flush_until(self, now: int) -> None:
        done = int(np.searchsorted(np.asarray(self.io["complete_ns"]), now, side="right"))
        if done > self.sent_io:
            self.con.register("_b", self.io.slice(self.sent_io, done - self.sent_io))
            self.con.execute("INSERT INTO io SELECT * FROM _b")
            self.sent_io = done
        # Hook windows as they end; metrics windows a second late, as scrapes see them.
        ready = [w for w in self.windows[self.sent_windows:]
                 if w[1] + (NS if w[3] == "metrics" else 0) <= now]
        if ready:
            rows = [{"start_ns": s, "end_ns": e, "phase": p, "source": src, "engine": "e",
                     "gpu": None, "prefill_tokens": None, "decode_tokens": None,
                     "confidence": 1.0} for s, e, p, src in ready]
            self.con.register("_w", pa.Table.from_pylist(rows, schema=schema.PHASE))
            self.con.execute("INSERT INTO phase SELECT * FROM _w")
            self.sent_windows += len(ready)
        self.con.execute(f"UPDATE session SET end_ns = {now}")


def test_cache_fed_in_completion_order_stays_equal_to_sql():
    sess = Session(seconds=14, rate=4000)
    live = Rollup(IoCache())
    checked = 0
    for step in range(1, 30):
        now = sess.start + step * NS // 2
        sess.flush_until(now)
        live.cache.refresh(sess.con)
        for window, f in ((10.0, ViewFilter()), (60.0, ViewFilter()),
                          (None, ViewFilter(device="loop7")),
                          (10.0, ViewFilter(tgid=20))):
            if step % 3 and window != 10.0:
                continue  # every view every third step; the live default every step
            before = live.rows_built
            ours = build_snapshot(LiveRows(SqlRows(sess.con), live), window, now, f)
            assert_same_snapshot(ours, build_snapshot(SqlRows(sess.con), window, now, f))
            checked += 1
            if now - sess.start > 11 * NS and window == 10.0 and f == ViewFilter():
                # Incremental: a frame rebuilds the newest units, the one cut by the
                # window's start and those a late row or window reached, not the window.
                rebuilt, rows = live.rows_built - before, len(live.cache.rows(
                    ours.t0_ns, ours.t1_ns))
                assert rebuilt < 0.4 * rows, (rebuilt, rows)
    assert checked > 40


def test_views_past_the_cache_bound_fall_back_to_sql():
    sess = Session(seconds=6, rate=4000)
    sess.flush_until(sess.start + 6 * NS)
    live = Rollup(IoCache(max_rows=5000))
    live.cache.refresh(sess.con)
    assert 4000 < len(live.cache) <= 5000  # the newest rows; late ones issued earlier go
    end = sess.start + 6 * NS
    assert not live.cache.covers(sess.start) and live.cache.covers(end - NS // 2)
    for window in (None, 1.0):
        assert_same_snapshot(
            build_snapshot(LiveRows(SqlRows(sess.con), live), window, end, ViewFilter()),
            build_snapshot(SqlRows(sess.con), window, end))


def test_gpu_line_averages_the_samples_of_its_window():
    sess = Session(seconds=4, rate=500)
    end = sess.start + 4 * NS
    sess.flush_until(end)
    ts = np.arange(sess.start + 2 * NS, end, NS // 10)  # 10 Hz from second 2 on
    rows = [{"ts_ns": int(t), "gpu": g, "uuid": f"GPU-{g}", "gpu_util_pct": float(i % 97),
             "mem_util_pct": 50.0 + g, "sm_active_pct": None if g else float(i % 13),
             "tensor_active_pct": None, "dram_bw_util_pct": None,
             "power_w": None if g else 300.0 + i, "pcie_rx_bytes_per_s": 1e9 * (g + 1),
             "pcie_tx_bytes_per_s": 0.0, "process_util": "{}"}
            for i, t in enumerate(ts) for g in (0, 1)]
    sess.con.register("_g", pa.Table.from_pylist(rows, schema=schema.GPU))
    sess.con.execute("INSERT INTO gpu SELECT * FROM _g")
    s = build_snapshot(SqlRows(sess.con), 1.0, end)
    inside = [r for r in rows if s.t0_ns <= r["ts_ns"] < s.t1_ns]
    assert s.gpu.gpus == 2 and s.gpu.samples == len(inside) == 20
    assert s.gpu.util_pct == pytest.approx(np.mean([r["gpu_util_pct"] for r in inside]))
    # Fields a GPU does not support are left out of the mean, not counted as zero.
    assert s.gpu.power_w == pytest.approx(np.mean([r["power_w"] for r in inside if r["gpu"] == 0]))
    assert s.gpu.sm_active_pct == pytest.approx(
        np.mean([r["sm_active_pct"] for r in inside if r["gpu"] == 0]))
    early = build_snapshot(SqlRows(sess.con), 1.0, sess.start + NS)
    assert early.gpu is None and early.gpu_note == "no GPU samples in this window"


def test_cache_memory_stays_within_its_bound_while_rows_stream_through():
    """Rows keep arriving and the oldest go: the arrays stop growing at their limit."""
    sess = Session(seconds=12, rate=3000)
    cache = IoCache(max_rows=8000)
    for step in range(1, 25):
        sess.flush_until(sess.start + step * NS // 2)
        cache.refresh(sess.con)
        assert len(cache) <= 8000
        assert len(cache.col("issue")) == len(cache)
        assert len(cache._cols["issue"]) <= 10000  # 8000 + a quarter
    issue = cache.col("issue")
    assert (np.diff(issue) >= 0).all()
    # Every stored row issued since the cache's horizon is held, once.
    stored = sess.con.execute(f"SELECT count(*) FROM io WHERE issue_ns >= {cache.lo_ns}"
                              ).fetchall()[0][0]
    assert stored == len(cache)


def test_asking_for_another_view_interrupts_a_long_sql_build(monkeypatch):
    """A whole-session view computed by SQL (the session outgrew the cache) takes seconds at
    high rates; switching away from it does not wait for it."""
    import threading
    import time

    import kvprof.analysis.rowsource as rowsource
    from kvprof.views.snapshot import Clock, SnapshotFeed, ViewRequest

    sess = Session(seconds=40, rate=25000)
    end = sess.start + 40 * NS
    sess.flush_until(end)
    t = time.perf_counter()
    build_snapshot(SqlRows(sess.con), None, end)
    sql_s = time.perf_counter() - t
    t = time.perf_counter()
    build_snapshot(SqlRows(sess.con), 10.0, end)
    ten_s = time.perf_counter() - t  # the view asked for, built on its own
    monkeypatch.setattr(rowsource, "feed_cache", lambda: Rollup(IoCache(max_rows=10)))
    got, errors = [], []
    arrived = threading.Event()

    def deliver(s):
        got.append((time.perf_counter(), s.window_s))
        arrived.set()

    feed = SnapshotFeed(Reader(sess.con), Clock(sess.start, end, playing=False), deliver,
                        errors.append, interval_s=0.05, request=ViewRequest(window_s=None))
    feed.start()
    try:
        while feed._building is None:  # the whole-session build is under way
            time.sleep(0.005)
        time.sleep(sql_s / 5)
        asked = time.perf_counter()
        feed.ask(ViewRequest(window_s=10.0))
        deadline = time.monotonic() + 30
        while not any(w == 10.0 for _, w in got) and time.monotonic() < deadline:
            arrived.wait(0.1)
            arrived.clear()
    finally:
        feed.stop()
    first_10s = next(t for t, w in got if w == 10.0)
    assert not errors
    assert [w for t, w in got if t < first_10s] == []  # the session view never arrived
    # Had it waited, the rest of the session's build (about 0.8 of sql_s, asked a fifth of
    # the way in) would come before the 10 s view's own build: the bound sits half way.
    assert first_10s - asked < ten_s + 0.4 * sql_s, (first_10s - asked, ten_s, sql_s)


def test_a_frame_reads_only_the_windows_reaching_into_its_view():
    from kvprof.store.session import phase_windows

    sess = Session(seconds=6, rate=100)
    sess.flush_until(sess.start + 6 * NS)
    sess.con.execute(f"INSERT INTO phase_open VALUES ({sess.start + 5 * NS}, "
                     f"{sess.start + 6 * NS}, 'decode', 'hook', 'e', NULL, NULL, NULL, 1.0, "
                     "NULL, NULL)")
    every = phase_windows(sess.con).to_pylist()
    t0, t1 = sess.start + 2 * NS, sess.start + 4 * NS
    some = phase_windows(sess.con, t0, t1).to_pylist()
    assert sorted(map(str, some)) == sorted(str(w) for w in every
                                            if w["end_ns"] > t0 and w["start_ns"] < t1)
    assert 0 < len(some) < len(every)
    late = phase_windows(sess.con, sess.start + 5 * NS + 1, sess.start + 7 * NS).to_pylist()
    assert any(w["start_ns"] == sess.start + 5 * NS and w["phase"] == "decode" for w in late)
