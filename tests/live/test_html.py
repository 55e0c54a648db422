"""The visual report of a real recording: what it plots equals `kvprof report --json`, and it
opens in headless Chromium with no network at all (its own network namespace), every plot
drawn. The screenshot is kept in test-artifacts/."""
from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.helpers import (
    UNTRACED,
    assert_kernel_count,
    direct_random_reads,
    direct_write,
    live,
    run_kvprof,
)

pytestmark = live

ARTIFACTS = Path(__file__).resolve().parents[2] / "test-artifacts"


def figures(page: str) -> dict[str, dict]:
    """kind -> the figure (data and layout) the page draws from."""
    out = {}
    for kind, body in re.findall(
            r'<script type="application/json" class="kvprof-figure" data-kind="([^"]+)" '
            r'data-target="[^"]+">(.*?)</script>', page, re.S):
        out[kind] = json.loads(body.replace("<\\/", "</"))
    return out


def chromium(*args: str) -> subprocess.CompletedProcess:
    exe = shutil.which("chromium") or shutil.which("chromium-browser")
    assert exe, "chromium is not installed (scripts/dev.sh installs it)"
    # unshare -n: a network namespace with nothing but a down loopback. Nothing to fetch from.
    return subprocess.run(["unshare", "-n", exe, "--headless", "--no-sandbox", "--disable-gpu",
                           "--hide-scrollbars", "--virtual-time-budget=15000", *args],
                          capture_output=True, text=True, timeout=120)


@pytest.fixture
def session(loopdev, start_recorder):
    rec = start_recorder("-d", loopdev)
    run_kvprof("mark", "prefill", "--socket", rec.socket)
    direct_write(loopdev, 32 << 20)
    run_kvprof("mark", "decode", "--socket", rec.socket)
    direct_random_reads(loopdev, 3000, 32 << 20)
    run_kvprof("mark", "idle", "--socket", rec.socket)
    assert rec.stop() == 0
    return rec


def test_the_html_report_plots_the_reports_numbers_and_opens_offline(session, tmp_path):
    report = session.report()
    out = tmp_path / "report.html"
    r = run_kvprof("report", str(session.out), "--html", str(out))
    assert r.returncode == 0, r.stderr
    page = out.read_text()
    # Nothing loaded from elsewhere: no script or stylesheet by address.
    assert not re.findall(r"<script[^>]*\ssrc=|<link\s", page)
    figs = figures(page)
    assert set(figs) == {"timeline", "totals", "idle", "latency", "size"}

    phases = report["phases"]
    layer = "block"
    # Per-phase totals: bytes (first panel) and requests (second) per op.
    for trace in figs["totals"]["data"]:
        key = "bytes" if trace.get("xaxis", "x") == "x" else "ios"
        for phase, v in zip(trace["x"], trace["y"]):
            assert v == phases[phase][layer][trace["name"]][key], (phase, trace["name"], key)
    # The timeline's bins add up to the same per-phase bytes and requests.
    summed: dict[tuple[str, str, str], int] = {}
    for trace in figs["timeline"]["data"]:
        if trace["type"] != "bar":
            continue
        phase, op = trace["name"].split()
        key = "bytes" if trace.get("yaxis", "y") == "y" else "ios"
        summed[(phase, op, key)] = summed.get((phase, op, key), 0) + sum(trace["customdata"])
    for (phase, op, key), total in summed.items():
        assert total == phases[phase][layer][op][key], (phase, op, key)
    # What was written and read, but for completions the kernel did not trace (CI saw 2999
    # reads once, "lost 1"); a write request carries at most 1 MiB here.
    assert_kernel_count(summed[("prefill", "write", "bytes")], 32 << 20, report, 1 << 20,
                        UNTRACED)
    assert_kernel_count(summed[("decode", "read", "ios")], 3000, report, reason=UNTRACED)
    # Histograms: each bar is the report's bucket count.
    for kind, key in (("latency", "latency_hist_us"), ("size", "size_hist")):
        for trace in figs[kind]["data"]:
            phase, op = trace["name"].split()
            hist = phases[phase][layer][op][key]
            assert dict(zip((str(b) for b in trace["customdata"]), trace["y"])) == hist
    # Idle: the report's time idle per phase.
    idle = next(t for t in figs["idle"]["data"] if t["name"] == "time idle %")
    assert dict(zip(idle["x"], idle["y"])) == {
        p: phases[p]["block"]["time_idle_pct"] for p in idle["x"]}

    # Opened with no network: every figure drawn (plotly.js came from the page itself).
    dom = chromium("--dump-dom", out.as_uri())
    assert dom.returncode == 0, dom.stderr[-2000:]
    assert dom.stdout.count('class="main-svg"') >= 2 * len(figs), dom.stdout[:500]
    ARTIFACTS.mkdir(exist_ok=True)
    shot = ARTIFACTS / "html-report.png"
    shot.unlink(missing_ok=True)
    r = chromium("--window-size=1280,3000", f"--screenshot={shot}", out.as_uri())
    assert r.returncode == 0 and shot.stat().st_size > 50_000, r.stderr[-2000:]


def test_compare_html_puts_both_sessions_side_by_side(session, tmp_path):
    out = tmp_path / "compare.html"
    r = run_kvprof("compare", str(session.out), str(session.out), "--html", str(out))
    assert r.returncode == 0, r.stderr
    figs = figures(out.read_text())
    assert set(figs) == {"compare-bandwidth", "timeline-a", "timeline-b"}
    bw = {t["name"]: dict(zip(t["x"], t["y"])) for t in figs["compare-bandwidth"]["data"]}
    report = session.report()
    want = report["phases"]["decode"]["block"]["read"]["bandwidth_bytes_per_s"]
    assert bw["A"]["decode read bandwidth"] == bw["B"]["decode read bandwidth"] == want
    dom = chromium("--dump-dom", out.as_uri())
    assert dom.stdout.count('class="main-svg"') >= 2 * len(figs)


def test_html_to_a_place_that_cannot_be_written_is_one_line(session):
    r = run_kvprof("report", str(session.out), "--html", "/nonexistent/dir/r.html")
    assert (r.returncode, r.stderr) == (
        64, "kvprof: error: cannot write /nonexistent/dir/r.html: No such file or directory\n")
