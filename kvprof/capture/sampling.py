"""How many device-layer requests the event tier keeps: all of them up to a rate, past it 1 in
2^shift. The aggregate tier counts every request whatever this decides; the rows carry their
weight (schema.IO sample_weight) and each change is stored (schema.EVENT_SAMPLING), so reports
know which figures are exact and which sampled."""
from __future__ import annotations

import time
from collections.abc import Callable

import pyarrow as pa

from kvprof import schema

MAX_SHIFT = 16
WINDOW_S = 0.25
CALM_S = 3.0


class Sampler:
    def __init__(self, max_rate: int, set_shift: Callable[[int], None]):
        """`max_rate`: device-layer rows a second to keep before sampling; 0: every one."""
        self.max_rate = max_rate
        self.shift = 0
        self._set = set_shift
        self._started = 0
        self._since = time.monotonic()
        self._calm = 0.0

    def saw(self, started: Callable[[], int], now_ns: int | None = None
            ) -> pa.RecordBatch | None:
        """Decide from the rate offered: `started()`, the kernel's count of device-layer requests
        started so far, not the rows drained (they fall behind when the drain thread is starved
        of CPU), read every WINDOW_S in capture's drain thread (the recorder's flush can lag
        seconds behind). The shift goes up at once when the rate is over `max_rate` (a burst must
        not flood the ring and the store), down one step after CALM_S seconds in a row that would
        fit even then. Returns an event_sampling row when the shift changes."""
        if not self.max_rate:
            return None
        now = time.monotonic()
        elapsed = now - self._since
        if elapsed < WINDOW_S:
            return None
        count = started()
        rate = (count - self._started) / elapsed
        self._started, self._since = count, now
        want = 0
        while want < MAX_SHIFT and rate / (1 << want) > self.max_rate:
            want += 1
        if want > self.shift:
            self._calm = 0.0
            return self._change(want, now_ns)
        if want < self.shift:
            self._calm += elapsed
            if self._calm >= CALM_S:
                self._calm = 0.0
                return self._change(self.shift - 1, now_ns)
        else:
            self._calm = 0.0
        return None

    def _change(self, shift: int, now_ns: int | None) -> pa.RecordBatch:
        self.shift = shift
        self._set(shift)
        return row(time.monotonic_ns() if now_ns is None else now_ns, shift)


def row(ts_ns: int, shift: int) -> pa.RecordBatch:
    return pa.RecordBatch.from_arrays([pa.array([ts_ns], pa.int64()),
                                       pa.array([shift], pa.uint8())],
                                      schema=schema.EVENT_SAMPLING)
