"""`kvprof export --fio-iolog`: a recording's block requests, per phase and device, as fio
iologs that fio itself replays; checked against fio's own report of what it issued."""
from __future__ import annotations

import json
import subprocess

from kvprof.markers import Marker
from tests.helpers import direct_random_reads, direct_write, live, run_kvprof, settle

pytestmark = live


def _replay(iolog, dev: str) -> dict:
    """fio's own count of what it replayed from `iolog` onto `dev`, one request at a time
    (psync: nothing merged), as fast as it can (the counts, not the timing, are checked)."""
    out = subprocess.run(
        ["fio", "--name=replay", f"--read_iolog={iolog}", f"--replay_redirect=/dev/{dev}",
         "--ioengine=psync", "--direct=1", "--replay_no_stall=1", "--output-format=json"],
        check=True, capture_output=True, text=True).stdout
    job = json.loads(out[out.index("{"):])["jobs"][0]
    return {op: (job[op]["total_ios"], job[op]["io_bytes"]) for op in ("read", "write")}


def test_fio_replays_each_phases_iolog_with_the_recorded_requests_and_bytes(
        loopdev, loopdev2, start_recorder, tmp_path):
    rec = start_recorder("-d", loopdev)
    m = Marker(rec.socket, engine="test")
    settle(loopdev)
    m.mark("prefill")
    direct_write(loopdev, 8 << 20, block=256 << 10)
    m.mark("decode")
    direct_random_reads(loopdev, 1500, 8 << 20)
    m.mark("prefill")  # a second prefill window: one iolog holds both, with the wait between
    direct_write(loopdev, 4 << 20, block=128 << 10, offset=16 << 20)
    m.mark("idle")
    assert rec.stop() == 0
    report = rec.report()

    out = tmp_path / "iologs"
    r = run_kvprof("export", str(rec.out), "--fio-iolog", str(out))
    assert r.returncode == 0, r.stderr
    for phase in ("prefill", "decode"):
        iolog = out / f"{phase}.{loopdev}.iolog"
        lines = iolog.read_text().splitlines()
        assert lines[0] == "fio version 3 iolog"
        times = [int(line.split()[0]) for line in lines[3:-1]]
        assert times == sorted(times)
        block = report["phases"][phase]["block"]
        got = _replay(iolog, loopdev2)
        for op in ("read", "write"):
            assert got[op] == (block[op]["ios"], block[op]["bytes"]), (phase, op, got)
    # The two prefill windows' writes, with the decode window's time between them as a wait.
    prefill = (out / f"prefill.{loopdev}.iolog").read_text().splitlines()[3:-1]
    assert int(prefill[-1].split()[0]) - int(prefill[0].split()[0]) >= \
        report["phases"]["decode"]["time_s"] * 1e6 * 0.9  # (µs)


def test_a_session_without_per_request_rows_says_there_is_nothing_to_replay(
        loopdev, start_recorder, tmp_path):
    rec = start_recorder("-d", loopdev, "--no-events")
    direct_write(loopdev, 1 << 20)
    assert rec.stop() == 0
    r = run_kvprof("export", str(rec.out), "--fio-iolog", str(tmp_path / "x"))
    assert r.returncode == 65 and "nothing to replay" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.stderr
