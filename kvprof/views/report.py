"""`kvprof report`: the summary from correlate, as text for people or JSON for scripts."""
from __future__ import annotations

import json
import sys
import textwrap
from datetime import datetime, timezone
from typing import Literal

from kvprof import schema
from kvprof.summary import (
    DEVICE_LAYERS,
    LAYERS,
    Engine,
    Exact,
    Offload,
    OpCapacity,
    Session,
    Summary,
)
from kvprof.units import engine_parts, human_bytes, human_us, offload_sentence, size_label
from kvprof.views.findings import findings

WIDTH = 80


def write_report(summary: Summary, name: str, as_json: bool) -> None:
    """The report on stdout, as text or JSON: `kvprof report` and the demo."""
    sys.stdout.write(to_json(summary) + "\n" if as_json else to_text(summary, name))
    sys.stdout.flush()


def to_json(summary: Summary) -> str:
    """The summary, with the findings and the figures each rests on."""
    return json.dumps({**summary, "findings": [f.as_dict() for f in findings(summary)]},
                      indent=2, sort_keys=False)


def _status(status: str) -> str:
    """How a recording ended, in words. `recording` is a recorder still running, or, read
    where kvprof cannot tell (another host, another boot), one killed or crashed."""
    return {"killed": "killed (ended uncleanly: data up to its last flush)",
            "recording": "recording (or killed)"}.get(status, status)


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{v:.1f} %"


def _depth(v: float | None) -> str:
    """The mean requests in flight while busy (reports before it have none)."""
    return "-" if v is None else f"{v:.2f}"


def _idle_and_depth(devices: dict) -> str:
    """Per device: time idle and, where known, the mean requests in flight while busy."""
    return "  ".join(f"{d} {_pct(v['time_idle_pct'])}" + (
        "" if v.get("inflight_mean") is None else f" ({_depth(v['inflight_mean'])})")
        for d, v in devices.items())


def to_text(summary: Summary, name: str = "") -> str:
    s = summary["session"]
    start = datetime.fromtimestamp(s["start_wall_ns"] / 1e9, timezone.utc).strftime(
        "%Y-%m-%d %H:%M:%S UTC")
    lines = [
        f"kvprof report {name}".rstrip(),
        f"host {s['host']}  kernel {s['kernel']}  started {start}",
        f"duration {s['duration_s']:.2f} s  devices: {', '.join(s['devices']) or '-'}  "
        f"lost events: {s['lost_events']}"
        + (f"  status: {_status(s['status'])}" if s["status"] != "complete" else ""),
        "",
        f"{'phase':<9}{'time':>10}{'share':>9}{'time idle':>12}{'capacity idle':>15}"
        f"{'in flight':>11}",
    ]
    phases = summary["phases"]
    if s.get("mixed") == "split":
        lines.insert(-1, "mixed steps split into prefill and decode by token share (--mixed)")
    for p in schema.PHASES:
        ph = phases[p]
        lines.append(f"{p:<9}{ph['time_s']:>9.2f}s{ph['time_share_pct']:>8.1f}%"
                     f"{_pct(ph['block']['time_idle_pct']):>12}"
                     f"{_pct(ph['block']['capacity_idle_pct']):>15}"
                     f"{_depth(ph['block'].get('inflight_mean')):>11}")
    header = (f"  {'layer':<9}{'op':<6}{'ios':>8}{'bytes':>11}{'MiB/s':>8}{'IOPS':>8}"
              f"{'p50':>7}{'p90':>7}{'p99':>7}{'p99.9':>7}")
    for p in schema.PHASES:
        ph = phases[p]
        rows = [(layer, op, e) for layer in LAYERS
                for op, e in ph[layer].items() if isinstance(e, dict) and e.get("ios")]
        if not rows:
            continue
        rate = ph["engine"]["tokens_per_s"]
        lines += ["", f"== {p}: {ph['time_s']:.2f} s ({ph['time_share_pct']:.1f} % of session)"
                  + ("" if rate is None else f", {rate:,.0f} tokens/s"), header]
        for layer, op, e in rows:
            lat = e["latency_us"]
            lines.append(
                f"  {layer:<9}{op:<6}{e['ios']:>8}{human_bytes(e['bytes']):>11}"
                f"{e['bandwidth_bytes_per_s'] / 2**20:>8.1f}{e['iops']:>8.0f}"
                + "".join(f"{human_us(lat[k]):>7}" for k in ("p50", "p90", "p99", "p999")))
            if layer == "block":
                q, d = e["queue_us"], e["device_us"]
                lines.append(f"  {'':<15}queue p50 {human_us(q['p50'])} p99 {human_us(q['p99'])}"
                             f"   device p50 {human_us(d['p50'])} p99 {human_us(d['p99'])}")
            sizes = "  ".join(f"{size_label(int(b))}:{n}" for b, n in e["size_hist"].items())
            lines.append(f"  {'':<15}sizes {sizes}"[:WIDTH])
        cap = ph["block"]["capacity"]
        if cap:
            used = "; ".join(
                f"{op} {_achieved(o)} of {_achieved(o, 'capability')} ({o['pattern']})"
                for op, o in cap["by_op"].items() if o["achieved"])
            lines += _wrap(f"capacity used {cap['used_pct']:.1f} %: {used or 'no I/O'}",
                           "  ", "    ")
        devs = ph["block"]["devices"]
        if devs:
            lines.append(f"  block time idle (in flight): {_idle_and_depth(devs)}"[:WIDTH])
        probes = ph.get("gds", {}).get("probes")
        if probes:
            dma = sum(n for k, n in probes.items() if k.startswith("cufio_gds"))
            lines.append(f"  cuFile calls: {dma} by GPUDirect DMA, "
                         f"{sum(probes.values()) - dma} in compat mode (POSIX)"[:WIDTH])
        wb = ph.get("writeback")
        if wb and wb["bytes"]:
            by = "  ".join(f"{c} {human_bytes(v['bytes'])}" for c, v in sorted(
                wb["caches"].items()))
            lines.append(f"  writeback of this phase's buffered writes: "
                         f"{human_bytes(wb['bytes'])} ({by})"[:WIDTH])
        if ph.get("caches"):
            lines.append(f"  {'KV cache (syscalls)':<20}{'read':>10}{'MiB/s':>8}{'hit':>8}"
                         f"{'write':>11}{'MiB/s':>8}{'direct':>8}")
            for cache, c in sorted(ph["caches"].items()):
                rd, wr = c["read"], c["write"]
                direct = (rd["direct_bytes"] + wr["direct_bytes"]) / max(
                    1, rd["bytes"] + wr["bytes"])
                lines.append(
                    f"  {cache[:19]:<20}{human_bytes(rd['bytes']):>10}"
                    f"{rd['bandwidth_bytes_per_s'] / 2**20:>8.1f}"
                    f"{_pct(rd['page_cache_hit_pct']).replace(' ', ''):>8}"
                    f"{human_bytes(wr['bytes']):>11}{wr['bandwidth_bytes_per_s'] / 2**20:>8.1f}"
                    f"{100 * direct:>7.0f}%")
    lines += _engine_lines(summary.get("engine"))
    lines += _offload_lines(summary.get("offload"))
    lines += _exact_lines(summary.get("exact"))
    lines.insert(3, window_line(s)[:WIDTH])
    for src, pace in s.get("source_pace", {}).items():
        lines.insert(4, f"  {src}: scraped every {pace['scrape_interval_s']:g} s or less "
                     f"({pace['response_ms']:g} ms a page)")
    for src, problems in s["source_problems"].items():
        lines.insert(4, f"  {src}: " + ", ".join(f"{k.split('.', 1)[-1]} {v}"
                                                for k, v in problems.items()))
    known = [f"{p['tgid']} {p['role']}" for p in s.get("processes", []) if p["role"]]
    if known:
        lines += ["", ("processes: " + ", ".join(known))[:WIDTH]]
    left = s.get("writeback_unattributed") or {}
    if left.get("bytes"):
        lines += ["", f"writeback no traced write explains: {human_bytes(left['bytes'])} "
                      f"in {left['ios']} bios"]
    on_block = s.get("io_uring_on_block")
    if on_block:
        lines += [""] + textwrap.wrap(
            f"io_uring: {on_block} requests to raw block devices opened O_DIRECT were left to "
            f"the block layer, which carries them one for one and counts those on the traced "
            f"devices (record --layer block --layer io_uring traces them in both)", WIDTH,
            subsequent_indent="  ")
    sampled = s.get("event_sampling")
    if sampled:
        how = ("percentiles from the sample" if sampled["uniform"] else
               "percentiles from the sample, each row weighed by the rate it was kept at")
        lines += [""] + textwrap.wrap(
            f"block/io_uring rows sampled past --event-rate (1 in up to "
            f"{sampled['max_one_in']}): counts, rates and idle are the exact counts; {how}",
            WIDTH, subsequent_indent="  ")
    if s["lost_events"]:
        lines += ["", "lost: " + ", ".join(f"{k} {v}" for k, v in s["lost_by_reason"].items()
                                            if v)]
    verdicts = findings(summary)
    if verdicts:
        lines += ["", "findings:"]
        for text in (f.text for f in verdicts):
            lines += _wrap(text, "  ", "    ")
    return "\n".join(lines) + "\n"


def _wrap(text: str, first: str, then: str) -> list[str]:
    """Wrapped to WIDTH, keeping "96 %" on one line (the space masked while wrapping)."""
    return [w.replace("\0", " ") for w in textwrap.wrap(
        text.replace(" %", "\0%"), WIDTH, initial_indent=first, subsequent_indent=then,
        break_on_hyphens=False)]


def _engine_lines(engine: Engine | None) -> list[str]:
    """The engines' own figures, those their sources gave."""
    parts = engine_parts(engine)
    if not parts:
        return []
    # Each figure on one line: its spaces masked while wrapping.
    return [""] + _wrap("engine (means over the session): "
                        + ", ".join(x.replace(" ", "\0") for x in parts), "", "  ")


def _offload_lines(o: Offload | None) -> list[str]:
    text = offload_sentence(o)
    return [] if text is None else [""] + _wrap(text, "", "  ")


def _achieved(o: OpCapacity, key: Literal["achieved", "capability"] = "achieved") -> str:
    v = o[key]
    return f"{human_bytes(v)}/s" if o["measure"] == "bandwidth_bytes_per_s" else f"{v:,.0f} IOPS"


def _exact_lines(exact: Exact | None) -> list[str]:
    """The aggregate tier: every device-layer request, counted in the kernel."""
    if not exact or not exact["totals"]:
        return []
    edge = exact.get("boundary")
    rule = ("phase of the window at issue, per 4 ms slot" if edge is not None
            else "phase as marked at issue")
    lines = ["", f"exact counts (in-kernel, every request; {rule}):",
             f"  {'phase':<9}{'layer':<9}{'op':<6}{'ios':>9}{'bytes':>11}{'MiB/s':>8}"
             f"{'IOPS':>8}{'mean':>8}{'p99<':>8}"]
    for p in schema.PHASES:
        ph = exact["phases"][p]
        for layer in DEVICE_LAYERS:
            for op, e in ph[layer].items():
                if not e["ios"]:
                    continue
                lines.append(
                    f"  {p:<9}{layer:<9}{op:<6}{e['ios']:>9}{human_bytes(e['bytes']):>11}"
                    f"{e['bandwidth_bytes_per_s'] / 2**20:>8.1f}{e['iops']:>8.0f}"
                    f"{human_us(e['mean_service_us']):>8}"
                    f"{human_us(e['service_us_below']['p99']):>8}")
        if ph["devices"]:
            lines.append(f"  {p:<9}time idle (in flight): {_idle_and_depth(ph['devices'])}"
                         [:WIDTH])
    if edge and edge["ios"]:
        lines.append(f"  {edge['ios']:,} requests were in slots a window edge cut: each phase's "
                     f"count is within that of the per-request rule"[:WIDTH])
    return lines


def window_line(s: Session) -> str:
    """The header's line on phases: who made the windows (source and engine, as stored),
    else the sources the recording listened with, which made none."""
    made = [f"{w['source']}" + (f" {w['engine']}" if w["engine"] else "") + f" ({w['windows']})"
            for w in s.get("window_sources", [])]
    if made:
        return "phase windows: " + ", ".join(made)
    return "phase windows: none (listened: " + ", ".join(s["phase_sources"]) + ")"
