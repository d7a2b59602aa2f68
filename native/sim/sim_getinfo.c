/* fi_getinfo: one entry per modeled NIC, its fields those of the p5's `fi_info -p efa` where the model offers
 * the same (../shared/reference/figures.md; docs/model.md lists where it differs), filtered and shaped by the
 * hints as libfabric's own providers do (prov/util/src/util_attr.c: ofi_check_info, ofi_alter_info). */
#include "sim.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define SIM_TX_CAPS (FI_MSG | FI_RMA | FI_SEND | FI_WRITE)
#define SIM_RX_CAPS (FI_MSG | FI_RMA | FI_RECV | FI_REMOTE_WRITE)
#define SIM_DOMAIN_CAPS (FI_LOCAL_COMM | FI_REMOTE_COMM)
/* mr_mode as EFA reports it (no FI_MR_LOCAL), plus FI_MR_BASIC, which it also is: for applications of the
 * pre-1.5 API and those that ask for it by name (removed from what fi_getinfo returns otherwise) */
#define SIM_MR_MODE (FI_MR_VIRT_ADDR | FI_MR_ALLOCATED | FI_MR_PROV_KEY | FI_MR_HMEM | FI_MR_BASIC)
#define SIM_TX_OP_FLAGS (FI_COMPLETION | FI_INJECT | FI_TRANSMIT_COMPLETE | FI_DELIVERY_COMPLETE)
#define SIM_ORDER_SIZE 8776 /* EFA's max_order_raw/war/waw_size (the model promises no RMA order anyway) */

/* libfabric's grouping of capabilities (include/ofi.h) */
#define PRIMARY_CAPS (FI_MSG | FI_RMA | FI_TAGGED | FI_ATOMIC | FI_MULTICAST | FI_READ | FI_WRITE | FI_SEND | \
                      FI_COLLECTIVE | FI_NAMED_RX_CTX | FI_HMEM | FI_REMOTE_READ | FI_REMOTE_WRITE | FI_RECV | \
                      FI_DIRECTED_RECV | FI_VARIABLE_MSG | FI_REMOTE_COMM | FI_LOCAL_COMM)
#define SECONDARY_CAPS (FI_TRIGGER | FI_FENCE | FI_RMA_PMEM | FI_MULTI_RECV | FI_SOURCE | FI_RMA_EVENT | \
                        FI_SOURCE_ERR | FI_SHARED_AV)
#define MSG_DIRECTIONS (FI_SEND | FI_RECV)
#define RMA_DIRECTIONS (FI_READ | FI_WRITE | FI_REMOTE_READ | FI_REMOTE_WRITE)
#define IGNORED_TX_CAPS (FI_REMOTE_READ | FI_REMOTE_WRITE | FI_RECV | FI_DIRECTED_RECV | FI_VARIABLE_MSG | \
                         FI_MULTI_RECV | FI_SOURCE | FI_RMA_EVENT | FI_SOURCE_ERR)
#define IGNORED_RX_CAPS (FI_READ | FI_WRITE | FI_SEND | FI_FENCE | FI_MULTICAST | FI_NAMED_RX_CTX)
#define MR_RMA_TARGET (FI_MR_RAW | FI_MR_VIRT_ADDR | FI_MR_PROV_KEY | FI_MR_RMA_EVENT)

const char *sim_fabric_name(void) { return sim_model.payload ? SIM_FABRIC_PAYLOAD : SIM_FABRIC; }

/* The NIC a domain name (rdmapNs0-rdm, as EFA's, N from 16) names, or -1. */
int sim_domain_index(const char *name) {
    int index;
    char tail[8];
    if (!name || sscanf(name, "rdmap%ds0-rd%7s", &index, tail) != 2 || strcmp(tail, "m") != 0) return -1;
    index -= 16;
    return index >= 0 && index < sim_model.nics ? index : -1;
}

/* ------------------------------------------------------------------------------------ the NIC */

/* The NIC behind a domain, as fi_info shows it: a name, the modeled line rate and MTU (EFA's 8760). */
struct sim_nic {
    struct fid_nic fid;
    struct fi_device_attr device;
    struct fi_link_attr link;
    char name[32];
};

static struct sim_nic *nic_new(const char *name);

static int nic_close(struct fid *fid) {
    free(fid);
    return 0;
}

static int nic_control(struct fid *fid, int command, void *arg) {
    if (command != FI_DUP) return -FI_ENOSYS;
    struct sim_nic *copy = nic_new(((struct sim_nic *)fid)->name);
    if (!copy) return -FI_ENOMEM;
    *(struct fid_nic **)arg = &copy->fid;
    return 0;
}

static struct fi_ops nic_fi_ops = {.size = sizeof(struct fi_ops), .close = nic_close, .bind = sim_no_bind,
                                   .control = nic_control, .ops_open = sim_no_ops_open, .ops_set = sim_no_ops_set};

static struct sim_nic *nic_new(const char *name) {
    struct sim_nic *nic = calloc(1, sizeof *nic);
    if (!nic) return NULL;
    snprintf(nic->name, sizeof nic->name, "%s", name);
    nic->fid.fid = (struct fid){.fclass = FI_CLASS_NIC, .ops = &nic_fi_ops};
    nic->device.name = nic->name;
    nic->link.mtu = 8760;
    nic->link.speed = (size_t)(8e9 / sim_model.ns_per_byte);
    nic->link.state = FI_LINK_UP;
    nic->fid.device_attr = &nic->device;
    nic->fid.link_attr = &nic->link;
    return nic;
}

/* ---------------------------------------------------------------------------- what a NIC offers */

static struct fi_info *describe(int index, uint32_t version) {
    struct fi_info *info = fi_allocinfo();
    if (!info) return NULL;
    char domain[32];
    snprintf(domain, sizeof domain, "rdmap%ds0-rdm", index + 16);
    info->caps = SIM_CAPS;
    info->mode = 0;
    info->addr_format = FI_ADDR_STR;
    *info->tx_attr = (struct fi_tx_attr){.caps = SIM_TX_CAPS, .op_flags = SIM_TX_OP_FLAGS, .msg_order = FI_ORDER_SAS,
                                         .comp_order = FI_ORDER_NONE, .inject_size = SIM_INJECT, .size = SIM_TX,
                                         .iov_limit = SIM_IOV, .rma_iov_limit = 1};
    *info->rx_attr = (struct fi_rx_attr){.caps = SIM_RX_CAPS, .op_flags = FI_COMPLETION, .msg_order = FI_ORDER_SAS,
                                         .comp_order = FI_ORDER_NONE, .size = SIM_RX, .iov_limit = SIM_IOV};
    *info->ep_attr = (struct fi_ep_attr){.type = FI_EP_RDM, .protocol = FI_PROTO_UNSPEC,
                                         .max_msg_size = SIM_DATA_BYTES, .max_order_raw_size = SIM_ORDER_SIZE,
                                         .max_order_war_size = SIM_ORDER_SIZE, .max_order_waw_size = SIM_ORDER_SIZE,
                                         .tx_ctx_cnt = 1, .rx_ctx_cnt = 1};
    *info->domain_attr = (struct fi_domain_attr){
        .name = strdup(domain), .threading = FI_THREAD_SAFE, .control_progress = FI_PROGRESS_AUTO,
        .data_progress = FI_PROGRESS_AUTO, .resource_mgmt = FI_RM_ENABLED, .av_type = FI_AV_TABLE,
        .mr_mode = SIM_MR_MODE, .mr_key_size = 4, .cq_data_size = SIM_CQ_DATA, .cq_cnt = SIM_CQS,
        .ep_cnt = SIM_EPS, .tx_ctx_cnt = SIM_EPS, .rx_ctx_cnt = SIM_EPS, .max_ep_tx_ctx = 1, .max_ep_rx_ctx = 1,
        .cntr_cnt = 0, .mr_iov_limit = 1, .caps = SIM_DOMAIN_CAPS, .max_err_data = SIM_ERR_TEXT, .mr_cnt = SIM_MRS};
    info->fabric_attr->name = strdup(sim_fabric_name());
    info->fabric_attr->prov_version = FI_VERSION(1, 0);
    info->fabric_attr->api_version = version;
    domain[strlen(domain) - 4] = 0; /* the device: rdmapNs0 */
    struct sim_nic *nic = nic_new(domain);
    info->src_addr = calloc(1, SIM_ADDR_LEN);
    if (!nic || !info->src_addr || !info->domain_attr->name || !info->fabric_attr->name) {
        if (nic) nic_close(&nic->fid.fid);
        fi_freeinfo(info);
        return NULL;
    }
    info->nic = &nic->fid;
    sim_format_nic_addr(info->src_addr, index);
    info->src_addrlen = SIM_ADDR_LEN;
    return info;
}

/* --------------------------------------------------------------------- what hints may ask (check) */

static int rma_target_allowed(uint64_t caps) {
    if (!(caps & (FI_RMA | FI_ATOMIC))) return 0;
    if (caps & (FI_REMOTE_WRITE | FI_REMOTE_READ)) return 1;
    return !(caps & (FI_WRITE | FI_READ));
}

/* The registration modes that matter for these capabilities (libfabric's ofi_cap_mr_mode). */
static uint64_t cap_mr_mode(uint64_t caps, uint64_t mode) {
    if (!(caps & FI_HMEM)) mode &= ~(uint64_t)FI_MR_HMEM;
    if (!rma_target_allowed(caps)) {
        if (!(mode & (FI_MR_LOCAL | FI_MR_HMEM))) return 0;
        mode &= ~(uint64_t)MR_RMA_TARGET;
    }
    return mode & ~(uint64_t)(FI_MR_BASIC | FI_MR_SCALABLE);
}

static int mr_mode_fits(uint64_t prov, const struct fi_info *hints, uint32_t version) {
    uint64_t user = (uint64_t)hints->domain_attr->mr_mode;
    if (FI_VERSION_LT(version, FI_VERSION(1, 5)))
        return user == FI_MR_UNSPEC ? (prov & (FI_MR_BASIC | FI_MR_SCALABLE)) != 0
               : user == FI_MR_BASIC || user == FI_MR_SCALABLE ? (prov & user) != 0 : 0;
    if (user & (FI_MR_BASIC | FI_MR_SCALABLE)) {
        uint64_t legacy = user & (FI_MR_BASIC | FI_MR_SCALABLE);
        return user == legacy && legacy != (FI_MR_BASIC | FI_MR_SCALABLE) && (prov & legacy);
    }
    prov = cap_mr_mode(hints->caps, prov);
    return user == FI_MR_UNSPEC || (user & prov) == prov;
}

static int level(int value, const int *ranked, int n) { /* libfabric ranks threading and progress models */
    for (int i = 0; i < n; i++)
        if (ranked[i] == value) return i;
    return -1;
}

static int domain_fits(const struct fi_domain_attr *prov, const struct fi_info *hints, uint32_t version) {
    static const int threading[] = {FI_THREAD_SAFE, FI_THREAD_FID, FI_THREAD_ENDPOINT, FI_THREAD_COMPLETION,
                                    FI_THREAD_DOMAIN, FI_THREAD_UNSPEC};
    static const int progress[] = {FI_PROGRESS_AUTO, FI_PROGRESS_MANUAL, FI_PROGRESS_UNSPEC};
    static const int rm[] = {FI_RM_ENABLED, FI_RM_DISABLED, FI_RM_UNSPEC};
    const struct fi_domain_attr *user = hints->domain_attr;
    if (user->name && strcmp(user->name, prov->name) != 0) return 0;
    if (level(user->threading, threading, 6) < level(prov->threading, threading, 6) ||
        level(user->control_progress, progress, 3) < level(prov->control_progress, progress, 3) ||
        level(user->data_progress, progress, 3) < level(prov->data_progress, progress, 3) ||
        level(user->resource_mgmt, rm, 3) < level(prov->resource_mgmt, rm, 3))
        return 0;
    if (user->av_type != FI_AV_UNSPEC && user->av_type != prov->av_type) return 0;
    if (user->cq_data_size > prov->cq_data_size || !mr_mode_fits((uint64_t)prov->mr_mode, hints, version)) return 0;
    if (FI_VERSION_LT(version, FI_VERSION(1, 5))) return 1;
    return user->cntr_cnt <= prov->cntr_cnt && user->mr_iov_limit <= prov->mr_iov_limit &&
           !(user->caps & ~prov->caps) && (user->mode & prov->mode) == prov->mode &&
           user->max_err_data <= prov->max_err_data && user->mr_cnt <= prov->mr_cnt;
}

static int ep_fits(const struct fi_info *prov, const struct fi_info *hints) {
    const struct fi_ep_attr *p = prov->ep_attr, *u = hints->ep_attr;
    if (u->type != FI_EP_UNSPEC && u->type != p->type) return 0;
    if ((u->protocol != FI_PROTO_UNSPEC && u->protocol != p->protocol) || u->protocol_version > p->protocol_version)
        return 0;
    if (u->max_msg_size > p->max_msg_size) return 0;
    if (u->tx_ctx_cnt > prov->domain_attr->max_ep_tx_ctx || u->rx_ctx_cnt > prov->domain_attr->max_ep_rx_ctx)
        return 0; /* FI_SHARED_CONTEXT included: no shared contexts */
    if ((hints->caps & (FI_RMA | FI_ATOMIC)) &&
        (u->max_order_raw_size > p->max_order_raw_size || u->max_order_war_size > p->max_order_war_size ||
         u->max_order_waw_size > p->max_order_waw_size))
        return 0;
    return !u->auth_key_size || u->auth_key_size == p->auth_key_size;
}

static int rx_fits(const struct fi_rx_attr *p, const struct fi_rx_attr *u, uint64_t mode) {
    mode = u->mode ? u->mode : mode;
    return !((u->caps & ~(uint64_t)IGNORED_RX_CAPS) & ~p->caps) && (mode & p->mode) == p->mode &&
           !(u->op_flags & ~p->op_flags) && !(u->msg_order & ~p->msg_order) && !(u->comp_order & ~p->comp_order) &&
           u->total_buffered_recv <= p->total_buffered_recv && u->size <= p->size && u->iov_limit <= p->iov_limit;
}

static int tx_fits(const struct fi_tx_attr *p, const struct fi_tx_attr *u, uint64_t mode) {
    mode = u->mode ? u->mode : mode;
    return !((u->caps & ~(uint64_t)IGNORED_TX_CAPS) & ~p->caps) && (mode & p->mode) == p->mode &&
           !(u->op_flags & ~p->op_flags) && !(u->msg_order & ~p->msg_order) && !(u->comp_order & ~p->comp_order) &&
           u->inject_size <= p->inject_size && u->size <= p->size && u->iov_limit <= p->iov_limit &&
           u->rma_iov_limit <= p->rma_iov_limit;
}

static int fits(const struct fi_info *prov, const struct fi_info *hints, uint32_t version) {
    if (!hints) return 1;
    if (hints->ep_attr && !ep_fits(prov, hints)) return 0;
    if (hints->caps & ~(prov->caps | FI_REMOTE_CQ_DATA)) return 0; /* the latter: older hints' way to ask for it */
    if ((hints->mode & prov->mode) != prov->mode) return 0;
    if (hints->addr_format != FI_FORMAT_UNSPEC && hints->addr_format != prov->addr_format) return 0;
    if (hints->fabric_attr) {
        const struct fi_fabric_attr *f = hints->fabric_attr;
        if ((f->name && strcmp(f->name, prov->fabric_attr->name) != 0) ||
            f->prov_version > prov->fabric_attr->prov_version)
            return 0;
    }
    if (hints->domain_attr && !domain_fits(prov->domain_attr, hints, version)) return 0;
    if (hints->rx_attr && !rx_fits(prov->rx_attr, hints->rx_attr, hints->mode)) return 0;
    return !hints->tx_attr || tx_fits(prov->tx_attr, hints->tx_attr, hints->mode);
}

/* -------------------------------------------------------------- what the answer says (alter) */

static uint64_t get_caps(uint64_t info_caps, uint64_t hint_caps, uint64_t attr_caps) {
    uint64_t caps = hint_caps ? (hint_caps & PRIMARY_CAPS) | (attr_caps & SECONDARY_CAPS)
                              : (info_caps & attr_caps & PRIMARY_CAPS) | (attr_caps & SECONDARY_CAPS);
    if ((caps & (FI_MSG | FI_TAGGED)) && !(caps & MSG_DIRECTIONS)) caps |= attr_caps & MSG_DIRECTIONS;
    if ((caps & (FI_RMA | FI_ATOMIC)) && !(caps & RMA_DIRECTIONS)) caps |= attr_caps & RMA_DIRECTIONS;
    return caps;
}

/* An application that does not take the provider's registration modes for remote targets cannot be one. */
static uint64_t info_caps(const struct fi_info *prov, const struct fi_info *hints, uint32_t version) {
    if (!hints) return prov->caps;
    uint64_t caps = get_caps(prov->caps, hints->caps, prov->caps), mode = (uint64_t)prov->domain_attr->mr_mode;
    if (!rma_target_allowed(caps) || !(mode & MR_RMA_TARGET)) return caps;
    if (hints->domain_attr) {
        uint64_t user = (uint64_t)hints->domain_attr->mr_mode;
        if ((FI_VERSION_LT(version, FI_VERSION(1, 5)) && user == FI_MR_UNSPEC) || user == FI_MR_BASIC ||
            (user & mode & MR_RMA_TARGET) == (mode & MR_RMA_TARGET))
            return caps;
    }
    return caps & ~(uint64_t)(FI_REMOTE_WRITE | FI_REMOTE_READ);
}

static void alter_domain(struct fi_domain_attr *attr, const struct fi_domain_attr *hints, uint64_t caps,
                         uint32_t version) {
    uint64_t hinted = hints ? (uint64_t)hints->mr_mode : 0, mode = (uint64_t)attr->mr_mode;
    if (hinted & (FI_MR_BASIC | FI_MR_SCALABLE))
        mode = hinted;
    else if (FI_VERSION_LT(version, FI_VERSION(1, 5)))
        mode = mode && mode != FI_MR_SCALABLE ? FI_MR_BASIC : FI_MR_SCALABLE;
    else {
        mode &= ~(uint64_t)(FI_MR_BASIC | FI_MR_SCALABLE);
        if (hints && (hinted & mode) != mode) mode = cap_mr_mode(caps, mode & hinted);
    }
    attr->mr_mode = (int)mode;
    attr->caps = get_caps(caps, hints ? hints->caps : 0, attr->caps);
    if (!hints) return;
    if (hints->threading) attr->threading = hints->threading;
    if (hints->control_progress) attr->control_progress = hints->control_progress;
    if (hints->data_progress) attr->data_progress = hints->data_progress;
    if (hints->av_type) attr->av_type = hints->av_type;
}

static void alter(struct fi_info *info, const struct fi_info *hints, uint32_t version) {
    uint64_t caps = info_caps(info, hints, version);
    info->caps = caps | (hints ? hints->caps & FI_REMOTE_CQ_DATA : 0);
    alter_domain(info->domain_attr, hints ? hints->domain_attr : NULL, caps, version);
    info->tx_attr->caps = get_caps(caps, hints && hints->tx_attr ? hints->tx_attr->caps : 0, info->tx_attr->caps);
    info->rx_attr->caps = get_caps(caps, hints && hints->rx_attr ? hints->rx_attr->caps : 0, info->rx_attr->caps);
    if (!hints) return;
    if (hints->ep_attr) {
        const struct fi_ep_attr *h = hints->ep_attr;
        struct fi_ep_attr *e = info->ep_attr;
        if ((caps & (FI_RMA | FI_ATOMIC)) && h->max_order_raw_size) e->max_order_raw_size = h->max_order_raw_size;
        if ((caps & (FI_RMA | FI_ATOMIC)) && h->max_order_war_size) e->max_order_war_size = h->max_order_war_size;
        if ((caps & (FI_RMA | FI_ATOMIC)) && h->max_order_waw_size) e->max_order_waw_size = h->max_order_waw_size;
        if (h->tx_ctx_cnt) e->tx_ctx_cnt = h->tx_ctx_cnt;
        if (h->rx_ctx_cnt) e->rx_ctx_cnt = h->rx_ctx_cnt;
    }
    if (hints->rx_attr) {
        const struct fi_rx_attr *h = hints->rx_attr;
        info->rx_attr->op_flags = h->op_flags;
        info->rx_attr->total_buffered_recv = h->total_buffered_recv;
        if (h->size) info->rx_attr->size = h->size;
        if (h->iov_limit) info->rx_attr->iov_limit = h->iov_limit;
    }
    if (hints->tx_attr) {
        const struct fi_tx_attr *h = hints->tx_attr;
        info->tx_attr->op_flags = h->op_flags;
        if (h->inject_size) info->tx_attr->inject_size = h->inject_size;
        if (h->size) info->tx_attr->size = h->size;
        if (h->iov_limit) info->tx_attr->iov_limit = h->iov_limit;
        if (h->rma_iov_limit) info->tx_attr->rma_iov_limit = h->rma_iov_limit;
    }
}

/* ------------------------------------------------------------------------------------ addresses */

/* A node is an address of the model's own (sim:...): with FI_SOURCE, a NIC to bind to (a NIC's or an
 * endpoint's address); else the peer, an endpoint's address. Host names mean nothing to it: no data. */
static int node_address(const char *node, char out[SIM_ADDR_LEN]) {
    size_t len = strnlen(node, SIM_ADDR_LEN);
    if (len == SIM_ADDR_LEN) return -1;
    memset(out, 0, SIM_ADDR_LEN);
    memcpy(out, node, len);
    return 0;
}

static int endpoint_address(const void *addr, size_t len) {
    int nic, pid, fd, slot;
    uint32_t serial;
    return len == SIM_ADDR_LEN && sim_parse_addr(addr, &nic, &pid, &fd, &serial, &slot) == 0;
}

/* The NIC the caller binds to (-1: any), and the peer's address (dest[0] == 0: none); -1 if they mean nothing
 * here. */
static int resolve(const char *node, uint64_t flags, const struct fi_info *hints, int *nic, char dest[SIM_ADDR_LEN]) {
    char text[SIM_ADDR_LEN];
    *nic = -1;
    dest[0] = 0;
    if (node && node_address(node, text) < 0) return -1;
    if (hints && hints->addr_format != FI_FORMAT_UNSPEC && hints->addr_format != FI_ADDR_STR) return -1;
    if (node && (flags & FI_SOURCE)) {
        if ((*nic = sim_parse_nic(text, SIM_ADDR_LEN)) < 0) return -1;
    } else if (hints && hints->src_addr) {
        if ((*nic = sim_parse_nic(hints->src_addr, hints->src_addrlen)) < 0) return -1;
    }
    if (node && !(flags & FI_SOURCE)) {
        if (!endpoint_address(text, SIM_ADDR_LEN)) return -1;
        memcpy(dest, text, SIM_ADDR_LEN);
    } else if (hints && hints->dest_addr) {
        if (!endpoint_address(hints->dest_addr, hints->dest_addrlen)) return -1;
        memcpy(dest, hints->dest_addr, SIM_ADDR_LEN);
    }
    return 0;
}

/* ------------------------------------------------------------------------------------------ getinfo */

int sim_getinfo(uint32_t version, const char *node, const char *service, uint64_t flags,
                const struct fi_info *hints, struct fi_info **out) {
    int bound;
    char dest[SIM_ADDR_LEN];
    *out = NULL;
    if (resolve(node, flags, hints, &bound, dest) < 0) return -FI_ENODATA;
    struct fi_info *head = NULL, **tail = &head;
    for (int i = 0; i < sim_model.nics; i++) {
        if (bound >= 0 && bound != i) continue;
        struct fi_info *info = describe(i, version);
        if (!info) {
            fi_freeinfo(head);
            return -FI_ENOMEM;
        }
        if (!fits(info, hints, version)) {
            fi_freeinfo(info);
            continue;
        }
        alter(info, hints, version);
        if (dest[0] && !(info->dest_addr = malloc(SIM_ADDR_LEN))) {
            fi_freeinfo(info);
            fi_freeinfo(head);
            return -FI_ENOMEM;
        }
        if (dest[0]) {
            memcpy(info->dest_addr, dest, SIM_ADDR_LEN);
            info->dest_addrlen = SIM_ADDR_LEN;
        }
        *tail = info;
        tail = &info->next;
    }
    *out = head;
    return head ? 0 : -FI_ENODATA;
}
