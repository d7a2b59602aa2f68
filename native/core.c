/* fabriclab's native multi-NIC write engine: see core.h. No allocation, lock or system call per write:
 * contexts come from a per-NIC free list, pending writes from a per-NIC ring, and counters are plain
 * stores or (chapters 11-12 on purpose) relaxed atomics. */
#define _GNU_SOURCE
#include "core.h"

#include <errno.h>
#include <stdarg.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <rdma/fi_endpoint.h>
#include <rdma/fi_eq.h>
#include <rdma/fi_errno.h>
#include <rdma/fi_rma.h>

#define CQ_BATCH 16
#define MORE_RUN_MAX 16 /* FI_MORE runs stay far below any provider's tx queue, so a flush always fits */

typedef struct op_slot {
    struct fi_context2 ctx; /* first: the completion's op_context points here */
    fl_op op;               /* what was posted: sent again elsewhere if its link goes down */
    uint32_t next_free;
    int in_flight;
    int abandoned;          /* sent again elsewhere: a late completion only frees the slot */
    uint32_t ep_gen;        /* the NIC's endpoint it was posted on (fl_nic.renewals at the time) */
} op_slot;

#define MAX_DEAD_PATHS 32

#define INBOX_CAPACITY 65536u
#define DONE_CAPACITY(e) (2 * (uint64_t)(e)->transfer_capacity)

/* Service mode: what fl_service_submit hands one worker thread. Producers take the lock; the worker
 * only reads head/tail atomically. */
typedef struct inbox {
    pthread_mutex_t lock;
    fl_op *ops;
    _Atomic uint32_t head, tail;
} inbox;

struct group;

typedef struct nic_state {
    op_slot *slots;
    uint64_t last_ok_ns;    /* last completion, or the post that gave an idle NIC work */
    /* service mode: peers this NIC no longer reaches (a stalled link or a gone peer); beyond
     * MAX_DEAD_PATHS the whole NIC is taken as down */
    fi_addr_t dead_dests[MAX_DEAD_PATHS];
    uint8_t dead_stalled[MAX_DEAD_PATHS]; /* marked for a stall (no completion), not for an error */
    int dead_paths;
    /* the paths that were dead at the last revival and have not failed since (revived_all: the whole NIC
     * was down): a path error there may be the provider still tearing down the old connection, so the
     * write is posted once more, after RETRY_HOLD, before the path is declared dead again */
    fi_addr_t revived_dests[MAX_DEAD_PATHS];
    int revived_paths, revived_all;
    fl_op *held;            /* writes waiting for that second try, posted from held_until_ns on */
    uint32_t held_len, held_cap;
    uint64_t held_until_ns;
    uint32_t free_head;
    int last_had_more;
    struct group *group; /* the group that drives this NIC during a write run */
} nic_state;

/* Per-thread counters for chapters 13 (sharded: packed, four threads' pairs to a cache line) and beyond
 * (padded: a line each). */
typedef struct { volatile uint64_t posted, finished; } packed_shard;
typedef struct { volatile uint64_t posted, finished; char pad[48]; } __attribute__((aligned(64))) padded_shard;

typedef struct engine_state {
    nic_state *nics;
    /* chapters 11-12: every thread updates these */
    _Atomic uint64_t shared_posted, shared_finished;
    packed_shard packed[FL_MAX_THREADS];
    padded_shard padded[FL_MAX_THREADS];
    _Atomic int finished_threads;
    pthread_barrier_t start_line;
    uint64_t start_ns[FL_MAX_THREADS], end_ns[FL_MAX_THREADS];
    uint64_t timed_bytes[FL_MAX_THREADS];
    /* service mode */
    int service_threads;
    pthread_t service_tids[FL_MAX_THREADS];
    struct thread_ctx *service_ctx;
    inbox inboxes[FL_MAX_THREADS];
    fl_config service_cfg;
    /* finished transfers, for fl_service_wait: each id is in here at most twice (when its writes are all
     * finished, and when the last of its abandoned writes is reported; it is reused only after Python
     * took it out), so DONE_CAPACITY entries always suffice */
    _Atomic int park_request[FL_MAX_THREADS], parked[FL_MAX_THREADS]; /* fl_worker_park */
    pthread_mutex_t done_lock;
    pthread_cond_t done_cond;
    uint32_t *done_ids;
    uint64_t done_head, done_tail;
    int woken;
} engine_state;

typedef struct group {
    int id, nnics;
    int nics[FL_MAX_NICS];
    uint32_t rr;
    uint64_t quota, issued, completed; /* timed writes: to do, enqueued, completed */
} group;

/* A write waiting for room on one of its group's NICs after its own link went down. */
typedef struct spilled {
    struct group *group;
    uint64_t seq;
} spilled;

typedef struct thread_ctx {
    fl_engine *e;
    const fl_config *cfg;
    engine_state *st;
    int id, ngroups;
    group *groups;
    volatile uint64_t *my_posted, *my_finished;
    uint64_t last_progress_ns, timeout_ns;
    int timed;
    int service;        /* a service worker: errors fail the transfer, not the engine */
    uint64_t remaining; /* timed writes of this thread's groups not yet completed */
    uint64_t timed_bytes;
    uint32_t pages;
    spilled *spill;     /* grows only when a link goes down, never on the hot path */
    size_t spill_len, spill_cap;
    uint32_t revive_seen; /* service: the e->revive_epoch this worker's dead paths belong to */
    uint32_t reroute_rr;
} thread_ctx;

uint64_t fl_now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

static inline int stopping(const fl_engine *e) { return __atomic_load_n(&e->stop, __ATOMIC_RELAXED); }

static void fail(fl_engine *e, int code, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
static void fail(fl_engine *e, int code, const char *fmt, ...) {
    int expected = 0;
    if (atomic_compare_exchange_strong((_Atomic int *)&e->error_code, &expected, code ? code : -FI_EOTHER)) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(e->error, FL_ERROR_LEN, fmt, ap);
        va_end(ap);
    }
    __atomic_store_n(&e->stop, 1, __ATOMIC_RELAXED);
}

fl_engine *fl_engine_new(int nnics, uint32_t ring_capacity) {
    if (nnics <= 0 || nnics > FL_MAX_NICS || ring_capacity == 0) return NULL;
    fl_engine *e = calloc(1, sizeof(*e));
    engine_state *st = NULL;
    if (!e || posix_memalign((void **)&e->nics, 64, sizeof(fl_nic) * nnics) ||
        posix_memalign((void **)&st, 64, sizeof(*st))) {
        fl_engine_free(e);
        return NULL;
    }
    memset(e->nics, 0, sizeof(fl_nic) * nnics);
    memset(st, 0, sizeof(*st));
    e->state = st;
    e->nnics = nnics;
    st->nics = calloc(nnics, sizeof(nic_state));
    for (int i = 0; st->nics && i < nnics; i++) {
        e->nics[i].ring = calloc(ring_capacity, sizeof(fl_op));
        e->nics[i].ring_capacity = ring_capacity;
        if (!e->nics[i].ring) break;
        if (i == nnics - 1) return e;
    }
    fl_engine_free(e);
    return NULL;
}

void fl_service_stop(fl_engine *e);

void fl_engine_free(fl_engine *e) {
    if (!e) return;
    fl_service_stop(e);
    engine_state *st = e->state;
    for (int i = 0; e->nics && i < e->nnics; i++) {
        free(e->nics[i].ring);
        if (st && st->nics) {
            free(st->nics[i].slots);
            free(st->nics[i].held);
        }
    }
    if (st) free(st->nics);
    free(st);
    free(e->nics);
    free(e);
}

static int prepare_slots(fl_engine *e) {
    engine_state *st = e->state;
    for (int i = 0; i < e->nnics; i++) {
        fl_nic *n = &e->nics[i];
        nic_state *ns = &st->nics[i];
        if (n->max_in_flight == 0) n->max_in_flight = 1;
        free(ns->slots);
        ns->slots = calloc(n->max_in_flight, sizeof(op_slot));
        if (!ns->slots) return -FI_ENOMEM;
        for (uint32_t s = 0; s < n->max_in_flight; s++) ns->slots[s].next_free = s + 1;
        ns->free_head = 0;
        ns->last_had_more = 0;
        n->ring_head = n->ring_tail = 0;
        n->in_flight = 0;
        n->bytes = n->writes = n->completions = n->eagain = n->cq_polls = n->errors = n->arrivals = 0;
        n->more_flushes = 0;
        n->down = 0;
        n->down_ns = n->resent = 0;
        n->down_why[0] = 0;
        ns->last_ok_ns = 0;
        ns->dead_paths = 0;
        ns->revived_paths = ns->revived_all = 0;
        ns->held_len = 0;
        n->unreported = n->unreported_here = n->retried = 0;
        n->renewals = 0;
    }
    return 0;
}

static inline uint64_t page_length(const fl_config *cfg, uint32_t page) {
    uint64_t off = (uint64_t)page * cfg->page_size;
    uint64_t rest = cfg->buffer_bytes - off;
    return rest < cfg->page_size ? rest : cfg->page_size;
}

static inline void count_post(thread_ctx *t) {
    if (t->cfg->shard) (*t->my_posted)++;
    else atomic_fetch_add_explicit(&t->st->shared_posted, 1, memory_order_relaxed);
}

static inline void count_finished(thread_ctx *t) {
    if (t->cfg->shard) (*t->my_finished)++;
    else atomic_fetch_add_explicit(&t->st->shared_finished, 1, memory_order_relaxed);
}

static void transfer_done(fl_engine *e, uint32_t transfer, int error);
static void abandon(fl_engine *e, fl_nic *n, op_slot *slot);
static void abandoned_done(fl_engine *e, fl_nic *n, op_slot *slot);
static int retry_after_revival(thread_ctx *t, int nic_index, const fl_op *op);
static int path_error(int err);
static int path_dead(const fl_engine *e, const nic_state *ns, int nic_index, fi_addr_t dest);
static void mark_path_dead(fl_engine *e, nic_state *ns, int nic_index, fi_addr_t dest, int stalled);
static void service_reroute(thread_ctx *t, const fl_op *failed);
static void reroute_dead_paths(thread_ctx *t, int nic_index, int stalled);
static void service_paths_down(thread_ctx *t, int nic_index);
static int link_down(thread_ctx *t, int nic_index, const char *fmt, ...) __attribute__((format(printf, 3, 4)));

/* A write moved off a dead path carries why that path died, so that a transfer failing for want of any
 * path can tell a stall (the peer may well be alive) from errors. */
static inline fl_op moved_off(const fl_op *op, int why) {
    fl_op out = *op;
    if (why == 2) out.flags |= FL_OP_STALLED;
    return out;
}

/* Completions of a peer's writes into our memory carry remote flags and no context of ours (shm hands back
 * whatever the peer's command held, e.g. 0x1): they are told apart by their flags, never by the pointer.
 * Anything else must be one of this NIC's op slots; a context outside them is not ours to touch. */
static inline int remote_completion(uint64_t flags) {
    return (flags & (FI_REMOTE_WRITE | FI_REMOTE_READ | FI_RECV)) != 0;
}

static inline op_slot *own_slot(const fl_nic *n, const nic_state *ns, void *context) {
    uintptr_t at = (uintptr_t)context, first = (uintptr_t)ns->slots;
    if (!ns->slots || at < first || (at - first) % sizeof(op_slot) || (at - first) / sizeof(op_slot) >= n->max_in_flight)
        return NULL;
    return context;
}

/* Returns 0 when the engine can go on (a service transfer failed), 1 when the NIC's link was declared
 * down (stop reading it), -1 when the engine must stop. */
static int cq_error(thread_ctx *t, int nic_index) {
    fl_nic *n = &t->e->nics[nic_index];
    struct fi_cq_err_entry err = {0};
    char buf[256] = "";
    n->errors++;
    if (fi_cq_readerr(n->cq, &err, 0) < 0) {
        fail(t->e, -FI_EIO, "NIC %d: completion error that could not be read", nic_index);
        return -1;
    }
    nic_state *ns = &t->st->nics[nic_index];
    op_slot *slot = remote_completion(err.flags) ? NULL : own_slot(n, ns, err.op_context);
    if (t->service) {
        /* a peer's write into us that failed is its writer's to report; a context that is no write of
         * ours in flight (a stale or foreign one) is not ours to touch */
        if (!slot || (!slot->in_flight && !slot->abandoned)) return 0;
        if (slot->abandoned) {
            abandoned_done(t->e, n, slot);
        } else if (t->cfg->link_timeout_s > 0 && path_error(err.err) && retry_after_revival(t, nic_index, &slot->op)) {
            n->in_flight--; /* posted once more on this NIC, after RETRY_HOLD */
            slot->in_flight = 0;
            snprintf(n->down_why, sizeof n->down_why, "a write failed right after a revival (%s): posted once more",
                     fi_strerror(err.err));
        } else if (t->cfg->link_timeout_s > 0 && path_error(err.err)) {
            /* this NIC no longer reaches that peer: the write and the others bound there go elsewhere
             * (a gone peer ends as PeerLost once no NIC reaches it) */
            n->in_flight--;
            slot->in_flight = 0;
            n->resent++;
            mark_path_dead(t->e, ns, nic_index, slot->op.dest, 0);
            snprintf(n->down_why, sizeof n->down_why, "a write failed: %s", fi_strerror(err.err));
            service_reroute(t, &slot->op);
            reroute_dead_paths(t, nic_index, 0);
        } else {
            n->in_flight--;
            slot->in_flight = 0;
            transfer_done(t->e, slot->op.transfer, err.err ? -err.err : -FI_EIO);
        }
        slot->next_free = ns->free_head;
        ns->free_head = (uint32_t)(slot - ns->slots);
        return 0;
    }
    const char *detail = fi_cq_strerror(n->cq, err.prov_errno, err.err_data, buf, sizeof buf);
    if (t->cfg->link_timeout_s > 0)
        return link_down(t, nic_index, "a write failed: %s (%s)", fi_strerror(err.err), detail ? detail : "") < 0 ? -1 : 1;
    fail(t->e, -err.err, "NIC %d: write failed: %s (%s)", nic_index, fi_strerror(err.err), detail ? detail : "");
    return -1;
}

/* Wake fl_service_wait: a transfer finished, or (FL_NO_TRANSFER) something else happened. */
static void notify(fl_engine *e, uint32_t finished) {
    engine_state *st = e->state;
    pthread_mutex_lock(&st->done_lock);
    if (finished != FL_NO_TRANSFER) st->done_ids[st->done_tail++ % DONE_CAPACITY(e)] = finished;
    else st->woken = 1;
    pthread_cond_signal(&st->done_cond);
    pthread_mutex_unlock(&st->done_lock);
}

#define LEFT(e, id) (&(e)->transfers[FL_TRANSFER_FIELDS * (uint64_t)(id)])
#define FIRST_ERROR(e, id) (&(e)->transfers[FL_TRANSFER_FIELDS * (uint64_t)(id) + 1])
#define ABANDONED(e, id) (&(e)->transfers[FL_TRANSFER_FIELDS * (uint64_t)(id) + 2])

static inline int is_transfer(const fl_engine *e, uint32_t transfer) {
    return transfer != FL_NO_TRANSFER && e->transfers && transfer < e->transfer_capacity;
}

static void transfer_finished_writes(fl_engine *e, uint32_t transfer, int64_t writes) {
    if (!is_transfer(e, transfer) || !writes) return;
    if (__atomic_sub_fetch(LEFT(e, transfer), writes, __ATOMIC_ACQ_REL) == 0) notify(e, transfer);
}

/* A posted write given up on (its copy went elsewhere, or its transfer failed) may still read the local
 * buffer until the provider reports it: the transfer is not buffer-safe until then. */
static void abandon(fl_engine *e, fl_nic *n, op_slot *slot) {
    slot->in_flight = 0;
    slot->abandoned = 1;
    n->unreported++;
    if (slot->ep_gen == n->renewals) n->unreported_here++;
    if (is_transfer(e, slot->op.transfer)) __atomic_add_fetch(ABANDONED(e, slot->op.transfer), 1, __ATOMIC_ACQ_REL);
}

/* The provider reported an abandoned write: it no longer reads the buffer. The transfer is told once its
 * writes are all finished and none it gave up on is still posted. */
static void abandoned_done(fl_engine *e, fl_nic *n, op_slot *slot) {
    slot->abandoned = 0;
    n->unreported--;
    if (slot->ep_gen == n->renewals) n->unreported_here--;
    uint32_t transfer = slot->op.transfer;
    if (is_transfer(e, transfer) && __atomic_sub_fetch(ABANDONED(e, transfer), 1, __ATOMIC_ACQ_REL) == 0 &&
        __atomic_load_n(LEFT(e, transfer), __ATOMIC_ACQUIRE) == 0)
        notify(e, transfer);
}

/* One write of a service transfer has finished (error < 0: failed). */
static void transfer_done(fl_engine *e, uint32_t transfer, int error) {
    if (!is_transfer(e, transfer)) return;
    if (error) {
        int64_t none = 0;
        __atomic_compare_exchange_n(FIRST_ERROR(e, transfer), &none, (int64_t)error, 0,
                                    __ATOMIC_RELAXED, __ATOMIC_RELAXED);
    }
    transfer_finished_writes(e, transfer, 1);
}

void fl_transfer_release(fl_engine *e, uint32_t transfer, uint64_t writes) {
    transfer_finished_writes(e, transfer, (int64_t)writes);
}

/* 1 when the immediate data was one somebody may wait for. */
static int count_imm(fl_engine *e, uint64_t imm) {
    if (!e->imm_keys || imm == FL_NO_IMM) return 0;
    uint64_t key = imm + 1, mask = e->imm_capacity - 1;
    for (uint64_t probe = 0; probe <= mask; probe++) {
        uint64_t i = (imm * 0x9E3779B97F4A7C15ull + probe) & mask;
        uint64_t seen = __atomic_load_n(&e->imm_keys[i], __ATOMIC_ACQUIRE);
        if (seen == 0 && __atomic_compare_exchange_n(&e->imm_keys[i], &seen, key, 0, __ATOMIC_ACQ_REL,
                                                     __ATOMIC_ACQUIRE))
            seen = key;
        if (seen == key) {
            __atomic_fetch_add(&e->imm_counts[i], 1, __ATOMIC_RELEASE);
            return 1;
        }
    }
    return 0;
}

int fl_imm_take(fl_engine *e, uint64_t imm, uint64_t count) {
    if (!e->imm_keys) return 0;
    uint64_t key = imm + 1, mask = e->imm_capacity - 1;
    for (uint64_t probe = 0; probe <= mask; probe++) {
        uint64_t i = (imm * 0x9E3779B97F4A7C15ull + probe) & mask;
        uint64_t seen = __atomic_load_n(&e->imm_keys[i], __ATOMIC_ACQUIRE);
        if (seen == 0) return 0;
        if (seen != key) continue;
        uint64_t have = __atomic_load_n(&e->imm_counts[i], __ATOMIC_ACQUIRE);
        while (have >= count) {
            if (__atomic_compare_exchange_n(&e->imm_counts[i], &have, have - count, 0, __ATOMIC_ACQ_REL,
                                            __ATOMIC_ACQUIRE))
                return 1;
        }
        return 0;
    }
    return 0;
}

/* Reap every completion waiting on a NIC's queue; returns how many, or -1 on error. Never posts. */
static int poll_nic(thread_ctx *t, int nic_index) {
    fl_nic *n = &t->e->nics[nic_index];
    nic_state *ns = &t->st->nics[nic_index];
    struct fi_cq_data_entry entries[CQ_BATCH];
    int handled = 0, landed = 0;
    /* Completions of one transfer come in runs: count a run with one atomic on its shared counter. */
    uint32_t run_transfer = FL_NO_TRANSFER;
    int64_t run_writes = 0, completed = 0;
    for (;;) {
        ssize_t got = fi_cq_read(n->cq, entries, CQ_BATCH);
        n->cq_polls++;
        if (got == -FI_EAGAIN) break;
        if (got == -FI_EAVAIL) {
            int rc = cq_error(t, nic_index);
            if (rc < 0) return -1;
            if (rc > 0) return handled + 1;
            handled++;
            continue;
        }
        if (got < 0) { fail(t->e, (int)got, "NIC %d: fi_cq_read: %s", nic_index, fi_strerror((int)-got)); return -1; }
        for (ssize_t i = 0; i < got; i++) {
            if (remote_completion(entries[i].flags)) { /* a peer's write into our memory */
                if (entries[i].flags & FI_REMOTE_CQ_DATA) {
                    n->arrivals++;
                    landed |= count_imm(t->e, entries[i].data);
                }
                continue;
            }
            op_slot *slot = own_slot(n, ns, entries[i].op_context);
            if (!slot || (!slot->in_flight && !slot->abandoned)) continue; /* not a write of ours in flight */
            if (slot->abandoned) { /* it was sent again elsewhere; that copy is the one counted */
                abandoned_done(t->e, n, slot);
                slot->next_free = ns->free_head;
                ns->free_head = (uint32_t)(slot - ns->slots);
                continue;
            }
            uint64_t len = slot->op.len;
            if (slot->op.transfer != run_transfer) {
                if (t->e->transfers) transfer_finished_writes(t->e, run_transfer, run_writes);
                run_transfer = slot->op.transfer;
                run_writes = 0;
            }
            run_writes++;
            completed++;
            slot->in_flight = 0;
            n->bytes += len;
            n->completions++;
            n->in_flight--;
            if (t->timed && slot->op.imm < t->cfg->total_writes) { /* not a warm-up write */
                t->timed_bytes += len;
                ns->group->completed++;
                t->remaining--;
                count_finished(t);
            }
            slot->next_free = ns->free_head;
            ns->free_head = (uint32_t)(slot - ns->slots);
        }
        handled += (int)got;
        if (got < CQ_BATCH) break;
    }
    if (t->e->transfers) transfer_finished_writes(t->e, run_transfer, run_writes);
    if (completed) ns->last_ok_ns = fl_now_ns();
    if (landed && __atomic_load_n(&t->e->imm_watch, __ATOMIC_RELAXED)) notify(t->e, FL_NO_TRANSFER);
    return handled;
}

/* 0 posted, 1 the provider said -FI_EAGAIN, 2 refused (its service transfer failed, or the write was moved to
 * another NIC or held for a second try), 3 the NIC's link was declared down (its writes moved to other
 * NICs), -1 error. */
static int post_write(thread_ctx *t, int nic_index, const fl_op *op, uint64_t extra_flags) {
    fl_nic *n = &t->e->nics[nic_index];
    nic_state *ns = &t->st->nics[nic_index];
    if (ns->free_head >= n->max_in_flight) return 1; /* every context is held by an abandoned write */
    op_slot *slot = &ns->slots[ns->free_head];
    struct iovec iov = {.iov_base = (void *)(uintptr_t)op->local, .iov_len = op->len};
    void *desc = op->desc;
    struct fi_rma_iov rma = {.addr = op->remote, .len = op->len, .key = op->rkey};
    struct fi_msg_rma msg = {.msg_iov = &iov, .desc = &desc, .iov_count = 1, .addr = op->dest,
                             .rma_iov = &rma, .rma_iov_count = 1, .context = &slot->ctx, .data = op->imm};
    slot->op = *op;
    uint64_t flags = FI_COMPLETION | extra_flags | ((op->flags & FL_OP_IMM) ? FI_REMOTE_CQ_DATA : 0) |
                     (t->cfg->link_timeout_s > 0 ? FI_DELIVERY_COMPLETE : 0);
    ssize_t rc = fi_writemsg(n->ep, &msg, flags);
    if (rc == 0) {
        slot->ep_gen = n->renewals;
        if (n->in_flight == 0) ns->last_ok_ns = fl_now_ns(); /* the link's clock starts with work */
        slot->in_flight = 1;
        ns->free_head = slot->next_free;
        n->in_flight++;
        n->writes++;
        ns->last_had_more = (extra_flags & FI_MORE) != 0;
        if (t->timed) count_post(t);
        return 0;
    }
    if (rc == -FI_EAGAIN) {
        n->eagain++;
        return 1;
    }
    if (t->service) { /* failed over when the way to the peer failed, else its transfer fails */
        n->errors++;
        if (t->cfg->link_timeout_s > 0 && path_error((int)-rc) && retry_after_revival(t, nic_index, op)) {
            snprintf(n->down_why, sizeof n->down_why, "fi_writemsg failed right after a revival (%s): posted once "
                     "more", fi_strerror((int)-rc));
        } else if (t->cfg->link_timeout_s > 0 && path_error((int)-rc)) {
            mark_path_dead(t->e, ns, nic_index, op->dest, 0);
            snprintf(n->down_why, sizeof n->down_why, "fi_writemsg: %s", fi_strerror((int)-rc));
            n->resent++;
            service_reroute(t, op);
        } else {
            transfer_done(t->e, op->transfer, (int)rc);
        }
        return 2;
    }
    if (t->cfg->link_timeout_s > 0) {
        n->errors++;
        return link_down(t, nic_index, "fi_writemsg: %s", fi_strerror((int)-rc)) < 0 ? -1 : 3;
    }
    fail(t->e, (int)rc, "NIC %d: fi_writemsg: %s", nic_index, fi_strerror((int)-rc));
    return -1;
}

/* Write number `seq` of a run (chapters 9-15): page seq % pages of the buffer to the same page of the
 * peer, immediate data seq, so the target can tell a write sent twice after a link failure. */
static void page_op(const thread_ctx *t, int nic_index, uint64_t seq, fl_op *op) {
    const fl_nic *n = &t->e->nics[nic_index];
    uint32_t page = (uint32_t)(seq % t->pages);
    uint64_t off = (uint64_t)page * t->cfg->page_size;
    *op = (fl_op){.local = t->cfg->local_base + off, .remote = n->remote_base + off,
                  .len = page_length(t->cfg, page), .rkey = n->rkey, .imm = seq, .desc = n->desc, .dest = n->dest,
                  .transfer = FL_NO_TRANSFER, .nic = (uint16_t)nic_index, .flags = FL_OP_IMM};
}

static int check_timeout(thread_ctx *t, int nic_index) {
    if (fl_now_ns() - t->last_progress_ns > t->timeout_ns) {
        fail(t->e, -FI_ETIMEDOUT, "NIC %d: no completion within %.1f s with %u writes in flight (is the peer gone?)",
             nic_index, t->cfg->timeout_s, t->e->nics[nic_index].in_flight);
        return -1;
    }
    return 0;
}

/* Failover (write runs): a link with writes in flight and no completion for link_timeout_s is down. */
static inline int link_stalled(const thread_ctx *t, int nic_index, uint64_t now) {
    const fl_nic *n = &t->e->nics[nic_index];
    uint64_t last = t->st->nics[nic_index].last_ok_ns;
    return t->cfg->link_timeout_s > 0 && !n->down && n->in_flight > 0 && now > last &&
           now - last > (uint64_t)(t->cfg->link_timeout_s * 1e9);
}

static int check_link(thread_ctx *t, int nic_index) {
    return link_down(t, nic_index, "no completion for %.1f s with %u writes in flight", t->cfg->link_timeout_s,
                     t->e->nics[nic_index].in_flight) < 0 ? -1 : 0;
}

/* The FI_MORE flush rule: a run of writes posted with FI_MORE always ends in one without it. When the
 * provider refuses the next write (-FI_EAGAIN) right after an FI_MORE write, that write is posted again
 * without FI_MORE, reaping completions in between, until the provider takes it. */
static int flush_more(thread_ctx *t, int nic_index) {
    fl_nic *n = &t->e->nics[nic_index];
    for (;;) {
        const fl_op *op = &n->ring[n->ring_head % n->ring_capacity];
        int rc = n->in_flight < n->max_in_flight ? post_write(t, nic_index, op, 0) : 1;
        if (rc == 3) return 0;
        if (rc == 0 || rc == 2) {
            n->ring_head++;
            n->more_flushes++;
            return 0;
        }
        if (rc < 0 || stopping(t->e)) return -1;
        int got = poll_nic(t, nic_index);
        if (got < 0) return -1;
        if (n->down) return 0;
        if (got > 0) t->last_progress_ns = fl_now_ns();
        else if (link_stalled(t, nic_index, fl_now_ns())) {
            if (!t->service) return check_link(t, nic_index);
            service_paths_down(t, nic_index); /* service NICs have no group: their peers' paths go down */
            return 0;
        } else if (!t->service && check_timeout(t, nic_index)) return -1; /* service deadlines are per transfer */
    }
}

/* Post from the head of a NIC's pending ring while the provider accepts and there is room in flight. */
static int progress_pending(thread_ctx *t, int nic_index) {
    fl_nic *n = &t->e->nics[nic_index];
    nic_state *ns = &t->st->nics[nic_index];
    uint32_t run = 0;
    while (n->ring_tail != n->ring_head && n->in_flight < n->max_in_flight) {
        uint32_t pending = n->ring_tail - n->ring_head;
        uint32_t room = n->max_in_flight - n->in_flight;
        uint32_t available = pending < room ? pending : room;
        int more = t->cfg->fi_more && available > 1 && run + 1 < MORE_RUN_MAX;
        const fl_op *op = &n->ring[n->ring_head % n->ring_capacity];
        int why = ns->dead_paths ? path_dead(t->e, ns, nic_index, op->dest) : 0;
        if (why) { /* marked since it was queued */
            n->resent++;
            fl_op moved = moved_off(op, why);
            service_reroute(t, &moved);
            n->ring_head++;
            continue;
        }
        int rc = post_write(t, nic_index, op, more ? FI_MORE : 0);
        if (rc == 3) return 0;
        if (rc == 0 || rc == 2) { /* 2: refused for good; its transfer has been failed */
            n->ring_head++;
            run = more && rc == 0 ? run + 1 : 0;
            continue;
        }
        if (rc < 0) return -1;
        /* -FI_EAGAIN: the write stays at the head of the ring for the next round */
        if (ns->last_had_more) return flush_more(t, nic_index);
        break;
    }
    return 0;
}

/* Bind this thread to the CUDA context when memory is staged (a no-op otherwise). */
static int staging_thread_setup(fl_engine *e) {
    if (!e->stage_device_base) return 0;
    int rc = e->stage_set_context(e->stage_context);
    if (rc) fail(e, -FI_EIO, "cuCtxSetCurrent failed with CUDA error %d", rc);
    return rc;
}

static int stage_page(fl_engine *e, uint64_t dst_base, uint64_t src_base, uint64_t off, uint64_t len) {
    int rc = e->stage_copy(dst_base + off, src_base + off, len);
    if (rc) fail(e, -FI_EIO, "staging copy of %llu bytes failed with CUDA error %d", (unsigned long long)len, rc);
    return rc;
}

static inline int ring_full(const fl_nic *n) { return n->ring_tail - n->ring_head >= n->ring_capacity; }

static inline fl_op *ring_slot(fl_nic *n) { return &n->ring[n->ring_tail % n->ring_capacity]; }

/* Chapters 11-12 ask the shared counter; from chapter 13 each thread only looks at its own work. */
static inline int done(thread_ctx *t) {
    if (t->cfg->shard) return t->remaining == 0;
    return atomic_load_explicit(&t->st->shared_finished, memory_order_relaxed) >= t->cfg->total_writes;
}

/* Queue write `seq` again on the next live NIC of its group, or park it until one has room. */
static int requeue(thread_ctx *t, group *g, uint64_t seq) {
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
            fail(t->e, -FI_ENOMEM, "no memory to re-queue the writes of a failed link");
            return -1;
        }
        t->spill = grown;
        t->spill_cap = cap;
    }
    t->spill[t->spill_len++] = (spilled){g, seq};
    return 0;
}

static int requeue_spilled(thread_ctx *t) {
    size_t waiting = t->spill_len;
    spilled *parked = t->spill;
    t->spill = NULL;
    t->spill_len = t->spill_cap = 0;
    int rc = 0;
    for (size_t i = 0; i < waiting && rc == 0; i++) rc = requeue(t, parked[i].group, parked[i].seq);
    free(parked);
    return rc;
}

/* Declare a NIC's link down: stop using it, and send its writes again over the group's other NICs — those
 * in flight too, since whether they landed is unknown (the target counts each write once). Returns -1
 * (engine failed, the link named) when the group has no NIC left. */
static int link_down(thread_ctx *t, int nic_index, const char *fmt, ...) {
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
        fail(t->e, -FI_EHOSTUNREACH, "NIC %d: link down (%s), and it was the last NIC of group %d: every link "
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

static int warm_up(thread_ctx *t) {
    for (int i = 0; i < t->ngroups; i++) {
        group *g = &t->groups[i];
        for (int k = 0; k < g->nnics; k++) {
            int nic = g->nics[k];
            /* untimed: numbered after the run's writes, which are all a target counts */
            uint64_t seq = t->cfg->total_writes + (uint64_t)nic;
            uint32_t page = (uint32_t)(seq % t->pages);
            if (t->e->stage_device_base && stage_page(t->e, t->e->stage_host_base, t->e->stage_device_base,
                                                      (uint64_t)page * t->cfg->page_size, page_length(t->cfg, page)))
                return -1;
            fl_op op;
            page_op(t, nic, seq, &op);
            int rc;
            t->last_progress_ns = fl_now_ns();
            while ((rc = post_write(t, nic, &op, 0)) == 1) { /* a peer that never answers must not hang us */
                if (poll_nic(t, nic) < 0 || stopping(t->e) || check_timeout(t, nic)) return -1;
                if (t->e->nics[nic].down) break;
            }
            if (rc < 0) return -1;
        }
    }
    t->last_progress_ns = fl_now_ns();
    for (int i = 0; i < t->ngroups; i++) {
        group *g = &t->groups[i];
        for (int k = 0; k < g->nnics; k++) {
            int nic = g->nics[k];
            while (t->e->nics[nic].in_flight > 0) {
                int got = poll_nic(t, nic);
                if (got < 0 || stopping(t->e)) return -1;
                if (got > 0) t->last_progress_ns = fl_now_ns();
                else if (link_stalled(t, nic, fl_now_ns())) {
                    if (check_link(t, nic) < 0) return -1;
                    k--; /* the group's NICs moved down by one */
                } else if (check_timeout(t, nic)) return -1;
            }
        }
    }
    return 0;
}

static void *writer_thread(void *arg) {
    thread_ctx *t = arg;
    fl_engine *e = t->e;
    const fl_config *cfg = t->cfg;
    engine_state *st = t->st;
    if (cfg->pin) {
        cpu_set_t set;
        CPU_ZERO(&set);
        CPU_SET(cfg->cores[t->id], &set);
        int rc = pthread_setaffinity_np(pthread_self(), sizeof set, &set);
        if (rc) fail(e, -rc, "thread %d: cannot pin to core %d: %s", t->id, cfg->cores[t->id], strerror(rc));
    }
    if (staging_thread_setup(e)) __atomic_store_n(&e->stop, 1, __ATOMIC_RELAXED);
    if (!stopping(e) && cfg->warmup && warm_up(t) < 0) __atomic_store_n(&e->stop, 1, __ATOMIC_RELAXED);
    pthread_barrier_wait(&st->start_line);
    t->timed = 1;
    st->start_ns[t->id] = fl_now_ns();
    t->last_progress_ns = st->start_ns[t->id];
    uint64_t passes = 0;
    while (!stopping(e) && !done(t)) {
        int progressed = 0;
        if (t->spill_len && requeue_spilled(t) < 0) goto out;
        for (int i = 0; i < t->ngroups; i++) {
            group *g = &t->groups[i];
            for (int k = 0; k < g->nnics; k++) {
                int got = poll_nic(t, g->nics[k]);
                if (got < 0) goto out;
                progressed |= got > 0;
                /* as in chapter 7: after draining the queue, post what is pending */
                if (k < g->nnics && progress_pending(t, g->nics[k]) < 0) goto out;
            }
            for (int b = 0; b < cfg->batch && g->issued < g->quota; b++) {
                int nic = g->nics[g->rr++ % (uint32_t)g->nnics];
                uint64_t seq = g->id + g->issued * (uint64_t)cfg->groups;
                uint32_t page = (uint32_t)(seq % t->pages);
                if (ring_full(&e->nics[nic])) break;
                if (e->stage_device_base && stage_page(e, e->stage_host_base, e->stage_device_base,
                                                       (uint64_t)page * cfg->page_size, page_length(cfg, page)))
                    goto out;
                page_op(t, nic, seq, ring_slot(&e->nics[nic]));
                e->nics[nic].ring_tail++;
                g->issued++;
                /* before chapter 15 every enqueue also tries to post; lazy posting leaves that to the
                 * completion loop above */
                if (!cfg->lazy && progress_pending(t, nic) < 0) goto out;
            }
        }
        if (cfg->link_timeout_s > 0 && (passes & 1023) == 0) {
            uint64_t now = fl_now_ns();
            for (int i = 0; i < t->ngroups; i++)
                for (int k = 0; k < t->groups[i].nnics; k++)
                    if (link_stalled(t, t->groups[i].nics[k], now) && check_link(t, t->groups[i].nics[k]) < 0)
                        goto out;
        }
        if (progressed) {
            passes++;
            t->last_progress_ns = fl_now_ns();
        } else if ((++passes & 255) == 0 && t->remaining) {
            for (int i = 0; i < t->ngroups; i++)
                if (t->groups[i].completed < t->groups[i].quota && check_timeout(t, t->groups[i].nics[0]) < 0)
                    goto out;
        }
    }
out:
    free(t->spill);
    t->spill = NULL;
    st->end_ns[t->id] = fl_now_ns();
    st->timed_bytes[t->id] = t->timed_bytes;
    atomic_fetch_add(&st->finished_threads, 1);
    return NULL;
}

int fl_write_run(fl_engine *e, const fl_config *cfg) {
    engine_state *st = e->state;
    e->error_code = 0;
    e->error[0] = 0;
    if (cfg->threads <= 0 || cfg->threads > FL_MAX_THREADS || cfg->groups <= 0 || cfg->groups < cfg->threads ||
        cfg->batch <= 0 || cfg->page_size == 0 || cfg->buffer_bytes < cfg->page_size) {
        snprintf(e->error, FL_ERROR_LEN, "invalid engine configuration");
        return e->error_code = -FI_EINVAL;
    }
    int rc = prepare_slots(e);
    if (rc) return e->error_code = rc;
    atomic_store(&st->shared_posted, 0);
    atomic_store(&st->shared_finished, 0);
    atomic_store(&st->finished_threads, 0);
    memset(st->packed, 0, sizeof st->packed);
    memset(st->padded, 0, sizeof st->padded);
    uint32_t pages = (uint32_t)((cfg->buffer_bytes + cfg->page_size - 1) / cfg->page_size);
    int T = cfg->threads;
    thread_ctx *ctx = calloc(T, sizeof(thread_ctx));
    group *groups = calloc(cfg->groups, sizeof(group));
    pthread_t *tids = calloc(T, sizeof(pthread_t));
    if (!ctx || !groups || !tids) {
        free(ctx); free(groups); free(tids);
        return e->error_code = -FI_ENOMEM;
    }
    for (int i = 0; i < e->nnics; i++) {
        int g = e->nics[i].group;
        if (g < 0 || g >= cfg->groups) {
            snprintf(e->error, FL_ERROR_LEN, "NIC %d belongs to group %d, outside 0..%d", i, g, cfg->groups - 1);
            free(ctx); free(groups); free(tids);
            return e->error_code = -FI_EINVAL;
        }
        groups[g].nics[groups[g].nnics++] = i;
    }
    for (int g = 0; g < cfg->groups; g++) {
        groups[g].quota = cfg->total_writes / cfg->groups + ((uint64_t)g < cfg->total_writes % cfg->groups);
        if (groups[g].quota && groups[g].nnics == 0) {
            snprintf(e->error, FL_ERROR_LEN, "group %d has writes to do but no NIC", g);
            free(ctx); free(groups); free(tids);
            return e->error_code = -FI_EINVAL;
        }
    }
    /* Groups are dealt to threads: with one thread it drives all of them (chapters 9-10). Each thread
     * gets its groups as one contiguous block of the group array. */
    group *regrouped = calloc(cfg->groups, sizeof(group));
    int at = 0;
    for (int t = 0; t < T; t++) {
        ctx[t].groups = &regrouped[at];
        for (int g = t; g < cfg->groups; g += T) {
            group *mine = &regrouped[at++];
            *mine = groups[g];
            mine->id = g;
            ctx[t].ngroups++;
            ctx[t].remaining += mine->quota;
            for (int k = 0; k < mine->nnics; k++) st->nics[mine->nics[k]].group = mine;
        }
    }
    free(groups);
    pthread_barrier_init(&st->start_line, NULL, T);
    for (int t = 0; t < T; t++) {
        ctx[t].e = e;
        ctx[t].cfg = cfg;
        ctx[t].st = st;
        ctx[t].id = t;
        ctx[t].pages = pages;
        ctx[t].timeout_ns = (uint64_t)(cfg->timeout_s * 1e9);
        ctx[t].my_posted = cfg->pad ? &st->padded[t].posted : &st->packed[t].posted;
        ctx[t].my_finished = cfg->pad ? &st->padded[t].finished : &st->packed[t].finished;
    }
    int started = 0;
    for (; started < T; started++) {
        rc = pthread_create(&tids[started], NULL, writer_thread, &ctx[started]);
        if (rc) {
            fail(e, -rc, "cannot start thread %d: %s", started, strerror(rc));
            break;
        }
    }
    if (started < T) {
        /* threads already waiting at the start line would never be released */
        for (int t = started; t < T; t++) pthread_barrier_wait(&st->start_line);
    }
    for (int t = 0; t < started; t++) pthread_join(tids[t], NULL);
    pthread_barrier_destroy(&st->start_line);
    uint64_t first = UINT64_MAX, last = 0, bytes = 0, writes = 0;
    for (int t = 0; t < started; t++) {
        if (st->start_ns[t] < first) first = st->start_ns[t];
        if (st->end_ns[t] > last) last = st->end_ns[t];
        bytes += st->timed_bytes[t];
    }
    for (int t = 0; t < T; t++)
        for (int g = 0; g < ctx[t].ngroups; g++) writes += ctx[t].groups[g].completed;
    e->elapsed_s = last > first ? (double)(last - first) / 1e9 : 0.0;
    e->timed_bytes = bytes;
    e->timed_writes = writes;
    free(regrouped);
    free(ctx);
    free(tids);
    return e->error_code;
}

/* ------------------------------------------------------------------------------------------ target */

typedef struct target_ctx {
    fl_engine *e;
    int id, threads, pin, core;
    uint64_t timeout_ns;
} target_ctx;

static void publish_arrival_times(fl_engine *e, uint64_t first, uint64_t last) {
    if (!first) return;
    uint64_t seen = __atomic_load_n(&e->first_arrival_ns, __ATOMIC_RELAXED);
    while ((seen == 0 || first < seen) &&
           !__atomic_compare_exchange_n(&e->first_arrival_ns, &seen, first, 0, __ATOMIC_RELAXED, __ATOMIC_RELAXED)) {
    }
    seen = __atomic_load_n(&e->last_arrival_ns, __ATOMIC_RELAXED);
    while (last > seen &&
           !__atomic_compare_exchange_n(&e->last_arrival_ns, &seen, last, 0, __ATOMIC_RELAXED, __ATOMIC_RELAXED)) {
    }
}

static void *target_thread(void *arg) {
    target_ctx *t = arg;
    fl_engine *e = t->e;
    if (t->pin) {
        cpu_set_t set;
        CPU_ZERO(&set);
        CPU_SET(t->core, &set);
        pthread_setaffinity_np(pthread_self(), sizeof set, &set);
    }
    struct fi_cq_data_entry entries[CQ_BATCH];
    if (staging_thread_setup(e)) return NULL;
    uint64_t last_arrival = fl_now_ns(), first_seen = 0, last_seen = 0;
    uint64_t passes = 0;
    while (!stopping(e)) {
        int got_any = 0;
        for (int i = t->id; i < e->nnics; i += t->threads) {
            fl_nic *n = &e->nics[i];
            ssize_t got = fi_cq_read(n->cq, entries, CQ_BATCH);
            n->cq_polls++;
            if (got == -FI_EAGAIN) continue;
            if (got == -FI_EAVAIL) {
                struct fi_cq_err_entry err = {0};
                char buf[256] = "";
                fi_cq_readerr(n->cq, &err, 0);
                n->errors++;
                fail(e, -err.err, "target NIC %d: %s (%s)", i, fi_strerror(err.err),
                     fi_cq_strerror(n->cq, err.prov_errno, err.err_data, buf, sizeof buf));
                return NULL;
            }
            if (got < 0) {
                fail(e, (int)got, "target NIC %d: fi_cq_read: %s", i, fi_strerror((int)-got));
                return NULL;
            }
            uint64_t counted = 0;
            for (ssize_t k = 0; k < got; k++) {
                if (!(entries[k].flags & FI_REMOTE_CQ_DATA)) continue;
                uint64_t seq = entries[k].data;
                if (e->seen_writes) {
                    if (seq >= e->seen_capacity) continue; /* a warm-up write */
                    uint64_t bit = 1ull << (seq & 63);
                    if (__atomic_fetch_or(&e->seen_writes[seq >> 6], bit, __ATOMIC_RELAXED) & bit) {
                        __atomic_fetch_add(&e->duplicates, 1, __ATOMIC_RELAXED);
                        continue;
                    }
                }
                uint64_t page = e->pages ? seq % e->pages : seq;
                if (page < e->pages) {
                    __atomic_fetch_add(&e->page_counts[page], 1, __ATOMIC_RELAXED);
                    if (e->stage_device_base) {
                        uint64_t off = page * e->target_page_size, rest = e->target_buffer_bytes - off;
                        if (stage_page(e, e->stage_device_base, e->stage_host_base, off,
                                       rest < e->target_page_size ? rest : e->target_page_size))
                            return NULL;
                    }
                }
                counted++;
            }
            n->arrivals += counted;
            if (counted) {
                __atomic_fetch_add(&e->arrivals, counted, __ATOMIC_RELAXED);
                last_seen = fl_now_ns();
                if (!first_seen) first_seen = last_seen;
            }
            got_any = 1;
        }
        if (got_any) last_arrival = fl_now_ns();
        uint64_t expected = __atomic_load_n(&e->expected_arrivals, __ATOMIC_RELAXED);
        if (__atomic_load_n(&e->arrivals, __ATOMIC_RELAXED) >= expected) break;
        if ((++passes & 1023) == 0 && expected != UINT64_MAX && fl_now_ns() - last_arrival > t->timeout_ns) {
            fail(e, -FI_ETIMEDOUT, "only %llu of %llu writes arrived; nothing more for %.1f s",
                 (unsigned long long)e->arrivals, (unsigned long long)expected, t->timeout_ns / 1e9);
            break;
        }
    }
    publish_arrival_times(e, first_seen, last_seen);
    return NULL;
}

int fl_target_run(fl_engine *e, int threads, const int *cores, int pin, double timeout_s) {
    e->error_code = 0;
    e->error[0] = 0;
    if (threads <= 0 || threads > FL_MAX_THREADS || !e->page_counts) {
        snprintf(e->error, FL_ERROR_LEN, "invalid target configuration");
        return e->error_code = -FI_EINVAL;
    }
    target_ctx ctx[FL_MAX_THREADS];
    pthread_t tids[FL_MAX_THREADS];
    int started = 0;
    for (; started < threads; started++) {
        ctx[started] = (target_ctx){e, started, threads, pin, cores ? cores[started] : 0,
                                    (uint64_t)(timeout_s * 1e9)};
        int rc = pthread_create(&tids[started], NULL, target_thread, &ctx[started]);
        if (rc) {
            fail(e, -rc, "cannot start target thread %d: %s", started, strerror(rc));
            break;
        }
    }
    for (int t = 0; t < started; t++) pthread_join(tids[t], NULL);
    return e->error_code;
}

/* ----------------------------------------------------------------------------------------- service */

/* 0: the path is alive; 1: marked dead after an error (or the whole NIC is down); 2: after a stall. */
static int path_dead(const fl_engine *e, const nic_state *ns, int nic_index, fi_addr_t dest) {
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
    return room;
}

/* Service mode: send a write through another NIC that still reaches its peer (this worker's first, then
 * the others' through their inboxes); fail it when no NIC does. */
static void service_reroute(thread_ctx *t, const fl_op *failed) {
    fl_engine *e = t->e;
    int threads = t->cfg->threads;
    for (int pass = 0; pass < 2; pass++) {
        for (int i = 0; i < e->nnics; i++) {
            int k = (int)((t->reroute_rr + (uint32_t)i) % (uint32_t)e->nnics);
            int mine = k % threads == t->id;
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
            } else if (!push_inbox(t->st, k % threads, &op)) {
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

static void mark_path_dead(fl_engine *e, nic_state *ns, int nic_index, fi_addr_t dest, int stalled) {
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
static int retry_after_revival(thread_ctx *t, int nic_index, const fl_op *op) {
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
    for (int k = t->id; k < e->nnics; k += t->cfg->threads) {
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

int fl_worker_park(fl_engine *e, int nic, double timeout_s) {
    engine_state *st = e->state;
    int threads = st ? st->service_threads : 0;
    if (threads <= 0 || nic < 0 || nic >= e->nnics) return 0;
    int w = nic % threads;
    uint64_t until = fl_now_ns() + (uint64_t)(timeout_s > 0 ? timeout_s * 1e9 : 0);
    struct timespec pause = {0, 20000};
    atomic_store_explicit(&st->park_request[w], 1, memory_order_release);
    while (!atomic_load_explicit(&st->parked[w], memory_order_acquire)) {
        if (stopping(e) || fl_now_ns() > until) {
            atomic_store_explicit(&st->park_request[w], 0, memory_order_release);
            return 0;
        }
        nanosleep(&pause, NULL);
    }
    return 1;
}

void fl_worker_unpark(fl_engine *e, int nic) {
    engine_state *st = e->state;
    int threads = st ? st->service_threads : 0;
    if (threads > 0 && nic >= 0 && nic < e->nnics)
        atomic_store_explicit(&st->park_request[nic % threads], 0, memory_order_release);
}

int fl_nic_renew(fl_engine *e, int nic, struct fid_ep *ep) {
    if (nic < 0 || nic >= e->nnics || !ep) return 0;
    struct fid_ep *none = NULL;
    return __atomic_compare_exchange_n(&e->nics[nic].next_ep, &none, ep, 0, __ATOMIC_RELEASE, __ATOMIC_RELAXED);
}

/* Send every write of a NIC whose path is dead (in flight: outcome unknown; or queued) through other NICs.
 * `stalled`: the paths died for want of completions; the writes in flight on them carry that along. */
static void reroute_dead_paths(thread_ctx *t, int nic_index, int stalled) {
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
static void service_paths_down(thread_ctx *t, int nic_index) {
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
 * write itself was wrong: those are failed over like a stalled link. */
static int path_error(int err) {
    return err != FI_EINVAL && err != FI_EACCES && err != FI_EPERM && err != FI_EMSGSIZE && err != FI_EFAULT &&
           err != FI_ENOSYS && err != FI_EOPNOTSUPP && err != FI_EBADFLAGS;
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

static void *service_thread(void *arg) {
    thread_ctx *t = arg;
    fl_engine *e = t->e;
    const fl_config *cfg = t->cfg;
    if (cfg->pin) {
        cpu_set_t set;
        CPU_ZERO(&set);
        CPU_SET(cfg->cores[t->id], &set);
        pthread_setaffinity_np(pthread_self(), sizeof set, &set);
    }
    uint32_t idle = 0;
    int resting = 0;
    uint64_t quiet_since = fl_now_ns();
    t->last_progress_ns = quiet_since;
    uint64_t passes = 0;
    t->revive_seen = __atomic_load_n(&e->revive_epoch, __ATOMIC_ACQUIRE);
    while (!stopping(e)) {
        park_if_asked(t);
        service_revive(t); /* a peer (re)connected: every path gets another chance */
        if (cfg->link_timeout_s > 0 && (++passes & 1023) == 0) {
            uint64_t now = fl_now_ns();
            for (int k = t->id; k < e->nnics; k += cfg->threads)
                if (link_stalled(t, k, now)) service_paths_down(t, k);
        }
        int busy = drain_inbox(t, (uint32_t)cfg->batch * 64);
        uint32_t outstanding = 0;
        for (int k = t->id; k < e->nnics; k += cfg->threads) {
            int got = poll_nic(t, k);
            if (got < 0) return NULL;
            busy |= got;
            if (t->st->nics[k].held_len) release_held(t, k);
            /* lazy posting: the queue was just drained, so this is when there is room */
            if (progress_pending(t, k) < 0) return NULL;
            outstanding += e->nics[k].in_flight + (e->nics[k].ring_tail - e->nics[k].ring_head) +
                           t->st->nics[k].held_len;
        }
        if (busy || outstanding) {
            idle = 0;
            resting = 0;
        } else if (resting) {
            /* Quiet for over 10 ms (every write carries immediate data, so a target sees its peers'
             * traffic): keep polling — software providers need it for incoming writes — every 20 us. */
            struct timespec pause = {0, 20000};
            nanosleep(&pause, NULL);
        } else if ((++idle & 4095) == 0) {
            uint64_t now = fl_now_ns();
            if (idle == 4096) quiet_since = now;
            resting = now - quiet_since > 10000000ull;
        }
    }
    return NULL;
}

/* Join the workers that started and free what fl_service_start allocated (for `boxes` inboxes). */
static void service_release(engine_state *st, int started, int boxes) {
    for (int w = 0; w < started; w++) pthread_join(st->service_tids[w], NULL);
    for (int w = 0; w < boxes; w++) {
        free(st->inboxes[w].ops);
        st->inboxes[w].ops = NULL;
        pthread_mutex_destroy(&st->inboxes[w].lock);
    }
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
    if (cfg->threads <= 0 || cfg->threads > FL_MAX_THREADS || cfg->threads > e->nnics || cfg->batch <= 0 ||
        !e->transfers || !e->transfer_capacity) {
        snprintf(e->error, FL_ERROR_LEN, "invalid service configuration");
        return e->error_code = -FI_EINVAL;
    }
    int rc = prepare_slots(e);
    if (rc) return e->error_code = rc;
    st->service_cfg = *cfg;
    st->service_ctx = calloc(cfg->threads, sizeof(thread_ctx));
    st->done_ids = calloc(DONE_CAPACITY(e), sizeof(uint32_t));
    pthread_mutex_init(&st->done_lock, NULL);
    pthread_cond_init(&st->done_cond, NULL);
    st->done_head = st->done_tail = 0;
    st->woken = 0;
    int boxes = 0;
    for (; st->service_ctx && st->done_ids && boxes < cfg->threads; boxes++) {
        inbox *box = &st->inboxes[boxes];
        box->ops = calloc(INBOX_CAPACITY, sizeof(fl_op));
        pthread_mutex_init(&box->lock, NULL);
        if (!box->ops) break;
        atomic_store(&box->head, 0);
        atomic_store(&box->tail, 0);
        atomic_store(&st->park_request[boxes], 0);
        atomic_store(&st->parked[boxes], 0);
        st->service_ctx[boxes] = (thread_ctx){.e = e, .cfg = &st->service_cfg, .st = st, .id = boxes, .service = 1,
                                              .timeout_ns = (uint64_t)(cfg->timeout_s * 1e9)};
    }
    if (boxes < cfg->threads) {
        service_release(st, 0, boxes + (st->service_ctx && st->done_ids));
        return e->error_code = -FI_ENOMEM;
    }
    for (int w = 0; w < cfg->threads; w++) {
        rc = pthread_create(&st->service_tids[w], NULL, service_thread, &st->service_ctx[w]);
        if (rc) {
            fail(e, -rc, "cannot start service thread %d: %s", w, strerror(rc));
            service_release(st, w, boxes);
            return e->error_code;
        }
    }
    st->service_threads = cfg->threads;
    return 0;
}

uint64_t fl_service_submit(fl_engine *e, const fl_request *r, uint64_t start) {
    engine_state *st = e->state;
    int threads = st->service_threads;
    if (threads <= 0 || stopping(e) || !r->routes) return 0;
    /* One lock per worker for the whole request (taken in order, so producers never deadlock). */
    uint32_t tail[FL_MAX_THREADS], room[FL_MAX_THREADS];
    for (int w = 0; w < threads; w++) {
        pthread_mutex_lock(&st->inboxes[w].lock);
        tail[w] = atomic_load_explicit(&st->inboxes[w].tail, memory_order_relaxed);
        room[w] = INBOX_CAPACITY - (tail[w] - atomic_load_explicit(&st->inboxes[w].head, memory_order_acquire));
    }
    uint64_t i = start;
    uint32_t nic = (uint32_t)((r->first_nic + start) % (uint64_t)e->nnics);
    for (; i < r->count; i++) {
        int w = (int)(nic % (uint32_t)threads);
        if (!room[w]) break;
        room[w]--;
        const fl_route *route = &r->routes[nic];
        uint64_t len = r->lengths ? r->lengths[i] : r->length;
        st->inboxes[w].ops[tail[w]++ % INBOX_CAPACITY] = (fl_op){
            .local = r->local_base + (uint64_t)r->src[i] * r->stride,
            .remote = route->remote_base + (uint64_t)r->dst[i] * r->stride, .len = len, .rkey = route->rkey,
            .imm = r->imm, .desc = (void *)(uintptr_t)route->desc, .dest = route->dest, .routes = r->routes,
            .transfer = r->transfer, .nic = (uint16_t)nic, .flags = FL_OP_IMM};
        if (++nic == (uint32_t)e->nnics) nic = 0;
    }
    for (int w = threads - 1; w >= 0; w--) {
        atomic_store_explicit(&st->inboxes[w].tail, tail[w], memory_order_release);
        pthread_mutex_unlock(&st->inboxes[w].lock);
    }
    return i - start;
}

int fl_service_wait(fl_engine *e, uint32_t *ids, int max, double timeout_s) {
    engine_state *st = e->state;
    if (!st->done_ids) return 0;
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
    return got;
}

void fl_service_wake(fl_engine *e) {
    if (((engine_state *)e->state)->done_ids) notify(e, FL_NO_TRANSFER);
}

void fl_service_stop(fl_engine *e) {
    engine_state *st = e->state;
    if (!st || st->service_threads <= 0) return;
    __atomic_store_n(&e->stop, 1, __ATOMIC_RELAXED);
    service_release(st, st->service_threads, st->service_threads);
}
