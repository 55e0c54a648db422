/* Loss counters, the filters user space fills, and a row for the current task. */
#ifndef KVPROF_TASK_H
#define KVPROF_TASK_H
#include "../kvprof.h"

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

#endif /* KVPROF_TASK_H */
