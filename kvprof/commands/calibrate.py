"""`kvprof calibrate`: measure what a device can do for the access patterns of prefill and
decode (docs/calibrate.md; the patterns and the stored results: kvprof/calibration.py).

Each pattern runs a few seconds with fio as the load (the generator ops already trust; kvprof
does not write its own). The figures are the kernel's, as every kvprof number is: the device's
/sys/block stat deltas over fio's run time, fio's own beside them and its latency percentiles
(the kernel keeps none); a target with no block device under it (tmpfs) keeps fio's figures."""
from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import time

from kvprof.calibration import (
    BY_NAME,
    MIB,
    PATTERNS,
    VERSION,
    Pattern,
    identity,
    read_attr,
    save,
    sysfs_dir,
)
from kvprof.devices import Device
from kvprof.errors import EX_DATAERR, EX_UNAVAILABLE, EX_USAGE, KvprofError
from kvprof.targets import Target, prepare


def _diskstats(dev: Device) -> tuple[int, int, int, int]:
    """(reads, read sectors, writes, write sectors) completed, from /sys/block stat."""
    f = read_attr(sysfs_dir(dev) / "stat").split()
    return int(f[0]), int(f[2]), int(f[4]), int(f[6])


def fio_command(target: Target, pat: Pattern, runtime_s: float) -> list[str]:
    return ["fio", "--name=kvprof-calibrate", f"--filename={target.path}", f"--rw={pat.rw}",
            f"--bs={pat.bs}", f"--iodepth={pat.iodepth}", f"--ioengine={pat.engine}",
            "--direct=1", "--time_based", f"--runtime={runtime_s:g}", f"--size={target.size}",
            "--randrepeat=0", "--norandommap", "--output-format=json"]


def _progress(i: int, pat: Pattern, runtime_s: float, started: float) -> None:
    width = 24
    done = min(1.0, (time.monotonic() - started) / max(runtime_s, 1e-9))
    bar = "#" * int(done * width) + "." * (width - int(done * width))
    sys.stderr.write(f"\r[{i + 1}/{len(PATTERNS)}] [{bar}] {pat.name:<20}")
    sys.stderr.flush()


def _settle_filesystem(path: str) -> None:
    """Everything the file system under `path` still owes the device (dirty pages, extents
    to convert, the journal's open transaction) written now, not during the next pattern:
    otherwise a commit of earlier work lands in the run and counts as the pattern's."""
    import ctypes

    fd = os.open(path, os.O_RDONLY)
    try:
        ctypes.CDLL(None, use_errno=True).syncfs(fd)
    finally:
        os.close(fd)


def run_pattern(i: int, target: Target, pat: Pattern, runtime_s: float) -> dict:
    """One pattern under fio: the kernel's figures over fio's run time, fio's beside them."""
    if target.scratch is not None:
        _settle_filesystem(target.path)
    before = _diskstats(target.device) if target.device else None
    started = time.monotonic()
    tty = sys.stderr.isatty()
    proc = subprocess.Popen(fio_command(target, pat, runtime_s), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    while proc.poll() is None:
        if tty:
            _progress(i, pat, runtime_s, started)
        time.sleep(0.25)
    out, err = proc.communicate()
    if proc.returncode != 0:
        last = (err.strip().splitlines() or ["no output"])[-1]
        raise KvprofError(f"fio failed on {pat.name}: {last}", EX_DATAERR)
    after = _diskstats(target.device) if target.device else None
    job = json.loads(out[out.index("{"):])["jobs"][0]
    side = job["write" if pat.op == "write" else "read"]
    # The run time fio divides by for its own figures (this direction's, in ms; the job's
    # can be a millisecond shorter).
    runtime = (side.get("runtime") or job.get("job_runtime") or runtime_s * 1e3) / 1e3
    pct = side["clat_ns"].get("percentile", {})
    entry = {
        "label": pat.label, "rw": pat.rw, "bs": pat.bs, "iodepth": pat.iodepth,
        "engine": pat.engine, "runtime_s": runtime,
        "fio": {"iops": side["iops"], "bandwidth_bytes_per_s": side["bw_bytes"],
                "ios": side["total_ios"], "bytes": side["io_bytes"]},
        "latency_us": {"mean": side["clat_ns"]["mean"] / 1e3,
                       **{k: pct[v] / 1e3 if v in pct else None for k, v in
                          (("p50", "50.000000"), ("p99", "99.000000"),
                           ("p999", "99.900000"))}},
    }
    if before is not None and after is not None:
        ios, sectors = ((after[0] - before[0], after[1] - before[1]) if pat.op == "read"
                        else (after[2] - before[2], after[3] - before[3]))
        entry.update(source="kernel", ios=ios, bytes=sectors * 512, iops=ios / runtime,
                     bandwidth_bytes_per_s=sectors * 512 / runtime)
    else:
        entry.update(source="fio", iops=side["iops"], bandwidth_bytes_per_s=side["bw_bytes"])
    if tty:
        sys.stderr.write("\r" + " " * 60 + "\r")
    return entry


def fio_version() -> str:
    if not shutil.which("fio"):
        raise KvprofError("kvprof calibrate drives fio, which is not installed", EX_UNAVAILABLE,
                          hint="apt install fio")
    return subprocess.run(["fio", "--version"], capture_output=True, text=True).stdout.strip()


def calibrate(spec: str, runtime_s: float = 5.0, size: int = 1 << 30, force: bool = False,
              patterns: tuple[str, ...] = (), log=lambda line: print(line, file=sys.stderr)
              ) -> dict:
    """Run the patterns on `spec` (a block device or a directory) and return the result."""
    version = fio_version()
    chosen = [BY_NAME[n] for n in patterns] if patterns else list(PATTERNS)
    target = prepare(spec, size, force)
    try:
        dev = identity(target.device) if target.device else None
        where = f"{dev['name']} ({dev['key']})" if dev else "no block device (fio's figures)"
        log(f"kvprof: calibrating {spec} on {where}: {len(chosen)} patterns of "
            f"{runtime_s:g} s over {target.size >> 20} MiB")
        results = {}
        for i, pat in enumerate(chosen):
            results[pat.name] = run_pattern(i, target, pat, runtime_s)
            r = results[pat.name]
            log(f"  {pat.name:<20} {r['iops']:>10,.0f} IOPS "
                f"{r['bandwidth_bytes_per_s'] / MIB:>9.1f} MiB/s  "
                f"p99 {r['latency_us']['p99'] or 0:>8.1f} us")
    finally:
        if target.scratch is not None:
            target.scratch.unlink(missing_ok=True)
    return {"version": VERSION, "key": dev["key"] if dev else None, "device": dev,
            "target": spec, "host": socket.gethostname(), "when_wall_ns": time.time_ns(),
            "runtime_s": runtime_s, "size_bytes": target.size, "fio": version,
            "patterns": results}


def run(args: argparse.Namespace) -> int:
    unknown = [n for n in args.pattern if n not in BY_NAME]
    if unknown:
        raise KvprofError(f"unknown pattern {unknown[0]!r}; patterns: " + ", ".join(BY_NAME),
                          EX_USAGE)
    if args.runtime <= 0:
        raise KvprofError("--runtime must be positive", EX_USAGE)
    result = calibrate(args.target, args.runtime, args.size, args.force,
                                 tuple(args.pattern))
    path = save(result)
    if args.json:
        print(json.dumps(result, indent=2))
    print(f"kvprof: kept for {result['key']} in {path}" if path else
          "kvprof: not kept: the target has no block device of its own", file=sys.stderr)
    return 0
