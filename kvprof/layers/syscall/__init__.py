"""The syscall layer: the traced processes' file syscalls, from the openat that opened a file
to its close (the files are followed in kvprof/capture/files.py)."""
from __future__ import annotations

from kvprof.layers.layer import Layer

_SYSCALLS = ("read", "pread64", "readv", "preadv", "preadv2", "write", "pwrite64", "writev",
             "pwritev", "pwritev2", "fsync", "fdatasync", "openat", "close", "dup", "dup2",
             "dup3", "fcntl")

LAYER = Layer(
    "syscall", 2, device=False,
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
