"""`kvprof calibrate` on real devices: its figures against fio's own on the same pattern in the
same test, its kernel counts against fio's, its safety refusals, and capacity idle in the
report of a real recording."""
from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

import pytest

from tests.helpers import direct_random_reads, direct_write, live, run_kvprof

pytestmark = live

QUICK = ("rand_read_4k_qd32", "rand_read_4k_qd1", "seq_write_1m", "psync_rand_read_4k")


def calibrate(target: str, *patterns: str, runtime: float = 3, extra: tuple = ()) -> dict:
    args = ["calibrate", target, "--runtime", str(runtime), "--json", *extra]
    for p in patterns:
        args += ["--pattern", p]
    r = run_kvprof(*args, timeout=300)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def assert_fios_own_run(e: dict, name: str) -> None:
    """A pattern's figures are the kernel's count over fio's own run: the same requests and
    bytes fio reports, over fio's run time. Calibrate adds nothing to the I/O path (it reads
    diskstats before and after fio), so a figure off fio's own is calibrate's error.

    Not compared with a separate fio run of the same command line: on a shared 2-vCPU VM two
    runs differ by the machine alone (psync 4 KiB reads at 7.6 k then 13.9 k IOPS one after
    the other; 1 MiB writes to a loop device over /dev/shm, a memory copy, at 4.7 then
    7.6 GB/s), which says nothing of calibrate."""
    assert e["source"] == "kernel", name
    # One request per 4 KiB I/O; the loop device splits large ones, so only bytes for them.
    if e["bs"] == 4096:
        assert e["ios"] == e["fio"]["ios"] > 0, name
        assert e["iops"] == pytest.approx(e["fio"]["iops"], rel=1e-3), name
    assert e["bytes"] == e["fio"]["bytes"] > 0, name
    assert e["bandwidth_bytes_per_s"] == pytest.approx(
        e["fio"]["bandwidth_bytes_per_s"], rel=1e-3), name
    assert e["latency_us"]["p99"] >= e["latency_us"]["p50"] > 0, name


def test_a_loop_device_is_measured_by_the_kernel_over_fios_own_run(loopdev, calibration_store):
    # fio's own writes are data on the device, but ours: --force.
    got = calibrate(f"/dev/{loopdev}", *QUICK, runtime=1, extra=("--force",))
    assert got["device"]["name"] == loopdev
    assert got["key"].startswith("loop /dev/shm/")
    assert got["patterns"].keys() == set(QUICK)
    for name, e in got["patterns"].items():
        assert_fios_own_run(e, name)
    # Kept for the device; a run of some patterns updates those and keeps the others.
    kept = json.loads(next(calibration_store.glob("*.json")).read_text())
    assert kept["patterns"].keys() == set(QUICK)
    calibrate(f"/dev/{loopdev}", "seq_read_1m", runtime=1, extra=("--force",))
    kept = json.loads(next(calibration_store.glob("*.json")).read_text())
    assert kept["patterns"].keys() == {*QUICK, "seq_read_1m"}


@pytest.fixture
def mounted(loopdev, ext4):
    return loopdev, ext4


def test_a_directory_measures_the_device_under_it_with_a_scratch_file(mounted):
    dev, mnt = mounted
    ref = mnt / "kept.bin"
    ref.write_bytes(b"x" * 4096)
    # Through the file system, the kernel's count under the file equals fio's own: O_DIRECT
    # overwrites of a laid-out file add no block I/O of their own within a 2 s run.
    got = calibrate(str(mnt), "seq_write_1m", "rand_read_4k_qd32", runtime=2,
                    extra=("--size", "64M"))
    assert got["device"]["name"] == dev
    for name, e in got["patterns"].items():
        assert_fios_own_run(e, name)
    assert sorted(mnt.iterdir()) == [mnt / "kept.bin", mnt / "lost+found"], \
        "the scratch file was left, or a file of the user's touched"
    assert ref.read_bytes() == b"x" * 4096


def test_a_device_holding_a_filesystem_is_refused_unless_forced(loopdev, tmp_path):
    subprocess.run(["mkfs.ext4", "-q", f"/dev/{loopdev}"], check=True)
    r = run_kvprof("calibrate", f"/dev/{loopdev}", "--runtime", "0.5")
    assert r.returncode == 64
    assert r.stderr.splitlines()[0] == (f"kvprof: error: refusing to write to /dev/{loopdev}: "
                                        "it holds ext4 data (blkid)")
    assert "Traceback" not in r.stderr
    # Data without a signature blkid knows is refused too.
    subprocess.run(["wipefs", "-qa", f"/dev/{loopdev}"], check=True)
    with open(f"/dev/{loopdev}", "r+b") as f:
        f.seek(4096)
        f.write(b"kv cache")
    r = run_kvprof("calibrate", f"/dev/{loopdev}", "--runtime", "0.5")
    assert r.returncode == 64 and "its first MiB holds data" in r.stderr
    r = run_kvprof("calibrate", f"/dev/{loopdev}", "--runtime", "0.5", "--force",
                   "--pattern", "psync_rand_read_4k")
    assert r.returncode == 0, r.stderr
    # Mounted: refused even with --force (writing under a mounted filesystem corrupts it).
    subprocess.run(["mkfs.ext4", "-q", f"/dev/{loopdev}"], check=True)
    mnt = tmp_path / "m"
    mnt.mkdir()
    subprocess.run(["mount", f"/dev/{loopdev}", str(mnt)], check=True)
    try:
        r = run_kvprof("calibrate", f"/dev/{loopdev}", "--force", "--runtime", "0.5")
    finally:
        subprocess.run(["umount", str(mnt)], check=True)
    assert r.returncode == 64 and f"it is mounted on {mnt}" in r.stderr, r.stderr


def test_bad_arguments_get_one_line():
    r = run_kvprof("calibrate", "/nonexistent/dir")
    assert (r.returncode, r.stderr.strip()) == (
        64, "kvprof: error: /nonexistent/dir: no such device or directory")
    r = run_kvprof("calibrate", "/tmp", "--pattern", "bogus")
    assert r.returncode == 64 and r.stderr.startswith("kvprof: error: unknown pattern 'bogus'")


def test_capacity_idle_in_the_report_rests_on_the_calibration_and_the_phase_figures(
        loopdev, start_recorder):
    cal = calibrate(f"/dev/{loopdev}", "seq_write_1m", "rand_write_4k_qd32", "seq_read_1m",
                    "rand_read_4k_qd32", runtime=2)
    rec = start_recorder("-d", loopdev)
    run_kvprof("mark", "prefill", "--socket", rec.socket)
    direct_write(loopdev, 64 << 20)
    run_kvprof("mark", "decode", "--socket", rec.socket)
    t = time.monotonic()
    while time.monotonic() - t < 1.5:
        direct_random_reads(loopdev, 500, 64 << 20)
    run_kvprof("mark", "idle", "--socket", rec.socket)
    assert rec.stop() == 0
    report = rec.report()
    for phase, op, pattern_bw, pattern_iops in (
            ("prefill", "write", "seq_write_1m", "rand_write_4k_qd32"),
            ("decode", "read", "seq_read_1m", "rand_read_4k_qd32")):
        block = report["phases"][phase]["block"]
        cap = block["capacity"]
        e = report["phases"][phase]["block"][op]
        by = cap["by_op"][op]
        bw_share = e["bandwidth_bytes_per_s"] / cal["patterns"][pattern_bw][
            "bandwidth_bytes_per_s"]
        iops_share = e["iops"] / cal["patterns"][pattern_iops]["iops"]
        assert by["used_pct"] == pytest.approx(100 * max(bw_share, iops_share))
        assert by["pattern"] == (pattern_bw if bw_share >= iops_share else pattern_iops)
        assert block["capacity_idle_pct"] == pytest.approx(
            max(0.0, 100 - sum(o["used_pct"] for o in cap["by_op"].values())))
        assert block["devices"][loopdev]["capacity_idle_pct"] == block["capacity_idle_pct"]
        print(phase, f"time idle {block['time_idle_pct']:.1f} %, capacity idle "
                     f"{block['capacity_idle_pct']:.1f} % ({by['pattern']})")
    # Large writes: bandwidth binds; 4 KiB reads: IOPS.
    assert report["phases"]["prefill"]["block"]["capacity"]["by_op"]["write"]["pattern"] == \
        "seq_write_1m"
    assert report["phases"]["decode"]["block"]["capacity"]["by_op"]["read"]["pattern"] == \
        "rand_read_4k_qd32"
    text = run_kvprof("report", str(rec.out)).stdout
    assert "capacity idle" in text and "capacity used" in text
    # Kept in the session: the same report once the store is gone.
    env = {**os.environ, "KVPROF_CALIBRATION_DIR": str(Path(rec.out) / "nowhere")}
    again = json.loads(run_kvprof("report", str(rec.out), "--json", env=env).stdout)
    assert again["phases"]["decode"]["block"]["capacity_idle_pct"] == \
        report["phases"]["decode"]["block"]["capacity_idle_pct"]
