/* syscall: the file syscalls of the traced processes (read, write, pread64, pwrite64, readv,
 * writev, preadv, pwritev, preadv2, pwritev2, fsync, fdatasync) on regular files they opened
 * with openat. KV-offload backends do their disk I/O this way, from thread pools, and
 * buffered writes reach the device later from flush threads, so the block layer alone cannot
 * say which phase asked for what.
 *
 * Only files in file_map are traced: an openat of the traced process puts (tgid, fd) there
 * (not for paths under /dev, but /dev/shm, /proc or /sys), user space seeds it with the regular files open
 * when it attached and takes out what turns out not to be a regular file, close takes the
 * entry out. Sockets, pipes and ttys never get an entry, so they cost one lookup per call and
 * produce nothing. Each open gets a file id; rows carry it (kvprof_io.ctx), and the open
 * records in the `opens` ring name its path. */
#include "../kvprof.h"
#include "../lib/task.h"
#include "../lib/ring.h"
#include <linux/fcntl.h>
#include <linux/uio.h>

/* preadv2/pwritev2's tracepoints name their flags argument with this type (linux/fs.h). */
typedef int rwf_t;

#define KVPROF_PATH_MAX 240
#define KVPROF_IOV_MAX 8
/* kvprof_open.flags of a close and of a dup record (no open flags combination has these
 * bits all set). */
#define KVPROF_CLOSED 0xffffffff
#define KVPROF_DUP 0xfffffffe
#define KVPROF_F_DUPFD 0
#define KVPROF_F_DUPFD_CLOEXEC 1030
/* Open file ids given by user space while seeding start here; the kernel counts from 1. */
#define KVPROF_SEEDED_IDS (1ULL << 40)

struct file_key {
    u32 tgid;
    s32 fd;
};

struct file_val {
    u64 id;
    u16 flags; /* KVPROF_FL_DIRECT */
    u16 pad[3];
};

/* sys_start.pos of a call that names no offset: read, write, readv, writev, preadv2 and
 * pwritev2 at -1 (the file's own position, which user space follows per open file). */
#define KVPROF_POS_NONE 0xffffffffffffffffULL

struct sys_start {
    u64 enter_ns;
    u64 pos; /* the offset the call named (pread64, pwrite64, preadv ...), else POS_NONE */
    u64 id;
    u64 fetched; /* bytes this thread put into the page cache during the call */
    u32 asked;
    u16 flags;
    u8 op;
    u8 sysno;
};

struct open_start {
    const char *filename;
    u32 flags;
    u32 pad;
};

/* Read by OPEN_DTYPE in kvprof/capture/files.py (checked at load: open_layout). */
struct kvprof_open {
    u64 ts_ns;
    u64 id;
    u64 from_id; /* a dup record: the id of the descriptor it copies */
    u32 tgid;
    s32 fd;
    u32 flags;
    u32 pad;
    char path[KVPROF_PATH_MAX];
};

BPF_HASH(file_map, struct file_key, struct file_val, KVPROF_START_ENTRIES);
BPF_HASH(sys_start_map, u32, struct sys_start, KVPROF_START_ENTRIES);
BPF_HASH(open_start_map, u32, struct open_start, 4096);
BPF_HASH(dup_start_map, u32, s32, 4096); /* thread -> fd being duplicated */
BPF_ARRAY(file_ids, u64, 1);
/* 16 MiB, about 58k open and close records: engines that open a file per chunk access
 * open thousands a second, and the ring is drained every 20 ms. */
BPF_RINGBUF_OUTPUT(opens, 4096);
/* Never used by a program. bcc describes a map's key and value types as clang laid them out,
 * but not a ring's records: this map's value type is how capture compares OPEN_DTYPE with
 * the compiled struct at load. One entry of 280 bytes, nothing at run time. */
BPF_ARRAY(open_layout, struct kvprof_open, 1);

/* The kernel's syscall names, by the code in kvprof_io.opcode (schema.SYSCALLS). */
#define SYS_READ 0
#define SYS_PREAD64 1
#define SYS_READV 2
#define SYS_PREADV 3
#define SYS_PREADV2 4
#define SYS_WRITE 5
#define SYS_PWRITE64 6
#define SYS_WRITEV 7
#define SYS_PWRITEV 8
#define SYS_PWRITEV2 9
#define SYS_FSYNC 10
#define SYS_FDATASYNC 11

/* Bytes asked by a vector of iovecs: the first KVPROF_IOV_MAX entries (0 when there are more:
 * unknown rather than wrong). */
static __always_inline u64 iov_bytes(const struct iovec *vec, u64 vlen)
{
    if (vlen > KVPROF_IOV_MAX)
        return 0;
    u64 total = 0;
#pragma unroll
    for (int i = 0; i < KVPROF_IOV_MAX; i++) {
        if (i >= vlen)
            break;
        struct iovec v = {};
        bpf_probe_read_user(&v, sizeof(v), &vec[i]);
        total += v.iov_len;
    }
    return total;
}

/* A call on a file starts: `asked` bytes, or those of `vlen` iovecs at `vec` when vec is set
 * (read from user memory after the stamp, and only for a traced file). */
static __always_inline int sys_begin(s64 fd, u8 op, u8 sysno, u64 asked,
                                     const struct iovec *vec, u64 vlen, u64 pos)
{
    u64 now = bpf_ktime_get_ns(); /* before the file lookup: it is not the call's time */
    u64 id = bpf_get_current_pid_tgid();
    struct file_key k = {};
    k.tgid = id >> 32;
    k.fd = (s32)fd;
    struct file_val *f = file_map.lookup(&k);
    if (!f)
        return 0;
    struct sys_start s = {};
    s.enter_ns = now;
    s.pos = pos;
    s.id = f->id;
    s.flags = f->flags;
    if (vec)
        asked = iov_bytes(vec, vlen);
    s.asked = asked > 0xffffffffULL ? 0xffffffff : (u32)asked;
    s.op = op;
    s.sysno = sysno;
    u32 tid = (u32)id;
    sys_start_map.update(&tid, &s);
    return 0;
}

static __always_inline int sys_end(s64 ret)
{
    u64 now = bpf_ktime_get_ns();
    u64 id = bpf_get_current_pid_tgid();
    u32 tid = (u32)id;
    struct sys_start *s = sys_start_map.lookup(&tid);
    if (!s)
        return 0;
    struct kvprof_io e = {};
    e.issue_ns = s->enter_ns;
    e.complete_ns = now;
    e.cgroup_id = bpf_get_current_cgroup_id();
    e.ctx = s->id;
    e.bytes = ret > 0 ? (u32)ret : 0;
    e.error = ret < 0 ? (s32)ret : 0;
    e.pid = tid;
    e.tgid = id >> 32;
    e.flags = s->flags;
    e.op = s->op;
    e.opcode = s->sysno;
    e.asked = s->asked;
    e.layer = KVPROF_LAYER_SYSCALL;
    e.sector = s->fetched; /* no sector for a syscall: the slot carries what it fetched */
    e.insert_ns = s->pos;  /* and no scheduler queue: this slot carries the offset named */
    bpf_get_current_comm(&e.comm, sizeof(e.comm));
    sys_start_map.delete(&tid);
    kvprof_emit(&e);
    return 0;
}

#ifdef KVPROF_FILEMAP
/* A page a thread puts into the page cache while in a traced read call: the call missed it,
 * or read it ahead. Counted here, in the thread, rather than from the block requests that
 * fill it: those need not be the thread's own (the io controller's throttle submits the
 * bios it held back from a worker of its own). */
TRACEPOINT_PROBE(filemap, mm_filemap_add_to_page_cache)
{
    u32 tid = (u32)bpf_get_current_pid_tgid();
    struct sys_start *s = sys_start_map.lookup(&tid);
    if (s && s->op == KVPROF_OP_READ)
#ifdef KVPROF_FILEMAP_ORDER
        s->fetched += (u64)PAGE_SIZE << args->order;
#else
        s->fetched += PAGE_SIZE;
#endif
    return 0;
}
#endif

TRACEPOINT_PROBE(syscalls, sys_enter_read)
{ return sys_begin(args->fd, KVPROF_OP_READ, SYS_READ, args->count, NULL, 0, KVPROF_POS_NONE); }
TRACEPOINT_PROBE(syscalls, sys_enter_pread64)
{ return sys_begin(args->fd, KVPROF_OP_READ, SYS_PREAD64, args->count, NULL, 0, args->pos); }
TRACEPOINT_PROBE(syscalls, sys_enter_readv)
{
    return sys_begin(args->fd, KVPROF_OP_READ, SYS_READV, 0, args->vec, args->vlen,
                     KVPROF_POS_NONE);
}
TRACEPOINT_PROBE(syscalls, sys_enter_preadv)
{
    return sys_begin(args->fd, KVPROF_OP_READ, SYS_PREADV, 0, args->vec, args->vlen,
                     args->pos_l);
}
TRACEPOINT_PROBE(syscalls, sys_enter_preadv2)
{
    return sys_begin(args->fd, KVPROF_OP_READ, SYS_PREADV2, 0, args->vec, args->vlen,
                     args->pos_l);
}
TRACEPOINT_PROBE(syscalls, sys_enter_write)
{ return sys_begin(args->fd, KVPROF_OP_WRITE, SYS_WRITE, args->count, NULL, 0, KVPROF_POS_NONE); }
TRACEPOINT_PROBE(syscalls, sys_enter_pwrite64)
{ return sys_begin(args->fd, KVPROF_OP_WRITE, SYS_PWRITE64, args->count, NULL, 0, args->pos); }
TRACEPOINT_PROBE(syscalls, sys_enter_writev)
{
    return sys_begin(args->fd, KVPROF_OP_WRITE, SYS_WRITEV, 0, args->vec, args->vlen,
                     KVPROF_POS_NONE);
}
TRACEPOINT_PROBE(syscalls, sys_enter_pwritev)
{
    return sys_begin(args->fd, KVPROF_OP_WRITE, SYS_PWRITEV, 0, args->vec, args->vlen,
                     args->pos_l);
}
TRACEPOINT_PROBE(syscalls, sys_enter_pwritev2)
{
    return sys_begin(args->fd, KVPROF_OP_WRITE, SYS_PWRITEV2, 0, args->vec, args->vlen,
                     args->pos_l);
}
TRACEPOINT_PROBE(syscalls, sys_enter_fsync)
{ return sys_begin(args->fd, KVPROF_OP_FLUSH, SYS_FSYNC, 0, NULL, 0, KVPROF_POS_NONE); }
TRACEPOINT_PROBE(syscalls, sys_enter_fdatasync)
{ return sys_begin(args->fd, KVPROF_OP_FLUSH, SYS_FDATASYNC, 0, NULL, 0, KVPROF_POS_NONE); }

TRACEPOINT_PROBE(syscalls, sys_exit_read) { return sys_end(args->ret); }
TRACEPOINT_PROBE(syscalls, sys_exit_pread64) { return sys_end(args->ret); }
TRACEPOINT_PROBE(syscalls, sys_exit_readv) { return sys_end(args->ret); }
TRACEPOINT_PROBE(syscalls, sys_exit_preadv) { return sys_end(args->ret); }
TRACEPOINT_PROBE(syscalls, sys_exit_preadv2) { return sys_end(args->ret); }
TRACEPOINT_PROBE(syscalls, sys_exit_write) { return sys_end(args->ret); }
TRACEPOINT_PROBE(syscalls, sys_exit_pwrite64) { return sys_end(args->ret); }
TRACEPOINT_PROBE(syscalls, sys_exit_writev) { return sys_end(args->ret); }
TRACEPOINT_PROBE(syscalls, sys_exit_pwritev) { return sys_end(args->ret); }
TRACEPOINT_PROBE(syscalls, sys_exit_pwritev2) { return sys_end(args->ret); }
TRACEPOINT_PROBE(syscalls, sys_exit_fsync) { return sys_end(args->ret); }
TRACEPOINT_PROBE(syscalls, sys_exit_fdatasync) { return sys_end(args->ret); }

TRACEPOINT_PROBE(syscalls, sys_enter_openat)
{
    u64 id = bpf_get_current_pid_tgid();
    /* kvprof's own session files would feed back into what it records. */
    if ((id >> 32) == KVPROF_SELF_TGID || !kvprof_task_allowed(id >> 32))
        return 0;
    struct open_start o = {};
    o.filename = args->filename;
    o.flags = (u32)args->flags;
    u32 tid = (u32)id;
    open_start_map.update(&tid, &o);
    return 0;
}

TRACEPOINT_PROBE(syscalls, sys_exit_openat)
{
    u64 now = bpf_ktime_get_ns();
    u64 id = bpf_get_current_pid_tgid();
    u32 tid = (u32)id;
    struct open_start *o = open_start_map.lookup(&tid);
    if (!o)
        return 0;
    const char *filename = o->filename;
    u32 oflags = o->flags;
    open_start_map.delete(&tid);
    long fd = args->ret;
    if (fd < 0)
        return 0;
    struct kvprof_open *rec = opens.ringbuf_reserve(sizeof(struct kvprof_open));
    if (!rec) {
        kvprof_count(KVPROF_LOST_OPEN_RINGBUF);
        return 0;
    }
    bpf_probe_read_user_str(rec->path, sizeof(rec->path), filename);
    /* Device nodes, ttys and kernel interfaces are not storage the engine offloads to
     * (files in /dev/shm are: a tmpfs). */
    if (rec->path[0] == '/' && ((rec->path[1] == 'd' && rec->path[2] == 'e' &&
                                 rec->path[3] == 'v' && rec->path[4] == '/' &&
                                 !(rec->path[5] == 's' && rec->path[6] == 'h' &&
                                   rec->path[7] == 'm' && rec->path[8] == '/')) ||
                                (rec->path[1] == 'p' && rec->path[2] == 'r' &&
                                 rec->path[3] == 'o' && rec->path[4] == 'c' &&
                                 rec->path[5] == '/') ||
                                (rec->path[1] == 's' && rec->path[2] == 'y' &&
                                 rec->path[3] == 's' && rec->path[4] == '/'))) {
        opens.ringbuf_discard(rec, BPF_RB_NO_WAKEUP);
        return 0;
    }
    u32 zero = 0;
    u64 *next = file_ids.lookup(&zero);
    if (!next) {
        opens.ringbuf_discard(rec, BPF_RB_NO_WAKEUP);
        return 0;
    }
    u64 fid = __sync_fetch_and_add(next, 1) + 1;
    struct file_key k = {};
    k.tgid = id >> 32;
    k.fd = (s32)fd;
    struct file_val v = {};
    v.id = fid;
    v.flags = (oflags & O_DIRECT) ? KVPROF_FL_DIRECT : 0;
    file_map.update(&k, &v);
    rec->ts_ns = now;
    rec->id = fid;
    rec->from_id = 0;
    rec->tgid = k.tgid;
    rec->fd = k.fd;
    rec->flags = oflags;
    rec->pad = 0;
    opens.ringbuf_submit(rec, BPF_RB_NO_WAKEUP);
    return 0;
}

/* A traced file's descriptor duplicated (dup, dup2, dup3, fcntl F_DUPFD): the copy is traced
 * too, under an id of its own whose record names the id it copies (so closing one copy
 * forgets only its own name). */
static __always_inline int dup_begin(s32 oldfd)
{
    u64 id = bpf_get_current_pid_tgid();
    struct file_key k = {};
    k.tgid = id >> 32;
    k.fd = oldfd;
    if (!file_map.lookup(&k))
        return 0;
    u32 tid = (u32)id;
    dup_start_map.update(&tid, &oldfd);
    return 0;
}

static __always_inline int dup_end(long newfd)
{
    u64 now = bpf_ktime_get_ns();
    u64 id = bpf_get_current_pid_tgid();
    u32 tid = (u32)id;
    s32 *oldfd = dup_start_map.lookup(&tid);
    if (!oldfd)
        return 0;
    struct file_key k = {};
    k.tgid = id >> 32;
    k.fd = *oldfd;
    dup_start_map.delete(&tid);
    struct file_val *f = file_map.lookup(&k);
    if (newfd < 0 || !f)
        return 0;
    u32 zero = 0;
    u64 *next = file_ids.lookup(&zero);
    if (!next)
        return 0;
    struct kvprof_open *rec = opens.ringbuf_reserve(sizeof(struct kvprof_open));
    if (!rec) {
        kvprof_count(KVPROF_LOST_OPEN_RINGBUF);
        return 0;
    }
    struct file_val v = {};
    v.id = __sync_fetch_and_add(next, 1) + 1;
    v.flags = f->flags;
    rec->ts_ns = now;
    rec->id = v.id;
    rec->from_id = f->id;
    rec->tgid = k.tgid;
    rec->fd = (s32)newfd;
    rec->flags = KVPROF_DUP;
    rec->pad = 0;
    rec->path[0] = 0;
    k.fd = (s32)newfd;
    file_map.update(&k, &v);
    opens.ringbuf_submit(rec, BPF_RB_NO_WAKEUP);
    return 0;
}

TRACEPOINT_PROBE(syscalls, sys_enter_dup) { return dup_begin((s32)args->fildes); }
TRACEPOINT_PROBE(syscalls, sys_enter_dup2) { return dup_begin((s32)args->oldfd); }
TRACEPOINT_PROBE(syscalls, sys_enter_dup3) { return dup_begin((s32)args->oldfd); }
TRACEPOINT_PROBE(syscalls, sys_enter_fcntl)
{
    if (args->cmd != KVPROF_F_DUPFD && args->cmd != KVPROF_F_DUPFD_CLOEXEC)
        return 0;
    return dup_begin((s32)args->fd);
}
TRACEPOINT_PROBE(syscalls, sys_exit_dup) { return dup_end(args->ret); }
TRACEPOINT_PROBE(syscalls, sys_exit_dup2) { return dup_end(args->ret); }
TRACEPOINT_PROBE(syscalls, sys_exit_dup3) { return dup_end(args->ret); }
TRACEPOINT_PROBE(syscalls, sys_exit_fcntl) { return dup_end(args->ret); }

#ifdef KVPROF_WRITEBACK
/* Buffered writes reach the device later, from flush threads: a bio submitted while a
 * thread writes back an inode is that inode's. Each such bio is recorded with its inode
 * (requests merge bios of several inodes, so the split is by bio, not by request). */
BPF_HASH(wb_inode_map, u32, u64, 4096); /* flush thread -> inode it is writing back */

TRACEPOINT_PROBE(writeback, writeback_single_inode_start)
{
    u32 tid = (u32)bpf_get_current_pid_tgid();
    u64 ino = args->ino;
    wb_inode_map.update(&tid, &ino);
    return 0;
}

TRACEPOINT_PROBE(writeback, writeback_single_inode)
{
    u32 tid = (u32)bpf_get_current_pid_tgid();
    wb_inode_map.delete(&tid);
    return 0;
}

TRACEPOINT_PROBE(block, block_bio_queue)
{
    u64 now = bpf_ktime_get_ns();
    u32 tid = (u32)bpf_get_current_pid_tgid();
    u64 *ino = wb_inode_map.lookup(&tid);
    if (!ino)
        return 0;
    u64 v = *ino;
    if (!kvprof_dev_allowed(args->dev))
        return 0;
    struct kvprof_io e = {};
    e.issue_ns = now;
    e.complete_ns = now;
    e.sector = args->sector;
    e.bytes = args->nr_sector << 9;
    e.dev = args->dev;
    e.ctx = v;
    u64 id = bpf_get_current_pid_tgid();
    e.pid = (u32)id;
    e.tgid = id >> 32;
    e.op = KVPROF_OP_WRITE;
    e.layer = KVPROF_LAYER_WRITEBACK;
    bpf_get_current_comm(&e.comm, sizeof(e.comm));
    kvprof_emit(&e);
    return 0;
}
#endif

TRACEPOINT_PROBE(syscalls, sys_enter_close)
{
    u64 now = bpf_ktime_get_ns();
    struct file_key k = {};
    k.tgid = bpf_get_current_pid_tgid() >> 32;
    k.fd = (s32)args->fd;
    struct file_val *f = file_map.lookup(&k);
    if (!f)
        return 0;
    /* Tell user space the id is done with, so its name table stays as small as the set of
     * open files (engines open a file per chunk access). A full ring only delays that. */
    struct kvprof_open *rec = opens.ringbuf_reserve(sizeof(struct kvprof_open));
    if (rec) {
        rec->ts_ns = now;
        rec->id = f->id;
        rec->from_id = 0;
        rec->tgid = k.tgid;
        rec->fd = k.fd;
        rec->flags = KVPROF_CLOSED;
        rec->pad = 0;
        rec->path[0] = 0;
        opens.ringbuf_submit(rec, BPF_RB_NO_WAKEUP);
    }
    file_map.delete(&k);
    return 0;
}
