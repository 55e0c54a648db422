"""What every phase source shares: a thread that polls or listens, rows out, errors counted.

A source never stops the recording: a failure (endpoint down, engine restarted, malformed
payload) is counted under the source's name, remembered as its last error, and retried with
back-off. The recorder takes rows from each source on its flush interval and stores them.
"""
from __future__ import annotations

import threading
import time
from collections import defaultdict, deque

import pyarrow as pa

from kvprof import schema
from kvprof.markers import step_phase  # noqa: F401 - re-exported for sources


class PhaseSource:
    """Base for phase sources. Subclasses implement `poll()` (called every `interval_s`) or
    override `run()` for a blocking listener; they call `emit()` with rows and `problem()`
    with what went wrong."""

    name = "source"
    interval_s = 0.1
    max_backoff_s = 5.0

    def __init__(self) -> None:
        self._rows: dict[str, deque] = defaultdict(deque)
        self._problems: dict[str, int] = defaultdict(int)
        self.last_error: str | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name=f"kvprof-{self.name}",
                                        daemon=True)
        self.ended = False  # stop() ran: its windows are closed

    # -- for subclasses -----------------------------------------------------------------------
    def poll(self) -> None:
        raise NotImplementedError

    def close(self, end_ns: int) -> None:
        """Close open windows at end_ns (called once, after the thread stopped)."""

    def open_rows(self, now_ns: int) -> list[dict]:
        """Phase rows of windows still open, ending at now_ns; sources that keep a window
        open between polls override this so live views see the phase in progress."""
        return []

    def emit(self, table: str, row: dict) -> None:
        self._rows[table].append(row)

    def problem(self, kind: str, detail: str = "", n: int = 1) -> None:
        """Count n occurrences (a sequence gap of 5 is 5 messages lost, not one event)."""
        self._problems[kind] += n
        self.last_error = f"{kind}: {detail}" if detail else kind

    @property
    def stopping(self) -> bool:
        return self._stop.is_set()

    # -- for the recorder ---------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def _loop(self) -> None:
        backoff = self.interval_s
        while not self._stop.is_set():
            t0 = time.monotonic()
            try:
                self.poll()
                backoff = self.interval_s
            except Exception as e:  # noqa: BLE001 - any failure is counted and retried
                self._failure(e)
                backoff = min(self.max_backoff_s, max(backoff * 2, self.interval_s))
                self._stop.wait(backoff)
                continue
            self._stop.wait(max(0.0, self.interval_s - (time.monotonic() - t0)))

    def halt(self) -> None:
        """Stop the thread and take the source's last reading (`last_poll`); once."""
        if self._stop.is_set():  # (only here is it set)
            return
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(10)
        if self._thread.ident is not None and not self._thread.is_alive():  # it ran, and ended
            try:
                self.last_poll()
            except Exception as e:  # noqa: BLE001 - counted, as in the loop; the stop goes on
                self._failure(e)

    def _failure(self, e: Exception) -> None:
        self.problem(type(e).__name__, str(e).splitlines()[0] if str(e) else "")

    def last_poll(self) -> None:
        """A reading at the end, for sources that only learn of work by asking (else none)."""

    def stop(self, end_ns: int) -> None:
        """Halt (if not yet) and close the windows still open at end_ns."""
        self.halt()
        self.ended = True
        self.close(end_ns)

    def take(self) -> dict[str, pa.Table]:
        out = {}
        for table, rows in self._rows.items():
            batch = []
            while rows:
                batch.append(rows.popleft())
            if batch:
                out[table] = pa.Table.from_pylist(batch, schema=schema.TABLES[table])
        return out

    def pace(self) -> dict[str, float]:
        """How often the source asked, for sources whose pace changes (else nothing)."""
        return {}

    def counts(self) -> dict[str, int]:
        return {f"{self.name}.{k}": v for k, v in self._problems.items()}
