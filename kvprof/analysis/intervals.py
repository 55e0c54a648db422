"""Unions of [start, end) intervals (requests in flight) and how much of a span they cover."""
from __future__ import annotations

import numpy as np


def busy_islands(start: np.ndarray, end: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Union of [start, end) intervals as sorted disjoint islands. Starts and ends are sorted
    each on its own, several times cheaper than ordering intervals by start (a session's rows
    come in its CPUs' batch order). With both sorted, the j-th start is never after the j-th
    end, so the device is idle just after the j-th end exactly when the (j + 1)-th start comes
    later: then only j + 1 intervals started by that end, and all of them have ended."""
    if len(start) == 0:
        return np.empty(0, np.int64), np.empty(0, np.int64)
    # Stable (timsort) rather than the default: rows stored in completion order come in
    # long sorted runs, which it merges instead of sorting them again.
    s, e = np.sort(start, kind="stable"), np.sort(end, kind="stable")
    brk = s[1:] > e[:-1]
    return s[np.r_[True, brk]], e[np.r_[brk, True]]


def busy_islands_ordered(start: np.ndarray, end: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """busy_islands without the sort, for intervals listed in issue order (start <= issue <=
    end). A gap in the union splits the list into a prefix ending before it and a suffix
    starting after it, so islands break where the suffix's earliest start passes the
    prefix's latest end."""
    if len(start) == 0:
        return np.empty(0, np.int64), np.empty(0, np.int64)
    run = np.maximum.accumulate(end)
    suffix_min = np.minimum.accumulate(start[::-1])[::-1]
    brk = suffix_min[1:] > run[:-1]
    return suffix_min[np.r_[True, brk]], run[np.r_[brk, True]]


def busy_between(isl_s: np.ndarray, isl_e: np.ndarray, a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Busy ns inside each [a, b), from a cumulative busy-time function over the islands."""
    if len(isl_s) == 0:
        return np.zeros(len(a), np.int64)
    lengths = isl_e - isl_s
    cum = np.concatenate([[0], np.cumsum(lengths)])

    def upto(t: np.ndarray) -> np.ndarray:
        k = np.searchsorted(isl_s, t, side="right") - 1
        kk = np.clip(k, 0, None)
        within = np.minimum(np.maximum(t - isl_s[kk], 0), lengths[kk])
        return np.where(k >= 0, cum[kk] + within, 0)

    return upto(b) - upto(a)
