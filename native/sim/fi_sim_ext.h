/* The sim provider's extension (as fi_ext_efa.h is efa's): the modeled host's clock and what a caller tells
 * the model about itself. An application gets it with
 *     fi_open_ops(&cq->fid, FI_SIM_HOST_OPS, 0, (void **)&ops, NULL)
 * on any CQ of the provider; -FI_ENOSYS where the provider runs on the wall clock (FABRICLAB_SIM_TIME=wall)
 * or is not sim. Every function answers for the calling thread. docs/model.md describes the model. */
#ifndef FI_SIM_EXT_H
#define FI_SIM_EXT_H
#include <stddef.h>
#include <stdint.h>

#define FI_SIM_HOST_OPS "fabriclab_sim_host_v1"

/* What the model charged the calling thread since its first provider call (or the last reset). */
struct fi_sim_counts {
    uint64_t posts;        /* transmit posts taken */
    uint64_t doorbells;    /* posts that rang the NIC's doorbell (without FI_MORE) */
    uint64_t futile_posts; /* posts answered -FI_EAGAIN */
    uint64_t cq_reads;     /* fi_cq_read calls, each counted as on a p5: those a skip stood for included */
    uint64_t empty_reads;  /* of them, those that found nothing */
    uint64_t entries;      /* completions read */
    uint64_t far_accesses; /* doorbells and completion lines that crossed to the NIC's other socket */
    uint64_t line_moves;   /* cache lines several threads write, fetched from another core */
    uint64_t migrations;   /* moves of the (unpinned) thread by the modeled scheduler */
    uint64_t app_ns;       /* the caller's own CPU time between provider calls */
    uint64_t provider_ns;  /* the modeled cost of the provider calls (posting, doorbells, polls) */
    uint64_t host_ns;      /* the modeled host's: far-socket accesses, line moves, cache refills */
    uint64_t idle_ns;      /* time skipped while the thread only polled empty queues */
};

struct fi_sim_host_ops {
    size_t size;
    uint64_t (*now_ns)(void);                    /* the calling thread's modeled clock */
    void (*place)(int core); /* pinned to this core of the modeled host (0-95); negative: the modeled scheduler
                              * places and moves it, -1 - n as it does the n-th thread of every run */
    /* The thread accesses a line other threads may write: between access_begin and access_end (address: the
     * line) its own time is the model's line move, not what the access took on this box. */
    void (*access_begin)(void);
    void (*access_end)(const volatile void *address);
    void (*counts)(struct fi_sim_counts *out);   /* the calling thread's counts */
    void (*reset)(void);                         /* zero them */
};
#endif
