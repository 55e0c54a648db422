"""kvprof's cost beside the tools ops already trust, side by side in one run.

    sudo .venv/bin/python benchmarks/peers.py [--rounds 5] [--runtime 5] [--job ...] [--tool ...]
                                                [--backing data] [--scheduler S]
                                                [--settle S] [--bpf-stats]

The same load on the same private loop device (over /dev/shm) for every tool: fio without any
tracer, fio with the tool attached, fio without again; the ratio is the attached figure over
the mean of the two bracketing baselines (so drift of the machine during a round cancels).
Rounds interleave the tools, so a slow minute of the VM hits all of them alike. Printed: per
job and tool the median ratio and its spread (min..max) over the rounds, then a Markdown table
for docs/performance.md.

Tools (each where it runs on this host; one that cannot attach is reported, not measured):
- libbpf-tools `biolatency` and `biotop` (Debian's `libbpf-tools`: CO-RE binaries), filtered
  to the device where the tool can be;
- bpftrace with empty programs on block_rq_issue/complete (the floor of a tracer there), and
  with a biolatency program on the same tracepoints (its own biolatency.bt uses kprobes, which
  this kernel lacks);
- kvprof `record` in its modes: the default (the block layer), `--layer block --no-events`
  (the same without the event tier), and both device layers named (`--layer block --layer
  io_uring`: io_uring traces the raw device's requests too); and two of them with the
  recorder stopped (SIGSTOP) once attached, so that the probes run and nothing in user space
  does: against the same mode running, what the recorder's process costs.

Jobs: 4 KiB random reads through io_uring at QD32 and psync at QD1 (IOPS), and buffered
1 MiB sequential writes ending in fsync (MB/s: the page cache, writeback and the device).

`--scheduler` is the device's I/O scheduler: `none` by default, as on an NVMe drive (the fast
host this is about: its requests go straight to the driver, no program runs at an insert),
or `mq-deadline`, the one a loop device or a SATA disk gets, where every request waits in the
scheduler first: kvprof then follows it from that insert (its queue time), as `biolatency -Q`
does and plain `biolatency` does not; so `biolatency -Q` is measured beside it there.

`--backing data` puts random data where the jobs read (the default device is sparse: its
reads copy the kernel's one zero page, so at QD32 the CPU that submits is the only limit and
a tracer's cost there shows in full; with data the loop worker copies real pages and that
limits first, as a device that moves data does).
"""
from __future__ import annotations

import argparse
import json
import queue
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from loopdev import loop_device

JOBS = {
    "io_uring randread QD32": ["--rw=randread", "--bs=4k", "--direct=1", "--ioengine=io_uring",
                               "--iodepth=32"],
    "psync randread QD1": ["--rw=randread", "--bs=4k", "--direct=1", "--ioengine=psync",
                           "--iodepth=1"],
    "buffered write 1M": ["--rw=write", "--bs=1M", "--direct=0", "--ioengine=psync",
                          "--end_fsync=1"],
}
EMPTY_BT = ("tracepoint:block:block_rq_issue { } tracepoint:block:block_rq_complete { }")
BIOLATENCY_BT = ("tracepoint:block:block_rq_issue /args->dev == $1/ "
                 "{ @start[args->dev, args->sector] = nsecs; } "
                 "tracepoint:block:block_rq_complete /@start[args->dev, args->sector]/ "
                 "{ @usecs = hist((nsecs - @start[args->dev, args->sector]) / 1000); "
                 "delete(@start[args->dev, args->sector]); }")


@dataclass(frozen=True)
class Tool:
    name: str
    argv: Callable[[str, Path], list[str] | None]  # (device, scratch dir) -> argv, None: absent
    ready: str  # a regex of the line it prints once attached
    stop: int = signal.SIGINT
    # Stopped (SIGSTOP) once attached and resumed before it is detached: its probes run and
    # nothing in user space does; against the same tool running, what its process costs.
    paused: bool = False


def _which(*names: str) -> str | None:
    for n in names:
        path = shutil.which(n) or (f"/usr/sbin/{n}" if Path(f"/usr/sbin/{n}").exists() else None)
        if path:
            return path
    return None


def _dev_number(dev: str) -> int:
    """The kernel's dev_t of a block device as the block tracepoints give it (major << 20 |
    minor)."""
    major, minor = Path(f"/sys/class/block/{Path(dev).name}/dev").read_text().split(":")
    return int(major) << 20 | int(minor)


def _libbpf(tool: str, *args: str) -> Callable[[str, Path], list[str] | None]:
    def argv(dev: str, tmp: Path) -> list[str] | None:
        # Debian installs libbpf-tools without a suffix; bcc's python tools end in -bpfcc.
        path = _which(tool)
        return [path, *(a.replace("{disk}", Path(dev).name) for a in args)] if path else None
    return argv


def _bpftrace(program: str) -> Callable[[str, Path], list[str] | None]:
    def argv(dev: str, tmp: Path) -> list[str] | None:
        path = _which("bpftrace")
        return [path, "-e", program, str(_dev_number(dev))] if path else None
    return argv


def _kvprof(*flags: str, socket: str | None = None) -> Callable[[str, Path], list[str] | None]:
    """`socket`: where its marker socket listens (an engine's plugin sends there)."""
    def argv(dev: str, tmp: Path) -> list[str]:
        out = tmp / f"kv-{time.monotonic_ns()}"
        return [sys.executable, "-m", "kvprof", "record", "-d", dev, "-o", str(out),
                "--socket", socket or str(tmp / "m.sock"), *flags]
    return argv


TOOLS = (
    Tool("biolatency (libbpf-tools)", _libbpf("biolatency", "-d", "{disk}", "3600", "1"),
         r"Tracing block device"),
    Tool("biolatency -Q (libbpf-tools)", _libbpf("biolatency", "-Q", "-d", "{disk}", "3600",
                                                 "1"), r"Tracing block device"),
    # (biotop has no device filter; it prints its table every second, as ops run it)
    Tool("biotop (libbpf-tools)", _libbpf("biotop", "1"), r"\bCOMM\b"),
    Tool("bpftrace, empty programs", _bpftrace(EMPTY_BT), r"Attaching \d+ probe"),
    Tool("bpftrace, biolatency program", _bpftrace(BIOLATENCY_BT), r"Attaching \d+ probe"),
    Tool("kvprof --layer block --no-events", _kvprof("--layer", "block", "--no-events"),
         r"Hit Ctrl-C"),
    Tool("kvprof --layer block --no-events, stopped", _kvprof("--layer", "block",
                                                              "--no-events"),
         r"Hit Ctrl-C", paused=True),
    Tool("kvprof (default), stopped", _kvprof(), r"Hit Ctrl-C", paused=True),
    Tool("kvprof (default)", _kvprof(), r"Hit Ctrl-C"),
    # Both device layers named: io_uring traces the raw device's requests too.
    Tool("kvprof --layer block --layer io_uring", _kvprof("--layer", "block", "--layer",
                                                          "io_uring"), r"Hit Ctrl-C"),
)


def fio(dev: str, job: list[str], runtime: int) -> float:
    """The job's figure: IOPS for reads, MB/s for writes."""
    return _fio(dev, job, runtime)[0]


def _fio(dev: str, job: list[str], runtime: int) -> tuple[float, int]:
    """The job's figure and the requests it completed."""
    out = subprocess.run(["fio", "--name=b", f"--filename={dev}", "--time_based",
                          f"--runtime={runtime}", "--size=128M", "--output-format=json", *job],
                         check=True, capture_output=True, text=True).stdout
    j = json.loads(out)["jobs"][0]
    if "--rw=randread" in job:
        return j["read"]["iops"], j["read"]["total_ios"]
    return j["write"]["bw_bytes"] / 1e6, j["write"]["total_ios"]


def _prog_stats() -> dict[int, tuple[str, int, int]]:
    """Every loaded BPF program's (name, runs, ns run), by id (kernel.bpf_stats_enabled)."""
    out = subprocess.run(["bpftool", "prog", "show", "--json"], check=True,
                         capture_output=True, text=True).stdout
    return {p["id"]: (p.get("name", "?"), p.get("run_cnt", 0), p.get("run_time_ns", 0))
            for p in json.loads(out)}


def bpf_costs(dev: str, job: list[str], runtime: int) -> dict[str, float]:
    """One more fio run with the kernel's BPF run-time statistics on: per program that ran,
    the ns it ran per request fio completed (the statistics cost time of their own, so the
    ratios come from runs without them). Where each tool's cost goes, program by program."""
    stats = Path("/proc/sys/kernel/bpf_stats_enabled")
    stats.write_text("1")
    try:
        before = _prog_stats()
        _, ios = _fio(dev, job, runtime)
        after = _prog_stats()
    finally:
        stats.write_text("0")
    out = {}
    for pid, (name, runs, ns) in after.items():
        _, runs0, ns0 = before.get(pid, (name, 0, 0))
        if runs > runs0:
            out[name] = (ns - ns0) / max(ios, 1)
    return out


def attach(tool: Tool, dev: str, tmp: Path, timeout: float = 60) -> subprocess.Popen | str:
    """The tool, started and attached; or why it could not be."""
    argv = tool.argv(dev, tmp)
    if argv is None:
        return "not installed"
    # Line-buffered: C tools buffer a pipe fully, and the line saying they attached would
    # only come at exit.
    if not argv[0].endswith("python") and shutil.which("stdbuf"):
        argv = ["stdbuf", "-oL", "-eL", *argv]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: queue.Queue[str | None] = queue.Queue()

    def pump() -> None:  # reads for as long as the tool runs, so it never blocks on the pipe
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.put(line)
        lines.put(None)

    threading.Thread(target=pump, daemon=True).start()
    deadline = time.monotonic() + timeout
    seen: list[str] = []
    while (left := deadline - time.monotonic()) > 0:
        try:
            line = lines.get(timeout=left)
        except queue.Empty:
            break
        if line is None:
            proc.wait()
            return f"exited {proc.returncode}: {' '.join(seen[-1:]).strip()[:160]}"
        seen.append(line)
        if re.search(tool.ready, line) and proc.poll() is None:
            return proc
    proc.kill()
    proc.wait()
    return "did not say it attached"


def detach(proc: subprocess.Popen, sig: int) -> None:
    proc.send_signal(sig)
    try:
        proc.wait(timeout=120)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--runtime", type=int, default=5, help="seconds of each fio run")
    ap.add_argument("--job", action="append", choices=tuple(JOBS))
    ap.add_argument("--tool", action="append", choices=[t.name for t in TOOLS])
    ap.add_argument("--backing", choices=("sparse", "data"), default="sparse",
                    help="the loop device's file: sparse (reads cost the device next to "
                         "nothing: the tracers' cost on the submitting CPU in full) or random "
                         "data where the jobs read and write (the device copies real pages)")
    ap.add_argument("--scheduler", choices=("none", "mq-deadline"), default="none",
                    help="the device's I/O scheduler: none (an NVMe drive's) or mq-deadline "
                         "(a loop device's or a SATA disk's)")
    ap.add_argument("--settle", type=float, default=0.0,
                    help="seconds each tool stays attached, the device idle, before its measured "
                         "run: the tool left attached, not its first moments (a recorder's "
                         "first flush; attach times: overhead.py)")
    ap.add_argument("--bpf-stats", action="store_true",
                    help="also run each attached job once more with the kernel's BPF run-time "
                         "statistics on and print, per tool, the ns its programs ran per "
                         "request (needs bpftool)")
    args = ap.parse_args()
    if args.bpf_stats and not shutil.which("bpftool"):
        print("peers.py: --bpf-stats needs bpftool", file=sys.stderr)
        return 2
    jobs = [j for j in JOBS if not args.job or j in args.job]
    tools = [t for t in TOOLS if not args.tool or t.name in args.tool]
    tmp = Path(tempfile.mkdtemp(prefix="kvprof-peers-"))
    ratios: dict[tuple[str, str], list[float]] = {}
    costs: dict[tuple[str, str], list[dict[str, float]]] = {}
    absent: dict[str, str] = {}
    with loop_device("peers", data=(128 << 20) if args.backing == "data" else 0) as dev:
        Path(f"/sys/block/{Path(dev).name}/queue/scheduler").write_text(args.scheduler)
        for r in range(args.rounds):
            for job in jobs:
                for tool in tools:
                    if tool.name in absent:
                        continue
                    before = fio(dev, JOBS[job], args.runtime)
                    got = attach(tool, dev, tmp)
                    if isinstance(got, str):
                        absent[tool.name] = " ".join(got.split())
                        print(f"{tool.name}: not measured ({got})", flush=True)
                        continue
                    if tool.paused:
                        got.send_signal(signal.SIGSTOP)
                    time.sleep(args.settle)
                    traced = fio(dev, JOBS[job], args.runtime)
                    if args.bpf_stats:
                        costs.setdefault((job, tool.name), []).append(
                            bpf_costs(dev, JOBS[job], args.runtime))
                    if tool.paused:
                        got.send_signal(signal.SIGCONT)
                    detach(got, tool.stop)
                    after = fio(dev, JOBS[job], args.runtime)
                    ratio = traced / ((before + after) / 2)
                    ratios.setdefault((job, tool.name), []).append(ratio)
                    print(f"round {r} {job:<24} {tool.name:<34} {before:10.0f} / {after:10.0f}"
                          f" -> {traced:10.0f}  ratio {ratio:.3f}", flush=True)
    shutil.rmtree(tmp, ignore_errors=True)
    print(f"\n{args.rounds} rounds of {args.runtime} s on a {args.backing} loop device "
          f"(scheduler {args.scheduler}; {args.settle:g} s attached before each run); "
          "attached / mean of the bracketing baselines, median (min..max)\n")
    print("| attached | " + " | ".join(jobs) + " |")
    print("|---|" + "---|" * len(jobs))
    for tool in tools:
        if tool.name in absent:
            print(f"| {tool.name} | " + " | ".join(["not measured"] * len(jobs))
                  + f" ({absent[tool.name]}) |")
            continue
        cells = []
        for job in jobs:
            v = ratios.get((job, tool.name), [])
            cells.append(f"{statistics.median(v):.2f} ({min(v):.2f}..{max(v):.2f})" if v
                         else "-")
        print(f"| {tool.name} | " + " | ".join(cells) + " |")
    if costs:
        print("\nBPF run time per request (median over the rounds; kernel.bpf_stats_enabled, "
              "which adds its own clock reads to each run):")
        for (job, name), runs in costs.items():
            progs = sorted({p for r in runs for p in r})
            per = {p: statistics.median(r.get(p, 0.0) for r in runs) for p in progs}
            total = statistics.median(sum(r.values()) for r in runs)
            print(f"  {job} / {name}: {total:.0f} ns (" +
                  ", ".join(f"{p} {v:.0f}" for p, v in per.items()) + ")")
    return 0


if __name__ == "__main__":
    sys.exit(main())
