"""fold.py on slot rows written by hand: which phase a slot gets, when a row is a boundary,
how busy time is laid over windows and seconds, and which windows came too late."""
from __future__ import annotations

import numpy as np
import pyarrow as pa

from kvprof import schema
from kvprof.analysis.fold import WindowBook, fold
from kvprof.schema import AGG_ROW, BUSY_ROW, SLOT_NS

S = 1_000_000_000


def windows(*rows: tuple[int, int, str, str]) -> pa.Table:
    return pa.table({"start_ns": [r[0] for r in rows], "end_ns": [r[1] for r in rows],
                     "phase": [r[2] for r in rows], "source": [r[3] for r in rows]})


def agg(*rows: tuple[int, int, int, int]) -> np.ndarray:
    """(slot, first, last, ios) block reads on device 7:0, completed in the slot's second."""
    out = np.zeros(len(rows), AGG_ROW)
    for i, (slot, first, last, ios) in enumerate(rows):
        out[i]["slot"], out[i]["first"], out[i]["last"] = slot, first, last
        out[i]["sec"] = slot * SLOT_NS // S
        out[i]["dev"] = 7 << 20
        out[i]["layer"] = schema.LAYERS.index("block")
        out[i]["op"] = schema.OPS.index("read")
        out[i]["ios"] = ios
        out[i]["bytes"] = ios * 4096
        out[i]["size"][13] = ios
    return out


def busy(*rows: tuple[int, int, int, int, int]) -> np.ndarray:
    """(slot, run, ns, first, last)"""
    out = np.zeros(len(rows), BUSY_ROW)
    for i, (slot, run, ns, first, last) in enumerate(rows):
        out[i]["slot"], out[i]["run"], out[i]["ns"] = slot, run, ns
        out[i]["first"], out[i]["last"] = first, last
        out[i]["dev"] = 7 << 20
    return out


def name(dev: int) -> str:
    return f"dev{dev >> 20}"


def by_phase(rows: pa.RecordBatch, value: str = "ios") -> dict:
    out: dict = {}
    t = pa.table(rows).to_pylist()
    for r in t:
        key = (r["phase"], r.get("boundary"))
        out[key] = out.get(key, 0) + r[value]
    return out


def test_a_slot_inside_one_window_takes_its_phase_even_across_seconds_of_windows():
    base = 250 * 10  # slot 2500: t = 10 s
    w = windows((10 * S, 10 * S + 2 * SLOT_NS, "prefill", "hook"),
                (10 * S + 2 * SLOT_NS, 11 * S, "decode", "hook"))
    rows, _ = fold(agg((base, 0, SLOT_NS - 1, 5), (base + 1, 10, 20, 3),
                       (base + 2, 100, 200, 4), (base + 300, 0, 5, 2)),
                   np.zeros(0, BUSY_ROW), w, name)
    assert by_phase(rows) == {("prefill", False): 8, ("decode", False): 4, ("idle", False): 2}
    assert set(pa.table(rows)["dev_name"].to_pylist()) == {"dev7"}
    assert rows.schema == schema.IO_AGG


def test_an_edge_between_a_slots_first_and_last_issue_makes_a_boundary_row():
    t0 = 10 * S
    # The edge 1 ms into the slot; the slot's issues from 0.5 ms to 3.5 ms: most after it.
    w = windows((t0, t0 + 1_000_000, "prefill", "hook"), (t0 + 1_000_000, 11 * S, "decode",
                                                          "hook"))
    rows, _ = fold(agg((2500, 500_000, 3_500_000, 9)), np.zeros(0, BUSY_ROW), w, name)
    assert by_phase(rows) == {("decode", True): 9}
    # All issues before the edge: exact, no boundary.
    rows, _ = fold(agg((2500, 100_000, 900_000, 9)), np.zeros(0, BUSY_ROW), w, name)
    assert by_phase(rows) == {("prefill", False): 9}


def test_the_more_exact_source_wins_as_for_events():
    t0 = 10 * S
    w = windows((t0, 11 * S, "decode", "nvml"), (t0, t0 + SLOT_NS, "prefill", "hook"))
    rows, _ = fold(agg((2500, 0, 100, 1), (2501, 0, 100, 1)), np.zeros(0, BUSY_ROW), w, name)
    assert by_phase(rows) == {("prefill", False): 1, ("decode", False): 1}


def test_busy_pieces_and_runs_are_laid_over_windows_and_seconds():
    t0 = 10 * S
    w = windows((t0, t0 + 1_000_000, "prefill", "hook"), (t0 + 1_000_000, 20 * S, "decode",
                                                          "hook"))
    # Pieces within slot 2500 between 0.5 and 1.5 ms (edge at 1 ms): shared by overlap.
    # A run from the start of slot 2750 (t = 11 s) lasting 1.5 s: into seconds 11 and 12.
    _, b = fold(np.zeros(0, AGG_ROW), busy((2500, 0, 800_000, 500_000, 1_500_000),
                                            (2750, 375, 1_500_000_000, 0, 0)), w, name)
    got = {(r["ts_ns"] // S, r["phase"]): r["busy_ns"] for r in pa.table(b).to_pylist()}
    assert got == {(10, "prefill"): 400_000, (10, "decode"): 400_000,
                   (11, "decode"): S, (12, "decode"): S // 2}
    assert b.schema == schema.DEVICE_BUSY


def test_a_window_for_time_already_folded_is_counted_late():
    book = WindowBook()
    book.fold(agg((2500, 0, 10, 1)), np.zeros(0, BUSY_ROW), name, settled=True)
    assert book.folded_until == 2501 * SLOT_NS
    book.add(windows((2499 * SLOT_NS, 2502 * SLOT_NS, "prefill", "hook")))
    book.add(windows((2501 * SLOT_NS, 2502 * SLOT_NS, "decode", "hook")))
    assert book.counts() == {"phase_window_after_fold": 1}
    # Open windows count for the fold, closed ones too, as long as they are kept.
    book.set_open([{"start_ns": 2600 * SLOT_NS, "end_ns": 2700 * SLOT_NS, "phase": "decode",
                    "source": "manual"}])
    rows, _ = book.fold(agg((2501, 0, 10, 2), (2650, 0, 10, 3)), np.zeros(0, BUSY_ROW), name,
                        settled=False)
    assert by_phase(rows) == {("decode", False): 5}
    assert book.phase_time(2500 * SLOT_NS, 2700 * SLOT_NS) == {
        "prefill": SLOT_NS, "decode": 101 * SLOT_NS, "mixed": 0, "idle": 98 * SLOT_NS}
    book.prune(2700 * SLOT_NS + book.KEEP_NS + 1)
    assert book.phase_time(2500 * SLOT_NS, 2502 * SLOT_NS)["idle"] == 2 * SLOT_NS


def test_a_window_open_when_its_time_was_folded_is_not_late():
    """A window the recorder had as an open row when it folded settled slots (a long marks
    window, a replayed phase stretched past --settle) folded those slots itself: sent
    closed afterwards, it is not counted late; one it never had is."""
    book = WindowBook()
    book.set_open([{"start_ns": 2400 * SLOT_NS, "end_ns": 2600 * SLOT_NS, "phase": "prefill",
                    "source": "manual"}])
    rows, _ = book.fold(agg((2500, 0, 10, 1)), np.zeros(0, BUSY_ROW), name, settled=True)
    assert by_phase(rows) == {("prefill", False): 1}
    book.set_open([])
    book.add(windows((2400 * SLOT_NS, 2700 * SLOT_NS, "prefill", "manual"),
                     (2450 * SLOT_NS, 2460 * SLOT_NS, "decode", "hook")))
    assert book.counts() == {"phase_window_after_fold": 1}
