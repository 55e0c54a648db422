"""Fixtures and hooks for every suite (unit/, live/, engine/); the helpers they use are in
tests/helpers.py."""
from __future__ import annotations

import shutil
import subprocess
import threading
from pathlib import Path

import pytest

from tests import helpers
from tests.helpers import (
    FUZZ_COUNTS,
    KVPROF,
    CompletionWitness,
    Recorder,
    can_trace,
    mounted_ext4,
    private_loop,
    require,
)


def pytest_terminal_summary(terminalreporter) -> None:
    for line in FUZZ_COUNTS:
        terminalreporter.write_line(line)


@pytest.fixture
def ext4(loopdev, tmp_path):
    """An ext4 file system on the test's loop device, mounted; yields the mount point."""
    if shutil.which("mkfs.ext4") is None:
        pytest.skip("needs mkfs.ext4")
    with mounted_ext4(loopdev, tmp_path / "kv") as mnt:
        yield mnt


@pytest.fixture(autouse=True)
def calibration_store(tmp_path, monkeypatch):
    """Each test keeps `kvprof calibrate` results apart (recorders it starts inherit this):
    nothing is read from or left in the machine's own store."""
    store = tmp_path / "calibration"
    monkeypatch.setenv("KVPROF_CALIBRATION_DIR", str(store))
    return store


@pytest.fixture(scope="session")
def completion_witness():
    """The block completions' witness (helpers.CompletionWitness) for the rest of the run,
    from the first test that may trace."""
    if can_trace() is not None:
        yield None
        return
    helpers.WITNESS = CompletionWitness()
    yield helpers.WITNESS
    helpers.WITNESS.close()
    helpers.WITNESS = None


@pytest.fixture(autouse=True)
def untraced_since_test_start(request):
    """Where each live or engine test began, for what `forgiven` may forgive as untraced."""
    if "unit" in request.node.path.parts:
        return
    witness = request.getfixturevalue("completion_witness")
    if witness is not None:
        helpers.TEST_STARTED = witness.mark()


@pytest.fixture
def loopdev(tmp_path):
    with private_loop(tmp_path) as dev:
        yield dev


@pytest.fixture
def slow_device(tmp_path):
    """Makes devices with a latency of their own (tests/slow_device.py):
    `slow_device(read_ms=2, write_ms=2, rate_bps=None)` -> SlowDevice; all removed after the
    test, whatever happened. Skips in one line where nbdkit cannot run; CI fails instead."""
    from tests import slow_device as slow

    made: list[Path] = []

    def make(read_ms: int = 2, write_ms: int = 2, rate_bps: int | None = None,
             size: int = 2 << 30) -> slow.SlowDevice:
        require(slow.unavailable())
        where = tmp_path / f"slow-device-{len(made)}"
        made.append(where)
        return slow.up(where, read_ms, write_ms, rate_bps, size)

    try:
        yield make
    finally:
        for where in made:
            slow.down(where)


@pytest.fixture
def loopdev2(tmp_path):
    """A second one, for load beside the one recorded."""
    with private_loop(tmp_path, "-2") as dev:
        yield dev


@pytest.fixture
def start_recorder(tmp_path):
    started: list[Recorder] = []

    def start(*args: str, name: str = "session", socket: str | None = None,
              env: dict | None = None, cwd: Path | None = None,
              command: list[str] | None = None) -> Recorder:
        out = tmp_path / name
        sock = socket or str(tmp_path / f"{name}.sock")
        # Every row: the tests compare the event tier with the kernel's counts (a test of
        # sampling passes its own --event-rate).
        rate = [] if "--event-rate" in args else ["--event-rate", "0"]
        proc = subprocess.Popen((command or KVPROF) + ["record", "-o", str(out), "--socket",
                                                       sock, *rate, *args],
                                stderr=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                env=env, cwd=cwd)
        lines: list[str] = []
        ready = threading.Event()

        def pump():
            for line in proc.stderr:
                lines.append(line)
                if "Hit Ctrl-C" in line:
                    ready.set()
            ready.set()

        t = threading.Thread(target=pump, daemon=True)
        t.start()
        rec = Recorder(proc, out, sock, lines)
        rec._reader = t
        started.append(rec)
        assert ready.wait(90), "recorder did not start"
        assert proc.poll() is None, "".join(lines)
        return rec

    yield start
    for rec in started:
        if rec.proc.poll() is None:
            rec.proc.kill()
            rec.proc.wait()
