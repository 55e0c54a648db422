"""How many device-layer requests the event tier keeps: all of them up to a rate, past it 1 in
2^shift, chosen from the rate offered (rows kept times their weight, an unbiased
count). The aggregate tier counts every request whatever this decides; the rows carry their
weight (schema.IO sample_weight) and each change is stored (schema.EVENT_SAMPLING), so reports
know which figures are exact and which sampled.

Decided at every take (WINDOW_S or more apart): raised at once when the rate is over the
budget (a burst must not flood the ring and the store), lowered one step after CALM_S seconds
in a row that would fit the budget even then.
"""
from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from kvprof import schema

MAX_SHIFT = 16
WINDOW_S = 0.25
CALM_S = 3.0
DEVICE_LAYERS = list(schema.DEVICE_LAYERS)


class Sampler:
    def __init__(self, max_rate: int, set_shift: Callable[[int], None]):
        """`max_rate`: device-layer rows a second to keep before sampling; 0: every one."""
        self.max_rate = max_rate
        self.shift = 0
        self._set = set_shift
        self._offered = 0
        self._since = time.monotonic()
        self._calm = 0.0

    def saw(self, io: pa.RecordBatch | None, now_ns: int | None = None
            ) -> pa.RecordBatch | None:
        """Count the rows just taken; returns an event_sampling row when the rate changes."""
        if not self.max_rate:
            return None
        if io is not None and io.num_rows:
            device = pc.is_in(io.column("layer"), pa.array(DEVICE_LAYERS))
            weights = np.asarray(io.column("sample_weight"), np.int64)
            self._offered += int(weights[np.asarray(device, bool)].sum())
        now = time.monotonic()
        elapsed = now - self._since
        if elapsed < WINDOW_S:
            return None
        rate = self._offered / elapsed
        self._offered, self._since = 0, now
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
