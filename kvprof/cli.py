"""kvprof command line. `main(argv) -> int` so tests can call it without a subprocess."""
from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable

# Threads that libraries start when imported would keep the privileges the recorder drops
# once attached (they are per thread: kvprof.privileges). A command line run starts none:
# one BLAS thread is plenty here, and jemalloc purges without its background thread.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
os.environ.setdefault("JE_ARROW_MALLOC_CONF", "background_thread:false")

from kvprof import __version__  # noqa: E402 - after the environment above
from kvprof import layers as layer_table
from kvprof.calibration import BY_NAME as PATTERNS
from kvprof.errors import EX_SOFTWARE, EX_USAGE, KvprofError
from kvprof.phases import registry as phase_registry

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
    lines += [f"  {source_usage(k):<25}{k.help}" for k in phase_registry.PHASE_SOURCES]
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
                        + " and ".join(layer_table.DEFAULT_NAMES) + "; with -p or --cgroup "
                        "also the processes' io_uring requests, file syscalls, TCP bytes, and "
                        "cuFile calls where libcufile is installed)")
    p.add_argument("--duration", type=float, help="stop after this many seconds")
    p.add_argument("--max-size", type=_size, metavar="SIZE",
                   help="end the recording cleanly once the session takes this much disk "
                        "(e.g. 500M, 20G)")
    p.add_argument("--event-rate", type=_count, default=layer_table.DEVICE_EVENT_RATE,
                   metavar="N",
                   help="block and io_uring rows a second kept before the event tier samples "
                        "(1 in 2, 4, ...; every request is still counted exactly); 0: keep "
                        f"every one (default: {layer_table.DEVICE_EVENT_RATE})")
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

    p = sub.add_parser("export", help="write a session's tables as Parquet, or its block "
                                      "requests as fio iologs")
    p.add_argument("session")
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument("--parquet", metavar="DIR", help="output directory")
    what.add_argument("--fio-iolog", metavar="DIR",
                      help="one fio iolog (version 3) per phase and device into DIR, to "
                           "replay with fio --read_iolog=FILE --replay_redirect=/dev/OTHER")
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

    p = sub.add_parser("replay", help="issue a recorded session's I/O again on candidate "
                                      "storage at its recorded times, recording a new session "
                                      "with the same phase windows")
    p.add_argument("session")
    p.add_argument("--on", required=True, metavar="DEVICE_OR_DIR",
                   help="the candidate: a directory (scratch files are written there and "
                        "deleted) or a block device (written to: refused if it holds data)")
    p.add_argument("--layer", choices=("block", "syscall"),
                   help="what to replay: the block requests, or the file calls (syscall "
                        "layer; on a directory). Default: the file calls on a directory where "
                        "the session has them, else the block requests")
    p.add_argument("--cache", action="append", default=[], metavar="NAME",
                   help="file calls: replay only this KV cache's files (repeatable; default: "
                        "the KV caches the session names, else every file)")
    p.add_argument("--phase", action="append", default=[], choices=("prefill", "decode",
                                                                     "mixed", "idle"),
                   help="replay only this phase's requests (repeatable; default: all)")
    p.add_argument("--speed", type=float, default=1.0,
                   help="arrivals this many times faster than recorded (default 1)")
    p.add_argument("--open-loop", action="store_true",
                   help="file calls: each at its recorded time, whether or not its thread's "
                        "call before it completed (default: each thread's calls in order, "
                        "each after the one before, as the engine's threads made them)")
    p.add_argument("-o", "--out", help="directory of the new session")
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


VERBS = ("record", "top", "report", "compare", "export", "mark", "doctor", "calibrate",
         "replay", "demo")


def command(verb: str) -> Callable[[argparse.Namespace], int]:
    """The verb's `run` (kvprof/commands/VERB.py), imported when run: `kvprof mark` loads
    neither pyarrow nor duckdb."""
    if verb == "record":
        from kvprof.commands import record
        return record.run
    if verb == "top":
        from kvprof.commands import top
        return top.run
    if verb == "report":
        from kvprof.commands import report
        return report.run
    if verb == "compare":
        from kvprof.commands import compare
        return compare.run
    if verb == "export":
        from kvprof.commands import export
        return export.run
    if verb == "mark":
        from kvprof.commands import mark
        return mark.run
    if verb == "doctor":
        from kvprof.commands import doctor
        return doctor.run
    if verb == "calibrate":
        from kvprof.commands import calibrate
        return calibrate.run
    if verb == "replay":
        from kvprof.commands import replay
        return replay.run
    if verb == "demo":
        from kvprof.commands import demo
        return demo.run
    raise KvprofError(f"no command {verb!r}", EX_USAGE)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not args.command:
        parser.print_help()
        return EX_USAGE
    try:
        return command(args.command)(args)
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
