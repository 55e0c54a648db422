"""The report's shape, as types: what `correlate.summarize` returns and every view reads.

The report is a public contract (`kvprof report --json`, docs/report.md): its JSON is these
dicts as they are, so they stay dicts, typed as TypedDicts: a type checker follows every key a
view reads, and tests/unit/test_report_schema.py checks real reports against these types key
for key, so they cannot drift from what is produced. Maps keyed by data (phases, devices,
caches, buckets) are plain `dict[str, ...]`; a phase's layer holds its operations (LayerOps)."""
# No `from __future__ import annotations`: TypedDict must see NotRequired itself to know
# which keys are optional (3.11 cannot look inside a postponed annotation).
import sys
from typing import Any, Literal, TypedDict

if sys.version_info >= (3, 11):
    from typing import NotRequired
else:  # pragma: no cover - Python 3.10
    from typing_extensions import NotRequired


# Names a view indexes the report by, as literals so a type checker follows the keys; they
# are schema.PHASES / DEVICE_LAYERS / LAYERS' own (kvprof/analysis/correlate.py asserts it).
MainOp = Literal["read", "write"]
DeviceLayer = Literal["block", "io_uring"]
Layer = Literal["block", "io_uring", "syscall", "tcp", "gds"]
MAIN_OPS: tuple[MainOp, ...] = ("read", "write")
DEVICE_LAYERS: tuple[DeviceLayer, ...] = ("block", "io_uring")
LAYERS: tuple[Layer, ...] = ("block", "io_uring", "syscall", "tcp", "gds")


class Quantiles(TypedDict):
    """schema.QUANTILES, in µs; None where nothing was measured."""
    p50: float | None
    p90: float | None
    p99: float | None
    p999: float | None


class OpStats(TypedDict):
    """One layer's requests of one operation in a phase (the event tier)."""
    bytes: int
    ios: int
    bandwidth_bytes_per_s: float
    iops: float
    latency_us: Quantiles
    queue_us: Quantiles
    device_us: Quantiles
    size_hist: dict[str, int]  # bucket low bound in bytes -> requests
    latency_hist_us: dict[str, int]
    # Device layers counted by the aggregate tier (--no-events, sampled): the log2 slot
    # the 99th percentile of service time falls below.
    p99_below_us: NotRequired[float | None]


class LayerOps(TypedDict):
    read: OpStats
    write: OpStats
    other: NotRequired[OpStats]
    flush: NotRequired[OpStats]
    discard: NotRequired[OpStats]


class DeviceIdle(TypedDict):
    time_idle_pct: float | None
    # The mean number of requests in flight while the device was busy (Little's law: the
    # phase's block requests' summed device time over its busy time); None without either.
    inflight_mean: float | None
    capacity_idle_pct: NotRequired[float | None]


class OpCapacity(TypedDict):
    pattern: str
    measure: str
    achieved: float
    capability: float
    used_pct: float


class Capacity(TypedDict):
    used_pct: float
    by_op: dict[str, OpCapacity]
    layer: str


class BlockLayer(LayerOps):
    time_idle_pct: float | None
    inflight_mean: float | None  # as DeviceIdle's, on all traced devices together
    devices: dict[str, DeviceIdle]
    capacity_idle_pct: float | None
    capacity: Capacity | None


class SyscallLayer(LayerOps):
    page_cache_hit_pct: float | None


class GdsLayer(LayerOps):
    probes: dict[str, int]


class CacheOp(TypedDict):
    ios: int
    bytes: int
    bandwidth_bytes_per_s: float
    direct_bytes: int
    busy_s: float  # wall time with at least one of these calls in flight
    device_bytes: NotRequired[int]  # reads: what the calling threads read from the device
    page_cache_hit_pct: NotRequired[float | None]  # reads


class CacheStats(TypedDict):
    read: CacheOp
    write: CacheOp


class Count(TypedDict):
    ios: int
    bytes: int


class Writeback(TypedDict):
    ios: int
    bytes: int
    elsewhere_bytes: int
    caches: dict[str, Count]


class PhaseEngine(TypedDict):
    prefill_tokens: float | None
    decode_tokens: float | None
    tokens_per_s: float | None
    # Prompt tokens the engine's KV connector supplied in the phase's steps, where a hook
    # counted them per step (None: no source did).
    offload_hit_tokens: float | None


class PhaseStats(TypedDict):
    time_s: float
    time_share_pct: float
    windows: int
    block: BlockLayer
    io_uring: LayerOps
    syscall: SyscallLayer
    tcp: LayerOps
    gds: GdsLayer
    caches: dict[str, CacheStats]
    writeback: Writeback
    engine: PhaseEngine


class Engine(TypedDict):
    ttft_s: float | None
    itl_s: float | None
    prefix_cache_hit_pct: float | None
    prompt_tokens: float | None
    generation_tokens: float | None
    throughput_tokens_per_s: float | None


class Offload(TypedDict):
    """What the engine says its KV offload did beside what the KV caches' files did (the
    caches' read and write calls, all phases of the span)."""
    hit_tokens: float | None  # prompt tokens the connector supplied (the engine's count)
    # Of the phases' offload_hit_tokens, those that could be in another phase (scraped
    # counters, shared by time: an interval's over more than one phase); 0 from the plugin.
    hit_tokens_unsure: float | None
    query_tokens: float | None  # prompt tokens it was asked for
    bytes_per_token: float | None  # the engine's KV bytes a token, where it says
    # What it says it read from its storage tiers (their count, else its hits' bytes) and
    # stored to them, and the time its own loads and stores took.
    claimed_read_bytes: float | None
    claimed_written_bytes: float | None
    engine_load_time_s: float | None
    engine_store_time_s: float | None
    files_read_bytes: int
    files_written_bytes: int
    device_read_bytes: int  # what the reading threads took from the device meanwhile
    page_cache_hit_pct: float | None  # of files_read_bytes, the share not from the device
    files_read_busy_s: float  # wall time with a read of a KV cache file in flight
    ttft_total_s: float | None  # the requests' times to first token, summed (the engine's)
    load_wait_pct: float | None  # files_read_busy_s of ttft_total_s
    caches: list[str]


class ExactOp(TypedDict):
    ios: int
    bytes: int
    bandwidth_bytes_per_s: float
    iops: float
    mean_queue_us: float | None
    mean_service_us: float | None
    service_us_below: Quantiles
    size_hist: dict[str, int]
    queue_hist_ns: dict[str, int]
    service_hist_ns: dict[str, int]


class ExactDevice(TypedDict):
    busy_s: float
    time_idle_pct: float | None
    inflight_mean: float | None  # summed service time of its block requests over busy_s


class ExactPhase(TypedDict):
    block: dict[str, ExactOp]
    io_uring: dict[str, ExactOp]
    devices: dict[str, ExactDevice]


class Boundary(TypedDict):
    slot_ns: int
    settle_s: float | None
    ios: int
    by_phase: dict[str, int]


class Exact(TypedDict):
    phases: dict[str, ExactPhase]
    totals: dict[str, dict[str, Count]]
    phase_rule: str
    boundary: Boundary | None


class Sampling(TypedDict):
    max_one_in: int
    uniform: bool
    percentiles: str


class Process(TypedDict):
    tgid: int
    comm: str
    role: str | None
    cmdline: str


class WindowSource(TypedDict):
    """Who made a span's phase windows: a source (`hook`, `metrics`, `nvml`, `manual`, ...)
    and engine as the phase table stores them, and how many windows."""
    source: str
    engine: str
    windows: int


class Session(TypedDict):
    id: str
    host: str
    kernel: str
    kvprof_version: str
    start_wall_ns: int
    duration_s: float
    status: str
    devices: list[str]
    device_limits: dict[str, dict[str, int]]
    lost_events: int
    lost_by_reason: dict[str, int]
    phase_sources: list[str]  # the sources the recording listened with
    window_sources: list["WindowSource"]  # who made the windows, as stored
    source_problems: dict[str, dict[str, int]]
    source_pace: dict[str, dict[str, float]]  # scrape sources: scrape_interval_s, response_ms
    writeback_unattributed: Count
    device_events: bool
    event_sampling: Sampling | None
    # io_uring requests to raw block devices opened O_DIRECT that the io_uring layer left to
    # the block layer (the default; absent where it traced them, or before kvprof did this).
    io_uring_on_block: NotRequired[int]
    processes: list[Process]
    mixed: str


class Summary(TypedDict):
    """`correlate.summarize`: one span of one session, one view."""
    session: Session
    phases: dict[str, PhaseStats]
    engine: Engine
    offload: Offload
    exact: Exact | None


class FindingDict(TypedDict):
    rule: str
    phase: str | None
    text: str
    figures: dict[str, Any]  # report path -> the value the finding rests on


class Report(Summary):
    """`kvprof report --json`: the summary and its findings."""
    findings: list[FindingDict]
