/* Block layer: one record per completed request, from the block_rq_insert / issue / requeue /
 * complete raw tracepoints, followed by the struct request pointer in the in-flight table.
 * Raw tracepoints hand over the request itself instead of a formatted record, which costs a
 * fraction per I/O; its fields are read at offsets from the running kernel's BTF
 * (KVPROF_RQ_* etc., set by kvprof/capture/btf.py). */
#include "../kvprof.h"
#include "../lib/task.h"
#include "../lib/ring.h"
#include "../lib/aggregate.h"
#include "../lib/inflight.h"
#include "../lib/sampling.h"
#include "../lib/fields.h"

/* rq->cmd_flags: the op in the low KVPROF_REQ_OP_BITS bits, flags above (numbers from the
 * kernel's enum req_op and enum req_flag_bits). */
static __always_inline void decode_cmd(u32 cmd, u8 *op, u16 *flags)
{
    u32 o = cmd & ((1U << KVPROF_REQ_OP_BITS) - 1);
    *op = o == KVPROF_REQ_OP_READ ? KVPROF_OP_READ
        : o == KVPROF_REQ_OP_WRITE ? KVPROF_OP_WRITE
        : o == KVPROF_REQ_OP_FLUSH ? KVPROF_OP_FLUSH
        : o == KVPROF_REQ_OP_DISCARD ? KVPROF_OP_DISCARD
        : KVPROF_OP_OTHER;
    u16 fl = 0;
    if (cmd & (1U << KVPROF_REQ_SYNC_BIT)) fl |= KVPROF_FL_SYNC;
    if (cmd & (1U << KVPROF_REQ_FUA_BIT)) fl |= KVPROF_FL_FUA;
    if (cmd & (1U << KVPROF_REQ_PREFLUSH_BIT)) fl |= KVPROF_FL_PREFLUSH;
    if (cmd & (1U << KVPROF_REQ_META_BIT)) fl |= KVPROF_FL_META;
    if (cmd & (1U << KVPROF_REQ_RAHEAD_BIT)) fl |= KVPROF_FL_RAHEAD;
    *flags = fl;
}

/* struct request's queue, op and flags, and size, read in one bpf_probe_read_kernel (they
 * sit within its first 128 bytes on every kernel kvprof runs on, 48 on 6.18; the check below
 * holds it). */
#define RQ_LO KVPROF_MIN(KVPROF_RQ_Q, KVPROF_MIN(KVPROF_RQ_CMD_FLAGS, KVPROF_RQ_DATA_LEN))
#define RQ_HI KVPROF_MAX(KVPROF_RQ_Q + 8, KVPROF_MAX(KVPROF_RQ_CMD_FLAGS + 4, \
                                                    KVPROF_RQ_DATA_LEN + 4))
_Static_assert(RQ_HI - RQ_LO <= 128, "struct request's first fields are far apart");

/* The request queue whose disk a CPU saw last: most requests on a CPU go to the same device,
 * so its number, index and whether the device filter lets it through are read once rather
 * than per request. Only a device the filter lets through is kept: user space fills the
 * filter after the programs attach, and a refusal seen before that must not stick. */
struct queue_dev {
    u64 q;
    u32 dev;
    u32 idx;
};
BPF_PERCPU_ARRAY(last_queue, struct queue_dev, 1);

/* The whole disk's dev_t (MKDEV(major, first_minor)), as the block tracepoints report it,
 * and its index for dev_state; 0 (and *ok 0) when the device filter leaves it out. */
static __always_inline u32 rq_dev(void *q, u32 *idx, int *ok)
{
    int zero = 0;
    struct queue_dev *last = last_queue.lookup(&zero);
    *ok = 1;
    if (last && last->q == (u64)q) {
        *idx = last->idx;
        return last->dev;
    }
    *idx = KVPROF_MAX_DEVICES;
    void *disk = KVPROF_FIELD(void *, q, KVPROF_Q_DISK);
    if (!disk) {
        *ok = kvprof_dev_allowed(0);
        return 0;
    }
    u32 major = KVPROF_FIELD(u32, disk, KVPROF_DISK_MAJOR);
    u32 minor = KVPROF_FIELD(u32, disk, KVPROF_DISK_FIRST_MINOR);
    u32 dev = (major << 20) | minor;
    if (!kvprof_dev_allowed(dev)) {
        *ok = 0;
        return dev;
    }
    *idx = kvprof_dev_index(dev);
    if (last) {
        last->q = (u64)q;
        last->dev = dev;
        last->idx = *idx;
    }
    return dev;
}

/* A request we held as in flight whose completion we never saw: it is over by the time it
 * starts again (the kernel reuses a request only once it is freed). The kernel may run no
 * BPF program for a completion (one that would nest in itself on a CPU, and some served in
 * a softirq, where ftrace's event still fires). diskstats counts them complete, and so does
 * the aggregate tier, in the slot they were issued in, with their size and queue time and
 * no service time (unknown); the event tier has no row for them and reports them lost. */
static __always_inline void forget_unseen(struct kvprof_inflight *s, u64 now)
{
    /* A request the filters (-p, --cgroup) leave out was never going to be recorded: its
     * completion is nobody's loss. */
    if (s->flags & KVPROF_FL_FILTERED)
        return;
    kvprof_count(KVPROF_LOST_BLOCK_NOT_SEEN);
    u64 queue_ns = s->insert_ns ? s->issue_ns - s->insert_ns : 0;
    kvprof_agg_as(KVPROF_LAYER_BLOCK, s->op, s->dev, s->issue_ns, s->bytes, queue_ns, 0, now, 0);
    kvprof_dev_tick(s->dev, s->dev_idx, now, -1);
}

/* A request starts: inserted into a scheduler queue (issue_ns 0 for now) or issued straight
 * to the driver. */
static __always_inline void track(struct kvprof_inflight *s, u32 cmd, u32 bytes, u32 dev,
                                  u32 di, u64 insert_ns, u64 issue_ns)
{
    u16 flags;
    decode_cmd(cmd, &s->op, &flags);
    u64 id = bpf_get_current_pid_tgid();
    if (!kvprof_task_allowed(id >> 32))
        flags |= KVPROF_FL_FILTERED;
    s->insert_ns = insert_ns;
    s->issue_ns = issue_ns;
    s->dev = dev;
    s->dev_idx = di;
    s->bytes = bytes;
    s->done = 0;
    s->layer = KVPROF_LAYER_BLOCK;
    s->flags = kvprof_start_event(s, id >> 32, (u32)id, flags);
    if (!(flags & KVPROF_FL_FILTERED))
        kvprof_dev_tick(dev, di, insert_ns ? insert_ns : issue_ns, 1);
}

/* A request starts: inserted into a scheduler queue (`issue` 0), or issued to the driver,
 * after an insert or straight. */
static __always_inline int rq_start(void *rq, int issue)
{
    u64 now = bpf_ktime_get_ns(); /* before the lookups: they are not the request's time */
    KVPROF_SPAN(r, rq, RQ_LO, RQ_HI);
    u32 bytes = KVPROF_AT(u32, r, RQ_LO, KVPROF_RQ_DATA_LEN);
    u32 di;
    int ok;
    u32 dev = rq_dev(KVPROF_AT(void *, r, RQ_LO, KVPROF_RQ_Q), &di, &ok);
    if (!ok)
        return 0;
    int found;
    struct kvprof_inflight *s = kvprof_slot_data(kvprof_claim((u64)rq, &found));
    if (!s)
        return 0;
    if (found) {
        if (!s->issue_ns) {
            /* Inserted before. Inserted again (a requeue): keep the first insert. Issued:
             * merges after insert can grow the request, the issued size is the real one. */
            if (issue) {
                s->issue_ns = now;
                s->bytes = bytes;
            }
            return 0;
        }
        forget_unseen(s, now); /* started before and its completion never seen: afresh */
    }
    track(s, KVPROF_AT(u32, r, RQ_LO, KVPROF_RQ_CMD_FLAGS), bytes, dev, di, issue ? 0 : now,
          issue ? now : 0);
    return 0;
}

RAW_TRACEPOINT_PROBE(block_rq_insert) { return rq_start((void *)ctx->args[0], 0); }

RAW_TRACEPOINT_PROBE(block_rq_issue) { return rq_start((void *)ctx->args[0], 1); }

/* A requeued request is issued again: not a new request, and no completion was missed. */
RAW_TRACEPOINT_PROBE(block_rq_requeue)
{
    struct kvprof_inflight *s = kvprof_slot_data(kvprof_find(ctx->args[0]));
    if (s)
        s->issue_ns = 0;
    return 0;
}

/* block_rq_complete(rq, blk_status_t error, unsigned int nr_bytes) runs at every
 * blk_update_request(): once per request, or once per part when a driver completes it in
 * parts (nr_bytes < what is left of it); the request is over with its last part.
 *
 * The flush machinery (block/blk-flush.c) strips PREFLUSH/FUA from a request before it is
 * issued and, for a data request that needed a flush, completes it twice: once with its data
 * (counted then) and once empty when the sequence ends, which finds no slot and is ignored.
 * An empty PREFLUSH write (what fsync sends) never reaches the device: it is only completed,
 * empty and without a position, after the device flush it waited for, which is traced as a
 * flush. The kernel counts it as a write of 0 bytes, and so does kvprof. */
RAW_TRACEPOINT_PROBE(block_rq_complete)
{
    u64 now = bpf_ktime_get_ns();
    void *rq = (void *)ctx->args[0];
    u32 nr_bytes = (u32)ctx->args[2];
    int slot = kvprof_find((u64)rq);
    struct kvprof_inflight *s = kvprof_slot_data(slot);
    struct kvprof_io e = {};
    if (!s) {
        u32 di;
        int ok;
        u32 dev = rq_dev(KVPROF_FIELD(void *, rq, KVPROF_RQ_Q), &di, &ok);
        if (!ok)
            return 0;
        if (nr_bytes != 0) {
            kvprof_count(KVPROF_LOST_BLOCK_UNMATCHED);
            return 0;
        }
#if defined(KVPROF_FILTER_TGID) || defined(KVPROF_FILTER_CGROUP)
        /* Completion runs in interrupt context: no task to filter on, so leave it out. */
        return 0;
#endif
        u64 sector = KVPROF_FIELD(u64, rq, KVPROF_RQ_SECTOR);
        if (sector != 0 && sector != (u64)-1)
            return 0;
        u16 fl = 0;
        decode_cmd(KVPROF_FIELD(u32, rq, KVPROF_RQ_CMD_FLAGS), &e.op, &fl);
        if (e.op != KVPROF_OP_WRITE)
            return 0;
        e.flags = fl;
        e.issue_ns = now;
        e.complete_ns = now;
        e.dev = dev;
        e.error = -(s32)(u8)ctx->args[1];
        e.layer = KVPROF_LAYER_BLOCK;
        kvprof_agg(KVPROF_LAYER_BLOCK, e.op, dev, now, 0, 0, 0, now);
        kvprof_emit_device(&e);
        return 0;
    }
    u32 done = s->done + nr_bytes;
    if (done < s->bytes) {
        s->done = done; /* a part: the request goes on */
        return 0;
    }
    if (s->flags & KVPROF_FL_FILTERED) {
        kvprof_release(slot);
        return 0;
    }
    e.insert_ns = s->insert_ns;
    e.issue_ns = s->issue_ns ? s->issue_ns : s->insert_ns;
    e.complete_ns = now;
    e.cgroup_id = s->cgroup_id;
    e.bytes = s->bytes;
    e.dev = s->dev;
    e.pid = s->pid;
    e.tgid = s->tgid;
    e.error = -(s32)(u8)ctx->args[1]; /* the blk_status_t, negated */
    e.flags = s->flags;
    e.op = s->op;
    e.layer = KVPROF_LAYER_BLOCK;
    e.sample_shift = s->sample_shift;
    __builtin_memcpy(e.comm, s->comm, sizeof(e.comm));
    u32 di = s->dev_idx;
    u64 queue_ns = e.insert_ns && s->issue_ns ? s->issue_ns - e.insert_ns : 0;
    kvprof_release(slot);
    kvprof_agg(KVPROF_LAYER_BLOCK, e.op, e.dev, e.issue_ns, e.bytes, queue_ns, now - e.issue_ns, now);
    kvprof_dev_tick(e.dev, di, now, -1);
#ifndef KVPROF_NO_DEVICE_EVENTS
    if (!(e.flags & KVPROF_FL_UNSAMPLED)) {
        e.sector = KVPROF_FIELD(u64, rq, KVPROF_RQ_SECTOR);
        kvprof_emit(&e);
    }
#endif
    return 0;
}
