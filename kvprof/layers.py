"""The capture layers, one descriptor each: what a layer is made of, written in one place.

A layer's probe file, the tracepoints it attaches, the kernel struct fields it reads, the
privileges it keeps and its CLI help are read from here by schema (`LAYERS`,
`DEVICE_LAYERS`), system (`TRACEPOINTS`), capture/btf (`TRACEPOINTS`, `FIELDS`, `ENUMS`),
privileges (`needed`), capture/ebpf (`PROBE_FILES`, the layer codes) and the CLI
(`--layer`). Adding a layer is a probe file, its code in probes/kvprof.h and a descriptor
here; tests/unit/test_descriptors.py fails until the three agree.

Only the standard library is imported, so that everything down to schema can read it.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Layer:
    name: str
    # The `layer` byte the probes write (KVPROF_LAYER_<NAME> in probes/kvprof.h) and the
    # index into schema.LAYERS: one number, so that both decode the same.
    code: int
    probe: str  # file under probes/
    help: str  # one line for `kvprof record -h`, beside the name: 68 columns at most
    # Sees each device byte once. The others repeat (io_uring asks, block carries out) or
    # precede (a syscall's bytes may never reach a device) block requests, so device
    # totals add only these; they are also on by default, the process layers opt-in.
    device: bool
    # "group/name": every tracepoint the probe attaches whenever the layer runs; a kernel
    # without one of them cannot run the layer (system.check_tracepoints says which).
    tracepoints: tuple[str, ...] = ()
    # Attached only where the kernel has them or another layer runs too (#ifdef'd in the
    # probe): the layer works without them.
    optional_tracepoints: tuple[str, ...] = ()
    # Of `tracepoints`, the raw ones: name -> the C types of the arguments the probe reads,
    # compared with the running kernel's BTF before loading (capture/btf.py).
    raw_args: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    # -D name -> (struct, member) whose byte offset the probe needs, from the kernel's BTF.
    fields: Mapping[str, tuple[str, str]] = field(default_factory=dict)
    # -D name -> (enum, enumerator) whose value the probe needs, from the kernel's BTF.
    enums: Mapping[str, tuple[str, str]] = field(default_factory=dict)
    # Capabilities (their kernel names) the recorder keeps after attaching, for this layer.
    privileges: tuple[str, ...] = ()


# Rows a second of the device layers (block, io_uring) the event tier keeps by default before
# it samples (record --event-rate). The aggregate tier counts every request whatever this is;
# the rows are for percentiles and who issued what, which a sample of this many a second
# answers; more costs the recorder's Arrow and DuckDB work CPU at high IOPS (docs/performance.md).
DEVICE_EVENT_RATE = 10_000

_SYSCALLS = ("read", "pread64", "readv", "preadv", "preadv2", "write", "pwrite64", "writev",
             "pwritev", "pwritev2", "fsync", "fdatasync", "openat", "close", "dup", "dup2",
             "dup3", "fcntl")
_REQUEST = ("struct request *",)

BLOCK = Layer(
    "block", 0, "block.bpf.c", device=True,
    help="block requests on the traced devices, queue insert to completion",
    tracepoints=("block/block_rq_insert", "block/block_rq_issue", "block/block_rq_requeue",
                 "block/block_rq_complete"),
    raw_args={"block_rq_insert": _REQUEST, "block_rq_issue": _REQUEST,
              "block_rq_requeue": _REQUEST,
              "block_rq_complete": ("struct request *", "blk_status_t", "unsigned int")},
    fields={"KVPROF_RQ_Q": ("request", "q"), "KVPROF_RQ_CMD_FLAGS": ("request", "cmd_flags"),
            "KVPROF_RQ_DATA_LEN": ("request", "__data_len"),
            "KVPROF_RQ_SECTOR": ("request", "__sector"),
            "KVPROF_Q_DISK": ("request_queue", "disk"),
            "KVPROF_DISK_MAJOR": ("gendisk", "major"),
            "KVPROF_DISK_FIRST_MINOR": ("gendisk", "first_minor")},
    # block/blk_types.h: the op numbers and the cmd_flags bits; REQ_OP_BITS is where the
    # first flag bit starts.
    enums={"KVPROF_REQ_OP_BITS": ("req_flag_bits", "__REQ_FAILFAST_DEV"),
           "KVPROF_REQ_OP_READ": ("req_op", "REQ_OP_READ"),
           "KVPROF_REQ_OP_WRITE": ("req_op", "REQ_OP_WRITE"),
           "KVPROF_REQ_OP_FLUSH": ("req_op", "REQ_OP_FLUSH"),
           "KVPROF_REQ_OP_DISCARD": ("req_op", "REQ_OP_DISCARD"),
           "KVPROF_REQ_SYNC_BIT": ("req_flag_bits", "__REQ_SYNC"),
           "KVPROF_REQ_META_BIT": ("req_flag_bits", "__REQ_META"),
           "KVPROF_REQ_FUA_BIT": ("req_flag_bits", "__REQ_FUA"),
           "KVPROF_REQ_PREFLUSH_BIT": ("req_flag_bits", "__REQ_PREFLUSH"),
           "KVPROF_REQ_RAHEAD_BIT": ("req_flag_bits", "__REQ_RAHEAD")},
)
IO_URING = Layer(
    "io_uring", 1, "io_uring.bpf.c", device=True,
    help="io_uring requests, submission to completion",
    tracepoints=("io_uring/io_uring_create", "io_uring/io_uring_submit_req",
                 "io_uring/io_uring_complete"),
    raw_args={"io_uring_create": ("int", "void *", "u32", "u32", "u32"),
              "io_uring_submit_req": ("struct io_kiocb *",),
              "io_uring_complete": ("struct io_ring_ctx *", "void *", "struct io_uring_cqe *")},
    fields={"KVPROF_IOK_OPCODE": ("io_kiocb", "opcode"),
            "KVPROF_IOK_CTX": ("io_kiocb", "ctx"),
            "KVPROF_IOK_FILE": ("io_kiocb", "file"),
            "KVPROF_FILE_INODE": ("file", "f_inode"),
            "KVPROF_FILE_FLAGS": ("file", "f_flags"),
            "KVPROF_INODE_MODE": ("inode", "i_mode"),
            "KVPROF_CQE_RES": ("io_uring_cqe", "res")},
)
SYSCALL = Layer(
    "syscall", 2, "syscall.bpf.c", device=False,
    help="the traced processes' file syscalls, openat to close",
    # close is followed at its entry only: the file is forgotten whatever the call returns.
    tracepoints=tuple(f"syscalls/sys_{side}_{name}" for name in _SYSCALLS
                      for side in ("enter", "exit") if (side, name) != ("exit", "close")),
    # The page cache fills a read caused (where the kernel has the tracepoint), and the bios
    # flush threads submit while writing back an inode (only with the block layer).
    optional_tracepoints=("filemap/mm_filemap_add_to_page_cache",
                          "writeback/writeback_single_inode_start",
                          "writeback/writeback_single_inode", "block/block_bio_queue"),
    # Naming other users' files: reading their /proc/PID/fd links.
    privileges=("CAP_SYS_PTRACE", "CAP_DAC_READ_SEARCH"),
)
TCP = Layer(
    "tcp", 3, "tcp.bpf.c", device=False,
    help="the traced processes' TCP bytes, per peer",
    tracepoints=("sock/sock_send_length", "sock/sock_recv_length", "sock/inet_sock_set_state"),
)
# USDT probes in libcufile rather than tracepoints: attached where the library is found
# (capture/gds.py names them).
GDS = Layer(
    "gds", 4, "gds.bpf.c", device=False,
    help="the traced processes' cuFile (GPUDirect Storage) calls",
)

# Code order: the probes' layer byte indexes this.
LAYERS: tuple[Layer, ...] = (BLOCK, IO_URING, SYSCALL, TCP, GDS)
BY_NAME: dict[str, Layer] = {layer.name: layer for layer in LAYERS}
NAMES: tuple[str, ...] = tuple(BY_NAME)
DEVICE_NAMES: tuple[str, ...] = tuple(layer.name for layer in LAYERS if layer.device)
# Views index per-device-layer arrays by code, so the device layers come first.
assert NAMES[:len(DEVICE_NAMES)] == DEVICE_NAMES, "device layers first"
assert all(layer.code == i for i, layer in enumerate(LAYERS)), "code = index"
