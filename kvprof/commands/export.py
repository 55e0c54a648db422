"""`kvprof export SESSION --parquet DIR`: the session's tables as Parquet, one file each (or
the fleet's hive layout). `--fio-iolog DIR`: its block requests as fio iologs, one per phase
and device (kvprof/views/iolog.py)."""
from __future__ import annotations

import argparse

from kvprof.errors import EX_USAGE, KvprofError


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


def _iologs(args: argparse.Namespace) -> int:
    import sys
    from pathlib import Path

    from kvprof.analysis.recorded import recorded
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
