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


def _btf() -> system.Check:
    """The device probes read struct request and io_kiocb at offsets from the kernel's BTF."""
    from kvprof.capture.btf import VMLINUX, layout_defines

    try:
        found = layout_defines(("block", "io_uring"))
    except KvprofError as e:
        return system.Check("btf", False, str(e).split(";")[0].split(" (")[0],
                            "a kernel built with CONFIG_DEBUG_INFO_BTF=y (Linux 6.x)")
    return system.Check("btf", True, f"{len(found)} request layout values from {VMLINUX}")


def _nvml() -> system.Check:
    from kvprof.capture.nvml import nvml_available

    status = nvml_available()
    if status.ok:
        return system.Check("nvml", True, f"{status.gpus} GPU(s)")
    return system.Check("nvml", False, f"{status.reason}; no phase windows from NVML",
                        f"{status.fix}; optional", required=False)


def _gds() -> system.Check:
    """GPUDirect Storage moves KV between NVMe and GPU memory without the page cache; in its
    compat mode it does plain POSIX I/O, which the syscall layer sees."""
    from kvprof.capture.gds import find_cufile

    found = find_cufile()
    if found is None:
        return system.Check("gds", False, "libcufile not found: no GPUDirect Storage on this "
                            "host (nothing to trace)", "", required=False)
    return system.Check("gds", True, f"{found}: cuFile calls traced with --layer gds (on "
                        "by default with -p/--cgroup)")


def run_doctor() -> int:
    checks = [system.check_privilege(), system.check_tracefs(), *system.check_tracepoints(),
              _btf(), _bcc(), system.check_headers(), _nvml(), _gds()]
    for c in checks:
        mark = "ok  " if c.ok else ("FAIL" if c.required else "warn")
        line = f"{mark} {c.name:<20} {c.detail}"
        print(line)
        if not c.ok and c.fix:
            print(f"     {'':<20} fix: {c.fix}")
    required_failed = [c for c in checks if not c.ok and c.required]
    return 1 if required_failed else 0
