"""`kvprof replay SESSION --on DEVICE_OR_DIR`: a recorded session's block requests issued again
on candidate storage, at their recorded times, while a new session is recorded there with the
recording's phase windows; `kvprof compare SESSION NEW` then sets one against the other.

What is issued: every block request of the chosen phases (op, size, offset, issue time),
with O_DIRECT, by JOBS threads that take the requests in order, each sleeping until its
request's time: a request goes out at its time whether or not the ones before it have
completed (open loop, up to JOBS in flight), so latency is measured under the recorded
arrivals, and a candidate too slow for them falls behind, which the replay measures per
phase (when it had issued each planned request's bytes, against when that was due).

Not fio: fio 3.33 replaying an iolog waits for each line's time by spinning (one core per
job, which here is the CPU the candidate's I/O needs), and through one asynchronous queue
leaves up to its depth - 1 of the requests unissued while counting them done. `kvprof export
--fio-iolog` writes the same requests for fio, for those who replay with it.

The new session holds the recording's phase windows, moved to the replay's clock (its first
request at the recording's first) and sent to its recorder as the replay reaches them
(kvprof/phases/replayed.py), so its report, exact tier and idle time per phase and `compare`
split the same way.

While it replays, the candidate merges no requests (queue/nomerges, put back after): the
recorded requests were merged already.

Safety: as `kvprof calibrate`: a directory gets a scratch file (deleted afterwards), a raw
device that is mounted or held is refused, and one holding data is refused unless --force.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa

from kvprof.errors import EX_DATAERR, EX_USAGE, KvprofError

JOBS = 8  # replaying threads: the most requests in flight at once
LEAD_MAX_NS = 10_000_000_000


@dataclass
class Plan:
    """The requests to issue, in issue order: candidate offsets, sizes, ops, phases, and
    the recorded issue times (ns); `t0`: the first one's."""
    offset: np.ndarray
    size: np.ndarray
    op: list[str]
    phase: list[str]
    issue_ns: np.ndarray
    span: int  # bytes of the candidate the offsets reach

    @property
    def t0(self) -> int:
        return int(self.issue_ns[0])


def plan(requests: pa.Table, phases: list[str]) -> Plan:
    """The recorded block requests of `phases` (all when empty) laid out for one candidate:
    each recorded device's range [lowest offset, highest end) placed after the previous
    one's. Requests with no data to move (flushes, empty writes) are left out."""
    phase = np.array(requests["phase"].to_pylist(), dtype=object)
    op = np.array(requests["op"].to_pylist(), dtype=object)
    size = requests["bytes"].to_numpy(zero_copy_only=False).astype(np.int64)
    keep = ((op == "read") | (op == "write")) & (size > 0)
    if phases:
        keep &= np.isin(phase, phases)
    dev = np.array(requests["dev_name"].to_pylist(), dtype=object)[keep]
    offset = requests["offset"].to_numpy(zero_copy_only=False).astype(np.int64)[keep]
    size = size[keep]
    out = np.zeros(len(offset), np.int64)
    base = 0
    for d in sorted(set(dev.tolist())):
        mine = dev == d
        lo, hi = int(offset[mine].min()), int((offset[mine] + size[mine]).max())
        out[mine] = offset[mine] - lo + base
        base += hi - lo
    issue = requests["issue_ns"].to_numpy(zero_copy_only=False).astype(np.int64)[keep]
    return Plan(out, size, op[keep].tolist(), phase[keep].tolist(), issue, base)


def issue(p: Plan, path: str, speed: float, start_ns: int, jobs: int = JOBS) -> None:
    """Issue the plan's requests on `path` at their times, the first at `start_ns`
    (monotonic), `jobs` at once at most. The threads sleep rather than spin while they wait (the
    candidate's I/O needs the CPU), and leave the GIL in the reads and writes themselves."""
    import itertools
    import mmap
    import os

    fd = os.open(path, os.O_RDWR | os.O_DIRECT)
    order = itertools.count()  # (next() on it is atomic under the GIL)
    offset, size = p.offset.tolist(), p.size.tolist()
    write = [o == "write" for o in p.op]
    due = ((p.issue_ns - p.t0) / speed).astype(np.int64).tolist()
    data = os.urandom(max(size))  # what writes carry: incompressible, as KV cache is
    errors: list[OSError] = []
    start = start_ns

    def work() -> None:
        buf = mmap.mmap(-1, max(size))  # page-aligned, as O_DIRECT needs
        buf.write(data)
        view = memoryview(buf)
        while not errors:
            k = next(order)
            if k >= len(due):
                return
            wait = start + due[k] - time.monotonic_ns()
            if wait > 0:
                time.sleep(wait / 1e9)
            try:
                if write[k]:
                    os.pwritev(fd, [view[:size[k]]], offset[k])
                else:
                    os.preadv(fd, [view[:size[k]]], offset[k])
            except OSError as e:
                errors.append(e)

    threads = [threading.Thread(target=work, name=f"kvprof-replay-{j}", daemon=True)
               for j in range(min(jobs, len(due)))]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        os.close(fd)
    if errors:
        raise KvprofError(f"replaying on {path}: {errors[0].strerror}", EX_DATAERR)


def lag(p: Plan, issued_ns: np.ndarray, issued_bytes: np.ndarray,
        speed: float) -> dict[str, dict[str, float]]:
    """Per phase, how late the candidate issued requests against the schedule, in seconds:
    for each planned request, when the replay had issued as many bytes as the plan had by
    then (bytes rather than the k-th request: a device may merge or split them), against
    when it was due, both from the first request."""
    if len(issued_ns) == 0:
        return {}
    order = np.argsort(issued_ns, kind="stable")
    at, done = issued_ns[order], np.cumsum(issued_bytes[order])
    k = np.minimum(np.searchsorted(done, np.cumsum(p.size), side="left"), len(at) - 1)
    late = np.maximum((at[k] - at[0]) - (p.issue_ns - p.t0) / speed, 0) / 1e9
    phases = np.array(p.phase, dtype=object)
    out = {}
    for ph in sorted(set(p.phase)):
        d = late[phases == ph]
        out[ph] = {"p50_s": float(np.quantile(d, 0.5)), "p99_s": float(np.quantile(d, 0.99)),
                   "max_s": float(d.max()), "requests": int(len(d))}
    return out


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


def _replayed(out: Path) -> tuple[np.ndarray, np.ndarray]:
    """The issue times and sizes of the block reads and writes the new session holds."""
    from kvprof.store.session import open_session

    con = open_session(out)
    try:
        got = con.execute(
            "SELECT issue_ns, bytes FROM io WHERE layer = 'block' AND op IN ('read', 'write') "
            "AND bytes > 0 ORDER BY issue_ns").fetchnumpy()
        return np.asarray(got["issue_ns"], np.int64), np.asarray(got["bytes"], np.int64)
    finally:
        con.close()


def replay(session: str, on: str, phases: list[str], speed: float, out: str | None,
           force: bool = False) -> dict:
    import shutil

    from kvprof.commands.calibrate import prepare
    from kvprof.commands.record import RecordOptions, Recorder, default_out
    from kvprof.phases.replayed import ReplayedWindows

    if speed <= 0:
        raise KvprofError("--speed must be positive", EX_USAGE)
    from kvprof.commands.export import recorded

    got = recorded(session)
    p = plan(got.requests, phases)
    if len(p.issue_ns) == 0:
        raise KvprofError(f"{session}: no block reads or writes recorded one by one"
                          + (f" in {', '.join(phases)}" if phases else "")
                          + " (a --no-events session keeps none): nothing to replay",
                          EX_DATAERR)
    said = got.say_scaled("the replay issues")
    if said:
        print(said, file=sys.stderr)
    target = prepare(on, p.span, force, verb="replay")
    if target.size < p.span:
        raise KvprofError(f"{on} has {target.size >> 20} MiB; the recorded requests reach over "
                          f"{p.span >> 20} MiB", EX_USAGE)
    if target.device is None:
        raise KvprofError(f"{on} has no block device of its own to record", EX_USAGE)
    dest = Path(out) if out else default_out()
    tmp = Path(tempfile.mkdtemp(prefix="kvprof-replay-"))
    try:
        attached = threading.Event()
        stop = threading.Event()
        # The recording's windows sent as the replay reaches them, and no other source's
        # (phases=["marks"]: nothing discovered on this host).
        windows = ReplayedWindows(got.windows)
        opts = RecordOptions(out=str(dest), devices=[target.device.name], event_rate=0,
                             socket=str(tmp / "marks.sock"), phases=["marks"],
                             feeds=[windows])
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
            raise errors[0]
        total_s = (int(p.issue_ns[-1]) - p.t0) / speed / 1e9
        done = threading.Event()
        threading.Thread(target=_progress, args=(time.monotonic(), total_s, done),
                         daemon=True).start()
        try:
            # The first request as long after attaching as in the recording (up to
            # LEAD_MAX_NS), so the windows that began before it fall inside the new session.
            start = time.monotonic_ns() + int(min(p.t0 - got.start_ns, LEAD_MAX_NS) / speed)
            windows.schedule(start, p.t0, speed)
            issue(p, target.path, speed, start)
        finally:
            done.set()
            time.sleep(0.3)  # the last completions into the recording
            stop.set()
            rec.join()
        if errors:
            raise errors[0]
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        if target.scratch is not None:
            target.scratch.unlink(missing_ok=True)
    issued, sizes = _replayed(dest)
    behind = lag(p, issued, sizes, speed)
    return {"session": str(dest), "candidate": on, "speed": speed,
            "requests": len(p.issue_ns), "bytes": int(p.size.sum()),
            "replayed": int(len(issued)), "replayed_bytes": int(sizes.sum()), "lag": behind,
            "scaled_up": None if got.scaled is None else [
                {"phase": ph, "device": dev, "op": op, "kept": kept, "issued": n}
                for (ph, dev, op), (kept, n) in sorted(got.scaled.groups.items())]}


def run(args: argparse.Namespace) -> int:
    result = replay(args.session, args.on, args.phase, args.speed, args.out, args.force)
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    print(f"kvprof: replayed {result['requests']} requests of {args.session} on {args.on} "
          f"(x{result['speed']:g}); new session {result['session']}")
    for ph, lg in result["lag"].items():
        verdict = ("kept up" if lg["p99_s"] < 0.01 else
                   f"fell behind: p99 {lg['p99_s']:.2f} s, at most {lg['max_s']:.2f} s late")
        print(f"  {ph:8} {lg['requests']:>8} requests  {verdict}")
    print(f"kvprof: compare them with: kvprof compare {args.session} {result['session']}")
    return 0
