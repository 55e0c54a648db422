"""The capture layers: one folder each (its probe and its descriptor), listed here.

Adding a layer is a folder beside these (probe.bpf.c, and LAYER in its __init__.py) and its
name in FOLDERS; tests/unit/test_descriptors.py fails until they agree, and shows a toy layer
added so.
"""
from __future__ import annotations

from importlib import import_module
from pathlib import Path

from kvprof.layers.layer import DEVICE_EVENT_RATE, HEADER, PROBE, Layer

__all__ = ["BLOCK", "BY_NAME", "DEFAULT_NAMES", "DEVICE_EVENT_RATE", "DEVICE_NAMES", "DIR",
           "FOLDERS", "GDS", "HEADER", "IO_URING", "LAYERS", "Layer", "NAMES", "PROBE",
           "SYSCALL", "TCP", "probe_file"]

# The registry, one line a layer, in code order (the probes' layer byte indexes it).
FOLDERS = (
    "block",
    "io_uring",
    "syscall",
    "tcp",
    "gds",
)
LAYERS: tuple[Layer, ...] = tuple(import_module(f"{__name__}.{f}").LAYER for f in FOLDERS)
BY_NAME: dict[str, Layer] = {layer.name: layer for layer in LAYERS}
NAMES: tuple[str, ...] = tuple(BY_NAME)
DEVICE_NAMES: tuple[str, ...] = tuple(layer.name for layer in LAYERS if layer.device)
DEFAULT_NAMES: tuple[str, ...] = tuple(layer.name for layer in LAYERS if layer.default)
# Views index per-device-layer arrays by code, so the device layers come first.
assert NAMES[:len(DEVICE_NAMES)] == DEVICE_NAMES, "device layers first"
assert all(layer.code == i for i, layer in enumerate(LAYERS)), "code = index"
# The layers the rest of kvprof names.
BLOCK, IO_URING, SYSCALL, TCP, GDS = (BY_NAME[n] for n in
                                      ("block", "io_uring", "syscall", "tcp", "gds"))
DIR = Path(__file__).parent


def probe_file(name: str) -> Path:
    """The probe of layer `name`."""
    return DIR / name / PROBE
