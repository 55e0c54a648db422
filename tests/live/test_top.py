"""`kvprof top`: snapshots equal the report for the same window, the real app under Pilot and
in a real terminal (tmux), the findings, and replay of a Parquet export."""
from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from kvprof import schema
from kvprof.analysis.correlate import summarize
from kvprof.analysis.rowsource import SqlRows, ViewFilter
from kvprof.commands.demo import SAMPLE_DIR
from kvprof.store.parquet import export_parquet
from kvprof.store.session import Reader, open_replay, session_info
from kvprof.views.findings import findings, phase_finding
from kvprof.views.report import to_text
from kvprof.views.snapshot import Clock, build_snapshot
from tests.helpers import KVPROF, assert_same_report, live, report_both_ways, run_kvprof

ROOT = Path(__file__).resolve().parents[2]
SAMPLE = SAMPLE_DIR


@pytest.fixture
def sample():
    con = open_replay(SAMPLE)
    yield con, session_info(con)
    con.close()


# -- findings ----------------------------------------------------------------------------------

def _phase(time_s=1.0, idle=None, **ops):
    def entry(ios=0, nbytes=0, p99=None, size=4096, bw=0.0):
        return {"ios": ios, "bytes": nbytes, "bandwidth_bytes_per_s": bw,
                "iops": ios / time_s if time_s else 0.0,
                "latency_us": {"p50": p99, "p90": p99, "p99": p99, "p999": p99},
                "size_hist": {str(size): ios} if ios else {}}
    ph = {"time_s": time_s, "block": {"read": entry(), "write": entry(),
                                      "time_idle_pct": idle},
          "io_uring": {"read": entry(), "write": entry()}, "caches": {}}
    for op, kw in ops.items():
        ph["block"][op] = entry(**kw)
    return ph


def test_findings_name_the_limit_of_each_phase():
    lat = _phase(idle=96.0, read=dict(ios=1000, nbytes=4096000, p99=3100.0))
    assert phase_finding("decode", lat) == \
        "decode reads are latency-bound at p99 = 3.1ms while the device is 96 % idle"
    bw = _phase(idle=10.0, write=dict(ios=100, nbytes=100 << 20, p99=900.0, size=1 << 20,
                                      bw=400 * 2**20))
    assert phase_finding("prefill", bw).startswith(
        "prefill writes are bandwidth-bound at 400.0 MiB/s (1M requests, device busy 90 %")
    assert phase_finding("idle", _phase(idle=100.0)) == "idle: no storage I/O in 1.0 s"
    assert phase_finding("mixed", _phase(time_s=0.0)) is None


def test_report_ends_with_the_findings(sample):
    con, _ = sample
    summary = summarize(SqlRows(con))
    text = to_text(summary, "kvprof/samples/demo")
    block = text.split("\nfindings:\n", 1)[1]
    assert "decode reads are latency-bound" in block
    assert all(len(line) <= 80 for line in text.splitlines())
    assert [(f.phase, f.rule) for f in findings(summary)] == [
        ("prefill", "bandwidth-bound"), ("decode", "latency-bound"), ("idle", "no-io"),
        ("decode", "sized-for-one-phase"), ("decode", "decode-dominated")]


# -- snapshots -----------------------------------------------------------------------------------

@pytest.mark.parametrize("window_s", [None, 60.0, 10.0, 1.0])
def test_snapshot_summary_is_the_report_for_its_window(sample, window_s):
    con, info = sample
    now = info.start_ns + 2_500_000_000 if window_s == 1.0 else info.end_ns
    s = build_snapshot(SqlRows(con), window_s, now)
    assert s.t1_ns == now and s.t0_ns == (info.start_ns if window_s != 1.0 else now - 10**9)
    assert s.summary == summarize(SqlRows(con), s.t0_ns, s.t1_ns)
    if window_s is None:
        # The whole session at its end is `kvprof report`.
        assert s.summary == summarize(SqlRows(con))
    dec = s.phase("decode")
    rep = s.summary["phases"]["decode"]["block"]["read"]
    assert dec.read.mean == rep["bandwidth_bytes_per_s"] and dec.p99_us == rep["latency_us"]["p99"]
    assert dec.read.peak >= dec.read.mean > 0 and dec.read.now > 0
    assert len(s.timeline) == 60 and any(b.phase == "decode" for b in s.timeline)
    assert s.findings == tuple(f.text for f in findings(s.summary))
    assert s.gpu is None and "no GPU data" in s.gpu_note


def test_snapshot_filters(sample):
    con, info = sample
    fio = next(t for t, c in build_snapshot(SqlRows(con), None, info.end_ns).process_choices
               if c == "fio")
    s = build_snapshot(SqlRows(con), None, info.end_ns, ViewFilter(tgid=fio))
    assert s.summary == summarize(SqlRows(con), s.t0_ns, s.t1_ns, ViewFilter(tgid=fio))
    assert s.phase("prefill").ios == 0 and s.phase("decode").ios > 0
    none = build_snapshot(SqlRows(con), None, info.end_ns, ViewFilter(device="nvme9n9"))
    assert not any(p.ios for p in none.phases) and any("no I/O" in n for n in none.notes)


def test_parquet_export_replays_the_same(sample, tmp_path):
    con, info = sample
    export_parquet(con, tmp_path / "pq")
    pq = open_replay(tmp_path / "pq")
    try:
        assert build_snapshot(SqlRows(pq), None, info.end_ns).summary == summarize(SqlRows(con))
    finally:
        pq.close()


def test_rows_seen_before_the_sessions_first_timestamp_stay_in_their_window(tmp_path):
    """The probes attach a few ms before the recorder stamps the session's start, and the
    whole-session report counts what they saw then: each row in the window that held it
    (an engine step already running), as DuckDB's own join of rows to windows says, not in
    the phase that holds the start. (On a real vLLM, 9 of an fs-tier prefill's stores were
    reported in decode so.) The sample with its start moved 1 ms into its first decode
    window: its first prefill's rows now precede the session."""
    import duckdb

    from kvprof.analysis.correlate import timeline

    shutil.copytree(SAMPLE, tmp_path / "s")
    with duckdb.connect(str(tmp_path / "s" / "session.duckdb")) as con:
        start = con.execute("SELECT min(start_ns) + 1000000 FROM phase WHERE phase = 'decode'"
                            ).fetchone()[0]
        con.execute("UPDATE session SET start_ns = ?", [start])
        joined = """SELECT coalesce(w.phase, 'idle'), io.layer, io.op, count(*) FROM io
                    LEFT JOIN phase w ON io.issue_ns >= w.start_ns AND io.issue_ns < w.end_ns
                    {} GROUP BY ALL"""
        want = {(p, layer, op): n for p, layer, op, n in con.execute(joined.format("")).fetchall()}
        early = con.execute(joined.format(f"WHERE io.issue_ns < {start}")).fetchall()
    assert {p for p, *_ in early} == {"prefill"} and sum(n for *_, n in early) > 50, early
    report = json.loads(run_kvprof("report", str(tmp_path / "s"), "--json").stdout)
    got = {(p, layer, op): report["phases"][p][layer][op]["ios"]
           for p in schema.PHASES for layer in ("block", "io_uring") for op in ("read", "write")
           if report["phases"][p].get(layer, {}).get(op, {}).get("ios")}
    assert got == want
    con = open_replay(tmp_path / "s")
    try:
        # The dashboard's row cache and the visual report's timeline count them so too.
        report_both_ways(con)
        binned: dict = {}
        for s in timeline(SqlRows(con))["series"].values():
            key = (s["phase"], s["layer"], s["op"])
            binned[key] = binned.get(key, 0) + sum(s["ios"])
        assert binned == want
    finally:
        con.close()


def test_replay_clock_plays_scrubs_and_stops_at_the_end():
    t = [0]
    c = Clock(1000, 1000 + 10 * 10**9, playing=False, mono=lambda: t[0])
    assert c.now_ns() == c.end_ns
    assert c.toggle() and c.now_ns() == 1000  # play from the end restarts
    c.set_speed(2.0)
    t[0] += 10**9
    assert c.now_ns() == 1000 + 2 * 10**9
    c.seek(-5 * 10**9)
    assert c.now_ns() == 1000
    t[0] += 60 * 10**9
    assert c.now_ns() == c.end_ns and not c.playing


# -- the real app under Pilot ----------------------------------------------------------------------

def _app(con, info, **kw):
    from kvprof.views.tui.app import KvprofTop

    return KvprofTop(Reader(con), Clock(info.start_ns, info.end_ns, playing=False), name="demo",
                     interval_s=0.2, window_s=None, **kw)


async def _wait(pilot, app, pred, timeout=10.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if app.snapshot is not None and pred(app.snapshot):
            return app.snapshot
        await pilot.pause(0.05)
    raise AssertionError("no snapshot matched")


def test_pilot_keys_change_window_filter_and_pause(sample):
    from kvprof.views.tui.app import SnapshotReady

    con, info = sample
    posted = []

    async def run():
        app = _app(con, info)
        hook = lambda m: posted.append(m.snapshot) if isinstance(m, SnapshotReady) else None  # noqa
        async with app.run_test(size=(80, 24), message_hook=hook) as pilot:
            s = await _wait(pilot, app, lambda s: True)
            assert s.window_s is None and s.t1_ns == info.end_ns
            await pilot.press("w")
            s = await _wait(pilot, app, lambda s: s.window_s == 10.0)
            await pilot.press("d")
            s = await _wait(pilot, app, lambda s: s.filters.device == "loop0")
            await pilot.press("d")
            s = await _wait(pilot, app, lambda s: s.filters.device is None)
            await pilot.press("p")
            s = await _wait(pilot, app, lambda s: s.filters.tgid is not None)
            assert s.filters.tgid == s.process_choices[0][0]
            await pilot.press(*["p"] * len(s.process_choices))  # round to all processes
            s = await _wait(pilot, app, lambda s: s.filters.tgid is None)
            await pilot.press("space")  # play: from the end, replay restarts at the start
            s = await _wait(pilot, app, lambda s: s.t1_ns < info.end_ns)
            assert app.clock.playing
            await pilot.press("space")
            assert not app.clock.playing
            frozen = app.clock.now_ns()
            await pilot.pause(0.5)
            assert app.clock.now_ns() == frozen
            await pilot.press("left")
            assert app.clock.now_ns() == info.start_ns
            await pilot.press("question_mark")
            assert type(app.screen).__name__ == "HelpScreen"
            await pilot.press("escape")
            await pilot.press("q")
        return app

    app = asyncio.run(run())
    assert app.return_code in (0, None)
    assert {s.window_s for s in posted} >= {None, 10.0}
    # The first message, the whole session at its end, is what `kvprof report --json` prints.
    out = run_kvprof("report", str(SAMPLE), "--json")
    assert out.returncode == 0, out.stderr
    printed = json.loads(out.stdout)
    # The report's JSON adds the findings, which the dashboard shows from the same summary.
    assert [f["text"] for f in printed.pop("findings")] == [
        f.text for f in findings(posted[0].summary)]
    assert_same_report(posted[0].summary, printed)
    # Every message carries the report of its window and filter (built from the feed's row
    # cache, held equal to the SQL of `kvprof report`).
    for s in posted[:: max(1, len(posted) // 6)] + posted[-1:]:
        assert_same_report(s.summary, summarize(SqlRows(con), s.t0_ns, s.t1_ns, s.filters))
        assert s.phase("decode").ios == sum(s.summary["phases"]["decode"]["block"][op]["ios"]
                                            for op in ("read", "write"))


def test_pilot_export_writes_parquet_off_the_ui_thread(sample, tmp_path):
    con, info = sample

    async def run():
        app = _app(con, info, export_dir=tmp_path / "pq")
        async with app.run_test(size=(80, 24)) as pilot:
            await _wait(pilot, app, lambda s: True)
            await pilot.press("e")
            await app.workers.wait_for_complete()
            await pilot.press("q")

    asyncio.run(run())
    assert sorted(p.name for p in (tmp_path / "pq").iterdir()) == sorted(
        f"{table}.parquet" for table in schema.TABLES)


def test_command_palette_lists_the_actions(sample):
    con, info = sample
    app = _app(con, info)
    from kvprof.views.tui.app import KvprofTop

    names = [b.description for b in KvprofTop.BINDINGS]
    assert {"Pause", "Window", "Device", "Process", "Export", "Quit"} <= set(names)

    async def run():
        async with app.run_test(size=(80, 24)) as pilot:
            got = [c.title for c in app.get_system_commands(app.screen)]
            await pilot.press("q")
            return got

    titles = asyncio.run(run())
    for n in ("Pause", "Window", "Device", "Process", "Export", "Quit"):
        assert any(t.startswith(n) for t in titles), titles


# -- snapshot (SVG) tests: fixed terminal size; replay paused at the end is a frozen clock --------

@pytest.mark.parametrize("size", [(80, 24), (120, 36)])
def test_screen_snapshot(snap_compare, sample, size):
    con, info = sample
    app = _app(con, info)

    async def ready(pilot):
        await _wait(pilot, app, lambda s: True)
        await pilot.pause()

    assert snap_compare(app, terminal_size=size, run_before=ready)


def _panel_app(widget):
    from textual.app import App

    class Panel(App):
        def compose(self):
            yield widget

    return Panel()


@pytest.mark.parametrize("panel,size", [("header", (80, 3)), ("timeline", (80, 6)),
                                        ("prefill", (26, 16)), ("decode", (26, 16)),
                                        ("mixed", (26, 16)), ("idle", (26, 16)),
                                        ("gpu", (80, 2)), ("findings", (80, 5))])
def test_panel_snapshot(snap_compare, sample, panel, size):
    """Each panel alone, on the sample paused at its end (a frozen clock)."""
    from kvprof.views.tui.app import FindingsLine, GpuLine, HeaderBar, PhasePanel, Timeline

    con, info = sample
    snap = build_snapshot(SqlRows(con), None, info.end_ns)
    widget = {"header": HeaderBar, "timeline": Timeline, "gpu": GpuLine,
              "findings": FindingsLine}.get(panel, lambda: PhasePanel(panel))()
    app = _panel_app(widget)

    async def ready(pilot):
        widget.snapshot = snap
        await pilot.pause()

    assert snap_compare(app, terminal_size=size, run_before=ready)


# -- a real terminal ------------------------------------------------------------------------------

def _tmux(*args: str) -> str:
    return subprocess.run(["tmux", *args], check=True, capture_output=True, text=True).stdout


def _screen_until(name: str, pred, timeout: float = 20.0) -> str:
    deadline = time.monotonic() + timeout
    screen = ""
    while time.monotonic() < deadline:
        screen = _tmux("capture-pane", "-p", "-t", name)
        if pred(screen):
            return screen
        time.sleep(0.1)
    raise AssertionError(screen)


@pytest.mark.skipif(shutil.which("tmux") is None, reason="needs tmux")
def test_replay_in_tmux_shows_the_panels_and_q_exits_cleanly(tmp_path):
    name = f"kvprof-test-{os.getpid()}"
    rc = tmp_path / "rc"
    cmd = (f"cd {ROOT} && {' '.join(KVPROF)} top --replay kvprof/samples/demo; "
           f"echo $? > {rc}; exec sleep 60")
    _tmux("new-session", "-d", "-s", name, "-x", "80", "-y", "24", cmd)
    try:
        # Textual repaints panel by panel and tmux may capture between them: wait for a
        # whole frame (no panel still waiting), then judge what it shows.
        screen = _screen_until(name, lambda s: "73.0 %" in s and "waiting for data" not in s)
        for phase in ("prefill", "decode", "mixed", "idle"):
            assert f"╭─ {phase} " in screen
        assert "time 73.0 % 3.0s" in screen and "p50/99 13us 62us" in screen
        assert "idle 95.9 %" in screen and "latency-bound" in screen
        assert all(len(line) <= 80 for line in screen.splitlines())
        _tmux("send-keys", "-t", name, "q")
        deadline = time.monotonic() + 10
        while not rc.exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert rc.read_text().strip() == "0"
        after = _tmux("capture-pane", "-p", "-t", name)
        assert "╭─" not in after and "kvprof top" not in after  # alternate screen left
    finally:
        subprocess.run(["tmux", "kill-session", "-t", name], capture_output=True)


@pytest.mark.skipif(shutil.which("setpriv") is None, reason="needs setpriv")
def test_live_top_without_privileges_is_one_line_and_77():
    r = run_kvprof("top", "-d", "loop0",
                   prefix=["setpriv", "--bounding-set=-all", "--inh-caps=-all"])
    assert r.returncode == 77
    assert r.stderr.startswith("kvprof: error: live capture needs root")
    assert "Traceback" not in r.stderr


def test_replay_of_a_missing_session_is_one_line(tmp_path):
    r = run_kvprof("top", "--replay", str(tmp_path / "nope"))
    assert r.returncode == 66 and r.stderr.count("\n") == 1


def _live_top(name: str, args: str, tmp_path: Path) -> int:
    """`kvprof top ARGS` in a tmux session `name` (80x24), its exit status to tmp_path/rc
    when it ends; waits until it shows the live dashboard and returns its pid."""
    cmd = (f"cd {ROOT} && {' '.join(KVPROF)} top {args}; echo $? > {tmp_path / 'rc'}; "
           "exec sleep 60")
    _tmux("new-session", "-d", "-s", name, "-x", "80", "-y", "24", cmd)
    _screen_until(name, lambda s: "live ▶" in s and "╭─ idle" in s, timeout=90)
    return next(int(p) for p in subprocess.run(
        ["pgrep", "-f", f"kvprof top {args}"], capture_output=True, text=True).stdout.split()
        if Path(f"/proc/{p}/cmdline").read_bytes().split(b"\0")[1:4] ==
        [b"-m", b"kvprof", b"top"])  # not the shell or tmux that hold the same words


@live
@pytest.mark.skipif(shutil.which("tmux") is None, reason="needs tmux")
def test_live_numbers_move_within_a_second_of_the_io(loopdev, tmp_path):
    from tests.helpers import direct_write, thread_privileges

    name = f"kvprof-live-{os.getpid()}"
    out = tmp_path / "live"
    try:
        pid = _live_top(name, f"-d {loopdev} -o {out} --socket {tmp_path / 'm.sock'}",
                        tmp_path)
        # Attached: the dashboard's process holds no privilege in any thread (block and
        # io_uring need none once attached; kvprof.privileges).
        threads = thread_privileges(pid)
        print(f"live top: {len(threads)} threads, privileges "
              f"{sorted({p['CapEff'] | p['CapPrm'] | p['CapBnd'] for p in threads.values()})}")
        assert len(threads) >= 5 and all(
            p["CapEff"] | p["CapPrm"] | p["CapBnd"] == 0 and p["NoNewPrivs"] == 1
            for p in threads.values()), threads
        time.sleep(0.5)
        direct_write(loopdev, 64 << 20)
        t_io = time.monotonic()
        # No phase source: all of it is idle time; its write bandwidth appears on screen.
        screen = _screen_until(name, lambda s: "no I/O" not in s.split("╭─ idle")[1]
                               and "W " in s.split("╭─ idle")[1], timeout=5)
        print(f"live: on screen {time.monotonic() - t_io:.2f} s after the I/O")
        assert time.monotonic() - t_io < 1.0, screen
        _tmux("send-keys", "-t", name, "q")
        deadline = time.monotonic() + 30
        while not (tmp_path / "rc").exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert (tmp_path / "rc").read_text().strip() == "0"
    finally:
        subprocess.run(["tmux", "kill-session", "-t", name], capture_output=True)
    rep = run_kvprof("report", str(out), "--json")
    assert rep.returncode == 0, rep.stderr
    assert '"write"' in rep.stdout



@live
@pytest.mark.skipif(shutil.which("tmux") is None, reason="needs tmux")
def test_live_top_with_the_syscall_layer_keeps_only_what_naming_files_takes(loopdev, tmp_path):
    """`top -p PID` (the syscall layer: naming other users' files takes CAP_SYS_PTRACE and
    CAP_DAC_READ_SEARCH, kept by the recorder once attached): every thread holds at most
    those (and the BPF capability where the kernel checks it on each map use), the dashboard's
    none, and kvprof says no thread kept more (it did, wrongly, of the recorder's own
    threads when it measured them against the dashboard's empty set)."""
    from kvprof import privileges
    from tests.helpers import thread_privileges

    name = f"kvprof-caps-{os.getpid()}"
    out = tmp_path / "live"
    try:
        # (Textual draws on stderr: the recorder's lines follow on the terminal once it quits)
        pid = _live_top(name, f"-d {loopdev} -p {os.getpid()} -o {out} "
                              f"--socket {tmp_path / 'm.sock'}", tmp_path)
        threads = thread_privileges(pid)
        allowed = 0
        for cap in ("CAP_SYS_PTRACE", "CAP_DAC_READ_SEARCH", "CAP_BPF", "CAP_SYS_ADMIN"):
            allowed |= 1 << privileges.CAP_NUMBERS[cap]
        held = {t: p["CapEff"] | p["CapPrm"] for t, p in threads.items()}
        print(f"live top -p: {len(threads)} threads; held {sorted(set(held.values()))}")
        assert len(threads) >= 5 and all(c & ~allowed == 0 for c in held.values()), held
        assert any(c for c in held.values()), held  # the recorder's threads keep theirs
        _tmux("send-keys", "-t", name, "q")
        deadline = time.monotonic() + 30
        while not (tmp_path / "rc").exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert (tmp_path / "rc").read_text().strip() == "0"
        said = _tmux("capture-pane", "-p", "-J", "-t", name)
    finally:
        subprocess.run(["tmux", "kill-session", "-t", name], capture_output=True)
    print(said)
    assert "keep privileges" not in said and "privileges dropped (kept:" in said, said


def test_phase_panel_shows_each_kv_cache_where_it_has_room():
    """With the syscall layer, a panel adds the application's file bandwidth and then one
    line per KV cache, busiest first, as far as its height allows."""
    from kvprof.views.tui.app import PhasePanel
    from tests.unit.test_live_cache import NS, Session

    sess = Session(seconds=4, rate=2000)
    sess.flush_until(sess.start + 4 * NS)
    snap = build_snapshot(SqlRows(sess.con), None, sess.start + 4 * NS)
    dec = snap.phase("decode")
    caches = snap.summary["phases"]["decode"]["caches"]
    assert [c[0] for c in dec.caches] == sorted(
        caches, key=lambda n: (-(caches[n]["read"]["bandwidth_bytes_per_s"]
                                 + caches[n]["write"]["bandwidth_bytes_per_s"]), n))
    assert dec.app_read == snap.summary["phases"]["decode"]["syscall"]["read"][
        "bandwidth_bytes_per_s"]

    def lines(size):
        widget = PhasePanel("decode")
        app = _panel_app(widget)
        out = []

        async def run():
            async with app.run_test(size=size) as pilot:
                widget.snapshot = snap
                await pilot.pause()
                out.append(str(widget.render()))
        asyncio.run(run())
        return out[0].splitlines()

    tall, short = lines((40, 16)), lines((40, 11))
    app_at = next(i for i, line in enumerate(tall) if line.startswith("app "))
    p50_at = next(i for i, line in enumerate(tall) if line.startswith("p50/99"))
    assert [line.split()[0] for line in tall[app_at + 1:p50_at]] == [c[0] for c in dec.caches]
    # Too short for the extra lines: the device's numbers keep their place.
    assert not any(line.startswith("app ") for line in short)
    assert short[-1].startswith("idle")


@pytest.mark.parametrize("queued", ["none", "some", "all"])
def test_queue_and_device_quantiles_equal_numpy_on_the_rows_whatever_waited_in_a_queue(
        tmp_path, queued):
    """Queue and device time quantiles per phase and op, with no block request queued by a
    scheduler (NVMe, loop), some, or all: numpy's (linear, as quantile_cont) over DuckDB's
    own join of the rows to the windows; the dashboard's row cache says the same."""
    import duckdb
    import numpy as np


    shutil.copytree(SAMPLE, tmp_path / "s")
    waited = {"none": "FALSE", "some": "issue_ns % 3 = 0", "all": "TRUE"}[queued]
    with duckdb.connect(str(tmp_path / "s" / "session.duckdb")) as con:
        con.execute(f"""UPDATE io SET insert_ns = CASE WHEN {waited}
                        THEN issue_ns - 500 - issue_ns % 7000 ELSE 0 END
                        WHERE layer = 'block'""")
        rows = con.execute("""
            SELECT coalesce(w.phase, 'idle'), io.op,
                   CASE WHEN insert_ns > 0 THEN issue_ns - insert_ns ELSE 0 END,
                   complete_ns - issue_ns
            FROM io LEFT JOIN phase w ON io.issue_ns >= w.start_ns AND io.issue_ns < w.end_ns
            WHERE io.layer = 'block'""").fetchall()
    want: dict = {}
    for p, op, q, d in rows:
        want.setdefault((p, op), ([], []))
        want[(p, op)][0].append(q)
        want[(p, op)][1].append(d)
    con = open_replay(tmp_path / "s")
    try:
        report = report_both_ways(con)
    finally:
        con.close()
    qs = [q for _, q in schema.QUANTILES]
    for (p, op), (q, d) in want.items():
        got = report["phases"][p]["block"][op]
        for key, values in (("queue_us", q), ("device_us", d)):
            ref = np.percentile(np.array(values, np.int64), [100 * x for x in qs]) / 1e3
            assert list(got[key].values()) == pytest.approx(list(ref), rel=1e-9), \
                (queued, p, op, key)
    assert (queued == "none") == all(max(q) == 0 for q, _ in want.values())
