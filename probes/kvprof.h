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
#define KVPROF_NCOUNTERS 5

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

#endif /* KVPROF_H */
