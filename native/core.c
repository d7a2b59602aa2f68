/* fabriclab's native engine core: see core.h. No allocation, lock or system call per write:
 * contexts come from a per-NIC free list, pending writes from a per-NIC ring, and counters are plain
 * stores or (chapters 11-12 on purpose) relaxed atomics. What a failed write or a quiet NIC leads to is the
 * user's (thread_ctx.failover: course_failover.c, path.c): the core calls nothing above it
 * (core_internal.h). */
#define _GNU_SOURCE
#include "core_internal.h"

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

void flc_fail(fl_engine *e, int code, const char *fmt, ...) {
    int expected = 0;
    if (atomic_compare_exchange_strong((_Atomic int *)&e->error_code, &expected, code ? code : -FI_EOTHER)) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(e->error, FL_ERROR_LEN, fmt, ap);
        va_end(ap);
    }
    __atomic_store_n(&e->stop, 1, __ATOMIC_RELAXED);
}

int flc_prepare_slots(fl_engine *e) {
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

/* A modeled host (the sim provider) charges each access to a line other threads write as that line's move
 * from another core: it is told which line. */
static inline void count_post(thread_ctx *t) {
    if (t->host) t->host->access_begin();
    if (t->shard) (*t->my_posted)++;
    else atomic_fetch_add_explicit(&t->st->shared_posted, 1, memory_order_relaxed);
    if (t->host) t->host->access_end(t->shard ? (const volatile void *)t->my_posted : &t->st->shared_posted);
}

static inline void count_finished(thread_ctx *t) {
    if (t->host) t->host->access_begin();
    if (t->shard) (*t->my_finished)++;
    else atomic_fetch_add_explicit(&t->st->shared_finished, 1, memory_order_relaxed);
    if (t->host) t->host->access_end(t->shard ? (const volatile void *)t->my_finished : &t->st->shared_finished);
}

static void flc_free_flush_slot(fl_nic *n, nic_state *ns, op_slot *slot) {
    slot->in_flight = 0;
    n->in_flight--;
    flc_free_slot(ns, slot);
}

/* Immediate data travels in the provider's cq_data_size bytes: more would arrive truncated, a write
 * counted as another. fi_getinfo's hints ask for 4 bytes; this guards every post all the same. */
static inline int flc_imm_fits(const fl_nic *n, uint64_t imm) {
    return n->cq_data_size >= 8 || (n->cq_data_size > 0 && imm >> (8 * n->cq_data_size) == 0);
}

/* Completions of a peer's writes into our memory carry remote flags and no context of ours (shm hands back
 * whatever the peer's command held, e.g. 0x1): they are told apart by their flags, never by the pointer.
 * Anything else must be one of this NIC's op slots; a context outside them is not ours to touch. */
static inline int flc_remote_completion(uint64_t flags) {
    return (flags & (FI_REMOTE_WRITE | FI_REMOTE_READ | FI_RECV)) != 0;
}

static inline op_slot *flc_own_slot(const fl_nic *n, const nic_state *ns, void *context) {
    uintptr_t at = (uintptr_t)context, first = (uintptr_t)ns->slots;
    if (!ns->slots || at < first || (at - first) % sizeof(op_slot) || (at - first) / sizeof(op_slot) >= n->max_in_flight)
        return NULL;
    return context;
}

/* A completion error: the flush write's slot is the core's to give back; anything else is the user's
 * (flc_failover.write_failed). */
static enum flc_reap flc_cq_error(thread_ctx *t, int nic_index) {
    fl_nic *n = &t->e->nics[nic_index];
    struct fi_cq_err_entry err = {0};
    n->errors++;
    if (fi_cq_readerr(n->cq, &err, 0) < 0) {
        flc_fail(t->e, -FI_EIO, "NIC %d: completion error that could not be read", nic_index);
        return FLC_REAP_FAILED;
    }
    nic_state *ns = &t->st->nics[nic_index];
    op_slot *slot = flc_remote_completion(err.flags) ? NULL : flc_own_slot(n, ns, err.op_context);
    if (slot && slot->in_flight && (slot->op.flags & FL_OP_FLUSH)) { /* the writes it flushed report for */
        flc_free_flush_slot(n, ns, slot); /* themselves; a failed flush moves nothing and fails no transfer */
        return FLC_REAP_GO_ON;
    }
    /* a context that is no write of ours in flight (a peer's, a stale or a foreign one) is not ours to touch */
    if (slot && !slot->in_flight && !slot->abandoned) slot = NULL;
    return t->failover->write_failed(t, nic_index, slot, &err);
}

/* Wake fl_service_wait: a transfer finished, or (FL_NO_TRANSFER) something else happened. */
void flc_notify(fl_engine *e, uint32_t finished) {
    engine_state *st = e->state;
    pthread_mutex_lock(&st->done_lock);
    if (finished == FL_NO_TRANSFER) st->woken = 1;
    else if (st->done_tail - st->done_head < FLC_DONE_CAPACITY(e))
        st->done_ids[st->done_tail++ % FLC_DONE_CAPACITY(e)] = finished;
    else st->done_lost = 1; /* never overwrite a notice not taken yet: the waiter looks at every transfer */
    pthread_cond_signal(&st->done_cond);
    pthread_mutex_unlock(&st->done_lock);
}

/* The transfer's last write finished: the reaper is told, unless a caller is looking for it (fl_transfer_wait).
 * Sequentially consistent with the caller's looks: either this sees the caller looking, or the caller,
 * once it stops, sees the count at 0. (A caller that looked at an id as it was handed to another transfer
 * may leave the count below 0: that counts as nobody looking.) */
void flc_transfer_finished_writes(fl_engine *e, uint32_t transfer, int64_t writes) {
    if (!flc_is_transfer(e, transfer) || !writes) return;
    if (__atomic_sub_fetch(FLC_LEFT(e, transfer), writes, __ATOMIC_SEQ_CST) == 0 &&
        __atomic_load_n(FLC_WAITERS(e, transfer), __ATOMIC_SEQ_CST) <= 0)
        flc_notify(e, transfer);
}

/* A posted write given up on (its copy went elsewhere, or its transfer failed) may still read the local
 * buffer until the provider reports it: the transfer is not buffer-safe until then. */
void flc_abandon(fl_engine *e, fl_nic *n, op_slot *slot) {
    slot->in_flight = 0;
    slot->abandoned = 1;
    n->unreported++;
    if (slot->ep_gen == n->renewals) n->unreported_here++;
    if (flc_is_transfer(e, slot->op.transfer))
        __atomic_add_fetch(FLC_ABANDONED(e, slot->op.transfer), 1, __ATOMIC_ACQ_REL);
}

/* The provider reported an abandoned write: it no longer reads the buffer. The transfer is told once its
 * writes are all finished and none it gave up on is still posted. */
void flc_abandoned_done(fl_engine *e, fl_nic *n, op_slot *slot) {
    slot->abandoned = 0;
    n->unreported--;
    if (slot->ep_gen == n->renewals) n->unreported_here--;
    uint32_t transfer = slot->op.transfer;
    if (flc_is_transfer(e, transfer) && __atomic_sub_fetch(FLC_ABANDONED(e, transfer), 1, __ATOMIC_ACQ_REL) == 0 &&
        __atomic_load_n(FLC_LEFT(e, transfer), __ATOMIC_ACQUIRE) == 0)
        flc_notify(e, transfer);
}

/* One write of a service transfer has finished (error < 0: failed). */
void flc_transfer_done(fl_engine *e, uint32_t transfer, int error) {
    if (!flc_is_transfer(e, transfer)) return;
    if (error) {
        int64_t none = 0;
        __atomic_compare_exchange_n(FLC_FIRST_ERROR(e, transfer), &none, (int64_t)error, 0,
                                    __ATOMIC_RELAXED, __ATOMIC_RELAXED);
    }
    flc_transfer_finished_writes(e, transfer, 1);
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
            enum flc_reap rc = flc_cq_error(t, nic_index);
            if (rc == FLC_REAP_FAILED) return -1;
            if (rc == FLC_REAP_LINK_DOWN) return handled + 1;
            handled++;
            continue;
        }
        if (got < 0) {
            flc_fail(t->e, (int)got, "NIC %d: fi_cq_read: %s", nic_index, fi_strerror((int)-got));
            return -1;
        }
        for (ssize_t i = 0; i < got; i++) {
            if (flc_remote_completion(entries[i].flags)) { /* a peer's write into our memory */
                t->incoming = 1;
                if (entries[i].flags & FI_REMOTE_CQ_DATA) {
                    n->arrivals++;
                    landed |= flc_count_imm(t->e, entries[i].data);
                }
                continue;
            }
            op_slot *slot = flc_own_slot(n, ns, entries[i].op_context);
            if (!slot || (!slot->in_flight && !slot->abandoned)) continue; /* not a write of ours in flight */
            if (slot->abandoned) { /* it was sent again elsewhere; that copy is the one counted */
                flc_abandoned_done(t->e, n, slot);
                flc_free_slot(ns, slot);
                continue;
            }
            if (slot->op.flags & FL_OP_FLUSH) { /* no page, no transfer: only its slot to give back */
                flc_free_flush_slot(n, ns, slot);
                continue;
            }
            uint64_t len = slot->op.len;
            if (slot->op.transfer != run_transfer) {
                if (t->e->service.transfers) flc_transfer_finished_writes(t->e, run_transfer, run_writes);
                run_transfer = slot->op.transfer;
                run_writes = 0;
            }
            run_writes++;
            completed++;
            slot->in_flight = 0;
            n->bytes += len;
            n->completions++;
            n->in_flight--;
            if (t->timed && slot->op.imm < t->warmup_from) { /* not a warm-up write */
                t->timed_bytes += len;
                ns->group->completed++;
                t->remaining--;
                count_finished(t);
            }
            flc_free_slot(ns, slot);
        }
        handled += (int)got;
        if (got < CQ_BATCH) break;
    }
    if (t->e->service.transfers) flc_transfer_finished_writes(t->e, run_transfer, run_writes);
    if (completed) ns->last_ok_ns = t->now_ns;
    if (landed && __atomic_load_n(&t->e->service.imm_watch, __ATOMIC_RELAXED)) flc_notify(t->e, FL_NO_TRANSFER);
    return handled;
}

/* Post one write (extra_flags: FI_MORE or 0). A write the provider refuses for good is the user's
 * (flc_failover.post_failed), but for a flush write: the writes it was to flush report for themselves. */
enum flc_post post_write(thread_ctx *t, int nic_index, const fl_op *op, uint64_t extra_flags) {
    fl_nic *n = &t->e->nics[nic_index];
    nic_state *ns = &t->st->nics[nic_index];
    if (ns->free_head >= n->max_in_flight) return FLC_POST_AGAIN; /* every context is held by an abandoned write */
    if ((op->flags & FL_OP_IMM) && !flc_imm_fits(n, op->imm)) {
        n->errors++;
        return t->failover->imm_refused(t, nic_index, op);
    }
    op_slot *slot = &ns->slots[ns->free_head];
    struct iovec iov = {.iov_base = (void *)(uintptr_t)op->local, .iov_len = op->len};
    void *desc = op->desc;
    struct fi_rma_iov rma = {.addr = op->remote, .len = op->len, .key = op->rkey};
    struct fi_msg_rma msg = {.msg_iov = &iov, .desc = &desc, .iov_count = 1, .addr = op->dest,
                             .rma_iov = &rma, .rma_iov_count = 1, .context = &slot->ctx, .data = op->imm};
    slot->op = *op;
    uint64_t flags = t->op_flags | extra_flags | ((op->flags & FL_OP_IMM) ? FI_REMOTE_CQ_DATA : 0);
    ssize_t rc = fi_writemsg(n->ep, &msg, flags);
    if (rc == 0) {
        slot->ep_gen = n->renewals;
        if (n->in_flight == 0) ns->last_ok_ns = t->now_ns; /* the link's clock starts with work */
        slot->in_flight = 1;
        ns->free_head = slot->next_free;
        n->in_flight++;
        ns->last_had_more = (extra_flags & FI_MORE) != 0;
        if (ns->last_had_more) ns->last_more = *op;
        if (op->flags & FL_OP_FLUSH) return FLC_POSTED; /* no page: not a write of the run */
        n->writes++;
        if (t->timed) count_post(t);
        return FLC_POSTED;
    }
    if (rc == -FI_EAGAIN) {
        n->eagain++;
        return FLC_POST_AGAIN;
    }
    n->errors++;
    if (op->flags & FL_OP_FLUSH) return FLC_POST_REFUSED; /* nothing to fail or move */
    return t->failover->post_failed(t, nic_index, op, (int)rc);
}

/* The FI_MORE flush rule: a run of writes posted with FI_MORE always ends in one without it, or the
 * provider may hold the run back (tcp does) and its writes never complete. When the provider refuses the
 * next write (-FI_EAGAIN) right after an FI_MORE write, that write is posted again without FI_MORE,
 * reaping completions in between, until the provider takes it. When it is refused for good (an error, its
 * transfer failed, its link went down), the run is ended by a flush write: zero bytes to where the last
 * FI_MORE write went, without FI_MORE and without immediate data (it reads no buffer and counts for no
 * transfer). */
static int flc_flush_refused_run(thread_ctx *t, int nic_index);

static int flush_more(thread_ctx *t, int nic_index) {
    fl_nic *n = &t->e->nics[nic_index];
    for (;;) {
        uint64_t now = flc_tick(t);
        const fl_op *op = &n->ring[n->ring_head % n->ring_capacity];
        enum flc_post rc = n->in_flight < n->max_in_flight ? post_write(t, nic_index, op, 0) : FLC_POST_AGAIN;
        if (rc == FLC_POSTED) {
            n->ring_head++;
            n->more_flushes++;
            return 0;
        }
        if (rc == FLC_POST_REFUSED || rc == FLC_POST_LINK_DOWN) {
            if (rc == FLC_POST_REFUSED) n->ring_head++;
            return flc_flush_refused_run(t, nic_index);
        }
        if (rc == FLC_POST_FAILED || stopping(t->e)) return -1;
        int got = poll_nic(t, nic_index);
        if (got < 0) return -1;
        if (n->down) return 0;
        if (got > 0) t->last_progress_ns = now;
        else if (link_stalled(t, nic_index, now)) return t->failover->link_quiet(t, nic_index);
        else if (t->failover->check_deadline && t->failover->check_deadline(t, nic_index)) return -1;
    }
}

/* End an FI_MORE run whose next write was refused for good, with a flush write (see flush_more). */
static int flc_flush_refused_run(thread_ctx *t, int nic_index) {
    fl_nic *n = &t->e->nics[nic_index];
    nic_state *ns = &t->st->nics[nic_index];
    fl_op flush = ns->last_more;
    flush.len = 0;
    flush.flags = FL_OP_FLUSH;
    flush.transfer = FL_NO_TRANSFER;
    flush.imm = FL_NO_IMM;
    uint64_t deadline = fl_now_ns() + t->timeout_ns;
    while (ns->last_had_more) {
        flc_tick(t);
        enum flc_post rc = n->in_flight < n->max_in_flight ? post_write(t, nic_index, &flush, 0) : FLC_POST_AGAIN;
        if (rc == FLC_POSTED) {
            n->more_flushes++;
            return 0;
        }
        if (rc != FLC_POST_AGAIN) { /* the NIC refuses even that: its writes fail or time out on their own */
            ns->last_had_more = 0;
            return rc == FLC_POST_FAILED ? -1 : 0;
        }
        if (stopping(t->e)) return -1;
        if (poll_nic(t, nic_index) < 0) return -1;
        if (t->now_ns > deadline) {
            flc_fail(t->e, -FI_ETIMEDOUT, "NIC %d: the provider took no write for %.1f s to end an FI_MORE run",
                     nic_index, (double)t->timeout_ns / 1e9);
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
        int more = t->fi_more && available > 1 && run + 1 < MORE_RUN_MAX;
        const fl_op *op = &n->ring[n->ring_head % n->ring_capacity];
        if (ns->dead_paths && t->failover->moved_if_dead(t, nic_index, op)) { /* marked since it was queued */
            n->ring_head++;
            continue;
        }
        enum flc_post rc = post_write(t, nic_index, op, more ? FI_MORE : 0);
        if (rc == FLC_POST_LINK_DOWN) return ns->last_had_more ? flc_flush_refused_run(t, nic_index) : 0;
        if (rc == FLC_POSTED || rc == FLC_POST_REFUSED) { /* refused for good: its transfer has been failed */
            n->ring_head++;
            run = more && rc == FLC_POSTED ? run + 1 : 0;
            continue;
        }
        if (rc == FLC_POST_FAILED) return -1;
        /* -FI_EAGAIN: the write stays at the head of the ring for the next round */
        if (ns->last_had_more) return flush_more(t, nic_index);
        break;
    }
    /* a write refused for good was the last queued: the run before it is still open */
    if (ns->last_had_more && n->ring_tail == n->ring_head) return flc_flush_refused_run(t, nic_index);
    return 0;
}
