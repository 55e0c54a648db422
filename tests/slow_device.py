"""A block device with a latency of its own, for tests, benchmarks and people.

Every other device here is a memory copy (a loop device over /dev/shm, zram) or one the
kernel's io controller throttles: neither waits on anything, so one request at a time keeps
them as busy as many. This one does: Debian's nbdkit serves the blocks from memory and holds
each request for a fixed time on a thread of its own (the `delay` filter; the `rate` filter
caps the bandwidth of the whole server), `nbdfuse` shows the export as a file, and a loop
device with direct I/O sits on that file. Concurrent requests wait out their delays side by
side, as on an SSD: one reader at a time is latency-bound, several overlap.

FUSE and NBD add ~0.3 ms to each request on these 2-CPU VMs; delays are whole milliseconds
(nbdkit 1.32 takes `1.5ms` as 1 ms), so `read_ms` and `write_ms` are integers.

    python -m tests.slow_device up DIR [--read-ms 2] [--write-ms 2] [--rate 800M] [--size 2G]
    python -m tests.slow_device down DIR

(`bash scripts/dev.sh slow-device ...` does the same as root.) `up` prints the loop device;
what it started is named in DIR, so `down` undoes it from any shell.
"""
from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

TOOLS = {"nbdkit": "nbdkit", "nbdfuse": "libnbd-bin"}


def unavailable() -> str | None:
    """Why such a device cannot be made here, in one line, or None."""
    missing = [pkg for tool, pkg in TOOLS.items() if shutil.which(tool) is None]
    if missing:
        return f"a slow device needs {' and '.join(missing)} (apt-get install {' '.join(missing)})"
    if os.geteuid() != 0:
        return "a slow device needs root (losetup, FUSE mount)"
    if not Path("/dev/fuse").exists():
        return "a slow device needs /dev/fuse (modprobe fuse)"
    return None


@dataclass(frozen=True)
class SlowDevice:
    name: str  # loopN
    read_ms: int
    write_ms: int
    rate_bps: int | None  # bytes per second, the server's total; None: no cap
    dir: Path

    @property
    def path(self) -> str:
        return f"/dev/{self.name}"


def _wait(what, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if what():
            return True
        time.sleep(0.05)
    return False


def up(dir: Path, read_ms: int = 2, write_ms: int = 2, rate_bps: int | None = None,
       size: int = 2 << 30) -> SlowDevice:
    """Makes the device; on any failure undoes what it did and raises RuntimeError."""
    why = unavailable()
    if why:
        raise RuntimeError(why)
    dir.mkdir(parents=True, exist_ok=True)
    down(dir)  # what an earlier run left there
    (dir / "mnt").mkdir(exist_ok=True)
    sock = dir / "sock"
    # nbdkit daemonises once it listens (-P: its pid). Kept in the foreground under a
    # parent that exits (the command line's `up`), it shuts its connections down.
    # Its default 16 threads and nbdfuse's 4 connections served 3-4 requests at a time
    # (fio, 40 ms: four jobs 3.1x one, eight 4.4x); 64 threads and 8 connections serve 8
    # jobs 7x one.
    args = ["nbdkit", "--unix", str(sock), "-P", str(dir / "nbdkit.pid"), "--threads", "64",
            "--filter=delay"]
    extra = [f"rdelay={int(read_ms)}ms", f"wdelay={int(write_ms)}ms"]
    if rate_bps:  # nbdkit counts bits; a burst of 50 ms of the rate, not its default 2 s
        args.append("--filter=rate")
        extra += [f"rate={int(rate_bps) * 8}", "burstiness=0.05"]
    try:
        with open(dir / "nbdkit.log", "wb") as log:
            kit = subprocess.run([*args, "memory", f"size={size}", *extra],
                                 stdin=subprocess.DEVNULL, stdout=log, stderr=log)
        if kit.returncode != 0 or not _wait(sock.exists):
            raise RuntimeError(f"nbdkit did not start: {_tail(dir / 'nbdkit.log')}")
        disk = dir / "mnt" / "disk"
        with open(dir / "nbdfuse.log", "wb") as log:
            fuse = subprocess.Popen(["nbdfuse", "-C", "8", str(disk), "--unix", str(sock)],
                                    stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                                    start_new_session=True)
        (dir / "nbdfuse.pid").write_text(str(fuse.pid))
        if not _wait(disk.exists):
            raise RuntimeError(f"nbdfuse did not mount: {_tail(dir / 'nbdfuse.log')}")
        loop = subprocess.run(["losetup", "--find", "--show", "--direct-io=on", str(disk)],
                              capture_output=True, text=True)
        if loop.returncode != 0:
            raise RuntimeError(f"losetup: {loop.stderr.strip()}")
        name = Path(loop.stdout.strip()).name
        (dir / "loop").write_text(name)
        if Path(f"/sys/block/{name}/loop/dio").read_text().strip() != "1":
            raise RuntimeError(f"{name} has no direct I/O over {disk}: reads would hit the "
                               "page cache, not the device")
    except BaseException:
        down(dir)
        raise
    return SlowDevice(name, int(read_ms), int(write_ms), rate_bps, dir)


def _tail(log: Path) -> str:
    try:
        lines = log.read_text(errors="replace").strip().splitlines()
    except OSError:
        return "(no log)"
    return lines[-1] if lines else "(no output)"


def _kill(pidfile: Path) -> None:
    try:
        pid = int(pidfile.read_text())
    except (OSError, ValueError):
        return
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        pidfile.unlink(missing_ok=True)
        return
    if not _wait(lambda: not Path(f"/proc/{pid}").exists() or _zombie(pid), 5):
        os.kill(pid, signal.SIGKILL)
    try:
        os.waitpid(pid, os.WNOHANG)  # ours: reap it; another shell's: not a child
    except ChildProcessError:
        pass
    pidfile.unlink(missing_ok=True)


def _zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ", 1)[1][0] == "Z"
    except (OSError, IndexError):
        return True


def down(dir: Path) -> None:
    """Undoes `up` in `dir`, whatever it got to: loop device, FUSE mount, nbdfuse, nbdkit."""
    loop = dir / "loop"
    if loop.exists():
        subprocess.run(["losetup", "-d", f"/dev/{loop.read_text().strip()}"],
                       capture_output=True)
        loop.unlink()
    mnt = dir / "mnt"
    if mnt.is_dir() and os.path.ismount(mnt):
        # nbdfuse leaves when its mount goes (fusermount3 -u does not find it mounted here)
        subprocess.run(["umount", str(mnt)], capture_output=True)
    _kill(dir / "nbdfuse.pid")
    _kill(dir / "nbdkit.pid")
    (dir / "sock").unlink(missing_ok=True)


@contextmanager
def slow_device(dir: Path, read_ms: int = 2, write_ms: int = 2, rate_bps: int | None = None,
                size: int = 2 << 30) -> Iterator[SlowDevice]:
    dev = up(dir, read_ms, write_ms, rate_bps, size)
    try:
        yield dev
    finally:
        down(dir)


def _rate(text: str) -> int:
    """Bytes per second from 800M, 1G, 200K or a plain number (powers of 1000)."""
    scale = {"K": 10**3, "M": 10**6, "G": 10**9}
    unit = text[-1:].upper()
    return int(float(text[:-1]) * scale[unit]) if unit in scale else int(text)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="slow-device", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    u = sub.add_parser("up", help="make the device; prints /dev/loopN")
    u.add_argument("dir", type=Path)
    u.add_argument("--read-ms", type=int, default=2, help="each read waits this long")
    u.add_argument("--write-ms", type=int, default=2, help="each write waits this long")
    u.add_argument("--rate", type=_rate, default=None,
                   help="bandwidth cap of the whole device, bytes/s (800M, 1G)")
    u.add_argument("--size", type=_rate, default=2 << 30, help="bytes (memory, sparse)")
    d = sub.add_parser("down", help="remove the device made in DIR")
    d.add_argument("dir", type=Path)
    a = p.parse_args(argv)
    if a.cmd == "down":
        down(a.dir)
        return 0
    try:
        dev = up(a.dir, a.read_ms, a.write_ms, a.rate, a.size)
    except RuntimeError as e:
        print(f"slow-device: {e}", file=sys.stderr)
        return 77 if "root" in str(e) else 69
    print(dev.path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
