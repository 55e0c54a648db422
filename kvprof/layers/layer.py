"""What a capture layer is made of, written once: its descriptor (LAYER in its folder's
__init__.py, beside its probe). Only the standard library is imported, so that everything
down to schema can read it; tests/unit/test_descriptors.py holds it to its probe.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

# A layer's probe, in its folder; the C every probe shares, beside the folders.
PROBE = "probe.bpf.c"
HEADER = "kvprof.h"


@dataclass(frozen=True)
class Layer:
    name: str
    # The `layer` byte the probes write (KVPROF_LAYER_<NAME>, given them as a -D) and the
    # index into schema.LAYERS: one number, so that both decode the same.
    code: int
    help: str  # one line for `kvprof record -h`, beside the name: 68 columns at most
    # Sees each device byte once. The others repeat (io_uring asks, block carries out) or
    # precede (a syscall's bytes may never reach a device) block requests, so device
    # totals add only these; they are also on by default, the process layers opt-in.
    device: bool
    # "group/name": every tracepoint the probe attaches whenever the layer runs; a kernel
    # without one of them cannot run the layer (system.check_tracepoints says which).
    tracepoints: tuple[str, ...] = ()
    # Attached only where the kernel has them or another layer runs too (#ifdef'd in the
    # probe): the layer works without them.
    optional_tracepoints: tuple[str, ...] = ()
    # Of `tracepoints`, the raw ones: name -> the C types of the arguments the probe reads,
    # compared with the running kernel's BTF before loading (capture/btf.py).
    raw_args: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    # -D name -> (struct, member) whose byte offset the probe needs, from the kernel's BTF.
    fields: Mapping[str, tuple[str, str]] = field(default_factory=dict)
    # -D name -> (enum, enumerator) whose value the probe needs, from the kernel's BTF.
    enums: Mapping[str, tuple[str, str]] = field(default_factory=dict)
    # Capabilities (their kernel names) the recorder keeps after attaching, for this layer.
    privileges: tuple[str, ...] = ()


# Rows a second of the device layers (block, io_uring) the event tier keeps by default before
# it samples (record --event-rate). The aggregate tier counts every request whatever this is;
# the rows are for percentiles and who issued what, which a sample of this many a second
# answers; more costs the recorder's Arrow and DuckDB work CPU at high IOPS (docs/performance.md).
DEVICE_EVENT_RATE = 10_000
