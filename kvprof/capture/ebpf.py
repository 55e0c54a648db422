"""Load the probes, drain the ring buffer on a timer, hand out Arrow batches of the io table."""
from __future__ import annotations

import ctypes
import functools
import os
import re
import struct
import threading
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute  # noqa: F401 - casts need it: loaded here, not in the first flush

from kvprof import caches, schema
from kvprof import layers as layer_table
from kvprof.capture.aggregate import CODES as AGG_CODES
from kvprof.capture.aggregate import LAYOUTS as AGG_LAYOUTS
from kvprof.capture.aggregate import AggregateReader
from kvprof.capture.btf import layout_defines
from kvprof.capture.files import CODES as FILE_CODES
from kvprof.capture.files import LAYOUTS as FILE_LAYOUTS
from kvprof.capture.files import OPEN_DTYPE, FileTable, all_tgids
from kvprof.capture.gds import NAMES as GDS_PROBES
from kvprof.capture.gds import find_cufile, usdt_contexts
from kvprof.capture.layout import Code, Struct, check_codes, check_structs, int_defines
from kvprof.capture.procs import ProcessTable
from kvprof.capture.ringbuf import RingReader
from kvprof.capture.sampling import Sampler
from kvprof.devices import Device, by_number
from kvprof.errors import EX_UNAVAILABLE, KvprofError
from kvprof.privileges import SYS_BPF
from kvprof.system import tracefs

# struct kvprof_io in kvprof/layers/kvprof.h, as numpy reads it (checked at load: LAYOUTS).
EVENT_DTYPE = np.dtype(
    [
        ("insert_ns", "<u8"),
        ("issue_ns", "<u8"),
        ("complete_ns", "<u8"),
        ("sector", "<u8"),
        ("cgroup_id", "<u8"),
        ("ctx", "<u8"),
        ("bytes", "<u4"),
        ("dev", "<u4"),
        ("pid", "<u4"),
        ("tgid", "<u4"),
        ("error", "<i4"),
        ("flags", "<u2"),
        ("op", "u1"),
        ("layer", "u1"),
        ("opcode", "u1"),
        ("sample_shift", "u1"),
        ("pad", "V2"),
        ("asked", "<u4"),
        ("comm", "S16"),
    ]
)
BATCH = 32  # KVPROF_BATCH
# struct kvprof_batch: what the event ring holds, a batch of records per entry.
BATCH_DTYPE = np.dtype([("n", "<u4"), ("in_use", "<u4"), ("pad", "<u8"),
                        ("rec", EVENT_DTYPE, (BATCH,))])

HEADER = layer_table.HEADER
# The probes' library (kvprof/layers/lib/), in the order each needs the ones before it.
LIBRARY = ("task.h", "ring.h", "aggregate.h", "inflight.h", "sampling.h", "fields.h")
_LOCAL_INCLUDE = re.compile(r'^#include "[^"]+"\n', re.M)
# The loss counters: their index macro in kvprof/layers/kvprof.h, its value, the name reported.
COUNTERS = (("KVPROF_LOST_RINGBUF", 0, "ringbuf_reserve_failed"),
            ("KVPROF_LOST_BLOCK_UNMATCHED", 1, "block_unmatched_completion"),
            ("KVPROF_LOST_BLOCK_NOT_SEEN", 2, "block_completion_not_seen"),
            ("KVPROF_LOST_URING_NOT_SEEN", 3, "io_uring_completion_not_seen"),
            ("KVPROF_LOST_OPEN_RINGBUF", 4, "syscall_open_ring_full"),
            ("KVPROF_LOST_AGG_FULL", 5, "aggregate_map_full"),
            ("KVPROF_LOST_INFLIGHT_FULL", 6, "inflight_table_full"),
            ("KVPROF_LOST_URING_SKIPPED", 9, "io_uring_skipped_not_raw"))
COUNTER_NAMES = {idx: name for _, idx, name in COUNTERS}
DEVICE_STARTED = 7  # KVPROF_DEVICE_STARTED: not a loss, the sampling's rate offered
# KVPROF_URING_ON_BLOCK: not a loss either, io_uring requests to raw block devices (O_DIRECT)
# left to the block layer (kvprof/layers/io_uring/probe.bpf.c).
URING_ON_BLOCK = 8
# Requests still in flight at stop, by the layer that held them: never seen completing. (A
# block request the kernel completed without tracing it and then started again is counted
# apart, by the probe: block_completion_not_seen, in the exact tier all the same.)
NOT_SEEN = {"block": "block_in_flight_at_stop", "io_uring": "io_uring_completion_not_seen",
            "syscall": "syscall_completion_not_seen"}
# The `layer` byte of struct kvprof_io (KVPROF_LAYER_*).
LAYER_BLOCK = layer_table.BLOCK.code
LAYER_URING = layer_table.IO_URING.code
LAYER_SYSCALL = layer_table.SYSCALL.code
LAYER_TCP = layer_table.TCP.code
LAYER_GDS = layer_table.GDS.code
LAYER_WRITEBACK = 7  # KVPROF_LAYER_WRITEBACK: writeback bios, not io rows
OP_READ = schema.OPS.index("read")
OP_WRITE = schema.OPS.index("write")
POS_NONE = np.uint64(0xFFFFFFFFFFFFFFFF)  # KVPROF_POS_NONE in kvprof/layers/syscall/probe.bpf.c
# The drain thread's sleep between drains: the shortest while events pour in, growing to the
# longest while they trickle. Every wake-up preempts the traced workload on a busy host, and a
# trickle fills the ring in minutes, not in a tenth of a second. The longest also bounds how
# late a row reaches the store, and how stale the sampler's rate can be.
DRAIN_INTERVAL_S = 0.02
DRAIN_IDLE_S = 0.1
# A drain is due, at the rate the last one saw, before the ring is this full.
DRAIN_AT_FILL = 1 / 8
# 16 MiB: about 170 k events, most of a second at 250 k events/s, so a pause of the Python
# side (a store flush holding the GIL) does not overflow the ring.
RINGBUF_PAGES = 4096


def probe_dir() -> Path:
    """Where the C is: the shared header, and each layer's folder with its probe."""
    return layer_table.DIR


@dataclass(frozen=True)
class CaptureFilter:
    devices: tuple[Device, ...] = ()
    tgids: tuple[int, ...] = ()
    cgroup_ids: tuple[int, ...] = ()


@dataclass(frozen=True)
class ProbeProgram:
    """The exact C text and compiler flags capture loads; `--ebpf` prints these."""

    text: str
    cflags: tuple[str, ...]


FILEMAP_FORMAT = "events/filemap/mm_filemap_add_to_page_cache/format"


def filemap_defines() -> list[str]:
    """The syscall layer's page-cache probe, where this kernel has the tracepoint (sized by
    the folio order where its tracepoint gives one, else a page an event); without it,
    none, and a read's device bytes are the block reads its thread issued during the call."""
    root = tracefs()
    try:
        text = (root / FILEMAP_FORMAT).read_text() if root else ""
    except OSError:
        text = ""
    if not text:
        return []
    return ["-DKVPROF_FILEMAP", *(["-DKVPROF_FILEMAP_ORDER"] if " order;" in text else [])]


def raw_to_block(layers: tuple[str, ...], uring_raw: bool) -> bool:
    """Whether the io_uring layer leaves requests to raw block devices opened O_DIRECT to the
    block layer (which carries them one for one): both traced, and `uring_raw` not asked."""
    return "io_uring" in layers and "block" in layers and not uring_raw


def build_program(layers: tuple[str, ...], filters: CaptureFilter,
                  ringbuf_pages: int = RINGBUF_PAGES, device_events: bool = True,
                  uring_raw: bool = False) -> ProbeProgram:
    """`uring_raw`: the io_uring layer also traces requests to raw block devices opened
    O_DIRECT (by default it leaves them to the block layer: raw_to_block)."""
    d = probe_dir()
    # bcc rewrites map calls (events.ringbuf_output, ...) only in the main text, not in
    # #included files, so the shared header and the library are placed in front of the
    # probes, in this order, and their own #include "..." lines dropped.
    files = [d / HEADER, *(d / "lib" / h for h in LIBRARY),
             *(d / layer / layer_table.PROBE for layer in layers)]
    text = "\n".join(_LOCAL_INCLUDE.sub("", f.read_text()) for f in files)
    cflags = [f"-DKVPROF_RINGBUF_PAGES={int(ringbuf_pages)}"]
    cflags += [f"-DKVPROF_LAYER_{x.name.upper()}={x.code}" for x in layer_table.LAYERS]
    cflags += [f"-D{name}={value}" for name, value in layout_defines(layers).items()]
    if not device_events:
        cflags.append("-DKVPROF_NO_DEVICE_EVENTS")
    if not raw_to_block(layers, uring_raw):
        cflags.append("-DKVPROF_URING_ALL")
    if "syscall" in layers:
        cflags += filemap_defines()
    if {"syscall", "tcp", "gds"} & set(layers):
        cflags.append(f"-DKVPROF_SELF_TGID={os.getpid()}")
        if "block" in layers:
            cflags.append("-DKVPROF_WRITEBACK")
    if filters.devices:
        cflags.append("-DKVPROF_FILTER_DEV")
    if filters.tgids:
        cflags.append("-DKVPROF_FILTER_TGID")
    if filters.cgroup_ids:
        cflags.append("-DKVPROF_FILTER_CGROUP")
    return ProbeProgram(text, tuple(cflags))


class Capture:
    """Attached probes plus a drain thread. Batches accumulate until `take()`.

    Built in four steps: the program (the C text and its flags, its codes checked against
    ours), loaded (bcc compiles it and attaches every probe; its structs checked against our
    dtypes, the filters filled), the readers of its maps, and, at start(), the drain thread."""

    def __init__(self, layers: tuple[str, ...], filters: CaptureFilter,
                 ringbuf_pages: int = RINGBUF_PAGES,
                 cache_rules: tuple[caches.Rule, ...] = caches.BUILTIN,
                 device_events: bool = True, event_rate: int = 0, uring_raw: bool = False):
        """`event_rate`: device-layer rows a second the event tier keeps before it samples
        (0: every one; kvprof/capture/sampling.py). `uring_raw`: see build_program."""
        from kvprof.capture.bccload import load_bcc

        self.bcc = load_bcc()
        self.layers = layers
        self.filters = filters
        self.raw_to_block = raw_to_block(layers, uring_raw)
        self.program = build_program(layers, filters, ringbuf_pages, device_events, uring_raw)
        check_codes(int_defines(self.program.text, self.program.cflags), _codes(layers),
                    CODE_FAMILIES)
        self._filemap = "-DKVPROF_FILEMAP" in self.program.cflags
        self._dev_names: dict[int, Device] = {d.kernel_dev: d for d in filters.devices}
        self._load()
        self._open_readers(cache_rules)
        # Decided in the drain thread from the kernel's count: a burst is sampled within a
        # quarter second, however late the recorder's flush is.
        self.sampler = Sampler(event_rate if device_events else 0, self.set_sampling)
        self._sampling: deque[pa.RecordBatch] = deque()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._drain_loop, name="kvprof-drain", daemon=True)

    def _load(self) -> None:
        """The program compiled, loaded and attached (bcc does all three), its structs held to
        our dtypes and its filters filled; nothing attached is left behind on failure."""
        usdt: list = []
        if "gds" in self.layers:
            lib = find_cufile()
            if lib is None:
                raise KvprofError("--layer gds: libcufile not found (set KVPROF_CUFILE to "
                                  "its path)", EX_UNAVAILABLE)
            usdt, self.gds_missing = usdt_contexts(self.bcc, lib)
            if not usdt:
                raise KvprofError(f"--layer gds: {lib} has none of the cufio USDT probes",
                                  EX_UNAVAILABLE)
        try:
            bpf = self.bcc.BPF(text=self.program.text.encode(),
                               cflags=list(self.program.cflags), usdt_contexts=usdt)
        except Exception as e:  # noqa: BLE001 - bcc raises bare Exception on compile/load
            raise KvprofError(f"loading the BPF probes failed: {e}", EX_UNAVAILABLE) from None
        try:
            check_structs(bpf, _structs(self.layers))
        except KvprofError:
            bpf.cleanup()
            raise
        self.bpf = bpf
        self._fill_filters()
        _release_compiler_memory()

    def _open_readers(self, cache_rules: tuple[caches.Rule, ...]) -> None:
        """What reads the loaded program's maps: the event ring and its flush, the opens ring
        and the file table (syscall layer), the aggregate tier (device layers)."""
        # deque: append (drain thread) and popleft (take) are each atomic, so no batch can
        # land in a list that take() has already swapped out.
        self._batches: deque[np.ndarray] = deque()
        self.events_total = 0
        events = self.bpf["events"]
        self._ring = RingReader(events.map_fd, int(events.max_entries), BATCH_DTYPE)
        self._flush_fd = self.bpf.load_func(b"flush_events", self.bcc.BPF.RAW_TRACEPOINT).fd
        self._cpus = self.bcc.utils.get_online_cpus()
        self._flushed_at = 0.0
        if not run_on_cpu(self._flush_fd, self._cpus[0]):
            # Without it a batch that is not full would wait for more events indefinitely.
            self.bpf.cleanup()
            raise KvprofError("this kernel cannot run a BPF program on a chosen CPU "
                              "(BPF_PROG_TEST_RUN with BPF_F_TEST_RUN_ON_CPU, Linux 5.10+), "
                              "which kvprof's event batches need", EX_UNAVAILABLE)
        # Who the processes are, read from /proc as soon as each opens a file or does I/O:
        # a short-lived one may be gone by the next flush.
        self.procs = ProcessTable()
        self._proc_rows: deque[pa.Table] = deque()
        self.files: FileTable | None = None
        self._opens: RingReader | None = None
        self._not_regular_rows = 0
        self._held = np.empty(0, EVENT_DTYPE)  # rows waiting for their file's open record
        self._held_age = np.empty(0, np.int32)
        self._file_pos: dict[int, int] = {}  # open file id -> its position (_file_offsets)
        if "syscall" in self.layers:
            opens = self.bpf["opens"]
            self._opens = RingReader(opens.map_fd, int(opens.max_entries), OPEN_DTYPE)
            self.files = FileTable(self._forget, cache_rules)
            self._seed_files(self.files)
        self.aggregate: AggregateReader | None = None
        self._agg_final: dict[str, np.ndarray] | None = None
        if set(schema.DEVICE_LAYERS) & set(self.layers):
            self.aggregate = AggregateReader(self.bpf)

    def on_block(self) -> int | None:
        """io_uring requests to raw block devices (O_DIRECT) the io_uring layer left to the
        block layer; None where it traces them itself (or is not traced)."""
        if not self.raw_to_block:
            return None
        final = getattr(self, "_on_block_final", None)
        if final is not None:
            return int(final)
        return int(sum(self.bpf["counters"].getvalue(ctypes.c_int(URING_ON_BLOCK))))

    def counted(self) -> dict[str, int]:
        """Device-layer requests the aggregate tier has counted so far (every one, sampled
        or not), by layer name; empty where no device layer is traced."""
        if self.aggregate is None:
            return {}
        return {schema.LAYERS[code]: n for code, n in sorted(self.aggregate.counted.items())}

    def started(self) -> int:
        """Device-layer requests started since the probes attached (kept by sampling or not):
        the rate the event tier is offered, whatever the drain keeps up with."""
        return int(sum(self.bpf["counters"].getvalue(ctypes.c_int(DEVICE_STARTED))))

    def set_sampling(self, shift: int) -> None:
        """From now on the event tier keeps 1 in 2**shift device-layer requests."""
        self.bpf["sample_shift"][ctypes.c_int(0)] = ctypes.c_uint32(shift)

    def _fill_filters(self) -> None:
        one = ctypes.c_uint8(1)
        if self.filters.devices:
            t = self.bpf["dev_filter"]
            for d in self.filters.devices:
                t[ctypes.c_uint32(d.kernel_dev)] = one
        if self.filters.tgids:
            t = self.bpf["tgid_filter"]
            for p in self.filters.tgids:
                t[ctypes.c_uint32(p)] = one
        if self.filters.cgroup_ids:
            t = self.bpf["cgroup_filter"]
            for c in self.filters.cgroup_ids:
                t[ctypes.c_uint64(c)] = one

    def _seed_files(self, files: FileTable) -> None:
        """Regular files the traced processes hold open already: into the kernel's map."""
        if self.filters.tgids:
            tgids = list(self.filters.tgids)
        else:
            tgids = [t for t in all_tgids() if t != os.getpid()]
            if self.filters.cgroup_ids:
                tgids = [t for t in tgids if _cgroup_id(t) in self.filters.cgroup_ids]
        table = self.bpf["file_map"]
        for fid, tgid, fd, direct in files.seed(tgids):
            val = table.Leaf()
            val.id, val.flags = fid, FLAG_DIRECT if direct else 0
            table[table.Key(tgid, fd)] = val

    def _forget(self, tgid: int, fd: int, fid: int) -> None:
        table = self.bpf["file_map"]
        key = table.Key(tgid, fd)
        try:
            if table[key].id == fid:  # not a later file under the same fd number
                del table[key]
        except KeyError:
            pass  # closed already

    def usable(self) -> bool:
        """Whether this process can still use what it attached: run the flush program and
        read a map (see kvprof.privileges: tried with fewer capabilities in effect)."""
        try:
            self.bpf["sample_shift"][ctypes.c_int(0)]
        except KeyError:  # bcc's answer to any failed lookup; an array's slot 0 exists
            return False
        return run_on_cpu(self._flush_fd, self._cpus[0])

    def start(self) -> None:
        self._thread.start()

    def _drain(self) -> int:
        """Returns the bytes taken from the event ring."""
        # Opens first: a file's open record is always submitted before its first I/O.
        if self._opens is not None and self.files is not None:  # (both: the syscall layer)
            recs = self._opens.drain()
            if len(recs):
                self.files.opened(recs)
                self._described(recs["tgid"])
        now = time.monotonic()
        flushed = False
        if now - self._flushed_at >= FLUSH_EVERY_S:
            flushed = self._flush_batches()
            self._flushed_at = now
        batches = self._ring.drain()
        ev = unbatch(batches)
        if len(ev):
            self._batches.append(ev)
            self._described(ev["tgid"])
        change = self.sampler.saw(self.started)
        if change is not None:
            self._sampling.append(change)
        if self.files is not None and flushed:
            # Every row written before the close records read above was in a CPU's batch
            # or the ring, and is drained now.
            self.files.settle()
        return len(batches) * self._ring.rec_size

    def _flush_batches(self) -> bool:
        """Each CPU's batch that is not full yet, into the ring (flush_events in kvprof.h);
        False when some CPU's batch could not be handed over this time."""
        return all([run_on_cpu(self._flush_fd, cpu) for cpu in self._cpus])

    def _described(self, tgids: np.ndarray) -> None:
        rows = self.procs.rows(tgids, time.monotonic_ns())
        if rows is not None:
            self._proc_rows.append(rows)

    def _drain_loop(self) -> None:
        last = time.monotonic()
        while not self._stop.is_set():
            took = self._drain()
            now = time.monotonic()
            self._stop.wait(next_drain(took, now - last, self._ring.size))
            last = now

    @property
    def stopping(self) -> bool:
        """Whether stop() has been called: a second call would detach what is gone."""
        return self._stop.is_set()

    def stop(self) -> None:
        """Detach and drain what is left; no event emitted before detaching is lost."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
        # Let in-flight requests complete so their events are emitted before detaching, then
        # detach the tracepoints: everything they emitted is in the rings and the maps.
        time.sleep(0.05)
        for tp in list(self.bpf.tracepoint_fds):
            self.bpf.detach_tracepoint(tp)
        for tp in list(self.bpf.raw_tracepoint_fds):
            self.bpf.detach_raw_tracepoint(tp)
        self._drain()
        # The probes are detached, so each CPU's last batch can be read in place.
        last = [bytes(b) for b in self.bpf["staging"].getvalue(ctypes.c_int(0))]
        ev = unbatch(np.frombuffer(b"".join(last), BATCH_DTYPE))
        if len(ev):
            self._batches.append(ev)
        if self.aggregate is not None:
            self._agg_final = self.aggregate.take(final=True)
        lost = self.lost()
        self._on_block_final = self.on_block()  # (the counters go with the probes)
        # Requests still held as in flight were never seen completing: skipped completion
        # probes, or I/O in flight at the moment of detaching. Either way, not recorded in
        # either tier.
        for layer, count in self._held_at_stop().items():
            lost[NOT_SEEN[layer]] = lost.get(NOT_SEEN[layer], 0) + count
        self._lost_final = lost
        self._ring.close()
        if self._opens is not None:
            self._opens.close()
        self.bpf.cleanup()

    def _held_at_stop(self) -> dict[str, int]:
        """Requests the probes still hold as in flight, by layer (tcp holds none: each of
        its records is one call's bytes)."""
        held: dict[str, int] = {}
        if set(schema.DEVICE_LAYERS) & set(self.layers):
            keys = np.frombuffer(_map_bytes(self.bpf["inflight_keys"]), "<u8")
            table = self.bpf["inflight"]  # only the slots in use: a few of 65 536
            slots = np.frombuffer(b"".join(bytes(table[table.Key(int(i))])
                                           for i in np.flatnonzero(keys)), INFLIGHT_DTYPE)
            live = slots[slots["flags"] & FLAG_FILTERED == 0]
            for device in (x for x in layer_table.LAYERS if x.device):
                if device.name in self.layers:
                    held[device.name] = int((live["layer"] == device.code).sum())
        if "syscall" in self.layers:
            held["syscall"] = sum(1 for _ in self.bpf["sys_start_map"].keys())
        return held

    def lost(self) -> dict[str, int]:
        if getattr(self, "_lost_final", None) is not None:
            out = dict(self._lost_final)  # the kernel's counters, read before detaching
        else:
            counters = self.bpf["counters"]
            out = {name: int(sum(counters.getvalue(ctypes.c_int(idx))))
                   for idx, name in COUNTER_NAMES.items()}
            out["probe_skipped_nested"] = sum(
                recursion_misses(f.fd) for f in self.bpf.funcs.values() if f.fd is not None)
        if self.files is not None:
            # Counted here as rows are named, so also by the take() after stop().
            out["syscall_not_regular_file"] = self._not_regular_rows
        return out

    def take(self) -> dict[str, pa.RecordBatch]:
        """The rows drained since the last call, by table (io, and writeback bios), and under
        "aggregate" the aggregate tier's slot rows (AggregateReader.take) for the recorder
        to fold by the phase windows."""
        # Files whose rows were all in the batches before this: named below, then forgotten.
        closed = self.files.closed_since() if self.files is not None else set()
        batches = [self._held] if len(self._held) else []
        while self._batches:
            batches.append(self._batches.popleft())
        procs = []
        while self._proc_rows:
            procs.append(self._proc_rows.popleft())
        out = {"process": pa.concat_tables(procs)} if procs else {}
        changes = []
        while self._sampling:
            changes.append(self._sampling.popleft())
        if changes:
            out["event_sampling"] = pa.Table.from_batches(changes)
        if self.aggregate is not None:
            if self._stop.is_set():
                if self._agg_final is not None:  # taken at stop(), before the maps went
                    out["aggregate"] = self._agg_final
                    self._agg_final = None
            else:
                out["aggregate"] = self.aggregate.take()
        if not batches:
            if self.files is not None:
                self.files.forget(closed)
            return out
        ev = self._hold_unnamed(np.concatenate(batches))
        bios = ev["layer"] == LAYER_WRITEBACK
        if bios.any():
            out["writeback"] = self._writeback_batch(ev[bios])
            ev = ev[~bios]
        self.events_total += len(ev)
        if len(ev):
            out["io"] = self.to_batch(ev)
        self._forget_closed(closed)
        return out

    def _forget_closed(self, closed: set[int]) -> None:
        if self.files is not None:
            self.files.forget(closed)
        for i in closed:
            self._file_pos.pop(i, None)

    def _hold_unnamed(self, ev: np.ndarray) -> np.ndarray:
        """Rows of files whose open record has not been read yet are held for the next take:
        the drain stops at an open record another thread has reserved but not yet committed,
        so a committed open behind it (and the rows of its file, read from the other ring)
        can be a drain late. Held for at most HOLD_TAKES takes, and never after stop()."""
        held_age = self._held_age
        self._held, self._held_age = ev[:0], held_age[:0]
        if self.files is None or self._stop.is_set():  # stopped: every open has been read
            return ev
        sysc = np.flatnonzero(ev["layer"] == LAYER_SYSCALL)
        if not len(sysc):
            return ev
        ids, inv = np.unique(ev["ctx"][sysc], return_inverse=True)
        unknown = np.array([not self.files.known(i) for i in ids.tolist()], bool)
        late = sysc[unknown[inv.reshape(-1)]]
        if not len(late):
            return ev
        age = np.zeros(len(ev), np.int32)
        age[:len(held_age)] = held_age  # held rows come first (take() puts them there)
        late = late[age[late] < HOLD_TAKES]
        keep = np.ones(len(ev), bool)
        keep[late] = False
        self._held, self._held_age = ev[late], age[late] + 1
        return ev[keep]

    def _writeback_batch(self, ev: np.ndarray) -> pa.RecordBatch:
        devs = ev["dev"]
        uniq, inv = np.unique(devs, return_inverse=True)
        cols = {
            "ts_ns": pa.array(ev["issue_ns"].astype(np.int64)),
            "dev_major": pa.array((devs >> 20).astype(np.uint32)),
            "dev_minor": pa.array((devs & 0xFFFFF).astype(np.uint32)),
            "dev_name": _labels(inv.reshape(-1), [self.device(int(u)).name for u in uniq]),
            "sector": pa.array(ev["sector"]),
            "bytes": pa.array(ev["bytes"].astype(np.uint64)),
            "inode": pa.array(ev["ctx"]),
            "pid": pa.array(ev["pid"]),
            "comm": _comm(ev["comm"]),
        }
        return pa.RecordBatch.from_arrays([cols[f.name] for f in schema.WRITEBACK],
                                          schema=schema.WRITEBACK)

    def _file_offsets(self, ev: np.ndarray, sysc: np.ndarray) -> pa.Array:
        """Syscall reads' and writes' file offsets: the one the call named (its insert_ns
        slot), else the open file's position, followed here per open file id from 0 at its
        open: each call's bytes after those of the one before it (as the kernel moves it,
        where nothing seeks)."""
        pos = ev["insert_ns"]
        rw = sysc & ((ev["op"] == OP_READ) | (ev["op"] == OP_WRITE))
        out = np.where(rw & (pos != POS_NONE), pos, 0).astype(np.int64)
        follow = np.flatnonzero(rw & (pos == POS_NONE))
        if len(follow):
            order = np.lexsort((ev["issue_ns"][follow], ev["ctx"][follow]))
            f = follow[order]
            ids = ev["ctx"][f]
            nbytes = ev["bytes"][f].astype(np.int64)
            first = np.r_[True, ids[1:] != ids[:-1]]
            group = np.cumsum(first) - 1
            done = np.cumsum(nbytes)
            starts = np.flatnonzero(first)
            base = np.array([self._file_pos.get(int(i), 0) for i in ids[starts]], np.int64)
            out[f] = base[group] + done - nbytes - (done[starts] - nbytes[starts])[group]
            last = np.r_[starts[1:] - 1, len(f) - 1]
            for i, end in zip(ids[last].tolist(), (out[f[last]] + nbytes[last]).tolist()):
                self._file_pos[i] = end
        return pa.array(out, mask=~rw)

    def device(self, kernel_dev: int) -> Device:
        d = self._dev_names.get(kernel_dev)
        if d is None:
            d = by_number(kernel_dev >> 20, kernel_dev & ((1 << 20) - 1))
            self._dev_names[kernel_dev] = d
        return d

    def seen_devices(self) -> list[Device]:
        return list(self._dev_names.values())

    def to_batch(self, ev: np.ndarray) -> pa.RecordBatch:
        # Vectorised throughout: this runs for every event at up to hundreds of thousands a
        # second, on the same cores as the workload it measures.
        layer = ev["layer"]
        sysc = layer == LAYER_SYSCALL
        if sysc.any() and self.files is not None:
            # Rows of files found not to be regular files after all: dropped, and said so.
            ids, inv = np.unique(ev["ctx"][sysc], return_inverse=True)
            inv = inv.reshape(-1)
            found, dropped = self.files.lookup(ids)
            if dropped[inv].any():
                bad = np.zeros(len(ev), bool)
                bad[np.flatnonzero(sysc)] = dropped[inv]
                self._not_regular_rows += int(bad.sum())
                ev, layer, inv = ev[~bad], layer[~bad], inv[~dropped[inv]]
                sysc = layer == LAYER_SYSCALL
        else:
            found, inv = [], np.empty(0, np.int64)
        block = layer == LAYER_BLOCK
        uring = layer == LAYER_URING
        gds = layer == LAYER_GDS
        devs = ev["dev"]
        uniq, dinv = np.unique(np.where(block, devs, 0), return_inverse=True)
        names = [self.device(int(u)).name if u else "" for u in uniq]
        path_idx = np.zeros(len(ev), np.int32)
        path_idx[sysc] = inv
        files = pa.array(path_idx, mask=~sysc)

        def per_file(attr: str, typ: pa.DataType) -> pa.Array:
            values = pa.array([getattr(f, attr) if f else None for f in found] or [None], typ)
            return pa.DictionaryArray.from_arrays(files, values).cast(typ)

        cols = {
            "layer": _labels(layer, schema.LAYERS),
            "op": _labels(np.minimum(ev["op"], len(schema.OPS) - 1), schema.OPS),
            "flags": pa.array(ev["flags"] & 0x7FFF, pa.uint16()),
            # (a syscall row's insert_ns slot: the offset the call named; file_offset below)
            "insert_ns": pa.array(np.where(sysc, 0, ev["insert_ns"]).astype(np.int64)),
            "issue_ns": pa.array(ev["issue_ns"].astype(np.int64)),
            "complete_ns": pa.array(ev["complete_ns"].astype(np.int64)),
            "dev_major": pa.array((devs >> 20).astype(np.uint32), mask=~block),
            "dev_minor": pa.array((devs & 0xFFFFF).astype(np.uint32), mask=~block),
            "dev_name": _labels(dinv.reshape(-1), names, mask=~block),
            "sector": pa.array(ev["sector"], pa.uint64(), mask=~block),
            "bytes": pa.array(ev["bytes"].astype(np.uint64)),
            "pid": pa.array(ev["pid"]),
            "tgid": pa.array(ev["tgid"]),
            "comm": _comm(ev["comm"]),
            "cgroup_id": pa.array(ev["cgroup_id"]),
            "error": pa.array(ev["error"]),
            "uring_opcode": pa.array(ev["opcode"], pa.uint8(), mask=~uring),
            "uring_ctx": pa.array(ev["ctx"], pa.uint64(), mask=~uring),
            "syscall": _labels(np.where(gds, np.minimum(ev["opcode"], len(GDS_PROBES) - 1)
                                        + len(schema.SYSCALLS),
                                        np.minimum(ev["opcode"], len(schema.SYSCALLS) - 1)),
                               schema.SYSCALLS + GDS_PROBES, mask=~(sysc | gds)),
            "path": _peers(ev, layer == LAYER_TCP, per_file("path", pa.string())),
            "bytes_asked": pa.array(ev["asked"].astype(np.uint64), mask=~sysc),
            "cache": per_file("cache", pa.string()),
            "inode": per_file("inode", pa.uint64()),
            "sample_weight": pa.array(np.left_shift(np.uint32(1), ev["sample_shift"]
                                                    .astype(np.uint32))),
            # (a syscall row's sector slot: what the read put into the page cache)
            "fetched_bytes": pa.array(ev["sector"], pa.uint64(),
                                      mask=~(sysc & (ev["op"] == OP_READ) & self._filemap)),
            "file_offset": self._file_offsets(ev, sysc),
        }
        return pa.RecordBatch.from_arrays([cols[f.name] for f in schema.IO], schema=schema.IO)


# struct kvprof_inflight in kvprof/layers/lib/inflight.h, as numpy reads it.
INFLIGHT_DTYPE = np.dtype([("insert_ns", "<u8"), ("issue_ns", "<u8"), ("cgroup_id", "<u8"),
                           ("dev", "<u4"), ("bytes", "<u4"), ("done", "<u4"), ("pid", "<u4"),
                           ("tgid", "<u4"), ("flags", "<u2"), ("op", "u1"), ("pad1", "u1"),
                           ("opcode", "u1"), ("layer", "u1"), ("sample_shift", "u1"),
                           ("pad0", "V1"), ("dev_idx", "<u2"), ("pad", "V2"),
                           ("comm", "S16")])
# Checked field by field at load against the types bcc built from clang's layout of the
# maps holding them (kvprof/capture/layout.py): kvprof_io as the element of a batch.
LAYOUTS = (Struct("kvprof_io", EVENT_DTYPE, __name__, "staging", field="rec"),
           Struct("kvprof_batch", BATCH_DTYPE, __name__, "staging"),
           Struct("kvprof_inflight", INFLIGHT_DTYPE, __name__, "inflight",
                  c_file="kvprof/layers/lib/inflight.h"))
# Code families of the C whose every member must be among _codes(): one added to the C
# alone fails the load too.
HEADER_C = "kvprof/layers/kvprof.h"
SYSCALL_C = "kvprof/layers/syscall/probe.bpf.c"
CODE_FAMILIES = {"KVPROF_LAYER_": HEADER_C, "KVPROF_OP_": HEADER_C, "KVPROF_LOST_": HEADER_C,
                 "SYS_": SYSCALL_C}


def _structs(layers: tuple[str, ...]) -> list[Struct]:
    return [*LAYOUTS, *AGG_LAYOUTS, *(FILE_LAYOUTS if "syscall" in layers else ())]


def _codes(layers: tuple[str, ...]) -> list[Code]:
    """Every number user space shares with the C of these layers, and who sets it here."""
    sch = schema.__name__
    # (each layer's KVPROF_LAYER_ code is its descriptor's, given to the C as a -D)
    out = [Code(f"KVPROF_LAYER_{layer.name.upper()}", layer.code, layer_table.__name__)
           for layer in layer_table.LAYERS]
    out += [Code(f"KVPROF_OP_{name.upper()}", i, sch) for i, name in enumerate(schema.OPS)]
    out += [Code(f"KVPROF_FL_{f}", getattr(schema, f"FLAG_{f}"), sch)
            for f in ("SYNC", "FUA", "PREFLUSH", "META", "RAHEAD", "DIRECT")]
    out += [Code(macro, idx, __name__) for macro, idx, _ in COUNTERS]
    out += [Code(macro, value, __name__) for macro, value in (
        ("KVPROF_LAYER_WRITEBACK", LAYER_WRITEBACK), ("KVPROF_DEVICE_STARTED", DEVICE_STARTED),
        ("KVPROF_URING_ON_BLOCK", URING_ON_BLOCK),
        ("KVPROF_BATCH", BATCH), ("KVPROF_FL_FILTERED", FLAG_FILTERED))]
    out += AGG_CODES
    if "syscall" in layers:
        out += [Code(f"SYS_{name.upper()}", i, sch, SYSCALL_C)
                for i, name in enumerate(schema.SYSCALLS)]
        out.append(Code("KVPROF_POS_NONE", int(POS_NONE), __name__, SYSCALL_C))
        out += FILE_CODES
    return out


def _map_bytes(table) -> bytes:
    """An array map's values, in one piece (read once, at stop)."""
    return b"".join(bytes(v) for v in table.values())


# How often each CPU's partial batch of events is handed over: how late a row can be when
# I/O is sparse (the aggregate tier, exact and drained each second, is not delayed by it).
FLUSH_EVERY_S = 0.2


def next_drain(took: int, over_s: float, ring_bytes: int) -> float:
    """Seconds to sleep before the next drain, after one that took `took` bytes of events
    that came in over `over_s`: the time the ring takes at that rate to be DRAIN_AT_FILL
    full, between DRAIN_INTERVAL_S and DRAIN_IDLE_S."""
    if took <= 0 or over_s <= 0:
        return DRAIN_IDLE_S
    due = ring_bytes * DRAIN_AT_FILL / (took / over_s)
    return min(DRAIN_IDLE_S, max(DRAIN_INTERVAL_S, due))


def unbatch(batches: np.ndarray) -> np.ndarray:
    """The records in use of each batch, in order."""
    if not len(batches):
        return np.empty(0, EVENT_DTYPE)
    used = np.arange(BATCH)[None, :] < batches["n"][:, None]
    return batches["rec"][used]


# Takes (FLUSH_INTERVAL_S apart) a row of a not yet named file waits for its open record
# before it is stored without a path.
HOLD_TAKES = 8
FLAG_FILTERED = 1 << 15  # KVPROF_FL_FILTERED: entries of tasks the filters leave out
FLAG_DIRECT = schema.FLAG_DIRECT


MADV_PAGEOUT = 21  # Linux 5.4+


def _release_compiler_memory() -> None:
    """Compiling the probes (clang/LLVM inside bcc) leaves a large freed heap that glibc
    keeps mapped, and the compiler's code paged in; a long recording needs neither. The heap
    goes back to the kernel; the code pages are handed back (MADV_PAGEOUT: they come back
    from the file if ever run again)."""
    libc = _libc()
    try:
        libc.malloc_trim(0)
    except AttributeError:
        pass  # not glibc
    try:
        maps = Path("/proc/self/maps").read_text().splitlines()
    except OSError:
        return
    for line in maps:
        fields = line.split()
        if len(fields) > 5 and ("/libLLVM" in fields[5] or "/libclang" in fields[5]):
            start, end = (int(x, 16) for x in fields[0].split("-"))
            # An old kernel's EINVAL leaves them paged in: advice, nothing more.
            libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), MADV_PAGEOUT)


def _peers(ev: np.ndarray, tcp: np.ndarray, paths: pa.Array) -> pa.Array:
    """The path column: files' paths, and for tcp rows the peer as address:port (IPv6 peers
    by port only, `?` where the connection predates kvprof)."""
    if not tcp.any():
        return paths
    # One string per distinct peer, not per row: a busy socket sends many times a second.
    key = ev["sector"][tcp] * 16 + (ev["opcode"][tcp] & 15)
    uniq, inv = np.unique(key, return_inverse=True)
    names = []
    for k in uniq.tolist():
        ap, fam = k >> 4, k & 15
        if fam == 2:
            a = (ap >> 16).to_bytes(4, "little")
            names.append(f"{a[0]}.{a[1]}.{a[2]}.{a[3]}:{ap & 0xFFFF}")
        else:
            names.append(f"[ipv6]:{ap & 0xFFFF}" if fam == 10 else "?")
    out = np.array(paths.to_pylist(), dtype=object)
    out[tcp] = np.array(names, dtype=object)[inv.reshape(-1)]
    return pa.array(out.tolist(), pa.string())


def _cgroup_id(tgid: int) -> int | None:
    """The cgroup v2 id (its directory's inode) a process is in, as the probes see it."""
    try:
        for line in Path(f"/proc/{tgid}/cgroup").read_text().splitlines():
            if line.startswith("0::"):
                return os.stat("/sys/fs/cgroup" + line[3:]).st_ino
    except OSError:
        pass
    return None

BPF_OBJ_GET_INFO_BY_FD = 15
# struct bpf_prog_info (uapi/linux/bpf.h) up to recursion_misses (added in Linux 5.12).
PROG_INFO_SIZE = 216
RECURSION_MISSES_OFFSET = 208


@functools.cache
def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


BPF_PROG_TEST_RUN = 10
BPF_F_TEST_RUN_ON_CPU = 1


def run_on_cpu(prog_fd: int, cpu: int) -> bool:
    """Run a raw tracepoint program once on `cpu` (the kernel sends it there; Linux 5.10+);
    True when it ran and returned 0."""
    import platform

    nr = SYS_BPF.get(platform.machine())
    if nr is None:
        return False
    # union bpf_attr, test: prog_fd, retval, sizes and pointers all 0 (no context), flags at
    # byte 64, cpu at 68.
    attr = ctypes.create_string_buffer(80)
    struct.pack_into("<I", attr, 0, prog_fd)
    struct.pack_into("<II", attr, 64, BPF_F_TEST_RUN_ON_CPU, cpu)
    if _libc().syscall(nr, BPF_PROG_TEST_RUN, attr, 80) != 0:
        return False
    return struct.unpack_from("<I", attr, 4)[0] == 0  # the program's return value


def recursion_misses(prog_fd: int) -> int:
    """How often the kernel skipped this program because another BPF program was already
    running on that CPU (e.g. a completion in an interrupt during a submit probe): each skip
    can cost one event, so it is reported with the losses."""
    import platform

    nr = SYS_BPF.get(platform.machine())
    if nr is None:
        return 0
    info = ctypes.create_string_buffer(PROG_INFO_SIZE)
    attr = struct.pack("<IIQ", prog_fd, PROG_INFO_SIZE, ctypes.addressof(info))
    attr_buf = ctypes.create_string_buffer(attr, 120)
    if _libc().syscall(nr, BPF_OBJ_GET_INFO_BY_FD, attr_buf, 120) != 0:
        return 0
    (misses,) = struct.unpack_from("<Q", info, RECURSION_MISSES_OFFSET)
    return int(misses)


def _labels(codes: np.ndarray, names, mask: np.ndarray | None = None) -> pa.Array:
    """Small-integer codes to strings through a dictionary, NULL where mask is True."""
    idx = pa.array(codes.astype(np.int32), mask=mask)
    return pa.DictionaryArray.from_arrays(idx, pa.array(list(names), pa.string())) \
        .cast(pa.string())


def _comm(raw: np.ndarray) -> pa.Array:
    """Task names: NUL-padded bytes, nearly always ASCII. A vectorised cast does the common
    case; a name that is not UTF-8 sends the batch through a Latin-1 decode instead."""
    try:
        return pa.array(raw, pa.binary()).cast(pa.string())
    except pa.ArrowInvalid:
        return pa.array([c.decode("latin-1") for c in raw.tolist()], pa.string())
