"""The image (`bash scripts/dev.sh image`, localhost/kvprof:VERSION) run by podman as the
DaemonSet runs it: the podman command line is read from deploy/kubernetes/daemonset.yaml (host
PID, its capabilities and nothing else, its user, working directory, host mounts and
arguments, host network). Three things differ, each for the test's sake: the marker socket's
and the sessions' host directories are this test's own; the Prometheus port is a free one; and
the open-files and processes limits are set (`--ulimit`) to what root here can give, where
podman would raise them past it (root's bounding set here lacks CAP_SYS_RESOURCE); a kubelet's
runtime hands down its own. Podman runs with runc: crun refuses this host's hybrid cgroups.

It records a loop device on the host; its Prometheus counters per phase equal
/sys/block/DEV/stat; `kvprof doctor` inside it passes; SIGTERM (`podman stop`, the DaemonSet's
grace period) ends it in time, exit 0, the session complete and readable on the host. Without
the host's headers it compiles against the generic ones it carries.

Where podman or the image is missing the tests skip; under CI (`require`: scripts/dev.sh builds
the image first there) they fail instead.
"""
from __future__ import annotations

import json
import os
import resource
import shutil
import subprocess
import time
from pathlib import Path

import pytest
import yaml

from tests.helpers import (
    free_port,
    live,
    require,
    run_kvprof,
)
from tests.live.test_deploy import (
    DAEMONSET,
    IMAGE,
    assert_scraped_is_the_kernels,
    marked_io,
    ready,
    scraped_block,
)

pytestmark = live

PODMAN = ["podman", "--cgroup-manager=cgroupfs", "--events-backend=file", "--runtime=runc"]


def _missing() -> str | None:
    if shutil.which("podman") is None:
        return "needs podman (bash scripts/dev.sh image installs it)"
    r = subprocess.run(PODMAN + ["image", "exists", IMAGE], capture_output=True)
    if r.returncode != 0:
        return f"needs the image {IMAGE}: bash scripts/dev.sh image"
    return None


@pytest.fixture(scope="module", autouse=True)
def image():
    require(_missing())


def _host_limits() -> list[str]:
    """Limits root here can give: the open files this process may have, and 4096 processes
    (kvprof runs a dozen threads; podman's conmon itself holds 32768 here)."""
    nofile = ":".join(map(str, resource.getrlimit(resource.RLIMIT_NOFILE)))
    return [f"--ulimit=nofile={nofile}", "--ulimit=nproc=4096:4096"]


def daemonset_run(name: str, tmp: Path, port: int, *, host_headers: bool = True,
                  args: list[str] | None = None) -> list[str]:
    """`podman run` as the DaemonSet's pod runs its container (see the module's text)."""
    pod = yaml.safe_load(DAEMONSET.read_text())["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    sec = c["securityContext"]
    assert sec.get("privileged") is False and sec["capabilities"]["drop"] == ["ALL"]
    argv = PODMAN + ["run", "--name", name, "--log-driver=k8s-file", *_host_limits(),
                     "--cap-drop=all", "--user", str(sec["runAsUser"]),
                     "--workdir", c["workingDir"]]
    if pod.get("hostPID"):
        argv.append("--pid=host")
    if pod.get("hostNetwork"):
        argv.append("--network=host")
    argv += [f"--cap-add=CAP_{cap}" for cap in sec["capabilities"]["add"]]
    volumes = {v["name"]: v["hostPath"]["path"] for v in pod["volumes"]}
    own = {"/run/kvprof": tmp / "run", "/var/lib/kvprof": tmp / "sessions"}
    for m in c["volumeMounts"]:
        host = own.get(m["mountPath"], volumes[m["name"]])
        if not host_headers and m["mountPath"] in ("/lib/modules", "/usr/src"):
            continue
        Path(host).mkdir(parents=True, exist_ok=True)
        argv += ["-v", f"{host}:{m['mountPath']}" + (":ro" if m.get("readOnly") else "")]
    cargs = list(args if args is not None else c["args"])
    if "--prometheus" in cargs:
        cargs[cargs.index("--prometheus") + 1] = f"127.0.0.1:{port}"
    return argv + [c["image"], *cargs]


@pytest.fixture
def container(tmp_path):
    names: list[str] = []

    def start(argv: list[str]) -> subprocess.Popen:
        names.append(argv[argv.index("--name") + 1])
        proc = subprocess.Popen(argv, stderr=subprocess.PIPE, stdout=subprocess.PIPE,
                                text=True)
        return proc

    yield start
    for name in names:
        subprocess.run(PODMAN + ["rm", "-f", "-t", "0", name], capture_output=True)


def test_the_image_runs_as_the_daemonset_and_counts_what_the_kernel_counts(
        loopdev, tmp_path, container):
    name, port = f"kvprof-test-{os.getpid()}", free_port()
    proc = container(daemonset_run(name, tmp_path, port))
    lines = ready(proc)
    doctor = subprocess.run(PODMAN + ["exec", name, "kvprof", "doctor"], capture_output=True,
                            text=True)
    assert doctor.returncode == 0, doctor.stdout + doctor.stderr
    sock = str(tmp_path / "run" / "marks.sock")
    stats = marked_io(loopdev, lambda phase: run_kvprof("mark", phase, "--socket", sock))
    time.sleep(5 + 1.5)  # published --settle (5) s after their second, at the next flush
    scraped = scraped_block(port, loopdev)
    pod = yaml.safe_load(DAEMONSET.read_text())["spec"]["template"]["spec"]
    grace = pod["terminationGracePeriodSeconds"]
    t0 = time.monotonic()
    subprocess.run(PODMAN + ["stop", "-t", str(grace), name], capture_output=True, check=True)
    stopped_s = time.monotonic() - t0
    proc.wait(30)
    code = subprocess.run(PODMAN + ["inspect", "--format", "{{.State.ExitCode}}", name],
                          capture_output=True, text=True).stdout.strip()
    assert code == "0" and stopped_s < grace, (code, stopped_s, "".join(lines))
    (session,) = (tmp_path / "sessions").glob("kvprof-*")
    r = run_kvprof("report", str(session), "--json")
    assert r.returncode == 0, r.stderr
    report = json.loads(r.stdout)
    assert report["session"]["status"] == "complete"
    print(f"image {IMAGE}: stopped in {stopped_s:.1f} s")
    assert_scraped_is_the_kernels(scraped, stats, report)


def test_without_the_hosts_headers_it_compiles_against_its_own(loopdev, tmp_path, container):
    name = f"kvprof-test-{os.getpid()}-noheaders"
    doctor = subprocess.run(daemonset_run(name + "-doctor", tmp_path, 0, host_headers=False,
                                          args=["doctor"]), capture_output=True, text=True)
    subprocess.run(PODMAN + ["rm", "-f", name + "-doctor"], capture_output=True)
    assert "/opt/kvprof/kernel-headers (generic" in doctor.stdout, doctor.stdout
    proc = container(daemonset_run(name, tmp_path, 0, host_headers=False,
                                   args=["record", "-d", loopdev, "--duration", "2",
                                         "--no-events"]))
    _, err = proc.communicate(timeout=180)
    assert proc.returncode == 0, err


def test_doctor_in_a_bare_container_names_each_missing_part_and_its_fix():
    """The image with nothing of the host's (no privileges, no tracefs, no host headers, its
    own headers unset): a bare host, as `kvprof doctor` first meets it."""
    r = subprocess.run(PODMAN + ["run", "--rm", *_host_limits(), "--cap-drop=all",
                                 "--user", "65534", "-e", "KVPROF_KERNEL_HEADERS=", IMAGE,
                                 "doctor"], capture_output=True, text=True)
    assert r.returncode == 1 and "Traceback" not in r.stdout + r.stderr, r.stdout + r.stderr
    lines = r.stdout.splitlines()
    for part in ("privilege", "tracefs", "kernel headers"):
        assert any(line.startswith(f"FAIL {part}  ") for line in lines), (part, r.stdout)
    for i, line in enumerate(lines):
        if line.startswith("FAIL"):
            assert lines[i + 1].strip().startswith("fix: "), (line, r.stdout)
