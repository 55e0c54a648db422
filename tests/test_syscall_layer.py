"""The syscall layer on a real file system: the KV-offload backends' own file I/O, per phase,
equals what the backends did; the block layer still equals the kernel's counters."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import duckdb
import pytest

from kvprof import schema
from kvprof.correlate import summarize
from kvprof.rowsource import SqlRows, ViewFilter
from tests.conftest import (
    READ_IOS,
    READ_SECTORS,
    WRITE_IOS,
    WRITE_SECTORS,
    assert_kernel_count,
    live,
    settle,
    stat_delta,
)

ROOT = Path(__file__).resolve().parent.parent


@live
@pytest.mark.skipif(shutil.which("mkfs.ext4") is None, reason="needs mkfs.ext4")
def test_backend_file_io_per_phase_equals_what_the_backends_did(loopdev, start_recorder,
                                                                tmp_path):
    mnt = tmp_path / "kv"
    mnt.mkdir()
    subprocess.run(["mkfs.ext4", "-q", "-F", "-E", "lazy_itable_init=0,lazy_journal_init=0",
                    f"/dev/{loopdev}"], check=True)
    subprocess.run(["mount", f"/dev/{loopdev}", str(mnt)], check=True)
    try:
        s0 = settle(loopdev)
        # No -p: the block layer must see the flush threads' writeback too. The syscall layer
        # then follows every process's files; the numbers below are the workload's.
        rec = start_recorder("-d", loopdev, "--layer", "block", "--layer", "syscall")
        work = subprocess.Popen([sys.executable, str(ROOT / "tests" / "kv_backends.py"),
                                 str(mnt), rec.socket], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, text=True)
        out, _ = work.communicate("go\n", timeout=120)
        assert work.returncode == 0
        did = __import__("json").loads(out)
        os.sync()  # the buffered chunks reach the device while the recorder still runs
        s1 = settle(loopdev)
        assert rec.stop() == 0, "".join(rec.stderr_lines)
        report = rec.report()
    finally:
        subprocess.run(["umount", str(mnt)], check=False)

    con = duckdb.connect(str(rec.out / "session.duckdb"), read_only=True)
    try:
        mine = summarize(SqlRows(con), view=ViewFilter(tgid=work.pid))["phases"]
        for phase, ops in did.items():
            for op, (calls, nbytes) in ops.items():
                got = mine[phase]["syscall"][op]
                assert (got["ios"], got["bytes"]) == (calls, nbytes), (phase, op, got)
        # Nothing else of the workload while it worked (before, Python read its modules):
        # its pipe is not a file.
        assert sum(mine[p]["syscall"][op]["ios"] for p in did for op in ("read", "write")) \
            == sum(c for ops in did.values() for c, _ in ops.values())
        rows = con.execute("""
            SELECT path, syscall, flags, bytes, bytes_asked FROM io
            WHERE layer = 'syscall' AND tgid = ? AND path LIKE ?""",
                           [work.pid, str(mnt) + "/%"]).fetchall()
        assert len(rows) == sum(c for ops in did.values() for c, _ in ops.values())
        assert con.execute("SELECT count(*) FROM io WHERE layer = 'syscall' AND path IS NULL"
                           ).fetchall()[0][0] == 0
        # O_DIRECT files (vLLM's fs tier) are marked so; the buffered ones are not.
        for path, syscall, flags, nbytes, asked in rows:
            direct = len(Path(path).stem) == 16 and Path(path).suffix == ".bin"
            assert bool(flags & schema.FLAG_DIRECT) == direct, (path, flags)
            assert nbytes <= asked
        # glibc's preadv is the preadv2 syscall on newer kernels.
        called = {s for _, s, *_ in rows}
        assert {"write", "read"} <= called and called - {"write", "read"} <= {"preadv",
                                                                              "preadv2"}
    finally:
        con.close()

    # The device layer is as exact as before: every block request the kernel counted.
    d = stat_delta(s0, s1)
    blk = [report["phases"][p]["block"] for p in schema.PHASES]
    assert_kernel_count(sum(b["read"]["ios"] for b in blk), d[READ_IOS], report)
    assert_kernel_count(sum(b["write"]["ios"] for b in blk), d[WRITE_IOS], report)
    if report["session"]["lost_events"] == 0:
        assert sum(b["write"]["bytes"] for b in blk) == d[WRITE_SECTORS] * 512
        assert sum(b["read"]["bytes"] for b in blk) == d[READ_SECTORS] * 512
