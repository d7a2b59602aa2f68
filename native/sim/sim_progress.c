/* Progress: what is due becomes a completion, looked at when the application polls a CQ (no thread runs
 * behind the application's back). The target side reads its ports, the writer side its pending posts.
 * Every posted operation completes exactly once, with success or an error: an error that finds the CQ's
 * error queue full waits where it is until the application has read the queue. */
#include "sim.h"

#include <inttypes.h>
#include <string.h>

static int is_message(uint32_t kind) { return kind == SIM_KIND_SEND || kind == SIM_KIND_SEND_DATA; }

static void scatter(const struct sim_recv *r, const char *src, size_t len) {
    for (size_t i = 0; i < r->count && len; i++) {
        size_t piece = r->iov[i].iov_len < len ? r->iov[i].iov_len : len;
        memcpy(r->iov[i].iov_base, src, piece);
        src += piece;
        len -= piece;
    }
}

/* A message meets the oldest posted receive: copied into it, or an error if it does not fit. 0 when done
 * (the entry is taken), -1 when the error queue is full (tried again at a later poll). */
static int deliver(struct sim_ep *ep, struct sim_port *port, int p, struct sim_entry *e, void *buf, size_t *n) {
    struct sim_segment *seg = ep->seg;
    struct sim_recv *r = &ep->rx[ep->rx_head % SIM_RX];
    uint64_t at = e->data_at % SIM_DATA_BYTES;
    if (e->len > SIM_DATA_BYTES || at + e->len > SIM_DATA_BYTES) { /* not what a sender writes: dropped */
        e->kind = SIM_KIND_TAKEN;
        return 0;
    }
    if (e->len > r->len) {
        if (sim_cq_push_error(ep->rx_cq, r->context, FI_RECV | FI_MSG, r->len, FI_ETRUNC,
                              "message of %" PRIu64 " bytes into a %zu-byte receive", e->len, r->len) < 0)
            return -1;
    } else {
        uint64_t data = e->kind == SIM_KIND_SEND_DATA ? FI_REMOTE_CQ_DATA : 0;
        scatter(r, sim_port_data(seg, ep->slot, p) + at, e->len);
        if (r->flags & FI_COMPLETION) /* a receive posted without it, on a selective endpoint, completes silently */
            sim_cq_fill(ep->rx_cq, buf, (*n)++, r->context, FI_RECV | FI_MSG | data, e->len, NULL, data ? e->imm : 0);
    }
    ep->rx_head++;
    atomic_store_explicit(&port->data_tail, e->data_at + e->len, memory_order_release);
    e->kind = SIM_KIND_TAKEN;
    return 0;
}

/* Messages that came before any receive was posted for them, oldest first, now that receives are posted. */
static void deliver_waiting(struct sim_ep *ep, struct sim_port *port, int p, void *buf, size_t count, size_t *n) {
    struct sim_rx_port *rp = &ep->rx_ports[p];
    uint64_t tail = atomic_load_explicit(&port->tail, memory_order_relaxed);
    for (uint64_t i = tail; i != rp->scan && rp->waiting && ep->rx_head != ep->rx_tail && *n < count; i++) {
        struct sim_entry *e = &port->ring[i % SIM_RING];
        if (!is_message(e->kind)) continue;
        if (deliver(ep, port, p, e, buf, n) < 0) return;
        rp->waiting--;
    }
}

/* One port: what has landed becomes a completion. A message without a posted receive waits (RDM's
 * unexpected message) and holds back only the messages after it, never the immediate data of writes. */
static void read_port(struct sim_ep *ep, int p, void *buf, size_t count, size_t *n, uint64_t now) {
    struct sim_port *port = &ep->seg->ports[ep->slot][p];
    struct sim_rx_port *rp = &ep->rx_ports[p];
    uint64_t tail = atomic_load_explicit(&port->tail, memory_order_relaxed);
    uint64_t head = atomic_load_explicit(&port->head, memory_order_acquire);
    if (head - tail > SIM_RING) head = tail + SIM_RING; /* a head no sender writes: read no further */
    if (rp->scan - tail > head - tail) *rp = (struct sim_rx_port){.scan = tail}; /* a port claimed anew */
    if (rp->waiting) deliver_waiting(ep, port, p, buf, count, n);
    for (; rp->scan != head && *n < count; rp->scan++) {
        struct sim_entry *e = &port->ring[rp->scan % SIM_RING];
        if (e->due_ns > now) {
            if (e->due_ns < ep->rx_next_due_ns) ep->rx_next_due_ns = e->due_ns;
            break;
        }
        if (is_message(e->kind)) {
            if (rp->waiting || ep->rx_head == ep->rx_tail) {
                rp->waiting++;
                continue;
            }
            if (deliver(ep, port, p, e, buf, n) < 0) break;
        } else {
            if (e->kind == SIM_KIND_WRITE_DATA)
                sim_cq_fill(ep->rx_cq, buf, (*n)++, NULL, FI_REMOTE_WRITE | FI_RMA | FI_REMOTE_CQ_DATA, e->len,
                            NULL, e->imm);
            if (rp->waiting) e->kind = SIM_KIND_TAKEN; /* else the tail passes it right below */
        }
    }
    if (!rp->waiting) tail = rp->scan;
    while (tail != rp->scan && port->ring[tail % SIM_RING].kind == SIM_KIND_TAKEN) tail++;
    atomic_store_explicit(&port->tail, tail, memory_order_release);
    if (tail == head && atomic_load_explicit(&port->closed, memory_order_acquire)) {
        /* the sender closed and everything it sent is read: the port is free again */
        atomic_store(&port->closed, 0);
        atomic_store(&port->owner, 0);
    }
}

/* The target side, filling buf from n on. Polling is also this process's sign of life to its peers' writers
 * (sim_peer_alive_at); a poll with nothing to look at gives none (sim_cq.c: has_work), and a writer without
 * a recent one looks at the process instead. */
size_t sim_progress_rx(struct sim_ep *ep, void *buf, size_t count, size_t n, uint64_t now) {
    struct sim_segment *seg = ep->seg;
    atomic_store_explicit(&seg->polled_ns, sim_wall_ns(), memory_order_relaxed);
    ep->rx_next_due_ns = UINT64_MAX;
    for (int w = 0; w < SIM_PORT_WORDS && n < count; w++) {
        uint64_t used = atomic_load_explicit(&seg->ports_used[ep->slot][w], memory_order_acquire);
        for (; used && n < count; used &= used - 1) read_port(ep, w * 64 + __builtin_ctzll(used), buf, count, &n, now);
    }
    return n;
}

/* A failed operation's error, into the transmit CQ: 1, or 0 when the error queue is full (it waits). */
static int complete_failed(struct sim_ep *ep, struct sim_pending *t) {
    if (sim_cq_push_error(ep->tx_cq, t->context, t->flags, t->len, t->err, "%s", sim_error_text(t->err)) < 0)
        return 0;
    ep->tx_failed--;
    return 1;
}

/* One pending operation, once it is due or its peer is known gone: 1 when it completed (with success or
 * an error), 0 when it must wait (not due, the error queue is full, or a success finds buf full: an error
 * needs no room there). */
static int complete(struct sim_ep *ep, struct sim_pending *t, int sent, void *buf, size_t count, size_t *n,
                    uint64_t now) {
    if (t->err) return complete_failed(ep, t);
    struct sim_peer *peer = &ep->av->peers[t->dest];
    int removed = !peer->seg;              /* fi_av_remove'd while the operation was on its way */
    if (!sent || t->due_ns > now) {
        /* not due yet, unless the peer's process ended before these bytes could land: they never will */
        if (!removed && !sim_peer_known_dead(peer, sent ? t->left_wall_ns : sim_wall_ns())) return 0;
    } else if (!removed && sim_peer_alive_at(peer, t->left_wall_ns, sim_wall_ns())) {
        if (!(t->flags & FI_COMPLETION)) return 1;
        if (*n == count) return 0;
        sim_cq_fill(ep->tx_cq, buf, (*n)++, t->context, t->flags & (FI_RMA | FI_WRITE | FI_MSG | FI_SEND), t->len,
                    NULL, 0);
        return 1;
    }
    return sim_cq_push_error(ep->tx_cq, t->context, t->flags, t->len, FI_EHOSTUNREACH,
                             "the peer process %d was gone (closed or killed) before the %s landed", peer->pid,
                             t->kind == SIM_KIND_SEND ? "message" : "write") == 0;
}

/* No ordering promise (EFA reports none): an operation that failed (refused at its post, or unable to leave)
 * is due at once and its error goes ahead of every older operation still held by FI_MORE, waiting for the
 * line or on its way; looked for only while there is one (tx_failed). */
static void complete_failed_ones(struct sim_ep *ep) {
    for (uint64_t i = ep->tx_head; ep->tx_failed && i != ep->tx_tail; i++) {
        struct sim_pending *t = &ep->tx[i % SIM_TX];
        if (!t->err || t->done) continue;
        if (!complete_failed(ep, t)) return; /* the error queue is full: looked at again once it is read */
        t->done = 1;
    }
}

/* Likewise an operation that left completes when its acknowledgement is due, ahead of older ones still on
 * their way (to a target NIC whose receive line is busier). Looked at only once something is due
 * (next_due_ns), and past the first one not due only while a later one is due before an older one
 * (dip_at): with one target, a poll costs what it did in posting order. */
static size_t complete_due(struct sim_ep *ep, void *buf, size_t count, size_t n, uint64_t now) {
    uint64_t next = UINT64_MAX;
    for (uint64_t i = ep->tx_head; i != ep->tx_sent; i++) {
        struct sim_pending *t = &ep->tx[i % SIM_TX];
        if (t->done || t->err) continue; /* failed ones: complete_failed_ones */
        if (t->due_ns > now) {
            if (t->due_ns < next) next = t->due_ns;
            if (i >= ep->dip_at) break; /* the later ones are due no earlier */
            continue;
        }
        if (!complete(ep, t, 1, buf, count, &n, now)) { /* no room now: look again at the next poll */
            next = 0;
            break;
        }
        t->done = 1;
    }
    ep->next_due_ns = next;
    return n;
}

/* The writer side, once what is due to leave has left (sim_send_due, by the caller): failed operations and
 * those whose acknowledgement is due complete (all in posting order with FABRICLAB_SIM_ORDERED=1); the
 * oldest also when its peer is known gone. count 0 (fi_cq_readerr) completes only what needs no room in buf:
 * errors. The transmit queue frees every completed one at its head. */
/* After a poll that found nothing: the first time anything of the endpoint's is due (UINT64_MAX: nothing
 * it waits for will come by itself), for the modeled host's skip over a thread's empty polls. */
uint64_t sim_next_event(const struct sim_ep *ep, int rx, int tx) {
    uint64_t next = rx ? ep->rx_next_due_ns : UINT64_MAX;
    if (!tx || ep->tx_head == ep->tx_tail) return next;
    if (ep->tx_failed) return 0; /* an error is due at once */
    if (ep->tx_sent != ep->tx_head) {
        uint64_t due = sim_model.ordered ? ep->tx[ep->tx_head % SIM_TX].due_ns : ep->next_due_ns;
        if (due < next) next = due;
    }
    if (ep->tx_sent != ep->tx_tail) {
        uint64_t start = ep->tx[ep->tx_sent % SIM_TX].tx_start_ns; /* SIM_HELD: waits for a doorbell */
        if (start < next) next = start;
    }
    return next;
}

size_t sim_progress_tx(struct sim_ep *ep, void *buf, size_t count, size_t n, uint64_t now) {
    if (!sim_model.ordered) {
        complete_failed_ones(ep);
        if (now >= ep->next_due_ns) n = complete_due(ep, buf, count, n, now);
    }
    while (ep->tx_head != ep->tx_tail) {
        struct sim_pending *t = &ep->tx[ep->tx_head % SIM_TX];
        if (!t->done && !complete(ep, t, ep->tx_sent != ep->tx_head, buf, count, &n, now)) break;
        if (ep->tx_sent == ep->tx_head) ep->tx_sent++;
        ep->tx_head++;
    }
    return n;
}
