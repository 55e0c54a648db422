"""`kvprof top`: the dashboard on a live recording or a replayed session.

Live: `record()` runs in a background thread and writes the session as usual (so the run can
be replayed later); the dashboard's feed reads it through its own cursor. The UI itself lives
in kvprof.ui and is imported only here, when a dashboard is actually shown.
"""
from __future__ import annotations

import sys
from pathlib import Path

from kvprof import system
from kvprof.record import BackgroundRecorder, RecordOptions
from kvprof.snapshot import Clock
from kvprof.store import Reader, open_replay, session_info



def run_replay(source: str, interval_s: float = 0.5, window_s: float | None = None) -> int:
    """Open a recorded session (directory, .duckdb file or Parquet export) paused at its
    end, showing the whole session: the first screen matches `kvprof report`."""
    from kvprof.ui.app import KvprofTop

    con = open_replay(source)
    try:
        info = session_info(con)
        clock = Clock(info.start_ns, info.end_ns, playing=False)
        app = KvprofTop(Reader(con), clock, name=Path(source).name, interval_s=interval_s,
                        window_s=window_s)
        app.run()
        return app.return_code or 0
    finally:
        con.close()


def run_live(opts: RecordOptions, interval_s: float = 0.5, window_s: float | None = 60.0) -> int:
    # Privilege first, before any screen is drawn: one line and exit 77, like record.
    system.require_privilege()
    from kvprof.ui.app import KvprofTop

    rec = BackgroundRecorder(opts)
    rec.start()
    try:
        cur = rec.store.con.cursor()
        info = session_info(cur)
        cur.close()
        clock = Clock(info.start_ns, None, playing=True)
        app = KvprofTop(Reader(rec.store.con), clock, name="live", interval_s=interval_s,
                        window_s=window_s, export_dir=Path(rec.store.directory) / "parquet")
        app.run()
        rc = app.return_code or 0
    finally:
        # The app has stopped its feed (on unmount) before the recorder closes the store.
        rec.finish()
    for line in rec.log:
        print(line, file=sys.stderr)
    return rc
