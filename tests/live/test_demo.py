"""The README's main job: `kvprof demo`, live as root and from the sample without privileges."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tests.helpers import forgiven, live, run_kvprof


@live
def test_demo_records_prefill_writes_and_decode_reads(tmp_path):
    r = run_kvprof("demo", "--seconds", "2", "--json", "-o", str(tmp_path / "demo"))
    assert r.returncode == 0, r.stderr
    rep = json.loads(r.stdout)
    pre, dec = rep["phases"]["prefill"], rep["phases"]["decode"]
    # One round: 4 chunks of 8 MiB, in 1 MiB writes; short only by writes whose completion no
    # probe could see (UNTRACED: CI once had 30 MiB, cause not printed then; it is now).
    assert pre["block"]["write"]["bytes"] >= (32 << 20) - forgiven(rep, 32) * (1 << 20), \
        (rep["session"]["lost_by_reason"],
         {p: v["block"].get("write") for p, v in rep["phases"].items()})
    assert dec["block"]["read"]["ios"] > 0 and dec["block"]["read"]["size_hist"].keys() == {"4096"}
    assert dec["block"]["write"]["bytes"] < pre["block"]["write"]["bytes"]
    # every completion matched its issue (flush sequences included)
    assert rep["session"]["lost_by_reason"]["block_unmatched_completion"] == 0
    if shutil.which("fio"):
        assert dec["io_uring"]["read"]["ios"] > 0
    # its loop device is detached again (it may already serve someone else, not the demo)
    (dev,) = rep["session"]["devices"]
    backing = Path(f"/sys/block/{dev}/loop/backing_file")
    assert not backing.exists() or "kvprof-demo" not in backing.read_text()


@pytest.mark.skipif(shutil.which("setpriv") is None, reason="needs setpriv")
def test_demo_without_privileges_shows_the_recorded_sample():
    r = run_kvprof("demo", prefix=["setpriv", "--bounding-set=-all", "--inh-caps=-all"])
    assert r.returncode == 0, r.stderr
    assert "showing a recorded sample instead" in r.stderr
    assert "== prefill" in r.stdout and "== decode" in r.stdout
    assert all(len(line) <= 80 for line in r.stdout.splitlines())
