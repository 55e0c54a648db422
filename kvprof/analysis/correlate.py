"""Per-phase storage numbers: every measure a view shows is computed here, once. Reads only.

An I/O belongs to the window holding its issue time (overlaps flattened by `fold.flatten`, as
the aggregate tier is folded); time in no window is `idle`. A phase's idle time is its time with
no block request in flight, counting those issued before it began; `inflight_mean` (Little's
law) is its requests' summed device time over the rest. A `RowSource`'s answers (SQL over the
store, or the live row cache) become the report (`summarize`) and the dashboard's `frame`."""
from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, cast

import numpy as np
import pyarrow as pa

from kvprof import calibration, schema
from kvprof.analysis.fold import flatten, flatten_whole
from kvprof.analysis.intervals import busy_between
from kvprof.analysis.rollup import GRID_NS
from kvprof.analysis.rowsource import (
    CacheRow,
    DeviceTimeOf,
    GpuMeans,
    IslandsOf,
    Pieces,
    RowSource,
    StatRow,
    ViewFilter,
    WritebackRow,
)
from kvprof.caches import OTHER
from kvprof.schema import SLOT_NS
from kvprof.store.session import SessionInfo
from kvprof.summary import (
    DEVICE_LAYERS,
    LAYERS,
    MAIN_OPS,
    BlockLayer,
    CacheOp,
    CacheStats,
    Capacity,
    Count,
    DeviceIdle,
    DeviceLayer,
    Engine,
    Exact,
    ExactDevice,
    GdsLayer,
    LayerOps,
    MainOp,
    Offload,
    OpCapacity,
    OpStats,
    PhaseEngine,
    PhaseStats,
    Process,
    Quantiles,
    Sampling,
    Summary,
    SyscallLayer,
    Writeback,
)

# The report's names are schema's (kvprof/summary.py spells them out for a type checker).
assert tuple(Quantiles.__annotations__) == tuple(n for n, _ in schema.QUANTILES)
assert (DEVICE_LAYERS, LAYERS) == (schema.DEVICE_LAYERS, schema.LAYERS)
NS = 1_000_000_000
# A phase must fill this share of a rate bin for that bin to count: bytes over 10 ms of
# phase time would read as an absurd rate.
MIN_BIN_SHARE = 0.2


def split_mixed(windows: pa.Table) -> pa.Table:
    """`--mixed split`: each mixed window with token counts becomes a prefill window and a
    decode window, its time cut by token share (prefill first, as an engine step schedules
    its prefill chunk before its decode tokens' turn). I/O in it then follows the cut by its
    issue time, like any other. Mixed windows without counts stay mixed."""
    cols = {c: windows[c].to_pylist() for c in windows.column_names}
    out: dict[str, list[Any]] = {c: [] for c in cols}
    for i, phase in enumerate(cols["phase"]):
        pre = cols["prefill_tokens"][i] or 0 if "prefill_tokens" in cols else 0
        dec = cols["decode_tokens"][i] or 0 if "decode_tokens" in cols else 0
        if phase != "mixed" or pre + dec <= 0:
            for c in cols:
                out[c].append(cols[c][i])
            continue
        s, e = cols["start_ns"][i], cols["end_ns"][i]
        cut = s + (e - s) * pre // (pre + dec)
        for part, (a, b) in (("prefill", (s, cut)), ("decode", (cut, e))):
            if b <= a:
                continue
            for c in cols:
                out[c].append(cols[c][i])
            out["phase"][-1], out["start_ns"][-1], out["end_ns"][-1] = part, a, b
            out["prefill_tokens"][-1] = pre if part == "prefill" else 0
            out["decode_tokens"][-1] = dec if part == "decode" else 0
    return pa.table({c: pa.array(v, windows.schema.field(c).type) for c, v in out.items()})


def per_second(amount: float, time_s: float) -> float:
    """A phase's rate: the amount over the phase's time; 0 in a phase that never ran."""
    return amount / time_s if time_s > 0 else 0.0


def idle_pct(busy_s: float, time_s: float) -> float | None:
    """Time idle %: the share of the phase's time with no request in flight (None: the
    phase never ran). The report, the fleet and the Prometheus endpoint all use this."""
    return max(0.0, 100.0 * (1 - busy_s / time_s)) if time_s > 0 else None


def inflight_mean(device_ns: float, busy_ns: float) -> float | None:
    """The mean number of requests in flight while the device was busy, by Little's law: the
    phase's block requests' summed device time (issue to completion) over its busy time
    (time with at least one request in flight). About 1: one request at a time, each
    waiting out the device's latency; more: requests overlapping in the device. None
    without either (no request, or none in flight in the phase's time)."""
    return device_ns / busy_ns if device_ns > 0 and busy_ns > 0 else None


def _op_entry(bytes_: int, ios: int, time_s: float) -> OpStats:
    return {
        "bytes": int(bytes_),
        "ios": int(ios),
        "bandwidth_bytes_per_s": per_second(bytes_, time_s),
        "iops": per_second(ios, time_s),
        "latency_us": _no_quantiles(),
        "queue_us": _no_quantiles(),
        "device_us": _no_quantiles(),
        "size_hist": {},
        "latency_hist_us": {},
    }


def _no_quantiles() -> Quantiles:
    return {"p50": None, "p90": None, "p99": None, "p999": None}


def _quantiles(values: Sequence[Any]) -> Quantiles:
    """schema.QUANTILES' values in order, as the report's quantiles."""
    p50, p90, p99, p999 = (None if v is None else float(v) for v in values)
    return {"p50": p50, "p90": p90, "p99": p99, "p999": p999}


def device_layer(block_ios: int, io_uring_ios: int) -> DeviceLayer:
    """The layer whose numbers describe the device: block, which sees each byte once, unless
    only io_uring saw I/O (io_uring rows repeat block ones wherever both are traced)."""
    return "block" if block_ios or not io_uring_ios else "io_uring"


def phase_layer(ph: PhaseStats) -> DeviceLayer:
    """`device_layer` of one phase of the report, by its reads and writes."""
    return device_layer(*(sum(ph[layer][op]["ios"] for op in MAIN_OPS)
                          for layer in DEVICE_LAYERS))


def summarize(rows: RowSource, t0: int | None = None, t1: int | None = None,
              view: ViewFilter = ViewFilter(), info: SessionInfo | None = None,
              windows: pa.Table | None = None, mixed: str = "apart") -> Summary:
    """The report (kvprof/summary.py's `Summary`; its shape, kept stable, in docs/report.md).
    `info`, `windows`: the session row and phase windows when the caller has just read them.
    `mixed`: "apart" (mixed windows are their own phase) or "split" (`split_mixed`). Each
    section is built by one function from the row source's answers and the sections it rests
    on: layer figures from the events, or the aggregate tier where events are missing or
    sampled; idle from the events' in-flight islands, or the aggregate tier's; capacity from
    the final layer figures; then caches, writeback and engine figures."""
    info = info or rows.info()
    t0 = info.start_ns if t0 is None else t0
    t1 = info.end_ns if t1 is None else t1
    windows = rows.windows() if windows is None else windows
    if mixed == "split":
        windows = split_mixed(windows)
    ws, we, wp = flatten(windows, t0, t1)
    durations = (we - ws).astype(np.float64)
    total_s = max(t1 - t0, 0) / 1e9
    times = {p: float(durations[wp == p].sum()) / 1e9 for p in schema.PHASES}

    # The whole session also counts rows issued outside its bounds, each in its own window.
    whole = t0 == info.start_ns and t1 == info.end_ns
    pieces = Pieces(*(flatten_whole(windows, t0, t1) if whole else (ws, we, wp)), t0, t1,
                    info.start_ns, whole)
    got = rows.per_phase(pieces, view)
    ops = _layer_ops(got.stats, times)
    idle = _idle(ws, we, wp, [d["name"] for d in info.devices] or got.devices, got.islands_of,
                 got.device_time_of)
    # The per-cache query only where the view has file syscalls at all (most sessions and
    # views have none, and the dashboard asks every frame).
    files = any(r.layer == "syscall" and r.op in MAIN_OPS for r in got.stats)
    caches, hits = _caches(rows.per_cache(pieces, view) if files else [], times)
    writeback, unattributed = _writeback(rows.writeback(pieces, view) if files else [])
    probes: dict[str, dict[str, int]] = {p: {} for p in schema.PHASES}
    if any(r.layer == "gds" for r in got.stats):
        for p, probe, n in rows.gds_calls(pieces, view):
            probes[p][probe] = int(n)
    lost = {k: int(v) for k, v in info.lost.items()}
    exact = _exact(rows, times, pieces, view, info)
    events = bool(info.config.get("device_events", True))
    shifts = rows.sampling(t0, t1) if events else []
    sampling: Sampling | None = None
    weighted = {}
    if any(shifts):
        # One rate over the span: the kept rows are a uniform sample, their percentiles
        # unbiased. Several: each row weighs what it stands for (1/16-octave buckets).
        uniform = len(set(shifts)) == 1
        sampling = {"max_one_in": 1 << max(shifts), "uniform": uniform,
                    "percentiles": "sample" if uniform else "weighted sample"}
        if not uniform:
            weighted = rows.weighted_quantiles(pieces, view)
    if (not events or sampling) and exact is not None:
        ops = _ops_from_exact(ops, exact, times, sampling, weighted)
        idle = _idle_from_exact(idle, exact)
    capacity = _capacity(ops, times, info.devices)
    supplied, unsure = _hits_by_phase(rows, t0, t1, ws, we, wp)
    phase_engine = _phase_engine(rows.phase_tokens(t0, t1), times, mixed, supplied)
    counters = rows.engine_counters(t0, t1)
    phases: dict[str, PhaseStats] = {}
    for p in schema.PHASES:
        cap = capacity[p]
        block_idle, inflight, devices = idle[p]
        if cap is not None and len(devices) == 1:
            devices = {d: {**v, "capacity_idle_pct": cap[1]} for d, v in devices.items()}
        # A layer is its operations (read and write always: _layer_ops) and its own figures.
        layer = ops[p]
        phases[p] = {
            "time_s": times[p],
            "time_share_pct": 100.0 * times[p] / total_s if total_s > 0 else 0.0,
            "windows": int((wp == p).sum()),
            "block": cast(BlockLayer, {
                **layer["block"], "time_idle_pct": block_idle, "inflight_mean": inflight,
                "devices": devices,
                "capacity_idle_pct": None if cap is None else cap[1],
                "capacity": None if cap is None else cap[0]}),
            "io_uring": cast(LayerOps, layer["io_uring"]),
            "syscall": cast(SyscallLayer, {**layer["syscall"], "page_cache_hit_pct": hits[p]}),
            "tcp": cast(LayerOps, layer["tcp"]),
            "gds": cast(GdsLayer, {**layer["gds"], "probes": probes[p]}),
            "caches": caches[p],
            "writeback": writeback[p],
            "engine": phase_engine[p],
        }
    summary: Summary = {
        "session": {
            "id": info.session_id,
            "host": info.host,
            "kernel": info.kernel,
            "kvprof_version": info.kvprof_version,
            "start_wall_ns": info.start_wall_ns + (t0 - info.start_ns),
            "duration_s": total_s,
            "status": info.status,
            "devices": [d["name"] for d in info.devices],
            # What the kernel says each device takes and prefers (block sizes, I/O sizes).
            "device_limits": {d["name"]: d["limits"] for d in info.devices
                              if d.get("limits")},
            "lost_events": sum(lost.values()),
            "lost_by_reason": lost,
            "phase_sources": ["marks", *(s["source"] for s in info.sources)],
            "window_sources": [{"source": src, "engine": engine, "windows": n}
                               for src, engine, n in rows.window_sources(t0, t1)],
            "source_problems": {s["source"]: s["problems"] for s in info.sources
                                if s["problems"]},
            # Scrape-paced sources: the longest interval between scrapes (window edges are
            # within one) and the engine's response time that set it.
            "source_pace": {s["source"]: {k: s[k] for k in ("scrape_interval_s", "response_ms")}
                            for s in info.sources if "scrape_interval_s" in s},
            "writeback_unattributed": unattributed,
            # False: recorded with --no-events; the device layers' figures are the exact
            # section's, without exact percentiles.
            "device_events": events,
            # Where the event tier sampled the device layers in this span (past
            # --event-rate): 1 in up to max_one_in requests kept; their counts, rates and
            # idle are then the exact section's, percentiles the sample's when `uniform`.
            "event_sampling": sampling,
            "processes": cast(list[Process], rows.processes()),
            # "split": mixed windows with token counts cut into prefill and decode.
            "mixed": mixed,
        },
        "phases": phases,
        "engine": _engine(counters, total_s),
        "offload": _offload(_moved(counters), _bytes_per_token(
            rows.engine_last(list(schema.KV_SIZE_SERIES), t1)), phases, unsure),
        "exact": exact,
    }
    on_block = info.config.get("io_uring_on_block")
    if on_block is not None:  # (the whole session's: the probes count them, not per span)
        summary["session"]["io_uring_on_block"] = int(on_block)
    return summary


# phase -> layer -> op -> figures: the layers' operations before the layer's own figures join
LayerOpsByPhase = dict[str, dict[str, dict[str, OpStats]]]


def _layer_ops(stats: list[StatRow], times: dict[str, float]) -> LayerOpsByPhase:
    """Per phase and layer, each operation's figures from the event tier (read and write
    always, other operations where seen)."""
    out: LayerOpsByPhase = {
        p: {layer: {op: _op_entry(0, 0, times[p]) for op in MAIN_OPS}
            for layer in schema.LAYERS} for p in schema.PHASES}
    for r in stats:
        entry = _op_entry(r.bytes or 0, r.ios, times[r.phase])
        entry["latency_us"] = _quantiles(r.latency_us)
        entry["queue_us"] = _quantiles(r.queue_us)
        entry["device_us"] = _quantiles(r.device_us)
        entry["size_hist"] = _bucket_dict(r.size_hist)
        entry["latency_hist_us"] = _bucket_dict(r.latency_hist)
        out[r.phase][r.layer][r.op] = entry
    return out


def _bucket_dict(hist: dict[Any, Any] | None) -> dict[str, int]:
    return {str(int(b)): int(n) for b, n in sorted(dict(hist or {}).items())}


def _slot_bounds(slot: int) -> tuple[int, int]:
    """A log2 histogram slot's [low, high) (schema.IO_AGG): slot 0 is the value 0."""
    return (0, 1) if slot == 0 else (1 << (slot - 1), 1 << slot)


def _hist_dict(hist: np.ndarray) -> dict[str, int]:
    return {str(_slot_bounds(i)[0]): int(n) for i, n in enumerate(hist) if n}


def _hist_quantiles(hist: np.ndarray, scale: float) -> dict[str, float | None]:
    """Per quantile, the upper bound of the slot it falls in: the value is below it."""
    total = int(hist.sum())
    out: dict[str, float | None] = {}
    cum = np.cumsum(hist)
    for name, q in schema.QUANTILES:
        if not total:
            out[name] = None
            continue
        slot = int(np.searchsorted(cum, q * total))
        out[name] = _slot_bounds(min(slot, len(hist) - 1))[1] / scale
    return out


def _exact(rows: RowSource, times: dict[str, float], pieces: Pieces, view: ViewFilter,
           info: SessionInfo) -> Exact | None:
    """The aggregate tier's figures (every block and io_uring request, counted in the kernel
    whatever the event tier kept) per phase, by the window holding each request's issue
    time as known per 4 ms issue slot (fold.py), over whole seconds; `boundary` says how
    many requests were in slots a window edge cut, the most that can differ from the events'
    per-request phase. None where it does not apply: a process view (the kernel counts
    devices, not processes) or a session recorded without it."""
    if view.tgid is not None or not info.config.get("aggregate"):
        return None
    got = rows.aggregate(pieces.t0, pieces.t1, pieces.whole, view.device)
    if got is None:
        return None
    agg, busy = got
    out: dict[str, Any] = {  # an Exact, being built
        "phases": {p: {**{layer: {} for layer in schema.DEVICE_LAYERS}, "devices": {}}
                   for p in schema.PHASES}, "totals": {}}
    sums: dict[tuple[str, str, str], list[Any]] = {}
    served: dict[tuple[str, str], int] = {}  # (phase, device) -> block requests' service ns
    edge: dict[str, int] | None = None
    for a in agg:
        if a.layer == "block":
            # (from insert, as the busy word counts: queue and service time)
            served[(a.phase, a.device)] = served.get((a.phase, a.device), 0) + \
                int(a.service_ns) + int(a.queue_ns)
        if a.cut is not None:
            edge = edge or {q: 0 for q in schema.PHASES}
            edge[a.phase] += int(a.ios) if a.cut else 0
        acc = sums.setdefault((a.phase, a.layer, a.op), [0, 0, 0, 0, 0, 0, 0])
        for i, v in enumerate((a.ios, a.bytes, a.queue_ns, a.service_ns)):
            acc[i] += int(v)
        for i, h in enumerate((a.size_hist, a.queue_hist, a.service_hist), start=4):
            acc[i] = acc[i] + np.asarray(h, np.int64)
    for (p, layer, op), (ios, nbytes, queue_ns, service_ns, size, queue, service) in \
            sorted(sums.items()):
        t = times[p]
        # The requests with a service time: a block completion the kernel never traced is
        # counted, as diskstats counts it, without one (forget_unseen, the block probe).
        timed = int(service.sum())
        out["phases"][p][layer][op] = {
            "ios": ios, "bytes": nbytes,
            "bandwidth_bytes_per_s": per_second(nbytes, t),
            "iops": per_second(ios, t),
            "mean_queue_us": queue_ns / ios / 1e3 if ios else None,
            "mean_service_us": service_ns / timed / 1e3 if timed else None,
            "service_us_below": _hist_quantiles(service, 1e3),
            "size_hist": _hist_dict(size),
            "queue_hist_ns": _hist_dict(queue),
            "service_hist_ns": _hist_dict(service),
        }
        tot = out["totals"].setdefault(layer, {}).setdefault(op, {"ios": 0, "bytes": 0})
        tot["ios"] += ios
        tot["bytes"] += nbytes
    for b in busy:
        dev: ExactDevice = {
            "busy_s": int(b.busy_ns) / 1e9,
            "time_idle_pct": idle_pct(int(b.busy_ns) / 1e9, times[b.phase]),
            "inflight_mean": inflight_mean(served.get((b.phase, b.device), 0), int(b.busy_ns))}
        out["phases"][b.phase]["devices"][b.device] = dev
    if edge is None:  # recorded before schema 15
        out["phase_rule"] = ("phase kvprof had been told by marks when the request was "
                             "issued; whole seconds")
        out["boundary"] = None
        return cast(Exact, out)
    out["phase_rule"] = ("the window holding the request's issue time, per 4 ms issue slot; "
                         "whole seconds")
    # Requests in slots a window edge cut between their first and last issue, by the phase
    # they were counted in: each phase's count is within `ios` of the per-request rule.
    out["boundary"] = {"slot_ns": int(info.config.get("aggregate_slot_ns") or SLOT_NS),
                       "settle_s": info.config.get("settle_s"),
                       "ios": sum(edge.values()), "by_phase": edge}
    return cast(Exact, out)


def _ops_from_exact(ops: LayerOpsByPhase, exact: Exact, times: dict[str, float],
                    sampling: Sampling | None, weighted: dict[tuple[str, str, str], Any]
                    ) -> LayerOpsByPhase:
    """A span whose device-layer events are missing (--no-events) or sampled: the device
    layers' per-phase counts, rates and sizes from the aggregate tier. Percentiles are
    the sample's (`weighted`: estimated with each row's weight where the rate changed), null
    without events (the kernel kept log2 histograms, not the values); size histograms have
    the events' buckets (powers of two)."""
    keep = sampling is not None and sampling["uniform"]
    out = {p: dict(layers) for p, layers in ops.items()}
    for p in schema.PHASES:
        for layer in DEVICE_LAYERS:
            by_op = out[p][layer] = dict(out[p][layer])
            for op, e in exact["phases"][p][layer].items():
                entry = _op_entry(e["bytes"], e["ios"], times[p])
                if keep and op in by_op:
                    for k in ("latency_us", "queue_us", "device_us"):
                        entry[k] = by_op[op][k]
                elif weighted and (p, layer, op) in weighted:
                    lat, queue, dev = weighted[(p, layer, op)]
                    entry["latency_us"] = _quantiles(lat)
                    entry["queue_us"] = _quantiles(queue)
                    entry["device_us"] = _quantiles(dev)
                entry["size_hist"] = {k: n for k, n in e["size_hist"].items() if k != "0"}
                # The log2 slot the 99th percentile of service time falls in: below this.
                entry["p99_below_us"] = e["service_us_below"]["p99"]
                by_op[op] = entry
    return out


# phase -> (time idle % on all traced devices together, the mean requests in flight while
# they were busy, per device)
IdleByPhase = dict[str, tuple[float | None, float | None, dict[str, DeviceIdle]]]


def _idle_from_exact(idle: IdleByPhase, exact: Exact) -> IdleByPhase:
    """Idle and the mean requests in flight from the aggregate tier's busy time and summed
    service time, per device; all devices together (the union of their busy time) is known
    only for one device."""
    out: IdleByPhase = {}
    for p in schema.PHASES:
        overall, inflight, devices = idle[p]
        devices = {d: DeviceIdle(**v) for d, v in devices.items()}  # (copies)
        for dev, d in exact["phases"][p]["devices"].items():
            got = devices.setdefault(dev, {"time_idle_pct": None, "inflight_mean": None})
            got["time_idle_pct"], got["inflight_mean"] = d["time_idle_pct"], d["inflight_mean"]
        if len(devices) == 1:
            one = next(iter(devices.values()))
            overall, inflight = one["time_idle_pct"], one["inflight_mean"]
        elif len(devices) > 1:
            overall = inflight = None
        out[p] = (overall, inflight, devices)
    return out


def _capacity(ops: LayerOpsByPhase, times: dict[str, float], devices: list[dict[str, Any]]
              ) -> dict[str, tuple[Capacity, float] | None]:
    """Per phase, the share of the devices' calibrated capability (`kvprof calibrate`) the
    phase left unused (`block.capacity_idle_pct`, beside time idle) and how it was reached
    (`block.capacity`). Per op, what the phase achieved is set against the two patterns
    that bound it, large sequential transfers (bandwidth) and 4 KiB random ones at QD32
    (IOPS); the nearer limit counts. Reads and writes share the device, so their shares add
    up. Several devices: against the sum of their capabilities, and only when every traced
    device was calibrated. None where there is no figure."""
    cals = [d["calibration"] for d in devices if d.get("calibration")]
    out: dict[str, tuple[Capacity, float] | None] = {p: None for p in schema.PHASES}
    if not cals or len(cals) < len(devices):
        return out

    def capability(pattern: str, measure: str) -> float | None:
        got = [c["patterns"].get(pattern, {}).get(measure) for c in cals]
        return float(sum(got)) if all(got) else None

    for p in schema.PHASES:
        if times[p] <= 0:
            continue
        layer = device_layer(*(sum(ops[p][lay][op]["ios"] for op in MAIN_OPS)
                               for lay in schema.DEVICE_LAYERS))
        by_op: dict[str, OpCapacity] = {}
        for op in MAIN_OPS:
            e = ops[p][layer][op]
            bw_pattern, iops_pattern = calibration.LIMITS[op]
            limits = [(e["bandwidth_bytes_per_s"], bw_pattern, "bandwidth_bytes_per_s"),
                      (e["iops"], iops_pattern, "iops")]
            shares = []
            for achieved, pattern, measure in limits:
                cap = capability(pattern, measure)
                if cap is None:
                    # an older or partial calibration: no figure rather than a guess
                    return {q: None for q in schema.PHASES}
                shares.append((achieved / cap, achieved, cap, pattern, measure))
            share, achieved, cap, pattern, measure = max(shares)
            by_op[op] = {"pattern": pattern, "measure": measure, "achieved": achieved,
                         "capability": cap, "used_pct": 100.0 * share}
        used = sum(o["used_pct"] for o in by_op.values())
        out[p] = ({"used_pct": used, "by_op": by_op, "layer": layer}, max(0.0, 100.0 - used))
    return out


def _hits_by_phase(rows: RowSource, t0: int, t1: int, ws: np.ndarray, we: np.ndarray,
                   wp: np.ndarray) -> tuple[dict[str, float], float | None]:
    """The KV connector's hits per phase, and how many of them could be in another phase.
    Where a hook counted each step (the vLLM plugin): a step's hits in the phase of its
    window, exact (0 unsure). Else from scrapes: the hits between two scrapes shared by time
    among the interval's prefill and mixed windows (a connector's tokens come with the step
    that computes the prompt), or where it has neither among all its phases (time outside
    every window is idle); those of an interval shared among more than one phase could all
    be in any of them (unsure). ({}, None: no counts.)"""
    names = [n for engines in schema.OFFLOAD_BY_ENGINE["hit_tokens"] for n in engines]
    steps = rows.counter_steps([n for n in names if n in schema.MARK_SERIES], t0, t1)
    if steps:
        out: dict[str, float] = {}
        for _, ts, delta in steps:
            i = int(np.searchsorted(ws, ts - 1, side="right")) - 1
            p = str(wp[i]) if i >= 0 and we[i] > ts - 1 else "idle"
            out[p] = out.get(p, 0.0) + delta
        return out, 0.0
    steps = rows.counter_steps([n for n in names if n not in schema.MARK_SERIES], t0, t1)
    if not steps:
        return {}, None
    out, unsure = {}, 0.0
    for a, b, delta in steps:
        a, b = max(a, t0), min(b, t1)
        if b <= a:
            continue
        lo = int(np.searchsorted(we, a, side="right"))
        hi = int(np.searchsorted(ws, b, side="left"))
        took = np.clip(np.minimum(we[lo:hi], b) - np.maximum(ws[lo:hi], a), 0, None)
        shares: dict[str, float] = {}
        for p, ns in zip(wp[lo:hi], took):
            if ns > 0:
                shares[str(p)] = shares.get(str(p), 0.0) + float(ns)
        prompts = {p: ns for p, ns in shares.items() if p in ("prefill", "mixed")}
        if prompts:
            shares = prompts
        elif (rest := (b - a) - sum(shares.values())) > 0:
            shares["idle"] = shares.get("idle", 0.0) + rest
        total = sum(shares.values())
        for p, ns in shares.items():
            out[p] = out.get(p, 0.0) + delta * ns / total
        if len(shares) > 1:
            unsure += delta
    return out, unsure


def _moved(counters: list[tuple[str, str, float]]) -> dict[str, float]:
    """How far each series moved, over all its label sets."""
    moved: dict[str, float] = {}
    for name, _labels, delta in counters:
        moved[name] = moved.get(name, 0.0) + delta
    return moved


def _over_engines(engines: tuple[tuple[str, ...], ...], moved: dict[str, float]
                  ) -> float | None:
    """A figure counted per engine (schema.TOKENS_BY_ENGINE, OFFLOAD_BY_ENGINE): per engine,
    its first series the span has, summed over the engines; None when none has one."""
    got = [next(moved[n] for n in names if n in moved) for names in engines
           if any(n in moved for n in names)]
    return sum(got) if got else None


def _bytes_per_token(last: list[tuple[str, str, str, float]]) -> float | None:
    """The engines' KV bytes a token, from what they say of their KV cache (last values of
    schema.KV_SIZE_SERIES): vLLM's cache_config_info labels, the cache's budget over its size
    in tokens; SGLang's pools' memory (in GiB, though it says GB) over their tokens. None
    where no engine says both, or they say different things."""
    found = set()
    sglang: dict[str, dict[str, float]] = {}
    for engine, name, labels, value in last:
        if name == "vllm:cache_config_info":
            try:
                info = json.loads(labels)
                found.add(int(info["kv_cache_memory_bytes"]) / int(info["kv_cache_size_tokens"]))
            except (ValueError, KeyError, TypeError, ZeroDivisionError):
                continue
        else:
            sglang.setdefault(engine, {})[name] = value
    for said in sglang.values():
        gib, tokens = (said.get(n) for n in schema.KV_SIZE_SERIES[1:])
        if gib and tokens:
            found.add(round(gib * (1 << 30) / tokens, 3))
    return found.pop() if len(found) == 1 else None


def _offload(moved: dict[str, float], bytes_per_token: float | None,
             phases: dict[str, PhaseStats], hits_unsure: float | None) -> Offload:
    """The engine's offload figures (schema.OFFLOAD_BY_ENGINE) beside its KV caches' files.
    What it claims to have read: its storage tiers' own count where it keeps one (bytes, else
    tokens at its bytes a token), else its connector's hits at its bytes a token."""
    got = {f: _over_engines(names, moved) for f, names in schema.OFFLOAD_BY_ENGINE.items()}
    hits, hit_bytes = got.get("hit_tokens"), got.get("hit_bytes")
    if hit_bytes is None and hits is not None and bytes_per_token:
        hit_bytes = hits * bytes_per_token
    if hits and hit_bytes is not None and bytes_per_token is None:
        bytes_per_token = hit_bytes / hits

    def tier(op: str) -> float | None:
        nbytes, tokens = got.get(f"{op}_bytes"), got.get(f"{op}_tokens")
        if nbytes is None and tokens is not None and bytes_per_token:
            nbytes = tokens * bytes_per_token
        return nbytes
    loaded = tier("loaded")
    read = written = device = 0
    busy = 0.0
    names: list[str] = []
    for ph in phases.values():
        for cache, c in ph["caches"].items():
            if cache == OTHER:  # (files of no KV cache)
                continue
            names.append(cache)
            read += c["read"]["bytes"]
            written += c["write"]["bytes"]
            device += c["read"].get("device_bytes", 0)
            busy += c["read"]["busy_s"]
    ttft = next((moved[num] for num, den in schema.ENGINE_MEANS["ttft_s"] if moved.get(den)),
                None)
    return {"hit_tokens": hits, "hit_tokens_unsure": hits_unsure,
            "query_tokens": got.get("query_tokens"),
            "bytes_per_token": bytes_per_token,
            "claimed_read_bytes": loaded if loaded is not None else hit_bytes,
            "claimed_written_bytes": tier("stored"),
            "engine_load_time_s": got.get("load_time_s"),
            "engine_store_time_s": got.get("store_time_s"),
            "files_read_bytes": read, "files_written_bytes": written,
            "device_read_bytes": device, "page_cache_hit_pct": _hit_pct(read, device),
            "files_read_busy_s": busy, "ttft_total_s": ttft,
            "load_wait_pct": 100.0 * busy / ttft if ttft and names else None,
            "caches": sorted(set(names))}


def _engine(counters: list[tuple[str, str, float]], total_s: float) -> Engine:
    """The engines' serving figures over the span from how far their counters moved
    (`RowSource.engine_counters`), where their sources give them (None otherwise): mean TTFT
    and inter-token latency, prefix-cache hit share, tokens and the throughput they make."""
    moved = _moved(counters)
    means: dict[str, float | None] = {}
    for figure, pairs in schema.ENGINE_MEANS.items():
        means[figure] = None
        for num, den in pairs:
            if moved.get(den):
                means[figure] = moved.get(num, 0.0) / moved[den]
                break
    tokens = {figure: _over_engines(engines, moved)
              for figure, engines in schema.TOKENS_BY_ENGINE.items()}
    share, gen = means["prefix_cache_hit_share"], tokens["generation_tokens"]
    return {"ttft_s": means["ttft_s"], "itl_s": means["itl_s"],
            "prefix_cache_hit_pct": None if share is None else 100.0 * share,
            "prompt_tokens": tokens["prompt_tokens"], "generation_tokens": gen,
            "throughput_tokens_per_s": gen / total_s if gen is not None and total_s > 0
            else None}


def _phase_engine(tokens: list[tuple[str, str, float, float]], times: dict[str, float],
                  mixed: str, supplied: dict[str, float]) -> dict[str, PhaseEngine]:
    """Per phase, the tokens its windows counted (`RowSource.phase_tokens`) and their rate.
    Several sources count the same tokens (marks and an engine's metrics): per phase, the
    most exact source that counted any. With --mixed split, a mixed window's prefill tokens
    go to prefill, its decode tokens to decode, as its time does. `supplied`: the KV
    connector's hits per phase, where a hook counted them ({}: none did)."""
    out: dict[str, PhaseEngine] = {
        p: {"prefill_tokens": None, "decode_tokens": None, "tokens_per_s": None,
            "offload_hit_tokens": supplied.get(p, 0.0) if supplied else None}
        for p in schema.PHASES}
    counted: dict[tuple[str, str], list[float]] = {}
    for p, source, prefill, decode in tokens:
        parts = ([("prefill", prefill, 0), ("decode", 0, decode)]
                 if mixed == "split" and p == "mixed" else [(p, prefill, decode)])
        for q, pre, dec in parts:
            acc = counted.setdefault((q, source), [0.0, 0.0])
            acc[0] += pre or 0
            acc[1] += dec or 0
    best: dict[str, tuple[int, float, float]] = {}
    for (p, source), (prefill, decode) in counted.items():
        rank = schema.SOURCE_RANK.get(source, 0)
        if p in out and (prefill or decode) and rank >= best.get(p, (-1,))[0]:
            best[p] = (rank, prefill, decode)
    for p, (_, prefill, decode) in best.items():
        t = times[p]
        out[p] = {"prefill_tokens": prefill, "decode_tokens": decode,
                  "tokens_per_s": (prefill + decode) / t if t > 0 else None,
                  "offload_hit_tokens": out[p]["offload_hit_tokens"]}
    return out


def _caches(rows: list[CacheRow], times: dict[str, float]
            ) -> tuple[dict[str, dict[str, CacheStats]], dict[str, float | None]]:
    """Per phase and KV cache (kvprof/caches.py), the syscall layer's reads and writes, and
    for buffered reads the share the page cache served: app bytes the calls returned beside
    the device bytes the calling threads read meanwhile. Also per phase, that share over
    every cache (the syscall layer's `page_cache_hit_pct`)."""
    caches: dict[str, dict[str, CacheStats]] = {p: {} for p in schema.PHASES}
    buffered_dev: dict[tuple[str, str], int] = {}  # (phase, cache) -> buffered reads' device
    for r in rows:
        p, cache = r.phase, r.cache
        c = caches[p].get(cache)
        if c is None:
            c = caches[p][cache] = {"read": _cache_op(), "write": _cache_op()}
        e = c[cast(MainOp, r.op)]
        e["ios"] += int(r.ios)
        e["bytes"] += int(r.bytes)
        e["direct_bytes"] += int(r.bytes) if r.direct else 0
        e["busy_s"] += int(r.busy_ns) / 1e9
        e["bandwidth_bytes_per_s"] = per_second(e["bytes"], times[p])
        if r.op == "read":
            e["device_bytes"] = e.get("device_bytes", 0) + int(r.device_bytes)
            if not r.direct:
                buffered_dev[(p, cache)] = buffered_dev.get((p, cache), 0) + int(r.device_bytes)
    hits: dict[str, float | None] = {}
    for p in schema.PHASES:
        app = dev = 0  # buffered reads of every cache
        for cache, c in caches[p].items():
            rd = c["read"]
            buffered = rd["bytes"] - rd["direct_bytes"]
            rd.setdefault("device_bytes", 0)
            rd["page_cache_hit_pct"] = _hit_pct(buffered, buffered_dev.get((p, cache), 0))
            app += buffered
            dev += buffered_dev.get((p, cache), 0)
        hits[p] = _hit_pct(app, dev)
    return caches, hits


def _cache_op() -> CacheOp:
    return {"ios": 0, "bytes": 0, "bandwidth_bytes_per_s": 0.0, "direct_bytes": 0,
            "busy_s": 0.0}


def _writeback(rows: list[WritebackRow]) -> tuple[dict[str, Writeback], Count]:
    """Flush-thread writes of the buffered files, under the phase (and cache) whose writes
    dirtied them (phases.<p>.writeback), with `elsewhere_bytes` the part issued while
    another phase ran (where the block layer files it); and what no traced write explains."""
    out: dict[str, Writeback] = {
        p: {"ios": 0, "bytes": 0, "elsewhere_bytes": 0, "caches": {}} for p in schema.PHASES}
    lost: Count = {"ios": 0, "bytes": 0}
    for r in rows:
        if r.phase is None or r.cache is None:
            lost["ios"] += int(r.ios)
            lost["bytes"] += int(r.bytes)
            continue
        wb = out[r.phase]
        wb["ios"] += int(r.ios)
        wb["bytes"] += int(r.bytes)
        wb["elsewhere_bytes"] += int(r.elsewhere_bytes or 0)
        c = wb["caches"].setdefault(r.cache, {"ios": 0, "bytes": 0})
        c["ios"] += int(r.ios)
        c["bytes"] += int(r.bytes)
    return out, lost


def _hit_pct(app_bytes: int, device_bytes: int) -> float | None:
    """Share of buffered read bytes the page cache served, or None without any."""
    return 100.0 * max(0.0, 1 - device_bytes / app_bytes) if app_bytes > 0 else None


def _idle(ws: np.ndarray, we: np.ndarray, wp: np.ndarray, devices: list[str],
          islands_of: IslandsOf, device_time_of: DeviceTimeOf) -> IdleByPhase:
    """Per phase, the share of its time with no block request in flight, and the mean
    number in flight while there was one (`inflight_mean`: its requests' summed device time
    over that busy time): on all traced devices together and per device. In flight = from
    insert (or issue, when the request skipped the queue) to completion, the span the
    kernel's io_ticks also covers."""
    def idle_of(device: str | None) -> dict[str, tuple[float | None, float | None]]:
        isl_s, isl_e = islands_of(device)
        busy = busy_between(isl_s, isl_e, ws, we)
        spent = device_time_of(device)
        out = {}
        for p in schema.PHASES:
            sel = wp == p
            busy_ns = float(busy[sel].sum())
            out[p] = (idle_pct(busy_ns / NS, float((we[sel] - ws[sel]).sum()) / NS),
                      inflight_mean(spent.get(p, 0), busy_ns))
        return out

    overall = idle_of(None)
    per_dev = {d: idle_of(d) for d in devices}
    return {p: (*overall[p], {d: {"time_idle_pct": per_dev[d][p][0],
                                  "inflight_mean": per_dev[d][p][1]} for d in devices})
            for p in schema.PHASES}


# -- the dashboard's frame: the report of a window, and the same rows over time ----------------

@dataclass(frozen=True)
class Frame:
    """Everything a dashboard frame shows for the window [t0, t1), as computed here."""
    info: SessionInfo
    t0: int
    t1: int
    summary: Summary  # the report of exactly [t0, t1) and the view
    # phase -> {"layer": the device layer, "read"/"write": (now, mean, peak) bytes/s}
    rates: dict[str, dict[str, Any]]
    bin_ns: int
    # (bin start, the phase covering most of it or None outside the session, bytes)
    timeline: list[tuple[int, str | None, int]]
    gpu: GpuMeans | None  # GPU means over the window, None with `gpu_note` saying why
    gpu_note: str
    recent: int  # I/O issued in the last second of the window
    devices: list[str]  # the traced devices and every device of the window
    processes: tuple[tuple[int, str], ...]  # the window's busiest processes
    windows: int  # phase windows reaching into the view


def window_bounds(start_ns: int, now_ns: int, window_s: float | None) -> tuple[int, int]:
    """[t0, t1) of a window of window_s ending now (None: the whole session so far)."""
    t1 = max(now_ns, start_ns)
    t0 = start_ns if window_s is None else max(start_ns, t1 - int(window_s * NS))
    return t0, t1


def frame(rows: RowSource, window_s: float | None, now_ns: int,
          view: ViewFilter = ViewFilter(), timeline_s: float = 60.0,
          timeline_bins: int = 60) -> Frame:
    """The window of `window_s` ending at `now_ns` (session clock). The timeline spans the
    last `timeline_s` (early on partly before the session), or the whole session when that
    is the window."""
    info = rows.info()
    origin = info.start_ns
    t0, t1 = window_bounds(origin, now_ns, window_s)
    span_t0 = min(t0, t1 - int(timeline_s * NS)) if window_s is not None else t0
    bin_ns = max(1, math.ceil((t1 - span_t0) / timeline_bins))
    edges = span_t0 + np.arange(timeline_bins + 1, dtype=np.int64) * bin_ns
    lo, hi = max(span_t0, origin), max(t1, origin + 1)
    # Phase pieces over the whole span any grid below touches: the windows are read once.
    windows = rows.windows(lo, hi)
    summary = summarize(rows, t0, t1, view, info, windows)
    ws, we, wp = flatten(windows, lo, hi)

    # Per-second rates inside the window by phase: grid seconds, the outer two cut at t0, t1.
    c0 = (t0 - origin) // GRID_NS
    ncells = max(1, (max(t1 - 1, t0) - origin) // GRID_NS - c0 + 1)
    rate_edges = origin + (c0 + np.arange(ncells + 1, dtype=np.int64)) * GRID_NS
    rate_edges[0], rate_edges[-1] = t0, max(t1, t0)
    got = rows.over_time(Pieces(ws, we, wp, t0, t1, origin), view, c0, ncells, edges)
    ptime = _phase_time(ws, we, wp, rate_edges)
    rates = {p: _rates(p, summary["phases"][p], got.cell_bytes, ptime[p])
             for p in schema.PHASES}

    seen = dict(zip(schema.LAYERS, got.layers_seen.tolist()))
    layer = device_layer(seen["block"], seen["io_uring"])
    total = got.bin_bytes[schema.LAYERS.index(layer)]
    tl_time = _phase_time(ws, we, wp, edges)
    stacked = np.vstack([tl_time[p] for p in schema.PHASES])
    timeline = []
    for i in range(timeline_bins):
        covered = edges[i + 1] > origin and edges[i] < t1 and stacked[:, i].sum() > 0
        phase = schema.PHASES[int(stacked[:, i].argmax())] if covered else None
        timeline.append((int(edges[i]), phase, int(total[i])))

    gpu, gpu_note = gpu_means(rows, t0, t1)
    devices = list(dict.fromkeys([d["name"] for d in info.devices] + got.devices))
    # A process is shown as what it is in the serving stack where that is known.
    named = {p["tgid"]: p["role"] for p in summary["session"]["processes"] if p["role"]}
    processes = tuple((t, named.get(t, comm)) for t, comm in got.processes)
    return Frame(info, t0, t1, summary, rates, bin_ns, timeline, gpu, gpu_note, got.recent,
                 devices, processes, len(windows))


def timeline(rows: RowSource, nbins: int = 200, mixed: str = "apart") -> dict[str, Any]:
    """The whole session over time, for the visual report: `nbins` bins from its start, each
    with the phase covering most of it, per phase the device layers' requests and bytes
    issued in it (as the report attributes them: summed over the bins, they are the report's
    per-phase counts), and mean GPU utilisation where NVML was sampled."""
    info = rows.info()
    t0, t1 = info.start_ns, max(info.end_ns, info.start_ns + 1)
    bin_ns = max(1, math.ceil((t1 - t0) / nbins))
    edges = t0 + np.arange(nbins + 1, dtype=np.int64) * bin_ns
    windows = rows.windows()
    if mixed == "split":
        windows = split_mixed(windows)
    ws, we, wp = flatten(windows, t0, t1)
    covered = _phase_time(ws, we, wp, edges)
    stacked = np.vstack([covered[p] for p in schema.PHASES])
    series: dict[str, Any] = {}
    whole = Pieces(*flatten_whole(windows, t0, t1), t0, t1, t0, True)
    for b, p, layer, op, ios, nbytes in rows.bins(whole, bin_ns, nbins):
        s = series.setdefault(f"{p}.{layer}.{op}", {"phase": p, "layer": layer, "op": op,
                                                    "ios": [0] * nbins, "bytes": [0] * nbins})
        s["ios"][int(b)] = int(ios)
        s["bytes"][int(b)] = int(nbytes)
    gpu = {"util_pct": [None] * nbins, "sm_active_pct": [None] * nbins}
    for b, util, sm in rows.gpu_bins(t0, bin_ns, nbins):
        gpu["util_pct"][int(b)], gpu["sm_active_pct"][int(b)] = util, sm
    return {"start_ns": t0, "bin_s": bin_ns / NS,
            "phase": [schema.PHASES[int(i)] for i in stacked.argmax(axis=0)],
            "series": series, "gpu": gpu if any(v is not None for v in gpu["util_pct"]) else None}


def _phase_time(ws: np.ndarray, we: np.ndarray, wp: np.ndarray, edges: np.ndarray
                ) -> dict[str, np.ndarray]:
    """Phase -> ns of that phase inside each bin; one phase's pieces are disjoint islands."""
    return {p: busy_between(ws[wp == p], we[wp == p], edges[:-1], edges[1:])
            for p in schema.PHASES}


def _rates(p: str, ph: PhaseStats, cell_bytes: dict[tuple[str, str, str], np.ndarray],
           ptime: np.ndarray) -> dict[str, Any]:
    """Bytes/s of the phase's device layer: in its latest second, over the window (the
    report's bandwidth), and its best second."""
    layer = phase_layer(ph)
    # A phase shorter than the bar (a 25 ms prefill) still gets a rate from its longest bins.
    ok = (ptime > 0) & (ptime >= min(MIN_BIN_SHARE * GRID_NS, 0.5 * ptime.max()))
    out: dict[str, Any] = {"layer": layer}
    for op in MAIN_OPS:
        mean = ph[layer][op]["bandwidth_bytes_per_s"]
        nbytes = cell_bytes.get((p, layer, op))
        if nbytes is None or not ok.any():
            out[op] = (0.0, mean, mean)
            continue
        r = np.where(ok, nbytes / np.maximum(ptime, 1) * NS, 0.0)
        last = int(np.flatnonzero(ok)[-1])
        out[op] = (float(r[last]), mean, max(float(r.max()), mean))
    return out


def gpu_means(rows: RowSource, t0: int, t1: int) -> tuple[GpuMeans | None, str]:
    """Means of the GPU samples in [t0, t1) (a field a GPU does not support is left out, not
    counted as zero), or None and why there are none."""
    row = rows.gpu(t0, t1)
    if row is None:
        return None, "no GPU data: this session was recorded before NVML support"
    if not row.samples:
        return None, ("no GPU samples in this window" if row.session_samples else
                      "no GPU data: no NVML samples (no GPU, or not recorded with --phases nvml)")
    return row, ""
