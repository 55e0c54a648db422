"""`kvprof record`: capture + phase marks -> session store, until Ctrl-C, SIGTERM or --duration."""
from __future__ import annotations

import argparse

from kvprof.recorder.options import options_from_args, resolve_filters
from kvprof.recorder.recorder import record


def run(args: argparse.Namespace) -> int:
    opts = options_from_args(args)
    if args.ebpf:
        from kvprof.capture.ebpf import build_program

        prog = build_program(opts.layers, resolve_filters(opts), device_events=opts.events,
                             uring_raw=opts.io_uring_raw)
        print("// cflags: " + " ".join(prog.cflags))
        print(prog.text)
        return 0
    record(opts)
    return 0
