"""What live capture needs from the host, each check with its fix. Used by capture before it
attaches and by `kvprof doctor`; nothing here imports bcc."""
from __future__ import annotations

import os
import platform
from dataclasses import dataclass
from pathlib import Path

from kvprof import layers
from kvprof.errors import EX_NOPERM, EX_UNAVAILABLE, KvprofError

CAP_SYS_ADMIN = 21
CAP_PERFMON = 38
CAP_BPF = 39

TRACEFS_CANDIDATES = (Path("/sys/kernel/tracing"), Path("/sys/kernel/debug/tracing"))

# Layer -> the tracepoints ("group/name") its probe always attaches (kvprof/layers.py);
# layers without any (gds: USDT probes) have no entry.
TRACEPOINTS = {layer.name: layer.tracepoints for layer in layers.LAYERS if layer.tracepoints}


@dataclass(frozen=True)
class Check:
    name: str
    ok: bool
    detail: str
    fix: str = ""
    required: bool = True  # False: only an optional part (a layer, a phase source) is off


def effective_caps() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("CapEff:"):
            return int(line.split()[1], 16)
    return 0


def check_privilege() -> Check:
    caps = effective_caps()
    has = lambda c: bool(caps >> c & 1)  # noqa: E731
    if has(CAP_SYS_ADMIN) or (has(CAP_BPF) and has(CAP_PERFMON)):
        return Check("privilege", True, "CAP_BPF+CAP_PERFMON" if not has(CAP_SYS_ADMIN) else "root")
    return Check(
        "privilege",
        False,
        "live capture needs root or CAP_BPF+CAP_PERFMON",
        "run with sudo, or: sudo setcap cap_bpf,cap_perfmon+ep $(readlink -f $(which python3))",
    )


def require_privilege() -> None:
    c = check_privilege()
    if not c.ok:
        raise KvprofError(f"{c.detail} (try sudo)", EX_NOPERM)


def _tracefs_found() -> tuple[Path | None, Path | None]:
    """The first tracefs this user can read; else (None, the first mounted where it may not
    look: its mode is 0700, root's)."""
    denied = None
    for p in TRACEFS_CANDIDATES:
        try:
            if (p / "events").is_dir():
                return p, None
        except PermissionError:
            denied = denied or p
    return None, denied


def tracefs() -> Path | None:
    return _tracefs_found()[0]


# What to do where tracefs is there but not this user's to read.
AS_ROOT = "run kvprof as root (sudo)"


def check_tracefs() -> Check:
    p, denied = _tracefs_found()
    if p:
        return Check("tracefs", True, str(p))
    if denied:
        return Check("tracefs", False, f"{denied} is not readable by this user", AS_ROOT)
    return Check("tracefs", False, "tracefs is not mounted",
                 "sudo mount -t tracefs tracefs /sys/kernel/tracing")


def ensure_tracefs() -> Path:
    """Mount tracefs when it is missing and we may (bcc needs it to read tracepoint formats)."""
    p = tracefs()
    if p:
        return p
    try:
        import subprocess

        subprocess.run(["mount", "-t", "tracefs", "tracefs", "/sys/kernel/tracing"],
                       check=True, capture_output=True)
    except (OSError, subprocess.CalledProcessError):
        pass
    p = tracefs()
    if not p:
        c = check_tracefs()
        raise KvprofError(f"{c.detail}; fix: {c.fix}", EX_UNAVAILABLE)
    return p


def tracepoint_available(tp: str) -> bool:
    p = tracefs()
    return p is not None and (p / "events" / tp / "format").is_file()


def check_tracepoints() -> list[Check]:
    out = []
    readable, denied = _tracefs_found()
    for group, tps in TRACEPOINTS.items():
        if readable is None and denied is not None:
            out.append(Check(f"tracepoints:{group}", False, "not checked: tracefs is not "
                             "readable by this user", AS_ROOT,
                             required=layers.BY_NAME[group].default))
            continue
        missing = [t for t in tps if not tracepoint_available(t)]
        if missing:
            out.append(Check(f"tracepoints:{group}", False, "missing " + ", ".join(missing[:3])
                             + (f" and {len(missing) - 3} more" if len(missing) > 3 else ""),
                             "a kernel with CONFIG_BLK_DEV_IO_TRACE, io_uring and "
                             "CONFIG_FTRACE_SYSCALLS tracepoints, and tracefs mounted",
                             # The others are opt-in: without them, the default works.
                             required=layers.BY_NAME[group].default))
        else:
            names = [t.split("/")[1] for t in tps]
            out.append(Check(f"tracepoints:{group}", True, ", ".join(names) if len(names) <= 3
                             else f"{len(names)} tracepoints ({names[0]}, ...)"))
    return out


# Generic headers carried beside kvprof (the image's, docs/install.md): one merged tree in the
# kernel source's layout, which bcc compiles against when BCC_KERNEL_SOURCE names it.
ENV_HEADERS = "KVPROF_KERNEL_HEADERS"


def _bundled_headers() -> Path | None:
    d = os.environ.get(ENV_HEADERS)
    if d and (Path(d) / "include" / "linux" / "kconfig.h").is_file():
        return Path(d)
    return None


def headers_dir() -> Path | None:
    build = Path(f"/lib/modules/{platform.release()}/build")
    if (build / "include").is_dir() or (build / "Makefile").exists():
        return build
    return None


def headers_fix() -> str:
    """Debian ships no headers for every kernel build; kvprof's programs are safe to compile
    against the distribution's generic headers because no kernel struct layout comes from
    them: tracepoint arguments come from tracefs, and the raw tracepoints' struct offsets from
    the kernel's BTF (capture/btf.py)."""
    rel = platform.release()
    generic = sorted(Path("/usr/src").glob("linux-headers-*-amd64")) + sorted(
        Path("/usr/src").glob("linux-headers-*-arm64"))
    if generic:
        build = generic[-1]
        common = Path(str(build).rsplit("-", 1)[0] + "-common")
        return (f"sudo mkdir -p /lib/modules/{rel} && sudo ln -sfn {build} /lib/modules/{rel}/build"
                f" && sudo ln -sfn {common} /lib/modules/{rel}/source")
    return (f"sudo apt-get install linux-headers-{rel}  (or, where that package does not exist: "
            "sudo apt-get install linux-headers-amd64, then run kvprof doctor again)")


# The kernel's own headers, where it was built with CONFIG_IKHEADERS (bcc unpacks them).
KHEADERS = Path("/sys/kernel/kheaders.tar.xz")


def headers_found() -> tuple[str, Path] | None:
    """The headers bcc will compile against, in its own order ("build": the kernel's build
    tree; "kheaders"), then kvprof's bundled generic ones ("bundled", handed to bcc)."""
    d = headers_dir()
    if d:
        return "build", d
    if KHEADERS.exists():
        return "kheaders", KHEADERS
    bundled = _bundled_headers()
    if bundled:
        return "bundled", bundled
    return None


def check_headers() -> Check:
    found = headers_found()
    if found is None:
        return Check("kernel headers", False, f"none for {platform.release()}", headers_fix())
    kind, d = found
    detail = {"build": str(d.resolve()), "kheaders": f"{d} (CONFIG_IKHEADERS)",
              "bundled": f"{d} (generic, ${ENV_HEADERS})"}[kind]
    return Check("kernel headers", True, detail)


def require_headers() -> None:
    found = headers_found()
    if found is None:
        raise KvprofError(f"no kernel headers for {platform.release()}; "
                          f"fix: {headers_fix()}", EX_UNAVAILABLE)
    kind, d = found
    if kind == "bundled":
        # bcc reads it when it compiles (libbcc's loader), in this process.
        os.environ.setdefault("BCC_KERNEL_SOURCE", str(d))
