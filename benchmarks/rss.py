"""Memory of a long recording: RSS of `kvprof record` sampled every second while fio keeps a
loop device over /dev/shm busy (4 KiB random reads, io_uring, a fixed rate).

    sudo .venv/bin/python benchmarks/rss.py [--minutes 10] [--rate 100000] [--no-events]

Prints RSS after attaching (and its anonymous and file-backed parts), then every minute, and
the growth per minute over the second half (the first minutes include DuckDB's and the row
caches' warm-up), with the session's size on disk.
"""
from __future__ import annotations

import argparse
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from loopdev import growth_per_min, loop_device, memory_mib


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--minutes", type=float, default=10)
    ap.add_argument("--rate", type=int, default=100_000, help="fio IOPS")
    ap.add_argument("--no-events", action="store_true")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="kvprof-rss-"))
    session = tmp / "session"
    with loop_device("rss") as dev:
        return _run(args, tmp, session, dev)


def _run(args, tmp: Path, session: Path, dev: str) -> int:
    rec = subprocess.Popen([sys.executable, "-m", "kvprof", "record", "-d", dev, "-o",
                            str(session), "--socket", str(tmp / "m.sock"),
                            *(["--no-events"] if args.no_events else [])],
                           stderr=subprocess.PIPE, text=True)
    fio = None
    try:
        for line in rec.stderr:
            if "Hit Ctrl-C" in line:
                break
        seconds = int(args.minutes * 60)
        fio = subprocess.Popen(["fio", "--name=rss", f"--filename={dev}", "--rw=randread",
                                "--bs=4k", "--direct=1", "--ioengine=io_uring", "--iodepth=32",
                                f"--rate_iops={args.rate}", "--thread", "--time_based",
                                f"--runtime={seconds}", "--size=200M"],
                               stdout=subprocess.DEVNULL)
        samples = []  # (s, RSS, anonymous)
        t0 = time.monotonic()
        rss, anon, files = memory_mib(rec.pid)
        print(f"attached: RSS {rss:.0f} MiB (anonymous {anon:.0f}, file-backed {files:.0f})",
              flush=True)
        while fio.poll() is None:
            time.sleep(1)
            rss, anon, files = memory_mib(rec.pid)
            samples.append((time.monotonic() - t0, rss, anon))
            if len(samples) % 60 == 0:
                size = (session / "session.duckdb").stat().st_size / 2**20
                print(f"{samples[-1][0] / 60:4.1f} min: RSS {rss:.0f} MiB (anonymous "
                      f"{anon:.0f}, file-backed {files:.0f}), session {size:.0f} MiB",
                      flush=True)
        if len(samples) >= 4:
            print(f"RSS max {max(r for _, r, _ in samples):.0f} MiB, last {samples[-1][1]:.0f} "
                  f"MiB; growth over the second half: RSS "
                  f"{growth_per_min([(t, r) for t, r, _ in samples]):+.1f} MiB/min, anonymous "
                  f"{growth_per_min([(t, a) for t, _, a in samples]):+.1f} MiB/min")
    finally:
        if fio is not None and fio.poll() is None:
            fio.kill()
        rec.send_signal(signal.SIGINT)
        rec.communicate(timeout=300)
    return 0


if __name__ == "__main__":
    sys.exit(main())
