"""`kvprof report --html` and `kvprof compare --html`: one self-contained HTML file.

plotly.js is embedded whole, so the report opens with no network (on an air-gapped host, from a
ticket attachment). Every figure's data sits in the page as a JSON block (`<script
type="application/json" class="kvprof-figure">`) the page draws from, so what is plotted can be
read back and checked against `kvprof report --json`. Numbers come from correlate only."""
from __future__ import annotations

import html
import sys
from datetime import datetime, timezone
from pathlib import Path
from typing import Literal

import plotly.graph_objects as go
from plotly.offline import get_plotlyjs
from plotly.subplots import make_subplots

from kvprof import schema
from kvprof.analysis.correlate import MAIN_OPS, device_layer, phase_layer
from kvprof.errors import EX_USAGE, KvprofError
from kvprof.summary import Summary
from kvprof.units import engine_parts, human_bytes, human_us, offload_sentence, size_label
from kvprof.views.findings import findings
from kvprof.views.report import window_line

COLOURS = {"prefill": "#e5a50a", "decode": "#3584e4", "mixed": "#9141ac", "idle": "#77767b"}
OP_DASH = {"read": None, "write": "/"}
MIB = 1 << 20

_STYLE = """
body { font-family: system-ui, sans-serif; margin: 24px auto; max-width: 1200px; color: #222; }
h1 { font-size: 1.5em; margin-bottom: 4px; } h2 { font-size: 1.15em; margin-top: 28px; }
.meta { color: #555; } table { border-collapse: collapse; margin: 8px 0; }
td, th { border-bottom: 1px solid #ddd; padding: 4px 10px; text-align: right; }
th:first-child, td:first-child { text-align: left; }
.better { color: #26a269; } .worse { color: #c01c28; }
.figure { min-height: 360px; } li { margin: 4px 0; }
.grid { display: grid; grid-template-columns: 1fr 1fr; gap: 8px; }
"""


class _Page:
    """Sections of HTML and the figures they hold, in order."""

    def __init__(self, title: str):
        self.title = title
        self.parts: list[str] = []
        self.figures = 0

    def add(self, text: str) -> None:
        self.parts.append(text)

    def figure(self, fig: go.Figure, kind: str) -> None:
        fig.update_layout(template="plotly_white", margin=dict(l=60, r=20, t=50, b=50))
        data = fig.to_json().replace("</", "<\\/")  # never ends the script block early
        n = self.figures
        self.figures += 1
        self.parts.append(
            f'<div class="figure" id="kvprof-fig-{n}"></div>'
            f'<script type="application/json" class="kvprof-figure" data-kind="{kind}" '
            f'data-target="kvprof-fig-{n}">{data}</script>')

    def render(self) -> str:
        draw = """
document.querySelectorAll('script.kvprof-figure').forEach(function (s) {
  var f = JSON.parse(s.textContent);
  Plotly.newPlot(s.dataset.target, f.data, f.layout, {displaylogo: false, responsive: true});
});"""
        return ("<!DOCTYPE html>\n<html><head><meta charset=\"utf-8\">"
                f"<title>{html.escape(self.title)}</title><style>{_STYLE}</style>"
                f"<script>{get_plotlyjs()}</script></head><body>"
                + "\n".join(self.parts) + f"<script>{draw}</script></body></html>\n")


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{v:.1f} %"


def _header(page: _Page, summary: Summary, name: str) -> None:
    s = summary["session"]
    start = datetime.fromtimestamp(s["start_wall_ns"] / 1e9, timezone.utc)
    page.add(f"<h1>kvprof report {html.escape(name)}</h1><p class=\"meta\">"
             f"host {html.escape(s['host'])} · kernel {html.escape(s['kernel'])} · "
             f"started {start:%Y-%m-%d %H:%M:%S} UTC · {s['duration_s']:.2f} s · devices "
             f"{html.escape(', '.join(s['devices']) or '-')} · "
             f"{html.escape(window_line(s))} · lost events {s['lost_events']}"
             "</p>")


def _phase_table(page: _Page, summary: Summary) -> None:
    rows = []
    for p in schema.PHASES:
        ph = summary["phases"][p]
        if ph["time_s"] <= 0:
            continue
        layer = phase_layer(ph)
        cells = [p, f"{ph['time_s']:.2f} s", f"{ph['time_share_pct']:.1f} %",
                 _pct(ph["block"]["time_idle_pct"]), _pct(ph["block"]["capacity_idle_pct"]),
                 "-" if (depth := ph["block"].get("inflight_mean")) is None else f"{depth:.2f}"]
        for op in MAIN_OPS:
            e = ph[layer][op]
            cells += [f"{human_bytes(e['bandwidth_bytes_per_s'])}/s", f"{e['iops']:,.0f}",
                      human_us(e["latency_us"]["p99"])]
        rows.append("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in cells) + "</tr>")
    head = ["phase", "time", "share", "time idle", "capacity idle", "in flight", "read bw",
            "read IOPS", "read p99", "write bw", "write IOPS", "write p99"]
    page.add("<h2>Phases</h2><table><tr>" + "".join(f"<th>{h}</th>" for h in head) + "</tr>"
             + "".join(rows) + "</table>")
    engine = engine_parts(summary.get("engine"))
    if engine:
        page.add(f"<p>engine (means over the session): {html.escape(', '.join(engine))}</p>")
    offload = offload_sentence(summary.get("offload"))
    if offload:
        page.add(f"<p>{html.escape(offload)}</p>")


def _findings(page: _Page, summary: Summary) -> None:
    items = "".join(f"<li>{html.escape(f.text)}</li>" for f in findings(summary))
    page.add(f"<h2>Findings</h2><ul>{items}</ul>")


def _timeline_figure(timeline: dict, title: str) -> go.Figure:
    """Bandwidth and IOPS over time per phase and op (the device layer), GPU below if any."""
    series = timeline["series"]
    blocks = sum(sum(s["ios"]) for s in series.values() if s["layer"] == "block")
    urings = sum(sum(s["ios"]) for s in series.values() if s["layer"] == "io_uring")
    layer = device_layer(blocks, urings)
    n = len(timeline["phase"])
    x = [i * timeline["bin_s"] for i in range(n)]
    rows = 3 if timeline["gpu"] else 2
    fig = make_subplots(rows=rows, cols=1, shared_xaxes=True, vertical_spacing=0.06,
                        subplot_titles=["bandwidth (MiB/s)", "IOPS", "GPU util (%)"][:rows])
    for s in series.values():
        if s["layer"] != layer:
            continue
        label = f"{s['phase']} {s['op']}"
        style = dict(color=COLOURS[s["phase"]], pattern_shape=OP_DASH.get(s["op"]))
        fig.add_bar(x=x, y=[b / timeline["bin_s"] / MIB for b in s["bytes"]], name=label,
                    legendgroup=label, marker=style, customdata=s["bytes"],
                    hovertemplate="%{y:.1f} MiB/s (%{customdata} bytes)", row=1, col=1)
        fig.add_bar(x=x, y=[c / timeline["bin_s"] for c in s["ios"]], name=label,
                    legendgroup=label, marker=style, customdata=s["ios"], showlegend=False,
                    hovertemplate="%{y:.0f} IOPS (%{customdata} requests)", row=2, col=1)
    if timeline["gpu"]:
        fig.add_scatter(x=x, y=timeline["gpu"]["util_pct"], name="GPU util", row=3, col=1,
                        line=dict(color="#26a269"))
        fig.add_scatter(x=x, y=timeline["gpu"]["sm_active_pct"], name="SM active", row=3,
                        col=1, line=dict(color="#2ec27e", dash="dot"))
    # The phase covering most of each bin, as a band behind the bars.
    start = 0
    for i in range(1, n + 1):
        if i == n or timeline["phase"][i] != timeline["phase"][start]:
            fig.add_vrect(x0=x[start] - timeline["bin_s"] / 2,
                          x1=x[i - 1] + timeline["bin_s"] / 2,
                          fillcolor=COLOURS[timeline["phase"][start]], opacity=0.08,
                          line_width=0)
            start = i
    fig.update_layout(barmode="stack", title=f"{title} ({layer} layer, "
                                             f"{human_us(timeline['bin_s'] * 1e6)} bins)",
                      height=260 * rows, bargap=0)
    fig.update_xaxes(title_text="seconds from start", row=rows, col=1)
    return fig


def _totals_figure(summary: Summary) -> go.Figure:
    """Per phase, bytes and requests of each op in its device layer: the report's totals."""
    fig = make_subplots(rows=1, cols=2, subplot_titles=["bytes", "requests"])
    phases = [p for p in schema.PHASES if summary["phases"][p]["time_s"] > 0]
    for op in MAIN_OPS:
        entries = [summary["phases"][p][phase_layer(summary["phases"][p])][op] for p in phases]
        fig.add_bar(x=phases, y=[e["bytes"] for e in entries], name=op, legendgroup=op,
                    marker_color="#3584e4" if op == "read" else "#e66100", row=1, col=1)
        fig.add_bar(x=phases, y=[e["ios"] for e in entries], name=op, legendgroup=op,
                    showlegend=False, marker_color="#3584e4" if op == "read" else "#e66100",
                    row=1, col=2)
    fig.update_layout(barmode="group", title="per phase (device layer)", height=360)
    return fig


def _idle_figure(summary: Summary) -> go.Figure:
    phases = [p for p in schema.PHASES if summary["phases"][p]["time_s"] > 0]
    fig = go.Figure()
    fig.add_bar(x=phases, y=[summary["phases"][p]["block"]["time_idle_pct"] for p in phases],
                name="time idle %", marker_color="#77767b")
    fig.add_bar(x=phases, y=[summary["phases"][p]["block"]["capacity_idle_pct"]
                             for p in phases], name="capacity idle %", marker_color="#c0bfbc")
    fig.update_layout(barmode="group", title="storage idle per phase", height=360,
                      yaxis=dict(range=[0, 100], title="%"))
    return fig


def _hist_figure(summary: Summary, key: Literal["size_hist", "latency_hist_us"], title: str,
                 label) -> go.Figure:
    """One log2 histogram per phase and op of the device layer (the report's buckets)."""
    fig = go.Figure()
    buckets: set[int] = set()
    for p in schema.PHASES:
        ph = summary["phases"][p]
        for op in MAIN_OPS:
            hist = ph[phase_layer(ph)][op][key]
            if not hist:
                continue
            buckets.update(int(b) for b in hist)
            fig.add_bar(x=[label(int(b)) for b in hist], y=list(hist.values()),
                        name=f"{p} {op}", marker=dict(color=COLOURS[p],
                                                      pattern_shape=OP_DASH.get(op)),
                        customdata=[int(b) for b in hist])
    # Buckets in value order, whichever trace has them first.
    fig.update_layout(barmode="group", title=title, height=360, yaxis_title="requests",
                      xaxis=dict(type="category", categoryorder="array",
                                 categoryarray=[label(b) for b in sorted(buckets)]))
    return fig


def report_html(summary: Summary, timeline: dict, name: str) -> str:
    page = _Page(f"kvprof report {name}")
    _header(page, summary, name)
    _phase_table(page, summary)
    _findings(page, summary)
    page.add("<h2>Timeline</h2>")
    page.figure(_timeline_figure(timeline, "phases over time"), "timeline")
    page.add("<h2>Per phase</h2>")
    page.figure(_totals_figure(summary), "totals")
    page.figure(_idle_figure(summary), "idle")
    page.add("<h2>Latency and request sizes</h2>")
    page.figure(_hist_figure(summary, "latency_hist_us", "latency (µs, log2 buckets)",
                             lambda b: human_us(b)), "latency")
    page.figure(_hist_figure(summary, "size_hist", "request size (log2 buckets)", size_label),
                "size")
    return page.render()


def compare_html(result: dict, a: Summary, b: Summary, timelines: tuple[dict, dict],
                 names: tuple[str, str]) -> str:
    """`kvprof compare --html`: the figures' table, A and B side by side, both timelines."""
    from kvprof.views.compare import value_text

    page = _Page(f"kvprof compare {names[0]} {names[1]}")
    page.add(f"<h1>kvprof compare</h1><p class=\"meta\">A: {html.escape(names[0])} "
             f"({a['session']['duration_s']:.1f} s) · B: {html.escape(names[1])} "
             f"({b['session']['duration_s']:.1f} s)</p>")
    rows = []
    for r in result["figures"]:
        cls = {True: "better", False: "worse", None: ""}[r["better"]]
        change = "" if r["change_pct"] is None else f"{r['change_pct']:+.1f} %"
        if r["ratio"] and (r["ratio"] >= 2 or r["ratio"] <= 0.5):
            change = f"×{r['ratio']:.2f} ({change})"
        rows.append(f"<tr><td>{html.escape(r['label'])}</td>"
                    f"<td>{html.escape(value_text(r['unit'], r['a']))}</td>"
                    f"<td>{html.escape(value_text(r['unit'], r['b']))}</td>"
                    f"<td class=\"{cls}\">{html.escape(change)}</td></tr>")
    page.add("<h2>Figures</h2><table><tr><th>figure</th><th>A</th><th>B</th><th>change</th>"
             "</tr>" + "".join(rows) + "</table>")
    if result["gates"]:
        items = "".join(
            f"<li class=\"{'better' if g['passed'] else 'worse'}\">{html.escape(g['gate'])}: "
            f"{'pass' if g['passed'] else 'FAIL'}</li>" for g in result["gates"])
        page.add(f"<h2>Gates</h2><ul>{items}</ul>")
    bw = [r for r in result["figures"] if r["name"].endswith(".bandwidth")]
    fig = go.Figure()
    for side, colour in (("a", "#77767b"), ("b", "#3584e4")):
        fig.add_bar(x=[r["label"] for r in bw], y=[r[side] for r in bw], name=side.upper(),
                    marker_color=colour)
    fig.update_layout(barmode="group", title="bandwidth per phase and op (bytes/s)",
                      height=380)
    page.figure(fig, "compare-bandwidth")
    page.add("<h2>Timelines</h2><div class=\"grid\">")
    for timeline, label in zip(timelines, ("A", "B")):
        page.figure(_timeline_figure(timeline, label), f"timeline-{label.lower()}")
    page.add("</div>")
    return page.render()


def write_page(path: str, text: str) -> None:
    """The page written to `path`, said on stderr; a path it cannot write is one line."""
    try:
        Path(path).write_text(text)
    except OSError as e:
        raise KvprofError(f"cannot write {path}: {e.strerror}", EX_USAGE) from None
    print(f"kvprof: wrote {path} ({len(text) >> 10} KiB, opens with no network)",
          file=sys.stderr)
