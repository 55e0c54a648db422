"""`kvprof top`: the dashboard on a live recording or a replayed session.

Live: `record()` runs in a background thread and writes the session as usual (so the run can
be replayed later); the dashboard's feed reads it through its own cursor. The UI itself lives
in kvprof.ui and is imported only here, when a dashboard is actually shown.
"""
from __future__ import annotations

import sys
import threading
from pathlib import Path

from kvprof import system
from kvprof.errors import EX_UNAVAILABLE, KvprofError
from kvprof.record import RecordOptions, record
from kvprof.snapshot import Clock
from kvprof.store import open_replay, session_info

ATTACH_TIMEOUT_S = 60.0


def run_replay(source: str, interval_s: float = 0.5, window_s: float | None = None) -> int:
    """Open a recorded session (directory, .duckdb file or Parquet export) paused at its
    end, showing the whole session: the first screen matches `kvprof report`."""
    from kvprof.ui.app import KvprofTop

    con = open_replay(source)
    try:
        info = session_info(con)
        clock = Clock(info.start_ns, info.end_ns, playing=False)
        app = KvprofTop(con, clock, name=Path(source).name, interval_s=interval_s,
                        window_s=window_s)
        app.run()
        return app.return_code or 0
    finally:
        con.close()


class LiveRecorder:
    """`record()` in a thread, stopped by our event; hands over the store once attached."""

    def __init__(self, opts: RecordOptions):
        self.opts = opts
        self.stop = threading.Event()
        self.ready = threading.Event()
        self.store = None
        self.error: BaseException | None = None
        self.log: list[str] = []
        self._thread = threading.Thread(target=self._run, name="kvprof-top-record", daemon=True)

    def _started(self, store) -> None:
        self.store = store
        self.ready.set()

    def _run(self) -> None:
        try:
            record(self.opts, log=self.log.append, stop=self.stop, on_start=self._started)
        except BaseException as e:  # noqa: BLE001 - handed to the main thread
            self.error = e
        finally:
            self.ready.set()

    def start(self) -> None:
        self._thread.start()
        if not self.ready.wait(ATTACH_TIMEOUT_S):
            self.finish(ATTACH_TIMEOUT_S)
            raise KvprofError(f"the recorder did not attach within {ATTACH_TIMEOUT_S:.0f} s",
                              EX_UNAVAILABLE)
        self._raise()

    def finish(self, timeout: float | None = None) -> None:
        self.stop.set()
        self._thread.join(timeout)
        self._raise()

    def _raise(self) -> None:
        if self.error is not None:
            err, self.error = self.error, None
            raise err


def run_live(opts: RecordOptions, interval_s: float = 0.5, window_s: float | None = 60.0) -> int:
    # Privilege first, before any screen is drawn: one line and exit 77, like record.
    system.require_privilege()
    from kvprof.ui.app import KvprofTop

    rec = LiveRecorder(opts)
    rec.start()
    try:
        cur = rec.store.con.cursor()
        info = session_info(cur)
        cur.close()
        clock = Clock(info.start_ns, None, playing=True)
        app = KvprofTop(rec.store.con, clock, name="live", interval_s=interval_s,
                        window_s=window_s, export_dir=Path(rec.store.directory) / "parquet")
        app.run()
        rc = app.return_code or 0
    finally:
        # The app has stopped its feed (on unmount) before the recorder closes the store.
        rec.finish()
    for line in rec.log:
        print(line, file=sys.stderr)
    return rc
