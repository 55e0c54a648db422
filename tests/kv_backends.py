"""KV-cache chunk files written and read the way the offload backends do it, run as its own
process by tests/live/test_syscall_layer.py (see ../shared/reference/engines.md):

- vLLM's fs tier: one `<hash>.bin` per block, O_DIRECT, written whole, read back with
  `readv` into page-aligned buffers, from a pool of threads;
- LMCache's local disk backend: `model@world_size@worker_id@chunk_hash@dtype.pt`, buffered
  writes in pieces, read back whole (page-cache hits on a re-read);
- SGLang HiCache's file backend: `<hash>.bin` per page, buffered `write` / `readinto`.

It waits for a line on stdin (the recorder is attached), marks prefill and decode on the
marker socket, and prints what it did as JSON: per phase, KV cache (kvprof/caches.py's names)
and op, calls and bytes done. Between prefill and decode it drops the page cache, so decode's
first read of a buffered file comes from the device and the second from the page cache. A
pipe carries a little traffic too: not a file, so the syscall layer must leave it out.
"""
from __future__ import annotations

import json
import mmap
import os
import random
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from kvprof.markers import Marker

BLOCK = 256 << 10  # vLLM block file
PIECE = 4 << 10    # decode read size
CHUNK = 192 << 10  # LMCache chunk, written in 64 KiB pieces
PAGE = 96 << 10    # HiCache page


def main() -> int:
    root, sock = Path(sys.argv[1]), sys.argv[2]
    counts: dict[str, dict[str, dict[str, list[int]]]] = {}
    rng = random.Random(5)

    def did(phase: str, cache: str, op: str, n: int) -> None:
        c = counts.setdefault(phase, {}).setdefault(cache, {}).setdefault(op, [0, 0])
        c[0] += 1
        c[1] += n

    sys.stdin.readline()
    m = Marker(sock, engine="kv-backends")

    m.mark("prefill")
    tier = root / "Qwen-Qwen3-8B_3f9a1c_r0"
    vllm = [tier / f"{i:03x}" / f"{i:02x}_g0" / f"{i:032x}.bin" for i in range(8)]
    for p in vllm:
        p.parent.mkdir(parents=True, exist_ok=True)
    lmc = [root / f"Qwen-Qwen3-8B@1@0@{i:016x}@bfloat16.pt" for i in range(4)]
    hic = [root / f"{i:016x}_Qwen3-8B_0_1.bin" for i in range(4)]

    def write_block(path: Path) -> None:
        buf = mmap.mmap(-1, BLOCK)
        buf.write(os.urandom(BLOCK))
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_DIRECT, 0o600)
        try:
            did("prefill", "vllm-fs-tier", "write", os.write(fd, buf))
        finally:
            os.close(fd)

    def write_chunk(path: Path) -> None:
        with open(path, "wb", buffering=0) as f:
            for _ in range(CHUNK // (64 << 10)):
                did("prefill", "lmcache-disk", "write", f.write(os.urandom(64 << 10)))

    with ThreadPoolExecutor(4, thread_name_prefix="kv-offload") as pool:
        list(pool.map(write_block, vllm))
        list(pool.map(write_chunk, lmc))
    for path in hic:
        with open(path, "wb", buffering=0) as f:
            did("prefill", "sglang-hicache", "write", f.write(os.urandom(PAGE)))
    os.sync()
    Path("/proc/sys/vm/drop_caches").write_text("1")

    m.mark("decode")
    buf = mmap.mmap(-1, PIECE)
    fds = [os.open(p, os.O_RDONLY | os.O_DIRECT) for p in vllm]
    try:
        for _ in range(200):
            did("decode", "vllm-fs-tier", "read", os.preadv(
                rng.choice(fds), [buf], rng.randrange(BLOCK // PIECE) * PIECE))
    finally:
        for fd in fds:
            os.close(fd)
    for _ in range(2):  # the second pass is served by the page cache
        for path in lmc:
            with open(path, "rb", buffering=0) as f:
                while True:  # the read that finds the end is a call too
                    n = len(f.read(64 << 10))
                    did("decode", "lmcache-disk", "read", n)
                    if not n:
                        break
    for path in hic:
        data = bytearray(PAGE)
        with open(path, "rb", buffering=0) as f:
            did("decode", "sglang-hicache", "read", f.readinto(data))
    r, w = os.pipe()
    for _ in range(50):
        os.write(w, b"token")
        os.read(r, 5)
    m.mark("idle")
    m.close()
    print(json.dumps(counts))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
