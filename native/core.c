/* fabriclab's native engine core: see core.h. No allocation, lock or system call per write:
 * contexts come from a per-NIC free list, pending writes from a per-NIC ring, and counters are plain
 * stores or (chapters 11-12 on purpose) relaxed atomics. */
#define _GNU_SOURCE
#include "core_internal.h"
#include "service.h" /* fl_engine_free stops a running service first */

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define MORE_RUN_MAX 16 /* FI_MORE runs stay far below any provider's tx queue, so a flush always fits */

uint64_t fl_now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

void fail(fl_engine *e, int code, const char *fmt, ...) {
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

int fl_engine_free(fl_engine *e) {
    if (!e) return 0;
    int left = fl_service_stop(e, FL_STOP_TIMEOUT_S);
    if (!left) left = fl_service_release_stranded(e);
    if (left) return left; /* threads stuck in the engine may still touch any of it: it stays allocated */
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
    imm_detach(e);
    free(e->nics);
    free(e);
    return 0;
}

int prepare_slots(fl_engine *e) {
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
        n->more_flushes = n->passes = 0;
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

static inline void count_post(thread_ctx *t) {
    if (t->cfg->shard) (*t->my_posted)++;
    else atomic_fetch_add_explicit(&t->st->shared_posted, 1, memory_order_relaxed);
}

static inline void count_finished(thread_ctx *t) {
    if (t->cfg->shard) (*t->my_finished)++;
    else atomic_fetch_add_explicit(&t->st->shared_finished, 1, memory_order_relaxed);
}

static void abandoned_done(fl_engine *e, fl_nic *n, op_slot *slot);

static void free_flush_slot(fl_nic *n, nic_state *ns, op_slot *slot) {
    slot->in_flight = 0;
    n->in_flight--;
    slot->next_free = ns->free_head;
    ns->free_head = (uint32_t)(slot - ns->slots);
}

/* Immediate data travels in the provider's cq_data_size bytes: more would arrive truncated, a write
 * counted as another. fi_getinfo's hints ask for 4 bytes; this guards every post all the same. */
static inline int imm_fits(const fl_nic *n, uint64_t imm) {
    return n->cq_data_size >= 8 || (n->cq_data_size > 0 && imm >> (8 * n->cq_data_size) == 0);
}
static int link_down(thread_ctx *t, int nic_index, const char *fmt, ...) __attribute__((format(printf, 3, 4)));

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
    if (slot && slot->in_flight && (slot->op.flags & FL_OP_FLUSH)) { /* the writes it flushed report for */
        free_flush_slot(n, ns, slot);    /* themselves; a failed flush moves nothing and fails no transfer */
        return 0;
    }
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
void notify(fl_engine *e, uint32_t finished) {
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
void abandon(fl_engine *e, fl_nic *n, op_slot *slot) {
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
void transfer_done(fl_engine *e, uint32_t transfer, int error) {
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

/* Reap every completion waiting on a NIC's queue; returns how many, or -1 on error. Never posts. */
int poll_nic(thread_ctx *t, int nic_index) {
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
                t->incoming = 1;
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
            if (slot->op.flags & FL_OP_FLUSH) { /* no page, no transfer: only its slot to give back */
                free_flush_slot(n, ns, slot);
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
int post_write(thread_ctx *t, int nic_index, const fl_op *op, uint64_t extra_flags) {
    fl_nic *n = &t->e->nics[nic_index];
    nic_state *ns = &t->st->nics[nic_index];
    if (ns->free_head >= n->max_in_flight) return 1; /* every context is held by an abandoned write */
    if ((op->flags & FL_OP_IMM) && !imm_fits(n, op->imm)) {
        n->errors++;
        if (t->service) {
            transfer_done(t->e, op->transfer, -FI_EINVAL);
            return 2;
        }
        fail(t->e, -FI_EINVAL, "NIC %d: immediate data %llu does not fit the provider's %u-byte cq_data_size; "
             "use a fabric that offers %d bytes (python -m fabriclab doctor)", nic_index, (unsigned long long)op->imm,
             n->cq_data_size, 4);
        return -1;
    }
    op_slot *slot = &ns->slots[ns->free_head];
    struct iovec iov = {.iov_base = (void *)(uintptr_t)op->local, .iov_len = op->len};
    void *desc = op->desc;
    struct fi_rma_iov rma = {.addr = op->remote, .len = op->len, .key = op->rkey};
    struct fi_msg_rma msg = {.msg_iov = &iov, .desc = &desc, .iov_count = 1, .addr = op->dest,
                             .rma_iov = &rma, .rma_iov_count = 1, .context = &slot->ctx, .data = op->imm};
    slot->op = *op;
    uint64_t flags = FI_COMPLETION | extra_flags | ((op->flags & FL_OP_IMM) ? FI_REMOTE_CQ_DATA : 0) |
                     (t->cfg->link_timeout_s > 0 || t->cfg->mark_last ? FI_DELIVERY_COMPLETE : 0);
    ssize_t rc = fi_writemsg(n->ep, &msg, flags);
    if (rc == 0) {
        slot->ep_gen = n->renewals;
        if (n->in_flight == 0) ns->last_ok_ns = fl_now_ns(); /* the link's clock starts with work */
        slot->in_flight = 1;
        ns->free_head = slot->next_free;
        n->in_flight++;
        ns->last_had_more = (extra_flags & FI_MORE) != 0;
        if (ns->last_had_more) ns->last_more = *op;
        if (op->flags & FL_OP_FLUSH) return 0; /* no page: not a write of the run */
        n->writes++;
        if (t->timed) count_post(t);
        return 0;
    }
    if (rc == -FI_EAGAIN) {
        n->eagain++;
        return 1;
    }
    if (op->flags & FL_OP_FLUSH) { /* nothing to fail or move: the writes it was to flush report themselves */
        n->errors++;
        return 2;
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
 * peer, immediate data seq (when marked_write), so the target can tell a write sent twice after a link
 * failure. */
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
        fail(t->e, -FI_ETIMEDOUT, "NIC %d: no completion within %.1f s with %u writes in flight (is the peer gone?)",
             nic_index, t->cfg->timeout_s, t->e->nics[nic_index].in_flight);
        return -1;
    }
    return 0;
}

int check_link(thread_ctx *t, int nic_index) {
    return link_down(t, nic_index, "no completion for %.1f s with %u writes in flight", t->cfg->link_timeout_s,
                     t->e->nics[nic_index].in_flight) < 0 ? -1 : 0;
}

/* The FI_MORE flush rule: a run of writes posted with FI_MORE always ends in one without it, or the
 * provider may hold the run back (tcp does) and its writes never complete. When the provider refuses the
 * next write (-FI_EAGAIN) right after an FI_MORE write, that write is posted again without FI_MORE,
 * reaping completions in between, until the provider takes it. When it is refused for good (an error, its
 * transfer failed, its link went down), the run is ended by a flush write: zero bytes to where the last
 * FI_MORE write went, without FI_MORE and without immediate data (it reads no buffer and counts for no
 * transfer). */
static int flush_refused_run(thread_ctx *t, int nic_index);

static int flush_more(thread_ctx *t, int nic_index) {
    fl_nic *n = &t->e->nics[nic_index];
    for (;;) {
        const fl_op *op = &n->ring[n->ring_head % n->ring_capacity];
        int rc = n->in_flight < n->max_in_flight ? post_write(t, nic_index, op, 0) : 1;
        if (rc == 0) {
            n->ring_head++;
            n->more_flushes++;
            return 0;
        }
        if (rc == 2 || rc == 3) {
            if (rc == 2) n->ring_head++;
            return flush_refused_run(t, nic_index);
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

/* End an FI_MORE run whose next write was refused for good, with a flush write (see flush_more). */
static int flush_refused_run(thread_ctx *t, int nic_index) {
    fl_nic *n = &t->e->nics[nic_index];
    nic_state *ns = &t->st->nics[nic_index];
    fl_op flush = ns->last_more;
    flush.len = 0;
    flush.flags = FL_OP_FLUSH;
    flush.transfer = FL_NO_TRANSFER;
    flush.imm = FL_NO_IMM;
    uint64_t deadline = fl_now_ns() + t->timeout_ns;
    while (ns->last_had_more) {
        int rc = n->in_flight < n->max_in_flight ? post_write(t, nic_index, &flush, 0) : 1;
        if (rc == 0) {
            n->more_flushes++;
            return 0;
        }
        if (rc != 1) { /* the NIC refuses even that: its writes fail or time out on their own */
            ns->last_had_more = 0;
            return rc < 0 ? -1 : 0;
        }
        if (stopping(t->e)) return -1;
        if (poll_nic(t, nic_index) < 0) return -1;
        if (fl_now_ns() > deadline) {
            fail(t->e, -FI_ETIMEDOUT, "NIC %d: the provider took no write for %.1f s to end an FI_MORE run",
                 nic_index, t->cfg->timeout_s);
            return -1;
        }
    }
    return 0;
}

/* Post from the head of a NIC's pending ring while the provider accepts and there is room in flight. */
int progress_pending(thread_ctx *t, int nic_index) {
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
        if (rc == 3) return ns->last_had_more ? flush_refused_run(t, nic_index) : 0;
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
    /* a write refused for good was the last queued: the run before it is still open */
    if (ns->last_had_more && n->ring_tail == n->ring_head) return flush_refused_run(t, nic_index);
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
            fail(t->e, -FI_ENOMEM, "no memory to re-queue the writes of a failed link");
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

