"""`--phases SOURCE[=TARGET]`: which phase sources a recording uses, and `auto` discovery.

Marks on the marker socket are always received (the vLLM plugin and manual marks use it);
the other sources run next to them, each in its own thread. When windows of several sources
cover the same time, correlate keeps the most exact (hook > metrics > nvml).
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from kvprof.errors import EX_USAGE, KvprofError

# name -> (needs a target, default target, exactness rank used to order `auto` choices)
KINDS = {
    "marks": (False, None, 3),
    "vllm-plugin": (False, None, 3),
    "vllm-metrics": (True, "http://127.0.0.1:8000/metrics", 2),
    "vllm-kv-events": (True, "tcp://127.0.0.1:5557", 0),
    "sglang-fpm": (True, None, 3),
    "sglang-metrics": (True, "http://127.0.0.1:30000/metrics", 2),
    "tgi-metrics": (True, "http://127.0.0.1:9000/metrics", 2),
    "nvml": (False, None, 1),
    "auto": (False, None, 0),
}


@dataclass(frozen=True)
class SourceSpec:
    kind: str
    target: str | None = None

    def __str__(self) -> str:
        return f"{self.kind}={self.target}" if self.target else self.kind


def parse(spec: str) -> SourceSpec:
    kind, _, target = spec.partition("=")
    if kind not in KINDS:
        raise KvprofError(f"unknown phase source {kind!r}; one of: {', '.join(KINDS)}", EX_USAGE)
    needs, default, _ = KINDS[kind]
    target = target or default
    if needs and not target:
        raise KvprofError(f"phase source {kind} needs a target: --phases {kind}=ENDPOINT",
                          EX_USAGE)
    return SourceSpec(kind, target or None)


def _flag(argv: list[str], name: str) -> str | None:
    for i, a in enumerate(argv):
        if a == name and i + 1 < len(argv):
            return argv[i + 1]
        if a.startswith(name + "="):
            return a.split("=", 1)[1]
    return None


def discover(proc: Path = Path("/proc")) -> list[SourceSpec]:
    """Serving engines running on this host, from their command lines, most exact source
    first per engine. Nothing found: an empty list (marks still work)."""
    found: list[SourceSpec] = []
    pids = sorted((d for d in proc.iterdir() if d.name.isdigit()), key=lambda d: int(d.name)) \
        if proc.is_dir() else []
    for d in pids:
        try:
            argv = (d / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        argv = [a.decode(errors="replace") for a in argv if a]
        line = " ".join(argv)
        if re.search(r"\bvllm\b.*\bserve\b|vllm\.entrypoints", line):
            port = _flag(argv, "--port") or "8000"
            found.append(SourceSpec("vllm-metrics", f"http://127.0.0.1:{port}/metrics"))
            kv = _flag(argv, "--kv-events-config")
            m = re.search(r'"endpoint"\s*:\s*"([^"]+)"', kv or "")
            if m:
                found.append(SourceSpec("vllm-kv-events", m.group(1).replace("*", "127.0.0.1")))
        elif re.search(r"sglang\.launch_server|\bsglang\b.*\bserve\b", line):
            port = _flag(argv, "--port") or "30000"
            found.append(SourceSpec("sglang-metrics", f"http://127.0.0.1:{port}/metrics"))
        elif "text-generation-launcher" in line or "text-generation-router" in line:
            port = _flag(argv, "--prometheus-port") or "9000"
            found.append(SourceSpec("tgi-metrics", f"http://127.0.0.1:{port}/metrics"))
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
        elif p.kind not in ("marks", "vllm-plugin"):
            out.append(p)
    return list(dict.fromkeys(out))


def _nvml_present() -> bool:
    """A GPU that NVML can sample. The same probe as `kvprof doctor`; without a GPU it fails
    fast (no library, or no driver), and it never raises."""
    from kvprof.capture.nvml import nvml_available

    status = nvml_available()
    return status.ok and status.gpus > 0


def build(spec: SourceSpec):
    """Instantiate a source; imports happen here so unused sources cost nothing."""
    if spec.kind == "vllm-metrics":
        from kvprof.phases.metrics import VllmMetrics

        return VllmMetrics(spec.target)
    if spec.kind == "sglang-metrics":
        from kvprof.phases.metrics import SglangMetrics

        return SglangMetrics(spec.target)
    if spec.kind == "tgi-metrics":
        from kvprof.phases.metrics import TgiMetrics

        return TgiMetrics(spec.target)
    if spec.kind == "sglang-fpm":
        from kvprof.phases.zmq_sources import SglangFpm

        return SglangFpm(spec.target)
    if spec.kind == "vllm-kv-events":
        from kvprof.phases.zmq_sources import VllmKvEvents

        return VllmKvEvents(spec.target)
    if spec.kind == "nvml":
        from kvprof.phases.nvml import NvmlSource

        return NvmlSource()
    raise KvprofError(f"phase source {spec.kind} cannot be built", EX_USAGE)
