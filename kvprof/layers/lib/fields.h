/* Kernel struct fields at offsets from the running kernel's BTF. */
#ifndef KVPROF_FIELDS_H
#define KVPROF_FIELDS_H
#include "../kvprof.h"

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

#endif /* KVPROF_FIELDS_H */
