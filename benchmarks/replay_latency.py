"""Decode's block latency, recorded and replayed on the same kind of device, by who made it.

    sudo .venv/bin/python benchmarks/replay_latency.py [--rounds 3] [--rate 2000] [--bs 16384]

The same decode load (`--rate` random O_DIRECT reads a second of `--bs` bytes for 2 s on a
loop device over /dev/shm), made by three generators in turn and each recorded by kvprof
(`record -d`, its default capture), then replayed with `kvprof replay --on` a second loop
device of the same size; printed per generator and round: the block layer's read p50 and
p99 in the recording and in the replay, and their ratios. The generators:

- `fio io_uring`: fio 3.33, io_uring at depth 8, `--rate_iops`: fio's rate limiter waits for
  each request's time by spinning, so the CPU that completes the reads is never idle;
- `fio psync`: the same with synchronous reads;
- `thread pool`: an engine's load path (LMCache's and the fs tier's disk loads are thread
  pools over plain syscalls): a scheduler hands each read to one of 8 worker threads at its
  time; the workers block in preadv, nothing spins.

What it shows: a loop device's "service time" is a kernel worker running on the same two
CPUs, so tens of microseconds of block latency depend on what the generator does with the
CPUs; a replay reproduces the requests and their arrivals (its threads sleep until each is
due and block in the call), not the recorded process's CPU use.

`--under DIR` puts both loop devices' files in DIR on a disk, filled with data and read with
direct I/O, so their latency is the disk's (here the VM's virtio disk, i.e. the host's).
"""
from __future__ import annotations

import argparse
import json
import mmap
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from loopdev import loop_device, report_json

from kvprof.markers import Marker

SPAN = 128 << 20


def fio(dev: str, engine: str, rate: int, bs: int) -> None:
    subprocess.run(["fio", "--name=d", f"--filename={dev}", "--direct=1", "--rw=randread",
                    f"--bs={bs}", f"--rate_iops={rate}", "--runtime=2", "--time_based",
                    f"--size={SPAN}", f"--ioengine={engine}",
                    f"--iodepth={8 if engine == 'io_uring' else 1}", "--output-format=terse"],
                   check=True, capture_output=True)


def pool(dev: str, rate: int, bs: int, workers: int = 8) -> None:
    fd = os.open(dev, os.O_RDONLY | os.O_DIRECT)
    bufs = [mmap.mmap(-1, bs) for _ in range(workers)]
    free = list(range(workers))
    rng = random.Random(0)

    def read(off: int) -> None:
        b = free.pop()
        try:
            os.preadv(fd, [bufs[b]], off)
        finally:
            free.append(b)

    try:
        with ThreadPoolExecutor(workers) as ex:
            t0 = time.monotonic_ns()
            for i in range(2 * rate):
                wait = t0 + i * 1_000_000_000 // rate - time.monotonic_ns()
                if wait > 0:
                    time.sleep(wait / 1e9)
                ex.submit(read, rng.randrange(SPAN // bs) * bs)
    finally:
        os.close(fd)


GENERATORS = {
    "fio io_uring": lambda dev, rate, bs: fio(dev, "io_uring", rate, bs),
    "fio psync": lambda dev, rate, bs: fio(dev, "psync", rate, bs),
    "thread pool": pool,
}


def record(dev: str, out: Path, sock: Path, make) -> None:
    rec = subprocess.Popen([sys.executable, "-m", "kvprof", "record", "-d", dev, "-o", str(out),
                            "--socket", str(sock)], stdout=subprocess.DEVNULL,
                           stderr=subprocess.PIPE, text=True)
    assert rec.stderr is not None
    for line in rec.stderr:
        if "Hit Ctrl-C" in line:
            break
    m = Marker(str(sock), engine="bench")
    m.mark("decode")
    make()
    m.mark("idle")
    time.sleep(0.3)
    rec.send_signal(signal.SIGINT)
    rec.wait()


def decode_read(session: Path) -> tuple[float, float]:
    lat = report_json(session)["phases"]["decode"]["block"]["read"]["latency_us"]
    return lat["p50"], lat["p99"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--rate", type=int, default=2000)
    ap.add_argument("--bs", type=int, default=16384)
    ap.add_argument("--under", type=Path, help="the devices' files in this directory on a disk")
    a = ap.parse_args()
    data = SPAN if a.under else 0  # (a hole on a file system is read without the disk)
    tmp = Path(tempfile.mkdtemp(prefix="kvprof-replay-lat-"))
    print(f"decode: {a.bs} B random reads at {a.rate}/s for 2 s; block read latency, us\n")
    print(f"{'generator':<14} round   p50 rec -> replay (ratio)   p99 rec -> replay (ratio)")
    with loop_device("rl-a", data=data, under=a.under) as dev, \
            loop_device("rl-b", data=data, under=a.under) as cand:
        for r in range(a.rounds):
            for name, make in GENERATORS.items():
                out = tmp / f"{name.replace(' ', '-')}-{r}"
                record(dev, out, tmp / "m.sock", lambda: make(dev, a.rate, a.bs))
                got = subprocess.run([sys.executable, "-m", "kvprof", "replay", str(out), "--on",
                                      cand, "-o", str(out) + "-on-cand", "--json", "--force"],
                                     capture_output=True, text=True)
                if got.returncode:
                    print(f"{name}: replay failed: {got.stderr.strip()}")
                    return 1
                lag = json.loads(got.stdout)["lag"]["decode"]["p99_s"]
                (p50, p99), (q50, q99) = decode_read(out), decode_read(Path(str(out) + "-on-cand"))
                print(f"{name:<14} {r:5}   {p50:6.1f} -> {q50:6.1f} ({q50 / p50:4.2f})      "
                      f"{p99:6.1f} -> {q99:6.1f} ({q99 / p99:4.2f})   late p99 {lag * 1e3:.1f} ms",
                      flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
