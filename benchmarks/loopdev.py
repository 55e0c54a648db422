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
def loop_device(name: str, size: int = 256 << 20, data: int = 0,
                under: Path | None = None) -> Iterator[str]:
    """Yields the device path (/dev/loopN); detached and its file removed afterwards. The
    file is sparse beyond its first `data` bytes (random): a read of a hole copies the one
    shared zero page, which costs the loop worker next to nothing, so the CPU that submits
    is all that limits a sparse device; reads of data copy real pages, as a device moves
    real data. The file is in /dev/shm, or with `under` a directory on a disk, read and
    written with direct I/O (losetup --direct-io): the disk's latency, not the page cache's."""
    backing = Path(under or "/dev/shm") / f"kvprof-{name}-{os.getpid()}.img"
    with open(backing, "wb") as f:
        for _ in range(data >> 20):
            f.write(os.urandom(1 << 20))
    os.truncate(backing, size)
    direct = ["--direct-io=on"] if under is not None else []
    dev = subprocess.run(["losetup", "--find", "--show", *direct, str(backing)], check=True,
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


def memory_mib(pid: int) -> tuple[float, float, float]:
    """(RSS, anonymous, file-backed) MiB of a process. The anonymous part is what it
    allocated; the file-backed part is mostly library code (LLVM's, from compiling the
    probes), shared and dropped by the kernel under memory pressure."""
    got = {}
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines()[1:]:
        key, _, rest = line.partition(":")
        got[key] = int(rest.split()[0]) / 1024 if rest.split() else 0.0
    return got.get("Rss", 0.0), got.get("Anonymous", 0.0), \
        got.get("Rss", 0.0) - got.get("Anonymous", 0.0)


def growth_per_min(samples: list[tuple[float, float]]) -> float:
    """MiB a minute over the second half of (seconds, MiB) samples (the first half holds
    the warm-up: DuckDB's cache filling, the row caches)."""
    half = samples[len(samples) // 2:]
    if len(half) < 2:
        return 0.0
    return (half[-1][1] - half[0][1]) / max(1e-9, (half[-1][0] - half[0][0]) / 60)
