"""What `kvprof compare` says when the requests in flight changed between A and B
(views/compare.depth_changes), from figures alone."""
from __future__ import annotations

from kvprof.views.compare import depth_changes


def _figures(depth: tuple, p50: tuple, bw: tuple) -> dict:
    return {"prefill.inflight": {"a": depth[0], "b": depth[1]},
            "prefill.read.p50": {"a": p50[0], "b": p50[1]},
            "prefill.read.bandwidth": {"a": bw[0], "b": bw[1]}}


def test_more_in_flight_at_the_same_latency_says_the_device_was_waiting_on_too_few():
    got = depth_changes(_figures((1.0, 3.95), (40_700, 40_700), (4.64e6, 17.44e6)))
    assert [(c["phase"], c["op"], c["verdict"]) for c in got] == [("prefill", "read",
                                                                    "overlapped")]
    assert "latency-bound" in got[0]["text"] and "x3.76" in got[0]["text"]
    assert got[0]["figures"]["prefill.inflight"] == [1.0, 3.95]


def test_latency_growing_with_the_depth_says_they_shared_its_bandwidth():
    got = depth_changes(_figures((1.0, 4.0), (1_000, 3_900), (400e6, 410e6)))
    assert [c["verdict"] for c in got] == ["shared"]
    got = depth_changes(_figures((4.0, 1.0), (3_900, 1_000), (410e6, 400e6)))
    assert [c["verdict"] for c in got] == ["shared"]  # the same, B the shallower
    assert [c["verdict"] for c in depth_changes(
        _figures((1.0, 4.0), (1_000, 2_000), (100e6, 200e6)))] == ["between"]


def test_nothing_is_said_where_the_depth_hardly_moved_or_a_figure_is_missing():
    assert depth_changes(_figures((1.0, 1.4), (1_000, 1_000), (1e6, 1.4e6))) == []
    assert depth_changes(_figures((None, 4.0), (1_000, 1_000), (1e6, 4e6))) == []
    assert depth_changes({"prefill.inflight": {"a": 1.0, "b": 4.0}}) == []
