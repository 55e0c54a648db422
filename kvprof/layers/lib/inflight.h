/* The device layers' requests in flight, in a table of fixed slots. */
#ifndef KVPROF_INFLIGHT_H
#define KVPROF_INFLIGHT_H
#include "../kvprof.h"
#include "task.h"

/* ---- Requests in flight ------------------------------------------------------------------
 * The device layers follow each request from start to completion by the kernel's own pointer
 * to it (struct request, struct io_kiocb), in a table of plain arrays: the keys in buckets of
 * eight (64 bytes: one cache line where an array map's values start on one; on 6.18 they
 * start 56 bytes past one, and buckets padded onto single lines measured no cheaper), each
 * claimed by compare-and-swap and freed by writing 0, and beside them the requests' data. Unlike a BPF hash map there is no
 * bucket lock and no element allocation per request, which was most of the probes' cost per
 * I/O (DESIGN.md, "Two capture tiers"). A request whose bucket is full (more than eight in
 * flight hashing together, out of KVPROF_INFLIGHT_SLOTS) is counted as lost
 * (KVPROF_LOST_INFLIGHT_FULL). Requests are reused by the kernel (per tag), so one whose
 * completion was never seen is found again at its next start and accounted then. */
#ifndef KVPROF_INFLIGHT_SLOTS
#define KVPROF_INFLIGHT_SLOTS 65536 /* a power of two */
#endif
#define KVPROF_BUCKET 8
#define KVPROF_BUCKETS (KVPROF_INFLIGHT_SLOTS / KVPROF_BUCKET)

struct kvprof_bucket {
    u64 key[KVPROF_BUCKET]; /* the requests' addresses; 0: free */
};

struct kvprof_inflight {
    u64 insert_ns;
    u64 issue_ns;
    u64 cgroup_id;
    u32 dev;
    u32 bytes;
    u32 done; /* bytes completed so far (a request completed in parts) */
    u32 pid;
    u32 tgid;
    u16 flags;
    u8 op;
    u8 pad1;
    u8 opcode;
    u8 layer;
    u8 sample_shift;
    u8 pad0;
    u16 dev_idx; /* block: the device's index (kvprof_dev_index) */
    u8 pad[2];
    char comm[16];
};

BPF_ARRAY(inflight_keys, struct kvprof_bucket, KVPROF_BUCKETS);
BPF_ARRAY(inflight, struct kvprof_inflight, KVPROF_INFLIGHT_SLOTS);

static __always_inline u32 kvprof_bucket_of(u64 key)
{
    /* Fibonacci hashing of the address without its low bits (the kernel's request objects
     * are 64-byte aligned or more). */
    return (u32)(((key >> 6) * 0x9E3779B97F4A7C15ULL) >> 40) & (KVPROF_BUCKETS - 1);
}

/* The slot of `key`'s bucket that holds `want`, or -1; with `want` 0, a free slot, claimed
 * for `key` by compare-and-swap. */
static __always_inline int kvprof_scan(u64 key, u64 want)
{
    u32 b = kvprof_bucket_of(key);
    struct kvprof_bucket *bk = inflight_keys.lookup(&b);
    if (!bk)
        return -1;
#pragma unroll
    for (int i = 0; i < KVPROF_BUCKET; i++)
        if (bk->key[i] == want &&
            (want || __sync_val_compare_and_swap(&bk->key[i], 0, key) == 0))
            return b * KVPROF_BUCKET + i;
    return -1;
}

/* The slot holding `key`, or -1. */
static __always_inline int kvprof_find(u64 key)
{
    return kvprof_scan(key, key);
}

/* The slot holding `key`, claimed for it if it was not there (*found says which), or -1 when
 * its bucket is full. One pass over the bucket looks for the key and the first free slot at
 * once (a start, the commonest call, nearly never finds its key); only a free slot another
 * CPU took between the look and the claim sends it round again. */
static __always_inline int kvprof_claim(u64 key, int *found)
{
    *found = 0;
    u32 b = kvprof_bucket_of(key);
    struct kvprof_bucket *bk = inflight_keys.lookup(&b);
    if (!bk)
        return -1;
    int free = -1;
#pragma unroll
    for (int i = 0; i < KVPROF_BUCKET; i++) {
        u64 k = bk->key[i];
        if (k == key) {
            *found = 1;
            return b * KVPROF_BUCKET + i;
        }
        if (!k && free < 0)
            free = i;
    }
    if (free >= 0 && __sync_val_compare_and_swap(&bk->key[free], 0, key) == 0)
        return b * KVPROF_BUCKET + free;
    int slot = kvprof_scan(key, 0);
    if (slot < 0)
        kvprof_count(KVPROF_LOST_INFLIGHT_FULL);
    return slot;
}

static __always_inline struct kvprof_inflight *kvprof_slot_data(int slot)
{
    u32 i = (u32)slot;
    return inflight.lookup(&i);
}

static __always_inline void kvprof_release(int slot)
{
    /* Read the slot's data before: once its key is 0 another CPU may claim it. */
    u32 b = (u32)slot / KVPROF_BUCKET;
    struct kvprof_bucket *bk = inflight_keys.lookup(&b);
    if (bk)
        __sync_lock_test_and_set(&bk->key[slot & (KVPROF_BUCKET - 1)], 0);
}

#endif /* KVPROF_INFLIGHT_H */
