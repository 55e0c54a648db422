"""Phase sources that subscribe to an engine's ZMQ PUB stream.

`SglangFpm`: SGLang's Forward Pass Metrics (one message per scheduler iteration; Dynamo uses the
schema for vLLM) into phase windows; `VllmKvEvents`: vLLM's (and SGLang's) KV cache events into
`kv_event` rows. Messages: topic, 8-byte big-endian sequence number, msgspec msgpack, its Structs
as arrays or maps (engines changed this between versions: both are read). Malformed messages
and sequence gaps are counted (`counts()`) and dropped; a sequence back at 0 is a restart."""
from __future__ import annotations

import time
from typing import Any

import msgpack
import zmq

from kvprof.phases.base import PhaseSource, step_phase
from kvprof.phases.windows import phase_row

# How long one poll() waits for a message: bounds how long stop() takes.
POLL_MS = 100
# Messages read per poll() before yielding back to the loop (which checks for stop).
DRAIN_MAX = 1000


class Malformed(ValueError):
    """A message whose frames or payload are not what the format says."""


def _int(v: Any, what: str) -> int:
    # bool is an int subclass, but a bool where a count belongs means the layout is wrong.
    if isinstance(v, bool) or not isinstance(v, int):
        raise Malformed(f"{what} is not an integer: {v!r}")
    return v


def _num(v: Any, what: str) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise Malformed(f"{what} is not a number: {v!r}")
    return float(v)


def _unpack(data: bytes) -> Any:
    try:
        return msgpack.unpackb(data, raw=False, strict_map_key=False)
    except Exception as e:  # noqa: BLE001 - msgpack raises several types for bad input
        raise Malformed(f"bad msgpack: {type(e).__name__} {e}".rstrip()) from None


class ZmqSubSource(PhaseSource):
    """A SUB socket read from the source's own thread, with per-topic sequence tracking.

    The socket is created lazily inside `poll()` because ZMQ sockets must stay on the thread
    that uses them. `poll()` waits at most POLL_MS for traffic, so with the tiny interval the
    base loop calls it back to back and still notices `stop()` quickly.
    """

    interval_s = 0.001

    def __init__(self, endpoint: str) -> None:
        super().__init__()
        self.endpoint = endpoint
        self.received = 0  # messages read off the socket, well-formed or not
        self.restarts = 0  # sequence went backwards: the publisher restarted
        self._ctx: zmq.Context | None = None
        self._sock: zmq.Socket | None = None
        self._poller: zmq.Poller | None = None
        self._last_seq: dict[bytes, int] = {}

    def _check_seq(self, topic: bytes, seq: int) -> None:
        last = self._last_seq.get(topic)
        self._last_seq[topic] = seq
        if last is None:
            return  # nothing before the first message we see can be called lost
        if seq <= last:
            self.restarts += 1
        elif seq > last + 1:
            self.problem("gap", f"seq {last} -> {seq} on {self.endpoint}", n=seq - last - 1)

    # -- socket -----------------------------------------------------------------------------
    def _open(self) -> None:
        # A private context: terminating it on close must not touch anyone else's sockets.
        ctx = zmq.Context()
        sock = ctx.socket(zmq.SUB)
        try:
            sock.setsockopt(zmq.LINGER, 0)
            # Engines publish with a high HWM; match it so a slow flush does not drop here.
            sock.setsockopt(zmq.RCVHWM, 100_000)
            sock.setsockopt(zmq.SUBSCRIBE, b"")
            # The engine binds; ZMQ reconnects by itself when it restarts.
            sock.connect(self.endpoint)
        except zmq.ZMQError:
            # A bad endpoint: the base loop counts it and retries with back-off; leave
            # nothing open behind each try.
            sock.close(linger=0)
            ctx.term()
            raise
        self._ctx = ctx
        self._poller = zmq.Poller()
        self._poller.register(sock, zmq.POLLIN)
        self._sock = sock

    def poll(self) -> None:
        if self._sock is None:
            self._open()
        assert self._poller is not None and self._sock is not None
        if not self._poller.poll(POLL_MS):
            return
        for _ in range(DRAIN_MAX):
            if self.stopping:
                return
            try:
                frames = self._sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            # Stamped per message, at receipt: the closest this side can get to "now" for
            # streams without a timestamp of their own.
            recv_ns = time.monotonic_ns()
            self.received += 1
            try:
                if len(frames) != 3:
                    raise Malformed(f"expected 3 frames, got {len(frames)}")
                topic, seq_b, payload_b = frames
                if len(seq_b) != 8:
                    raise Malformed(f"sequence frame has {len(seq_b)} bytes, not 8")
                seq = int.from_bytes(seq_b, "big")
                # Before decoding: a message that arrived garbled was not lost.
                self._check_seq(topic, seq)
                self.handle(topic, seq, _unpack(payload_b), recv_ns)
            except (Malformed, TypeError, ValueError, KeyError, IndexError) as e:
                # Whatever shape a hostile or newer payload has, it costs one message.
                self.problem("malformed", str(e) or type(e).__name__)

    def handle(self, topic: bytes, seq: int, payload: Any, recv_ns: int) -> None:
        raise NotImplementedError

    def close(self, end_ns: int) -> None:
        # Runs after the thread has stopped, so touching its socket here is safe.
        if self._sock is not None:
            self._sock.close(linger=0)
            self._sock = None
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None


# -- SGLang / Dynamo Forward Pass Metrics ----------------------------------------------------

# Field order of the msgspec Structs, for publishers that encode them as arrays. Version 1
# (SGLang >= the FPM_VERSION field, Dynamo) leads with `version`; the first SGLang release
# and Dynamo's original schema start at `worker_id`.
_FPM_FIELDS_V1 = ("version", "worker_id", "dp_rank", "counter_id", "wall_time",
                  "scheduled_requests", "queued_requests")
_FPM_FIELDS_V0 = ("worker_id", "dp_rank", "wall_time", "scheduled_requests", "queued_requests")
_SCHEDULED_FIELDS = ("num_prefill_requests", "sum_prefill_tokens", "var_prefill_length",
                     "sum_prefill_kv_tokens", "num_decode_requests", "sum_decode_kv_tokens",
                     "var_decode_kv_tokens")


def _as_map(v: Any, fields: tuple[str, ...], what: str) -> dict:
    if isinstance(v, dict):
        return v
    if isinstance(v, (list, tuple)):
        if len(v) > len(fields):
            raise Malformed(f"{what} has {len(v)} fields, expected at most {len(fields)}")
        return dict(zip(fields, v))
    raise Malformed(f"{what} is neither a map nor an array")


def decode_fpm(payload: Any) -> dict:
    """One ForwardPassMetrics as a map, whichever way it was encoded. Missing fields take the
    Struct defaults (msgspec may omit them)."""
    if isinstance(payload, (list, tuple)) and payload and isinstance(payload[0], str):
        fpm = _as_map(payload, _FPM_FIELDS_V0, "ForwardPassMetrics")
    else:
        fpm = _as_map(payload, _FPM_FIELDS_V1, "ForwardPassMetrics")
    sched = _as_map(fpm.get("scheduled_requests") or {}, _SCHEDULED_FIELDS, "scheduled_requests")
    worker = fpm.get("worker_id", "")
    if not isinstance(worker, str):
        raise Malformed(f"worker_id is not a string: {worker!r}")
    return {
        "worker_id": worker,
        "dp_rank": _int(fpm.get("dp_rank", 0), "dp_rank"),
        "wall_time": _num(fpm.get("wall_time", 0.0), "wall_time"),
        "num_prefill_requests": _int(sched.get("num_prefill_requests", 0),
                                     "num_prefill_requests"),
        "sum_prefill_tokens": _int(sched.get("sum_prefill_tokens", 0), "sum_prefill_tokens"),
        "num_decode_requests": _int(sched.get("num_decode_requests", 0), "num_decode_requests"),
    }


class SglangFpm(ZmqSubSource):
    """Phase windows from SGLang's `--enable-forward-pass-metrics` stream (or Dynamo's): one
    per iteration that scheduled work. A message carries only the iteration's `wall_time`, so
    the window ends at receipt (CLOCK_MONOTONIC) and starts wall_time before: late by the
    publisher's queueing and transport, so back-to-back windows may overlap slightly (correlate
    flattens overlaps). Prefill tokens: sum_prefill_tokens (freshly computed); decode:
    num_decode_requests (one token each per iteration; speculative decoding's extra tokens are
    not in the stream)."""

    name = "sglang-fpm"

    def __init__(self, endpoint: str, engine_prefix: str = "sglang") -> None:
        super().__init__(endpoint)
        # Dynamo publishes this schema for vLLM too; the prefix lets the recorder say so.
        self.engine_prefix = engine_prefix

    def handle(self, topic: bytes, seq: int, payload: Any, recv_ns: int) -> None:
        m = decode_fpm(payload)
        prefill, decode = m["sum_prefill_tokens"], m["num_decode_requests"]
        phase = step_phase(prefill, decode)
        if phase == "idle":
            return
        dur_ns = int(round(m["wall_time"] * 1e9))
        if dur_ns <= 0:
            # Work without a duration cannot be placed; say so rather than invent one.
            self.problem("no_duration", f"seq {seq}: scheduled work with wall_time "
                                        f"{m['wall_time']!r}")
            return
        engine = f"{self.engine_prefix}:{m['worker_id']}:{m['dp_rank']}"
        self.emit("phase", phase_row(recv_ns - dur_ns, recv_ns, phase, "hook", engine,
                                     prefill_tokens=prefill, decode_tokens=decode))


# -- vLLM KV cache events --------------------------------------------------------------------

# Positions in the array form of each event (after the tag at index 0), from the msgspec
# Struct field order: BlockStored(block_hashes, parent_block_hash, token_ids, block_size,
# lora_id, medium, ...), BlockRemoved(block_hashes, medium, ...). Versions before `medium`
# existed end earlier; the field is then NULL.
_STORED_POS = {"block_hashes": 1, "block_size": 4, "medium": 6}
_REMOVED_POS = {"block_hashes": 1, "medium": 2}
_KINDS = {"BlockStored": "stored", "BlockRemoved": "removed", "AllBlocksCleared": "all_cleared"}


def _field(ev: Any, name: str, pos: dict[str, int]) -> Any:
    if isinstance(ev, dict):
        return ev.get(name)
    i = pos.get(name)
    return ev[i] if i is not None and i < len(ev) else None


def decode_kv_event(ev: Any) -> dict:
    """{kind, medium, blocks, block_size} of one event, array or map form."""
    if isinstance(ev, (list, tuple)) and ev:
        tag = ev[0]
    elif isinstance(ev, dict):
        tag = ev.get("type")
    else:
        raise Malformed(f"event is neither a tagged array nor a map: {ev!r:.80}")
    kind = _KINDS.get(tag) if isinstance(tag, str) else None
    if kind is None:
        raise Malformed(f"unknown event type {tag!r:.40}")
    if kind == "all_cleared":
        return {"kind": kind, "medium": None, "blocks": None, "block_size": None}
    pos = _STORED_POS if kind == "stored" else _REMOVED_POS
    hashes = _field(ev, "block_hashes", pos)
    if not isinstance(hashes, (list, tuple)):
        raise Malformed(f"{tag}.block_hashes is not a list")
    medium = _field(ev, "medium", pos)
    block_size = _field(ev, "block_size", pos) if kind == "stored" else None
    if block_size is not None:
        block_size = _int(block_size, "block_size")
    return {"kind": kind, "medium": medium if isinstance(medium, str) else None,
            "blocks": len(hashes), "block_size": block_size}


def decode_kv_batch(payload: Any) -> tuple[float, list, int | None]:
    """(ts, events, data_parallel_rank) of a KVEventBatch, array or map form."""
    if isinstance(payload, (list, tuple)):
        if len(payload) < 2:
            raise Malformed("KVEventBatch array has fewer than 2 fields")
        ts, events = payload[0], payload[1]
        rank = payload[2] if len(payload) > 2 else None
    elif isinstance(payload, dict):
        ts, events, rank = payload.get("ts"), payload.get("events"), \
            payload.get("data_parallel_rank")
    else:
        raise Malformed("KVEventBatch is neither an array nor a map")
    ts = _num(ts, "ts")
    if not isinstance(events, (list, tuple)):
        raise Malformed("KVEventBatch.events is not a list")
    if rank is not None:
        rank = _int(rank, "data_parallel_rank")
    return ts, list(events), rank


class VllmKvEvents(ZmqSubSource):
    """`kv_event` rows from vLLM's `--kv-events-config` ZMQ publisher (SGLang's is the same).

    One row per event. The batch's `ts` is the engine's time.time() when the step's events
    were taken; it is moved onto the session clock with the wall-minus-monotonic offset
    measured when the source starts (NTP slews during a session are not followed). The engine
    is `vllm:dp<rank>` from the batch, else the topic, else `vllm`.
    """

    name = "vllm-kv-events"

    def __init__(self, endpoint: str) -> None:
        super().__init__(endpoint)
        self.clock_offset_ns = time.time_ns() - time.monotonic_ns()

    def start(self) -> None:
        self.clock_offset_ns = time.time_ns() - time.monotonic_ns()
        super().start()

    def handle(self, topic: bytes, seq: int, payload: Any, recv_ns: int) -> None:
        ts, events, rank = decode_kv_batch(payload)
        if rank is not None:
            engine = f"vllm:dp{rank}"
        else:
            engine = topic.decode("utf-8", "replace") or "vllm"
        ts_ns = int(ts * 1e9) - self.clock_offset_ns
        for ev in events:
            try:
                d = decode_kv_event(ev)
            except Malformed as e:
                # One bad event should not cost the rest of the batch.
                self.problem("malformed", f"seq {seq}: {e}")
                continue
            self.emit("kv_event", {"ts_ns": ts_ns, "engine": engine, "seq": seq, **d})
