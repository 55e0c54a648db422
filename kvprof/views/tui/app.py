"""`kvprof top`: live or replayed per-phase storage dashboard.

Data path (memray's pattern): one `SnapshotFeed` thread builds a frozen `Snapshot` from its
own row source and posts it as a `SnapshotReady` message; the app keeps only the newest
and hands it to the widgets, which just render it. The app holds the session only as a
`store.Reader` for the feed and the export worker: nothing here queries DuckDB.
"""
from __future__ import annotations

from dataclasses import replace
from datetime import datetime, timezone
from pathlib import Path
from typing import Iterable

from rich.text import Text
from textual.app import App, ComposeResult, SystemCommand
from textual.binding import Binding
from textual.containers import Horizontal
from textual.message import Message
from textual.reactive import reactive
from textual.screen import ModalScreen, Screen
from textual.widget import Widget
from textual.widgets import Footer, Static

from kvprof import schema
from kvprof.errors import KvprofError
from kvprof.store.parquet import export_session
from kvprof.store.session import Reader
from kvprof.units import human_us, size_label
from kvprof.views.snapshot import NS, WINDOWS_S, Clock, Snapshot, SnapshotFeed, ViewRequest

PHASE_COLOURS = {"prefill": "#e5a50a", "decode": "#3584e4", "mixed": "#c061cb",
                 "idle": "#5e5c64"}
BARS = " ▁▂▃▄▅▆▇█"
SPEEDS = (0.25, 0.5, 1.0, 2.0, 4.0, 8.0)
SEEK_NS = 5 * NS


def short_rate(v: float) -> str:
    """Bytes/s in at most 4 characters (the panels are 18 columns wide at 80x24)."""
    for unit, div in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if v >= div * 1000 / 1024:  # 1011M would take 5 columns: show 1.0G
            x = v / div
            return f"{x:.1f}{unit}" if x < 10 else f"{x:.0f}{unit}"
    return f"{v:.0f}"


def spark(hist: tuple[tuple[int, int], ...], width: int) -> str:
    """log2 buckets as one row of bars, from the smallest to the largest bucket seen."""
    if not hist:
        return "-"
    lo, hi = hist[0][0].bit_length(), hist[-1][0].bit_length()
    counts = dict((k.bit_length(), n) for k, n in hist)
    row = [counts.get(b, 0) for b in range(lo, hi + 1)][:width]
    top = max(row) or 1
    return "".join(BARS[0 if n == 0 else max(1, round(8 * n / top))] for n in row)


def window_label(w: float | None) -> str:
    return "whole session" if w is None else f"{w:.0f} s"


class SnapshotReady(Message):
    """A new snapshot from the feed thread. Queued ones coalesce: only the newest matters."""

    def __init__(self, snapshot: Snapshot) -> None:
        super().__init__()
        self.snapshot = snapshot

    def can_replace(self, message: Message) -> bool:
        return isinstance(message, SnapshotReady)


class FeedError(Message):
    def __init__(self, text: str) -> None:
        super().__init__()
        self.text = text


class SnapshotView(Widget):
    """A widget that renders the app's newest snapshot and nothing else."""

    snapshot: reactive[Snapshot | None] = reactive(None)

    def render(self) -> Text:
        return self.render_snapshot(self.snapshot) if self.snapshot else Text("waiting for data…")

    def render_snapshot(self, s: Snapshot) -> Text:
        raise NotImplementedError


class HeaderBar(SnapshotView):
    DEFAULT_CSS = "HeaderBar { height: 2; background: $boost; }"
    mode = reactive("")

    def render_snapshot(self, s: Snapshot) -> Text:
        # UTC, as in `kvprof report`: the same screen wherever it is replayed.
        start = datetime.fromtimestamp(
            (s.summary["session"]["start_wall_ns"] - (s.t0_ns - s.start_ns)) / 1e9, timezone.utc)
        t = Text(no_wrap=True, overflow="ellipsis")
        t.append("kvprof top ", style="bold")
        t.append(f"{s.host}  dev {','.join(s.devices) or '-'}  "
                 f"src {','.join(s.sources)}  {self.mode}\n")
        t.append(f"{start:%H:%M:%S}+{s.session_s:.1f}s  win {window_label(s.window_s)}  "
                 f"{s.filters.label()}  {s.events_per_s:,.0f} ev/s  lost {s.lost_events}")
        return t


class Timeline(SnapshotView):
    """Storage bandwidth per bin as bars over a band of phase colours."""

    DEFAULT_CSS = "Timeline { height: 5; }"

    def render_snapshot(self, s: Snapshot) -> Text:
        width = max(1, self.size.width)
        bins = s.timeline
        cols = [bins[min(len(bins) - 1, c * len(bins) // width)] for c in range(width)] \
            if len(bins) >= width else [bins[c * len(bins) // width] for c in range(width)]
        peak = max((b.bytes for b in bins), default=0)
        rate = lambda b: b.bytes / (s.bin_ns / NS)  # noqa: E731
        span = (bins[-1].start_ns + s.bin_ns - bins[0].start_ns) / NS if bins else 0
        t = Text(no_wrap=True, overflow="crop")
        t.append(f"last {span:.0f} s  bandwidth peak {short_rate(peak / (s.bin_ns / NS))}/s  ",
                 style="bold")
        for p in schema.PHASES:
            t.append("■", style=PHASE_COLOURS[p])
            t.append(f"{p} ")
        t.append("\n")
        rows = 3
        for r in range(rows - 1, -1, -1):
            for b in cols:
                level = 0 if peak == 0 else rate(b) / (peak / (s.bin_ns / NS)) * rows * 8
                cell = int(min(8, max(0, level - r * 8)))
                if b.bytes and r == 0 and cell == 0:
                    cell = 1  # any I/O at all stays visible
                t.append(BARS[cell], style=PHASE_COLOURS.get(b.phase or "", "white"))
            t.append("\n")
        for b in cols:
            t.append("▀" if b.phase else " ", style=PHASE_COLOURS.get(b.phase or "", ""))
        return t


class PhasePanel(SnapshotView):
    DEFAULT_CSS = """
    PhasePanel { width: 1fr; height: 100%; border: round $panel-lighten-2; padding: 0; }
    """

    def __init__(self, phase: str) -> None:
        super().__init__(id=f"panel-{phase}")
        self.phase = phase
        self.border_title = phase
        self.styles.border = ("round", PHASE_COLOURS[phase])

    def render_snapshot(self, s: Snapshot) -> Text:
        p = s.phase(self.phase)
        t = Text(no_wrap=True, overflow="crop")
        t.append(f"time {p.time_share_pct:4.1f} % {p.time_s:.1f}s\n")
        if p.time_s <= 0:
            t.append("not seen in this\nwindow", style="dim")
            return t
        if not p.ios:
            t.append("no I/O", style="dim")
            t.append(f"\nidle {p.idle_pct:.1f} %" if p.idle_pct is not None else "")
            t.append(_capacity(p))
            return t
        w = max(4, self.size.width - 5)
        t.append("    now mean peak\n", style="dim")
        for label, r in (("R", p.read), ("W", p.write)):
            t.append(f"{label} {short_rate(r.now):>4} {short_rate(r.mean):>4} "
                     f"{short_rate(r.peak):>4}\n")
        t.append(f"IOPS {p.iops:,.0f}" + (" uring" if p.layer != "block" else "") + "\n")
        if (p.app_read or p.app_write) and self.size.height >= 10:
            # The application's own file calls: page-cache hits and buffered writes included.
            # Only where it fits: the device's numbers below come first.
            hit = "" if p.page_cache_hit_pct is None else f" {p.page_cache_hit_pct:.0f}%"
            t.append(f"app {short_rate(p.app_read):>4} {short_rate(p.app_write):>4}{hit}\n")
            # Then each KV cache, while the panel has a line to spare for it.
            shown = p.caches[:max(0, self.size.height - 10)]
            tails = [f" {short_rate(rd):>4} {short_rate(wr):>4}" + (
                "" if chit is None else f" {chit:>3.0f}%") for _, rd, wr, chit in shown]
            w = max(1, self.size.width - 1 - max(map(len, tails), default=0))
            for (name, *_), tail in zip(shown, tails):
                t.append(f" {name[:w]:<{w}}", style="dim")
                t.append(tail + "\n")
        t.append(f"p50/99 {human_us(p.p50_us)} {human_us(p.p99_us)}\n")
        t.append("lat  ", style="dim")
        t.append(spark(p.latency_hist_us, w) + "\n", style=PHASE_COLOURS[self.phase])
        t.append("size ", style="dim")
        t.append(spark(p.size_hist, w), style=PHASE_COLOURS[self.phase])
        if p.size_hist:
            lo, hi = size_label(p.size_hist[0][0]), size_label(p.size_hist[-1][0])
            label = f" {lo}" if lo == hi else f" {lo}-{hi}"
            # Only where it fits beside the bars: a wrapped line would push "idle" out.
            if 5 + len(spark(p.size_hist, w)) + len(label) <= self.size.width:
                t.append(label, style="dim")
        t.append("\nidle " + ("-" if p.idle_pct is None else f"{p.idle_pct:.1f} %"))
        t.append(_capacity(p))
        if p.inflight_mean is not None:
            # The requests in flight while busy, on average: about 1, one at a time.
            t.append(f" qd {p.inflight_mean:.1f}")
        return t


def _capacity(p) -> str:
    """Capacity idle beside time idle, where the device was calibrated."""
    return "" if p.capacity_idle_pct is None else f" cap {p.capacity_idle_pct:.0f} %"


class GpuLine(SnapshotView):
    DEFAULT_CSS = "GpuLine { height: 1; }"

    def render_snapshot(self, s: Snapshot) -> Text:
        g = s.gpu
        if g is None:
            return Text(f"GPU: {s.gpu_note}", style="dim", no_wrap=True, overflow="ellipsis")

        def pct(v: float | None) -> str:
            return "-" if v is None else f"{v:.0f} %"

        return Text(f"GPU x{g.gpus}: util {pct(g.util_pct)}  mem {pct(g.mem_util_pct)}  "
                    f"SM {pct(g.sm_active_pct)}  "
                    f"power {'-' if g.power_w is None else f'{g.power_w:.0f} W'}  "
                    f"PCIe rx {short_rate(g.pcie_rx_bytes_per_s or 0)}/s "
                    f"tx {short_rate(g.pcie_tx_bytes_per_s or 0)}/s",
                    no_wrap=True, overflow="ellipsis")


class FindingsLine(SnapshotView):
    DEFAULT_CSS = "FindingsLine { height: auto; min-height: 3; max-height: 6; }"
    # Its height follows its lines, so a new snapshot or error lays the screen out again
    # (a repaint alone would keep the height of the text before).
    snapshot: reactive[Snapshot | None] = reactive(None, layout=True)
    error = reactive("", layout=True)

    def render(self) -> Text:
        if self.error:
            return Text(f"error: {self.error}", style="bold red")
        return super().render()

    def render_snapshot(self, s: Snapshot) -> Text:
        t = Text()
        for i, line in enumerate((*s.notes, *s.findings)):
            t.append("\n" if i else "")
            t.append("» ", style="bold")
            t.append(line)
        return t


class HelpScreen(ModalScreen):
    DEFAULT_CSS = """
    HelpScreen { align: center middle; }
    HelpScreen > Static { width: 64; height: auto; border: round $accent; padding: 1 2;
                          background: $surface; }
    """
    BINDINGS = [Binding("escape,q,question_mark", "app.pop_screen", "Close")]

    def compose(self) -> ComposeResult:
        lines = ["kvprof top — keys", ""]
        for b in KvprofTop.KEYS:
            lines.append(f"  {b.key_display or b.key:<12} {b.description}")
        lines += ["", "Numbers are per phase over the window; bandwidth = bytes ÷ phase time.",
                  "The same actions are in the command palette (ctrl+p).", "Esc closes."]
        yield Static("\n".join(lines))


class KvprofTop(App):
    TITLE = "kvprof top"
    CSS = """
    Screen { layout: vertical; }
    #panels { height: 1fr; min-height: 10; }
    """
    # (All Binding objects, which the help screen and the palette read.)
    KEYS = [
        Binding("space", "pause", "Pause", key_display="space"),
        Binding("w", "window", "Window"),
        Binding("d", "device", "Device"),
        Binding("p", "process", "Process"),
        Binding("e", "export", "Export"),
        Binding("left", "seek(-1)", "-5s", key_display="←"),
        Binding("right", "seek(1)", "+5s", key_display="→"),
        Binding("plus,equals_sign", "speed(1)", "Faster", show=False, key_display="+"),
        Binding("minus", "speed(-1)", "Slower", show=False, key_display="-"),
        Binding("question_mark", "help", "Help", key_display="?"),
        Binding("q", "quit", "Quit"),
    ]
    BINDINGS = list(KEYS)

    def __init__(self, session: Reader, clock: Clock, *, name: str = "",
                 export_dir: str | Path | None = None, interval_s: float = 0.5,
                 window_s: float | None = 60.0) -> None:
        super().__init__()
        self.session, self.clock, self.session_name = session, clock, name
        self.export_dir = export_dir
        self.snapshot: Snapshot | None = None
        self.request = ViewRequest(window_s=window_s)
        self.feed = SnapshotFeed(session, clock, deliver=self.post_message_snapshot,
                                 on_error=lambda e: self._post(FeedError(e)),
                                 interval_s=interval_s, request=self.request)

    # Called on the feed thread: post_message is the thread-safe way into the app.
    def post_message_snapshot(self, snap: Snapshot) -> None:
        self.post_message(SnapshotReady(snap))

    def _post(self, message: Message) -> None:
        self.post_message(message)  # (its "was it queued" is of no use to the feed)

    def compose(self) -> ComposeResult:
        yield HeaderBar(id="header")
        yield Timeline(id="timeline")
        with Horizontal(id="panels"):
            for p in schema.PHASES:
                yield PhasePanel(p)
        yield GpuLine(id="gpu")
        yield FindingsLine(id="findings")
        yield Footer()

    def on_mount(self) -> None:
        self._show_mode()
        self._fit_findings()
        self.feed.start()

    def on_resize(self) -> None:
        self._fit_findings()

    def _fit_findings(self) -> None:
        # A small terminal keeps its lines for the phase panels: fewer findings lines there.
        self.query_one(FindingsLine).styles.max_height = 4 if self.size.height < 30 else 6

    def on_unmount(self) -> None:
        # Before the caller closes the connection or stops the recorder.
        self.feed.stop()

    def on_snapshot_ready(self, msg: SnapshotReady) -> None:
        self.snapshot = msg.snapshot
        for w in self.query(SnapshotView):
            w.snapshot = msg.snapshot
        self.query_one(FindingsLine).error = ""

    def on_feed_error(self, msg: FeedError) -> None:
        self.query_one(FindingsLine).error = msg.text

    def _show_mode(self) -> None:
        c = self.clock
        state = "▶" if c.playing else "⏸"
        mode = "live" if c.live else f"replay {self.session_name} {c.speed:g}x"
        self.query_one(HeaderBar).mode = f"{mode} {state}"
        self.query_one(HeaderBar).refresh()

    def _set_request(self, **changes) -> None:
        self.request = replace(self.request, **changes)
        self.feed.ask(self.request)

    # -- actions (keys, footer and command palette) ---------------------------------------

    def action_pause(self) -> None:
        self.clock.toggle()
        self._show_mode()
        self.feed.wake()

    def action_window(self) -> None:
        i = WINDOWS_S.index(self.request.window_s) if self.request.window_s in WINDOWS_S else -1
        w = WINDOWS_S[(i + 1) % len(WINDOWS_S)]
        self._set_request(window_s=w)
        self.notify(f"window: {window_label(w)}", timeout=1.5)

    def _cycle(self, current, choices: list):
        opts = [None, *choices]
        return opts[(opts.index(current) + 1) % len(opts)] if current in opts else None

    def action_device(self) -> None:
        choices = list(self.snapshot.device_choices) if self.snapshot else []
        dev = self._cycle(self.request.filters.device, choices)
        self._set_request(filters=replace(self.request.filters, device=dev))
        self.notify(f"device: {dev or 'all'}", timeout=1.5)

    def action_process(self) -> None:
        choices = [t for t, _ in self.snapshot.process_choices] if self.snapshot else []
        tgid = self._cycle(self.request.filters.tgid, choices)
        self._set_request(filters=replace(self.request.filters, tgid=tgid))
        comm = dict(self.snapshot.process_choices).get(tgid, "") if self.snapshot else ""
        self.notify(f"process: {'all' if tgid is None else f'{tgid} {comm}'}", timeout=1.5)

    def action_seek(self, direction: int) -> None:
        self.clock.seek(direction * SEEK_NS)
        self._show_mode()
        self.feed.wake()

    def action_speed(self, step: int) -> None:
        i = SPEEDS.index(self.clock.speed) if self.clock.speed in SPEEDS else 2
        self.clock.set_speed(SPEEDS[min(max(i + step, 0), len(SPEEDS) - 1)])
        self._show_mode()

    def action_help(self) -> None:
        if not isinstance(self.screen, HelpScreen):
            self.push_screen(HelpScreen())

    def action_export(self) -> None:
        out = Path(self.export_dir or datetime.now().strftime("kvprof-export-%Y%m%d-%H%M%S"))
        self.notify(f"exporting Parquet to {out} …", timeout=2)
        self.run_worker(lambda: self._export(out), thread=True, exclusive=True, group="export")

    def _export(self, out: Path) -> None:
        # Worker thread: it talks back only through call_from_thread.
        try:
            files = export_session(self.session, out)
        except KvprofError as e:
            self.call_from_thread(self.notify, f"export failed: {e}", severity="error")
            return
        self.call_from_thread(self.notify, f"exported {len(files)} files to {out}")

    def get_system_commands(self, screen: Screen) -> Iterable[SystemCommand]:
        yield from super().get_system_commands(screen)
        for b in self.KEYS:
            action = b.action
            yield SystemCommand(f"{b.description} ({b.key_display or b.key})",
                                f"kvprof top: {b.description.lower()}",
                                lambda a=action: self.run_action(a))


__all__ = ["KvprofTop", "SnapshotReady"]
