"""The floor under any tracer of the device layers: empty programs on the raw tracepoints
kvprof attaches to (kvprof.capture.btf.TRACEPOINTS), nothing else. overhead.py's `floor`
mode runs this in place of `kvprof record`: its ratio is what attaching alone costs.

    sudo .venv/bin/python benchmarks/floor_probes.py   # attached until Ctrl-C
"""
from __future__ import annotations

import signal
import sys
import threading

from kvprof.capture.bccload import load_bcc
from kvprof.capture.btf import TRACEPOINTS


def main() -> int:
    bcc = load_bcc()
    names = [tp for layer in ("block", "io_uring") for tp in TRACEPOINTS[layer]]
    text = "".join(f"RAW_TRACEPOINT_PROBE({tp}) {{ return 0; }}\n" for tp in names)
    bpf = bcc.BPF(text=text.encode())
    done = threading.Event()
    signal.signal(signal.SIGINT, lambda *_: done.set())
    print(f"{len(names)} empty raw tracepoint programs attached. Hit Ctrl-C to end.",
          file=sys.stderr, flush=True)
    done.wait()
    bpf.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
