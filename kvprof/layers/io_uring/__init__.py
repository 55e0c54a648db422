"""The io_uring layer: every io_uring request, from its submission to its completion."""
from __future__ import annotations

from kvprof.layers.layer import Layer

LAYER = Layer(
    "io_uring", 1, device=True,
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
