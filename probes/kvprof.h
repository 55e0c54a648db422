/* Shared by every kvprof probe: the event record, counters, filters.
 * User space reads the structs here through numpy dtypes (EVENT_DTYPE and the others in
 * kvprof/capture/) and the codes by number; capture checks both against this file's
 * compiled layouts and #defines at load, field by field (kvprof/capture/layout.py). */
#ifndef KVPROF_H
#define KVPROF_H

#define KVPROF_LAYER_BLOCK 0
#define KVPROF_LAYER_IO_URING 1
#define KVPROF_LAYER_SYSCALL 2
#define KVPROF_LAYER_TCP 3
#define KVPROF_LAYER_GDS 4
/* Not an I/O: a bio a flush thread submitted while writing back an inode (its own table). */
#define KVPROF_LAYER_WRITEBACK 7

#define KVPROF_OP_OTHER 0
#define KVPROF_OP_READ 1
#define KVPROF_OP_WRITE 2
#define KVPROF_OP_FLUSH 3
#define KVPROF_OP_DISCARD 4

#define KVPROF_FL_SYNC (1 << 0)
#define KVPROF_FL_FUA (1 << 1)
#define KVPROF_FL_PREFLUSH (1 << 2)
#define KVPROF_FL_META (1 << 3)
#define KVPROF_FL_RAHEAD (1 << 4)
/* syscall layer: the file was opened with O_DIRECT (page cache bypassed). */
#define KVPROF_FL_DIRECT (1 << 5)
/* Start-map entry of a request whose task was filtered out: dropped silently at completion. */
#define KVPROF_FL_FILTERED (1 << 15)
/* In-flight entry of a request the event tier's sampling left out (counted all the same). */
#define KVPROF_FL_UNSAMPLED (1 << 14)

/* Indexes into the per-CPU counters array. */
#define KVPROF_LOST_RINGBUF 0
#define KVPROF_LOST_BLOCK_UNMATCHED 1
/* A request seen again (issued, or its req reused) while we still held it as in flight, or
 * still held at stop: its completion never reached our probe (see forget_unseen in
 * block.bpf.c). */
#define KVPROF_LOST_BLOCK_NOT_SEEN 2
#define KVPROF_LOST_URING_NOT_SEEN 3
/* An open whose record found the opens ring full: its file's I/O is not traced. */
#define KVPROF_LOST_OPEN_RINGBUF 4
/* An aggregate-tier key found its map full (user space drains it every 250 ms). */
#define KVPROF_LOST_AGG_FULL 5
/* A request found every slot it may use in the in-flight table taken (see kvprof_claim). */
#define KVPROF_LOST_INFLIGHT_FULL 6
/* Not a loss: device-layer requests started (filters passed), whether sampling kept them or
 * not. The sampling's rate offered comes from here, not from the rows user space drained: a
 * starved drain thread would see a slower rate and keep too many. */
#define KVPROF_DEVICE_STARTED 7
/* Not a loss: io_uring requests to a raw block device opened O_DIRECT, left to the block
 * layer (io_uring.bpf.c). */
#define KVPROF_URING_ON_BLOCK 8
/* A request skipped as its ring's were (they went to a raw block device) whose file turned
 * out to be another: not traced in either layer. */
#define KVPROF_LOST_URING_SKIPPED 9
#define KVPROF_NCOUNTERS 10

#ifndef KVPROF_RINGBUF_PAGES
#define KVPROF_RINGBUF_PAGES 1024
#endif
#ifndef KVPROF_START_ENTRIES
#define KVPROF_START_ENTRIES 65536
#endif

struct kvprof_io {
    u64 insert_ns; /* syscall: the offset the call named, or all ones (syscall.bpf.c) */
    u64 issue_ns;
    u64 complete_ns;
    u64 sector; /* block: the first sector; syscall reads: bytes fetched (syscall.bpf.c) */
    u64 cgroup_id;
    u64 ctx;   /* io_uring: the ring; syscall: the file id (see syscall.bpf.c) */
    u32 bytes; /* done */
    u32 dev;
    u32 pid;
    u32 tgid;
    s32 error;
    u16 flags;
    u8 op;
    u8 layer;
    u8 opcode; /* io_uring: IORING_OP_*; syscall: which syscall */
    u8 sample_shift; /* the device layers: 1 in 2^sample_shift requests was kept */
    u8 pad[2];
    u32 asked; /* syscall: bytes asked for */
    char comm[16];
};

BPF_PERCPU_ARRAY(counters, u64, KVPROF_NCOUNTERS);

/* Filters are maps filled from user space; the defines only switch the checks on, so no
 * user-supplied string ever reaches the C text. */
#ifdef KVPROF_FILTER_DEV
BPF_HASH(dev_filter, u32, u8, 256);
#endif
#ifdef KVPROF_FILTER_TGID
BPF_HASH(tgid_filter, u32, u8, 1024);
#endif
#ifdef KVPROF_FILTER_CGROUP
BPF_HASH(cgroup_filter, u64, u8, 64);
#endif

static __always_inline void kvprof_count(int idx)
{
    u64 *c = counters.lookup(&idx);
    /* Atomic although per-CPU: raw tracepoint programs can nest on one CPU (a completion
     * interrupt while another of kvprof's programs runs). */
    if (c)
        __sync_fetch_and_add(c, 1);
}

static __always_inline int kvprof_dev_allowed(u32 dev)
{
#ifdef KVPROF_FILTER_DEV
    if (!dev_filter.lookup(&dev))
        return 0;
#endif
    return 1;
}

static __always_inline int kvprof_task_allowed(u32 tgid)
{
#ifdef KVPROF_FILTER_TGID
    if (!tgid_filter.lookup(&tgid))
        return 0;
#endif
#ifdef KVPROF_FILTER_CGROUP
    u64 cg = bpf_get_current_cgroup_id();
    if (!cgroup_filter.lookup(&cg))
        return 0;
#endif
    return 1;
}

#ifndef KVPROF_SELF_TGID
#define KVPROF_SELF_TGID 0 /* set by capture to kvprof's own pid */
#endif

/* An instant row (issue = completion) for the current task, or 0 when the filters, or
 * kvprof being that task, leave it out. */
static __always_inline int kvprof_task_row(struct kvprof_io *e)
{
    u64 now = bpf_ktime_get_ns(); /* before the filters: they are not the event's time */
    u64 id = bpf_get_current_pid_tgid();
    u32 tgid = id >> 32;
    if (tgid == KVPROF_SELF_TGID || !kvprof_task_allowed(tgid))
        return 0;
    e->issue_ns = now;
    e->complete_ns = now;
    e->pid = (u32)id;
    e->tgid = tgid;
    e->cgroup_id = bpf_get_current_cgroup_id();
    bpf_get_current_comm(&e->comm, sizeof(e->comm));
    return 1;
}

/* Events go to user space through a ring buffer drained on a timer, without a wake-up per
 * event (wake-ups cost ~8 us each under virtualisation; see shared/reference/perf.md), and in
 * batches: each CPU gathers KVPROF_BATCH records in its own slot of `staging` and hands the
 * whole batch to the ring in one reservation, so the ring's lock and header are paid once
 * per batch and user space reads a batch as one array. A batch that is not full is handed
 * over by `flush_events`, which capture runs on each CPU every few hundred milliseconds
 * (BPF_PROG_TEST_RUN on that CPU) and once more at stop.
 * Raw tracepoint programs can nest on a CPU (a completion interrupt while another of kvprof's
 * programs runs); the inner one finds the CPU's batch in use and sends its record alone. The
 * classic tracepoints (syscall, tcp) never nest: the kernel skips such a program while
 * another runs on the CPU, and capture reads those skips from recursion_misses. */
#ifndef KVPROF_BATCH
#define KVPROF_BATCH 32
#endif

struct kvprof_batch {
    u32 n;      /* records in use */
    u32 in_use; /* a program on this CPU is adding to it now */
    u64 pad;
    struct kvprof_io rec[KVPROF_BATCH];
};

BPF_RINGBUF_OUTPUT(events, KVPROF_RINGBUF_PAGES);
BPF_PERCPU_ARRAY(staging, struct kvprof_batch, 1);

static __always_inline void kvprof_lost_events(u32 n)
{
    int idx = KVPROF_LOST_RINGBUF;
    u64 *c = counters.lookup(&idx);
    if (c)
        __sync_fetch_and_add(c, n);
}

/* The CPU's batch to the ring, its records then given up. */
static __always_inline void kvprof_flush(struct kvprof_batch *b)
{
    if (events.ringbuf_output(b, sizeof(*b), BPF_RB_NO_WAKEUP) != 0)
        kvprof_lost_events(b->n);
    b->n = 0;
}

static __always_inline void kvprof_emit(struct kvprof_io *e)
{
    int zero = 0;
    struct kvprof_batch *b = staging.lookup(&zero);
    if (b && !b->in_use) {
        b->in_use = 1;
        /* Program order is all that matters between an interrupt and what it interrupted on
         * one CPU, but the compiler must not move the accesses across the flag. */
        asm volatile("" ::: "memory");
        u32 n = b->n;
        if (n < KVPROF_BATCH) {
            __builtin_memcpy(&b->rec[n], e, sizeof(*e));
            b->n = ++n;
        }
        if (n >= KVPROF_BATCH)
            kvprof_flush(b);
        asm volatile("" ::: "memory");
        b->in_use = 0;
        return;
    }
    /* Nested in another of kvprof's programs on this CPU: a batch of one. */
    struct kvprof_batch *one = events.ringbuf_reserve(sizeof(struct kvprof_batch));
    if (!one) {
        kvprof_count(KVPROF_LOST_RINGBUF);
        return;
    }
    one->n = 1;
    __builtin_memcpy(&one->rec[0], e, sizeof(*e));
    events.ringbuf_submit(one, BPF_RB_NO_WAKEUP);
}

/* Run by capture on each CPU in turn (never attached): hands over a batch that is not full.
 * Returns 1 when it could not, because it interrupted a probe adding to that batch. */
int flush_events(struct bpf_raw_tracepoint_args *ctx)
{
    int zero = 0;
    struct kvprof_batch *b = staging.lookup(&zero);
    if (b && b->in_use)
        return 1;
    if (b && b->n) {
        /* Run on the caller's own CPU it can be interrupted like any probe. */
        b->in_use = 1;
        asm volatile("" ::: "memory");
        kvprof_flush(b);
        asm volatile("" ::: "memory");
        b->in_use = 0;
    }
    return 0;
}

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

/* ---- Requests in flight ------------------------------------------------------------------
 * The device layers follow each request from start to completion by the kernel's own pointer
 * to it (struct request, struct io_kiocb), in a table of plain arrays: the keys in buckets of
 * eight (one cache line, so a lookup touches one line), each claimed by compare-and-swap and
 * freed by writing 0, and beside them the requests' data. Unlike a BPF hash map there is no
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

/* The event tier's sampling: 1 in 2^sample_shift[0] device-layer requests becomes a row;
 * capture raises it past the event rate it sustains (record --event-rate) and lowers it
 * again. Every request is counted by the aggregate tier all the same. */
BPF_ARRAY(sample_shift, u32, 1);

/* A request starts: whether the event tier keeps it, and if so who started it (submission
 * runs in the submitter's context; block completion does not). `flags`: the request's so
 * far; returns them with the sampling's. */
static __always_inline u16 kvprof_start_event(struct kvprof_inflight *s, u32 tgid, u32 pid,
                                              u16 flags)
{
    s->pid = pid;
    s->tgid = tgid;
#ifdef KVPROF_NO_DEVICE_EVENTS
    return flags | KVPROF_FL_UNSAMPLED;
#else
    if (flags & KVPROF_FL_FILTERED)
        return flags | KVPROF_FL_UNSAMPLED;
    int started = KVPROF_DEVICE_STARTED;
    u64 *c = counters.lookup(&started);
    /* Not atomic: a nested program's increment lost now and then only blurs a rate. */
    if (c)
        *c += 1;
    int zero = 0;
    u32 *k = sample_shift.lookup(&zero);
    u32 shift = k ? *k & 31 : 0;
    s->sample_shift = shift;
    if (shift && (bpf_get_prandom_u32() & ((1U << shift) - 1)))
        return flags | KVPROF_FL_UNSAMPLED;
    s->cgroup_id = bpf_get_current_cgroup_id();
    bpf_get_current_comm(&s->comm, sizeof(s->comm));
    return flags;
#endif
}

/* A field of a kernel struct at an offset read from the running kernel's BTF (-D values from
 * kvprof/capture/btf.py; no kernel struct layout is compiled in). */
#define KVPROF_FIELD(type, ptr, off) ({ type _v = 0; \
    bpf_probe_read_kernel(&_v, sizeof(_v), (const char *)(ptr) + (off)); _v; })

/* Fields of one kernel struct in one bpf_probe_read_kernel of the bytes from the first to the
 * end of the last (the helper costs per call, not per byte): KVPROF_SPAN declares and fills
 * `buf` with [lo, hi) of *ptr, from lo rounded down to 8 so every field keeps its alignment;
 * KVPROF_AT reads a field at its struct offset from it. */
#define KVPROF_MIN(a, b) ((a) < (b) ? (a) : (b))
#define KVPROF_MAX(a, b) ((a) > (b) ? (a) : (b))
#define KVPROF_SPAN(buf, ptr, lo, hi) \
    u64 buf[((hi) - ((lo) & ~7) + 7) / 8]; \
    if (bpf_probe_read_kernel(buf, sizeof(buf), (const char *)(ptr) + ((lo) & ~7))) \
        __builtin_memset(buf, 0, sizeof(buf))
#define KVPROF_AT(type, buf, lo, off) ({ type _v; \
    __builtin_memcpy(&_v, (const char *)(buf) + (off) - ((lo) & ~7), sizeof(_v)); _v; })

/* The device layers' per-I/O rows: those sampling kept (`--no-events`: none). */
static __always_inline void kvprof_emit_device(struct kvprof_io *e)
{
#ifndef KVPROF_NO_DEVICE_EVENTS
    if (!(e->flags & KVPROF_FL_UNSAMPLED))
        kvprof_emit(e);
#endif
}

#endif /* KVPROF_H */
