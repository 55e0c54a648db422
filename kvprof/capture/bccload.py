"""Find the OS's bcc from any interpreter or venv.

bcc's Python module ships with the distribution (Debian/Ubuntu: python3-bpfcc) and is not on
PyPI; the PyPI package called "bcc" is an unrelated library that must not shadow it.
"""
from __future__ import annotations

import importlib
import sys

from kvprof.errors import EX_UNAVAILABLE, KvprofError

SYSTEM_DIRS = ("/usr/lib/python3/dist-packages", "/usr/lib/python3/site-packages",
               "/usr/local/lib/python3/dist-packages")
FIX = "sudo apt-get install python3-bpfcc bpfcc-tools  (Fedora: sudo dnf install python3-bcc)"


def _is_real(mod) -> bool:
    return hasattr(mod, "BPF") and hasattr(mod, "lib")


def load_bcc():
    """Return the bcc module or raise KvprofError naming the package to install."""
    try:
        mod = importlib.import_module("bcc")
        if _is_real(mod):
            return mod
    except Exception:  # noqa: BLE001 - any failure here means "not the real bcc"
        pass
    for name in [n for n in sys.modules if n == "bcc" or n.startswith("bcc.")]:
        del sys.modules[name]
    # Put the system dirs first only while importing bcc, so nothing else the venv has
    # is shadowed by the OS's packages.
    saved = list(sys.path)
    sys.path[:0] = list(SYSTEM_DIRS)
    try:
        mod = importlib.import_module("bcc")
        if _is_real(mod):
            return mod
    except Exception as e:  # noqa: BLE001
        raise KvprofError(f"bcc (BPF Compiler Collection) is not usable: {e}; fix: {FIX}",
                          EX_UNAVAILABLE) from None
    finally:
        sys.path[:] = saved
    raise KvprofError(f"bcc (BPF Compiler Collection) is not installed; fix: {FIX}",
                      EX_UNAVAILABLE)


def bcc_version() -> str:
    try:
        from importlib.metadata import version

        return version("bcc")
    except Exception:  # noqa: BLE001
        pass
    try:
        return getattr(load_bcc(), "__version__", "unknown")
    except KvprofError:
        return "missing"
