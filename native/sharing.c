/* Lesson 13's measurement: what one counter update costs when threads share a counter, share a cache line
 * of per-thread slots, or each have a line of their own. The slots are the engine's own shard types
 * (core_internal.h), updated the way the run loops update them (count_post in core.c). */
#define _GNU_SOURCE
#include "core_internal.h"
#include "sharing.h"

#include <sched.h>
#include <stdlib.h>
#include <time.h>

typedef struct {
    int layout, id, core;
    uint64_t updates;
    _Atomic uint64_t *shared;
    packed_shard *packed;
    padded_shard *padded;
    _Atomic int *ready, *go;
    uint64_t start_ns, end_ns, cpu_ns;
} counter_thread;

static uint64_t thread_cpu_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

static void *count_updates(void *arg) {
    counter_thread *c = arg;
    if (c->core >= 0) {
        cpu_set_t set;
        CPU_ZERO(&set);
        CPU_SET(c->core, &set);
        pthread_setaffinity_np(pthread_self(), sizeof set, &set);
    }
    /* a barrier: the main thread says go only when every thread is pinned and spinning here, so that the
     * threads start together and update their counters at the same time, which is what is measured */
    atomic_fetch_add_explicit(c->ready, 1, memory_order_acq_rel);
    while (!atomic_load_explicit(c->go, memory_order_acquire)) {
    }
    uint64_t cpu0 = thread_cpu_ns();
    c->start_ns = fl_now_ns();
    switch (c->layout) {
    case FL_SHARED_ATOMIC:
        for (uint64_t i = 0; i < c->updates; i++) atomic_fetch_add_explicit(c->shared, 1, memory_order_relaxed);
        break;
    case FL_PACKED_SLOTS:
        for (uint64_t i = 0; i < c->updates; i++) c->packed[c->id].posted++;
        break;
    default:
        for (uint64_t i = 0; i < c->updates; i++) c->padded[c->id].posted++;
    }
    c->end_ns = fl_now_ns();
    c->cpu_ns = thread_cpu_ns() - cpu0;
    return NULL;
}

/* The share of the run in which every thread was updating at once: the time all of them were between
 * their start and their end, as a share of the longest thread's, times the least share of its own time a
 * thread spent on a CPU (a thread the scheduler took off its core updates nothing meanwhile). */
static double overlap_of(const counter_thread *ctx, int threads) {
    uint64_t last_start = 0, first_end = UINT64_MAX, longest = 1;
    double on_cpu = 1.0;
    for (int t = 0; t < threads; t++) {
        uint64_t wall = ctx[t].end_ns - ctx[t].start_ns;
        if (ctx[t].start_ns > last_start) last_start = ctx[t].start_ns;
        if (ctx[t].end_ns < first_end) first_end = ctx[t].end_ns;
        if (wall > longest) longest = wall;
        double share = wall ? (double)ctx[t].cpu_ns / (double)wall : 1.0;
        if (share < on_cpu) on_cpu = share;
    }
    double together = first_end > last_start ? (double)(first_end - last_start) / (double)longest : 0.0;
    return together * (on_cpu > 1.0 ? 1.0 : on_cpu);
}

double fl_counter_bench(int layout, int threads, uint64_t updates, const int *cores, int ncores, double *overlap) {
    if (threads <= 0 || threads > FL_MAX_THREADS || updates == 0 || layout < FL_SHARED_ATOMIC ||
        layout > FL_PADDED_SLOTS)
        return -1.0;
    _Atomic uint64_t shared = 0;
    packed_shard *packed = aligned_alloc(64, ((sizeof(packed_shard) * threads + 63) / 64) * 64);
    padded_shard *padded = aligned_alloc(64, sizeof(padded_shard) * threads);
    counter_thread *ctx = calloc(threads, sizeof *ctx);
    pthread_t *tids = calloc(threads, sizeof *tids);
    _Atomic int ready = 0, go = 0;
    double result = -1.0;
    if (!packed || !padded || !ctx || !tids) goto out;
    for (int t = 0; t < threads; t++) packed[t].posted = packed[t].finished = padded[t].posted = padded[t].finished = 0;
    int started = 0;
    for (; started < threads; started++) {
        ctx[started] = (counter_thread){layout, started, ncores > 0 ? cores[started % ncores] : -1, updates,
                                        &shared, packed, padded, &ready, &go, 0, 0, 0};
        if (pthread_create(&tids[started], NULL, count_updates, &ctx[started])) break;
    }
    while (atomic_load_explicit(&ready, memory_order_acquire) < started) sched_yield();
    atomic_store_explicit(&go, 1, memory_order_release); /* also when one failed to start: no thread waits forever */
    for (int t = 0; t < started; t++) pthread_join(tids[t], NULL);
    if (started == threads) {
        uint64_t total = 0;
        for (int t = 0; t < threads; t++) total += ctx[t].end_ns - ctx[t].start_ns;
        result = (double)total / threads / (double)updates;
        if (overlap) *overlap = overlap_of(ctx, threads);
    }
out:
    free(packed);
    free(padded);
    free(ctx);
    free(tids);
    return result;
}
