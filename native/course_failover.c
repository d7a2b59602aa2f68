/* A write run's writes (chapters 9-15) as the core posts them, and what the run does when one fails: the
 * course's table of callbacks for the core (flc_course_failover). A write that fails, or a NIC that stops
 * completing writes, takes its whole link down: its writes go over the group's other NICs, and the run
 * fails only when a group has none left (or, without failover, at the first failure). */
#define _GNU_SOURCE
#include "core_internal.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* Does write `seq` of a run carry its sequence number as immediate data? In the checking mode every write
 * does (warm-up writes too: the target skips their numbers). With mark_last only the group's last writes,
 * one per NIC by round robin: a write sent again after a link failure keeps its mark, as it keeps its
 * number, so the target's count of marks never depends on failures. */
static inline int marked_write(const thread_ctx *t, int nic_index, uint64_t seq) {
    if (!t->cfg->mark_last) return 1;
    return seq < t->cfg->total_writes && seq / (uint64_t)t->cfg->groups >= t->st->nics[nic_index].group->mark_from;
}

/* Write number `seq` of a run: page seq % pages of the buffer to the same page of the peer, immediate data
 * seq (when marked_write), so the target can tell a write sent twice after a link failure. */
void page_op(const thread_ctx *t, int nic_index, uint64_t seq, fl_op *op) {
    const fl_nic *n = &t->e->nics[nic_index];
    uint32_t page = (uint32_t)(seq % t->pages);
    uint64_t off = (uint64_t)page * t->cfg->page_size;
    *op = (fl_op){.local = t->cfg->local_base + off, .remote = n->remote_base + off,
                  .len = page_length(t->cfg, page), .rkey = n->rkey, .imm = seq, .desc = n->desc, .dest = n->dest,
                  .transfer = FL_NO_TRANSFER, .nic = (uint16_t)nic_index,
                  .flags = marked_write(t, nic_index, seq) ? FL_OP_IMM : 0};
}

int check_timeout(thread_ctx *t, int nic_index) {
    if (fl_now_ns() - t->last_progress_ns > t->timeout_ns) {
        flc_fail(t->e, -FI_ETIMEDOUT, "NIC %d: no completion within %.1f s with %u writes in flight (is the peer "
                 "gone?)", nic_index, t->cfg->timeout_s, t->e->nics[nic_index].in_flight);
        return -1;
    }
    return 0;
}

/* Queue write `seq` again on the next live NIC of its group, or park it until one has room. */
int requeue(thread_ctx *t, group *g, uint64_t seq) {
    for (uint32_t tries = 0; tries < (uint32_t)g->nnics; tries++) {
        int nic = g->nics[g->rr++ % (uint32_t)g->nnics];
        fl_nic *n = &t->e->nics[nic];
        if (ring_full(n)) continue;
        page_op(t, nic, seq, ring_slot(n));
        n->ring_tail++;
        return 0;
    }
    if (t->spill_len == t->spill_cap) {
        size_t cap = t->spill_cap ? 2 * t->spill_cap : 4096;
        spilled *grown = realloc(t->spill, cap * sizeof *grown);
        if (!grown) {
            flc_fail(t->e, -FI_ENOMEM, "no memory to re-queue the writes of a failed link");
            return -1;
        }
        t->spill = grown;
        t->spill_cap = cap;
    }
    t->spill[t->spill_len++] = (spilled){g, seq};
    return 0;
}

/* Declare a NIC's link down: stop using it, and send its writes again over the group's other NICs — those
 * in flight too, since whether they landed is unknown (the target counts each write once). Returns -1
 * (engine failed, the link named) when the group has no NIC left. */
static int flc_link_down(thread_ctx *t, int nic_index, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
static int flc_link_down(thread_ctx *t, int nic_index, const char *fmt, ...) {
    fl_nic *n = &t->e->nics[nic_index];
    nic_state *ns = &t->st->nics[nic_index];
    group *g = ns->group;
    if (n->down) return 0;
    n->down = 1;
    n->down_ns = fl_now_ns();
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(n->down_why, sizeof n->down_why, fmt, ap);
    va_end(ap);
    int k = 0;
    while (k < g->nnics && g->nics[k] != nic_index) k++;
    if (k < g->nnics) memmove(&g->nics[k], &g->nics[k + 1], sizeof(int) * (size_t)(g->nnics - k - 1));
    g->nnics -= k < g->nnics;
    if (g->nnics == 0) {
        flc_fail(t->e, -FI_EHOSTUNREACH, "NIC %d: link down (%s), and it was the last NIC of group %d: every link "
                 "to the peer is down", nic_index, n->down_why, g->id);
        return -1;
    }
    /* warm-up writes (numbered from total_writes on) are not counted by the target: nothing to redo */
    for (uint32_t s = 0; s < n->max_in_flight; s++)
        if (ns->slots[s].in_flight) {
            ns->slots[s].in_flight = 0;
            if (ns->slots[s].op.imm >= t->cfg->total_writes) continue;
            n->resent++;
            if (requeue(t, g, ns->slots[s].op.imm) < 0) return -1;
        }
    for (; n->ring_head != n->ring_tail; n->ring_head++) {
        n->resent++;
        if (requeue(t, g, n->ring[n->ring_head % n->ring_capacity].imm) < 0) return -1;
    }
    n->in_flight = 0;
    return 0;
}

int check_link(thread_ctx *t, int nic_index) {
    return flc_link_down(t, nic_index, "no completion for %.1f s with %u writes in flight", t->cfg->link_timeout_s,
                         t->e->nics[nic_index].in_flight) < 0 ? -1 : 0;
}

/* ------------------------------------------------------------------ the course's callbacks for the core */

static const flc_failover flc_course_failover;

void flc_run_posting(thread_ctx *t, const fl_run_config *cfg) {
    t->cfg = cfg;
    t->failover = &flc_course_failover;
    t->fi_more = cfg->fi_more;
    t->shard = cfg->shard;
    /* failover and the article's receiver need a completion to mean the bytes landed (course.c says why) */
    t->op_flags = flc_op_flags(cfg->link_timeout_s > 0 || cfg->mark_last);
    t->link_timeout_s = cfg->link_timeout_s;
    t->warmup_from = cfg->total_writes;
}

static enum flc_post flc_run_post_failed(thread_ctx *t, int nic_index, const fl_op *op, int err) {
    (void)op;
    if (t->cfg->link_timeout_s > 0)
        return flc_link_down(t, nic_index, "fi_writemsg: %s", fi_strerror(-err)) < 0 ? FLC_POST_FAILED
                                                                                     : FLC_POST_LINK_DOWN;
    flc_fail(t->e, err, "NIC %d: fi_writemsg: %s", nic_index, fi_strerror(-err));
    return FLC_POST_FAILED;
}

static enum flc_post flc_run_imm_refused(thread_ctx *t, int nic_index, const fl_op *op) {
    flc_fail(t->e, -FI_EINVAL, "NIC %d: immediate data %llu does not fit the provider's %u-byte cq_data_size; "
             "use a fabric that offers %d bytes (python -m fabriclab doctor)", nic_index, (unsigned long long)op->imm,
             t->e->nics[nic_index].cq_data_size, 4);
    return FLC_POST_FAILED;
}

/* Any write of the run that fails takes its link down (a run has no transfer to fail on its own). */
static enum flc_reap flc_run_write_failed(thread_ctx *t, int nic_index, op_slot *slot,
                                          const struct fi_cq_err_entry *err) {
    (void)slot;
    fl_nic *n = &t->e->nics[nic_index];
    char buf[256] = "";
    const char *detail = fi_cq_strerror(n->cq, err->prov_errno, err->err_data, buf, sizeof buf);
    if (t->cfg->link_timeout_s > 0)
        return flc_link_down(t, nic_index, "a write failed: %s (%s)", fi_strerror(err->err), detail ? detail : "") < 0
                   ? FLC_REAP_FAILED : FLC_REAP_LINK_DOWN;
    flc_fail(t->e, -err->err, "NIC %d: write failed: %s (%s)", nic_index, fi_strerror(err->err), detail ? detail : "");
    return FLC_REAP_FAILED;
}

static const flc_failover flc_course_failover = {
    .post_failed = flc_run_post_failed,
    .imm_refused = flc_run_imm_refused,
    .write_failed = flc_run_write_failed,
    .link_quiet = check_link,
    .check_deadline = check_timeout,
    .moved_if_dead = NULL, /* a run marks no path dead: a failing link goes down whole */
};
