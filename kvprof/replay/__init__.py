"""Replay (docs/replay.md): a recorded session's I/O issued again on candidate storage at its
recorded times, while a new session records it there with the recording's phase windows.
plan (Plan, FilePlan) -> gate (the phases' order) -> issue (threads, `child`) -> stats -> run.

Not fio: fio 3.33 replaying an iolog spins a core per job waiting for each line's time (the
CPU the candidate's I/O needs), and through one asynchronous queue leaves up to its depth - 1
requests unissued while counting them done."""
