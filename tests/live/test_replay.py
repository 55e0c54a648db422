"""`kvprof replay`: a recording's block requests issued again on candidate storage at their
recorded times, recorded as a new session with the recording's phase windows. Checked
against the recording itself: the same device type must give the same per-phase figures."""
from __future__ import annotations

import json
import subprocess
import time

import pytest

from kvprof.markers import Marker
from tests.helpers import (
    READ_IOS,
    WRITE_IOS,
    WRITE_SECTORS,
    calls_near_edges,
    forgiven,
    live,
    run_kvprof,
    settle,
    stat_delta,
)

pytestmark = live


def _fio(dev: str, *job: str) -> None:
    subprocess.run(["fio", "--name=w", f"--filename=/dev/{dev}", "--direct=1",
                    "--ioengine=io_uring", "--time_based", "--output-format=terse", *job],
                   check=True, capture_output=True)


def _engine_like(dev: str, marker: Marker) -> None:
    """Two rounds of prefill (256 KiB writes at 40 MB/s, open loop) and decode (16 KiB random
    reads at 2 000 a second): arrivals the device keeps up with, as a server's would be."""
    for rnd in range(2):
        marker.mark("prefill")
        _fio(dev, "--rw=write", "--bs=256k", "--rate=40m", "--runtime=2", "--size=64M",
             f"--offset={rnd * 64}M", "--iodepth=4")
        marker.mark("decode")
        _fio(dev, "--rw=randread", "--bs=16k", "--rate_iops=2000", "--runtime=2",
             "--size=128M", "--iodepth=8")
    marker.mark("idle")


def _same_exact_tier(before: dict, after: dict, missed: int) -> None:
    """The new session's aggregate tier splits by the recording's windows as the replay
    placed them (its recorder got them as the replay decided them), each request in the
    phase it was recorded in: per phase, the requests of the recording's report (its
    events; a sampled session's counts are its aggregate tier's), and no 4 ms issue slot
    holds requests of two phases (the replay starts a phase on a slot's edge where one
    would). The recording's own exact tier may give the requests of the slots a window's
    edge cut to either side (its exact.boundary)."""
    for phase, op in (("prefill", "write"), ("decode", "read")):
        want = before["phases"][phase]["block"][op]
        a = before["exact"]["phases"][phase]["block"][op]
        b = after["exact"]["phases"][phase]["block"][op]
        edge = before["exact"]["boundary"]["by_phase"].get(phase, 0)
        print(f"{phase} {op}: exact ios {a['ios']} / {b['ios']} (the recording's edge slots "
              f"{edge}; its events {want['ios']}), bytes {a['bytes']} / {b['bytes']}")
        assert abs(b["ios"] - want["ios"]) <= missed, (phase, want["ios"], b["ios"])
        assert abs(b["bytes"] - want["bytes"]) <= missed * (256 << 10), (phase, want, b)
        assert abs(a["ios"] - want["ios"]) <= missed + edge, (phase, want["ios"], a["ios"])
    assert after["exact"]["boundary"]["ios"] <= missed, after["exact"]["boundary"]


def _record_then_replay(loopdev: str, loopdev2: str, start_recorder, tmp_path, *args: str):
    """_engine_like recorded on `loopdev` (record's `args` added), replayed on `loopdev2`:
    the recording's report, the recorded device's /sys/block delta, the replay's stderr and
    --json result, the candidate's /sys/block delta and the new session's report."""
    rec = start_recorder("-d", loopdev, *args)
    r0 = settle(loopdev)
    _engine_like(loopdev, Marker(rec.socket, engine="test"))
    recorded = stat_delta(r0, settle(loopdev))
    time.sleep(0.5)
    assert rec.stop() == 0
    before = rec.report()
    out = tmp_path / "replayed"
    s0 = settle(loopdev2)
    r = run_kvprof("replay", str(rec.out), "--on", f"/dev/{loopdev2}", "-o", str(out),
                   "--json")
    assert r.returncode == 0, r.stderr
    d = stat_delta(s0, settle(loopdev2))
    after = json.loads(run_kvprof("report", str(out), "--json").stdout)
    return before, recorded, r.stderr, json.loads(r.stdout), d, after


def test_a_replay_on_the_same_kind_of_device_reproduces_each_phase(
        loopdev, loopdev2, start_recorder, tmp_path):
    before, recorded, _, result, d, after = _record_then_replay(
        loopdev, loopdev2, start_recorder, tmp_path)
    # The writes the candidate got, by its own counters, are the ones the recorded device
    # got, by its own: one for one, none merged (its reads also count the safety check's
    # look at its first MiB), but for those the recording holds no row of. Loop devices on
    # 6.18 complete a few requests in ten thousand, in bursts, without running the completion
    # probe; each session counts those it missed (UNTRACED's reasons; seen: 14 of the 640
    # writes and 8 001 reads): a write missed so is neither a row nor replayed, and the
    # figures may differ by no more than those.
    short = recorded[WRITE_IOS] - d[WRITE_IOS]
    losses = {k: n for k, n in before["session"]["lost_by_reason"].items() if n}
    print(f"writes: recorded device {recorded[WRITE_IOS]}, candidate {d[WRITE_IOS]}; "
          f"the recording's losses {losses}")
    assert 0 <= short <= forgiven(before, recorded[READ_IOS] + recorded[WRITE_IOS])
    assert recorded[WRITE_SECTORS] - d[WRITE_SECTORS] == short * ((256 << 10) // 512)
    missed = before["session"]["lost_events"] + after["session"]["lost_events"]
    assert 0 <= result["requests"] - result["replayed"] <= after["session"]["lost_events"]
    figures = []
    for phase, op in (("prefill", "write"), ("decode", "read")):
        a, b = before["phases"][phase]["block"][op], after["phases"][phase]["block"][op]
        figures.append(f"{phase} {op}: ios {a['ios']} / {b['ios']}, bytes {a['bytes']} / "
                       f"{b['bytes']}, MB/s {a['bandwidth_bytes_per_s'] / 1e6:.2f} / "
                       f"{b['bandwidth_bytes_per_s'] / 1e6:.2f}, p50 "
                       f"{a['latency_us']['p50']:.0f} / {b['latency_us']['p50']:.0f} us, p99 "
                       f"{a['latency_us']['p99']:.0f} / {b['latency_us']['p99']:.0f} us, "
                       f"late p99 {result['lag'][phase]['p99_s']:.3f} s")
    print("\n".join(figures))
    for phase, op in (("prefill", "write"), ("decode", "read")):
        a, b = before["phases"][phase]["block"][op], after["phases"][phase]["block"][op]
        assert abs(b["ios"] - a["ios"]) <= missed, figures
        assert abs(b["bytes"] - a["bytes"]) <= missed * (256 << 10), figures
        for k in ("bandwidth_bytes_per_s", "iops"):
            assert abs(b[k] / a[k] - 1) <= 0.05, figures
        assert result["lag"][phase]["p99_s"] < 0.05, figures
    _same_exact_tier(before, after, missed)
    # (#25 asks p50 and p99 within 25 % too: prefill's are; decode's are printed above, not
    # held: tens of microseconds on a loop device depend on what the recorded process did
    # with the CPUs (fio's rate limiter spins one), which benchmarks/replay_latency.py
    # measures: the replay gives 8-11 us whether fio io_uring (5-6 us), fio psync (6-13) or
    # a thread pool (30-31) made the recording.)


def test_replay_refuses_what_it_cannot_or_must_not_do(loopdev, loopdev2, start_recorder,
                                                      tmp_path):
    from tests.helpers import direct_write

    rec = start_recorder("-d", loopdev, "--no-events")
    direct_write(loopdev, 1 << 20)
    assert rec.stop() == 0
    r = run_kvprof("replay", str(rec.out), "--on", f"/dev/{loopdev2}", "-o",
                   str(tmp_path / "a"))
    assert r.returncode == 65 and "nothing to replay" in r.stderr, r.stderr

    rec = start_recorder("-d", loopdev, name="events")
    direct_write(loopdev, 1 << 20)
    assert rec.stop() == 0
    direct_write(loopdev2, 1 << 20)  # the candidate holds data now
    r = run_kvprof("replay", str(rec.out), "--on", f"/dev/{loopdev2}", "-o",
                   str(tmp_path / "b"))
    assert r.returncode == 64 and "refusing to write" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr
    # File calls replay on a filesystem; this session has none anyway.
    r = run_kvprof("replay", str(rec.out), "--on", f"/dev/{loopdev2}", "--layer", "syscall",
                   "-o", str(tmp_path / "c"))
    assert r.returncode == 64 and "give a directory" in r.stderr, r.stderr
    r = run_kvprof("replay", str(rec.out), "--on", str(tmp_path), "--layer", "syscall",
                   "-o", str(tmp_path / "d"))
    assert r.returncode == 65 and "no file reads, writes or syncs" in r.stderr, r.stderr


def test_a_sampled_recording_is_replayed_scaled_up_to_every_request_counted(
        loopdev, loopdev2, start_recorder, tmp_path):
    """Past --event-rate the event tier keeps 1 in 2^k rows; the replay issues as many
    requests per phase as the kernel counted (the aggregate tier), not the kept rows alone,
    and says so. Checked against the candidate's own /sys/block counters."""
    before, recorded, stderr, result, d, after = _record_then_replay(
        loopdev, loopdev2, start_recorder, tmp_path, "--event-rate", "300")
    assert before["session"]["event_sampling"], "the recording was meant to sample"
    assert "scaled up to the counts of its aggregate tier" in stderr, stderr
    missed = before["session"]["lost_events"] + after["session"]["lost_events"]
    kept = sum(g["kept"] for g in result["scaled_up"])
    print(f"kept {kept} rows, issued {result['requests']}, candidate writes {d[WRITE_IOS]} "
          f"(recorded device {recorded[WRITE_IOS]})")
    assert kept < result["requests"] / 2
    # Every write the recorded device got, by its counters, the candidate got, by its own:
    # but for those the exact tier did not count (completions the kernel did not report,
    # lost_events) or counted in a 4 ms slot a window's edge cut, in another phase than its
    # kept rows' (exact.boundary): the scale-up has no kept row there to copy.
    edges = before["exact"]["boundary"]["ios"]
    print(f"missed {missed}, in edge slots {edges}; scaled {result['scaled_up']}; exact "
          + str({ph: {op: v["block"][op]["ios"] for op in v["block"]}
                 for ph, v in before["exact"]["phases"].items() if v["block"]}))
    short = recorded[WRITE_IOS] - d[WRITE_IOS]
    assert 0 <= short <= missed + edges, (d[WRITE_IOS], recorded[WRITE_IOS])
    assert recorded[WRITE_SECTORS] - d[WRITE_SECTORS] == short * 512  # (256 KiB each)
    _same_exact_tier(before, after, missed)
    assert all(lg["p99_s"] < 0.05 for lg in result["lag"].values()), result["lag"]


def test_the_backends_file_calls_replay_on_another_filesystem(loopdev, ext4, loopdev2,
                                                                start_recorder, tmp_path):
    """The offload backends' own file I/O (tests/kv_backends.py: vLLM's fs tier O_DIRECT,
    LMCache's and HiCache's buffered chunk files), recorded with -p as an engine is, replayed
    call for call on a directory of another filesystem: per phase and op the replay made the
    calls and moved the bytes the backends say they did, at the offsets the kernel put
    them, O_DIRECT where theirs was; the candidate's device got the bytes written."""
    import os
    import sys
    from pathlib import Path

    import duckdb

    from tests.helpers import mounted_ext4

    root = Path(__file__).resolve().parents[2]
    work = subprocess.Popen(["VLLM::EngineCore_DP0", str(root / "tests" / "kv_backends.py"),
                             str(ext4), str(tmp_path / "session.sock")],
                            executable=sys.executable, stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(root)})
    rec = start_recorder("-d", loopdev, "-p", str(work.pid))
    out, _ = work.communicate("go\n", timeout=120)
    assert work.returncode == 0
    did = json.loads(out)
    assert rec.stop() == 0, "".join(rec.stderr_lines)

    with mounted_ext4(loopdev2, tmp_path / "candidate") as cand:
        os.sync()
        s0 = settle(loopdev2)
        new = tmp_path / "replayed"
        r = run_kvprof("replay", str(rec.out), "--on", str(cand), "-o", str(new), "--json")
        assert r.returncode == 0, r.stderr
        result = json.loads(r.stdout)
        os.sync()
        d = stat_delta(s0, settle(loopdev2))
        assert not list(cand.glob(".kvprof-replay-*")), "the scratch files were left behind"
        # Decode alone: the files it reads were written in prefill, which is not replayed,
        # so they are laid down first, as far as its reads reach.
        r = run_kvprof("replay", str(rec.out), "--on", str(cand), "--phase", "decode", "-o",
                       str(tmp_path / "decode-only"), "--json")
        assert r.returncode == 0, r.stderr
        alone = json.loads(r.stdout)
    reads = [sum(ops["read"][k] for ops in did["decode"].values() if "read" in ops)
             for k in (0, 1)]
    # (kv_backends.py reads 8 vLLM block files, 4 LMCache chunks and 4 HiCache pages)
    assert alone["laid_down"]["files"] == 16, alone
    assert (alone["requests"], alone["replayed_bytes"]) == tuple(reads), alone
    print(json.dumps({k: result[k] for k in ("requests", "files", "laid_down",
                                              "direct_calls", "syncs", "lag")}))
    assert result["layer"] == "syscall"
    after = json.loads(run_kvprof("report", str(new), "--json").stdout)
    # However late the replay let a call out (`lag`; the test's decode ends ~0.2 ms after
    # its last read), it is in the phase it was recorded in: per phase and op the calls and
    # bytes are the backends'.
    late = max(lg["max_s"] for lg in result["lag"].values())
    print(f"late by at most {late * 1e6:.0f} us; {calls_near_edges(rec.out, late)} recorded "
          "calls that close to an edge")
    total = {"read": [0, 0], "write": [0, 0]}
    for phase, by_cache in did.items():
        for op in ("read", "write"):
            calls = sum(ops[op][0] for ops in by_cache.values() if op in ops)
            nbytes = sum(ops[op][1] for ops in by_cache.values() if op in ops)
            got = after["phases"][phase]["syscall"].get(op, {"ios": 0, "bytes": 0})
            print(f"{phase} {op}: backends {calls} calls {nbytes} bytes, replay {got['ios']} "
                  f"calls {got['bytes']} bytes")
            assert (got["ios"], got["bytes"]) == (calls, nbytes), (phase, op)
            total[op][0] += calls
            total[op][1] += nbytes
    for op, want in total.items():
        got = [sum(after["phases"][ph]["syscall"][op][k] for ph in after["phases"])
               for k in ("ios", "bytes")]
        assert got == want, (op, got, want)
    written = sum(ops["write"][1] for by_cache in did.values() for ops in by_cache.values()
                  if "write" in ops)
    assert d[WRITE_SECTORS] * 512 >= written, (d[WRITE_SECTORS] * 512, written)
    assert all(lg["p99_s"] < 0.05 for lg in result["lag"].values()), result["lag"]
    # The replay's calls, one for one with the recording's: offset, bytes, O_DIRECT.

    def calls(session: Path) -> list[tuple]:
        con = duckdb.connect(str(session / "session.duckdb"), read_only=True)
        try:
            return con.execute("""SELECT op, file_offset, bytes, (flags & 32) <> 0 FROM io
                                  WHERE layer = 'syscall' AND op IN ('read', 'write')
                                  ORDER BY issue_ns""").fetchall()
        finally:
            con.close()

    assert sorted(calls(new)) == sorted(calls(rec.out))


def test_a_slower_candidate_holds_prefill_to_its_limit_and_says_how_far_behind(
        loopdev, loopdev2, start_recorder, tmp_path):
    """The candidate's writes held by the kernel's io controller below prefill's recorded
    write bandwidth: in the replay prefill writes at the limit, every write in prefill,
    which lasts until they are out; the replay says prefill fell behind and by how much,
    and decode, whose reads the limit does not touch and which the held-back writes have
    caught up with by then, reads without waiting on it."""
    from tests.helpers import io_limit

    limit = 20_000_000
    rec = start_recorder("-d", loopdev)
    marker = Marker(rec.socket, engine="test")
    marker.mark("prefill")  # 40 MB/s for 3 s: 6 s at the limit
    _fio(loopdev, "--rw=write", "--bs=256k", "--rate=40m", "--runtime=3", "--size=128M",
         "--iodepth=4")
    marker.mark("idle")
    time.sleep(3.5)  # the held-back writes done before decode
    marker.mark("decode")
    _fio(loopdev, "--rw=randread", "--bs=64k", "--rate_iops=1000", "--runtime=3",
         "--size=128M", "--iodepth=8")
    marker.mark("idle")
    time.sleep(0.5)
    assert rec.stop() == 0
    before = rec.report()

    out = tmp_path / "replayed"
    with io_limit(loopdev2, write_bps=limit):
        r = run_kvprof("replay", str(rec.out), "--on", f"/dev/{loopdev2}", "-o", str(out))
    assert r.returncode == 0, r.stderr
    after = json.loads(run_kvprof("report", str(out), "--json").stdout)
    a = before["phases"]["prefill"]["block"]["write"]["bandwidth_bytes_per_s"]
    b = after["phases"]["prefill"]["block"]["write"]["bandwidth_bytes_per_s"]
    da, db = (s["phases"]["decode"]["block"]["read"]["latency_us"] for s in (before, after))
    print(r.stdout)
    print(f"prefill write {a / 1e6:.2f} -> {b / 1e6:.2f} MB/s (limit {limit / 1e6:.0f}); "
          f"decode read p50 {da['p50']:.0f} -> {db['p50']:.0f} us, p99 {da['p99']:.0f} -> "
          f"{db['p99']:.0f} us")
    assert a > 1.5 * limit
    assert abs(b / limit - 1) <= 0.10
    # How far behind: the last write goes out when the limit has let the recorded bytes
    # through, against when it was due: bytes / limit - the span they were issued over.
    import duckdb

    con = duckdb.connect(str(rec.out / "session.duckdb"), read_only=True)
    try:
        nbytes, span = con.execute("""SELECT sum(bytes), max(issue_ns) - min(issue_ns) FROM io
                                      WHERE layer = 'block' AND op = 'write'""").fetchall()[0]
    finally:
        con.close()
    # The same replay without the limit keeps up: the limit is what held prefill back.
    result = json.loads(run_kvprof("replay", str(rec.out), "--on", f"/dev/{loopdev2}", "-o",
                                   str(tmp_path / "again"), "--json", "--force").stdout)
    line = next(x for x in r.stdout.splitlines() if x.strip().startswith("prefill"))
    late = float(line.split("at most ")[1].split(" s")[0])
    want = nbytes / limit - span / 1e9
    print(f"prefill at most {late:.2f} s late; the limit lets it through {want:.2f} s late")
    assert "fell behind" in line and abs(late / want - 1) <= 0.10, r.stdout
    # Each write stays in prefill, which lasts until the last one is out: longer than
    # recorded by about as much as that one was late (the bandwidth above is over it).
    a_s, b_s = (s["phases"]["prefill"]["time_s"] for s in (before, after))
    print(f"prefill {a_s:.2f} -> {b_s:.2f} s")
    assert after["phases"]["prefill"]["block"]["write"]["ios"] == \
        before["phases"]["prefill"]["block"]["write"]["ios"]
    assert abs((b_s - a_s) / late - 1) <= 0.05
    assert "kept up" in next(x for x in r.stdout.splitlines() if x.strip().startswith("decode"))
    assert all(lg["p99_s"] < 0.05 for lg in result["lag"].values()), result["lag"]
    # Decode's reads are not held by the limit: they kept up, on time (the two lines above).
    # blk-throttle holds the writes' bios before they become requests, so no read queues
    # behind a held one; what is left to check is that the reads ran at the device's speed,
    # below even one write's turn at the limit (256 KiB / 20 MB/s = 13 ms). (Decode's latency
    # as recorded is held on a device with a latency of its own, test_slow_device.py: tens of
    # microseconds on this memory-backed loop are the CPUs' (44 -> 29 us p50 in one CI run).)
    assert db["p99"] < (256 << 10) / limit * 1e6, db


def _counts(report: dict, tier: str | None = None) -> dict[tuple[str, str], tuple[int, int]]:
    """(phase, op) -> (requests, bytes) of the block layer, in the event tier, or with
    tier="exact" in the aggregate tier."""
    phases = report[tier]["phases"] if tier else report["phases"]
    return {(ph, op): (v["ios"], v["bytes"]) for ph, layers in phases.items()
            for op, v in layers["block"].items() if op in ("read", "write") and v["ios"]}


def _lead_s(session) -> float:
    """How long the session's first window ran before its first request was issued: the
    replay counts a phase from its first request, a report from the window's start."""
    import duckdb

    con = duckdb.connect(str(session / "session.duckdb"), read_only=True)
    try:
        return con.execute("""SELECT ((SELECT min(issue_ns) FROM io WHERE layer = 'block')
                                      - (SELECT min(start_ns) FROM phase)) / 1e9""").fetchone()[0]
    finally:
        con.close()


def test_requests_a_slow_candidate_lets_out_late_stay_in_their_recorded_phase(
        loopdev, slow_device, start_recorder, tmp_path):
    """Windows a millisecond or two long, each ended right after its last request (requests
    at every edge): 24 writes in prefill, 24 reads in decode, 4 in idle, 40 rounds. Replayed
    on a device whose every request waits 2 ms, 8 in flight a lane: the replay falls behind
    inside every window, and each request still counts in the phase it was recorded in,
    per phase and op, in the event tier and the exact tier (no slot a phase edge cuts); the
    windows stretch instead, and the replay says by how much."""
    import mmap
    import os
    import random

    slow = slow_device(read_ms=2, write_ms=2)
    rec = start_recorder("-d", loopdev)
    settle(loopdev)
    marker = Marker(rec.socket, engine="test")
    buf = mmap.mmap(-1, 64 << 10)
    buf.write(os.urandom(64 << 10))
    view = memoryview(buf)
    rnd = random.Random(3)
    fd = os.open(f"/dev/{loopdev}", os.O_RDWR | os.O_DIRECT)
    try:
        for n in range(40):
            marker.mark("prefill")
            for i in range(24):
                os.pwritev(fd, [view], (n * 24 + i) << 16)
            marker.mark("decode")
            for _ in range(24):
                os.preadv(fd, [view[:16 << 10]], rnd.randrange(4096) << 14)
            marker.mark("idle")
            for _ in range(4):
                os.preadv(fd, [view[:4096]], rnd.randrange(16384) << 12)
            time.sleep(0.01)
    finally:
        os.close(fd)
    time.sleep(0.5)
    assert rec.stop() == 0
    before = rec.report()
    out = tmp_path / "replayed"
    r = run_kvprof("replay", str(rec.out), "--on", slow.path, "-o", str(out), "--json")
    assert r.returncode == 0, r.stderr
    result = json.loads(r.stdout)
    after = json.loads(run_kvprof("report", str(out), "--json").stdout)
    missed = forgiven(before, 2080) + forgiven(after, 2080)
    want = _counts(before)
    events, exact = _counts(after), _counts(after, "exact")
    print(f"lag {result['lag']}\nphases {result.get('phases')}\nlost {missed}; the "
          f"recording's exact-tier edge slots {before['exact']['boundary']['ios']}, the "
          f"replay's {after['exact']['boundary']['ios']}")
    for key in sorted(want.keys() | events.keys() | exact.keys()):
        print(f"{key}: recorded {want.get(key)}, replayed events {events.get(key)}, "
              f"exact {exact.get(key)}")
    assert want[("prefill", "write")] == (960, 960 << 16) or missed, want
    assert want[("decode", "read")][0] == 960 or missed, want
    assert want[("idle", "read")][0] == 160 or missed, want
    # It fell behind inside the windows: requests went out up to several ms late.
    assert result["lag"]["prefill"]["max_s"] > 0.004, result["lag"]
    assert result["replayed"] == result["requests"] == 2080 or missed, result
    for key in want.keys() | events.keys() | exact.keys():
        for got in (events, exact):
            a, b = want.get(key, (0, 0)), got.get(key, (0, 0))
            assert abs(a[0] - b[0]) <= missed and abs(a[1] - b[1]) <= missed * (64 << 10), \
                (key, a, b)
    assert after["exact"]["boundary"]["ios"] <= missed
    # The windows stretched instead: prefill and decode took longer than recorded, as long
    # as the replay says (its figures span the first request to the last).
    for ph in ("prefill", "decode"):
        took = result["phases"][ph]
        print(f"{ph}: {before['phases'][ph]['time_s']:.4f} -> {after['phases'][ph]['time_s']:.4f}"
              f" s in the reports; the replay says {took}")
        assert took["replayed_s"] > 2 * took["recorded_s"], result["phases"]
        assert took["stretched_s"] == pytest.approx(took["replayed_s"] - took["recorded_s"])
        # (the replay's window opens where the recording's did, its first request due as long
        # after: both reports count that lead, the replay's figures do not)
        lead = _lead_s(rec.out) if ph == "prefill" else 0
        assert took["recorded_s"] == pytest.approx(before["phases"][ph]["time_s"] - lead, abs=1e-6)
        assert took["replayed_s"] == pytest.approx(after["phases"][ph]["time_s"] - lead, abs=1e-6)
