"""A recording rolled into segment files (--roll) reads as one session; with --max-size the
oldest segments go and what is kept stays consistent."""
from __future__ import annotations

import shutil
import subprocess

import duckdb
import pytest

from kvprof.store import session as store
from tests.helpers import (
    AT_STOP,
    READ_IOS,
    assert_kernel_count,
    live,
    run_kvprof,
    settle,
    stat_delta,
)

pytestmark = [live, pytest.mark.skipif(shutil.which("fio") is None, reason="needs fio")]


def reads(dev: str, seconds: int) -> None:
    """20 000 random 4 KiB reads a second through io_uring."""
    subprocess.run(["fio", "--name=seg", f"--filename=/dev/{dev}", "--rw=randread", "--bs=4k",
                    "--direct=1", "--ioengine=io_uring", "--iodepth=4", "--rate_iops=20000",
                    "--time_based", f"--runtime={seconds}", "--size=100M",
                    "--output-format=terse"], check=True, capture_output=True)


def test_a_rolled_session_reads_as_one(loopdev, start_recorder, tmp_path):
    # (both layers named: the raw device's io_uring rows too, for the segments they fill)
    rec = start_recorder("-d", loopdev, "--layer", "block", "--layer", "io_uring", "--roll", "1M")
    s0 = settle(loopdev)
    reads(loopdev, 3)
    s1 = settle(loopdev)
    assert rec.stop() == 0, "".join(rec.stderr_lines)
    parts = store.segments(rec.out)
    assert len(parts) >= 3 and parts[0].name == "session.duckdb", parts
    report = rec.report()
    d = stat_delta(s0, s1)
    ours = report["phases"]["idle"]["block"]["read"]["ios"]
    exact = report["exact"]["totals"]["block"]["read"]["ios"]
    print(f"{len(parts)} segments; kernel {d[READ_IOS]} reads; rows {ours}; exact {exact}")
    assert_kernel_count(ours, d[READ_IOS], report)
    assert_kernel_count(exact, d[READ_IOS], report, reason=AT_STOP)
    assert report["session"]["status"] == "complete"
    # Every row once: the segments' rows add up to the session's, and a replay (tables in
    # memory) holds the same.
    per_part = 0
    for p in parts:
        con = duckdb.connect(str(p), read_only=True)
        per_part += con.execute("SELECT count(*) FROM io WHERE layer = 'block'"
                                ).fetchall()[0][0]
        con.close()
    con = store.open_replay(rec.out)
    assert con.execute("SELECT count(*) FROM io WHERE layer = 'block'").fetchall()[0][0] \
        == per_part
    con.close()
    # The Parquet export of a rolled session is the whole session.
    out = tmp_path / "export"
    r = run_kvprof("export", str(rec.out), "--parquet", str(out))
    assert r.returncode == 0, r.stderr
    n = duckdb.sql(f"SELECT count(*) FROM read_parquet('{out / 'io.parquet'}') "
                   "WHERE layer = 'block'").fetchall()[0][0]
    assert n == per_part


def test_max_size_with_roll_keeps_the_newest_segments(loopdev, start_recorder):
    # (A new segment file takes ~1.3 MB before any row: DuckDB's blocks of its tables.)
    rec = start_recorder("-d", loopdev, "--roll", "2M", "--max-size", "5M")
    reads(loopdev, 5)
    assert rec.stop() == 0, "".join(rec.stderr_lines)
    parts = store.segments(rec.out)
    names = [p.name for p in parts]
    on_disk = sum(p.stat().st_blocks * 512 for p in parts)
    print(f"kept {names}, {on_disk} bytes")
    assert "session.duckdb" not in names and len(parts) >= 1
    assert any("deleted the oldest segment" in line for line in rec.stderr_lines)
    # Bounded: the limit, plus the segment being written when it was checked.
    assert on_disk <= (5 << 20) + 2 * (2 << 20) + (2 << 20)
    report = rec.report()
    assert report["session"]["status"] == "complete"
    # What is kept agrees with itself: the rows (by issue) and the exact counts (by
    # completion second) cover the same span, but for the few requests in flight (QD 4) at
    # its start.
    rows = report["phases"]["idle"]["block"]["read"]["ios"]
    exact = report["exact"]["totals"]["block"]["read"]["ios"]
    assert rows > 0 and abs(rows - exact) <= report["session"]["lost_events"] + 8
    # The oldest were deleted: what is kept spans less than the 5 s of reads (segments roll
    # at a flush, every 0.5 s, so how much less varies with where the rolls fell).
    assert report["session"]["duration_s"] < 5
