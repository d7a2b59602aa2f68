/* The provider's entry (fi_prov_ini), fi_getinfo's answer, the fabric and the domain (one modeled NIC). */
#include "sim.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <unistd.h>

#include <rdma/providers/fi_prov.h>

int sim_no_bind(struct fid *fid, struct fid *bfid, uint64_t flags) { return -FI_ENOSYS; }
int sim_no_control(struct fid *fid, int command, void *arg) { return -FI_ENOSYS; }
int sim_no_ops_open(struct fid *fid, const char *name, uint64_t flags, void **ops, void *context) {
    return -FI_ENOSYS;
}

/* ------------------------------------------------------------------------------ domain and fabric */

static int domain_close(struct fid *fid) {
    struct sim_domain *d = (struct sim_domain *)fid;
    if (d->slots_used || d->registrations) return -FI_EBUSY;
    atomic_store(&d->seg->alive, 0);
    munmap(d->seg, sim_segment_size());
    close(d->memfd);
    free(d);
    return 0;
}

static struct fi_ops domain_fi_ops = {.size = sizeof(struct fi_ops), .close = domain_close, .bind = sim_no_bind,
                                      .control = sim_no_control, .ops_open = sim_no_ops_open};
static struct fi_ops_domain domain_ops = {.size = sizeof(struct fi_ops_domain), .av_open = sim_av_open,
                                          .cq_open = sim_cq_open, .endpoint = sim_ep_open};

static int domain_index(const char *name) {
    int index;
    char tail[8];
    if (!name || sscanf(name, "rdmap%ds0-rd%7s", &index, tail) != 2 || strcmp(tail, "m") != 0) return -1;
    index -= 16;
    return index >= 0 && index < sim_model.nics ? index : -1;
}

static int domain_open(struct fid_fabric *ffid, struct fi_info *info, struct fid_domain **out, void *context) {
    int index = domain_index(info && info->domain_attr ? info->domain_attr->name : NULL);
    if (index < 0) return -FI_EINVAL;
    struct sim_domain *d = calloc(1, sizeof *d);
    if (!d) return -FI_ENOMEM;
    d->index = index;
    d->serial = sim_next_serial();
    char name[32];
    snprintf(name, sizeof name, "fabriclab-sim-%d", index);
    d->memfd = memfd_create(name, 0); /* not MFD_CLOEXEC: peers open it through /proc/<pid>/fd */
    if (d->memfd < 0 || ftruncate(d->memfd, (off_t)sim_segment_size()) < 0) goto fail;
    d->seg = mmap(NULL, sim_segment_size(), PROT_READ | PROT_WRITE, MAP_SHARED, d->memfd, 0);
    if (d->seg == MAP_FAILED) goto fail;
    d->seg->pid = getpid();
    d->seg->serial = d->serial;
    atomic_store(&d->seg->alive, 1);
    atomic_store_explicit((_Atomic uint64_t *)&d->seg->magic, SIM_MAGIC, memory_order_release);
    if (sim_model.payload) prctl(PR_SET_PTRACER, PR_SET_PTRACER_ANY); /* yama: let writers' process_vm_writev in */
    d->fid.fid = (struct fid){.fclass = FI_CLASS_DOMAIN, .context = context, .ops = &domain_fi_ops};
    d->fid.ops = &domain_ops;
    d->fid.mr = &sim_mr_ops;
    *out = &d->fid;
    return 0;
fail: {
    int err = errno;
    if (d->memfd >= 0) close(d->memfd);
    free(d);
    return -err;
}
}

static int fabric_close(struct fid *fid) {
    free(fid);
    return 0;
}

static struct fi_ops fabric_fi_ops = {.size = sizeof(struct fi_ops), .close = fabric_close, .bind = sim_no_bind,
                                      .control = sim_no_control, .ops_open = sim_no_ops_open};
static struct fi_ops_fabric fabric_ops = {.size = sizeof(struct fi_ops_fabric), .domain = domain_open};

static const char *fabric_name(void) { return sim_model.payload ? SIM_FABRIC_PAYLOAD : SIM_FABRIC; }

static int fabric_open(struct fi_fabric_attr *attr, struct fid_fabric **out, void *context) {
    if (attr && attr->name && strcmp(attr->name, fabric_name()) != 0) return -FI_ENODATA;
    struct fid_fabric *f = calloc(1, sizeof *f);
    if (!f) return -FI_ENOMEM;
    f->fid = (struct fid){.fclass = FI_CLASS_FABRIC, .context = context, .ops = &fabric_fi_ops};
    f->ops = &fabric_ops;
    *out = f;
    return 0;
}

/* ------------------------------------------------------------------------------------------ getinfo */

static int fits(const struct fi_info *hints, const char *domain) {
    if (!hints) return 1;
    if (hints->caps & ~(uint64_t)(SIM_CAPS | FI_REMOTE_CQ_DATA)) return 0;
    if (hints->ep_attr && hints->ep_attr->type != FI_EP_UNSPEC && hints->ep_attr->type != FI_EP_RDM) return 0;
    if (hints->addr_format != FI_FORMAT_UNSPEC && hints->addr_format != FI_ADDR_STR) return 0;
    if (hints->fabric_attr && hints->fabric_attr->name && strcmp(hints->fabric_attr->name, fabric_name()) != 0)
        return 0;
    if (hints->domain_attr) {
        const struct fi_domain_attr *d = hints->domain_attr;
        if (d->name && strcmp(d->name, domain) != 0) return 0;
        if (d->mr_mode != FI_MR_UNSPEC && (d->mr_mode & SIM_MR_MODE) != SIM_MR_MODE) return 0;
        if (d->cq_data_size > SIM_CQ_DATA) return 0;
    }
    if (hints->tx_attr && hints->tx_attr->inject_size > SIM_INJECT) return 0;
    return 1;
}

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
                                   .control = nic_control, .ops_open = sim_no_ops_open};

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

static struct fi_info *describe(int index) {
    struct fi_info *info = fi_allocinfo();
    if (!info) return NULL;
    char domain[32];
    snprintf(domain, sizeof domain, "rdmap%ds0-rdm", index + 16);
    info->caps = SIM_CAPS;
    info->mode = 0;
    info->addr_format = FI_ADDR_STR;
    info->ep_attr->type = FI_EP_RDM;
    info->ep_attr->protocol = FI_PROTO_UNSPEC;
    info->ep_attr->max_msg_size = SIM_DATA_BYTES;
    info->ep_attr->tx_ctx_cnt = 1;
    info->ep_attr->rx_ctx_cnt = 1;
    info->tx_attr->caps = FI_MSG | FI_RMA | FI_SEND | FI_WRITE;
    info->tx_attr->op_flags = FI_COMPLETION;
    info->tx_attr->msg_order = FI_ORDER_SAS;
    info->tx_attr->comp_order = FI_ORDER_STRICT;
    info->tx_attr->inject_size = SIM_INJECT;
    info->tx_attr->size = SIM_TX;
    info->tx_attr->iov_limit = 1;
    info->tx_attr->rma_iov_limit = 1;
    info->rx_attr->caps = FI_MSG | FI_RMA | FI_RECV | FI_REMOTE_WRITE;
    info->rx_attr->op_flags = FI_COMPLETION;
    info->rx_attr->msg_order = FI_ORDER_SAS;
    info->rx_attr->size = SIM_RX;
    info->rx_attr->iov_limit = 1;
    info->domain_attr->name = strdup(domain);
    info->domain_attr->threading = FI_THREAD_SAFE;
    info->domain_attr->control_progress = FI_PROGRESS_AUTO;
    info->domain_attr->data_progress = FI_PROGRESS_AUTO;
    info->domain_attr->resource_mgmt = FI_RM_ENABLED;
    info->domain_attr->av_type = FI_AV_TABLE;
    info->domain_attr->mr_mode = SIM_MR_MODE;
    info->domain_attr->mr_key_size = 8;
    info->domain_attr->cq_data_size = SIM_CQ_DATA;
    info->domain_attr->cq_cnt = 1;
    info->domain_attr->ep_cnt = 1;
    info->domain_attr->tx_ctx_cnt = 1;
    info->domain_attr->rx_ctx_cnt = 1;
    info->domain_attr->max_ep_tx_ctx = 1;
    info->domain_attr->max_ep_rx_ctx = 1;
    info->domain_attr->mr_iov_limit = 1;
    info->domain_attr->mr_cnt = SIM_MRS;
    info->fabric_attr->name = strdup(fabric_name());
    domain[strlen(domain) - 4] = 0; /* the device: rdmapNs0 */
    struct sim_nic *nic = nic_new(domain);
    if (!nic) {
        fi_freeinfo(info);
        return NULL;
    }
    info->nic = &nic->fid;
    info->fabric_attr->prov_version = FI_VERSION(1, 0);
    return info;
}

static int sim_getinfo(uint32_t version, const char *node, const char *service, uint64_t flags,
                       const struct fi_info *hints, struct fi_info **out) {
    struct fi_info *head = NULL, **tail = &head;
    for (int i = 0; i < sim_model.nics; i++) {
        char domain[32];
        snprintf(domain, sizeof domain, "rdmap%ds0-rdm", i + 16);
        if (!fits(hints, domain)) continue;
        struct fi_info *info = describe(i);
        if (!info) {
            fi_freeinfo(head);
            return -FI_ENOMEM;
        }
        if (hints && hints->caps) info->caps = (hints->caps & FI_REMOTE_CQ_DATA) | SIM_CAPS;
        *tail = info;
        tail = &info->next;
    }
    *out = head;
    return head ? 0 : -FI_ENODATA;
}

static void sim_cleanup(void) {}

static struct fi_provider sim_provider = {
    .version = FI_VERSION(1, 0),
    .fi_version = FI_VERSION(FI_MAJOR_VERSION, FI_MINOR_VERSION),
    .name = SIM_NAME,
    .getinfo = sim_getinfo,
    .fabric = fabric_open,
    .cleanup = sim_cleanup,
};

FI_EXT_INI {
    sim_model_read();
    return &sim_provider;
}
