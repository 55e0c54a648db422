"""The phases' order in a replay: a phase starts once every call of the one before completed."""
from __future__ import annotations

import threading

import numpy as np

from kvprof.phases.replayed import UNKNOWN
from kvprof.replay.plan import due_offsets
from kvprof.schema import SLOT_NS


class Gate:
    """Where each phase piece of the replay starts on its clock (`edges`, shared with the
    recorder's ReplayedWindows), decided as the replay goes (`_advance`), and the replaying
    threads held to it, so that every request is issued inside the piece of the phase it was
    recorded in. The recording's time is cut where its phase changes (`bounds`: piece j runs
    from bounds[j - 1] to bounds[j]); `segment[k]`: call k's piece, in issue order. The threads
    of one process wait on one condition (a file replay's `edges` are a shared mapping, which
    its recorder reads). `shift`: see `due_in`."""

    def __init__(self, bounds: np.ndarray, segment: np.ndarray, edges: np.ndarray,
                 t0: int, speed: float, shift: bool = False) -> None:
        self.bounds = np.asarray(bounds, np.int64)
        self.edges = edges
        self.shift = shift
        self.left = np.bincount(np.asarray(segment, np.int64),
                                minlength=len(self.bounds) + 1).tolist()
        self.t0, self.speed = t0, speed
        self.aborted = False
        self._cond = threading.Condition()
        self._next = 1  # the first piece whose start is not decided
        self._latest = 0  # when the last call completed, of all completed so far
        self._due: list[int] = []

    def begin(self, start_ns: int) -> None:
        """The replay's first call is due at `start_ns`: the pieces up to the first with
        calls start when they were due."""
        self._start = start_ns
        self._due = [start_ns + d for d in due_offsets(self.bounds, self.t0, self.speed)]
        with self._cond:
            self._advance()

    def due_in(self, j: int, issue_ns: int) -> int:
        """When a call recorded at issue_ns, of piece j (whose start is decided), is due in a
        shifting replay (one that keeps each recorded thread's order): at its offset from the
        piece's start. There a piece is due its recorded length after the previous one started,
        not at its time on the recording's clock: a piece the candidate stretched moves every
        later one, as a step that waited longer for its loads moves the engine's next steps
        (ReplayedWindows maps the windows the same way: in_shifted_pieces, for many at once).
        In plain integers: the replaying threads ask it for every call."""
        if j == 0:
            return self._start + int((issue_ns - self.t0) / self.speed)
        began = int(self.bounds[j - 1]) if len(self.bounds) else self.t0
        return int(self.edges[j]) + int((issue_ns - began) / self.speed)

    def _advance(self) -> None:
        """Under the condition: decide the start of each next piece whose predecessors are all
        done. Piece j starts once every call of the pieces before it has completed (the only
        moment the replaying process knows the kernel has issued them) and not before it was
        due, so a piece the candidate is slow to serve stretches and the next starts where it
        ended. Where such a call completed within the issue slot (schema.SLOT_NS) the start falls
        in, it moves to the next slot, so the aggregate tier folds each request as events do."""
        while self._next < len(self.left) and self.left[self._next - 1] == 0:
            j = self._next
            due = (self.due_in(j - 1, int(self.bounds[j - 1])) if self.shift
                   else self._due[j - 1])
            at = max(due, int(self.edges[j - 1]), self._latest)
            if at % SLOT_NS and self._latest > at - at % SLOT_NS:
                at += SLOT_NS - at % SLOT_NS
            self.edges[j] = at
            self._next += 1
        self._cond.notify_all()

    def wait(self, j: int) -> int | None:
        """When piece j starts, once decided; None where the replay ended meanwhile."""
        edge = int(self.edges[j])
        if edge != UNKNOWN and not self.aborted:  # decided: once set, never changed
            return edge
        with self._cond:
            while self.edges[j] == UNKNOWN and not self.aborted:
                self._cond.wait()
            return None if self.aborted else int(self.edges[j])

    def done(self, j: int, at_ns: int) -> None:
        """A call of piece j completed at `at_ns`."""
        with self._cond:
            self._latest = max(self._latest, at_ns)
            self.left[j] -= 1
            if self.left[j] == 0 and j == self._next - 1:
                self._advance()

    def abort(self) -> None:
        with self._cond:
            self.aborted = True
            self._cond.notify_all()
