"""The recording's room on disk: a reserve that lets a full disk end it cleanly, its size,
and the pruning of old segments under --max-size."""
from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path

import duckdb

from kvprof.store.session import Store, segments

RESERVE_BYTES = 4 << 20


def reserve_space(out: Path) -> Path | None:
    """A few MiB set aside in the session directory, freed when its disk fills up so that
    the session row can still say how the recording ended."""
    path = out / ".kvprof-reserve"
    try:
        with open(path, "wb") as f:
            f.write(bytes(RESERVE_BYTES))
            f.flush()
            os.fsync(f.fileno())
    except OSError:
        path.unlink(missing_ok=True)
        return None
    return path


def drop_reserve(reserve: Path | None) -> None:
    if reserve is not None:
        reserve.unlink(missing_ok=True)


# Free bytes below which a fatal write error counts as the disk filling up: DuckDB may
# report only that an earlier write failed (its database "invalidated"), after deleting the
# temporary files it spilled a flush to, which gives back up to its memory limit.
NEARLY_FULL_BYTES = RESERVE_BYTES + (64 << 20)


def disk_full(e: BaseException, out: Path) -> bool:
    if isinstance(e, OSError) and e.errno == errno.ENOSPC:
        return True
    if "No space left on device" in str(e):
        return True
    fatal = isinstance(e, duckdb.Error) and any(
        word in str(e) for word in ("invalidated", "FATAL", "IO Error"))
    try:
        free = shutil.disk_usage(out).free
    except OSError:
        return False
    return free < RESERVE_BYTES or (fatal and free < NEARLY_FULL_BYTES)


def end_on_full_disk(store: Store | None, out: Path, reserve: Path | None,
                      last_flush_ns: int | None, log) -> None:
    """The writer's connection is dead after a failed write: free the reserve, reopen the
    newest segment and record the status 'disk full', ending at the last flush."""
    if store is not None:
        try:
            store.con.close()
        except duckdb.Error:
            pass
    drop_reserve(reserve)
    try:
        con = duckdb.connect(str(segments(out)[-1]))
        try:
            # Committed to the write-ahead log, which readers replay: no checkpoint, which
            # would need more room than the reserve gives back.
            con.execute("UPDATE session SET status = 'disk full', "
                        "end_ns = greatest(coalesce(?, start_ns), start_ns)", [last_flush_ns])
        finally:
            con.close()
    except (duckdb.Error, IndexError) as e:
        first = (str(e).splitlines() or [type(e).__name__])[0]
        log(f"kvprof: the session row could not say how the recording ended: {first}")


def disk_bytes(out: Path, only: Path | None = None) -> int:
    """What the session (or one segment of it) takes on disk now: its DuckDB files and
    write-ahead logs."""
    total = 0
    for db in [only] if only is not None else segments(out):
        for f in (db, db.with_name(db.name + ".wal")):
            try:
                total += f.stat().st_blocks * 512
            except OSError:
                pass
    return total


def prune(out: Path, max_size: int, log) -> None:
    """Delete the oldest segments (never the one being written) while the session takes more
    than max_size: a recorder left attached keeps the most recent stretch."""
    parts = segments(out)
    while len(parts) > 1 and disk_bytes(out) > max_size:
        oldest = parts.pop(0)
        oldest.unlink(missing_ok=True)
        oldest.with_name(oldest.name + ".wal").unlink(missing_ok=True)
        log(f"kvprof: --max-size: deleted the oldest segment {oldest.name}")
