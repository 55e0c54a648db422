"""The processes whose I/O a session recorded: command line, name and role, read from /proc
the first time each does I/O (a process that has exited by then keeps only its rows' comm)."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa

from kvprof import roles, schema


class ProcessTable:
    """New `process` rows for the tgids not seen before; used by the recorder's thread."""

    def __init__(self, proc: Path = Path("/proc")):
        self._proc = proc
        self._seen: set[int] = set()

    def rows(self, tgids: np.ndarray, now_ns: int) -> pa.Table | None:
        new = [int(t) for t in np.unique(tgids).tolist() if int(t) not in self._seen]
        if not new:
            return None
        out = []
        for tgid in new:
            self._seen.add(tgid)
            d = self._proc / str(tgid)
            try:
                cmdline = (d / "cmdline").read_bytes().replace(b"\0", b" ").strip()
                comm = (d / "comm").read_text().strip()
            except OSError:
                continue
            line = cmdline.decode(errors="replace")
            out.append({"tgid": tgid, "first_ns": now_ns, "comm": comm, "cmdline": line,
                        "role": roles.role(line)})
        return pa.Table.from_pylist(out, schema=schema.PROCESS) if out else None
