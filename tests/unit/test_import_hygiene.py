"""Layering: the headless core runs without bcc, pynvml or textual being imported."""
from __future__ import annotations

import json
import subprocess
import sys

CORE = ["kvprof.cli", "kvprof.analysis.correlate", "kvprof.views.report", "kvprof.store.parquet",
        "kvprof.store.session", "kvprof.recorder.recorder", "kvprof.markers",
        "kvprof.phases.mark_server", "kvprof.commands.doctor", "kvprof.views.snapshot",
        "kvprof.views.findings", "kvprof.commands.top", "kvprof.commands.demo",
        "kvprof.live", "kvprof.replay.run"]


def test_core_imports_no_capture_or_ui_libraries():
    code = ("import importlib, json, sys\n"
            f"for m in {CORE!r}: importlib.import_module(m)\n"
            "print(json.dumps(sorted(sys.modules)))")
    mods = set(json.loads(subprocess.run([sys.executable, "-c", code], check=True,
                                         capture_output=True, text=True).stdout))
    assert not {"bcc", "pynvml", "textual"} & mods


def test_marker_client_and_vllm_plugin_import_only_the_standard_library():
    code = ("import sys; import kvprof.markers, kvprof.phases.vllm_plugin; "
            "print(' '.join(sorted(sys.modules)))")
    mods = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True,
                          text=True).stdout.split()
    heavy = {"duckdb", "pyarrow", "numpy", "bcc", "pynvml", "textual", "zmq", "msgpack"}
    assert not heavy & set(mods)
