"""The phase sources' facts, one descriptor each: rank, target, engine figures, roles, help.

`--phases` offers these kinds; schema derives SOURCE_RANK, ENGINE_MEANS and ENGINE_TOKENS from
them, roles.py the engines' process roles, the CLI its help, and kvprof/phases/registry.py adds
how each is found and built. Apart from the registry because schema and roles sit below the
phase sources; standard library only, so that the CLI reads them without pyarrow.
tests/unit/test_descriptors.py fails while a kind misses a part."""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field


@dataclass(frozen=True)
class PhaseSourceKind:
    """The facts of one `--phases` source; kvprof/phases/registry.py adds how it is found and
    built."""

    kind: str  # the --phases name
    help: str  # one line for `kvprof record -h`, beside the usage: 53 columns at most
    target: str | None = None  # what =TARGET names (URL, ENDPOINT); None: it takes none
    default_target: str | None = None
    # The `source` its phase rows carry, and how exact their windows are (SOURCE_RANK);
    # None: it brings no windows (kv_event rows only, or it only chooses other sources).
    label: str | None = None
    rank: int | None = None
    # Engine figures its counters give: figure -> (numerator, denominator) series pairs
    # (ENGINE_MEANS), figure -> token counters (ENGINE_TOKENS).
    means: Mapping[str, tuple[tuple[str, str], ...]] = field(default_factory=dict)
    tokens: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    # (pattern on a command line, role) for the engine's processes (roles.py); `\1` takes
    # the engine's own name for the process.
    roles: tuple[tuple[str, str], ...] = ()
    # Runs in a thread of its own, built by the registry; False: its windows come on the
    # marker socket (always received), or it only picks other sources (auto).
    built: bool = True


# Engines name their processes with setproctitle, which rewrites the command line: vLLM
# `VLLM::EngineCore_DP0`, `VLLM::Worker_TP1`, `VLLM::APIServer` (prefix from
# VLLM_PROCESS_NAME_PREFIX, see ../shared/reference/engines.md); SGLang
# `sglang::scheduler_TP0`, `sglang::detokenizer`. Processes that keep their plain command
# line are known by what they run. First match wins, in the order of PHASE_SOURCES.
PHASE_SOURCES: tuple[PhaseSourceKind, ...] = (
    # Marks sent by an engine hook and marks sent by hand both name the exact moment, so
    # they rank together above scraped metrics.
    PhaseSourceKind("marks", "windows sent to the marker socket (always received)",
                    label="manual", rank=3, built=False),
    PhaseSourceKind("vllm-plugin", "vLLM's kvprof plugin: a window per engine step",
                    label="hook", rank=3, built=False),
    PhaseSourceKind(
        "vllm-metrics", "vLLM's Prometheus /metrics, scraped", target="URL",
        default_target="http://127.0.0.1:8000/metrics", label="metrics", rank=2,
        means={"ttft_s": (("vllm:time_to_first_token_seconds_sum",
                           "vllm:time_to_first_token_seconds_count"),),
               "itl_s": (("vllm:inter_token_latency_seconds_sum",
                          "vllm:inter_token_latency_seconds_count"),
                         ("vllm:time_per_output_token_seconds_sum",
                          "vllm:time_per_output_token_seconds_count")),
               "prefix_cache_hit_share": (("vllm:prefix_cache_hits_total",
                                           "vllm:prefix_cache_queries_total"),)},
        tokens={"prompt_tokens": ("vllm:prompt_tokens_total",),
                "generation_tokens": ("vllm:generation_tokens_total",)},
        roles=((r"^VLLM::EngineCore", "vllm EngineCore"),
               (r"^VLLM::Worker", "vllm worker"),
               (r"^VLLM::APIServer", "vllm API server"),
               (r"^VLLM::(\w+?)(?:_\w+)?\b", r"vllm \1"),
               (r"(^|\s|/)vllm\s+serve\b|vllm\.entrypoints", "vllm API server"))),
    PhaseSourceKind("vllm-kv-events", "vLLM's KV cache events (ZMQ): kv_event rows only",
                    target="ENDPOINT", default_target="tcp://127.0.0.1:5557"),
    PhaseSourceKind("sglang-fpm", "SGLang's forward pass metrics (ZMQ): a window a step",
                    target="ENDPOINT", label="hook", rank=3),
    PhaseSourceKind(
        "sglang-metrics", "SGLang's Prometheus /metrics, scraped", target="URL",
        default_target="http://127.0.0.1:30000/metrics", label="metrics", rank=2,
        means={"ttft_s": (("sglang:time_to_first_token_seconds_sum",
                           "sglang:time_to_first_token_seconds_count"),),
               "itl_s": (("sglang:inter_token_latency_seconds_sum",
                          "sglang:inter_token_latency_seconds_count"),)},
        tokens={"prompt_tokens": ("sglang:prompt_tokens_total",),
                "generation_tokens": ("sglang:generation_tokens_total",)},
        roles=((r"^sglang::scheduler", "sglang scheduler"),
               (r"^sglang::(\w+?)(?:_TP\d+.*)?$", r"sglang \1"),
               (r"sglang\.launch_server|(^|\s|/)sglang\s+serve\b", "sglang server"))),
    PhaseSourceKind(
        "tgi-metrics", "TGI's Prometheus /metrics, scraped", target="URL",
        default_target="http://127.0.0.1:9000/metrics", label="metrics", rank=2,
        means={"itl_s": (("tgi_request_mean_time_per_token_duration_sum",
                          "tgi_request_mean_time_per_token_duration_count"),)},
        roles=((r"text-generation-launcher", "tgi launcher"),
               (r"text-generation-router", "tgi router"),
               (r"text-generation-server", "tgi shard"))),
    PhaseSourceKind("nvml", "GPU activity sampled through NVML, as windows",
                    label="nvml", rank=1),
    PhaseSourceKind("auto", "discover running engines' sources, nvml with a GPU", built=False),
)
PHASE_SOURCE_KINDS = {s.kind: s for s in PHASE_SOURCES}
