"""`--phases SOURCE[=TARGET]`: which phase sources a recording uses, and `auto` discovery.

Marks on the marker socket are always received; the other sources run beside them, each in
its own thread, and where windows overlap correlate keeps the most exact (hook > metrics >
nvml). A source's facts (rank, target, engine figures, roles, help) are in
kvprof/phase_sources.py, how it is found and built in SOURCES below, under the same kind;
tests/unit/test_descriptors.py fails while the two disagree."""
from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from kvprof.errors import EX_USAGE, KvprofError
from kvprof.phase_sources import PHASE_SOURCE_KINDS


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


def _flag(argv: list[str], name: str) -> str | None:
    for i, a in enumerate(argv):
        if a == name and i + 1 < len(argv):
            return argv[i + 1]
        if a.startswith(name + "="):
            return a.split("=", 1)[1]
    return None


@dataclass(frozen=True)
class Discovery:
    """How `auto` finds a source: a process whose command line matches `engine` runs it, at
    the target `target` reads from its arguments (None: this one does not)."""

    engine: re.Pattern
    target: Callable[[list[str]], str | None]


def _metrics_url(port_flag: str, default_port: str) -> Callable[[list[str]], str]:
    return lambda argv: f"http://127.0.0.1:{_flag(argv, port_flag) or default_port}/metrics"


def _kv_events_endpoint(argv: list[str]) -> str | None:
    m = re.search(r'"endpoint"\s*:\s*"([^"]+)"', _flag(argv, "--kv-events-config") or "")
    return m.group(1).replace("*", "127.0.0.1") if m else None


VLLM = re.compile(r"\bvllm\b.*\bserve\b|vllm\.entrypoints")
SGLANG = re.compile(r"sglang\.launch_server|\bsglang\b.*\bserve\b")
TGI = re.compile(r"text-generation-launcher|text-generation-router")


# Imports happen inside the builders so unused sources cost nothing.
def _vllm_metrics(target: str | None):
    from kvprof.phases.metrics import VllmMetrics

    return VllmMetrics(target)


def _sglang_metrics(target: str | None):
    from kvprof.phases.metrics import SglangMetrics

    return SglangMetrics(target)


def _tgi_metrics(target: str | None):
    from kvprof.phases.metrics import TgiMetrics

    return TgiMetrics(target)


def _endpoint(kind: str, target: str | None) -> str:
    # parse() refuses these kinds without one; a SourceSpec made by hand may still lack it.
    if not target:
        raise KvprofError(f"phase source {kind} needs a target: --phases {kind}=ENDPOINT",
                          EX_USAGE)
    return target


def _sglang_fpm(target: str | None):
    from kvprof.phases.zmq_sources import SglangFpm

    return SglangFpm(_endpoint("sglang-fpm", target))


def _vllm_kv_events(target: str | None):
    from kvprof.phases.zmq_sources import VllmKvEvents

    return VllmKvEvents(_endpoint("vllm-kv-events", target))


def _nvml(target: str | None):
    from kvprof.phases.nvml import NvmlSource

    return NvmlSource()


@dataclass(frozen=True)
class Source:
    """How a kind of kvprof/phase_sources.py is built (those run in a thread of their own) and
    found by `auto` (those a running engine's command line names)."""

    build: Callable[[str | None], object] | None = None
    discover: Discovery | None = None


# In PHASE_SOURCES order: `auto` lists an engine's sources in this order.
SOURCES: dict[str, Source] = {
    "marks": Source(),
    "vllm-plugin": Source(),
    "vllm-metrics": Source(_vllm_metrics, Discovery(VLLM, _metrics_url("--port", "8000"))),
    "vllm-kv-events": Source(_vllm_kv_events, Discovery(VLLM, _kv_events_endpoint)),
    "sglang-fpm": Source(_sglang_fpm),
    "sglang-metrics": Source(_sglang_metrics,
                             Discovery(SGLANG, _metrics_url("--port", "30000"))),
    "tgi-metrics": Source(_tgi_metrics,
                          Discovery(TGI, _metrics_url("--prometheus-port", "9000"))),
    "nvml": Source(_nvml),
    "auto": Source(),
}


def discover(proc: Path = Path("/proc")) -> list[SourceSpec]:
    """Serving engines running on this host, from their command lines, most exact source
    first per engine. Nothing found: an empty list (marks still work)."""
    found: list[SourceSpec] = []
    pids = sorted((d for d in proc.iterdir() if d.name.isdigit()), key=lambda d: int(d.name)) \
        if proc.is_dir() else []
    finders = [(kind, s.discover) for kind, s in SOURCES.items() if s.discover]
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


def resolve_specs(specs: list[str], log=None) -> list[SourceSpec]:
    """The sources to run. `auto` (the default) adds what discovery finds, plus NVML when a GPU
    is there; explicit sources are taken as given."""
    parsed = [parse(s) for s in specs] or [SourceSpec("auto")]
    out: list[SourceSpec] = []
    for p in parsed:
        if p.kind == "auto":
            found = discover()
            out += found
            if _nvml_present():
                out.append(SourceSpec("nvml"))
            if log:
                log("phase sources (auto): marks" + "".join(f", {s}" for s in out))
        elif PHASE_SOURCE_KINDS[p.kind].built:
            out.append(p)
    return list(dict.fromkeys(out))


def _nvml_present() -> bool:
    """A GPU that NVML can sample. The same probe as `kvprof doctor`; without a GPU it fails
    fast (no library, or no driver), and it never raises."""
    from kvprof.capture.nvml import nvml_available

    status = nvml_available()
    return status.ok and status.gpus > 0


def build(spec: SourceSpec):
    """Instantiate a source; imports happen in its builder so unused sources cost nothing."""
    source = SOURCES.get(spec.kind)
    if source is None or source.build is None:
        raise KvprofError(f"phase source {spec.kind} cannot be built", EX_USAGE)
    return source.build(spec.target)
