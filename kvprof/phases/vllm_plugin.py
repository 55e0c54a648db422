"""A vLLM stat logger that sends one phase window per engine step to a running kvprof.

Register it under vLLM's `vllm.stat_logger_plugins` entry-point group (kvprof's packaging
does), then start vLLM as usual; vLLM loads every plugin of that group in the API-server
process (AsyncLLM) unless `VLLM_PLUGINS` lists others. Windows go over the marker protocol
(`kvprof.markers`) to the socket in `KVPROF_SOCKET` (default /run/kvprof/marks.sock), with
source "hook" and engine `vllm:<engine index>`. With no kvprof listening they are dropped.

What one step's window is, in order of preference:
- tokens: `SchedulerStats.iteration_details` (num_ctx_tokens as prefill, num_generation_tokens
  as decode; vLLM fills it when `--enable-logging-iteration-details` is set), else the
  `IterationStats` of the same output batch: prompt tokens computed, and generated tokens
  minus the first tokens of requests that just finished prefill (those belong to prefill);
- time: end = when record() runs; start = end - iteration_details.elapsed_ms when vLLM
  measured it, else the previous record() for that engine. The latter covers idle time that
  preceded the step, so gaps longer than `max_gap_s` are not turned into windows.
record() runs in the front-end process after the engine core's output crossed the process
boundary, so windows sit late by that hand-off (typically a millisecond or less).

vLLM's stat interfaces are not stable (its own docstring says so); every attribute is read
defensively and nothing raised here reaches vLLM.
"""
from __future__ import annotations

import time
from typing import Any

from kvprof.markers import Marker, step_phase

try:  # vLLM only accepts subclasses of its own base.
    from vllm.v1.metrics.loggers import StatLoggerBase
    USING_VLLM_BASE = True
except Exception:  # noqa: BLE001 - absent, or present but failing to import: run without it
    USING_VLLM_BASE = False

    class StatLoggerBase:  # type: ignore[no-redef]
        """Stand-in with vLLM's StatLoggerBase methods, so this module imports, and can be
        exercised, where vLLM is not installed. vLLM never sees this class."""

        def __init__(self, vllm_config: Any = None, engine_index: int = 0) -> None:
            pass

        def record(self, scheduler_stats: Any, iteration_stats: Any,
                   mm_cache_stats: Any = None, engine_idx: int = 0) -> None:
            pass

        def log_engine_initialized(self) -> None:
            pass

        def log(self) -> None:
            pass

        def record_sleep_state(self, is_awake: int, level: int) -> None:
            pass


def _count(obj: Any, name: str) -> int | None:
    """A non-negative integer attribute, or None when it is missing or not a count."""
    v = getattr(obj, name, None)
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        return None
    return v


class KvprofStatLogger(StatLoggerBase):
    """Per-engine stat logger: vLLM builds one per engine with `(vllm_config, engine_index)`."""

    # A step longer than this is rare; a gap longer than this between outputs is idle time.
    max_gap_s = 5.0

    def __init__(self, vllm_config: Any = None, engine_index: int = 0, **kwargs: Any) -> None:
        # vLLM's base __init__ is abstract and does nothing; not calling it keeps a future
        # signature change from failing here.
        self.vllm_config = vllm_config
        self.engine_index = engine_index if isinstance(engine_index, int) else 0
        self.marker = Marker(engine=f"vllm:{self.engine_index}", source="hook")
        self.sent = 0
        self.errors = 0
        self._last_ns: dict[int, int] = {}

    def record(self, scheduler_stats: Any, iteration_stats: Any, mm_cache_stats: Any = None,
               engine_idx: int = 0, **kwargs: Any) -> None:
        now = time.monotonic_ns()
        try:
            self._record(scheduler_stats, iteration_stats, engine_idx, now)
        except Exception:  # noqa: BLE001 - profiling must never break serving
            self.errors += 1
        finally:
            # Every output batch ends a step, whether or not it made a window.
            if isinstance(engine_idx, int):
                self._last_ns[engine_idx] = now

    def _record(self, scheduler_stats: Any, iteration_stats: Any, engine_idx: int,
                now: int) -> None:
        details = getattr(scheduler_stats, "iteration_details", None)
        if details is not None and getattr(details, "is_dummy", False):
            return  # a DP padding step: no request ran
        tokens = self._tokens(details, iteration_stats)
        if tokens is None:
            return
        prefill, decode = tokens
        phase = step_phase(prefill, decode)
        if phase == "idle":
            return
        start = self._start(details, engine_idx, now)
        if start is None or start >= now:
            return
        if self.marker.window(phase, start, now, engine=f"vllm:{engine_idx}",
                              prefill_tokens=prefill, decode_tokens=decode):
            self.sent += 1

    @staticmethod
    def _tokens(details: Any, iteration_stats: Any) -> tuple[int, int] | None:
        if details is not None:
            prefill = _count(details, "num_ctx_tokens")
            decode = _count(details, "num_generation_tokens")
            if prefill is not None and decode is not None:
                return prefill, decode
        if iteration_stats is None:
            return None
        prompt = getattr(iteration_stats, "prompt_token_stats", None)
        prefill = _count(prompt, "computed")
        if prefill is None:
            prefill = _count(iteration_stats, "num_prompt_tokens") or 0
        generated = _count(iteration_stats, "num_generation_tokens") or 0
        # Each request whose prefill completed in this batch also produced its first token;
        # that token came out of a prefill pass, not a decode step.
        first = getattr(iteration_stats, "time_to_first_tokens_iter", None)
        firsts = len(first) if isinstance(first, (list, tuple)) else 0
        return prefill, max(0, generated - firsts)

    def _start(self, details: Any, engine_idx: int, now: int) -> int | None:
        elapsed = getattr(details, "elapsed_ms", None) if details is not None else None
        if isinstance(elapsed, (int, float)) and not isinstance(elapsed, bool) and elapsed > 0:
            return now - int(elapsed * 1e6)
        last = self._last_ns.get(engine_idx)
        if last is None or now - last > self.max_gap_s * 1e9:
            return None
        return last

    def log(self) -> None:
        pass

    def log_engine_initialized(self) -> None:
        pass

    def record_sleep_state(self, *args: Any, **kwargs: Any) -> None:
        pass


# Should a later vLLM add an abstract method, instantiating this class would raise inside
# vLLM's start-up; the hooks it would call then fall back to the base's empty bodies instead.
KvprofStatLogger.__abstractmethods__ = frozenset()
