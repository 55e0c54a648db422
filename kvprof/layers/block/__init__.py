"""The block layer: every request on the traced devices, from the scheduler's insert (or the
issue, without a scheduler) to its completion, from the block_rq_* raw tracepoints."""
from __future__ import annotations

from kvprof.layers.layer import Layer

_REQUEST = ("struct request *",)

LAYER = Layer(
    "block", 0, device=True, default=True,
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
