/* Lesson 13's measurement: what one counter update costs when threads share a counter, share a cache line
 * of per-thread slots, or each have a line of their own. The slots are the engine's own shard types
 * (core_internal.h), updated the way the run loops update them (count_post in core.c). */
#define _GNU_SOURCE
#include "core_internal.h"
#include "sharing.h"

#include <sched.h>
#include <stdlib.h>

typedef struct {
    int layout, id, core;
    uint64_t updates;
    _Atomic uint64_t *shared;
    packed_shard *packed;
    padded_shard *padded;
    _Atomic int *go;
    uint64_t elapsed_ns;
} counter_thread;

static void *count_updates(void *arg) {
    counter_thread *c = arg;
    if (c->core >= 0) {
        cpu_set_t set;
        CPU_ZERO(&set);
        CPU_SET(c->core, &set);
        pthread_setaffinity_np(pthread_self(), sizeof set, &set);
    }
    while (!atomic_load_explicit(c->go, memory_order_acquire)) {
    } /* every thread starts at once */
    uint64_t t0 = fl_now_ns();
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
    c->elapsed_ns = fl_now_ns() - t0;
    return NULL;
}

double fl_counter_bench(int layout, int threads, uint64_t updates, const int *cores, int ncores) {
    if (threads <= 0 || threads > FL_MAX_THREADS || updates == 0 || layout < FL_SHARED_ATOMIC ||
        layout > FL_PADDED_SLOTS)
        return -1.0;
    _Atomic uint64_t shared = 0;
    packed_shard *packed = aligned_alloc(64, ((sizeof(packed_shard) * threads + 63) / 64) * 64);
    padded_shard *padded = aligned_alloc(64, sizeof(padded_shard) * threads);
    counter_thread *ctx = calloc(threads, sizeof *ctx);
    pthread_t *tids = calloc(threads, sizeof *tids);
    _Atomic int go = 0;
    double result = -1.0;
    if (!packed || !padded || !ctx || !tids) goto out;
    for (int t = 0; t < threads; t++) packed[t].posted = packed[t].finished = padded[t].posted = padded[t].finished = 0;
    int started = 0;
    for (; started < threads; started++) {
        ctx[started] = (counter_thread){layout, started, ncores > 0 ? cores[started % ncores] : -1, updates,
                                        &shared, packed, padded, &go, 0};
        if (pthread_create(&tids[started], NULL, count_updates, &ctx[started])) break;
    }
    atomic_store_explicit(&go, 1, memory_order_release); /* also when one failed to start: no thread waits forever */
    for (int t = 0; t < started; t++) pthread_join(tids[t], NULL);
    if (started == threads) {
        uint64_t total = 0;
        for (int t = 0; t < threads; t++) total += ctx[t].elapsed_ns;
        result = (double)total / threads / (double)updates;
    }
out:
    free(packed);
    free(padded);
    free(ctx);
    free(tids);
    return result;
}
