"""kvprof as ops install it (docs/install.md).

The wheel: built from this tree (`python -m build`), installed with pip into a fresh venv of the
OS's Python with its system site packages (bcc from python3-bpfcc), and run from outside the
repository: it records a loop device and its per-phase counts equal the kernel's
(/sys/block/DEV/stat). The wheel is $KVPROF_WHEEL where set (`bash scripts/dev.sh wheel` prints
where it built it), else built here; its dependencies come from pip's own configuration.

The systemd unit (deploy/kvprof.service): `systemd-analyze verify` with the wheel's venv where
the unit says (no systemd runs here), then its command line run as the unit runs it: its
capability bounding set, no new privileges, its working directory, stopped by its KillSignal
within its TimeoutStopSec; its Prometheus counters per phase equal the kernel's.

The DaemonSet (deploy/kubernetes/daemonset.yaml): the Kubernetes schema (kubernetes-validate,
strict) and what the API server and kvprof's own parser require of it.
"""
from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

import kvprof
from tests.helpers import (
    NOT_SEEN,
    READ_IOS,
    READ_SECTORS,
    WRITE_IOS,
    WRITE_SECTORS,
    assert_kernel_count,
    direct_random_reads,
    direct_write,
    free_port,
    http_get,
    live,
    read_stat,
    require,
    settle,
    stat_delta,
)

pytestmark = live

REPO = Path(__file__).resolve().parents[2]
UNIT = REPO / "deploy" / "kvprof.service"
DAEMONSET = REPO / "deploy" / "kubernetes" / "daemonset.yaml"
# Where the unit and the docs put the wheel's venv.
VENV = "/opt/kvprof"
IMAGE = f"localhost/kvprof:{kvprof.__version__}"
# The OS's Python, whose site packages hold python3-bpfcc: what a host's venv is made from.
OS_PYTHON = "/usr/bin/python3"


def _clean_env() -> dict[str, str]:
    """The environment of a shell on the host: nothing that points at this checkout."""
    return {k: v for k, v in os.environ.items()
            if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    given = os.environ.get("KVPROF_WHEEL")
    if given:
        return Path(given)
    out = tmp_path_factory.mktemp("dist")
    # (sdist, then the wheel from it, as scripts/dev.sh does: nothing left in ./build counts)
    r = subprocess.run([sys.executable, "-m", "build", "--outdir", str(out), str(REPO)],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    (whl,) = out.glob("kvprof_storage-*-py3-none-any.whl")
    return whl


@pytest.fixture(scope="module")
def installed(wheel, tmp_path_factory) -> Path:
    """A fresh venv (the OS's Python, system site packages) with the wheel installed; its
    bin/ directory."""
    ok = subprocess.run([OS_PYTHON, "-c", "import venv, ensurepip, bcc"],
                        capture_output=True).returncode == 0
    require(None if ok else f"{OS_PYTHON} needs python3-venv and python3-bpfcc")
    venv = tmp_path_factory.mktemp("host") / "venv"
    subprocess.run([OS_PYTHON, "-m", "venv", "--system-site-packages", str(venv)], check=True)
    r = subprocess.run([str(venv / "bin" / "pip"), "install", "-q", "--no-compile",
                        "--disable-pip-version-check", str(wheel)],
                       capture_output=True, text=True, timeout=900, env=_clean_env(),
                       cwd=venv.parent)
    assert r.returncode == 0, r.stderr[-3000:]
    return venv / "bin"


def test_the_wheel_carries_the_package_and_nothing_else(wheel):
    tracked = subprocess.run(["git", "ls-files", "kvprof"], cwd=REPO, capture_output=True,
                             text=True, check=True).stdout.split()
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        info = next(n for n in names if n.endswith(".dist-info/METADATA"))
        meta = z.read(info).decode()
        entry = z.read(info.replace("METADATA", "entry_points.txt")).decode()
    # Every file of the package (its Python, the probes' C and headers, the demo's session),
    # and nothing else.
    assert sorted(n for n in names if not n.startswith(info.split("/")[0])) == sorted(tracked)
    assert "Name: kvprof-storage\n" in meta and f"Version: {kvprof.__version__}\n" in meta
    # bcc comes from the OS; PyPI's "bcc" is another library.
    assert not [line for line in meta.splitlines()
                if line.lower().startswith("requires-dist: bcc")]
    assert "kvprof = kvprof.cli:main" in entry
    assert "kvprof = kvprof.phases.vllm_plugin:KvprofStatLogger" in entry


def test_the_installed_wheel_records_per_phase_counts_equal_to_the_kernels(
        installed, loopdev, start_recorder, tmp_path):
    env, cwd = _clean_env(), tmp_path  # outside the repository: nothing imports the checkout
    where = subprocess.run(
        [str(installed / "python"), "-c",
         "import kvprof, bcc; print(kvprof.__file__); print(bcc.__file__)"],
        capture_output=True, text=True, env=env, cwd=cwd, check=True).stdout.split()
    assert where[0].startswith(str(installed.parent)), where
    assert where[1].startswith("/usr/lib/python3/dist-packages/bcc/"), where
    version = subprocess.run([str(installed / "kvprof"), "--version"], capture_output=True,
                             text=True, env=env, cwd=cwd)
    assert version.stdout.split()[-1] == kvprof.__version__, version
    # The demo's recorded sample comes with the package.
    sample = Path(where[0]).parent / "samples" / "demo"
    r = subprocess.run([str(installed / "kvprof"), "report", str(sample), "--json"],
                       capture_output=True, text=True, env=env, cwd=cwd)
    assert r.returncode == 0 and json.loads(r.stdout)["session"]["devices"] == ["loop0"], r.stderr

    rec = start_recorder("-d", loopdev, command=[str(installed / "kvprof")], env=env, cwd=cwd)

    s0, s1, s2 = marked_io(loopdev, lambda phase: _mark(installed, phase, rec.socket))
    time.sleep(0.1)
    assert rec.stop() == 0
    r = subprocess.run([str(installed / "kvprof"), "report", str(rec.out), "--json"],
                       capture_output=True, text=True, env=env, cwd=cwd)
    assert r.returncode == 0, r.stderr
    report = json.loads(r.stdout)
    prefill, decode = stat_delta(s0, s1), stat_delta(s1, s2)
    p, d = report["phases"]["prefill"]["block"], report["phases"]["decode"]["block"]
    assert prefill[WRITE_SECTORS] * 512 == 16 << 20 and decode[READ_IOS] == 1000
    assert_kernel_count(p["write"]["ios"], prefill[WRITE_IOS], report)
    assert_kernel_count(d["read"]["ios"], decode[READ_IOS], report)
    if report["session"]["lost_events"] == 0:
        assert p["write"]["bytes"] == prefill[WRITE_SECTORS] * 512
        assert d["read"]["bytes"] == decode[READ_SECTORS] * 512
    assert d["write"]["ios"] == decode[WRITE_IOS] == 0


# -- the systemd unit ----------------------------------------------------------------------------


def unit_settings() -> dict[str, str]:
    """The unit's settings (continuation lines joined; a later one of a name wins)."""
    text = re.sub(r"\\\n\s*", " ", UNIT.read_text())
    return dict(line.split("=", 1) for line in text.splitlines()
                if "=" in line and not line.startswith(("#", ";")))


def scraped_block(port: int, dev: str) -> dict[tuple[str, str], tuple[int, int]]:
    """(ios, bytes) per (phase, op) of the block layer on dev, from the recorder's /metrics."""
    text = http_get(f"http://127.0.0.1:{port}/metrics").decode()
    got: dict[tuple[str, str], list[int]] = {}
    for fam in text_string_to_metric_families(text):
        for smp in fam.samples:
            lab = smp.labels
            if (smp.name in ("kvprof_io_ops_total", "kvprof_io_bytes_total")
                    and lab.get("layer") == "block" and lab.get("device") == dev):
                pair = got.setdefault((lab["phase"], lab["op"]), [0, 0])
                pair[smp.name == "kvprof_io_bytes_total"] = int(smp.value)
    return {k: (v[0], v[1]) for k, v in got.items()}


def marked_io(dev: str, mark) -> tuple[list[int], list[int], list[int]]:
    """Prefill: 16 MiB of 1 MiB direct writes; decode: 1000 random 4 KiB direct reads; each
    phase marked by `mark(phase)` first, idle after. The device's stat before, between, after."""
    s0 = settle(dev)
    mark("prefill")
    direct_write(dev, 16 << 20)
    s1 = read_stat(dev)
    mark("decode")
    direct_random_reads(dev, 1000, span=16 << 20)
    s2 = read_stat(dev)
    mark("idle")
    return s0, s1, s2


def assert_scraped_is_the_kernels(scraped: dict, stats: tuple, report: dict) -> None:
    """What a recorder's /metrics served for the device, per phase, against the kernel's
    count of marked_io's work. Scraped before the stop: what was in flight then (AT_STOP, on
    any device of the host) cannot excuse a shortfall; a completion the kernel did not trace
    (NOT_SEEN) only as far as the witness proves it."""
    prefill, decode = stat_delta(stats[0], stats[1]), stat_delta(stats[1], stats[2])
    assert prefill[WRITE_SECTORS] * 512 == 16 << 20 and decode[READ_IOS] == 1000
    print(f"Prometheus {scraped}; kernel: prefill writes {prefill[WRITE_IOS]}, decode reads "
          f"{decode[READ_IOS]}")
    write, read = scraped[("prefill", "write")], scraped[("decode", "read")]
    assert_kernel_count(write[0], prefill[WRITE_IOS], report, reason=NOT_SEEN)
    assert_kernel_count(read[0], decode[READ_IOS], report, reason=NOT_SEEN)
    assert_kernel_count(write[1], prefill[WRITE_SECTORS] * 512, report, 1 << 20, NOT_SEEN)
    assert_kernel_count(read[1], decode[READ_SECTORS] * 512, report, 4096, NOT_SEEN)


def test_the_systemd_unit_verifies_and_runs_the_wheel_as_it_would(installed, loopdev, tmp_path):
    unit = unit_settings()
    argv = shlex.split(unit["ExecStart"])
    assert argv[0] == f"{VENV}/bin/kvprof", argv
    # systemd-analyze checks that ExecStart's program exists: the wheel's venv at /opt/kvprof
    # in a mount namespace of its own, the host's /opt untouched.
    r = subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c",
                        f'mount -t tmpfs tmpfs /opt && ln -s "$1" {VENV} && '
                        f'systemd-analyze verify "$2"', "-",
                        str(installed.parent), str(UNIT)], capture_output=True, text=True)
    assert r.returncode == 0 and not r.stderr.strip(), r.stderr

    # Its command line as the unit runs it; the socket and port moved to this test's own.
    port, sock = free_port(), str(tmp_path / "marks.sock")
    args = [str(installed / "kvprof")] + argv[1:]
    args[args.index("/run/kvprof/marks.sock")] = sock
    args[args.index("--prometheus") + 1] = f"127.0.0.1:{port}"
    caps = ",".join("+" + c.removeprefix("CAP_").lower()
                    for c in unit["CapabilityBoundingSet"].split())
    assert unit["NoNewPrivileges"] == "yes" and unit["KillSignal"] == "SIGINT"
    workdir = tmp_path / "state"  # WorkingDirectory=/var/lib/kvprof (StateDirectory)
    workdir.mkdir()
    proc = subprocess.Popen(["setpriv", f"--bounding-set=-all,{caps}", "--no-new-privs", "--"]
                            + args, cwd=workdir, env=_clean_env(), stderr=subprocess.PIPE,
                            text=True)
    try:
        lines = ready(proc)
        bounding = int(re.search(r"CapBnd:\s*(\w+)",
                                 Path(f"/proc/{proc.pid}/status").read_text())[1], 16)
        # Nothing outside the unit's set (kvprof drops more itself once attached).
        allowed = sum(1 << _CAP_BITS[c] for c in unit["CapabilityBoundingSet"].split())
        assert bounding & ~allowed == 0, hex(bounding)
        stats = marked_io(loopdev, lambda phase: _mark(installed, phase, sock))
        # Counts are published --settle (5) s after their second, at the next flush.
        time.sleep(5 + 1.5)
        scraped = scraped_block(port, loopdev)
        t0 = time.monotonic()
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=int(unit["TimeoutStopSec"]))
        stopped_s = time.monotonic() - t0
        assert proc.returncode == 0, "".join(lines) + err
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    (session,) = workdir.glob("kvprof-*")
    r = subprocess.run([str(installed / "kvprof"), "report", str(session), "--json"],
                       capture_output=True, text=True, env=_clean_env(), cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    report = json.loads(r.stdout)
    assert report["session"]["status"] == "complete"
    print(f"unit: stopped in {stopped_s:.1f} s")
    assert_scraped_is_the_kernels(scraped, stats, report)


# capability numbers (linux/capability.h)
_CAP_BITS = {"CAP_DAC_READ_SEARCH": 2, "CAP_SYS_PTRACE": 19, "CAP_SYS_ADMIN": 21,
             "CAP_SYS_RESOURCE": 24, "CAP_PERFMON": 38, "CAP_BPF": 39}


def ready(proc: subprocess.Popen, timeout: float = 120) -> list[str]:
    """The recorder's stderr (its own, or its container's) up to the line that says it is
    tracing."""
    lines: list[str] = []
    assert proc.stderr is not None
    deadline = time.monotonic() + timeout
    for line in proc.stderr:
        lines.append(line)
        if "Hit Ctrl-C" in line:
            return lines
        assert time.monotonic() < deadline, "".join(lines)
    raise AssertionError("the recorder ended before it attached:\n" + "".join(lines))


def _mark(installed: Path, phase: str, sock: str) -> None:
    subprocess.run([str(installed / "kvprof"), "mark", phase, "--socket", sock], check=True,
                   env=_clean_env(), capture_output=True)


# -- the DaemonSet -------------------------------------------------------------------------------


def _validate(path: Path, version: str) -> tuple[int, str]:
    exe = Path(sys.executable).parent / "kubernetes-validate"
    r = subprocess.run([str(exe), "--strict", "-k", version, str(path)], capture_output=True,
                       text=True)
    return r.returncode, r.stdout + r.stderr


def test_the_daemonset_validates_against_the_kubernetes_schema(tmp_path):
    """kubernetes-validate, strict (unknown fields refused), against Kubernetes 1.30 and the
    newest it has; a misspelt field fails it."""
    from kubernetes_validate.utils import latest_version

    for version in ("1.30.0", latest_version()):
        rc, out = _validate(DAEMONSET, version)
        # A missing schema is only a warning (exit 0): require the pass line itself.
        assert rc == 0 and "WARN" not in out and "ERROR" not in out, out
        assert f"passed for resource daemonset/kvprof against version {version[:4]}" in out, out
    bad = tmp_path / "daemonset.yaml"
    bad.write_text(DAEMONSET.read_text().replace("imagePullPolicy:", "imagePulPolicy:"))
    rc, out = _validate(bad, "1.30.0")
    assert rc == 1 and "imagePulPolicy" in out, out


def test_the_daemonset_runs_the_image_the_script_builds():
    (c,) = yaml.safe_load(DAEMONSET.read_text())["spec"]["template"]["spec"]["containers"]
    assert c["image"] == IMAGE and c["imagePullPolicy"] == "Never"
    # scripts/dev.sh image tags what it imports so, the version read from kvprof/__init__.py.
    script = 'source <(grep -E "^(version|image_name)\\(\\)" scripts/dev.sh) && image_name'
    r = subprocess.run(["bash", "-c", script], cwd=REPO, capture_output=True, text=True)
    assert r.stdout.strip() == IMAGE, r


def test_the_daemonset_has_what_kubernetes_requires():
    docs = list(yaml.safe_load_all(DAEMONSET.read_text()))
    assert len(docs) == 1
    ds = docs[0]
    assert (ds["apiVersion"], ds["kind"]) == ("apps/v1", "DaemonSet")
    assert ds["metadata"]["name"]
    selector = ds["spec"]["selector"]["matchLabels"]
    template = ds["spec"]["template"]
    # The selector must match the pod template's labels, or the API server refuses it.
    assert selector.items() <= template["metadata"]["labels"].items()
    pod = template["spec"]
    assert pod["hostPID"] is True
    (c,) = pod["containers"]
    assert c["name"] and c["image"]
    assert c["args"][0] == "record"
    # The arguments are kvprof's own: they parse.
    from kvprof.cli import build_parser

    build_parser().parse_args(c["args"])
    caps = set(c["securityContext"]["capabilities"]["add"])
    assert {"BPF", "PERFMON"} <= caps
    volumes = {v["name"]: v for v in pod["volumes"]}
    mounts = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
    assert mounts.keys() == volumes.keys()
    for need in ("/sys/kernel/tracing", "/sys/kernel/btf", "/lib/modules", "/run/kvprof"):
        assert need in mounts.values()
    for v in volumes.values():
        assert v["hostPath"]["path"].startswith("/")
