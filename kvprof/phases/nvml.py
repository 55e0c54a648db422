"""The `nvml` phase source: windows guessed from GPU counters (prefill compute-bound, decode
memory-bound), the lowest rank, used where no hook or metrics window is.

`NvmlSource` polls capture's sampler at 10 Hz, stores its `gpu` rows and feeds `WindowTracker`:
a row's label covers the time since the GPU's previous row, rows of one label merge into a
window ending at its last row; no window means idle. A GPU that stops answering counts once as
`nvml.gpu_lost`, its window ends at its last row, and the other GPUs go on."""
from __future__ import annotations

from dataclasses import dataclass

from kvprof.capture.nvml import NvmlSampler
from kvprof.phases.base import PhaseSource
from kvprof.phases.windows import Track

SOURCE = "nvml"
IDLE = "idle"


@dataclass(frozen=True)
class ClassifierConfig:
    """Thresholds of `_label_gpm`, `_label_fallback` and `_PowerRange`. A GPU's first row, or
    one after a gap over max_gap_ns, covers first_span_ns back."""
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
    """The power a GPU has shown so far, to say whether a reading is high for this board:
    relative, because a row does not carry the board's limit. Above power_split of the range
    counts toward prefill, once the range spans power_span_min_w."""

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
    """GPM rows (Hopper and newer): idle when SM, tensor and DRAM activity are all low; else
    prefill when tensor cores are busier than DRAM (the score, mixed with power, > 0), else
    decode, with confidence 0.5 + |score| / 2 up to gpm_max_confidence."""
    tensor, dram = row["tensor_active_pct"], row["dram_bw_util_pct"]
    activity = max(v for v in (row.get("sm_active_pct"), tensor, dram) if v is not None)
    if activity < c.idle_activity_pct:
        return IDLE, 1.0 - 0.5 * activity / c.idle_activity_pct
    s = _mix(_clamp((tensor - c.compute_memory_ratio * dram) / c.gpm_margin_pct), power,
             c.gpm_power_weight)
    return ("prefill" if s > 0 else "decode"), min(c.gpm_max_confidence, 0.5 + 0.5 * abs(s))


def _label_fallback(row: dict, power: float | None,
                    c: ClassifierConfig) -> tuple[str, float] | None:
    """Rows without GPM (older GPUs, or before its first window): idle on a low duty cycle,
    no decision without one; else decode when DRAM is busy for much of the GPU's busy time.
    A duty cycle is weak evidence, so the confidence stays in the fallback's lower range."""
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


class NvmlSource(PhaseSource):
    """Polls every GPU; emits `gpu` rows and the `phase` windows they close."""

    name = "nvml"
    interval_s = 0.1

    def __init__(self, config: ClassifierConfig | None = None,
                 gpus: list[int] | None = None) -> None:
        super().__init__()
        # Before the sampler: it reports GPUs lost while it opens them.
        self._windows = WindowTracker(config)
        self._closed = False
        self._sampler = NvmlSampler(gpus, on_lost=self._lost)

    @property
    def gpu_indices(self) -> list[int]:
        return self._sampler.gpu_indices

    def poll(self) -> None:
        for row in self._sampler.poll():
            self.emit("gpu", row)
            for window in self._windows.feed(row):
                self.emit("phase", window)

    def _lost(self, gpu: int, why: str) -> None:
        self.problem("gpu_lost", f"gpu {gpu}: {why}")
        for window in self._windows.end_gpu(gpu):
            self.emit("phase", window)

    def open_rows(self, now_ns: int) -> list[dict]:
        # Read from the recorder's thread while poll() feeds the tracker: dict and row reads
        # are atomic under the GIL, and a window caught mid-update is at worst one sample old.
        return self._windows.open_rows()

    def close(self, end_ns: int) -> None:
        if self._closed:
            return
        self._closed = True
        for window in self._windows.close(end_ns):
            self.emit("phase", window)
        self._sampler.close()
