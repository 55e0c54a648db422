"""KV-cache offload inside the real vLLM: the tests' KV connector (tests/engine/kv_connector.py)
saves the engine's KV blocks through a backend's own I/O code at the engine's save points and
loads them back at its load points. kvprof, attached with the block and syscall layers and the
plugin's windows, is judged by the connector's own counts, the engine's windows and the
device's diskstats."""
from __future__ import annotations

import json
import os
import time
from pathlib import Path

import duckdb
import pytest

from kvprof import schema
from kvprof.correlate import summarize
from kvprof.rowsource import SqlRows, ViewFilter
from tests.conftest import (
    READ_SECTORS,
    WRITE_SECTORS,
    live,
    settle,
    stat_delta,
)
from tests.engine import vllm_server

pytestmark = live
REPO = Path(__file__).resolve().parent.parent


def serve_with_connector(workdir: Path, root: Path, backend: str) -> tuple:
    why = vllm_server.unavailable()
    if why is not None:
        if os.environ.get("KVPROF_REQUIRE_VLLM") == "1":
            pytest.fail(why)
        pytest.skip(why)
    log = workdir / "connector.jsonl"
    config = {"kv_connector": "KvprofTestConnector",
              "kv_connector_module_path": "tests.engine.kv_connector", "kv_role": "kv_both",
              "kv_connector_extra_config": {"backend": backend, "root": str(root),
                                            "log": str(log)}}
    server = vllm_server.start(workdir, args=("--kv-transfer-config", json.dumps(config)),
                               extra_env={"PYTHONPATH": str(REPO),
                                          # /reset_prefix_cache: the engine's own cache
                                          # dropped, as when its memory is needed, so a
                                          # prefix comes from disk
                                          "VLLM_SERVER_DEV_MODE": "1"})
    return server, log


def connector_log(log: Path) -> list[dict]:
    return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []


def external_tokens(server) -> float:
    """vLLM's own count of prompt tokens that came from a KV connector."""
    import urllib.request

    text = urllib.request.urlopen(server.url + "/metrics", timeout=10).read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("vllm:prompt_tokens_by_source_total{")
               and 'source="external_kv_transfer"' in line)


def window_at(con, t: int) -> tuple[str, int | None]:
    """The phase of the plugin's window (an engine step) holding time t, and the prompt
    tokens the engine computed in that step; idle outside any."""
    row = con.execute("SELECT phase, prefill_tokens FROM phase WHERE source = 'hook' "
                      "AND start_ns <= ? AND end_ns > ?", [t, t]).fetchall()
    return row[0] if row else ("idle", None)


def test_fs_tier_stores_in_prefill_and_loads_in_the_step_that_waited(loopdev, ext4, tmp_path,
                                                                     start_recorder):
    root = ext4 / "kv"
    server, log = serve_with_connector(tmp_path, root, "fs")
    try:
        # torch compiles each new batch shape on first use; these prompts are stored too,
        # before the recorder starts.
        for seed in (1, 2):
            server.complete(600, 4, seed)
        warm = len(connector_log(log))
        assert warm and all(b["op"] == "store" for b in connector_log(log))
        # ext4 commits its journal (the connector's file creates and renames) every 5 s:
        # synced before the recorder attaches and before the last snapshot, so no commit
        # falls between the snapshots and the recorder's attach or stop.
        os.sync()
        rec = start_recorder("-d", loopdev, "--layer", "block", "--layer", "syscall",
                             "--phases", "vllm-plugin", socket=server.marks_socket)
        s0 = settle(loopdev)
        external_before = external_tokens(server)
        prompt = vllm_server.make_prompt(1200, 11)
        first = server.complete(0, 16, prompt=prompt)
        server.post("/reset_prefix_cache")
        # The same prefix and a new tail: the stored blocks come back from disk.
        again = server.complete(0, 16, prompt=prompt + " " + vllm_server.make_prompt(40, 12))
        time.sleep(0.5)
        external_after = external_tokens(server)
        os.sync()
        s1 = settle(loopdev)
        assert rec.stop() == 0, "".join(rec.stderr_lines)
    finally:
        server.stop()
    batches = connector_log(log)[warm:]
    stores = [b for b in batches if b["op"] == "store"]
    loads = [b for b in batches if b["op"] == "load"]
    print(f"requests {first['prompt_tokens']} and {again['prompt_tokens']} prompt tokens; "
          f"connector: {len(stores)} store batches {sum(b['bytes'] for b in stores)} B, "
          f"{len(loads)} load batches {sum(b['bytes'] for b in loads)} B, O_DIRECT "
          f"{stores[0]['direct']}")
    assert stores and loads and stores[0]["direct"]
    # The first request's full blocks were stored, and loaded back for the second.
    full = first["prompt_tokens"] // stores[0]["block_tokens"]
    assert sum(b["blocks"] for b in stores) == full == sum(b["blocks"] for b in loads)

    report = rec.report()
    con = duckdb.connect(str(rec.out / "session.duckdb"), read_only=True)
    try:
        # The engine's windows say in which phase each batch ran.
        want: dict[str, dict[str, list[int]]] = {}
        steps = {}
        for b in batches:
            phase, step_tokens = window_at(con, b["start_ns"])
            assert window_at(con, b["end_ns"] - 1) == (phase, step_tokens), \
                (b, "a batch across windows")
            steps[b["op"]] = step_tokens
            got = want.setdefault(phase, {}).setdefault(
                "write" if b["op"] == "store" else "read", [0, 0])
            got[0] += b["calls"]
            got[1] += b["bytes"]
        print(f"connector by the engine's windows: {want}; prompt tokens of the "
              f"steps holding them: {steps}")
        # The store ran in the step that prefilled the first prompt, the load in the step
        # that prefilled the second (the plugin's windows count a step's whole prompts), and
        # the engine counted the loaded tokens as its own external KV transfer.
        assert steps == {"store": first["prompt_tokens"], "load": again["prompt_tokens"]}
        loaded = sum(b["blocks"] * b["block_tokens"] for b in loads)
        assert external_after - external_before == loaded
        assert set(want.get("prefill", {})) == {"write", "read"}
        mine = summarize(SqlRows(con), view=ViewFilter())["phases"]
        for phase, ops in want.items():
            caches = mine[phase]["caches"]
            for op, (calls, nbytes) in ops.items():
                got = caches["vllm-fs-tier"][op]
                assert (got["ios"], got["bytes"]) == (calls, nbytes), (phase, op, got)
        # O_DIRECT: every byte read came from the device, none from the page cache.
        read = mine["prefill"]["caches"]["vllm-fs-tier"]["read"]
        assert read["device_bytes"] == read["bytes"] and read["page_cache_hit_pct"] is None
        rows = con.execute("SELECT tgid, flags FROM io WHERE cache = 'vllm-fs-tier'").fetchall()
        # All of it from the process the connector ran in (the engine core's worker).
        assert {t for t, _ in rows} == {b["pid"] for b in batches}
        assert all(f & schema.FLAG_DIRECT for _, f in rows)
    finally:
        con.close()
    assert "vllm-fs-tier" not in report["phases"]["prefill"].get("writeback", {}).get(
        "caches", {})
    # The device: what the kernel counted from attach on, in bytes, is kvprof's exact count.
    d = stat_delta(s0, s1)
    total = report["exact"]["totals"]["block"]
    assert total["write"]["bytes"] == d[WRITE_SECTORS] * 512
    assert total.get("read", {}).get("bytes", 0) == d[READ_SECTORS] * 512
