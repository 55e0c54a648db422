"""A recording's phase windows sent again while `kvprof replay` issues its requests, on the
replay's clock, so each replayed request is issued inside its recorded phase's window however
late the candidate lets it go out. The replay decides when each piece of the recording (cut
where the phase changes: fold.flatten's `bounds`) starts on its clock (`edges`, replay/gate.py's
Gate). A window edge at recording time t is sent at max(t on the replay's clock, its piece's
start): a monotone map, so windows keep their order and overlaps and each piece its phase; a
shifting replay (`schedule(shift=True)`) puts t at its offset from its piece's start instead."""
from __future__ import annotations

import time

import numpy as np
import pyarrow as pa

from kvprof.phases.base import PhaseSource
from kvprof.phases.windows import phase_row

UNKNOWN = np.iinfo(np.int64).min  # a piece's start the replay has not decided yet
BEFORE = UNKNOWN + 1  # the first piece's: it starts before every edge


def new_edges(pieces: int, buffer=None) -> np.ndarray:
    """Each piece's start on the replay's clock (monotonic ns), none decided yet; in
    `buffer` (shared with the process that replays) where given."""
    edges = (np.zeros(pieces, np.int64) if buffer is None
             else np.frombuffer(buffer, np.int64, pieces))
    edges[:] = UNKNOWN
    if pieces:
        edges[0] = BEFORE
    return edges


def in_shifted_pieces(t: np.ndarray, piece: np.ndarray, bounds: np.ndarray,
                      edges: np.ndarray, start_ns: int, t0: int, speed: float) -> np.ndarray:
    """Recording times `t`, each in phase piece `piece`, on a shifting replay's clock
    (Gate.shift): at their offset from their piece's start, piece j >= 1 starting at edges[j]
    (recording: bounds[j - 1]), the first at start_ns (recording: t0)."""
    began = np.where(piece > 0, bounds[np.maximum(piece - 1, 0)] if len(bounds) else t0, t0)
    at = np.where(piece > 0, np.asarray(edges, np.int64)[piece], start_ns)
    return at + ((t - began) / speed).astype(np.int64)


class ReplayedWindows(PhaseSource):
    name = "replay"
    interval_s = 0.1

    def __init__(self, windows: pa.Table, bounds: np.ndarray | None = None) -> None:
        """`windows`: store.phase_windows' columns, on the recording's clock; `bounds`: the
        recording's times where its phase changes (Recorded.bounds), none: one piece."""
        super().__init__()
        self._w = windows.to_pylist()
        self._start = np.array([w["start_ns"] for w in self._w], np.int64)
        self._end = np.array([w["end_ns"] for w in self._w], np.int64)
        self._bounds = np.zeros(0, np.int64) if bounds is None else np.asarray(bounds, np.int64)
        self._sent = np.zeros(len(self._w), bool)
        self._at: tuple[int, int, float] | None = None
        self._edges: np.ndarray | None = None
        self._shift = False

    def schedule(self, start_ns: int, t0_ns: int, speed: float,
                 edges: np.ndarray | None = None, shift: bool = False) -> None:
        """The recording's time `t0_ns` falls at `start_ns` (monotonic) in the replay, which
        runs `speed` times as fast; `edges`: where each piece starts in the replay, as the
        replay decides it (new_edges; read, never written here), none: where it was due;
        `shift` (the replay's Gate.shift): a time in a piece lies at its offset from the
        piece's start, so a stretched piece moves every later window."""
        self._at = (int(start_ns), int(t0_ns), float(speed))
        self._edges = edges
        self._shift = shift

    def warp(self, t: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Recording times on the replay's clock, and whether each is decided yet."""
        assert self._at is not None
        start, t0, speed = self._at
        moved = start + ((t - t0) / speed).astype(np.int64)
        if self._edges is None:
            return moved, np.ones(len(t), bool)
        piece = np.searchsorted(self._bounds, t, side="right")
        edge = np.array(self._edges)[piece]
        known = edge != UNKNOWN
        if self._shift:
            offset = in_shifted_pieces(t, np.where(known, piece, 0), self._bounds,
                                       self._edges, start, t0, speed)
            return np.where(known, offset, moved), known
        return np.where(known, np.maximum(moved, edge), moved), known

    def _row(self, i: int, start: int, end: int) -> dict:
        w = self._w[i]
        return phase_row(start, end, w["phase"], w["source"],
                         prefill_tokens=w["prefill_tokens"], decode_tokens=w["decode_tokens"])

    def _send(self, until_ns: int, cut: bool) -> None:
        """Send the windows ended by `until_ns`; `cut`: those begun by then too, ended there.
        A window the replay squeezed to nothing (its piece started after its end was due)
        is not sent."""
        if self._at is None:
            return
        s, s_known = self.warp(self._start)
        e, e_known = self.warp(self._end)
        if cut:
            due = ~self._sent & s_known & (s < until_ns)
            e = np.where(e_known, np.minimum(e, until_ns), until_ns)
        else:
            due = ~self._sent & e_known & (e <= until_ns)
        for i in np.flatnonzero(due & (e > s)):
            self.emit("phase", self._row(int(i), int(s[i]), int(e[i])))
        self._sent |= due

    def poll(self) -> None:
        """(Windows are sent at the recorder's flushes, `take`: one sent between taking the
        sources' rows and asking for the open ones would be in neither.)"""

    def take(self) -> dict[str, pa.Table]:
        self._send(time.monotonic_ns(), cut=False)
        return super().take()

    def open_rows(self, now_ns: int) -> list[dict]:
        """The windows begun and not sent, up to their end where it is decided and has come
        (sent at the next flush), else up to now: a piece the replay is still issuing goes
        on at least until now."""
        if self._at is None:
            return []
        s, s_known = self.warp(self._start)
        e, e_known = self.warp(self._end)
        e = np.where(e_known, np.minimum(e, now_ns), now_ns)
        return [self._row(int(i), int(s[i]), int(e[i]))
                for i in np.flatnonzero(~self._sent & s_known & (s < e))]

    def close(self, end_ns: int) -> None:
        self._send(end_ns, cut=True)
