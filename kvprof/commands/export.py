"""`kvprof export SESSION --parquet DIR`: the session's tables as Parquet, one file each (or
the fleet's hive layout). `--fio-iolog DIR`: its block requests as fio iologs, one per phase
and device (kvprof/views/iolog.py)."""
from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import pyarrow as pa

from kvprof.errors import EX_USAGE, KvprofError

if TYPE_CHECKING:
    from kvprof.analysis.scaleup import Scaled


def run(args: argparse.Namespace) -> int:
    if args.fio_iolog:
        return _iologs(args)
    from kvprof.store.parquet import export_parquet
    from kvprof.store.session import open_session, unreadable

    if args.host and not args.hive:
        raise KvprofError("--host files a session in the fleet layout: add --hive", EX_USAGE)
    import duckdb

    con = open_session(args.session)
    try:
        for path in export_parquet(con, args.parquet, hive=args.hive, host=args.host):
            print(path)
    except duckdb.Error as e:
        raise unreadable(e, f"{args.session}: the session's data is damaged") from None
    finally:
        con.close()
    return 0


@dataclass
class Recorded:
    """What replaying a session starts from: its block requests and file calls with their
    phases (SqlRows.block_requests, file_calls, over the whole session), its phase windows
    (open ones too), the event sampling's shifts and its start. Where the event tier
    sampled, `requests` are the kept rows scaled up to the aggregate tier's counts, and
    `scaled` says how. (The syscall layer is never sampled.) `bounds`: where the phase
    changes, from the pieces that gave the requests and calls their phases (fold.flatten over
    the session; the first piece reaches back before the session, the last on after it);
    piece j runs from bounds[j - 1] to bounds[j] and has phase `piece_phase[j]`."""
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


def _iologs(args: argparse.Namespace) -> int:
    import sys
    from pathlib import Path

    from kvprof.errors import EX_DATAERR
    from kvprof.views.iolog import write_iologs

    got = recorded(args.session)
    if got.requests.num_rows == 0:
        raise KvprofError(f"{args.session}: no block requests recorded one by one (recorded "
                          "with --no-events, or without the block layer): nothing to replay",
                          EX_DATAERR)
    done = write_iologs(got.requests, Path(args.fio_iolog))
    for (phase, dev), (n, nbytes) in sorted(done.requests.items()):
        print(f"{args.fio_iolog}/{phase}.{dev}.iolog\t{phase}\t{dev}\t{n} requests\t"
              f"{nbytes} bytes")
    said = got.say_scaled("the iologs hold")
    if said:
        print(said, file=sys.stderr)
    for op, n in sorted(done.left_out.items()):
        print(f"kvprof: {n} {op} requests left out (the device's own, not replayed)",
              file=sys.stderr)
    return 0
