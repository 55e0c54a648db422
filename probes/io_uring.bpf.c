/* io_uring: read/write requests from io_uring_submit_req to io_uring_complete, matched by
 * the request pointer (the kernel reuses it only after the completion is posted). */
#include "kvprof.h"

struct uring_start {
    u64 submit_ns;
    u64 ctx;
    u64 cgroup_id;
    u32 pid;
    u32 tgid;
    u8 opcode;
    u8 phase; /* kvprof's phase at submission (aggregate tier) */
    u8 pad[6];
    char comm[16];
};

BPF_TABLE("lru_hash", u64, struct uring_start, uring_start_map, KVPROF_START_ENTRIES);

/* IORING_OP_READV 1, WRITEV 2, READ_FIXED 4, WRITE_FIXED 5, READ 22, WRITE 23 (uapi numbers,
 * stable by ABI). */
static __always_inline u8 uring_op(u8 opcode)
{
    switch (opcode) {
    case 1: case 4: case 22: return KVPROF_OP_READ;
    case 2: case 5: case 23: return KVPROF_OP_WRITE;
    default: return KVPROF_OP_OTHER;
    }
}

TRACEPOINT_PROBE(io_uring, io_uring_submit_req)
{
    u8 opcode = args->opcode;
    if (uring_op(opcode) == KVPROF_OP_OTHER)
        return 0;
    u64 id = bpf_get_current_pid_tgid();
    u32 tgid = id >> 32;
    if (!kvprof_task_allowed(tgid))
        return 0;
    u64 key = (u64)args->req;
    if (uring_start_map.lookup(&key))
        kvprof_count(KVPROF_LOST_URING_NOT_SEEN); /* req reused: its completion was skipped */
    struct uring_start v = {};
    v.submit_ns = bpf_ktime_get_ns();
    v.ctx = (u64)args->ctx;
    v.cgroup_id = bpf_get_current_cgroup_id();
    v.pid = (u32)id;
    v.tgid = tgid;
    v.opcode = opcode;
    v.phase = kvprof_phase_now();
    bpf_get_current_comm(&v.comm, sizeof(v.comm));
    uring_start_map.update(&key, &v);
    return 0;
}

TRACEPOINT_PROBE(io_uring, io_uring_complete)
{
    u64 key = (u64)args->req;
    /* Completions of other opcodes (and of filtered tasks) have no entry by design, so a
     * miss is not counted as a loss here. */
    struct uring_start *v = uring_start_map.lookup(&key);
    if (!v)
        return 0;
    struct kvprof_io e = {};
    e.issue_ns = v->submit_ns;
    e.complete_ns = bpf_ktime_get_ns();
    e.cgroup_id = v->cgroup_id;
    e.ctx = v->ctx;
    int res = args->res;
    e.bytes = res > 0 ? res : 0;
    e.error = res < 0 ? res : 0;
    e.pid = v->pid;
    e.tgid = v->tgid;
    e.op = uring_op(v->opcode);
    e.opcode = v->opcode;
    e.layer = KVPROF_LAYER_IO_URING;
    __builtin_memcpy(e.comm, v->comm, sizeof(e.comm));
    u8 phase = v->phase;
    uring_start_map.delete(&key);
    kvprof_agg(KVPROF_LAYER_IO_URING, e.op, 0, phase, e.bytes, 0, e.complete_ns - e.issue_ns,
               e.complete_ns);
    kvprof_emit_device(&e);
    return 0;
}
