"""The window-building core shared by the sources that label time interval by interval.

A source that learns the phase of [t0, t1) one interval at a time (a scrape interval, the span
an NVML sample averaged over) keeps one `Track` per engine or GPU. Touching intervals of one
phase merge into an open window (confidence: their duration-weighted mean; token counts, where
known, summed); a change of phase or a gap closes it. The rules for labels, gaps and held spans
stay with each source (metrics.py, nvml.py)."""
from __future__ import annotations

from dataclasses import dataclass


def phase_row(start_ns: int, end_ns: int, phase: str, source: str, engine: str = "",
              prefill_tokens: int | None = None, decode_tokens: int | None = None,
              gpu: int | None = None, confidence: float = 1.0) -> dict:
    """One row of the phase table (source is one of schema.SOURCE_RANK). Here, not in base,
    so that the classifiers build windows without pyarrow (the GPU check runs them alone)."""
    return {"start_ns": int(start_ns), "end_ns": int(end_ns), "phase": phase, "source": source,
            "engine": engine, "gpu": gpu, "prefill_tokens": prefill_tokens,
            "decode_tokens": decode_tokens, "confidence": float(confidence)}


@dataclass
class Window:
    """A window being built: it covers [start_ns, end_ns)."""

    phase: str
    start_ns: int
    end_ns: int
    weighted_ns: float = 0.0  # sum of confidence x duration, for the duration-weighted mean
    prefill: int = 0
    decode: int = 0
    counted: bool = False  # False: no interval brought token counts, so they are unknown

    def extend(self, t0: int, t1: int, confidence: float,
               tokens: tuple[int, int] | None = None) -> None:
        """Reach t1, [t0, t1) weighing with confidence. t0 is the caller's: a span that was
        held while the window stood still may weigh from before the window's end."""
        self.end_ns = t1
        self.weighted_ns += confidence * (t1 - t0)
        if tokens is not None:
            self.prefill += tokens[0]
            self.decode += tokens[1]
            self.counted = True


class Track:
    """The windows of one engine or one GPU: at most one open, rows out as they close.
    Not thread-safe: one owner feeds it; `open_row()` may be read from another thread."""

    def __init__(self, source: str, engine: str = "", gpu: int | None = None,
                 confidence_digits: int = 6) -> None:
        self.source = source
        self.engine = engine
        self.gpu = gpu
        self.confidence_digits = confidence_digits
        self.open: Window | None = None

    def add(self, phase: str, t0: int, t1: int, confidence: float = 1.0,
            tokens: tuple[int, int] | None = None) -> list[dict]:
        """Label [t0, t1) with phase; returns the row of the window this closes, if any."""
        out: list[dict] = []
        w = self.open
        if w is None or w.phase != phase or w.end_ns != t0:
            out += self.close()
            w = self.open = Window(phase, t0, t0)
        w.extend(t0, t1, confidence, tokens)
        return out

    def close(self, end_ns: int | None = None) -> list[dict]:
        """End the open window at its last interval, cut at end_ns when given."""
        w, self.open = self.open, None
        row = self._row(w, end_ns) if w is not None else None
        return [row] if row is not None else []

    def open_row(self) -> dict | None:
        """The open window up to its last interval, left open (for live views)."""
        w = self.open  # one read: the owner may replace it meanwhile
        return self._row(w) if w is not None else None

    def _row(self, w: Window, end_ns: int | None = None) -> dict | None:
        end = w.end_ns if end_ns is None else min(end_ns, w.end_ns)
        if end <= w.start_ns:
            return None
        # The mean is over what was measured, even when the row is cut shorter.
        confidence = round(w.weighted_ns / (w.end_ns - w.start_ns), self.confidence_digits)
        return phase_row(w.start_ns, end, w.phase, self.source, self.engine,
                         prefill_tokens=w.prefill if w.counted else None,
                         decode_tokens=w.decode if w.counted else None,
                         gpu=self.gpu, confidence=confidence)
