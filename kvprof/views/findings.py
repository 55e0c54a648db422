"""Plain-language findings from the summary dict of `correlate.summarize`.

A pure function of that dict, so `kvprof report`, its JSON, the dashboard and tests all say the
same thing. Each finding names its rule and the report figures it rests on (`figures`: JSON
paths into the report and their values), so a reader can check it. The rules: docs/report.md,
"Findings"; the thresholds: the constants below. A device kept busy by about one request in
flight at a time is latency-bound whatever the size: more in flight would raise the bandwidth."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import cast

from kvprof import schema
from kvprof.analysis.correlate import MAIN_OPS, phase_layer
from kvprof.caches import OTHER
from kvprof.summary import MainOp, OpStats, PhaseStats, Summary
from kvprof.units import human_bytes, human_us, size_label

# Requests at least this large count as bulk transfers, below SMALL_BYTES as point lookups.
LARGE_BYTES = 128 << 10
SMALL_BYTES = 64 << 10
# Device busier than this (idle below 100 - BUSY_PCT) during the phase: it is the limit.
BUSY_PCT = 50.0
# Fewer requests than this in flight on average while the device was busy: one at a time
# (two overlapping requests for a quarter of the busy time make 1.25; halves, 1.5).
ONE_AT_A_TIME = 1.5
# Sized for one phase: the other phase leaves at least this much idle, over at least
# OTHER_SHARE_PCT of the session's time.
IDLE_PCT = 80.0
OTHER_SHARE_PCT = 10.0
# Time split: a phase taking this share of the time, and DOMINANT times the other's.
SPLIT_SHARE_PCT = 30.0
DOMINANT = 3.0
# Writeback elsewhere: at least this share of a phase's writeback landed in other phases.
ELSEWHERE_PCT = 20.0
# Small writes: at least this share of a phase's block writes below the physical block.
SMALL_WRITE_PCT = 10.0
# Prefix cache: the reads this many more points of hit share would remove.
HIT_STEP_PCT = 10.0
# Offload: the KV cache files' reads the page cache served, at least this share, are not
# device reads; the engine's bytes and its files' differ past this share.
PAGE_CACHE_PCT = 50.0
BYTES_DIFFER_PCT = 10.0
# Reads of the KV cache files in flight for at least this share of the requests' summed time
# to first token: prefix loads wait on storage.
LOAD_WAIT_PCT = 25.0
# The files' reads in flight for at most this share of the engine's own load time: the time
# goes above the storage.
ABOVE_STORAGE_PCT = 50.0
# A phase's own finding rests on at least this many requests of one op: fewer are incidental
# (a file system's journal flushing a few blocks, a log line), not a workload to size for.
MIN_IOS = 32


@dataclass(frozen=True)
class Finding:
    rule: str
    phase: str | None
    text: str
    figures: dict = field(default_factory=dict)  # report path -> the value it rests on

    def as_dict(self) -> dict:
        return {"rule": self.rule, "phase": self.phase, "text": self.text,
                "figures": self.figures}


def _main_op(ph: PhaseStats, least: int = 1) -> tuple[str, str, OpStats] | None:
    """(layer, op, entry) carrying most bytes in the phase's device layer (ties: read), of
    the ops with at least `least` requests."""
    layer = phase_layer(ph)
    ops = [(op, ph[layer][op]) for op in MAIN_OPS if ph[layer][op]["ios"] >= max(1, least)]
    if not ops:
        return None
    op, e = max(ops, key=lambda kv: kv[1]["bytes"])
    return layer, op, e


def _little_io(phase: str, ph: PhaseStats, main: tuple[str, str, OpStats]) -> Finding:
    """A phase whose ops all have fewer than MIN_IOS requests; `main`: its `_main_op`."""
    _, op, e = main
    layer = phase_layer(ph)
    at = f"phases.{phase}.{layer}.{op}"
    others = [f"{ph[layer][o]['ios']} {o}s" for o in MAIN_OPS if o != op and ph[layer][o]["ios"]]
    return Finding("little-io", phase, (
        f"{phase}: little storage I/O, {e['ios']} {op}s ({human_bytes(e['bytes'])})"
        f"{''.join(', ' + o for o in others)} in {ph['time_s']:.1f} s: too few requests "
        f"(under {MIN_IOS}) to judge the storage by"),
        {f"{at}.ios": e["ios"], f"{at}.bytes": e["bytes"], f"phases.{phase}.time_s": ph["time_s"]})


def _phase(phase: str, ph: PhaseStats) -> Finding | None:
    """What limits one phase, and whose I/O it is; None when the phase took no time."""
    if ph["time_s"] <= 0:
        return None
    some = _main_op(ph)
    if some is None:
        return Finding("no-io", phase, f"{phase}: no storage I/O in {ph['time_s']:.1f} s",
                       {f"phases.{phase}.time_s": ph["time_s"]})
    found = _main_op(ph, MIN_IOS)
    f = _little_io(phase, ph, some) if found is None else _limit(phase, ph, found)
    return _whose(f, phase, ph, cast(MainOp, (found or some)[1]))


def _whose(f: Finding, phase: str, ph: PhaseStats, op: MainOp) -> Finding:
    """The finding with whose I/O it is, where the syscall layer traced the phase's files:
    the share of the phase's file calls of its op on the KV caches' files, the rest
    being other files (logs, weights, the file system's own)."""
    caches = ph["caches"]
    total = sum(c[op]["bytes"] for c in caches.values())
    if not total:
        return f
    kv = {name: c[op]["bytes"] for name, c in caches.items() if name != OTHER and c[op]["bytes"]}
    pct = 100.0 * sum(kv.values()) / total
    said = (f"{pct:.0f} % of the phase's file {op}s ({human_bytes(total)}) were on KV cache "
            f"files ({', '.join(sorted(kv))})" if kv else
            f"none of the phase's file {op}s ({human_bytes(total)}) were on KV cache files")
    return Finding(f.rule, f.phase, f"{f.text}; {said}", {
        **f.figures, **{f"phases.{phase}.caches.{name}.{op}.bytes": c[op]["bytes"]
                        for name, c in caches.items() if c[op]["bytes"]}})


def _limit(phase: str, ph: PhaseStats, found: tuple[str, str, OpStats]) -> Finding:
    """What limits one phase, from `found`: its `_main_op` of at least MIN_IOS requests."""
    base = f"phases.{phase}"
    layer, op, e = found
    at = f"{base}.{layer}.{op}"
    idle = ph["block"].get("time_idle_pct")
    cap = ph["block"].get("capacity_idle_pct")
    # (reports before kvprof measured it have no such key; over several devices it adds
    # theirs up, and two devices each serving one request at a time are not one serving two)
    depth = (ph["block"].get("inflight_mean") if len(ph["block"].get("devices", {})) <= 1
             else None)
    figures = {f"{at}.bytes": e["bytes"], f"{at}.ios": e["ios"],
               f"{at}.bandwidth_bytes_per_s": e["bandwidth_bytes_per_s"],
               f"{base}.block.time_idle_pct": idle}
    if depth is not None:
        figures[f"{base}.block.inflight_mean"] = depth
    mean_size = e["bytes"] / e["ios"]
    # The most common request size names the pattern better than the mean of a mix.
    common = max(e["size_hist"].items(), key=lambda kv: kv[1], default=(mean_size, 0))[0]
    size = size_label(int(common))
    p99 = e["latency_us"]["p99"]
    p99_txt = f"p99 = {human_us(p99)}"
    figures[f"{at}.latency_us.p99"] = p99
    if p99 is None and "p99_below_us" in e:
        # Recorded without events: only the kernel's log2 histogram bounds the percentile.
        p99_txt = f"p99 < {human_us(e['p99_below_us'])}"
        figures[f"{at}.p99_below_us"] = e["p99_below_us"]
    bw = f"{human_bytes(e['bandwidth_bytes_per_s'])}/s"
    noun = f"{phase} {op}s" + ("" if layer == "block" else f" ({layer})")
    idle_txt = "" if idle is None else f" while the device is {idle:.0f} % idle"
    cap_txt = ""
    if cap is not None:
        cap_txt = f", {cap:.0f} % of its calibrated capacity unused"
        figures[f"{base}.block.capacity_idle_pct"] = cap
    used = None if idle is None else 100 - idle  # % of the phase the device was busy
    busy = used is not None and used >= BUSY_PCT
    if used is not None and busy and depth is not None and depth < ONE_AT_A_TIME:
        # Busy, but by one request at a time: each waits out the device's latency, and the
        # device could serve more side by side (its bandwidth is not what was reached).
        p50 = e["latency_us"]["p50"]
        lat_txt = p99_txt if p50 is None else f"p50 = {human_us(p50)}"
        if p50 is not None:
            figures[f"{at}.latency_us.p50"] = p50
        more = "readers" if op == "read" else "writers" if op == "write" else "submitters"
        return Finding("latency-bound", phase, (
            f"{noun} are latency-bound: one request at a time in flight ({depth:.1f} on "
            f"average while the device was busy, {used:.0f} % of the phase), {size} "
            f"requests at {lat_txt}, {bw}{cap_txt}; more in flight (parallel {more}, a "
            "deeper queue) would raise the bandwidth"), figures)
    depth_txt = "" if depth is None else f"{depth:.1f} in flight on average, "
    if used is not None and busy and mean_size >= LARGE_BYTES:
        return Finding("bandwidth-bound", phase,
                       f"{noun} are bandwidth-bound at {bw} ({size} requests, {depth_txt}"
                       f"device busy {used:.0f} % of the phase{cap_txt})", figures)
    if idle is not None and mean_size >= LARGE_BYTES and idle >= IDLE_PCT and \
            (cap is None or cap >= IDLE_PCT):
        return Finding("not-storage-bound", phase, (
            f"{noun}: {bw} in {size} requests while the device is {idle:.0f} % idle"
            f"{cap_txt}: storage is not what limits them (a cgroup I/O limit, too few "
            "writers or readers, or the engine's own pace is)"), figures)
    if mean_size < SMALL_BYTES and not busy:
        depth_txt = "" if depth is None else f", {depth:.1f} in flight on average while busy"
        return Finding("latency-bound", phase, f"{noun} are latency-bound at {p99_txt}"
                                               f"{idle_txt}{depth_txt}{cap_txt}", figures)
    figures[f"{at}.iops"] = e["iops"]
    return Finding("phase-io", phase, f"{noun}: {bw} in {size} requests, {e['iops']:.0f} IOPS, "
                                      f"{p99_txt}{idle_txt}{cap_txt}", figures)


def phase_finding(phase: str, ph: PhaseStats) -> str | None:
    """One sentence about this phase, or None when the phase took no time."""
    f = _phase(phase, ph)
    return None if f is None else f.text


def _busy(ph: PhaseStats) -> tuple[float, str, str, float] | None:
    """How much of the device the phase uses, in %: of its calibrated capacity where known,
    else of its time; with the report path it comes from, its word and the report's
    figure there."""
    block = ph["block"]
    if (cap := block["capacity_idle_pct"]) is not None:
        return 100 - cap, "capacity_idle_pct", "capacity", cap
    if (idle := block["time_idle_pct"]) is not None:
        return 100 - idle, "time_idle_pct", "time", idle
    return None


def _sized_for_one_phase(summary: Summary) -> list[Finding]:
    phases = summary["phases"]
    work = [p for p in ("prefill", "decode", "mixed") if phases[p]["time_s"] > 0]
    used = {p: u for p in work if (u := _busy(phases[p])) is not None}
    if len(used) < 2:
        return []
    peak = max(used, key=lambda p: used[p][0])
    if used[peak][0] < BUSY_PCT:
        return []
    out = []
    for other in used:
        share = phases[other]["time_share_pct"]
        idle, key, word = 100 - used[other][0], used[other][1], used[other][2]
        if other == peak or idle < IDLE_PCT or share < OTHER_SHARE_PCT:
            continue
        peak_key = used[peak][1]
        uses = (f"keeps the device busy {used[peak][0]:.0f} % of its time"
                if used[peak][2] == "time" else
                f"uses {used[peak][0]:.0f} % of the device's calibrated capacity")
        leaves = (f"leaves it idle {idle:.0f} % of its time" if word == "time" else
                  f"leaves {idle:.0f} % of that capacity unused")
        text = (f"storage is sized for {peak}'s peak: {peak} {uses}, while {other} "
                f"({share:.0f} % of the session) {leaves}")
        out.append(Finding("sized-for-one-phase", other, text, {
            f"phases.{peak}.block.{peak_key}": used[peak][3],
            f"phases.{other}.block.{key}": used[other][3],
            f"phases.{other}.time_share_pct": share}))
    return out


def _time_split(summary: Summary) -> list[Finding]:
    phases = summary["phases"]
    pre, dec = phases["prefill"]["time_share_pct"], phases["decode"]["time_share_pct"]
    figures = {"phases.prefill.time_share_pct": pre, "phases.decode.time_share_pct": dec}
    if dec >= SPLIT_SHARE_PCT and dec >= DOMINANT * pre:
        return [Finding("decode-dominated", "decode", (
            f"decode takes {dec:.0f} % of the time, prefill {pre:.0f} %: output-heavy serving "
            "(short prompts, long outputs); storage serves it best with low latency on small "
            "reads"), figures)]
    if pre >= SPLIT_SHARE_PCT and pre >= DOMINANT * dec:
        return [Finding("prefill-dominated", "prefill", (
            f"prefill takes {pre:.0f} % of the time, decode {dec:.0f} %: prompt-heavy serving "
            "(long contexts, short outputs); storage serves it best with write and read "
            "bandwidth"), figures)]
    return []


def _small_writes(summary: Summary) -> list[Finding]:
    """Block writes below the physical block size of a device whose logical block is smaller
    (a "512e" drive): each makes the device read, patch and rewrite a whole physical block."""
    limits = summary["session"].get("device_limits") or {}
    devs = [(name, lim["physical_block_size"]) for name, lim in limits.items()
            if lim.get("physical_block_size", 0) > lim.get("logical_block_size", 0) > 0]
    if not devs:
        return []
    dev, physical = min(devs, key=lambda d: d[1])
    out = []
    for p in schema.PHASES:
        w = summary["phases"][p]["block"]["write"]
        # Of the writes that carry data: a flush (0 bytes, out of the size histogram) writes
        # no block at all.
        sized = sum(w["size_hist"].values())
        small = {b: n for b, n in w["size_hist"].items() if int(b) < physical}
        if not sized or 100 * sum(small.values()) / sized < SMALL_WRITE_PCT:
            continue
        share = 100 * sum(small.values()) / sized
        out.append(Finding("small-writes", p, (
            f"{share:.0f} % of {p}'s block writes are smaller than {dev}'s "
            f"{size_label(physical)} physical block: the device reads and rewrites whole "
            f"blocks for them (write amplification); write in {size_label(physical)} "
            "multiples"), {
                f"phases.{p}.block.write.ios": w["ios"],
                **{f"phases.{p}.block.write.size_hist.{b}": n for b, n in small.items()},
                f"session.device_limits.{dev}.physical_block_size": physical}))
    return out


def _prefix_cache(summary: Summary) -> list[Finding]:
    hit = (summary.get("engine") or {}).get("prefix_cache_hit_pct")
    dec = summary["phases"]["decode"]
    if hit is None or hit >= 100 or dec["time_s"] <= 0:
        return []
    layer = phase_layer(dec)
    read = dec[layer]["read"]["bytes"]
    if not read:
        return []
    step = min(HIT_STEP_PCT, 100 - hit)
    saved = read * step / (100 - hit)
    return [Finding("prefix-cache", "decode", (
        f"prefix-cache hit {hit:.0f} %: if decode's storage reads scale with misses, "
        f"{step:.0f} points more would remove about {human_bytes(saved)} of its "
        f"{human_bytes(read)} read"), {"engine.prefix_cache_hit_pct": hit,
                                       f"phases.decode.{layer}.read.bytes": read})]


def _writeback(summary: Summary) -> list[Finding]:
    out = []
    for p in schema.PHASES:
        wb = summary["phases"][p].get("writeback") or {}
        total, away = wb.get("bytes", 0), wb.get("elsewhere_bytes", 0)
        if not total or 100 * away / total < ELSEWHERE_PCT:
            continue
        out.append(Finding("writeback-elsewhere", p, (
            f"{100 * away / total:.0f} % of {p}'s buffered writes ({human_bytes(away)} of "
            f"{human_bytes(total)}) reached the device in another phase, through writeback: "
            "the block layer shows them there"),
            {f"phases.{p}.writeback.bytes": total,
             f"phases.{p}.writeback.elsewhere_bytes": away}))
    return out


def _offload(summary: Summary) -> list[Finding]:
    """The engine's offload claims held to its KV cache files (the `offload` section)."""
    o = summary.get("offload")
    if not o:
        return []
    out = []
    hits, read, written = o["hit_tokens"], o["files_read_bytes"], o["files_written_bytes"]
    figures = {"offload.files_read_bytes": read, "offload.files_written_bytes": written,
               "offload.hit_tokens": hits}
    caches = ", ".join(o["caches"])
    if o["caches"] and not read and hits:
        out.append(Finding("offload-never-read", None, (
            f"the engine says its KV connector supplied {hits:.0f} prompt tokens, but no file "
            f"of its KV caches ({caches}) was read: the hits came from elsewhere (a memory "
            "tier, another process) or the files are not the ones traced"), figures))
    elif written and not read:
        queries = o["query_tokens"]
        said = ("the engine counts no connector hits here" if hits is None else
                f"its KV connector had none of the {queries:.0f} prompt tokens it was asked for"
                if queries else "the engine counted no connector hits")
        out.append(Finding("offload-never-read", None, (
            f"KV cache files ({caches}) were written {human_bytes(written)} and never read "
            f"back: stores and no loads ({said})"),
            {**figures, "offload.query_tokens": queries}))
    pct = o["page_cache_hit_pct"]
    if read and pct is not None and pct >= PAGE_CACHE_PCT:
        cached = human_bytes(read - o["device_read_bytes"])
        out.append(Finding("offload-from-page-cache", None, (
            f"{pct:.0f} % of the KV cache files' reads ({cached} of {human_bytes(read)}) came "
            "from the page cache, not the device: the offload's "
            "loads do not show the device (O_DIRECT not in effect, or a cache that fits in "
            "memory)"), {"offload.files_read_bytes": read,
                         "offload.device_read_bytes": o["device_read_bytes"],
                         "offload.page_cache_hit_pct": pct}))
    for op, claimed, done in (("read", o["claimed_read_bytes"], read),
                              ("written", o["claimed_written_bytes"], written)):
        if claimed and done and abs(done - claimed) > BYTES_DIFFER_PCT / 100 * claimed:
            per_token = o["bytes_per_token"]
            said = (f"{hits:.0f} hit tokens" if op == "read" and hits and per_token
                    and claimed == hits * per_token else "its own count")
            out.append(Finding("offload-bytes-differ", None, (
                f"the engine's offloaded bytes {op} ({human_bytes(claimed)}: {said}) and its "
                f"KV cache files' ({human_bytes(done)}) differ by "
                f"{100 * (done - claimed) / claimed:+.0f} %"), {
                    f"offload.claimed_{'read' if op == 'read' else 'written'}_bytes": claimed,
                    f"offload.files_{op}_bytes": done, "offload.hit_tokens": hits}))
    took, busy = o["engine_load_time_s"], o["files_read_busy_s"]
    if took and o["caches"] and 100 * busy / took <= ABOVE_STORAGE_PCT:
        capacity = _capacity_while_loading(summary)
        cap_txt = "" if capacity is None else (
            f", the device at {100 - capacity[1]:.0f} % of its calibrated capacity in "
            f"{capacity[0]}")
        out.append(Finding("offload-above-storage", None, (
            f"the engine's loads took {took:.3f} s by its own count, and its KV cache files' "
            f"reads were in flight {busy:.3f} s of it ({100 * busy / took:.0f} %){cap_txt}: "
            "the load time goes above the storage (copies, queues, the CPU), not to the "
            "device"), {"offload.engine_load_time_s": took, "offload.files_read_busy_s": busy,
                        **({} if capacity is None else {
                            f"phases.{capacity[0]}.block.capacity_idle_pct": capacity[1]})}))
    wait = o["load_wait_pct"]
    if wait is not None and wait >= LOAD_WAIT_PCT:
        out.append(Finding("offload-loads-wait", None, (
            f"reads of the KV cache files ({caches}) were in flight "
            f"{o['files_read_busy_s']:.3f} s of the {o['ttft_total_s'] or 0:.3f} s the "
            f"requests waited for their first token ({wait:.0f} %): prefix loads wait on "
            "storage; faster reads, or more of them at once, shorten TTFT"), {
                "offload.files_read_busy_s": o["files_read_busy_s"],
                "offload.ttft_total_s": o["ttft_total_s"], "offload.load_wait_pct": wait}))
    return out


def _capacity_while_loading(summary: Summary) -> tuple[str, float] | None:
    """(phase, its capacity_idle_pct) of the phase whose KV cache files read the most, where
    the device is calibrated."""
    reads = {p: sum(c["read"]["bytes"] for name, c in ph["caches"].items() if name != OTHER)
             for p, ph in summary["phases"].items()}
    phase = max(reads, key=lambda p: reads[p], default=None)
    if phase is None or not reads[phase]:
        return None
    idle = summary["phases"][phase]["block"]["capacity_idle_pct"]
    return None if idle is None else (phase, idle)


def findings(summary: Summary) -> list[Finding]:
    """Every finding: per phase in schema.PHASES order (those that took time), then the
    rules across phases."""
    out = [f for p in schema.PHASES if (f := _phase(p, summary["phases"][p])) is not None]
    return (out + _sized_for_one_phase(summary) + _time_split(summary)
            + _small_writes(summary) + _prefix_cache(summary) + _writeback(summary)
            + _offload(summary))
