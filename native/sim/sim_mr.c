/* Memory registrations: a slot in the domain's segment that remote writers check key, range and access
 * against, as the target NIC would. */
#include "sim.h"

#include <stdlib.h>
#include <sys/uio.h>

static int mr_close(struct fid *fid) {
    struct sim_mr *mr = (struct sim_mr *)fid;
    atomic_store(&mr->domain->seg->mrs[mr->slot].key, 0);
    mr->domain->registrations--;
    free(mr);
    return 0;
}

static struct fi_ops mr_fi_ops = {.size = sizeof(struct fi_ops), .close = mr_close, .bind = sim_no_bind,
                                  .control = sim_no_control, .ops_open = sim_no_ops_open};

static int mr_regattr(struct fid *fid, const struct fi_mr_attr *attr, uint64_t flags, struct fid_mr **out) {
    struct sim_domain *d = (struct sim_domain *)fid;
    if (attr->iov_count != 1) return -FI_EINVAL;
    if (attr->iface != FI_HMEM_SYSTEM) return -FI_ENOSYS;
    /* a key names its slot and a generation: a stale key of a closed registration never matches again */
    static _Atomic uint32_t generation;
    uint64_t gen = (uint64_t)(atomic_fetch_add(&generation, 1) + 1) << 32;
    for (int i = 0; i < SIM_MRS; i++) {
        struct sim_mr_slot *s = &d->seg->mrs[i];
        uint64_t expected = 0, key = gen | (uint64_t)i;
        if (atomic_load(&s->key) != 0) continue;
        s->addr = (uint64_t)(uintptr_t)attr->mr_iov[0].iov_base;
        s->len = attr->mr_iov[0].iov_len;
        s->access = attr->access;
        if (!atomic_compare_exchange_strong(&s->key, &expected, key)) continue;
        struct sim_mr *mr = calloc(1, sizeof *mr);
        if (!mr) {
            atomic_store(&s->key, 0);
            return -FI_ENOMEM;
        }
        mr->fid.fid = (struct fid){.fclass = FI_CLASS_MR, .context = attr->context, .ops = &mr_fi_ops};
        mr->fid.mem_desc = mr;
        mr->fid.key = key;
        mr->domain = d;
        mr->slot = i;
        d->registrations++;
        *out = &mr->fid;
        return 0;
    }
    return -FI_ENOSPC;
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
