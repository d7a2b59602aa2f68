/* Completion counters: a value and an error count the application reads, adds to, sets and waits on. The
 * model does not count an endpoint's completions into them (binding one to an endpoint is -FI_ENOSYS, and
 * fi_info reports cntr_cnt 0, as EFA's does), so they move only by the application's own calls. */
#include "sim.h"

#include <stdlib.h>
#include <time.h>

struct sim_cntr {
    struct fid_cntr fid;
    struct sim_domain *domain;
    int wait_obj;
    _Atomic uint64_t value, errors;
};

static uint64_t cntr_read(struct fid_cntr *fid) { return atomic_load(&((struct sim_cntr *)fid)->value); }
static uint64_t cntr_readerr(struct fid_cntr *fid) { return atomic_load(&((struct sim_cntr *)fid)->errors); }

static int cntr_add(struct fid_cntr *fid, uint64_t value) {
    atomic_fetch_add(&((struct sim_cntr *)fid)->value, value);
    return 0;
}

static int cntr_set(struct fid_cntr *fid, uint64_t value) {
    atomic_store(&((struct sim_cntr *)fid)->value, value);
    return 0;
}

static int cntr_adderr(struct fid_cntr *fid, uint64_t value) {
    atomic_fetch_add(&((struct sim_cntr *)fid)->errors, value);
    return 0;
}

static int cntr_seterr(struct fid_cntr *fid, uint64_t value) {
    atomic_store(&((struct sim_cntr *)fid)->errors, value);
    return 0;
}

/* Until the value reaches threshold (0), an error is counted meanwhile (-FI_EAVAIL), or timeout ms pass
 * (-FI_ETIMEDOUT; -1: none). Another thread's fi_cntr_add is what can end it: it polls, sleeping between. */
static int cntr_wait(struct fid_cntr *fid, uint64_t threshold, int timeout) {
    struct sim_cntr *c = (struct sim_cntr *)fid;
    if (c->wait_obj == FI_WAIT_NONE) return -FI_ENOSYS;
    uint64_t errors = atomic_load(&c->errors);
    uint64_t deadline = timeout < 0 ? UINT64_MAX : sim_wall_ns() + (uint64_t)timeout * 1000000;
    for (;;) {
        if (atomic_load(&c->value) >= threshold) return 0;
        if (atomic_load(&c->errors) != errors) return -FI_EAVAIL;
        if (sim_wall_ns() >= deadline) return -FI_ETIMEDOUT;
        nanosleep(&(struct timespec){0, 100000}, NULL);
    }
}

static int cntr_close(struct fid *fid) {
    struct sim_cntr *c = (struct sim_cntr *)fid;
    atomic_fetch_sub(&c->domain->refs, 1);
    free(c);
    return 0;
}

static struct fi_ops cntr_fi_ops = {.size = sizeof(struct fi_ops), .close = cntr_close, .bind = sim_no_bind,
                                    .control = sim_no_control, .ops_open = sim_no_ops_open, .ops_set = sim_no_ops_set};
static struct fi_ops_cntr cntr_ops = {.size = sizeof(struct fi_ops_cntr), .read = cntr_read, .readerr = cntr_readerr,
                                      .add = cntr_add, .set = cntr_set, .wait = cntr_wait, .adderr = cntr_adderr,
                                      .seterr = cntr_seterr};

int sim_cntr_open(struct fid_domain *dfid, struct fi_cntr_attr *attr, struct fid_cntr **out, void *context) {
    int wait = attr ? attr->wait_obj : FI_WAIT_NONE;
    if (wait != FI_WAIT_NONE && wait != FI_WAIT_UNSPEC && wait != FI_WAIT_YIELD) return -FI_ENOSYS;
    if (attr && attr->events != FI_CNTR_EVENTS_COMP) return -FI_ENOSYS;
    struct sim_cntr *c = calloc(1, sizeof *c);
    if (!c) return -FI_ENOMEM;
    c->fid.fid = (struct fid){.fclass = FI_CLASS_CNTR, .context = context, .ops = &cntr_fi_ops};
    c->fid.ops = &cntr_ops;
    c->domain = (struct sim_domain *)dfid;
    c->wait_obj = wait;
    atomic_fetch_add(&c->domain->refs, 1);
    *out = &c->fid;
    return 0;
}
