/* The library's service (fabriclab.Engine): worker threads fed through per-worker inboxes, transfers
 * finishing into a queue that fl_service_wait reads, and per-path failover and revival. See service.h. */
#define _GNU_SOURCE
#include "core_internal.h"
#include "service.h"

#include <errno.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define INBOX_CAPACITY 65536u

/* 0: the path is alive; 1: marked dead after an error (or the whole NIC is down); 2: after a stall. */
int path_dead(const fl_engine *e, const nic_state *ns, int nic_index, fi_addr_t dest) {
    if (e->nics[nic_index].down) return 1;
    for (int i = 0; i < ns->dead_paths; i++)
        if (ns->dead_dests[i] == dest) return ns->dead_stalled[i] ? 2 : 1;
    return 0;
}

static int push_inbox(engine_state *st, int worker, const fl_op *op) {
    inbox *box = &st->inboxes[worker];
    pthread_mutex_lock(&box->lock);
    uint32_t tail = atomic_load_explicit(&box->tail, memory_order_relaxed);
    int room = tail - atomic_load_explicit(&box->head, memory_order_acquire) < INBOX_CAPACITY;
    if (room) {
        box->ops[tail % INBOX_CAPACITY] = *op;
        atomic_store_explicit(&box->tail, tail + 1, memory_order_release);
    }
    pthread_mutex_unlock(&box->lock);
    if (room) wake_worker(st, worker);
    return room;
}

/* Service mode: send a write through another NIC that still reaches its peer (this worker's first, then
 * the others' through their inboxes); fail it when no NIC does. */
void service_reroute(thread_ctx *t, const fl_op *failed) {
    fl_engine *e = t->e;
    for (int pass = 0; pass < 2; pass++) {
        for (int i = 0; i < e->nnics; i++) {
            int k = (int)((t->reroute_rr + (uint32_t)i) % (uint32_t)e->nnics);
            int owner = e->nics[k].group, mine = owner == t->id;
            const fl_route *route = &failed->routes[k];
            /* another worker's table is read without its lock: a stale answer only costs one more hop */
            if (k == failed->nic || mine != (pass == 0) || path_dead(e, &t->st->nics[k], k, route->dest)) continue;
            fl_op op = *failed;
            op.remote = route->remote_base + (failed->remote - failed->routes[failed->nic].remote_base);
            op.rkey = route->rkey;
            op.desc = (void *)(uintptr_t)route->desc;
            op.dest = route->dest;
            op.nic = (uint16_t)k;
            if (mine && !ring_full(&e->nics[k])) {
                *ring_slot(&e->nics[k]) = op;
                e->nics[k].ring_tail++;
            } else if (!push_inbox(t->st, owner, &op)) {
                continue;
            }
            t->reroute_rr = (uint32_t)k + 1;
            return;
        }
    }
    /* no NIC reaches the peer: FI_ETIMEDOUT when this write's path stopped completing writes (no error
     * came back: the peer may be alive, see fabriclab.engine), FI_EHOSTUNREACH when paths failed */
    transfer_done(e, failed->transfer, (failed->flags & FL_OP_STALLED) ? -FI_ETIMEDOUT : -FI_EHOSTUNREACH);
}

void mark_path_dead(fl_engine *e, nic_state *ns, int nic_index, fi_addr_t dest, int stalled) {
    for (int i = 0; i < ns->revived_paths; i++) /* its second chance is spent */
        if (ns->revived_dests[i] == dest) ns->revived_dests[i--] = ns->revived_dests[--ns->revived_paths];
    if (path_dead(e, ns, nic_index, dest)) return;
    if (ns->dead_paths < MAX_DEAD_PATHS) {
        ns->dead_stalled[ns->dead_paths] = (uint8_t)(stalled != 0);
        ns->dead_dests[ns->dead_paths++] = dest;
    } else {
        e->nics[nic_index].down = 1;
    }
}

/* How long a write waits before its second try after a path error on a freshly revived path: a tenth of
 * the link timeout, within [RETRY_HOLD_MIN_NS, RETRY_HOLD_MAX_NS] and never over a quarter of it. Long
 * enough for a provider to finish tearing down the old connection (tcp;ofi_rxm handles the peer's shutdown
 * in its own progress, some milliseconds after the error it reported: posted at once, the second try
 * often fails the same way), short next to the link timeout. */
#define RETRY_HOLD_MIN_NS 50000000ull
#define RETRY_HOLD_MAX_NS 250000000ull

static int path_revived(const nic_state *ns, fi_addr_t dest) {
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
int retry_after_revival(thread_ctx *t, int nic_index, const fl_op *op) {
    nic_state *ns = &t->st->nics[nic_index];
    if ((op->flags & FL_OP_RETRIED) || !path_revived(ns, op->dest)) return 0;
    if (ns->held_len == ns->held_cap) { /* only on this failure path, never per write */
        uint32_t cap = ns->held_cap ? 2 * ns->held_cap : 64;
        fl_op *grown = realloc(ns->held, cap * sizeof *grown);
        if (!grown) return 0;
        ns->held = grown;
        ns->held_cap = cap;
    }
    uint64_t hold = (uint64_t)(t->cfg->link_timeout_s * 1e8), quarter = (uint64_t)(t->cfg->link_timeout_s * 25e7);
    hold = hold < RETRY_HOLD_MIN_NS ? RETRY_HOLD_MIN_NS : hold > RETRY_HOLD_MAX_NS ? RETRY_HOLD_MAX_NS : hold;
    if (quarter < hold) hold = quarter;
    if (ns->held_len == 0) ns->held_until_ns = fl_now_ns() + hold;
    fl_op *again = &ns->held[ns->held_len++];
    *again = *op;
    again->flags |= FL_OP_RETRIED;
    t->e->nics[nic_index].retried++;
    return 1;
}

/* Queue the held writes of a NIC once their hold is over (as many as its ring takes). */
static void release_held(thread_ctx *t, int nic_index) {
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
 * posted (drain_inbox calls it too, after it sees the new writes). */
static void service_revive(thread_ctx *t) {
    fl_engine *e = t->e;
    uint32_t epoch = __atomic_load_n(&e->revive_epoch, __ATOMIC_ACQUIRE);
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

void fl_service_revive(fl_engine *e) {
    __atomic_add_fetch(&e->revive_epoch, 1, __ATOMIC_RELEASE);
}

/* fl_worker_park asked this worker to keep off its NICs: sleep until it is released (or the engine stops). */
static void park_if_asked(thread_ctx *t) {
    engine_state *st = t->st;
    if (!atomic_load_explicit(&st->park_request[t->id], memory_order_acquire)) return;
    atomic_store_explicit(&st->parked[t->id], 1, memory_order_release);
    struct timespec pause = {0, 20000};
    while (atomic_load_explicit(&st->park_request[t->id], memory_order_acquire) && !stopping(t->e))
        nanosleep(&pause, NULL);
    atomic_store_explicit(&st->parked[t->id], 0, memory_order_release);
}

/* A thread enters one of the service's functions that touch what fl_service_stop frees: 0 (and it must
 * not touch it) once the stop began. The stop sets `closing` and then waits for `callers` to drop to 0;
 * a caller counts itself in and then reads `closing` (both sequentially consistent): one of them sees
 * the other. */
static int enter_service(engine_state *st) {
    atomic_fetch_add(&st->callers, 1);
    if (!atomic_load(&st->closing)) return 1;
    atomic_fetch_sub(&st->callers, 1);
    return 0;
}

static void leave_service(engine_state *st) { atomic_fetch_sub(&st->callers, 1); }

static int park_worker(fl_engine *e, engine_state *st, int nic, double timeout_s) {
    int threads = st->service_threads;
    if (threads <= 0 || nic < 0 || nic >= e->nnics) return 0;
    int w = e->nics[nic].group;
    uint64_t until = fl_now_ns() + (uint64_t)(timeout_s > 0 ? timeout_s * 1e9 : 0);
    struct timespec pause = {0, 20000};
    atomic_store_explicit(&st->park_request[w], 1, memory_order_release);
    wake_worker(st, w);
    while (!atomic_load_explicit(&st->parked[w], memory_order_acquire)) {
        if (stopping(e) || fl_now_ns() > until) {
            atomic_store_explicit(&st->park_request[w], 0, memory_order_release);
            return 0;
        }
        nanosleep(&pause, NULL);
    }
    return 1;
}

int fl_worker_park(fl_engine *e, int nic, double timeout_s) {
    engine_state *st = e->state;
    if (!st || !enter_service(st)) return 0;
    int parked = park_worker(e, st, nic, timeout_s);
    leave_service(st);
    return parked;
}

void fl_worker_unpark(fl_engine *e, int nic) {
    engine_state *st = e->state;
    int threads = st ? st->service_threads : 0;
    if (threads > 0 && nic >= 0 && nic < e->nnics)
        atomic_store_explicit(&st->park_request[e->nics[nic].group], 0, memory_order_release);
}

int fl_nic_renew(fl_engine *e, int nic, struct fid_ep *ep) {
    if (nic < 0 || nic >= e->nnics || !ep) return 0;
    struct fid_ep *none = NULL;
    return __atomic_compare_exchange_n(&e->nics[nic].next_ep, &none, ep, 0, __ATOMIC_RELEASE, __ATOMIC_RELAXED);
}

/* Send every write of a NIC whose path is dead (in flight: outcome unknown; or queued) through other NICs.
 * `stalled`: the paths died for want of completions; the writes in flight on them carry that along. */
void reroute_dead_paths(thread_ctx *t, int nic_index, int stalled) {
    fl_nic *n = &t->e->nics[nic_index];
    nic_state *ns = &t->st->nics[nic_index];
    n->down_ns = fl_now_ns();
    for (uint32_t s = 0; s < n->max_in_flight; s++) {
        op_slot *slot = &ns->slots[s];
        int why = slot->in_flight ? path_dead(t->e, ns, nic_index, slot->op.dest) : 0;
        if (!why) continue;
        abandon(t->e, n, slot);
        n->in_flight--;
        n->resent++;
        fl_op op = moved_off(&slot->op, stalled ? 2 : why);
        service_reroute(t, &op);
    }
    uint32_t keep = n->ring_head;
    for (uint32_t i = n->ring_head; i != n->ring_tail; i++) {
        fl_op op = n->ring[i % n->ring_capacity];
        int why = path_dead(t->e, ns, nic_index, op.dest);
        if (why) {
            n->resent++;
            op = moved_off(&op, why);
            service_reroute(t, &op);
        } else {
            n->ring[keep++ % n->ring_capacity] = op;
        }
    }
    n->ring_tail = keep;
}

/* Service mode: a NIC with writes in flight and no completion for link_timeout_s no longer reaches the
 * peers of those writes. */
void service_paths_down(thread_ctx *t, int nic_index) {
    fl_nic *n = &t->e->nics[nic_index];
    nic_state *ns = &t->st->nics[nic_index];
    int before = ns->dead_paths;
    for (uint32_t s = 0; s < n->max_in_flight; s++)
        if (ns->slots[s].in_flight) mark_path_dead(t->e, ns, nic_index, ns->slots[s].op.dest, 1);
    snprintf(n->down_why, sizeof n->down_why, "no completion for %.1f s with %u writes in flight: %d peer path(s) "
             "marked down", t->cfg->link_timeout_s, n->in_flight, ns->dead_paths - before);
    reroute_dead_paths(t, nic_index, 1);
}

/* Errors that say the way to the peer failed (connection reset, canceled, unreachable, ...), not that the
 * write itself was wrong, nor that the peer's endpoint hears as many senders as it can (FI_ENOSPC): those
 * are failed over like a stalled link. */
int path_error(int err) {
    return err != FI_EINVAL && err != FI_EACCES && err != FI_EPERM && err != FI_EMSGSIZE && err != FI_EFAULT &&
           err != FI_ENOSYS && err != FI_EOPNOTSUPP && err != FI_EBADFLAGS && err != FI_ENOSPC;
}

/* Move what the submitter queued for this worker into its NICs' rings (at most `budget`). */
static int drain_inbox(thread_ctx *t, uint32_t budget) {
    inbox *box = &t->st->inboxes[t->id];
    uint32_t head = atomic_load_explicit(&box->head, memory_order_relaxed);
    uint32_t tail = atomic_load_explicit(&box->tail, memory_order_acquire);
    /* writes submitted after Engine.connect revived the paths are seen only with that revival */
    if (head != tail) service_revive(t);
    uint32_t moved = 0;
    while (head != tail && moved < budget) {
        fl_op *op = &box->ops[head % INBOX_CAPACITY];
        fl_nic *n = &t->e->nics[op->nic];
        int why = path_dead(t->e, &t->st->nics[op->nic], op->nic, op->dest);
        if (why) {
            head++; /* first, so that a reroute to this very inbox finds room */
            atomic_store_explicit(&box->head, head, memory_order_release);
            fl_op rerouted = moved_off(op, why);
            service_reroute(t, &rerouted);
            moved++;
            continue;
        }
        if (ring_full(n)) break; /* keep order: wait until that NIC's ring has room */
        *ring_slot(n) = *op;
        n->ring_tail++;
        head++;
        moved++;
    }
    atomic_store_explicit(&box->head, head, memory_order_release);
    return (int)moved;
}

/* One pass over the worker's inbox and NICs: 1 when it moved anything, 0 when it found nothing, -1 when the
 * engine failed. *outstanding: writes of its own still queued, held or in flight. */
static int service_pass(thread_ctx *t, uint32_t *outstanding) {
    fl_engine *e = t->e;
    const group *mine = t->groups; /* the NICs this worker owns (fl_nic.group == its id) */
    int busy = drain_inbox(t, (uint32_t)t->cfg->batch * 64);
    *outstanding = 0;
    for (int i = 0; i < mine->nnics; i++) {
        int k = mine->nics[i];
        int got = poll_nic(t, k);
        if (got < 0) return -1;
        busy |= got;
        if (t->st->nics[k].held_len) release_held(t, k);
        /* lazy posting: the queue was just drained, so this is when there is room */
        if (progress_pending(t, k) < 0) return -1;
        *outstanding += e->nics[k].in_flight + (e->nics[k].ring_tail - e->nics[k].ring_head) +
                        t->st->nics[k].held_len;
    }
    return busy != 0;
}

static void service_loop(thread_ctx *t) {
    fl_engine *e = t->e;
    const fl_config *cfg = t->cfg;
    const group *mine = t->groups;
    if (cfg->pin) {
        cpu_set_t set;
        CPU_ZERO(&set);
        CPU_SET(cfg->cores[t->id], &set);
        pthread_setaffinity_np(pthread_self(), sizeof set, &set);
    }
    rest_state rest;
    rest_begin(&rest);
    t->last_progress_ns = fl_now_ns();
    uint64_t passes = 0;
    t->revive_seen = __atomic_load_n(&e->revive_epoch, __ATOMIC_ACQUIRE);
    while (!stopping(e)) {
        park_if_asked(t);
        service_revive(t); /* a peer (re)connected: every path gets another chance */
        if (cfg->link_timeout_s > 0 && (++passes & 1023) == 0) {
            uint64_t now = fl_now_ns();
            for (int i = 0; i < mine->nnics; i++)
                if (link_stalled(t, mine->nics[i], now)) service_paths_down(t, mine->nics[i]);
        }
        uint32_t outstanding;
        int busy = service_pass(t, &outstanding);
        if (busy < 0) return;
        rest_after_pass(t, &rest, busy, outstanding);
    }
}

static void *service_thread(void *arg) {
    thread_ctx *t = arg;
    service_loop(t);
    /* the last touch of the engine: from here on fl_service_stop and fl_engine_free may free it */
    atomic_store_explicit(&t->st->worker_running[t->id], 0, memory_order_release);
    return NULL;
}

/* Join the workers that started (`joined` of them: those fl_service_stop did not join or detach) and free
 * what fl_service_start allocated (for `boxes` inboxes). */
static void service_release(engine_state *st, int joined, int boxes) {
    for (int w = 0; w < joined; w++) pthread_join(st->service_tids[w], NULL);
    for (int w = 0; w < boxes; w++) {
        free(st->inboxes[w].ops);
        st->inboxes[w].ops = NULL;
        pthread_mutex_destroy(&st->inboxes[w].lock);
    }
    if (st->service_ctx) free(st->service_ctx[0].groups);
    free(st->service_ctx);
    st->service_ctx = NULL;
    st->service_threads = 0;
    if (st->done_ids) {
        pthread_mutex_destroy(&st->done_lock);
        pthread_cond_destroy(&st->done_cond);
        free(st->done_ids);
        st->done_ids = NULL;
    }
}

int fl_service_start(fl_engine *e, const fl_config *cfg) {
    engine_state *st = e->state;
    if (st->service_threads > 0 || st->stranded_threads) {
        snprintf(e->error, FL_ERROR_LEN, "the service was started before (start it once per engine)");
        return e->error_code = -FI_EBUSY;
    }
    if (cfg->threads <= 0 || cfg->threads > FL_MAX_THREADS || cfg->threads > e->nnics || cfg->batch <= 0 ||
        !e->transfers || !e->transfer_capacity) {
        snprintf(e->error, FL_ERROR_LEN, "invalid service configuration");
        return e->error_code = -FI_EINVAL;
    }
    for (int k = 0; k < e->nnics; k++)
        if (e->nics[k].group < 0 || e->nics[k].group >= cfg->threads) {
            snprintf(e->error, FL_ERROR_LEN, "NIC %d belongs to worker %d, outside 0..%d", k, e->nics[k].group,
                     cfg->threads - 1);
            return e->error_code = -FI_EINVAL;
        }
    int rc = prepare_slots(e);
    if (rc) return e->error_code = rc;
    st->service_cfg = *cfg;
    st->service_ctx = calloc(cfg->threads, sizeof(thread_ctx));
    group *owned = calloc(cfg->threads, sizeof(group)); /* worker w's NICs: those whose group is w */
    for (int k = 0; owned && k < e->nnics; k++) owned[e->nics[k].group].nics[owned[e->nics[k].group].nnics++] = k;
    st->done_ids = calloc(DONE_CAPACITY(e), sizeof(uint32_t));
    pthread_mutex_init(&st->done_lock, NULL);
    pthread_cond_init(&st->done_cond, NULL);
    st->done_head = st->done_tail = 0;
    st->woken = 0;
    atomic_store(&st->closing, 0);
    int boxes = 0;
    for (; st->service_ctx && owned && st->done_ids && boxes < cfg->threads; boxes++) {
        inbox *box = &st->inboxes[boxes];
        box->ops = calloc(INBOX_CAPACITY, sizeof(fl_op));
        pthread_mutex_init(&box->lock, NULL);
        if (!box->ops) break;
        atomic_store(&box->head, 0);
        atomic_store(&box->tail, 0);
        atomic_store(&st->park_request[boxes], 0);
        atomic_store(&st->parked[boxes], 0);
        st->service_ctx[boxes] = (thread_ctx){.e = e, .cfg = &st->service_cfg, .st = st, .id = boxes, .service = 1,
                                              .ngroups = 1, .groups = &owned[boxes],
                                              .timeout_ns = (uint64_t)(cfg->timeout_s * 1e9)};
    }
    if (boxes < cfg->threads) {
        if (!st->service_ctx || !boxes) free(owned); /* else service_release frees it, through worker 0 */
        service_release(st, 0, boxes + (st->service_ctx && owned && st->done_ids));
        return e->error_code = -FI_ENOMEM;
    }
    for (int w = 0; w < cfg->threads; w++) {
        atomic_store(&st->worker_running[w], 1);
        rc = pthread_create(&st->service_tids[w], NULL, service_thread, &st->service_ctx[w]);
        if (rc) {
            atomic_store(&st->worker_running[w], 0);
            fail(e, -rc, "cannot start service thread %d: %s", w, strerror(rc)); /* stops those started */
            service_release(st, w, boxes);
            return e->error_code;
        }
    }
    st->service_threads = cfg->threads;
    return 0;
}

static uint64_t submit_writes(fl_engine *e, const fl_request *r, uint64_t start);

uint64_t fl_service_submit(fl_engine *e, const fl_request *r, uint64_t start) {
    engine_state *st = e->state;
    if (!enter_service(st)) return 0;
    uint64_t taken = submit_writes(e, r, start);
    leave_service(st);
    return taken;
}

static uint64_t submit_writes(fl_engine *e, const fl_request *r, uint64_t start) {
    engine_state *st = e->state;
    int threads = st->service_threads;
    uint32_t span = r->nic_order ? r->nic_count : (uint32_t)e->nnics;
    if (threads <= 0 || stopping(e) || !r->routes || !span) return 0;
    /* One lock per worker for the whole request (taken in order, so producers never deadlock). */
    uint32_t tail[FL_MAX_THREADS], room[FL_MAX_THREADS];
    for (int w = 0; w < threads; w++) {
        pthread_mutex_lock(&st->inboxes[w].lock);
        tail[w] = atomic_load_explicit(&st->inboxes[w].tail, memory_order_relaxed);
        room[w] = INBOX_CAPACITY - (tail[w] - atomic_load_explicit(&st->inboxes[w].head, memory_order_acquire));
    }
    uint64_t i = start;
    uint32_t turn = (uint32_t)((r->first_nic + start) % span);
    if (start == 0 && r->count < span) turn = awake_turn(e, r, turn, span);
    for (; i < r->count; i++) {
        uint32_t nic = r->nic_order ? r->nic_order[turn] : turn;  /* checked < nnics by the caller */
        int w = e->nics[nic].group;
        if (!room[w]) break;
        room[w]--;
        const fl_route *route = &r->routes[nic];
        uint64_t len = r->lengths ? r->lengths[i] : r->length;
        uint64_t imm = r->imm;
        if (r->pages_in_imm && imm != FL_NO_IMM) imm |= (len / r->stride - 1) << FL_IMM_VALUE_BITS;
        st->inboxes[w].ops[tail[w]++ % INBOX_CAPACITY] = (fl_op){
            .local = r->local_base + (uint64_t)r->src[i] * r->stride,
            .remote = route->remote_base + (uint64_t)r->dst[i] * r->stride, .len = len, .rkey = route->rkey,
            .imm = imm, .desc = (void *)(uintptr_t)route->desc, .dest = route->dest, .routes = r->routes,
            .transfer = r->transfer, .nic = (uint16_t)nic, .flags = FL_OP_IMM};
        if (++turn == span) turn = 0;
    }
    for (int w = threads - 1; w >= 0; w--) {
        int given = tail[w] != atomic_load_explicit(&st->inboxes[w].tail, memory_order_relaxed);
        atomic_store_explicit(&st->inboxes[w].tail, tail[w], memory_order_release);
        pthread_mutex_unlock(&st->inboxes[w].lock);
        if (given) wake_worker(st, w);
    }
    return i - start;
}

int fl_service_wait(fl_engine *e, uint32_t *ids, int max, double timeout_s) {
    engine_state *st = e->state;
    if (!enter_service(st)) return 0;
    if (!st->done_ids) {
        leave_service(st);
        return 0;
    }
    struct timespec until;
    clock_gettime(CLOCK_REALTIME, &until);
    uint64_t ns = (uint64_t)until.tv_nsec + (uint64_t)(timeout_s > 0 ? timeout_s * 1e9 : 0);
    until.tv_sec += (time_t)(ns / 1000000000ull);
    until.tv_nsec = (long)(ns % 1000000000ull);
    pthread_mutex_lock(&st->done_lock);
    while (st->done_head == st->done_tail && !st->woken)
        if (pthread_cond_timedwait(&st->done_cond, &st->done_lock, &until) == ETIMEDOUT) break;
    int got = 0;
    while (got < max && st->done_head != st->done_tail) ids[got++] = st->done_ids[st->done_head++ % DONE_CAPACITY(e)];
    st->woken = 0;
    pthread_mutex_unlock(&st->done_lock);
    leave_service(st);
    return got;
}

void fl_service_wake(fl_engine *e) {
    engine_state *st = e->state;
    if (!enter_service(st)) return;
    if (st->done_ids) notify(e, FL_NO_TRANSFER);
    leave_service(st);
}

/* Whether a stopped service's workers and callers are all gone (`threads` workers had run). */
static int service_quiet(engine_state *st, int threads) {
    if (atomic_load(&st->callers) > 0) return 0;
    for (int w = 0; w < threads; w++)
        if (atomic_load_explicit(&st->worker_running[w], memory_order_acquire)) return 0;
    return 1;
}

static int threads_left(engine_state *st, int threads) {
    int left = atomic_load(&st->callers);
    for (int w = 0; w < threads; w++) left += atomic_load_explicit(&st->worker_running[w], memory_order_acquire);
    return left;
}

int fl_service_stop(fl_engine *e, double timeout_s) {
    engine_state *st = e->state;
    if (!st) return 0;
    if (st->stranded_threads) return threads_left(st, st->stranded_threads);
    int threads = st->service_threads;
    if (threads <= 0) return 0;
    __atomic_store_n(&e->stop, 1, __ATOMIC_SEQ_CST);
    atomic_store(&st->closing, 1);
    notify(e, FL_NO_TRANSFER); /* a caller waiting in fl_service_wait leaves now */
    for (int w = 0; w < threads; w++) wake_worker(st, w);
    uint64_t until = fl_now_ns() + (uint64_t)(timeout_s > 0 ? timeout_s * 1e9 : 0);
    struct timespec pause = {0, 100000};
    while (!service_quiet(st, threads) && fl_now_ns() < until) nanosleep(&pause, NULL);
    if (service_quiet(st, threads)) {
        service_release(st, threads, threads);
        return 0;
    }
    /* Someone is stuck (a worker inside a provider call that never returns): join those that left, detach
     * the others at the lowest priority (a provider spinning on a lock burns only idle time), and free
     * nothing: fl_engine_free frees it all once they are gone, if ever. */
    for (int w = 0; w < threads; w++) {
        if (!atomic_load_explicit(&st->worker_running[w], memory_order_acquire)) {
            pthread_join(st->service_tids[w], NULL);
            continue;
        }
        struct sched_param idle = {0};
        pthread_setschedparam(st->service_tids[w], SCHED_IDLE, &idle);
        pthread_detach(st->service_tids[w]);
    }
    st->stranded_threads = threads;
    st->service_threads = 0;
    int left = threads_left(st, threads);
    snprintf(e->error, FL_ERROR_LEN, "%d thread(s) did not leave the engine within %.1f s of the stop (stuck in a "
             "provider call?): the engine stays allocated", left, timeout_s);
    return left;
}

int fl_service_release_stranded(fl_engine *e) {
    engine_state *st = e->state;
    if (!st || !st->stranded_threads) return 0;
    if (!service_quiet(st, st->stranded_threads)) return threads_left(st, st->stranded_threads);
    service_release(st, 0, st->stranded_threads);
    st->stranded_threads = 0;
    return 0;
}
