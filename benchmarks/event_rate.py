"""The event tier's drain rate on one core: `kvprof record --event-rate 0` (every row) pinned
to CPU 0 while fio, pinned to the other CPUs, drives the loop device as fast as it goes.
Prints rows stored per second, the rows the kernel counted (the exact tier), and what was lost;
and the exact tier's block reads beside /sys/block/DEV/stat's over the recording (the device
is private to this run, so the kernel's own count is the truth at the device's full rate).
The generator shares this machine, so the figure is the highest rate it could offer; zero loss
at that rate is a lower bound on what one core drains.

    sudo .venv/bin/python benchmarks/event_rate.py [--seconds 10] [--iops N]
"""
from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from loopdev import disk_reads, loop_device, report_json


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=int, default=10)
    ap.add_argument("--iops", type=int, help="cap fio's rate (rows: twice this, block and "
                                             "io_uring)")
    args = ap.parse_args()
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        print("needs two CPUs: one for kvprof, the others for the load", file=sys.stderr)
        return 1
    others = ",".join(str(c) for c in cpus[1:])
    tmp = Path(tempfile.mkdtemp(prefix="kvprof-rate-"))
    with loop_device("rate") as dev:
        before = disk_reads(dev)
        rec = subprocess.Popen(["taskset", "-c", str(cpus[0]), sys.executable, "-m", "kvprof",
                                "record", "-d", dev, "-o", str(tmp / "s"), "--socket",
                                str(tmp / "m.sock"), "--event-rate", "0"],
                               stderr=subprocess.PIPE, text=True)
        for line in rec.stderr:
            if "Hit Ctrl-C" in line:
                break
        t = time.monotonic()
        subprocess.run(["taskset", "-c", others, "fio", "--name=r", f"--filename={dev}",
                        "--rw=randread", "--bs=4k", "--direct=1", "--ioengine=io_uring",
                        "--iodepth=32", "--time_based", f"--runtime={args.seconds}",
                        "--size=128M", "--output-format=json",
                        *([f"--rate_iops={args.iops}"] if args.iops else [])], check=True,
                       capture_output=True)
        elapsed = time.monotonic() - t
        rec.send_signal(signal.SIGINT)
        rec.communicate(timeout=120)
        kernel_reads = disk_reads(dev) - before
    report = report_json(tmp / "s")
    import duckdb

    con = duckdb.connect(str(tmp / "s" / "session.duckdb"), read_only=True)
    rows = con.execute("SELECT count(*) FROM io WHERE layer IN ('block', 'io_uring')"
                       ).fetchall()[0][0]
    con.close()
    exact = sum(op["ios"] for layer in report["exact"]["totals"].values()
                for op in layer.values())
    lost = report["session"]["lost_by_reason"]
    print(f"one core (CPU {cpus[0]}): {rows} rows stored in {elapsed:.1f} s = "
          f"{rows / elapsed:,.0f} rows/s; kernel counted {exact} requests "
          f"({exact / elapsed:,.0f}/s); rows missing {exact - rows}; lost "
          f"{ {k: v for k, v in lost.items() if v} }")
    block = report["exact"]["totals"].get("block", {}).get("read", {}).get("ios", 0)
    print(f"exact tier block reads {block}, /sys/block stat reads {kernel_reads}: "
          f"{'equal' if block == kernel_reads else f'differ by {block - kernel_reads}'}")
    return 0 if block == kernel_reads else 1


if __name__ == "__main__":
    sys.exit(main())
