/* The course's run loops (chapters 9-15): a timed write run over the engine core (core.c), one or many
 * threads driving GPU groups of NICs, and the one-thread target that waits for what lands. See course.h. */
#define _GNU_SOURCE
#include "core_internal.h"
#include "course.h"

#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

/* Bind this thread to the CUDA context when memory is staged (a no-op otherwise). */
static int staging_thread_setup(fl_engine *e) {
    if (!e->course.stage_device_base) return 0;
    int rc = e->course.stage_set_context(e->course.stage_context);
    if (rc) flc_fail(e, -FI_EIO, "cuCtxSetCurrent failed with CUDA error %d", rc);
    return rc;
}

static int stage_page(fl_engine *e, uint64_t dst_base, uint64_t src_base, uint64_t off, uint64_t len) {
    int rc = e->course.stage_copy(dst_base + off, src_base + off, len);
    if (rc) flc_fail(e, -FI_EIO, "staging copy of %llu bytes failed with CUDA error %d", (unsigned long long)len, rc);
    return rc;
}

/* Chapters 11-12 ask the shared counter; from chapter 13 each thread only looks at its own work. */
static inline int done(thread_ctx *t) {
    if (t->cfg->shard) return t->remaining == 0;
    if (!t->host) return atomic_load_explicit(&t->st->shared_finished, memory_order_relaxed) >= t->cfg->total_writes;
    t->host->access_begin();
    uint64_t finished = atomic_load_explicit(&t->st->shared_finished, memory_order_relaxed);
    t->host->access_end(&t->st->shared_finished);
    return finished >= t->cfg->total_writes;
}

/* The thread's clock for the timed run: the modeled host's where the provider has one. */
static inline uint64_t run_clock(thread_ctx *t) { return t->host ? t->host->now_ns() : fl_now_ns(); }

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

static int warm_up(thread_ctx *t) {
    for (int i = 0; i < t->ngroups; i++) {
        group *g = &t->groups[i];
        for (int k = 0; k < g->nnics; k++) {
            int nic = g->nics[k];
            /* untimed: numbered after the run's writes, which are all a target counts */
            uint64_t seq = t->cfg->total_writes + (uint64_t)nic;
            uint32_t page = (uint32_t)(seq % t->pages);
            const fl_course_data *c = &t->e->course;
            if (c->stage_device_base && stage_page(t->e, c->stage_host_base, c->stage_device_base,
                                                   (uint64_t)page * t->cfg->page_size, page_length(t->cfg, page)))
                return -1;
            fl_op op;
            page_op(t, nic, seq, &op);
            enum flc_post rc;
            t->last_progress_ns = flc_tick(t);
            /* a peer that never answers must not hang us */
            while ((rc = post_write(t, nic, &op, 0)) == FLC_POST_AGAIN) {
                flc_tick(t);
                if (poll_nic(t, nic) < 0 || stopping(t->e) || check_timeout(t, nic)) return -1;
                if (t->e->nics[nic].down) break;
            }
            if (rc == FLC_POST_FAILED) return -1;
        }
    }
    t->last_progress_ns = flc_tick(t);
    for (int i = 0; i < t->ngroups; i++) {
        group *g = &t->groups[i];
        for (int k = 0; k < g->nnics; k++) {
            int nic = g->nics[k];
            while (t->e->nics[nic].in_flight > 0) {
                uint64_t now = flc_tick(t);
                int got = poll_nic(t, nic);
                if (got < 0 || stopping(t->e)) return -1;
                if (got > 0) t->last_progress_ns = now;
                else if (link_stalled(t, nic, now)) {
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
    const fl_run_config *cfg = t->cfg;
    engine_state *st = t->st;
    pthread_setname_np(pthread_self(), "fl-writer"); /* lesson 12 finds its threads under /proc by this name */
    if (cfg->pin && !t->host) { /* on a modeled host the model places it (below): this box's cores count for nothing */
        cpu_set_t set;
        CPU_ZERO(&set);
        CPU_SET(cfg->cores[t->id], &set);
        int rc = pthread_setaffinity_np(pthread_self(), sizeof set, &set);
        if (rc) flc_fail(e, -rc, "thread %d: cannot pin to core %d: %s", t->id, cfg->cores[t->id], strerror(rc));
    }
    if (t->host) t->host->place(cfg->pin ? cfg->model_cores[t->id] : -1 - t->id);
    if (staging_thread_setup(e)) __atomic_store_n(&e->stop, 1, __ATOMIC_RELAXED);
    if (!stopping(e) && cfg->warmup && warm_up(t) < 0) __atomic_store_n(&e->stop, 1, __ATOMIC_RELAXED);
    pthread_barrier_wait(&st->start_line);
    t->timed = 1;
    if (t->host) t->host->reset();
    st->start_ns[t->id] = run_clock(t);
    t->last_progress_ns = flc_tick(t);
    uint64_t passes = 0, finished_ns = 0;
    while (!stopping(e) && !done(t)) {
        int progressed = 0;
        flc_tick(t);
        if (t->spill_len && requeue_spilled(t) < 0) goto out;
        for (int i = 0; i < t->ngroups; i++) {
            group *g = &t->groups[i];
            for (int k = 0; k < g->nnics; k++) {
                e->nics[g->nics[k]].passes++;
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
                if (e->course.stage_device_base && stage_page(e, e->course.stage_host_base, e->course.stage_device_base,
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
            uint64_t now = t->now_ns;
            for (int i = 0; i < t->ngroups; i++)
                for (int k = 0; k < t->groups[i].nnics; k++)
                    if (link_stalled(t, t->groups[i].nics[k], now) && check_link(t, t->groups[i].nics[k]) < 0)
                        goto out;
        }
        if (!finished_ns && !t->remaining) { /* its last write completed: its part of the run is over */
            finished_ns = run_clock(t);
            if (t->host) t->host->counts(&st->model[t->id]);
        }
        if (progressed) {
            passes++;
            t->last_progress_ns = t->now_ns;
        } else {
            /* nothing came back: a thread this one keeps from its core (the target's, on a small box) may
             * be the one that would make progress; let it run now rather than at the next tick */
            if ((++passes & 1023) == 0) sched_yield();
            if ((passes & 255) == 0 && t->remaining) {
                for (int i = 0; i < t->ngroups; i++)
                    if (t->groups[i].completed < t->groups[i].quota && check_timeout(t, t->groups[i].nics[0]) < 0)
                        goto out;
            }
        }
    }
out:
    free(t->spill);
    t->spill = NULL;
    /* a thread whose writes are all done may go on polling until every thread's are (chapters 11-12 ask the
     * shared counter): that is no part of the run */
    st->end_ns[t->id] = finished_ns ? finished_ns : run_clock(t);
    if (t->host && !finished_ns) t->host->counts(&st->model[t->id]);
    st->timed_bytes[t->id] = t->timed_bytes;
    atomic_fetch_add(&st->finished_threads, 1);
    return NULL;
}

/* Each group's NICs, its share of the run's writes and the first of them that is marked (marked_write: the
 * article marks each GPU's last writes, one per NIC, and the target waits for those); the run's marked
 * writes in e->course.marked_writes. 0, or -FI_EINVAL with the reason in e->error. */
static int plan_groups(fl_engine *e, const fl_run_config *cfg, group *groups) {
    for (int i = 0; i < e->nnics; i++) {
        int g = e->nics[i].group;
        if (g < 0 || g >= cfg->groups) {
            snprintf(e->error, FL_ERROR_LEN, "NIC %d belongs to group %d, outside 0..%d", i, g, cfg->groups - 1);
            return -FI_EINVAL;
        }
        groups[g].nics[groups[g].nnics++] = i;
    }
    e->course.marked_writes = 0;
    for (int g = 0; g < cfg->groups; g++) {
        group *gr = &groups[g];
        gr->quota = cfg->total_writes / cfg->groups + ((uint64_t)g < cfg->total_writes % cfg->groups);
        if (gr->quota && gr->nnics == 0) {
            snprintf(e->error, FL_ERROR_LEN, "group %d has writes to do but no NIC", g);
            return -FI_EINVAL;
        }
        uint64_t last = (uint64_t)gr->nnics < gr->quota ? (uint64_t)gr->nnics : gr->quota;
        gr->mark_from = cfg->mark_last ? gr->quota - last : 0;
        e->course.marked_writes += gr->quota - gr->mark_from;
    }
    return 0;
}

int fl_write_run(fl_engine *e, const fl_run_config *cfg) {
    engine_state *st = e->state;
    e->error_code = 0;
    e->error[0] = 0;
    if (cfg->threads <= 0 || cfg->threads > FL_MAX_THREADS || cfg->groups <= 0 || cfg->groups < cfg->threads ||
        cfg->batch <= 0 || cfg->page_size == 0 || cfg->buffer_bytes < cfg->page_size) {
        snprintf(e->error, FL_ERROR_LEN, "invalid engine configuration");
        return e->error_code = -FI_EINVAL;
    }
    int rc = flc_prepare_slots(e);
    if (rc) return e->error_code = rc;
    atomic_store(&st->shared_posted, 0);
    atomic_store(&st->shared_finished, 0);
    atomic_store(&st->finished_threads, 0);
    memset(st->packed, 0, sizeof st->packed);
    memset(st->padded, 0, sizeof st->padded);
    uint32_t pages = (uint32_t)((cfg->buffer_bytes + cfg->page_size - 1) / cfg->page_size);
    int T = cfg->threads;
    thread_ctx *ctx = flc_calloc_lines(T, sizeof(thread_ctx));
    group *groups = flc_calloc_lines(cfg->groups, sizeof(group));
    pthread_t *tids = calloc(T, sizeof(pthread_t));
    if (!ctx || !groups || !tids) {
        free(ctx); free(groups); free(tids);
        return e->error_code = -FI_ENOMEM;
    }
    if ((rc = plan_groups(e, cfg, groups)) != 0) {
        free(ctx); free(groups); free(tids);
        return e->error_code = rc;
    }
    /* Groups are dealt to threads: with one thread it drives all of them (chapters 9-10). Each thread
     * gets its groups as one contiguous block of the group array. */
    group *regrouped = flc_calloc_lines(cfg->groups, sizeof(group));
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
    /* the provider's modeled host, if it has one: its clock times the run, and it is told of shared lines */
    const struct fi_sim_host_ops *host = NULL;
    if (fi_open_ops(&e->nics[0].cq->fid, FI_SIM_HOST_OPS, 0, (void **)&host, NULL) != 0) host = NULL;
    memset(st->model, 0, sizeof(st->model[0]) * (size_t)T);
    for (int t = 0; t < T; t++) {
        ctx[t].e = e;
        ctx[t].host = host;
        flc_run_posting(&ctx[t], cfg);
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
            flc_fail(e, -rc, "cannot start thread %d: %s", started, strerror(rc));
            break;
        }
    }
    if (started < T) {
        /* threads already waiting at the start line would never be released */
        for (int t = started; t < T; t++) pthread_barrier_wait(&st->start_line);
    }
    for (int t = 0; t < started; t++) pthread_join(tids[t], NULL);
    pthread_barrier_destroy(&st->start_line);
    /* the run lasts as long as its longest thread: each thread's clock is its own on a modeled host */
    uint64_t longest = 0, bytes = 0, writes = 0;
    memset(&e->course.model, 0, sizeof e->course.model);
    for (int t = 0; t < started; t++) {
        if (st->end_ns[t] > st->start_ns[t] && st->end_ns[t] - st->start_ns[t] > longest)
            longest = st->end_ns[t] - st->start_ns[t];
        bytes += st->timed_bytes[t];
        _Static_assert(sizeof(struct fi_sim_counts) % sizeof(uint64_t) == 0, "fi_sim_counts holds uint64_t only");
        uint64_t *sum = (uint64_t *)&e->course.model;
        const uint64_t *mine = (const uint64_t *)&st->model[t];
        for (size_t k = 0; k < sizeof e->course.model / sizeof(uint64_t); k++) sum[k] += mine[k];
    }
    e->course.modeled = host != NULL;
    for (int t = 0; t < T; t++)
        for (int g = 0; g < ctx[t].ngroups; g++) writes += ctx[t].groups[g].completed;
    e->course.elapsed_s = (double)longest / 1e9;
    e->course.timed_bytes = bytes;
    e->course.timed_writes = writes;
    free(regrouped);
    free(ctx);
    free(tids);
    return e->error_code;
}

/* ------------------------------------------------------------------------------------------ target */

/* The target of chapters 9-15 is the article's receiver: one thread reads every NIC's completion queue.
 *
 * What proves a run complete (marks_only, the stages' default). Only each group's last writes carry
 * immediate data (fl_run_config.mark_last), so only they make completions here. "Every NIC's last write has
 * landed" proves the run complete only where a NIC's writes land in the order they were posted: fi_getinfo
 * says so with FI_ORDER_WAW or FI_ORDER_RMA_WAW in msg_order and an unbounded max_order_waw_size
 * (tcp;ofi_rxm here). It does not hold on EFA's RDM endpoints (SRD delivers out of order), nor on shm (tx
 * msg_order FI_ORDER_SAS only, max_order_waw_size 0) or the sim provider (FI_ORDER_SAS): an earlier
 * write may still be on its way when the last one lands. The article's receiver relies on it anyway. Here
 * the run ends only when both
 *   1. the writer has said the run is over (expected_arrivals, set when its control message comes), which
 *      it says only after every write of the run completed on its side, each write having asked for
 *      FI_DELIVERY_COMPLETE: its completion then means its bytes are in this host's memory (EFA's device
 *      writes complete only once the peer's NIC placed them; the sim completes a write after its last
 *      byte has landed). No provider here promises that by default (fi_getinfo's tx_attr.op_flags hold no
 *      completion level), hence the flag on every write; and
 *   2. every marked write has landed (expected_arrivals of them, each counted once: the article's signal,
 *      which also tells the target when the last write landed).
 *
 * The checking mode (marks_only 0): every write carries its sequence number and is counted once (a bit per
 * write), per page; staged pages are copied to the GPU as they land. Tests assert exact counts with it.
 *
 * Liveness: once the writer has said it is writing (writer_heard_ns) or a write has landed, silence (no word,
 * no write) for timeout_s is an error, so a writer that died mid-run ends the loop with a clear error rather
 * than a target polling for ever. Before any of that the target waits for a run without limit, asleep.
 *
 * Backing off: with FI_PROGRESS_MANUAL (shm, tcp) writes move only while the target reads its queues, so
 * during a run it reads them without rest, but yields its core on every empty pass (a writer thread
 * sharing the core runs first). With FI_PROGRESS_AUTO (EFA, sim) the provider moves writes by itself: an
 * idle target sleeps, up to IDLE_SLEEP_MAX_NS at a time, as any target does before its run starts. */

#define IDLE_SPIN_PASSES 64                /* empty passes, each yielding the core, before the first sleep */
#define IDLE_SLEEP_MIN_NS 50000ull
#define IDLE_SLEEP_MAX_NS 1000000ull       /* the longest a landing (or a stop) waits to be seen */

/* The target thread's state, on the heap: a thread given up on (target_watch) may still run, and owns it
 * then. TARGET_LOOPING until the thread ends (TARGET_ENDED) or fl_target_run gives up on it
 * (TARGET_ABANDONED); whichever comes first wins. */
enum { TARGET_LOOPING, TARGET_ENDED, TARGET_ABANDONED };

typedef struct target_ctx {
    fl_engine *e;
    int core, manual;
    uint64_t timeout_ns;
    _Atomic uint64_t passed_ns; /* when the thread last came out of a pass over its queues; 0 once it left
                                 * its loop (what follows is not a provider call) */
    _Atomic int state;
} target_ctx;

/* Count a batch of completions: each marked write once (a bit per write), and in the checking mode its page
 * too, copying a staged page to the GPU. Returns the new writes, or -1 (the engine failed). */
static int64_t take_arrivals(fl_engine *e, const struct fi_cq_data_entry *entries, ssize_t got) {
    int64_t counted = 0;
    for (ssize_t k = 0; k < got; k++) {
        if (!(entries[k].flags & FI_REMOTE_CQ_DATA)) continue;
        uint64_t seq = entries[k].data;
        if (e->course.seen_writes) {
            if (seq >= e->course.seen_capacity) continue; /* a warm-up write */
            uint64_t bit = 1ull << (seq & 63);
            if (e->course.seen_writes[seq >> 6] & bit) {
                e->course.duplicates++;
                continue;
            }
            e->course.seen_writes[seq >> 6] |= bit;
        }
        uint64_t page = e->course.pages ? seq % e->course.pages : seq;
        if (!e->course.marks_only && page < e->course.pages) {
            e->course.page_counts[page]++;
            if (e->course.stage_device_base) {
                uint64_t off = page * e->course.target_page_size, rest = e->course.target_buffer_bytes - off;
                if (stage_page(e, e->course.stage_device_base, e->course.stage_host_base, off,
                               rest < e->course.target_page_size ? rest : e->course.target_page_size))
                    return -1;
            }
        }
        counted++;
    }
    return counted;
}

/* One pass over every NIC's queue: 1 if anything came, 0 if not, -1 (the engine failed). */
static int read_queues(fl_engine *e, struct fi_cq_data_entry *entries) {
    int got_any = 0;
    for (int i = 0; i < e->nnics; i++) {
        fl_nic *n = &e->nics[i];
        ssize_t got = fi_cq_read(n->cq, entries, CQ_BATCH);
        n->cq_polls++;
        if (got == -FI_EAGAIN) continue;
        if (got == -FI_EAVAIL) {
            struct fi_cq_err_entry err = {0};
            char buf[256] = "";
            fi_cq_readerr(n->cq, &err, 0);
            n->errors++;
            flc_fail(e, -err.err, "target NIC %d: %s (%s)", i, fi_strerror(err.err),
                     fi_cq_strerror(n->cq, err.prov_errno, err.err_data, buf, sizeof buf));
            return -1;
        }
        if (got < 0) {
            flc_fail(e, (int)got, "target NIC %d: fi_cq_read: %s", i, fi_strerror((int)-got));
            return -1;
        }
        int64_t counted = take_arrivals(e, entries, got);
        if (counted < 0) return -1;
        n->arrivals += (uint64_t)counted;
        __atomic_store_n(&e->course.arrivals, e->course.arrivals + (uint64_t)counted, __ATOMIC_RELAXED);
        got_any = 1;
    }
    return got_any;
}

/* `stuck`: what the watchdog adds when the thread itself could not tell (empty from the thread). */
static void target_silent(fl_engine *e, uint64_t expected, double timeout_s, const char *stuck) {
    const char *what = e->course.marks_only ? "marked last writes" : "writes";
    unsigned long long arrivals = __atomic_load_n(&e->course.arrivals, __ATOMIC_RELAXED); /* the watchdog's too */
    if (expected != UINT64_MAX)
        flc_fail(e, -FI_ETIMEDOUT, "only %llu of the run's %llu %s arrived; nothing more for %.1f s%s",
                 arrivals, (unsigned long long)expected, what, timeout_s, stuck);
    else
        flc_fail(e, -FI_ETIMEDOUT, "the writer went silent mid-run: no write landed and no word came for %.1f s "
                 "(%llu %s had landed); is it gone?%s", timeout_s, arrivals, what, stuck);
}

/* The thread leaves its loop: 1 if it was given up on meanwhile (then it frees its state and touches
 * nothing more), else 0. */
static int target_abandoned(target_ctx *t) {
    atomic_store(&t->passed_ns, 0);
    if (atomic_load(&t->state) != TARGET_ABANDONED) return 0;
    free(t);
    return 1;
}

static void *target_thread(void *arg) {
    target_ctx *t = arg;
    fl_engine *e = t->e;
    pthread_setname_np(pthread_self(), "fl-target");
    if (t->core >= 0) {
        cpu_set_t set;
        CPU_ZERO(&set);
        CPU_SET(t->core, &set);
        pthread_setaffinity_np(pthread_self(), sizeof set, &set); /* best effort: unpinned is still correct */
    }
    struct fi_cq_data_entry entries[CQ_BATCH];
    if (staging_thread_setup(e)) return NULL;
    atomic_store(&t->passed_ns, fl_now_ns()); /* from here on the watchdog judges its passes */
    uint64_t last_arrival = 0, first_word = 0, idle_passes = 0, sleep_ns = IDLE_SLEEP_MIN_NS;
    int complete = 0;
    while (!stopping(e)) {
        int got_any = read_queues(e, entries);
        if (got_any < 0) break;
        uint64_t now = fl_now_ns();
        atomic_store_explicit(&t->passed_ns, now, memory_order_relaxed);
        if (got_any) {
            if (!e->course.first_arrival_ns) e->course.first_arrival_ns = now;
            last_arrival = now;
            __atomic_store_n(&e->course.last_arrival_ns, now, __ATOMIC_RELAXED); /* target_watch reads it */
            idle_passes = 0;
            sleep_ns = IDLE_SLEEP_MIN_NS;
        }
        uint64_t expected = __atomic_load_n(&e->course.expected_arrivals, __ATOMIC_ACQUIRE);
        if (e->course.arrivals >= expected) {
            complete = 1;
            break;
        }
        uint64_t heard = __atomic_load_n(&e->course.writer_heard_ns, __ATOMIC_RELAXED);
        if (heard && !first_word) first_word = heard;
        uint64_t alive = heard > last_arrival ? heard : last_arrival;
        if (alive && now > alive && now - alive > t->timeout_ns) {
            target_silent(e, expected, t->timeout_ns / 1e9, "");
            break;
        }
        if (got_any) continue;
        if ((alive && t->manual) || ++idle_passes <= IDLE_SPIN_PASSES) {
            sched_yield(); /* a run is on, and its writes move only while this thread reads its queues */
            continue;
        }
        struct timespec pause = {0, (long)sleep_ns};
        nanosleep(&pause, NULL);
        sleep_ns = sleep_ns * 2 < IDLE_SLEEP_MAX_NS ? sleep_ns * 2 : IDLE_SLEEP_MAX_NS;
    }
    if (target_abandoned(t)) return NULL;
    /* landed_s in the article's mode: from the writer's first word, as no earlier write announces itself */
    if (e->course.marks_only && first_word) e->course.first_arrival_ns = first_word;
    /* staged GPU memory: the article's receiver copies what landed once, after the run */
    if (complete && e->course.marks_only && e->course.stage_device_base)
        stage_page(e, e->course.stage_device_base, e->course.stage_host_base, 0, e->course.target_buffer_bytes);
    int looping = TARGET_LOOPING;
    if (!atomic_compare_exchange_strong(&t->state, &looping, TARGET_ENDED)) free(t); /* given up on meanwhile */
    return NULL;
}

/* The watchdog's verdict on a target thread that has not come out of a pass over its queues for stuck_ns
 * (a healthy pass takes microseconds): WATCH_ON while that may still be a slow pass; WATCH_SILENT once the
 * writer, too, has been silent for the timeout (what the thread would have said, had it run); WATCH_STUCK
 * after twice the timeout whatever the writer says (the thread cannot serve it), or FL_STOP_TIMEOUT_S into
 * a stop that was asked for. */
enum { WATCH_ON, WATCH_SILENT, WATCH_STUCK };

static int target_verdict(fl_engine *e, const target_ctx *t, uint64_t now, uint64_t stuck_ns) {
    uint64_t heard = __atomic_load_n(&e->course.writer_heard_ns, __ATOMIC_RELAXED);
    uint64_t landed = __atomic_load_n(&e->course.last_arrival_ns, __ATOMIC_RELAXED);
    uint64_t alive = heard > landed ? heard : landed;
    if (stuck_ns > t->timeout_ns && alive && now > alive && now - alive > t->timeout_ns) return WATCH_SILENT;
    if (stuck_ns > 2 * t->timeout_ns || (stopping(e) && stuck_ns > (uint64_t)(FL_STOP_TIMEOUT_S * 1e9)))
        return WATCH_STUCK;
    return WATCH_ON;
}

/* The watchdog, on fl_target_run's thread, outside every provider call. The target thread's own silence
 * clock runs only between its calls: a call that never returns (shm's fi_cq_read spins for ever on its
 * region's lock when a writer was stopped, SIGSTOP, or killed while it held that lock to post a write)
 * would leave the run neither done nor failed. Past target_verdict's limits the run fails here, saying why,
 * and the thread is given up on as a stuck service worker is (service.h, at fl_service_stop): detached at
 * idle priority, renamed fl-stranded, its engine kept allocated (target_stranded). Returns once the thread
 * ended or was given up on. */
static void target_watch(fl_engine *e, target_ctx *t, pthread_t tid) {
    for (;;) {
        struct timespec until;
        clock_gettime(CLOCK_REALTIME, &until);
        until.tv_nsec += 100000000L; /* a tenth of a second between looks */
        if (until.tv_nsec >= 1000000000L) until.tv_sec++, until.tv_nsec -= 1000000000L;
        if (pthread_timedjoin_np(tid, NULL, &until) == 0) break;
        uint64_t passed = atomic_load(&t->passed_ns), now = fl_now_ns();
        int verdict = passed && now > passed ? target_verdict(e, t, now, now - passed) : WATCH_ON;
        double timeout_s = t->timeout_ns / 1e9;
        int looping = TARGET_LOOPING;
        if (verdict == WATCH_ON || !atomic_compare_exchange_strong(&t->state, &looping, TARGET_ABANDONED))
            continue; /* on its way, or it just ended */
        /* from here on t is the thread's (it frees it if it ever comes back) */
        char stuck[160];
        snprintf(stuck, sizeof stuck, " (the target thread has been stuck in the provider's fi_cq_read for %.1f s, "
                 "on a lock a stopped or killed peer holds: it is left behind)", (now - passed) / 1e9);
        if (verdict == WATCH_SILENT)
            target_silent(e, __atomic_load_n(&e->course.expected_arrivals, __ATOMIC_ACQUIRE), timeout_s, stuck);
        else
            flc_fail(e, -FI_ETIMEDOUT, "the run cannot go on:%s", stuck);
        struct sched_param idle = {0};
        pthread_setschedparam(tid, SCHED_IDLE, &idle);
        pthread_setname_np(tid, "fl-stranded");
        pthread_detach(tid);
        e->course.target_stranded++;
        return;
    }
    free(t);
}

int fl_target_run(fl_engine *e, int core, int manual_progress, double timeout_s) {
    e->error_code = 0;
    e->error[0] = 0;
    if ((!e->course.marks_only && !e->course.page_counts) || !(timeout_s > 0)) {
        snprintf(e->error, FL_ERROR_LEN, "invalid target configuration");
        return e->error_code = -FI_EINVAL;
    }
    e->course.first_arrival_ns = e->course.last_arrival_ns = 0;
    target_ctx *ctx = calloc(1, sizeof *ctx);
    if (!ctx) {
        flc_fail(e, -FI_ENOMEM, "cannot start the target thread: out of memory");
        return e->error_code;
    }
    *ctx = (target_ctx){.e = e, .core = core, .manual = manual_progress, .timeout_ns = (uint64_t)(timeout_s * 1e9)};
    pthread_t tid;
    int rc = pthread_create(&tid, NULL, target_thread, ctx);
    if (rc) {
        free(ctx);
        flc_fail(e, -rc, "cannot start the target thread: %s", strerror(rc));
        return e->error_code;
    }
    target_watch(e, ctx, tid);
    return e->error_code;
}
