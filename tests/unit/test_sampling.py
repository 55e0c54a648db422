"""The event tier's sampling controller on the kernel's request counts (no kernel needed)."""
from __future__ import annotations

import numpy as np
import pytest

from kvprof.capture import sampling


def test_the_shift_rises_at_once_and_falls_one_step_after_calm(monkeypatch):
    """Driven by the kernel's count of requests started, whatever was drained."""
    clock = [0.0]
    monkeypatch.setattr(sampling.time, "monotonic", lambda: clock[0])
    set_to: list[int] = []
    s = sampling.Sampler(1000, set_to.append)
    started = [0]

    def second(n: int):
        clock[0] += 1.0
        started[0] += n
        return s.saw(lambda: started[0], now_ns=int(clock[0] * 1e9))

    assert second(900) is None and s.shift == 0
    change = second(8000)  # 8000/s offered: 1 in 8 keeps 1000
    assert s.shift == 3 and set_to == [3]
    assert change.to_pydict() == {"ts_ns": [int(clock[0] * 1e9)], "shift": [3]}
    # Still 8000/s offered (whatever share of it was kept): no change.
    assert second(8000) is None and s.shift == 3
    # Quiet: down one step only after CALM_S seconds that would fit.
    for _ in range(int(sampling.CALM_S) - 1):
        assert second(80) is None
    assert second(80) is not None and s.shift == 2
    assert set_to == [3, 2]


def test_zero_keeps_every_row():
    s = sampling.Sampler(0, lambda k: None)
    assert s.saw(lambda: 10 ** 9) is None and s.shift == 0


def test_weighted_quantiles_weigh_each_row_by_what_it_stands_for():
    """1000 rows of 100 µs kept at 1 in 1, 1000 rows of 1 ms kept at 1 in 8: 9000 requests,
    8000 of them 1 ms, so the median is 1 ms (unweighted it would fall between)."""
    from kvprof.analysis.rowsource import WEIGHTED_STEPS, _weighted_q

    def bucket(us: float) -> int:
        return int(np.floor(np.log2(us * 1e3) * WEIGHTED_STEPS))

    q = dict(zip(("p50", "p90", "p99", "p999"),
                 _weighted_q({bucket(100): 1000, bucket(1000): 8000})))
    assert q["p50"] == pytest.approx(1000, rel=0.025)
    assert q["p99"] == pytest.approx(1000, rel=0.025)
    q = _weighted_q({bucket(100): 8000, bucket(1000): 1000})
    assert q[0] == pytest.approx(100, rel=0.025) and q[2] == pytest.approx(1000, rel=0.025)
    assert _weighted_q({}) == [None] * 4
    assert _weighted_q({-1: 5}) == [0.0] * 4  # no queue time at all


def test_a_quiet_device_lowers_the_rate_too(monkeypatch):
    """No request at all (the device went quiet) counts as calm: record calls saw() every
    take."""
    clock = [0.0]
    monkeypatch.setattr(sampling.time, "monotonic", lambda: clock[0])
    s = sampling.Sampler(1000, lambda k: None)
    clock[0] += 1.0
    s.saw(lambda: 8000)
    assert s.shift == 3
    for _ in range(int(sampling.CALM_S / sampling.WINDOW_S)):
        clock[0] += sampling.WINDOW_S
        s.saw(lambda: 8000)
    assert s.shift == 2


def test_the_drain_sleeps_longer_the_slower_the_ring_fills():
    """Wake-ups cost the traced workload: the drain thread sleeps as long as the ring allows
    at the rate it last saw (due before it is 1/8 full), within its bounds."""
    from kvprof.capture import ebpf

    ring = 16 << 20
    assert ebpf.next_drain(0, 0.1, ring) == ebpf.DRAIN_IDLE_S  # nothing came
    # ~45 MB/s (a row for every request at 350 k IOPS): due before 2 MiB, in ~47 ms
    assert ebpf.next_drain(4_500_000, 0.1, ring) == pytest.approx(ring / 8 / 45e6)
    assert ebpf.next_drain(ring, 0.1, ring) == ebpf.DRAIN_INTERVAL_S  # a flood
    # ~1 MB/s (the default's 10 000 rows a second, sampled): the longest
    assert ebpf.next_drain(100_000, 0.1, ring) == ebpf.DRAIN_IDLE_S
