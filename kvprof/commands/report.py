"""`kvprof report`: the per-phase report of a recorded session (text, JSON or one HTML file),
or of a fleet's Parquet export; the loading and writing `compare` and `demo` share."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from kvprof.errors import EX_USAGE, KvprofError
from kvprof.summary import Summary


def load_summary(session: str | Path, mixed: str = "apart") -> Summary:
    """The report of a recorded session."""
    return _load(session, mixed, with_timeline=False)[0]


def load_with_timeline(session: str | Path, mixed: str = "apart"
                       ) -> tuple[Summary, dict[str, Any]]:
    """The report of a recorded session and its timeline, for the visual report."""
    summary, timeline = _load(session, mixed, with_timeline=True)
    assert timeline is not None
    return summary, timeline


def _load(session: str | Path, mixed: str, with_timeline: bool
          ) -> tuple[Summary, dict[str, Any] | None]:
    import duckdb

    from kvprof.analysis.correlate import summarize, timeline
    from kvprof.analysis.rowsource import SqlRows
    from kvprof.store.session import open_session, unreadable

    con = open_session(session)
    try:
        rows = SqlRows(con)
        summary = summarize(rows, mixed=mixed)
        return summary, timeline(rows, mixed=mixed) if with_timeline else None
    except duckdb.Error as e:
        # Opened, but its data is damaged (a file cut short, a disk error).
        raise unreadable(e, f"{session}: the session's data is damaged") from None
    finally:
        con.close()


def write_html(path: str, text: str) -> None:
    try:
        Path(path).write_text(text)
    except OSError as e:
        raise KvprofError(f"cannot write {path}: {e.strerror}", EX_USAGE) from None
    print(f"kvprof: wrote {path} ({len(text) >> 10} KiB, opens with no network)",
          file=sys.stderr)


def print_report(session: str | Path, name: str, as_json: bool, mixed: str = "apart") -> None:
    """The per-phase report of a recorded session on stdout: `kvprof report` and the demo."""
    from kvprof.views.report import to_json, to_text

    summary = load_summary(session, mixed=mixed)
    sys.stdout.write(to_json(summary) + "\n" if as_json else to_text(summary, name))
    sys.stdout.flush()


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
        from kvprof.views.html import report_html

        summary, timeline = load_with_timeline(args.session, mixed=args.mixed)
        write_html(args.html, report_html(summary, timeline, args.session))
        return 0
    print_report(args.session, args.session, args.json, args.mixed)
    return 0
