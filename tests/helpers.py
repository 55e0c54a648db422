"""What the tests share: the kernel's block counters, private loop devices, `kvprof` run as a
real subprocess, and the rules a test may forgive losses by (fixtures and hooks: conftest.py)."""
from __future__ import annotations

import contextlib
import json
import mmap
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest

from kvprof import system
from kvprof.phases.metrics import MetricsSource
from kvprof.summary import Report
from tests.report_shape import check as check_shape

KVPROF = [sys.executable, "-m", "kvprof"]
# Long enough for a metrics source's scrape after some work, at its slowest pace: for tests
# that read the open session at that point (a stopped session ends with a last scrape).
SCRAPED_S = MetricsSource.max_interval_s + 0.2


# /sys/block/DEV/stat fields (Documentation/block/stat.rst)
READ_IOS, READ_SECTORS, WRITE_IOS, WRITE_SECTORS, IO_TICKS = 0, 2, 4, 6, 9


def can_trace() -> str | None:
    """Why live tracing tests cannot run here, or None."""
    if not system.check_privilege().ok:
        return "needs root (CAP_BPF+CAP_PERFMON)"
    if shutil.which("losetup") is None:
        return "needs losetup"
    try:
        from kvprof.capture.bccload import load_bcc

        load_bcc()
    except Exception as e:  # noqa: BLE001
        return f"needs bcc: {e}"
    if system.check_headers().ok is False:
        return "needs kernel headers"
    return None


live = pytest.mark.skipif(
    can_trace() is not None and os.environ.get("KVPROF_REQUIRE_LIVE") != "1",
    reason=str(can_trace()))


# Lines the fuzz tests leave for the end of the run (how many inputs each parser took), so CI's
# log shows them without -s.
FUZZ_COUNTS: list[str] = []


@contextmanager
def mounted_ext4(dev: str, mnt: Path):
    """A fresh ext4 on /dev/DEV mounted on `mnt` (created); unmounted afterwards."""
    mnt.mkdir(exist_ok=True)
    subprocess.run(["mkfs.ext4", "-q", "-F", "-E", "lazy_itable_init=0,lazy_journal_init=0",
                    f"/dev/{dev}"], check=True)
    # ext4lazyinit prefetches block bitmaps in the background after a mount, at any moment:
    # reads nobody asked for, which would fall between the tests' diskstats snapshots.
    subprocess.run(["mount", "-o", "no_prefetch_block_bitmaps", f"/dev/{dev}", str(mnt)],
                   check=True)
    try:
        yield mnt
    finally:
        subprocess.run(["umount", str(mnt)], check=False)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http_get(url: str) -> bytes:
    # Loopback only: a proxy from the environment must not catch it.
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    with opener.open(url, timeout=5) as r:
        return r.read()


def require(why: str | None) -> None:
    """A part the test needs (vLLM, nbdkit, the image, the OS's venv) is missing (`why`):
    skip, saying so; under CI (KVPROF_REQUIRE_VLLM=1, which scripts/dev.sh sets there) fail
    instead."""
    if why is None:
        return
    if os.environ.get("KVPROF_REQUIRE_VLLM") == "1":
        pytest.fail(why)
    pytest.skip(why)


@contextmanager
def io_limit(dev: str, read_bps: int | None = None, write_bps: int | None = None):
    """This process (and what it starts) in a cgroup whose reads and writes of `dev` the
    kernel holds to these rates: cgroup v2 `io.max` where the io controller is on the v2
    hierarchy, else v1 blkio's throttle."""
    majmin = Path(f"/sys/block/{dev}/dev").read_text().strip()
    v2 = next((r for r in (Path("/sys/fs/cgroup"), Path("/sys/fs/cgroup/unified"))
               if (r / "cgroup.controllers").exists()
               and "io" in (r / "cgroup.controllers").read_text().split()), None)
    if v2 is not None:
        root = v2
        (root / "cgroup.subtree_control").write_text("+io")
        cg = root / f"kvprof-test-{os.getpid()}"
        cg.mkdir()
        limits = " ".join(f"{k}={v}" for k, v in (("rbps", read_bps), ("wbps", write_bps))
                          if v)
        (cg / "io.max").write_text(f"{majmin} {limits}")
    else:
        root = Path("/sys/fs/cgroup/blkio")
        if not root.exists():
            pytest.skip("no cgroup I/O controller (v2 io or v1 blkio) on this machine")
        cg = root / f"kvprof-test-{os.getpid()}"
        cg.mkdir()
        for name, v in (("read", read_bps), ("write", write_bps)):
            if v:
                (cg / f"blkio.throttle.{name}_bps_device").write_text(f"{majmin} {v}")
    (cg / "cgroup.procs").write_text(str(os.getpid()))
    try:
        yield
    finally:
        (root / "cgroup.procs").write_text(str(os.getpid()))
        # A server started inside may still be exiting (its children reaped after it).
        deadline = time.monotonic() + 30
        while (cg / "cgroup.procs").read_text().split() and time.monotonic() < deadline:
            time.sleep(0.1)
        cg.rmdir()


def read_stat(dev: str) -> list[int]:
    return [int(x) for x in Path(f"/sys/block/{dev}/stat").read_text().split()]


def stat_delta(a: list[int], b: list[int]) -> list[int]:
    return [y - x for x, y in zip(a, b)]


def settle(dev: str, quiet_s: float = 0.3, timeout_s: float = 10) -> list[int]:
    """Wait until nobody (udev probes, earlier tests) touches the device."""
    deadline = time.monotonic() + timeout_s
    last = read_stat(dev)
    while time.monotonic() < deadline:
        time.sleep(quiet_s)
        now = read_stat(dev)
        if now[:8] == last[:8] and now[8] == 0:
            return now
        last = now
    return last


@contextlib.contextmanager
def private_loop(tmp_path, tag: str = ""):
    """A private loop device over a sparse file in /dev/shm; yields its name (loopN)."""
    backing = Path(f"/dev/shm/kvprof-test-{os.getpid()}-{tmp_path.name}{tag}.img")
    with open(backing, "wb") as f:
        f.truncate(256 << 20)
    dev = subprocess.run(["losetup", "--find", "--show", str(backing)], check=True,
                         capture_output=True, text=True).stdout.strip()
    try:
        yield Path(dev).name
    finally:
        subprocess.run(["losetup", "-d", dev], check=False)
        backing.unlink(missing_ok=True)


def aligned(size: int) -> mmap.mmap:
    return mmap.mmap(-1, size)  # page-aligned, as O_DIRECT needs


def direct_write(dev: str, nbytes: int, block: int = 1 << 20, offset: int = 0) -> None:
    buf = aligned(block)
    buf.write(b"\xab" * block)
    fd = os.open(f"/dev/{dev}", os.O_WRONLY | os.O_DIRECT)
    try:
        for off in range(offset, offset + nbytes, block):
            assert os.pwritev(fd, [buf], off) == block
    finally:
        os.close(fd)


def direct_random_reads(dev: str, count: int, span: int, size: int = 4096, seed: int = 7) -> None:
    import random

    rnd = random.Random(seed)
    buf = aligned(size)
    fd = os.open(f"/dev/{dev}", os.O_RDONLY | os.O_DIRECT)
    try:
        for _ in range(count):
            off = rnd.randrange(0, span // size) * size
            assert os.preadv(fd, [buf], off) == size
    finally:
        os.close(fd)


@dataclass
class Recorder:
    proc: subprocess.Popen
    out: Path
    socket: str
    stderr_lines: list

    def stop(self, sig=signal.SIGINT, timeout: float = 60) -> int:
        self.proc.send_signal(sig)
        rc = self.proc.wait(timeout)
        self._reader.join(5)
        if rc != 0:  # shown with the failing test (the assertion's repr cuts it short)
            print(f"recorder exited {rc}; its stderr:\n" + "".join(self.stderr_lines))
        return rc

    def report(self) -> dict:
        r = run_kvprof("report", str(self.out), "--json")
        assert r.returncode == 0, r.stderr
        report = json.loads(r.stdout)
        # Every real session's report has exactly the shape kvprof/summary.py declares.
        check_shape(report, Report)
        return report


def thread_privileges(pid: int) -> dict[str, dict[str, int]]:
    """Each thread's capability sets and no_new_privs, as the kernel shows them."""
    out = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            status = (task / "status").read_text()
            comm = (task / "comm").read_text().strip()
        except OSError:
            continue  # ended meanwhile
        fields = dict(line.split(":\t", 1) for line in status.splitlines() if ":\t" in line)
        out[f"{comm} {task.name}"] = {
            **{k: int(fields[k], 16) for k in ("CapEff", "CapPrm", "CapBnd", "CapAmb")},
            "NoNewPrivs": int(fields["NoNewPrivs"])}
    return out


def run_kvprof(*args: str, env: dict | None = None, prefix: list[str] | None = None,
               timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run((prefix or []) + KVPROF + list(args), capture_output=True, text=True,
                          timeout=timeout, env=env)


# On the Firecracker test VMs the kernel completes some block requests without running the
# BPF programs on block_rq_complete, and counts no miss (ftrace's event fires): a few in
# 10 000 requests under load, up to 1.6e-3 in a burst, none idle; bpftrace and biolatency lose
# the same ones (tests/live/test_biolatency.py). diskstats counts them. kvprof counts each as
# a loss of the event tier: when the kernel starts that request again (NOT_SEEN; the exact tier
# counts it then, as diskstats does), or, not started again by the stop, as held then (AT_STOP:
# counted by neither tier). A test forgives those only as far as CompletionWitness proves them.
NOT_SEEN = "block_completion_not_seen"


AT_STOP = "block_in_flight_at_stop"


UNTRACED = (NOT_SEEN, AT_STOP)


# The most a test forgives as lost for other reasons, whatever kvprof reports: this share of
# the requests it made, and two.
FORGIVEN_SHARE = 5e-4


def ftrace_stats(instance: Path) -> dict[str, int]:
    """A tracefs instance's ring-buffer counters (entries, overrun, ...), summed over CPUs."""
    out: dict[str, int] = {}
    for stats in instance.glob("per_cpu/cpu*/stats"):
        for line in stats.read_text().splitlines():
            key, _, value = line.partition(": ")
            if value.strip().isdigit():
                out[key] = out.get(key, 0) + int(value)
    return out


class CompletionWitness:
    """The machine's block completions as two witnesses other than kvprof count them, at any
    moment: ftrace's own block_rq_complete events in a tracefs instance of the tests' (the
    kernel fires them whether or not a BPF program runs; those the small buffer overwrote count
    as its overruns) and the runs of a BPF program of the tests' on the same tracepoint. What
    the first counted and the second did not, the kernel completed without running BPF."""

    PROGRAM = r"""
BPF_PERCPU_ARRAY(runs, u64, 1);
RAW_TRACEPOINT_PROBE(block_rq_complete) {
    int zero = 0;
    u64 *n = runs.lookup(&zero);
    if (n)
        (*n)++;
    return 0;
}
"""

    def __init__(self) -> None:
        from kvprof.capture.bccload import load_bcc

        root = system.tracefs()
        if root is None:
            raise OSError("tracefs is not mounted")
        self.bpf = load_bcc().BPF(text=self.PROGRAM)
        self.inst = root / "instances" / f"kvprof-witness-{os.getpid()}"
        self.inst.mkdir()
        (self.inst / "buffer_size_kb").write_text("8")
        (self.inst / "events/block/block_rq_complete/enable").write_text("1")

    def fired(self) -> int:
        f = ftrace_stats(self.inst)
        # Overwritten events are counted; events dropped otherwise would not be.
        assert f["commit overrun"] == f["dropped events"] == 0, f
        return f["entries"] + f["overrun"]

    def runs(self) -> int:
        return sum(self.bpf["runs"][0])

    def mark(self) -> tuple[int, int]:
        # ftrace first: a completion between the two reads can only make `proven` larger.
        return self.fired(), self.runs()

    def proven(self, since: tuple[int, int]) -> int:
        """Completions the kernel ran no BPF for since `since` (a mark())."""
        runs = self.runs()
        return self.fired() - since[0] - (runs - since[1])

    def close(self) -> None:
        (self.inst / "events/block/block_rq_complete/enable").write_text("0")
        self.inst.rmdir()
        self.bpf.cleanup()


# The witness, while live tests run (conftest.py starts it once and marks where each test
# began); None where there is none (no root), and the untraced then held to FORGIVEN_SHARE.
WITNESS: CompletionWitness | None = None
TEST_STARTED: tuple[int, int] = (0, 0)


def lost_to(report: dict, reasons: str | tuple[str, ...] = UNTRACED) -> int:
    """The events the report says were lost for `reasons` (all of them: UNTRACED)."""
    by = report["session"]["lost_by_reason"]
    return sum(by.get(r, 0) for r in ((reasons,) if isinstance(reasons, str) else reasons))


def forgiven(report: dict, requests: int, reasons: str | tuple[str, ...] | None = UNTRACED,
             share: float = FORGIVEN_SHARE) -> int:
    """What the report says was lost for `reasons` (None: for any reason): of UNTRACED's, no
    more than the witness proves the kernel completed untraced since the test began; of the
    others, at most `share` of the `requests` the kernel served (or the test made), and two. A
    count kvprof over-reports cannot excuse a shortfall."""
    by = report["session"]["lost_by_reason"]
    names = tuple(by) if reasons is None else (reasons,) if isinstance(reasons, str) else reasons
    untraced = lost_to(report, tuple(r for r in names if r in UNTRACED))
    other = lost_to(report, tuple(r for r in names if r not in UNTRACED))
    if WITNESS is not None:
        proven = WITNESS.proven(TEST_STARTED)
        assert untraced <= proven, (f"{untraced} reported untraced, {proven} proven so since "
                                    f"the test began", by)
    else:
        other += untraced
    most = 2 + int(share * requests)
    assert other <= most, (f"{other} reported lost of {requests} requests, more than the "
                           f"{most} forgiven", by)
    return untraced + other


def assert_kernel_count(ours: int, kernel: int, report: dict, each: int = 1,
                        reason: str | tuple[str, ...] | None = None) -> None:
    """kvprof's count equals the kernel's (or what a test issued), except for events kvprof
    itself reports as lost (e.g. a completion probe the kernel skipped because another BPF
    program ran on that CPU, which happens a few times per million events): of `reason`
    only, where the cause is known, and no more than `forgiven` allows. `each`: what one lost
    request can carry (for bytes). Unaccounted differences fail."""
    lost = forgiven(report, kernel // each, reason)
    assert 0 <= kernel - ours <= lost * each, (ours, kernel, report["session"]["lost_by_reason"])


def assert_same_report(ours, ref, path: str = "") -> None:
    """Two report dicts equal in every key and count; floats equal up to the last bits that
    different arithmetic order can move (quantile interpolation, sums)."""
    if isinstance(ref, dict):
        assert isinstance(ours, dict) and ours.keys() == ref.keys(), (path, ours, ref)
        for k in ref:
            assert_same_report(ours[k], ref[k], f"{path}/{k}")
    elif isinstance(ref, float) and isinstance(ours, float):
        assert ours == pytest.approx(ref, rel=1e-12, abs=1e-9), (path, ours, ref)
    elif isinstance(ref, (list, tuple)):
        assert len(ours) == len(ref), (path, ours, ref)
        for i, (a, b) in enumerate(zip(ours, ref)):
            assert_same_report(a, b, f"{path}[{i}]")
    else:
        assert ours == ref, (path, ours, ref)


def report_both_ways(con) -> dict:
    """The session's report by SQL, held first to the one the dashboard's row cache and
    per-second rollup give for the same session (they must agree key for key)."""
    from kvprof.analysis.correlate import summarize
    from kvprof.analysis.iocache import IoCache
    from kvprof.analysis.rollup import Rollup
    from kvprof.analysis.rowsource import LiveRows, SqlRows

    report = summarize(SqlRows(con))
    live = Rollup(IoCache())
    live.cache.refresh(con)
    assert_same_report(summarize(LiveRows(SqlRows(con), live)), report)
    return report


def calls_near_edges(session: Path, late_s: float) -> int:
    """The recorded file calls issued less than `late_s` before a window's start or end: a
    replay that issued them that late put them in the next window."""
    import duckdb

    con = duckdb.connect(str(session / "session.duckdb"), read_only=True)
    try:
        return con.execute("""
            SELECT count(*) FROM io, (SELECT start_ns AS t FROM phase UNION
                                      SELECT end_ns FROM phase) w
            WHERE layer = 'syscall' AND issue_ns < w.t AND issue_ns >= w.t - ?""",
                           [int(late_s * 1e9) + 1]).fetchall()[0][0]
    finally:
        con.close()
