"""The replaying threads: block requests on a device, file calls in a scratch folder (from a
process of its own, `child`)."""
from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np

from kvprof.errors import EX_DATAERR, KvprofError
from kvprof.replay.gate import Gate
from kvprof.replay.plan import FilePlan, Plan, due_offsets

JOBS = 8  # replaying threads per lane (reads, writes, syncs): the most in flight in each


# What a sleep's wake-up costs, about: on the 2-core VMs this runs on, time.sleep(10e-6)
# returns after 90 us (p50; 102 us p99, 2000 tries).
WAKE_UP_NS = 100_000


def _at_their_times(due: list[int], do: Callable[[int, memoryview], None],
                    sizes: np.ndarray, lanes: np.ndarray, jobs: int,
                    gate: Gate, segment: np.ndarray, after: np.ndarray | None = None,
                    gap: np.ndarray | None = None, speed: float = 1.0,
                    issue_ns: np.ndarray | None = None) -> Callable[[int], None]:
    """A runner: given start_ns, it calls do(k, buffer of sizes[k]) for each k at start_ns +
    due[k] (monotonic ns), or at its phase piece's start (`gate`, `segment[k]`) if later, and
    returns when all are done. Each lane (`lanes`: reads, writes, syncs) has `jobs` threads of
    its own, so a slow candidate's writes hold back no reads (an engine's store and load threads
    do not wait on each other); they take its calls in order, open loop: a call goes out whether
    or not the ones before it completed. With `after` and `gap` (at `speed`) a recorded thread's
    calls keep its order and pace; a shifting gate places each at its `issue_ns` in its piece."""
    import itertools
    import mmap
    import os

    errors: list[BaseException] = []
    data = os.urandom(max(int(sizes.max()), 4096))  # what writes carry: incompressible
    start = [0]
    seg = np.asarray(segment, np.int64).tolist()
    prev = [-1] * len(due) if after is None else np.asarray(after, np.int64).tolist()
    pause = [0] * len(due) if gap is None else (np.asarray(gap, np.float64) / speed
                                               ).astype(np.int64).tolist()
    # (no call waits on a later one, nor a piece on a later piece: the first call not done
    # can always go out, so the threads never wait on each other in a ring)
    assert all(j < k for k, j in enumerate(prev))
    assert all(a <= b for a, b in zip(seg, seg[1:]))
    ordered = any(j >= 0 for j in prev)
    rec = [] if issue_ns is None else np.asarray(issue_ns, np.int64).tolist()
    done_ns = [0] * len(due)
    # Who waits for which call: one wake-up a completion, for the thread that waits on it (a
    # condition shared by all would wake every waiting thread at every call).
    waiting: dict[int, threading.Event] = {}
    lock = threading.Lock()

    def after_previous(k: int) -> int | None:
        """When call k may go out after its thread's previous call; None: stopping."""
        j = prev[k]
        if not done_ns[j]:  # (set once; read without the lock)
            with lock:
                ev = None if done_ns[j] else waiting.setdefault(j, threading.Event())
            while ev is not None and not ev.wait(0.5) and not errors:
                pass
        return None if errors else done_ns[j] + pause[k]

    def completed(k: int, now: int) -> None:
        with lock:
            done_ns[k] = now
            ev = waiting.pop(k, None)
        if ev is not None:
            ev.set()

    def work(mine: list[int], order: Iterator[int], view: memoryview) -> None:
        try:
            while not errors:
                n = next(order)
                if n >= len(mine):
                    return
                k = mine[n]
                at, edge = start[0] + due[k], start[0]
                if seg[k]:
                    got = gate.wait(seg[k])
                    if got is None:
                        return
                    edge = got
                    at = gate.due_in(seg[k], rec[k]) if gate.shift else max(at, edge)
                if prev[k] >= 0:
                    ready = after_previous(k)
                    if ready is None:
                        return
                    at = max(at, ready)
                # Sleep, never spin: the candidate's I/O needs the CPU. A wait shorter than a
                # wake-up takes is not slept: the call goes out that much early rather than a
                # wake-up late, which in a recorded thread's run of calls (each due after the
                # one before) would add up over all that follow. Never before its phase piece
                # starts (`edge`): there it would count in the piece before.
                while (wait := at - time.monotonic_ns()) > WAKE_UP_NS:
                    time.sleep(wait / 1e9)
                while (wait := edge - time.monotonic_ns()) > 0:
                    time.sleep(wait / 1e9)
                do(k, view)
                now = time.monotonic_ns()
                gate.done(seg[k], now)
                if ordered:
                    completed(k, now)
        except BaseException as e:  # noqa: BLE001 (raised in the caller's thread)
            # The first error ends the replay; run() raises it in the caller's thread.
            errors.append(e)
            gate.abort()
            with lock:
                for ev in waiting.values():
                    ev.set()

    # Buffers and threads set up now, before the start: a traced process replaying makes no
    # other calls once it starts.
    threads = []
    for lane in np.unique(lanes).tolist():
        ks = np.flatnonzero(lanes == lane)
        order = itertools.count()  # (next() on it is atomic under the GIL)
        bufsize = max(-(-int(sizes[ks].max()) // 4096) * 4096, 4096)
        for j in range(min(jobs, len(ks))):
            buf = mmap.mmap(-1, bufsize)  # page-aligned, as O_DIRECT needs
            buf.write(data[:bufsize])
            threads.append(threading.Thread(target=work, args=(ks.tolist(), order,
                                                               memoryview(buf)),
                                            name=f"kvprof-replay-{lane}-{j}", daemon=True))

    def run(start_ns: int) -> None:
        start[0] = start_ns
        gate.begin(start_ns)
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            e = errors[0]
            if not isinstance(e, OSError):
                raise e
            raise KvprofError(f"replaying on {e.filename or 'the candidate'}: {e.strerror}",
                              EX_DATAERR)
    return run


def issue(p: Plan, path: str, speed: float, start_ns: int, gate: Gate,
          jobs: int = JOBS) -> None:
    """The plan's block requests on `path` (O_DIRECT), the first at `start_ns`, each in
    its phase piece (`gate`)."""
    import os

    fd = os.open(path, os.O_RDWR | os.O_DIRECT)
    offset, size = p.offset.tolist(), p.size.tolist()
    write = [o == "write" for o in p.op]

    def do(k: int, view: memoryview) -> None:
        try:
            if write[k]:
                os.pwritev(fd, [view[:size[k]]], offset[k])
            else:
                os.preadv(fd, [view[:size[k]]], offset[k])
        except OSError as e:
            e.filename = path
            raise

    try:
        _at_their_times(due_offsets(p.issue_ns, p.t0, speed), do, p.size,
                        np.array(write, np.int8), jobs, gate, p.segment)(start_ns)
    finally:
        os.close(fd)


# -- file calls (the syscall layer), replayed on a filesystem ---------------------------------

def _name(root: Path, fp: FilePlan, f: int) -> Path:
    """Where the replay puts recorded file `f`: in a folder named after its KV cache, which
    the new session's --cache rule (_cache_rules) labels as the recording did."""
    return root / fp.caches[f] / f"file-{f}"


def cache_rules(root: Path, fp: FilePlan) -> list[str]:
    return [f"{c}={root}/{c}/*" for c in sorted(set(fp.caches) - {"other"})]


def make_folders(fp: FilePlan, root: Path) -> None:
    for c in set(fp.caches):
        (root / c).mkdir(exist_ok=True)


def lay_down(fp: FilePlan, root: Path) -> None:
    """The files read before the replay writes them, written with random data, synced and
    dropped from the page cache: their reads start cold, from the candidate."""
    import os

    chunk = os.urandom(1 << 20)
    for f, n in fp.lay_down.items():
        fd = os.open(_name(root, fp, f), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            left = -(-n // 4096) * 4096
            while left > 0:
                left -= os.write(fd, chunk[:min(left, len(chunk))])
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def issue_files(fp: FilePlan, root: Path, speed: float, gate: Gate, jobs: int = JOBS
                ) -> Callable[[int], None]:
    """A runner making the plan's file calls on files under `root` (as _at_their_times): each
    recorded file a file of its own, opened at its first call (O_DIRECT where the recording's
    was), reads and writes at their offsets, fsyncs as fsyncs. A buffered read that missed the
    page cache in the recording has its range dropped from it first (clean pages only), so it
    goes to the candidate as it went to the device. At the end each file written through the
    page cache is synced: the writeback the engine left it to happens in the new session."""
    import os

    fds: dict[tuple[int, bool], int] = {}
    lock = threading.Lock()
    file, kind, direct = fp.file.tolist(), fp.kind.tolist(), fp.direct.tolist()
    offset, size, cold = fp.offset.tolist(), fp.ask.tolist(), fp.cold.tolist()

    def fd_of(f: int, d: bool) -> int:
        with lock:
            if (f, d) not in fds:
                fds[(f, d)] = os.open(_name(root, fp, f), os.O_RDWR | os.O_CREAT
                                      | (os.O_DIRECT if d else 0), 0o600)
            return fds[(f, d)]

    def do(k: int, view: memoryview) -> None:
        try:
            fd = fd_of(file[k], direct[k])
            if kind[k] == 0:
                if cold[k]:
                    os.posix_fadvise(fd, offset[k], size[k], os.POSIX_FADV_DONTNEED)
                os.preadv(fd, [view[:size[k]]], offset[k])
            elif kind[k] == 1:
                os.pwritev(fd, [view[:size[k]]], offset[k])
            elif kind[k] == 2:
                os.fsync(fd)
            else:
                os.fdatasync(fd)
        except OSError as e:
            e.filename = str(_name(root, fp, file[k]))
            raise

    replay = _at_their_times(due_offsets(fp.issue_ns, fp.t0, speed), do, fp.ask,
                             np.minimum(fp.kind, 2), jobs, gate, fp.segment, fp.after,
                             fp.gap, speed, fp.issue_ns)

    def run(start_ns: int) -> None:
        try:
            replay(start_ns)
            # The buffered writes' pages, which the engine left to the kernel's writeback,
            # to the candidate now, while it is recorded: its files are deleted after.
            for (f, d), fd in fds.items():
                if not d:
                    os.fsync(fd)
        finally:
            for fd in fds.values():
                os.close(fd)
    return run


def child() -> None:
    """The process that makes the file calls (`python -c "...child()" PLAN ROOT SPEED
    EDGES`): of its own, so the new session traces its calls alone (by pid), not the
    recorder's writes to the session. Says `ready`, reads the start time (monotonic ns),
    replays, exits. Where each phase piece starts (Gate) it writes in EDGES, a file the
    replay maps too: shared memory, which its recorder reads without a call of ours."""
    import itertools  # noqa: F401 - loaded now: after `ready` its calls alone are traced
    import mmap
    import pickle

    plan_path, root, speed = sys.argv[1], Path(sys.argv[2]), float(sys.argv[3])
    with open(plan_path, "rb") as f:
        # (our own file, written by the replay that started us)
        fp, bounds = pickle.load(f)
    with open(sys.argv[4], "r+b") as f:
        shared = mmap.mmap(f.fileno(), 0)
    edges = np.frombuffer(shared, np.int64, len(bounds) + 1)
    run = issue_files(fp, root, speed, Gate(bounds, fp.segment, edges, fp.t0, speed,
                                            shift=fp.threads > 0))
    print("ready", flush=True)
    start = int(sys.stdin.readline())
    try:
        run(start)
    except KvprofError as e:
        print(e, file=sys.stderr)
        sys.exit(e.exit_code)
