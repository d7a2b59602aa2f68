/* The service's per-path failover and revival (fabriclab.Engine): a NIC that stops reaching one peer (a
 * write failed on the way there, or its writes stopped completing) marks that path dead and sends the
 * writes bound there through other NICs; when a peer connects again (Engine.connect) every path gets another
 * chance. The service's table of callbacks for the core (flc_service_failover) lives here: a write that
 * fails either goes elsewhere or fails its transfer, never the engine. */
#define _GNU_SOURCE
#include "core_internal.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

enum flc_path flc_path_dead(const fl_engine *e, const nic_state *ns, int nic_index, fi_addr_t dest) {
    if (e->nics[nic_index].down) return FLC_PATH_FAILED;
    for (int i = 0; i < ns->dead_paths; i++)
        if (ns->dead_dests[i] == dest) return ns->dead_stalled[i] ? FLC_PATH_STALLED : FLC_PATH_FAILED;
    return FLC_PATH_ALIVE;
}

/* A write moved off a dead path carries why that path died, so that a transfer failing for want of any
 * path can tell a stall (the peer may well be alive) from errors. */
fl_op flc_moved_off(const fl_op *op, enum flc_path why) {
    fl_op out = *op;
    if (why == FLC_PATH_STALLED) out.flags |= FL_OP_STALLED;
    return out;
}

/* Hand a write to another worker's inbox: 0 when it is full. */
static int flc_push_inbox(engine_state *st, int worker, const fl_op *op) {
    inbox *box = &st->inboxes[worker];
    pthread_mutex_lock(&box->lock);
    uint32_t tail = atomic_load_explicit(&box->tail, memory_order_relaxed);
    int room = tail - atomic_load_explicit(&box->head, memory_order_acquire) < FLC_INBOX_CAPACITY;
    if (room) {
        box->ops[tail % FLC_INBOX_CAPACITY] = *op;
        atomic_store_explicit(&box->tail, tail + 1, memory_order_release);
    }
    pthread_mutex_unlock(&box->lock);
    if (room) flc_wake_worker(st, worker);
    return room;
}

/* Send a write through another NIC that still reaches its peer (this worker's first, then the others'
 * through their inboxes); fail it when no NIC does. */
void flc_reroute(thread_ctx *t, const fl_op *failed) {
    fl_engine *e = t->e;
    for (int pass = 0; pass < 2; pass++) {
        for (int i = 0; i < e->nnics; i++) {
            int k = (int)((t->reroute_rr + (uint32_t)i) % (uint32_t)e->nnics);
            int owner = e->nics[k].group, mine = owner == t->id;
            const fl_route *route = &failed->routes[k];
            /* another worker's table is read without its lock: a stale answer only costs one more hop */
            if (k == failed->nic || mine != (pass == 0) || flc_path_dead(e, &t->st->nics[k], k, route->dest))
                continue;
            fl_op op = *failed;
            op.remote = route->remote_base + (failed->remote - failed->routes[failed->nic].remote_base);
            op.rkey = route->rkey;
            op.desc = (void *)(uintptr_t)route->desc;
            op.dest = route->dest;
            op.nic = (uint16_t)k;
            if (mine && !ring_full(&e->nics[k])) {
                *ring_slot(&e->nics[k]) = op;
                e->nics[k].ring_tail++;
            } else if (!flc_push_inbox(t->st, owner, &op)) {
                continue;
            }
            t->reroute_rr = (uint32_t)k + 1;
            return;
        }
    }
    /* no NIC reaches the peer: FI_ETIMEDOUT when this write's path stopped completing writes (no error
     * came back: the peer may be alive, see fabriclab.engine), FI_EHOSTUNREACH when paths failed */
    flc_transfer_done(e, failed->transfer, (failed->flags & FL_OP_STALLED) ? -FI_ETIMEDOUT : -FI_EHOSTUNREACH);
}

static void flc_mark_path_dead(fl_engine *e, nic_state *ns, int nic_index, fi_addr_t dest, int stalled) {
    for (int i = 0; i < ns->revived_paths; i++) /* its second chance is spent */
        if (ns->revived_dests[i] == dest) ns->revived_dests[i--] = ns->revived_dests[--ns->revived_paths];
    if (flc_path_dead(e, ns, nic_index, dest)) return;
    if (ns->dead_paths < FLC_MAX_DEAD_PATHS) {
        ns->dead_stalled[ns->dead_paths] = (uint8_t)(stalled != 0);
        ns->dead_dests[ns->dead_paths++] = dest;
    } else {
        e->nics[nic_index].down = 1;
    }
}

/* How long a write waits before its second try after a path error on a freshly revived path: a tenth of
 * the link timeout, within [FLC_RETRY_HOLD_MIN_NS, FLC_RETRY_HOLD_MAX_NS] and never over a quarter of it.
 * Long enough for a provider to finish tearing down the old connection (tcp;ofi_rxm handles the peer's
 * shutdown in its own progress, some milliseconds after the error it reported: posted at once, the second
 * try often fails the same way), short next to the link timeout. */
#define FLC_RETRY_HOLD_MIN_NS 50000000ull
#define FLC_RETRY_HOLD_MAX_NS 250000000ull

static int flc_path_revived(const nic_state *ns, fi_addr_t dest) {
    if (ns->revived_all) return 1;
    for (int i = 0; i < ns->revived_paths; i++)
        if (ns->revived_dests[i] == dest) return 1;
    return 0;
}

/* A write failed with a path error. If its path was revived (Engine.connect) since it last failed and the
 * write has not had its second try yet, hold it for one more post on this NIC and return 1: right after a
 * revival the provider may still hold the connection that failed (tcp;ofi_rxm: the first write after the
 * peer dropped it goes down the old socket and fails with ENOTCONN, and only then is the connection
 * replaced). Else 0: the caller declares the path dead. */
static int flc_retry_after_revival(thread_ctx *t, int nic_index, const fl_op *op) {
    nic_state *ns = &t->st->nics[nic_index];
    if ((op->flags & FL_OP_RETRIED) || !flc_path_revived(ns, op->dest)) return 0;
    if (ns->held_len == ns->held_cap) { /* only on this failure path, never per write */
        uint32_t cap = ns->held_cap ? 2 * ns->held_cap : 64;
        fl_op *grown = realloc(ns->held, cap * sizeof *grown);
        if (!grown) return 0;
        ns->held = grown;
        ns->held_cap = cap;
    }
    uint64_t hold = (uint64_t)(t->link_timeout_s * 1e8), quarter = (uint64_t)(t->link_timeout_s * 25e7);
    hold = hold < FLC_RETRY_HOLD_MIN_NS ? FLC_RETRY_HOLD_MIN_NS : hold > FLC_RETRY_HOLD_MAX_NS ? FLC_RETRY_HOLD_MAX_NS
                                                                                             : hold;
    if (quarter < hold) hold = quarter;
    if (ns->held_len == 0) ns->held_until_ns = fl_now_ns() + hold;
    fl_op *again = &ns->held[ns->held_len++];
    *again = *op;
    again->flags |= FL_OP_RETRIED;
    t->e->nics[nic_index].retried++;
    return 1;
}

/* Queue the held writes of a NIC once their hold is over (as many as its ring takes). */
void flc_release_held(thread_ctx *t, int nic_index) {
    nic_state *ns = &t->st->nics[nic_index];
    fl_nic *n = &t->e->nics[nic_index];
    if (fl_now_ns() < ns->held_until_ns) return;
    uint32_t moved = 0;
    while (moved < ns->held_len && !ring_full(n)) {
        *ring_slot(n) = ns->held[moved++];
        n->ring_tail++;
    }
    memmove(ns->held, ns->held + moved, (ns->held_len - moved) * sizeof *ns->held);
    ns->held_len -= moved;
}

/* Revival, on the worker that owns the NICs: forget dead paths (remembering them as revived), and swap in
 * a fresh endpoint where Python handed one over. Runs before anything submitted after the revival is
 * posted (the inbox's drain calls it too, after it sees the new writes). */
void flc_revive(thread_ctx *t) {
    fl_engine *e = t->e;
    uint32_t epoch = __atomic_load_n(&e->service.revive_epoch, __ATOMIC_ACQUIRE);
    if (epoch == t->revive_seen) return;
    t->revive_seen = epoch;
    for (int i = 0; i < t->groups->nnics; i++) {
        int k = t->groups->nics[i];
        fl_nic *n = &e->nics[k];
        nic_state *ns = &t->st->nics[k];
        struct fid_ep *fresh = __atomic_exchange_n(&n->next_ep, NULL, __ATOMIC_ACQ_REL);
        if (fresh) {
            /* the old endpoint stays open and bound to the same CQ: its late completions still come here,
             * counted through their slots, and peers may still write to its address */
            n->ep = fresh;
            n->renewals++;
            n->unreported_here = 0;
            ns->last_had_more = 0;
        }
        memcpy(ns->revived_dests, ns->dead_dests, sizeof ns->dead_dests);
        ns->revived_paths = ns->dead_paths;
        ns->revived_all = n->down;
        ns->dead_paths = 0;
        n->down = 0;
    }
}

/* Send every write of a NIC whose path is dead (in flight: outcome unknown; or queued) through other NICs.
 * `stalled`: the paths died for want of completions; the writes in flight on them carry that along. */
static void flc_reroute_dead_paths(thread_ctx *t, int nic_index, int stalled) {
    fl_nic *n = &t->e->nics[nic_index];
    nic_state *ns = &t->st->nics[nic_index];
    n->down_ns = fl_now_ns();
    for (uint32_t s = 0; s < n->max_in_flight; s++) {
        op_slot *slot = &ns->slots[s];
        enum flc_path why = slot->in_flight ? flc_path_dead(t->e, ns, nic_index, slot->op.dest) : FLC_PATH_ALIVE;
        if (!why) continue;
        flc_abandon(t->e, n, slot);
        n->in_flight--;
        n->resent++;
        fl_op op = flc_moved_off(&slot->op, stalled ? FLC_PATH_STALLED : why);
        flc_reroute(t, &op);
    }
    uint32_t keep = n->ring_head;
    for (uint32_t i = n->ring_head; i != n->ring_tail; i++) {
        fl_op op = n->ring[i % n->ring_capacity];
        enum flc_path why = flc_path_dead(t->e, ns, nic_index, op.dest);
        if (why) {
            n->resent++;
            op = flc_moved_off(&op, why);
            flc_reroute(t, &op);
        } else {
            n->ring[keep++ % n->ring_capacity] = op;
        }
    }
    n->ring_tail = keep;
}

/* A NIC with writes in flight and no completion for link_timeout_s no longer reaches the peers of those
 * writes. */
void flc_paths_down(thread_ctx *t, int nic_index) {
    fl_nic *n = &t->e->nics[nic_index];
    nic_state *ns = &t->st->nics[nic_index];
    int before = ns->dead_paths;
    for (uint32_t s = 0; s < n->max_in_flight; s++)
        if (ns->slots[s].in_flight) flc_mark_path_dead(t->e, ns, nic_index, ns->slots[s].op.dest, 1);
    snprintf(n->down_why, sizeof n->down_why, "no completion for %.1f s with %u writes in flight: %d peer path(s) "
             "marked down", t->link_timeout_s, n->in_flight, ns->dead_paths - before);
    flc_reroute_dead_paths(t, nic_index, 1);
}

/* Errors that say the way to the peer failed (connection reset, canceled, unreachable, ...), not that the
 * write itself was wrong, nor that the peer's endpoint hears as many senders as it can (FI_ENOSPC): those
 * are failed over like a stalled link. */
static int flc_path_error(int err) {
    return err != FI_EINVAL && err != FI_EACCES && err != FI_EPERM && err != FI_EMSGSIZE && err != FI_EFAULT &&
           err != FI_ENOSYS && err != FI_EOPNOTSUPP && err != FI_EBADFLAGS && err != FI_ENOSPC;
}

/* ------------------------------------------------------------------ the service's callbacks for the core */

/* fi_writemsg refused a write: failed over when the way to the peer failed, else its transfer fails. */
static enum flc_post flc_service_post_failed(thread_ctx *t, int nic_index, const fl_op *op, int err) {
    fl_nic *n = &t->e->nics[nic_index];
    if (t->link_timeout_s > 0 && flc_path_error(-err) && flc_retry_after_revival(t, nic_index, op)) {
        snprintf(n->down_why, sizeof n->down_why, "fi_writemsg failed right after a revival (%s): posted once "
                 "more", fi_strerror(-err));
    } else if (t->link_timeout_s > 0 && flc_path_error(-err)) {
        flc_mark_path_dead(t->e, &t->st->nics[nic_index], nic_index, op->dest, 0);
        snprintf(n->down_why, sizeof n->down_why, "fi_writemsg: %s", fi_strerror(-err));
        n->resent++;
        flc_reroute(t, op);
    } else {
        flc_transfer_done(t->e, op->transfer, err);
    }
    return FLC_POST_REFUSED;
}

static enum flc_post flc_service_imm_refused(thread_ctx *t, int nic_index, const fl_op *op) {
    (void)nic_index;
    flc_transfer_done(t->e, op->transfer, -FI_EINVAL);
    return FLC_POST_REFUSED;
}

/* A write completed in error: one given up on before is only reported now; one whose way to the peer failed
 * goes elsewhere (a gone peer ends as PeerLost once no NIC reaches it); else its transfer fails. A peer's
 * write into us that failed is its writer's to report. */
static enum flc_reap flc_service_write_failed(thread_ctx *t, int nic_index, op_slot *slot,
                                              const struct fi_cq_err_entry *err) {
    fl_nic *n = &t->e->nics[nic_index];
    nic_state *ns = &t->st->nics[nic_index];
    if (!slot) return FLC_REAP_GO_ON;
    int failed_over = t->link_timeout_s > 0 && flc_path_error(err->err);
    if (slot->abandoned) {
        flc_abandoned_done(t->e, n, slot);
    } else if (failed_over && flc_retry_after_revival(t, nic_index, &slot->op)) {
        n->in_flight--; /* posted once more on this NIC, after the retry hold */
        slot->in_flight = 0;
        snprintf(n->down_why, sizeof n->down_why, "a write failed right after a revival (%s): posted once more",
                 fi_strerror(err->err));
    } else if (failed_over) {
        n->in_flight--;
        slot->in_flight = 0;
        n->resent++;
        flc_mark_path_dead(t->e, ns, nic_index, slot->op.dest, 0);
        snprintf(n->down_why, sizeof n->down_why, "a write failed: %s", fi_strerror(err->err));
        flc_reroute(t, &slot->op);
        flc_reroute_dead_paths(t, nic_index, 0);
    } else {
        n->in_flight--;
        slot->in_flight = 0;
        flc_transfer_done(t->e, slot->op.transfer, err->err ? -err->err : -FI_EIO);
    }
    flc_free_slot(ns, slot);
    return FLC_REAP_GO_ON;
}

/* Service NICs have no group: a quiet one takes down the paths of its writes, never the engine. */
static int flc_service_link_quiet(thread_ctx *t, int nic_index) {
    flc_paths_down(t, nic_index);
    return 0;
}

static int flc_service_moved_if_dead(thread_ctx *t, int nic_index, const fl_op *op) {
    enum flc_path why = flc_path_dead(t->e, &t->st->nics[nic_index], nic_index, op->dest);
    if (!why) return 0;
    t->e->nics[nic_index].resent++;
    fl_op moved = flc_moved_off(op, why);
    flc_reroute(t, &moved);
    return 1;
}

const flc_failover flc_service_failover = {
    .post_failed = flc_service_post_failed,
    .imm_refused = flc_service_imm_refused,
    .write_failed = flc_service_write_failed,
    .link_quiet = flc_service_link_quiet,
    .check_deadline = NULL, /* a service transfer's deadline is its caller's (fabriclab.Engine) */
    .moved_if_dead = flc_service_moved_if_dead,
};
