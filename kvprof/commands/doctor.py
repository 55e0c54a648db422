"""`kvprof doctor`: one line per requirement of live capture, with the fix when it fails."""
from __future__ import annotations

import argparse
import os
import re
from pathlib import Path

from kvprof import system
from kvprof.errors import KvprofError


def _bcc() -> system.Check:
    from kvprof.capture.bccload import FIX, load_bcc

    try:
        mod = load_bcc()
    except KvprofError as e:
        return system.Check("bcc", False, str(e).split(";")[0], FIX)
    return system.Check("bcc", True, f"{getattr(mod, '__version__', '?')} from "
                                     f"{os.path.dirname(mod.__file__)}")


def _btf() -> system.Check:
    """The device probes read struct request and io_kiocb at offsets from the kernel's BTF:
    the default's (block) are needed, io_uring's (on with -p or named) only for that layer."""
    from kvprof.capture.btf import VMLINUX, layout_defines

    def why(e: KvprofError) -> str:
        return str(e).split(";")[0].split(" (")[0]

    try:
        found = layout_defines(("block",))
    except KvprofError as e:
        return system.Check("btf", False, why(e),
                            "a kernel built with CONFIG_DEBUG_INFO_BTF=y (Linux 6.x)")
    try:
        found = layout_defines(("block", "io_uring"))
    except KvprofError as e:
        return system.Check("btf", True, f"{len(found)} request layout values from {VMLINUX}; "
                            f"not io_uring's ({why(e)}): no io_uring layer")
    return system.Check("btf", True, f"{len(found)} request layout values from {VMLINUX}")


def _nvml() -> system.Check:
    from kvprof.capture.nvml import nvml_available

    status = nvml_available()
    if status.ok:
        return system.Check("nvml", True, f"{status.gpus} GPU(s)")
    return system.Check("nvml", False, f"{status.reason}; no phase windows from NVML",
                        f"{status.fix}; optional", required=False)


def _gds() -> system.Check:
    """GPUDirect Storage moves KV between NVMe and GPU memory without the page cache; in its
    compat mode it does plain POSIX I/O, which the syscall layer sees."""
    from kvprof.capture.gds import find_cufile

    found = find_cufile()
    if found is None:
        return system.Check("gds", False, "libcufile not found: no GPUDirect Storage on this "
                            "host (nothing to trace)", "", required=False)
    return system.Check("gds", True, f"{found}: cuFile calls traced with --layer gds (on "
                        "by default with -p/--cgroup)")


def _site_packages(pid: int) -> Path | None:
    """The site-packages a running Python loaded vLLM from (its mapped .so files say)."""
    try:
        maps = Path(f"/proc/{pid}/maps").read_text()
    except OSError:
        return None
    m = re.search(r"\s(/\S*/site-packages)/(?:vllm|torch)/", maps)
    return Path(m.group(1)) if m else None


def _has_plugin(site: Path) -> bool:
    for ep in site.glob("*.dist-info/entry_points.txt"):
        try:
            text = ep.read_text()
        except OSError:
            continue
        group = re.search(r"^\[vllm\.stat_logger_plugins\]\n((?:[^\[].*\n?)*)", text, re.M)
        if group and "kvprof.phases.vllm_plugin" in group.group(1):
            return True
    return False


def _install_hint() -> str:
    """How to install this kvprof elsewhere: from its checkout (or wheel), never by the bare
    name, which on PyPI is an unrelated project (the distribution is kvprof-storage)."""
    from kvprof import __version__

    root = Path(__file__).resolve().parents[2]
    if (root / "pyproject.toml").is_file():
        return (f"install kvprof's checkout, not PyPI's kvprof (another project): "
                f"pip install {root}")
    return (f"install kvprof's wheel, not PyPI's kvprof (another project): "
            f"pip install ./kvprof_storage-{__version__}-py3-none-any.whl")


def _vllm(proc: Path = Path("/proc")) -> list[system.Check]:
    """Each running vLLM API server: will kvprof's plugin send it a window per step?"""
    from kvprof.markers import ENV_SOCKET, socket_path
    from kvprof.roles import role

    out = []
    for d in sorted(proc.glob("[0-9]*"), key=lambda p: int(p.name)):
        try:
            args = (d / "cmdline").read_bytes().split(b"\0")
            cmd = b" ".join(args).decode(errors="replace").strip()
        except OSError:
            continue
        if role(cmd) != "vllm API server":
            continue
        try:
            env = dict(kv.split("=", 1) for kv in (d / "environ").read_bytes().decode(
                errors="replace").split("\0") if "=" in kv)
        except OSError:
            env = {}
        name = f"vllm pid {d.name}"
        plugins = env.get("VLLM_PLUGINS")
        site = _site_packages(int(d.name))
        if b"--disable-log-stats" in args:
            out.append(system.Check(name, False, "runs with --disable-log-stats: vLLM calls no "
                                    "stat logger, so kvprof's plugin sends no windows",
                                    "drop --disable-log-stats, or record with --phases "
                                    "vllm-metrics=URL", required=False))
        elif plugins is not None and "kvprof" not in plugins.split(","):
            out.append(system.Check(name, False, f"VLLM_PLUGINS={plugins} leaves out kvprof's "
                                    "plugin", "add kvprof to VLLM_PLUGINS", required=False))
        elif site is not None and not _has_plugin(site):
            out.append(system.Check(name, False, f"kvprof is not installed in {site}: no "
                                    "per-step windows", f"{_install_hint()} with vLLM's "
                                    "pip, then restart vLLM", required=False))
        else:
            sock = socket_path(env.get(ENV_SOCKET))
            where = "installed" if site is not None else "(where it is installed)"
            out.append(system.Check(name, True, f"kvprof's plugin {where}: one window per "
                                    f"engine step, timed by vLLM itself with its default "
                                    f"flags, to {sock}"))
    return out


def run_doctor() -> int:
    checks = [system.check_privilege(), system.check_tracefs(), *system.check_tracepoints(),
              _btf(), _bcc(), system.check_headers(), _nvml(), _gds(), *_vllm()]
    for c in checks:
        mark = "ok  " if c.ok else ("FAIL" if c.required else "warn")
        line = f"{mark} {c.name:<20} {c.detail}"
        print(line)
        if not c.ok and c.fix:
            print(f"     {'':<20} fix: {c.fix}")
    required_failed = [c for c in checks if not c.ok and c.required]
    return 1 if required_failed else 0


def run(args: argparse.Namespace) -> int:
    return run_doctor()
