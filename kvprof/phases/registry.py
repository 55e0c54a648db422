"""The phase sources, one `PhaseSourceKind` each: facts (target, window label and rank, engine
figures, process roles, help), the class that runs it and how `auto` finds it.

Schema, roles and the CLI read this table, so it imports only the standard library: a source's
module is loaded by name when it is built. tests/unit/test_descriptors.py checks every entry."""
from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from importlib import import_module
from pathlib import Path
from typing import Any

from kvprof.errors import EX_USAGE, KvprofError


@dataclass(frozen=True)
class Discovery:
    """How `auto` finds a source: a process whose command line matches `engine` runs it, at
    the target `target` reads from its arguments (None: this one does not)."""

    engine: re.Pattern[str]
    target: Callable[[list[str]], str | None]


@dataclass(frozen=True)
class PhaseSourceKind:
    """One `--phases` source."""

    kind: str  # the --phases name
    help: str  # one line for `kvprof record -h`, beside the usage: 53 columns at most
    target: str | None = None  # what =TARGET names (URL, ENDPOINT); None: it takes none
    default_target: str | None = None
    # The `source` its phase rows carry, and how exact their windows are (SOURCE_RANK);
    # None: it brings no windows (kv_event rows only, or it only chooses other sources).
    label: str | None = None
    rank: int | None = None
    # Engine figures its counters give: figure -> (numerator, denominator) series pairs
    # (ENGINE_MEANS), figure -> token counters (TOKENS_BY_ENGINE).
    means: Mapping[str, tuple[tuple[str, str], ...]] = field(default_factory=dict)
    tokens: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    # What the engine says of its KV offload: figure -> counters (OFFLOAD_BY_ENGINE): tokens its
    # connector supplied and was asked for, the bytes those hits make, what its storage tiers
    # loaded and stored (bytes or tokens) and the time they took.
    offload: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    # (pattern on a command line, role) for the engine's processes (roles.py); `\1` takes
    # the engine's own name for the process.
    roles: tuple[tuple[str, str], ...] = ()
    # The engine whose counters these are: its sources count the same tokens (schema
    # counts them once); None: the kind's own.
    engine: str | None = None
    # "module:Class" in kvprof.phases, built with its target (when it takes one) and run in a
    # thread of its own; None: its windows come on the marker socket (always received), or it
    # only picks other sources (auto).
    source: str | None = None
    discover: Discovery | None = None


def _flag(argv: list[str], name: str) -> str | None:
    for i, a in enumerate(argv):
        if a == name and i + 1 < len(argv):
            return argv[i + 1]
        if a.startswith(name + "="):
            return a.split("=", 1)[1]
    return None


def _metrics_url(port_flag: str, default_port: str) -> Callable[[list[str]], str]:
    return lambda argv: f"http://127.0.0.1:{_flag(argv, port_flag) or default_port}/metrics"


def _kv_events_endpoint(argv: list[str]) -> str | None:
    m = re.search(r'"endpoint"\s*:\s*"([^"]+)"', _flag(argv, "--kv-events-config") or "")
    return m.group(1).replace("*", "127.0.0.1") if m else None


VLLM = re.compile(r"\bvllm\b.*\bserve\b|vllm\.entrypoints")
SGLANG = re.compile(r"sglang\.launch_server|\bsglang\b.*\bserve\b")
TGI = re.compile(r"text-generation-launcher|text-generation-router")

# Engines name their processes with setproctitle, which rewrites the command line: vLLM
# `VLLM::EngineCore_DP0`, `VLLM::Worker_TP1`, `VLLM::APIServer` (prefix from
# VLLM_PROCESS_NAME_PREFIX, see ../shared/reference/engines.md); SGLang
# `sglang::scheduler_TP0`, `sglang::detokenizer`. Processes that keep their plain command
# line are known by what they run. First match wins, in the order of PHASE_SOURCES (the
# order in which `auto` lists an engine's sources too).
PHASE_SOURCES: tuple[PhaseSourceKind, ...] = (
    # Marks sent by an engine hook and marks sent by hand both name the exact moment, so
    # they rank together above scraped metrics.
    PhaseSourceKind("marks", "windows sent to the marker socket (always received)",
                    label="manual", rank=3),
    # The plugin's windows carry how far vLLM's own counters moved in each step (the same
    # figures vLLM's Prometheus logger counts, from the same stats), under these names.
    PhaseSourceKind(
        "vllm-plugin", "vLLM's kvprof plugin: a window per engine step", label="hook", rank=3,
        engine="vllm",
        means={"ttft_s": (("vllm-plugin:time_to_first_token_seconds_sum",
                           "vllm-plugin:time_to_first_token_seconds_count"),),
               "itl_s": (("vllm-plugin:inter_token_latency_seconds_sum",
                          "vllm-plugin:inter_token_latency_seconds_count"),),
               "prefix_cache_hit_share": (("vllm-plugin:prefix_cache_hits_total",
                                           "vllm-plugin:prefix_cache_queries_total"),)},
        tokens={"prompt_tokens": ("vllm-plugin:prompt_tokens_total",),
                "generation_tokens": ("vllm-plugin:generation_tokens_total",)},
        offload={"hit_tokens": ("vllm-plugin:external_prefix_cache_hits_total",),
                 "query_tokens": ("vllm-plugin:external_prefix_cache_queries_total",),
                 "hit_bytes": ("vllm-plugin:external_prefix_cache_hit_bytes_total",)}),
    PhaseSourceKind(
        "vllm-metrics", "vLLM's Prometheus /metrics, scraped", target="URL",
        default_target="http://127.0.0.1:8000/metrics", label="metrics", rank=2, engine="vllm",
        source="metrics:VllmMetrics", discover=Discovery(VLLM, _metrics_url("--port", "8000")),
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
        # Its storage tiers' own counts (vLLM's tiering: file reads and writes, keys x chunk
        # size; LMCache's, served through vLLM's /metrics: stored tokens, time in its
        # retrieves and stores). Names as their code registers them, not seen running here.
        offload={"hit_tokens": ("vllm:external_prefix_cache_hits_total",),
                 "query_tokens": ("vllm:external_prefix_cache_queries_total",),
                 "loaded_bytes": ("vllm:kv_offload_tiering_read_bytes_total",),
                 "stored_bytes": ("vllm:kv_offload_tiering_write_bytes_total",),
                 "stored_tokens": ("lmcache:num_stored_tokens_total",),
                 "load_time_s": ("vllm:kv_offload_tiering_read_time_total",
                                 "lmcache:time_to_retrieve_sum"),
                 "store_time_s": ("vllm:kv_offload_tiering_write_time_total",
                                  "lmcache:time_to_store_sum")},
        roles=((r"^VLLM::EngineCore", "vllm EngineCore"),
               (r"^VLLM::Worker", "vllm worker"),
               (r"^VLLM::APIServer", "vllm API server"),
               (r"^VLLM::(\w+?)(?:_\w+)?\b", r"vllm \1"),
               (r"(^|\s|/)vllm\s+serve\b|vllm\.entrypoints", "vllm API server"))),
    PhaseSourceKind("vllm-kv-events", "vLLM's KV cache events (ZMQ): kv_event rows only",
                    target="ENDPOINT", default_target="tcp://127.0.0.1:5557",
                    source="zmq_sources:VllmKvEvents",
                    discover=Discovery(VLLM, _kv_events_endpoint)),
    PhaseSourceKind("sglang-fpm", "SGLang's forward pass metrics (ZMQ): a window a step",
                    target="ENDPOINT", label="hook", rank=3, source="zmq_sources:SglangFpm"),
    PhaseSourceKind(
        "sglang-metrics", "SGLang's Prometheus /metrics, scraped", target="URL",
        default_target="http://127.0.0.1:30000/metrics", label="metrics", rank=2,
        engine="sglang",
        source="metrics:SglangMetrics",
        discover=Discovery(SGLANG, _metrics_url("--port", "30000")),
        means={"ttft_s": (("sglang:time_to_first_token_seconds_sum",
                           "sglang:time_to_first_token_seconds_count"),),
               "itl_s": (("sglang:inter_token_latency_seconds_sum",
                          "sglang:inter_token_latency_seconds_count"),)},
        tokens={"prompt_tokens": ("sglang:prompt_tokens_total",),
                "generation_tokens": ("sglang:generation_tokens_total",)},
        # HiCache's storage tier: tokens prefetched from it and backed up to it (its
        # collector's names, not seen running here).
        offload={"loaded_tokens": ("sglang:prefetched_tokens_total",),
                 "stored_tokens": ("sglang:backuped_tokens_total",)},
        roles=((r"^sglang::scheduler", "sglang scheduler"),
               (r"^sglang::(\w+?)(?:_TP\d+.*)?$", r"sglang \1"),
               (r"sglang\.launch_server|(^|\s|/)sglang\s+serve\b", "sglang server"))),
    PhaseSourceKind(
        "tgi-metrics", "TGI's Prometheus /metrics, scraped", target="URL",
        default_target="http://127.0.0.1:9000/metrics", label="metrics", rank=2,
        source="metrics:TgiMetrics",
        discover=Discovery(TGI, _metrics_url("--prometheus-port", "9000")),
        means={"itl_s": (("tgi_request_mean_time_per_token_duration_sum",
                          "tgi_request_mean_time_per_token_duration_count"),)},
        roles=((r"text-generation-launcher", "tgi launcher"),
               (r"text-generation-router", "tgi router"),
               (r"text-generation-server", "tgi shard"))),
    PhaseSourceKind("nvml", "GPU activity sampled through NVML, as windows",
                    label="nvml", rank=1, source="nvml:NvmlSource"),
    PhaseSourceKind("auto", "discover running engines' sources, nvml with a GPU"),
)
PHASE_SOURCE_KINDS = {s.kind: s for s in PHASE_SOURCES}


@dataclass(frozen=True)
class SourceSpec:
    kind: str
    target: str | None = None

    def __str__(self) -> str:
        return f"{self.kind}={self.target}" if self.target else self.kind


def parse(spec: str) -> SourceSpec:
    kind, _, target = spec.partition("=")
    facts = PHASE_SOURCE_KINDS.get(kind)
    if facts is None:
        raise KvprofError(f"unknown phase source {kind!r}; one of: "
                          f"{', '.join(PHASE_SOURCE_KINDS)}", EX_USAGE)
    chosen = target or facts.default_target
    if facts.target and not chosen:
        raise KvprofError(f"phase source {kind} needs a target: --phases {kind}={facts.target}",
                          EX_USAGE)
    return SourceSpec(kind, chosen or None)


def discover(proc: Path = Path("/proc")) -> list[SourceSpec]:
    """Serving engines running on this host, from their command lines, most exact source
    first per engine. Nothing found: an empty list (marks still work)."""
    found: list[SourceSpec] = []
    pids = sorted((d for d in proc.iterdir() if d.name.isdigit()), key=lambda d: int(d.name)) \
        if proc.is_dir() else []
    finders = [(s.kind, s.discover) for s in PHASE_SOURCES if s.discover]
    for d in pids:
        try:
            raw = (d / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        argv = [a.decode(errors="replace") for a in raw if a]
        line = " ".join(argv)
        # A process is one engine: the first whose command line it matches.
        engine = next((f.engine for _, f in finders if f.engine.search(line)), None)
        for kind, f in finders:
            if f.engine is engine and (target := f.target(argv)):
                found.append(SourceSpec(kind, target))
    return list(dict.fromkeys(found))


def resolve_specs(specs: list[str], gpu_present: Callable[[], bool],
                  log: Callable[[str], None] | None = None) -> list[SourceSpec]:
    """The sources to run in threads of their own. `auto` (the default) adds what discovery
    finds, plus NVML when `gpu_present()`; explicit sources are taken as given."""
    parsed = [parse(s) for s in specs] or [SourceSpec("auto")]
    out: list[SourceSpec] = []
    for p in parsed:
        if p.kind == "auto":
            found = discover()
            out += found
            if gpu_present():
                out.append(SourceSpec("nvml"))
            if log:
                log("phase sources (auto): marks" + "".join(f", {s}" for s in out))
        elif PHASE_SOURCE_KINDS[p.kind].source:
            out.append(p)
    return list(dict.fromkeys(out))


def build(spec: SourceSpec) -> Any:
    """The source `spec` names, its module imported now so that unused sources cost nothing."""
    facts = PHASE_SOURCE_KINDS.get(spec.kind)
    if facts is None or facts.source is None:
        raise KvprofError(f"phase source {spec.kind} cannot be built", EX_USAGE)
    if facts.target and not spec.target:  # parse() refuses this; a spec made by hand may not
        raise KvprofError(f"phase source {spec.kind} needs a target: "
                          f"--phases {spec.kind}={facts.target}", EX_USAGE)
    module, _, name = facts.source.partition(":")
    cls = getattr(import_module(f"{__package__}.{module}"), name)
    return cls(spec.target) if facts.target else cls()
