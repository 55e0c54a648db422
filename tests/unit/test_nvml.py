"""NVML sampling and the phase classifier built on it, through the real pynvml.

The GPUs are a simulated libnvidia-ml.so.1 (tests/nvml_sim/libnvidia-ml.c), built here and
loaded by pynvml through LD_LIBRARY_PATH in a subprocess, replaying a scripted trace on three
GPUs that fail differently: GPU0 has everything, GPU1 lacks GPM and power, GPU2 is lost.
"""
from __future__ import annotations

import itertools
import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pytest

from kvprof import schema
from kvprof.errors import EX_UNAVAILABLE, KvprofError
from kvprof.phases.nvml import ClassifierConfig, WindowTracker, classify

ROOT = Path(__file__).resolve().parents[2]
SIM = Path(__file__).resolve().parents[1] / "nvml_sim"
RUN_S = 6.5
LOST_MS = 2400  # GPU2's "lost" line
MS = 1_000_000

SCRIPT = f"""\
# t_start_ms t_end_ms gpu phase
300 1300 0 prefill
1300 2900 0 decode
3400 4000 0 prefill
4000 5200 0 decode
5200 5600 0 prefill
5600 7000 0 decode
200 900 1 prefill
900 2600 1 decode
3000 3800 1 prefill
3800 5000 1 decode
5400 7000 1 prefill
200 1200 2 prefill
1200 2600 2 decode
{LOST_MS} - 2 lost
"""
PREFILL_POWER_W, PREFILL_RX_BYTES_PER_S = 610.0, 2000 * 1024 * 1024  # the simulator's levels
GPM_FIELDS = ("sm_active_pct", "tensor_active_pct", "dram_bw_util_pct")

needs_gcc = pytest.mark.skipif(shutil.which("gcc") is None, reason="needs gcc")


# -- the simulator ----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def sim_lib(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("nvsim")
    subprocess.run(["gcc", "-shared", "-fPIC", "-O2", "-Wall", "-Werror", "-o",
                    str(out / "libnvidia-ml.so.1"), str(SIM / "libnvidia-ml.c"), "-lm"],
                   check=True, capture_output=True, text=True)
    return out


def drive(sim_dir: Path, work: Path, seconds: float, **env: str) -> subprocess.CompletedProcess:
    (work / "script.txt").write_text(SCRIPT)
    full_env = {**os.environ, "LD_LIBRARY_PATH": str(sim_dir),
                "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
                "NVSIM_SCRIPT": str(work / "script.txt"), "NVSIM_T0_FILE": str(work / "t0"),
                # the legacy PCIe call is reported to measure 20 ms per direction: keep it so
                "NVSIM_PCIE_DELAY_US": "20000", **env}
    return subprocess.run([sys.executable, str(SIM / "drive.py"), str(seconds),
                           str(work / "out.json")], env=full_env, capture_output=True,
                          text=True, timeout=60, check=False)


@pytest.fixture(scope="module")
def run(sim_lib, tmp_path_factory) -> dict:
    """One sampler run over the whole script, shared by the tests that read it."""
    work = tmp_path_factory.mktemp("nvml-run")
    r = drive(sim_lib, work, RUN_S)
    assert r.returncode == 0, r.stderr
    out = json.loads((work / "out.json").read_text())
    out["t0_ns"] = int((work / "t0").read_text())
    return out


def rows_of(run: dict, gpu: int) -> list[dict]:
    return sorted((r for r in run["gpu"] if r["gpu"] == gpu), key=lambda r: r["ts_ns"])


def segments() -> list[tuple[int, int, int, str]]:
    segs = []
    for line in SCRIPT.splitlines():
        if line.startswith("#"):
            continue
        start, end, gpu, phase = line.split()
        if phase != "lost":
            segs.append((int(start), int(end), int(gpu), phase))
    return segs


def truth(gpu: int, t_ms: float) -> str:
    phase = "idle"
    for start, end, g, p in segments():
        if g == gpu and start <= t_ms < end:
            phase = p  # later lines win, as in the simulator
    return phase


def deep_in(run: dict, gpu: int, phase: str, margin_ms: int = 250) -> list[dict]:
    """Rows well inside a segment of `phase`, where every averaging window is pure."""
    def ms(r):
        return (r["ts_ns"] - run["t0_ns"]) / MS
    return [r for r in rows_of(run, gpu)
            if all(truth(gpu, ms(r) + d) == phase for d in (-margin_ms, 0, margin_ms))]


def accuracy(run: dict, gpu: int) -> float:
    """Share of the sampled time (1 ms steps) where the windows say what the script did."""
    rows = rows_of(run, gpu)
    windows = [w for w in run["phase"] if w["gpu"] == gpu]
    lo, hi = rows[0]["ts_ns"], rows[-1]["ts_ns"]
    right = total = 0
    for t_ns in range(lo, hi, MS):
        said = next((w["phase"] for w in windows if w["start_ns"] <= t_ns < w["end_ns"]), "idle")
        right += said == truth(gpu, (t_ns - run["t0_ns"]) / MS)
        total += 1
    return right / total


# -- (a) rows through the real pynvml ---------------------------------------------------------
@needs_gcc
def test_every_gpu_gives_rows_with_nulls_exactly_where_unsupported(run):
    pa.Table.from_pylist(run["gpu"], schema=schema.GPU)  # the rows are the table's rows
    gpu0, gpu1, gpu2 = (rows_of(run, g) for g in range(3))
    assert gpu0 and gpu1 and gpu2
    assert {r["uuid"] for r in gpu1} == {"GPU-5151c0de-0000-4000-8000-000000000001"}
    for r in run["gpu"]:
        assert r["gpu_util_pct"] is not None and r["mem_util_pct"] is not None
        assert r["process_util"] is not None
        assert not any(isinstance(v, float) and not math.isfinite(v) for v in r.values())
    # GPU1: no GPM, no power -- NULL on every row, the rest present on every row.
    assert all(r[f] is None for r in gpu1 for f in GPM_FIELDS + ("power_w",))
    assert all(r["pcie_rx_bytes_per_s"] is not None for r in gpu1)
    for rows in (gpu0, gpu2):
        assert all(r["power_w"] is not None for r in rows)
        # GPM needs two samples >= 100 ms apart: only the rows before that can lack it.
        for f in GPM_FIELDS + ("pcie_rx_bytes_per_s", "pcie_tx_bytes_per_s"):
            missing = [i for i, r in enumerate(rows) if r[f] is None]
            assert missing == list(range(len(missing))) and len(missing) <= 2, f


@needs_gcc
def test_units_are_watts_and_bytes_per_second_on_both_pcie_paths(run):
    prefill0, prefill1 = deep_in(run, 0, "prefill"), deep_in(run, 1, "prefill")
    assert prefill0 and prefill1
    for r in prefill0:
        assert r["power_w"] == pytest.approx(PREFILL_POWER_W, rel=0.1)
        assert r["pcie_rx_bytes_per_s"] == pytest.approx(PREFILL_RX_BYTES_PER_S, rel=0.1)  # GPM
        assert set(json.loads(r["process_util"])) == {"4100", "4101"}
    for r in prefill1:
        assert r["pcie_rx_bytes_per_s"] == pytest.approx(PREFILL_RX_BYTES_PER_S, rel=0.1)  # KiB/s
    assert all(r["process_util"] == "{}" for r in deep_in(run, 0, "idle"))


@needs_gcc
def test_a_lost_gpu_stops_and_is_counted_while_the_others_go_on(run):
    lost_ns = run["t0_ns"] + LOST_MS * MS
    gpu2 = rows_of(run, 2)
    assert lost_ns - 300 * MS < gpu2[-1]["ts_ns"] < lost_ns
    assert all(w["end_ns"] <= gpu2[-1]["ts_ns"] for w in run["phase"] if w["gpu"] == 2)
    assert run["counts"] == {"nvml.gpu_lost": 1}
    for gpu in (0, 1):
        assert rows_of(run, gpu)[-1]["ts_ns"] > run["end_ns"] - 300 * MS


@needs_gcc
def test_sampling_rate_is_10_hz(run):
    for gpu in (0, 1):
        ts = [r["ts_ns"] for r in rows_of(run, gpu)]
        hz = (len(ts) - 1) / ((ts[-1] - ts[0]) / 1e9)
        gaps = sorted(b - a for a, b in itertools.pairwise(ts))
        print(f"nvml sampling gpu{gpu} {hz:.2f} Hz, median gap {gaps[len(gaps) // 2] / MS:.1f} ms")
        # interval_s is 0.1 start to start; the thread's wake-up latency is all it may lose.
        assert hz >= 9.5 and gaps[len(gaps) // 2] <= 105 * MS


# -- (b) the classifier against the script's truth --------------------------------------------
@needs_gcc
def test_classifier_accuracy_against_the_script(run):
    pa.Table.from_pylist(run["phase"], schema=schema.PHASE)
    bars = {0: 0.85, 1: 0.70, 2: 0.85}  # GPM, without GPM, GPM until lost
    for gpu, bar in bars.items():
        acc = accuracy(run, gpu)
        print(f"nvml classifier accuracy gpu{gpu} {acc:.1%}")
        assert acc >= bar
    assert {w["phase"] for w in run["phase"]} == {"prefill", "decode"}
    assert all(w["source"] == "nvml" for w in run["phase"])

    def mean_confidence(gpu):
        ws = [w for w in run["phase"] if w["gpu"] == gpu]
        return sum(w["confidence"] for w in ws) / len(ws)
    assert mean_confidence(1) < 0.6 < mean_confidence(0)  # a duty cycle is weaker evidence


@needs_gcc
def test_live_windows_equal_classifying_the_rows_afterwards(run):
    def key(w):
        return (w["gpu"], w["start_ns"])
    want = sorted(classify(run["gpu"]), key=key)
    # The stored rows also have the columns of other sources (marks' senders): NULL here.
    got = [{k: w[k] for k in want[0]} for w in sorted(run["phase"], key=key)]
    assert all(w["sender_pid"] is None for w in run["phase"])
    assert got == want


# -- failure at start -------------------------------------------------------------------------
@needs_gcc
def test_no_driver_is_one_line_and_exit_status_69(sim_lib, tmp_path):
    r = drive(sim_lib, tmp_path, 0.1, NVSIM_INIT_FAIL="1")
    assert r.returncode == EX_UNAVAILABLE
    assert r.stderr.count("\n") == 1
    assert "NVML not available: Driver Not Loaded; install the NVIDIA driver" in r.stderr


def test_no_pynvml_is_a_kvprof_error(monkeypatch):
    from kvprof.capture.nvml import NvmlSampler

    monkeypatch.setitem(sys.modules, "pynvml", None)
    with pytest.raises(KvprofError) as e:
        NvmlSampler()
    assert e.value.exit_code == EX_UNAVAILABLE and "NVML not available" in str(e.value)


def test_importing_the_modules_does_not_import_pynvml():
    code = ("import sys, kvprof.capture.nvml, kvprof.phases.nvml; "
            "print('pynvml' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True,
                         text=True, cwd=ROOT).stdout
    assert out.strip() == "False"


# -- (c) classify() on hand-made rows ---------------------------------------------------------
def gpu_row(ts_ms: int, gpu: int = 0, *, sm=None, tensor=None, dram=None, util=None, mem=None,
            power=None) -> dict:
    return {"ts_ns": ts_ms * MS, "gpu": gpu, "uuid": None, "gpu_util_pct": util,
            "mem_util_pct": mem, "sm_active_pct": sm, "tensor_active_pct": tensor,
            "dram_bw_util_pct": dram, "power_w": power, "pcie_rx_bytes_per_s": None,
            "pcie_tx_bytes_per_s": None, "process_util": None}


PREFILL = {"sm": 88, "tensor": 62, "dram": 38, "util": 99, "mem": 38}
DECODE = {"sm": 62, "tensor": 9, "dram": 82, "util": 97, "mem": 74}
IDLE = {"sm": 1, "tensor": 0, "dram": 1, "util": 0, "mem": 0}
NO_GPM = {"sm": None, "tensor": None, "dram": None}


def spans(windows) -> list[tuple[int, int, str]]:
    return [(w["start_ns"] // MS, w["end_ns"] // MS, w["phase"]) for w in windows]


def test_samples_merge_into_windows_and_idle_ends_them():
    rows = [gpu_row(t, **p) for t, p in
            [(100, PREFILL), (200, PREFILL), (300, PREFILL), (400, IDLE), (500, DECODE),
             (600, DECODE), (700, PREFILL)]]
    got = classify(rows)
    # each row covers the time since the one before; the first one 100 ms back
    assert spans(got) == [(0, 300, "prefill"), (400, 600, "decode"), (600, 700, "prefill")]
    pa.Table.from_pylist(got, schema=schema.PHASE)
    assert all(w["source"] == "nvml" and w["gpu"] == 0 for w in got)
    assert all(0.5 < w["confidence"] <= 1.0 for w in got)


def test_without_gpm_the_duty_cycles_decide_with_lower_confidence():
    gpm = classify([gpu_row(t, **PREFILL) for t in (100, 200)])
    legacy = classify([gpu_row(t, **{**PREFILL, **NO_GPM}) for t in (100, 200)])
    assert spans(legacy) == spans(gpm) == [(0, 200, "prefill")]
    assert legacy[0]["confidence"] < gpm[0]["confidence"]
    decode = classify([gpu_row(t, **{**DECODE, **NO_GPM}) for t in (100, 200)])
    assert spans(decode) == [(0, 200, "decode")]
    assert classify([gpu_row(100, **{**IDLE, **NO_GPM})]) == []


def test_power_high_in_the_gpus_own_range_counts_toward_prefill():
    # A sample the counters leave undecided (tensor == DRAM) leans toward what power says.
    undecided = {"sm": 70, "tensor": 50, "dram": 50}
    rows = [gpu_row(100, power=70, **IDLE), gpu_row(200, power=600, **undecided)]
    assert spans(classify(rows)) == [(100, 200, "prefill")]
    rows = [gpu_row(100, power=70, **IDLE), gpu_row(200, power=600, **PREFILL),
            gpu_row(300, power=300, **undecided)]
    assert spans(classify(rows))[-1] == (200, 300, "decode")


def test_a_row_without_evidence_or_a_long_gap_ends_the_window():
    rows = [gpu_row(100, **PREFILL), gpu_row(200, **PREFILL), gpu_row(300),
            gpu_row(400, **PREFILL), gpu_row(3000, **PREFILL)]
    assert spans(classify(rows)) == [(0, 200, "prefill"), (300, 400, "prefill"),
                                     (2900, 3000, "prefill")]


def test_gpus_are_classified_apart_whatever_the_row_order():
    rows = [gpu_row(t, gpu=g, **(PREFILL if g == 0 else DECODE))
            for t in (100, 200, 300) for g in (0, 1)]
    got = classify(reversed(rows))
    assert sorted((w["gpu"], *spans([w])[0]) for w in got) == [
        (0, 0, 300, "prefill"), (1, 0, 300, "decode")]


def test_thresholds_are_configurable():
    rows = [gpu_row(t, **PREFILL) for t in (100, 200)]
    assert classify(rows, ClassifierConfig(compute_memory_ratio=2.0))[0]["phase"] == "decode"
    assert classify(rows, ClassifierConfig(idle_activity_pct=95.0)) == []
    with pytest.raises(AttributeError):
        ClassifierConfig().idle_util_pct = 1.0  # frozen: one config per session


def test_tracker_hands_back_only_closed_windows_and_close_cuts_at_end():
    tracker = WindowTracker()
    assert tracker.feed(gpu_row(100, **PREFILL)) == []
    assert tracker.feed(gpu_row(200, **PREFILL)) == []
    assert spans(tracker.feed(gpu_row(300, **DECODE))) == [(0, 200, "prefill")]
    assert spans(tracker.open_rows()) == [(200, 300, "decode")]  # shown, still open
    assert tracker.feed(gpu_row(250, **PREFILL)) == []  # older than the last row: ignored
    assert spans(tracker.close(260 * MS)) == [(200, 260, "decode")]
    assert tracker.close(1000 * MS) == []


# -- through the recorder ---------------------------------------------------------------------
@needs_gcc
def test_record_with_nvml_source_stores_gpu_rows_and_windows(sim_lib, tmp_path):
    """`kvprof record --phases nvml` with the simulated library: the session holds the GPU
    samples and the classified windows, and the report lists the source and the lost GPU."""
    from tests.helpers import can_trace

    if can_trace() is not None:
        pytest.skip(can_trace())
    import duckdb

    (tmp_path / "script.txt").write_text(SCRIPT)
    env = {**os.environ, "LD_LIBRARY_PATH": str(sim_lib),
           "NVSIM_SCRIPT": str(tmp_path / "script.txt"), "NVSIM_T0_FILE": str(tmp_path / "t0"),
           # The script runs from the first reading, after the probes compiled (under load
           # that took past GPU2's loss at 2.4 s: no row of it).
           "NVSIM_ORIGIN": "first_read"}
    out = tmp_path / "s"
    r = subprocess.run([sys.executable, "-m", "kvprof", "record", "--layer", "block",
                        "--phases", "nvml", "--duration", "4", "-o", str(out), "--socket",
                        str(tmp_path / "m.sock")], env=env, capture_output=True, text=True,
                       timeout=120, check=False)
    assert r.returncode == 0, r.stderr
    con = duckdb.connect(str(out / "session.duckdb"), read_only=True)
    gpus = dict(con.execute("SELECT gpu, count(*) FROM gpu GROUP BY gpu").fetchall())
    assert set(gpus) == {0, 1, 2} and gpus[0] >= 30
    phases = {p for (p,) in con.execute("SELECT DISTINCT phase FROM phase WHERE source='nvml'"
                                        ).fetchall()}
    assert {"prefill", "decode"} <= phases
    rep = subprocess.run([sys.executable, "-m", "kvprof", "report", str(out), "--json"],
                         capture_output=True, text=True, check=True)
    session = json.loads(rep.stdout)["session"]
    assert "nvml" in session["phase_sources"]
    assert session["source_problems"]["nvml"]["nvml.gpu_lost"] == 1
    # The visual report plots GPU activity over time: each bin the mean of the samples in it.
    html = tmp_path / "r.html"
    subprocess.run([sys.executable, "-m", "kvprof", "report", str(out), "--html", str(html)],
                   capture_output=True, text=True, check=True)
    from tests.live.test_html import figures

    timeline = figures(html.read_text())["timeline"]
    util = next(t for t in timeline["data"] if t["name"] == "GPU util")
    start, end = con.execute("SELECT start_ns, end_ns FROM session").fetchall()[0]
    bin_ns = -(-(end - start) // len(util["y"]))
    want = dict(con.execute("""
        SELECT (ts_ns - ?) // ?, avg(gpu_util_pct) FROM gpu
        WHERE ts_ns >= ? AND ts_ns < ? GROUP BY ALL""",
                            [start, bin_ns, start, start + bin_ns * len(util["y"])]).fetchall())
    got = {i: v for i, v in enumerate(util["y"]) if v is not None}
    assert got.keys() == want.keys() and len(got) > 10
    assert all(got[i] == pytest.approx(want[i]) for i in got)


# -- a real GPU's rows ------------------------------------------------------------------------
H100 = Path(__file__).resolve().parents[1] / "nvml_h100" / "gpu_check.json"


def _gpu_check():
    """benchmarks/gpu_check.py, whose scoring the recorded run is held to."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "benchmarks" / "gpu_check.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("fields", ["gpm", "fallback"])
def test_a_real_h100s_rows_classify_as_the_work_that_ran(fields):
    """Rows the real sampler took on an NVIDIA H100 (nvidia-ml-py, torch 2.11 with CUDA 13)
    while benchmarks/gpu_check.py ran prefill-like work (bf16 GEMMs of 4 096 tokens, causal
    attention) and decode-like work (the same weight against 8 tokens, one token's attention
    over 8 x 8 192 cached ones) at times it recorded: every segment, 1 s ones included, is
    labelled as what ran for all of its time but the 250 ms at each edge (NVML's averaging),
    through GPM and, with the GPM fields taken out (GPUs before Hopper), through the
    utilisation fallback. Also: decode kept DRAM busier than the tensor cores, prefill the
    reverse, as the classifier assumes."""
    gc = _gpu_check()
    run = json.loads(H100.read_text())
    rows = run["rows"]
    if fields == "fallback":
        rows = [{**r, **{f: None for f in GPM_FIELDS}} for r in rows]
    windows = classify(rows)
    for seg in run["segments"]:
        inner = gc.shares(windows, seg["start_ns"] + gc.GUARD_NS, seg["end_ns"] - gc.GUARD_NS)
        assert gc.agreement(seg["phase"], inner) >= 0.99, (seg["phase"], inner)
        if seg["phase"] != "idle":
            med = gc.medians(run["rows"], seg["start_ns"], seg["end_ns"])
            busier = med["tensor_active_pct"] > med["dram_bw_util_pct"]
            assert busier is (seg["phase"] == "prefill"), med
