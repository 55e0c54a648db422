"""A phase source feeds windows while real I/O runs on a loop device: the report attributes
the I/O by those windows (here SGLang's forward-pass metrics over a real ZMQ socket)."""
from __future__ import annotations

import time

import msgpack
import zmq

from tests.helpers import (
    AT_STOP,
    NOT_SEEN,
    READ_IOS,
    WRITE_IOS,
    assert_kernel_count,
    direct_random_reads,
    direct_write,
    live,
    read_stat,
    settle,
    stat_delta,
)

pytestmark = live


def fpm_payload(wall_time_s: float, prefill_tokens: int, decode_reqs: int) -> bytes:
    return msgpack.packb({
        "version": 1, "worker_id": "w0", "dp_rank": 0, "counter_id": 0,
        "wall_time": wall_time_s,
        "scheduled_requests": {"num_prefill_requests": 1 if prefill_tokens else 0,
                               "sum_prefill_tokens": prefill_tokens, "var_prefill_length": 0.0,
                               "sum_prefill_kv_tokens": 0, "num_decode_requests": decode_reqs,
                               "sum_decode_kv_tokens": 0, "var_decode_kv_tokens": 0.0},
        "queued_requests": {}})


def test_fpm_windows_attribute_loop_device_io(loopdev, start_recorder, tmp_path):
    endpoint = f"ipc://{tmp_path}/fpm.0"
    ctx = zmq.Context()
    pub = ctx.socket(zmq.PUB)
    pub.setsockopt(zmq.LINGER, 0)
    pub.bind(endpoint)
    seq = 0

    def send(payload: bytes) -> None:
        nonlocal seq
        pub.send_multipart([b"", seq.to_bytes(8, "big"), payload])
        seq += 1

    try:
        rec = start_recorder("-d", loopdev, "--phases", f"sglang-fpm={endpoint}")
        # Heartbeats (no scheduled work: no window) until the subscriber is surely joined.
        for _ in range(25):
            send(fpm_payload(0.0, 0, 0))
            time.sleep(0.02)
        s0 = settle(loopdev)
        time.sleep(0.05)
        t0 = time.monotonic()
        direct_write(loopdev, 16 << 20)
        # The iteration's wall time reaches back over the writes (and the quiet gap before).
        send(fpm_payload(time.monotonic() - t0 + 0.04, 4096, 0))
        s1 = read_stat(loopdev)
        time.sleep(0.05)
        t1 = time.monotonic()
        direct_random_reads(loopdev, 800, span=16 << 20)
        send(fpm_payload(time.monotonic() - t1 + 0.04, 0, 8))
        s2 = read_stat(loopdev)
        time.sleep(0.3)
        assert rec.stop() == 0
    finally:
        pub.close(0)
        ctx.term()
    report = rec.report()
    assert "sglang-fpm=" + endpoint in report["session"]["phase_sources"]
    pre, dec = report["phases"]["prefill"]["block"], report["phases"]["decode"]["block"]
    assert stat_delta(s0, s1)[WRITE_IOS] > 0 and stat_delta(s1, s2)[READ_IOS] == 800
    assert_kernel_count(pre["write"]["ios"], stat_delta(s0, s1)[WRITE_IOS], report)
    assert_kernel_count(dec["read"]["ios"], stat_delta(s1, s2)[READ_IOS], report)
    assert_kernel_count(pre["read"]["ios"], stat_delta(s0, s1)[READ_IOS], report)
    assert dec["write"]["ios"] == 0
    # The exact tier follows the same windows, which arrived after their I/O: here to the
    # request, since no issue slot held both phases' requests.
    # (It counts a completion the kernel did not trace too, found when the kernel started
    # that request again: no row has it, so only those may part the tiers.)
    exact = report["exact"]["phases"]
    assert_kernel_count(pre["write"]["ios"], exact["prefill"]["block"]["write"]["ios"], report,
                        reason=NOT_SEEN)
    assert_kernel_count(dec["read"]["ios"], exact["decode"]["block"]["read"]["ios"], report,
                        reason=NOT_SEEN)
    assert_kernel_count(exact["decode"]["block"]["read"]["ios"], stat_delta(s1, s2)[READ_IOS],
                        report, reason=AT_STOP)
    assert report["exact"]["boundary"]["ios"] == 0
