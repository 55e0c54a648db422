"""`kvprof export`: one zstd Parquet file per table, columns exactly the store's."""
from __future__ import annotations

from pathlib import Path

import duckdb

from kvprof import schema
from kvprof.errors import EX_USAGE, KvprofError


def export_parquet(con: duckdb.DuckDBPyConnection, out_dir: str | Path) -> list[Path]:
    out = Path(out_dir)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise KvprofError(f"cannot create {out}: {e.strerror}", EX_USAGE) from None
    written = []
    for table in schema.TABLES:
        path = out / f"{table}.parquet"
        cols = ", ".join(f'"{f.name}"' for f in schema.TABLES[table])
        # Path goes in as a parameter-free literal: quote it the SQL way.
        literal = "'" + str(path).replace("'", "''") + "'"
        con.execute(f"COPY (SELECT {cols} FROM {table}) TO {literal} "
                    "(FORMAT parquet, COMPRESSION zstd, ROW_GROUP_SIZE 1048576)")
        written.append(path)
    return written
