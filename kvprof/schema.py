"""The tables every part of kvprof agrees on, defined once.

DuckDB tables are created from these Arrow schemas and Parquet exports carry exactly these
columns, so a column is added here or nowhere.
"""
from __future__ import annotations

import numpy as np
import pyarrow as pa

from kvprof import layers
from kvprof.phases.registry import PHASE_SOURCES

# Layers that produce I/O rows, by name; each is described once in kvprof/layers.py (probe,
# tracepoints, codes). Index = code.
LAYER_BLOCK = layers.BLOCK.name
LAYER_IO_URING = layers.IO_URING.name
# The file syscalls of the traced processes (the syscall layer): what the application
# asked of its files, page cache hits and buffered writes included.
LAYER_SYSCALL = layers.SYSCALL.name
# TCP bytes the traced processes send and receive: network-backed KV stores.
LAYER_TCP = layers.TCP.name
# cuFile (GPUDirect Storage) calls at libcufile's USDT probes: DMA or compat-mode POSIX.
LAYER_GDS = layers.GDS.name
LAYERS = layers.NAMES
# The layers a device sees once each byte: the others repeat (io_uring) or precede (syscall)
# block requests.
DEVICE_LAYERS = layers.DEVICE_NAMES
assert LAYERS[:len(DEVICE_LAYERS)] == DEVICE_LAYERS, "layer codes index both"

# Operation codes shared with kvprof/layers/kvprof.h (KVPROF_OP_*). Index = code.
OPS = ("other", "read", "write", "flush", "discard")

# Request flag bits shared with the probes (KVPROF_FL_*), decoded from the kernel's rwbs.
FLAG_SYNC = 1 << 0
FLAG_FUA = 1 << 1
FLAG_PREFLUSH = 1 << 2
FLAG_META = 1 << 3
FLAG_RAHEAD = 1 << 4
# syscall layer: the file was opened with O_DIRECT (no page cache).
FLAG_DIRECT = 1 << 5

# Syscall codes shared with kvprof/layers/syscall/probe.bpf.c (SYS_*). Index = code.
SYSCALLS = ("read", "pread64", "readv", "preadv", "preadv2", "write", "pwrite64", "writev",
            "pwritev", "pwritev2", "fsync", "fdatasync")

PHASES = ("prefill", "decode", "mixed", "idle")
# The latency quantiles every summary reports (name, q).
QUANTILES = (("p50", 0.5), ("p90", 0.9), ("p99", 0.99), ("p999", 0.999))

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
        # syscall layer only: which syscall (gds: which cufio probe), the file's path as
        # opened (tcp: the peer, address:port), bytes asked for (`bytes` is what the call
        # did). Absent from sessions recorded before the layer.
        ("syscall", pa.string()),
        ("path", pa.string()),
        ("bytes_asked", pa.uint64()),
        # syscall layer: the KV cache the file belongs to (kvprof/caches.py), by its path.
        ("cache", pa.string()),
        # syscall: the file's inode, which names it in the writeback table.
        ("inode", pa.uint64()),
        # The device layers: this row stands for that many requests (the event tier kept 1
        # in sample_weight; see EVENT_SAMPLING); 1 elsewhere. Absent from older sessions.
        ("sample_weight", pa.uint32()),
        # syscall reads: the bytes the call put into the page cache (what it missed, and the
        # readahead it started), counted as it happened in the calling thread; NULL for other
        # rows, and where the kernel lacks the tracepoint. Absent from older sessions.
        ("fetched_bytes", pa.uint64()),
        # syscall reads and writes: the file offset of the call's first byte, as the call
        # named it (pread64, pwritev ...) or, for read/write/readv/writev, the open file's
        # position followed from its open on (each call's bytes after the one before, as
        # the kernel moves it without an lseek; capture/ebpf.py). What a replay issues on
        # another filesystem. NULL elsewhere and in older sessions.
        ("file_offset", pa.int64()),
    ]
)

# The event tier's sampling of the device layers: from ts_ns on, 1 in 2^shift block and
# io_uring requests became an io row (0: every one). The aggregate tier counts them all.
EVENT_SAMPLING = pa.schema(
    [
        ("ts_ns", pa.int64()),
        ("shift", pa.uint8()),
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
        # Marks: who sent the window, as the kernel vouched (SCM_CREDENTIALS); NULL for
        # windows of other sources.
        ("sender_pid", pa.int64()),
        ("sender_uid", pa.int64()),
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
        # While recording (and after a kill): the last flush, which every stored row precedes.
        ("end_ns", pa.int64()),
        # wall-clock ns = monotonic ns + clock_offset_ns
        ("clock_offset_ns", pa.int64()),
        # JSON: [{"name", "major", "minor"}] of the traced devices (all seen when unfiltered).
        ("devices", pa.string()),
        # JSON: the filters and phase sources the session was recorded with.
        ("config", pa.string()),
        # JSON: {reason: count} of events lost; the reasons are documented in docs/report.md.
        ("lost", pa.string()),
        # JSON: [{"source", "problems": {kind: count}, "last_error"}] per phase source; a
        # metrics source adds "scrape_interval_s" (its slowest pace) and "response_ms".
        ("sources", pa.string()),
        ("status", pa.string()),
    ]
)

GPU = pa.schema(
    [
        # Session clock: CLOCK_MONOTONIC ns taken when the sample was read.
        ("ts_ns", pa.int64()),
        ("gpu", pa.int32()),
        ("uuid", pa.string()),
        # Percentages 0..100; NULL where the GPU does not support the field.
        ("gpu_util_pct", pa.float64()),
        ("mem_util_pct", pa.float64()),
        ("sm_active_pct", pa.float64()),
        ("tensor_active_pct", pa.float64()),
        ("dram_bw_util_pct", pa.float64()),
        ("power_w", pa.float64()),
        ("pcie_rx_bytes_per_s", pa.float64()),
        ("pcie_tx_bytes_per_s", pa.float64()),
        # JSON {pid: sm_util_pct} from per-process utilisation (host PIDs, as eBPF sees them).
        ("process_util", pa.string()),
    ]
)

# Bios flush threads submitted while writing back an inode (the syscall layer with the
# block layer): how the device's writeback splits by file, since one block request can
# carry several files' pages.
WRITEBACK = pa.schema(
    [
        ("ts_ns", pa.int64()),
        ("dev_major", pa.uint32()),
        ("dev_minor", pa.uint32()),
        ("dev_name", pa.string()),
        ("sector", pa.uint64()),
        ("bytes", pa.uint64()),
        ("inode", pa.uint64()),
        ("pid", pa.uint32()),
        ("comm", pa.string()),
    ]
)

# The processes that did I/O: what they are in the serving stack (kvprof/roles.py), read
# from /proc when each first did I/O.
PROCESS = pa.schema(
    [
        ("tgid", pa.uint32()),
        ("first_ns", pa.int64()),
        ("comm", pa.string()),
        ("cmdline", pa.string()),
        ("role", pa.string()),  # NULL: not a known role
    ]
)

# Engine KV-cache events (vLLM/SGLang ZMQ KV events): what the engine says it stored or removed.
KV_EVENT = pa.schema(
    [
        ("ts_ns", pa.int64()),
        ("engine", pa.string()),
        ("kind", pa.string()),  # stored, removed, all_cleared
        ("medium", pa.string()),  # GPU, CPU, STORAGE, or NULL when the engine does not say
        ("blocks", pa.int32()),
        ("block_size", pa.int32()),  # tokens per block, when known
        ("seq", pa.int64()),
    ]
)

# Engine-side counters scraped beside the phases (e.g. vllm:kv_offload_* bytes), so reports can
# set what the engine claims next to what the kernel saw. One row per sample and series.
ENGINE_METRIC = pa.schema(
    [
        ("ts_ns", pa.int64()),
        ("engine", pa.string()),
        ("name", pa.string()),
        ("labels", pa.string()),  # JSON object
        ("value", pa.float64()),
    ]
)



def _merged(parts) -> dict:
    """Figure -> the tuples of every source that gives it, in PHASE_SOURCES order."""
    out: dict = {}
    for part in parts:
        for figure, entries in part.items():
            out[figure] = out.get(figure, ()) + tuple(entries)
    return out


# Where a phase window came from (the phase table's `source`) -> how exact it is; where
# windows overlap, correlate keeps the most exact.
SOURCE_RANK = {s.label: s.rank for s in PHASE_SOURCES if s.label and s.rank is not None}
# The engines' own serving figures, from counters the metrics sources also keep in
# engine_metric (only their _sum/_count, not the buckets). Figure -> (numerator, denominator)
# series per engine, the first pair a session has is used: a mean is delta sum / delta count,
# a hit share delta hits / delta queries, over the span asked for.
ENGINE_MEANS = _merged(s.means for s in PHASE_SOURCES)


def _by_engine(counts: str) -> dict[str, tuple[tuple[str, ...], ...]]:
    """Figure -> per engine, its counters of that figure, most exact source first: a
    session's figure is, per engine, that of the first of its series it has (an engine's
    plugin and its scrape count the same tokens)."""
    figures = dict.fromkeys(f for s in PHASE_SOURCES for f in getattr(s, counts))
    return {figure: tuple(
        tuple(n for s in PHASE_SOURCES if (s.engine or s.kind) == engine
              for n in getattr(s, counts).get(figure, ()))
        for engine in dict.fromkeys(s.engine or s.kind for s in PHASE_SOURCES
                                    if figure in getattr(s, counts)))
        for figure in figures}


# Token counters (the session's tokens, and generated tokens a second: its throughput), and
# what the engines say of their KV offload (tokens the connector supplied, was asked for).
TOKENS_BY_ENGINE = _by_engine("tokens")
OFFLOAD_BY_ENGINE = _by_engine("offload")


def _series(s) -> list[str]:
    return [*(n for pairs in s.means.values() for pair in pairs for n in pair),
            *(n for names in s.tokens.values() for n in names),
            *(n for names in s.offload.values() for n in names)]


# What engines say of their KV cache's size, for its bytes a token: vLLM's info series (its
# labels), SGLang's pools' memory in GiB and their tokens (gauges).
KV_SIZE_SERIES = ("vllm:cache_config_info", "sglang:kv_cache_memory_usage_gb",
                  "sglang:max_total_num_tokens")
ENGINE_SERIES = frozenset([*(n for s in PHASE_SOURCES for n in _series(s)),
                           *KV_SIZE_SERIES])
# The series a window on the marker socket may carry (`counters`): those of the sources
# whose windows come there (no thread of their own).
MARK_SERIES = frozenset(n for s in PHASE_SOURCES if s.source is None for n in _series(s))

# The aggregate tier (kvprof.h, capture/aggregate.py, kvprof/analysis/fold.py): every
# block and io_uring request counted in the kernel, per completion second, phase, layer, op
# and device, whatever the event tier kept. The phase is that of the window holding the
# request's issue time (fold.flatten, as for events), given per 4 ms issue slot; `boundary`
# rows are slots a window edge cut between their first and last issue, counted in the phase
# that held most of that span. Histograms are log2: slot 0 holds the value 0, slot s >= 1
# holds [2^(s-1), 2^s), the last slot also everything above.
AGG_SLOTS = 40  # KVPROF_AGG_SLOTS
SLOT_NS = 4_000_000  # KVPROF_SLOT_NS, the issue slot: a divisor of the second
# What capture/aggregate.py makes of the kernel's map entries, and the recorder folds
# (kvprof/analysis/fold.py) into io_agg and device_busy rows. One aggregate slot row:
AGG_ROW = np.dtype([("slot", "<u8"), ("sec", "<u4"), ("dev", "<u4"), ("layer", "u1"),
                    ("op", "u1"), ("ios", "<u8"), ("bytes", "<u8"), ("queue_ns", "<u8"),
                    ("service_ns", "<u8"), ("first", "<u8"), ("last", "<u8"),
                    ("size", "<u8", AGG_SLOTS), ("queue", "<u8", AGG_SLOTS),
                    ("service", "<u8", AGG_SLOTS)])
# Busy time of one slot. `run` 0: pieces within the slot, between first and last (ns after
# its start); n > 0: one stretch from the slot's start on for `ns`, over n slots. `sec`: the
# second it was accounted in (completion second, for AGG_ROW), which says when it may be
# folded for good.
BUSY_ROW = np.dtype([("slot", "<u8"), ("sec", "<u4"), ("dev", "<u4"), ("run", "<u4"),
                     ("ns", "<u8"), ("first", "<u8"), ("last", "<u8")])
IO_AGG = pa.schema(
    [
        ("ts_ns", pa.int64()),  # the second's start, CLOCK_MONOTONIC ns
        ("phase", pa.string()),
        ("layer", pa.string()),
        ("op", pa.string()),
        ("dev_major", pa.uint32()),  # block only
        ("dev_minor", pa.uint32()),
        ("dev_name", pa.string()),
        ("ios", pa.uint64()),
        ("bytes", pa.uint64()),
        ("queue_ns", pa.uint64()),  # insert -> issue, summed
        ("service_ns", pa.uint64()),  # issue -> completion (io_uring: submit -> completion)
        ("size_hist", pa.list_(pa.uint32())),  # bytes
        ("queue_hist", pa.list_(pa.uint32())),  # ns
        ("service_hist", pa.list_(pa.uint32())),  # ns
        ("boundary", pa.bool_()),  # a window edge lay within the slot's issue span
    ]
)

# Time each block device had a request in flight, per second and phase (the kernel's io_ticks
# view, counted in the kernel at every request start and completion, laid over the windows
# per slot by fold.py).
DEVICE_BUSY = pa.schema(
    [
        ("ts_ns", pa.int64()),
        ("phase", pa.string()),
        ("dev_major", pa.uint32()),
        ("dev_minor", pa.uint32()),
        ("dev_name", pa.string()),
        ("busy_ns", pa.uint64()),
    ]
)

# The layout of the tables above, written into every Parquet export (its key-value metadata
# `kvprof.schema_version`). Raised when a table or column is added; readers take older
# versions (missing tables empty, missing columns NULL).
SCHEMA_VERSION = 16

# Every session has these; the others came later and are absent from older recordings.
CORE_TABLES = ("io", "phase", "session")

# Windows still open at the last flush (a phase in progress), ending at that flush. Replaced
# on every flush and emptied when the recording ends, so live views and a session cut short
# by SIGKILL still see the phase that was running.
PHASE_OPEN = PHASE
# Likewise the aggregate tier's seconds still counting at the last flush (they move to
# io_agg and device_busy once settled, in the same transaction as the next flush).
IO_AGG_OPEN = IO_AGG
DEVICE_BUSY_OPEN = DEVICE_BUSY
# Each flush replaces these whole; a session's readers add them to their closed tables.
OPEN_TABLES = ("phase_open", "io_agg_open", "device_busy_open")

TABLES = {"io": IO, "phase": PHASE, "session": SESSION, "gpu": GPU, "kv_event": KV_EVENT,
          "engine_metric": ENGINE_METRIC, "phase_open": PHASE_OPEN, "writeback": WRITEBACK,
          "process": PROCESS, "io_agg": IO_AGG, "device_busy": DEVICE_BUSY,
          "event_sampling": EVENT_SAMPLING, "io_agg_open": IO_AGG_OPEN,
          "device_busy_open": DEVICE_BUSY_OPEN}

_DUCK = {
    pa.string(): "VARCHAR",
    pa.uint8(): "UTINYINT",
    pa.uint16(): "USMALLINT",
    pa.uint32(): "UINTEGER",
    pa.uint64(): "UBIGINT",
    pa.int32(): "INTEGER",
    pa.int64(): "BIGINT",
    pa.float64(): "DOUBLE",
    pa.list_(pa.uint32()): "UINTEGER[]",
    pa.bool_(): "BOOLEAN",
}


def duck_type(table: str, column: str) -> str:
    return _DUCK[TABLES[table].field(column).type]


def duckdb_ddl(name: str) -> str:
    cols = ", ".join(f'"{f.name}" {_DUCK[f.type]}' for f in TABLES[name])
    return f"CREATE TABLE IF NOT EXISTS {name} ({cols})"
