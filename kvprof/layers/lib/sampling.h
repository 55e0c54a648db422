/* The event tier's sampling of the device layers' rows. */
#ifndef KVPROF_SAMPLING_H
#define KVPROF_SAMPLING_H
#include "../kvprof.h"
#include "ring.h"
#include "inflight.h"

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

/* The device layers' per-I/O rows: those sampling kept (`--no-events`: none). */
static __always_inline void kvprof_emit_device(struct kvprof_io *e)
{
#ifndef KVPROF_NO_DEVICE_EVENTS
    if (!(e->flags & KVPROF_FL_UNSAMPLED))
        kvprof_emit(e);
#endif
}

#endif /* KVPROF_SAMPLING_H */
