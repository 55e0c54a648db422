/* tcp: bytes the traced processes send to and receive from TCP peers (sock_send_length /
 * sock_recv_length), so KV stores across the network (Mooncake-style pools, NFS and
 * NVMe-oF over TCP from user space) are not invisible. The peer of each socket is learnt
 * when its connection is established (inet_sock_set_state); sockets connected before kvprof
 * attached have no known peer. RDMA (and GPUDirect over RDMA) moves data without the kernel's
 * socket layer: nothing here sees it. */
#include "../kvprof.h"
#include "../lib/task.h"
#include "../lib/ring.h"

#define KVPROF_TCP_ESTABLISHED 1
#define KVPROF_TCP_CLOSE 7
#define KVPROF_IPPROTO_TCP 6
#define KVPROF_AF_INET 2

struct tcp_peer {
    u64 addr_port; /* IPv4: address << 16 | port; IPv6: port only */
    u16 family;
    u8 pad[6];
};

BPF_HASH(tcp_peer_map, u64, struct tcp_peer, KVPROF_START_ENTRIES);

TRACEPOINT_PROBE(sock, inet_sock_set_state)
{
    if (args->protocol != KVPROF_IPPROTO_TCP)
        return 0;
    u64 sk = (u64)args->skaddr;
    if (args->newstate == KVPROF_TCP_CLOSE) {
        tcp_peer_map.delete(&sk);
        return 0;
    }
    if (args->newstate != KVPROF_TCP_ESTABLISHED)
        return 0;
    struct tcp_peer p = {};
    p.family = args->family;
    u64 port = args->dport;
    if (args->family == KVPROF_AF_INET) {
        u32 a = 0;
        __builtin_memcpy(&a, args->daddr, 4);
        p.addr_port = ((u64)a << 16) | port;
    } else {
        p.addr_port = port;
    }
    tcp_peer_map.update(&sk, &p);
    return 0;
}

static __always_inline int tcp_bytes(u64 sk, int protocol, int ret, u8 op)
{
    /* Read before the stamp (kvprof_task_row): only the tracepoint's own arguments. */
    if (protocol != KVPROF_IPPROTO_TCP || ret <= 0)
        return 0;
    struct kvprof_io e = {};
    if (!kvprof_task_row(&e))
        return 0;
    e.bytes = ret;
    e.ctx = sk;
    struct tcp_peer *p = tcp_peer_map.lookup(&sk);
    if (p) {
        e.sector = p->addr_port;
        e.opcode = (u8)p->family;
    }
    e.op = op;
    e.layer = KVPROF_LAYER_TCP;
    kvprof_emit(&e);
    return 0;
}

TRACEPOINT_PROBE(sock, sock_send_length)
{ return tcp_bytes((u64)args->sk, args->protocol, args->ret, KVPROF_OP_WRITE); }

TRACEPOINT_PROBE(sock, sock_recv_length)
{ return tcp_bytes((u64)args->sk, args->protocol, args->ret, KVPROF_OP_READ); }
