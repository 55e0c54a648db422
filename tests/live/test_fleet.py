"""Fleet: three real sessions exported as three hosts into one hive-layout directory; the fleet
report's totals are the sum of the three reports, DuckDB reads the layout with
hive_partitioning, files carry the schema version, and an older file (without later columns)
still reads. (The deployment files: tests/live/test_deploy.py.)"""
from __future__ import annotations

import json
from pathlib import Path

import duckdb
import pyarrow.parquet as pq
import pytest

from kvprof import schema
from tests.helpers import (
    UNTRACED,
    assert_kernel_count,
    direct_random_reads,
    direct_write,
    live,
    run_kvprof,
)

ROOT = Path(__file__).resolve().parents[2]
HOSTS = ("gpu-a", "gpu-b", "gpu-c")


def record_one(start_recorder, loopdev: str, name: str, mib: int, reads: int) -> Path:
    rec = start_recorder("-d", loopdev, name=name)
    run_kvprof("mark", "prefill", "--socket", rec.socket)
    direct_write(loopdev, mib << 20)
    run_kvprof("mark", "decode", "--socket", rec.socket)
    direct_random_reads(loopdev, reads, mib << 20)
    run_kvprof("mark", "idle", "--socket", rec.socket)
    assert rec.stop() == 0
    return rec.out


@live
def test_three_hosts_into_one_directory_sum_to_the_fleet_report(loopdev, start_recorder,
                                                                  tmp_path):
    fleet = tmp_path / "fleet"
    reports = []
    for i, host in enumerate(HOSTS):
        out = record_one(start_recorder, loopdev, f"s{i}", 8 * (i + 1), 300 * (i + 1))
        r = run_kvprof("export", str(out), "--parquet", str(fleet), "--hive", "--host", host)
        assert r.returncode == 0, r.stderr
        reports.append(json.loads(run_kvprof("report", str(out), "--json").stdout))
    ids = [r["session"]["id"] for r in reports]

    # An older kvprof's io file: without the columns added since (read as NULL).
    old = next((fleet / "table=io" / f"host={HOSTS[0]}").glob(f"*/session={ids[0]}/*.parquet"))
    t = pq.read_table(old)
    pq.write_table(t.drop_columns(["sample_weight", "inode"]), old)

    r = run_kvprof("report", "--parquet", str(fleet), "--json")
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout)
    assert sorted(s["session"] for s in got["sessions"]) == sorted(ids)
    assert sorted(got["hosts"]) == list(HOSTS)
    for p in schema.PHASES:
        assert got["phases"][p]["time_s"] == pytest.approx(
            sum(rep["phases"][p]["time_s"] for rep in reports), abs=1e-9)
        for layer in ("block", "io_uring"):
            for op in ("read", "write"):
                for key in ("ios", "bytes"):
                    assert got["phases"][p][layer][op][key] == sum(
                        rep["phases"][p][layer][op][key] for rep in reports), (p, layer, op)
    for host, rep in zip(HOSTS, reports):
        mine = got["hosts"][host]["phases"]["decode"]["block"]["read"]
        assert mine["bytes"] == rep["phases"]["decode"]["block"]["read"]["bytes"]
    # Each host: what was written and read, but for completions the kernel did not trace
    # (the fleet's figures are their sums, above).
    for i, rep in enumerate(reports):
        ph = rep["phases"]
        assert_kernel_count(ph["prefill"]["block"]["write"]["bytes"], 8 * (i + 1) << 20, rep,
                            1 << 20, UNTRACED)
        assert_kernel_count(ph["decode"]["block"]["read"]["ios"], 300 * (i + 1), rep,
                            reason=UNTRACED)
    text = run_kvprof("report", "--parquet", str(fleet)).stdout
    assert "3 sessions on 3 hosts" in text

    # Any reader with hive partitioning sees host, date and session as columns.
    con = duckdb.connect()
    rows = dict(con.execute(f"""
        SELECT host, count(*) FROM read_parquet('{fleet}/table=io/*/*/*/*.parquet',
                                                hive_partitioning = true, union_by_name = true)
        WHERE layer = 'block' GROUP BY host""").fetchall())
    for host, out in zip(HOSTS, (tmp_path / f"s{i}" for i in range(3))):
        own = duckdb.connect(str(out / "session.duckdb"), read_only=True)
        assert rows[host] == own.execute(
            "SELECT count(*) FROM io WHERE layer = 'block'").fetchall()[0][0]
        own.close()
    meta = pq.read_metadata(next(fleet.glob("table=phase/*/*/*/*.parquet"))).metadata
    assert meta[b"kvprof.schema_version"] == str(schema.SCHEMA_VERSION).encode()

    # Exporting a session again replaces its files; --host needs --hive.
    assert run_kvprof("export", str(tmp_path / "s0"), "--parquet", str(fleet), "--hive",
                      "--host", HOSTS[0]).returncode == 0
    again = json.loads(run_kvprof("report", "--parquet", str(fleet), "--json").stdout)
    assert again["phases"]["decode"]["block"]["read"]["ios"] == \
        got["phases"]["decode"]["block"]["read"]["ios"]
    r = run_kvprof("export", str(tmp_path / "s0"), "--parquet", str(tmp_path / "x"),
                   "--host", "h")
    assert (r.returncode, r.stderr) == (
        64, "kvprof: error: --host files a session in the fleet layout: add --hive\n")


def test_report_parquet_on_a_directory_that_is_no_export_is_one_line(tmp_path):
    r = run_kvprof("report", "--parquet", str(tmp_path))
    assert r.returncode == 66
    assert r.stderr.startswith(f"kvprof: error: no kvprof fleet export at {tmp_path}")
    r = run_kvprof("report")
    assert (r.returncode, r.stderr) == (
        64, "kvprof: error: report needs a SESSION (or --parquet DIR)\n")


