"""A KV connector of the tests' own, loaded by the real vLLM through `--kv-transfer-config`
(`kv_connector_module_path`): it saves the engine's KV blocks through a KV-offload backend's
own I/O code and loads them back for a request whose prefix was stored.

It stands in for vLLM's own offload connectors, which do not run on the CPU platform
(`OffloadingConnector`'s fs tier refuses CPU, `LMCacheConnectorV1` finds no CPU connector:
../shared/reference/vllm-cpu.md). What it keeps real is what kvprof observes:
- the I/O is the backend's own code: vLLM's fs tier (`fs`: `FileMapper` names,
  `tiering/fs/io.py` `batch_store_block` / `batch_load_block`: O_DIRECT, temp file + rename,
  one write or read a block, as strace shows), or LMCache's local disk backend (`lmcache`:
  a buffered `.pt` file a block; option `readers`, its read threads);
- the timing is the engine's: stores at `wait_for_save`, the end of the step that computed the
  blocks (a prefill step); loads at `start_load_kv`, before the forward of the step that needs
  them, which waits for them (sync loads).

A block's key chains the hash of the prompt's token ids block by block, so a prompt that
shares a stored prefix finds it (after the engine's own prefix cache was reset). What the
connector did goes to the file named `log` in `kv_connector_extra_config`, one JSON line a
batch: op, monotonic start and end, blocks, bytes, backend calls. The tests judge kvprof by it.
"""
from __future__ import annotations

import hashlib
import json
import mmap
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)


@dataclass
class Transfer:
    keys: list[bytes]
    block_ids: list[int]


@dataclass
class Meta(KVConnectorMetadata):
    loads: list[Transfer] = field(default_factory=list)
    stores: list[Transfer] = field(default_factory=list)


class FsTier:
    """vLLM's fs tier: a file per block named by FileMapper, written and read by its io module."""

    cache = "vllm-fs-tier"

    def __init__(self, root: str, model: str, block_size: int) -> None:
        from vllm.v1.kv_offload.file_mapper import FileMapper
        from vllm.v1.kv_offload.tiering.fs import io as fsio

        os.makedirs(root, exist_ok=True)
        self._io = fsio
        self._mapper = FileMapper(root_dir=root, model_name=model, tokens_per_hash=block_size,
                                  blocks_per_file=1, tp_size=1, pp_size=1, pcp_size=1,
                                  dcp_size=1, rank=0, dtype="torch.bfloat16")
        self.direct = fsio.probe_o_direct(root)

    def _path(self, key: bytes) -> str:
        from vllm.v1.kv_offload.base import make_offload_key

        return self._mapper.get_file_name(make_offload_key(key, 0))

    def has(self, key: bytes) -> bool:
        return os.path.exists(self._path(key))

    def store(self, keys: list[bytes], view: memoryview, nbytes: int) -> None:
        self._io.batch_store_block([self._path(k) for k in keys], view,
                                   [i * nbytes for i in range(len(keys))], nbytes,
                                   use_o_direct=self.direct)

    def load(self, keys: list[bytes], view: memoryview, nbytes: int) -> None:
        self._io.batch_load_block([self._path(k) for k in keys], view,
                                  [i * nbytes for i in range(len(keys))], nbytes,
                                  use_o_direct=self.direct)


class LmcacheDisk:
    """LMCache's `LocalDiskBackend` with its CPU allocator: a buffered `.pt` file per chunk
    (here a chunk is one vLLM block), written by its disk worker threads and read back by
    `batched_get_blocking`, which fans the reads out on `readers` threads (its `disk_io_threads`:
    the parallel-read change); beyond `disk_gb` it evicts the least recently used chunks and removes
    their files (its `max_local_disk_size`). The connector waits at the engine's save point for
    LMCache's puts to finish (LMCache's own connector does not wait, and its writes land in the
    steps after); LMCache keeps its index in memory, so a chunk is loaded only by the worker that
    stored it.

    `odirect`: LMCache's `use_odirect` (its files opened O_DIRECT where a chunk is a multiple of
    the file system's block); its CPU objects then come from a pool aligned to 4 KiB, as its
    pinned pools are on a GPU host (O_DIRECT needs aligned buffers: the ad hoc allocator's fail
    with EINVAL)."""

    cache = "lmcache-disk"

    def __init__(self, root: str, model: str, block_size: int, readers: int = 4,
                 disk_gb: float = 4.0, odirect: bool = False) -> None:
        import asyncio

        from lmcache.utils import CacheEngineKey
        from lmcache.v1.config import LMCacheEngineConfig
        from lmcache.v1.memory_allocators.ad_hoc_memory_allocator import AdHocMemoryAllocator
        from lmcache.v1.memory_allocators.tensor_memory_allocator import TensorMemoryAllocator
        from lmcache.v1.memory_management import MemoryFormat
        from lmcache.v1.storage_backend.local_cpu_backend import LocalCPUBackend
        from lmcache.v1.storage_backend.local_disk_backend import LocalDiskBackend

        os.makedirs(root, exist_ok=True)
        config = LMCacheEngineConfig.from_defaults(
            chunk_size=block_size, local_cpu=False, local_disk=root,
            max_local_disk_size=disk_gb,
            extra_config={"disk_io_threads": readers, "use_odirect": odirect})
        self.direct = odirect
        self._loop = asyncio.new_event_loop()
        threading.Thread(target=self._loop.run_forever, name="lmcache-loop",
                         daemon=True).start()
        if odirect:
            self._pool = mmap.mmap(-1, 1 << 30)  # page-aligned, touched as used
            allocator = TensorMemoryAllocator(torch.frombuffer(self._pool, dtype=torch.uint8))
        else:
            allocator = AdHocMemoryAllocator("cpu")
        cpu = LocalCPUBackend(config, memory_allocator=allocator, dst_device="cpu")
        self._disk = LocalDiskBackend(config, self._loop, cpu, dst_device="cpu")
        self._cpu = cpu
        self._key = lambda k: CacheEngineKey(model.replace("/", "-"), 1, 0,
                                             int.from_bytes(k, "little"), torch.bfloat16)
        self._fmt = MemoryFormat.KV_2LTD

    def has(self, key: bytes) -> bool:
        # Asked on the scheduler's side, whose LMCache instance stored nothing (LMCache's own
        # connector asks the worker's over its lookup server): the chunk's file, by its name.
        return os.path.exists(self._disk._key_to_path(self._key(key)))

    def store(self, keys: list[bytes], view: memoryview, nbytes: int) -> None:
        done = threading.Semaphore(0)
        waits = 0
        for i, k in enumerate(keys):
            if self._disk.contains(self._key(k)):  # LMCache skips it, calling nothing back
                continue
            obj = self._cpu.allocate(torch.Size([nbytes // 2]), torch.bfloat16, self._fmt)
            self._bytes(obj).copy_(torch.frombuffer(view, dtype=torch.uint8,
                                                    count=nbytes, offset=i * nbytes))
            self._disk.submit_put_task(self._key(k), obj,
                                       on_complete_callback=lambda _k: done.release())
            obj.ref_count_down()  # the put holds its own reference until written
            waits += 1
        for _ in range(waits):
            done.acquire()

    def load(self, keys: list[bytes], view: memoryview, nbytes: int) -> None:
        objs = self._disk.batched_get_blocking([self._key(k) for k in keys])
        for i, obj in enumerate(objs):
            torch.frombuffer(view, dtype=torch.uint8, count=nbytes,
                             offset=i * nbytes).copy_(self._bytes(obj))
            obj.ref_count_down()

    @staticmethod
    def _bytes(obj) -> torch.Tensor:
        return obj.tensor.view(-1).view(torch.uint8)


BACKENDS = {"fs": FsTier, "lmcache": LmcacheDisk}


def block_keys(token_ids, block_size: int, blocks: int) -> list[bytes]:
    """The keys of a prompt's first `blocks` full blocks: each hashes the one before it and
    its own token ids, so a key names the whole prefix up to its block."""
    keys, prev = [], b""
    for b in range(blocks):
        ids = token_ids[b * block_size:(b + 1) * block_size]
        prev = hashlib.sha256(prev + b"".join(int(t).to_bytes(4, "little") for t in ids)
                              ).digest()[:16]
        keys.append(prev)
    return keys


class KvprofTestConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config, role: KVConnectorRole, kv_cache_config=None) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        extra = self._kv_transfer_config.kv_connector_extra_config
        self._bs = vllm_config.cache_config.block_size
        self._backend = BACKENDS[extra.get("backend", "fs")](
            extra["root"], vllm_config.model_config.served_model_name or "model", self._bs,
            **extra.get("options", {}))
        # `loads: false`: a connector that stores and never finds what it stored (a lookup
        # that always misses), the failure offload-never-read names.
        self._loads = extra.get("loads", True)
        self._log_path = extra["log"]
        self._log_lock = threading.Lock()
        # scheduler side
        self._requests: dict[str, Any] = {}
        self._block_ids: dict[str, list[int]] = {}
        self._stored: dict[str, int] = {}  # prompt blocks on disk, by request
        self._pending_loads: dict[str, Transfer] = {}
        self._computed: dict[str, int] = {}
        # worker side
        self._layers: list[torch.Tensor] = []

    # -- scheduler side ---------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request, num_computed_tokens: int):
        self._requests[request.request_id] = request
        self._computed[request.request_id] = num_computed_tokens
        prompt = list(request.prompt_token_ids or [])
        # At least one prompt token is computed: the step needs its logits.
        most = (len(prompt) - 1) // self._bs
        keys = block_keys(prompt, self._bs, most)
        hit = 0
        while self._loads and hit < most and self._backend.has(keys[hit]):
            hit += 1
        self._stored[request.request_id] = hit
        return max(0, hit * self._bs - num_computed_tokens), False

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        if num_external_tokens <= 0:
            return
        rid = request.request_id
        first = self._computed[rid] // self._bs
        n = num_external_tokens // self._bs
        ids = blocks.get_block_ids()[0]
        prompt = list(request.prompt_token_ids or [])
        keys = block_keys(prompt, self._bs, first + n)[first:]
        self._pending_loads[rid] = Transfer(keys, list(ids[first:first + n]))

    def build_connector_meta(self, scheduler_output) -> Meta:
        meta = Meta(loads=list(self._pending_loads.values()))
        self._pending_loads.clear()
        for new in scheduler_output.scheduled_new_reqs:
            self._block_ids[new.req_id] = list(new.block_ids[0])
            self._store(meta, new.req_id, new.num_computed_tokens
                        + scheduler_output.num_scheduled_tokens[new.req_id])
        cached = scheduler_output.scheduled_cached_reqs
        for i, rid in enumerate(cached.req_ids):
            new_ids = cached.new_block_ids[i]
            if new_ids is not None:
                if rid in cached.resumed_req_ids:
                    self._block_ids[rid] = list(new_ids[0])
                else:
                    self._block_ids.setdefault(rid, []).extend(new_ids[0])
            self._store(meta, rid, cached.num_computed_tokens[i]
                        + scheduler_output.num_scheduled_tokens[rid])
        return meta

    def _store(self, meta: Meta, rid: str, computed_after: int) -> None:
        """The prompt's blocks this step completes, not yet on disk."""
        request = self._requests.get(rid)
        if request is None:
            return
        prompt = list(request.prompt_token_ids or [])
        full = min(computed_after, len(prompt)) // self._bs
        done = self._stored.get(rid, 0)
        if full <= done:
            return
        keys = block_keys(prompt, self._bs, full)[done:]
        meta.stores.append(Transfer(keys, self._block_ids[rid][done:full]))
        self._stored[rid] = full

    def request_finished(self, request, block_ids):
        rid = request.request_id
        for d in (self._requests, self._block_ids, self._stored, self._computed):
            d.pop(rid, None)
        return False, None

    # -- worker side ------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        # The CPU attention backend's layout: [num_blocks, kv_heads, block_size, 2 * head].
        self._layers = list(kv_caches.values())

    def _block_bytes(self) -> int:
        return sum(kv[0].numel() * kv.element_size() for kv in self._layers)

    def _pieces(self, block_ids: list[int], nbytes: int):
        """Each block's bytes in each layer, with where they go in a batch's buffer (a block
        after another, its layers in order)."""
        for i, block in enumerate(block_ids):
            off = i * nbytes
            for kv in self._layers:
                piece = kv[block].view(-1).view(torch.uint8)  # a block is contiguous
                yield piece, off
                off += piece.numel()

    def _buffer(self, n: int) -> tuple[mmap.mmap, torch.Tensor]:
        # Page-aligned, as O_DIRECT wants.
        buf = mmap.mmap(-1, n * self._block_bytes())
        return buf, torch.frombuffer(buf, dtype=torch.uint8)

    def start_load_kv(self, forward_context, **kwargs) -> None:
        meta = self._get_connector_metadata()
        for t in meta.loads:
            nbytes = self._block_bytes()
            buf, flat = self._buffer(len(t.keys))
            t0 = time.monotonic_ns()
            self._backend.load(t.keys, memoryview(buf), nbytes)
            t1 = time.monotonic_ns()
            for piece, off in self._pieces(t.block_ids, nbytes):
                piece.copy_(flat[off:off + piece.numel()])
            self._log("load", t0, t1, len(t.keys), len(t.keys) * nbytes)
            del flat
            buf.close()

    def wait_for_layer_load(self, layer_name: str) -> None:
        return

    def save_kv_layer(self, layer_name, kv_layer, attn_metadata, **kwargs) -> None:
        return  # whole blocks of every layer are saved at wait_for_save

    def wait_for_save(self) -> None:
        meta = self._get_connector_metadata()
        for t in meta.stores:
            nbytes = self._block_bytes()
            buf, flat = self._buffer(len(t.keys))
            for piece, off in self._pieces(t.block_ids, nbytes):
                flat[off:off + piece.numel()].copy_(piece)
            t0 = time.monotonic_ns()
            self._backend.store(t.keys, memoryview(buf), nbytes)
            self._log("store", t0, time.monotonic_ns(), len(t.keys), len(t.keys) * nbytes)
            del flat
            buf.close()

    def _log(self, op: str, t0: int, t1: int, blocks: int, nbytes: int) -> None:
        line = json.dumps({"op": op, "cache": self._backend.cache, "start_ns": t0, "end_ns": t1,
                           "blocks": blocks, "block_tokens": self._bs, "bytes": nbytes,
                           "calls": blocks,
                           "pid": os.getpid(), "direct": getattr(self._backend, "direct", False)})
        with self._log_lock, open(self._log_path, "a") as f:
            f.write(line + "\n")
