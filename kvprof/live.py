"""The dashboard on a live recording (the recorder in a thread beside it) or on a recorded
session. The UI itself lives in kvprof.views.tui and is imported only when a dashboard is
actually shown."""
from __future__ import annotations

import sys
import threading
from collections.abc import Callable
from pathlib import Path

from kvprof import system
from kvprof.recorder.background import BackgroundRecorder
from kvprof.recorder.options import RecordOptions
from kvprof.store.session import Reader, open_replay, session_info
from kvprof.views.snapshot import Clock


def run_replay(source: str, interval_s: float = 0.5, window_s: float | None = None) -> int:
    """Open a recorded session (directory, .duckdb file or Parquet export) paused at its
    end, showing the whole session: the first screen matches `kvprof report`."""
    from kvprof.views.tui.app import KvprofTop

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


def run_live(opts: RecordOptions, interval_s: float = 0.5, window_s: float | None = 60.0, *,
             name: str = "live", beside: Callable[[BackgroundRecorder], None] | None = None,
             log: Callable[[str], None] | None = None) -> int:
    """Record with `opts` and show the dashboard on it until the user quits.

    `beside` (a workload to watch) runs in a thread once the recorder is attached, since
    Textual needs the main thread. Quitting early waits for it to end on its own, as the
    recorder must outlive it; what it raised is raised here. The recorder's own lines go to
    `log` (default: stderr) once the terminal is free again.
    """
    # Privilege first, before any screen is drawn: one line and exit 77, like record.
    system.require_privilege()
    from kvprof.views.tui.app import KvprofTop

    log = log or (lambda line: print(line, file=sys.stderr))
    errors: list[BaseException] = []

    def work(job: Callable[[BackgroundRecorder], None]) -> None:
        try:
            job(rec)
        except BaseException as e:  # noqa: BLE001 - re-raised on the main thread
            errors.append(e)

    rec = BackgroundRecorder(opts)
    store = rec.start()
    if opts.drop_privileges:
        # The recorder's thread dropped them once attached, before it started any other;
        # this one, the dashboard's, needs none at all.
        from kvprof import privileges

        try:
            privileges.drop_all()
        except OSError as e:  # a sandbox that forbids capset or prctl
            rec.log.append(f"kvprof: the dashboard's privileges could not be dropped ({e})")
        # The recorder's threads hold what it kept (the syscall layer's, to name other users'
        # files); a thread holding more was started before attaching.
        try:
            kept = privileges.thread_mask(rec.native_id) if rec.native_id else None
        except OSError:  # (the recorder's thread ended: its error is raised below)
            kept = None
        held = privileges.holders(kept)
        if held:
            rec.log.append(f"kvprof: threads started before attaching keep privileges: "
                           f"{', '.join(held)}")
    worker = (threading.Thread(target=work, args=(beside,), name="kvprof-live-work", daemon=True)
              if beside is not None else None)
    try:
        cur = store.con.cursor()
        info = session_info(cur)
        cur.close()
        clock = Clock(info.start_ns, None, playing=True)
        app = KvprofTop(Reader(store.con), clock, name=name, interval_s=interval_s,
                        window_s=window_s, export_dir=Path(store.directory) / "parquet")
        # A frame as each flush lands (every 0.25 s): on a loaded machine a frame on the
        # feed's own tick can come a tick late, over a second after the I/O.
        rec.on_flush = app.feed.wake
        if worker is not None:
            worker.start()
        app.run()
        rc = app.return_code or 0
    finally:
        try:
            if worker is not None and worker.is_alive():
                worker.join()
        finally:
            # The app has stopped its feed (on unmount) before the recorder closes the store.
            rec.finish()
    if errors:
        raise errors[0]
    for line in rec.log:
        log(line)
    return rc
