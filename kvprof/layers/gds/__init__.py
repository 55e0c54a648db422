"""The gds layer: the traced processes' cuFile (GPUDirect Storage) calls, from USDT probes in
libcufile (kvprof/capture/gds.py names them)."""
from __future__ import annotations

from kvprof.layers.layer import Layer

# USDT probes in libcufile rather than tracepoints: attached where the library is found
# (capture/gds.py names them).
LAYER = Layer(
    "gds", 4, device=False,
    help="the traced processes' cuFile (GPUDirect Storage) calls",
)
