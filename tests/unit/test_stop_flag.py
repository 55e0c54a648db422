"""Ctrl-C (SIGINT) and SIGTERM end a recording at whatever moment they come.

The recorder's main thread spends its time in `stop.wait(FLUSH_INTERVAL_S)`, and a Python
signal handler runs in that same thread between two of its bytecodes. A handler that takes a
lock the interrupted code holds never returns: with a threading.Event as the flag, a signal
landing while Event.wait held the event's lock hung the recorder for good (seen once under
fio load; SIGTERM then hung too, its handler being the same). Here a signal is sent at every
line the wait executes, one after another, in a child process that is killed if it hangs.
"""
from __future__ import annotations

import subprocess
import sys
import textwrap

CHILD = textwrap.dedent("""
    import os, signal, sys
    from kvprof.recorder.stop import StopFlag

    def run(k):
        # A fresh flag with its handlers installed; SIGINT sent at the k-th event the tracer
        # sees inside one wait (k 0: never), then waited on as the recorder does.
        flag = StopFlag()
        flag.install()
        n = 0
        def tracer(frame, event, arg):
            nonlocal n
            n += 1
            if n == k:
                os.kill(os.getpid(), signal.SIGINT)
            return tracer
        sys.settrace(tracer)
        flag.wait(0.01)
        sys.settrace(None)
        while k and not flag.is_set():
            flag.wait(0.01)
        flag.restore()
        return n

    total = run(0)
    for k in range(1, total + 1):
        run(k)
    print(total)
""")


def test_a_signal_at_any_line_of_the_wait_stops_the_recording():
    try:
        got = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True,
                             timeout=60)
    except subprocess.TimeoutExpired:  # (run() kills the child)
        raise AssertionError("a signal during stop.wait() hung the process") from None
    assert got.returncode == 0, got.stderr
    assert int(got.stdout) >= 1  # the wait ran traced code, each line of it signalled


def test_the_flag_wakes_a_waiter_in_another_thread():
    import threading
    import time

    from kvprof.recorder.stop import StopFlag

    flag = StopFlag()
    woke: list[float] = []
    t = threading.Thread(target=lambda: woke.append(time.monotonic() if flag.wait(30) else 0))
    t.start()
    time.sleep(0.05)
    set_at = time.monotonic()
    flag.set()
    t.join(5)
    assert woke and woke[0] >= set_at and flag.is_set()
    flag.restore()
    assert flag.wait(0) and flag.wait(None)  # (closed: still set, never blocks)
