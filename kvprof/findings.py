"""Plain-language verdicts per phase, from the summary dict of `correlate.summarize`.

A pure function of that dict, so `kvprof report`, the dashboard and tests all say the same
thing. The rules follow the sizing guidance in DESIGN.md: large requests with the device busy
most of the time are bandwidth-bound; small requests with the device mostly idle are
latency-bound (more bandwidth would not help, lower latency would).
"""
from __future__ import annotations

from kvprof import schema
from kvprof.correlate import MAIN_OPS, phase_layer
from kvprof.units import human_bytes, human_us, size_label

# Requests at least this large count as bulk transfers, below SMALL_BYTES as point lookups.
LARGE_BYTES = 128 << 10
SMALL_BYTES = 64 << 10
# Device busier than this (idle below 100 - BUSY_PCT) during the phase: it is the limit.
BUSY_PCT = 50.0


def _main_op(ph: dict) -> tuple[str, str, dict] | None:
    """(layer, op, entry) carrying most bytes in the phase's device layer (ties: read)."""
    layer = phase_layer(ph)
    ops = [(op, ph[layer][op]) for op in MAIN_OPS if ph[layer][op]["ios"]]
    if not ops:
        return None
    op, e = max(ops, key=lambda kv: kv[1]["bytes"])
    return layer, op, e


def phase_finding(phase: str, ph: dict) -> str | None:
    """One sentence about this phase, or None when the phase took no time."""
    if ph["time_s"] <= 0:
        return None
    found = _main_op(ph)
    if found is None:
        return f"{phase}: no storage I/O in {ph['time_s']:.1f} s"
    layer, op, e = found
    idle = ph["block"].get("time_idle_pct")
    mean_size = e["bytes"] / e["ios"]
    # The most common request size names the pattern better than the mean of a mix.
    common = max(e["size_hist"].items(), key=lambda kv: kv[1], default=(mean_size, 0))[0]
    size = size_label(int(common))
    p99 = e["latency_us"]["p99"]
    p99_txt = f"p99 = {human_us(p99)}"
    if p99 is None and "p99_below_us" in e:
        # Recorded without events: only the kernel's log2 histogram bounds the percentile.
        p99_txt = f"p99 < {human_us(e['p99_below_us'])}"
    bw = f"{human_bytes(e['bandwidth_bytes_per_s'])}/s"
    noun = f"{phase} {op}s" + ("" if layer == "block" else f" ({layer})")
    idle_txt = "" if idle is None else f" while the device is {idle:.0f} % idle"
    cap = ph["block"].get("capacity_idle_pct")
    cap_txt = "" if cap is None else f", {cap:.0f} % of its calibrated capacity unused"
    if idle is not None and mean_size >= LARGE_BYTES and 100 - idle >= BUSY_PCT:
        return (f"{noun} are bandwidth-bound at {bw} ({size} requests, "
                f"device busy {100 - idle:.0f} % of the phase{cap_txt})")
    if mean_size < SMALL_BYTES and (idle is None or 100 - idle < BUSY_PCT):
        return f"{noun} are latency-bound at {p99_txt}{idle_txt}{cap_txt}"
    return (f"{noun}: {bw} in {size} requests, {e['iops']:.0f} IOPS, "
            f"{p99_txt}{idle_txt}{cap_txt}")


def findings(summary: dict) -> dict[str, str]:
    """Phase -> verdict, in schema.PHASES order, for every phase that took time."""
    out = {}
    for p in schema.PHASES:
        text = phase_finding(p, summary["phases"][p])
        if text is not None:
            out[p] = text
    return out
