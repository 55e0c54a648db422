"""Scaling a sampled recording's block requests back up to the aggregate tier's counts
(kvprof/analysis/scaleup.py), as replay and `export --fio-iolog` do."""
from __future__ import annotations

import numpy as np
import pyarrow as pa

from kvprof.analysis.scaleup import ALIGN, scale_up


def _requests(phase, dev, op, offset, size, issue, weight, piece_end=None) -> pa.Table:
    n = len(offset)
    piece_end = [2**62] * n if piece_end is None else piece_end
    return pa.table({"phase": [phase] * n, "dev_name": [dev] * n, "op": [op] * n,
                     "offset": pa.array(offset, pa.int64()), "bytes": pa.array(size, pa.int64()),
                     "issue_ns": pa.array(issue, pa.int64()),
                     "sample_weight": pa.array(weight, pa.uint32()),
                     "piece_end": pa.array(piece_end, pa.int64())})


def test_a_stream_kept_one_in_four_comes_back_whole():
    # A prefill-like stream: 1000 writes of 256 KiB back to back, one every 6.5 ms.
    n, size = 1000, 256 << 10
    offset = np.arange(n) * size + (8 << 20)
    issue = np.arange(n) * 6_500_000 + 10**12
    kept = np.arange(0, n, 4)  # (the kernel picks at random; one in four exactly here)
    t = _requests("prefill", "loop0", "write", offset[kept], [size] * len(kept), issue[kept],
                  [4] * len(kept))
    out, done = scale_up(t, {("prefill", "loop0", "write"): n})
    assert done.groups == {("prefill", "loop0", "write"): (len(kept), n)}
    assert out["offset"].to_pylist() == offset.tolist()
    assert out["issue_ns"].to_pylist() == issue.tolist()
    assert set(out["sample_weight"].to_pylist()) == {1}


def test_random_reads_scaled_up_hit_the_count_inside_the_device_range():
    rng = np.random.default_rng(7)
    m, size, span = 300, 16 << 10, 64 << 20
    offset = np.sort(rng.integers(0, span // size, m)) * size
    issue = np.cumsum(rng.integers(100_000, 900_000, m))
    weight = rng.choice([8, 16], m)
    reads = _requests("decode", "loop1", "read", offset, [size] * m, issue, weight)
    writes = _requests("prefill", "loop1", "write", [0, size], [size, size], [5, 6], [1, 1])
    want = int(weight.sum()) + 5  # the kernel's count, not exactly the weights' sum
    out, done = scale_up(pa.concat_tables([reads, writes]),
                         {("decode", "loop1", "read"): want,
                          ("prefill", "loop1", "write"): 2})  # written whole: left alone
    assert done.groups[("decode", "loop1", "read")] == (m, want)
    assert done.groups[("prefill", "loop1", "write")] == (2, 2)
    got = out.filter(pa.compute.equal(out["op"], "read"))
    assert got.num_rows == want
    off = np.asarray(got["offset"].to_pylist())
    lo, hi = 0, (offset + weight * size).max()  # (the device's writes begin at 0)
    assert (off >= lo).all() and (off + size <= hi).all() and ((off - lo) % ALIGN == 0).all()
    times = np.asarray(out["issue_ns"].to_pylist())
    assert (np.diff(times) >= 0).all()
    # Each kept row's copies lie between it and the next kept row: none before the first.
    assert times.min() == 5 and got["issue_ns"].to_pylist()[0] == issue[0]


def test_copies_stay_in_their_rows_window():
    # Decode reads in two windows, 1 s apart, kept 1 in 8: the copies of a window's last
    # kept row spread over the usual gap, not over the time to the next window's first.
    size = 16 << 10
    first = np.arange(0, 80, 8) * 500_000  # one read every 0.5 ms, in [0, 40 ms)
    second = first + 1_000_000_000
    issue = np.concatenate([first, second])
    ends = [40_000_000] * 10 + [1_040_000_000] * 10
    t = _requests("decode", "loop0", "read", np.arange(20) * size * 8, [size] * 20, issue,
                  [8] * 20, ends)
    out, _ = scale_up(t, {("decode", "loop0", "read"): 160})
    times = np.asarray(out["issue_ns"].to_pylist())
    assert len(times) == 160
    assert ((times < 40_000_000) | (times >= 1_000_000_000)).all()
    assert (times < 1_040_000_000).all()
