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
    # Followed request by request from start to completion (block, io_uring), with the
    # event tier's sampling and the report's device sections.
    device: bool
    # On without --layer, on every host: what the devices do (block sees each device byte
    # once). The rest come on with -p / --cgroup (what the selected processes do: io_uring
    # repeats block's requests, a syscall's bytes may never reach a device) or when named.
    default: bool = False
    # "group/name": every tracepoint the probe attaches whenever the layer runs; a kernel
    # without one of them cannot run the layer (system.check_tracepoints says which).
    tracepoints: tuple[str, ...] = ()
    # Attached only where the kernel has them, another layer runs too, or a filter needs
    # them (#ifdef'd in the probe): the layer works without them.
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
