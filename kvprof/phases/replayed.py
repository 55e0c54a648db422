"""A recording's phase windows sent again while `kvprof replay` issues its requests: each
window moved to the replay's clock and handed to the recorder as its time comes, as the
engine's sources sent them while it was recorded. So the new session's aggregate tier (its
exact counts and idle time per phase, folded by the windows the recorder knows at each flush)
and its events split by the same windows, and a live view of it sees the phase in progress.
The windows keep their sources (the rule ranks overlapping ones by source) and tokens."""
from __future__ import annotations

import time

import numpy as np
import pyarrow as pa

from kvprof.phases.base import PhaseSource
from kvprof.phases.windows import phase_row


class ReplayedWindows(PhaseSource):
    name = "replay"
    interval_s = 0.1

    def __init__(self, windows: pa.Table) -> None:
        """`windows`: store.phase_windows' columns, on the recording's clock."""
        super().__init__()
        self._w = windows.to_pylist()
        self._start = np.array([w["start_ns"] for w in self._w], np.int64)
        self._end = np.array([w["end_ns"] for w in self._w], np.int64)
        self._sent = np.zeros(len(self._w), bool)
        self._at: tuple[int, int, float] | None = None

    def schedule(self, start_ns: int, t0_ns: int, speed: float) -> None:
        """The recording's time `t0_ns` falls at `start_ns` (monotonic) in the replay, which
        runs `speed` times as fast."""
        self._at = (int(start_ns), int(t0_ns), float(speed))

    def _moved(self, t: np.ndarray) -> np.ndarray:
        assert self._at is not None
        start, t0, speed = self._at
        return start + ((t - t0) / speed).astype(np.int64)

    def _row(self, i: int, start: int, end: int) -> dict:
        w = self._w[i]
        return phase_row(start, end, w["phase"], w["source"],
                         prefill_tokens=w["prefill_tokens"], decode_tokens=w["decode_tokens"])

    def _send(self, until_ns: int, cut: bool) -> None:
        """Send the windows over by `until_ns`; `cut`: those begun by then too, ended there."""
        if self._at is None:
            return
        s, e = self._moved(self._start), self._moved(self._end)
        due = ~self._sent & ((e <= until_ns) | (cut & (s < until_ns)))
        for i in np.flatnonzero(due):
            self.emit("phase", self._row(int(i), int(s[i]), int(min(e[i], until_ns))))
        self._sent |= due

    def poll(self) -> None:
        self._send(time.monotonic_ns(), cut=False)

    def open_rows(self, now_ns: int) -> list[dict]:
        if self._at is None:
            return []
        s, e = self._moved(self._start), self._moved(self._end)
        return [self._row(int(i), int(s[i]), now_ns)
                for i in np.flatnonzero(~self._sent & (s <= now_ns) & (e > now_ns))]

    def close(self, end_ns: int) -> None:
        self._send(end_ns, cut=True)
