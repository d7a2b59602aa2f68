/* The course's run loops (chapters 9-15) over the engine core: a timed write run and its target. */
#ifndef FABRICLAB_COURSE_H
#define FABRICLAB_COURSE_H
#include "core.h"

/* A write run: each chapter's technique is a switch here, so that a lesson can measure exactly what that
 * technique adds. */
typedef struct fl_run_config {
    int threads;            /* 1 = one thread drives every group (ch 9-10); else one thread per group */
    int groups;             /* GPU groups; a NIC belongs to one */
    int warmup;             /* ch 10: one untimed write per NIC before the clock starts */
    int pin;                /* ch 12: pin thread t to cores[t] */
    int shard;              /* ch 13: per-thread counters instead of shared atomics */
    int pad;                /* beyond ch 13: one cache line per thread's counters */
    int batch;              /* ch 14: writes enqueued per group per pass (1 = chapters 9-13) */
    int lazy;               /* ch 15: enqueue only; post from the completion loop after draining the CQ */
    int fi_more;            /* extra: FI_MORE on all but the last write of each run posted to one NIC */
    int mark_last;          /* the article's receiver: only each group's last writes (one per NIC, by round
                             * robin) carry immediate data, and every write asks for FI_DELIVERY_COMPLETE
                             * (course.c says why); 0 = every write carries its sequence number, the
                             * checking mode a counting target needs */
    int cores[FL_MAX_THREADS];
    int model_cores[FL_MAX_THREADS]; /* with pin, on the modeled host (the sim provider): thread t's core there */
    uint64_t total_writes;  /* timed writes, over all groups */
    uint64_t page_size;
    uint64_t buffer_bytes;  /* the region written cyclically, page by page */
    uint64_t local_base;    /* address of the local buffer (source of the writes) */
    double timeout_s;       /* no completion on any NIC with work for this long: the peer is gone */
    double link_timeout_s;  /* no completion on one NIC with work for this long: that link is down; its
                             * writes go to the group's other NICs (0: never declare a link down). With
                             * failover on, writes ask for FI_DELIVERY_COMPLETE: over tcp a write otherwise
                             * completes once its bytes are in a socket buffer, and a dead link loses them */
} fl_run_config;

/* Writer: runs the configured transfer to completion (or error/stop); 0 or a negative error code. Its
 * figures land in e->course (elapsed_s, timed_writes, timed_bytes, marked_writes). */
int fl_write_run(fl_engine *e, const fl_run_config *cfg);
/* Target: one thread (pinned to `core`, or not where it is negative) polls every NIC until
 * e->course.expected_arrivals writes (marked writes with e->course.marks_only) have landed, stop is set, or
 * the writer has been silent for timeout_s during a run. `manual_progress`: the provider moves writes only
 * while the target polls (FI_PROGRESS_MANUAL), so an idle target yields its core but never sleeps during a
 * run. See course.c. */
int fl_target_run(fl_engine *e, int core, int manual_progress, double timeout_s);
#endif
