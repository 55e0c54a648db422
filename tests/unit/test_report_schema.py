"""The JSON report is a public contract: pinned byte for byte on the recorded sample, and
every report checked against the types that define it (kvprof/summary.py)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvprof.commands.demo import SAMPLE_DIR
from kvprof.summary import Report
from tests.helpers import run_kvprof
from tests.report_shape import check

ROOT = Path(__file__).resolve().parents[2]
GOLDEN = Path(__file__).resolve().parents[1] / "golden"


@pytest.mark.parametrize("args, golden", [
    (("--json",), "report-demo.json"),
    (("--json", "--mixed", "split"), "report-demo-split.json"),
    ((), "report-demo.txt"),
])
def test_the_sample_report_is_byte_for_byte_the_pinned_one(args, golden):
    r = run_kvprof("report", str(SAMPLE_DIR), *args)
    assert r.returncode == 0, r.stderr
    # (the text report's first line names the session as given)
    assert r.stdout.replace(f"{ROOT}/", "") == (GOLDEN / golden).read_text()


def test_the_sample_report_has_exactly_the_typed_shape():
    check(json.loads((GOLDEN / "report-demo.json").read_text()), Report)


def test_the_shape_check_fails_a_renamed_or_missing_key_and_a_wrong_type():
    good = json.loads((GOLDEN / "report-demo.json").read_text())
    ph = good["phases"]["decode"]
    for broken, why in (
        (lambda r: r["phases"]["decode"]["block"].update(idle_pct=r["phases"]["decode"]
                                                         ["block"].pop("time_idle_pct")),
         "missing ['time_idle_pct'] (BlockLayer)"),
        (lambda r: r["session"].pop("lost_events"), "missing ['lost_events']"),
        (lambda r: r["phases"]["decode"]["block"]["read"].update(ios=1.5), "is not int"),
        (lambda r: r["engine"].update(ttft_s="1"), "is none of"),
    ):
        r = json.loads(json.dumps(good))
        broken(r)
        with pytest.raises(AssertionError, match=r"report\.") as e:
            check(r, Report)
        assert why in str(e.value)
    assert ph["block"]["read"]["ios"] > 0  # (the sample does have reads to break)


def test_the_offload_line_puts_the_engines_claims_beside_its_files():
    from kvprof.units import offload_sentence

    o = {"hit_tokens": 1152.0, "query_tokens": 2440.0, "bytes_per_token": 3072.0,
         "claimed_read_bytes": 3538944.0, "claimed_written_bytes": None,
         "engine_load_time_s": None, "engine_store_time_s": None,
         "files_read_bytes": 3538944, "files_written_bytes": 3538944,
         "device_read_bytes": 3538944, "page_cache_hit_pct": 0.0, "files_read_busy_s": 0.5,
         "ttft_total_s": 2.0, "load_wait_pct": 25.0, "caches": ["vllm-fs-tier"]}
    assert offload_sentence(o) == (
        "offload: the engine says its KV connector supplied 1152 of 2440 prompt tokens asked "
        "for (3.4 MiB at 3.0 KiB a token); its KV cache files (vllm-fs-tier) were read "
        "3.4 MiB (in flight 0.500 s, 25 % of the requests' time to first token), 3.4 MiB of "
        "it from the device, and written 3.4 MiB")
    # The storage tiers' own counts (vLLM's tiering, LMCache's), with their own times.
    tiers = {**o, "claimed_written_bytes": 7077888.0, "engine_load_time_s": 0.25,
             "engine_store_time_s": 0.125, "load_wait_pct": None}
    assert offload_sentence(tiers) == (
        "offload: the engine says its KV connector supplied 1152 of 2440 prompt tokens asked "
        "for (3.4 MiB at 3.0 KiB a token), its offload loaded 3.4 MiB in 0.250 s of its own, "
        "its offload stored 6.8 MiB in 0.125 s of its own; its KV cache files (vllm-fs-tier) "
        "were read 3.4 MiB (in flight 0.500 s), 3.4 MiB of it from the device, and written "
        "3.4 MiB")
    assert offload_sentence({**o, "hit_tokens": None, "claimed_read_bytes": None,
                             "caches": []}) is None


def test_the_text_report_says_how_often_a_metrics_source_scraped():
    from kvprof.views.report import to_text

    report = json.loads((GOLDEN / "report-demo.json").read_text())
    src = "vllm-metrics=http://127.0.0.1:8000/metrics"
    report["session"]["source_pace"] = {src: {"scrape_interval_s": 0.431, "response_ms": 4.3}}
    lines = to_text(report, "demo").splitlines()
    assert f"  {src}: scraped every 0.431 s or less (4.3 ms a page)" in lines
