"""`kvprof export`: one zstd Parquet file per table, columns exactly the store's, each
carrying kvprof's schema version in its key-value metadata; flat, or in the fleet's hive
layout."""
from __future__ import annotations

import re
from datetime import datetime, timezone
from pathlib import Path

import duckdb
import pyarrow.parquet as pq

from kvprof import __version__, schema
from kvprof.errors import EX_DATAERR, EX_USAGE, KvprofError
from kvprof.store.session import Reader, missing_columns


def export_parquet(con: duckdb.DuckDBPyConnection, out_dir: str | Path, hive: bool = False,
                   host: str | None = None) -> list[Path]:
    """Every table to Parquet: `out_dir/<table>.parquet`, or with `hive` the fleet layout
    `out_dir/table=<table>/host=<host>/date=<YYYY-MM-DD>/session=<id>/data.parquet` that many
    hosts write into one directory or bucket (`host`: the session's own unless given).
    Exporting a session again replaces its files."""
    out = Path(out_dir)
    present = {r[0] for r in con.execute(
        "SELECT table_name FROM information_schema.tables").fetchall()}
    paths = {table: out / f"{table}.parquet" for table in schema.TABLES}
    if hive:
        sid, own_host, wall = con.execute(
            "SELECT session_id, host, start_wall_ns FROM session").fetchall()[0]
        date = datetime.fromtimestamp(wall / 1e9, timezone.utc).strftime("%Y-%m-%d")
        part = (f"host={_part(host or own_host)}/date={date}/session={_part(sid)}")
        paths = {table: out / f"table={table}" / part / "data.parquet"
                 for table in schema.TABLES}
    try:
        for path in paths.values():
            path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise KvprofError(f"cannot create {out}: {e.strerror}", EX_USAGE) from None
    meta = {"kvprof.schema_version": str(schema.SCHEMA_VERSION),
            "kvprof.version": __version__}
    written = []
    for table, sch in schema.TABLES.items():
        path = paths[table]
        if table not in present:
            # A session recorded before this table existed: an empty file with the columns,
            # so every export has the same set of files.
            pq.write_table(sch.empty_table().replace_schema_metadata(meta), path,
                           compression="zstd")
        else:
            # A session recorded before a column existed: exported as NULL, same schema.
            absent = set(missing_columns(con, table))
            cols = ", ".join(f'NULL::{schema.duck_type(table, f.name)} AS "{f.name}"'
                             if f.name in absent else f'"{f.name}"' for f in sch)
            # Path goes in as a parameter-free literal: quote it the SQL way.
            literal = "'" + str(path).replace("'", "''") + "'"
            kv = ", ".join(f"'{k}': '{v}'" for k, v in meta.items())
            con.execute(f"COPY (SELECT {cols} FROM {table}) TO {literal} "
                        f"(FORMAT parquet, COMPRESSION zstd, ROW_GROUP_SIZE 1048576, "
                        f"KV_METADATA {{{kv}}})")
        written.append(path)
    return written


def _part(value: str) -> str:
    """A hive partition value: no path separators, no '=' (which would read as a key)."""
    return re.sub(r"[^A-Za-z0-9._-]", "_", value) or "_"


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
