"""Block devices by name or path, as the kernel numbers them."""
from __future__ import annotations

import os
import stat
from dataclasses import dataclass
from pathlib import Path

from kvprof.errors import EX_USAGE, KvprofError

SYS_BLOCK = Path("/sys/class/block")


@dataclass(frozen=True)
class Device:
    name: str
    major: int
    minor: int

    @property
    def kernel_dev(self) -> int:
        """dev_t as block tracepoints report it (MKDEV: major << 20 | minor)."""
        return (self.major << 20) | self.minor


def list_devices() -> list[Device]:
    out = []
    for entry in sorted(SYS_BLOCK.iterdir()) if SYS_BLOCK.exists() else []:
        try:
            major, minor = (entry / "dev").read_text().strip().split(":")
        except OSError:
            continue
        out.append(Device(entry.name, int(major), int(minor)))
    return out


def by_number(major: int, minor: int) -> Device:
    try:
        uevent = Path(f"/sys/dev/block/{major}:{minor}/uevent").read_text()
        name = next(line[8:] for line in uevent.splitlines() if line.startswith("DEVNAME="))
    except (OSError, StopIteration):
        # Container runtimes mask /sys/dev/block (podman's default masked paths): the
        # class directory names the same devices.
        name = next((d.name for d in list_devices() if (d.major, d.minor) == (major, minor)),
                    f"{major}:{minor}")
    return Device(name, major, minor)


def resolve(spec: str) -> Device:
    """A device named like 'nvme0n1' or 'loop3', or a path such as '/dev/loop3'."""
    if "/" in spec:
        try:
            st = os.stat(spec)
        except OSError as e:
            raise KvprofError(f"device {spec!r}: {e.strerror}", EX_USAGE) from None
        if not stat.S_ISBLK(st.st_mode):
            raise KvprofError(f"{spec!r} is not a block device", EX_USAGE)
        return by_number(os.major(st.st_rdev), os.minor(st.st_rdev))
    for dev in list_devices():
        if dev.name == spec:
            return dev
    names = " ".join(d.name for d in list_devices()) or "(none found in /sys/class/block)"
    raise KvprofError(f"unknown device {spec!r}; block devices here: {names}", EX_USAGE)


LIMITS = ("logical_block_size", "physical_block_size", "minimum_io_size", "optimal_io_size",
          "max_sectors_kb")


def queue_limits(dev: Device) -> dict[str, int]:
    """The request sizes the kernel says the device takes and prefers (a partition: its
    disk's queue): logical and physical block size, minimum and optimal I/O size, largest
    request in KiB. Empty where sysfs has none."""
    node = SYS_BLOCK / dev.name
    queue = node / "queue"
    if not queue.exists():
        queue = node.resolve().parent / "queue"
    out = {}
    for name in LIMITS:
        try:
            out[name] = int((queue / name).read_text())
        except (OSError, ValueError):
            continue
    return out
