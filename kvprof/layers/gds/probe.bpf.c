/* gds: calls into cuFile (GPUDirect Storage) seen at libcufile's USDT probes: reads and
 * writes done by DMA between storage and GPU memory (cufio_gds_*), and those cuFile served
 * through POSIX I/O and a bounce buffer instead (cufio_px_*: compat mode, which the syscall
 * layer sees as file I/O too). One row per call; the probes' arguments are not read: their
 * layout is not documented, so bytes stay 0 rather than a guess. x86_64 builds of
 * libcufile carry these probes; some aarch64 builds carry none. */
#include "../kvprof.h"
#include "../lib/task.h"
#include "../lib/ring.h"

/* Which probe, by the code in kvprof_io.opcode (capture.gds.PROBES). */
static __always_inline int gds_call(u8 op, u8 probe)
{
    struct kvprof_io e = {};
    if (!kvprof_task_row(&e))
        return 0;
    e.op = op;
    e.opcode = probe;
    e.layer = KVPROF_LAYER_GDS;
    kvprof_emit(&e);
    return 0;
}

int kvprof_gds_read(struct pt_regs *ctx) { return gds_call(KVPROF_OP_READ, 0); }
int kvprof_gds_write(struct pt_regs *ctx) { return gds_call(KVPROF_OP_WRITE, 1); }
int kvprof_px_read(struct pt_regs *ctx) { return gds_call(KVPROF_OP_READ, 2); }
int kvprof_px_write(struct pt_regs *ctx) { return gds_call(KVPROF_OP_WRITE, 3); }
int kvprof_gds_read_async(struct pt_regs *ctx) { return gds_call(KVPROF_OP_READ, 4); }
int kvprof_gds_write_async(struct pt_regs *ctx) { return gds_call(KVPROF_OP_WRITE, 5); }
