"""What the syscall layer costs a busy process: pread64 calls on a page-cached file (512 bytes
by default: about the cheapest file call there is, so the probes' share is the largest), calls per
second with `kvprof record -p PID --layer syscall` attached ÷ without, baselines in the same run
before and after each attached one. Needs root. Not a test: run it, read it.

    sudo .venv/bin/python benchmarks/syscall_overhead.py [--rounds 3] [--seconds 3] [--size 512]
        [--cold DIR]   (misses instead: each call reads from the device into the page cache)
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BUSY = """
import os, sys, time
fd = os.open(sys.argv[1], os.O_RDONLY)
size = int(sys.argv[3])
sys.stdin.readline()
n, end = 0, time.monotonic() + float(sys.argv[2])
while time.monotonic() < end:
    for _ in range(100):
        os.pread(fd, size, (n % 64) * size)
        n += 1
print(n)
"""


# --cold: every pass over the file starts with its pages dropped, so each call misses and
# puts pages into the page cache (what the probe on mm_filemap_add_to_page_cache counts).
BUSY_COLD = """
import os, sys, time
fd = os.open(sys.argv[1], os.O_RDONLY)
size, total = int(sys.argv[3]), os.fstat(fd).st_size
sys.stdin.readline()
n, end = 0, time.monotonic() + float(sys.argv[2])
while time.monotonic() < end:
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    for off in range(0, total, size):
        os.pread(fd, size, off)
        n += 1
print(n)
"""


def run(data: Path, seconds: float, traced: bool, tmp: Path, size: int,
        cold: bool = False) -> float:
    busy = subprocess.Popen([sys.executable, "-c", BUSY_COLD if cold else BUSY, str(data),
                             str(seconds), str(size)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    rec = None
    if traced:
        out = tmp / f"s{time.monotonic_ns()}"
        rec = subprocess.Popen([sys.executable, "-m", "kvprof", "record", "-p", str(busy.pid),
                                "--layer", "syscall", "-o", str(out),
                                "--socket", str(tmp / "m.sock")],
                               stderr=subprocess.PIPE, text=True)
        for line in rec.stderr:
            if "Hit Ctrl-C" in line:
                break
    calls = int(busy.communicate("go\n")[0])
    if rec is not None:
        rec.send_signal(2)
        rec.wait(60)
    return calls / seconds


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seconds", type=float, default=3.0)
    ap.add_argument("--size", type=int, default=512, help="bytes per pread64 (64 KiB: a "
                    "KV chunk piece)")
    ap.add_argument("--cold", metavar="DIR",
                    help="read a 64 MiB file in DIR (a real file system, not tmpfs) from the "
                         "device: its pages dropped before each pass")
    a = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="kvprof-sysbench-"))
    if a.cold:
        data = Path(a.cold) / "cold.bin"
        with open(data, "wb") as f:
            for _ in range(64):
                f.write(os.urandom(1 << 20))
            os.fsync(f.fileno())
    else:
        data = tmp / "hot.bin"
        data.write_bytes(os.urandom(64 * a.size))
    ratios = []
    for i in range(a.rounds):
        before = run(data, a.seconds, False, tmp, a.size, bool(a.cold))
        traced = run(data, a.seconds, True, tmp, a.size, bool(a.cold))
        after = run(data, a.seconds, False, tmp, a.size, bool(a.cold))
        base = (before + after) / 2
        ratios.append(traced / base)
        print(f"round {i + 1}: without {before:,.0f} / {after:,.0f} calls/s, attached "
              f"{traced:,.0f} calls/s: ratio {traced / base:.2f}")
    print(f"attached / without, median of {a.rounds}: {statistics.median(ratios):.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
