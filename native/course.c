/* The course's run loops (chapters 9-15): a timed write run over the engine core (core.c), one or many
 * threads driving GPU groups of NICs, and the target that counts what lands. See course.h. */
#define _GNU_SOURCE
#include "core_internal.h"
#include "course.h"

#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

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

/* Chapters 11-12 ask the shared counter; from chapter 13 each thread only looks at its own work. */
static inline int done(thread_ctx *t) {
    if (t->cfg->shard) return t->remaining == 0;
    return atomic_load_explicit(&t->st->shared_finished, memory_order_relaxed) >= t->cfg->total_writes;
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
    pthread_setname_np(pthread_self(), "fl-writer"); /* lesson 12 finds its threads under /proc by this name */
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
    uint64_t passes = 0, idle_passes = 0;
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
        else if ((idle_passes++ & 1023) == 1023) sched_yield(); /* as the writers do: give way to a thread with work */
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

