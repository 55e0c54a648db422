"""A private loop device over a sparse file in /dev/shm, for the benchmarks that need one."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def loop_device(name: str, size: int = 256 << 20) -> Iterator[str]:
    """Yields the device path (/dev/loopN); detached and its file removed afterwards."""
    backing = Path(f"/dev/shm/kvprof-{name}-{os.getpid()}.img")
    backing.write_bytes(b"")
    os.truncate(backing, size)
    dev = subprocess.run(["losetup", "--find", "--show", str(backing)], check=True,
                         capture_output=True, text=True).stdout.strip()
    try:
        yield dev
    finally:
        subprocess.run(["losetup", "-d", dev], check=False)
        backing.unlink(missing_ok=True)


def disk_reads(dev: str) -> int:
    """Reads completed, the first field of /sys/block/DEV/stat: the kernel's own count."""
    return int(Path(f"/sys/block/{Path(dev).name}/stat").read_text().split()[0])


def report_json(session: str | Path) -> dict:
    """`kvprof report SESSION --json`, parsed."""
    return json.loads(subprocess.run([sys.executable, "-m", "kvprof", "report", str(session),
                                      "--json"], check=True, capture_output=True,
                                     text=True).stdout)
