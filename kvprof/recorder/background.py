"""`record()` in a thread, for views that run beside it (the dashboard, the demo)."""
from __future__ import annotations

import threading
from collections.abc import Callable

from kvprof.errors import EX_UNAVAILABLE, KvprofError
from kvprof.recorder.options import RecordOptions
from kvprof.recorder.recorder import record
from kvprof.store.session import Store

ATTACH_TIMEOUT_S = 60.0


class BackgroundRecorder:
    """`record()` in a thread, for views that run next to it (the dashboard, the demo).
    Stopped by its own event, so it installs no signal handlers; hands over the store once
    the probes are attached; an error in the thread is raised again in the caller's."""

    def __init__(self, opts: RecordOptions):
        self.opts = opts
        self.stop = threading.Event()
        self.ready = threading.Event()
        self.store: Store | None = None
        self.error: BaseException | None = None
        self.log: list[str] = []
        self.on_flush: Callable[[], None] | None = None  # called after each flush
        self._thread = threading.Thread(target=self._run, name="kvprof-record", daemon=True)

    def _started(self, store: Store) -> None:
        self.store = store
        self.ready.set()

    @property
    def native_id(self) -> int | None:
        """The recording thread's id: what it kept once attached is what its threads hold."""
        return self._thread.native_id

    def _flushed(self) -> None:
        if self.on_flush is not None:
            self.on_flush()

    def _run(self) -> None:
        try:
            record(self.opts, log=self.log.append, stop=self.stop, on_start=self._started,
                   on_flush=self._flushed)
        except BaseException as e:  # noqa: BLE001 - handed to the caller's thread
            self.error = e
        finally:
            self.ready.set()

    def start(self) -> Store:
        """Start recording; once the probes are attached, return the store `record()`
        handed over."""
        self._thread.start()
        try:
            attached = self.ready.wait(ATTACH_TIMEOUT_S)
        except BaseException:
            # Ctrl-C while the probes load: no recorder may go on in the background.
            self.stop.set()
            self._thread.join(ATTACH_TIMEOUT_S)
            raise
        if not attached:
            self.finish(ATTACH_TIMEOUT_S)
            raise KvprofError(f"the recorder did not attach within {ATTACH_TIMEOUT_S:.0f} s",
                              EX_UNAVAILABLE)
        self._raise()
        # `ready` is set by _started, which sets the store, or once record() raised.
        assert self.store is not None
        return self.store

    def finish(self, timeout: float | None = None) -> None:
        """Stop, wait (at most `timeout` on an error path) and raise what the thread raised."""
        self.stop.set()
        self._thread.join(timeout)
        self._raise()

    def _raise(self) -> None:
        if self.error is not None:
            err, self.error = self.error, None
            raise err
