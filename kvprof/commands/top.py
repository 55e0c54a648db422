"""`kvprof top`: the dashboard on a live recording or a replayed session (kvprof.live).

Live: the recorder runs in a background thread and writes the session as usual (so the run
can be replayed later); the dashboard's feed reads it through its own cursor.
"""
from __future__ import annotations

import argparse
import sys

from kvprof import system
from kvprof.errors import EX_USAGE, KvprofError
from kvprof.live import run_live, run_replay
from kvprof.recorder.options import options_from_args


def run(args: argparse.Namespace) -> int:
    if args.interval <= 0:
        raise KvprofError("--interval must be positive", EX_USAGE)
    if args.replay:
        return run_replay(args.replay, interval_s=args.interval)
    system.require_privilege()  # one line and exit 77 before any screen, like record
    if not sys.stdout.isatty():
        raise KvprofError("kvprof top needs a terminal; use kvprof record for a script",
                          EX_USAGE)
    return run_live(options_from_args(args), interval_s=args.interval)
