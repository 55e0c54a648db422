/* The event ring: records to user space in per-CPU batches. */
#ifndef KVPROF_RING_H
#define KVPROF_RING_H
#include "../kvprof.h"
#include "task.h"

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

#endif /* KVPROF_RING_H */
