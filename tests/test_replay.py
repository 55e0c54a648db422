"""`kvprof replay`: a recording's block requests issued again on candidate storage at their
recorded times, recorded as a new session with the recording's phase windows. Checked
against the recording itself: the same device type must give the same per-phase figures."""
from __future__ import annotations

import json
import subprocess
import time

from kvprof.markers import Marker
from tests.conftest import (
    WRITE_IOS,
    WRITE_SECTORS,
    calls_near_edges,
    live,
    lost_to,
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
    """The new session's aggregate tier splits by the recording's windows as the
    recording's did (its recorder got them as the replay reached them). The exact tier gives
    a request the phase of its 4 ms issue slot; those in slots a window's edge cut may fall
    either side (exact.boundary counts them, per session)."""
    for phase, op in (("prefill", "write"), ("decode", "read")):
        a = before["exact"]["phases"][phase]["block"][op]
        b = after["exact"]["phases"][phase]["block"][op]
        edge = sum(s["exact"]["boundary"]["by_phase"].get(phase, 0) for s in (before, after))
        print(f"{phase} {op}: exact ios {a['ios']} / {b['ios']} (edge slots {edge}), "
              f"bytes {a['bytes']} / {b['bytes']}")
        assert abs(b["ios"] - a["ios"]) <= missed + edge, (phase, a["ios"], b["ios"])
        assert abs(b["bytes"] - a["bytes"]) <= (missed + edge) * (256 << 10), (phase, a, b)


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
    # 6.18 complete a few requests in a million without the completion tracepoint; each
    # session counts those it missed (UNTRACED's reasons): a write missed so is
    # neither a row nor replayed (seen: 639 of 640, with one counted), and the figures may
    # differ by no more than those.
    short = recorded[WRITE_IOS] - d[WRITE_IOS]
    losses = {k: n for k, n in before["session"]["lost_by_reason"].items() if n}
    print(f"writes: recorded device {recorded[WRITE_IOS]}, candidate {d[WRITE_IOS]}; "
          f"the recording's losses {losses}")
    assert 0 <= short <= lost_to(before)
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
    from tests.conftest import direct_write

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

    from tests.conftest import mounted_ext4

    root = Path(__file__).resolve().parent.parent
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
    # A call issued late by the replay (`lag`) may cross the edge of its window: the test's
    # decode ends ~0.2 ms after its last read. Per phase the replay's calls may differ from
    # the backends' by the recorded calls that close to an edge; over all phases, none.
    late = max(lg["max_s"] for lg in result["lag"].values())
    edge = calls_near_edges(rec.out, late)
    print(f"late by at most {late * 1e6:.0f} us; {edge} recorded calls that close to an edge")
    total = {"read": [0, 0], "write": [0, 0]}
    for phase, by_cache in did.items():
        for op in ("read", "write"):
            calls = sum(ops[op][0] for ops in by_cache.values() if op in ops)
            nbytes = sum(ops[op][1] for ops in by_cache.values() if op in ops)
            got = after["phases"][phase]["syscall"].get(op, {"ios": 0, "bytes": 0})
            print(f"{phase} {op}: backends {calls} calls {nbytes} bytes, replay {got['ios']} "
                  f"calls {got['bytes']} bytes")
            assert abs(got["ios"] - calls) <= edge, (phase, op)
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
    write bandwidth: in the replay prefill writes at the limit, the replay says prefill fell
    behind and by how much, and decode, whose reads the limit does not touch and which the
    held-back writes have caught up with by then, reads as it did."""
    from tests.conftest import io_limit

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
    assert "kept up" in next(x for x in r.stdout.splitlines() if x.strip().startswith("decode"))
    assert all(lg["p99_s"] < 0.05 for lg in result["lag"].values()), result["lag"]
    # Decode, whose reads the limit does not hold: p50 as recorded. (#25 asks p99 within
    # 25 % too: measured 111 -> 87, 125 -> 87, 76 -> 83, 160 -> 88, 124 -> 75 us: the replay's
    # holds still, the recording's own p99 moves more than that between identical
    # recordings, 76 to 160 us, so it is printed above, not held.)
    assert abs(db["p50"] / da["p50"] - 1) <= 0.25
