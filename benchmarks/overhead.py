"""Overhead of live capture, as ratios against baselines measured in the same run.

    sudo .venv/bin/python benchmarks/overhead.py [--rounds 3] [--runtime 5]

For each round: fio without kvprof, fio with `kvprof record` attached, fio without again, on
a private loop device over /dev/shm (4 KiB random reads, io_uring QD32, and psync QD1). Prints
IOPS and the attached/baseline ratio, for each capture mode: `events` (the default: the
aggregate tier plus a row per I/O, sampled past --event-rate), `all-events` (a row for every
I/O: --event-rate 0) and `aggregate` (`--no-events`: only the in-kernel counts),
and how long attaching and detaching took. Mode `floor` attaches empty programs on the same
raw tracepoints instead (floor_probes.py): the cost of attaching alone, below which no tracer
of these tracepoints can go on this machine. Then times `kvprof report` on the recorded session
against a bare DuckDB scan of the same table.
"""
from __future__ import annotations

import argparse
import json
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from loopdev import loop_device

MODES = {"events": [], "all-events": ["--event-rate", "0"], "aggregate": ["--no-events"],
         "floor": None}
HERE = Path(__file__).resolve().parent
JOBS = {
    "io_uring QD32": ["--ioengine=io_uring", "--iodepth=32"],
    "psync QD1": ["--ioengine=psync", "--iodepth=1"],
}


def fio_iops(dev: str, extra: list[str], runtime: int) -> float:
    out = subprocess.run(["fio", "--name=b", f"--filename={dev}", "--rw=randread", "--bs=4k",
                          "--direct=1", "--time_based", f"--runtime={runtime}", "--size=128M",
                          "--output-format=json", *extra], check=True, capture_output=True,
                         text=True).stdout
    return json.loads(out)["jobs"][0]["read"]["iops"]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--runtime", type=int, default=5)
    ap.add_argument("--mode", action="append", choices=tuple(MODES),
                    help="capture modes to measure (default: all)")
    ap.add_argument("--job", action="append", choices=tuple(JOBS),
                    help="fio jobs to run (default: all)")
    ap.add_argument("--record-arg", action="append", default=[], metavar="ARG",
                    help="passed on to kvprof record (e.g. --record-arg=--layer=block)")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="kvprof-bench-"))
    session = None
    with loop_device("bench") as dev:
        for name, extra in JOBS.items():
            if args.job and name not in args.job:
                continue
            for mode, flags in MODES.items():
                if args.mode and mode not in args.mode:
                    continue
                ratios = []
                for r in range(args.rounds):
                    before = fio_iops(dev, extra, args.runtime)
                    out = tmp / f"{name.split()[0]}-{mode}-{r}"
                    t = time.perf_counter()
                    cmd = [sys.executable, "-m", "kvprof", "record", "-d", dev, "-o",
                           str(out), "--socket", str(tmp / "m.sock"), *(flags or []),
                           *args.record_arg]
                    if flags is None:
                        cmd = [sys.executable, str(HERE / "floor_probes.py")]
                    elif "--no-events" not in flags:
                        session = out  # the report is timed on a session with rows
                    rec = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True)
                    for line in rec.stderr:
                        if "Hit Ctrl-C" in line:
                            break
                    attach = time.perf_counter() - t
                    attached = fio_iops(dev, extra, args.runtime)
                    t = time.perf_counter()
                    rec.send_signal(signal.SIGINT)
                    rec.communicate(timeout=120)
                    detach = time.perf_counter() - t
                    after = fio_iops(dev, extra, args.runtime)
                    base = (before + after) / 2
                    ratios.append(attached / base)
                    print(f"{name:<14} {mode:<9} round {r}: baseline {before:9.0f} / "
                          f"{after:9.0f} IOPS, attached {attached:9.0f} IOPS, ratio "
                          f"{attached / base:.3f}; attach {attach:.1f} s, detach {detach:.1f} s",
                          flush=True)
                print(f"{name:<14} {mode:<9} median attached/baseline ratio "
                      f"{statistics.median(ratios):.3f}", flush=True)
        if session is None:
            return 0
        import duckdb

        db = str(session / "session.duckdb")
        t = time.perf_counter()
        con = duckdb.connect(db, read_only=True)
        n = con.execute("SELECT count(*), sum(bytes), max(complete_ns - issue_ns) FROM io"
                        ).fetchall()[0][0]
        con.close()
        bare = time.perf_counter() - t
        t = time.perf_counter()
        subprocess.run([sys.executable, "-m", "kvprof", "report", str(session), "--json"],
                       check=True, capture_output=True)
        rep = time.perf_counter() - t
        t = time.perf_counter()
        subprocess.run([sys.executable, "-c", "import kvprof.cli, duckdb, numpy, pyarrow"],
                       check=True)
        startup = time.perf_counter() - t
        print(f"report on {n} I/O rows: {rep:.2f} s (of which interpreter+imports "
              f"{startup:.2f} s); bare scan {bare:.3f} s; ratio (report - startup)/bare "
              f"{(rep - startup) / bare:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
