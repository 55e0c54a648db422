"""kvprof on a device with a latency of its own (tests/slow_device.py: nbdkit's delay behind a
direct-I/O loop device), held to fio's own report and the kernel's counters."""
from __future__ import annotations

import json
import shutil
import subprocess

import pytest

from tests.conftest import (
    READ_IOS,
    assert_kernel_count,
    live,
    read_stat,
    settle,
    stat_delta,
)

pytestmark = live

READS = 600  # 4 KiB each, QD1: ~1.4 s at 2 ms


def fio_qd1_reads(dev: str, out) -> dict:
    """fio's psync 4 KiB random reads at QD1 on the raw device, O_DIRECT: its read section."""
    subprocess.run(["fio", "--name=qd1", f"--filename=/dev/{dev}", "--rw=randread", "--bs=4k",
                    "--size=256M", f"--io_size={READS * 4}k", "--direct=1", "--ioengine=psync",
                    "--randrepeat=0", "--output-format=json", f"--output={out}"], check=True)
    return json.loads(out.read_text())["jobs"][0]["read"]


def test_block_latency_equals_fios_on_a_device_that_waits(slow_device, start_recorder,
                                                            tmp_path):
    """Each read waits 2 ms in the device: kvprof's block-layer median equals fio's own
    (within 10 %) for the same reads, twice in a row, and kvprof counted each read fio made
    and the kernel saw."""
    if shutil.which("fio") is None:
        pytest.skip("needs fio")
    dev = slow_device(read_ms=2, write_ms=2)
    medians = []
    for run in range(2):
        rec = start_recorder("-d", dev.name, "--layer", "block", name=f"run{run}")
        s0 = settle(dev.name)
        got = fio_qd1_reads(dev.name, tmp_path / f"fio{run}.json")
        s1 = read_stat(dev.name)
        assert rec.stop() == 0
        report = rec.report()
        read = report["phases"]["idle"]["block"]["read"]
        kernel = stat_delta(s0, s1)[READ_IOS]
        ours, fio_p50 = read["latency_us"]["p50"], got["clat_ns"]["percentile"]["50.000000"] / 1e3
        print(f"run {run}: fio {got['total_ios']} reads, p50 {fio_p50:.0f} us, p99 "
              f"{got['clat_ns']['percentile']['99.000000'] / 1e3:.0f} us; kernel {kernel}; "
              f"kvprof {read['ios']} reads, p50 {ours:.0f} us, p99 "
              f"{read['latency_us']['p99']:.0f} us; device time p50 "
              f"{read['device_us']['p50']:.0f} us")
        assert got["total_ios"] == READS == kernel
        assert_kernel_count(read["ios"], kernel, report)
        # The device's own wait is the latency: 2 ms and FUSE's ~0.3 ms, not the loop
        # worker's CPU time.
        assert 2000 <= ours < 4000
        assert abs(ours - fio_p50) <= 0.10 * fio_p50, (ours, fio_p50)
        medians.append(ours)
    # Steady: the second run's median is the first's.
    assert abs(medians[1] - medians[0]) <= 0.10 * medians[0], medians
