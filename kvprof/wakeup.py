"""A stop flag that a signal handler may set and a select() may wait on.

Waited on like a threading.Event (`set`, `is_set`, `wait`), but set without a lock: a Python
signal handler runs in the main thread between two bytecodes, maybe inside Event.wait holding
the event's lock, which Event.set would take again and hang for good. Setting writes a byte to
a pipe; `fileno()` is its read end, for a thread that waits on a socket and the flag at once."""
from __future__ import annotations

import os
import select


class Wakeup:
    def __init__(self) -> None:
        self._set = False
        self._r, self._w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)

    def set(self) -> None:
        self._set = True
        if self._w >= 0:
            try:
                os.write(self._w, b"\0")
            except BlockingIOError:
                pass  # (readable already)

    def is_set(self) -> bool:
        return self._set

    def fileno(self) -> int:
        """Readable once set (-1 once closed)."""
        return self._r

    def wait(self, timeout: float | None = None) -> bool:
        if not self._set and self._r >= 0:
            try:
                select.select([self._r], [], [], timeout)
            except (OSError, ValueError):
                pass  # closed meanwhile by another thread: it is over
        return self._set

    def close(self) -> None:
        """Let go of the pipe; it stays set if it was. Once only: the numbers may be another
        file's by a second call."""
        if self._r >= 0:
            os.close(self._r)
            os.close(self._w)
            self._r = self._w = -1
