"""The real LMCache local disk backend (`lmcache.v1.storage_backend.local_disk_backend`),
driven on CPU by tests/live/test_syscall_layer.py in an interpreter that has lmcache and torch
(`KVPROF_LMCACHE_PYTHON`): LMCache's own code and thread pools write and read its chunk files,
kvprof only watches.

It waits for a line on stdin (the recorder is attached), marks prefill while LMCache stores
CHUNKS chunks (buffered, its default), syncs and drops the page cache, marks decode while
LMCache loads every chunk back twice (the second load is served by the page cache), and
prints as JSON the chunk files LMCache left and their sizes: the ground truth the test holds
kvprof's figures to.
"""
from __future__ import annotations

import asyncio
import json
import logging
import os
import sys
import threading
import time
from pathlib import Path

import torch
from lmcache.utils import CacheEngineKey
from lmcache.v1.config import LMCacheEngineConfig
from lmcache.v1.memory_allocators.ad_hoc_memory_allocator import AdHocMemoryAllocator
from lmcache.v1.memory_management import MemoryFormat
from lmcache.v1.storage_backend.local_cpu_backend import LocalCPUBackend
from lmcache.v1.storage_backend.local_disk_backend import LocalDiskBackend

from kvprof.markers import Marker

CHUNKS = 6
# One LMCache chunk of a small model: K and V, 4 layers, 256 tokens, 64 head dims, bf16.
SHAPE = torch.Size([2, 4, 256, 64])


def main() -> int:
    root, sock = Path(sys.argv[1]), sys.argv[2]
    logging.disable(logging.WARNING)  # LMCache warns about our test allocator's objects
    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()
    cfg = LMCacheEngineConfig.from_defaults(local_disk=str(root), max_local_disk_size=1.0,
                                            local_cpu=False, chunk_size=256)
    alloc = AdHocMemoryAllocator("cpu")
    cpu = LocalCPUBackend(cfg, memory_allocator=alloc, dst_device="cpu")
    disk = LocalDiskBackend(cfg, loop, cpu, dst_device="cpu")
    keys = [CacheEngineKey("Qwen/Qwen3-8B", 1, 0, 0x5EED0 + i, torch.bfloat16)
            for i in range(CHUNKS)]

    sys.stdin.readline()
    m = Marker(sock, engine="lmcache")
    m.mark("prefill")
    for k in keys:
        obj = alloc.allocate(SHAPE, torch.bfloat16, MemoryFormat.KV_2LTD)
        raw = obj.tensor.view(-1).view(torch.uint8)
        raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8))
        disk.submit_put_task(k, obj)
    deadline = time.monotonic() + 30
    while not all(disk.contains(k) for k in keys):  # LMCache's pool writes asynchronously
        if time.monotonic() > deadline:
            print("LMCache did not store the chunks", file=sys.stderr)
            return 1
        time.sleep(0.01)
    os.sync()
    Path("/proc/sys/vm/drop_caches").write_text("1")

    m.mark("decode")
    for _ in range(2):
        for k in keys:
            if disk.get_blocking(k) is None:
                print(f"LMCache lost {k}", file=sys.stderr)
                return 1
    m.mark("idle")
    m.close()
    disk.close()
    print(json.dumps({str(p): p.stat().st_size for p in sorted(root.iterdir())}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
