"""The files the syscall layer traces: which (process, fd) the probes follow, and their paths.

The probe follows a file from the openat that opened it to its close and gives each open an
id, which syscall rows carry; open records come through their own ring with the path as the
process passed it, resolved here to an absolute path. A file that is not a regular one is taken
out of the kernel's map at once, its rows meanwhile dropped and counted. Files already open at
attach are found in /proc and put into the map by hand, with ids of their own range."""
from __future__ import annotations

import dataclasses
import os
import stat
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from kvprof import caches
from kvprof.capture.layout import Code, Struct

SEEDED_IDS = 1 << 40  # KVPROF_SEEDED_IDS in kvprof/layers/syscall/probe.bpf.c
CLOSED = 0xFFFFFFFF  # KVPROF_CLOSED: the record says the file was closed
DUP = 0xFFFFFFFE  # KVPROF_DUP: a descriptor duplicated from `from_id`
PATH_MAX = 240  # KVPROF_PATH_MAX
O_DIRECT = getattr(os, "O_DIRECT", 0o40000)

# struct kvprof_open in kvprof/layers/syscall/probe.bpf.c, as numpy reads it.
OPEN_DTYPE = np.dtype([("ts_ns", "<u8"), ("id", "<u8"), ("from_id", "<u8"), ("tgid", "<u4"),
                       ("fd", "<i4"), ("flags", "<u4"), ("pad", "<u4"),
                       ("path", f"S{PATH_MAX}")])
# Checked against the C at load, with the syscall layer (kvprof/capture/layout.py).
SYSCALL_C = "kvprof/layers/syscall/probe.bpf.c"
LAYOUTS = (Struct("kvprof_open", OPEN_DTYPE, __name__, "open_layout", c_file=SYSCALL_C),)
CODES = tuple(Code(macro, value, __name__, SYSCALL_C) for macro, value in (
    ("KVPROF_SEEDED_IDS", SEEDED_IDS), ("KVPROF_CLOSED", CLOSED), ("KVPROF_DUP", DUP),
    ("KVPROF_PATH_MAX", PATH_MAX)))
# Kernel interfaces and devices are not storage an engine offloads to (the probe skips them
# too, for the paths it sees; this catches them behind relative paths or links). Files in
# /dev/shm (a tmpfs) are kept.
_SKIP_PREFIXES = ("/dev/", "/proc/", "/sys/")


@dataclass(frozen=True)
class OpenFile:
    path: str
    tgid: int
    fd: int
    direct: bool
    cache: str  # kvprof/caches.py's label
    inode: int | None  # None when the file was gone before it could be looked at


class FileTable:
    """id -> OpenFile for the files the probes follow; used by capture's drain thread."""

    def __init__(self, forget: Callable[[int, int, int], None],
                 rules: tuple[caches.Rule, ...] = caches.BUILTIN, proc: Path = Path("/proc")):
        self._forget = forget  # takes (tgid, fd) out of the kernel's map if it still has id
        self._rules = rules
        self._proc = proc
        self.files: dict[int, OpenFile] = {}
        self.not_regular: set[int] = set()
        # Ids closed: read from the ring but maybe not yet all their rows (`_read`), then
        # with every row drained (`_closed`) until take() names those rows and forgets them.
        self._read: set[int] = set()
        self._closed: set[int] = set()
        self._lock = threading.Lock()

    def opened(self, recs: np.ndarray) -> None:
        """Open records from the kernel, in order."""
        for r in recs.tolist():
            ts, fid, from_id, tgid, fd, flags, _, raw = r
            if flags == CLOSED:
                self._read.add(fid)
                continue
            if flags == DUP:
                f = self.files.get(from_id)
                if f is not None:
                    self.files[fid] = dataclasses.replace(f, fd=fd)
                elif from_id in self.not_regular:
                    self.not_regular.add(fid)
                continue
            path = self._absolute(raw.split(b"\0", 1)[0].decode(errors="replace"), tgid, fd)
            regular, inode = self._regular(path)
            if not regular:
                self.not_regular.add(fid)
                self._forget(tgid, fd, fid)
                continue
            self.files[fid] = OpenFile(path, tgid, fd, bool(flags & O_DIRECT),
                                       caches.label(path, self._rules), inode)

    def _absolute(self, path: str, tgid: int, fd: int) -> str:
        if path.startswith("/"):
            return os.path.normpath(path)
        # Relative to the cwd or a directory fd: the kernel's own name for the open file.
        try:
            return os.readlink(self._proc / str(tgid) / "fd" / str(fd))
        except OSError:
            try:
                return os.path.normpath(os.path.join(
                    os.readlink(self._proc / str(tgid) / "cwd"), path))
            except OSError:
                return path

    @staticmethod
    def _regular(path: str) -> tuple[bool, int | None]:
        """Whether the path is a regular file, and its inode."""
        if path.startswith(_SKIP_PREFIXES) and not path.startswith("/dev/shm/"):
            return False, None
        try:
            st = os.stat(path)
        except OSError:
            return True, None  # gone already (unlinked chunk files are common): it was a file
        return stat.S_ISREG(st.st_mode), st.st_ino

    def seed(self, tgids: Iterable[int]) -> list[tuple[int, int, int, bool]]:
        """The regular files the processes hold open now, as (id, tgid, fd, direct) for the
        kernel's map; their ids are this table's."""
        out = []
        next_id = SEEDED_IDS + len(self.files)
        for tgid in tgids:
            fd_dir = self._proc / str(tgid) / "fd"
            try:
                fds = sorted(int(n) for n in os.listdir(fd_dir) if n.isdigit())
            except OSError:
                continue
            for fd in fds:
                try:
                    path = os.readlink(fd_dir / str(fd))
                    regular, inode = self._regular(path)
                    if not path.startswith("/") or not regular:
                        continue
                    direct = _fdinfo_flags(self._proc / str(tgid) / "fdinfo" / str(fd)) \
                        & O_DIRECT != 0
                except (OSError, ValueError):
                    continue
                next_id += 1
                self.files[next_id] = OpenFile(path, tgid, fd, direct,
                                               caches.label(path, self._rules), inode)
                out.append((next_id, tgid, fd, direct))
        return out

    def settle(self) -> None:
        """The events ring has been drained after the close records were read: those files'
        rows are all drained now (each row was written before its file's close record)."""
        with self._lock:
            self._closed |= self._read
        self._read = set()

    def closed_since(self) -> set[int]:
        """Ids whose rows are all drained, handed over once: after the rows drained until
        now are named, they can go."""
        with self._lock:
            done, self._closed = self._closed, set()
        return done

    def forget(self, ids: set[int]) -> None:
        for fid in ids:
            self.files.pop(fid, None)
            self.not_regular.discard(fid)

    def known(self, fid: int) -> bool:
        """Whether the id's open record has been read (named, or found not a file)."""
        return fid in self.files or fid in self.not_regular

    def lookup(self, ids: np.ndarray) -> tuple[list[OpenFile | None], np.ndarray]:
        """The files of the unique ids (None when unknown), and which ids are not regular
        files."""
        found = [self.files.get(int(i)) for i in ids.tolist()]
        dropped = np.array([int(i) in self.not_regular for i in ids.tolist()], bool)
        return found, dropped


def _fdinfo_flags(path: Path) -> int:
    for line in path.read_text().splitlines():
        if line.startswith("flags:"):
            return int(line.split()[1], 8)
    return 0


def all_tgids(proc: Path = Path("/proc")) -> list[int]:
    return [int(d) for d in os.listdir(proc) if d.isdigit()]
