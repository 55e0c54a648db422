"""Giving up, once the probes are attached, the privileges a recording no longer needs.

Attaching takes CAP_BPF, CAP_PERFMON and CAP_SYS_ADMIN (or root); afterwards the recorder only
uses descriptors it holds, which the kernel checked when they were created (see `drop()`). The
syscall layer's file names keep reading other users' /proc/PID/fd (CAP_SYS_PTRACE,
CAP_DAC_READ_SEARCH). Capabilities are per thread and copied into each new one, so the drop is
done while the recorder's thread is the only one holding any; `holders()` finds any left."""
from __future__ import annotations

import ctypes
import functools
import os
import platform
import struct
from collections.abc import Callable
from pathlib import Path

from kvprof import layers as layer_table

CAP_DAC_READ_SEARCH = 2
CAP_SETPCAP = 8
CAP_SYS_PTRACE = 19
CAP_SYS_ADMIN = 21
CAP_BPF = 39
CAP_NAMES = {CAP_DAC_READ_SEARCH: "CAP_DAC_READ_SEARCH", CAP_SYS_PTRACE: "CAP_SYS_PTRACE",
             CAP_SYS_ADMIN: "CAP_SYS_ADMIN", CAP_BPF: "CAP_BPF"}
CAP_NUMBERS = {name: cap for cap, name in CAP_NAMES.items()}

_CAP_VERSION_3 = 0x20080522  # two 32-bit words per set
PR_CAPBSET_DROP = 24
PR_SET_NO_NEW_PRIVS = 38
PR_CAP_AMBIENT = 47
PR_CAP_AMBIENT_CLEAR_ALL = 4


class _Header(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _Data(ctypes.Structure):
    _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32),
                ("inheritable", ctypes.c_uint32)]


@functools.cache
def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def _get() -> tuple[int, int]:
    """This thread's (effective, permitted) sets."""
    hdr, data = _Header(_CAP_VERSION_3, 0), (_Data * 2)()
    if _libc().capget(ctypes.byref(hdr), data) != 0:
        raise OSError(ctypes.get_errno(), "capget")
    return (data[0].effective | data[1].effective << 32,
            data[0].permitted | data[1].permitted << 32)


def _set(effective: int, permitted: int) -> None:
    hdr, data = _Header(_CAP_VERSION_3, 0), (_Data * 2)()
    for i in (0, 1):
        data[i].effective = effective >> (32 * i) & 0xFFFFFFFF
        data[i].permitted = permitted >> (32 * i) & 0xFFFFFFFF
    if _libc().capset(ctypes.byref(hdr), data) != 0:
        raise OSError(ctypes.get_errno(), "capset")


def _mask(caps) -> int:
    return sum(1 << c for c in caps)


def needed(layers: tuple[str, ...]) -> frozenset[int]:
    """What a recording of these layers still uses after attaching (each layer's
    descriptor names it, kvprof/layers.py)."""
    return frozenset(CAP_NUMBERS[cap] for name in layers
                     for cap in layer_table.BY_NAME[name].privileges)


def drop(keep: frozenset[int], works: Callable[[], bool]) -> str:
    """Keep only `keep` (of what this thread holds) in the effective, permitted and
    bounding sets, clear the ambient set and set no_new_privs, so that no program run later
    gains any back. `works()` is tried first with only `keep` in effect: where it fails (before
    Linux 6.5 the kernel checks `kernel.unprivileged_bpf_disabled` on every use of a map, not
    only at its creation), the BPF capability is kept too. Returns what is kept, in words."""
    libc = _libc()
    effective, permitted = _get()
    _set(effective & _mask(keep), permitted)  # effective only: can be raised again
    try:
        ok = works()
    finally:
        _set(effective, permitted)
    if not ok:
        last = int(Path("/proc/sys/kernel/cap_last_cap").read_text())
        keep = keep | {CAP_BPF if last >= CAP_BPF else CAP_SYS_ADMIN}
    # The bounding set next, while CAP_SETPCAP is still held. Without it (systemd's unit
    # bounds kvprof to what it needs; a setcap'd interpreter runs as a user), no_new_privs
    # below is what keeps a program run later from gaining any back.
    if effective >> CAP_SETPCAP & 1:
        for cap in range(int(Path("/proc/sys/kernel/cap_last_cap").read_text()) + 1):
            if cap not in keep and libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0) != 0:
                raise OSError(ctypes.get_errno(), f"dropping capability {cap}")
    libc.prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0)  # EINVAL before Linux 4.3
    kept = permitted & _mask(keep)
    _set(kept, kept)
    if libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "no_new_privs")
    return " ".join(CAP_NAMES.get(c, f"cap {c}") for c in sorted(keep) if kept >> c & 1) \
        or "none"


def holders(mask: int | None = None) -> list[str]:
    """The threads of this process whose effective or permitted set holds more than this
    thread's (or `mask`): what a partial drop left behind."""
    if mask is None:
        mask = _get()[1]
    out = []
    for tid in os.listdir("/proc/self/task"):
        try:
            held = thread_mask(int(tid))
            comm = Path(f"/proc/self/task/{tid}/comm").read_text().strip()
        except OSError:
            continue  # ended meanwhile
        if held & ~mask:
            out.append(f"{comm} ({tid})")
    return out


def thread_mask(tid: int) -> int:
    """What thread `tid` of this process holds (effective or permitted)."""
    status = Path(f"/proc/self/task/{tid}/status").read_text()
    caps = dict(line.split(":\t", 1) for line in status.splitlines() if ":\t" in line)
    return int(caps["CapEff"], 16) | int(caps["CapPrm"], 16)


def drop_all() -> None:
    """For a thread that never needs privilege (the dashboard's)."""
    drop(frozenset(), lambda: True)


# The bpf() syscall's number, where kvprof knows it.
SYS_BPF = {"x86_64": 321, "aarch64": 280}
BPF_MAP_CREATE, BPF_MAP_LOOKUP_ELEM, BPF_MAP_TYPE_ARRAY = 0, 1, 2


def _bpf(cmd: int, attr: bytes) -> int:
    nr = SYS_BPF.get(platform.machine())
    if nr is None:
        return -1
    buf = ctypes.create_string_buffer(attr, 72)
    return _libc().syscall(nr, cmd, buf, 72)


def drop_for_map_writer() -> str:
    """For a thread that uses the recorder's BPF maps and nothing else privileged (the
    marker socket's: it sets the phase the probes count under, from what other users send).
    It starts before the probes attach, so its check is a one-slot map of its own."""
    fd = _bpf(BPF_MAP_CREATE, struct.pack("<IIII", BPF_MAP_TYPE_ARRAY, 4, 4, 1))

    def works() -> bool:
        key, value = ctypes.c_uint32(0), ctypes.c_uint32(0)
        return _bpf(BPF_MAP_LOOKUP_ELEM, struct.pack(
            "<IIQQQ", fd, 0, ctypes.addressof(key), ctypes.addressof(value), 0)) == 0

    try:
        # No map (no privilege, or no BPF here): nothing this thread could keep.
        return drop(frozenset(), works if fd >= 0 else lambda: True)
    finally:
        if fd >= 0:
            os.close(fd)
