"""Human-readable numbers shared by every view (report, findings, TUI)."""
from __future__ import annotations


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
