"""What a device can do for the access patterns of prefill and decode, as kvprof keeps it.

The patterns (`PATTERNS`), which of them bound each operation (`LIMITS`, for capacity idle),
a device's identity (model and serial where the kernel knows them) and the stored result per
device (`load`, `save`, `for_devices`): read by the recorder, the store and correlate. The
measuring itself, with fio, is `kvprof calibrate` (kvprof/commands/calibrate.py).
"""
from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

from kvprof.devices import Device

VERSION = 1
MIB = 1 << 20


@dataclass(frozen=True)
class Pattern:
    name: str
    label: str
    rw: str  # fio's --rw
    bs: int
    iodepth: int
    engine: str  # fio's --ioengine

    @property
    def op(self) -> str:
        return "write" if "write" in self.rw else "read"


PATTERNS = (
    Pattern("seq_write_1m", "1 MiB sequential writes, io_uring QD8 (prefill storing KV)",
            "write", MIB, 8, "io_uring"),
    Pattern("seq_read_1m", "1 MiB sequential reads, io_uring QD8 (reloading a prefix)",
            "read", MIB, 8, "io_uring"),
    Pattern("rand_read_4k_qd1", "4 KiB random reads, io_uring QD1 (decode, one at a time)",
            "randread", 4096, 1, "io_uring"),
    Pattern("rand_read_4k_qd32", "4 KiB random reads, io_uring QD32 (decode, queued deep)",
            "randread", 4096, 32, "io_uring"),
    Pattern("rand_write_4k_qd32", "4 KiB random writes, io_uring QD32", "randwrite", 4096, 32,
            "io_uring"),
    Pattern("psync_seq_write_1m", "1 MiB sequential pwrite, QD1 (thread-pool offload)",
            "write", MIB, 1, "psync"),
    Pattern("psync_rand_read_4k", "4 KiB random pread, QD1 (thread-pool offload)",
            "randread", 4096, 1, "psync"),
)
BY_NAME = {p.name: p for p in PATTERNS}
# Per op, the patterns that bound what a phase can get: its bandwidth and its IOPS.
LIMITS = {"write": ("seq_write_1m", "rand_write_4k_qd32"),
          "read": ("seq_read_1m", "rand_read_4k_qd32")}


def default_store() -> Path:
    """Where calibrations are kept: $KVPROF_CALIBRATION_DIR, else a system directory for root
    (the recorder runs as root) and the user's data directory otherwise."""
    env = os.environ.get("KVPROF_CALIBRATION_DIR")
    if env:
        return Path(env)
    if os.geteuid() == 0:
        return Path("/var/lib/kvprof/calibration")
    return Path.home() / ".local/share/kvprof/calibration"


def sysfs_dir(dev: Device) -> Path:
    return Path("/sys/class/block") / dev.name


def read_attr(path: Path) -> str:
    try:
        return path.read_text().strip()
    except OSError:
        return ""


def identity(dev: Device) -> dict:
    """The device's name, numbers and, where the kernel knows them, model and serial (a
    partition: its disk's); `key` names it across reboots and renumbering."""
    sys_dev = sysfs_dir(dev)
    disk = sys_dev.resolve().parent if (sys_dev / "partition").exists() else sys_dev.resolve()
    model = read_attr(disk / "device/model")
    serial = (read_attr(disk / "device/serial") or read_attr(disk / "serial")
              or read_attr(disk / "wwid"))
    backing = read_attr(disk / "loop/backing_file")
    if model or serial:
        key = " ".join(x for x in (model, serial) if x)
        if disk != sys_dev.resolve():
            key += f" part{read_attr(sys_dev / 'partition')}"
    elif backing:
        key = f"loop {backing}"
    else:
        key = dev.name
    size = int(read_attr(sys_dev / "size") or 0) * 512
    return {"name": dev.name, "major": dev.major, "minor": dev.minor, "model": model,
            "serial": serial, "key": key, "size_bytes": size,
            "rotational": read_attr(disk / "queue/rotational") == "1"}


def store_path(store: Path, key: str) -> Path:
    return store / (re.sub(r"[^A-Za-z0-9._-]+", "_", key).strip("_") + ".json")


def load(key: str, store: Path | None = None) -> dict | None:
    """The stored calibration of the device named `key`, or None."""
    path = store_path(store or default_store(), key)
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) and data.get("version") == VERSION else None


def for_devices(devices: list[dict], store: Path | None = None) -> dict[str, dict]:
    """Device name -> its calibration, for the devices (session rows' dicts) that have one."""
    out = {}
    for d in devices:
        found = load(d["key"], store) if d.get("key") else None
        if found is not None:
            out[d["name"]] = found
    return out


def save(result: dict, store: Path | None = None) -> Path | None:
    """Keep the result for the device's later sessions (not for a target with no device);
    patterns measured before and not in this run are kept."""
    if not result.get("key"):
        return None
    store = store or default_store()
    store.mkdir(parents=True, exist_ok=True)
    path = store_path(store, result["key"])
    kept = load(result["key"], store)
    if kept is not None:
        # A run of some patterns updates those and keeps the others measured before.
        result = {**result, "patterns": {**kept["patterns"], **result["patterns"]}}
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(result, indent=2))
    tmp.replace(path)
    return path
