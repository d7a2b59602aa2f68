/* The count behind Engine.expect (native/imm.c) on its own, for the sanitizer builds the test suite makes and
 * as a micro benchmark: worker threads count arrivals the way poll_nic does (count_imm) while a taker awaits,
 * takes and releases them the way the engine's reaper does, over a table far smaller than the values that
 * pass through it. Checks every page is counted exactly once, that slots come back, that values nobody awaits
 * give theirs up (the oldest first, or once expired; a flood of them racing with honest counts), that a table every slot of which is awaited refuses and
 * reports what it could not count, and prints ns per count_imm.
 *
 * usage: imm_selftest VALUES [BENCH_COUNTS]   (exit status 0 = all good; BENCH_COUNTS: also print the figures)
 * build: cc -O2 native/selftest/imm_selftest.c native/{core,course,service,imm}.c -lfabric -lpthread
 * (tests/test_engine_sanitizers.py builds and runs it, under sanitizers too) */
#include <stdio.h>
#include <stdlib.h>
#include <pthread.h>
#include <time.h>
#include "../core_internal.h"

#define WORKERS 2
#define MOST 64    /* values counted at once: every value below passes through the table many times over */
#define WINDOW 48  /* values in flight at once: workers never run further ahead of the taker */

static fl_engine *E;
static uint64_t VALUES;
static _Atomic uint64_t taken_upto; /* the taker has taken every value below this */
static int failures;

#define CHECK(cond, ...) \
    do { if (!(cond)) { fprintf(stderr, __VA_ARGS__); fputc('\n', stderr); failures++; } } while (0)

/* Arrival v is v % 3 + 1 pages of value v / 2, from worker v % WORKERS, in writes of one or two pages (a write
 * of two pages carries 1 above the value bits, as the service's writes do): each value comes twice, from both
 * workers, so its slot may be given back between its two arrivals, or while the second lands. */
static uint64_t pages_of(uint64_t v) { return v % 3 + 1; }
static uint32_t value_of(uint64_t v) { return (uint32_t)((v / 2) % FL_LANDING_VALUE); }

static void *worker(void *arg) {
    uint64_t me = (uint64_t)(uintptr_t)arg;
    for (uint64_t v = me; v < VALUES; v += WORKERS) {
        while (v >= atomic_load(&taken_upto) + WINDOW) sched_yield();
        for (uint64_t left = pages_of(v); left;) {
            uint64_t pages = left >= 2 ? 2 : 1;
            flc_count_imm(E, value_of(v) | ((pages - 1) << FL_IMM_VALUE_BITS));
            flc_count_imm(E, (me << FL_IMM_VALUE_BITS) | FL_LANDING_VALUE); /* and a write into landing lane `me` */
            left -= pages;
        }
    }
    return NULL;
}

/* Each arrival is taken by an expect of its own: every fourth awaited before its pages can arrive, the others
 * once they may have (arrivals before the expect are kept until taken). A count that went missing shows as a
 * take that never succeeds, one counted twice as a count left over. */
static void *taker(void *arg) {
    (void)arg;
    uint64_t ahead = 0;
    for (uint64_t v = 0; v < VALUES; v++) {
        for (; ahead < VALUES && ahead < v + WINDOW; ahead++)
            if (ahead % 4 == 3)
                CHECK(fl_imm_await(E, value_of(ahead), 1) == FL_IMM_OK, "awaiting %llu failed",
                      (unsigned long long)ahead);
        if (v % 4 != 3)
            CHECK(fl_imm_await(E, value_of(v), 1) == FL_IMM_OK, "awaiting %llu failed", (unsigned long long)v);
        uint64_t deadline = fl_now_ns() + 10000000000ull;
        while (!fl_imm_take(E, value_of(v), pages_of(v))) {
            if (fl_now_ns() > deadline) {
                fprintf(stderr, "arrival %llu (value %u) was not counted\n", (unsigned long long)v, value_of(v));
                exit(1);
            }
            sched_yield();
        }
        fl_imm_release(E, value_of(v));
        atomic_store(&taken_upto, v + 1);
    }
    return NULL;
}

static void exact_counts(void) {
    pthread_t threads[WORKERS + 1];
    for (int i = 0; i < WORKERS; i++) pthread_create(&threads[i], NULL, worker, (void *)(uintptr_t)i);
    pthread_create(&threads[WORKERS], NULL, taker, NULL);
    for (int i = 0; i <= WORKERS; i++) pthread_join(threads[i], NULL);
    fl_imm_usage usage;
    fl_imm_usage_get(E, &usage);
    CHECK(usage.values == 0 && usage.lost == 0 && usage.dropped == 0,
          "after every value was taken: %llu values hold a slot, %llu lost, %llu dropped",
          (unsigned long long)usage.values, (unsigned long long)usage.lost, (unsigned long long)usage.dropped);
    for (uint64_t v = 0; v < VALUES; v++)
        CHECK(!fl_imm_take(E, value_of(v), 1), "value %u counted more pages than it got", value_of(v));
    for (uint32_t lane = 0; lane < WORKERS; lane++) {
        uint64_t writes = 0;
        for (uint64_t v = lane; v < VALUES; v += WORKERS) writes += (pages_of(v) + 1) / 2;
        CHECK(fl_lane_take(E, lane, writes) && fl_lane_drain(E, lane) == 0, "lane %u did not count %llu writes",
              lane, (unsigned long long)writes);
    }
}

/* One value's pages stream in while an expect after another takes them one at a time and gives the slot back
 * as soon as its count is 0: the slot is given up and claimed again under the worker's feet, all the time. */
static void *stream_one_value(void *arg) {
    for (uint64_t i = 0; i < VALUES; i++) {
        for (int spins = 1; atomic_load(&taken_upto) < i; spins++) /* in step: page i lands as page i - 1 is */
            if (spins % 1024 == 0) sched_yield();                     /* released, its slot given up */
        flc_count_imm(E, 7);
    }
    return arg;
}

static void one_value_taken_as_it_streams(void) {
    pthread_t thread;
    atomic_store(&taken_upto, 0);
    pthread_create(&thread, NULL, stream_one_value, NULL);
    uint64_t deadline = fl_now_ns() + 10000000000ull;
    for (uint64_t i = 0; i < VALUES; i++) {
        CHECK(fl_imm_await(E, 7, 1) == FL_IMM_OK, "awaiting 7 failed");
        while (!fl_imm_take(E, 7, 1)) {
            if (fl_now_ns() > deadline) {
                fprintf(stderr, "page %llu of value 7 was not counted\n", (unsigned long long)i);
                exit(1);
            }
            sched_yield();
        }
        atomic_store(&taken_upto, i + 1);
        fl_imm_release(E, 7);
    }
    pthread_join(thread, NULL);
    CHECK(!fl_imm_take(E, 7, 1), "value 7 counted more pages than it got");
}

/* Values nobody awaits give their slots up to new ones, the oldest first, and expire; only a table every slot
 * of which is awaited refuses, and what it could not count is reported, never dropped in silence. */
static void full_table(void) {
    fl_imm_usage usage;
    for (uint32_t v = 0; v < MOST + 5; v++) flc_count_imm(E, v); /* nobody awaits them */
    fl_imm_usage_get(E, &usage);
    CHECK(usage.values == MOST && usage.lost == 0 && usage.dropped == 5 && usage.last_dropped == 4,
          "values nobody awaits: %llu values, %llu lost, %llu dropped", (unsigned long long)usage.values,
          (unsigned long long)usage.lost, (unsigned long long)usage.dropped);
    CHECK(!fl_imm_take(E, 4, 1) && fl_imm_take(E, 5, 1), "the oldest were not the ones dropped");
    for (uint32_t v = 1000; v < 1000 + MOST; v++)
        CHECK(fl_imm_await(E, v, 1) == FL_IMM_OK, "awaiting %u found no slot given up", v);
    flc_count_imm(E, 5000); /* every slot awaited: not counted */
    fl_imm_usage_get(E, &usage);
    CHECK(usage.values == MOST && usage.lost == 1 && usage.lost_values == 1 && usage.last_lost == 5000 &&
          usage.dropped == MOST + 4, "an awaited table: %llu values, %llu lost, %llu dropped",
          (unsigned long long)usage.values, (unsigned long long)usage.lost, (unsigned long long)usage.dropped);
    CHECK(fl_imm_await(E, 5000, 1) == FL_IMM_LOST, "a lost value was not reported");
    CHECK(fl_imm_await(E, 6000, 1) == FL_IMM_FULL, "an awaited table took one more value");
    CHECK(fl_imm_credit(E, 6000, 3) == FL_IMM_LOST, "an awaited table counted one more value");
    CHECK(fl_imm_await(E, FL_LANDING_VALUE, 1) == FL_IMM_BAD, "a landing value was awaited");
    for (uint32_t v = 1000; v < 1000 + MOST; v++) {
        flc_count_imm(E, v);
        fl_imm_release(E, v); /* an arrival nobody took: its slot is held for nobody from now */
    }
    CHECK(fl_imm_await(E, 5000, 1) == FL_IMM_OK, "a lost value is reported once");
    CHECK(fl_imm_await(E, 6000, 1) == FL_IMM_LOST, "a value lost through a credit was not reported");
    CHECK(fl_imm_expire(E, 3600000000000ull) == 0, "arrivals expired before their age");
    CHECK(fl_imm_expire(E, 0) == MOST - 1, "the arrivals nobody awaited did not all expire");
    CHECK(fl_imm_take(E, 1000, 1) == 0, "an expired value kept its count");
    fl_imm_release(E, 5000);
    fl_imm_usage_get(E, &usage);
    CHECK(usage.values == 0 && usage.lost_values == 0, "slots came back: %llu values, %llu lost values",
          (unsigned long long)usage.values, (unsigned long long)usage.lost_values);
}

/* A flood of values nobody awaits lands (a thread of its own, the lock-free path racing with the slots given
 * up under it) while expects await, count and take values of their own: each of those counted exactly, none
 * lost, the flood's pushed out. */
static _Atomic int flooding;

static void *flood(void *arg) {
    for (uint64_t i = 0; atomic_load(&flooding); i++) flc_count_imm(E, (uint32_t)(100000 + i % (4 * MOST)));
    return arg;
}

static void honest_through_a_flood(void) {
    pthread_t thread;
    atomic_store(&flooding, 1);
    pthread_create(&thread, NULL, flood, NULL);
    fl_imm_usage usage;
    do { /* the flood fills the table first */
        sched_yield();
        fl_imm_usage_get(E, &usage);
    } while (usage.values < MOST);
    for (uint64_t i = 0; i < VALUES / 4; i++) {
        uint32_t v = (uint32_t)(i % 1000);
        CHECK(fl_imm_await(E, v, 1) == FL_IMM_OK, "awaiting %u during a flood failed", v);
        flc_count_imm(E, v | (1ull << FL_IMM_VALUE_BITS)); /* a write of two pages */
        CHECK(fl_imm_take(E, v, 2) && !fl_imm_take(E, v, 1), "value %u was not counted exactly during a flood", v);
        fl_imm_release(E, v);
    }
    atomic_store(&flooding, 0);
    pthread_join(thread, NULL);
    fl_imm_usage_get(E, &usage);
    CHECK(usage.lost == 0 && usage.dropped > 0 && usage.values <= MOST, "after a flood: %llu lost, %llu dropped",
          (unsigned long long)usage.lost, (unsigned long long)usage.dropped);
}

/* A fresh engine counting at most `most` values. */
static void fresh(uint32_t most) {
    fl_engine_free(E);
    E = fl_engine_new(1, 16);
    if (!E || fl_imm_attach(E, most) != 0) exit(2);
}

/* ns per count_imm: of values holding a slot (the lock-free path: writes of a transfer whose expect() came
 * first, or whose first write claimed the slot), and of values that each arrive once and are taken (a slot
 * claimed under the lock, and given back). */
/* CPU time of the calling thread: on a shared box, time spent descheduled is not the code's. */
static uint64_t cpu_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

typedef struct { uint64_t counts; double ns; } bench_job;

static void *bench_worker(void *arg) {
    bench_job *job = arg;
    uint64_t start = cpu_ns();
    for (uint64_t i = 0; i < job->counts; i++) flc_count_imm(E, i % 32);
    job->ns = (double)(cpu_ns() - start) / (double)job->counts;
    return NULL;
}

/* The best of five runs: CPU ns per count_imm, averaged over the threads. */
static double bench_held(uint64_t counts, int threads) {
    double best = 1e30;
    for (int run = 0; run < 5; run++) {
        fresh(1 << 16);
        for (uint32_t v = 0; v < 32; v++) fl_imm_await(E, v, 1);
        pthread_t t[WORKERS];
        bench_job jobs[WORKERS];
        double ns = 0;
        for (int i = 0; i < threads; i++) {
            jobs[i] = (bench_job){counts, 0};
            pthread_create(&t[i], NULL, bench_worker, &jobs[i]);
        }
        for (int i = 0; i < threads; i++) {
            pthread_join(t[i], NULL);
            ns += jobs[i].ns / threads;
        }
        best = ns < best ? ns : best;
    }
    return best;
}

static double bench_distinct(uint64_t counts) {
    double best = 1e30;
    for (int run = 0; run < 5; run++) {
        fresh(1 << 16);
        uint64_t start = cpu_ns();
        for (uint64_t i = 0; i < counts; i++) {
            flc_count_imm(E, i % FL_LANDING_VALUE);
            if (i >= 32) fl_imm_take(E, (uint32_t)((i - 32) % FL_LANDING_VALUE), 1); /* 32 values wait at once */
        }
        double ns = (double)(cpu_ns() - start) / (double)counts;
        best = ns < best ? ns : best;
    }
    return best;
}

int main(int argc, char **argv) {
    VALUES = argc > 1 ? strtoull(argv[1], NULL, 10) : 100000;
    uint64_t bench = argc > 2 ? strtoull(argv[2], NULL, 10) : 0;
    E = fl_engine_new(1, 16);
    if (!E || fl_imm_attach(E, MOST) != 0 || fl_imm_attach(E, MOST) != -FI_EINVAL) return 2;
    exact_counts();
    one_value_taken_as_it_streams();
    full_table();
    fresh(MOST);
    honest_through_a_flood();
    if (bench) {
        printf("count_imm, a value holding a slot: %.1f ns (1 thread), %.1f ns per count (2 threads; CPU time, best "
               "of 5)\n",
               bench_held(bench, 1), bench_held(bench, 2));
        printf("count_imm + fl_imm_take, each value once: %.1f ns per value (CPU time, best of 5)\n",
               bench_distinct(bench));
    }
    fl_engine_free(E);
    printf("imm selftest: %llu values through %d slots, %s\n", (unsigned long long)VALUES, MOST,
           failures ? "FAILED" : "ok");
    return failures != 0;
}
