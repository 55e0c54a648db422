"""`kvprof mark PHASE`: mark a phase from a shell (the marker protocol, kvprof/markers.py).
Imports nothing heavy: a script may call it often."""
from __future__ import annotations

import argparse
import sys

from kvprof.errors import EX_NOPERM, KvprofError


def run(args: argparse.Namespace) -> int:
    import errno

    from kvprof.markers import Marker

    m = Marker(args.socket, engine=args.engine)
    if not m.mark(args.phase, prefill_tokens=args.prefill_tokens,
                  decode_tokens=args.decode_tokens):
        if m.last_error in (errno.EACCES, errno.EPERM):
            raise KvprofError(f"permission denied on the marker socket {m.path} (the recorder's "
                              "--socket-group or --socket-mode decides who may send)",
                              EX_NOPERM)
        # A shell script should learn that nobody listened, without failing hard.
        print(f"kvprof: no recorder listening on {m.path}", file=sys.stderr)
        return 1
    return 0
