"""The vLLM stat-logger plugin, loaded the way vLLM loads it, sending to a real marker socket.

vLLM cannot be installed here, so the step statistics are stand-ins with the attribute names
of vllm/v1/metrics/stats.py (SchedulerStats.iteration_details = SchedulerIterationDetails,
IterationStats.prompt_token_stats = PromptTokenStats, ...).
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

from kvprof.phases.marks import MarkServer

REPO = Path(__file__).resolve().parents[1]
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

    @dataclass
    class PromptTokenStats:
        computed: int = 0
        local_cache_hit: int = 0
        external_kv_transfer: int = 0
        cached_tokens: int = 0
        total: int = 0

    class IterationStats:
        def __init__(self, generated=0, computed=0, firsts=0):
            self.iteration_timestamp = time.time()
            self.num_generation_tokens = generated
            self.prompt_token_stats = PromptTokenStats(computed=computed, total=computed)
            self.num_preempted_reqs = 0
            self.finished_requests = []
            self.time_to_first_tokens_iter = [0.05] * firsts
            self.inter_token_latencies_iter = []

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
    log0.record(step(0, 1, 512, 0, 0, 40.0), IterationStats(generated=1, computed=512, firsts=1))
    log0.record(step(1, 1, 128, 4, 4, 20.0), IterationStats(generated=4))
    log0.record(step(2, 0, 0, 8, 8, 10.0), IterationStats(generated=8), None, 0)
    log0.record(step(3, 0, 0, 0, 0, 0.0, dummy=True), None)      # DP padding: nothing
    log0.record(step(4, 0, 0, 0, 0, 1.5), IterationStats())     # empty step: nothing
    time.sleep(0.03)
    # No iteration details (vLLM without --enable-logging-iteration-details): the
    # IterationStats fallback, and the window reaches back to the previous record().
    log0.record(SchedulerStats(), IterationStats(generated=6))
    time.sleep(0.02)
    log0.record(None, IterationStats(generated=2, computed=300, firsts=2))
    log0.record(None, None)
    log0.record(Exploding(), Exploding())                        # must not raise
    log1.record(step(0, 2, 1000, 3, 3, 25.0), IterationStats(), engine_idx=1)
    # An engine with no earlier record and no elapsed time: start unknown, no window.
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
    table = marks.take()["phase"]
    assert marks.counts() == {"marks_malformed": 0, "marks_out_of_order": 0,
                              "marks_refused": 0, "marks_dropped": 0}
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
    # Windows with vLLM's elapsed_ms last exactly that long.
    assert durations[0] == 40_000_000 and durations[1] == 20_000_000
    assert durations[2] == 10_000_000 and durations[5] == 25_000_000
    # Fallback windows span from the previous record() of the same engine.
    assert 30_000_000 <= durations[3] < 1_000_000_000
    assert 20_000_000 <= durations[4] < 1_000_000_000


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
