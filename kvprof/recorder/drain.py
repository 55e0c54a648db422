"""One flush's move: what capture and the phase sources collected, into the store."""
from __future__ import annotations

import time

import pyarrow as pa

from kvprof import schema
from kvprof.analysis.fold import WindowBook
from kvprof.store.session import Store


def drain(store: Store, capture, feeds: tuple, book: WindowBook,
           exporter=None, closed: bool = False) -> int:
    """Move what capture and the phase sources collected into the store (and the Prometheus
    exporter's totals); return the time the open windows were cut at. `closed`: the sources
    have stopped, no window is open. The aggregate tier's settled slots are folded by the
    windows the sources have sent by now (the same rule as the events'), so they wait
    `settle_s` for late windows; those still counting are folded as things stand."""
    def keep(table: str, rows) -> None:
        if rows is None:
            return
        store.append(table, rows)
        if exporter is not None:
            exporter.rows(table, rows)

    def name(dev: int) -> str:
        return capture.device(dev).name

    taken = capture.take()
    slots = taken.pop("aggregate", None)
    # One transaction: killed at any moment, the session holds every flush before, whole,
    # and the open tables never overlap the closed ones.
    with store.transaction():
        for table, rows in taken.items():
            if table in schema.OPEN_TABLES:
                store.replace(table, rows)  # the exporter counts only what is settled
            else:
                keep(table, rows)
        for src in feeds:
            for table, rows in src.take().items():
                keep(table, rows)
                if table == "phase":
                    book.add(rows)
        now = time.monotonic_ns()
        # Open windows are rewritten at every flush so live views see the phase in progress.
        opened = [] if closed else [r for src in feeds for r in src.open_rows(now)]
        store.replace("phase_open", pa.Table.from_pylist(opened, schema=schema.PHASE_OPEN)
                      if opened else None)
        book.set_open(opened)
        if slots is not None:
            agg, busy, until = book.settle(slots["agg"], slots["busy"], now, name, closed)
            keep("io_agg", agg)
            keep("device_busy", busy)
            if exporter is not None:
                # The phases' time over the span the settled rows cover, for idle ratios
                # over the same span as their busy time.
                exporter.settled(book.phase_time(exporter.settled_ns, until), until)
            # The exporter counts only what is settled.
            agg, busy = book.provisional(slots["agg_open"], slots["busy_open"], name)
            store.replace("io_agg_open", agg)
            store.replace("device_busy_open", busy)
            book.prune(now)
    if exporter is not None:
        exporter.open_windows(opened)
    return now
