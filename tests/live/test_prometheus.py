"""`record --prometheus`: a real Prometheus server (Debian's package, started here on
loopback) scrapes a recorder tracing real I/O; PromQL through its HTTP API gives the per-phase
bytes and requests of kvprof's own report. The Grafana dashboard and alert rules in
dashboards/ name only metrics a live scrape has, and promtool accepts the rules."""
from __future__ import annotations

import json
import re
import shutil
import socket
import subprocess
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pyarrow as pa
import pytest
import yaml
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from kvprof import schema
from kvprof.views.prometheus import Exporter
from tests.helpers import (
    AT_STOP,
    UNTRACED,
    assert_kernel_count,
    direct_random_reads,
    direct_write,
    free_port,
    http_get,
    live,
    run_kvprof,
)

pytestmark = live

ROOT = Path(__file__).resolve().parents[2]
DASHBOARDS = ROOT / "dashboards"


def wait_for(cond, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while True:
        try:
            got = cond()
            if got:
                return got
        except OSError:
            pass
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


@pytest.fixture
def prometheus(tmp_path):
    exe = shutil.which("prometheus")
    assert exe, "prometheus is not installed (scripts/dev.sh installs Debian's package)"
    servers = []

    def start(target_port: int) -> str:
        port = free_port()
        cfg = tmp_path / "prometheus.yml"
        cfg.write_text(yaml.safe_dump({
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
            "scrape_configs": [{"job_name": "kvprof",
                                "static_configs": [{"targets": [f"127.0.0.1:{target_port}"]}]}],
        }))
        proc = subprocess.Popen([exe, f"--config.file={cfg}",
                                 f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                                 f"--web.listen-address=127.0.0.1:{port}"],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        servers.append(proc)
        url = f"http://127.0.0.1:{port}"
        wait_for(lambda: http_get(url + "/-/ready"), 60, "prometheus to be ready")
        return url

    yield start
    for p in servers:
        p.terminate()
        p.wait(30)


def promql(url: str, query: str) -> list[dict]:
    body = json.loads(http_get(f"{url}/api/v1/query?" + urllib.parse.urlencode({"query": query})))
    assert body["status"] == "success", body
    return body["data"]["result"]


def scraped_names(text: str) -> set[str]:
    return {line.split("{")[0].split(" ")[0] for line in text.splitlines()
            if line and not line.startswith("#")}


def test_prometheus_scrapes_the_reports_per_phase_totals(loopdev, start_recorder, prometheus):
    port = free_port()
    rec = start_recorder("-d", loopdev, "--prometheus", f"127.0.0.1:{port}")
    url = prometheus(port)
    # Prometheus finds its targets a few seconds after it is ready.
    wait_for(lambda: promql(url, "kvprof_build_info"), 30, "the first scrape")
    run_kvprof("mark", "prefill", "--socket", rec.socket)
    direct_write(loopdev, 48 << 20)
    run_kvprof("mark", "decode", "--socket", rec.socket)
    direct_random_reads(loopdev, 4000, 48 << 20)
    run_kvprof("mark", "idle", "--socket", rec.socket)
    # A second is folded by the windows and published `--settle` (5) s after it ends, at
    # the next flush; then one scrape more.
    time.sleep(5 + 1.5)
    stamp = time.time()
    wait_for(lambda: float(promql(url, "timestamp(kvprof_build_info)")[0]["value"][1]) > stamp,
             10, "a scrape after the I/O")
    query = 'sum by (phase, op) (kvprof_io_bytes_total{layer="block"})'
    got_bytes = {(r["metric"]["phase"], r["metric"]["op"]): int(float(r["value"][1]))
                 for r in promql(url, query)}
    got_ios = {(r["metric"]["phase"], r["metric"]["op"]): int(float(r["value"][1]))
               for r in promql(url, query.replace("bytes", "ops"))}
    # Idle ratio, phase time and the info metric, as PromQL sees them.
    idle = {r["metric"]["phase"]: float(r["value"][1]) for r in promql(
        url, f'kvprof_storage_idle_ratio{{device="{loopdev}"}}')}
    seconds = {r["metric"]["phase"]: float(r["value"][1])
               for r in promql(url, 'kvprof_phase_seconds_total{source="manual"}')}
    up = promql(url, 'kvprof_build_info')
    metrics_text = http_get(f"http://127.0.0.1:{port}/metrics").decode()
    assert rec.stop() == 0
    report = rec.report()
    exact = report["exact"]["phases"]
    want_bytes = {(p, op): e["bytes"] for p in exact for op, e in exact[p]["block"].items()}
    want_ios = {(p, op): e["ios"] for p in exact for op, e in exact[p]["block"].items()}
    print(f"PromQL {got_bytes}; report {want_bytes}; lost "
          f"{report['session']['lost_by_reason']}")
    assert got_bytes == want_bytes and got_ios == want_ios
    # What was written and read: the exact tier counts a completion the kernel did not trace
    # too (CI saw 3999 reads once), once the kernel starts that request again; one it had not
    # by the stop is held then (AT_STOP). A write request carries at most 1 MiB here.
    assert_kernel_count(want_bytes[("prefill", "write")], 48 << 20, report, 1 << 20, AT_STOP)
    assert_kernel_count(want_ios[("decode", "read")], 4000, report, reason=AT_STOP)
    # The report's per-phase rows agree too (every row recorded here, but for those).
    assert_kernel_count(report["phases"]["decode"]["block"]["read"]["ios"], 4000, report,
                        reason=UNTRACED)
    assert 0 <= idle["prefill"] < 1 and 0 <= idle["decode"] < 1
    assert seconds["prefill"] > 0 and seconds["decode"] > 0
    assert up and up[0]["metric"]["session"] == report["session"]["id"]

    # The dashboards name only metrics this live scrape has.
    names = scraped_names(metrics_text)
    dashboard = json.loads((DASHBOARDS / "kvprof-grafana.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    assert len(exprs) >= 6
    for expr in exprs:
        used = set(re.findall(r"\bkvprof_[a-z_]+", expr))
        assert used and used <= names, (expr, used - names)
        # Each query runs on the real server.
        q = expr.replace("$host", ".*").replace("$__rate_interval", "1m")
        body = json.loads(http_get(f"{url}/api/v1/query?" + urllib.parse.urlencode({"query": q})))
        assert body["status"] == "success", (q, body)
    assert any(v["name"] == "host" for v in dashboard["templating"]["list"])
    rules = yaml.safe_load((DASHBOARDS / "kvprof-alerts.yml").read_text())
    for group in rules["groups"]:
        for rule in group["rules"]:
            assert set(re.findall(r"\bkvprof_[a-z_]+", rule["expr"])) <= names, rule


def test_promtool_accepts_the_alert_rules_and_scrape_config():
    r = subprocess.run(["promtool", "check", "rules", str(DASHBOARDS / "kvprof-alerts.yml")],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "SUCCESS: 3 rules found" in r.stdout
    r = subprocess.run(["promtool", "check", "config", str(DASHBOARDS / "prometheus.yml")],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


def test_a_taken_port_is_one_line_and_nothing_attaches(loopdev, tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        r = run_kvprof("record", "-d", loopdev, "-o", str(tmp_path / "s"), "--socket",
                       str(tmp_path / "m.sock"), "--prometheus", f"127.0.0.1:{port}")
    assert r.returncode == 64
    assert r.stderr == f"kvprof: error: --prometheus 127.0.0.1:{port}: Address already in use\n"
    assert not (tmp_path / "s").exists()
    r = run_kvprof("record", "-d", loopdev, "--prometheus", "nonsense")
    assert (r.returncode, r.stderr) == (
        64, "kvprof: error: --prometheus 'nonsense': expected PORT or ADDR:PORT\n")


def test_a_request_counted_without_a_service_time_is_in_the_ops_not_the_latency_histogram():
    # The exact tier counts a block completion the kernel did not trace (it found the request
    # started again) with its size and no service time: 3 requests, 2 with one (1 and 3 µs).
    # The histogram Prometheus reads is of those 2; the ops counter has all 3.
    hist = [0] * schema.AGG_SLOTS
    hist[10], hist[12] = 1, 1  # [512, 1024) ns and [2048, 4096) ns
    exp = Exporter({"version": "t", "kernel": "k", "host": "h", "session": "s"})
    exp.rows("io_agg", pa.table({
        "phase": ["decode"], "op": ["read"], "layer": ["block"], "dev_name": ["loop9"],
        "ios": pa.array([3], pa.uint64()), "bytes": pa.array([12288], pa.uint64()),
        "service_ns": pa.array([4000], pa.uint64()),
        "service_hist": pa.array([hist], pa.list_(pa.uint32()))}))
    registry = CollectorRegistry(auto_describe=False)
    registry.register(exp)
    text = generate_latest(registry).decode()
    got = {(s.name, s.labels.get("le")): s.value
           for fam in text_string_to_metric_families(text) for s in fam.samples
           if s.labels.get("device") == "loop9"}
    assert got[("kvprof_io_ops_total", None)] == 3
    assert got[("kvprof_io_latency_seconds_count", None)] == 2
    assert got[("kvprof_io_latency_seconds_bucket", "+Inf")] == 2
    assert got[("kvprof_io_latency_seconds_sum", None)] == pytest.approx(4e-6)
