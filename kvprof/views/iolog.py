"""A recorded session's block requests as fio iologs (version 3), one file per phase and device,
to replay a phase's own I/O on other storage (`kvprof export SESSION --fio-iolog DIR`). Each
request is a line at its issue time, in µs from its file's first request (as fio reads version 3;
it waits for none after a line at time 0, so times start at 1), at its offset on the recorded
device. A phase's file holds the requests issued in its windows, so the gaps between them are
waits too. An empty write (an fsync's) is a `sync`; the device flushes after an fsync are its
own doing, not replayed, and are counted as left out."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import pyarrow as pa

HEADER = "fio version 3 iolog"
NS_PER_US = 1_000


@dataclass
class Written:
    """What `write_iologs` wrote: the files, and per (phase, device) the requests and bytes
    each holds; `left_out`: requests of no replayable kind, by op."""
    files: list[Path] = field(default_factory=list)
    requests: dict[tuple[str, str], tuple[int, int]] = field(default_factory=dict)
    left_out: dict[str, int] = field(default_factory=dict)


def _action(op: str, nbytes: int) -> str | None:
    if op == "read":
        return "read"
    if op == "write":
        return "write" if nbytes else "sync"
    if op == "discard":
        return "trim"
    return None


def write_iologs(requests: pa.Table, out: Path) -> Written:
    """One iolog per (phase, device) of `requests` (SqlRows.block_requests) into `out`,
    named PHASE.DEVICE.iolog."""
    out.mkdir(parents=True, exist_ok=True)
    done = Written()
    if requests.num_rows == 0:
        return done
    cols = {name: requests[name].to_pylist()
            for name in ("phase", "dev_name", "op", "offset", "bytes", "issue_ns")}
    offset, size, issue = cols["offset"], cols["bytes"], cols["issue_ns"]
    lines: dict[tuple[str, str], list[str]] = {}
    first: dict[tuple[str, str], int] = {}
    last: dict[tuple[str, str], int] = {}
    counts: dict[tuple[str, str], list[int]] = {}
    for i, (phase, dev, op) in enumerate(zip(cols["phase"], cols["dev_name"], cols["op"])):
        action = _action(op, int(size[i]))
        if action is None:
            done.left_out[op] = done.left_out.get(op, 0) + 1
            continue
        key = (phase, dev)
        t0 = first.setdefault(key, int(issue[i]))
        us = 1 + (int(issue[i]) - t0) // NS_PER_US
        last[key] = us
        path = f"/dev/{dev}"
        # (fio reads every action line as offset and length; a sync's are 0)
        at = 0 if action == "sync" else int(offset[i])
        lines.setdefault(key, []).append(f"{us} {path} {action} {at} {int(size[i])}")
        c = counts.setdefault(key, [0, 0])
        c[0] += 1
        c[1] += int(size[i])
    for key, body in sorted(lines.items()):
        phase, dev = key
        f = out / f"{phase}.{dev}.iolog"
        path = f"/dev/{dev}"
        f.write_text("\n".join([HEADER, f"1 {path} add", f"1 {path} open", *body,
                                f"{last[key]} {path} close"]) + "\n")
        done.files.append(f)
        done.requests[key] = (counts[key][0], counts[key][1])
    return done
