"""--phases parsing and `auto` discovery from engine command lines."""
from __future__ import annotations

import pytest

from kvprof.errors import EX_USAGE, KvprofError
from kvprof.phases import registry
from kvprof.phases.registry import SourceSpec


def test_parse_defaults_and_targets():
    assert registry.parse("vllm-metrics") == SourceSpec("vllm-metrics",
                                                        "http://127.0.0.1:8000/metrics")
    assert registry.parse("sglang-fpm=ipc:///tmp/fpm.0") == SourceSpec("sglang-fpm",
                                                                      "ipc:///tmp/fpm.0")
    assert registry.parse("nvml") == SourceSpec("nvml")


@pytest.mark.parametrize("bad", ["nope", "sglang-fpm", "vllm"])
def test_parse_rejects_unknown_or_incomplete(bad):
    with pytest.raises(KvprofError) as e:
        registry.parse(bad)
    assert e.value.exit_code == EX_USAGE


def fake_proc(tmp_path, *cmdlines: list[str]):
    for pid, argv in enumerate(cmdlines, start=100):
        d = tmp_path / str(pid)
        d.mkdir()
        (d / "cmdline").write_bytes(b"\0".join(a.encode() for a in argv) + b"\0")
    (tmp_path / "self").mkdir()
    return tmp_path


def test_discover_finds_engines_and_their_ports(tmp_path):
    proc = fake_proc(
        tmp_path,
        ["/usr/bin/python3", "-m", "vllm.entrypoints.openai.api_server", "--port", "8123",
         "--kv-events-config", '{"enable_kv_cache_events": true, "endpoint": "tcp://*:5600"}'],
        ["python", "-m", "sglang.launch_server", "--model", "m", "--port=31000"],
        ["text-generation-launcher", "--prometheus-port", "9100"],
        ["bash"])
    assert registry.discover(proc) == [
        SourceSpec("vllm-metrics", "http://127.0.0.1:8123/metrics"),
        SourceSpec("vllm-kv-events", "tcp://127.0.0.1:5600"),
        SourceSpec("sglang-metrics", "http://127.0.0.1:31000/metrics"),
        SourceSpec("tgi-metrics", "http://127.0.0.1:9100/metrics"),
    ]


def test_discover_with_nothing_running(tmp_path):
    assert registry.discover(fake_proc(tmp_path, ["sleep", "10"])) == []
