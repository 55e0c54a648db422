"""`kvprof compare` on two real recordings of one workload, the second with the device
throttled by the kernel's own cgroup I/O limit; and the engine's serving figures in the
report, from a real Prometheus endpoint with vLLM's metric names.

The "engine" is this test: each request reads its prefix from the loop device (prefill) and
then a small piece per token (decode), marks its phases, and publishes what it measured
(time to first token, inter-token latency, tokens, prefix-cache queries and hits) through
prometheus_client, as vLLM does. The recorder scrapes it with `--phases vllm-metrics=URL`.
"""
from __future__ import annotations

import json
import os
import random
import time
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from kvprof.analysis.rowsource import SqlRows
from kvprof.markers import Marker
from kvprof.store.session import open_session, session_info
from kvprof.views.snapshot import build_snapshot
from tests.helpers import aligned, io_limit, live, run_kvprof

pytestmark = live

MODEL = "Qwen/Qwen3-8B"
PROMPT, TOKENS, REQUESTS = 2048, 32, 3
PREFIX_READS = 8  # 1 MiB reads of KV cache per prefill


class Engine:
    def __init__(self, dev: str):
        self.dev = dev
        reg = CollectorRegistry()
        labels = ["model_name", "engine"]
        self.prompt = Counter("vllm:prompt_tokens", "prompt", labels, registry=reg)
        self.gen = Counter("vllm:generation_tokens", "generated", labels, registry=reg)
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "ttft", labels,
                              buckets=[0.001, 0.01, 0.1, 1.0], registry=reg)
        self.itl = Histogram("vllm:inter_token_latency_seconds", "itl", labels,
                             buckets=[0.0001, 0.001, 0.01, 0.1], registry=reg)
        self.queries = Counter("vllm:prefix_cache_queries", "queries", labels, registry=reg)
        self.hits = Counter("vllm:prefix_cache_hits", "hits", labels, registry=reg)
        self.running = Gauge("vllm:num_requests_running", "running", labels, registry=reg)
        for m in (self.prompt, self.gen, self.ttft, self.itl, self.queries, self.hits,
                  self.running):
            m.labels(MODEL, "0")  # vLLM creates its series at start
        self.server, _ = start_http_server(0, addr="127.0.0.1", registry=reg)
        self.url = f"http://127.0.0.1:{self.server.server_port}/metrics"
        self.ttfts: list[float] = []
        self.itls: list[float] = []

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def serve(self, marker: Marker) -> None:
        e = (MODEL, "0")
        rnd = random.Random(5)
        big, small = aligned(1 << 20), aligned(4096)
        fd = os.open(f"/dev/{self.dev}", os.O_RDONLY | os.O_DIRECT)
        try:
            for _ in range(REQUESTS):
                marker.mark("prefill", prefill_tokens=PROMPT)
                t = time.monotonic()
                for _ in range(PREFIX_READS):
                    os.preadv(fd, [big], rnd.randrange(64) << 20)
                time.sleep(0.03)  # the prefill's compute
                self.ttfts.append(time.monotonic() - t)
                self.ttft.labels(*e).observe(self.ttfts[-1])
                self.prompt.labels(*e).inc(PROMPT)
                self.queries.labels(*e).inc(PROMPT)
                self.hits.labels(*e).inc(PROMPT // 4)
                self.gen.labels(*e).inc(1)
                marker.mark("decode", decode_tokens=TOKENS)
                for _ in range(TOKENS):
                    t = time.monotonic()
                    os.preadv(fd, [small], rnd.randrange(16384) << 12)
                    time.sleep(0.003)  # the step's compute
                    self.itls.append(time.monotonic() - t)
                    self.itl.labels(*e).observe(self.itls[-1])
                    self.gen.labels(*e).inc(1)
                marker.mark("idle")
                time.sleep(0.05)
        finally:
            os.close(fd)


def record_run(loopdev: str, start_recorder, name: str) -> tuple[Path, Engine]:
    engine = Engine(loopdev)
    try:
        rec = start_recorder("-d", loopdev, "--phases", f"vllm-metrics={engine.url}",
                             name=name)
        time.sleep(0.3)  # the source's first scrape: every counter's starting value
        engine.serve(Marker(rec.socket))
        # Stopped right away: the recorder's last scrape, at the stop, holds the last request.
        assert rec.stop() == 0
    finally:
        engine.close()
    return rec.out, engine


def test_engine_figures_are_what_the_engine_measured(loopdev, start_recorder):
    out, engine = record_run(loopdev, start_recorder, "a")
    report = json.loads(run_kvprof("report", str(out), "--json").stdout)
    eng = report["engine"]
    assert eng["ttft_s"] == pytest.approx(sum(engine.ttfts) / len(engine.ttfts), rel=1e-9)
    assert eng["itl_s"] == pytest.approx(sum(engine.itls) / len(engine.itls), rel=1e-9)
    assert eng["prefix_cache_hit_pct"] == pytest.approx(25.0)
    assert eng["prompt_tokens"] == REQUESTS * PROMPT
    assert eng["generation_tokens"] == REQUESTS * (1 + TOKENS)
    assert eng["throughput_tokens_per_s"] == pytest.approx(
        REQUESTS * (1 + TOKENS) / report["session"]["duration_s"])
    # Tokens per phase from the marks (the most exact source), not counted twice with the
    # metrics source's windows of the same tokens.
    pre, dec = report["phases"]["prefill"], report["phases"]["decode"]
    assert pre["engine"]["prefill_tokens"] == pytest.approx(REQUESTS * PROMPT)
    assert dec["engine"]["decode_tokens"] == pytest.approx(REQUESTS * TOKENS)
    assert pre["engine"]["tokens_per_s"] == pytest.approx(REQUESTS * PROMPT / pre["time_s"])
    text = run_kvprof("report", str(out)).stdout
    assert "TTFT" in text and "prefix-cache hit 25.0 %" in text
    # The prefix-cache finding: decode's reads, scaled by the misses 10 more points remove.
    f = next(f for f in report["findings"] if f["rule"] == "prefix-cache")
    read = report["phases"]["decode"]["block"]["read"]["bytes"]
    assert f["figures"] == {"engine.prefix_cache_hit_pct": eng["prefix_cache_hit_pct"],
                            "phases.decode.block.read.bytes": read}
    assert f["text"].startswith("prefix-cache hit 25 %: if decode's storage reads scale")
    # The dashboard's frame of the whole session says the same.
    con = open_session(out)
    try:
        snap = build_snapshot(SqlRows(con), None, session_info(con).end_ns)
    finally:
        con.close()
    assert snap.summary["engine"] == eng
    assert any(n.startswith("engine: TTFT ") and "prefix-cache hit 25.0 %" in n
               for n in snap.notes), snap.notes


def test_compare_shows_a_throttled_device_and_gates_fail_exactly_past_the_threshold(
        loopdev, start_recorder):
    a, _ = record_run(loopdev, start_recorder, "fast")
    # 10 MiB/s: the kernel's throttle (blk-throttle) trims a slice's unused budget only past
    # the last one and a rounded-down part, so a group idle between prefills starts one with
    # less than three 100 ms slices of credit, under 3 MiB here. A prefill's 8 MiB then waits
    # at least 0.5 s; unthrottled it is its 30 ms of compute and a few ms of reads. (At
    # 40 MiB/s the credit, up to 12 MiB, can let a whole prefill through at full speed.)
    with io_limit(loopdev, read_bps=10 << 20):
        b, _ = record_run(loopdev, start_recorder, "throttled")
    r = run_kvprof("compare", str(a), str(b), "--json")
    assert r.returncode == 0, r.stderr
    got = {f["name"]: f for f in json.loads(r.stdout)["figures"]}
    ra, rb = (json.loads(run_kvprof("report", str(s), "--json").stdout) for s in (a, b))
    # The figures are the reports' own.
    for name, side in (("prefill.read.bandwidth", "bandwidth_bytes_per_s"),
                       ("decode.read.p99", None)):
        phase, op, _ = name.split(".")
        for rep, key in ((ra, "a"), (rb, "b")):
            e = rep["phases"][phase]["block"][op]
            want = e[side] if side else e["latency_us"]["p99"]
            assert got[name][key] == want
    assert got["ttft"]["a"] == ra["engine"]["ttft_s"]
    # Throttled: prefill reads slow down and TTFT grows, seen as worse. Each prefill at
    # most 8 MiB / 0.53 s (16 MiB/s) against unthrottled ones an order of magnitude faster.
    bw = got["prefill.read.bandwidth"]
    assert bw["b"] < 0.5 * bw["a"], bw
    assert got["ttft"]["b"] > got["ttft"]["a"] + 0.05
    assert bw["better"] is False and got["ttft"]["better"] is False
    print(f"prefill read bandwidth x{bw['ratio']:.3f}, TTFT {got['ttft']['change_pct']:+.0f} %")
    # Gates around the measured change: past it fails (exit 1), short of it passes.
    for name in ("ttft", "prefill.read.bandwidth"):
        change = got[name]["change_pct"]
        short, past = change * 0.9, change * 1.1
        ok = run_kvprof("compare", str(a), str(b), "--gate", f"{name}={short:+.2f}%")
        assert ok.returncode == 0, ok.stdout
        bad = run_kvprof("compare", str(a), str(b), "--gate", f"{name}={past:+.2f}%",
                         "--gate", f"{name}={short:+.2f}%")
        assert bad.returncode == 1, bad.stdout
        assert "FAIL" in bad.stdout and "pass" in bad.stdout
    r = run_kvprof("compare", str(a), str(b), "--gate", "ttft=-25")
    assert (r.returncode, r.stderr.splitlines()[0]) == (
        64, "kvprof: error: bad gate 'ttft=-25': expected NAME=+N% or NAME=-N% "
            "(e.g. ttft=-25%, prefill.write.bandwidth=+30%)")
    r = run_kvprof("compare", str(a), str(b), "--gate", "nonsense.figure=+5%")
    assert r.returncode == 1 and "not a figure of either session" in r.stdout
