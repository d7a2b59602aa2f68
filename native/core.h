/* fabriclab's native multi-NIC write engine (chapters 9-15): the core both of its users share.
 *
 * Python opens every libfabric object (fabriclab.fi) and fills one fl_nic per NIC slot; this code only
 * runs the hot loop: posting RDMA WRITEs with immediate data, reaping completions, retrying -FI_EAGAIN,
 * from one or many pinned threads. The core (core.c) posts, reaps and fails over; its two users drive it:
 * the course's run loops (course.h: each chapter's technique is a switch in fl_run_config, so a lesson can
 * measure exactly what that technique adds) and the library's service (service.h: fabriclab.Engine). */
#ifndef FABRICLAB_CORE_H
#define FABRICLAB_CORE_H
#include <stdint.h>
#include <rdma/fabric.h>
#include <rdma/fi_domain.h>

#include "sim/fi_sim_ext.h"

#define FL_MAX_THREADS 256
#define FL_MAX_NICS 1024
#define FL_ERROR_LEN 512

/* How one NIC slot reaches a peer's region: our descriptor of the local memory in that NIC's domain, the
 * peer's address in its address vector, and the peer's name and key for its memory behind that NIC. */
typedef struct fl_route {
    uint64_t desc;
    uint64_t dest;
    uint64_t remote_base;
    uint64_t rkey;
} fl_route;

/* One RDMA WRITE waiting in a NIC's ring: everything fi_writemsg needs, plus who to tell. */
typedef struct fl_op {
    uint64_t local;          /* local address of the bytes */
    uint64_t remote;         /* what the peer calls the destination (per FI_MR_VIRT_ADDR) */
    uint64_t len;
    uint64_t rkey;
    uint64_t imm;            /* immediate data, sent when FL_OP_IMM is set */
    void *desc;              /* local memory descriptor in this NIC's domain */
    fi_addr_t dest;
    const fl_route *routes;  /* every NIC's route for this write, to move it to another NIC */
    uint32_t transfer;       /* the engine service's transfer this write belongs to */
    uint16_t nic;            /* which NIC slot posts it */
    uint16_t flags;
} fl_op;
#define FL_OP_IMM 1u
#define FL_OP_RETRIED 2u /* service: already posted once more after a path error right after a revival */
#define FL_OP_STALLED 4u /* service: given up on because its path stopped completing writes (no error came) */
#define FL_OP_FLUSH 8u   /* a zero-byte write without FI_MORE that ends a run whose next write was refused */
#define FL_NO_TRANSFER 0xffffffffu
#define FL_NO_IMM 0xffffffffull /* sent when the caller gave none, so targets still see traffic */
#define FL_TRANSFER_FIELDS 4
/* The service's immediate data: the caller's value in the low FL_IMM_VALUE_BITS bits and, above them, how
 * many pages the write carries minus one, so that a target counts a write of several coalesced pages as
 * that many (fl_imm_take counts pages). FL_NO_IMM is never a caller's value. */
#define FL_IMM_VALUE_BITS 24
/* The value bits of a write into a staged target's landing lane (fabriclab.landing): never a caller's (whose
 * largest is FL_IMM_VALUE_BITS ones minus one); the lane's number sits above them. */
#define FL_LANDING_VALUE ((1ull << FL_IMM_VALUE_BITS) - 1)

/* One NIC slot: an endpoint and what it needs to write to (or count writes from) its peer slot.
 * Aligned to a cache line so that threads owning different NICs never share one. */
typedef struct fl_nic {
    struct fid_ep *ep;
    struct fid_cq *cq;
    void *desc;              /* fi_mr_desc of the local buffer in this NIC's domain */
    fi_addr_t dest;          /* the peer slot, in this endpoint's address vector */
    uint64_t remote_base;    /* what offset 0 of the peer's buffer is called (FI_MR_VIRT_ADDR or 0) */
    uint64_t rkey;           /* the peer buffer's key in the peer's domain for this slot */
    int group;               /* which GPU group (thread, from chapter 11 on) drives this NIC */
    uint32_t max_in_flight;  /* writes allowed in flight on this NIC (the provider's tx queue size) */
    uint32_t cq_data_size;   /* bytes of immediate data the provider delivers (fi_info's cq_data_size) */
    /* the pending queue: page indices waiting to be posted, a ring owned by one thread */
    fl_op *ring;
    uint32_t ring_capacity;
    uint32_t ring_head, ring_tail;
    uint32_t in_flight;
    /* counters, written only by the thread that owns the NIC */
    uint64_t bytes, writes, completions, eagain, cq_polls, errors, arrivals, more_flushes;
    uint64_t passes;         /* course runs: timed passes of the owning thread's loop (each visits all its NICs) */
    /* failover (write runs): the link was declared down, when (fl_now_ns), why, and how many of its
     * writes were sent again over the group's other NICs (in flight: outcome unknown; or still queued) */
    int down;
    uint64_t down_ns, resent;
    char down_why[160];
    /* service mode, written only by the owning worker: writes given up on (sent again elsewhere) that the
     * provider has not reported yet, on any of this slot's endpoints, and on the current one. A provider
     * that never reports a write (shm: one into a region the peer closed) may leave the endpoint stuck
     * behind it: Engine.connect then hands the slot a fresh endpoint (next_ep, fl_nic_renew) */
    uint64_t unreported, unreported_here;
    uint64_t retried;        /* writes posted once more after a path error on a path revived since it failed */
    uint32_t renewals;       /* fresh endpoints swapped in */
    struct fid_ep *next_ep;  /* a fresh endpoint waiting for the worker (swapped in at the next revival) */
} __attribute__((aligned(64))) fl_nic;

/* The course's part of an engine (course.c): the last write run's figures, what its target counts, and
 * the staging of GPU memory through a pinned host copy. */
typedef struct fl_course_data {
    double elapsed_s;                  /* timed part of the last run: the longest of its threads' (each on the
                                        * provider's modeled clock where it offers one, else the wall clock) */
    uint64_t timed_writes, timed_bytes;
    int modeled;                       /* elapsed_s is modeled time (the sim provider's host, fi_sim_ext.h) */
    struct fi_sim_counts model;        /* what the modeled host charged the run's threads, summed */
    uint64_t marked_writes;            /* writes of the last run that carried immediate data
                                        * (fl_run_config.mark_last) */
    /* target side */
    int marks_only;                    /* 0: every write carries its sequence number and is counted per page
                                        * (the checking mode); 1: only the run's marked writes carry one
                                        * (fl_run_config.mark_last), and the run is proved complete from them and
                                        * the writer's word (course.c) */
    volatile uint64_t writer_heard_ns; /* when the writer last said it is writing (set by the control
                                        * channel's reader; fl_now_ns); 0 = not yet this run */
    uint32_t *page_counts;             /* distinct writes landed per page (page = immediate data % pages) */
    uint64_t pages;
    /* A write run's immediate data is the write's sequence number; a bit per number tells a write sent
     * again after a link failure (it may have landed already) from a new one. */
    uint64_t *seen_writes;
    uint64_t seen_capacity;            /* bits */
    volatile uint64_t duplicates;      /* arrivals of a write that had landed before */
    volatile uint64_t expected_arrivals; /* the target stops once this many distinct writes (marked writes
                                          * with marks_only) have landed */
    volatile uint64_t arrivals;        /* published total of distinct writes (marked writes with marks_only) */
    uint64_t first_arrival_ns, last_arrival_ns; /* when the target saw the first and last write land */
    uint64_t target_page_size, target_buffer_bytes;
    /* Staged GPU memory: the NIC sees a pinned host copy at stage_host_base; each page is copied from
     * the GPU (stage_device_base) just before it is queued for writing, and to the GPU as it lands.
     * stage_copy is cuMemcpyDtoH_v2 on a writer and cuMemcpyHtoD_v2 on a target (both take dst, src,
     * bytes); stage_set_context is cuCtxSetCurrent, called once per engine thread. 0 = not staged. */
    uint64_t stage_device_base, stage_host_base;
    int (*stage_copy)(uint64_t dst, uint64_t src, size_t bytes);
    int (*stage_set_context)(void *context);
    void *stage_context;
    /* Target threads fl_target_run gave up on, stuck in a provider call (course.c, target_watch): each may
     * still touch this engine and its NICs, which therefore stay allocated (fl_engine_free) and open. */
    volatile int target_stranded;
} fl_course_data;

/* The service's part of an engine (fabriclab.Engine, service.c): per transfer id, FL_TRANSFER_FIELDS
 * counters: writes still to finish, the first error (negative), writes given up on that the provider
 * may still be reading (a transfer is buffer-safe only once both counts are 0), and callers looking for
 * its end themselves (fl_transfer_wait: while one looks, its end wakes nobody); arrivals carrying immediate
 * data are counted per value (imm.h: NULL until fl_imm_attach). */
typedef struct fl_service_data {
    volatile int64_t *transfers;
    uint32_t transfer_capacity;
    void *imms;
    volatile int imm_watch;  /* someone waits for immediate data: wake fl_service_wait when it arrives */
    volatile uint32_t revive_epoch; /* bumped when a peer connects (fl_service_revive): service workers forget
                                     * dead paths and swap in the endpoints fl_nic_renew handed over */
} fl_service_data;

typedef struct fl_engine {
    int nnics;
    fl_nic *nics;
    volatile int stop;                 /* set by Python (interrupt) or by a failing thread; cleared only by
                                        * the caller before a run, so a stop asked for early still holds */
    int error_code;                    /* negative libfabric/errno code of the first failure, or 0 */
    char error[FL_ERROR_LEN];
    fl_course_data course;             /* used only by course.c's loops */
    fl_service_data service;           /* used only by the service (service.c, and the core's transfer counts) */
    void *state;                       /* engine-private */
} fl_engine;

fl_engine *fl_engine_new(int nnics, uint32_t ring_capacity);
/* Frees the engine (stopping its service first): 0, or how many threads were stuck in it, in which case
 * it stays allocated (see fl_service_stop). */
int fl_engine_free(fl_engine *e);
uint64_t fl_now_ns(void);
/* `writes` of a transfer will never be posted (its submission was given up): count them as finished. */
void fl_transfer_release(fl_engine *e, uint32_t transfer, uint64_t writes);
#include "imm.h"
#endif
