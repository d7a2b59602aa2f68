/* Endpoints: open, bind to a CQ and an AV, enable, close; their address. The post paths are in sim_post.c. */
#include "sim.h"

#include <stdlib.h>
#include <unistd.h>

void sim_ep_lock(struct sim_ep *ep) {
    while (atomic_flag_test_and_set_explicit(&ep->lock, memory_order_acquire))
        ;
}
void sim_ep_unlock(struct sim_ep *ep) { atomic_flag_clear_explicit(&ep->lock, memory_order_release); }

static int ep_getname(fid_t fid, void *addr, size_t *addrlen) {
    struct sim_ep *ep = container_of(fid, struct sim_ep, fid.fid);
    size_t have = *addrlen;
    *addrlen = SIM_ADDR_LEN;
    if (have < SIM_ADDR_LEN) return -FI_ETOOSMALL;
    sim_format_addr(addr, getpid(), ep->domain->memfd, ep->domain->serial, ep->slot);
    return 0;
}

static int ep_bind(struct fid *fid, struct fid *bfid, uint64_t flags) {
    struct sim_ep *ep = (struct sim_ep *)fid;
    if (bfid->fclass == FI_CLASS_CQ) {
        struct sim_cq *cq = (struct sim_cq *)bfid;
        if ((ep->cq && ep->cq != cq) || (cq->ep && cq->ep != ep)) return -FI_EINVAL; /* one CQ per endpoint */
        ep->cq = cq;
        cq->ep = ep;
        return 0;
    }
    if (bfid->fclass == FI_CLASS_AV) {
        if (ep->av) return -FI_EINVAL;
        ep->av = (struct sim_av *)bfid;
        ep->av->eps[ep->slot] = ep;
        return 0;
    }
    return -FI_EINVAL;
}

static int ep_control(struct fid *fid, int command, void *arg) {
    struct sim_ep *ep = (struct sim_ep *)fid;
    if (command != FI_ENABLE) return -FI_ENOSYS;
    if (!ep->cq || !ep->av) return -FI_ENOCQ;
    ep->enabled = 1;
    return 0;
}

static int ep_close(struct fid *fid) {
    struct sim_ep *ep = (struct sim_ep *)fid;
    if (ep->cq) ep->cq->ep = NULL;
    if (ep->av) {
        for (int i = 0; i < ep->av->count; i++) sim_release_port(ep, (fi_addr_t)i);
        ep->av->eps[ep->slot] = NULL;
    }
    for (int w = 0; w < SIM_PORT_WORDS; w++) atomic_store(&ep->domain->seg->ports_used[ep->slot][w], 0);
    ep->domain->slots_used &= ~(1u << ep->slot);
    free(ep);
    return 0;
}

static ssize_t ep_tx_left(struct fid_ep *fid) {
    struct sim_ep *ep = (struct sim_ep *)fid;
    return SIM_TX - (ssize_t)(ep->tx_tail - ep->tx_head);
}

static ssize_t ep_rx_left(struct fid_ep *fid) {
    struct sim_ep *ep = (struct sim_ep *)fid;
    return SIM_RX - (ssize_t)(ep->rx_tail - ep->rx_head);
}

static ssize_t ep_cancel(fid_t fid, void *context) { return -FI_ENOENT; }
static int ep_getopt(fid_t fid, int level, int optname, void *optval, size_t *optlen) { return -FI_ENOPROTOOPT; }
static int ep_setopt(fid_t fid, int level, int optname, const void *optval, size_t optlen) { return -FI_ENOPROTOOPT; }

static struct fi_ops ep_fi_ops = {.size = sizeof(struct fi_ops), .close = ep_close, .bind = ep_bind,
                                  .control = ep_control, .ops_open = sim_no_ops_open};
static struct fi_ops_ep ep_ops = {.size = sizeof(struct fi_ops_ep), .cancel = ep_cancel, .getopt = ep_getopt,
                                  .setopt = ep_setopt, .rx_size_left = ep_rx_left, .tx_size_left = ep_tx_left};
static struct fi_ops_cm ep_cm_ops = {.size = sizeof(struct fi_ops_cm), .getname = ep_getname};

int sim_ep_open(struct fid_domain *dfid, struct fi_info *info, struct fid_ep **out, void *context) {
    struct sim_domain *d = (struct sim_domain *)dfid;
    if (d->slots_used == (1u << SIM_EPS) - 1) return -FI_ENOSPC; /* the segment has ports for SIM_EPS */
    struct sim_ep *ep = calloc(1, sizeof *ep);
    if (!ep) return -FI_ENOMEM;
    ep->fid.fid = (struct fid){.fclass = FI_CLASS_EP, .context = context, .ops = &ep_fi_ops};
    ep->fid.ops = &ep_ops;
    ep->fid.cm = &ep_cm_ops;
    ep->fid.msg = &sim_msg_ops;
    ep->fid.rma = &sim_rma_ops;
    ep->domain = d;
    atomic_flag_clear(&ep->lock);
    ep->slot = __builtin_ctz(~d->slots_used);
    d->slots_used |= 1u << ep->slot;
    /* ports a closed endpoint of this slot left behind are free again */
    for (int i = 0; i < SIM_PORTS; i++) {
        struct sim_port *port = &d->seg->ports[ep->slot][i];
        atomic_store(&port->closed, 0);
        atomic_store(&port->owner, 0);
        atomic_store(&port->head, 0);
        atomic_store(&port->tail, 0);
        atomic_store(&port->data_tail, 0);
    }
    *out = &ep->fid;
    return 0;
}
