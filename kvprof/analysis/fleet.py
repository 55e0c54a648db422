"""`kvprof report --parquet DIR`: the per-phase report across the sessions (and hosts) that
`kvprof export --parquet DIR --hive` wrote into one directory or bucket mount. Each session is
reported by correlate exactly as `kvprof report` reports it alone; the fleet's figures are the
sums of those reports (time, requests, bytes, busy time), and its rates and idle shares are
computed from the sums, so its totals are by construction the sum of its sessions' reports.
"""
from __future__ import annotations

from pathlib import Path
from typing import Literal

import duckdb

from kvprof import schema
from kvprof.analysis.correlate import MAIN_OPS, idle_pct, per_second, summarize
from kvprof.analysis.rowsource import SqlRows
from kvprof.errors import EX_NOINPUT, KvprofError
from kvprof.store.session import load_parquet, unreadable
from kvprof.summary import DEVICE_LAYERS, PhaseStats
from kvprof.units import human_bytes

LAYERS: tuple[Literal["block", "io_uring", "syscall"], ...] = (*DEVICE_LAYERS, "syscall")


def sessions(root: Path) -> list[tuple[str, str, str]]:
    """(host, date, session) of every session the directory holds."""
    part = root / "table=session"
    if not part.is_dir():
        raise KvprofError(f"no kvprof fleet export at {root} (expected {part}/; write one with "
                          "kvprof export SESSION --parquet DIR --hive)", EX_NOINPUT)
    glob = "'" + str(part / "**" / "*.parquet").replace("'", "''") + "'"
    try:
        con = duckdb.connect(":memory:")
        try:
            rows = con.execute(f"""
                SELECT DISTINCT host::VARCHAR, date::VARCHAR, session::VARCHAR
                FROM read_parquet({glob}, hive_partitioning = true, union_by_name = true)
                ORDER BY ALL""").fetchall()
        finally:
            con.close()
    except duckdb.Error as e:
        raise unreadable(e, f"{root}: not a readable kvprof fleet export") from None
    return [tuple(r) for r in rows]


def _empty() -> dict:
    return {"time_s": 0.0, "busy_s": 0.0, **{
        layer: {op: {"ios": 0, "bytes": 0} for op in MAIN_OPS} for layer in LAYERS}}


def _add(acc: dict, ph: PhaseStats) -> None:
    acc["time_s"] += ph["time_s"]
    idle = ph["block"]["time_idle_pct"]
    if idle is not None:
        acc["busy_s"] += ph["time_s"] * (1 - idle / 100)
    for layer in LAYERS:
        for op in MAIN_OPS:
            acc[layer][op]["ios"] += ph[layer][op]["ios"]
            acc[layer][op]["bytes"] += ph[layer][op]["bytes"]


def _rates(acc: dict) -> None:
    t = acc["time_s"]
    acc["time_idle_pct"] = idle_pct(acc["busy_s"], t)
    for layer in LAYERS:
        for e in acc[layer].values():
            e["bandwidth_bytes_per_s"] = per_second(e["bytes"], t)
            e["iops"] = per_second(e["ios"], t)


def fleet_summary(root: str | Path) -> dict:
    root = Path(root)
    found = sessions(root)
    phases = {p: _empty() for p in schema.PHASES}
    hosts: dict[str, dict] = {}
    listed = []
    for host, date, sid in found:
        files = {t: root / f"table={t}" / f"host={host}" / f"date={date}" / f"session={sid}"
                 / "data.parquet" for t in schema.TABLES}
        what = f"{root}: session {sid} of {host} is not readable"
        con = load_parquet(files, what)
        try:
            summary = summarize(SqlRows(con))
        except duckdb.Error as e:
            raise unreadable(e, what) from None
        finally:
            con.close()
        listed.append({"host": host, "date": date, "session": sid,
                       "duration_s": summary["session"]["duration_s"],
                       "lost_events": summary["session"]["lost_events"]})
        per_host = hosts.setdefault(host, {"sessions": 0, "duration_s": 0.0,
                                           "phases": {p: _empty() for p in schema.PHASES}})
        per_host["sessions"] += 1
        per_host["duration_s"] += summary["session"]["duration_s"]
        for p in schema.PHASES:
            _add(phases[p], summary["phases"][p])
            _add(per_host["phases"][p], summary["phases"][p])
    total = sum(ph["time_s"] for ph in phases.values())
    for p, acc in phases.items():
        _rates(acc)
        acc["time_share_pct"] = 100 * acc["time_s"] / total if total > 0 else 0.0
    for h in hosts.values():
        for acc in h["phases"].values():
            _rates(acc)
    return {"root": str(root), "sessions": listed, "hosts": hosts, "phases": phases}


def to_text(fleet: dict) -> str:
    hosts = fleet["hosts"]
    lines = [f"kvprof fleet report {fleet['root']}",
             f"{len(fleet['sessions'])} sessions on {len(hosts)} hosts: "
             + ", ".join(f"{h} ({v['sessions']})" for h, v in sorted(hosts.items())), "",
             f"{'phase':<9}{'time':>10}{'share':>8}{'idle':>8}{'read':>11}{'MiB/s':>9}"
             f"{'write':>11}{'MiB/s':>9}"]
    for p in schema.PHASES:
        ph = fleet["phases"][p]
        rd, wr = ph["block"]["read"], ph["block"]["write"]
        idle = "-" if ph["time_idle_pct"] is None else f"{ph['time_idle_pct']:.1f}%"
        lines.append(f"{p:<9}{ph['time_s']:>9.1f}s{ph['time_share_pct']:>7.1f}%{idle:>8}"
                     f"{human_bytes(rd['bytes']):>11}{rd['bandwidth_bytes_per_s'] / 2**20:>9.1f}"
                     f"{human_bytes(wr['bytes']):>11}{wr['bandwidth_bytes_per_s'] / 2**20:>9.1f}")
    lines += ["", "per host (block layer, bytes read / written per phase):"]
    for h, v in sorted(hosts.items()):
        parts = [f"{p} {human_bytes(v['phases'][p]['block']['read']['bytes'])}/"
                 f"{human_bytes(v['phases'][p]['block']['write']['bytes'])}"
                 for p in schema.PHASES if v["phases"][p]["time_s"] > 0]
        lines.append(f"  {h}: " + ", ".join(parts))
    return "\n".join(lines) + "\n"
