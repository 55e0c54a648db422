/* io_uring: read/write requests from io_uring_submit_req to io_uring_complete (raw
 * tracepoints), followed by the io_kiocb pointer in the in-flight table (the kernel reuses a
 * request only after its completion is posted). Field offsets come from the running kernel's
 * BTF (KVPROF_IOK_*, KVPROF_FILE_*, KVPROF_INODE_MODE, KVPROF_CQE_RES). */
#include "../kvprof.h"
#include "../lib/task.h"
#include "../lib/aggregate.h"
#include "../lib/inflight.h"
#include "../lib/sampling.h"
#include "../lib/fields.h"
#include <linux/fcntl.h> /* O_DIRECT, as this architecture numbers it */

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

/* The io_kiocb fields read at submission and at completion, each set in one read. */
#define IOK_SUB_LO KVPROF_MIN(KVPROF_IOK_OPCODE, KVPROF_IOK_CTX)
#define IOK_SUB_HI KVPROF_MAX(KVPROF_IOK_OPCODE + 1, KVPROF_IOK_CTX + 8)
#define IOK_END_LO KVPROF_MIN(KVPROF_IOK_OPCODE, KVPROF_IOK_FILE)
#define IOK_END_HI KVPROF_MAX(KVPROF_IOK_OPCODE + 1, KVPROF_IOK_FILE + 8)
#define FILE_LO KVPROF_MIN(KVPROF_FILE_INODE, KVPROF_FILE_FLAGS)
#define FILE_HI KVPROF_MAX(KVPROF_FILE_INODE + 8, KVPROF_FILE_FLAGS + 4)

#ifndef KVPROF_URING_ALL
/* A read or write to a raw block device opened O_DIRECT is, byte for byte, what the block
 * layer carries (no file system, no page cache between): by default the block layer counts
 * it and this layer leaves it, counting it in KVPROF_URING_ON_BLOCK, so that the same
 * requests are not paid for twice per I/O (`record --layer io_uring` traces them here too:
 * KVPROF_URING_ALL). The file is assigned only when the request is issued, after
 * io_uring_submit_req, so the verdict is taken at completion and kept per ring, with the
 * file and inode it was taken on: a ring whose requests went to such a device has its later
 * ones left at submission, and their completions only compare the file. One that went to
 * another file after all is found there: the ring is traced again from then on, and that
 * request is counted lost (KVPROF_LOST_URING_SKIPPED). */
struct uring_raw_val {
    u64 file;
    u64 inode;
};
BPF_TABLE("lru_hash", u64, struct uring_raw_val, uring_raw, 4096);

/* The ring each CPU last found in uring_raw, as the table stood then (`gen`): most requests
 * on a CPU come from one ring, and a per-CPU array read is a fraction of a hash lookup on
 * the CPU that submits. Every change to uring_raw moves uring_gen on, which voids every
 * CPU's copy (changes come with a ring's first completions and a ring's end, not per I/O). */
struct uring_seen {
    u64 ring;
    u64 gen;
    struct uring_raw_val v;
};
BPF_PERCPU_ARRAY(uring_last, struct uring_seen, 1);
BPF_ARRAY(uring_gen, u64, 1);

static __always_inline void raw_changed(void)
{
    int zero = 0;
    u64 *gen = uring_gen.lookup(&zero);
    if (gen)
        __sync_fetch_and_add(gen, 1);
}

/* Whether the ring's requests go to a raw block device; its file and inode in *out. */
static __always_inline int raw_ring(u64 ring, struct uring_raw_val *out)
{
    int zero = 0;
    u64 *gen = uring_gen.lookup(&zero);
    struct uring_seen *last = uring_last.lookup(&zero);
    if (!gen || !last)
        return 0;
    u64 g = *gen;
    if (last->ring == ring && last->gen == g) {
        *out = last->v;
        return 1;
    }
    struct uring_raw_val *v = uring_raw.lookup(&ring);
    if (!v)
        return 0;
    *out = *v;
    /* (the copy void while it is written: the completion's program may run nested in the
     * submission's on this CPU) */
    last->gen = (u64)-1;
    asm volatile("" ::: "memory");
    last->ring = ring;
    last->v = *v;
    asm volatile("" ::: "memory");
    last->gen = g;
    return 1;
}

/* The ring's requests go to a raw block device: `file`, its `inode`. */
static __always_inline void mark_raw(u64 ring, u64 file, u64 inode)
{
    struct uring_raw_val v = {file, inode};
    uring_raw.update(&ring, &v);
    raw_changed();
}

static __always_inline void unmark_raw(u64 ring)
{
    uring_raw.delete(&ring);
    raw_changed();
}

/* Whether `file` is a raw block device opened O_DIRECT; its inode in *inode. */
static __always_inline int raw_block_file(void *file, u64 *inode)
{
    *inode = 0;
    if (!file)
        return 0;
    KVPROF_SPAN(f, file, FILE_LO, FILE_HI);
    void *ino = KVPROF_AT(void *, f, FILE_LO, KVPROF_FILE_INODE);
    if (!ino)
        return 0;
    *inode = (u64)ino;
    u16 mode = KVPROF_FIELD(u16, ino, KVPROF_INODE_MODE);
    if ((mode & 0170000) != 0060000) /* S_IFMT, S_IFBLK: uapi numbers */
        return 0;
    return (KVPROF_AT(u32, f, FILE_LO, KVPROF_FILE_FLAGS) & O_DIRECT) != 0;
}
#endif

/* io_uring_create(int fd, void *ctx, u32 sq_entries, u32 cq_entries, u32 flags): a new
 * ring. It may sit at the address of a freed one whose requests went to a raw device (fio
 * running its jobs one after another: one request of the next ring's was skipped so and
 * counted lost, 1 run in 3 of tests/test_live_capture.py), so it is judged afresh rather
 * than on the old ring's verdict. */
RAW_TRACEPOINT_PROBE(io_uring_create)
{
#ifndef KVPROF_URING_ALL
    unmark_raw(ctx->args[1]);
#endif
    return 0;
}

/* io_uring_submit_req(struct io_kiocb *req). A request left to the block layer is told
 * apart first, before anything else is spent on it, its clock read included. */
RAW_TRACEPOINT_PROBE(io_uring_submit_req)
{
    void *req = (void *)ctx->args[0];
    KVPROF_SPAN(k, req, IOK_SUB_LO, IOK_SUB_HI);
    u8 opcode = KVPROF_AT(u8, k, IOK_SUB_LO, KVPROF_IOK_OPCODE);
    u8 op = uring_op(opcode);
    if (op == KVPROF_OP_OTHER)
        return 0;
    u64 id = bpf_get_current_pid_tgid();
    u32 tgid = id >> 32;
    if (!kvprof_task_allowed(tgid))
        return 0;
#ifndef KVPROF_URING_ALL
    struct uring_raw_val raw;
    if (raw_ring(KVPROF_AT(u64, k, IOK_SUB_LO, KVPROF_IOK_CTX), &raw)) {
        kvprof_count(KVPROF_URING_ON_BLOCK);
        return 0;
    }
#endif
    u64 now = bpf_ktime_get_ns(); /* before the slot's lookup: it is not the request's time */
    int found;
    struct kvprof_inflight *s = kvprof_slot_data(kvprof_claim((u64)req, &found));
    if (!s)
        return 0;
    if (found)
        kvprof_count(KVPROF_LOST_URING_NOT_SEEN); /* req reused: its completion was skipped */
    s->issue_ns = now;
    s->op = op;
    s->opcode = opcode;
    s->layer = KVPROF_LAYER_IO_URING;
    s->flags = kvprof_start_event(s, tgid, (u32)id, 0);
    return 0;
}

/* io_uring_complete(struct io_ring_ctx *ctx, void *req, struct io_uring_cqe *cqe). The clock
 * is read once the request is known to be one of ours: most completions on a host running
 * raw-device I/O are not, and the read is a good part of what this program costs (a VM's
 * clock: ~27 ns, benchmarks/RESULTS.md). */
RAW_TRACEPOINT_PROBE(io_uring_complete)
{
    /* Completions of other opcodes (and of filtered tasks) have no slot by design, so a miss
     * is not counted as a loss here. */
    int slot = kvprof_find(ctx->args[1]);
    struct kvprof_inflight *s = kvprof_slot_data(slot);
#ifndef KVPROF_URING_ALL
    u64 ring = ctx->args[0];
    void *req = (void *)ctx->args[1];
    u64 inode;
    if (!s) {
        /* Left at submission because of its ring? Then it went where the ring's others did:
         * the same open file (and inode, should the file have been freed and reused). */
        struct uring_raw_val v;
        if (!raw_ring(ring, &v))
            return 0;
        KVPROF_SPAN(k, req, IOK_END_LO, IOK_END_HI);
        if (uring_op(KVPROF_AT(u8, k, IOK_END_LO, KVPROF_IOK_OPCODE)) == KVPROF_OP_OTHER)
            return 0;
        u64 file = KVPROF_AT(u64, k, IOK_END_LO, KVPROF_IOK_FILE);
        if (file == v.file &&
            KVPROF_FIELD(u64, (void *)file, KVPROF_FILE_INODE) == v.inode)
            return 0;
        if (raw_block_file((void *)file, &inode)) {
            mark_raw(ring, file, inode); /* another open of a raw device */
            return 0;
        }
        unmark_raw(ring);
        kvprof_count(KVPROF_LOST_URING_SKIPPED);
        return 0;
    }
    u64 file = KVPROF_FIELD(u64, req, KVPROF_IOK_FILE);
    if (raw_block_file((void *)file, &inode)) {
        mark_raw(ring, file, inode);
        kvprof_release(slot);
        kvprof_count(KVPROF_URING_ON_BLOCK);
        return 0;
    }
#else
    if (!s)
        return 0;
#endif
    u64 now = bpf_ktime_get_ns();
    s32 res = KVPROF_FIELD(s32, (void *)ctx->args[2], KVPROF_CQE_RES);
    struct kvprof_io e = {};
    e.issue_ns = s->issue_ns;
    e.complete_ns = now;
    e.cgroup_id = s->cgroup_id;
    e.ctx = ctx->args[0];
    e.bytes = res > 0 ? res : 0;
    e.error = res < 0 ? res : 0;
    e.pid = s->pid;
    e.tgid = s->tgid;
    e.op = s->op;
    e.opcode = s->opcode;
    e.layer = KVPROF_LAYER_IO_URING;
    e.flags = s->flags;
    e.sample_shift = s->sample_shift;
    __builtin_memcpy(e.comm, s->comm, sizeof(e.comm));
    kvprof_release(slot);
    kvprof_agg(KVPROF_LAYER_IO_URING, e.op, 0, e.issue_ns, e.bytes, 0, e.complete_ns - e.issue_ns,
               e.complete_ns);
    kvprof_emit_device(&e);
    return 0;
}
