/* Shared by every kvprof probe: the event record, counters, filters.
 * The layout of struct kvprof_io is mirrored by EVENT_DTYPE in kvprof/capture/ebpf.py;
 * capture checks the size at load time. */
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

/* Indexes into the per-CPU counters array. */
#define KVPROF_LOST_RINGBUF 0
#define KVPROF_LOST_BLOCK_UNMATCHED 1
/* A request seen again (issued, or its req reused) while we still held it as in flight: the
 * kernel skipped our completion probe, as it skips any BPF program that would run while
 * another one runs on that CPU (e.g. a completion interrupt during a submit probe). */
#define KVPROF_LOST_BLOCK_NOT_SEEN 2
#define KVPROF_LOST_URING_NOT_SEEN 3
/* An open whose record found the opens ring full: its file's I/O is not traced. */
#define KVPROF_LOST_OPEN_RINGBUF 4
/* An aggregate-tier key found its map full (user space drains it every 250 ms). */
#define KVPROF_LOST_AGG_FULL 5
#define KVPROF_NCOUNTERS 6

#ifndef KVPROF_RINGBUF_PAGES
#define KVPROF_RINGBUF_PAGES 1024
#endif
#ifndef KVPROF_START_ENTRIES
#define KVPROF_START_ENTRIES 65536
#endif

struct kvprof_io {
    u64 insert_ns;
    u64 issue_ns;
    u64 complete_ns;
    u64 sector;
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
    u8 pad[3];
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
    if (c)
        (*c)++;
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
    u64 id = bpf_get_current_pid_tgid();
    u32 tgid = id >> 32;
    if (tgid == KVPROF_SELF_TGID || !kvprof_task_allowed(tgid))
        return 0;
    e->issue_ns = bpf_ktime_get_ns();
    e->complete_ns = e->issue_ns;
    e->pid = (u32)id;
    e->tgid = tgid;
    e->cgroup_id = bpf_get_current_cgroup_id();
    bpf_get_current_comm(&e->comm, sizeof(e->comm));
    return 1;
}

/* Events go to user space through a ring buffer drained on a timer, without a wake-up per
 * event (wake-ups cost ~8 us each under virtualisation; see shared/reference/perf.md).
 * Probes never nest: the kernel skips a tracepoint program while another runs on the same
 * CPU, and capture reads those skips from the programs' recursion_misses. */
BPF_RINGBUF_OUTPUT(events, KVPROF_RINGBUF_PAGES);

static __always_inline void kvprof_emit(struct kvprof_io *e)
{
    if (events.ringbuf_output(e, sizeof(*e), BPF_RB_NO_WAKEUP) != 0)
        kvprof_count(KVPROF_LOST_RINGBUF);
}

/* ---- Aggregate tier ----------------------------------------------------------------------
 * Counts, bytes and log2 histograms per (completion second, device, phase, layer, op) in
 * per-CPU maps, and per device the time with a request in flight: exact at any I/O rate,
 * whatever the event ring and its Python consumer manage. User space drains the seconds
 * that are over (schema.IO_AGG, schema.DEVICE_BUSY). The phase is kvprof's current phase
 * (cur_phase, written by user space as marks arrive) when the request was issued. */
#define KVPROF_AGG_SLOTS 40
#define KVPROF_NS_PER_S 1000000000ULL
#ifndef KVPROF_AGG_ENTRIES
#define KVPROF_AGG_ENTRIES 16384
#endif

struct kvprof_agg_key {
    u32 sec;   /* bpf_ktime_get_ns() at completion, in whole seconds */
    u32 dev;   /* block: the device; io_uring: 0 */
    u8 phase;  /* 0: no phase marked yet; else schema.PHASES index + 1 */
    u8 layer;
    u8 op;
    u8 pad;
};

struct kvprof_agg_val {
    u64 ios;
    u64 bytes;
    u64 queue_ns;   /* insert -> issue, summed */
    u64 service_ns; /* issue -> completion, summed */
    /* Slot 0: the value 0; slot s >= 1: [2^(s-1), 2^s); the last slot also everything above. */
    u32 size[KVPROF_AGG_SLOTS];    /* bytes */
    u32 queue[KVPROF_AGG_SLOTS];   /* ns */
    u32 service[KVPROF_AGG_SLOTS]; /* ns */
};

struct kvprof_busy_key {
    u32 sec;
    u32 dev;
    u8 phase;
    u8 pad[3];
};

/* Per device: requests in flight and when busy time was last accounted (as the kernel keeps
 * io_ticks: every start and completion accounts the time since the last one as busy if a
 * request was in flight, the stamp moved by compare-and-swap so two CPUs never count the
 * same stretch). */
struct kvprof_dev_state {
    s64 inflight;
    u64 stamp;
};

BPF_PERCPU_HASH(agg, struct kvprof_agg_key, struct kvprof_agg_val, KVPROF_AGG_ENTRIES);
BPF_PERCPU_ARRAY(agg_zero, struct kvprof_agg_val, 1); /* never written: the initial value */
BPF_PERCPU_HASH(busy, struct kvprof_busy_key, u64, KVPROF_AGG_ENTRIES);
BPF_HASH(dev_state, u32, struct kvprof_dev_state, 1024);
BPF_ARRAY(cur_phase, u32, 1);

static __always_inline u8 kvprof_phase_now(void)
{
    int zero = 0;
    u32 *p = cur_phase.lookup(&zero);
    return p ? (u8)*p : 0;
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

static __always_inline void kvprof_agg(u8 layer, u8 op, u32 dev, u8 phase, u64 bytes,
                                       u64 queue_ns, u64 service_ns, u64 complete_ns)
{
    struct kvprof_agg_key k = {};
    k.sec = complete_ns / KVPROF_NS_PER_S;
    k.dev = dev;
    k.phase = phase;
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
    /* Per-CPU values: only this CPU writes this copy, and probes never nest on a CPU. */
    v->ios++;
    v->bytes += bytes;
    v->queue_ns += queue_ns;
    v->service_ns += service_ns;
    u32 s = kvprof_slot(bytes);
    if (s < KVPROF_AGG_SLOTS)
        v->size[s]++;
    s = kvprof_slot(queue_ns);
    if (s < KVPROF_AGG_SLOTS)
        v->queue[s]++;
    s = kvprof_slot(service_ns);
    if (s < KVPROF_AGG_SLOTS)
        v->service[s]++;
}

static __always_inline void kvprof_busy_add(u32 dev, u8 phase, u64 from, u64 to)
{
    /* Split at second boundaries; a stretch over 8 s (a device busy without a pause and
     * without a single completion) puts the rest in its last second. */
    for (int i = 0; i < 8; i++) {
        if (from >= to)
            break;
        u64 sec = from / KVPROF_NS_PER_S;
        u64 edge = (sec + 1) * KVPROF_NS_PER_S;
        u64 end = (to < edge || i == 7) ? to : edge;
        struct kvprof_busy_key k = {};
        k.sec = (u32)sec;
        k.dev = dev;
        k.phase = phase;
        u64 zero = 0;
        u64 *b = busy.lookup_or_try_init(&k, &zero);
        if (b)
            *b += end - from;
        else
            kvprof_count(KVPROF_LOST_AGG_FULL);
        from = end;
    }
}

/* A request starts (delta 1) or completes (delta -1) on the device at `now`. */
static __always_inline void kvprof_dev_tick(u32 dev, u64 now, s64 delta)
{
    struct kvprof_dev_state *st = dev_state.lookup(&dev);
    if (!st) {
        struct kvprof_dev_state z = {};
        z.stamp = now;
        dev_state.insert(&dev, &z); /* fails harmlessly if another CPU was first */
        st = dev_state.lookup(&dev);
        if (!st)
            return;
    }
    u64 stamp = st->stamp;
    if (now > stamp && __sync_val_compare_and_swap(&st->stamp, stamp, now) == stamp) {
        /* A completing request was in flight until now; a starting one finds the device
         * busy only if another request is in flight. */
        if (delta < 0 || st->inflight > 0)
            kvprof_busy_add(dev, kvprof_phase_now(), stamp, now);
    }
    __sync_fetch_and_add(&st->inflight, delta);
}

/* The device layers' per-I/O rows; `--no-events` leaves only the aggregate tier. */
static __always_inline void kvprof_emit_device(struct kvprof_io *e)
{
#ifndef KVPROF_NO_DEVICE_EVENTS
    kvprof_emit(e);
#endif
}

#endif /* KVPROF_H */
