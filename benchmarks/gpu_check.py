"""The NVML sampler and the phase classifier on a real GPU, against work whose phases are known.

    python3 benchmarks/gpu_check.py [--out DIR] [--device cuda|cpu]

Needs torch and nvidia-ml-py (not pyarrow, DuckDB or bcc: the sampler and the classifier are
imported alone). The work, each segment timed here, is the truth:

- prefill-like: what a prefill step runs, compute-bound: bf16 GEMMs of 4 096 tokens against a
  4 096 x 14 336 weight, and causal attention over those 4 096 tokens (32 heads of 128);
- decode-like: what a decode step runs, memory-bound: the same weight against 8 tokens (each
  call reads the whole weight from DRAM for a few FLOPs a byte), and attention of one new
  token per sequence over 8 sequences x 8 192 cached tokens (the KV cache read whole);
- idle: nothing queued.

Script: idle 2 s, prefill 4 s, idle 1 s, decode 4 s, idle 1 s, then prefill and decode 1 s
each, three times, and idle 1 s. With --mixed, then mixed steps as vLLM's chunked prefill runs
them (a prefill chunk of C tokens, attending causally within the chunk, and the decode step in
one step), 1.5 s for each C in MIXED_CHUNKS, 1 s idle between: not scored (the classifier
has no mixed label), printed with the chunk's share of the step's GPU time (CUDA events over
the two parts run apart), to say where the labels turn.

The host syncs with the GPU every ~20 ms of work, so a segment's host times are its GPU times
within that. A thread polls the sampler every 100 ms (the `nvml` source's interval) and
feeds each row to the classifier's WindowTracker, as kvprof.phases.nvml.NvmlSource does; the
windows are scored against the segments: the share of
each segment's time the windows label as its phase, over the whole segment and without its
first and last 250 ms (NVML averages over up to 100 ms windows, utilisation over longer).

Prints per segment the sampler's fields (medians) and the labelled shares; writes every row,
window and segment to DIR/gpu_check.json, so the classifier can be re-scored offline with
other thresholds (`classify(rows, ClassifierConfig(...))`). Exit status 0 when every long
segment and every idle one is labelled right for >= 90 % of its inner time, 1 otherwise,
69 when there is no GPU to sample.

`--device cpu` runs the same plumbing on the CPU (with a simulated libnvidia-ml.so.1 through
LD_LIBRARY_PATH): a dry run of this script, which proves nothing about a GPU.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvprof.capture.nvml import NvmlSampler  # noqa: E402
from kvprof.errors import KvprofError  # noqa: E402
from kvprof.phases.nvml import WindowTracker  # noqa: E402

MS = 1_000_000
GUARD_NS = 250 * MS
POLL_S = 0.1
SYNC_EVERY_S = 0.02
PLAN = ([("idle", 2.0), ("prefill", 4.0), ("idle", 1.0), ("decode", 4.0), ("idle", 1.0)]
        + [("prefill", 1.0), ("decode", 1.0)] * 3 + [("idle", 1.0)])
MIXED_CHUNKS = (64, 256, 1024, 2048, 4096)
FIELDS = ("gpu_util_pct", "mem_util_pct", "sm_active_pct", "tensor_active_pct",
          "dram_bw_util_pct", "power_w", "pcie_rx_bytes_per_s")


class Work:
    """Prefill-like and decode-like steps on one device (see the module docstring)."""

    def __init__(self, device: str) -> None:
        import torch
        import torch.nn.functional as F

        self.torch, self.F, self.device = torch, F, device
        small = device == "cpu"  # the dry run: shapes that a CPU gets through
        dt = torch.float32 if small else torch.bfloat16
        d, ff, heads, hd = (256, 512, 4, 64) if small else (4096, 14336, 32, 128)
        self.w = torch.randn(d, ff, device=device, dtype=dt)
        self.x_prefill = torch.randn(256 if small else 4096, d, device=device, dtype=dt)
        self.x_decode = torch.randn(8, d, device=device, dtype=dt)
        n = 256 if small else 4096
        self.q_prefill = torch.randn(1, heads, n, hd, device=device, dtype=dt)
        self.kv_prefill = torch.randn(2, 1, heads, n, hd, device=device, dtype=dt)
        ctx = 512 if small else 8192
        self.q_decode = torch.randn(8, heads, 1, hd, device=device, dtype=dt)
        self.kv_decode = torch.randn(2, 8, heads, ctx, hd, device=device, dtype=dt)
        self.chunk = n  # the prefill chunk of a mixed step: a prefix of the prefill tensors

    def sync(self) -> None:
        if self.device != "cpu":
            self.torch.cuda.synchronize()

    def prefill(self, n: int | None = None) -> None:
        n = n or self.x_prefill.shape[0]
        self.x_prefill[:n] @ self.w
        self.F.scaled_dot_product_attention(self.q_prefill[:, :, :n], self.kv_prefill[0, :, :, :n],
                                            self.kv_prefill[1, :, :, :n], is_causal=True)

    def mixed(self) -> None:
        self.prefill(self.chunk)
        self.decode()

    def gpu_ms(self, step, n: int = 20) -> float:
        """GPU time of one `step`, by CUDA events around n of them (host time on a CPU)."""
        if self.device == "cpu":
            t0 = time.perf_counter()
            for _ in range(n):
                step()
            return (time.perf_counter() - t0) * 1e3 / n
        start, end = (self.torch.cuda.Event(enable_timing=True) for _ in range(2))
        step()
        start.record()
        for _ in range(n):
            step()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / n

    def decode(self) -> None:
        self.x_decode @ self.w
        self.F.scaled_dot_product_attention(self.q_decode, self.kv_decode[0], self.kv_decode[1])

    def run(self, phase: str, seconds: float) -> tuple[int, int, int]:
        """Runs `phase` for `seconds`; returns (start_ns, end_ns, steps)."""
        step = {"prefill": self.prefill, "decode": self.decode, "mixed": self.mixed}.get(phase)
        self.sync()
        start = time.monotonic_ns()
        end_at = start + int(seconds * 1e9)
        steps = 0
        if step is None:
            time.sleep(seconds)
            return start, time.monotonic_ns(), 0
        batch = 1
        while time.monotonic_ns() < end_at:
            t0 = time.monotonic_ns()
            for _ in range(batch):
                step()
            self.sync()
            steps += batch
            took = time.monotonic_ns() - t0
            # Queue ~20 ms of steps between syncs: the GPU never starves, the host never
            # runs more than that ahead of it.
            batch = max(1, int(batch * SYNC_EVERY_S * 1e9 / max(took, 1)))
        return start, time.monotonic_ns(), steps


class Poller(threading.Thread):
    """Polls the sampler every 100 ms and feeds the classifier, as NvmlSource does."""

    def __init__(self, sampler: NvmlSampler) -> None:
        super().__init__(daemon=True)
        self.sampler, self.tracker = sampler, WindowTracker()
        self.rows: list[dict] = []
        self.windows: list[dict] = []
        self.poll_ns: list[int] = []
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.wait(POLL_S):
            t0 = time.monotonic_ns()
            rows = self.sampler.poll()
            self.poll_ns.append(time.monotonic_ns() - t0)
            for row in rows:
                self.rows.append(row)
                self.windows += self.tracker.feed(row)

    def finish(self, end_ns: int) -> None:
        self.stop.set()
        self.join()
        self.windows += self.tracker.close(end_ns)


def shares(windows: list[dict], start: int, end: int) -> dict[str, float]:
    """Share of [start, end) the windows label prefill, decode; the rest is none (idle)."""
    out = {"prefill": 0.0, "decode": 0.0}
    span = max(end - start, 1)
    for w in windows:
        overlap = min(w["end_ns"], end) - max(w["start_ns"], start)
        if overlap > 0 and w["phase"] in out:
            out[w["phase"]] += overlap / span
    out["none"] = max(0.0, 1.0 - out["prefill"] - out["decode"])
    return out


def agreement(phase: str, s: dict[str, float]) -> float:
    return s["none" if phase == "idle" else phase]


def medians(rows: list[dict], start: int, end: int) -> dict[str, float | None]:
    inside = [r for r in rows if start + GUARD_NS <= r["ts_ns"] <= end]
    out: dict[str, float | None] = {}
    for f in FIELDS:
        vals = [r[f] for r in inside if r.get(f) is not None]
        out[f] = round(statistics.median(vals), 1) if vals else None
    return out


def score(segments: list[dict], rows: list[dict], windows: list[dict], gpu: int) -> bool:
    """Prints the per-segment table; True when every long or idle segment is >= 90 % right."""
    mine = [w for w in windows if w.get("gpu") == gpu]
    ok = True
    print(f"GPU {gpu}: segment, steps, labelled prefill/decode/none (whole | inner), "
          "medians of " + ", ".join(FIELDS))
    for seg in segments:
        whole = shares(mine, seg["start_ns"], seg["end_ns"])
        inner = shares(mine, seg["start_ns"] + GUARD_NS, seg["end_ns"] - GUARD_NS)
        seg.setdefault("score", {})[gpu] = {"whole": whole, "inner": inner}
        if seg["phase"] == "mixed":
            med = medians([r for r in rows if r["gpu"] == gpu], seg["start_ns"], seg["end_ns"])
            print(f"  mixed   chunk {seg['chunk']:4d} tokens, {seg['prefill_share']:.2f} of the "
                  f"step's GPU time: inner prefill {inner['prefill']:.2f} decode "
                  f"{inner['decode']:.2f} none {inner['none']:.2f}  "
                  + " ".join(f"{v}" for v in med.values()))
            continue
        long = seg["end_ns"] - seg["start_ns"] >= 1.9e9 or seg["phase"] == "idle"
        right = agreement(seg["phase"], inner)
        if long and right < 0.9:
            ok = False
        med = medians([r for r in rows if r["gpu"] == gpu], seg["start_ns"], seg["end_ns"])
        print(f"  {seg['phase']:<7} {(seg['end_ns'] - seg['start_ns']) / 1e9:4.1f} s "
              f"{seg['steps']:6d} steps  "
              + " ".join(f"{whole[k]:.2f}" for k in ("prefill", "decode", "none")) + " | "
              + " ".join(f"{inner[k]:.2f}" for k in ("prefill", "decode", "none"))
              + f"  right {right:.2f}{'' if right >= 0.9 or not long else ' (< 0.90)'}  "
              + " ".join(f"{v}" for v in med.values()))
    return ok


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--mixed", action="store_true", help="also mixed (chunked prefill) steps")
    args = ap.parse_args()
    try:
        sampler = NvmlSampler()
    except KvprofError as e:
        print(f"gpu_check: {e}", file=sys.stderr)
        return e.exit_code
    work = Work(args.device)
    for phase in ("prefill", "decode"):  # warm up kernels and allocator
        work.run(phase, 0.5)
    if args.device == "cuda":
        import torch
        print(f"device: {torch.cuda.get_device_name(0)}; torch {torch.__version__}")
    print(f"sampler: GPUs {sampler.gpu_indices}")
    poller = Poller(sampler)
    poller.start()
    segments = []
    for phase, seconds in PLAN:
        start, end, steps = work.run(phase, seconds)
        segments.append({"phase": phase, "start_ns": start, "end_ns": end, "steps": steps})
    for chunk in MIXED_CHUNKS if args.mixed else ():
        work.chunk = min(chunk, work.x_prefill.shape[0])
        p_ms, d_ms = work.gpu_ms(lambda: work.prefill(work.chunk)), work.gpu_ms(work.decode)
        start, end, steps = work.run("mixed", 1.5)
        segments.append({"phase": "mixed", "start_ns": start, "end_ns": end, "steps": steps,
                         "chunk": work.chunk, "prefill_share": p_ms / (p_ms + d_ms)})
        work.run("idle", 1.0)
    end_ns = time.monotonic_ns()
    poller.finish(end_ns)
    sampler.close()
    polls = sorted(poller.poll_ns)
    print(f"{len(poller.rows)} rows, {len(poller.windows)} windows; a poll took "
          f"{polls[len(polls) // 2] / 1e6:.2f} ms median, {polls[-1] / 1e6:.2f} ms max")
    ok = all([score(segments, poller.rows, poller.windows, g) for g in sampler.gpu_indices])
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_check.json").write_text(json.dumps(
        {"device": args.device, "segments": segments, "rows": poller.rows,
         "windows": poller.windows, "poll_ns": poller.poll_ns}, default=str))
    print("PASS" if ok else "FAIL", "(every long or idle segment >= 0.90 of its inner time)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
