"""A vLLM stat logger that sends one phase window per engine step to a running kvprof.

vLLM loads it in the API-server process through the `vllm.stat_logger_plugins` entry point
(kvprof's packaging registers it) unless `VLLM_PLUGINS` lists others, and calls record() once
per output batch of a step. Windows go over the marker protocol (a `Marker`, which counts what it
cannot deliver) to `KVPROF_SOCKET` (default /run/kvprof/marks.sock), source "hook". vLLM's stat
interfaces are not stable: every attribute is read defensively, nothing raised reaches vLLM."""
from __future__ import annotations

import logging
import time
from typing import Any

from kvprof.markers import Marker, step_phase

# Under vLLM's own logger, so its handlers and level apply and the lines land in its log.
_log = logging.getLogger("vllm.kvprof")

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


def clock_pair(tries: int = 4) -> tuple[int, int]:
    """CLOCK_MONOTONIC and the wall clock at one instant, in ns. vLLM stamps a batch's arrival
    with the wall clock; the window needs it on the monotonic one. Read apart, the two can lie
    milliseconds apart when the process is preempted between them, more than a step's own KV
    store may precede its batch's arrival: such an error puts the store after its window. So
    the wall clock is read between two monotonic reads and the tightest of a few tries is kept."""
    best = (1 << 62, 0, 0)
    for _ in range(tries):
        m0 = time.monotonic_ns()
        wall = time.time_ns()
        m1 = time.monotonic_ns()
        if m1 - m0 < best[0]:
            best = (m1 - m0, (m0 + m1) // 2, wall)
        if m1 - m0 < 20_000:  # no preemption between the reads
            break
    return best[1], best[2]


# The attribute of a batch's IterationStats that lists when the engine core first scheduled
# each request whose prefill the batch completed (engine-core CLOCK_MONOTONIC seconds).
SCHEDULED = "kvprof_scheduled_ts"


def keep_scheduled_times() -> bool:
    """Have vLLM's IterationStats keep, per output batch, when the engine core scheduled each
    request whose prefill the batch completed. vLLM tracks that per request
    (`RequestStateStats.scheduled_ts`) but hands stat loggers only the batch's IterationStats,
    and the time only once the request finishes, so `IterationStats.update_from_output` (called
    per request of a batch before any logger runs) is wrapped to note it. Once per process;
    False where vLLM's class is missing or differs (windows then use the time to first token)."""
    try:
        from vllm.v1.metrics.stats import IterationStats
        original = IterationStats.update_from_output
    except Exception:  # noqa: BLE001 - no vLLM, or another layout
        return False
    if getattr(original, "kvprof_wrapped", False):
        return True

    def update_from_output(self: Any, output: Any, engine_core_timestamp: Any,
                           is_prefilling: Any, req_stats: Any, *args: Any, **kwargs: Any) -> Any:
        result = original(self, output, engine_core_timestamp, is_prefilling, req_stats,
                          *args, **kwargs)
        if is_prefilling:
            try:
                ts = req_stats.scheduled_ts
                if isinstance(ts, float) and ts > 0:
                    self.__dict__.setdefault(SCHEDULED, []).append(ts)
            except Exception:  # noqa: BLE001 - never break vLLM's own accounting
                pass
        return result

    update_from_output.kvprof_wrapped = True  # type: ignore[attr-defined]
    IterationStats.update_from_output = update_from_output
    return True


# The series of vLLM's own counters the windows carry (kvprof/phases/registry.py).
PREFIX = "vllm-plugin:"


def kv_bytes_per_token(vllm_config: Any) -> int | None:
    """The bytes of KV cache a token takes in the whole model (all ranks), where vLLM's config
    says: the cache's budget over its size in tokens, as `vllm:cache_config_info` gives them
    where the budget was set (`kv_cache_memory_bytes`), else K and V of every layer and KV
    head in the cache's dtype, over every rank. None where neither can be read (then hits
    are counted as tokens only)."""
    try:
        cache = vllm_config.cache_config
        budget, size = cache.kv_cache_memory_bytes, cache.kv_cache_size_tokens
        if isinstance(budget, int) and isinstance(size, int) and budget > 0 and size > 0:
            return budget // size
        model, parallel = vllm_config.model_config, vllm_config.parallel_config
        element = 1 if "fp8" in str(cache.cache_dtype) else \
            _DTYPE_BYTES[str(model.dtype).removeprefix("torch.")]
        per_rank = (2 * model.get_num_layers(parallel) * model.get_num_kv_heads(parallel)
                    * model.get_head_size() * element)
        return int(per_rank * parallel.tensor_parallel_size * parallel.pipeline_parallel_size)
    except Exception:  # noqa: BLE001 - another vLLM, or no vLLM: hits are counted as tokens
        return None


_DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}


def _count(obj: Any, name: str) -> int | None:
    """A non-negative integer attribute, or None when it is missing or not a count."""
    v = getattr(obj, name, None)
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        return None
    return v


def _seconds(values: Any) -> list[float]:
    """The non-negative finite floats of a list attribute (latencies, in seconds)."""
    if not isinstance(values, (list, tuple)):
        return []
    return [float(v) for v in values if isinstance(v, (int, float)) and not isinstance(v, bool)
            and 0 <= v < 1e6]


class KvprofStatLogger(StatLoggerBase):
    """Per-engine stat logger: vLLM builds one per engine with `(vllm_config, engine_index)`."""

    # How far back the batch's arrival may lie behind record(); a larger difference is a
    # clock step (time.time() is the wall clock), not processing time.
    max_lag_s = 1.0

    def __init__(self, vllm_config: Any = None, engine_index: int = 0, **kwargs: Any) -> None:
        # vLLM's base __init__ is abstract and does nothing; not calling it keeps a future
        # signature change from failing here.
        self.vllm_config = vllm_config
        self.engine_index = engine_index if isinstance(engine_index, int) else 0
        self.marker = Marker(engine=f"vllm:{self.engine_index}", source="hook")
        self.sent = 0
        self.errors = 0
        self.skipped: dict[str, int] = {}  # steps with tokens that got no window, by why
        self._last_end: dict[int, int] = {}
        # How far vLLM's counters moved since the last window sent, per engine index: a step
        # that gets no window hands its counts to the next.
        self._moved: dict[int, dict[str, float]] = {}
        self.kv_bytes_per_token = kv_bytes_per_token(vllm_config)
        keep_scheduled_times()
        # The one line vLLM's log shows at start: what the plugin does and where it sends.
        _log.info("kvprof: a phase window per step of engine %d, timed by vLLM's own "
                  "measurements (no vLLM option needed), to %s", self.engine_index,
                  self.marker.path)

    def _skip(self, why: str) -> None:
        self.marker.skip()  # the session counts it (marks_unsent): no step lost silently
        n = self.skipped[why] = self.skipped.get(why, 0) + 1
        if n == 1:
            _log.warning("kvprof: an engine step got no phase window (%s); counted, said once",
                         why)

    def record(self, scheduler_stats: Any, iteration_stats: Any, mm_cache_stats: Any = None,
               engine_idx: int = 0, **kwargs: Any) -> None:
        now = time.monotonic_ns()
        try:
            self._record(scheduler_stats, iteration_stats, engine_idx, now)
        except Exception:  # noqa: BLE001 - profiling must never break serving
            self.errors += 1
            self.marker.skip()
            if self.errors == 1:
                _log.warning("kvprof: the phase plugin failed on vLLM's stats (said once)",
                             exc_info=True)

    def _count_moved(self, scheduler_stats: Any, iteration_stats: Any, engine_idx: int) -> None:
        """Add what vLLM's Prometheus logger counts from these same stats to the engine's
        pending counters (series of the registry's `vllm-plugin` entry)."""
        moved = self._moved.setdefault(engine_idx, {})

        def add(name: str, amount: float, keep: bool = False) -> None:
            """`keep`: carried even at zero (no hits out of queries asked is a count)."""
            if amount or keep:
                moved[PREFIX + name] = moved.get(PREFIX + name, 0.0) + amount

        cache = getattr(scheduler_stats, "prefix_cache_stats", None)
        asked = _count(cache, "queries") or 0
        add("prefix_cache_queries_total", asked)
        add("prefix_cache_hits_total", _count(cache, "hits") or 0, keep=asked > 0)
        # The KV connector's: tokens it was asked for and said it had (offload hits).
        connector = getattr(scheduler_stats, "connector_prefix_cache_stats", None)
        hits, asked = _count(connector, "hits") or 0, _count(connector, "queries") or 0
        add("external_prefix_cache_queries_total", asked)
        add("external_prefix_cache_hits_total", hits, keep=asked > 0)
        if self.kv_bytes_per_token:
            add("external_prefix_cache_hit_bytes_total", hits * self.kv_bytes_per_token,
                keep=asked > 0)
        if iteration_stats is None:
            return
        add("prompt_tokens_total", _count(iteration_stats, "num_prompt_tokens") or 0)
        add("generation_tokens_total", _count(iteration_stats, "num_generation_tokens") or 0)
        for series, attr in (("time_to_first_token_seconds", "time_to_first_tokens_iter"),
                             ("inter_token_latency_seconds", "inter_token_latencies_iter")):
            seen = _seconds(getattr(iteration_stats, attr, None))
            add(series + "_sum", sum(seen))
            add(series + "_count", len(seen))

    def _record(self, scheduler_stats: Any, iteration_stats: Any, engine_idx: int,
                now: int) -> None:
        self._count_moved(scheduler_stats, iteration_stats, engine_idx)
        details = getattr(scheduler_stats, "iteration_details", None)
        if details is not None and getattr(details, "is_dummy", False):
            return  # a DP padding step: no request ran
        tokens = self._tokens(details, iteration_stats)
        if tokens is None:
            return
        prefill, decode = tokens
        phase = step_phase(prefill, decode)
        if phase == "idle":
            if iteration_stats is not None:
                self._skip("it carried no tokens")
            return
        end = self._end(iteration_stats, now)
        begun = self._start(details, iteration_stats, end)
        if begun is None:
            self._skip("vLLM measured no time for it")
            return
        # Never before the engine's previous window ended: windows do not overlap, and a
        # request that waited behind other steps does not bring that wait into this one.
        start = max(begun, self._last_end.get(engine_idx, 0))
        if start >= end:
            self._skip("it ended before the previous step did")
            return
        self._last_end[engine_idx] = end
        # Counts go with this window whether or not it arrives: a window lost is counted,
        # and counts held back for a recorder not yet listening would land in a later span.
        moved = self._moved.pop(engine_idx, None)
        if self.marker.window(phase, start, end, engine=f"vllm:{engine_idx}",
                              prefill_tokens=prefill, decode_tokens=decode, counters=moved):
            self.sent += 1

    @staticmethod
    def _tokens(details: Any, iteration_stats: Any) -> tuple[int, int] | None:
        """(prefill, decode) tokens of the batch: `SchedulerStats.iteration_details` where vLLM
        fills it (`--enable-logging-iteration-details`), else the batch's IterationStats: the
        prompt tokens of the prefills it completed (as `vllm:prompt_tokens_total`) and the
        generated tokens less those prefills' first tokens."""
        if details is not None:
            prefill = _count(details, "num_ctx_tokens")
            decode = _count(details, "num_generation_tokens")
            if prefill is not None and decode is not None:
                return prefill, decode
        if iteration_stats is None:
            return None
        prompt = getattr(iteration_stats, "prompt_token_stats", None)
        prefill = _count(prompt, "total")
        if prefill is None:
            prefill = _count(iteration_stats, "num_prompt_tokens") or 0
        generated = _count(iteration_stats, "num_generation_tokens") or 0
        # Each request whose prefill completed in this batch also produced its first token;
        # that token came out of a prefill pass, not a decode step.
        firsts = len(_seconds(getattr(iteration_stats, "time_to_first_tokens_iter", None)))
        return prefill, max(0, generated - firsts)

    def _end(self, iteration_stats: Any, now: int) -> int:
        """When the batch reached the API server (`IterationStats.iteration_timestamp`, so the
        front end's own processing is not counted), on the monotonic clock."""
        arrived = getattr(iteration_stats, "iteration_timestamp", None)
        if isinstance(arrived, float):
            mono, wall = clock_pair()
            lag = wall - int(arrived * 1e9)
            if 0 <= lag <= self.max_lag_s * 1e9:
                return mono - lag
        return now

    @staticmethod
    def _start(details: Any, iteration_stats: Any, end: int) -> int | None:
        """When the step began (ns, CLOCK_MONOTONIC), from what vLLM measured for this very
        step; None when it measured nothing. A step that advanced decoding requests: their
        inter-token latency (the shortest; a resumed request's is longer). One that only
        finished prefills: when the engine core scheduled the earliest (keep_scheduled_times),
        else the longest time to first token (from arrival in the API server, so it holds the
        hand-off to the engine core). Else `elapsed_ms`, where iteration details are on."""
        itls = _seconds(getattr(iteration_stats, "inter_token_latencies_iter", None))
        if itls:
            return end - int(min(itls) * 1e9)
        # Engine-core time.monotonic() seconds, as keep_scheduled_times keeps them: this clock.
        scheduled = getattr(iteration_stats, SCHEDULED, None)
        if isinstance(scheduled, list) and scheduled and int(min(scheduled) * 1e9) < end:
            return int(min(scheduled) * 1e9)
        ttfts = _seconds(getattr(iteration_stats, "time_to_first_tokens_iter", None))
        if ttfts:
            return end - int(max(ttfts) * 1e9)
        elapsed = getattr(details, "elapsed_ms", None) if details is not None else None
        if isinstance(elapsed, (int, float)) and not isinstance(elapsed, bool) and elapsed > 0:
            return end - int(elapsed * 1e6)
        return None

    def log(self) -> None:
        pass

    def log_engine_initialized(self) -> None:
        pass

    def record_sleep_state(self, *args: Any, **kwargs: Any) -> None:
        pass


# Should a later vLLM add an abstract method, instantiating this class would raise inside
# vLLM's start-up; the hooks it would call then fall back to the base's empty bodies instead.
KvprofStatLogger.__abstractmethods__ = frozenset()
