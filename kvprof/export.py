"""`kvprof export`: one zstd Parquet file per table, columns exactly the store's."""
from __future__ import annotations

from pathlib import Path

import duckdb
import pyarrow.parquet as pq

from kvprof import schema
from kvprof.errors import EX_DATAERR, EX_USAGE, KvprofError
from kvprof.store import Reader, missing_columns


def export_parquet(con: duckdb.DuckDBPyConnection, out_dir: str | Path) -> list[Path]:
    out = Path(out_dir)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise KvprofError(f"cannot create {out}: {e.strerror}", EX_USAGE) from None
    present = {r[0] for r in con.execute(
        "SELECT table_name FROM information_schema.tables").fetchall()}
    written = []
    for table, sch in schema.TABLES.items():
        path = out / f"{table}.parquet"
        if table not in present:
            # A session recorded before this table existed: an empty file with the columns,
            # so every export has the same set of files.
            pq.write_table(sch.empty_table(), path, compression="zstd")
        else:
            # A session recorded before a column existed: exported as NULL, same schema.
            absent = set(missing_columns(con, table))
            cols = ", ".join(f'NULL::{schema.duck_type(table, f.name)} AS "{f.name}"'
                             if f.name in absent else f'"{f.name}"' for f in sch)
            # Path goes in as a parameter-free literal: quote it the SQL way.
            literal = "'" + str(path).replace("'", "''") + "'"
            con.execute(f"COPY (SELECT {cols} FROM {table}) TO {literal} "
                        "(FORMAT parquet, COMPRESSION zstd, ROW_GROUP_SIZE 1048576)")
        written.append(path)
    return written


def export_session(session: Reader, out_dir: str | Path) -> list[Path]:
    """`export_parquet` on a cursor of its own, for a view exporting from a worker thread;
    a DuckDB failure becomes a one-line KvprofError."""
    cur = session.cursor()
    try:
        return export_parquet(cur, out_dir)
    except duckdb.Error as e:
        first = (str(e).splitlines() or [type(e).__name__])[0]
        raise KvprofError(f"export to {out_dir} failed: {first}", EX_DATAERR) from None
    finally:
        cur.close()
