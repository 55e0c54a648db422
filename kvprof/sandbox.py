"""The demo's private disk and cgroup, and their removal whatever happens.

A sparse backing file (in /dev/shm where there is one) behind a loop device, with ext4 on it
when mkfs.ext4 is installed, and a cgroup v2 this process joins for the run. Each step
registers its undo as soon as it has succeeded; leaving `sandbox()` undoes them in reverse,
also on errors and Ctrl-C, so the loop device, mount and backing file never stay behind.
"""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from kvprof.errors import EX_UNAVAILABLE, KvprofError

# In the backing file's, cgroup's and work directory's names, so leftovers are recognisable.
NAME = "kvprof-demo"


@dataclass(frozen=True)
class Disk:
    device: str  # /dev/loopN
    root: Path | None  # ext4 mount point; None: no file system, the raw device only
    size_bytes: int

    @property
    def kind(self) -> str:
        size = f"{self.size_bytes >> 20} MiB"
        return f"ext4, {size}" if self.root else f"raw, {size}, no mkfs.ext4"


@dataclass(frozen=True)
class Sandbox:
    work: Path  # private scratch directory (the mount point lives in it)
    disk: Disk
    cgroup: str | None  # None where no private cgroup could be made
    _stack: ExitStack = field(repr=False, compare=False)

    def defer(self, what: str, fn: Callable[[], object]) -> None:
        """Run `fn` on the way out, before the sandbox's own steps (a recorder of the disk
        stops before the disk goes); a failure is reported as 'could not {what}'."""
        self._stack.callback(_undo, what, fn)


@contextmanager
def sandbox(size_bytes: int) -> Iterator[Sandbox]:
    """Work directory, disk of `size_bytes` and cgroup up; all of it down again on exit."""
    with _teardown() as stack:
        work = Path(tempfile.mkdtemp(prefix=f"{NAME}-work-"))
        stack.callback(_undo, f"remove {work}", lambda: _remove_workdir(work))
        disk = _make_disk(stack, work, size_bytes)
        cgroup = _join_private_cgroup(stack)
        yield Sandbox(work, disk, cgroup, stack)


def _make_disk(stack: ExitStack, work: Path, size_bytes: int) -> Disk:
    """Backing file -> loop device -> ext4 mount; each step registers its undo on `stack`."""
    losetup = shutil.which("losetup")
    if losetup is None:
        raise KvprofError("the demo needs losetup (util-linux) to make its loop device",
                          EX_UNAVAILABLE)
    backing = _make_backing(size_bytes)
    stack.callback(_undo, f"remove {backing}", lambda: backing.unlink(missing_ok=True))
    device = _run([losetup, "--find", "--show", "--direct-io=off", str(backing)]).strip()
    stack.callback(_undo, f"detach {device}", lambda: _run([losetup, "-d", device]))

    mkfs = shutil.which("mkfs.ext4")
    if mkfs is None:
        return Disk(device, None, size_bytes)
    _run([mkfs, "-q", "-F", "-E", "lazy_itable_init=0,lazy_journal_init=0", device])
    mnt = work / "mnt"
    mnt.mkdir()
    _run(["mount", "-t", "ext4", "-o", "noatime", device, str(mnt)])
    stack.callback(_undo, f"unmount {mnt}", lambda: _umount(mnt))
    return Disk(device, mnt, size_bytes)


def _make_backing(size_bytes: int) -> Path:
    shm = Path("/dev/shm")
    where = shm if shm.is_dir() else Path(tempfile.gettempdir())
    st = os.statvfs(where)
    free = st.f_bavail * st.f_frsize
    # Sparse, but the workload fills most of it, and a full tmpfs under a loop device shows
    # up as I/O errors deep in the workload instead of a clear message here.
    if free < size_bytes:
        raise KvprofError(f"{where} has {free >> 20} MiB free; the demo needs "
                          f"{size_bytes >> 20} MiB", EX_UNAVAILABLE)
    path = where / f"{NAME}-{os.getpid()}.img"
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except OSError as e:
        raise KvprofError(f"cannot create {path}: {e.strerror}", EX_UNAVAILABLE) from None
    try:
        os.ftruncate(fd, size_bytes)
    except OSError as e:
        path.unlink(missing_ok=True)
        raise KvprofError(f"cannot size {path}: {e.strerror}", EX_UNAVAILABLE) from None
    finally:
        os.close(fd)
    return path


def _join_private_cgroup(stack: ExitStack) -> str | None:
    """Move this process (and so its children) into a new cgroup v2 for the run, so a
    recorder can keep only the sandbox's I/O: io_uring requests carry no device to filter
    on, and other programs' io_uring traffic would count too. None where that is not
    possible; the demo then records io_uring host-wide."""
    root = _cgroup2_root()
    if root is None:
        return None
    pid = str(os.getpid())
    home = root / _own_cgroup2().lstrip("/")
    cg = root / f"{NAME}-{pid}"
    try:
        cg.mkdir()
    except OSError:
        return None
    stack.callback(_undo, f"remove cgroup {cg}", cg.rmdir)
    try:
        (cg / "cgroup.procs").write_text(pid)
    except OSError:
        return None
    stack.callback(_undo, f"move back to cgroup {home}",
                   lambda: (home / "cgroup.procs").write_text(pid))
    return str(cg)


def _cgroup2_root() -> Path | None:
    try:
        for line in Path("/proc/self/mountinfo").read_text().splitlines():
            fields = line.split(" - ", 1)
            if len(fields) == 2 and fields[1].split()[0] == "cgroup2":
                return Path(fields[0].split()[4])
    except OSError:
        pass
    return None


def _own_cgroup2() -> str:
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        if line.startswith("0::"):
            return line[3:]
    return "/"


def _umount(mnt: Path) -> None:
    try:
        _run(["umount", str(mnt)])
    except KvprofError:
        # Something still holds it open; detach it now so the loop device can go too.
        _run(["umount", "-l", str(mnt)])


def _remove_workdir(work: Path) -> None:
    # Never recurse into a file system that failed to unmount.
    if not os.path.ismount(work / "mnt"):
        shutil.rmtree(work)


def _run(cmd: list[str]) -> str:
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, check=True)
    except FileNotFoundError:
        raise KvprofError(f"{cmd[0]} not found", EX_UNAVAILABLE) from None
    except subprocess.CalledProcessError as e:
        why = (e.stderr or "").strip().splitlines()
        raise KvprofError(f"{' '.join(cmd)}: {why[-1] if why else f'exit {e.returncode}'}",
                          EX_UNAVAILABLE) from None
    return res.stdout


def _undo(what: str, fn: Callable[[], object]) -> None:
    """Run one cleanup step; a failure is reported and the remaining steps still run."""
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - cleanup must go on whatever broke
        print(f"kvprof: warning: could not {what}: {e}", file=sys.stderr)


@contextmanager
def _teardown() -> Iterator[ExitStack]:
    """An ExitStack whose unwinding a second Ctrl-C cannot cut short (it takes a second)."""
    stack = ExitStack()
    try:
        yield stack
    finally:
        main = threading.current_thread() is threading.main_thread()
        old = signal.signal(signal.SIGINT, signal.SIG_IGN) if main else None
        try:
            stack.close()
        finally:
            if main:
                signal.signal(signal.SIGINT, signal.SIG_DFL if old is None else old)
