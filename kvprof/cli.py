"""kvprof command line. `main(argv) -> int` so tests can call it without a subprocess."""
from __future__ import annotations

import argparse
import json
import os
import sys
from functools import partial
from pathlib import Path

# Threads that libraries start when imported would keep the privileges the recorder drops
# once attached (they are per thread: kvprof.privileges). A command line run starts none:
# one BLAS thread is plenty here, and jemalloc purges without its background thread.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
os.environ.setdefault("JE_ARROW_MALLOC_CONF", "background_thread:false")

from kvprof import __version__  # noqa: E402 - after the environment above
from kvprof import layers as layer_table
from kvprof import phase_sources
from kvprof.calibration import BY_NAME as PATTERNS
from kvprof.errors import EX_NOPERM, EX_SOFTWARE, EX_USAGE, KvprofError

EXAMPLES = """examples:
  sudo kvprof demo                       # built-in KV-offload workload on a private loop device
  sudo kvprof record -d nvme0n1          # trace nvme0n1 until Ctrl-C, marks on the default socket
  sudo kvprof record -d /dev/loop3 -p 4242 --duration 60 -o run1
  kvprof mark prefill                    # from a shell: from now on, prefill
  kvprof report run1                     # per-phase storage numbers
  kvprof report run1 --json              # the same, for scripts
  kvprof export run1 --parquet run1-pq   # one Parquet file per table
  kvprof doctor                          # what live capture needs, and the fix for each part
"""


COMPARE_EXAMPLES = """figures (gate names): PHASE.OP.bandwidth|iops|p50|p99 (PHASE prefill,
decode, mixed, idle; OP read, write), PHASE.time_share|time_idle|capacity_idle|tokens_per_s,
and the engine's ttft, itl, throughput, prefix_hit

examples:
  kvprof compare before after
  kvprof compare before after --gate ttft=-25% --gate prefill.write.bandwidth=+30%
  kvprof compare before after --json
exit status: 0, or 1 when a gate failed
"""


def source_usage(kind) -> str:
    """How --phases names a source: kind, or kind=TARGET."""
    return f"{kind.kind}={kind.target}" if kind.target else kind.kind


def descriptor_help() -> str:
    """What `kvprof record -h` says of each layer and phase source, one line each."""
    lines = ["layers (--layer):"]
    lines += [f"  {x.name:<10}{x.help}" for x in layer_table.LAYERS]
    lines.append("phase sources (--phases):")
    lines += [f"  {source_usage(k):<25}{k.help}" for k in phase_sources.PHASE_SOURCES]
    return "\n".join(lines) + "\n"


def _record_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("-o", "--output", help="session directory (default: ./kvprof-DATE-TIME)")
    p.add_argument("-d", "--device", action="append", default=[],
                   help="block device name (nvme0n1, loop3) or path (/dev/loop3); repeatable")
    p.add_argument("-p", "--pid", action="append", type=int, default=[],
                   help="trace only this process and its threads; repeatable")
    p.add_argument("--cgroup", action="append", default=[],
                   help="trace only tasks in this cgroup v2 (path under /sys/fs/cgroup)")
    p.add_argument("--layer", action="append", choices=[x.name for x in layer_table.LAYERS],
                   metavar="LAYER",
                   help="capture only these layers, repeatable (see below; default: "
                        + " and ".join(layer_table.DEVICE_NAMES) + "; with -p or --cgroup "
                        "also the processes' file syscalls, TCP bytes, and cuFile calls where "
                        "libcufile is installed)")
    p.add_argument("--duration", type=float, help="stop after this many seconds")
    p.add_argument("--max-size", type=_size, metavar="SIZE",
                   help="end the recording cleanly once the session takes this much disk "
                        "(e.g. 500M, 20G)")
    p.add_argument("--event-rate", type=_count, default=50_000, metavar="N",
                   help="block and io_uring rows a second kept before the event tier samples "
                        "(1 in 2, 4, ...; every request is still counted exactly); 0: keep "
                        "every one (default: 50000)")
    p.add_argument("--settle", type=_seconds, default=5, metavar="SECONDS",
                   help="how long the exact counts wait for the phase sources' windows "
                        "before a second is folded for good and published on --prometheus "
                        "(default: 5; at least 2)")
    p.add_argument("--socket", help="marker socket path (default: $KVPROF_SOCKET or "
                                    "/run/kvprof/marks.sock)")
    p.add_argument("--socket-mode", type=_mode, default=0o660, metavar="MODE",
                   help="the marker socket's permissions, octal (default 0660: its owner and "
                        "group only; 0666 lets every local user steer the session)")
    p.add_argument("--socket-group", metavar="GROUP",
                   help="the marker socket's group: the serving engine's, when it runs as "
                        "another user (default: the recorder's)")
    p.add_argument("--allow-sender", action="append", default=[], metavar="USER",
                   help="take marks only from this user (name or uid; repeatable; root "
                        "always): the kernel vouches for each sender")
    p.add_argument("--keep-privileges", action="store_true",
                   help="keep every privilege while recording (default: once the probes are "
                        "attached, drop all but CAP_SYS_PTRACE and CAP_DAC_READ_SEARCH, which "
                        "the syscall layer's file names need)")
    p.add_argument("--phases", dest="phase_sources", action="append", default=[],
                   metavar="SOURCE[=TARGET]",
                   help="phase source, repeatable (see below; default: auto; marks are "
                        "always received)")
    p.add_argument("--cache", dest="caches", action="append", default=[], metavar="NAME=GLOB",
                   help="label files whose path matches GLOB as KV cache NAME (repeatable; "
                        "before the built-in lmcache-disk, vllm-fs-tier, vllm-disk-offload, "
                        "sglang-hicache rules)")
    p.add_argument("--prometheus", metavar="[ADDR:]PORT",
                   help="serve the exact per-phase totals as Prometheus metrics on this port "
                        "(/metrics; all addresses unless ADDR is given, e.g. 127.0.0.1:9464)")
    p.add_argument("--ebpf", action="store_true", help=argparse.SUPPRESS)
    # The layers and phase sources, one line each, from their descriptors.
    p.epilog = descriptor_help() + "\n" + (p.epilog or "")


TOP_EXAMPLES = """examples:
  sudo kvprof top -d nvme0n1             # record nvme0n1 and watch it live
  kvprof top --replay run1               # replay a session: space plays, arrows scrub
  kvprof top --replay run1-pq            # ... or its Parquet export
keys: space pause/play, w window (10 s/60 s/session), d device, p process,
      e export Parquet, left/right scrub, +/- speed, ? help, q quit
"""


def _size(text: str) -> int:
    """A size for --max-size: bytes, or a number with K, M, G or T (powers of 1024)."""
    units = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
    t = text.strip().upper().removesuffix("B").removesuffix("I")
    num, unit = (t[:-1], t[-1]) if t and t[-1] in units else (t, "")
    try:
        value = float(num) * units[unit]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 500M, 20G)") from None
    if value < 1 << 20:
        raise argparse.ArgumentTypeError(f"{text!r} is below 1M, too small for a session")
    return int(value)


def _layers(args) -> tuple[str, ...]:
    """--layer as given; by default the device layers, and the file syscalls of the selected
    processes (system-wide, every read and write of every process would be traced)."""
    from kvprof import system

    if args.layer:
        return tuple(dict.fromkeys(args.layer))
    from kvprof.capture.gds import find_cufile

    layers = list(layer_table.DEVICE_NAMES)
    if args.pid or args.cgroup:
        # The process layers this kernel has the tracepoints for; gds attaches to libcufile
        # instead, where it is installed.
        layers += [x.name for x in layer_table.LAYERS if not x.device and x.tracepoints
                   and all(system.tracepoint_available(t) for t in x.tracepoints)]
        if find_cufile():
            layers.append(layer_table.GDS.name)
    return tuple(layers)


def _mixed_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--mixed", choices=("apart", "split"), default="apart",
                   help="mixed engine steps (chunked prefill): their own phase (apart, the "
                        "default), or each mixed window cut into prefill and decode by its "
                        "token share (split)")


def _mode(text: str) -> int:
    try:
        mode = int(text, 8)
    except ValueError:
        mode = -1
    if not 0 <= mode <= 0o777:
        raise argparse.ArgumentTypeError(f"not an octal mode: {text!r}")
    return mode


def _int_at_least(minimum: int, what: str):
    def parse(text: str) -> int:
        try:
            n = int(text)
        except ValueError:
            n = minimum - 1
        if n < minimum:
            raise argparse.ArgumentTypeError(f"not {what}: {text!r}")
        return n
    return parse


_count = _int_at_least(0, "a count")
_seconds = _int_at_least(2, "a whole number of seconds >= 2")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvprof", description="What storage does during LLM prefill and decode.",
        epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"kvprof {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    p = sub.add_parser("record", help="trace storage I/O and phase marks into a session",
                       epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    _record_args(p)
    p.add_argument("--roll", type=_size, metavar="SIZE",
                   help="go on in a new segment file of the session once the current one "
                        "takes SIZE on disk; with --max-size the oldest segments are then "
                        "deleted to stay under it instead of ending (left attached with "
                        "bounded disk)")
    p.add_argument("--no-events", dest="events", action="store_false",
                   help="no per-I/O rows for the block and io_uring layers: only their exact "
                        "in-kernel counts and histograms per second and phase (the cheapest "
                        "way to stay attached)")

    p = sub.add_parser("top", help="live dashboard while recording (same options as record),"
                                   " or --replay a recorded session",
                       epilog=TOP_EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    _record_args(p)
    p.add_argument("--replay", metavar="SESSION",
                   help="show a recorded session (directory, .duckdb file or Parquet export) "
                        "instead of recording")
    p.add_argument("--interval", type=float, default=0.5, help="refresh interval in seconds")

    p = sub.add_parser("report", help="per-phase storage numbers of a recorded session (or of "
                                      "a fleet's export: --parquet DIR)")
    p.add_argument("session", nargs="?", help="session directory (or its session.duckdb)")
    p.add_argument("--parquet", metavar="DIR",
                   help="report across every session (and host) exported into DIR with "
                        "kvprof export --hive")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--html", metavar="FILE",
                   help="write the visual report (timeline, histograms, idle, findings) as one "
                        "self-contained HTML file instead")
    _mixed_arg(p)

    p = sub.add_parser("compare", help="two sessions' per-phase figures side by side, with "
                                       "gates that fail a test pipeline",
                       epilog=COMPARE_EXAMPLES,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("a", help="the baseline session")
    p.add_argument("b", help="the session compared with it")
    p.add_argument("--gate", action="append", default=[], metavar="NAME=+N%",
                   help="fail (exit 1) unless B changed NAME by at least this much: +N%% up, "
                        "-N%% down; repeatable")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--html", metavar="FILE",
                   help="also write both sessions side by side as one self-contained HTML file")
    _mixed_arg(p)

    p = sub.add_parser("export", help="write a session's tables as Parquet")
    p.add_argument("session")
    p.add_argument("--parquet", required=True, metavar="DIR", help="output directory")
    p.add_argument("--hive", action="store_true",
                   help="fleet layout: DIR/table=T/host=H/date=D/session=S/data.parquet, for "
                        "many hosts writing into one directory or bucket")
    p.add_argument("--host", help="the host name to file the session under (default: the "
                                  "recording host's)")

    p = sub.add_parser("mark", help="send a phase mark to a running recorder")
    p.add_argument("phase", choices=("prefill", "decode", "mixed", "idle"))
    p.add_argument("--engine", default="", help="engine / instance name")
    p.add_argument("--socket", help="marker socket path")
    p.add_argument("--prefill-tokens", type=int)
    p.add_argument("--decode-tokens", type=int)

    sub.add_parser("doctor", help="check what live capture needs, with the fix for each")

    p = sub.add_parser("calibrate", help="measure what a device (or the one under a directory) "
                                         "can do for prefill- and decode-like I/O, kept for "
                                         "reports' capacity idle")
    p.add_argument("target", help="a directory (a scratch file is written there and deleted) "
                                  "or a block device (written to: refused if it holds data)")
    p.add_argument("--runtime", type=float, default=5.0, help="seconds per pattern (default 5)")
    p.add_argument("--size", type=_size, default=1 << 30, metavar="SIZE",
                   help="bytes the I/O spreads over (default 1G)")
    p.add_argument("--pattern", action="append", default=[], metavar="NAME",
                   help="run only this pattern (repeatable): " + ", ".join(PATTERNS))
    p.add_argument("--force", action="store_true",
                   help="write to a raw device even though it holds a filesystem or data")
    p.add_argument("--json", action="store_true", help="print the result as JSON")

    p = sub.add_parser("demo", help="run a small KV-offload workload on a private loop device, "
                                    "record it and report")
    p.add_argument("--seconds", type=float, default=6.0, help="length of the workload")
    p.add_argument("-o", "--output", help="keep the session in this directory")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("--no-tui", action="store_true",
                   help="print the report only (the default when stdout is not a terminal)")
    return parser


def cmd_record(args) -> int:
    from kvprof.record import RecordOptions, record, resolve_filters

    opts = RecordOptions(out=args.output, devices=args.device, pids=args.pid,
                         cgroups=args.cgroup, layers=_layers(args),
                         duration_s=args.duration, socket=args.socket, phases=args.phase_sources,
                         caches=args.caches, events=args.events, max_size=args.max_size,
                         event_rate=args.event_rate, roll=args.roll,
                         settle_s=args.settle,
                         prometheus=args.prometheus, socket_mode=args.socket_mode,
                         socket_group=args.socket_group, allow_senders=args.allow_sender,
                         drop_privileges=not args.keep_privileges)
    if args.ebpf:
        from kvprof.capture.ebpf import build_program

        prog = build_program(opts.layers, resolve_filters(opts), device_events=opts.events)
        print("// cflags: " + " ".join(prog.cflags))
        print(prog.text)
        return 0
    record(opts)
    return 0


def cmd_top(args) -> int:
    from kvprof.top import run_live, run_replay

    if args.interval <= 0:
        raise KvprofError("--interval must be positive", EX_USAGE)
    if args.replay:
        return run_replay(args.replay, interval_s=args.interval)
    from kvprof import system

    system.require_privilege()  # one line and exit 77 before any screen, like record
    if not sys.stdout.isatty():
        raise KvprofError("kvprof top needs a terminal; use kvprof record for a script",
                          EX_USAGE)
    from kvprof.record import RecordOptions

    opts = RecordOptions(out=args.output, devices=args.device, pids=args.pid,
                         cgroups=args.cgroup, layers=_layers(args),
                         duration_s=args.duration, socket=args.socket, phases=args.phase_sources,
                         caches=args.caches, max_size=args.max_size,
                         event_rate=args.event_rate, prometheus=args.prometheus,
                         settle_s=args.settle,
                         socket_mode=args.socket_mode, socket_group=args.socket_group,
                         allow_senders=args.allow_sender,
                         drop_privileges=not args.keep_privileges)
    return run_live(opts, interval_s=args.interval)


def load_summary(session: str | Path, with_timeline: bool = False, mixed: str = "apart"):
    """The report of a recorded session, as a dict; with its timeline for the visual report:
    (summary, timeline)."""
    import duckdb

    from kvprof.correlate import summarize, timeline
    from kvprof.rowsource import SqlRows
    from kvprof.store import open_session, unreadable

    con = open_session(session)
    try:
        rows = SqlRows(con)
        summary = summarize(rows, mixed=mixed)
        return (summary, timeline(rows, mixed=mixed)) if with_timeline else summary
    except duckdb.Error as e:
        # Opened, but its data is damaged (a file cut short, a disk error).
        raise unreadable(e, f"{session}: the session's data is damaged") from None
    finally:
        con.close()


def write_html(path: str, text: str) -> None:
    try:
        Path(path).write_text(text)
    except OSError as e:
        raise KvprofError(f"cannot write {path}: {e.strerror}", EX_USAGE) from None
    print(f"kvprof: wrote {path} ({len(text) >> 10} KiB, opens with no network)",
          file=sys.stderr)


def print_report(session: str | Path, name: str, as_json: bool, mixed: str = "apart") -> None:
    """The per-phase report of a recorded session on stdout: `kvprof report` and the demo."""
    from kvprof.report import to_json, to_text

    summary = load_summary(session, mixed=mixed)
    sys.stdout.write(to_json(summary) + "\n" if as_json else to_text(summary, name))
    sys.stdout.flush()


def cmd_report(args) -> int:
    if args.parquet:
        from kvprof import fleet

        if args.session or args.html:
            raise KvprofError("report --parquet DIR reports a fleet export: no SESSION, no "
                              "--html", EX_USAGE)
        summary = fleet.fleet_summary(args.parquet)
        sys.stdout.write(json.dumps(summary, indent=2) + "\n" if args.json
                         else fleet.to_text(summary))
        return 0
    if not args.session:
        raise KvprofError("report needs a SESSION (or --parquet DIR)", EX_USAGE)
    if args.html:
        from kvprof.htmlreport import report_html

        summary, timeline = load_summary(args.session, with_timeline=True, mixed=args.mixed)
        write_html(args.html, report_html(summary, timeline, args.session))
        return 0
    print_report(args.session, args.session, args.json, args.mixed)
    return 0


def cmd_compare(args) -> int:
    from kvprof import compare

    gates = [compare.parse_gate(g) for g in args.gate]
    timelines: tuple[dict, dict] | None = None  # loaded only for --html
    if args.html:
        (a, ta), (b, tb) = (load_summary(s, True, args.mixed) for s in (args.a, args.b))
        timelines = (ta, tb)
    else:
        a, b = (load_summary(s, mixed=args.mixed) for s in (args.a, args.b))
    result = compare.compare(a, b, gates)
    if timelines is not None:
        from kvprof.htmlreport import compare_html

        write_html(args.html, compare_html(result, a, b, timelines, (args.a, args.b)))
    sys.stdout.write(json.dumps(result, indent=2) + "\n" if args.json else
                     compare.to_text(result, args.a, args.b))
    sys.stdout.flush()
    return 0 if result["passed"] else 1


def cmd_export(args) -> int:
    from kvprof.export import export_parquet
    from kvprof.store import open_session, unreadable

    if args.host and not args.hive:
        raise KvprofError("--host files a session in the fleet layout: add --hive", EX_USAGE)
    import duckdb

    con = open_session(args.session)
    try:
        for path in export_parquet(con, args.parquet, hive=args.hive, host=args.host):
            print(path)
    except duckdb.Error as e:
        raise unreadable(e, f"{args.session}: the session's data is damaged") from None
    finally:
        con.close()
    return 0


def cmd_mark(args) -> int:
    from kvprof.markers import Marker

    import errno

    m = Marker(args.socket, engine=args.engine)
    if not m.mark(args.phase, prefill_tokens=args.prefill_tokens,
                  decode_tokens=args.decode_tokens):
        if m.last_error in (errno.EACCES, errno.EPERM):
            raise KvprofError(f"permission denied on the marker socket {m.path} (the recorder's "
                              "--socket-group or --socket-mode decides who may send)",
                              EX_NOPERM)
        # A shell script should learn that nobody listened, without failing hard.
        print(f"kvprof: no recorder listening on {m.path}", file=sys.stderr)
        return 1
    return 0


def cmd_calibrate(args) -> int:
    from kvprof import calibrate, calibration

    unknown = [n for n in args.pattern if n not in PATTERNS]
    if unknown:
        raise KvprofError(f"unknown pattern {unknown[0]!r}; patterns: " + ", ".join(PATTERNS),
                          EX_USAGE)
    if args.runtime <= 0:
        raise KvprofError("--runtime must be positive", EX_USAGE)
    result = calibrate.calibrate(args.target, args.runtime, args.size, args.force,
                                 tuple(args.pattern))
    path = calibration.save(result)
    if args.json:
        print(json.dumps(result, indent=2))
    print(f"kvprof: kept for {result['key']} in {path}" if path else
          "kvprof: not kept: the target has no block device of its own", file=sys.stderr)
    return 0


def cmd_doctor(args) -> int:
    from kvprof.doctor import run_doctor

    return run_doctor()


def cmd_demo(args) -> int:
    from kvprof.demo import run_demo

    # The dashboard only on a terminal: scripts and tests keep getting the printed report.
    tui = not (args.no_tui or args.json) and sys.stdout.isatty() and sys.stdin.isatty()
    # The demo gets the report from here: the CLI is the top layer, nothing imports it.
    return run_demo(seconds=args.seconds, out=args.output, tui=tui,
                    report=partial(print_report, as_json=args.json))


COMMANDS = {"record": cmd_record, "top": cmd_top, "report": cmd_report, "compare": cmd_compare,
            "export": cmd_export, "mark": cmd_mark, "doctor": cmd_doctor,
            "calibrate": cmd_calibrate, "demo": cmd_demo}


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not args.command:
        parser.print_help()
        return EX_USAGE
    try:
        return COMMANDS[args.command](args)
    except KvprofError as e:
        print(f"kvprof: error: {e}", file=sys.stderr)
        if e.hint:
            print(f"kvprof: hint: {e.hint}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        return 0
    except Exception as e:  # noqa: BLE001 - last line of defence: one line, never a traceback
        if os.environ.get("KVPROF_DEBUG"):
            raise
        first = (str(e).splitlines() or [""])[0]
        print(f"kvprof: internal error: {type(e).__name__}: {first} "
              "(set KVPROF_DEBUG=1 for the traceback)", file=sys.stderr)
        return EX_SOFTWARE
