/* The provider's entry (fi_prov_ini), the fabric and the domain (one modeled NIC). fi_getinfo's answer is
 * sim_getinfo.c's. */
#include "sim.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <unistd.h>

#include <rdma/providers/fi_prov.h>

/* ------------------------------------------------------------------------------------------ domain */

static int domain_close(struct fid *fid) {
    struct sim_domain *d = (struct sim_domain *)fid;
    pthread_mutex_lock(&d->lock);
    int busy = d->slots_used || d->registrations || atomic_load(&d->refs);
    pthread_mutex_unlock(&d->lock);
    if (busy) return -FI_EBUSY; /* endpoints, registrations, AVs, CQs or counters are still open on it */
    atomic_store(&d->seg->alive, 0);
    munmap(d->seg, sim_segment_size());
    close(d->memfd);
    atomic_fetch_sub(&d->fabric->refs, 1);
    pthread_mutex_destroy(&d->lock);
    free(d);
    return 0;
}

static int endpoint2(struct fid_domain *domain, struct fi_info *info, struct fid_ep **ep, uint64_t flags,
                     void *context) {
    return flags ? -FI_EBADFLAGS : sim_ep_open(domain, info, ep, context);
}

static struct fi_ops domain_fi_ops = {.size = sizeof(struct fi_ops), .close = domain_close, .bind = sim_no_bind,
                                      .control = sim_no_control, .ops_open = sim_no_ops_open,
                                      .ops_set = sim_no_ops_set};
static struct fi_ops_domain domain_ops = {
    .size = sizeof(struct fi_ops_domain), .av_open = sim_av_open, .cq_open = sim_cq_open, .endpoint = sim_ep_open,
    .scalable_ep = sim_no_scalable_ep, .cntr_open = sim_cntr_open, .poll_open = sim_no_poll_open,
    .stx_ctx = sim_no_stx_ctx, .srx_ctx = sim_no_srx_ctx, .query_atomic = sim_no_query_atomic,
    .query_collective = sim_no_query_collective, .endpoint2 = endpoint2};

static int domain_open(struct fid_fabric *ffid, struct fi_info *info, struct fid_domain **out, void *context) {
    int index = sim_domain_index(info && info->domain_attr ? info->domain_attr->name : NULL);
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
    pthread_mutex_init(&d->lock, NULL);
    d->fabric = (struct sim_fabric *)ffid;
    atomic_fetch_add(&d->fabric->refs, 1);
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

/* ------------------------------------------------------------------------------------------ fabric */

static int fabric_close(struct fid *fid) {
    struct sim_fabric *f = (struct sim_fabric *)fid;
    if (atomic_load(&f->refs)) return -FI_EBUSY; /* domains or EQs are still open on it */
    free(f);
    return 0;
}

static int domain2(struct fid_fabric *fabric, struct fi_info *info, struct fid_domain **dom, uint64_t flags,
                   void *context) {
    return flags ? -FI_EBADFLAGS : domain_open(fabric, info, dom, context);
}

/* 0 if the application may block on every object's wait fd, -FI_EAGAIN if one has something already. Only
 * EQs hand out an fd (FI_WAIT_FD). */
static int fabric_trywait(struct fid_fabric *fabric, struct fid **fids, int count) {
    for (int i = 0; i < count; i++) {
        if (!fids || !fids[i] || fids[i]->fclass != FI_CLASS_EQ) return -FI_EINVAL;
        int rc = sim_eq_trywait(fids[i]);
        if (rc) return rc;
    }
    return 0;
}

static struct fi_ops fabric_fi_ops = {.size = sizeof(struct fi_ops), .close = fabric_close, .bind = sim_no_bind,
                                      .control = sim_no_control, .ops_open = sim_no_ops_open,
                                      .ops_set = sim_no_ops_set};
static struct fi_ops_fabric fabric_ops = {.size = sizeof(struct fi_ops_fabric), .domain = domain_open,
                                          .passive_ep = sim_no_passive_ep, .eq_open = sim_eq_open,
                                          .wait_open = sim_no_wait_open, .trywait = fabric_trywait,
                                          .domain2 = domain2};

static int fabric_open(struct fi_fabric_attr *attr, struct fid_fabric **out, void *context) {
    if (attr && attr->name && strcmp(attr->name, sim_fabric_name()) != 0) return -FI_ENODATA;
    struct sim_fabric *f = calloc(1, sizeof *f);
    if (!f) return -FI_ENOMEM;
    f->fid.fid = (struct fid){.fclass = FI_CLASS_FABRIC, .context = context, .ops = &fabric_fi_ops};
    f->fid.ops = &fabric_ops;
    *out = &f->fid;
    return 0;
}

/* ----------------------------------------------------------------------------------- the provider */

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
