"""A session is a directory holding one DuckDB file with the tables of kvprof.schema."""
from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import duckdb
import pyarrow as pa

from kvprof import calibration, schema
from kvprof.errors import EX_DATAERR, EX_NOINPUT, EX_TEMPFAIL, EX_USAGE, KvprofError

DB_FILE = "session.duckdb"
# DuckDB's memory limit for a recording's connection. Past it, written blocks are evicted
# to the file (a writer reads none of them back) and big queries spill to its temp folder:
# a recording alone needs little; one that a live dashboard reads through (kvprof top) keeps
# more, for the dashboard's queries.
WRITER_MEMORY = "32MB"
LIVE_MEMORY = "128MB"


def db_path(session: str | Path) -> Path:
    p = Path(session)
    return p if p.suffix == ".duckdb" else p / DB_FILE


def segment_path(directory: Path, n: int) -> Path:
    """A session's n-th segment file: session.duckdb first, then session.1.duckdb, ... (a
    recording rolled with --roll)."""
    return directory / (DB_FILE if n == 0 else f"session.{n}.duckdb")


def segments(directory: Path) -> list[Path]:
    """The segment files a session directory holds, oldest first (the oldest may have been
    deleted to keep the session under --max-size)."""
    found = []
    for f in directory.glob("session*.duckdb"):
        parts = f.name.split(".")
        if f.name == DB_FILE:
            found.append((0, f))
        elif len(parts) == 3 and parts[1].isdigit():
            found.append((int(parts[1]), f))
    return [f for _, f in sorted(found)]


class Store:
    """Writer side. Owned by one thread; rows arrive as Arrow batches."""

    def __init__(self, directory: Path, con: duckdb.DuckDBPyConnection):
        self.directory = directory
        self.con = con
        self._depth = 0  # transactions open (transaction())
        # Open tables known to be empty: replacing nothing with nothing is skipped (each
        # statement costs DuckDB time, and a flush of an idle phase source would make three).
        self._empty: set[str] = set()

    @staticmethod
    def check_new(directory: str | Path) -> None:
        """Refuse a directory that holds a session, and make it: before a recorder attaches
        anything, it knows its session can go there."""
        d = Path(directory)
        if segments(d):
            raise KvprofError(f"{d} already holds a session; choose another -o", EX_USAGE)
        try:
            d.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise KvprofError(f"cannot create session in {d}: {e.strerror}", EX_USAGE) from None

    @classmethod
    def create(cls, directory: str | Path, segment: int = 0, live: bool = False) -> "Store":
        """A new session (or the next segment of one); `live`: read while it is written."""
        d = Path(directory)
        path = segment_path(d, segment)
        if segment == 0:
            cls.check_new(d)
        elif path.exists():
            raise KvprofError(f"{d} already holds a session; choose another -o", EX_USAGE)
        try:
            # DuckDB's default memory limit is 80 % of RAM, and a writer keeps what it wrote
            # cached up to it: RSS would grow with the recording. A recorder nobody reads live
            # only inserts a few thousand rows a flush: one thread does that in the flushing
            # thread itself, where DuckDB's thread pool would only add CPU time.
            con = duckdb.connect(str(path), config={
                "memory_limit": LIVE_MEMORY if live else WRITER_MEMORY,
                **({} if live else {"threads": 1})})
        except (OSError, duckdb.Error) as e:
            raise KvprofError(f"cannot create session in {d}: {e}", EX_USAGE) from None
        for name in schema.TABLES:
            con.execute(schema.duckdb_ddl(name))
        store = cls(d, con)
        store._empty = set(schema.OPEN_TABLES)
        return store

    def append(self, table: str, data: pa.RecordBatch | pa.Table | None) -> int:
        if data is None or data.num_rows == 0:
            return 0
        # DuckDB finds the batch by its name among this frame's locals (a replacement scan):
        # one call, where registering and unregistering it cost two more (0.9 ms of CPU an
        # append against 1.4 here, 200 rows).
        _kvprof_rows = data  # noqa: F841 - read by name in the statement below
        self.con.execute(f"INSERT INTO {table} SELECT * FROM _kvprof_rows")
        return data.num_rows

    def replace(self, table: str, data: pa.RecordBatch | pa.Table | None) -> None:
        """Put `data` in place of what one of the open tables (schema.OPEN_TABLES) held."""
        assert table in schema.OPEN_TABLES
        empty = data is None or data.num_rows == 0
        if empty and table in self._empty:
            return
        with self.transaction():
            self.con.execute(f"DELETE FROM {table}")
            self.append(table, data)
        if empty:
            self._empty.add(table)
        else:
            self._empty.discard(table)

    def mark_end(self, end_ns: int) -> None:
        """While recording, the session reaches up to the last flush: live readers and a
        killed recording's readers need not scan for its end."""
        self.con.execute(f"UPDATE session SET end_ns = {int(end_ns)}")

    def write_session(self, row: dict) -> None:
        tbl = pa.Table.from_pylist([row], schema=schema.SESSION)
        # One transaction: a live reader never sees the table without its row.
        with self.transaction():
            self.con.execute("DELETE FROM session")
            self.append("session", tbl)

    @contextmanager
    def transaction(self) -> Iterator[None]:
        """All of it or none of it reaches the file, whenever the process dies; nested ones
        are part of the outermost."""
        if self._depth:
            self._depth += 1
            try:
                yield
            finally:
                self._depth -= 1
            return
        self.con.execute("BEGIN TRANSACTION")
        self._depth = 1
        try:
            yield
        except BaseException:
            self._depth = 0
            self._empty.clear()  # rolled back: what the open tables hold is not known
            try:
                self.con.execute("ROLLBACK")
            except duckdb.Error:
                pass  # a failed write invalidated the connection: the error above says why
            raise
        self._depth = 0
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
    p = Path(session)
    parts = segments(p) if p.is_dir() else []
    if len(parts) > 1 or (parts and parts[0].name != DB_FILE):
        return _open_segments(parts)
    path = db_path(session)
    if not path.exists():
        raise KvprofError(f"no kvprof session at {session} (expected {path})", EX_NOINPUT)
    try:
        con = duckdb.connect(str(path), read_only=True)
        tables = {r[0] for r in con.execute("SELECT table_name FROM information_schema.tables")
                  .fetchall()}
    except duckdb.Error as e:
        raise unreadable(e, f"{path} is not a readable kvprof session") from None
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
    where = ("" if t0 is None or t1 is None
             else f" WHERE end_ns > {int(t0)} AND start_ns < {int(t1)}")
    query = ("SELECT start_ns, end_ns, phase, source, prefill_tokens, decode_tokens FROM {}"
             + where)
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
        clock_offset_ns=r["clock_offset_ns"], devices=_with_calibration(r["devices"]),
        config=json.loads(r["config"] or "{}"), lost=json.loads(r["lost"] or "{}"),
        status=_standing(r["status"], json.loads(r["config"] or "{}").get("recorder")),
        sources=json.loads(r.get("sources") or "[]"))


def recorder_identity() -> dict:
    """Who is recording, as kept in the session's config: enough for a reader on the same
    boot of the same host to tell whether it still runs (a pid alone may be reused)."""
    return {"pid": os.getpid(), "boot_id": _boot_id(), "start_ticks": _start_ticks(os.getpid())}


def _boot_id() -> str | None:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return None


def _start_ticks(pid: int) -> int | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rpartition(")")[2].split()[19])  # field 22, after the command's name


def _standing(status: str, recorder: dict | None) -> str:
    """A session row still saying `recording` whose recorder is gone was killed or crashed
    (its data reaches up to the last flush): `killed`, where this host can tell (same boot,
    the process gone); otherwise as recorded."""
    if status != "recording" or not recorder or recorder.get("boot_id") is None or \
            recorder["boot_id"] != _boot_id():
        return status
    alive = _start_ticks(int(recorder["pid"])) == recorder.get("start_ticks")
    return status if alive else "killed"


def _with_calibration(devices: str | None) -> list[dict]:
    """The session's devices; one recorded before its device was calibrated gets the
    calibration kept since (by the device's lasting key), if any."""
    out = json.loads(devices or "[]")
    for d in out:
        if "calibration" not in d and d.get("key"):
            found = calibration.load(d["key"])
            if found is not None:
                d["calibration"] = found
    return out


def _open_segments(parts: list[Path], kind: str = "VIEW") -> duckdb.DuckDBPyConnection:
    """A rolled session: its segments attached read-only to an in-memory DuckDB, each table a
    view over all of them (`kind` TABLE: a copy in memory), so everything downstream reads it
    as one session. The session row is the newest segment's, from the oldest segment's start
    (each segment's row starts where that segment does)."""
    con = duckdb.connect(":memory:")
    try:
        have: list[set[str]] = []
        for i, f in enumerate(parts):
            literal = "'" + str(f).replace("'", "''") + "'"
            con.execute(f"ATTACH {literal} AS s{i} (READ_ONLY)")
            have.append({r[0] for r in con.execute(
                "SELECT table_name FROM information_schema.tables WHERE table_catalog = ?",
                [f"s{i}"]).fetchall()})
            missing = set(schema.CORE_TABLES) - have[-1]
            if missing:
                raise KvprofError(f"{f} is not a kvprof session segment (missing tables: "
                                  f"{', '.join(sorted(missing))})", EX_DATAERR)
        last = len(parts) - 1
        start = con.execute(f"SELECT min(start_ns) FROM ({_union('session', have)})"
                            ).fetchall()[0][0]
        since = {}
        if parts[0].name != DB_FILE and start is not None:
            # The oldest segments were deleted (--max-size): the session starts at the first
            # whole second the kept ones hold entirely (the aggregate tier's seconds reach a
            # segment up to two seconds late), and rows from before are left out.
            start = -(-int(start) // 1_000_000_000) * 1_000_000_000
            since = {"io": "issue_ns", "io_agg": "ts_ns", "device_busy": "ts_ns",
                     "writeback": "ts_ns"}
        for name in schema.TABLES:
            if name == "session":
                con.execute(f"""CREATE {kind} session AS SELECT * REPLACE (
                    {int(start or 0)} AS start_ns,
                    {int(start or 0)} + clock_offset_ns AS start_wall_ns)
                    FROM s{last}.session""")
            elif name in schema.OPEN_TABLES:  # open at the last flush: the newest segment's
                con.execute(f"CREATE {kind} {name} AS SELECT * FROM s{last}.{name}"
                            if name in have[last] else schema.duckdb_ddl(name))
            elif any(name in h for h in have):
                where = f" WHERE {since[name]} >= {int(start)}" if name in since else ""
                con.execute(f"CREATE {kind} {name} AS SELECT * FROM ({_union(name, have)})"
                            f"{where}")
            else:
                con.execute(schema.duckdb_ddl(name))
    except duckdb.Error as e:
        con.close()
        raise unreadable(e, f"{parts[0].parent} is not a readable kvprof session") from None
    return con


def unreadable(e: duckdb.Error, what: str) -> KvprofError:
    """`what` and DuckDB's first line, as the one-line error of a damaged or foreign file;
    a session a recorder still writes (it holds the file's lock) says so instead."""
    first = str(e).splitlines()[0] if str(e) else type(e).__name__
    held = re.search(r'Could not set lock on file "([^"]+)".*\(PID (\d+)\)', first)
    if held:
        return KvprofError(f"{held[1]} is still being recorded (by process {held[2]}); read "
                           "it once the recording ends", EX_TEMPFAIL)
    return KvprofError(f"{what}: {first}", EX_DATAERR)


def _union(table: str, have: list[set[str]]) -> str:
    return " UNION ALL BY NAME ".join(f"SELECT * FROM s{i}.{table}"
                                      for i, h in enumerate(have) if table in h)


def open_replay(source: str | Path) -> duckdb.DuckDBPyConnection:
    """A session to replay: a session directory or .duckdb file, or a `kvprof export
    --parquet` directory, loaded into an in-memory DuckDB under the same table names so
    everything downstream reads it the same way."""
    p = Path(source)
    if not (p.is_dir() and (p / "io.parquet").exists()):
        parts = segments(p) if p.is_dir() else []
        if len(parts) > 1:
            # The live row cache reads io by rowid, which views over segments lack: a rolled
            # session is replayed from tables in memory.
            return _open_segments(parts, "TABLE")
        return open_session(source)
    return load_parquet({name: p / f"{name}.parquet" for name in schema.TABLES},
                        f"{p} is not a readable kvprof Parquet export")


def load_parquet(files: dict[str, Path], what: str) -> duckdb.DuckDBPyConnection:
    """One session's tables from Parquet files (a table whose file is absent: empty) in an
    in-memory DuckDB under the store's names. A file written by an older kvprof lacks later
    columns: they read as NULL."""
    con = duckdb.connect(":memory:")
    try:
        for name in schema.TABLES:
            f = files.get(name)
            if f is not None and f.exists():
                literal = "'" + str(f).replace("'", "''") + "'"
                con.execute(f"CREATE TABLE {name} AS SELECT * FROM read_parquet({literal})")
            else:
                con.execute(schema.duckdb_ddl(name))
            for col in missing_columns(con, name):
                con.execute(f'ALTER TABLE {name} ADD COLUMN "{col}" '
                            f'{schema.duck_type(name, col)}')
            _check_types(con, name, what)
    except duckdb.Error as e:
        con.close()
        raise unreadable(e, what) from None
    except KvprofError:
        con.close()
        raise
    return con


def _check_types(con: duckdb.DuckDBPyConnection, table: str, what: str) -> None:
    """A column kvprof knows must have kvprof's type: a file of some other making is refused
    here, in one line, rather than failing (or worse, converting) in a query later."""
    for col, got in con.execute(
            "SELECT column_name, data_type FROM information_schema.columns "
            "WHERE table_name = ?", [table]).fetchall():
        if col in schema.TABLES[table].names and got != schema.duck_type(table, col):
            raise KvprofError(f"{what}: {table}.{col} is {got}, expected "
                              f"{schema.duck_type(table, col)}", EX_DATAERR)
