"""Where libcufile (GPUDirect Storage) is, and which of its USDT probes the gds layer uses.

`KVPROF_CUFILE` names the library when it is not where CUDA installs put it (and lets the
tests point at a stand-in that carries the same probes)."""
from __future__ import annotations

import ctypes.util
import glob
import os

# (provider, probe) -> (handler in kvprof/layers/gds/probe.bpf.c, code in kvprof_io.opcode = index)
PROBES = (
    ("cufio", "cufio_gds_read", "kvprof_gds_read"),
    ("cufio", "cufio_gds_write", "kvprof_gds_write"),
    ("cufio", "cufio_px_read", "kvprof_px_read"),
    ("cufio", "cufio_px_write", "kvprof_px_write"),
    ("cufio", "cufio_gds_read_async", "kvprof_gds_read_async"),
    ("cufio", "cufio_gds_write_async", "kvprof_gds_write_async"),
)
NAMES = tuple(p for _, p, _ in PROBES)
DIRS = ("/usr/local/cuda/lib64", "/usr/local/cuda/targets/x86_64-linux/lib",
        "/usr/lib/x86_64-linux-gnu", "/usr/lib64")


def find_cufile() -> str | None:
    env = os.environ.get("KVPROF_CUFILE")
    if env:
        return env if os.path.exists(env) else None
    lib = ctypes.util.find_library("cufile")
    if lib and os.path.isabs(lib):
        return lib
    for d in DIRS:
        for p in sorted(glob.glob(f"{d}/libcufile.so*")):
            return os.path.realpath(p)
    return None


def usdt_contexts(bcc, lib: str) -> tuple[list, list[str]]:
    """bcc USDT contexts for the probes the library has, and the names it lacks."""
    u = bcc.USDT(path=lib)
    missing = []
    for _, probe, handler in PROBES:
        try:
            u.enable_probe(probe=probe, fn_name=handler)
        except Exception:  # noqa: BLE001 - bcc raises bare Exception for an absent probe
            missing.append(probe)
    return ([u] if len(missing) < len(PROBES) else []), missing
