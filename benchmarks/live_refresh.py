"""Dashboard frame times on a real live recording at ~100k I/O events per second.

    sudo .venv/bin/python benchmarks/live_refresh.py [--iops 50000] [--seconds 75]

Everything as `kvprof top` runs it, minus the terminal: the recorder in a thread tracing a private
loop device over /dev/shm (block and io_uring: two events per I/O), fio reading it at a fixed rate,
an engine-like hook marking 200 ms prefill / 800 ms decode windows, and the dashboard's feed
building a frame every 0.5 s from its own cursor. The feed shows the 10 s window first, then the
60 s one once a minute is recorded. A frame is what the feed does for one delivery: read the new
rows, build the snapshot (the snapshot's build_s). Baselines from the same session at the end: a
bare DuckDB scan of each window, and the frame built by SQL alone. Not a test: run it, read it.
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import tempfile
import threading
import time
from pathlib import Path

from kvprof.analysis.rowsource import SqlRows
from kvprof.markers import Marker
from kvprof.recorder.background import BackgroundRecorder
from kvprof.recorder.options import RecordOptions
from kvprof.store.session import Reader, session_info
from kvprof.views.snapshot import Clock, SnapshotFeed, ViewRequest, build_snapshot

NS = 1_000_000_000


def hook(sock: str, stop: threading.Event) -> None:
    """An engine's step hook: a prefill window, then decode, every second."""
    m = Marker(sock, engine="bench", source="hook")
    while not stop.is_set():
        t = time.monotonic_ns()
        stop.wait(0.2)
        m.window("prefill", t, time.monotonic_ns())
        t = time.monotonic_ns()
        stop.wait(0.8)
        m.window("decode", t, time.monotonic_ns())
    m.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iops", type=int, default=50_000, help="fio rate; events = 2 x I/Os")
    ap.add_argument("--seconds", type=int, default=75)
    a = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="kvprof-live-"))
    backing = Path(f"/dev/shm/kvprof-live-{os.getpid()}.img")
    with open(backing, "wb") as f:
        f.truncate(256 << 20)
    dev = subprocess.run(["losetup", "--find", "--show", str(backing)], check=True,
                         capture_output=True, text=True).stdout.strip()
    stop = threading.Event()
    frames: list[tuple[float, float | None, float, float]] = []  # (t, window, frame s, ev/s)
    rec = BackgroundRecorder(RecordOptions(out=str(tmp / "s"), devices=[dev],
                                           socket=str(tmp / "m.sock")))
    try:
        rec.start()
        con = rec.store.con
        info = session_info(con.cursor())
        clock = Clock(info.start_ns, None, playing=True)
        t_start = time.monotonic()

        def deliver(snap) -> None:
            frames.append((time.monotonic() - t_start, snap.window_s, snap.build_s,
                           snap.events_per_s))

        feed = SnapshotFeed(Reader(con), clock, deliver, on_error=print,
                            request=ViewRequest(window_s=10.0))
        threading.Thread(target=hook, args=(str(tmp / "m.sock"), stop), daemon=True).start()
        fio = subprocess.Popen(["fio", "--name=b", f"--filename={dev}", "--rw=randread",
                                "--bs=4k", "--direct=1", "--ioengine=io_uring", "--iodepth=16",
                                f"--rate_iops={a.iops}", "--time_based",
                                f"--runtime={a.seconds}", "--size=128M"],
                               stdout=subprocess.DEVNULL)
        feed.start()
        switch = min(a.seconds - 15, 40)
        while time.monotonic() - t_start < switch:
            time.sleep(0.2)
        feed.ask(ViewRequest(window_s=60.0))
        fio.wait()
        feed.stop()
        stop.set()
        end = time.monotonic_ns()
        cur = con.cursor()
        print(f"recorded {cur.execute('SELECT count(*) FROM io').fetchall()[0][0]:,} events "
              f"in {a.seconds} s on {dev}")
        print(f"{'window':<8}{'frames':>7}{'events/s':>10}{'frame ms':>10}{'p95':>7}{'max':>7}"
              f"{'scan ms':>9}{'SQL ms':>8}{'vs scan':>9}")
        for window, lo in ((10.0, 12.0), (60.0, 62.0)):
            mine = [f for f in frames if f[1] == window and f[0] >= lo]
            if not mine:
                print(f"{window:.0f} s: no full-window frames (record longer)")
                continue
            times = sorted(f[2] for f in mine)
            t0 = end - int(window * NS)

            def scan():
                return cur.execute(f"SELECT count(*), sum(bytes), sum(complete_ns - issue_ns) "
                                   f"FROM io WHERE issue_ns >= {t0} AND issue_ns < {end}"
                                   ).fetchall()

            s = time.perf_counter()
            scan()
            scan_s = time.perf_counter() - s
            s = time.perf_counter()
            build_snapshot(SqlRows(cur), window, end)
            sql_s = time.perf_counter() - s
            med = statistics.median(times)
            rows = statistics.median(f[3] for f in mine)
            print(f"{window:.0f} s{'':<5}{len(mine):>7}{rows:>10,.0f}"
                  f"{med * 1e3:>10.1f}{times[int(0.95 * (len(times) - 1))] * 1e3:>7.1f}"
                  f"{times[-1] * 1e3:>7.1f}{scan_s * 1e3:>9.1f}{sql_s * 1e3:>8.0f}"
                  f"{med / scan_s:>8.1f}x")
        cur.close()
    finally:
        stop.set()
        rec.finish(60)
        subprocess.run(["losetup", "-d", dev], check=False)
        backing.unlink(missing_ok=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
