"""Soak: a long recording at high IOPS while engine sources connect and drop.

    sudo .venv/bin/python benchmarks/soak.py [--minutes 10] [--iops 100000]

`kvprof record` traces a private loop device that fio reads at --iops (4 KiB random, io_uring
QD32) for the whole run, with phase marks every half second, a vLLM-style /metrics endpoint
that is up for 20 s and down for 10 s in turn (`--phases vllm-metrics=URL`), and an SGLang
forward-pass-metrics ZMQ publisher that binds and unbinds every 15 s (`--phases
sglang-fpm=ENDPOINT`). Prints the recorder's RSS every 30 s, then the exact tier's reads
against /sys/block/DEV/stat and what kvprof says it lost: "unaccounted" must be 0.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import msgpack
import zmq
from loopdev import disk_reads, growth_per_min, loop_device, memory_mib, report_json
from prometheus_client import CollectorRegistry, Counter, Gauge, start_http_server

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from kvprof.markers import Marker  # noqa: E402


def metrics_flapping(port: int, stop: threading.Event) -> None:
    """A vLLM-named endpoint, 20 s up and 10 s down, its counters moving."""
    reg = CollectorRegistry()
    labels = ["model_name", "engine"]
    prompt = Counter("vllm:prompt_tokens", "p", labels, registry=reg)
    gen = Counter("vllm:generation_tokens", "g", labels, registry=reg)
    running = Gauge("vllm:num_requests_running", "r", labels, registry=reg)
    while not stop.is_set():
        server, _ = start_http_server(port, addr="127.0.0.1", registry=reg)
        up_until = time.monotonic() + 20
        while time.monotonic() < up_until and not stop.is_set():
            prompt.labels("m", "0").inc(512)
            gen.labels("m", "0").inc(16)
            running.labels("m", "0").set(2)
            time.sleep(0.2)
        server.shutdown()
        server.server_close()
        stop.wait(10)


def fpm_flapping(endpoint: str, stop: threading.Event) -> None:
    """An SGLang FPM publisher that binds for 15 s, unbinds for 15 s."""
    ctx = zmq.Context()
    seq = 0
    while not stop.is_set():
        pub = ctx.socket(zmq.PUB)
        pub.setsockopt(zmq.LINGER, 0)
        pub.bind(endpoint)
        until = time.monotonic() + 15
        while time.monotonic() < until and not stop.is_set():
            payload = msgpack.packb({
                "version": 1, "worker_id": "w0", "dp_rank": 0, "counter_id": 0,
                "wall_time": 0.05, "scheduled_requests": {
                    "num_prefill_requests": seq % 2, "sum_prefill_tokens": 512 * (seq % 2),
                    "num_decode_requests": 4}, "queued_requests": {}})
            pub.send_multipart([b"", seq.to_bytes(8, "big"), payload])
            seq += 1
            time.sleep(0.05)
        pub.close()
        stop.wait(15)
    ctx.term()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--minutes", type=float, default=10)
    ap.add_argument("--iops", type=int, default=100_000)
    a = ap.parse_args()
    seconds = int(a.minutes * 60)
    tmp = Path(tempfile.mkdtemp(prefix="kvprof-soak-"))
    port = 19000 + os.getpid() % 1000
    endpoint = f"ipc://{tmp}/fpm.0"
    stop = threading.Event()
    with loop_device("soak") as dev:
        before = disk_reads(dev)
        rec = subprocess.Popen([sys.executable, "-m", "kvprof", "record", "-d", dev, "-o",
                                str(tmp / "s"), "--socket", str(tmp / "m.sock"),
                                "--phases", f"vllm-metrics=http://127.0.0.1:{port}/metrics",
                                "--phases", f"sglang-fpm={endpoint}"],
                               stderr=subprocess.PIPE, text=True)
        for line in rec.stderr:
            if "Hit Ctrl-C" in line:
                break
        threads = [threading.Thread(target=f, args=(x, stop), daemon=True)
                   for f, x in ((metrics_flapping, port), (fpm_flapping, endpoint))]
        for t in threads:
            t.start()
        fio = subprocess.Popen(["fio", "--name=soak", f"--filename={dev}", "--rw=randread",
                                "--bs=4k", "--direct=1", "--ioengine=io_uring", "--iodepth=32",
                                "--time_based", f"--runtime={seconds}", "--size=128M",
                                f"--rate_iops={a.iops}", "--output-format=json"],
                               stdout=subprocess.PIPE, text=True)
        marker = Marker(str(tmp / "m.sock"))
        start = time.monotonic()
        samples = [(0, *memory_mib(rec.pid))]  # (s, RSS, anonymous, file-backed)
        next_sample = 30
        i = 0
        while fio.poll() is None:
            marker.mark("prefill" if i % 2 else "decode")
            i += 1
            time.sleep(0.5)
            if time.monotonic() - start >= next_sample:
                samples.append((next_sample, *memory_mib(rec.pid)))
                print(f"{next_sample:>5} s  RSS {samples[-1][1]:.0f} MiB (anonymous "
                      f"{samples[-1][2]:.0f}, file-backed {samples[-1][3]:.0f})", flush=True)
                next_sample += 30
        fio_out = json.loads(fio.stdout.read())
        marker.mark("idle")
        stop.set()
        rec.send_signal(signal.SIGINT)
        rec.communicate(timeout=300)
        kernel = disk_reads(dev) - before
    report = report_json(tmp / "s")
    exact = report["exact"]["totals"]["block"]["read"]["ios"]
    lost = report["session"]["lost_by_reason"]
    device_lost = sum(v for k, v in lost.items() if k.startswith("block_"))
    problems = report["session"]["source_problems"]
    rss = [m for _, m, _, _ in samples]
    anon = [a for _, _, a, _ in samples]
    print(f"\n{seconds} s at {fio_out['jobs'][0]['read']['iops']:,.0f} IOPS (fio); "
          f"RSS first/max/last {rss[0]:.0f}/{max(rss):.0f}/{rss[-1]:.0f} MiB, "
          f"after the first minute {min(rss[2:] or rss):.0f}..{max(rss[2:] or rss):.0f} MiB; "
          f"anonymous first/max/last {anon[0]:.0f}/{max(anon):.0f}/{anon[-1]:.0f} MiB")
    print(f"growth over the second half: RSS "
          f"{growth_per_min([(t, r) for t, r, _, _ in samples]):+.1f} MiB/min, anonymous "
          f"{growth_per_min([(t, a) for t, _, a, _ in samples]):+.1f} MiB/min")
    print(f"kernel reads {kernel}; exact tier {exact}; block events lost {device_lost}; "
          f"unaccounted {kernel - exact - device_lost}")
    print(f"lost by reason (non-zero): { {k: v for k, v in lost.items() if v} }")
    print(f"phase sources' problems: {problems}")
    return 0 if kernel - exact - device_lost == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
