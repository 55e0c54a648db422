"""A recorded session's report (and timeline), computed from its store."""
from __future__ import annotations

from pathlib import Path
from typing import Any

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
