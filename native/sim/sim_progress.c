/* Progress: what is due becomes a completion, looked at when the application polls a CQ (no thread runs
 * behind the application's back). The target side reads its ports, the writer side its pending posts. */
#include "sim.h"

#include <inttypes.h>
#include <string.h>

static void scatter(const struct sim_recv *r, const char *src, size_t len) {
    for (size_t i = 0; i < r->count && len; i++) {
        size_t piece = r->iov[i].iov_len < len ? r->iov[i].iov_len : len;
        memcpy(r->iov[i].iov_base, src, piece);
        src += piece;
        len -= piece;
    }
}

/* The target side: announcements whose last byte has landed become completions (messages need a posted
 * receive and are copied into it), from buf[n] on. */
size_t sim_progress_rx(struct sim_ep *ep, void *buf, size_t count, size_t n, uint64_t now) {
    struct sim_segment *seg = ep->domain->seg;
    struct sim_cq *cq = ep->rx_cq;
    uint64_t used = atomic_load_explicit(&seg->ports_used[ep->slot], memory_order_acquire);
    while (used && n < count) {
        int p = __builtin_ctzll(used);
        used &= used - 1;
        struct sim_port *port = &seg->ports[ep->slot][p];
        uint64_t tail = atomic_load_explicit(&port->tail, memory_order_relaxed);
        uint64_t head = atomic_load_explicit(&port->head, memory_order_acquire);
        while (tail != head && n < count) {
            struct sim_entry *e = &port->ring[tail % SIM_RING];
            if (e->due_ns > now) break;
            if (e->kind != SIM_KIND_WRITE_DATA) {
                uint64_t data_flag = e->kind == SIM_KIND_SEND_DATA ? FI_REMOTE_CQ_DATA : 0;
                if (ep->rx_head == ep->rx_tail) break; /* no receive posted: the message waits */
                struct sim_recv *r = &ep->rx[ep->rx_head++ % SIM_RX];
                if (e->len > r->len) {
                    sim_cq_push_error(cq, r->context, FI_RECV | FI_MSG, r->len, FI_ETRUNC,
                                      "message of %" PRIu64 " bytes into a %zu-byte receive", e->len, r->len);
                } else {
                    scatter(r, sim_port_data(seg, ep->slot, p) + e->data_off, e->len);
                    if (r->flags & FI_COMPLETION)
                        sim_cq_fill(cq, buf, n++, r->context, FI_RECV | FI_MSG | data_flag, e->len, NULL,
                                    data_flag ? e->imm : 0);
                }
                atomic_store_explicit(&port->data_tail, e->data_off + e->len, memory_order_release);
            } else {
                sim_cq_fill(cq, buf, n++, NULL, FI_REMOTE_WRITE | FI_RMA | FI_REMOTE_CQ_DATA, e->len, NULL, e->imm);
            }
            tail++;
        }
        atomic_store_explicit(&port->tail, tail, memory_order_release);
        if (tail == head && atomic_load_explicit(&port->closed, memory_order_acquire)) {
            /* the sender closed and everything it sent is read: the port is free again */
            atomic_store(&port->closed, 0);
            atomic_store(&port->owner, 0);
        }
    }
    return n;
}

/* The writer side: operations whose acknowledgement is due complete, in posting order. */
size_t sim_progress_tx(struct sim_ep *ep, void *buf, size_t count, size_t n, uint64_t now) {
    while (ep->tx_head != ep->tx_tail && n < count) {
        struct sim_pending *t = &ep->tx[ep->tx_head % SIM_TX];
        if (t->err) {
            sim_cq_push_error(ep->tx_cq, t->context, t->flags, t->len, t->err, "%s", strerror(t->err));
        } else {
            if (t->due_ns > now) break;
            struct sim_peer *peer = &ep->av->peers[t->dest];
            if (sim_peer_dead(peer, now)) {
                sim_cq_push_error(ep->tx_cq, t->context, t->flags, t->len, FI_EHOSTUNREACH,
                                  "the peer process %d is gone (closed or killed)", peer->pid);
            } else if (t->flags & FI_COMPLETION) {
                sim_cq_fill(ep->tx_cq, buf, n++, t->context, t->flags & (FI_RMA | FI_WRITE | FI_MSG | FI_SEND), t->len,
                            NULL, 0);
            }
        }
        ep->tx_head++;
    }
    return n;
}
