"""The aggregate tier on real devices: the kernel's own counts per phase equal the kernel's
/sys/block counters at the device's full rate, whatever the event tier keeps, and equal the
event tier's per-phase figures where it keeps everything."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import threading
import time
from pathlib import Path

import duckdb
import pytest

from kvprof.markers import Marker
from tests.helpers import (
    AT_STOP,
    NOT_SEEN,
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
    settle,
    stat_delta,
)

PHASES = ("prefill", "decode")

pytestmark = live


def fio_randread(dev: str, seconds: float, out) -> dict:
    """4 KiB random reads through io_uring at QD32, as fast as the device goes."""
    subprocess.run(["fio", "--name=full", f"--filename=/dev/{dev}", "--rw=randread",
                    "--bs=4k", "--direct=1", "--ioengine=io_uring", "--iodepth=32",
                    "--time_based", f"--runtime={seconds}", "--size=200M",
                    "--output-format=json", f"--output={out}"], check=True)
    return json.loads(out.read_text())["jobs"][0]


@pytest.mark.skipif(shutil.which("fio") is None, reason="needs fio")
def test_io_a_millisecond_after_a_mark_is_in_the_new_phase_in_both_tiers_under_load(
        loopdev, loopdev2, start_recorder):
    """fio saturating both cores on another device while 150 marks alternate prefill and
    decode, each followed 1 ms later by one read on the recorded device: every read is in
    its mark's phase, in the events and in the exact counts (the mark carries the sender's
    time; the recorder relays nothing to the kernel), and the kernel counted those reads and
    no more; any whose completion no probe saw (see UNTRACED) is named by its position."""
    burn = subprocess.Popen(["fio", "--name=burn", f"--filename=/dev/{loopdev2}",
                             "--rw=randread", "--bs=4k", "--direct=1", "--ioengine=io_uring",
                             "--iodepth=32", "--numjobs=2", "--thread", "--time_based",
                             "--runtime=60", "--output=/dev/null"])
    try:
        # The block layer only: the burn's io_uring requests (another device's, ~200 k/s) are
        # not device-filtered at that layer, and flooding the event ring they cost a counted
        # batch of rows now and then (ringbuf_reserve_failed 32, one of them a read here; two
        # full-suite runs so far) — a loss the report says, not the phase rule tested here.
        rec = start_recorder("-d", loopdev, "--layer", "block")
        time.sleep(1)
        s0 = settle(loopdev)
        m = Marker(rec.socket, engine="load")
        fd = os.open(f"/dev/{loopdev}", os.O_RDONLY | os.O_DIRECT)
        buf = aligned(4096)
        try:
            for i in range(150):
                m.mark(PHASES[i % 2])
                t = time.monotonic() + 0.001
                while time.monotonic() < t:
                    pass
                os.preadv(fd, [buf], 4096 * (i * 7))
                time.sleep(0.02)
        finally:
            os.close(fd)
        m.mark("idle")
        time.sleep(0.3)
    finally:
        burn.terminate()
        burn.wait()
    s1 = settle(loopdev)
    assert rec.stop() == 0
    report = rec.report()
    got = {p: (report["exact"]["phases"][p]["block"].get("read", {}).get("ios", 0),
               report["phases"][p]["block"].get("read", {}).get("ios", 0))
           for p in ("prefill", "decode", "idle")}
    con = duckdb.connect(str(rec.out / "session.duckdb"), read_only=True)
    try:
        sectors = {s for (s,) in con.execute(
            "SELECT sector FROM io WHERE layer = 'block' AND op = 'read'").fetchall()}
    finally:
        con.close()
    # The reads the kernel completed without running the completion probes (under this load
    # a few in ten thousand: block_completion_not_seen, block_in_flight_at_stop), by phase.
    unseen = {p: sum(1 for i in range(i0, 150, 2) if i * 7 * 8 not in sectors)
              for i0, p in enumerate(PHASES)}
    lost = report["session"]["lost_by_reason"]
    print(f"reads 1 ms after marks, both cores busy: (exact, events) {got}; "
          f"completions not traced {unseen}")
    assert stat_delta(s0, s1)[READ_IOS] == 150
    assert report["session"]["lost_events"] == lost_to(report), lost
    assert sum(unseen.values()) == lost_to(report), lost
    # Every traced read is in its mark's phase; every untraced one is too in the exact tier
    # (which counts it in its issue slot), unless the kernel had not reused its request by
    # the stop (block_in_flight_at_stop).
    for p in PHASES:
        assert got[p][1] == 75 - unseen[p]
        assert 75 - unseen[p] <= got[p][0] <= 75
    assert got["idle"] == (0, 0)
    assert got["prefill"][0] + got["decode"][0] == 150 - lost.get(AT_STOP, 0)


@pytest.mark.skipif(shutil.which("fio") is None, reason="needs fio")
@pytest.mark.parametrize("events", [True, False], ids=["with-events", "no-events"])
def test_exact_totals_equal_diskstats_at_full_rate(loopdev, start_recorder, tmp_path, events):
    # Both layers named: io_uring traces the raw device's requests too (by default it leaves
    # them to the block layer), so both are held to fio's and the kernel's counts.
    rec = start_recorder("-d", loopdev, "--layer", "block", "--layer", "io_uring",
                         *([] if events else ["--no-events"]))
    s0 = settle(loopdev)
    job = fio_randread(loopdev, 2, tmp_path / "fio.json")
    s1 = settle(loopdev)
    assert rec.stop() == 0, "".join(rec.stderr_lines)
    report = rec.report()
    d = stat_delta(s0, s1)
    exact = report["exact"]["totals"]
    ours = exact["block"]["read"]
    rows = report["phases"]["idle"]["block"]["read"]["ios"]
    print(f"{'with' if events else 'without'} events: fio {job['read']['total_ios']} reads "
          f"({job['read']['iops']:,.0f} IOPS); kernel {d[READ_IOS]}; exact {ours['ios']}; "
          f"event rows {rows}; lost {report['session']['lost_by_reason']}")
    # Every read the kernel counted: a completion no probe saw (UNTRACED in conftest) is
    # counted once the kernel starts that request again; only one it had not by the stop is not.
    assert_kernel_count(ours["ios"], d[READ_IOS], report, reason=AT_STOP)
    if d[READ_IOS] == ours["ios"]:
        assert ours["bytes"] == d[READ_SECTORS] * 512
    # Those counted so have no service time: its histogram holds the others, every one.
    timed = report["exact"]["phases"]["idle"]["block"]["read"]
    assert sum(timed["service_hist_ns"].values()) == \
        timed["ios"] - report["session"]["lost_by_reason"].get(NOT_SEEN, 0)
    assert "write" not in exact["block"] or exact["block"]["write"]["ios"] == d[WRITE_IOS]
    # fio's io_uring requests, each counted once whatever the ring kept.
    assert 0 <= job["read"]["total_ios"] - exact["io_uring"]["read"]["ios"] <= \
        report["session"]["lost_by_reason"].get("io_uring_completion_not_seen", 0) + \
        report["session"]["lost_by_reason"].get("probe_skipped_nested", 0)
    con = duckdb.connect(str(rec.out / "session.duckdb"), read_only=True)
    try:
        secs = con.execute("SELECT count(DISTINCT ts_ns) FROM io_agg WHERE layer = 'block'"
                           ).fetchall()[0][0]
        stored = con.execute("SELECT count(*) FROM io").fetchall()[0][0]
    finally:
        con.close()
    assert report["session"]["device_events"] is events
    # The closing line says what was counted (the kernel's count above), not only the rows
    # kept: with --no-events those are none.
    counted = {layer: sum(o["ios"] for o in exact[layer].values())
               for layer in ("block", "io_uring")}
    assert (f"Counted {counted['block']} block, {counted['io_uring']} io_uring requests; "
            f"kept {stored} event rows in ") in "".join(rec.stderr_lines)
    if not events:
        # No per-I/O rows: the report's per-phase figures are the exact ones.
        assert stored == 0 and rows == ours["ios"]
        assert report["phases"]["idle"]["block"]["read"]["latency_us"]["p99"] is None
    assert 2 <= secs <= 4  # per-second rows over a 2 s run


def test_exact_per_phase_follows_marks(loopdev, start_recorder):
    """Marks switch the phase the kernel counts under: a prefill write burst and decode's
    random reads land in their phases, with the counts diskstats gives for each, equal to the
    event tier's, and the time the device was busy equal to the event tier's islands."""
    rec = start_recorder("-d", loopdev)
    settle(loopdev)
    m = Marker(rec.socket, engine="agg-test")
    deltas = {}
    for phase, work in (("prefill", lambda: direct_write(loopdev, 48 << 20)),
                        ("decode", lambda: direct_random_reads(loopdev, 3000, 48 << 20))):
        m.mark(phase)
        time.sleep(0.2)  # a quiet gap: no issue slot holds requests of two phases
        s0 = settle(loopdev, quiet_s=0.1)
        work()
        deltas[phase] = stat_delta(s0, settle(loopdev, quiet_s=0.1))
    m.mark("idle")
    time.sleep(0.2)
    assert rec.stop() == 0, "".join(rec.stderr_lines)
    report = rec.report()
    exact = report["exact"]["phases"]
    for phase, d in deltas.items():
        op, ios, sectors = (("write", WRITE_IOS, WRITE_SECTORS) if phase == "prefill"
                            else ("read", READ_IOS, READ_SECTORS))
        got = exact[phase]["block"][op]
        events = report["phases"][phase]["block"][op]
        print(f"{phase} {op}: kernel {d[ios]} ios {d[sectors] * 512} B; exact {got['ios']} "
              f"{got['bytes']} B; events {events['ios']}")
        # Equal to the kernel's: a completion no probe saw (UNTRACED in conftest) is counted
        # when the kernel starts that request again, and one it had not by the stop is
        # reported held then.
        assert_kernel_count(got["ios"], d[ios], report, reason=AT_STOP)
        assert got["ios"] != d[ios] or got["bytes"] == d[sectors] * 512
        # The rows are those, less the completions the kernel did not trace (no row has one).
        assert_kernel_count(events["ios"], got["ios"], report, reason=NOT_SEEN)
        assert got["ios"] != events["ios"] or got["bytes"] == events["bytes"]
        missing = d[ios] - events["ios"]
        idle_exact = exact[phase]["devices"][loopdev]["time_idle_pct"]
        idle_events = report["phases"][phase]["block"]["devices"][loopdev]["time_idle_pct"]
        print(f"{phase} time idle: exact {idle_exact:.3f} %, events {idle_events:.3f} %")
        if missing:
            # A request whose completion the probes never saw has no row, and no end: the
            # exact tier holds it in flight until the kernel hands its request out again
            # (block.bpf.c forget_unseen; seen: 1 of 3 000, 0.78 % more busy). Busy can
            # only be longer there, never shorter.
            assert idle_exact <= idle_events, (idle_exact, idle_events)
        else:
            assert abs(idle_exact - idle_events) < 0.5
    assert not exact["prefill"]["block"].get("read", {}).get("ios")
    assert not exact["decode"]["block"].get("write", {}).get("ios")


@pytest.mark.skipif(shutil.which("fio") is None, reason="needs fio")
def test_max_size_ends_the_recording_cleanly(loopdev, start_recorder, tmp_path):
    """A recording that fills its disk budget ends by itself, like Ctrl-C: the session is
    complete and readable, and its exact counts cover the I/O up to the end."""
    rec = start_recorder("-d", loopdev, "--max-size", "3M")
    # --thread: the job runs inside the process killed below (a forked job would go on
    # loading the machine for the rest of its minute, under the tests that follow).
    fio = subprocess.Popen(["fio", "--name=fill", f"--filename=/dev/{loopdev}", "--rw=randread",
                            "--bs=4k", "--direct=1", "--ioengine=io_uring", "--iodepth=8",
                            "--thread", "--time_based", "--runtime=60", "--size=200M"],
                           stdout=subprocess.DEVNULL)
    try:
        rc = rec.proc.wait(60)
    finally:
        fio.kill()
        fio.wait()
    rec._reader.join(5)
    assert rc == 0, "".join(rec.stderr_lines)
    assert any("reached --max-size" in line for line in rec.stderr_lines)
    report = rec.report()
    size = sum(f.stat().st_blocks * 512 for f in rec.out.iterdir())  # what it takes on disk
    rows = report["phases"]["idle"]["block"]["read"]["ios"]
    print(f"ended at {size / 2**20:.1f} MiB on disk after {report['session']['duration_s']:.1f}"
          f" s, {rows} event rows, exact {report['exact']['totals']['block']['read']['ios']}")
    assert report["session"]["status"] == "complete"
    # (It reached 3 MiB with its write-ahead log; the last checkpoint folds that in.)
    assert 1 << 20 <= size < 24 << 20
    assert report["session"]["duration_s"] < 50
    assert report["exact"]["totals"]["block"]["read"]["ios"] >= rows > 0


def test_a_mark_sent_while_the_probes_compile_sets_the_kernels_phase(loopdev, start_recorder,
                                                                     tmp_path):
    """The marker socket listens before the probes are compiled (a second or more): a mark
    received meanwhile is the phase the kernel counts under once they attach."""
    sock = tmp_path / "early.sock"

    def mark_early() -> None:
        while not sock.exists():
            time.sleep(0.002)
        Marker(str(sock), engine="early").mark("prefill")

    sender = threading.Thread(target=mark_early)
    sender.start()
    rec = start_recorder("-d", loopdev, name="early")
    sender.join(5)
    s0 = settle(loopdev)
    direct_write(loopdev, 16 << 20)
    d = stat_delta(s0, settle(loopdev, quiet_s=0.1))
    assert rec.stop() == 0, "".join(rec.stderr_lines)
    report = rec.report()
    got = report["exact"]["phases"]["prefill"]["block"]["write"]
    print(f"written under the early mark: kernel {d[WRITE_IOS]} ios, exact {got['ios']}; "
          f"lost {report['session']['lost_by_reason']}")
    # Every write, under the early mark; short only by a completion no probe saw that the
    # kernel had not started again by the stop (AT_STOP, as proven by the witness: CI once
    # had 31 of 32), each no larger than the queue lets a request be.
    assert_kernel_count(got["ios"], d[WRITE_IOS], report, reason=AT_STOP)
    most = int(Path(f"/sys/block/{loopdev}/queue/max_sectors_kb").read_text()) << 10
    assert_kernel_count(got["bytes"], d[WRITE_SECTORS] * 512, report, each=most,
                        reason=AT_STOP)


@pytest.mark.skipif(shutil.which("fio") is None, reason="needs fio")
def test_past_the_event_rate_rows_are_sampled_and_counts_stay_exact(loopdev, start_recorder,
                                                                     tmp_path):
    """At the device's full rate with --event-rate 20000 the event tier keeps 1 in 2^k
    requests: the counts are the kernel's all the same, and the kept rows, weighted, estimate
    them."""
    rec = start_recorder("-d", loopdev, "--event-rate", "20000")
    s0 = settle(loopdev)
    fio_randread(loopdev, 4, tmp_path / "fio.json")
    s1 = settle(loopdev)
    assert rec.stop() == 0, "".join(rec.stderr_lines)
    report = rec.report()
    d = stat_delta(s0, s1)
    sampling = report["session"]["event_sampling"]
    con = duckdb.connect(str(rec.out / "session.duckdb"), read_only=True)
    try:
        kept, weighted = con.execute("""
            SELECT count(*), sum(sample_weight) FROM io
            WHERE layer = 'block' AND op = 'read'""").fetchall()[0]
        shifts = [s for _, s in con.execute(
            "SELECT ts_ns, shift FROM event_sampling ORDER BY ts_ns").fetchall()]
    finally:
        con.close()
    ours = report["exact"]["totals"]["block"]["read"]["ios"]
    print(f"kernel {d[READ_IOS]} reads; exact {ours}; rows kept {kept}, weighted {weighted}; "
          f"shifts {shifts}; {sampling}")
    assert_kernel_count(ours, d[READ_IOS], report, reason=AT_STOP)
    assert shifts[0] == 0 and max(shifts) >= 3 and sampling["max_one_in"] == 1 << max(shifts)
    assert kept < d[READ_IOS] / 4
    # Each kept row stands for its weight: together an unbiased estimate of the count.
    assert abs(weighted - d[READ_IOS]) <= 0.05 * d[READ_IOS]
    # Sampled: the per-phase figures are the exact ones, not the rows'.
    assert report["phases"]["idle"]["block"]["read"]["ios"] == ours
    # The rate changed: percentiles weigh each row by what it stands for, and agree with the
    # kernel's own log2 histogram of every request (p99 within its slot, give or take the
    # estimate's 1/16-octave bucket).
    assert not sampling["uniform"] and sampling["percentiles"] == "weighted sample"
    p99 = report["phases"]["idle"]["block"]["read"]["device_us"]["p99"]
    below = report["exact"]["phases"]["idle"]["block"]["read"]["service_us_below"]["p99"]
    # Where the estimate falls in the kernel's histogram of every request: the share of
    # requests below the edges of its log2 slot (give or take the 1/16-octave bucket) must
    # bracket 99 %. Sharper than "in the slot of the kernel's p99": a true p99 next to a slot
    # edge may be estimated just across it.
    hist = {int(k): n for k, n in report["exact"]["phases"]["idle"]["block"]["read"][
        "service_hist_ns"].items()}
    total = sum(hist.values())

    def share_below(ns: float) -> float:
        return sum(n for lo, n in hist.items() if lo < ns and (lo == 0 or 2 * lo <= ns)) / total

    ns = p99 * 1e3
    slot_lo = 1 << (int(ns / 1.05).bit_length() - 1)
    slot_hi = 1 << (int(ns * 1.05).bit_length())
    print(f"weighted p99 {p99:.1f} us; the kernel's: below {below:.1f} us; share of requests "
          f"below {slot_lo} ns {share_below(slot_lo):.4f}, below {slot_hi} ns "
          f"{share_below(slot_hi):.4f}")
    assert share_below(slot_lo) <= 0.99 + 0.005 and share_below(slot_hi) >= 0.99 - 0.005
