"""The full per-phase report over a big session, against a bare DuckDB scan of the same table.

    .venv/bin/python benchmarks/report_scale.py [--rows 10000000] [--windows 100000]
                                                [--queued all|none]

Builds a synthetic session (benchmarks/snapshot_build.py's busy engine: reads and writes on
one device plus io_uring rows) with ROWS io rows and WINDOWS phase windows (prefill and decode
alternating), then times `correlate.summarize` (what `kvprof report` prints: per phase and
layer counts, exact quantiles, histograms, time idle from busy islands) against the one
DuckDB query a user would write for the same core figures (USER_QUERY: each row ASOF-joined
to the window holding its issue time, then per phase, layer and op the count, bytes, exact
p50/p90/p99/p99.9 of the latency and its log2 histogram), and a bare `SELECT sum(bytes)
FROM io`; each the median of a few runs. The query's counts and bytes are checked against
the report's before the ratios are printed.
"""
from __future__ import annotations

import argparse
import time

from snapshot_build import NS, Synth, make_session, timed

from kvprof.analysis.correlate import summarize
from kvprof.analysis.rowsource import SqlRows

USER_QUERY = """
WITH w AS (SELECT start_ns, end_ns, phase FROM phase),
j AS (
    SELECT CASE WHEN w.end_ns > io.issue_ns THEN w.phase ELSE 'idle' END AS phase,
           io.layer, io.op, io.bytes, io.complete_ns - io.issue_ns AS lat
    FROM io ASOF LEFT JOIN w ON io.issue_ns >= w.start_ns)
SELECT phase, layer, op, count(*) AS ios, sum(bytes) AS bytes,
       quantile_disc(lat, [0.5, 0.9, 0.99, 0.999]) AS pct,
       histogram(CASE WHEN lat > 0 THEN floor(log2(lat))::INT + 1 ELSE 0 END) AS hist
FROM j GROUP BY ALL
"""


def check_same(report: dict, rows: list[tuple]) -> None:
    """The query counts what the report counts: per phase, layer and op, ios and bytes."""
    for phase, layer, op, ios, nbytes, *_ in rows:
        got = report["phases"][phase][layer][op]
        assert (got["ios"], got["bytes"]) == (ios, nbytes), (phase, layer, op, got, ios, nbytes)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=10_000_000)
    ap.add_argument("--windows", type=int, default=100_000)
    ap.add_argument("--seconds", type=int, default=100, help="session length")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--queued", choices=("all", "none"), default="all",
                    help="block requests that waited in a scheduler queue: all (as with "
                         "mq-deadline) or none (no scheduler, as NVMe and loop devices)")
    a = ap.parse_args()
    t = time.perf_counter()
    period_ns = 2 * a.seconds * NS // a.windows  # two windows per period
    con = make_session(Synth(a.rows // a.seconds, period_ns), a.seconds)
    if a.queued == "none":
        con.execute("UPDATE io SET insert_ns = 0")
    n, w = (con.execute(f"SELECT count(*) FROM {t}").fetchall()[0][0] for t in ("io", "phase"))
    print(f"session: {n:,} io rows, {w:,} windows; built in {time.perf_counter() - t:.0f} s")
    check_same(summarize(SqlRows(con.cursor())), con.execute(USER_QUERY).fetchall())
    bare = timed(lambda: con.execute("SELECT sum(bytes) FROM io").fetchall(), a.repeat)
    query = timed(lambda: con.execute(USER_QUERY).fetchall(), a.repeat)
    report = timed(lambda: summarize(SqlRows(con.cursor())), a.repeat)
    print(f"bare sum(bytes) {bare * 1e3:.0f} ms; the user's query {query * 1e3:.0f} ms; "
          f"full report {report * 1e3:.0f} ms; report / query {report / query:.2f}x, "
          f"report / bare {report / bare:.1f}x")


if __name__ == "__main__":
    main()
