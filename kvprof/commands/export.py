"""`kvprof export SESSION --parquet DIR`: the session's tables as Parquet, one file each (or
the fleet's hive layout)."""
from __future__ import annotations

import argparse

from kvprof.errors import EX_USAGE, KvprofError


def run(args: argparse.Namespace) -> int:
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
