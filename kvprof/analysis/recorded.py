"""What replaying a session (or writing its fio iologs) starts from: its requests, calls and
phase windows, read from its store."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import pyarrow as pa

if TYPE_CHECKING:
    from kvprof.analysis.scaleup import Scaled


@dataclass
class Recorded:
    """What replaying a session starts from: its block requests and file calls with their
    phases (SqlRows.block_requests, file_calls), its phase windows (open ones too), the event
    sampling's shifts and its start. Where the event tier sampled, `requests` are the kept rows
    scaled up to the aggregate tier's counts (`scaled` says how; the syscall layer is never
    sampled). `bounds`: where the phase changes (fold.flatten over the session, reaching before
    and after it); piece j runs from bounds[j - 1] to bounds[j] with phase `piece_phase[j]`."""
    requests: pa.Table
    windows: pa.Table
    shifts: list[int]
    start_ns: int
    calls: pa.Table  # the syscall layer's file calls (SqlRows.file_calls)
    bounds: np.ndarray
    piece_phase: np.ndarray
    scaled: Scaled | None = None

    @property
    def kept_one_in(self) -> int | None:
        """1 in how many requests at most the event tier kept, where it sampled."""
        return 1 << max(self.shifts) if any(self.shifts) else None

    def say_scaled(self, what: str) -> str | None:
        """One line on the scaling, for stderr; None where nothing was sampled."""
        if not self.kept_one_in:
            return None
        if self.scaled is None:
            return (f"kvprof: the session kept 1 in up to {self.kept_one_in} requests past "
                    f"its --event-rate and has no aggregate tier to scale them up from: "
                    f"{what} the kept ones only")
        return (f"kvprof: the session kept 1 in up to {self.kept_one_in} requests past its "
                f"--event-rate: {what} {self.scaled.issued} requests, its "
                f"{self.scaled.kept} kept rows scaled up to the counts of its aggregate tier "
                "(copies at the next offsets, spread to the next kept row; sizes the kept "
                "rows')")


def recorded(session: str) -> Recorded:
    import duckdb

    from kvprof.analysis.fold import flatten
    from kvprof.analysis.rowsource import Pieces, SqlRows
    from kvprof.analysis.scaleup import scale_up
    from kvprof.store.session import open_session, unreadable

    con = open_session(session)
    try:
        rows = SqlRows(con.cursor())
        info = rows.info()
        windows = rows.windows()
        ws, we, wp = flatten(windows, info.start_ns, info.end_ns)
        pieces = Pieces(ws, we, wp, info.start_ns, info.end_ns, info.start_ns, True)
        got = Recorded(rows.block_requests(pieces), windows,
                       rows.sampling(info.start_ns, info.end_ns), info.start_ns,
                       rows.file_calls(pieces), ws[1:].astype(np.int64), wp)
        if got.kept_one_in and got.requests.num_rows:
            counts: dict[tuple[str, str, str], int] = {}
            for dev in set(got.requests["dev_name"].to_pylist()):
                agg = rows.aggregate(info.start_ns, info.end_ns, True, dev)
                for a in (agg[0] if agg else []):
                    if a.layer == "block":
                        key = (a.phase, dev, a.op)
                        counts[key] = counts.get(key, 0) + int(a.ios)
            if counts:
                got.requests, got.scaled = scale_up(got.requests, counts)
        return got
    except duckdb.Error as e:
        raise unreadable(e, f"{session}: the session's data is damaged") from None
    finally:
        con.close()
