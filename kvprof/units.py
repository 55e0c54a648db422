"""Human-readable numbers shared by every view (report, findings, TUI)."""
from __future__ import annotations

from kvprof.summary import Engine, Offload


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def human_us(v: float | None) -> str:
    if v is None:
        return "-"
    if v >= 1_000_000:
        return f"{v / 1e6:.2f}s"
    if v >= 10_000:
        return f"{v / 1000:.0f}ms"
    if v >= 1000:
        return f"{v / 1000:.1f}ms"
    return f"{v:.0f}us"


def size_label(b: int) -> str:
    for unit, div in (("M", 1 << 20), ("K", 1 << 10)):
        if b >= div:
            return f"{b // div}{unit}"
    return f"{b}B"


def engine_parts(engine: Engine | None) -> list[str]:
    """The engines' figures a summary has (`engine`), each as a short phrase."""
    if not engine:
        return []
    parts = []
    if (ttft := engine.get("ttft_s")) is not None:
        parts.append(f"TTFT {human_us(ttft * 1e6)}")
    if (itl := engine.get("itl_s")) is not None:
        parts.append(f"inter-token {human_us(itl * 1e6)}")
    if engine.get("prefix_cache_hit_pct") is not None:
        parts.append(f"prefix-cache hit {engine['prefix_cache_hit_pct']:.1f} %")
    if engine.get("throughput_tokens_per_s") is not None:
        parts.append(f"{engine['throughput_tokens_per_s']:,.0f} tokens/s generated")
    return parts


def offload_sentence(o: Offload | None) -> str | None:
    """The engine's offload claims beside what its KV caches' files did, in a sentence;
    None where neither is known."""
    if not o or (o["hit_tokens"] is None and o["claimed_read_bytes"] is None
                 and o["claimed_written_bytes"] is None and not o["caches"]):
        return None
    per_token = o["bytes_per_token"]
    said = ["the engine counts no connector hits here" if o["hit_tokens"] is None else (
        f"the engine says its KV connector supplied {o['hit_tokens']:.0f} of "
        f"{o['query_tokens'] or 0:.0f} prompt tokens asked for"
        + ("" if not per_token else
           f" ({human_bytes(o['hit_tokens'] * per_token)} at {human_bytes(per_token)} "
           "a token)"))]
    for what, nbytes, took in (("loaded", o["claimed_read_bytes"], o["engine_load_time_s"]),
                               ("stored", o["claimed_written_bytes"],
                                o["engine_store_time_s"])):
        if took is not None or (nbytes is not None and (what == "stored"
                                                        or o["hit_tokens"] is None)):
            said.append(f"its offload {what} "
                        + (human_bytes(nbytes) if nbytes is not None else "(bytes not said)")
                        + ("" if took is None else f" in {took:.3f} s of its own"))
    if not o["caches"]:
        return (f"offload: {', '.join(said)}; no KV cache files were traced (record with "
                "--layer syscall and --cache)")
    wait = "" if o["load_wait_pct"] is None else (
        f", {o['load_wait_pct']:.0f} % of the requests' time to first token")
    return (f"offload: {', '.join(said)}; its KV cache files ({', '.join(o['caches'])}) were "
            f"read {human_bytes(o['files_read_bytes'])} (in flight "
            f"{o['files_read_busy_s']:.3f} s{wait}), {human_bytes(o['device_read_bytes'])} "
            f"of it from the device, and written {human_bytes(o['files_written_bytes'])}")
