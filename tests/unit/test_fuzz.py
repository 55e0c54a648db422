"""Every parser of what other processes send kvprof, fuzzed with hypothesis: the marker
datagram, Prometheus exposition text, and the ZMQ payloads (msgpack) of SGLang's forward-pass
metrics and vLLM's KV events. Whatever comes in, each either returns its value or raises its
own error for a counted skip: never anything else, never a hang. At least 10 000 inputs each;
the counts are printed at the end of the run."""
from __future__ import annotations

import json

import msgpack
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvprof.markers import MAX_DATAGRAM
from kvprof.phases.exposition import parse_exposition
from kvprof.phases.mark_server import Mark, decode
from kvprof.phases.zmq_sources import (
    Malformed,
    _unpack,
    decode_fpm,
    decode_kv_batch,
    decode_kv_event,
)
from tests.helpers import FUZZ_COUNTS

RUNS = 10_000
FUZZ = settings(max_examples=RUNS, deadline=None, database=None, derandomize=True,
                suppress_health_check=list(HealthCheck))

scalars = (st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats()
           | st.text(max_size=20) | st.binary(max_size=20))
# What msgpack can carry: integers of 64 bits at most.
mp_scalars = (st.none() | st.booleans() | st.integers(-2**63, 2**64 - 1) | st.floats()
              | st.text(max_size=20) | st.binary(max_size=20))
values = st.recursive(mp_scalars, lambda inner: st.lists(inner, max_size=5)
                      | st.dictionaries(st.text(max_size=12), inner, max_size=5), max_leaves=20)
MARK_KEYS = ("v", "phase", "engine", "source", "ts_ns", "start_ns", "end_ns", "prefill_tokens",
             "decode_tokens")
# Near-valid marks, so the checks past the first ones run too.
stamp = st.integers(-2**64, 2**64) | st.sampled_from([0, 1, 2**63 - 1, 2**63]) | scalars
mark_like = st.one_of(
    st.dictionaries(st.sampled_from(MARK_KEYS) | st.text(max_size=8), scalars, max_size=9),
    st.fixed_dictionaries(
        {"v": st.sampled_from([1, 1, 1, 2, "1", True]),
         "phase": st.sampled_from(["prefill", "decode", "mixed", "idle", "Prefill", ""])},
        optional={"engine": st.text(max_size=200) | scalars,
                  "source": st.sampled_from(["manual", "hook", "metrics", "nvml", "x"]),
                  "ts_ns": stamp, "start_ns": stamp, "end_ns": stamp,
                  "prefill_tokens": stamp, "decode_tokens": stamp}))


class Count:
    def __init__(self, name: str):
        self.name, self.n, self.ok = name, 0, 0

    def report(self) -> None:
        FUZZ_COUNTS.append(f"fuzzed {self.name}: {self.n} inputs, {self.ok} accepted, "
                           f"{self.n - self.ok} refused cleanly")
        assert self.n >= RUNS


def test_marker_datagrams():
    count = Count("marker datagram")

    @FUZZ
    @given(st.one_of(st.binary(max_size=MAX_DATAGRAM + 10),
                     mark_like.map(lambda d: json.dumps(d, default=str).encode())))
    def run(data: bytes) -> None:
        count.n += 1
        try:
            m = decode(data)
        except ValueError:
            return
        count.ok += 1
        assert isinstance(m, Mark) and m.phase in ("prefill", "decode", "mixed", "idle")
        assert (m.ts_ns is None) != (m.start_ns is None)

    run()
    count.report()


def test_prometheus_exposition_text():
    count = Count("exposition text")
    lines = st.sampled_from(['vllm:prompt_tokens_total{model_name="m",engine="0"} 12',
                             "# HELP x y", "# TYPE x counter", 'a{b="c\\"d"} NaN', "x +Inf",
                             'y{le="0.5"} 1e3 1700000000', "{", '"', "\\", "=", " ", "\t"])

    @FUZZ
    @given(st.one_of(st.text(max_size=300),
                     st.lists(st.one_of(lines, st.text(max_size=40)), max_size=8)
                     .map("\n".join)))
    def run(text: str) -> None:
        count.n += 1
        try:
            samples = parse_exposition(text)
        except ValueError:
            return
        count.ok += 1
        assert all(isinstance(s.value, float) for s in samples)

    run()
    count.report()


def test_zmq_payloads():
    count = Count("ZMQ payload (msgpack)")

    @FUZZ
    @given(st.one_of(st.binary(max_size=200), values.map(
        lambda v: msgpack.packb(v, use_bin_type=True))))
    def run(data: bytes) -> None:
        count.n += 1
        try:
            payload = _unpack(data)
        except Malformed:
            return
        accepted = False
        for decoder in (decode_fpm, decode_kv_batch):
            try:
                decoder(payload)
                accepted = True
            except Malformed:
                pass
        try:
            ts, events, _ = decode_kv_batch(payload)
            for ev in events:
                try:
                    decode_kv_event(ev)
                except Malformed:
                    pass
        except Malformed:
            pass
        count.ok += accepted

    run()
    count.report()


def test_msgpack_bombs_are_refused_quickly():
    """Headers claiming huge arrays, maps or strings with nothing behind them, and deep
    nesting: refused as malformed, without allocating what they claim."""
    bombs = [b"\xdd\xff\xff\xff\xff", b"\xdf\xff\xff\xff\xff", b"\xdb\xff\xff\xff\xff",
             b"\xc6\xff\xff\xff\xff", b"\x91" * 100_000, b"\xde\xff\xff" + b"\xc0" * 10]
    for bomb in bombs:
        try:
            payload = _unpack(bomb)
        except Malformed:
            continue
        for decoder in (decode_fpm, decode_kv_batch):
            try:
                decoder(payload)
            except Malformed:
                pass
