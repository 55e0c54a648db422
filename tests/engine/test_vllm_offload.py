"""KV-cache offload inside the real vLLM: the tests' KV connector (tests/engine/kv_connector.py)
saves the engine's KV blocks through a backend's own I/O code at the engine's save points and
loads them back at its load points. kvprof, attached with the block and syscall layers and the
plugin's windows, is judged by the connector's own counts, the engine's windows and the
device's diskstats."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import duckdb
import pytest

from kvprof import schema
from kvprof.analysis.correlate import summarize
from kvprof.analysis.rowsource import SqlRows, ViewFilter
from tests.engine import vllm_server
from tests.helpers import (
    READ_SECTORS,
    SCRAPED_S,
    WRITE_SECTORS,
    live,
    require,
    run_kvprof,
    settle,
    stat_delta,
)

pytestmark = live
REPO = Path(__file__).resolve().parents[2]


def serve_with_connector(workdir: Path, root: Path, backend: str, max_model_len: int = 2048,
                         args: tuple[str, ...] = (), **options) -> tuple:
    require(vllm_server.unavailable())
    server = vllm_server.start_with_connector(workdir, root, backend, max_model_len, args,
                                              **options)
    return server, workdir / "connector.jsonl"


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


def by_windows(con, batches: list[dict]) -> tuple[dict, dict]:
    """The connector's batches by the engine's windows: phase -> op -> [calls, bytes], and
    per op the prompt tokens of the steps that held them."""
    want: dict[str, dict[str, list[int]]] = {}
    steps: dict[str, set] = {}
    for b in batches:
        phase, step_tokens = window_at(con, b["start_ns"])
        assert window_at(con, b["end_ns"] - 1) == (phase, step_tokens), \
            (b, "a batch across windows")
        steps.setdefault(b["op"], set()).add(step_tokens)
        got = want.setdefault(phase, {}).setdefault(
            "write" if b["op"] == "store" else "read", [0, 0])
        got[0] += b["calls"]
        got[1] += b["bytes"]
    return want, steps


def assert_caches(con, want: dict, cache: str) -> dict:
    """kvprof's per-phase calls and bytes of `cache` are the connector's; returns kvprof's
    phases (the event tier's summary)."""
    mine = summarize(SqlRows(con), view=ViewFilter())["phases"]
    for phase in schema.PHASES:
        for op in ("read", "write"):
            calls, nbytes = want.get(phase, {}).get(op, [0, 0])
            got = mine[phase]["caches"].get(cache, {}).get(op, {"ios": 0, "bytes": 0})
            assert (got["ios"], got["bytes"]) == (calls, nbytes), (phase, op, got)
    return mine


def assert_device_is_diskstats(report: dict, s0: list[int], s1: list[int]) -> int:
    """What the kernel counted between the snapshots, in bytes written and read, is
    kvprof's exact count from attach on; returns the bytes read."""
    d = stat_delta(s0, s1)
    total = report["exact"]["totals"]["block"]
    got = (total.get("write", {}).get("bytes", 0), total.get("read", {}).get("bytes", 0))
    assert got == (d[WRITE_SECTORS] * 512, d[READ_SECTORS] * 512)
    return got[1]


def test_fs_tier_stores_in_prefill_and_loads_in_the_step_that_waited(loopdev, ext4, tmp_path,
                                                                     start_recorder, loopdev2):
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
        m0 = server.metrics()
        prompt = vllm_server.make_prompt(1200, 11)
        first = server.complete(0, 16, prompt=prompt)
        server.post("/reset_prefix_cache")
        # The same prefix and a new tail: the stored blocks come back from disk.
        again = server.complete(0, 16, prompt=prompt + " " + vllm_server.make_prompt(40, 12))
        time.sleep(0.5)
        external_after = external_tokens(server)
        m1 = server.metrics()
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
        want, steps = by_windows(con, batches)
        print(f"connector by the engine's windows: {want}; prompt tokens of the "
              f"steps holding them: {steps}")
        # The store ran in the step that prefilled the first prompt, the load in the step
        # that prefilled the second (the plugin's windows count a step's whole prompts), and
        # the engine counted the loaded tokens as its own external KV transfer.
        assert steps == {"store": {first["prompt_tokens"]}, "load": {again["prompt_tokens"]}}
        loaded = sum(b["blocks"] * b["block_tokens"] for b in loads)
        assert external_after - external_before == loaded
        assert set(want) == {"prefill"} and set(want["prefill"]) == {"write", "read"}
        mine = assert_caches(con, want, "vllm-fs-tier")
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
    # The engine's offload claims beside its files: the plugin's count of the connector's
    # hits is the engine's own; those hits at the engine's KV bytes a token are the bytes the
    # connector read back, and the files' read calls, all from the device.
    off = report["offload"]
    print(f"offload section: {off}")
    read_back = sum(b["bytes"] for b in loads)
    hits = m1["vllm:external_prefix_cache_hits_total"] - m0["vllm:external_prefix_cache_hits_total"]
    assert off["hit_tokens"] == hits == loaded
    assert off["claimed_read_bytes"] == read_back == off["files_read_bytes"]
    assert off["device_read_bytes"] == read_back and off["page_cache_hit_pct"] == 0.0
    assert off["caches"] == ["vllm-fs-tier"]
    # Per phase, by the step that carried them: all in the prefill that loaded them.
    assert {p: report["phases"][p]["engine"]["offload_hit_tokens"] for p in schema.PHASES} == \
        {"prefill": loaded, "decode": 0.0, "mixed": 0.0, "idle": 0.0}
    assert not {f["rule"] for f in report["findings"]} & {
        "offload-never-read", "offload-from-page-cache", "offload-bytes-differ"}
    # The device: what the kernel counted from attach on, in bytes, is kvprof's exact count.
    assert_device_is_diskstats(report, s0, s1)
    replay_on_another_filesystem(rec.out, loopdev2, tmp_path, want, "vllm-fs-tier")


def stored_then_asked_again(tmp_path: Path, root: Path, backend: str, dev: str,
                            start_recorder, name: str, loads: bool = True,
                            between=None, **options) -> dict:
    """The real vLLM with the tests' connector over `backend`: recorded (block and syscall
    layers, the plugin's windows), a prompt stored, the engine's own prefix cache dropped, and
    the same prefix with a new tail asked again (loaded back where the connector loads);
    `between(files)` runs in between with the cache files the first request wrote. Returns
    the report, the connector's batches, vLLM's counters, the device's diskstats across the
    recording, and the bytes of the cache files that appeared meanwhile."""
    work = tmp_path / name
    work.mkdir()
    server, log = serve_with_connector(work, root, backend, loads=loads, **options)
    try:
        # Both halves compiled first (torch compiles a batch shape on first use), other words.
        warm = vllm_server.make_prompt(1200, 5)
        server.complete(0, 4, prompt=warm)
        server.post("/reset_prefix_cache")
        server.complete(0, 4, prompt=warm + " " + vllm_server.make_prompt(40, 6))
        done = len(connector_log(log))
        before = set(files_under(root))
        os.sync()  # ext4's journal commits before the recorder attaches (see above)
        rec = start_recorder("-d", dev, "--layer", "block", "--layer", "syscall",
                             "--phases", "vllm-plugin", name=name, socket=server.marks_socket)
        s0 = settle(dev)
        m0 = server.metrics()
        prompt = vllm_server.make_prompt(1200, 11)
        server.complete(0, 16, prompt=prompt)
        server.post("/reset_prefix_cache")
        if between is not None:
            between(sorted(set(files_under(root)) - before))
        server.complete(0, 16, prompt=prompt + " " + vllm_server.make_prompt(40, 12))
        time.sleep(0.5)
        m1 = server.metrics()
        s1 = settle(dev)
        assert rec.stop() == 0, "".join(rec.stderr_lines)
    finally:
        server.stop()
    batches = connector_log(log)[done:]
    moved = {k: m1.get(k, 0.0) - m0.get(k, 0.0) for k in (
        "vllm:external_prefix_cache_hits_total", "vllm:external_prefix_cache_queries_total")}
    new = sum(size for f, size in files_under(root).items() if f not in before)
    return {"report": rec.report(), "batches": batches, "disk": stat_delta(s0, s1),
            "moved": moved, "out": rec.out, "new_file_bytes": new}


def files_under(root: Path) -> dict[Path, int]:
    return {f: f.stat().st_size for f in root.rglob("*") if f.is_file()}


def offload_rules(report: dict) -> dict[str, dict]:
    return {f["rule"]: f for f in report["findings"] if f["rule"].startswith("offload-")}


def test_lmcache_o_direct_reads_the_device_and_buffered_reads_the_page_cache(
        loopdev, ext4, tmp_path, start_recorder):
    """LMCache#1522's question, whether the offload's loads reach the device: LMCache's disk
    backend with `use_odirect`, then without it and its files still cached from the store.
    The page-cache finding fires only in the second, with the share the device's own counters
    give."""
    seen = {}
    for odirect in (True, False):
        # Buffered, a third of the files no longer cached when they are read back (a cache
        # larger than the memory left for it): the share is neither all nor nothing.
        run = stored_then_asked_again(tmp_path, ext4 / f"lmcache-{odirect}", "lmcache", loopdev,
                                      start_recorder, f"odirect-{odirect}", odirect=odirect,
                                      between=lambda files: drop_cached_pages(files[::3]))
        loads = [b for b in run["batches"] if b["op"] == "load"]
        assert loads and all(b["direct"] == odirect for b in run["batches"]), run["batches"]
        read_back = sum(b["bytes"] for b in loads)
        device = run["disk"][READ_SECTORS] * 512  # what the device read, by diskstats
        off, rules = run["report"]["offload"], offload_rules(run["report"])
        # The engine counted the connector's loads as its hits, at its bytes a token.
        assert off["hit_tokens"] == run["moved"]["vllm:external_prefix_cache_hits_total"] \
            == sum(b["blocks"] * b["block_tokens"] for b in loads)
        assert off["claimed_read_bytes"] == read_back == off["files_read_bytes"]
        # The share the page cache served is what the device did not read.
        assert off["device_read_bytes"] == device
        assert off["page_cache_hit_pct"] == pytest.approx(100 * (read_back - device) / read_back,
                                                          rel=1e-12)
        seen[odirect] = (off["page_cache_hit_pct"], rules)
        print(f"LMCache use_odirect={odirect}: read back {read_back} B, device read {device} B,"
              f" page cache {off['page_cache_hit_pct']:.1f} %; findings "
              f"{[f['text'] for f in rules.values()]}")
    (direct_pct, direct_rules), (cached_pct, cached_rules) = seen[True], seen[False]
    assert direct_pct == 0.0 and "offload-from-page-cache" not in direct_rules
    found = cached_rules["offload-from-page-cache"]
    assert 50 <= cached_pct < 100 and found["figures"]["offload.page_cache_hit_pct"] == cached_pct
    assert f"{cached_pct:.0f} %" in found["text"]
    assert not {"offload-never-read", "offload-bytes-differ"} & (set(direct_rules)
                                                                 | set(cached_rules))


def test_a_connector_that_stores_and_never_loads_is_named(loopdev, ext4, tmp_path,
                                                           start_recorder):
    """The same requests as the fs-tier test (where the connector loads and no offload
    finding fires), through a connector whose lookups always miss: it writes every prompt's
    blocks, reads none back, and the engine counts no hits."""
    run = stored_then_asked_again(tmp_path, ext4 / "kv", "fs", loopdev, start_recorder,
                                  "never-loads", loads=False)
    stores = [b for b in run["batches"] if b["op"] == "store"]
    assert stores and not [b for b in run["batches"] if b["op"] == "load"]
    off, rules = run["report"]["offload"], offload_rules(run["report"])
    moved = run["moved"]
    assert moved["vllm:external_prefix_cache_hits_total"] == 0 == off["hit_tokens"]
    assert off["query_tokens"] == moved["vllm:external_prefix_cache_queries_total"] > 0
    # Written once, as the files say: the second request's blocks were already there, and
    # vLLM's fs tier returns early then; counted as stored all the same, as the connector
    # counts (and vLLM's own kv_offload_tiering_write_bytes: keys x block size).
    claimed = sum(b["bytes"] for b in stores)
    print(f"never loads: the connector counted {claimed} B stored, the files took "
          f"{run['new_file_bytes']} B, kvprof saw {off['files_written_bytes']} B written")
    assert off["files_written_bytes"] == run["new_file_bytes"] == claimed // 2
    assert off["files_read_bytes"] == 0
    found = rules.pop("offload-never-read")
    print(f"never loads: {found['text']}")
    assert found["figures"] == {"offload.files_read_bytes": 0,
                                "offload.files_written_bytes": off["files_written_bytes"],
                                "offload.hit_tokens": 0.0,
                                "offload.query_tokens": off["query_tokens"]}
    assert not rules


def replay_on_another_filesystem(session: Path, dev: str, tmp_path: Path, want: dict,
                                 cache: str) -> tuple[dict, dict]:
    """The real engine's session replayed (`kvprof replay --on DIR`: its KV cache's file
    calls) on a fresh ext4 on another device: per phase, the replay's calls and bytes of the
    cache are the connector's (by the engine's windows), however late the replay issued
    them (each stays in the phase it was recorded in). Returns the replay's result and its
    session's phases."""
    from tests.helpers import mounted_ext4

    new = tmp_path / "replayed"
    with mounted_ext4(dev, tmp_path / "candidate") as cand:
        r = run_kvprof("replay", str(session), "--on", str(cand), "-o", str(new), "--json")
    assert r.returncode == 0, r.stderr
    result = json.loads(r.stdout)
    assert result["layer"] == "syscall" and cache in r.stderr, r.stderr
    late = max(lg["max_s"] for lg in result["lag"].values())
    con = duckdb.connect(str(new / "session.duckdb"), read_only=True)
    try:
        mine = summarize(SqlRows(con), view=ViewFilter())["phases"]
    finally:
        con.close()
    print(f"replayed {result['requests']} calls on another ext4 ({result['threads']} recorded "
          f"threads' orders kept), late by at most {late * 1e3:.2f} ms: "
          + ", ".join(f"{ph} {op} {mine[ph]['syscall'][op]['ios']} calls "
                      f"{mine[ph]['syscall'][op]['bytes']} B"
                      for ph in schema.PHASES for op in ("read", "write")
                      if mine[ph]["syscall"][op]["ios"]))
    for op in ("read", "write"):
        for phase in schema.PHASES:
            calls, nbytes = want.get(phase, {}).get(op, [0, 0])
            got = mine[phase]["syscall"][op]
            assert (got["ios"], got["bytes"]) == (calls, nbytes), (phase, op, got)
    assert all(lg["p99_s"] < 0.05 for lg in result["lag"].values()), result["lag"]
    return result, mine


# LMCache's cold reads, one reader against several, as the seeds measured them (LMCache's
# parallel-read change: cold-read bandwidth 0.98 -> 5.23 GB/s, TTFT 37.97 s -> 9.30 s): the
# device under the engine waits READ_MS for each read, as storage does, so one reader leaves
# it waiting and several overlap (tests/slow_device.py; fio there: four jobs of 384 KiB
# reads 4.0x one). A block is BLOCK_TOKENS tokens, 192 KiB of this model's KV cache, one
# LMCache chunk file read in one request; each prompt's prefix is 32 of them: one reader
# waits 32 times, four wait 8 times. The new tail is a few tokens. Each prefill step on this
# CPU also costs ~30 ms that no read shortens (the API server's hand-off, the step's
# compute, the output's way back: measured 7-21 ms before the load and 10-25 ms after it),
# so the reads must take most of the step, as a long context's cold load does: at 5 ms a
# read (16 blocks of 384 KiB) they took 103 ms (1 reader) and 37 ms (4) of 132 and 71 ms
# steps, only 1.9x apart.
READ_MS, BLOCK_TOKENS = 40, 64
PROMPTS, PROMPT_WORDS, TAIL_WORDS, GENERATED = 3, 2048, 8, 16


def drop_cached_pages(files) -> None:
    """The files out of the page cache (written back first): their next reads are cold."""
    os.sync()
    for f in files:
        fd = os.open(f, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def lmcache_run(readers: int, dev: str, ext4: Path, tmp_path: Path, start_recorder) -> dict:
    """The real vLLM with LMCache's disk backend on the slow device: three prompts stored
    (recorded as `stores`), then, cold, the same prefixes with new tails loaded back
    (recorded as `loads`)."""
    work = tmp_path / f"readers-{readers}"
    work.mkdir()
    root = ext4 / f"lmcache-{readers}"
    prompts = [vllm_server.make_prompt(PROMPT_WORDS, 30 + k) for k in range(PROMPTS)]
    tail = " " + vllm_server.make_prompt(TAIL_WORDS, 12)
    out: dict = {"readers": readers}
    server, log = serve_with_connector(work, root, "lmcache", 4096,
                                       ("--block-size", str(BLOCK_TOKENS)), readers=readers)
    try:
        # The shapes of both halves compiled first (torch compiles a batch shape on first
        # use), with other words.
        warm = vllm_server.make_prompt(PROMPT_WORDS, 29)
        server.complete(0, GENERATED, prompt=warm)
        server.post("/reset_prefix_cache")
        server.complete(0, GENERATED, prompt=warm + tail)
        done = len(connector_log(log))
        phases = ("--phases", "vllm-plugin", "--phases", f"vllm-metrics={server.url}/metrics")
        for name, requests in (("stores", prompts), ("loads", [p + tail for p in prompts])):
            os.sync()  # ext4's journal commits before the recorder attaches (see above)
            rec = start_recorder("-d", dev, "--layer", "block", "--layer", "syscall",
                                 *phases, name=f"{readers}-{name}",
                                 socket=server.marks_socket)
            s0 = settle(dev)
            ext0, m0 = external_tokens(server), server.metrics()
            usage = [server.complete(0, GENERATED, prompt=p) for p in requests]
            time.sleep(SCRAPED_S)  # the last steps' windows and a scrape after them
            ext1, m1 = external_tokens(server), server.metrics()
            os.sync()  # the stores written back while recording: given back to prefill
            s1 = settle(dev)
            assert rec.stop() == 0, "".join(rec.stderr_lines)
            batches = connector_log(log)[done:]
            done += len(batches)
            ttft = "vllm:time_to_first_token_seconds_sum"
            out[name] = {"rec": rec, "usage": usage, "batches": batches,
                         "disk": (s0, s1), "external": ext1 - ext0,
                         "ttft_s": m1[ttft] - m0[ttft]}
            if name == "stores":
                drop_cached_pages(root.iterdir())
                server.post("/reset_prefix_cache")  # the prefixes only on disk now
    finally:
        server.stop()
    return out


def check_lmcache_session(run: dict, name: str) -> dict:
    """One recording against the connector's own counts, the engine's windows and counters,
    and the device's diskstats; returns its report."""
    part = run[name]
    rec, batches, usage = part["rec"], part["batches"], part["usage"]
    op = "store" if name == "stores" else "load"
    assert batches and {b["op"] for b in batches} == {op}, batches
    nbytes = sum(b["bytes"] for b in batches)
    if op == "store":  # every full block of each prompt
        assert sum(b["blocks"] for b in batches) == sum(
            u["prompt_tokens"] // batches[0]["block_tokens"] for u in usage)
    report = rec.report()
    con = duckdb.connect(str(rec.out / "session.duckdb"), read_only=True)
    try:
        want, steps = by_windows(con, batches)
        # Each batch ran in the prefill step of its own request.
        assert set(want) == {"prefill"}, want
        assert steps == {op: {u["prompt_tokens"] for u in usage}}, steps
        mine = assert_caches(con, want, "lmcache-disk")
        part["want"] = want
        rows = con.execute("SELECT DISTINCT tgid FROM io WHERE cache = 'lmcache-disk'"
                           ).fetchall()
        assert {t for (t,) in rows} == {b["pid"] for b in batches}
    finally:
        con.close()
    got_r = assert_device_is_diskstats(report, *part["disk"])
    c = mine["prefill"]["caches"]["lmcache-disk"]
    if op == "store":
        # Buffered: the flush threads wrote every stored byte back while the engine idled,
        # given back to the prefill steps that wrote them; nothing unexplained.
        wb = report["phases"]["prefill"]["writeback"]
        assert wb["caches"]["lmcache-disk"]["bytes"] == nbytes, wb
        assert report["session"]["writeback_unattributed"]["bytes"] == 0
        assert part["external"] == 0
    else:
        # Cold: every byte read came from the device (the page cache served none), and the
        # device read nothing else; the engine counted the loaded tokens as its own.
        assert c["read"]["device_bytes"] == nbytes == got_r
        assert c["read"]["page_cache_hit_pct"] == 0.0
        assert part["external"] == sum(b["blocks"] * b["block_tokens"] for b in batches)
        # How long the requests' first tokens waited on those reads: the files' reads in
        # flight, within the connector's own load time (its batches also open the files and
        # copy: under a millisecond a block beside 40 ms reads, hence 90 %), over vLLM's own
        # summed time to first token.
        off = report["offload"]
        load_s = sum(b["end_ns"] - b["start_ns"] for b in batches) / 1e9
        assert 0.9 * load_s <= off["files_read_busy_s"] <= load_s, (off, load_s)
        assert off["ttft_total_s"] == pytest.approx(part["ttft_s"], rel=1e-6)
        assert off["load_wait_pct"] == pytest.approx(
            100 * off["files_read_busy_s"] / part["ttft_s"], rel=1e-6)
        wait = next(f for f in report["findings"] if f["rule"] == "offload-loads-wait")
        print(f"{run['readers']} reader(s): the connector loaded for {load_s:.3f} s, its files' "
              f"reads were in flight {off['files_read_busy_s']:.3f} s, TTFT summed "
              f"{part['ttft_s']:.3f} s; {wait['text']}")
        assert wait["figures"]["offload.load_wait_pct"] == off["load_wait_pct"] >= 25
    return report


def test_lmcache_disk_cold_reads_one_reader_against_several(slow_device, tmp_path,
                                                            start_recorder, loopdev2):
    from tests.helpers import mounted_ext4

    require(vllm_server.unavailable())
    dev = slow_device(read_ms=READ_MS, write_ms=2, size=1 << 30).name
    with mounted_ext4(dev, tmp_path / "kv") as ext4:
        runs = [lmcache_run(r, dev, ext4, tmp_path, start_recorder) for r in (1, 4)]
    loads = []
    for run in runs:
        check_lmcache_session(run, "stores")
        loads.append(check_lmcache_session(run, "loads"))
        # What was stored came back, block for block.
        stored, loaded = (sum(b["blocks"] for b in run[n]["batches"])
                          for n in ("stores", "loads"))
        assert loaded == stored
    # The cold loads replayed on another filesystem: the chunks they read were stored in the
    # session before, so the replay lays them down first, out of the page cache, and its
    # reads go to the candidate's device, as the engine's went to its own.
    result, mine = replay_on_another_filesystem(runs[0]["loads"]["rec"].out, loopdev2,
                                                tmp_path, runs[0]["loads"]["want"],
                                                "lmcache-disk")
    assert result["laid_down"]["files"] > 0, result
    read = mine["prefill"]["caches"]["lmcache-disk"]["read"]
    assert read["device_bytes"] >= read["bytes"] > 0 and read["page_cache_hit_pct"] == 0.0
    a, b = (str(run["loads"]["rec"].out) for run in runs)
    r = run_kvprof("compare", a, b, "--json")
    assert r.returncode == 0, r.stderr
    got = {f["name"]: f for f in json.loads(r.stdout)["figures"]}
    # The compare's figures are the reports' own.
    for rep, side in zip(loads, ("a", "b")):
        assert got["prefill.read.bandwidth"][side] == \
            rep["phases"]["prefill"]["block"]["read"]["bandwidth_bytes_per_s"]
        assert got["ttft"][side] == rep["engine"]["ttft_s"]
    bw, ttft = got["prefill.read.bandwidth"], got["ttft"]
    print(f"LMCache cold reads, {READ_MS} ms a request, 1 reader -> 4: prefill read "
          f"bandwidth {bw['a'] / 1e6:.2f} -> {bw['b'] / 1e6:.2f} MB/s "
          f"({bw['change_pct']:+.1f} %), TTFT {ttft['a']:.3f} -> {ttft['b']:.3f} s "
          f"({ttft['change_pct']:+.1f} %)")
    # The seeds' shape: several-fold the read bandwidth, a quarter off TTFT at least.
    assert bw["ratio"] >= 3 and ttft["change_pct"] <= -25, (bw, ttft)
    # What bound each: in A one read at a time, each waiting out the device's latency
    # (latency-bound, whatever the request size); in B four side by side at about the same
    # latency, so the device had room the one reader left unused.
    depth, p50 = got["prefill.inflight"], got["prefill.read.p50"]
    found = json.loads(r.stdout)["findings"]
    rule_a = next(f for f in found["a"] if f["phase"] == "prefill")
    print(f"in flight {depth['a']:.2f} -> {depth['b']:.2f}, read p50 {p50['a'] / 1e3:.1f} -> "
          f"{p50['b'] / 1e3:.1f} ms; A: {rule_a['text']}; B: "
          + next(f["text"] for f in found["b"] if f["phase"] == "prefill"))
    assert rule_a["rule"] == "latency-bound" and "one request at a time" in rule_a["text"]
    assert depth["a"] < 1.2 and depth["b"] >= 2.5, depth
    assert p50["b"] <= 1.25 * p50["a"], p50
    # ... and the compare says so: B's extra requests overlapped without waiting longer.
    changes = json.loads(r.stdout)["changes"]
    assert [(c["phase"], c["op"], c["verdict"]) for c in changes] == [
        ("prefill", "read", "overlapped")], changes
    # Gates around the measured changes: short of them pass, past them fail (exit 1).
    for name in ("ttft", "prefill.read.bandwidth"):
        change = got[name]["change_pct"]
        assert change != 0
        short, past = change * 0.9, change * 1.1
        ok = run_kvprof("compare", a, b, "--gate", f"{name}={short:+.4f}%")
        assert ok.returncode == 0, ok.stdout
        bad = run_kvprof("compare", a, b, "--gate", f"{name}={past:+.4f}%")
        assert bad.returncode == 1 and "FAIL" in bad.stdout, bad.stdout


def test_the_vllm_demo_job_shows_the_real_engine_offloading(tmp_path):
    """`bash scripts/dev.sh demo-vllm --no-tui`: the real vLLM with the fs tier, a client
    asking about stored documents, kvprof attached as a user would; its report has the
    engine's stores and loads, in prefill."""
    require(vllm_server.unavailable())
    out = tmp_path / "session"
    r = subprocess.run([sys.executable, str(REPO / "scripts" / "vllm_demo.py"), "--no-tui",
                        "--seconds", "20", "-o", str(out)],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "prefill" in r.stdout
    report = json.loads(run_kvprof("report", str(out), "--json").stdout)
    tier = report["phases"]["prefill"]["caches"]["vllm-fs-tier"]
    print(f"demo-vllm: prefill {tier['write']['bytes']} B stored, {tier['read']['bytes']} B "
          f"loaded; windows {report['phases']['prefill']['windows']} prefill, "
          f"{report['phases']['decode']['windows']} decode")
    assert tier["write"]["bytes"] > 0 and tier["read"]["bytes"] > 0
    assert tier["read"]["direct_bytes"] == tier["read"]["bytes"]
    assert report["phases"]["decode"]["windows"] > 0
    # The report names who made the windows, as stored: the plugin in the engine's API
    # server (source hook, engine vllm:0), not the socket it listened on.
    made = report["session"]["window_sources"]
    assert [(w["source"], w["engine"]) for w in made] == [("hook", "vllm:0")], made
    assert made[0]["windows"] > 0
    header = run_kvprof("report", str(out)).stdout.splitlines()[3]
    assert header.startswith("phase windows: hook vllm:0 ("), header


def _documents(server, seed: int, rounds: int = 3, words: int = 1200) -> None:
    """Each round a new document (its prefill stores its blocks), the engine's prefix cache
    reset, the document asked again with a new question (its prefill loads them back)."""
    for k in range(rounds):
        doc = vllm_server.make_prompt(words, seed + k)
        for q in (1, 2):
            server.complete(0, 16, prompt=doc + " " + vllm_server.make_prompt(20, -seed - k - q))
            server.post("/reset_prefix_cache")


def _fs_tier_call_seconds(session, root) -> float:
    """Seconds the engine spent in read and write calls on the fs tier's files (under `root`),
    from the syscall layer's rows: every one of them is in prefill (asserted below)."""
    import duckdb

    con = duckdb.connect(str(session / "session.duckdb"), read_only=True)
    try:
        return con.execute("SELECT coalesce(sum(complete_ns - issue_ns), 0) / 1e9 FROM io "
                           "WHERE layer = 'syscall' AND op IN ('read', 'write') "
                           "AND starts_with(path, ?)", [f"{root}/"]).fetchall()[0][0]
    finally:
        con.close()


def _device_p50_us(dev: str, n: int = 40) -> float:
    """The device's own latency now: the p50 of n 4 KiB O_DIRECT reads one at a time, at
    random offsets of its first 512 MiB (a witness beside the runs, never inside one)."""
    import mmap
    import random
    import statistics

    buf = mmap.mmap(-1, 4096)
    fd = os.open(f"/dev/{dev}", os.O_RDONLY | os.O_DIRECT)
    try:
        took = []
        for _ in range(n):
            at = random.randrange((512 << 20) // 4096) * 4096
            t = time.monotonic_ns()
            os.preadv(fd, [buf], at)
            took.append((time.monotonic_ns() - t) / 1e3)
    finally:
        os.close(fd)
    return statistics.median(took)


def test_a_replay_on_a_slow_candidate_against_the_engine_run_there(loopdev, slow_device,
                                                                   tmp_path, start_recorder):
    """The fs tier's I/O recorded on a fast device, replayed on a candidate whose requests
    wait 2 ms, and the same engine work run on that candidate: the replay predicts the
    engine's own run there. The fs tier stores a step's blocks one after another and the
    step waits for them, so an open-loop replay (each call at its recorded time, ~0.2 ms
    apart) would put them all in flight at once, at a latency and in a time the engine never
    sees; the replay keeps the engine thread's order and pace instead."""
    from tests.helpers import mounted_ext4

    slow = slow_device(read_ms=2, write_ms=2, size=1 << 30)
    mnt = tmp_path / "kvmnt"
    root = mnt / "kv"
    server, log = serve_with_connector(tmp_path, root, "fs")
    sessions = {}
    probes: dict[str, list[float]] = {}  # the candidate's QD1 p50 around each run (us)
    try:
        for name, dev in (("fast", loopdev), ("candidate", slow.name)):
            with mounted_ext4(dev, mnt):
                root.mkdir()
                if name == "fast":
                    _documents(server, 1, rounds=1)  # torch compiles both shapes first
                os.sync()
                if name == "candidate":
                    probes["engine"] = [_device_p50_us(dev)]
                rec = start_recorder("-d", dev, "--layer", "block", "--layer", "syscall",
                                     "--phases", "vllm-plugin", "--phases",
                                     f"vllm-metrics={server.url}/metrics", name=name,
                                     socket=server.marks_socket)
                _documents(server, 100)
                time.sleep(SCRAPED_S)
                os.sync()
                assert rec.stop() == 0, "".join(rec.stderr_lines)
                sessions[name] = rec.report()
                if name == "candidate":
                    probes["engine"].append(_device_p50_us(dev))
                    probes["replay"] = [_device_p50_us(dev)]
                    out = tmp_path / "replayed"
                    r = run_kvprof("replay", str(tmp_path / "fast"), "--on", str(mnt), "-o",
                                   str(out), "--json", timeout=300)
                    probes["replay"].append(_device_p50_us(dev))
                    assert r.returncode == 0, r.stderr
                    print(r.stderr)
                    result = json.loads(r.stdout)
                    sessions["replay"] = json.loads(
                        run_kvprof("report", str(out), "--json").stdout)
    finally:
        server.stop()
    lines = []
    for phase in ("prefill", "decode"):
        for op in ("write", "read"):
            row = []
            for name in ("fast", "replay", "candidate"):
                ph = sessions[name]["phases"][phase]
                e = ph["block"][op]
                row.append(f"{name} {e['ios']} req {e['bandwidth_bytes_per_s'] / 1e6:.1f} MB/s "
                           f"p50 {e['latency_us']['p50'] or 0:.0f} us "
                           f"(phase {ph['time_s']:.3f} s)")
            lines.append(f"{phase} {op}: " + "; ".join(row))
    for name in ("fast", "replay", "candidate"):
        c = sessions[name]["phases"]["prefill"]["caches"].get("vllm-fs-tier", {})
        lines.append(f"{name} fs tier in prefill: " + ", ".join(
            f"{op} {c[op]['ios']} calls {c[op]['bandwidth_bytes_per_s'] / 1e6:.2f} MB/s"
            for op in ("write", "read") if op in c))
    lines.append(f"replay: {result['threads']} threads' orders kept; per phase {result['phases']}"
                 f"; late {result['lag']}")
    # Where a latency differs, the other I/O beside the cache's: every phase's block
    # requests, and prefill's requests in flight while busy.
    for name, s in sessions.items():
        lines.append(f"{name} block (write, read) by phase " + str({
            p: (s["phases"][p]["block"]["write"]["ios"], s["phases"][p]["block"]["read"]["ios"])
            for p in schema.PHASES}) + f", prefill in flight "
            f"{s['phases']['prefill']['block'].get('inflight_mean')}")
    drift = (sum(probes["replay"]) / 2) / (sum(probes["engine"]) / 2)
    lines.append(f"the candidate's own QD1 read p50 before and after (us): {probes}; the "
                 f"replay's over the engine run's {drift:.3f}")
    lines.append("engine TTFT, ITL: " + ", ".join(
        f"{k} {s['engine']['ttft_s']}, {s['engine']['itl_s']}" for k, s in sessions.items()
        if k != "replay"))
    # The replay holds the engine's own work (all but its storage calls) at the recording's:
    # what it predicts is the candidate's storage time, as the engine's steps wait on it. The
    # engine's own work changes from one run to the next on these two CPUs (seen: prefill
    # 0.99 s fast and 1.61 s on the candidate, of which 0.16 s more storage time), so the
    # candidate's run is taken with the fast run's own work: its prefill time less what its
    # fs-tier calls took, plus the fast run's work, measured in both sessions.
    calls_s = {n: _fs_tier_call_seconds(tmp_path / n, root) for n in ("fast", "candidate")}
    work_s = {n: sessions[n]["phases"]["prefill"]["time_s"] - calls_s[n] for n in calls_s}
    held_s = calls_s["candidate"] + work_s["fast"]
    lines.append(f"storage calls {calls_s}; the engine's own work in prefill {work_s}: the "
                 f"candidate's prefill with the fast run's work {held_s:.3f} s")
    print("\n".join(lines))
    # The engine stores and loads only in prefill, on both devices; the replay likewise.
    tier = {n: {ph: s["phases"][ph]["caches"].get("vllm-fs-tier") for ph in schema.PHASES}
            for n, s in sessions.items()}
    for name in sessions:
        assert all(tier[name][ph] is None or tier[name][ph]["read"]["ios"] ==
                   tier[name][ph]["write"]["ios"] == 0 for ph in schema.PHASES
                   if ph != "prefill"), (name, tier[name])
    # The replay predicts the engine's own run on the candidate, per op: the same calls, and
    # their bandwidth over prefill's time and the device's p50 within 25 % (the replay keeps
    # each thread's order, so the candidate's slower calls stretch prefill as they
    # stretched the engine's steps). (The block layer also has ext4's journal, which the
    # engine's creates and renames write and the replay's do not: calls are compared.)
    replay_s = sessions["replay"]["phases"]["prefill"]["time_s"]
    assert abs(replay_s / held_s - 1) <= 0.25, lines
    for op in ("write", "read"):
        x, y = (tier[n]["prefill"][op] for n in ("replay", "candidate"))
        assert (x["ios"], x["bytes"]) == (y["ios"], y["bytes"]) and x["ios"] > 0, lines
        # Bandwidth over prefill's time, the candidate's with the fast run's own work.
        assert abs(x["bandwidth_bytes_per_s"] / (y["bytes"] / held_s) - 1) <= 0.25, lines
    # The device's latency itself moves with the VM's CPU (its server is user space:
    # nbdkit, FUSE): a read's is held to what the probes measured around each run (4 KiB
    # QD1 reads). A write's p50 is not held: its 384 KiB swung both ways at the same probe
    # drift, which the probes do not see. Seen on CI at drifts of 0.995 and 1.013: the
    # engine's writes at p50 4.5 ms against the replay's 3.0, and the replay's at 4.1 against
    # the engine's 2.8, reads within 11 % both times. Printed above; their calls, bytes and
    # bandwidth are held.
    x, y = (sessions[n]["phases"]["prefill"]["block"]["read"]["latency_us"]["p50"]
            for n in ("replay", "candidate"))
    assert abs(x / y / drift - 1) <= 0.25, lines
