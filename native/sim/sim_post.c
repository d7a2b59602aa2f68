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

static ssize_t post(struct sim_ep *ep, int kind, const void *buf, size_t len, fi_addr_t dest, uint64_t raddr,
                    uint64_t key, uint64_t data, void *context, uint64_t flags) {
    uint64_t op_flags = (kind == SIM_KIND_SEND ? FI_MSG | FI_SEND : FI_RMA | FI_WRITE) | (flags & FI_COMPLETION);
    if (!ep->enabled) return -FI_EOPBADSTATE;
    if (dest >= (fi_addr_t)ep->av->count || !ep->av->peers[dest].seg) return -FI_EINVAL;
    struct sim_peer *peer = &ep->av->peers[dest];
    if (ep->tx_tail - ep->tx_head >= SIM_TX) return -FI_EAGAIN;
    uint64_t now = sim_now_ns();
    if (sim_peer_dead(peer, now)) return refuse(ep, context, op_flags, len, FI_EHOSTUNREACH);
    if (kind == SIM_KIND_SEND) {
        if (len > SIM_DATA_BYTES) return -FI_EMSGSIZE;
    } else {
        /* what the target NIC checks before it lets the write into memory */
        uint64_t slot = key & 0xffffffffu;
        struct sim_mr_slot *s = slot < SIM_MRS ? &peer->seg->mrs[slot] : NULL;
        if (!s || atomic_load_explicit(&s->key, memory_order_acquire) != key)
            return refuse(ep, context, op_flags, len, FI_EKEYREJECTED);
        if (!(s->access & FI_REMOTE_WRITE)) return refuse(ep, context, op_flags, len, FI_EACCES);
        if (raddr < s->addr || raddr + len > s->addr + s->len || raddr + len < raddr)
            return refuse(ep, context, op_flags, len, FI_EFAULT);
    }
    int announce = kind == SIM_KIND_SEND || (flags & FI_REMOTE_CQ_DATA);
    struct sim_port *port = NULL;
    int64_t data_off = 0;
    if (announce) {
        if (peer->port < 0 && sim_claim_port(ep, peer) < 0) return -FI_EAGAIN;
        port = &peer->seg->ports[peer->slot][peer->port];
        uint64_t head = atomic_load_explicit(&port->head, memory_order_relaxed);
        if (head - atomic_load_explicit(&port->tail, memory_order_acquire) >= SIM_RING) return -FI_EAGAIN;
        if (kind == SIM_KIND_SEND) {
            data_off = sim_reserve_data(port, len);
            if (data_off < 0) return -FI_EAGAIN;
            memcpy(sim_port_data(peer->seg, peer->slot, peer->port) + data_off, buf, len);
        }
    }
    if (kind != SIM_KIND_SEND && sim_model.payload && len) {
        struct iovec local = {(void *)buf, len}, remote = {(void *)(uintptr_t)raddr, len};
        if (process_vm_writev(peer->pid, &local, 1, &remote, 1, 0) != (ssize_t)len)
            return refuse(ep, context, op_flags, len, errno == EPERM ? FI_EPERM : FI_EIO);
    }
    uint64_t landed = sim_occupy_lines(ep, peer, len, now);
    if (announce) {
        uint64_t head = atomic_load_explicit(&port->head, memory_order_relaxed);
        port->ring[head % SIM_RING] = (struct sim_entry){.due_ns = landed, .len = len, .data_off = (uint32_t)data_off,
                                                         .kind = (uint32_t)kind, .imm = data & 0xffffffffu};
        atomic_store_explicit(&port->head, head + 1, memory_order_release);
    }
    uint64_t due = landed + sim_model.latency_ns;
    if (due < ep->last_due_ns) due = ep->last_due_ns;
    ep->last_due_ns = due;
    ep->tx[ep->tx_tail++ % SIM_TX] = (struct sim_pending){.due_ns = due, .context = context, .flags = op_flags,
                                                          .len = len, .dest = (uint32_t)dest};
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
