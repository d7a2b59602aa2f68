/* Endpoints: open, bind to CQs (separate or shared), an AV and an EQ, enable, close; their address. The post
 * paths are in sim_post.c. */
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
    return sim_format_addr(addr, ep->nic, getpid(), ep->domain->memfd, ep->domain->serial, ep->slot);
}

/* A CQ for transmits, receives or both (fi_endpoint(3)); each direction has one, several endpoints may share one. */
static int bind_cq(struct sim_ep *ep, struct sim_cq *cq, uint64_t flags) {
    if (cq->domain != ep->domain) return -FI_EINVAL;
    if (flags & ~(uint64_t)(FI_TRANSMIT | FI_RECV | FI_SELECTIVE_COMPLETION)) return -FI_EBADFLAGS;
    if (!(flags & (FI_TRANSMIT | FI_RECV))) return -FI_EBADFLAGS; /* a CQ completes transmits, receives or both */
    if (((flags & FI_TRANSMIT) && ep->tx_cq) || ((flags & FI_RECV) && ep->rx_cq)) return -FI_EINVAL; /* has one */
    int rc = sim_cq_bind(cq, ep);
    if (rc) return rc;
    int selective = (flags & FI_SELECTIVE_COMPLETION) != 0;
    if (flags & FI_TRANSMIT) {
        ep->tx_cq = cq;
        ep->tx_selective = selective;
    }
    if (flags & FI_RECV) {
        ep->rx_cq = cq;
        ep->rx_selective = selective;
    }
    return 0;
}

static int ep_bind(struct fid *fid, struct fid *bfid, uint64_t flags) {
    struct sim_ep *ep = (struct sim_ep *)fid;
    if (!bfid) return -FI_EINVAL;
    if (ep->enabled) return -FI_EOPBADSTATE; /* bindings come before fi_enable */
    switch (bfid->fclass) {
    case FI_CLASS_CQ:
        return bind_cq(ep, (struct sim_cq *)bfid, flags);
    case FI_CLASS_AV: {
        struct sim_av *av = (struct sim_av *)bfid;
        if (ep->av || av->domain != ep->domain) return -FI_EINVAL;
        int rc = sim_av_bind(av, ep);
        if (!rc) ep->av = av;
        return rc;
    }
    case FI_CLASS_EQ: {
        struct sim_eq *eq = (struct sim_eq *)bfid; /* its fid comes first, as every object's */
        if (ep->eq) return -FI_EINVAL;
        int rc = sim_eq_bind(eq, 1); /* no asynchronous event in the model: the EQ stays quiet */
        if (!rc) ep->eq = eq;
        return rc;
    }
    case FI_CLASS_CNTR:
        return -FI_ENOSYS; /* counting an endpoint's completions is not modeled (fi_info: cntr_cnt 0) */
    default:
        return -FI_EINVAL;
    }
}

static int ops_flags(struct sim_ep *ep, int command, uint64_t *arg) {
    if (!arg || !(*arg & (FI_TRANSMIT | FI_RECV))) return -FI_EINVAL;
    uint64_t *which = (*arg & FI_TRANSMIT) ? &ep->tx_op_flags : &ep->rx_op_flags;
    if (command == FI_SETOPSFLAG) *which = *arg & ~(uint64_t)(FI_TRANSMIT | FI_RECV);
    else *arg = *which;
    return 0;
}

static int ep_control(struct fid *fid, int command, void *arg) {
    struct sim_ep *ep = (struct sim_ep *)fid;
    switch (command) {
    case FI_ENABLE:
        if (!ep->av) return -FI_ENOAV;
        if (!ep->tx_cq || !ep->rx_cq) return -FI_ENOCQ;
        ep->enabled = 1;
        return 0;
    case FI_GETOPSFLAG:
    case FI_SETOPSFLAG:
        return ops_flags(ep, command, arg);
    default:
        return -FI_ENOSYS;
    }
}

static int ep_close(struct fid *fid) {
    struct sim_ep *ep = (struct sim_ep *)fid;
    if (ep->tx_cq) sim_cq_unbind(ep->tx_cq, ep);
    if (ep->rx_cq && ep->rx_cq != ep->tx_cq) sim_cq_unbind(ep->rx_cq, ep);
    if (ep->av) sim_av_unbind(ep->av, ep); /* gives back the ports this endpoint claimed */
    if (ep->eq) sim_eq_bind(ep->eq, -1);
    struct sim_domain *d = ep->domain;
    for (int w = 0; w < SIM_PORT_WORDS; w++) atomic_store(&d->seg->ports_used[ep->slot][w], 0);
    pthread_mutex_lock(&d->lock);
    d->slots_used &= ~(1u << ep->slot);
    pthread_mutex_unlock(&d->lock);
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
                                  .control = ep_control, .ops_open = sim_no_ops_open, .ops_set = sim_no_ops_set};
static struct fi_ops_ep ep_ops = {.size = sizeof(struct fi_ops_ep), .cancel = ep_cancel, .getopt = ep_getopt,
                                  .setopt = ep_setopt, .tx_ctx = sim_no_tx_ctx, .rx_ctx = sim_no_rx_ctx,
                                  .rx_size_left = ep_rx_left, .tx_size_left = ep_tx_left};
static struct fi_ops_cm ep_cm_ops = {.size = sizeof(struct fi_ops_cm), .setname = sim_no_setname,
                                     .getname = ep_getname, .getpeer = sim_no_getpeer, .connect = sim_no_connect,
                                     .listen = sim_no_listen, .accept = sim_no_accept, .reject = sim_no_reject,
                                     .shutdown = sim_no_shutdown, .join = sim_no_join};

/* A slot of the domain's segment (its ports) for a new endpoint, or -1 when all are taken. */
static int claim_slot(struct sim_domain *d) {
    pthread_mutex_lock(&d->lock);
    int slot = d->slots_used == (1u << SIM_EPS) - 1 ? -1 : __builtin_ctz(~d->slots_used);
    if (slot >= 0) d->slots_used |= 1u << slot;
    pthread_mutex_unlock(&d->lock);
    return slot;
}

int sim_ep_open(struct fid_domain *dfid, struct fi_info *info, struct fid_ep **out, void *context) {
    struct sim_domain *d = (struct sim_domain *)dfid;
    if (info && info->ep_attr && info->ep_attr->type != FI_EP_RDM && info->ep_attr->type != FI_EP_UNSPEC)
        return -FI_EINVAL;
    if (info && info->src_addr && sim_parse_nic(info->src_addr, info->src_addrlen) != d->index)
        return -FI_EINVAL; /* a source address on another NIC than the domain's */
    struct sim_ep *ep = calloc(1, sizeof *ep);
    if (!ep) return -FI_ENOMEM;
    ep->slot = claim_slot(d);
    if (ep->slot < 0) {
        free(ep);
        return -FI_ENOSPC; /* the segment has ports for SIM_EPS endpoints (fi_info: ep_cnt) */
    }
    ep->fid.fid = (struct fid){.fclass = FI_CLASS_EP, .context = context, .ops = &ep_fi_ops};
    ep->fid.ops = &ep_ops;
    ep->fid.cm = &ep_cm_ops;
    ep->fid.msg = &sim_msg_ops;
    ep->fid.rma = &sim_rma_ops;
    ep->fid.tagged = &sim_no_tagged_ops;
    ep->fid.atomic = &sim_no_atomic_ops;
    ep->fid.collective = &sim_no_collective_ops;
    ep->domain = d;
    ep->seg = d->seg;
    ep->nic = d->index;
    ep->tx_op_flags = info && info->tx_attr ? info->tx_attr->op_flags : 0;
    ep->rx_op_flags = info && info->rx_attr ? info->rx_attr->op_flags : 0;
    atomic_flag_clear(&ep->lock);
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
