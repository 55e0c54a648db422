/* The aggregate tier: every device-layer request counted in the kernel. */
#ifndef KVPROF_AGGREGATE_H
#define KVPROF_AGGREGATE_H
#include "../kvprof.h"
#include "task.h"

/* ---- Aggregate tier ----------------------------------------------------------------------
 * Counts, bytes and log2 histograms per (issue slot, completion second, device, layer, op),
 * and per device the time with a request in flight: exact at any I/O rate,
 * whatever the event ring and its Python consumer manage. The probes know nothing of phases:
 * a request is counted under the 4 ms slot its issue time falls in, with the earliest and
 * latest issue time the slot saw, and user space gives each slot the phase of the window
 * holding those times once the phase sources have sent their windows (kvprof/fold.py), the
 * same rule the event tier follows per request. The completion second in the key is what
 * makes taking a key safe: no probe writes to a second that is over. User space drains the
 * seconds that are over (schema.IO_AGG, schema.DEVICE_BUSY). */
#define KVPROF_AGG_SLOTS 40
#define KVPROF_NS_PER_S 1000000000ULL
/* A divisor of the second, so every slot lies in one second; kvprof/fold.py's SLOT_NS. */
#define KVPROF_SLOT_NS 4000000ULL
#ifndef KVPROF_AGG_ENTRIES
#define KVPROF_AGG_ENTRIES 16384
#endif

struct kvprof_agg_key {
    u64 slot;  /* issue time / KVPROF_SLOT_NS */
    u32 sec;   /* bpf_ktime_get_ns() at completion, in whole seconds */
    u32 dev;   /* block: the device; io_uring: 0 */
    u8 layer;
    u8 op;
    u8 pad[6];
};

struct kvprof_agg_val {
    /* No count of requests: every one is in the size histogram (slot 0: zero bytes), and an
     * atomic operation less per request is measurable on a CPU-bound device. */
    u64 bytes;
    u64 queue_ns;   /* insert -> issue, summed */
    u64 service_ns; /* issue -> completion, summed */
    /* The earliest and latest issue in the slot, as maxima that a zeroed value starts
     * from: KVPROF_SLOT_NS - (issue - slot start), and issue - slot start. */
    u64 first_inv;
    u64 last;
    /* Slot 0: the value 0; slot s >= 1: [2^(s-1), 2^s); the last slot also everything above. */
    u32 size[KVPROF_AGG_SLOTS];    /* bytes */
    u32 queue[KVPROF_AGG_SLOTS];   /* ns */
    u32 service[KVPROF_AGG_SLOTS]; /* ns */
};

/* Busy time, by the slot it lies in and the second it was accounted in. `run` 0: pieces
 * within the slot, with the earliest start and latest end among them (encoded as in
 * kvprof_agg_val); `run` n > 0: one stretch without a start or completion in it, from the
 * slot's start on for `ns`, over n slots (a long request alone on the device). */
struct kvprof_busy_key {
    u64 slot;
    u32 sec;
    u32 dev;
    u32 run;
    u32 pad;
};

struct kvprof_busy_val {
    u64 ns;
    u64 first_inv;
    u64 last;
};

/* Per device, in one word changed by compare-and-swap: the requests in flight (low 16 bits)
 * and since when the device has been busy without that time being accounted yet (the high
 * 48 bits of the clock in ns: a stretch is always shorter than the 78 hours they wrap in).
 * Busy time is accounted when the device goes idle, and at slot boundaries; in between a
 * request's start or completion only counts it in or out. One atomic operation per start
 * and completion (the kernel keeps its own io_ticks the same way, per jiffy): moving the
 * stamp at every request cost a tenth of the device's IOPS at full rate. */
struct kvprof_dev_state {
    u64 word;
};
#define KVPROF_DEV_N_MASK 0xFFFFULL
#define KVPROF_STAMP_BITS 48
#define KVPROF_STAMP_MASK ((1ULL << KVPROF_STAMP_BITS) - 1)

/* Shared maps updated with atomic operations, not per-CPU ones: a key lives ~3 s and a busy
 * device makes 250 a second per layer and op, and a per-CPU value is allocated on every
 * possible CPU (~100 MiB on a 128-CPU host; a few MiB shared). Not preallocated: entries
 * are allocated as keys appear. */
BPF_F_TABLE("hash", struct kvprof_agg_key, struct kvprof_agg_val, agg, KVPROF_AGG_ENTRIES,
            BPF_F_NO_PREALLOC);
BPF_ARRAY(agg_zero, struct kvprof_agg_val, 1); /* never written: the initial value */
BPF_F_TABLE("hash", struct kvprof_busy_key, struct kvprof_busy_val, busy, KVPROF_AGG_ENTRIES,
            BPF_F_NO_PREALLOC);
/* Per device, by a small index the probes give each device the first time they see it
 * (dev_index; kept in block.bpf.c's per-CPU queue cache): an array slot, not a hash lookup,
 * on every start and completion. */
#define KVPROF_MAX_DEVICES 1024
BPF_ARRAY(dev_state, struct kvprof_dev_state, KVPROF_MAX_DEVICES);
BPF_HASH(dev_index, u32, u32, KVPROF_MAX_DEVICES);
BPF_ARRAY(dev_count, u64, 1); /* indices given; 64 bits: bcc's LLVM has no 32-bit atomics */

/* The device's index, given it now if it has none; KVPROF_MAX_DEVICES when all are taken. */
static __always_inline u32 kvprof_dev_index(u32 dev)
{
    u32 *idx = dev_index.lookup(&dev);
    if (idx)
        return *idx;
    int zero = 0;
    u64 *count = dev_count.lookup(&zero);
    if (!count)
        return KVPROF_MAX_DEVICES;
    /* (counts on past KVPROF_MAX_DEVICES once they are all given: harmless) */
    u64 c = __sync_fetch_and_add(count, 1);
    if (c >= KVPROF_MAX_DEVICES)
        return KVPROF_MAX_DEVICES;
    u32 fresh = (u32)c;
    dev_index.insert(&dev, &fresh); /* another CPU may have been first: use its index */
    idx = dev_index.lookup(&dev);
    return idx ? *idx : KVPROF_MAX_DEVICES;
}

static __always_inline u32 kvprof_slot(u64 v)
{
    if (!v)
        return 0;
    u32 s = 1;
    if (v >> 32) { v >>= 32; s += 32; }
    if (v >> 16) { v >>= 16; s += 16; }
    if (v >> 8) { v >>= 8; s += 8; }
    if (v >> 4) { v >>= 4; s += 4; }
    if (v >> 2) { v >>= 2; s += 2; }
    if (v >> 1) { s += 1; }
    return s < KVPROF_AGG_SLOTS ? s : KVPROF_AGG_SLOTS - 1;
}

/* *p = max(*p, v), against other CPUs (and a start and a completion nesting on one). */
static __always_inline void kvprof_max64(u64 *p, u64 v)
{
    for (int i = 0; i < 8; i++) {
        u64 old = *p;
        if (old >= v || __sync_val_compare_and_swap(p, old, v) == old)
            return;
    }
}

/* hist[s]++ for a u32 histogram, by a 64-bit atomic add on the pair of slots it shares a
 * word with (bcc's LLVM has no 32-bit atomics; little-endian). A slot's count never carries
 * into its neighbour: that takes 2^32 requests in one 4 ms slot. */
static __always_inline void kvprof_hist_inc(u32 *hist, u32 s)
{
    __sync_fetch_and_add((u64 *)&hist[s & ~1U], 1ULL << (32 * (s & 1)));
}

/* A request completed: counted in its issue slot with its size, queue time and, when `timed`,
 * its service time (a block request whose completion the kernel never traced is counted, as
 * diskstats counts it, without one: the service histogram then holds one request less than
 * the size histogram, which counts every request). */
static __always_inline void kvprof_agg_as(u8 layer, u8 op, u32 dev, u64 issue_ns, u64 bytes,
                                          u64 queue_ns, u64 service_ns, u64 complete_ns,
                                          int timed)
{
    struct kvprof_agg_key k = {};
    k.slot = issue_ns / KVPROF_SLOT_NS;
    k.sec = complete_ns / KVPROF_NS_PER_S;
    k.dev = dev;
    k.layer = layer;
    k.op = op;
    int zero = 0;
    struct kvprof_agg_val *init = agg_zero.lookup(&zero);
    if (!init)
        return;
    struct kvprof_agg_val *v = agg.lookup_or_try_init(&k, init);
    if (!v) {
        kvprof_count(KVPROF_LOST_AGG_FULL);
        return;
    }
    /* Every CPU completing requests of this slot, device, layer and op writes this value;
     * zeros (flushes' bytes, queue time without a scheduler or on io_uring) add nothing. */
    if (bytes)
        __sync_fetch_and_add(&v->bytes, bytes);
    if (queue_ns)
        __sync_fetch_and_add(&v->queue_ns, queue_ns);
    if (timed)
        __sync_fetch_and_add(&v->service_ns, service_ns);
    u64 off = issue_ns - k.slot * KVPROF_SLOT_NS;
    kvprof_max64(&v->first_inv, KVPROF_SLOT_NS - off);
    kvprof_max64(&v->last, off);
    u32 s = kvprof_slot(bytes);
    if (s < KVPROF_AGG_SLOTS)
        kvprof_hist_inc(v->size, s);
    /* No queue time (io_uring; a device without a scheduler) leaves slot 0 to user space,
     * which has every request's count from the size histogram: an atomic less per request. */
    if (queue_ns) {
        s = kvprof_slot(queue_ns);
        if (s < KVPROF_AGG_SLOTS)
            kvprof_hist_inc(v->queue, s);
    }
    if (!timed)
        return;
    s = kvprof_slot(service_ns);
    if (s < KVPROF_AGG_SLOTS)
        kvprof_hist_inc(v->service, s);
}

static __always_inline void kvprof_agg(u8 layer, u8 op, u32 dev, u64 issue_ns, u64 bytes,
                                       u64 queue_ns, u64 service_ns, u64 complete_ns)
{
    kvprof_agg_as(layer, op, dev, issue_ns, bytes, queue_ns, service_ns, complete_ns, 1);
}

static __always_inline void kvprof_busy_put(u64 slot, u32 dev, u32 run, u64 ns, u64 from_off,
                                            u64 to_off, u64 now)
{
    struct kvprof_busy_key k = {};
    k.slot = slot;
    k.sec = now / KVPROF_NS_PER_S;
    k.dev = dev;
    k.run = run;
    struct kvprof_busy_val zero = {};
    struct kvprof_busy_val *b = busy.lookup_or_try_init(&k, &zero);
    if (!b) {
        kvprof_count(KVPROF_LOST_AGG_FULL);
        return;
    }
    __sync_fetch_and_add(&b->ns, ns); /* start and completion may nest */
    if (!run) {
        kvprof_max64(&b->first_inv, KVPROF_SLOT_NS - from_off);
        kvprof_max64(&b->last, to_off);
    }
}

/* The device was busy over [from, to), accounted at `now`: the part in `from`'s slot, the
 * part in the next one (a busy device crosses each slot edge so), and what goes on past that
 * as one run (a stretch with no start or completion for a whole slot; user space lays it
 * over the slots it spans). */
static __always_inline void kvprof_busy_add(u32 dev, u64 from, u64 to, u64 now)
{
    if (from >= to)
        return;
    u64 slot = from / KVPROF_SLOT_NS;
    u64 base = slot * KVPROF_SLOT_NS;
    u64 edge = base + KVPROF_SLOT_NS;
    u64 end = to < edge ? to : edge;
    kvprof_busy_put(slot, dev, 0, end - from, from - base, end - base, now);
    if (to <= edge)
        return;
    if (to <= edge + KVPROF_SLOT_NS) {
        kvprof_busy_put(slot + 1, dev, 0, to - edge, 0, to - edge, now);
        return;
    }
    kvprof_busy_put(slot + 1, dev, (u32)((to - edge + KVPROF_SLOT_NS - 1) / KVPROF_SLOT_NS),
                    to - edge, 0, 0, now);
}

/* A request starts (delta 1) or completes (delta -1) on the device (index `di`) at `now`. */
static __always_inline void kvprof_dev_tick(u32 dev, u32 di, u64 now, s64 delta)
{
    struct kvprof_dev_state *st = dev_state.lookup(&di);
    if (!st) {
        kvprof_count(KVPROF_LOST_AGG_FULL); /* more than KVPROF_MAX_DEVICES devices */
        return;
    }
    for (int i = 0; i < 8; i++) {
        u64 w = st->word;
        u64 n = w & KVPROF_DEV_N_MASK;
        u64 ago = ((now & KVPROF_STAMP_MASK) - (w >> 16)) & KVPROF_STAMP_MASK;
        if (ago >> (KVPROF_STAMP_BITS - 1))
            ago = 0; /* the stamp is a hair later than our clock read (another CPU) */
        u64 since = now - ago;
        int edge = since / KVPROF_SLOT_NS != now / KVPROF_SLOT_NS;
        u64 fresh = (now & KVPROF_STAMP_MASK) << 16;
        u64 next;
        int busy_until_now = 0;
        if (delta > 0) {
            if (n == KVPROF_DEV_N_MASK)
                return;
            if (n == 0) {
                next = fresh | 1; /* idle until now */
            } else if (edge) {
                next = fresh | (n + 1);
                busy_until_now = 1;
            } else {
                next = w + 1;
            }
        } else {
            if (n == 0)
                return; /* its start was not counted (it was in flight when we attached) */
            if (n == 1 || edge) {
                next = fresh | (n - 1);
                busy_until_now = 1;
            } else {
                next = w - 1;
            }
        }
        if (__sync_val_compare_and_swap(&st->word, w, next) != w)
            continue; /* another CPU changed it first: read it again */
        if (busy_until_now)
            kvprof_busy_add(dev, since, now, now);
        return;
    }
    kvprof_count(KVPROF_LOST_AGG_FULL);
}

#endif /* KVPROF_AGGREGATE_H */
