"""What a measurement writes to (`kvprof calibrate`, `kvprof replay`): a block device or a
scratch file in a directory, checked for safety. A raw device that is mounted or held (LVM,
md) is refused, and one holding a filesystem or any data unless forced."""
from __future__ import annotations

import os
import shutil
import stat
import subprocess
from dataclasses import dataclass
from pathlib import Path

from kvprof.calibration import MIB, read_attr, sysfs_dir
from kvprof.devices import Device, by_number, resolve
from kvprof.errors import EX_NOPERM, EX_USAGE, KvprofError


def holds_data(path: str) -> str | None:
    """Why a raw device must not be written to without --force: a signature blkid knows
    (filesystem, RAID, LVM, partition table), or any non-zero byte in its first MiB."""
    if shutil.which("blkid"):
        out = subprocess.run(["blkid", "-p", "-o", "export", path], capture_output=True,
                             text=True)
        for line in out.stdout.splitlines():
            if line.startswith(("TYPE=", "PTTYPE=")):
                return f"it holds {line.split('=', 1)[1]} data (blkid)"
    with open(path, "rb") as f:
        head = f.read(MIB)
    if head.strip(b"\0"):
        return "its first MiB holds data"
    return None


def in_use(dev: Device) -> str | None:
    """Mounted, or held by another block device (LVM, md, dm-crypt)."""
    sys_dev = sysfs_dir(dev)
    if any((sys_dev / "holders").iterdir()) if (sys_dev / "holders").exists() else False:
        return "it is held by another device (LVM, RAID or dm)"
    for line in read_attr(Path("/proc/self/mountinfo")).splitlines():
        if line.split()[2:3] == [f"{dev.major}:{dev.minor}"]:
            return f"it is mounted on {line.split()[4]}"
    return None


@dataclass
class Target:
    path: str  # what fio opens
    device: Device | None  # the block device the I/O lands on, when there is one
    size: int  # bytes of the target fio spreads its I/O over
    scratch: Path | None  # our own file, deleted afterwards


def dir_device(path: Path) -> Device | None:
    """The block device holding a directory's filesystem, or None where it has none of its
    own (tmpfs, nfs, a btrfs subvolume's anonymous one)."""
    st = os.stat(path)
    if not os.major(st.st_dev):
        return None
    dev = by_number(os.major(st.st_dev), os.minor(st.st_dev))
    return dev if sysfs_dir(dev).exists() else None


def prepare(spec: str, size: int, force: bool, verb: str = "calibrate") -> Target:
    """The block device or directory to calibrate, checked for safety; a directory gets its
    scratch file written once with random data (a fresh file's holes or zeros would read
    without touching the device, or compress away on zram)."""
    p = Path(spec)
    if p.is_dir():
        dev = dir_device(p)
        free = shutil.disk_usage(p).free
        if free < size + 64 * MIB:
            raise KvprofError(f"{p} has {free >> 20} MiB free; the scratch file needs "
                              f"{size >> 20} MiB (use --size)", EX_USAGE)
        scratch = p / f".kvprof-calibrate-{os.getpid()}"
        try:
            fill(scratch, size)
        except OSError as e:
            scratch.unlink(missing_ok=True)
            raise KvprofError(f"cannot write the scratch file {scratch}: {e.strerror}",
                              EX_NOPERM if e.errno in (1, 13) else EX_USAGE) from None
        return Target(str(scratch), dev, size, scratch)
    if not p.exists() and "/" in spec:
        raise KvprofError(f"{spec}: no such device or directory", EX_USAGE)
    dev = resolve(spec)
    path = spec if "/" in spec else f"/dev/{dev.name}"
    if not stat.S_ISBLK(os.stat(path).st_mode):
        raise KvprofError(f"{path} is not a block device", EX_USAGE)
    why = in_use(dev)
    if why:
        raise KvprofError(f"refusing to {verb} on {path}: {why}; {verb} on a directory on it "
                          "instead", EX_USAGE)
    try:
        why = holds_data(path)
    except OSError as e:
        raise KvprofError(f"cannot read {path}: {e.strerror}",
                          EX_NOPERM if e.errno in (1, 13) else EX_USAGE) from None
    if why and not force:
        raise KvprofError(f"refusing to write to {path}: {why}", EX_USAGE,
                          hint=f"{verb} on a directory on it, or pass --force to overwrite "
                               "it")
    dev_size = int(read_attr(sysfs_dir(dev) / "size") or 0) * 512
    return Target(path, dev, min(size, dev_size), None)


def fill(path: Path, size: int) -> None:
    chunk = os.urandom(MIB)
    with open(path, "wb") as f:
        for _ in range(size // MIB):
            f.write(chunk)
        f.flush()
        os.fsync(f.fileno())
