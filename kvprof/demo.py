"""`kvprof demo`: the main job on a built-in default.

A small KV-cache-offload workload runs on a private loop device (a sparse file in /dev/shm,
with ext4 on it), recorded live, and the per-phase report is printed:

- prefill writes new KV chunks: 8 MiB each, 1 MiB O_DIRECT writes from two threads, fsync;
- decode reads random 4 KiB pieces of the chunks written so far, a few per token step with
  short pauses between steps, so the device is mostly idle, as in real decode; with fio
  installed, part of decode goes through io_uring so that layer shows up too;
- idle: a short pause between requests.

Each phase is announced through the real marker protocol, exactly as an engine would.
Without the privileges live capture needs, the report of a recorded sample is shown instead.
The loop device, mount and backing file are always removed again, also on errors and Ctrl-C.
"""
from __future__ import annotations

import mmap
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from kvprof import system
from kvprof.errors import EX_NOPERM, EX_SOFTWARE, EX_UNAVAILABLE, KvprofError
from kvprof.markers import Marker
from kvprof.record import ATTACH_TIMEOUT_S, BackgroundRecorder, RecordOptions
from kvprof.store import DB_FILE

SAMPLE_DIR = Path(__file__).resolve().parent.parent / "samples" / "demo"
ENGINE = "kvprof-demo"

BACKING_BYTES = 256 << 20
CHUNK_BYTES = 8 << 20
BLOCK_BYTES = 1 << 20  # prefill write size
PIECE_BYTES = 4 << 10  # decode read size
CHUNKS_PER_PREFILL = 4
# Like a KV cache with a capacity: the oldest chunks are evicted, so any --seconds fits the
# 256 MiB disk (160 MiB of chunks leaves room for ext4's journal and inode tables).
MAX_LIVE_CHUNKS = 20
WRITERS = 2

DECODE_S = 1.5
MIN_DECODE_S = 0.2
READS_PER_TOKEN = 8
TOKEN_GAP_S = 0.002
IDLE_S = 0.3
# A new round starts only if prefill, a short decode and the idle pause still fit.
MIN_ROUND_S = 0.6
FIO_S = 0.5
# fio unthrottled does ~80k IOPS on a loop device; decode pulls KV at token pace instead,
# which also keeps a session (and the committed sample) small.
FIO_RATE_IOPS = 2000


def run_demo(seconds: float = 6.0, out: str | None = None, as_json: bool = False,
             tui: bool = False) -> int:
    """Run the workload for about `seconds`, recorded live, then print the report. With
    `tui`, the `kvprof top` dashboard shows it live first (and the sample, unprivileged)."""
    if not system.check_privilege().ok:
        return _show_sample(as_json, "live capture needs root (or CAP_BPF+CAP_PERFMON)", tui)
    if not system.effective_caps() >> system.CAP_SYS_ADMIN & 1:
        # CAP_BPF+CAP_PERFMON let `record` trace, but not make a loop device or mount it.
        return _show_sample(as_json, "the live demo needs root to make its loop device", tui)
    session = Path(out) if out else _default_out()
    try:
        _record_demo(session, seconds, tui)
    except BaseException:
        if out is None:
            # A run that never reached its report leaves no unannounced directory behind.
            shutil.rmtree(session, ignore_errors=True)
        raise
    _print_report(session, str(session), as_json)
    if out is None:
        print(f"kvprof demo: session kept in {session}; replay with: kvprof report {session}",
              file=sys.stderr)
    return 0


def _record_demo(session: Path, seconds: float, tui: bool = False) -> None:
    """Disk, cgroup and recorder up; the workload; everything down again, whatever happens."""
    with _teardown() as stack:
        work = Path(tempfile.mkdtemp(prefix="kvprof-demo-work-"))
        stack.callback(_undo, f"remove {work}", lambda: _remove_workdir(work))
        disk = _make_disk(stack, work)
        cgroup = _join_private_cgroup(stack)
        rec = BackgroundRecorder(RecordOptions(out=str(session), devices=[disk.device],
                                      cgroups=[cgroup] if cgroup else [],
                                      socket=str(work / "marks.sock")))
        stack.callback(_undo, "stop the recorder", lambda: rec.finish(ATTACH_TIMEOUT_S))
        rec.start()
        print(f"kvprof demo: recording {seconds:g} s of KV-offload rounds (prefill writes, "
              f"decode reads) on {disk.device} ({disk.kind}); Ctrl-C ends early",
              file=sys.stderr, flush=True)
        marker = Marker(rec.opts.socket, engine=ENGINE)
        try:
            if tui:
                _workload_under_dashboard(rec, _KVStore(disk), marker, seconds)
            else:
                _workload(_KVStore(disk), marker, seconds)
        except KeyboardInterrupt:
            pass  # end early, like `kvprof record`: what was recorded is still reported
        except OSError as e:
            raise KvprofError(f"demo workload on {disk.device} failed: {e}", EX_SOFTWARE) from None
        finally:
            marker.close()
        rec.finish()


# -- without privileges: the recorded sample -------------------------------------------------

def _show_sample(as_json: bool, why: str, tui: bool = False) -> int:
    if not (SAMPLE_DIR / DB_FILE).exists():
        raise KvprofError(f"{why}, and no recorded sample is installed at {SAMPLE_DIR}",
                          EX_NOPERM, hint="run: sudo kvprof demo")
    print(f"kvprof demo: {why}; showing a recorded sample instead", file=sys.stderr, flush=True)
    if tui:
        from kvprof.top import run_replay

        return run_replay(str(SAMPLE_DIR))
    _print_report(SAMPLE_DIR, "samples/demo", as_json)
    return 0


def _print_report(session: Path, name: str, as_json: bool) -> None:
    from kvprof.correlate import summarize
    from kvprof.rowsource import SqlRows
    from kvprof.report import to_json, to_text
    from kvprof.store import open_session

    con = open_session(session)
    try:
        summary = summarize(SqlRows(con))
    finally:
        con.close()
    sys.stdout.write(to_json(summary) + "\n" if as_json else to_text(summary, name))
    sys.stdout.flush()


def _default_out() -> Path:
    """A new ./kvprof-demo-DATE-TIME, or one in the temp dir when the cwd is not writable."""
    base = Path(".") if os.access(".", os.W_OK) else Path(tempfile.gettempdir())
    stem = datetime.now().strftime("kvprof-demo-%Y%m%d-%H%M%S")
    path, n = base / stem, 1
    while path.exists():
        n += 1
        path = base / f"{stem}-{n}"
    return path


# -- the private disk -------------------------------------------------------------------------

@dataclass(frozen=True)
class _Disk:
    device: str  # /dev/loopN
    root: Path | None  # ext4 mount point; None: chunks live at offsets of the raw device

    @property
    def kind(self) -> str:
        size = f"{BACKING_BYTES >> 20} MiB"
        return f"ext4, {size}" if self.root else f"raw, {size}, no mkfs.ext4"


def _make_disk(stack: ExitStack, work: Path) -> _Disk:
    """Backing file -> loop device -> ext4 mount; each step registers its undo on `stack`."""
    losetup = shutil.which("losetup")
    if losetup is None:
        raise KvprofError("the demo needs losetup (util-linux) to make its loop device",
                          EX_UNAVAILABLE)
    backing = _make_backing()
    stack.callback(_undo, f"remove {backing}", lambda: backing.unlink(missing_ok=True))
    device = _run([losetup, "--find", "--show", "--direct-io=off", str(backing)]).strip()
    stack.callback(_undo, f"detach {device}", lambda: _run([losetup, "-d", device]))

    mkfs = shutil.which("mkfs.ext4")
    if mkfs is None:
        return _Disk(device, None)
    _run([mkfs, "-q", "-F", "-E", "lazy_itable_init=0,lazy_journal_init=0", device])
    mnt = work / "mnt"
    mnt.mkdir()
    _run(["mount", "-t", "ext4", "-o", "noatime", device, str(mnt)])
    stack.callback(_undo, f"unmount {mnt}", lambda: _umount(mnt))
    return _Disk(device, mnt)


def _make_backing() -> Path:
    shm = Path("/dev/shm")
    where = shm if shm.is_dir() else Path(tempfile.gettempdir())
    st = os.statvfs(where)
    free = st.f_bavail * st.f_frsize
    # Sparse, but the workload fills most of it, and a full tmpfs under a loop device shows
    # up as I/O errors deep in the workload instead of a clear message here.
    if free < BACKING_BYTES:
        raise KvprofError(f"{where} has {free >> 20} MiB free; the demo needs "
                          f"{BACKING_BYTES >> 20} MiB", EX_UNAVAILABLE)
    path = where / f"kvprof-demo-{os.getpid()}.img"
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except OSError as e:
        raise KvprofError(f"cannot create {path}: {e.strerror}", EX_UNAVAILABLE) from None
    try:
        os.ftruncate(fd, BACKING_BYTES)
    except OSError as e:
        path.unlink(missing_ok=True)
        raise KvprofError(f"cannot size {path}: {e.strerror}", EX_UNAVAILABLE) from None
    finally:
        os.close(fd)
    return path


def _join_private_cgroup(stack: ExitStack) -> str | None:
    """Move this process (and so fio, its child) into a new cgroup v2 for the run, so the
    recorder keeps only the demo's I/O: io_uring requests carry no device to filter on, and
    other programs' io_uring traffic would count too. None where that is not possible; the
    demo then records io_uring host-wide."""
    root = _cgroup2_root()
    if root is None:
        return None
    pid = str(os.getpid())
    home = root / _own_cgroup2().lstrip("/")
    cg = root / f"kvprof-demo-{pid}"
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


# -- the workload -------------------------------------------------------------------------------

@dataclass(frozen=True)
class _Chunk:
    path: str
    offset: int  # 0 for a chunk file; the slot's start on the raw device


class _KVStore:
    """Offloaded KV chunks: one file per chunk on ext4, or fixed slots on the raw device."""

    def __init__(self, disk: _Disk):
        self.disk = disk
        self.live: list[_Chunk] = []
        self._made = 0

    def _new(self) -> _Chunk:
        n, self._made = self._made, self._made + 1
        if self.disk.root is None:
            return _Chunk(self.disk.device, (n % MAX_LIVE_CHUNKS) * CHUNK_BYTES)
        return _Chunk(str(self.disk.root / f"kv-{n:05d}.bin"), 0)

    def _evict_for(self, count: int) -> None:
        while self.live and len(self.live) + count > MAX_LIVE_CHUNKS:
            old = self.live.pop(0)
            if self.disk.root is not None:
                os.unlink(old.path)

    def prefill(self, pool: ThreadPoolExecutor, count: int) -> None:
        self._evict_for(count)
        chunks = [self._new() for _ in range(count)]
        create = self.disk.root is not None
        list(pool.map(lambda c: _write_chunk(c, create), chunks))
        self.live += chunks


def _write_chunk(chunk: _Chunk, create: bool) -> None:
    # An anonymous mmap is page-aligned, as O_DIRECT requires of the buffer.
    buf = mmap.mmap(-1, BLOCK_BYTES)
    buf.write(os.urandom(BLOCK_BYTES))
    fd = os.open(chunk.path, os.O_WRONLY | os.O_DIRECT | (os.O_CREAT if create else 0), 0o600)
    try:
        for off in range(0, CHUNK_BYTES, BLOCK_BYTES):
            if os.pwrite(fd, buf, chunk.offset + off) != BLOCK_BYTES:
                raise OSError(f"short write to {chunk.path}")
        os.fsync(fd)
    finally:
        os.close(fd)
        buf.close()


def _decode_reads(chunks: list[_Chunk], until: float, rng: random.Random) -> None:
    """Token steps: a few random 4 KiB reads, then a pause, so the device is mostly idle."""
    buf = mmap.mmap(-1, PIECE_BYTES)
    fds: dict[str, int] = {}
    try:
        while time.monotonic() < until:
            for _ in range(READS_PER_TOKEN):
                c = rng.choice(chunks)
                fd = fds.get(c.path)
                if fd is None:
                    fd = fds[c.path] = os.open(c.path, os.O_RDONLY | os.O_DIRECT)
                piece = rng.randrange(CHUNK_BYTES // PIECE_BYTES)
                os.preadv(fd, [buf], c.offset + piece * PIECE_BYTES)
            time.sleep(TOKEN_GAP_S)
    finally:
        for fd in fds.values():
            os.close(fd)
        buf.close()


def _fio_reads(chunk: _Chunk, seconds: float) -> bool:
    """Random reads of one chunk through io_uring; False (and nothing else) when fio can't."""
    fio = shutil.which("fio")
    if fio is None:
        return False
    cmd = [fio, "--name=kv-decode", f"--filename={chunk.path}", f"--offset={chunk.offset}",
           f"--size={CHUNK_BYTES}", "--ioengine=io_uring", "--rw=randread", "--bs=4k",
           "--direct=1", "--iodepth=4", f"--rate_iops={FIO_RATE_IOPS}",
           f"--runtime={int(seconds * 1000)}ms", "--time_based", "--output=/dev/null"]
    try:
        subprocess.run(cmd, capture_output=True, check=True, timeout=seconds + 30)
    except (OSError, subprocess.SubprocessError):
        return False
    return True


def _workload_under_dashboard(rec: BackgroundRecorder, store: _KVStore, marker: Marker,
                              seconds: float) -> None:
    """The workload in a thread while the dashboard owns the terminal (Textual must run in
    the main thread). Quitting early still lets the current round finish: the workload
    only stops at its deadline, and the recorder must outlive it."""
    from kvprof.snapshot import Clock
    from kvprof.store import Reader, session_info
    from kvprof.ui.app import KvprofTop

    errors: list[BaseException] = []

    def work() -> None:
        try:
            _workload(store, marker, seconds)
        except BaseException as e:  # noqa: BLE001 - re-raised on the main thread
            errors.append(e)

    worker = threading.Thread(target=work, name="kvprof-demo-workload", daemon=True)
    cur = rec.store.con.cursor()
    info = session_info(cur)
    cur.close()
    worker.start()
    KvprofTop(Reader(rec.store.con), Clock(info.start_ns, None, playing=True), name="demo",
              window_s=10.0).run()
    worker.join()
    if errors:
        raise errors[0]


def _workload(store: _KVStore, marker: Marker, seconds: float) -> None:
    """Rounds of prefill, decode and idle until `seconds` are used up (at least one round)."""
    rng = random.Random(0)
    deadline = time.monotonic() + seconds
    fio = [True]  # fio stays in use until it fails once
    with ThreadPoolExecutor(WRITERS, thread_name_prefix="kvprof-demo-write") as pool:
        try:
            _round(store, marker, pool, rng, deadline, fio)
            while time.monotonic() + MIN_ROUND_S <= deadline:
                _round(store, marker, pool, rng, deadline, fio)
        finally:
            # Close the open window where the work stopped, also when interrupted.
            marker.mark("idle")


def _round(store: _KVStore, marker: Marker, pool: ThreadPoolExecutor, rng: random.Random,
           deadline: float, fio: list[bool]) -> None:
    marker.mark("prefill")
    store.prefill(pool, CHUNKS_PER_PREFILL)

    marker.mark("decode")
    left = deadline - time.monotonic() - IDLE_S
    until = time.monotonic() + min(DECODE_S, max(MIN_DECODE_S, left))
    if fio[0] and until - time.monotonic() > 2 * FIO_S:
        fio[0] = _fio_reads(rng.choice(store.live), FIO_S)
    _decode_reads(store.live, until, rng)

    marker.mark("idle")
    time.sleep(IDLE_S)
