"""Bad input gets one line and a distinct exit status, never a traceback."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time

import pytest

from kvprof import errors, system
from tests.helpers import live, run_kvprof

# Root with an empty capability bounding set: uid 0 but no CAP_BPF/CAP_PERFMON/CAP_SYS_ADMIN,
# the same as an ordinary user as far as BPF is concerned.
NO_CAPS = ["setpriv", "--bounding-set=-all", "--inh-caps=-all"]


def one_line_error(r) -> str:
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    assert "Traceback" not in r.stderr
    assert lines[0].startswith("kvprof: error: ")
    return lines[0]


@pytest.mark.skipif(shutil.which("setpriv") is None, reason="needs setpriv (util-linux)")
def test_no_privilege_exits_77_with_one_line(tmp_path):
    r = run_kvprof("record", "-o", str(tmp_path / "s"), "--duration", "1", prefix=NO_CAPS)
    assert r.returncode == errors.EX_NOPERM == 77
    assert "root or CAP_BPF+CAP_PERFMON" in one_line_error(r)
    assert not (tmp_path / "s").exists()


@pytest.mark.skipif(shutil.which("setpriv") is None, reason="needs setpriv (util-linux)")
def test_ebpf_prints_the_program_without_root():
    r = run_kvprof("record", "--ebpf", "-d", "loop0", "-p", "1", prefix=NO_CAPS)
    assert r.returncode == 0, r.stderr
    assert "-DKVPROF_FILTER_DEV" in r.stdout and "-DKVPROF_FILTER_TGID" in r.stdout
    assert "RAW_TRACEPOINT_PROBE(block_rq_complete)" in r.stdout
    assert "RAW_TRACEPOINT_PROBE(io_uring_submit_req)" in r.stdout
    # values from the command line never reach the C text; they go into maps
    assert "loop0" not in r.stdout.split("\n", 1)[1]


def test_unknown_device_lists_the_devices():
    r = run_kvprof("record", "--ebpf", "-d", "nosuchdisk0")
    assert r.returncode == errors.EX_USAGE
    line = one_line_error(r)
    assert "unknown device 'nosuchdisk0'" in line and "block devices here:" in line


def test_path_that_is_not_a_block_device():
    r = run_kvprof("record", "--ebpf", "-d", "/etc/hostname")
    assert r.returncode == errors.EX_USAGE
    assert "not a block device" in one_line_error(r)


def test_missing_session(tmp_path):
    r = run_kvprof("report", str(tmp_path / "nothing"))
    assert r.returncode == errors.EX_NOINPUT
    assert "no kvprof session" in one_line_error(r)


def test_corrupt_session(tmp_path):
    d = tmp_path / "corrupt"
    d.mkdir()
    (d / "session.duckdb").write_bytes(b"this is not a database" * 1000)
    for args in (["report", str(d)], ["export", str(d), "--parquet", str(tmp_path / "pq")]):
        r = run_kvprof(*args)
        assert r.returncode == errors.EX_DATAERR
        assert "not a readable kvprof session" in one_line_error(r)


def test_duckdb_file_that_is_not_a_session(tmp_path):
    import duckdb

    path = tmp_path / "other.duckdb"
    duckdb.connect(str(path)).execute("CREATE TABLE t (x INT)").close()
    r = run_kvprof("report", str(path))
    assert r.returncode == errors.EX_DATAERR
    assert "missing tables" in one_line_error(r)


def test_mark_without_listener_says_so(tmp_path):
    r = run_kvprof("mark", "decode", "--socket", str(tmp_path / "none.sock"))
    assert r.returncode == 1
    assert "no recorder listening" in r.stderr


def test_marker_client_never_raises_without_listener(tmp_path):
    from kvprof.markers import Marker

    m = Marker(str(tmp_path / "none.sock"))
    assert m.mark("prefill") is False
    with m.phase("decode"):
        pass


@live
def test_second_recorder_on_same_socket_is_refused(start_recorder, tmp_path, loopdev):
    rec = start_recorder("-d", loopdev)
    r = run_kvprof("record", "-d", loopdev, "-o", str(tmp_path / "two"), "--socket", rec.socket,
                   "--duration", "1")
    assert r.returncode == errors.EX_USAGE
    assert "already listening" in one_line_error(r)
    assert not (tmp_path / "two").exists()  # refused before it made anything
    assert rec.stop() == 0
    # A directory holding a session is refused, and the session is left as it was.
    before = (rec.out / "session.duckdb").read_bytes()
    r = run_kvprof("record", "-d", loopdev, "-o", str(rec.out), "--socket",
                   str(tmp_path / "three.sock"), "--duration", "1")
    assert r.returncode == errors.EX_USAGE
    assert "already holds a session" in one_line_error(r)
    assert (rec.out / "session.duckdb").read_bytes() == before
    assert not (tmp_path / "three.sock").exists()


def test_missing_bcc_names_the_package_to_install():
    # A venv that cannot see the OS's dist-packages and has no bcc of its own.
    code = ("import sys; sys.path[:] = [p for p in sys.path if 'dist-packages' not in p]\n"
            "import kvprof.capture.bccload as b; b.SYSTEM_DIRS = ()\n"
            "from kvprof.errors import KvprofError\n"
            "try:\n    b.load_bcc()\nexcept KvprofError as e:\n"
            "    print(e.exit_code, e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout
    assert out.startswith(f"{errors.EX_UNAVAILABLE} ")
    assert "apt-get install python3-bpfcc" in out


def test_doctor_prints_one_line_per_check():
    r = run_kvprof("doctor")
    names = [line.split()[1] for line in r.stdout.splitlines()
             if line[:4] in ("ok  ", "FAIL", "warn")]
    names = [n for n in names if n != "vllm"]  # one line per running vLLM, if any
    assert names == ["privilege", "tracefs", "tracepoints:block", "tracepoints:io_uring",
                     "tracepoints:syscall", "tracepoints:tcp", "btf", "bcc", "kernel", "nvml",
                     "gds"]
    failed = [line for line in r.stdout.splitlines() if line.startswith("FAIL")]
    assert r.returncode == (1 if failed else 0)
    for i, line in enumerate(r.stdout.splitlines()):
        if line.startswith("FAIL"):
            assert "fix:" in r.stdout.splitlines()[i + 1]


@pytest.mark.skipif(shutil.which("setpriv") is None, reason="needs setpriv")
def test_doctor_without_privileges_says_what_is_missing():
    """As a user with no privileges (tracefs is root's alone), doctor names each missing part
    with its fix rather than failing on the first file it may not read."""
    if os.stat(system.tracefs() or "/sys/kernel/tracing").st_mode & 0o005 == 0o005:
        pytest.skip("tracefs is readable by everyone here")
    r = run_kvprof("doctor", prefix=["setpriv", "--reuid", "65534", "--regid", "65534",
                                     "--clear-groups", "--inh-caps=-all",
                                     "--bounding-set=-all"])
    assert r.returncode == 1, r.stderr
    assert "internal error" not in r.stderr
    lines = r.stdout.splitlines()
    assert lines[0].startswith("FAIL privilege")
    assert lines[2].startswith("FAIL tracefs") and "not readable by this user" in lines[2]
    assert "fix: run kvprof as root" in lines[3]
    assert any(line.startswith("FAIL tracepoints:block") and "not checked" in line
               for line in lines)


def test_doctor_says_when_a_running_vllm_will_send_no_windows():
    """A process that looks like a vLLM API server started with --disable-log-stats (no stat
    logger at all, so no plugin): doctor names it, says why, and how to fix it."""
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)",
                             "vllm.entrypoints.openai.api_server", "--disable-log-stats"])
    try:
        time.sleep(0.2)
        lines = run_kvprof("doctor").stdout.splitlines()
    finally:
        proc.kill()
        proc.wait()
    i = next(i for i, line in enumerate(lines) if line.split()[1:3] == ["vllm", "pid"]
             and line.split()[3] == str(proc.pid))
    assert lines[i].startswith("warn") and "--disable-log-stats" in lines[i]
    assert "fix: drop --disable-log-stats" in lines[i + 1]


@live
def test_reading_a_session_still_being_recorded_says_so(start_recorder, loopdev):
    rec = start_recorder("-d", loopdev)
    for cmd in (("report",), ("export", "--parquet", str(rec.out.parent / "pq"))):
        r = run_kvprof(cmd[0], str(rec.out), *cmd[1:])
        assert r.returncode == errors.EX_TEMPFAIL, r.stderr
        assert f"still being recorded (by process {rec.proc.pid})" in one_line_error(r)
    assert rec.stop() == 0
    assert run_kvprof("report", str(rec.out)).returncode == 0
