"""A sampled recording's block requests scaled back up to every request the kernel counted.

Past `--event-rate` the event tier keeps 1 in 2^shift requests (rows carry `sample_weight`) and
the aggregate tier counts all. Per (phase, device, op) the kept rows are copied, by weight with
largest remainders, to that count exactly: each copy as a stream's next request (next offset,
spread to the group's next kept row, in the row's piece and so its phase), of the row's size, so
bytes are the count times the sample's sizes, not the kernel's byte count."""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa

ALIGN = 4096  # copies' offsets stay on this boundary when wrapped (O_DIRECT's on any device)


@dataclass
class Scaled:
    """What `scale_up` did per (phase, device, op): rows kept, requests issued."""
    groups: dict[tuple[str, str, str], tuple[int, int]] = field(default_factory=dict)

    @property
    def kept(self) -> int:
        return sum(k for k, _ in self.groups.values())

    @property
    def issued(self) -> int:
        return sum(n for _, n in self.groups.values())


def _shares(weight: np.ndarray, total: int) -> np.ndarray:
    """Copies of each row: at least one, in proportion to its weight, summing to `total`."""
    quota = weight * (total / weight.sum())
    n = np.maximum(np.floor(quota).astype(np.int64), 1)
    short = total - int(n.sum())
    if short > 0:
        n[np.argsort(-(quota - np.floor(quota)), kind="stable")[:short]] += 1
    while short < 0:  # (rows' floors of 1 over the count: take back from the largest)
        i = int(np.argmax(n))
        if n[i] <= 1:
            break
        n[i] -= 1
        short += 1
    return n


def scale_up(requests: pa.Table, counts: dict[tuple[str, str, str], int]
             ) -> tuple[pa.Table, Scaled]:
    """`requests` (SqlRows.block_requests: phase, dev_name, op, offset, bytes, issue_ns,
    sample_weight, piece_end) with each (phase, device, op) group copied up to `counts`' requests
    there (the aggregate tier's); groups without a count, or whose rows reach it already,
    are left as they are. In issue order; every row's sample_weight is 1."""
    phase = np.array(requests["phase"].to_pylist(), dtype=object)
    dev = np.array(requests["dev_name"].to_pylist(), dtype=object)
    op = np.array(requests["op"].to_pylist(), dtype=object)
    offset = requests["offset"].to_numpy(zero_copy_only=False).astype(np.int64)
    size = requests["bytes"].to_numpy(zero_copy_only=False).astype(np.int64)
    issue = requests["issue_ns"].to_numpy(zero_copy_only=False).astype(np.int64)
    weight = requests["sample_weight"].to_numpy(zero_copy_only=False).astype(np.float64)
    copies = np.ones(len(issue), np.int64)
    done = Scaled()
    ranges = {}
    for d in set(dev.tolist()):
        mine = dev == d
        # (to the farthest byte the kept rows stand for: a stream's last kept row's copies
        # run past it, as the requests it stood for did)
        ranges[d] = (int(offset[mine].min()),
                     int((offset[mine] + size[mine] * weight[mine].astype(np.int64)).max()))
    keys = np.array([f"{p}\0{d}\0{o}" for p, d, o in zip(phase, dev, op)], dtype=object)
    for key in sorted(set(keys.tolist())):
        idx = np.flatnonzero(keys == key)
        p, d, o = key.split("\0")
        want = counts.get((p, d, o))
        if want is not None and want > len(idx) and (size[idx] > 0).any():
            copies[idx] = _shares(weight[idx], want)
        done.groups[(p, d, o)] = (len(idx), int(copies[idx].sum()))
    # Row i's k-th copy (k = 0 the row itself): its time and offset.
    row = np.repeat(np.arange(len(issue)), copies)
    k = np.arange(len(row)) - np.repeat(np.cumsum(copies) - copies, copies)
    # A row's copies spread to the group's next kept row, inside the piece of window the
    # row is in; the last one of a piece's over the group's usual gap, to the piece's end.
    piece_end = requests["piece_end"].to_numpy(zero_copy_only=False).astype(np.int64)
    gap = np.zeros(len(issue), np.int64)
    for key in set(keys.tolist()):
        idx = np.flatnonzero(keys == key)
        if len(idx) < 2:
            continue
        g = np.diff(issue[idx])
        same = piece_end[idx[:-1]] == piece_end[idx[1:]]
        usual = int(np.median(g[same])) if same.any() else 0
        gap[idx] = np.minimum(np.append(np.where(same, g, usual), usual),
                              np.maximum(piece_end[idx] - issue[idx], 0))
    t = issue[row] + gap[row] * k // copies[row]
    lo = np.array([ranges[d][0] for d in dev], np.int64)[row]
    span = np.array([ranges[d][1] - ranges[d][0] for d in dev], np.int64)[row]
    s = size[row]
    rel = offset[row] - lo + k * s
    room = np.maximum((span - s) // ALIGN * ALIGN, ALIGN)
    rel = np.where(rel + s > span, rel % room, rel)
    order = np.argsort(t, kind="stable")
    cols = {c: requests[c].take(pa.array(row[order])) for c in requests.column_names}
    cols["offset"] = pa.array((lo + rel)[order])
    cols["issue_ns"] = pa.array(t[order])
    cols["sample_weight"] = pa.array(np.ones(len(row), np.uint32))
    return pa.table(cols), done
