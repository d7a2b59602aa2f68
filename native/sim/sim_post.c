/* The post paths: writes, writes with immediate data, sends and receives (fi_msg and fi_rma operations). */
#include "sim.h"

#include <errno.h>
#include <string.h>
#include <sys/uio.h>

/* Queue an error completion for a post the remote NIC (or this one) refuses. */
static ssize_t refuse(struct sim_ep *ep, void *context, uint64_t flags, size_t len, int err) {
    if (ep->tx_tail - ep->tx_head >= SIM_TX) return -FI_EAGAIN;
    ep->tx[ep->tx_tail++ % SIM_TX] = (struct sim_pending){.context = context, .flags = flags | FI_COMPLETION,
                                                          .len = len, .err = err};
    return 0;
}

/* What the target NIC checks before it lets a write into memory: 0 or the error it answers. */
static int check_remote(struct sim_peer *peer, uint64_t raddr, size_t len, uint64_t key) {
    uint64_t slot = key & 0xffffffffu;
    struct sim_mr_slot *s = slot < SIM_MRS ? &peer->seg->mrs[slot] : NULL;
    if (!s || atomic_load_explicit(&s->key, memory_order_acquire) != key) return FI_EKEYREJECTED;
    if (!(s->access & FI_REMOTE_WRITE)) return FI_EACCES;
    if (raddr < s->addr || raddr + len > s->addr + s->len || raddr + len < raddr) return FI_EFAULT;
    return 0;
}

/* A message or immediate datum needs room in our port at the peer's endpoint: its ring entry (and a
 * message its bytes, copied now, as the NIC reads the buffer when it is posted). 0, -FI_EAGAIN while the
 * target has not read enough, or -FI_ENOSPC when its endpoint already hears as many senders as it can. */
static int take_port_room(struct sim_ep *ep, struct sim_pending *t, fi_addr_t dest, const void *buf) {
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
        memcpy(sim_port_data(peer->seg, peer->slot, ep->port_of[dest] - 1) + at % SIM_DATA_BYTES, buf, t->len);
        t->data_at = (uint64_t)at;
    }
    port->posted++;
    return 0;
}

/* The operation's first byte leaves this NIC: it takes the target's receive line (in the order of arrival
 * there) and, if it announces anything, its entry is published in our port. */
static void leave(struct sim_ep *ep, struct sim_pending *t) {
    struct sim_peer *peer = &ep->av->peers[t->dest];
    if (!peer->seg || sim_peer_known_dead(peer, t->tx_start_ns)) { /* removed, or gone before the bytes left */
        t->err = FI_EHOSTUNREACH;
        return;
    }
    t->landed_ns = sim_occupy_rx(peer, t->len, t->tx_start_ns);
    if (t->announce) {
        struct sim_port *port = &peer->seg->ports[peer->slot][ep->port_of[t->dest] - 1]; /* claimed at post */
        uint64_t head = atomic_load_explicit(&port->head, memory_order_relaxed);
        port->ring[head % SIM_RING] = (struct sim_entry){.due_ns = t->landed_ns, .len = t->len, .data_at = t->data_at,
                                                         .kind = (uint32_t)t->kind, .imm = t->imm};
        atomic_store_explicit(&port->head, head + 1, memory_order_release);
    }
    t->due_ns = t->landed_ns + sim_model.latency_ns;
    if (t->due_ns < ep->last_due_ns) t->due_ns = ep->last_due_ns;
    ep->last_due_ns = t->due_ns;
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

static ssize_t post(struct sim_ep *ep, int kind, const void *buf, size_t len, fi_addr_t dest, uint64_t raddr,
                    uint64_t key, uint64_t data, void *context, uint64_t flags) {
    uint64_t op_flags = (kind == SIM_KIND_SEND ? FI_MSG | FI_SEND : FI_RMA | FI_WRITE) | (flags & FI_COMPLETION);
    if (!ep->enabled) return -FI_EOPBADSTATE;
    if (dest >= (fi_addr_t)ep->av->count || !ep->av->peers[dest].seg) return -FI_EINVAL;
    struct sim_peer *peer = &ep->av->peers[dest];
    if (ep->tx_tail - ep->tx_head >= SIM_TX) return -FI_EAGAIN;
    uint64_t now = sim_now_ns();
    if (sim_peer_known_dead(peer, now)) return refuse(ep, context, op_flags, len, FI_EHOSTUNREACH);
    if (kind == SIM_KIND_SEND && len > SIM_DATA_BYTES) return -FI_EMSGSIZE;
    int err = kind == SIM_KIND_SEND ? 0 : check_remote(peer, raddr, len, key);
    if (err) return refuse(ep, context, op_flags, len, err);
    struct sim_pending t = {.context = context, .flags = op_flags, .len = len, .dest = (uint32_t)dest,
                            .imm = (uint32_t)data, .kind = kind,
                            .announce = kind == SIM_KIND_SEND || (flags & FI_REMOTE_CQ_DATA)};
    if (t.announce) {
        int rc = take_port_room(ep, &t, dest, buf);
        if (rc == -FI_ENOSPC) return refuse(ep, context, op_flags, len, FI_ENOSPC);
        /* a full port whose target is gone is an error, not -FI_EAGAIN for ever */
        if (rc) return sim_peer_alive_at(peer, now, now) ? rc : refuse(ep, context, op_flags, len, FI_EHOSTUNREACH);
    }
    if (kind != SIM_KIND_SEND && sim_model.payload && len) {
        struct iovec local = {(void *)buf, len}, remote = {(void *)(uintptr_t)raddr, len};
        if (process_vm_writev(peer->pid, &local, 1, &remote, 1, 0) != (ssize_t)len) {
            if (t.announce) sim_port_of(ep, dest)->posted--; /* the entry it had room for never comes */
            return refuse(ep, context, op_flags, len, errno == EPERM ? FI_EPERM : FI_EIO);
        }
    }
    t.tx_start_ns = sim_occupy_tx(ep->domain, len, now);
    ep->tx[ep->tx_tail++ % SIM_TX] = t;
    sim_send_due(ep, now);
    return 0;
}

static ssize_t locked_post(struct fid_ep *fid, int kind, const void *buf, size_t len, fi_addr_t dest, uint64_t raddr,
                           uint64_t key, uint64_t data, void *context, uint64_t flags) {
    struct sim_ep *ep = (struct sim_ep *)fid;
    sim_ep_lock(ep);
    ssize_t rc = post(ep, kind, buf, len, dest, raddr, key, data, context, flags);
    sim_ep_unlock(ep);
    return rc;
}

/* ------------------------------------------------------------------------------------------- RMA */

static ssize_t ep_writemsg(struct fid_ep *fid, const struct fi_msg_rma *msg, uint64_t flags) {
    if (msg->iov_count != 1 || msg->rma_iov_count != 1 || msg->msg_iov[0].iov_len != msg->rma_iov[0].len)
        return -FI_EINVAL; /* one contiguous piece each side, as fabriclab posts them */
    return locked_post(fid, SIM_KIND_WRITE_DATA, msg->msg_iov[0].iov_base, msg->msg_iov[0].iov_len, msg->addr,
                       msg->rma_iov[0].addr, msg->rma_iov[0].key, msg->data, msg->context, flags);
}

static ssize_t ep_write(struct fid_ep *fid, const void *buf, size_t len, void *desc, fi_addr_t dest, uint64_t addr,
                        uint64_t key, void *context) {
    return locked_post(fid, SIM_KIND_WRITE_DATA, buf, len, dest, addr, key, 0, context, FI_COMPLETION);
}

static ssize_t ep_writedata(struct fid_ep *fid, const void *buf, size_t len, void *desc, uint64_t data,
                            fi_addr_t dest, uint64_t addr, uint64_t key, void *context) {
    return locked_post(fid, SIM_KIND_WRITE_DATA, buf, len, dest, addr, key, data, context,
                       FI_COMPLETION | FI_REMOTE_CQ_DATA);
}

static ssize_t ep_inject_write(struct fid_ep *fid, const void *buf, size_t len, fi_addr_t dest, uint64_t addr,
                               uint64_t key) {
    if (len > SIM_INJECT) return -FI_EMSGSIZE;
    return locked_post(fid, SIM_KIND_WRITE_DATA, buf, len, dest, addr, key, 0, NULL, 0);
}

static ssize_t ep_injectdata(struct fid_ep *fid, const void *buf, size_t len, uint64_t data, fi_addr_t dest,
                             uint64_t addr, uint64_t key) {
    if (len > SIM_INJECT) return -FI_EMSGSIZE;
    return locked_post(fid, SIM_KIND_WRITE_DATA, buf, len, dest, addr, key, data, NULL, FI_REMOTE_CQ_DATA);
}

static ssize_t ep_writev(struct fid_ep *fid, const struct iovec *iov, void **desc, size_t count, fi_addr_t dest,
                         uint64_t addr, uint64_t key, void *context) {
    if (count != 1) return -FI_EINVAL;
    return ep_write(fid, iov[0].iov_base, iov[0].iov_len, desc ? desc[0] : NULL, dest, addr, key, context);
}

static ssize_t no_read(struct fid_ep *ep, void *buf, size_t len, void *desc, fi_addr_t src, uint64_t addr,
                       uint64_t key, void *context) {
    return -FI_ENOSYS;
}

/* ------------------------------------------------------------------------------------------- MSG */

static ssize_t ep_send(struct fid_ep *fid, const void *buf, size_t len, void *desc, fi_addr_t dest, void *context) {
    return locked_post(fid, SIM_KIND_SEND, buf, len, dest, 0, 0, 0, context, FI_COMPLETION);
}

static ssize_t ep_sendmsg(struct fid_ep *fid, const struct fi_msg *msg, uint64_t flags) {
    if (msg->iov_count != 1) return -FI_EINVAL;
    return locked_post(fid, SIM_KIND_SEND, msg->msg_iov[0].iov_base, msg->msg_iov[0].iov_len, msg->addr, 0, 0, 0,
                       msg->context, flags | FI_COMPLETION);
}

static ssize_t ep_sendv(struct fid_ep *fid, const struct iovec *iov, void **desc, size_t count, fi_addr_t dest,
                        void *context) {
    if (count != 1) return -FI_EINVAL;
    return ep_send(fid, iov[0].iov_base, iov[0].iov_len, NULL, dest, context);
}

static ssize_t ep_inject(struct fid_ep *fid, const void *buf, size_t len, fi_addr_t dest) {
    if (len > SIM_INJECT) return -FI_EMSGSIZE;
    return locked_post(fid, SIM_KIND_SEND, buf, len, dest, 0, 0, 0, NULL, 0);
}

static ssize_t ep_recv(struct fid_ep *fid, void *buf, size_t len, void *desc, fi_addr_t src, void *context) {
    struct sim_ep *ep = (struct sim_ep *)fid;
    if (!ep->enabled) return -FI_EOPBADSTATE;
    sim_ep_lock(ep);
    ssize_t rc = -FI_EAGAIN;
    if (ep->rx_tail - ep->rx_head < SIM_RX) {
        ep->rx[ep->rx_tail++ % SIM_RX] = (struct sim_recv){buf, len, context};
        rc = 0;
    }
    sim_ep_unlock(ep);
    return rc;
}

static ssize_t ep_recvmsg(struct fid_ep *fid, const struct fi_msg *msg, uint64_t flags) {
    if (msg->iov_count != 1) return -FI_EINVAL;
    return ep_recv(fid, msg->msg_iov[0].iov_base, msg->msg_iov[0].iov_len, NULL, msg->addr, msg->context);
}

static ssize_t ep_recvv(struct fid_ep *fid, const struct iovec *iov, void **desc, size_t count, fi_addr_t src,
                        void *context) {
    if (count != 1) return -FI_EINVAL;
    return ep_recv(fid, iov[0].iov_base, iov[0].iov_len, NULL, src, context);
}

struct fi_ops_msg sim_msg_ops = {.size = sizeof(struct fi_ops_msg), .recv = ep_recv, .recvv = ep_recvv,
                                 .recvmsg = ep_recvmsg, .send = ep_send, .sendv = ep_sendv,
                                 .sendmsg = ep_sendmsg, .inject = ep_inject};
struct fi_ops_rma sim_rma_ops = {.size = sizeof(struct fi_ops_rma), .read = no_read, .write = ep_write,
                                 .writev = ep_writev, .writemsg = ep_writemsg, .inject = ep_inject_write,
                                 .writedata = ep_writedata, .injectdata = ep_injectdata};
