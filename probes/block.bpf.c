/* Block layer: one record per completed request, from the block_rq_insert / issue /
 * complete tracepoints, matched by (dev, sector) as the bcc tools do on tracepoints. */
#include "kvprof.h"

struct block_key {
    u32 dev;
    u32 pad;
    u64 sector;
};

struct block_start {
    u64 insert_ns;
    u64 issue_ns;
    u64 cgroup_id;
    u32 pid;
    u32 tgid;
    u32 bytes;
    u16 flags;
    u8 op;
    u8 phase; /* kvprof's phase when the request started (aggregate tier) */
    char comm[16];
};

/* LRU: a request whose completion we never see (front merge moved its sector, or it was
 * in flight when a filter changed) must not fill the map for good. */
BPF_TABLE("lru_hash", struct block_key, struct block_start, block_start_map, KVPROF_START_ENTRIES);

/* rwbs as written by the kernel's blk_fill_rwbs(): an optional 'F' (preflush), the op letter
 * (W R D F N, 'DE' for secure erase), then modifiers F(ua) A(head) S(ync) M(eta). */
static __always_inline void parse_rwbs(const char *src, u8 *op, u16 *flags)
{
    char r[8];
    __builtin_memcpy(r, src, sizeof(r));
    u16 fl = 0;
    int i = 0;
    if (r[0] == 'F' && (r[1] == 'W' || r[1] == 'R' || r[1] == 'D' || r[1] == 'N' || r[1] == 'F')) {
        fl |= KVPROF_FL_PREFLUSH;
        i = 1;
    }
    char c = i ? r[1] : r[0];
    switch (c) {
    case 'R': *op = KVPROF_OP_READ; break;
    case 'W': *op = KVPROF_OP_WRITE; break;
    case 'D': *op = KVPROF_OP_DISCARD; break;
    case 'F': *op = KVPROF_OP_FLUSH; break;
    default: *op = KVPROF_OP_OTHER; break;
    }
#pragma unroll
    for (int j = 1; j < 8; j++) {
        if (j <= i)
            continue;
        switch (r[j]) {
        case 'F': fl |= KVPROF_FL_FUA; break;
        case 'A': fl |= KVPROF_FL_RAHEAD; break;
        case 'S': fl |= KVPROF_FL_SYNC; break;
        case 'M': fl |= KVPROF_FL_META; break;
        default: break;
        }
    }
    *flags = fl;
}

/* Who asked: only meaningful at insert/issue, which run in the submitter's context;
 * completion runs in interrupt context. */
static __always_inline void fill_task(struct block_start *v)
{
    u64 id = bpf_get_current_pid_tgid();
    v->pid = (u32)id;
    v->tgid = id >> 32;
    v->cgroup_id = bpf_get_current_cgroup_id();
    bpf_get_current_comm(&v->comm, sizeof(v->comm));
    if (!kvprof_task_allowed(v->tgid))
        v->flags |= KVPROF_FL_FILTERED;
}

static __always_inline void track(struct block_key *k, u32 bytes, const char *rwbs,
                                  u64 insert_ns, u64 issue_ns)
{
    struct block_start v = {};
    v.insert_ns = insert_ns;
    v.issue_ns = issue_ns;
    v.bytes = bytes;
    v.phase = kvprof_phase_now();
    parse_rwbs(rwbs, &v.op, &v.flags);
    fill_task(&v);
    block_start_map.update(k, &v);
    if (!(v.flags & KVPROF_FL_FILTERED))
        kvprof_dev_tick(k->dev, insert_ns ? insert_ns : issue_ns, 1);
}

/* A request we held as in flight whose completion the kernel never let us see: it is over
 * (for the device's in-flight count) by the time it is seen starting again. */
static __always_inline void forget_unseen(struct block_key *k, struct block_start *v, u64 now)
{
    kvprof_count(KVPROF_LOST_BLOCK_NOT_SEEN);
    if (!(v->flags & KVPROF_FL_FILTERED))
        kvprof_dev_tick(k->dev, now, -1);
}

TRACEPOINT_PROBE(block, block_rq_insert)
{
    u32 dev = args->dev;
    if (!kvprof_dev_allowed(dev))
        return 0;
    struct block_key k = {};
    k.dev = dev;
    k.sector = args->sector;
    struct block_start *found = block_start_map.lookup(&k);
    if (found && !found->issue_ns)
        return 0; /* inserted again before issue (a requeue): keep the first insert */
    u64 now = bpf_ktime_get_ns();
    if (found)
        forget_unseen(&k, found, now);
    track(&k, args->bytes, args->rwbs, now, 0);
    return 0;
}

TRACEPOINT_PROBE(block, block_rq_issue)
{
    u32 dev = args->dev;
    if (!kvprof_dev_allowed(dev))
        return 0;
    struct block_key k = {};
    k.dev = dev;
    k.sector = args->sector;
    u64 now = bpf_ktime_get_ns();
    struct block_start *found = block_start_map.lookup(&k);
    if (found && !found->issue_ns) {
        /* Merges after insert can grow the request: the issued size is the real one. */
        found->issue_ns = now;
        found->bytes = args->bytes;
        return 0;
    }
    if (found) /* issued before and its completion never seen: start afresh */
        forget_unseen(&k, found, now);
    /* Not inserted first: it went straight to the driver. */
    track(&k, args->bytes, args->rwbs, 0, now);
    return 0;
}

/* A requeued request is issued again: not a new request, and no completion was missed. */
TRACEPOINT_PROBE(block, block_rq_requeue)
{
    struct block_key k = {};
    k.dev = args->dev;
    k.sector = args->sector;
    struct block_start *found = block_start_map.lookup(&k);
    if (found)
        found->issue_ns = 0;
    return 0;
}

/* The flush machinery (block/blk-flush.c) strips PREFLUSH/FUA from a request before it is
 * issued and, for a data request that needed a flush, completes it twice: once with its data
 * (emitted then) and once empty, at its own sector, when the sequence ends; that second
 * completion finds no entry and is ignored. An empty PREFLUSH write (what fsync sends) never
 * reaches the device: it is only completed, empty and without a position (sector 0), after
 * the device flush it waited for, which is traced as a flush. The kernel counts it as a write
 * of 0 bytes, and so does kvprof. */
TRACEPOINT_PROBE(block, block_rq_complete)
{
    u32 dev = args->dev;
    if (!kvprof_dev_allowed(dev))
        return 0;
    struct block_key k = {};
    k.dev = dev;
    /* Insert/issue report a request without a position (a flush) as sector 0, completion
     * as (sector_t)-1. */
    k.sector = args->sector == (u64)-1 ? 0 : args->sector;
    u64 now = bpf_ktime_get_ns();
    struct kvprof_io e = {};
    struct block_start *v = block_start_map.lookup(&k);
    if (!v) {
        if (args->nr_sector != 0) {
            kvprof_count(KVPROF_LOST_BLOCK_UNMATCHED);
            return 0;
        }
#if defined(KVPROF_FILTER_TGID) || defined(KVPROF_FILTER_CGROUP)
        /* Completion runs in interrupt context: no task to filter on, so leave it out. */
        return 0;
#endif
        if (k.sector != 0)
            return 0;
        u16 fl = 0;
        parse_rwbs(args->rwbs, &e.op, &fl);
        if (e.op != KVPROF_OP_WRITE)
            return 0;
        e.flags = fl;
        e.issue_ns = now;
        e.complete_ns = now;
        e.sector = k.sector;
        e.dev = dev;
        e.error = args->error;
        e.layer = KVPROF_LAYER_BLOCK;
        kvprof_agg(KVPROF_LAYER_BLOCK, e.op, dev, kvprof_phase_now(), 0, 0, 0, now);
        kvprof_emit_device(&e);
        return 0;
    }
    if (v->flags & KVPROF_FL_FILTERED) {
        block_start_map.delete(&k);
        return 0;
    }
    e.insert_ns = v->insert_ns;
    e.issue_ns = v->issue_ns ? v->issue_ns : v->insert_ns;
    e.complete_ns = now;
    e.sector = k.sector;
    e.cgroup_id = v->cgroup_id;
    e.bytes = v->bytes;
    e.dev = dev;
    e.pid = v->pid;
    e.tgid = v->tgid;
    e.error = args->error;
    e.flags = v->flags;
    e.op = v->op;
    e.layer = KVPROF_LAYER_BLOCK;
    __builtin_memcpy(e.comm, v->comm, sizeof(e.comm));
    u8 phase = v->phase;
    block_start_map.delete(&k);
    kvprof_agg(KVPROF_LAYER_BLOCK, e.op, dev, phase, e.bytes,
               e.insert_ns && v->issue_ns ? v->issue_ns - e.insert_ns : 0,
               now - e.issue_ns, now);
    kvprof_dev_tick(dev, now, -1);
    kvprof_emit_device(&e);
    return 0;
}
