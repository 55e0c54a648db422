"""`kvprof report`: the per-phase report of a recorded session (text, JSON or one HTML file),
or of a fleet's Parquet export."""
from __future__ import annotations

import argparse
import json
import sys

from kvprof.analysis.load import load_summary, load_with_timeline
from kvprof.errors import EX_USAGE, KvprofError
from kvprof.views.report import write_report


def run(args: argparse.Namespace) -> int:
    if args.parquet:
        from kvprof.analysis import fleet

        if args.session or args.html:
            raise KvprofError("report --parquet DIR reports a fleet export: no SESSION, no "
                              "--html", EX_USAGE)
        sums = fleet.fleet_summary(args.parquet)
        sys.stdout.write(json.dumps(sums, indent=2) + "\n" if args.json
                         else fleet.to_text(sums))
        return 0
    if not args.session:
        raise KvprofError("report needs a SESSION (or --parquet DIR)", EX_USAGE)
    if args.html:
        from kvprof.views.html import report_html, write_page

        summary, timeline = load_with_timeline(args.session, mixed=args.mixed)
        write_page(args.html, report_html(summary, timeline, args.session))
        return 0
    write_report(load_summary(args.session, mixed=args.mixed), args.session, args.json)
    return 0
