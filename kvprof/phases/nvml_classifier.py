"""Phase windows guessed from GPU counters: prefill is compute-bound, decode memory-bound.

This is the fallback phase source (rank `nvml`, the lowest): an engine hook or scraped metrics
win wherever they have a window. Input rows are shaped like `schema.GPU`; output rows like
`schema.PHASE` with source="nvml" and the GPU index.

Rules, per row, thresholds from `ClassifierConfig` (defaults in brackets):

GPM rows (tensor_active_pct and dram_bw_util_pct present; Hopper and newer):
  1. idle when sm_active, tensor_active and dram_bw_util are all below idle_activity_pct [10].
  2. otherwise the compute score is
         s = (tensor_active - compute_memory_ratio [1.0] * dram_bw_util) / gpm_margin_pct [40]
     clamped to -1..1: prefill when s > 0 (tensor cores busier than DRAM), else decode.
  3. confidence = 0.5 + 0.5 * |s'|, at most gpm_max_confidence [0.95], where s' mixes in
     power (below) with weight gpm_power_weight [0.2].

Fallback rows (GPM NULL: older GPUs, or the first window not complete yet):
  1. idle when gpu_util_pct is below idle_util_pct [10]; no decision when it is NULL.
  2. the memory share r = mem_util_pct / gpu_util_pct; s = (mem_ratio_split [0.55] - r) /
     mem_ratio_margin [0.3]: prefill when s > 0, else decode (decode keeps DRAM busy for
     more of the time the GPU is busy).
  3. confidence = fallback_min_confidence [0.3] + (fallback_max_confidence [0.6] - 0.3) * |s'|
     where s' mixes in power with weight fallback_power_weight [0.3]: a duty cycle is weak
     evidence, so these windows always rank below GPM ones.

Power is used only as a relative signal, because a row does not carry the board's limit: a
GPU's position in the range of power it has shown so far this session, once that range spans
at least power_span_min_w [100]. Above power_split [0.8] of the range counts toward prefill.

Windows: a row's label covers the time since the GPU's previous row (what NVML averaged over);
a GPU's first row, or one after a gap longer than max_gap_ns [1 s], covers first_span_ns
[100 ms] back. Consecutive rows with the same label merge; an idle row, a row without
evidence or a gap ends the window. Idle is never emitted (no window means idle). Window
confidence is the time-weighted mean of its rows'. A window ends at its last row: time after
that was not measured. One `windows.Track` per GPU builds the windows.
"""
from __future__ import annotations

from dataclasses import dataclass

from kvprof.phases.windows import Track

SOURCE = "nvml"
IDLE = "idle"


@dataclass(frozen=True)
class ClassifierConfig:
    idle_activity_pct: float = 10.0
    compute_memory_ratio: float = 1.0
    gpm_margin_pct: float = 40.0
    gpm_max_confidence: float = 0.95
    gpm_power_weight: float = 0.2
    idle_util_pct: float = 10.0
    mem_ratio_split: float = 0.55
    mem_ratio_margin: float = 0.3
    fallback_min_confidence: float = 0.3
    fallback_max_confidence: float = 0.6
    fallback_power_weight: float = 0.3
    power_span_min_w: float = 100.0
    power_split: float = 0.8
    max_gap_ns: int = 1_000_000_000
    first_span_ns: int = 100_000_000


def _clamp(x: float) -> float:
    return max(-1.0, min(1.0, x))


class _PowerRange:
    """The power a GPU has shown so far, to say whether a reading is high for this board."""

    def __init__(self) -> None:
        self.low: float | None = None
        self.high: float | None = None

    def score(self, power_w: float | None, config: ClassifierConfig) -> float | None:
        """-1..1, positive when high in the range seen; None until the range means something."""
        if power_w is None:
            return None
        self.low = power_w if self.low is None else min(self.low, power_w)
        self.high = power_w if self.high is None else max(self.high, power_w)
        span = self.high - self.low
        if span < config.power_span_min_w:
            return None
        position = (power_w - self.low) / span
        return _clamp((position - config.power_split) / (1.0 - config.power_split))


def _mix(score: float, power: float | None, weight: float) -> float:
    return score if power is None else (1.0 - weight) * score + weight * power


def _label_gpm(row: dict, power: float | None, c: ClassifierConfig) -> tuple[str, float]:
    tensor, dram = row["tensor_active_pct"], row["dram_bw_util_pct"]
    activity = max(v for v in (row.get("sm_active_pct"), tensor, dram) if v is not None)
    if activity < c.idle_activity_pct:
        return IDLE, 1.0 - 0.5 * activity / c.idle_activity_pct
    s = _mix(_clamp((tensor - c.compute_memory_ratio * dram) / c.gpm_margin_pct), power,
             c.gpm_power_weight)
    return ("prefill" if s > 0 else "decode"), min(c.gpm_max_confidence, 0.5 + 0.5 * abs(s))


def _label_fallback(row: dict, power: float | None,
                    c: ClassifierConfig) -> tuple[str, float] | None:
    util, mem = row.get("gpu_util_pct"), row.get("mem_util_pct")
    if util is None:
        return None
    if util < c.idle_util_pct:
        return IDLE, c.fallback_max_confidence
    s = 0.0 if mem is None else _clamp((c.mem_ratio_split - mem / util) / c.mem_ratio_margin)
    s = _mix(s, power, c.fallback_power_weight)
    confidence = c.fallback_min_confidence + (
        c.fallback_max_confidence - c.fallback_min_confidence) * abs(s)
    return ("prefill" if s > 0 else "decode"), confidence


def label(row: dict, config: ClassifierConfig, power: _PowerRange | None = None
          ) -> tuple[str, float] | None:
    """(phase, confidence) of one gpu row, or None when the row holds no evidence."""
    power_score = (power or _PowerRange()).score(row.get("power_w"), config)
    if row.get("tensor_active_pct") is not None and row.get("dram_bw_util_pct") is not None:
        return _label_gpm(row, power_score, config)
    return _label_fallback(row, power_score, config)


class _GpuState:
    def __init__(self, gpu: int) -> None:
        self.last_ts: int | None = None
        self.track = Track(SOURCE, gpu=gpu, confidence_digits=3)
        self.power = _PowerRange()


class WindowTracker:
    """Feeds gpu rows in time order per GPU and hands back the phase windows they close.
    Not thread-safe: one owner feeds it."""

    def __init__(self, config: ClassifierConfig | None = None) -> None:
        self.config = config or ClassifierConfig()
        self._gpus: dict[int, _GpuState] = {}

    def feed(self, row: dict) -> list[dict]:
        gpu, ts = int(row["gpu"]), int(row["ts_ns"])
        st = self._gpus.get(gpu)
        if st is None:
            st = self._gpus[gpu] = _GpuState(gpu)
        closed: list[dict] = []
        if st.last_ts is not None and ts <= st.last_ts:
            return closed  # out of order or repeated: it describes no new time
        contiguous = st.last_ts is not None and ts - st.last_ts <= self.config.max_gap_ns
        span_start = (st.last_ts if contiguous and st.last_ts is not None
                      else ts - self.config.first_span_ns)
        st.last_ts = ts
        verdict = label(row, self.config, st.power)
        phase, confidence = verdict if verdict is not None else (IDLE, 0.0)
        w = st.track.open
        if w is not None and (phase != w.phase or not contiguous):
            closed += st.track.close()
        if phase == IDLE:
            return closed
        return closed + st.track.add(phase, span_start, ts, confidence)

    def open_rows(self) -> list[dict]:
        """Open windows up to their last row, left open (for live views)."""
        rows = (st.track.open_row() for st in list(self._gpus.values()))
        return [row for row in rows if row is not None]

    def end_gpu(self, gpu: int) -> list[dict]:
        """Close a GPU's open window at its last row (it stopped answering)."""
        st = self._gpus.get(gpu)
        return st.track.close() if st is not None else []

    def close(self, end_ns: int) -> list[dict]:
        """Close every open window at its last row, cut at end_ns."""
        closed: list[dict] = []
        for st in self._gpus.values():
            closed += st.track.close(end_ns)
        return closed


def classify(rows, config: ClassifierConfig | None = None) -> list[dict]:
    """Phase rows (schema.PHASE, source "nvml") for gpu rows in any order."""
    rows = list(rows)
    tracker = WindowTracker(config)
    out: list[dict] = []
    for row in sorted(rows, key=lambda r: (r["gpu"], r["ts_ns"])):
        out += tracker.feed(row)
    last = max((r["ts_ns"] for r in rows), default=0)
    return out + tracker.close(last)
