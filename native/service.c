/* The library's service (fabriclab.Engine): worker threads fed through per-worker inboxes, transfers
 * finishing into a queue that fl_service_wait reads (see service.h). Its per-path failover and revival are
 * path.c's; idle workers rest (resting.c). */
#define _GNU_SOURCE
#include "core_internal.h"

#include <errno.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

void fl_service_revive(fl_engine *e) {
    __atomic_add_fetch(&e->service.revive_epoch, 1, __ATOMIC_RELEASE);
}

/* fl_worker_park asked this worker to keep off its NICs: sleep until it is released (or the engine stops). */
static void flc_park_if_asked(thread_ctx *t) {
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
static int flc_enter_service(engine_state *st) {
    atomic_fetch_add(&st->callers, 1);
    if (!atomic_load(&st->closing)) return 1;
    atomic_fetch_sub(&st->callers, 1);
    return 0;
}

static void flc_leave_service(engine_state *st) { atomic_fetch_sub(&st->callers, 1); }

static int flc_park_worker(fl_engine *e, engine_state *st, int nic, double timeout_s) {
    int threads = st->service_threads;
    if (threads <= 0 || nic < 0 || nic >= e->nnics) return 0;
    int w = e->nics[nic].group;
    uint64_t until = fl_now_ns() + (uint64_t)(timeout_s > 0 ? timeout_s * 1e9 : 0);
    struct timespec pause = {0, 20000};
    atomic_store_explicit(&st->park_request[w], 1, memory_order_release);
    flc_wake_worker(st, w);
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
    if (!st || !flc_enter_service(st)) return 0;
    int parked = flc_park_worker(e, st, nic, timeout_s);
    flc_leave_service(st);
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

/* Move what the submitter queued for this worker into its NICs' rings (at most `budget`). */
static int flc_drain_inbox(thread_ctx *t, uint32_t budget) {
    inbox *box = &t->st->inboxes[t->id];
    uint32_t head = atomic_load_explicit(&box->head, memory_order_relaxed);
    uint32_t tail = atomic_load_explicit(&box->tail, memory_order_acquire);
    /* writes submitted after Engine.connect revived the paths are seen only with that revival */
    if (head != tail) flc_revive(t);
    uint32_t moved = 0;
    while (head != tail && moved < budget) {
        fl_op *op = &box->ops[head % FLC_INBOX_CAPACITY];
        fl_nic *n = &t->e->nics[op->nic];
        enum flc_path why = flc_path_dead(t->e, &t->st->nics[op->nic], op->nic, op->dest);
        if (why) {
            fl_op rerouted = flc_moved_off(op, why); /* copied out before its slot is given back */
            head++; /* then the slot, so that a reroute to this very inbox finds room */
            atomic_store_explicit(&box->head, head, memory_order_release);
            flc_reroute(t, &rerouted);
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
static int flc_service_pass(thread_ctx *t, uint32_t *outstanding) {
    fl_engine *e = t->e;
    const group *mine = t->groups; /* the NICs this worker owns (fl_nic.group == its id) */
    flc_tick(t);
    int busy = flc_drain_inbox(t, (uint32_t)t->st->service_cfg.batch * 64);
    *outstanding = 0;
    for (int i = 0; i < mine->nnics; i++) {
        int k = mine->nics[i];
        int got = poll_nic(t, k);
        if (got < 0) return -1;
        busy |= got;
        if (t->st->nics[k].held_len) flc_release_held(t, k);
        /* lazy posting: the queue was just drained, so this is when there is room */
        if (progress_pending(t, k) < 0) return -1;
        *outstanding += e->nics[k].in_flight + (e->nics[k].ring_tail - e->nics[k].ring_head) +
                        t->st->nics[k].held_len;
    }
    return busy != 0;
}

static void flc_service_loop(thread_ctx *t) {
    fl_engine *e = t->e;
    const fl_service_config *cfg = &t->st->service_cfg;
    const group *mine = t->groups;
    if (cfg->pin) {
        cpu_set_t set;
        CPU_ZERO(&set);
        CPU_SET(cfg->cores[t->id], &set);
        pthread_setaffinity_np(pthread_self(), sizeof set, &set);
    }
    rest_state rest;
    flc_rest_begin(&rest);
    t->last_progress_ns = flc_tick(t);
    uint64_t passes = 0;
    t->revive_seen = __atomic_load_n(&e->service.revive_epoch, __ATOMIC_ACQUIRE);
    while (!stopping(e)) {
        flc_park_if_asked(t);
        flc_revive(t); /* a peer (re)connected: every path gets another chance */
        if (cfg->link_timeout_s > 0 && (++passes & 1023) == 0) {
            uint64_t now = fl_now_ns();
            for (int i = 0; i < mine->nnics; i++)
                if (link_stalled(t, mine->nics[i], now)) flc_paths_down(t, mine->nics[i]);
        }
        uint32_t outstanding;
        int busy = flc_service_pass(t, &outstanding);
        if (busy < 0) return;
        flc_rest_after_pass(t, &rest, busy, outstanding);
    }
}

static void *flc_service_thread(void *arg) {
    thread_ctx *t = arg;
    flc_service_loop(t);
    /* the last touch of the engine: from here on fl_service_stop and fl_engine_free may free it */
    atomic_store_explicit(&t->st->worker_running[t->id], 0, memory_order_release);
    return NULL;
}

/* Join the workers that started (`joined` of them: those fl_service_stop did not join or detach) and free
 * what fl_service_start allocated (for `boxes` inboxes). */
static void flc_service_release(engine_state *st, int joined, int boxes) {
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

int fl_service_start(fl_engine *e, const fl_service_config *cfg) {
    engine_state *st = e->state;
    if (st->service_threads > 0 || st->stranded_threads) {
        snprintf(e->error, FL_ERROR_LEN, "the service was started before (start it once per engine)");
        return e->error_code = -FI_EBUSY;
    }
    if (cfg->threads <= 0 || cfg->threads > FL_MAX_THREADS || cfg->threads > e->nnics || cfg->batch <= 0 ||
        !e->service.transfers || !e->service.transfer_capacity) {
        snprintf(e->error, FL_ERROR_LEN, "invalid service configuration");
        return e->error_code = -FI_EINVAL;
    }
    for (int k = 0; k < e->nnics; k++)
        if (e->nics[k].group < 0 || e->nics[k].group >= cfg->threads) {
            snprintf(e->error, FL_ERROR_LEN, "NIC %d belongs to worker %d, outside 0..%d", k, e->nics[k].group,
                     cfg->threads - 1);
            return e->error_code = -FI_EINVAL;
        }
    int rc = flc_prepare_slots(e);
    if (rc) return e->error_code = rc;
    st->service_cfg = *cfg;
    st->service_ctx = flc_calloc_lines(cfg->threads, sizeof(thread_ctx));
    group *owned = calloc(cfg->threads, sizeof(group)); /* worker w's NICs: those whose group is w */
    for (int k = 0; owned && k < e->nnics; k++) owned[e->nics[k].group].nics[owned[e->nics[k].group].nnics++] = k;
    st->done_ids = calloc(FLC_DONE_CAPACITY(e), sizeof(uint32_t));
    pthread_mutex_init(&st->done_lock, NULL);
    pthread_cond_init(&st->done_cond, NULL);
    st->done_head = st->done_tail = 0;
    st->woken = 0;
    atomic_store(&st->closing, 0);
    int boxes = 0;
    for (; st->service_ctx && owned && st->done_ids && boxes < cfg->threads; boxes++) {
        inbox *box = &st->inboxes[boxes];
        box->ops = calloc(FLC_INBOX_CAPACITY, sizeof(fl_op));
        pthread_mutex_init(&box->lock, NULL);
        if (!box->ops) break;
        atomic_store(&box->head, 0);
        atomic_store(&box->tail, 0);
        atomic_store(&st->park_request[boxes], 0);
        atomic_store(&st->parked[boxes], 0);
        st->service_ctx[boxes] = (thread_ctx){.e = e, .st = st, .failover = &flc_service_failover, .id = boxes,
                                              .fi_more = cfg->fi_more,
                                              .op_flags = flc_op_flags(cfg->link_timeout_s > 0),
                                              .link_timeout_s = cfg->link_timeout_s,
                                              .ngroups = 1, .groups = &owned[boxes],
                                              .timeout_ns = (uint64_t)(cfg->timeout_s * 1e9)};
    }
    if (boxes < cfg->threads) {
        if (!st->service_ctx || !boxes) free(owned); /* else flc_service_release frees it, through worker 0 */
        flc_service_release(st, 0, boxes + (st->service_ctx && owned && st->done_ids));
        return e->error_code = -FI_ENOMEM;
    }
    for (int w = 0; w < cfg->threads; w++) {
        atomic_store(&st->worker_running[w], 1);
        rc = pthread_create(&st->service_tids[w], NULL, flc_service_thread, &st->service_ctx[w]);
        if (rc) {
            atomic_store(&st->worker_running[w], 0);
            flc_fail(e, -rc, "cannot start service thread %d: %s", w, strerror(rc)); /* stops those started */
            flc_service_release(st, w, boxes);
            return e->error_code;
        }
    }
    st->service_threads = cfg->threads;
    return 0;
}

static uint64_t flc_submit_writes(fl_engine *e, const fl_request *r, uint64_t start);

uint64_t fl_service_submit(fl_engine *e, const fl_request *r, uint64_t start) {
    engine_state *st = e->state;
    if (!flc_enter_service(st)) return 0;
    uint64_t taken = flc_submit_writes(e, r, start);
    flc_leave_service(st);
    return taken;
}

static uint64_t flc_submit_writes(fl_engine *e, const fl_request *r, uint64_t start) {
    engine_state *st = e->state;
    int threads = st->service_threads;
    uint32_t span = r->nic_order ? r->nic_count : (uint32_t)e->nnics;
    if (threads <= 0 || stopping(e) || !r->routes || !span) return 0;
    /* One lock per worker for the whole request (taken in order, so producers never deadlock). */
    uint32_t tail[FL_MAX_THREADS], room[FL_MAX_THREADS];
    for (int w = 0; w < threads; w++) {
        pthread_mutex_lock(&st->inboxes[w].lock);
        tail[w] = atomic_load_explicit(&st->inboxes[w].tail, memory_order_relaxed);
        room[w] = FLC_INBOX_CAPACITY - (tail[w] - atomic_load_explicit(&st->inboxes[w].head, memory_order_acquire));
    }
    uint64_t i = start;
    uint32_t turn = (uint32_t)((r->first_nic + start) % span);
    if (start == 0 && r->count < span) turn = flc_awake_turn(e, r, turn, span);
    for (; i < r->count; i++) {
        uint32_t nic = r->nic_order ? r->nic_order[turn] : turn;  /* checked < nnics by the caller */
        int w = e->nics[nic].group;
        if (!room[w]) break;
        room[w]--;
        const fl_route *route = &r->routes[nic];
        uint64_t len = r->lengths ? r->lengths[i] : r->length;
        uint64_t imm = r->imms ? r->imms[i] : r->imm;
        if (r->pages_in_imm && imm != FL_NO_IMM) imm |= (len / r->stride - 1) << FL_IMM_VALUE_BITS;
        st->inboxes[w].ops[tail[w]++ % FLC_INBOX_CAPACITY] = (fl_op){
            .local = r->local_base + (uint64_t)r->src[i] * r->stride,
            .remote = route->remote_base + (uint64_t)r->dst[i] * r->stride, .len = len, .rkey = route->rkey,
            .imm = imm, .desc = (void *)(uintptr_t)route->desc, .dest = route->dest, .routes = r->routes,
            .transfer = r->transfers ? r->transfers[i] : r->transfer, .nic = (uint16_t)nic, .flags = FL_OP_IMM};
        if (++turn == span) turn = 0;
    }
    for (int w = threads - 1; w >= 0; w--) {
        int given = tail[w] != atomic_load_explicit(&st->inboxes[w].tail, memory_order_relaxed);
        atomic_store_explicit(&st->inboxes[w].tail, tail[w], memory_order_release);
        pthread_mutex_unlock(&st->inboxes[w].lock);
        if (given) flc_wake_worker(st, w);
    }
    return i - start;
}

int fl_service_wait(fl_engine *e, uint32_t *ids, int max, double timeout_s) {
    engine_state *st = e->state;
    if (!flc_enter_service(st)) return 0;
    if (!st->done_ids) {
        flc_leave_service(st);
        return 0;
    }
    struct timespec until;
    clock_gettime(CLOCK_REALTIME, &until);
    uint64_t ns = (uint64_t)until.tv_nsec + (uint64_t)(timeout_s > 0 ? timeout_s * 1e9 : 0);
    until.tv_sec += (time_t)(ns / 1000000000ull);
    until.tv_nsec = (long)(ns % 1000000000ull);
    pthread_mutex_lock(&st->done_lock);
    while (st->done_head == st->done_tail && !st->woken && !st->done_lost)
        if (pthread_cond_timedwait(&st->done_cond, &st->done_lock, &until) == ETIMEDOUT) break;
    int got = 0;
    while (got < max && st->done_head != st->done_tail) ids[got++] = st->done_ids[st->done_head++ % FLC_DONE_CAPACITY(e)];
    if (st->done_lost && st->done_head == st->done_tail) {
        st->done_lost = 0;
        got = -1;
    }
    st->woken = 0;
    pthread_mutex_unlock(&st->done_lock);
    flc_leave_service(st);
    return got;
}

void fl_transfer_release(fl_engine *e, uint32_t transfer, uint64_t writes) {
    engine_state *st = e->state;
    if (!st || !flc_enter_service(st)) return; /* the stop frees the finished queue the last write tells */
    flc_transfer_finished_writes(e, transfer, (int64_t)writes);
    flc_leave_service(st);
}

int fl_transfer_wait(fl_engine *e, uint32_t transfer, double spin_s) {
    engine_state *st = e->state;
    if (!flc_is_transfer(e, transfer) || !flc_enter_service(st)) return 0;
    volatile int64_t *left = FLC_LEFT(e, transfer), *waiters = FLC_WAITERS(e, transfer);
    __atomic_add_fetch(waiters, 1, __ATOMIC_SEQ_CST);
    uint64_t until = fl_now_ns() + (uint64_t)(spin_s > 0 ? spin_s * 1e9 : 0);
    int done = 0;
    for (;;) {
        if (__atomic_load_n(left, __ATOMIC_SEQ_CST) <= 0) {
            done = 1;
            break;
        }
        if (atomic_load(&st->closing) || fl_now_ns() > until) break;
        sched_yield(); /* the workers that finish it may need this core (and the peer's, on a small box) */
    }
    __atomic_sub_fetch(waiters, 1, __ATOMIC_SEQ_CST);
    /* it may have finished as the caller stopped looking, the worker still seeing it look: nobody was told */
    if (!done && __atomic_load_n(left, __ATOMIC_SEQ_CST) <= 0) done = 1;
    flc_leave_service(st);
    return done;
}

void fl_service_wake(fl_engine *e) {
    engine_state *st = e->state;
    if (!flc_enter_service(st)) return;
    if (st->done_ids) flc_notify(e, FL_NO_TRANSFER);
    flc_leave_service(st);
}

/* Whether a stopped service's workers and callers are all gone (`threads` workers had run). */
static int flc_service_quiet(engine_state *st, int threads) {
    if (atomic_load(&st->callers) > 0) return 0;
    for (int w = 0; w < threads; w++)
        if (atomic_load_explicit(&st->worker_running[w], memory_order_acquire)) return 0;
    return 1;
}

static int flc_threads_left(engine_state *st, int threads) {
    int left = atomic_load(&st->callers);
    for (int w = 0; w < threads; w++) left += atomic_load_explicit(&st->worker_running[w], memory_order_acquire);
    return left;
}

int fl_service_stop(fl_engine *e, double timeout_s) {
    engine_state *st = e->state;
    if (!st) return 0;
    if (st->stranded_threads) return flc_threads_left(st, st->stranded_threads);
    int threads = st->service_threads;
    if (threads <= 0) return 0;
    __atomic_store_n(&e->stop, 1, __ATOMIC_SEQ_CST);
    atomic_store(&st->closing, 1);
    flc_notify(e, FL_NO_TRANSFER); /* a caller waiting in fl_service_wait leaves now */
    for (int w = 0; w < threads; w++) flc_wake_worker(st, w);
    uint64_t until = fl_now_ns() + (uint64_t)(timeout_s > 0 ? timeout_s * 1e9 : 0);
    struct timespec pause = {0, 100000};
    while (!flc_service_quiet(st, threads) && fl_now_ns() < until) nanosleep(&pause, NULL);
    if (flc_service_quiet(st, threads)) {
        flc_service_release(st, threads, threads);
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
    int left = flc_threads_left(st, threads);
    snprintf(e->error, FL_ERROR_LEN, "%d thread(s) did not leave the engine within %.1f s of the stop (stuck in a "
             "provider call?): the engine stays allocated", left, timeout_s);
    return left;
}

int flc_service_release_stranded(fl_engine *e) {
    engine_state *st = e->state;
    if (!st || !st->stranded_threads) return 0;
    if (!flc_service_quiet(st, st->stranded_threads)) return flc_threads_left(st, st->stranded_threads);
    flc_service_release(st, 0, st->stranded_threads);
    st->stranded_threads = 0;
    return 0;
}
