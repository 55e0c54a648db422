"""How long one dashboard refresh takes while a session records ~100k I/O events per second.

Builds a synthetic session in DuckDB (io rows at RATE events/s, stored in completion order as the
recorder stores them; a prefill then a decode window every period, 1/5 and 4/5 of it), then plays it
live: every step appends the next half second of rows (the recorder's work, not timed) and times
what the dashboard's feed does for one frame: read the new rows into its cache and build the
snapshot. Baselines measured in the same run on the same rows: a bare DuckDB scan of the window
(count + sums: the floor any query pays) and the SQL path (the snapshot built by re-querying the
window, as `kvprof report` computes it). Not a test: run it, read it.

    .venv/bin/python benchmarks/snapshot_build.py [--rate 100000] [--history 60] [--steps 20]
"""
from __future__ import annotations

import argparse
import statistics
import time

import duckdb
import numpy as np
import pyarrow as pa

from kvprof import schema
from kvprof.analysis.rowsource import LiveRows, SqlRows, feed_cache
from kvprof.views.snapshot import build_snapshot

NS = 1_000_000_000
START = 10 * NS


class Synth:
    """A busy engine's I/O: 4 KiB reads (decode) and 1 MiB writes (prefill), lognormal
    device times around 22 us and queue times around 1 us, four processes, one device plus
    its io_uring rows."""

    def __init__(self, rate: int, period_ns: int = NS):
        self.rate, self.period_ns = rate, period_ns
        self.rng = np.random.default_rng(0)
        self.late: pa.Table | None = None  # rows issued already, completing in the next step

    def io(self, t_from: int, t_to: int) -> pa.Table:
        """Rows issued in [t_from, t_to) that completed by t_to, plus the previous step's
        late completions: the order the recorder stores them in."""
        rng, n = self.rng, int(self.rate * (t_to - t_from) / NS)
        issue = np.sort(t_from + rng.integers(0, t_to - t_from, n)).astype(np.int64)
        lat = rng.lognormal(10, 1, n).astype(np.int64) + 1000
        write = rng.random(n) < 0.3
        block = rng.random(n) < 0.8
        tbl = pa.table({
            "layer": pa.array(np.where(block, "block", "io_uring")),
            "op": pa.array(np.where(write, "write", "read")),
            "flags": pa.array(np.zeros(n, np.uint16)),
            "insert_ns": pa.array(issue - rng.lognormal(7, 1, n).astype(np.int64)),
            "issue_ns": pa.array(issue),
            "complete_ns": pa.array(issue + lat),
            "dev_major": pa.array(np.full(n, 259, np.uint32)),
            "dev_minor": pa.array(np.zeros(n, np.uint32)),
            "dev_name": pa.array(np.where(block, "nvme0n1", None)),
            "sector": pa.array(rng.integers(0, 1 << 30, n).astype(np.uint64)),
            "bytes": pa.array(np.where(write, 1 << 20, 4096).astype(np.uint64)),
            "pid": pa.array(np.full(n, 100, np.uint32)),
            "tgid": pa.array(rng.integers(100, 104, n).astype(np.uint32)),
            "comm": pa.array(np.full(n, "engine")),
            "cgroup_id": pa.array(np.zeros(n, np.uint64)),
            "error": pa.array(np.zeros(n, np.int32)),
            "uring_opcode": pa.array(np.zeros(n, np.uint8)),
            "uring_ctx": pa.array(np.zeros(n, np.uint64)),
            "syscall": pa.nulls(n, pa.string()),
            "path": pa.nulls(n, pa.string()),
            "bytes_asked": pa.nulls(n, pa.uint64()),
            "cache": pa.nulls(n, pa.string()),
            "inode": pa.nulls(n, pa.uint64()),
            "sample_weight": pa.array(np.ones(n, np.uint32)),
            "fetched_bytes": pa.nulls(n, pa.uint64()),  # (syscall reads only)
            "file_offset": pa.nulls(n, pa.int64()),  # (syscall layer only)
        }, schema=schema.IO)
        tbl = tbl.take(np.argsort(issue + lat, kind="stable"))
        done = np.asarray(tbl["complete_ns"]) < t_to
        out = tbl.filter(done)
        if self.late is not None:
            out = pa.concat_tables([self.late, out])
        self.late = tbl.filter(~done)
        return out

    def windows(self, t_from: int, t_to: int) -> pa.Table:
        """A prefill window then a decode window every `period_ns` (1/5 and 4/5 of it)."""
        rows = []
        p = self.period_ns
        for s in range(t_from, t_to, p):
            for a, b, phase in ((s, s + p // 5, "prefill"), (s + p // 5, s + p, "decode")):
                rows.append({"start_ns": a, "end_ns": b, "phase": phase, "source": "hook",
                             "engine": "e", "gpu": None, "prefill_tokens": None,
                             "decode_tokens": None, "confidence": 1.0})
        return pa.Table.from_pylist(rows, schema=schema.PHASE)


def append(con, table: str, data: pa.Table) -> None:
    con.register("_b", data)
    con.execute(f"INSERT INTO {table} SELECT * FROM _b")
    con.unregister("_b")


def make_session(synth: Synth, seconds: int) -> duckdb.DuckDBPyConnection:
    con = duckdb.connect(":memory:")
    for name in schema.TABLES:
        con.execute(schema.duckdb_ddl(name))
    append(con, "session", pa.Table.from_pylist([{
        "session_id": "bench", "host": "bench", "kernel": "", "kvprof_version": "",
        "bcc_version": "", "start_wall_ns": 0, "start_ns": START, "end_ns": None,
        "clock_offset_ns": 0, "devices": '[{"name": "nvme0n1", "major": 259, "minor": 0}]',
        "config": "{}", "lost": "{}", "sources": "[]", "status": "recording"}],
        schema=schema.SESSION))
    for s in range(seconds):  # a second at a time, like flushes
        t = START + s * NS
        append(con, "io", synth.io(t, t + NS))
        append(con, "phase", synth.windows(t, t + NS))
    con.execute(f"UPDATE session SET end_ns = {START + seconds * NS}")  # as flushes mark it
    return con


def timed(fn, repeat: int) -> float:
    fn()  # warm up
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rate", type=int, default=100_000, help="I/O events per second")
    ap.add_argument("--history", type=int, default=60, help="seconds recorded before timing")
    ap.add_argument("--steps", type=int, default=20, help="half-second frames timed per window")
    ap.add_argument("--repeat", type=int, default=3, help="runs of each baseline")
    ap.add_argument("--period-ms", type=int, default=1000,
                    help="one prefill and one decode window per period (engine steps: ~50)")
    a = ap.parse_args()
    t = time.perf_counter()
    synth = Synth(a.rate, a.period_ms * 1_000_000)
    con = make_session(synth, a.history)
    now = START + a.history * NS
    print(f"session: {a.rate:,} events/s x {a.history} s = "
          f"{con.execute('SELECT count(*) FROM io').fetchall()[0][0]:,} io rows; "
          f"built in {time.perf_counter() - t:.1f} s")
    feed = feed_cache()  # what the dashboard's feed holds
    live, sql = LiveRows(SqlRows(con), feed), SqlRows(con)
    t = time.perf_counter()
    feed.cache.refresh(con)
    print(f"feed attaches: first read of {len(feed.cache):,} rows {time.perf_counter() - t:.2f} s")
    print(f"{'window':<9}{'rows':>11}{'scan ms':>9}{'SQL ms':>9}{'frame ms':>10}{'p95':>7}"
          f"{'max':>7}{'vs scan':>9}{'vs SQL':>8}  (frame: refresh + build)")
    for window in (10.0, 60.0, None):
        build_snapshot(live, window, now)  # the window's first frame builds it all
        frames = []
        for _ in range(a.steps):
            append(con, "io", synth.io(now, now + NS // 2))
            if (now - START) % NS == 0:
                append(con, "phase", synth.windows(now, now + NS))
            now += NS // 2
            con.execute(f"UPDATE session SET end_ns = {now}")
            t = time.perf_counter()
            live.refresh()
            build_snapshot(live, window, now)
            frames.append(time.perf_counter() - t)
        t0 = START if window is None else now - int(window * NS)
        rows = con.execute(f"SELECT count(*) FROM io WHERE issue_ns >= {t0} AND "
                           f"issue_ns < {now}").fetchall()[0][0]
        scan = timed(lambda: con.execute(
            f"SELECT count(*), sum(bytes), sum(complete_ns - issue_ns) FROM io "
            f"WHERE issue_ns >= {t0} AND issue_ns < {now}").fetchall(), a.repeat)
        sql_s = timed(lambda: build_snapshot(sql, window, now), a.repeat)
        med = statistics.median(frames)
        p95 = sorted(frames)[int(0.95 * (len(frames) - 1))]
        label = "session" if window is None else f"{window:.0f} s"
        print(f"{label:<9}{rows:>11,}{scan * 1e3:>9.1f}{sql_s * 1e3:>9.0f}{med * 1e3:>10.1f}"
              f"{p95 * 1e3:>7.1f}{max(frames) * 1e3:>7.1f}{med / scan:>8.1f}x"
              f"{med / sql_s:>8.2f}x")


if __name__ == "__main__":
    main()
