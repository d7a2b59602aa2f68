/* Address vectors: a peer is its endpoint's slot in the peer process's segment, mapped on insert. Endpoints
 * bound to an AV hold it open (fi_close is -FI_EBUSY until they are closed), and each of them sends through
 * ports of its own: sharing the AV never means sharing a single-producer ring. */
#include "sim.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

static int av_insert(struct fid_av *fid, const void *addr, size_t count, fi_addr_t *fi_addr, uint64_t flags,
                     void *context) {
    struct sim_av *av = (struct sim_av *)fid;
    if (!addr && count) return -FI_EINVAL;
    const char *a = addr;
    int inserted = 0;
    pthread_mutex_lock(&av->lock);
    for (size_t i = 0; i < count; i++, a += SIM_ADDR_LEN) {
        int nic, pid, fd, slot, at = atomic_load_explicit(&av->count, memory_order_relaxed);
        uint32_t serial;
        if (at >= SIM_MAX_AV || sim_parse_addr(a, &nic, &pid, &fd, &serial, &slot) != 0) {
            if (fi_addr) fi_addr[i] = FI_ADDR_NOTAVAIL; /* no room, or not a sim address */
            continue;
        }
        /* inserting asks nothing of the peer (EFA makes its address handles locally): an endpoint already
         * gone is inserted too, and what is sent to it fails with FI_EHOSTUNREACH */
        struct sim_segment *seg = sim_map_peer(pid, fd, serial);
        struct sim_watch *watch = seg ? sim_watch_open(pid) : NULL;
        if (seg && !watch) { /* no memory to watch its process */
            munmap(seg, sim_segment_size());
            if (fi_addr) fi_addr[i] = FI_ADDR_NOTAVAIL;
            continue;
        }
        struct sim_peer *p = &av->peers[at];
        *p = (struct sim_peer){.seg = seg, .pid = pid, .watch = watch, .serial = serial, .slot = slot, .gone = !seg};
        memcpy(p->addr, a, SIM_ADDR_LEN);
        atomic_store_explicit(&av->count, at + 1, memory_order_release); /* posts from other threads see it filled */
        if (fi_addr) fi_addr[i] = (fi_addr_t)at;
        inserted++;
    }
    pthread_mutex_unlock(&av->lock);
    return inserted;
}

/* The peer is forgotten: the endpoints bound here give back their ports in it, and its mapping goes. */
static void forget(struct sim_av *av, fi_addr_t at) {
    struct sim_peer *p = &av->peers[at];
    for (int e = 0; e < av->neps; e++) {
        sim_ep_lock(av->eps[e]);
        sim_release_port(av->eps[e], at);
        sim_ep_unlock(av->eps[e]);
    }
    if (p->watch) sim_watch_close(p->watch);
    if (p->seg) munmap(p->seg, sim_segment_size());
    p->seg = NULL;
    p->watch = NULL;
    p->gone = 0;
}

static int known(struct sim_av *av, fi_addr_t at) {
    return at < (fi_addr_t)atomic_load(&av->count) && (av->peers[at].seg || av->peers[at].gone);
}

static int av_remove(struct fid_av *fid, fi_addr_t *fi_addr, size_t count, uint64_t flags) {
    struct sim_av *av = (struct sim_av *)fid;
    if (!fi_addr && count) return -FI_EINVAL;
    int rc = 0;
    pthread_mutex_lock(&av->lock);
    for (size_t i = 0; i < count && !rc; i++) {
        if (!known(av, fi_addr[i])) {
            rc = -FI_EINVAL;
            break;
        }
        forget(av, fi_addr[i]);
    }
    pthread_mutex_unlock(&av->lock);
    return rc;
}

static int av_lookup(struct fid_av *fid, fi_addr_t fi_addr, void *addr, size_t *addrlen) {
    struct sim_av *av = (struct sim_av *)fid;
    if (!addrlen || !known(av, fi_addr)) return -FI_EINVAL;
    size_t have = *addrlen;
    *addrlen = SIM_ADDR_LEN;
    if (addr) memcpy(addr, av->peers[fi_addr].addr, have < SIM_ADDR_LEN ? have : SIM_ADDR_LEN);
    return 0;
}

static const char *av_straddr(struct fid_av *fid, const void *addr, char *buf, size_t *len) {
    if (!addr || !buf || !len || !*len) return NULL;
    snprintf(buf, *len, "%.*s", SIM_ADDR_LEN, (const char *)addr);
    *len = strnlen(addr, SIM_ADDR_LEN) + 1;
    return buf;
}

static int av_insertsvc(struct fid_av *av, const char *node, const char *service, fi_addr_t *fi_addr,
                        uint64_t flags, void *context) {
    return -FI_ENOSYS; /* sim addresses are not host names and services */
}

static int av_insertsym(struct fid_av *av, const char *node, size_t nodecnt, const char *service, size_t svccnt,
                        fi_addr_t *fi_addr, uint64_t flags, void *context) {
    return -FI_ENOSYS;
}

int sim_av_bind(struct sim_av *av, struct sim_ep *ep) {
    pthread_mutex_lock(&av->lock);
    int rc = av->neps == SIM_EPS ? -FI_ENOSPC : 0;
    if (!rc) av->eps[av->neps++] = ep;
    pthread_mutex_unlock(&av->lock);
    return rc;
}

void sim_av_unbind(struct sim_av *av, struct sim_ep *ep) {
    pthread_mutex_lock(&av->lock);
    for (int i = 0; i < av->count; i++) sim_release_port(ep, (fi_addr_t)i);
    for (int i = 0; i < av->neps; i++)
        if (av->eps[i] == ep) av->eps[i] = av->eps[--av->neps];
    pthread_mutex_unlock(&av->lock);
}

static int av_close(struct fid *fid) {
    struct sim_av *av = (struct sim_av *)fid;
    pthread_mutex_lock(&av->lock);
    int bound = av->neps;
    pthread_mutex_unlock(&av->lock);
    if (bound) return -FI_EBUSY; /* its endpoints still send through it */
    for (int i = 0; i < av->count; i++)
        if (known(av, (fi_addr_t)i)) forget(av, (fi_addr_t)i);
    atomic_fetch_sub(&av->domain->refs, 1);
    pthread_mutex_destroy(&av->lock);
    free(av);
    return 0;
}

static struct fi_ops av_fi_ops = {.size = sizeof(struct fi_ops), .close = av_close, .bind = sim_no_bind,
                                  .control = sim_no_control, .ops_open = sim_no_ops_open, .ops_set = sim_no_ops_set};
static struct fi_ops_av av_ops = {.size = sizeof(struct fi_ops_av), .insert = av_insert, .insertsvc = av_insertsvc,
                                  .insertsym = av_insertsym, .remove = av_remove, .lookup = av_lookup,
                                  .straddr = av_straddr, .av_set = sim_no_av_set};

int sim_av_open(struct fid_domain *dfid, struct fi_av_attr *attr, struct fid_av **out, void *context) {
    if (attr && attr->type == FI_AV_MAP) return -FI_ENOSYS;   /* FI_AV_TABLE, as EFA */
    if (attr && (attr->flags & FI_EVENT)) return -FI_ENOSYS; /* inserts complete at once: no events to bind */
    if (attr && attr->name) return -FI_ENOSYS;               /* no AV shared between processes */
    struct sim_av *av = calloc(1, sizeof *av);
    if (!av) return -FI_ENOMEM;
    pthread_mutex_init(&av->lock, NULL);
    av->fid.fid = (struct fid){.fclass = FI_CLASS_AV, .context = context, .ops = &av_fi_ops};
    av->fid.ops = &av_ops;
    av->domain = (struct sim_domain *)dfid;
    atomic_fetch_add(&av->domain->refs, 1);
    *out = &av->fid;
    return 0;
}
