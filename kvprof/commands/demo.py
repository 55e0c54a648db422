"""`kvprof demo`: the main job on a built-in default. A small KV-cache-offload workload
(`_round`) runs on a private loop device (kvprof.sandbox), recorded live, and its per-phase
report is printed (without the privileges live capture needs, a recorded sample's instead).
The loop device, mount and backing file are always removed again, also on errors and Ctrl-C."""
from __future__ import annotations

import argparse
import mmap
import os
import random
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import datetime
from functools import partial
from pathlib import Path

from kvprof import system
from kvprof.analysis.load import load_summary
from kvprof.errors import EX_NOPERM, EX_SOFTWARE, KvprofError
from kvprof.markers import Marker
from kvprof.recorder.background import ATTACH_TIMEOUT_S, BackgroundRecorder
from kvprof.recorder.options import RecordOptions
from kvprof.sandbox import Disk, sandbox
from kvprof.store.session import DB_FILE
from kvprof.views.report import write_report

# A recorded demo session, shipped in the package (and so in the wheel).
SAMPLE_DIR = Path(__file__).resolve().parents[1] / "samples" / "demo"
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
# Unthrottled, fio would read as fast as the loop device serves; decode pulls KV at token
# pace instead, which also keeps a session (and the committed sample) small.
FIO_RATE_IOPS = 2000


def run_demo(seconds: float = 6.0, out: str | None = None, tui: bool = False, *,
             report: Callable[[Path, str], None]) -> int:
    """Run the workload for about `seconds`, recorded live, then `report` the session (its
    directory and the name to show). With `tui`, the `kvprof top` dashboard shows it live
    first (and the sample, unprivileged)."""
    if not system.check_privilege().ok:
        return _show_sample(report, "live capture needs root (or CAP_BPF+CAP_PERFMON)", tui)
    if not system.effective_caps() >> system.CAP_SYS_ADMIN & 1:
        # CAP_BPF+CAP_PERFMON let `record` trace, but not make a loop device or mount it.
        return _show_sample(report, "the live demo needs root to make its loop device", tui)
    session = Path(out) if out else _default_out()
    try:
        _record_demo(session, seconds, tui)
    except BaseException:
        if out is None:
            # A run that never reached its report leaves no unannounced directory behind.
            shutil.rmtree(session, ignore_errors=True)
        raise
    report(session, str(session))
    if out is None:
        print(f"kvprof demo: session kept in {session}; replay with: kvprof report {session}",
              file=sys.stderr)
    return 0


def _record_demo(session: Path, seconds: float, tui: bool = False) -> None:
    """Sandbox and recorder up; the workload; everything down again, whatever happens."""
    with sandbox(BACKING_BYTES) as box:
        marks = str(box.work / "marks.sock")
        # The decode reads go through io_uring: its layer shows them as the workload made them.
        opts = RecordOptions(out=str(session), devices=[box.disk.device],
                             cgroups=[box.cgroup] if box.cgroup else [], socket=marks,
                             layers=("block", "io_uring"))
        announce = (f"kvprof demo: recording {seconds:g} s of KV-offload rounds (prefill "
                    f"writes, decode reads) on {box.disk.device} ({box.disk.kind}); "
                    "Ctrl-C ends early")
        work = partial(_run_workload, _KVStore(box.disk), marks, seconds)
        if not tui:
            rec = BackgroundRecorder(opts)
            box.defer("stop the recorder", lambda: rec.finish(ATTACH_TIMEOUT_S))
            rec.start()
            print(announce, file=sys.stderr, flush=True)
            try:
                work()
            except KeyboardInterrupt:
                pass  # end early, like `kvprof record`: what was recorded is still reported
            rec.finish()
            return
        from kvprof.live import run_live

        # Said before the dashboard takes the terminal, so it is there again once it is back.
        print(announce, file=sys.stderr, flush=True)
        started = threading.Event()

        def beside(_rec: BackgroundRecorder) -> None:
            started.set()
            work()

        try:
            # The demo names its session itself; the recorder's closing lines would repeat it.
            run_live(opts, window_s=10.0, name="demo", beside=beside, log=lambda _line: None)
        except KeyboardInterrupt:
            if not started.is_set():
                raise  # still attaching: nothing recorded, as without the dashboard
            # Waiting for the workload after the dashboard closed: end early, and report.


def _run_workload(store: _KVStore, socket: str, seconds: float) -> None:
    """The workload, its phases announced on the recorder's marker socket."""
    marker = Marker(socket, engine=ENGINE)
    try:
        _workload(store, marker, seconds)
    except OSError as e:
        raise KvprofError(f"demo workload on {store.disk.device} failed: {e}",
                          EX_SOFTWARE) from None
    finally:
        marker.close()


# -- without privileges: the recorded sample -------------------------------------------------

def _show_sample(report: Callable[[Path, str], None], why: str, tui: bool = False) -> int:
    if not (SAMPLE_DIR / DB_FILE).exists():
        raise KvprofError(f"{why}, and no recorded sample is installed at {SAMPLE_DIR}",
                          EX_NOPERM, hint="run: sudo kvprof demo")
    print(f"kvprof demo: {why}; showing a recorded sample instead", file=sys.stderr, flush=True)
    if tui:
        from kvprof.live import run_replay

        return run_replay(str(SAMPLE_DIR))
    report(SAMPLE_DIR, "kvprof/samples/demo")
    return 0


def _default_out() -> Path:
    """A new ./kvprof-demo-DATE-TIME, or one in the temp dir when the cwd is not writable."""
    base = Path(".") if os.access(".", os.W_OK) else Path(tempfile.gettempdir())
    stem = datetime.now().strftime("kvprof-demo-%Y%m%d-%H%M%S")
    path, n = base / stem, 1
    while path.exists():
        n += 1
        path = base / f"{stem}-{n}"
    return path


# -- the workload -------------------------------------------------------------------------------

@dataclass(frozen=True)
class _Chunk:
    path: str
    offset: int  # 0 for a chunk file; the slot's start on the raw device


class _KVStore:
    """Offloaded KV chunks: one file per chunk on ext4, or fixed slots on the raw device."""

    def __init__(self, disk: Disk):
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
    """One round, each phase announced through the real marker protocol, as an engine would:
    prefill writes new KV chunks (CHUNK_BYTES, in BLOCK_BYTES O_DIRECT writes from WRITERS
    threads, fsync); decode reads random PIECE_BYTES of the chunks so far, a few per token step
    with pauses, so the device is mostly idle as in real decode (part through fio's io_uring
    where installed, so that layer shows up too); then an idle pause."""
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


def run(args: argparse.Namespace) -> int:
    # The dashboard only on a terminal: scripts and tests keep getting the printed report.
    tui = not (args.no_tui or args.json) and sys.stdout.isatty() and sys.stdin.isatty()
    return run_demo(seconds=args.seconds, out=args.output, tui=tui,
                    report=lambda session, name: write_report(load_summary(session), name,
                                                              args.json))
