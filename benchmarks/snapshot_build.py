"""How long one dashboard snapshot takes to build, at ~100k I/O events per second of session.

Builds a synthetic in-memory session (io rows at RATE events/s for SECONDS, alternating
prefill/decode windows), then times `build_snapshot` for each dashboard window against a
bare DuckDB scan of the same rows (count + sum over the window): the floor any query pays.
Not a test: run it and read the figures.

    .venv/bin/python benchmarks/snapshot_build.py [--rate 100000] [--seconds 120]
"""
from __future__ import annotations

import argparse
import statistics
import time

import duckdb
import numpy as np
import pyarrow as pa

from kvprof import schema
from kvprof.snapshot import build_snapshot

NS = 1_000_000_000


def make_session(rate: int, seconds: int) -> duckdb.DuckDBPyConnection:
    con = duckdb.connect(":memory:")
    for name in schema.TABLES:
        con.execute(schema.duckdb_ddl(name))
    start = 10 * NS
    n = rate * seconds
    rng = np.random.default_rng(0)
    issue = np.sort(start + rng.integers(0, seconds * NS, n)).astype(np.int64)
    lat = rng.lognormal(10, 1, n).astype(np.int64) + 1000
    write = rng.random(n) < 0.3
    io = pa.table({
        "layer": pa.array(np.where(rng.random(n) < 0.8, "block", "io_uring")),
        "op": pa.array(np.where(write, "write", "read")),
        "flags": pa.array(np.zeros(n, np.uint16)),
        "insert_ns": pa.array(issue - 2000),
        "issue_ns": pa.array(issue),
        "complete_ns": pa.array(issue + lat),
        "dev_major": pa.array(np.full(n, 259, np.uint32)),
        "dev_minor": pa.array(np.zeros(n, np.uint32)),
        "dev_name": pa.array(np.full(n, "nvme0n1")),
        "sector": pa.array(rng.integers(0, 1 << 30, n).astype(np.uint64)),
        "bytes": pa.array(np.where(write, 1 << 20, 4096).astype(np.uint64)),
        "pid": pa.array(np.full(n, 100, np.uint32)),
        "tgid": pa.array(rng.integers(100, 104, n).astype(np.uint32)),
        "comm": pa.array(np.full(n, "engine")),
        "cgroup_id": pa.array(np.zeros(n, np.uint64)),
        "error": pa.array(np.zeros(n, np.int32)),
        "uring_opcode": pa.array(np.zeros(n, np.uint8)),
        "uring_ctx": pa.array(np.zeros(n, np.uint64)),
    }, schema=schema.IO)
    con.register("_io", io)
    con.execute("INSERT INTO io SELECT * FROM _io")
    con.unregister("_io")
    # 200 ms prefill, 800 ms decode, every second: 2 windows/s like a busy engine's marks.
    starts = np.arange(start, start + seconds * NS, NS, dtype=np.int64)
    rows = []
    for s in starts:
        rows.append({"start_ns": int(s), "end_ns": int(s + NS // 5), "phase": "prefill",
                     "source": "hook", "engine": "e", "gpu": None, "prefill_tokens": None,
                     "decode_tokens": None, "confidence": 1.0})
        rows.append({"start_ns": int(s + NS // 5), "end_ns": int(s + NS), "phase": "decode",
                     "source": "hook", "engine": "e", "gpu": None, "prefill_tokens": None,
                     "decode_tokens": None, "confidence": 1.0})
    con.register("_ph", pa.Table.from_pylist(rows, schema=schema.PHASE))
    con.execute("INSERT INTO phase SELECT * FROM _ph")
    con.register("_s", pa.Table.from_pylist([{
        "session_id": "bench", "host": "bench", "kernel": "", "kvprof_version": "",
        "bcc_version": "", "start_wall_ns": 0, "start_ns": start, "end_ns": start + seconds * NS,
        "clock_offset_ns": 0, "devices": '[{"name": "nvme0n1", "major": 259, "minor": 0}]',
        "config": "{}", "lost": "{}", "sources": "[]", "status": "complete"}],
        schema=schema.SESSION))
    con.execute("INSERT INTO session SELECT * FROM _s")
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
    ap.add_argument("--rate", type=int, default=100_000, help="events per second of session")
    ap.add_argument("--seconds", type=int, default=120, help="session length")
    ap.add_argument("--repeat", type=int, default=5)
    a = ap.parse_args()
    t = time.perf_counter()
    con = make_session(a.rate, a.seconds)
    start, end = 10 * NS, 10 * NS + a.seconds * NS
    print(f"session: {a.rate * a.seconds:,} io rows ({a.rate:,}/s x {a.seconds} s), "
          f"{2 * a.seconds} phase windows; built in {time.perf_counter() - t:.1f} s")
    print(f"{'window':<14}{'rows':>12}{'scan ms':>10}{'snapshot ms':>13}{'ratio':>8}")
    for window in (10.0, 60.0, None):
        t0 = start if window is None else end - int(window * NS)
        rows = con.execute(f"SELECT count(*) FROM io WHERE issue_ns >= {t0} AND "
                           f"issue_ns < {end}").fetchall()[0][0]
        scan = timed(lambda: con.execute(
            f"SELECT count(*), sum(bytes), sum(complete_ns - issue_ns) FROM io "
            f"WHERE issue_ns >= {t0} AND issue_ns < {end}").fetchall(), a.repeat)
        snap = timed(lambda: build_snapshot(con, window, end), a.repeat)
        label = "session" if window is None else f"{window:.0f} s"
        print(f"{label:<14}{rows:>12,}{scan * 1e3:>10.1f}{snap * 1e3:>13.1f}"
              f"{snap / scan:>7.0f}x")


if __name__ == "__main__":
    main()
