/* The bench's memcpy ceiling: N pthreads, each copying its own warmed slice, started together (copyrate.h).
 * Python threads around numpy's copy start one after the other, each waiting for the GIL, so on a fast
 * machine the first copies are over before the last begin: a ceiling measured that way is partly
 * single-threaded. Here thread start-up, allocation and first-touch page faults stay outside the timing. */
#define _GNU_SOURCE
#include "core.h"
#include "copyrate.h"

#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

typedef struct {
    int core, repeats;
    size_t bytes;
    _Atomic int *start; /* 0 wait, 1 go, 2 abort (a thread could not be created) */
    pthread_barrier_t *go;
    int failed;
    uint64_t *start_ns, *end_ns; /* one per repeat */
} copier;

static void *copy_slices(void *arg) {
    copier *c = arg;
    int start;
    while ((start = atomic_load_explicit(c->start, memory_order_acquire)) == 0) sched_yield();
    if (start != 1) return NULL; /* the run was called off before it began: no barrier is waited at */
    if (c->core >= 0) {
        cpu_set_t set;
        CPU_ZERO(&set);
        CPU_SET(c->core, &set);
        pthread_setaffinity_np(pthread_self(), sizeof set, &set);
    }
    /* allocated and touched by the thread that copies them: on its NUMA node, no page faults while timed */
    unsigned char *src = aligned_alloc(4096, (c->bytes + 4095) / 4096 * 4096);
    unsigned char *dst = aligned_alloc(4096, (c->bytes + 4095) / 4096 * 4096);
    c->failed = !src || !dst;
    if (!c->failed) {
        memset(src, 0x5a, c->bytes);
        memset(dst, 0, c->bytes);
        memcpy(dst, src, c->bytes); /* one untimed copy: every page of both sides mapped and written */
    }
    /* a thread without memory still meets every barrier, so that the others are not left waiting */
    for (int r = 0; r < c->repeats; r++) {
        pthread_barrier_wait(c->go);
        c->start_ns[r] = fl_now_ns();
        if (!c->failed) memcpy(dst, src, c->bytes);
        c->end_ns[r] = fl_now_ns();
    }
    free(src);
    free(dst);
    return NULL;
}

int fl_memcpy_rate(int threads, size_t bytes_per_thread, int repeats, const int *cores, int ncores, double *gbps) {
    if (threads <= 0 || threads > 1024 || bytes_per_thread == 0 || repeats <= 0 || !gbps) return -1;
    copier *ctx = calloc(threads, sizeof *ctx);
    pthread_t *tids = calloc(threads, sizeof *tids);
    uint64_t *times = calloc((size_t)threads * repeats * 2, sizeof *times);
    pthread_barrier_t go;
    _Atomic int start = 0;
    int rc = -1;
    if (!ctx || !tids || !times) goto out;
    pthread_barrier_init(&go, NULL, threads);
    int started = 0;
    for (; started < threads; started++) {
        ctx[started] = (copier){ncores > 0 ? cores[started % ncores] : -1, repeats, bytes_per_thread, &start, &go, 0,
                                times + (size_t)started * repeats * 2, times + (size_t)started * repeats * 2 + repeats};
        if (pthread_create(&tids[started], NULL, copy_slices, &ctx[started])) break;
    }
    atomic_store_explicit(&start, started == threads ? 1 : 2, memory_order_release);
    for (int t = 0; t < started; t++) pthread_join(tids[t], NULL);
    int failed = started < threads;
    for (int t = 0; t < started; t++) failed |= ctx[t].failed;
    if (!failed) {
        for (int r = 0; r < repeats; r++) {
            uint64_t first = UINT64_MAX, last = 0;
            for (int t = 0; t < threads; t++) {
                if (ctx[t].start_ns[r] < first) first = ctx[t].start_ns[r];
                if (ctx[t].end_ns[r] > last) last = ctx[t].end_ns[r];
            }
            gbps[r] = last > first ? (double)bytes_per_thread * threads * 8 / (double)(last - first) : 0.0;
        }
        rc = 0;
    }
    pthread_barrier_destroy(&go);
out:
    free(ctx);
    free(tids);
    free(times);
    return rc;
}
