"""Live capture on real loop devices, checked against the kernel's counters and fio's report."""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import duckdb
import pytest

from kvprof.markers import Marker
from kvprof.views.report import to_text
from tests.helpers import (
    IO_TICKS,
    READ_IOS,
    READ_SECTORS,
    WRITE_IOS,
    WRITE_SECTORS,
    aligned,
    assert_kernel_count,
    direct_random_reads,
    direct_write,
    live,
    lost_to,
    mounted_ext4,
    read_stat,
    settle,
    stat_delta,
)

pytestmark = live


def test_per_phase_block_numbers_equal_sys_block_stat(loopdev, start_recorder):
    rec = start_recorder("-d", loopdev)
    marker = Marker(rec.socket, engine="test")
    s0 = settle(loopdev)
    marker.mark("prefill")
    direct_write(loopdev, 24 << 20)  # 24 MiB, O_DIRECT, 1 MiB writes
    s1 = read_stat(loopdev)
    marker.mark("decode")
    direct_random_reads(loopdev, 1500, span=24 << 20)  # 1500 random 4 KiB reads
    s2 = read_stat(loopdev)
    marker.mark("idle")
    time.sleep(0.1)
    assert rec.stop() == 0
    report = rec.report()
    prefill, decode = stat_delta(s0, s1), stat_delta(s1, s2)
    p, d = report["phases"]["prefill"]["block"], report["phases"]["decode"]["block"]

    assert prefill[WRITE_SECTORS] * 512 == 24 << 20 and decode[READ_IOS] == 1500
    # on failure, where every read and write went, and what the kernel counted
    seen = ({ph: (v["block"]["read"]["ios"], v["block"]["write"]["ios"])
             for ph, v in report["phases"].items()}, prefill[:8], decode[:8],
            report["session"]["lost_by_reason"])
    if report["session"]["lost_events"] == 0:
        assert p["write"]["ios"] == prefill[WRITE_IOS] > 0, seen
        assert p["write"]["bytes"] == prefill[WRITE_SECTORS] * 512, seen
        assert p["read"]["ios"] == prefill[READ_IOS], seen
        assert d["read"]["ios"] == decode[READ_IOS], seen
        assert d["read"]["bytes"] == decode[READ_SECTORS] * 512
        assert d["read"]["size_hist"] == {"4096": 1500}
    else:  # only what kvprof itself reports as lost may be missing
        assert_kernel_count(p["write"]["ios"], prefill[WRITE_IOS], report)
        assert_kernel_count(d["read"]["ios"], decode[READ_IOS], report)
    assert d["write"]["ios"] == decode[WRITE_IOS] == 0
    # bandwidth and IOPS are the counts over the phase's own time
    t = report["phases"]["decode"]["time_s"]
    assert d["read"]["iops"] == pytest.approx(d["read"]["ios"] / t)
    assert d["read"]["ios"] >= 1500 - report["session"]["lost_events"]
    lat = d["read"]["latency_us"]
    assert 0 < lat["p50"] <= lat["p90"] <= lat["p99"] <= lat["p999"]


FLUSH_IOS = 15


@pytest.mark.skipif(shutil.which("mkfs.ext4") is None, reason="needs mkfs.ext4")
def test_fsync_on_ext4_counts_writes_and_flushes_as_the_kernel(loopdev, start_recorder, tmp_path):
    """KV chunk files on a filesystem with fsync, on a device with a write-back cache: the
    flush machinery completes requests twice or never issues them; counts still match."""
    Path(f"/sys/block/{loopdev}/queue/write_cache").write_text("write back")
    with mounted_ext4(loopdev, tmp_path / "mnt") as mnt:
        rec = start_recorder("-d", loopdev)
        marker = Marker(rec.socket)
        s0 = settle(loopdev)
        marker.mark("prefill")
        buf = aligned(1 << 20)
        for i in range(8):
            fd = os.open(mnt / f"chunk{i}", os.O_WRONLY | os.O_CREAT | os.O_DIRECT)
            for j in range(4):
                os.pwritev(fd, [buf], j << 20)
            os.fsync(fd)
            os.close(fd)
        os.sync()
        s1 = read_stat(loopdev)
        marker.mark("idle")
        time.sleep(0.1)
        assert rec.stop() == 0
    report = rec.report()
    delta = stat_delta(s0, s1)
    p = report["phases"]["prefill"]["block"]
    assert delta[WRITE_SECTORS] * 512 >= 32 << 20 and delta[FLUSH_IOS] > 0
    assert_kernel_count(p["write"]["ios"], delta[WRITE_IOS], report)
    assert_kernel_count(p["flush"]["ios"], delta[FLUSH_IOS], report)
    assert_kernel_count(p["read"]["ios"], delta[READ_IOS], report)
    if report["session"]["lost_events"] == 0:
        assert p["write"]["bytes"] == delta[WRITE_SECTORS] * 512


def _fio_under_recorder(loopdev, start_recorder, args: list[str], record_args: list[str]):
    """fio, started stopped so that the recorder can be pointed at its pid before any I/O
    (--thread keeps its jobs inside that process); returns the recorder's report, fio's jobs
    and the loop device's diskstats delta over the run."""
    starter = ("import os, signal, sys; os.kill(os.getpid(), signal.SIGSTOP); "
               "os.execvp('fio', sys.argv[1:])")
    fio = subprocess.Popen([sys.executable, "-c", starter, "fio", "--thread", *args])
    try:
        while open(f"/proc/{fio.pid}/stat").read().split()[2] != "T":
            time.sleep(0.01)
        rec = start_recorder("-d", loopdev, "-p", str(fio.pid), *record_args)
        s0 = settle(loopdev)
        fio.send_signal(signal.SIGCONT)
        assert fio.wait(120) == 0
        s1 = read_stat(loopdev)
    finally:
        if fio.poll() is None:
            fio.kill()
    assert rec.stop() == 0
    return rec.report(), stat_delta(s0, s1)


def _raw_reads(loopdev: str, out: Path) -> list[str]:
    return ["--name=kv", f"--filename=/dev/{loopdev}", "--rw=randread", "--bs=4k", "--size=64M",
            "--io_size=16M", "--direct=1", "--ioengine=io_uring", "--iodepth=16",
            "--output-format=json", f"--output={out}"]


def test_io_uring_reads_equal_fio_count(loopdev, start_recorder, tmp_path):
    """Named on the command line, the io_uring layer traces requests to a raw block device
    too, beside the block layer's."""
    if shutil.which("fio") is None:
        pytest.skip("needs fio")
    out = tmp_path / "fio.json"
    report, delta = _fio_under_recorder(loopdev, start_recorder, _raw_reads(loopdev, out),
                                        ["--layer", "block", "--layer", "io_uring"])
    fio_reads = json.loads(out.read_text())["jobs"][0]["read"]["total_ios"]
    idle = report["phases"]["idle"]
    assert fio_reads == 4096
    assert_kernel_count(idle["io_uring"]["read"]["ios"], fio_reads, report)
    assert idle["io_uring"]["read"]["bytes"] == idle["io_uring"]["read"]["ios"] * 4096
    assert_kernel_count(idle["block"]["read"]["ios"], delta[READ_IOS], report)
    assert "io_uring_on_block" not in report["session"]


def test_io_uring_to_a_raw_device_is_left_to_the_block_layer_by_default(
        loopdev, ext4, start_recorder, tmp_path):
    """With -p (which brings the process's io_uring layer), a request to a raw block device
    opened O_DIRECT is counted once, by the block layer (it carries it one for one), and the
    io_uring layer counts how many it left there; a file on a file system, read through
    io_uring, is still the io_uring layer's. One fio process, two rings: the raw device's
    first, then the file's."""
    if shutil.which("fio") is None:
        pytest.skip("needs fio")
    out = tmp_path / "fio.json"
    args = [*_raw_reads(loopdev, out), "--name=file", "--stonewall",
            f"--filename={ext4}/kv.bin", "--size=16M", "--io_size=8M", "--rw=randread",
            "--bs=4k", "--direct=1", "--ioengine=io_uring", "--iodepth=16"]
    report, delta = _fio_under_recorder(loopdev, start_recorder, args, [])
    raw, file = json.loads(out.read_text())["jobs"]
    assert (raw["read"]["total_ios"], file["read"]["total_ios"]) == (4096, 2048)
    s = report["session"]
    losses = {k: n for k, n in s["lost_by_reason"].items() if n}
    print(f"block reads: kernel {delta[READ_IOS]}; losses {losses}")
    # Nothing lost but a completion no probe could see (UNTRACED: the kernel ran none there).
    assert s["lost_events"] == lost_to(report), losses
    assert s["io_uring_on_block"] == 4096
    uring = sum(report["phases"][p]["io_uring"]["read"]["ios"] for p in report["phases"])
    assert uring == 2048
    assert report["exact"]["totals"]["io_uring"]["read"]["ios"] == 2048
    block = sum(report["phases"][p]["block"]["read"]["ios"] for p in report["phases"])
    assert_kernel_count(block, delta[READ_IOS], report)
    assert "io_uring: 4096 requests to raw block devices" in to_text(report)


def _idle_run(loopdev, start_recorder, tmp_path, attempt: int):
    """One decode window: ~2 s of back-to-back sequential reads (always something in
    flight), then ~2 s idle. Returns kvprof's report, the kernel's idle %, fio's busy ms."""
    rec = start_recorder("-d", loopdev, name=f"idle{attempt}")
    marker = Marker(rec.socket)
    settle(loopdev)
    out = tmp_path / f"fio{attempt}.json"
    t_a = time.monotonic_ns()
    s_a = read_stat(loopdev)
    marker.mark("decode", ts_ns=t_a)
    subprocess.run(["fio", "--name=seq", f"--filename=/dev/{loopdev}", "--rw=read",
                    "--bs=128k", "--direct=1", "--ioengine=io_uring", "--iodepth=16", "--numjobs=2",
                    "--time_based", "--runtime=2", "--size=200M", "--output-format=json",
                    f"--output={out}"], check=True)
    time.sleep(2)
    s_b = read_stat(loopdev)
    t_b = time.monotonic_ns()
    marker.mark("idle", ts_ns=t_b)
    time.sleep(0.1)
    assert rec.stop() == 0
    window_ms = (t_b - t_a) / 1e6
    delta = stat_delta(s_a, s_b)
    fio_ms = max(j["job_runtime"] for j in json.loads(out.read_text())["jobs"])
    return rec.report(), 100 * (1 - delta[IO_TICKS] / window_ms), fio_ms, window_ms, delta


def test_time_idle_matches_io_ticks(loopdev, start_recorder, tmp_path):
    if shutil.which("fio") is None:
        pytest.skip("needs fio")
    for attempt in range(3):
        report, kernel_idle, fio_ms, window_ms, delta = _idle_run(loopdev, start_recorder,
                                                                  tmp_path, attempt)
        ours = report["phases"]["decode"]["block"]["time_idle_pct"]
        print(f"time idle %: kvprof {ours:.2f}, kernel io_ticks {kernel_idle:.2f}; busy ms: "
              f"kvprof {(100 - ours) * window_ms / 100:.0f}, fio {fio_ms}")
        # fio's own clock: the reads kept something in flight for as long as fio ran.
        busy_ms = (100 - ours) * window_ms / 100
        assert busy_ms <= 1.1 * fio_ms, "busy for longer than fio ran"
        if busy_ms < 0.9 * fio_ms:
            # fio was starved of CPU (two cores, shared with the recorder and whatever else
            # runs): its reads come in short bursts that start when the scheduler's tick
            # hands it the CPU back and end within that jiffy. The kernel keeps io_ticks in
            # jiffies (4 ms at HZ=250) and adds only once a jiffy has passed since its last
            # stamp, so such a burst counts as nothing there (seen: 64.9 % idle by io_ticks
            # against 60.4 % by the requests' own times, fio busy 1 715 ms of 2 000). No
            # reference for this run: measure again.
            print("fio kept the device busy for less than it ran; measuring again")
            continue
        # Once in a few dozen runs the kernel's io_ticks counts nearly the whole window busy
        # (seen: 96 % with sector and read-tick counts of exactly 2 s of reads). That is the
        # kernel's figure going wrong, not the workload: measure again.
        if 25 < kernel_idle < 75:
            break
        print(f"kernel io_ticks implausible for this script, measuring again: {delta}")
    else:
        pytest.fail(f"no plausible run in 3 (last: kvprof {ours:.1f} % idle, io_ticks "
                    f"{kernel_idle:.1f} %, fio {fio_ms} ms of {window_ms:.0f} ms)")
    assert abs(ours - kernel_idle) <= 2.0, (ours, kernel_idle)
    assert report["phases"]["decode"]["block"]["devices"][loopdev]["time_idle_pct"] == ours
    # The aggregate tier's busy time, accounted in the kernel as io_ticks is.
    exact = report["exact"]["phases"]["decode"]["devices"][loopdev]["time_idle_pct"]
    print(f"time idle % from the aggregate tier: {exact:.2f}")
    assert abs(exact - kernel_idle) <= 2.0, (exact, kernel_idle)


def test_marks_from_another_process_keep_sender_timestamps(loopdev, start_recorder):
    rec = start_recorder("-d", loopdev)
    base = time.monotonic_ns()
    code = (
        "import sys, time; from kvprof.markers import Marker; m = Marker(sys.argv[1], "
        "engine='other'); b = int(sys.argv[2]);"
        "m.window('prefill', b + 1000, b + 5000, prefill_tokens=512);"
        "m.mark('decode', ts_ns=b + 6000, decode_tokens=1);"
        "m.mark('mixed', ts_ns=b + 9000); m.mark('idle', ts_ns=b + 12000)")
    subprocess.run([sys.executable, "-c", code, rec.socket, str(base)], check=True)
    # the shell form too: `kvprof mark` from a script, timestamped by its own process
    before = time.monotonic_ns()
    r = subprocess.run([sys.executable, "-m", "kvprof", "mark", "prefill", "--socket",
                        rec.socket, "--engine", "sh"], capture_output=True, text=True)
    after = time.monotonic_ns()
    assert r.returncode == 0, r.stderr
    time.sleep(0.2)
    assert rec.stop() == 0
    con = duckdb.connect(str(rec.out / "session.duckdb"), read_only=True)
    rows = con.execute("SELECT start_ns - $b, end_ns - $b, phase, engine, prefill_tokens, "
                   "decode_tokens FROM phase WHERE engine = 'other' ORDER BY start_ns",
                       {"b": base}).fetchall()
    assert rows == [(1000, 5000, "prefill", "other", 512, None),
                    (6000, 9000, "decode", "other", None, 1),
                    (9000, 12000, "mixed", "other", None, None)]
    (start,) = con.execute("SELECT start_ns FROM phase WHERE engine = 'sh'").fetchall()[0]
    assert before <= start <= after


def test_malformed_marks_are_counted_and_recording_goes_on(loopdev, start_recorder):
    import socket

    rec = start_recorder("-d", loopdev)
    s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    bad = [b"not json", b"[1,2]", b'{"v":1,"phase":"lunch","ts_ns":1}',
           b'{"v":1,"phase":"decode","ts_ns":-5}', b'{"v":9,"phase":"decode","ts_ns":1}',
           b'{"v":1,"phase":"decode","start_ns":10,"end_ns":5}', b"\xff\xfe"]
    for b in bad:
        s.sendto(b, rec.socket)
    Marker(rec.socket).mark("decode")
    settle(loopdev, quiet_s=0.05)
    direct_random_reads(loopdev, 100, span=16 << 20)
    Marker(rec.socket).mark("idle")
    time.sleep(0.1)
    assert rec.stop() == 0
    report = rec.report()
    assert report["session"]["lost_by_reason"]["marks_malformed"] == len(bad)
    assert report["phases"]["decode"]["block"]["read"]["ios"] == 100


def test_sigterm_and_sigkill_leave_a_readable_session(loopdev, start_recorder):
    rec = start_recorder("-d", loopdev, name="term")
    direct_write(loopdev, 4 << 20)
    assert rec.stop(signal.SIGTERM) == 0
    assert rec.report()["session"]["status"] == "complete"

    # Killed in the middle of a decode phase: the window still open at the last flush is kept.
    rec = start_recorder("-d", loopdev, name="kill")
    s0 = settle(loopdev)
    Marker(rec.socket).mark("decode")
    direct_write(loopdev, 8 << 20)
    s1 = read_stat(loopdev)
    time.sleep(1.0)  # a few flush intervals
    rec.stop(signal.SIGKILL)
    report = rec.report()
    assert report["session"]["status"] == "killed"  # its recorder is gone, on this boot
    assert report["phases"]["decode"]["time_s"] >= 0.5  # up to the last flush before the kill
    assert report["phases"]["decode"]["block"]["write"]["ios"] == stat_delta(s0, s1)[WRITE_IOS]


def test_export_reads_back_with_pyarrow_and_duckdb(loopdev, start_recorder, tmp_path):
    import pyarrow.parquet as pq

    from kvprof import schema

    rec = start_recorder("-d", loopdev)
    m = Marker(rec.socket)
    m.mark("prefill")
    direct_write(loopdev, 4 << 20)
    m.mark("decode")
    direct_random_reads(loopdev, 200, span=4 << 20)
    m.mark("idle")
    time.sleep(0.1)
    assert rec.stop() == 0
    out = tmp_path / "pq"
    r = subprocess.run([sys.executable, "-m", "kvprof", "export", str(rec.out), "--parquet",
                        str(out)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    store = duckdb.connect(str(rec.out / "session.duckdb"), read_only=True)
    for table, sch in schema.TABLES.items():
        t = pq.read_table(out / f"{table}.parquet")
        assert t.schema.names == sch.names
        assert [f.type for f in t.schema] == [f.type for f in sch]
        n = store.execute(f"SELECT count(*) FROM {table}").fetchall()[0][0]
        assert t.num_rows == n
        assert n > 0 or table not in ("io", "phase", "session")
        path = str(out / f"{table}.parquet")
        diff = store.execute(f"SELECT count(*) FROM (SELECT * FROM {table} EXCEPT ALL "
                         f"SELECT * FROM read_parquet('{path}'))").fetchall()[0][0]
        assert diff == 0
    assert store.execute("SELECT count(*) FROM io WHERE layer='block'").fetchall()[0][0] >= 200 + 4


def test_a_few_rows_reach_user_space_while_recording(loopdev):
    """Rows wait in a CPU's batch until it fills; at a trickle of I/O the flush run on each
    CPU hands them over within a fraction of a second, not at stop."""
    from kvprof.capture.ebpf import Capture, CaptureFilter
    from kvprof.devices import resolve

    cap = Capture(("block",), CaptureFilter(devices=(resolve(loopdev),)))
    try:
        cap.start()
        direct_random_reads(loopdev, 5, span=1 << 20)
        deadline, got = time.monotonic() + 2.0, 0
        while time.monotonic() < deadline and got < 5:
            time.sleep(0.1)
            io = cap.take().get("io")
            got += io.num_rows if io is not None else 0
        assert got == 5
    finally:
        cap.stop()


def test_a_kernel_that_cannot_run_a_program_on_a_cpu_is_refused(monkeypatch):
    from kvprof.capture import ebpf
    from kvprof.errors import EX_UNAVAILABLE, KvprofError

    monkeypatch.setattr(ebpf, "run_on_cpu", lambda fd, cpu: False)
    with pytest.raises(KvprofError) as e:
        ebpf.Capture(("block",), ebpf.CaptureFilter())
    assert e.value.exit_code == EX_UNAVAILABLE and "BPF_F_TEST_RUN_ON_CPU" in str(e.value)
