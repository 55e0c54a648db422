"""`kvprof compare A B`: two sessions' figures side by side, with gates for CI."""
from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from kvprof.analysis.load import load_summary, load_with_timeline


def run(args: argparse.Namespace) -> int:
    from kvprof.views import compare

    gates = [compare.parse_gate(g) for g in args.gate]
    timelines: tuple[dict[str, Any], dict[str, Any]] | None = None  # loaded only for --html
    if args.html:
        (a, ta), (b, tb) = (load_with_timeline(s, args.mixed) for s in (args.a, args.b))
        timelines = (ta, tb)
    else:
        a, b = (load_summary(s, mixed=args.mixed) for s in (args.a, args.b))
    result = compare.compare(a, b, gates)
    if timelines is not None:
        from kvprof.views.html import compare_html, write_page

        write_page(args.html, compare_html(result, a, b, timelines, (args.a, args.b)))
    sys.stdout.write(json.dumps(result, indent=2) + "\n" if args.json else
                     compare.to_text(result, args.a, args.b))
    sys.stdout.flush()
    return 0 if result["passed"] else 1
