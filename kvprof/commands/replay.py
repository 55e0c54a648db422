"""`kvprof replay SESSION --on DEVICE_OR_DIR`: a recorded session's I/O issued again on
candidate storage while a new session is recorded there (kvprof.replay)."""
from __future__ import annotations

import argparse
import json

from kvprof.replay.run import replay


def run(args: argparse.Namespace) -> int:
    result = replay(args.session, args.on, args.phase, args.speed, args.out, args.force,
                    args.layer, args.cache, args.open_loop)
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    what = "file calls" if result["layer"] == "syscall" else "requests"
    print(f"kvprof: replayed {result['requests']} {what} of {args.session} on {args.on} "
          f"(x{result['speed']:g}); new session {result['session']}")
    if result.get("threads"):
        print(f"  the {result['threads']} recorded threads' calls in their order, each after "
              "the one before it completed and the thread's own time between them: a call "
              "the candidate serves later moves the rest of its thread, as in the engine")
    for ph, lg in result["lag"].items():
        verdict = ("kept up" if lg["p99_s"] < 0.01 else
                   f"fell behind: p99 {lg['p99_s']:.2f} s, at most {lg['max_s']:.2f} s late")
        print(f"  {ph:8} {lg['requests']:>8} {what}  {verdict}")
    # Each call stays in the phase it was recorded in: a phase the candidate let its calls
    # out of late lasted until they were out.
    took = result["phases"]
    if took:
        print("  time per phase, recorded -> replayed: " + ", ".join(
            f"{ph} {t['recorded_s'] / result['speed']:.2f} -> {t['replayed_s']:.2f} s"
            + (f" ({t['stretched_s']:+.2f} s)" if abs(t["stretched_s"]) >= 0.005 else "")
            for ph, t in took.items()))
    print(f"kvprof: compare them with: kvprof compare {args.session} {result['session']}")
    return 0
