"""ZMQ phase sources against real PUB sockets on loopback/ipc, in each engine's wire format."""
from __future__ import annotations

import socket
import time

import msgpack
import pytest
import zmq

from kvprof import schema
from kvprof.phases.zmq_sources import SglangFpm, VllmKvEvents

DEADLINE_S = 10


def free_tcp_endpoint() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{s.getsockname()[1]}"


class Publisher:
    """The engine side: binds a PUB socket and sends (topic, seq_be8, payload)."""

    def __init__(self, endpoint: str, topic: bytes = b""):
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.PUB)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind(endpoint)
        self.topic = topic
        self.seq = 0

    def send(self, obj=None, raw: bytes | None = None, skip: int = 0, frames=None) -> None:
        if frames is not None:
            self.sock.send_multipart(frames)
            return
        self.seq += skip
        payload = raw if raw is not None else msgpack.packb(obj)
        self.sock.send_multipart([self.topic, self.seq.to_bytes(8, "big"), payload])
        self.seq += 1

    def close(self) -> None:
        self.sock.close(0)
        self.ctx.term()


def wait_for(cond, what: str) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def join(pub: Publisher, src, warmup) -> None:
    """Beat ZMQ's slow joiner: publish harmless messages until the source has one."""
    deadline = time.monotonic() + DEADLINE_S
    while src.received == 0:
        assert time.monotonic() < deadline, "subscriber never connected"
        pub.send(warmup)
        time.sleep(0.02)


def collect(src, table: str, n: int) -> list[dict]:
    rows: list[dict] = []

    def more() -> bool:
        got = src.take().get(table)
        if got is not None:
            assert got.schema == schema.TABLES[table]
            rows.extend(got.to_pylist())
        return len(rows) >= n

    wait_for(more, f"{n} {table} rows (have {len(rows)})")
    return rows


def fpm(wall_time: float, prefill_reqs=0, prefill_tokens=0, decode_reqs=0, worker="w0",
        dp_rank=1) -> dict:
    """ForwardPassMetrics as msgspec writes it: a map (the Struct is not array_like)."""
    return {
        "version": 1, "worker_id": worker, "dp_rank": dp_rank, "counter_id": 0,
        "wall_time": wall_time,
        "scheduled_requests": {
            "num_prefill_requests": prefill_reqs, "sum_prefill_tokens": prefill_tokens,
            "var_prefill_length": 0.0, "sum_prefill_kv_tokens": 0,
            "num_decode_requests": decode_reqs, "sum_decode_kv_tokens": 100 * decode_reqs,
            "var_decode_kv_tokens": 0.0,
        },
        "queued_requests": {
            "num_prefill_requests": 0, "sum_prefill_tokens": 0, "var_prefill_length": 0.0,
            "num_decode_requests": 0, "sum_decode_kv_tokens": 0, "var_decode_kv_tokens": 0.0,
        },
    }


HEARTBEAT = fpm(0.0)


@pytest.fixture
def ipc_endpoint(tmp_path):
    return f"ipc://{tmp_path}/fpm.0"


def test_sglang_fpm_windows_from_a_real_publisher(ipc_endpoint):
    pub = Publisher(ipc_endpoint)  # SGLang binds ipc://<tmp>.<dp_rank>
    src = SglangFpm(ipc_endpoint)
    src.start()
    try:
        join(pub, src, HEARTBEAT)
        t0 = time.monotonic_ns()
        pub.send(fpm(0.050, prefill_reqs=1, prefill_tokens=512))
        pub.send(fpm(0.020, prefill_reqs=1, prefill_tokens=128, decode_reqs=4))
        pub.send(fpm(0.010, decode_reqs=8))
        pub.send(HEARTBEAT)  # idle: no window
        pub.send(raw=msgpack.packb(fpm(0.010, decode_reqs=8))[:-5])  # truncated
        pub.send(fpm(0.010, decode_reqs=3), skip=2)  # two messages lost in between
        pub.send(frames=[b"", b"\x00"])  # wrong frame count
        # The older array encoding (no version field), accepted as well.
        pub.send(["w0", 1, 0.005, [0, 0, 0.0, 0, 2, 200, 0.0], [0, 0, 0.0, 0, 0, 0.0]])
        rows = collect(src, "phase", 5)
        t1 = time.monotonic_ns()
    finally:
        src.stop(time.monotonic_ns())
        pub.close()

    got = [(r["phase"], r["prefill_tokens"], r["decode_tokens"], r["end_ns"] - r["start_ns"])
           for r in rows]
    assert got == [("prefill", 512, 0, 50_000_000), ("mixed", 128, 4, 20_000_000),
                   ("decode", 0, 8, 10_000_000), ("decode", 0, 3, 10_000_000),
                   ("decode", 0, 2, 5_000_000)]
    for r in rows:
        assert r["source"] == "hook" and r["engine"] == "sglang:w0:1"
        assert t0 <= r["end_ns"] <= t1  # stamped at receipt
    ends = [r["end_ns"] for r in rows]
    assert ends == sorted(ends)
    counts = src.counts()
    assert counts == {"sglang-fpm.malformed": 2, "sglang-fpm.gap": 2}
    assert src.restarts == 0


def test_sglang_fpm_publisher_restart_is_not_a_gap():
    endpoint = free_tcp_endpoint()
    pub = Publisher(endpoint)
    src = SglangFpm(endpoint)
    src.start()
    try:
        join(pub, src, HEARTBEAT)
        pub.send(fpm(0.01, decode_reqs=1))
        pub.seq = 0  # the engine restarted: its counter begins again
        pub.send(fpm(0.01, decode_reqs=2))
        pub.send(fpm(0.01, decode_reqs=3))
        rows = collect(src, "phase", 3)
    finally:
        src.stop(time.monotonic_ns())
        pub.close()
    assert [r["decode_tokens"] for r in rows] == [1, 2, 3]
    assert src.restarts == 1
    assert src.counts() == {}


def test_sglang_fpm_stops_promptly_with_no_publisher(tmp_path):
    src = SglangFpm(f"ipc://{tmp_path}/nobody")
    src.start()
    time.sleep(0.15)
    t = time.monotonic()
    src.stop(time.monotonic_ns())
    assert time.monotonic() - t < 1.0
    assert src.take() == {} and src.counts() == {}


def kv_batch(events: list, rank=0, ts: float | None = None) -> list:
    """KVEventBatch as vLLM's msgspec encoder writes it: array_like [ts, events, rank]."""
    return [time.time() if ts is None else ts, events, rank]


def test_vllm_kv_events_rows_from_a_real_publisher():
    endpoint = free_tcp_endpoint()
    pub = Publisher(endpoint, topic=b"kv@pod-a@model")
    src = VllmKvEvents(endpoint)
    src.start()
    try:
        join(pub, src, kv_batch([]))
        ts = time.time()
        before = time.monotonic_ns()
        pub.send(kv_batch([
            # Tagged array events (vLLM before events became maps): tag first, then fields
            # in declaration order.
            ["BlockStored", [11, 12, 13], None, list(range(48)), 16, None, "GPU"],
            ["BlockRemoved", [11], "GPU"],
            ["AllBlocksCleared"],
        ], ts=ts))
        pub.send(kv_batch([
            # Map events (current vLLM: tag=True without array_like), byte-string hashes.
            {"type": "BlockStored", "block_hashes": [b"\x01" * 32, b"\x02" * 32],
             "parent_block_hash": None, "token_ids": list(range(32)), "block_size": 16,
             "lora_id": None, "medium": "CPU", "lora_name": None},
            {"type": "BlockStored", "block_hashes": [7], "parent_block_hash": 3,
             "token_ids": list(range(16)), "block_size": 16, "lora_id": None,
             "medium": "STORAGE", "lora_name": None},
            {"type": "BlockRemoved", "block_hashes": [b"\x01" * 32], "medium": "CPU"},
            {"type": "Mystery"},  # unknown: counted, the rest of the batch still counts
        ], rank=1, ts=ts))
        pub.send(raw=b"\x93\xcb")  # truncated msgpack
        # Older vLLM: no medium field at all, no rank; the topic names the engine.
        pub.send([ts, [["BlockStored", [5, 6], None, list(range(32)), 16, None]]], skip=1)
        rows = collect(src, "kv_event", 7)
    finally:
        src.stop(time.monotonic_ns())
        pub.close()

    got = [(r["engine"], r["kind"], r["medium"], r["blocks"], r["block_size"]) for r in rows]
    assert got == [
        ("vllm:dp0", "stored", "GPU", 3, 16),
        ("vllm:dp0", "removed", "GPU", 1, None),
        ("vllm:dp0", "all_cleared", None, None, None),
        ("vllm:dp1", "stored", "CPU", 2, 16),
        ("vllm:dp1", "stored", "STORAGE", 1, 16),
        ("vllm:dp1", "removed", "CPU", 1, None),
        ("kv@pod-a@model", "stored", None, 2, 16),
    ]
    seqs = [r["seq"] for r in rows]
    assert len(set(seqs[:3])) == 1 and len(set(seqs[3:6])) == 1 and seqs[3] == seqs[0] + 1
    assert seqs[6] == seqs[3] + 3  # truncated one, then one skipped
    # The batch's wall time on the session clock: close to when it was sent.
    for r in rows:
        assert abs(r["ts_ns"] - before) < 50_000_000
    assert src.counts() == {"vllm-kv-events.malformed": 2, "vllm-kv-events.gap": 1}


def test_vllm_kv_events_map_encoded_batch(tmp_path):
    endpoint = f"ipc://{tmp_path}/kv"
    pub = Publisher(endpoint)
    src = VllmKvEvents(endpoint)
    src.start()
    try:
        join(pub, src, kv_batch([]))
        pub.send({"ts": time.time(), "data_parallel_rank": 2,
                  "events": [{"type": "BlockRemoved", "block_hashes": [1, 2, 3, 4],
                              "medium": "GPU"}]})
        rows = collect(src, "kv_event", 1)
    finally:
        src.stop(time.monotonic_ns())
        pub.close()
    assert [(r["engine"], r["kind"], r["medium"], r["blocks"]) for r in rows] == [
        ("vllm:dp2", "removed", "GPU", 4)]


def test_bad_endpoint_is_counted_not_fatal():
    src = SglangFpm("tcp://no-such-host-or-port")
    src.start()
    wait_for(lambda: src.counts(), "the failure to be counted")
    src.stop(time.monotonic_ns())
    assert set(src.counts()) == {"sglang-fpm.ZMQError"}
    assert src.last_error
