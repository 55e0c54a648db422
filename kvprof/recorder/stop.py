"""What ends a recording: the caller's event, or SIGINT/SIGTERM through `StopFlag`."""
from __future__ import annotations

import signal
import threading
from typing import Protocol

from kvprof.wakeup import Wakeup


class StopFlag(Wakeup):
    """Set by SIGINT/SIGTERM, so a signal ends the recording cleanly at the next flush (a
    Wakeup: its handler takes no lock)."""

    def __init__(self) -> None:
        super().__init__()
        self._old: dict = {}

    def install(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        for sig in (signal.SIGINT, signal.SIGTERM):
            self._old[sig] = signal.signal(sig, lambda *_: self.set())

    def restore(self) -> None:
        for sig, old in self._old.items():
            signal.signal(sig, old)
        self._old.clear()
        self.close()


class Stop(Protocol):
    """What ends a recording: a threading.Event of the caller's, or the recorder's StopFlag."""

    def is_set(self) -> bool: ...

    def wait(self, timeout: float | None = None) -> bool: ...

    def set(self) -> None: ...
