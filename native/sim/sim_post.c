/* The post paths: writes, writes with immediate data, sends and receives (fi_msg and fi_rma operations). */
#include "sim.h"

#include <errno.h>
#include <string.h>
#include <sys/uio.h>

static size_t iov_bytes(const struct iovec *iov, size_t count) {
    size_t len = 0;
    for (size_t i = 0; i < count; i++) len += iov[i].iov_len;
    return len;
}

static void gather(char *dst, const struct iovec *iov, size_t count) {
    for (size_t i = 0; i < count; i++) {
        memcpy(dst, iov[i].iov_base, iov[i].iov_len);
        dst += iov[i].iov_len;
    }
}

/* Queue an error completion for a post the remote NIC (or this one) refuses: due at once (sim_progress_tx). */
static ssize_t refuse(struct sim_ep *ep, void *context, uint64_t flags, size_t len, int err) {
    if (ep->tx_tail - ep->tx_head >= SIM_TX) return -FI_EAGAIN;
    ep->tx[ep->tx_tail++ % SIM_TX] = (struct sim_pending){.context = context, .flags = flags | FI_COMPLETION,
                                                          .len = len, .err = err};
    ep->tx_failed++;
    return 0;
}

/* What the target NIC checks before it lets a write into memory: 0 or the error it answers. */
static int check_remote(struct sim_peer *peer, uint64_t raddr, size_t len, uint64_t key) {
    struct sim_mr_slot *s = sim_mr_find(peer->seg, key);
    if (!s) return FI_EKEYREJECTED;
    if (!(s->access & FI_REMOTE_WRITE)) return FI_EACCES;
    if (raddr < s->addr || raddr + len > s->addr + s->len || raddr + len < raddr) return FI_EFAULT;
    return 0;
}

/* A message or immediate datum needs room in our port at the peer's endpoint: its ring entry (and a
 * message its bytes, copied now, as the NIC reads the buffer when it is posted). 0, -FI_EAGAIN while the
 * target has not read enough, or -FI_ENOSPC when its endpoint already hears as many senders as it can. */
static int take_port_room(struct sim_ep *ep, struct sim_pending *t, fi_addr_t dest, const struct iovec *iov,
                          size_t count) {
    struct sim_peer *peer = &ep->av->peers[dest];
    if (!sim_port_of(ep, dest)) {
        int rc = sim_claim_port(ep, dest);
        if (rc) return rc;
    }
    struct sim_port *port = sim_port_of(ep, dest);
    if (port->posted - atomic_load_explicit(&port->tail, memory_order_acquire) >= SIM_RING) return -FI_EAGAIN;
    if (t->kind == SIM_KIND_SEND) {
        int64_t at = sim_reserve_data(port, t->len);
        if (at < 0) return -FI_EAGAIN;
        gather(sim_port_data(peer->seg, peer->slot, ep->port_of[dest] - 1) + at % SIM_DATA_BYTES, iov, count);
        t->data_at = (uint64_t)at;
    }
    port->posted++;
    return 0;
}

/* The operation's first byte leaves this NIC: it takes the target's receive line (in the order of arrival
 * there) and, if it announces anything, its entry is published in our port. */
static void leave(struct sim_ep *ep, struct sim_pending *t) {
    struct sim_peer *peer = &ep->av->peers[t->dest];
    t->left_wall_ns = sim_wall_ns();
    if (!peer->seg || sim_peer_known_dead(peer, t->left_wall_ns)) { /* removed, or gone before the bytes left */
        t->err = FI_EHOSTUNREACH;
        ep->tx_failed++;
        return;
    }
    t->landed_ns = sim_occupy_rx(peer, t->len, t->tx_start_ns);
    if (t->announce) {
        struct sim_port *port = &peer->seg->ports[peer->slot][ep->port_of[t->dest] - 1]; /* claimed at post */
        uint64_t head = atomic_load_explicit(&port->head, memory_order_relaxed);
        uint32_t kind = t->kind == SIM_KIND_SEND && (t->flags & FI_REMOTE_CQ_DATA) ? SIM_KIND_SEND_DATA
                                                                                   : (uint32_t)t->kind;
        port->ring[head % SIM_RING] = (struct sim_entry){.due_ns = t->landed_ns, .len = t->len, .data_at = t->data_at,
                                                         .kind = kind, .imm = t->imm};
        atomic_store_explicit(&port->head, head + 1, memory_order_release);
    }
    t->due_ns = t->landed_ns + sim_model.latency_ns;
    if (t->due_ns < ep->last_due_ns) { /* acknowledged before an older operation */
        if (sim_model.ordered) t->due_ns = ep->last_due_ns; /* FABRICLAB_SIM_ORDERED: it waits for that one */
        else ep->dip_at = ep->tx_sent;                      /* t is ep->tx[tx_sent] (sim_send_due) */
    }
    if (t->due_ns > ep->last_due_ns) ep->last_due_ns = t->due_ns;
    if (t->due_ns < ep->next_due_ns) ep->next_due_ns = t->due_ns;
}

/* Operations whose first byte has left the NIC by `now` go on the wire, in posting order. */
void sim_send_due(struct sim_ep *ep, uint64_t now) {
    for (; ep->tx_sent != ep->tx_tail; ep->tx_sent++) {
        struct sim_pending *t = &ep->tx[ep->tx_sent % SIM_TX];
        if (t->err) continue;
        if (t->tx_start_ns > now) break;
        leave(ep, t);
    }
}

/* Queue the operation behind the doorbell. It needs no time: only the doorbell (ring_doorbell) puts operations on
 * the line, at the time its caller read, so a post with FI_MORE reads no clock. */
static ssize_t post(struct sim_ep *ep, int kind, const struct iovec *iov, size_t count, fi_addr_t dest, uint64_t raddr,
                    uint64_t key, uint64_t data, void *context, uint64_t flags) {
    /* FI_REMOTE_CQ_DATA rides along: a send with it announces a message with immediate data */
    uint64_t op_flags = (kind == SIM_KIND_SEND ? FI_MSG | FI_SEND : FI_RMA | FI_WRITE) |
                        (flags & (FI_COMPLETION | FI_REMOTE_CQ_DATA));
    size_t len = iov_bytes(iov, count);
    if (!ep->enabled) return -FI_EOPBADSTATE;
    if (dest >= (fi_addr_t)atomic_load_explicit(&ep->av->count, memory_order_acquire)) return -FI_EINVAL;
    struct sim_peer *peer = &ep->av->peers[dest];
    if (!peer->seg) return peer->gone ? refuse(ep, context, op_flags, len, FI_EHOSTUNREACH) : -FI_EINVAL; /* removed */
    if (ep->tx_tail - ep->tx_head >= SIM_TX) return -FI_EAGAIN;
    /* found gone: its last sign of life came before that look, so before this post */
    if (atomic_load_explicit(&peer->dead_after_ns, memory_order_relaxed))
        return refuse(ep, context, op_flags, len, FI_EHOSTUNREACH);
    if (kind == SIM_KIND_SEND && len > SIM_DATA_BYTES) return -FI_EMSGSIZE;
    int err = kind == SIM_KIND_SEND ? 0 : check_remote(peer, raddr, len, key);
    if (err) return refuse(ep, context, op_flags, len, err);
    struct sim_pending t = {.context = context, .flags = op_flags, .len = len, .dest = (uint32_t)dest,
                            .imm = (uint32_t)data, .kind = kind,
                            .announce = kind == SIM_KIND_SEND || (flags & FI_REMOTE_CQ_DATA)};
    if (t.announce) {
        int rc = take_port_room(ep, &t, dest, iov, count);
        if (rc == -FI_ENOSPC) return refuse(ep, context, op_flags, len, FI_ENOSPC);
        /* a full port whose target is gone is an error, not -FI_EAGAIN for ever */
        if (rc) {
            uint64_t now = sim_wall_ns();
            return sim_peer_alive_at(peer, now, now) ? rc : refuse(ep, context, op_flags, len, FI_EHOSTUNREACH);
        }
    }
    if (kind != SIM_KIND_SEND && sim_model.payload && len) {
        struct iovec remote = {(void *)(uintptr_t)raddr, len};
        if (process_vm_writev(peer->pid, iov, count, &remote, 1, 0) != (ssize_t)len) {
            if (t.announce) sim_port_of(ep, dest)->posted--; /* the entry it had room for never comes */
            return refuse(ep, context, op_flags, len, errno == EPERM ? FI_EPERM : FI_EIO);
        }
    }
    t.tx_start_ns = SIM_HELD; /* it takes the line when the doorbell rings (ring_doorbell) */
    ep->tx[ep->tx_tail++ % SIM_TX] = t;
    return 0;
}

/* First contact: before the first write to a peer leaves this endpoint, a handshake goes there and back (two
 * latencies), as efa RDM's with a new peer; the write leaves no earlier. Messages go at once (EFA's eager
 * messages carry the sender's address and need no handshake). The model's transmit line serves in posting
 * order, so what is posted behind that write on the NIC waits with it, once per endpoint pair. */
static uint64_t first_contact(struct sim_ep *ep, const struct sim_pending *t, uint64_t now) {
    if (t->kind != SIM_KIND_WRITE_DATA) return now;
    uint64_t *met = &ep->met_ns[t->dest];
    if (!*met) *met = now + 2 * sim_model.latency_ns;
    return *met > now ? *met : now;
}

/* FI_MORE holds the doorbell, as on EFA's write path: an operation posted with it waits in the NIC's queue,
 * not on the line, until a transmit post without it is taken on this endpoint; then every waiting one takes
 * the transmit line, in posting order. A run of FI_MORE posts never followed by one without it never leaves
 * (the flush an engine forgets hangs here as on a p5). */
static void ring_doorbell(struct sim_ep *ep, uint64_t now) {
    if (ep->tx_held < ep->tx_head) ep->tx_held = ep->tx_head; /* held ones completed with an error (peer gone) */
    for (; ep->tx_held != ep->tx_tail; ep->tx_held++) {
        struct sim_pending *t = &ep->tx[ep->tx_held % SIM_TX];
        if (!t->err) t->tx_start_ns = sim_occupy_tx(ep->domain, t->len, first_contact(ep, t, now));
    }
    /* In modeled time each thread has its own clock, and a thread that shares the transmit line may have
     * booked it far ahead of this one's clock: what the doorbell rang goes on the wire at once, at the start
     * the line gave it (a target reads it only once due), so that it never waits for a poll that may not come. */
    sim_send_due(ep, sim_model.wall ? now : UINT64_MAX);
}

static ssize_t locked_post(struct fid_ep *fid, int kind, const struct iovec *iov, size_t count, fi_addr_t dest,
                           uint64_t raddr, uint64_t key, uint64_t data, void *context, uint64_t flags) {
    struct sim_ep *ep = (struct sim_ep *)fid;
    if (count > SIM_IOV || (count && !iov)) return -FI_EINVAL; /* iov_limit */
    if ((flags & FI_INJECT) && iov_bytes(iov, count) > SIM_INJECT) return -FI_EMSGSIZE;
    sim_enter();
    sim_ep_lock(ep);
    /* the doorbell's time is the call's start plus the post's own modeled cost: a payload's copy
     * (FABRICLAB_SIM_PAYLOAD) is the NIC's DMA, which costs the host nothing */
    ssize_t rc = post(ep, kind, iov, count, dest, raddr, key, data, context, flags);
    int rang = rc == 0 && !(flags & FI_MORE);
    sim_charge_post(ep->nic, rc, rang);
    if (rang) ring_doorbell(ep, sim_now_ns());
    sim_ep_unlock(ep);
    sim_leave();
    return rc;
}

/* An operation completes unless the endpoint was bound with FI_SELECTIVE_COMPLETION and it was posted without
 * FI_COMPLETION (fi_endpoint(3)); calls without flags use the endpoint's (its info's tx/rx op_flags). */
static uint64_t tx_flags(struct fid_ep *fid, uint64_t flags) {
    struct sim_ep *ep = (struct sim_ep *)fid;
    return ep->tx_selective ? flags : flags | FI_COMPLETION;
}

static uint64_t tx_default(struct fid_ep *fid) { return tx_flags(fid, ((struct sim_ep *)fid)->tx_op_flags); }

/* ------------------------------------------------------------------------------------------- RMA */

static ssize_t ep_writemsg(struct fid_ep *fid, const struct fi_msg_rma *msg, uint64_t flags) {
    if (!msg || msg->iov_count > SIM_IOV || msg->rma_iov_count != 1 ||
        iov_bytes(msg->msg_iov, msg->iov_count) != msg->rma_iov[0].len)
        return -FI_EINVAL; /* rma_iov_limit 1: one contiguous remote piece, as long as the local ones together */
    return locked_post(fid, SIM_KIND_WRITE_DATA, msg->msg_iov, msg->iov_count, msg->addr, msg->rma_iov[0].addr,
                       msg->rma_iov[0].key, msg->data, msg->context, tx_flags(fid, flags));
}

static ssize_t ep_writev(struct fid_ep *fid, const struct iovec *iov, void **desc, size_t count, fi_addr_t dest,
                         uint64_t addr, uint64_t key, void *context) {
    return locked_post(fid, SIM_KIND_WRITE_DATA, iov, count, dest, addr, key, 0, context, tx_default(fid));
}

static ssize_t ep_write(struct fid_ep *fid, const void *buf, size_t len, void *desc, fi_addr_t dest, uint64_t addr,
                        uint64_t key, void *context) {
    struct iovec iov = {(void *)buf, len};
    return ep_writev(fid, &iov, &desc, 1, dest, addr, key, context);
}

static ssize_t ep_writedata(struct fid_ep *fid, const void *buf, size_t len, void *desc, uint64_t data,
                            fi_addr_t dest, uint64_t addr, uint64_t key, void *context) {
    struct iovec iov = {(void *)buf, len};
    return locked_post(fid, SIM_KIND_WRITE_DATA, &iov, 1, dest, addr, key, data, context,
                       tx_default(fid) | FI_REMOTE_CQ_DATA);
}

/* Injects never complete (fi_rma(3)); a refused one still reports its error. */
static ssize_t ep_inject_write(struct fid_ep *fid, const void *buf, size_t len, fi_addr_t dest, uint64_t addr,
                               uint64_t key) {
    struct iovec iov = {(void *)buf, len};
    return locked_post(fid, SIM_KIND_WRITE_DATA, &iov, 1, dest, addr, key, 0, NULL, FI_INJECT);
}

static ssize_t ep_inject_writedata(struct fid_ep *fid, const void *buf, size_t len, uint64_t data, fi_addr_t dest,
                                   uint64_t addr, uint64_t key) {
    struct iovec iov = {(void *)buf, len};
    return locked_post(fid, SIM_KIND_WRITE_DATA, &iov, 1, dest, addr, key, data, NULL, FI_INJECT | FI_REMOTE_CQ_DATA);
}

/* ------------------------------------------------------------------------------------------- MSG */

static ssize_t ep_sendmsg(struct fid_ep *fid, const struct fi_msg *msg, uint64_t flags) {
    return locked_post(fid, SIM_KIND_SEND, msg->msg_iov, msg->iov_count, msg->addr, 0, 0, msg->data, msg->context,
                       tx_flags(fid, flags));
}

static ssize_t ep_sendv(struct fid_ep *fid, const struct iovec *iov, void **desc, size_t count, fi_addr_t dest,
                        void *context) {
    return locked_post(fid, SIM_KIND_SEND, iov, count, dest, 0, 0, 0, context, tx_default(fid));
}

static ssize_t ep_send(struct fid_ep *fid, const void *buf, size_t len, void *desc, fi_addr_t dest, void *context) {
    struct iovec iov = {(void *)buf, len};
    return ep_sendv(fid, &iov, &desc, 1, dest, context);
}

static ssize_t ep_senddata(struct fid_ep *fid, const void *buf, size_t len, void *desc, uint64_t data, fi_addr_t dest,
                           void *context) {
    struct iovec iov = {(void *)buf, len};
    return locked_post(fid, SIM_KIND_SEND, &iov, 1, dest, 0, 0, data, context, tx_default(fid) | FI_REMOTE_CQ_DATA);
}

static ssize_t ep_inject(struct fid_ep *fid, const void *buf, size_t len, fi_addr_t dest) {
    struct iovec iov = {(void *)buf, len};
    return locked_post(fid, SIM_KIND_SEND, &iov, 1, dest, 0, 0, 0, NULL, FI_INJECT);
}

static ssize_t ep_inject_senddata(struct fid_ep *fid, const void *buf, size_t len, uint64_t data, fi_addr_t dest) {
    struct iovec iov = {(void *)buf, len};
    return locked_post(fid, SIM_KIND_SEND, &iov, 1, dest, 0, 0, data, NULL, FI_INJECT | FI_REMOTE_CQ_DATA);
}

static ssize_t ep_recvmsg(struct fid_ep *fid, const struct fi_msg *msg, uint64_t flags) {
    struct sim_ep *ep = (struct sim_ep *)fid;
    if (!ep->enabled) return -FI_EOPBADSTATE;
    if (msg->iov_count > SIM_IOV) return -FI_EINVAL;
    struct sim_recv r = {.count = msg->iov_count, .len = iov_bytes(msg->msg_iov, msg->iov_count),
                         .context = msg->context, .flags = ep->rx_selective ? flags : flags | FI_COMPLETION};
    memcpy(r.iov, msg->msg_iov, msg->iov_count * sizeof *msg->msg_iov);
    sim_ep_lock(ep);
    ssize_t rc = -FI_EAGAIN;
    if (ep->rx_tail - ep->rx_head < SIM_RX) {
        ep->rx[ep->rx_tail++ % SIM_RX] = r;
        rc = 0;
    }
    sim_ep_unlock(ep);
    return rc;
}

static ssize_t ep_recvv(struct fid_ep *fid, const struct iovec *iov, void **desc, size_t count, fi_addr_t src,
                        void *context) {
    struct fi_msg msg = {.msg_iov = iov, .desc = desc, .iov_count = count, .addr = src, .context = context};
    return ep_recvmsg(fid, &msg, ((struct sim_ep *)fid)->rx_op_flags);
}

static ssize_t ep_recv(struct fid_ep *fid, void *buf, size_t len, void *desc, fi_addr_t src, void *context) {
    struct iovec iov = {buf, len};
    return ep_recvv(fid, &iov, &desc, 1, src, context);
}

struct fi_ops_msg sim_msg_ops = {.size = sizeof(struct fi_ops_msg), .recv = ep_recv, .recvv = ep_recvv,
                                 .recvmsg = ep_recvmsg, .send = ep_send, .sendv = ep_sendv, .sendmsg = ep_sendmsg,
                                 .inject = ep_inject, .senddata = ep_senddata, .injectdata = ep_inject_senddata};
struct fi_ops_rma sim_rma_ops = {.size = sizeof(struct fi_ops_rma), .read = sim_no_read, .readv = sim_no_readv,
                                 .readmsg = sim_no_readmsg, .write = ep_write, .writev = ep_writev,
                                 .writemsg = ep_writemsg, .inject = ep_inject_write, .writedata = ep_writedata,
                                 .injectdata = ep_inject_writedata};
