"""`kvprof compare A B`: two sessions' figures side by side, and gates for test pipelines.

Figures come from the two reports (`correlate.summarize`), never recomputed, under dotted names
a gate can use (docs/compare.md), with each session's findings: what bound A, what bound B. Where
the requests in flight changed, the latency says whether the device served the extra ones side
by side or shared its bandwidth (`changes`). `NAME=+30%` passes when B is at least 30 % above A,
`NAME=-25%` at least 25 % below; a gate on a figure either session lacks fails, saying so."""
from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvprof import schema
from kvprof.analysis.correlate import MAIN_OPS, phase_layer
from kvprof.errors import EX_USAGE, KvprofError
from kvprof.summary import Summary
from kvprof.units import human_bytes, human_us
from kvprof.views.findings import findings


@dataclass(frozen=True)
class Figure:
    name: str
    label: str
    unit: str  # bytes/s, iops, us, s, pct, depth, tokens/s
    higher_is_better: bool | None  # None: neither way is better (a time share, idle)


def figures(summary: Summary) -> dict[str, tuple[Figure, float | None]]:
    """Every figure a comparison shows, by name, with its value (None: not measured)."""
    out: dict[str, tuple[Figure, float | None]] = {}

    def put(name: str, label: str, unit: str, better_up: bool | None, value) -> None:
        out[name] = (Figure(name, label, unit, better_up),
                     None if value is None else float(value))

    for p in schema.PHASES:
        ph = summary["phases"][p]
        if ph["time_s"] <= 0:
            continue
        put(f"{p}.time_share", f"{p} time share", "pct", None, ph["time_share_pct"])
        put(f"{p}.time_idle", f"{p} time idle", "pct", None, ph["block"]["time_idle_pct"])
        put(f"{p}.capacity_idle", f"{p} capacity idle", "pct", None,
            ph["block"].get("capacity_idle_pct"))
        put(f"{p}.inflight", f"{p} requests in flight", "depth", None,
            ph["block"].get("inflight_mean"))
        layer = phase_layer(ph)
        for op in MAIN_OPS:
            e = ph[layer][op]
            if not e["ios"]:
                continue
            put(f"{p}.{op}.bandwidth", f"{p} {op} bandwidth", "bytes/s", True,
                e["bandwidth_bytes_per_s"])
            put(f"{p}.{op}.iops", f"{p} {op} IOPS", "iops", True, e["iops"])
            for q in ("p50", "p99"):
                put(f"{p}.{op}.{q}", f"{p} {op} {q} latency", "us", False, e["latency_us"][q])
        put(f"{p}.tokens_per_s", f"{p} tokens/s", "tokens/s", True,
            ph.get("engine", {}).get("tokens_per_s"))
    eng = summary.get("engine") or {}
    put("ttft", "time to first token", "s", False, eng.get("ttft_s"))
    put("itl", "inter-token latency", "s", False, eng.get("itl_s"))
    put("throughput", "generated tokens/s", "tokens/s", True,
        eng.get("throughput_tokens_per_s"))
    put("prefix_hit", "prefix-cache hit", "pct", True, eng.get("prefix_cache_hit_pct"))
    return out


@dataclass(frozen=True)
class Gate:
    name: str
    pct: float  # the change asked for, in %: +30 asks for >= +30 %, -25 for <= -25 %

    @property
    def text(self) -> str:
        return f"{self.name}={self.pct:+g}%"


_GATE = re.compile(r"^\s*([A-Za-z0-9_.]+)\s*=\s*([+-]\d+(?:\.\d+)?)\s*%\s*$")


def parse_gate(text: str) -> Gate:
    m = _GATE.match(text)
    if not m:
        raise KvprofError(f"bad gate {text!r}: expected NAME=+N% or NAME=-N% "
                          "(e.g. ttft=-25%, prefill.write.bandwidth=+30%)", EX_USAGE)
    return Gate(m.group(1), float(m.group(2)))


def _change(a: float | None, b: float | None) -> float | None:
    """B against A in %, None where it has no meaning (a figure missing, or A zero)."""
    if a is None or b is None or a == 0:
        return None
    return 100.0 * (b - a) / abs(a)


def compare(a: Summary, b: Summary, gates: Sequence[Gate] = ()) -> dict:
    """The comparison as a dict (the --json output): every figure either session has, with
    its change, and each gate's verdict."""
    fa, fb = figures(a), figures(b)
    rows: list[dict[str, Any]] = []
    for name in list(dict.fromkeys([*fa, *fb])):
        fig = (fa.get(name) or fb[name])[0]
        va = fa[name][1] if name in fa else None
        vb = fb[name][1] if name in fb else None
        if va is None and vb is None:
            continue
        change = _change(va, vb)
        ratio = vb / va if va and vb is not None else None
        better = (None if change is None or change == 0 or fig.higher_is_better is None
                  else (change > 0) == fig.higher_is_better)
        rows.append({"name": name, "label": fig.label, "unit": fig.unit, "a": va, "b": vb,
                     "change_pct": change, "ratio": ratio, "better": better})
    by_name = {r["name"]: r for r in rows}
    verdicts = []
    for g in gates:
        r = by_name.get(g.name)
        if r is None or r["change_pct"] is None:
            why = ("not a figure of either session" if r is None and g.name not in
                   {*fa, *fb} else "not measured in both sessions")
            verdicts.append({"gate": g.text, "passed": False, "why": why})
            continue
        ok = r["change_pct"] >= g.pct if g.pct >= 0 else r["change_pct"] <= g.pct
        verdicts.append({"gate": g.text, "passed": ok, "a": r["a"], "b": r["b"],
                         "change_pct": r["change_pct"]})
    return {"a": _who(a), "b": _who(b), "figures": rows, "gates": verdicts,
            "findings": {"a": [f.as_dict() for f in findings(a)],
                         "b": [f.as_dict() for f in findings(b)]},
            "changes": depth_changes(by_name),
            "passed": all(v["passed"] for v in verdicts)}


# Requests in flight changed by at least this factor between A and B: what the latency did
# then tells a device that served the extra requests side by side (its latency held: the
# fewer were waiting on it, latency-bound) from one whose bandwidth they shared (each waited
# longer in proportion).
DEPTH_STEP = 1.5
SAME_LATENCY = 1.25  # p50 ratio at most this: held
SHARED = 0.75  # p50 ratio at least this share of the depth ratio: shared


def depth_changes(by_name: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """Per phase and op whose requests in flight changed by DEPTH_STEP or more, what its p50
    and bandwidth did, and what that says of the device (`verdict`: `overlapped`, `shared`
    or `between`), with the figures it rests on."""
    out = []
    for p in schema.PHASES:
        depth = by_name.get(f"{p}.inflight")
        if not depth or not depth["a"] or not depth["b"]:
            continue
        rd = depth["b"] / depth["a"]
        if 1 / DEPTH_STEP < rd < DEPTH_STEP:
            continue
        for op in MAIN_OPS:
            lat, bw = by_name.get(f"{p}.{op}.p50"), by_name.get(f"{p}.{op}.bandwidth")
            if not lat or not bw or not all((lat["a"], lat["b"], bw["a"], bw["b"])):
                continue
            deeper, shallower = ("b", "a") if rd > 1 else ("a", "b")
            rl = lat[deeper] / lat[shallower]
            rdd = max(rd, 1 / rd)
            if rl <= SAME_LATENCY:
                verdict, says = "overlapped", (
                    f"the device served the extra requests side by side without their waiting "
                    f"longer: with {depth[shallower]:.1f} in flight it was latency-bound, "
                    f"waiting on too few requests, not at its bandwidth")
            elif rl >= SHARED * rdd:
                verdict, says = "shared", (
                    "each request waited longer in proportion: the extra requests shared the "
                    "device's bandwidth, its limit")
            else:
                verdict, says = "between", (
                    "each request waited somewhat longer: the device overlapped part of them")
            out.append({
                "phase": p, "op": op, "verdict": verdict,
                "text": (f"{p} {op}s: {depth['a']:.2f} -> {depth['b']:.2f} requests in flight, "
                         f"p50 {value_text('us', lat['a'])} -> {value_text('us', lat['b'])}, "
                         f"bandwidth x{bw['b'] / bw['a']:.2f}: {says}"),
                "figures": {f"{p}.inflight": [depth["a"], depth["b"]],
                            f"{p}.{op}.p50": [lat["a"], lat["b"]],
                            f"{p}.{op}.bandwidth": [bw["a"], bw["b"]]}})
    return out


def _who(s: Summary) -> dict:
    return {k: s["session"][k] for k in ("id", "host", "duration_s", "devices")}


def value_text(unit: str, v: float | None) -> str:
    if v is None:
        return "-"
    if unit == "bytes/s":
        return f"{human_bytes(v)}/s"
    if unit == "us":
        return human_us(v)
    if unit == "s":
        return human_us(v * 1e6)
    if unit == "pct":
        return f"{v:.1f} %"
    if unit == "depth":
        return f"{v:.2f}"
    return f"{v:,.0f}" + (" tok/s" if unit == "tokens/s" else "")


def to_text(result: dict, name_a: str, name_b: str) -> str:
    lines = [f"kvprof compare  A: {name_a}  B: {name_b}", "",
             f"{'figure':<30}{'A':>12}{'B':>12}  change"]
    for r in result["figures"]:
        if r["change_pct"] is None:
            change = "" if r["a"] == r["b"] else "-"
        else:
            change = f"{r['change_pct']:+.1f} %"
            if r["ratio"] and (r["ratio"] >= 2 or r["ratio"] <= 0.5):
                change = f"x{r['ratio']:.2f} ({change})"
            change += {True: " better", False: " worse", None: ""}[r["better"]]
        lines.append(f"{r['label'][:29]:<30}{value_text(r['unit'], r['a']):>12}"
                     f"{value_text(r['unit'], r['b']):>12}  {change}".rstrip())
    if result.get("changes"):
        lines += ["", "what the depth changed:"] + [f"  - {c['text']}"
                                                     for c in result["changes"]]
    for side, name in (("a", name_a), ("b", name_b)):
        found = result.get("findings", {}).get(side) or []
        if found:
            lines += ["", f"findings, {side.upper()} ({name}):"]
            lines += [f"  - {f['text']}" for f in found]
    if result["gates"]:
        lines += ["", "gates:"]
        units = {r["name"]: r["unit"] for r in result["figures"]}
        for v in result["gates"]:
            verdict = "pass" if v["passed"] else "FAIL"
            if "why" in v:
                lines.append(f"  {v['gate']}: {verdict} ({v['why']})")
                continue
            unit = units[v["gate"].split("=")[0]]
            lines.append(f"  {v['gate']}: {value_text(unit, v['a'])} -> "
                         f"{value_text(unit, v['b'])} ({v['change_pct']:+.1f} %) {verdict}")
    return "\n".join(lines) + "\n"
