"""`kvprof doctor`: one line per requirement of live capture, with the fix when it fails."""
from __future__ import annotations

import os

from kvprof import system
from kvprof.errors import KvprofError


def _bcc() -> system.Check:
    from kvprof.capture.bccload import FIX, load_bcc

    try:
        mod = load_bcc()
    except KvprofError as e:
        return system.Check("bcc", False, str(e).split(";")[0], FIX)
    return system.Check("bcc", True, f"{getattr(mod, '__version__', '?')} from "
                                     f"{os.path.dirname(mod.__file__)}")


def _nvml() -> system.Check:
    from kvprof.capture.nvml import nvml_available

    status = nvml_available()
    if status.ok:
        return system.Check("nvml", True, f"{status.gpus} GPU(s)")
    return system.Check("nvml", False, f"{status.reason}; no phase windows from NVML",
                        f"{status.fix}; optional", required=False)


# Where CUDA installs put libcufile (GPUDirect Storage); ldconfig's cache is asked first.
CUFILE_DIRS = ("/usr/local/cuda/lib64", "/usr/local/cuda/targets/x86_64-linux/lib",
               "/usr/lib/x86_64-linux-gnu", "/usr/lib64")


def _gds() -> system.Check:
    """GPUDirect Storage moves KV between NVMe and GPU memory without the page cache; in its
    compat mode it does plain POSIX I/O, which the syscall layer sees."""
    import ctypes.util
    import glob

    found = ctypes.util.find_library("cufile") or next(
        (p for d in CUFILE_DIRS for p in sorted(glob.glob(f"{d}/libcufile.so*"))), None)
    if found is None:
        return system.Check("gds", False, "libcufile not found: no GPUDirect Storage on this "
                            "host (nothing to trace)", "", required=False)
    return system.Check("gds", False, f"{found}: its DMA reads and writes (USDT cufio:*) "
                        "are not traced yet; compat-mode I/O shows in the syscall layer", "",
                        required=False)


def run_doctor() -> int:
    checks = [system.check_privilege(), system.check_tracefs(), *system.check_tracepoints(),
              _bcc(), system.check_headers(), _nvml(), _gds()]
    for c in checks:
        mark = "ok  " if c.ok else ("FAIL" if c.required else "warn")
        line = f"{mark} {c.name:<20} {c.detail}"
        print(line)
        if not c.ok and c.fix:
            print(f"     {'':<20} fix: {c.fix}")
    required_failed = [c for c in checks if not c.ok and c.required]
    return 1 if required_failed else 0
