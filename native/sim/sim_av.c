/* Address vectors: a peer is its endpoint's slot in the peer process's segment, mapped on insert. */
#include "sim.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

static int av_insert(struct fid_av *fid, const void *addr, size_t count, fi_addr_t *fi_addr, uint64_t flags,
                     void *context) {
    struct sim_av *av = (struct sim_av *)fid;
    const char *a = addr;
    int inserted = 0;
    for (size_t i = 0; i < count; i++, a += SIM_ADDR_LEN) {
        int pid, fd, slot;
        uint32_t serial;
        struct sim_segment *seg = NULL;
        struct sim_watch *watch = NULL;
        if (av->count < SIM_MAX_AV && sim_parse_addr(a, &pid, &fd, &serial, &slot) == 0)
            seg = sim_map_peer(pid, fd, serial);
        if (seg && !(watch = sim_watch_open(pid))) munmap(seg, sim_segment_size());
        if (!watch) {
            if (fi_addr) fi_addr[i] = FI_ADDR_NOTAVAIL;
            continue;
        }
        av->peers[av->count] = (struct sim_peer){.seg = seg, .pid = pid, .watch = watch, .serial = serial, .slot = slot};
        if (fi_addr) fi_addr[i] = (fi_addr_t)av->count;
        av->count++;
        inserted++;
    }
    return inserted;
}

/* The peer is forgotten: the endpoints bound here give back their ports in it, and its mapping goes. */
static void forget(struct sim_av *av, fi_addr_t i) {
    struct sim_peer *p = &av->peers[i];
    for (int e = 0; e < SIM_EPS; e++)
        if (av->eps[e]) sim_release_port(av->eps[e], i);
    sim_watch_close(p->watch);
    munmap(p->seg, sim_segment_size());
    p->seg = NULL;
}

static int av_remove(struct fid_av *fid, fi_addr_t *fi_addr, size_t count, uint64_t flags) {
    struct sim_av *av = (struct sim_av *)fid;
    for (size_t i = 0; i < count; i++) {
        if (fi_addr[i] >= (fi_addr_t)av->count || !av->peers[fi_addr[i]].seg) return -FI_EINVAL;
        forget(av, fi_addr[i]);
    }
    return 0;
}

static int av_lookup(struct fid_av *fid, fi_addr_t fi_addr, void *addr, size_t *addrlen) {
    struct sim_av *av = (struct sim_av *)fid;
    if (fi_addr >= (fi_addr_t)av->count || !av->peers[fi_addr].seg) return -FI_EINVAL;
    return -FI_ENOSYS;
}

static const char *av_straddr(struct fid_av *fid, const void *addr, char *buf, size_t *len) {
    snprintf(buf, *len, "%.*s", SIM_ADDR_LEN, (const char *)addr);
    *len = strnlen(addr, SIM_ADDR_LEN) + 1;
    return buf;
}

static int av_close(struct fid *fid) {
    struct sim_av *av = (struct sim_av *)fid;
    for (int i = 0; i < av->count; i++)
        if (av->peers[i].seg) forget(av, (fi_addr_t)i);
    free(av);
    return 0;
}

static struct fi_ops av_fi_ops = {.size = sizeof(struct fi_ops), .close = av_close, .bind = sim_no_bind,
                                  .control = sim_no_control, .ops_open = sim_no_ops_open};
static struct fi_ops_av av_ops = {.size = sizeof(struct fi_ops_av), .insert = av_insert, .remove = av_remove,
                                  .lookup = av_lookup, .straddr = av_straddr};

int sim_av_open(struct fid_domain *dfid, struct fi_av_attr *attr, struct fid_av **out, void *context) {
    if (attr && attr->type == FI_AV_MAP) return -FI_ENOSYS;
    struct sim_av *av = calloc(1, sizeof *av);
    if (!av) return -FI_ENOMEM;
    av->fid.fid = (struct fid){.fclass = FI_CLASS_AV, .context = context, .ops = &av_fi_ops};
    av->fid.ops = &av_ops;
    av->domain = (struct sim_domain *)dfid;
    *out = &av->fid;
    return 0;
}
