"""Overhead of this tree against an earlier revision, measured in the same run.

    sudo .venv/bin/python benchmarks/before_after.py --before REV [--rounds 4] [RECORD ARGS]

Each round runs fio (4 KiB random reads, io_uring QD32, 5 s) on a private loop device bare,
with the earlier revision's `kvprof record` attached and with this tree's, in an order that
turns around every round, so the drift of a shared machine falls on both alike. Prints the
median IOPS of each and the ratios. RECORD ARGS (e.g. `--no-events`) go to both recorders.
The earlier revision is checked out into a temporary git worktree and run from it with this
tree's venv.
"""
from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from loopdev import loop_device
from overhead import JOBS, fio_iops

ROOT = Path(__file__).resolve().parents[1]


JOB = JOBS["io_uring QD32"]


def attached(tree: Path, dev: str, runtime: int, extra: list[str]) -> float:
    with tempfile.TemporaryDirectory() as d:
        # PYTHONPATH first: the tree's own package, not the venv's editable install.
        env = dict(os.environ, PYTHONPATH=str(tree))
        rec = subprocess.Popen([sys.executable, "-m", "kvprof", "record", "-d",
                                os.path.basename(dev), "-o", f"{d}/s", "--socket",
                                f"{d}/m.sock", *extra], stderr=subprocess.PIPE, text=True,
                               env=env, cwd=tree)
        for line in rec.stderr:
            if "Hit Ctrl-C" in line:
                break
        else:
            raise SystemExit(f"the recorder of {tree} did not start")
        try:
            return fio_iops(dev, JOB, runtime)
        finally:
            rec.send_signal(signal.SIGINT)
            rec.communicate()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--before", required=True, help="the earlier revision (git rev)")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--runtime", type=int, default=5)
    args, extra = ap.parse_known_args()
    old = Path(tempfile.mkdtemp(prefix="kvprof-before-"))
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "-f", "--detach", str(old),
                    args.before], check=True, capture_output=True)
    # Trees before kvprof/layers/ kept their probes in probes/, the package `kvprof.probes`
    # (a link in an installed tree); without it the venv's editable install would hand the
    # old code this tree's probes.
    if (old / "probes").is_dir() and not (old / "kvprof" / "probes").exists():
        (old / "kvprof" / "probes").symlink_to(old / "probes")
    got: dict[str, list[float]] = {"bare": [], "before": [], "after": []}
    try:
        with loop_device("before-after") as dev:
            for r in range(args.rounds):
                order = ["bare", "before", "after"]
                for v in order if r % 2 == 0 else order[::-1]:
                    got[v].append(fio_iops(dev, JOB, args.runtime) if v == "bare" else
                                  attached(old if v == "before" else ROOT, dev, args.runtime,
                                           extra))
                print(f"round {r}: " + ", ".join(f"{k} {v[-1]:,.0f}" for k, v in got.items()),
                      flush=True)
    finally:
        subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(old)],
                       check=False, capture_output=True)
    m = {k: statistics.median(v) for k, v in got.items()}
    print(f"median IOPS: bare {m['bare']:,.0f}, {args.before} {m['before']:,.0f}, this tree "
          f"{m['after']:,.0f}; attached/bare {m['before'] / m['bare']:.3f} before, "
          f"{m['after'] / m['bare']:.3f} after; after/before {m['after'] / m['before']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
