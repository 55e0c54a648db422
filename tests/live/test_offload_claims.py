"""The engines' own counts of their KV offload beside what their files did.

The engine here is this test, a stand-in: vLLM's tiering connector, LMCache's own connector and
SGLang's HiCache do not run on CPU (../shared/reference/vllm-cpu.md, sglang-cpu.md). It stores KV
blocks as files in the backend's layout on ext4 on the loop device (O_DIRECT), finds some already
there and skips them as vLLM's fs tier does (counting them all the same, as its metrics do),
reads them back, marks its phases, and publishes its storage tier's counters through
prometheus_client under the names the engines' code registers: vLLM's
`vllm:kv_offload_tiering_{read,write}_{bytes,time}{tier}` and `vllm:cache_config_info`,
SGLang's `sglang:{prefetched,backuped}_tokens_total` and its pools' memory and tokens. These
expositions are written from the names, not scraped from the running engines;
tests/engine/test_vllm_engine.py holds the names to the installed vLLM's and LMCache's code.
The recorder scrapes them with the real metrics sources and traces the files' calls.
"""
from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Info, start_http_server

from kvprof.markers import Marker
from kvprof.units import human_bytes
from tests.helpers import SCRAPED_S, aligned, free_port, http_get, live, mounted_ext4, run_kvprof
from tests.live.test_prometheus import wait_for

pytestmark = live

MODEL = "Qwen/Qwen3-8B"
TOKENS_A_BLOCK, BYTES_A_TOKEN = 16, 4096
BLOCK = TOKENS_A_BLOCK * BYTES_A_TOKEN
STORED, AGAIN = 8, 4  # blocks written; blocks asked to be stored again, found there
COPY_S = 0.2  # the engine's own work in a load, after the reads


class Tier:
    """What one engine publishes of its storage tier: (bytes or tokens, seconds) per op."""

    def __init__(self, engine: str) -> None:
        self.engine = engine
        self.registry = reg = CollectorRegistry()
        if engine == "vllm":
            labels = ["model_name", "engine"]
            self.read_bytes = Counter("vllm:kv_offload_tiering_read_bytes", "read",
                                      labels + ["tier"], registry=reg)
            self.read_time = Counter("vllm:kv_offload_tiering_read_time", "read s",
                                     labels + ["tier"], registry=reg)
            self.write_bytes = Counter("vllm:kv_offload_tiering_write_bytes", "written",
                                       labels + ["tier"], registry=reg)
            self.write_time = Counter("vllm:kv_offload_tiering_write_time", "written s",
                                      labels + ["tier"], registry=reg)
            # vLLM's info series: its labels say the KV cache's budget and size in tokens.
            Info("vllm:cache_config", "cache config", registry=reg).info({
                "block_size": str(TOKENS_A_BLOCK), "kv_cache_memory_bytes": str(1 << 30),
                "kv_cache_size_tokens": str((1 << 30) // BYTES_A_TOKEN)})
            # The scheduler's count of the connector's hits, at the step that loads them.
            self.hits = Counter("vllm:external_prefix_cache_hits", "hits", labels, registry=reg)
            self.running = Gauge("vllm:num_requests_running", "running", labels, registry=reg)
            self.prompt = Counter("vllm:prompt_tokens", "prompt", labels, registry=reg)
            self.gen = Counter("vllm:generation_tokens", "generated", labels, registry=reg)
            for m in (self.read_bytes, self.read_time, self.write_bytes, self.write_time):
                m.labels(MODEL, "0", "1:fs")
            for m in (self.running, self.prompt, self.gen, self.hits):
                m.labels(MODEL, "0")  # vLLM creates its series at start
        else:
            labels = ["model_name", "engine_type", "tp_rank", "pp_rank", "moe_ep_rank"]
            self.labels = (MODEL, "unified", "0", "0", "0")
            self.prefetched = Counter("sglang:prefetched_tokens", "prefetched", labels,
                                      registry=reg)
            self.backuped = Counter("sglang:backuped_tokens", "backed up", labels, registry=reg)
            # As the real exposition has them: its pools' memory in GiB (it says GB), tokens.
            tokens = 1 << 18
            Gauge("sglang:kv_cache_memory_usage_gb", "pools", labels, registry=reg).labels(
                *self.labels).set(tokens * BYTES_A_TOKEN / (1 << 30))
            Gauge("sglang:max_total_num_tokens", "tokens", labels, registry=reg).labels(
                *self.labels).set(tokens)
            self.realtime = Counter("sglang:realtime_tokens_total", "tokens", [*labels, "mode"],
                                    registry=reg)
        self.server, _ = start_http_server(0, addr="127.0.0.1", registry=reg)
        self.url = f"http://127.0.0.1:{self.server.server_port}/metrics"
        self.said = {"read_s": 0.0, "write_s": 0.0}

    def stored(self, blocks: int, seconds: float) -> None:
        if self.engine == "vllm":
            self.write_bytes.labels(MODEL, "0", "1:fs").inc(blocks * BLOCK)
            self.write_time.labels(MODEL, "0", "1:fs").inc(seconds)
        else:
            self.backuped.labels(*self.labels).inc(blocks * TOKENS_A_BLOCK)
        self.said["write_s"] += seconds

    def loaded(self, blocks: int, seconds: float) -> None:
        if self.engine == "vllm":
            self.hits.labels(MODEL, "0").inc(blocks * TOKENS_A_BLOCK)
            self.read_bytes.labels(MODEL, "0", "1:fs").inc(blocks * BLOCK)
            self.read_time.labels(MODEL, "0", "1:fs").inc(seconds)
        else:
            self.prefetched.labels(*self.labels).inc(blocks * TOKENS_A_BLOCK)
        self.said["read_s"] += seconds

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def block_path(root: Path, engine: str, i: int) -> Path:
    """A block's file in the backend's layout (kvprof/caches.py)."""
    if engine == "vllm":  # <root>/<model>_<digest>_r<rank>/<hhh>/<hh>_g<group>/<hash>.bin
        return root / "qwen_5eed_r0" / "abc" / "de_g0" / f"{i:032x}.bin"
    return root / f"{i:032x}_qwen_0_1.bin"  # <key>_<model>_<tp_rank>_<tp_size>.bin


def serve(tier: Tier, root: Path, marker: Marker) -> None:
    buf = aligned(BLOCK)
    marker.mark("prefill", prefill_tokens=STORED * TOKENS_A_BLOCK)
    t0 = time.monotonic()
    for i in list(range(STORED)) + list(range(AGAIN)):
        path = block_path(root, tier.engine, i)
        if path.exists():  # vLLM's fs tier returns early: the file is there
            continue
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_DIRECT, 0o600)
        try:
            os.pwritev(fd, [buf], 0)
        finally:
            os.close(fd)
    tier.stored(STORED + AGAIN, time.monotonic() - t0)
    marker.mark("idle")
    time.sleep(0.2)
    marker.mark("prefill", prefill_tokens=STORED * TOKENS_A_BLOCK)
    t0 = time.monotonic()
    for i in range(STORED):
        fd = os.open(block_path(root, tier.engine, i), os.O_RDONLY | os.O_DIRECT)
        try:
            assert os.preadv(fd, [buf], 0) == BLOCK
        finally:
            os.close(fd)
    time.sleep(COPY_S)  # what the engine does with them after (copies, queues), timed too
    tier.loaded(STORED, time.monotonic() - t0)
    marker.mark("idle")


def files_side(port: int) -> dict:
    from prometheus_client.parser import text_string_to_metric_families

    text = http_get(f"http://127.0.0.1:{port}/metrics").decode()
    return {(s.name, s.labels.get("op")): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples
            if s.name.startswith("kvprof_kv_cache_")}


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_the_engines_offload_counts_beside_its_files(engine, loopdev, tmp_path,
                                                     start_recorder):
    tier = Tier(engine)
    try:
        with mounted_ext4(loopdev, tmp_path / "kv") as root:
            os.sync()
            port = free_port()
            rec = start_recorder("-d", loopdev, "--layer", "block", "--layer", "syscall",
                                 "--phases", f"{engine}-metrics={tier.url}",
                                 "--prometheus", f"127.0.0.1:{port}")
            time.sleep(0.5)  # the source's first scrape: every counter's starting value
            serve(tier, root, Marker(rec.socket))
            time.sleep(SCRAPED_S)  # a scrape after the last count
            # For fleets: the files' side, beside the engine's own count of its offload.
            want = {("kvprof_kv_cache_bytes_total", "read"): STORED * BLOCK,
                    ("kvprof_kv_cache_bytes_total", "write"): STORED * BLOCK,
                    ("kvprof_kv_cache_device_read_bytes_total", None): STORED * BLOCK,
                    ("kvprof_kv_cache_calls_total", "read"): STORED,
                    ("kvprof_kv_cache_calls_total", "write"): STORED}
            wait_for(lambda: files_side(port) == want, 10, f"{want} from kvprof's /metrics")
            assert rec.stop() == 0, "".join(rec.stderr_lines)
    finally:
        tier.close()
    report = json.loads(run_kvprof("report", str(rec.out), "--json").stdout)
    off = report["offload"]
    print(f"{engine}: {off}")
    cache = "vllm-fs-tier" if engine == "vllm" else "sglang-hicache"
    assert off["caches"] == [cache]
    # Its bytes a token, from what it says of its KV cache.
    assert off["bytes_per_token"] == BYTES_A_TOKEN
    # What it says it loaded is what its files' reads returned, all from the device.
    assert off["claimed_read_bytes"] == STORED * BLOCK == off["files_read_bytes"] \
        == off["device_read_bytes"]
    # What it says it stored counts the blocks it found there: the files took fewer.
    assert off["claimed_written_bytes"] == (STORED + AGAIN) * BLOCK
    assert off["files_written_bytes"] == STORED * BLOCK
    if engine == "vllm":  # its own times, as it published them
        # Its hits, scraped, in the prefill that loaded them: the scrape's interval held that
        # prefill and idle time, so they are the prefill's, none unsure.
        assert off["hit_tokens"] == STORED * TOKENS_A_BLOCK and off["hit_tokens_unsure"] == 0
        assert {p: ph["engine"]["offload_hit_tokens"] for p, ph in report["phases"].items()} \
            == {"prefill": STORED * TOKENS_A_BLOCK, "decode": 0, "mixed": 0, "idle": 0}
        assert off["engine_load_time_s"] == pytest.approx(tier.said["read_s"], rel=1e-9)
        assert off["engine_store_time_s"] == pytest.approx(tier.said["write_s"], rel=1e-9)
    else:  # (SGLang publishes no time of its own for them)
        assert off["engine_load_time_s"] is None is off["engine_store_time_s"]
    found = {f["rule"]: f for f in report["findings"] if f["rule"].startswith("offload-")}
    if engine == "vllm":  # its loads' time went to its own work, not to the reads
        above = found.pop("offload-above-storage")
        print(above["text"])
        assert above["figures"] == {"offload.engine_load_time_s": off["engine_load_time_s"],
                                    "offload.files_read_busy_s": off["files_read_busy_s"]}
        assert off["files_read_busy_s"] < 0.5 * COPY_S < off["engine_load_time_s"]
    differ = found.pop("offload-bytes-differ")
    assert differ["figures"] == {"offload.claimed_written_bytes": (STORED + AGAIN) * BLOCK,
                                 "offload.files_written_bytes": STORED * BLOCK,
                                 "offload.hit_tokens": off["hit_tokens"]}
    assert "differ by -33 %" in differ["text"], differ["text"]
    assert not found, found
    text = " ".join(run_kvprof("report", str(rec.out)).stdout.split())  # (lines wrapped)
    assert f"its offload stored {human_bytes((STORED + AGAIN) * BLOCK)}" in text, text
