"""The `nvml` phase source: GPU samples at 10 Hz, stored as `gpu` rows and classified into
`phase` windows as they come, wiring capture's sampler (kvprof.capture.nvml) to the
classifier (kvprof.phases.nvml_classifier). A GPU that stops answering is counted once as
`nvml.gpu_lost` and its open window ends at its last row; the other GPUs go on.
"""
from __future__ import annotations

from kvprof.capture.nvml import NvmlSampler
from kvprof.phases.base import PhaseSource
from kvprof.phases.nvml_classifier import ClassifierConfig, WindowTracker


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
