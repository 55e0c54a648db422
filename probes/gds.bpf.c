/* gds: calls into cuFile (GPUDirect Storage) seen at libcufile's USDT probes: reads and
 * writes done by DMA between storage and GPU memory (cufio_gds_*), and those cuFile served
 * through POSIX I/O and a bounce buffer instead (cufio_px_*: compat mode, which the syscall
 * layer sees as file I/O too). One row per call; the probes' arguments are not read: their
 * layout is not documented, so bytes stay 0 rather than a guess. x86_64 builds of
 * libcufile carry these probes; some aarch64 builds carry none. */
#include "kvprof.h"

#ifndef KVPROF_SELF_TGID
#define KVPROF_SELF_TGID 0
#endif

/* Which probe, by the code in kvprof_io.opcode (capture.gds.PROBES). */
static __always_inline int gds_call(u8 op, u8 probe)
{
    u64 id = bpf_get_current_pid_tgid();
    u32 tgid = id >> 32;
    if (tgid == KVPROF_SELF_TGID || !kvprof_task_allowed(tgid))
        return 0;
    struct kvprof_io e = {};
    e.issue_ns = bpf_ktime_get_ns();
    e.complete_ns = e.issue_ns;
    e.pid = (u32)id;
    e.tgid = tgid;
    e.cgroup_id = bpf_get_current_cgroup_id();
    e.op = op;
    e.opcode = probe;
    e.layer = KVPROF_LAYER_GDS;
    bpf_get_current_comm(&e.comm, sizeof(e.comm));
    kvprof_emit(&e);
    return 0;
}

int kvprof_gds_read(struct pt_regs *ctx) { return gds_call(KVPROF_OP_READ, 0); }
int kvprof_gds_write(struct pt_regs *ctx) { return gds_call(KVPROF_OP_WRITE, 1); }
int kvprof_px_read(struct pt_regs *ctx) { return gds_call(KVPROF_OP_READ, 2); }
int kvprof_px_write(struct pt_regs *ctx) { return gds_call(KVPROF_OP_WRITE, 3); }
int kvprof_gds_read_async(struct pt_regs *ctx) { return gds_call(KVPROF_OP_READ, 4); }
int kvprof_gds_write_async(struct pt_regs *ctx) { return gds_call(KVPROF_OP_WRITE, 5); }
