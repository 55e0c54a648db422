"""The vLLM stat-logger plugin, loaded the way vLLM loads it, sending to a real marker socket.

The step statistics here are stand-ins with the attribute names of vllm/v1/metrics/stats.py
(SchedulerStats.iteration_details = SchedulerIterationDetails, IterationStats.prompt_token_stats
= PromptTokenStats, ...): they pin the plugin's rules, including failures vLLM cannot be made
to show. Whether those rules match the real engine is tests/engine/test_vllm_engine.py's question.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from kvprof.phases.mark_server import MarkServer

REPO = Path(__file__).resolve().parents[2]
GROUP = "vllm.stat_logger_plugins"
TARGET = "kvprof.phases.vllm_plugin:KvprofStatLogger"

# Runs in a fresh interpreter: discovery through importlib.metadata must see the throwaway
# dist-info on sys.path, exactly as vLLM's load_plugins_by_group() would.
DRIVER = textwrap.dedent('''
    import json, os, sys, time
    from dataclasses import dataclass, field
    from importlib.metadata import entry_points
    from types import SimpleNamespace

    # As vllm.plugins.load_plugins_by_group + loggers.load_stat_logger_plugin_factories.
    allowed = os.environ.get("VLLM_PLUGINS")
    eps = [ep for ep in entry_points(group="vllm.stat_logger_plugins")
           if allowed is None or ep.name in allowed.split(",")]
    ours = [ep for ep in eps if ep.dist is not None and ep.dist.name == "kvprof-test-plugin"]
    assert ours, [(ep.name, ep.value) for ep in eps]
    factory = ours[0].load()
    from kvprof.phases.vllm_plugin import StatLoggerBase, USING_VLLM_BASE
    assert isinstance(factory, type) and issubclass(factory, StatLoggerBase)

    @dataclass
    class SchedulerIterationDetails:
        iteration_index: int
        num_ctx_requests: int
        num_ctx_tokens: int
        num_generation_requests: int
        num_generation_tokens: int
        elapsed_ms: float
        num_encoder_inputs: int = 0
        num_encoder_output_tokens: int = 0
        is_dummy: bool = False

    @dataclass
    class SchedulerStats:
        num_running_reqs: int = 0
        num_waiting_reqs: int = 0
        kv_cache_usage: float = 0.0
        iteration_details: SchedulerIterationDetails | None = None
        prefix_cache_stats: object = None
        connector_prefix_cache_stats: object = None

    @dataclass
    class PromptTokenStats:
        computed: int = 0
        local_cache_hit: int = 0
        external_kv_transfer: int = 0
        cached_tokens: int = 0
        total: int = 0

    class IterationStats:
        def __init__(self, generated=0, computed=0, ttft=(), itl=()):
            self.iteration_timestamp = time.time()
            self.num_generation_tokens = generated
            self.prompt_token_stats = PromptTokenStats(computed=computed, total=computed)
            self.num_preempted_reqs = 0
            self.finished_requests = []
            self.time_to_first_tokens_iter = list(ttft)
            self.inter_token_latencies_iter = list(itl)

        @property
        def num_prompt_tokens(self):
            return self.prompt_token_stats.total

    class Exploding:
        def __getattr__(self, name):
            raise RuntimeError("vLLM changed its stats")

    def step(i, ctx_req, ctx, gen_req, gen, ms, dummy=False):
        return SchedulerStats(iteration_details=SchedulerIterationDetails(
            i, ctx_req, ctx, gen_req, gen, ms, is_dummy=dummy))

    vllm_config = SimpleNamespace(parallel_config=SimpleNamespace(data_parallel_size=2),
                                  observability_config=SimpleNamespace(
                                      enable_logging_iteration_details=True))
    # vLLM's PerEngineStatLoggerAdapter calls factory(vllm_config, engine_index) positionally.
    log0 = factory(vllm_config, 0)
    log1 = factory(vllm_config, 1)
    log0.log_engine_initialized()

    t0 = time.monotonic_ns()
    # A prefill step (its length: the time to first token), a mixed one and a decode one
    # (their length: the inter-token latency of the requests already decoding).
    log0.record(step(0, 1, 512, 0, 0, 38.0),
                IterationStats(generated=1, computed=512, ttft=[0.04]))
    time.sleep(0.021)  # (records come a step apart, as in vLLM)
    log0.record(step(1, 1, 128, 4, 4, 19.0),
                IterationStats(generated=5, computed=128, ttft=[0.02], itl=[0.021, 0.02] * 2))
    time.sleep(0.011)
    log0.record(step(2, 0, 0, 8, 8, 9.0), IterationStats(generated=8, itl=[0.01] * 8), None, 0)
    log0.record(step(3, 0, 0, 0, 0, 0.0, dummy=True), None)      # DP padding: nothing
    log0.record(step(4, 0, 0, 0, 0, 1.5), IterationStats())     # empty step: nothing
    time.sleep(0.03)
    # No iteration details (vLLM's defaults): tokens and lengths from IterationStats.
    # The KV connector asked for 256 tokens, had none: zero hits is a count too.
    log0.record(SchedulerStats(prefix_cache_stats=SimpleNamespace(requests=2, queries=640,
                                                                  hits=512),
                               connector_prefix_cache_stats=SimpleNamespace(
                                   requests=1, queries=256, hits=0)),
                IterationStats(generated=6, itl=[0.012] * 6))
    time.sleep(0.02)
    # Two prefills finished; one waited 0.5 s: the window starts where the last one ended.
    log0.record(None, IterationStats(generated=2, computed=300, ttft=[0.5, 0.3]))
    log0.record(None, None)
    log0.record(Exploding(), Exploding())                        # must not raise
    # Only vLLM's elapsed_ms says how long this one was.
    log1.record(step(0, 2, 1000, 3, 3, 25.0), IterationStats(), engine_idx=1)
    # Nothing says how long the step took: no window.
    log1.record(None, IterationStats(generated=5), engine_idx=7)
    log0.log()
    t1 = time.monotonic_ns()
    print(json.dumps({"t0": t0, "t1": t1, "sent0": log0.sent, "sent1": log1.sent,
                      "errors": log0.errors, "vllm_base": USING_VLLM_BASE}))
''')


def make_dist(root: Path) -> None:
    """A throwaway installed distribution declaring only the plugin entry point."""
    info = root / "kvprof_test_plugin-0.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: kvprof-test-plugin\n"
                                   "Version: 0.0\n")
    (info / "entry_points.txt").write_text(f"[{GROUP}]\nkvprof = {TARGET}\n")


@pytest.fixture
def marks(tmp_path):
    server = MarkServer(str(tmp_path / "marks.sock"))
    server.start()
    yield server
    if not server._stop.is_set():
        server.stop(time.monotonic_ns())


def test_plugin_discovered_by_entry_point_sends_step_windows(tmp_path, marks):
    site = tmp_path / "site"
    make_dist(site)
    env = dict(os.environ, KVPROF_SOCKET=str(marks.path),
               PYTHONPATH=os.pathsep.join([str(site), str(REPO)]))
    env.pop("VLLM_PLUGINS", None)
    r = subprocess.run([sys.executable, "-c", DRIVER], env=env, capture_output=True,
                       text=True, timeout=30)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["vllm_base"] is False  # the stand-in base: no vLLM here
    assert out["sent0"] == 5 and out["sent1"] == 1
    assert out["errors"] == 1  # the exploding stats, swallowed

    wait_until = time.monotonic() + 5
    while marks.received < 6 and time.monotonic() < wait_until:
        time.sleep(0.01)
    marks.stop(time.monotonic_ns())
    taken = marks.take()
    table = taken["phase"]
    assert marks.counts() == {"marks_malformed": 0, "marks_out_of_order": 0,
                              "marks_refused": 0, "marks_dropped": 0,
                              "marks_undelivered": 0,
                              # the empty step (vLLM counts it); the exploding stats
                              # came after log0's last message, so no message told
                              "marks_unsent": 1}
    rows = sorted(table.to_pylist(), key=lambda r: (r["engine"], r["end_ns"]))
    got = [(r["engine"], r["phase"], r["prefill_tokens"], r["decode_tokens"]) for r in rows]
    assert got == [
        ("vllm:0", "prefill", 512, 0),
        ("vllm:0", "mixed", 128, 4),
        ("vllm:0", "decode", 0, 8),
        ("vllm:0", "decode", 0, 6),       # fallback: generated tokens
        ("vllm:0", "prefill", 300, 0),    # fallback: first tokens belong to prefill
        ("vllm:1", "mixed", 1000, 3),
    ]
    for r in rows:
        assert r["source"] == "hook"
        assert out["t0"] - 100_000_000 <= r["start_ns"] < r["end_ns"] <= out["t1"]
    durations = [r["end_ns"] - r["start_ns"] for r in rows]
    # Each window as long as vLLM measured that step.
    assert durations[:4] == [40_000_000, 20_000_000, 10_000_000, 12_000_000]
    assert durations[5] == 25_000_000
    # Never before the previous window's end: no overlap, the wait is not prefill time.
    assert rows[4]["start_ns"] == rows[3]["end_ns"]
    assert 20_000_000 <= durations[4] < 500_000_000
    for a, b in zip(rows[:4], rows[1:5]):
        assert a["end_ns"] <= b["start_ns"]

    # What vLLM's Prometheus logger counts from the same stats, carried by the windows: a
    # zero where each series starts, the running total at the end of every window it moved in.
    counted = sorted(taken["engine_metric"].to_pylist(), key=lambda r: (r["name"], r["ts_ns"]))
    assert {r["engine"] for r in counted} == {"vllm:0"}  # engine 1's stats counted nothing
    ends = {r["end_ns"] for r in rows}
    last = {}
    for r in counted:
        assert r["ts_ns"] in ends or r["value"] == 0.0
        last[r["name"].removeprefix("vllm-plugin:")] = r["value"]
    assert last == pytest.approx({
        "prompt_tokens_total": 512 + 128 + 300, "generation_tokens_total": 1 + 5 + 8 + 6 + 2,
        "time_to_first_token_seconds_sum": 0.04 + 0.02 + 0.5 + 0.3,
        "time_to_first_token_seconds_count": 4,
        "inter_token_latency_seconds_sum": 0.041 * 2 + 0.01 * 8 + 0.012 * 6,
        "inter_token_latency_seconds_count": 4 + 8 + 6,
        "prefix_cache_queries_total": 640, "prefix_cache_hits_total": 512,
        "external_prefix_cache_queries_total": 256, "external_prefix_cache_hits_total": 0})
    assert all(min(r["value"] for r in counted if r["name"] == n) == 0.0
               for n in {r["name"] for r in counted})


def test_plugin_imports_without_vllm_and_never_raises(tmp_path):
    from kvprof.phases import vllm_plugin

    assert vllm_plugin.USING_VLLM_BASE is False
    # No listener at all: sending is dropped silently.
    logger = vllm_plugin.KvprofStatLogger(None, 0)
    logger.marker.path = str(tmp_path / "nobody.sock")
    logger.record(None, None)
    logger.record(object(), object(), object(), "not-an-int")
    logger.log()
    logger.log_engine_initialized()
    logger.record_sleep_state(1, 1)
    assert logger.sent == 0


def _wait_received(server, n: int) -> None:
    """Until the receiver holds n windows (5 s at most), then stop it."""
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        with server._lock:
            if len(server.builder.rows) >= n:
                break
        time.sleep(0.05)
    server.stop(time.monotonic_ns())


def test_a_backed_up_receiver_gets_windows_late_and_counts_those_it_never_got(tmp_path):
    """The receiver reads nothing for a while (its queue holds net.unix.max_dgram_qlen
    datagrams): the sender neither blocks its caller nor drops silently. Windows wait in its
    backlog, are sent many to a datagram once there is room (a send that times out is tried
    again), and those that overflow the backlog are counted on both sides, the same
    number."""
    from kvprof.markers import Marker

    server = MarkServer(str(tmp_path / "m.sock"))  # bound, not reading yet
    m = Marker(str(server.path), engine="e", source="hook", send_timeout_s=0.2)
    m.backlog_max = 100
    t = time.monotonic()
    for i in range(300):
        m.window("decode", 1000 + 10 * i, 1005 + 10 * i)
    assert time.monotonic() - t < 0.5  # the caller never waited for the receiver
    time.sleep(0.6)  # the backlog's sends time out meanwhile
    server.start()
    assert m.flush(5)
    # One after the gap, once the backlog has room again (while it is full this one would be
    # lost too, after every message the receiver gets: a hole no receiver can see).
    m.window("decode", 10_000, 10_005)
    assert m.flush(5)
    _wait_received(server, 301 - m.lost)
    got = server.take()["phase"].num_rows
    undelivered = server.counts()["marks_undelivered"]
    assert m.lost > 0
    assert undelivered == m.lost
    assert got + undelivered == 301


def test_a_stalled_receiver_costs_the_engine_no_cpu(tmp_path):
    """While the receiver reads nothing (a recorder stopped, or starved), the sender's backlog
    thread sleeps between tries: its process spends next to no CPU time (a send that polled
    instead spends all of it, one CPU for the whole stall: 0.67 s a second measured so)."""
    from kvprof.markers import Marker

    server = MarkServer(str(tmp_path / "m.sock"))  # bound, not reading
    m = Marker(str(server.path), engine="e", source="hook", send_timeout_s=0.3)
    for i in range(300):
        m.window("decode", 1000 + 10 * i, 1005 + 10 * i)
    cpu, wall = time.process_time(), time.monotonic()
    time.sleep(1.0)  # three timed-out sends
    cpu, wall = time.process_time() - cpu, time.monotonic() - wall
    print(f"stalled receiver: the sender's process used {cpu:.3f} s CPU in {wall:.3f} s")
    assert cpu < 0.1 * wall
    server.start()
    assert m.flush(5)
    _wait_received(server, 300)
    assert (server.take()["phase"].num_rows, m.lost) == (300, 0)


def test_a_sender_outlives_its_receiver_and_reaches_the_next(tmp_path):
    """A recorder stops and another starts on the same path while the engine keeps sending:
    the new one gets what is sent after it is bound."""
    from kvprof.markers import Marker

    path = str(tmp_path / "m.sock")
    first = MarkServer(path)
    m = Marker(path, engine="e", source="hook", send_timeout_s=0.2)
    for i in range(100):  # the queue fills: the rest goes through the backlog thread
        m.window("decode", 1000 + 10 * i, 1005 + 10 * i)
    first.start()
    assert m.flush(5)
    first.stop(time.monotonic_ns())
    second = MarkServer(path)  # bound, not reading yet: sends back up again
    for i in range(100, 200):
        m.window("decode", 1000 + 10 * i, 1005 + 10 * i)
    second.start()
    assert m.flush(5)
    _wait_received(second, 100)
    assert second.take()["phase"].num_rows == 100


def test_a_receiver_starved_past_the_send_timeout_loses_nothing(tmp_path):
    """A recorder starved of CPU for longer than a send waits: the backlog waits with it
    (it is bounded, and not the engine's thread), and every window arrives."""
    from kvprof.markers import Marker

    server = MarkServer(str(tmp_path / "m.sock"))
    m = Marker(str(server.path), engine="e", source="hook", send_timeout_s=0.1)
    for i in range(200):
        m.window("decode", 1000 + 10 * i, 1005 + 10 * i)
    time.sleep(0.5)  # several sends time out meanwhile
    server.start()
    assert m.flush(5)
    _wait_received(server, 200)
    assert (server.take()["phase"].num_rows, m.lost, server.counts()["marks_undelivered"]) \
        == (200, 0, 0)


def test_the_clock_pair_skips_a_read_the_process_was_preempted_in(monkeypatch):
    """The batch's wall-clock arrival goes onto the monotonic clock through a pair of reads
    taken together: a try preempted between its reads (here 5 ms) is not the one used."""
    from kvprof.phases import vllm_plugin

    mono = iter([1_000_000, 6_000_000, 7_000_000, 7_004_000])  # ns: try 1 spans 5 ms
    wall = iter([50_000_000_000, 50_006_000_000])
    monkeypatch.setattr(vllm_plugin.time, "monotonic_ns", lambda: next(mono))
    monkeypatch.setattr(vllm_plugin.time, "time_ns", lambda: next(wall))
    assert vllm_plugin.clock_pair() == (7_002_000, 50_006_000_000)
