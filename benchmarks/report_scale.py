"""The full per-phase report over a big session, against a bare DuckDB scan of the same table.

    .venv/bin/python benchmarks/report_scale.py [--rows 10000000] [--windows 100000]

Builds a synthetic session (benchmarks/snapshot_build.py's busy engine: reads and writes on
one device plus io_uring rows) with ROWS io rows and WINDOWS phase windows (prefill and decode
alternating), then times `correlate.summarize` (what `kvprof report` prints: per phase and
layer counts, exact quantiles, histograms, time idle from busy islands) and a bare
`SELECT sum(bytes) FROM io`, each the median of a few runs, and prints the ratio.
"""
from __future__ import annotations

import argparse
import time

from snapshot_build import NS, Synth, make_session, timed

from kvprof.analysis.correlate import summarize
from kvprof.analysis.rowsource import SqlRows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=10_000_000)
    ap.add_argument("--windows", type=int, default=100_000)
    ap.add_argument("--seconds", type=int, default=100, help="session length")
    ap.add_argument("--repeat", type=int, default=3)
    a = ap.parse_args()
    t = time.perf_counter()
    period_ns = 2 * a.seconds * NS // a.windows  # two windows per period
    con = make_session(Synth(a.rows // a.seconds, period_ns), a.seconds)
    n, w = (con.execute(f"SELECT count(*) FROM {t}").fetchall()[0][0] for t in ("io", "phase"))
    print(f"session: {n:,} io rows, {w:,} windows; built in {time.perf_counter() - t:.0f} s")
    bare = timed(lambda: con.execute("SELECT sum(bytes) FROM io").fetchall(), a.repeat)
    report = timed(lambda: summarize(SqlRows(con.cursor())), a.repeat)
    print(f"bare sum(bytes) {bare * 1e3:.0f} ms; full report {report * 1e3:.0f} ms; "
          f"ratio {report / bare:.1f}x")


if __name__ == "__main__":
    main()
