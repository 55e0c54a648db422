"""The tables every part of kvprof agrees on, defined once.

DuckDB tables are created from these Arrow schemas and Parquet exports carry exactly these
columns, so a column is added here or nowhere.
"""
from __future__ import annotations

import pyarrow as pa

# Layers that produce I/O rows.
LAYER_BLOCK = "block"
LAYER_IO_URING = "io_uring"
LAYERS = (LAYER_BLOCK, LAYER_IO_URING)

# Operation codes shared with probes/kvprof.h (KVPROF_OP_*). Index = code.
OPS = ("other", "read", "write", "flush", "discard")

# Request flag bits shared with probes/kvprof.h (KVPROF_FL_*), decoded from the kernel's rwbs.
FLAG_SYNC = 1 << 0
FLAG_FUA = 1 << 1
FLAG_PREFLUSH = 1 << 2
FLAG_META = 1 << 3
FLAG_RAHEAD = 1 << 4

PHASES = ("prefill", "decode", "mixed", "idle")
# Where a phase window came from, most exact first. Marks sent by an engine hook and marks
# sent by hand both name the exact moment, so they rank together above scraped metrics.
SOURCE_RANK = {"hook": 3, "manual": 3, "metrics": 2, "nvml": 1}

IO = pa.schema(
    [
        ("layer", pa.string()),
        ("op", pa.string()),
        ("flags", pa.uint16()),
        # CLOCK_MONOTONIC ns. insert_ns is 0 when the request skipped the scheduler queue.
        ("insert_ns", pa.int64()),
        ("issue_ns", pa.int64()),
        ("complete_ns", pa.int64()),
        # Block layer only (NULL for io_uring, whose requests name a file, not a device).
        ("dev_major", pa.uint32()),
        ("dev_minor", pa.uint32()),
        ("dev_name", pa.string()),
        ("sector", pa.uint64()),
        ("bytes", pa.uint64()),
        ("pid", pa.uint32()),
        ("tgid", pa.uint32()),
        ("comm", pa.string()),
        ("cgroup_id", pa.uint64()),
        # Block: the completion's error code; io_uring: the negative result, else 0.
        ("error", pa.int32()),
        # io_uring only: IORING_OP_* and the ring (struct io_ring_ctx address) it came from.
        ("uring_opcode", pa.uint8()),
        ("uring_ctx", pa.uint64()),
    ]
)

PHASE = pa.schema(
    [
        ("start_ns", pa.int64()),
        ("end_ns", pa.int64()),
        ("phase", pa.string()),
        ("source", pa.string()),
        ("engine", pa.string()),
        ("gpu", pa.int32()),
        ("prefill_tokens", pa.int64()),
        ("decode_tokens", pa.int64()),
        ("confidence", pa.float64()),
    ]
)

SESSION = pa.schema(
    [
        ("session_id", pa.string()),
        ("host", pa.string()),
        ("kernel", pa.string()),
        ("kvprof_version", pa.string()),
        ("bcc_version", pa.string()),
        ("start_wall_ns", pa.int64()),
        ("start_ns", pa.int64()),
        ("end_ns", pa.int64()),
        # wall-clock ns = monotonic ns + clock_offset_ns
        ("clock_offset_ns", pa.int64()),
        # JSON: [{"name", "major", "minor"}] of the traced devices (all seen when unfiltered).
        ("devices", pa.string()),
        # JSON: the filters and phase sources the session was recorded with.
        ("config", pa.string()),
        # JSON: {reason: count} of events lost; the reasons are documented in the README.
        ("lost", pa.string()),
        ("status", pa.string()),
    ]
)

TABLES = {"io": IO, "phase": PHASE, "session": SESSION}

_DUCK = {
    pa.string(): "VARCHAR",
    pa.uint8(): "UTINYINT",
    pa.uint16(): "USMALLINT",
    pa.uint32(): "UINTEGER",
    pa.uint64(): "UBIGINT",
    pa.int32(): "INTEGER",
    pa.int64(): "BIGINT",
    pa.float64(): "DOUBLE",
}


def duckdb_ddl(name: str) -> str:
    cols = ", ".join(f'"{f.name}" {_DUCK[f.type]}' for f in TABLES[name])
    return f"CREATE TABLE IF NOT EXISTS {name} ({cols})"
