"""The session's recent I/O rows as numpy columns sorted by issue time, kept current by
reading only the rows stored since the last refresh, for the live dashboard's twice-a-second
rebuild (re-running the store's SQL would re-join and re-sort the whole window each time). A
time span is a slice found by binary search (an I/O's phase is the window holding its issue
time), busy islands grow as rows arrive with no sort, and running byte sums give any span's
bytes in two lookups. `rollup.py` builds per-second aggregates from these rows; `rowsource.LiveRows`
answers correlate from them, or with SQL where the cache lacks the span."""
from __future__ import annotations

from dataclasses import dataclass

import duckdb
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from kvprof import schema
from kvprof.analysis.intervals import busy_islands_ordered
from kvprof.store.session import weighted_bytes

# Columns kept per I/O: what correlate and the dashboard read, as small fixed-width numbers.
_DTYPES = {
    "issue": np.int64,
    "start": np.int64,     # insert_ns, or issue_ns when the request skipped the queue
    "complete": np.int64,
    "bytes": np.int64,
    "layer": np.int8,      # index in schema.LAYERS
    "op": np.int8,         # index in schema.OPS
    "dev": np.int16,       # index in IoCache.dev_names; -1 when the row names no device
    "proc": np.int32,      # index in IoCache.tgids
}
# About 60 bytes a row (columns and running sums): the default bound keeps the cache near
# 420 MB at most, and holds the 60 s window at 100k events/s.
MAX_ROWS = 7_000_000


def _sql_list(values) -> str:
    return "[" + ", ".join("'" + v + "'" for v in values) + "]"


# {bytes}: weighted by the event tier's sampling where the session has the column.
_SELECT = f"""
    SELECT issue_ns, CASE WHEN insert_ns > 0 THEN insert_ns ELSE issue_ns END,
           complete_ns, {{bytes}}::BIGINT,
           (list_position({_sql_list(schema.LAYERS)}, layer) - 1)::TINYINT,
           (greatest(list_position({_sql_list(schema.OPS)}, op), 1) - 1)::TINYINT,
           dev_name, coalesce(tgid, 0)::BIGINT, rowid
    FROM io"""


@dataclass(frozen=True)
class Rows:
    """One window's rows (a view into the cache, or a filtered copy), in issue order."""
    issue: np.ndarray
    start: np.ndarray
    complete: np.ndarray
    bytes: np.ndarray
    layer: np.ndarray
    op: np.ndarray
    dev: np.ndarray
    proc: np.ndarray

    def __len__(self) -> int:
        return len(self.issue)

    def mask(self, keep: np.ndarray) -> "Rows":
        return Rows(*(getattr(self, k)[keep] for k in _DTYPES))


class IoCache:
    """io rows with issue time in [lo_ns, ...), appended as the store grows: at most
    `max_rows`, dropping the oldest by issue time. Used by one thread at a time (the
    dashboard's feed)."""

    def __init__(self, max_rows: int = MAX_ROWS):
        self.max_rows = max_rows
        self.lo_ns = np.iinfo(np.int64).min  # every stored row issued at or after it is here
        self.dev_names: list[str] = []
        self.tgids: list[int] = []
        self.comm: dict[int, str] = {}
        self._dev_code: dict[str, int] = {}
        self._proc_code: dict[int, int] = {}
        self._next_rowid = 0
        self._cols = {k: np.empty(1024, t) for k, t in _DTYPES.items()}
        self._a = self._n = 0  # live rows are [_a, _n) of every column
        # Per device layer, bytes of that layer's rows before each row (one more entry than
        # rows): any span's bytes by two lookups, so the timeline needs no pass over its rows.
        self._cum = {lay: np.zeros(1025, np.int64) for lay in range(len(schema.DEVICE_LAYERS))}
        # Busy islands of the block rows (key None) and of each device's (key: its code),
        # kept current as rows arrive: idle time needs no pass over the window.
        self._islands: dict[int | None, tuple[np.ndarray, np.ndarray]] = {}

    def __len__(self) -> int:
        return self._n - self._a

    def col(self, name: str) -> np.ndarray:
        return self._cols[name][self._a:self._n]

    def covers(self, t0: int) -> bool:
        return t0 >= self.lo_ns

    def refresh(self, cur: duckdb.DuckDBPyConnection) -> int:
        """Read the rows stored since the last call; returns how many arrived. Row ids only
        grow: the store appends and never deletes io rows."""
        wm = self._next_rowid
        if wm == 0:
            pending, top = cur.execute("SELECT count(*), max(rowid) FROM io").fetchall()[0]
            if pending > self.max_rows:
                # More than fits (a long recording opened for replay): skip the oldest rows.
                # Rows skipped may still be issued later than the ones kept, so the cache
                # vouches only for times after the last of them.
                wm = top + 1 - self.max_rows
                skipped = cur.execute(
                    f"SELECT max(issue_ns) FROM io WHERE rowid < {wm}").fetchall()[0][0]
                self._drop_before(int(skipped) + 1)
        select = _SELECT.format(bytes=weighted_bytes(cur))
        tbl = cur.sql(f"{select} WHERE rowid >= {wm}").to_arrow_table()
        if tbl.num_rows == 0:
            return 0
        top = pc.max(tbl.column(8)).as_py()
        self._next_rowid = top + 1
        new = self._columns(tbl)
        # A process's name: the least of its threads' names (they differ: thread pools name
        # their threads), as the SQL path picks it, so both show the same one.
        for tgid, comm in cur.execute(
                f"SELECT coalesce(tgid, 0), min(comm) FROM io WHERE rowid >= {wm} "
                f"AND rowid <= {top} GROUP BY 1").fetchall():
            old = self.comm.get(int(tgid))
            self.comm[int(tgid)] = min(old, comm or "") if old is not None else comm or ""
        self._merge(new)
        self._trim()
        return len(new["issue"])

    def _columns(self, tbl: pa.Table) -> dict[str, np.ndarray]:
        def arr(i: int, dtype) -> np.ndarray:
            return tbl.column(i).to_numpy(zero_copy_only=False).astype(dtype, copy=False)

        out = {k: arr(i, t) for i, (k, t) in enumerate(_DTYPES.items()) if i < 6}
        # Devices and processes as codes: comparing and counting small ints, not strings.
        enc = pc.dictionary_encode(tbl.column(6).combine_chunks())
        remap = np.array([self._code(self._dev_code, self.dev_names, name)
                          for name in enc.dictionary.to_pylist()] + [-1], np.int16)
        idx = enc.indices.fill_null(len(enc.dictionary)).to_numpy(zero_copy_only=False)
        out["dev"] = remap[idx]
        tgid = arr(7, np.int64)
        uniq, inverse = np.unique(tgid, return_inverse=True)
        remap = np.array([self._code(self._proc_code, self.tgids, int(t)) for t in uniq],
                         np.int32)
        out["proc"] = remap[inverse.reshape(-1)]
        keep = out["issue"] >= self.lo_ns
        order = np.argsort(out["issue"][keep], kind="stable")
        return {k: v[keep][order] for k, v in out.items()}

    @staticmethod
    def _code(codes: dict, values: list, value) -> int:
        if value not in codes:
            codes[value] = len(values)
            values.append(value)
        return codes[value]

    def _merge(self, new: dict[str, np.ndarray]) -> None:
        k = len(new["issue"])
        if k == 0:
            return
        self._reserve(k)
        a, n = self._a, self._n
        issue = self._cols["issue"]
        # Rows arrive in completion order, so a batch can reach back before the newest rows
        # held: only the tail from there is re-sorted.
        p = a + int(np.searchsorted(issue[a:n], new["issue"][0], side="right"))
        order = None
        if p < n:
            order = np.argsort(np.concatenate([issue[p:n], new["issue"]]), kind="stable")
        for name, col in self._cols.items():
            if order is None:
                col[n:n + k] = new[name]
            else:
                col[p:n + k] = np.concatenate([col[p:n], new[name]])[order]
        self._n = n + k
        p = min(p, n)
        layer, nbytes = self._cols["layer"][p:n + k], self._cols["bytes"][p:n + k]
        for lay, cum in self._cum.items():
            cum[p + 1:n + k + 1] = cum[p] + np.cumsum(np.where(layer == lay, nbytes, 0))
        self._update_islands(new)

    def _reserve(self, k: int) -> None:
        live = self._n - self._a
        cap = len(self._cols["issue"])
        if self._n + k <= cap:
            return
        # Grow by doubling up to a quarter above the row bound; from there, move the live
        # rows to the front (every so many refreshes, as trimming frees the front).
        limit = self.max_rows + self.max_rows // 4
        need = live + k
        if need <= cap and (need <= cap // 2 or cap >= limit):
            size = cap
        else:
            size = max(need, min(2 * cap, limit))
        for name, col in self._cols.items():
            fresh = np.empty(size, col.dtype) if size != cap else col
            fresh[:live] = col[self._a:self._n]
            self._cols[name] = fresh
        for lay, cum in self._cum.items():
            fresh = np.empty(size + 1, np.int64) if size != cap else cum
            fresh[:live + 1] = cum[self._a:self._n + 1]
            self._cum[lay] = fresh
        self._a, self._n = 0, live

    def _trim(self) -> None:
        if self._n == self._a:
            return
        issue = self.col("issue")
        if len(issue) > self.max_rows:
            self._drop_before(int(issue[len(issue) - self.max_rows]))

    def _drop_before(self, t: int) -> None:
        if t <= self.lo_ns:
            return
        self.lo_ns = t
        self._a += int(np.searchsorted(self.col("issue"), t, side="left"))
        for key, (isl_s, isl_e) in self._islands.items():
            j = int(np.searchsorted(isl_e, t, side="left"))
            self._islands[key] = (isl_s[j:], isl_e[j:])

    def slice(self, a: int, b: int, device: str | None = None,
              tgid: int | None = None) -> Rows:
        """Rows a..b (indices into the columns) that pass the filter."""
        return self._filter(Rows(*(self.col(k)[a:b] for k in _DTYPES)), device, tgid)

    def take(self, ranges: list[tuple[int, int]], device: str | None = None,
             tgid: int | None = None) -> Rows:
        """The rows of several index ranges, in order, that pass the filter."""
        if len(ranges) == 1:
            return self.slice(*ranges[0], device, tgid)
        idx = np.concatenate([np.arange(a, b) for a, b in ranges])
        return self._filter(Rows(*(self.col(k)[idx] for k in _DTYPES)), device, tgid)

    def _filter(self, rows: Rows, device: str | None, tgid: int | None) -> Rows:
        keep = None
        if device is not None:
            keep = rows.dev == self._dev_code.get(device, -2)
        if tgid is not None:
            by_pid = rows.proc == self._proc_code.get(tgid, -1)
            keep = by_pid if keep is None else keep & by_pid
        return rows if keep is None else rows.mask(keep)

    def rows(self, t0: int, t1: int, device: str | None = None,
             tgid: int | None = None) -> Rows:
        """Rows issued in [t0, t1) that pass the filter; t0 must be covered."""
        i0, i1 = np.searchsorted(self.col("issue"), [t0, t1], side="left")
        return self.slice(int(i0), int(i1), device, tgid)

    def layer_bytes(self, edges: np.ndarray) -> np.ndarray:
        """(layer, bin) bytes of the rows issued between consecutive edges."""
        at = self._a + np.searchsorted(self.col("issue"), edges, side="left")
        return np.vstack([np.diff(self._cum[lay][at])
                          for lay in range(len(schema.DEVICE_LAYERS))])

    def device_code(self, name: str) -> int:
        """The device's code in the dev column; one no row has when it never did I/O."""
        return self._dev_code.get(name, -2)

    def islands(self, device: str | None = None) -> tuple[np.ndarray, np.ndarray]:
        """Busy islands of the cached block rows, of one device or of all."""
        key = None if device is None else self._dev_code.get(device, -2)
        empty = np.empty(0, np.int64)
        return self._islands.get(key, (empty, empty))

    def _update_islands(self, new: dict[str, np.ndarray]) -> None:
        """Islands change only from the earliest start among the new rows on: keep those
        ending before it, rebuild the rest from the rows issued since (see
        intervals.busy_islands_ordered for why issue order suffices)."""
        block = new["layer"] == schema.LAYERS.index(schema.LAYER_BLOCK)
        if not block.any():
            return
        issue = self.col("issue")
        for key in [None, *np.unique(new["dev"][block]).tolist()]:
            mine = block if key is None else block & (new["dev"] == key)
            earliest = int(new["start"][mine].min())
            isl_s, isl_e = self._islands.get(key, (np.empty(0, np.int64),) * 2)
            j = int(np.searchsorted(isl_e, earliest, side="left"))
            since = min(int(isl_s[j]), earliest) if j < len(isl_s) else earliest
            q = int(np.searchsorted(issue, since, side="left"))
            sel = self.col("layer")[q:] == schema.LAYERS.index(schema.LAYER_BLOCK)
            if key is not None:
                sel &= self.col("dev")[q:] == key
            ns, ne = busy_islands_ordered(self.col("start")[q:][sel],
                                          self.col("complete")[q:][sel])
            self._islands[key] = (np.concatenate([isl_s[:j], ns]),
                                  np.concatenate([isl_e[:j], ne]))
