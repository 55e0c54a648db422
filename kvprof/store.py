"""A session is a directory holding one DuckDB file with the tables of kvprof.schema."""
from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import duckdb
import pyarrow as pa

from kvprof import schema
from kvprof.errors import EX_DATAERR, EX_NOINPUT, EX_USAGE, KvprofError

DB_FILE = "session.duckdb"
WRITER_MEMORY = "128MB"


def db_path(session: str | Path) -> Path:
    p = Path(session)
    return p if p.suffix == ".duckdb" else p / DB_FILE


class Store:
    """Writer side. Owned by one thread; rows arrive as Arrow batches."""

    def __init__(self, directory: Path, con: duckdb.DuckDBPyConnection):
        self.directory = directory
        self.con = con

    @classmethod
    def create(cls, directory: str | Path) -> "Store":
        d = Path(directory)
        if (d / DB_FILE).exists():
            raise KvprofError(f"{d} already holds a session; choose another -o", EX_USAGE)
        try:
            d.mkdir(parents=True, exist_ok=True)
            # DuckDB's default memory limit is 80 % of RAM, and a writer keeps what it wrote
            # cached up to it: RSS would grow with the recording. Past the limit, written
            # blocks are evicted to the file and big live queries spill to its temp folder.
            con = duckdb.connect(str(d / DB_FILE), config={"memory_limit": WRITER_MEMORY})
        except (OSError, duckdb.Error) as e:
            raise KvprofError(f"cannot create session in {d}: {e}", EX_USAGE) from None
        for name in schema.TABLES:
            con.execute(schema.duckdb_ddl(name))
        return cls(d, con)

    def append(self, table: str, data: pa.RecordBatch | pa.Table | None) -> int:
        if data is None or data.num_rows == 0:
            return 0
        self.con.register("_kvprof_batch", data)
        try:
            self.con.execute(f"INSERT INTO {table} SELECT * FROM _kvprof_batch")
        finally:
            self.con.unregister("_kvprof_batch")
        return data.num_rows

    def replace_open_windows(self, rows: list[dict]) -> None:
        # One transaction: a kill between the delete and the insert would otherwise leave
        # a killed session without the phase that was running.
        with self._transaction():
            self.con.execute("DELETE FROM phase_open")
            if rows:
                self.append("phase_open", pa.Table.from_pylist(rows, schema=schema.PHASE_OPEN))

    def mark_end(self, end_ns: int) -> None:
        """While recording, the session reaches up to the last flush: live readers and a
        killed recording's readers need not scan for its end."""
        self.con.execute(f"UPDATE session SET end_ns = {int(end_ns)}")

    def write_session(self, row: dict) -> None:
        tbl = pa.Table.from_pylist([row], schema=schema.SESSION)
        # One transaction: a live reader never sees the table without its row.
        with self._transaction():
            self.con.execute("DELETE FROM session")
            self.append("session", tbl)

    @contextmanager
    def _transaction(self) -> Iterator[None]:
        self.con.execute("BEGIN TRANSACTION")
        try:
            yield
        except BaseException:
            self.con.execute("ROLLBACK")
            raise
        self.con.execute("COMMIT")

    def close(self) -> None:
        self.con.execute("CHECKPOINT")
        self.con.close()


class Reader:
    """A session open for reading, as views get it: they never hold DuckDB themselves, and
    each thread that reads (the dashboard's feed, an export worker) takes its own cursor."""

    def __init__(self, con: duckdb.DuckDBPyConnection):
        self._con = con

    def cursor(self) -> duckdb.DuckDBPyConnection:
        return self._con.cursor()


@dataclass(frozen=True)
class SessionInfo:
    session_id: str
    host: str
    kernel: str
    kvprof_version: str
    bcc_version: str
    start_wall_ns: int
    start_ns: int
    end_ns: int
    clock_offset_ns: int
    devices: list
    config: dict
    lost: dict
    status: str
    sources: list

    @property
    def duration_s(self) -> float:
        return max(0, self.end_ns - self.start_ns) / 1e9


def open_session(session: str | Path) -> duckdb.DuckDBPyConnection:
    """Read-only connection to a recorded session, or a one-line KvprofError."""
    path = db_path(session)
    if not path.exists():
        raise KvprofError(f"no kvprof session at {session} (expected {path})", EX_NOINPUT)
    try:
        con = duckdb.connect(str(path), read_only=True)
        tables = {r[0] for r in con.execute("SELECT table_name FROM information_schema.tables")
                  .fetchall()}
    except duckdb.Error as e:
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise KvprofError(f"{path} is not a readable kvprof session: {first}",
                          EX_DATAERR) from None
    missing = set(schema.CORE_TABLES) - tables
    if missing:
        con.close()
        raise KvprofError(f"{path} is not a kvprof session (missing tables: "
                          f"{', '.join(sorted(missing))})", EX_DATAERR)
    return con


def missing_columns(con: duckdb.DuckDBPyConnection, table: str) -> list[str]:
    """Columns of schema.TABLES[table] the stored table lacks (a session recorded by an older
    kvprof)."""
    have = {r[0] for r in con.execute(
        "SELECT column_name FROM information_schema.columns WHERE table_name = ?",
        [table]).fetchall()}
    return [f.name for f in schema.TABLES[table] if f.name not in have]


def weighted_bytes(cur: duckdb.DuckDBPyConnection) -> str:
    """The SQL for the bytes a row stands for: its own times its sample weight (the event
    tier's sampling of the device layers), for sessions that have the column."""
    if "sample_weight" in missing_columns(cur, "io"):
        return "bytes"
    return "(bytes * coalesce(sample_weight, 1))"


def phase_windows(con: duckdb.DuckDBPyConnection, t0: int | None = None,
                  t1: int | None = None) -> pa.Table:
    """Closed windows plus those still open at the last flush (absent in older sessions);
    with bounds, only those reaching into [t0, t1): a live view need not read, every frame,
    the thousands of windows an engine marks per minute."""
    where = "" if t0 is None else f" WHERE end_ns > {int(t0)} AND start_ns < {int(t1)}"
    query = "SELECT start_ns, end_ns, phase, source FROM {}" + where
    try:
        return con.sql(query.format("phase") + " UNION ALL " +
                       query.format("phase_open")).to_arrow_table()
    except duckdb.CatalogException:
        return con.sql(query.format("phase")).to_arrow_table()


def session_info(con: duckdb.DuckDBPyConnection) -> SessionInfo:
    rows = con.sql("SELECT * FROM session").to_arrow_table().to_pylist()
    if not rows:
        raise KvprofError("session has no session row (recording never started)", EX_DATAERR)
    r = rows[0]
    end = r["end_ns"]
    if end is None or end == 0:
        # A recording killed before its first flush, or by a kvprof that did not mark
        # flushes: the data is still there, so end the session at the last thing it saw.
        last_io = con.execute("SELECT max(complete_ns) FROM io").fetchall()[0][0]
        ends = phase_windows(con)["end_ns"].to_pylist()
        end = max(int(last_io or 0), max(ends, default=0), r["start_ns"])
    return SessionInfo(
        session_id=r["session_id"], host=r["host"], kernel=r["kernel"],
        kvprof_version=r["kvprof_version"], bcc_version=r["bcc_version"],
        start_wall_ns=r["start_wall_ns"], start_ns=r["start_ns"], end_ns=end,
        clock_offset_ns=r["clock_offset_ns"], devices=json.loads(r["devices"] or "[]"),
        config=json.loads(r["config"] or "{}"), lost=json.loads(r["lost"] or "{}"),
        status=r["status"], sources=json.loads(r.get("sources") or "[]"))


def open_replay(source: str | Path) -> duckdb.DuckDBPyConnection:
    """A session to replay: a session directory or .duckdb file, or a `kvprof export
    --parquet` directory, loaded into an in-memory DuckDB under the same table names so
    everything downstream reads it the same way."""
    p = Path(source)
    if not (p.is_dir() and (p / "io.parquet").exists()):
        return open_session(source)
    con = duckdb.connect(":memory:")
    try:
        for name in schema.TABLES:
            f = p / f"{name}.parquet"
            if f.exists():
                literal = "'" + str(f).replace("'", "''") + "'"
                con.execute(f"CREATE TABLE {name} AS SELECT * FROM read_parquet({literal})")
            else:
                con.execute(schema.duckdb_ddl(name))
        # An export of a session recorded before later io columns: they read as NULL.
        for col in missing_columns(con, "io"):
            con.execute(f'ALTER TABLE io ADD COLUMN "{col}" {schema.duck_type("io", col)}')
    except duckdb.Error as e:
        con.close()
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise KvprofError(f"{p} is not a readable kvprof Parquet export: {first}",
                          EX_DATAERR) from None
    return con
