/* What the probes and user space share: the codes and the event record. User space reads
 * the structs through numpy dtypes (EVENT_DTYPE and the others in kvprof/capture/) and the
 * codes by number; capture checks both against the compiled C at load, field by field
 * (kvprof/capture/layout.py). The probes' library is in lib/, one header a concern; capture
 * puts this header and lib/ (LIBRARY in kvprof/capture/ebpf.py) in front of the probes. */
#ifndef KVPROF_H
#define KVPROF_H

/* KVPROF_LAYER_<NAME>, each layer's `layer` byte, is given by capture from the layer's
 * descriptor (-D; kvprof/layers/). */
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

/* The event ring's entry: a batch of records (lib/ring.h). */
#ifndef KVPROF_BATCH
#define KVPROF_BATCH 32
#endif

struct kvprof_batch {
    u32 n;      /* records in use */
    u32 in_use; /* a program on this CPU is adding to it now */
    u64 pad;
    struct kvprof_io rec[KVPROF_BATCH];
};

#endif /* KVPROF_H */
