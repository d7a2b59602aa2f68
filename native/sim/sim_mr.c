/* Memory registrations: a slot in the domain's segment that remote writers check key, range and access
 * against, as the target NIC would. Keys are 4 bytes, as EFA's (mr_key_size 4). */
#include "sim.h"

#include <stdlib.h>

#define GENERATIONS ((1u << (32 - SIM_MR_SLOT_BITS)) - 1) /* 1 .. GENERATIONS - 1: never SIM_MR_CLAIMED */

static int mr_close(struct fid *fid) {
    struct sim_mr *mr = (struct sim_mr *)fid;
    atomic_store_explicit(&mr->domain->seg->mrs[mr->slot].key, 0, memory_order_release);
    mr->domain->registrations--;
    free(mr);
    return 0;
}

static struct fi_ops mr_fi_ops = {.size = sizeof(struct fi_ops), .close = mr_close, .bind = sim_no_bind,
                                  .control = sim_no_control, .ops_open = sim_no_ops_open, .ops_set = sim_no_ops_set};

/* The registration a key names in a segment, or NULL: what a remote writer's NIC looks up. */
struct sim_mr_slot *sim_mr_find(struct sim_segment *seg, uint64_t key) {
    if (key >> 32 || !(key >> SIM_MR_SLOT_BITS) || key == SIM_MR_CLAIMED) return NULL;
    struct sim_mr_slot *s = &seg->mrs[key & ((1u << SIM_MR_SLOT_BITS) - 1)];
    return atomic_load_explicit(&s->key, memory_order_acquire) == key ? s : NULL;
}

/* Claim a free slot (several threads may register at once: FI_THREAD_SAFE), fill it, then publish its key. */
static int claim_slot(struct sim_domain *d, const struct fi_mr_attr *attr, uint32_t *key) {
    uint32_t start = atomic_fetch_add_explicit(&d->mr_hint, 1, memory_order_relaxed);
    for (uint32_t n = 0; n < SIM_MRS; n++) {
        uint32_t i = (start + n) % SIM_MRS, expected = 0;
        struct sim_mr_slot *s = &d->seg->mrs[i];
        if (atomic_load_explicit(&s->key, memory_order_relaxed) != 0) continue;
        if (!atomic_compare_exchange_strong(&s->key, &expected, SIM_MR_CLAIMED)) continue;
        s->generation = s->generation % (GENERATIONS - 1) + 1;
        s->addr = (uint64_t)(uintptr_t)attr->mr_iov[0].iov_base;
        s->len = attr->mr_iov[0].iov_len;
        s->access = attr->access;
        *key = s->generation << SIM_MR_SLOT_BITS | i;
        atomic_store_explicit(&d->mr_hint, i + 1, memory_order_relaxed);
        return (int)i;
    }
    return -FI_ENOSPC;
}

static int mr_regattr(struct fid *fid, const struct fi_mr_attr *attr, uint64_t flags, struct fid_mr **out) {
    struct sim_domain *d = (struct sim_domain *)fid;
    if (!attr || !out || attr->iov_count != 1) return -FI_EINVAL; /* mr_iov_limit 1 */
    if (attr->iface != FI_HMEM_SYSTEM) return -FI_ENOSYS;         /* no device memory in the model */
    struct sim_mr *mr = calloc(1, sizeof *mr);
    if (!mr) return -FI_ENOMEM;
    uint32_t key;
    int slot = claim_slot(d, attr, &key);
    if (slot < 0) {
        free(mr);
        return slot;
    }
    mr->fid.fid = (struct fid){.fclass = FI_CLASS_MR, .context = attr->context, .ops = &mr_fi_ops};
    mr->fid.mem_desc = mr;
    mr->fid.key = key;
    mr->domain = d;
    mr->slot = slot;
    d->registrations++;
    atomic_store_explicit(&d->seg->mrs[slot].key, key, memory_order_release); /* now writers may match it */
    *out = &mr->fid;
    return 0;
}

static int mr_reg(struct fid *fid, const void *buf, size_t len, uint64_t access, uint64_t offset,
                  uint64_t requested_key, uint64_t flags, struct fid_mr **mr, void *context) {
    struct iovec iov = {(void *)buf, len};
    struct fi_mr_attr attr = {.mr_iov = &iov, .iov_count = 1, .access = access, .context = context,
                              .iface = FI_HMEM_SYSTEM};
    return mr_regattr(fid, &attr, flags, mr);
}

static int mr_regv(struct fid *fid, const struct iovec *iov, size_t count, uint64_t access, uint64_t offset,
                   uint64_t requested_key, uint64_t flags, struct fid_mr **mr, void *context) {
    struct fi_mr_attr attr = {.mr_iov = iov, .iov_count = count, .access = access, .context = context,
                              .iface = FI_HMEM_SYSTEM};
    return mr_regattr(fid, &attr, flags, mr);
}

struct fi_ops_mr sim_mr_ops = {.size = sizeof(struct fi_ops_mr), .reg = mr_reg, .regv = mr_regv,
                               .regattr = mr_regattr};
