"""Run kvprof's NVML phase source the way the recorder does, for DURATION_S, and write what it
produced as JSON to OUT: {"gpu": rows, "phase": rows, "counts": {...}, "start_ns", "end_ns"}.

Usage: python drive.py DURATION_S OUT. Run it with LD_LIBRARY_PATH naming the simulated
libnvidia-ml.so.1. A KvprofError prints its one line and exits with its status, as the CLI.
"""
from __future__ import annotations

import json
import sys
import time

from kvprof.errors import KvprofError

TAKE_EVERY_S = 0.25  # the recorder's flush interval: take() runs while the sampler polls


def main(duration_s: float, out: str) -> int:
    from kvprof.phases.nvml import NvmlSource

    try:
        sampler = NvmlSource()
    except KvprofError as e:
        print(f"kvprof: {e}", file=sys.stderr)
        return e.exit_code
    rows: dict[str, list] = {"gpu": [], "phase": []}

    def take() -> None:
        for table, t in sampler.take().items():
            rows[table] += t.to_pylist()

    start_ns = time.monotonic_ns()
    sampler.start()
    deadline = time.monotonic() + duration_s
    while time.monotonic() < deadline:
        time.sleep(TAKE_EVERY_S)
        take()
    end_ns = time.monotonic_ns()
    sampler.stop(end_ns)
    take()
    with open(out, "w") as f:
        json.dump({**rows, "counts": sampler.counts(), "start_ns": start_ns, "end_ns": end_ns}, f)
    return 0


if __name__ == "__main__":
    sys.exit(main(float(sys.argv[1]), sys.argv[2]))
