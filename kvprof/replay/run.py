"""`replay()`: the candidate prepared, the recording's calls issued while a new session is
recorded there, and the figures."""
from __future__ import annotations

import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np

from kvprof.errors import EX_DATAERR, EX_USAGE, KvprofError
from kvprof.phases.replayed import new_edges
from kvprof.replay.gate import Gate
from kvprof.replay.issue import cache_rules, issue, lay_down, make_folders
from kvprof.replay.plan import FilePlan, Plan, file_plan, plan
from kvprof.replay.stats import lag, stretch

LEAD_MAX_NS = 10_000_000_000


@contextmanager
def _no_merges(dev: str) -> Iterator[None]:
    """The device merging no requests while the replay runs (queue/nomerges 2), put back
    after: the recorded requests are the ones the device got, merged already, and two of
    them issued close together by two threads must not become one."""
    knob = Path(f"/sys/block/{dev}/queue/nomerges")
    try:
        was = knob.read_text().strip()
        knob.write_text("2")
    except OSError:
        yield  # (a device without the knob, or a partition's: its disk's queue merges)
        return
    try:
        yield
    finally:
        knob.write_text(was)


def _progress(started: float, total_s: float, done: threading.Event) -> None:
    while not done.wait(1.0):
        el = time.monotonic() - started
        print(f"\rkvprof: replaying {el:5.0f} s of {total_s:.0f} s", end="", file=sys.stderr,
              flush=True)
    print(file=sys.stderr)


def _replayed(out: Path, under: Path | None = None
              ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The issue times, sizes and whether a write, of the block reads and writes the new
    session holds, or with `under`, of the file reads and writes on the files there."""
    from kvprof.store.session import open_session

    where, params = "layer = 'block'", []
    if under is not None:
        where, params = "layer = 'syscall' AND starts_with(path, ?)", [f"{under}/"]
    con = open_session(out)
    try:
        got = con.execute(
            f"SELECT issue_ns, bytes, op = 'write' AS w FROM io WHERE {where} "
            "AND op IN ('read', 'write') AND bytes > 0 ORDER BY issue_ns", params).fetchnumpy()
        return (np.asarray(got["issue_ns"], np.int64), np.asarray(got["bytes"], np.int64),
                np.asarray(got["w"], bool))
    finally:
        con.close()


def _recording_while(opts, windows, edges: np.ndarray, t0: int, last: int, lead_ns: int,
                     speed: float, go: Callable[[int], None], shift: bool = False) -> int:
    """Record the candidate (`opts`: the new session, `windows` among its feeds, sent where
    the replay puts each phase piece: `edges`) while go(start_ns) replays: the recording's
    t0 at start_ns, `lead_ns` after attaching. Returns start_ns."""
    from kvprof.recorder.recorder import Recorder

    attached = threading.Event()
    stop = threading.Event()
    errors: list[BaseException] = []

    def recording() -> None:
        try:
            # (a Recorder as `record` runs one, not live: nothing reads it meanwhile)
            with Recorder(opts, lambda line: None, stop) as recorder:
                recorder.open(lambda store: attached.set())
                recorder.run()
                recorder.finish()
        except BaseException as e:  # noqa: BLE001 (raised in the caller's thread)
            errors.append(e)
            attached.set()

    rec = threading.Thread(target=recording, name="kvprof-replay-record")
    rec.start()
    attached.wait()
    if errors:
        rec.join()
        raise errors[0]
    done = threading.Event()
    threading.Thread(target=_progress, args=(time.monotonic(), (last - t0) / speed / 1e9, done),
                     daemon=True).start()
    try:
        start = time.monotonic_ns() + lead_ns
        windows.schedule(start, t0, speed, edges, shift)
        go(start)
    finally:
        done.set()
        time.sleep(0.3)  # the last completions into the recording
        stop.set()
        rec.join()
    if errors:
        raise errors[0]
    return start


def replay(session: str, on: str, phases: list[str], speed: float, out: str | None,
           force: bool = False, layer: str | None = None, caches: list[str] | None = None,
           open_loop: bool = False) -> dict:
    """Replay `session` on `on` (a block device or a directory) while a new session, `out`,
    records it with the recording's windows placed as the replay decides its phases (Gate).
    `layer` (None: "syscall" on a directory where the session has file calls, else "block"):
    the KV caches' file calls (`_replay_files`) or the block requests (`_replay_block`)."""
    from kvprof.analysis.recorded import recorded
    from kvprof.phases.replayed import ReplayedWindows
    from kvprof.recorder.options import default_out

    if speed <= 0:
        raise KvprofError("--speed must be positive", EX_USAGE)
    got = recorded(session)
    on_dir = Path(on).is_dir()
    if layer is None:
        layer = "syscall" if on_dir and got.calls.num_rows else "block"
    dest = Path(out) if out else default_out()
    # The recording's windows sent as the replay places its phases, and no other source's
    # (phases=["marks"]: nothing discovered on this host).
    windows = ReplayedWindows(got.windows, got.bounds)
    if layer == "syscall":
        result = _replay_files(got, session, on, phases, speed, dest, windows, caches or [],
                               open_loop)
    else:
        result = _replay_block(got, session, on, phases, speed, dest, windows, force)
    return {"session": str(dest), "candidate": on, "layer": layer, "speed": speed, **result}


def _lead(p: Plan | FilePlan, start_ns: int, speed: float) -> int:
    """The first request as long after attaching as in the recording (up to LEAD_MAX_NS),
    so the windows that began before it fall inside the new session."""
    return int(min(p.t0 - start_ns, LEAD_MAX_NS) / speed)


def _replay_block(got, session: str, on: str, phases: list[str], speed: float, dest: Path,
                  windows, force: bool) -> dict:
    """Every recorded block read and write of `phases`, O_DIRECT, on the device or a scratch
    file, each recorded device's range laid after the previous one's (`plan`), open loop; the
    device merging none meanwhile (`_no_merges`). A session sampled past --event-rate is
    scaled up to its aggregate tier's counts (analysis/scaleup.py)."""
    import shutil

    from kvprof.recorder.options import RecordOptions
    from kvprof.targets import prepare

    p = plan(got.requests, phases, got.bounds)
    if len(p.issue_ns) == 0:
        why = (" (a --no-events session keeps none)" if not got.calls.num_rows else
               "; it has file calls: replay them on a directory (--on DIR --layer syscall)")
        raise KvprofError(f"{session}: no block reads or writes recorded one by one"
                          + (f" in {', '.join(phases)}" if phases else "")
                          + why + ": nothing to replay", EX_DATAERR)
    said = got.say_scaled("the replay issues")
    if said:
        print(said, file=sys.stderr)
    target = prepare(on, p.span, force, verb="replay")
    tmp = Path(tempfile.mkdtemp(prefix="kvprof-replay-"))
    try:
        if target.size < p.span:
            raise KvprofError(f"{on} has {target.size >> 20} MiB; the recorded requests reach "
                              f"over {p.span >> 20} MiB", EX_USAGE)
        if target.device is None:
            raise KvprofError(f"{on} has no block device of its own to record", EX_USAGE)
        opts = RecordOptions(out=str(dest), devices=[target.device.name], event_rate=0,
                             socket=str(tmp / "marks.sock"), phases=["marks"],
                             feeds=[windows])
        edges = new_edges(len(got.bounds) + 1)
        gate = Gate(got.bounds, p.segment, edges, p.t0, speed)
        with _no_merges(target.device.name):
            start = _recording_while(opts, windows, edges, p.t0, int(p.issue_ns[-1]),
                                     _lead(p, got.start_ns, speed), speed,
                                     lambda start: issue(p, target.path, speed, start, gate))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        if target.scratch is not None:
            target.scratch.unlink(missing_ok=True)
    issued, sizes, writes = _replayed(dest)
    return {"requests": len(p.issue_ns), "bytes": int(p.size.sum()),
            "replayed": int(len(issued)), "replayed_bytes": int(sizes.sum()),
            "lag": lag(p, issued, sizes, writes, speed, start),
            "phases": stretch(got, edges, p, speed, start, issued),
            "scaled_up": None if got.scaled is None else [
                {"phase": ph, "device": dev, "op": op, "kept": kept, "issued": n}
                for (ph, dev, op), (kept, n) in sorted(got.scaled.groups.items())]}


def _replay_files(got, session: str, on: str, phases: list[str], speed: float, dest: Path,
                  windows, caches: list[str], open_loop: bool = False) -> dict:
    """The recording's file calls, made on files in a scratch directory under `on` by a
    process of its own, which the new session traces (syscall layer, by its pid) with the
    block requests it makes on the directory's device."""
    import mmap
    import pickle
    import shutil
    import subprocess

    from kvprof.caches import OTHER
    from kvprof.recorder.options import RecordOptions
    from kvprof.targets import dir_device

    if not Path(on).is_dir():
        raise KvprofError(f"{on}: file calls replay on a filesystem: give a directory",
                          EX_USAGE)
    if not caches and got.calls.num_rows:
        # The KV caches' files where the session names any: a recording without -p follows
        # every process's files (the engine's model weights, Python's modules ...).
        found = sorted(set(got.calls["cache"].to_pylist()) - {None, OTHER})
        if found:
            caches = found
            others = sum(1 for c in got.calls["cache"].to_pylist() if c not in found)
            print(f"kvprof: replaying the file calls of {', '.join(found)}"
                  + (f"; {others} calls on other files left out (--cache NAME for each cache "
                     "to replay, `other` for the rest)" if others else ""), file=sys.stderr)
    fp = file_plan(got.calls, phases, caches, got.bounds, open_loop)
    if len(fp.issue_ns) == 0:
        raise KvprofError(f"{session}: no file reads, writes or syncs recorded (syscall layer, "
                          "with their offsets)" + (f" in {', '.join(phases)}" if phases else "")
                          + ": nothing to replay", EX_DATAERR)
    dev = dir_device(Path(on))
    if dev is None:
        raise KvprofError(f"{on} has no block device of its own to record", EX_USAGE)
    need = sum(fp.lay_down.values()) + int(fp.size[fp.kind == 1].sum())
    free = shutil.disk_usage(on).free
    if free < need + (64 << 20):
        raise KvprofError(f"{on} has {free >> 20} MiB free; the replay writes up to "
                          f"{need >> 20} MiB", EX_USAGE)
    root = Path(tempfile.mkdtemp(prefix=".kvprof-replay-", dir=on))
    tmp = Path(tempfile.mkdtemp(prefix="kvprof-replay-"))
    proc = None
    edges = None
    try:
        make_folders(fp, root)
        lay_down(fp, root)
        with open(tmp / "plan.pickle", "wb") as f:
            pickle.dump((fp, got.bounds), f)
        # Where the child puts each phase piece (Gate), which the recorder's windows follow:
        # a file both map, so the child says it with no call the new session would trace.
        with open(tmp / "edges", "w+b") as g:
            g.truncate((len(got.bounds) + 1) * 8)
            shared = mmap.mmap(g.fileno(), 0)
        edges = new_edges(len(got.bounds) + 1, shared)
        proc = subprocess.Popen(
            [sys.executable, "-c", "from kvprof.replay.issue import child; child()",
             str(tmp / "plan.pickle"), str(root), repr(speed), str(tmp / "edges")],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        assert proc.stdin is not None and proc.stdout is not None
        if proc.stdout.readline().strip() != "ready":
            raise KvprofError(f"the replaying process did not start: {proc.communicate()[1]}",
                              EX_DATAERR)
        opts = RecordOptions(out=str(dest), devices=[dev.name], pids=[proc.pid],
                             layers=("block", "syscall"), event_rate=0,
                             caches=cache_rules(root, fp),
                             socket=str(tmp / "marks.sock"), phases=["marks"],
                             feeds=[windows])

        def go(start: int) -> None:
            assert proc is not None
            _, err = proc.communicate(f"{start}\n")
            if proc.returncode:
                raise KvprofError(err.strip().splitlines()[-1] if err.strip() else
                                  f"the replaying process ended with {proc.returncode}",
                                  EX_DATAERR)

        start = _recording_while(opts, windows, edges, fp.t0, int(fp.issue_ns[-1]),
                                 _lead(fp, got.start_ns, speed), speed, go, fp.threads > 0)
        edges = edges.copy()
    finally:
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait()
        shutil.rmtree(root, ignore_errors=True)
        shutil.rmtree(tmp, ignore_errors=True)
    issued, sizes, writes = _replayed(dest, root)
    return {"requests": len(fp.issue_ns), "bytes": int(fp.size.sum()),
            "files": len(fp.paths), "laid_down": {"files": len(fp.lay_down),
                                                  "bytes": sum(fp.lay_down.values())},
            "direct_calls": int(fp.direct.sum()), "syncs": int((fp.kind >= 2).sum()),
            "threads": fp.threads,
            "replayed": int(len(issued)), "replayed_bytes": int(sizes.sum()),
            "lag": lag(fp, issued, sizes, writes, speed, start,
                       (got.bounds, edges) if fp.threads else None),
            "phases": stretch(got, edges, fp, speed, start, issued)}
