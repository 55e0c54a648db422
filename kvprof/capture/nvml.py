"""GPU counters from NVML, as `gpu` rows (schema.GPU); `nvml_available()` for doctor and `auto`.

The only module that imports pynvml, and only inside functions, so everything else imports
without the library or a driver. Per GPU and poll: utilisation rates, power, PCIe throughput,
per-process SM utilisation and, with GPM (Hopper and newer), SM activity, tensor activity and
DRAM bandwidth utilisation; a field the GPU does not support is NULL, the rest of the row still
counts. Phases are not known here: kvprof.phases.nvml polls the sampler and classifies them."""
from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvprof.errors import EX_UNAVAILABLE, KvprofError

GPM_MIN_INTERVAL_NS = 100_000_000
KIB = 1024
MIB = 1024 * 1024

# GPM metric ids (nvml.h NVML_GPM_METRIC_*), fixed by the C API.
GPM_SM_UTIL = 2
GPM_ANY_TENSOR_UTIL = 5
GPM_DRAM_BW_UTIL = 10
GPM_PCIE_TX_PER_SEC = 20
GPM_PCIE_RX_PER_SEC = 21
GPM_METRICS = (GPM_SM_UTIL, GPM_ANY_TENSOR_UTIL, GPM_DRAM_BW_UTIL, GPM_PCIE_TX_PER_SEC,
               GPM_PCIE_RX_PER_SEC)

# Errors that mean "this GPU cannot give this field", not "this GPU is gone".
_FIELD_UNAVAILABLE = ("NVML_ERROR_NOT_SUPPORTED", "NVML_ERROR_NO_PERMISSION",
                      "NVML_ERROR_FUNCTION_NOT_FOUND", "NVML_ERROR_NO_DATA",
                      "NVML_ERROR_ARGUMENT_VERSION_MISMATCH")


class GpuLost(Exception):
    """A GPU stopped answering; it is dropped from sampling."""


@dataclass
class _Gpu:
    index: int
    handle: Any
    uuid: str | None
    gpm: bool = False
    samples: list = field(default_factory=list)  # two GPM sample buffers, used in turn
    prev_gpm_ns: int | None = None  # when samples[0] was surely taken (just after)
    gpm_values: dict | None = None  # the last completed window
    proc_since_us: int = 0  # NVML's per-process samples are stamped in wall-clock us


@dataclass(frozen=True)
class NvmlStatus:
    """Whether NVML initialises, and with how many GPUs; when not, why (one line) and the fix."""

    ok: bool
    gpus: int = 0
    reason: str = ""
    fix: str = ""


def nvml_available() -> NvmlStatus:
    """Initialise NVML once, count the GPUs, shut it down again. Never raises.

    Cheap where there is no GPU (the library is not found, or the driver not loaded); where
    there is one, it costs what the sampler's own start would."""
    try:
        nv = _init_nvml()
    except _Unavailable as e:
        return NvmlStatus(False, reason=e.reason, fix=e.fix)
    except Exception as e:  # noqa: BLE001 - a probe must answer, whatever the library does
        return NvmlStatus(False, reason=f"{type(e).__name__}: {e}", fix=_DRIVER_FIX)
    try:
        return NvmlStatus(True, gpus=int(nv.nvmlDeviceGetCount()))
    except Exception as e:  # noqa: BLE001 - see above
        return NvmlStatus(False, reason=f"cannot count GPUs: {e}", fix=_DRIVER_FIX)
    finally:
        _shutdown(nv)


class NvmlSampler:
    """Samples every GPU on each `poll()` and returns their `gpu` rows.

    on_lost(gpu_index, why) hears of each GPU that stopped answering, at start or later,
    before `poll()` returns. Not thread-safe: one owner polls it and closes it."""

    def __init__(self, gpus: list[int] | None = None,
                 on_lost: Callable[[int, str], None] | None = None) -> None:
        try:
            self._nv = _init_nvml()
        except _Unavailable as e:
            raise KvprofError(f"NVML not available: {e.reason}; {e.fix}",
                              EX_UNAVAILABLE) from None
        self._on_lost = on_lost or (lambda index, why: None)
        self._unavailable = {getattr(self._nv, n) for n in _FIELD_UNAVAILABLE
                             if hasattr(self._nv, n)}
        self._closed = False
        try:
            self._gpus = self._open_gpus(gpus)
        except GpuLost as e:
            self._shutdown()
            raise KvprofError(f"NVML not available: {e}", EX_UNAVAILABLE) from None
        if not self._gpus:
            self._shutdown()
            raise KvprofError("NVML sees no GPU to sample" + (f" among {gpus}" if gpus else ""),
                              EX_UNAVAILABLE)

    # -- setup --------------------------------------------------------------------------------
    def _open_gpus(self, wanted: list[int] | None) -> list[_Gpu]:
        count = self._query(self._nv.nvmlDeviceGetCount) or 0
        indices = range(count) if wanted is None else [i for i in wanted if 0 <= i < count]
        gpus = []
        for i in indices:
            try:
                gpus.append(self._open_gpu(i))
            except GpuLost as e:
                self._on_lost(i, str(e))
        return gpus

    def _open_gpu(self, index: int) -> _Gpu:
        nv = self._nv
        handle = self._query(nv.nvmlDeviceGetHandleByIndex, index)
        gpu = _Gpu(index, handle, self._query(nv.nvmlDeviceGetUUID, handle),
                   proc_since_us=time.time_ns() // 1000 - 1_000_000)
        support = self._query(nv.nvmlGpmQueryDeviceSupport, handle)
        if support is not None and support.isSupportedDevice:
            samples = [self._query(nv.nvmlGpmSampleAlloc) for _ in range(2)]
            gpu.samples = [s for s in samples if s is not None]
            gpu.gpm = len(gpu.samples) == 2
        return gpu

    @property
    def gpu_indices(self) -> list[int]:
        return [g.index for g in self._gpus]

    # -- sampling -----------------------------------------------------------------------------
    def _query(self, fn: Callable, *args):
        """fn(*args), or None when the GPU does not support it; GpuLost on any other error."""
        try:
            return fn(*args)
        except self._nv.NVMLError as e:
            if e.value in self._unavailable:
                return None
            raise GpuLost(str(e)) from None

    def poll(self) -> list[dict]:
        """One `gpu` row per GPU still answering. A GPU that fails other than for an unsupported
        field (lost, fallen off the bus, unknown error) goes to `on_lost` once and is not asked
        again (the phase source counts `nvml.gpu_lost` and closes its window at its last row);
        the others keep being sampled."""
        rows = []
        for gpu in list(self._gpus):
            try:
                rows.append(self._sample(gpu))
            except GpuLost as e:
                self._gpus.remove(gpu)
                self._free_samples(gpu)
                self._on_lost(gpu.index, str(e))
        return rows

    def _sample(self, gpu: _Gpu) -> dict:
        nv, h = self._nv, gpu.handle
        ts = time.monotonic_ns()
        gpm = self._gpm(gpu, ts) if gpu.gpm else None
        util = self._query(nv.nvmlDeviceGetUtilizationRates, h)
        power_mw = self._query(nv.nvmlDeviceGetPowerUsage, h)
        rx, tx = self._pcie(gpu, gpm)
        return {
            "ts_ns": ts, "gpu": gpu.index, "uuid": gpu.uuid,
            "gpu_util_pct": None if util is None else float(util.gpu),
            "mem_util_pct": None if util is None else float(util.memory),
            "sm_active_pct": (gpm or {}).get(GPM_SM_UTIL),
            "tensor_active_pct": (gpm or {}).get(GPM_ANY_TENSOR_UTIL),
            "dram_bw_util_pct": (gpm or {}).get(GPM_DRAM_BW_UTIL),
            "power_w": None if power_mw is None else power_mw / 1000.0,
            "pcie_rx_bytes_per_s": rx, "pcie_tx_bytes_per_s": tx,
            "process_util": self._process_util(gpu),
        }

    def _gpm(self, gpu: _Gpu, now_ns: int) -> dict | None:
        """The GPM metrics of the last window of >= 100 ms: NVML takes them from two samples,
        and shorter windows read as zero or NaN. A poll sooner than that takes no sample and
        gets the last completed window's values, not NULL, so that a poll a few microseconds
        early does not read as "GPM unsupported"; only a GPU's first rows have none."""
        if gpu.prev_gpm_ns is not None and now_ns - gpu.prev_gpm_ns < GPM_MIN_INTERVAL_NS:
            return gpu.gpm_values
        prev, cur = gpu.samples
        if self._query(self._nv.nvmlGpmSampleGet, gpu.handle, cur) is None:
            self._give_up_gpm(gpu)
            return None
        # Stamped once the sample is surely taken: a thread held up between the poll's stamp
        # and the call would otherwise let the next window come out under 100 ms (NaN).
        taken_ns = time.monotonic_ns()
        if gpu.prev_gpm_ns is not None:
            gpu.gpm_values = self._gpm_window(prev, cur)
            if gpu.gpm_values is None:
                self._give_up_gpm(gpu)
                return None
        gpu.samples = [cur, prev]
        gpu.prev_gpm_ns = taken_ns
        return gpu.gpm_values

    def _give_up_gpm(self, gpu: _Gpu) -> None:
        """Support was claimed but sampling is refused: sample this GPU as one without GPM."""
        self._free_samples(gpu)
        gpu.gpm_values = None

    def _gpm_window(self, older, newer) -> dict | None:
        nv = self._nv
        req = nv.c_nvmlGpmMetricsGet_t()
        req.version = nv.NVML_GPM_METRICS_GET_VERSION
        req.numMetrics = len(GPM_METRICS)
        req.sample1, req.sample2 = older, newer
        for i, metric in enumerate(GPM_METRICS):
            req.metrics[i].metricId = metric
        if self._query(nv.nvmlGpmMetricsGet, req) is None:
            return None
        out = {}
        for i in range(len(GPM_METRICS)):
            m = req.metrics[i]
            ok = m.nvmlReturn == nv.NVML_SUCCESS and math.isfinite(m.value)
            out[m.metricId] = float(m.value) if ok else None
        return out

    def _pcie(self, gpu: _Gpu, gpm: dict | None) -> tuple[float | None, float | None]:
        """(rx, tx) bytes a second; on GPM GPUs from the GPM window: nvmlDeviceGetPcieThroughput
        measures 20 ms per call and direction, which on several GPUs would not fit in the
        100 ms between the phase source's polls."""
        if gpu.gpm and gpm is None:
            return None, None  # the first GPM window is not complete yet
        if gpm and gpm.get(GPM_PCIE_RX_PER_SEC) is not None:
            tx = gpm.get(GPM_PCIE_TX_PER_SEC)
            return gpm[GPM_PCIE_RX_PER_SEC] * MIB, None if tx is None else tx * MIB
        nv = self._nv
        rx = self._query(nv.nvmlDeviceGetPcieThroughput, gpu.handle, nv.NVML_PCIE_UTIL_RX_BYTES)
        tx = self._query(nv.nvmlDeviceGetPcieThroughput, gpu.handle, nv.NVML_PCIE_UTIL_TX_BYTES)
        return (None if rx is None else rx * KIB), (None if tx is None else tx * KIB)

    def _process_util(self, gpu: _Gpu) -> str | None:
        """JSON {pid: sm_util_pct} of the samples newer than the last poll's; "{}" when no
        process reported a new one."""
        samples = self._query(self._processes, gpu.handle, gpu.proc_since_us)
        if samples is None:
            return None
        latest: dict[int, tuple[int, int]] = {}
        for s in samples:
            if s.pid not in latest or s.timeStamp >= latest[s.pid][0]:
                latest[s.pid] = (s.timeStamp, s.smUtil)
        if latest:
            gpu.proc_since_us = max(ts for ts, _ in latest.values())
        return json.dumps({str(pid): util for pid, (_, util) in sorted(latest.items())})

    def _processes(self, handle, since_us: int) -> list:
        try:
            return self._nv.nvmlDeviceGetProcessUtilization(handle, since_us)
        except self._nv.NVMLError_NotFound:
            return []  # NVML's way of saying "no sample newer than since_us"

    # -- the end ------------------------------------------------------------------------------
    def close(self) -> None:
        """Free the GPM buffers and shut NVML down; later calls do nothing."""
        if self._closed:
            return
        self._closed = True
        for gpu in self._gpus:
            self._free_samples(gpu)
        self._shutdown()

    def _free_samples(self, gpu: _Gpu) -> None:
        for s in gpu.samples:
            try:
                self._nv.nvmlGpmSampleFree(s)
            except self._nv.NVMLError:
                pass  # a lost GPU's buffers are the driver's problem now
        gpu.samples, gpu.gpm = [], False

    def _shutdown(self) -> None:
        _shutdown(self._nv)


_DRIVER_FIX = "install the NVIDIA driver (libnvidia-ml.so.1)"


class _Unavailable(Exception):
    def __init__(self, reason: str, fix: str) -> None:
        super().__init__(reason)
        self.reason, self.fix = reason, fix


def _init_nvml():
    """pynvml, initialised; _Unavailable with a one-line reason and its fix otherwise."""
    try:
        import pynvml
    except ImportError as e:
        raise _Unavailable(str(e), "install nvidia-ml-py") from None
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as e:
        raise _Unavailable(str(e), _DRIVER_FIX) from None
    return pynvml


def _shutdown(nv) -> None:
    try:
        nv.nvmlShutdown()
    except nv.NVMLError:
        pass  # nothing left to release
