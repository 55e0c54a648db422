"""What a recording is asked for (`RecordOptions`), from the library's callers or from the
command line (`options_from_args`, shared by `kvprof record` and `kvprof top`)."""
from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING

from kvprof import layers, system
from kvprof.devices import resolve
from kvprof.errors import EX_USAGE, KvprofError
from kvprof.layers import DEFAULT_NAMES, DEVICE_EVENT_RATE

if TYPE_CHECKING:
    from kvprof.capture.ebpf import CaptureFilter


@dataclass
class RecordOptions:
    out: str | None = None
    devices: list[str] = field(default_factory=list)
    pids: list[int] = field(default_factory=list)
    cgroups: list[str] = field(default_factory=list)
    layers: tuple[str, ...] = DEFAULT_NAMES
    # The io_uring layer also traces requests to raw block devices opened O_DIRECT, which the
    # block layer carries one for one; by default (False) it leaves them to the block layer
    # and counts them (`--layer io_uring` named on the command line: True).
    io_uring_raw: bool = False
    duration_s: float | None = None
    socket: str | None = None
    phases: list[str] = field(default_factory=list)  # --phases specs; empty = auto
    caches: list[str] = field(default_factory=list)  # --cache NAME=GLOB, before the built-ins
    # Per-I/O rows of the device layers (block, io_uring); without them only the aggregate
    # tier counts those layers (--no-events).
    events: bool = True
    max_size: int | None = None  # bytes on disk at which the recording ends (--max-size)
    # Seconds the aggregate tier waits for the phase sources' windows before folding a
    # second for good (and the Prometheus endpoint before publishing it): the vLLM plugin
    # sends a step's window up to ~1 s after it, a scrape's carve one interval later.
    settle_s: int = 5
    # Bytes on disk at which the recording goes on in a new segment file (--roll); with
    # max_size, the oldest segments are deleted to stay under it instead of ending.
    roll: int | None = None
    # Device-layer rows a second the event tier keeps before it samples (--event-rate); 0:
    # every one.
    event_rate: int = DEVICE_EVENT_RATE
    # [ADDR:]PORT to serve the exact totals as Prometheus metrics on (--prometheus).
    prometheus: str | None = None
    # The marker socket's permissions (--socket-mode, --socket-group) and the users whose
    # marks are taken (--allow-sender; empty: whoever the permissions let send).
    socket_mode: int = 0o660
    socket_group: str | None = None
    allow_senders: list[str] = field(default_factory=list)
    # Phase sources the caller made itself (kvprof replay's: the recording's windows), run
    # as the ones named by --phases are.
    feeds: list = field(default_factory=list)
    # Give up, once attached, the privileges the recording no longer needs
    # (kvprof.privileges). Only for a process of its own: what the caller does afterwards
    # in this thread runs without them too (the CLI sets it; --keep-privileges does not).
    drop_privileges: bool = False


def default_out() -> Path:
    return Path(datetime.now().strftime("kvprof-%Y%m%d-%H%M%S"))


def resolve_filters(opts: RecordOptions) -> CaptureFilter:
    from kvprof.capture.ebpf import CaptureFilter

    devices = tuple(dict.fromkeys(resolve(d) for d in opts.devices))
    for pid in opts.pids:
        if not Path(f"/proc/{pid}").exists():
            raise KvprofError(f"no process with pid {pid}", EX_USAGE)
    cgroup_ids = []
    for cg in opts.cgroups:
        p = Path(cg) if cg.startswith("/sys/fs/cgroup") else Path("/sys/fs/cgroup") / cg.lstrip("/")
        if not p.is_dir():
            raise KvprofError(f"no cgroup at {p} (cgroup v2 path expected)", EX_USAGE)
        cgroup_ids.append(os.stat(p).st_ino)
    return CaptureFilter(devices=devices, tgids=tuple(opts.pids),
                         cgroup_ids=tuple(cgroup_ids))


def layers_from_args(args: argparse.Namespace) -> tuple[str, ...]:
    """--layer as given; by default the block layer, and with -p / --cgroup the selected
    processes' layers too: their io_uring requests, file syscalls, TCP bytes and cuFile calls
    (system-wide, every read and write of every process would be traced, and io_uring's
    programs would run for requests the block layer already carries)."""
    if args.layer:
        return tuple(dict.fromkeys(args.layer))
    from kvprof.capture.gds import find_cufile

    chosen = list(layers.DEFAULT_NAMES)
    if args.pid or args.cgroup:
        # The process layers this kernel has the tracepoints for; gds attaches to libcufile
        # instead, where it is installed.
        chosen += [x.name for x in layers.LAYERS if not x.default and x.tracepoints
                   and all(system.tracepoint_available(t) for t in x.tracepoints)]
        if find_cufile():
            chosen.append(layers.GDS.name)
    return tuple(chosen)


def options_from_args(args: argparse.Namespace) -> RecordOptions:
    """The recording `kvprof record` asks for, or `kvprof top` (which has neither --roll nor
    --no-events: the dashboard reads one segment, with its rows)."""
    return RecordOptions(out=args.output, devices=args.device, pids=args.pid,
                         cgroups=args.cgroup, layers=layers_from_args(args),
                         io_uring_raw="io_uring" in (args.layer or ()),
                         duration_s=args.duration, socket=args.socket, phases=args.phase_sources,
                         caches=args.caches, events=getattr(args, "events", True),
                         max_size=args.max_size, event_rate=args.event_rate,
                         roll=getattr(args, "roll", None), settle_s=args.settle,
                         prometheus=args.prometheus, socket_mode=args.socket_mode,
                         socket_group=args.socket_group, allow_senders=args.allow_sender,
                         drop_privileges=not args.keep_privileges)
