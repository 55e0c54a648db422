"""The recorder: one recording from attaching the probes to the session's last row.

options (what is asked) -> recorder (Recorder, record: open, flush, roll, finish, close),
which moves each flush through drain into the store, keeps room on disk through space and
stops on stop's flag; background runs it in a thread beside a view."""
