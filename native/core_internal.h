/* What fabriclab's native files share and nobody else sees: the engine's private state (fl_engine.state),
 * the per-thread context, and the functions one file calls in another. Never given to cffi
 * (native/fabric_cdef.h declares only the public headers' names), and hidden from the built module's
 * exported symbols (FL_INTERNAL), so calls between the files stay direct calls.
 *
 * The files, each calling only those below it (tests/test_native_layers.py checks it on the built objects):
 *
 *     engine.c           fl_engine_new / fl_engine_free: the engine's life (its service stopped first)
 *     course.c           the course's write runs and their target (course.h)
 *     course_failover.c  a write run's writes by number, and failover of a whole link (flc_course_failover)
 *     service.c          the library's service: workers, inboxes, submission, waiting, stopping (service.h)
 *     path.c             the service's per-path failover and revival (flc_service_failover)
 *     resting.c          idle service workers nap; whoever hands them work wakes them
 *     core.c             posting, reaping, the FI_MORE flush rule, and counting writes against transfers
 *     imm.c              the count of arriving immediate data (imm.h)
 *
 * Headers: core.h (the engine's public structs) is included by course.h and service.h (each user's
 * configuration and entry points), all three by this one, and this one by every file above; imm.h comes
 * with core.h. No header includes one that includes it.
 *
 * The core never calls up: what happens when a write fails or a NIC goes quiet is each user's own, handed
 * to the core as a table of callbacks (flc_failover, in thread_ctx.failover). The benchmarks sharing.c (lesson
 * 13's counters, with the shard types below) and copyrate.c call only the core's clock; signals.c and gate.c stand alone.
 *
 * Internal names take the flc_ prefix, static ones too, but for those the course's lessons quote and teach
 * (fabriclab.course.lesson.show_c finds an excerpt by its first line): poll_nic, post_write, progress_pending,
 * flush_more, page_op, requeue, check_link, check_timeout, link_stalled, ring_full, ring_slot, stopping,
 * page_length, count_post, count_finished, and course.c's own. */
#ifndef FABRICLAB_CORE_INTERNAL_H
#define FABRICLAB_CORE_INTERNAL_H
#include "core.h"
#include "course.h"
#include "service.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <rdma/fi_endpoint.h>
#include <rdma/fi_eq.h>
#include <rdma/fi_errno.h>
#include <rdma/fi_rma.h>

#define FL_INTERNAL __attribute__((visibility("hidden")))

#define CQ_BATCH 16
#define FLC_INBOX_CAPACITY 65536u

typedef struct op_slot {
    struct fi_context2 ctx; /* first: the completion's op_context points here */
    fl_op op;               /* what was posted: sent again elsewhere if its link goes down */
    uint32_t next_free;
    int in_flight;
    int abandoned;          /* sent again elsewhere: a late completion only frees the slot */
    uint32_t ep_gen;        /* the NIC's endpoint it was posted on (fl_nic.renewals at the time) */
} op_slot;

#define FLC_MAX_DEAD_PATHS 32
#define FLC_DONE_CAPACITY(e) (2 * (uint64_t)(e)->service.transfer_capacity)

/* Service mode: what fl_service_submit hands one worker thread. Producers take the lock; the worker
 * only reads head/tail atomically. `resting`: 1 while the worker naps (resting.c), the word
 * it sleeps on; whoever gives it something to do and sees 1 wakes it. */
typedef struct inbox {
    pthread_mutex_t lock;
    fl_op *ops;
    _Atomic uint32_t head, tail;
    _Atomic uint32_t resting;
} inbox;

struct group;

typedef struct nic_state {
    op_slot *slots;
    uint64_t last_ok_ns;    /* last completion, or the post that gave an idle NIC work */
    /* service mode: peers this NIC no longer reaches (a stalled link or a gone peer); beyond
     * FLC_MAX_DEAD_PATHS the whole NIC is taken as down */
    fi_addr_t dead_dests[FLC_MAX_DEAD_PATHS];
    uint8_t dead_stalled[FLC_MAX_DEAD_PATHS]; /* marked for a stall (no completion), not for an error */
    int dead_paths;
    /* the paths that were dead at the last revival and have not failed since (revived_all: the whole NIC
     * was down): a path error there may be the provider still tearing down the old connection, so the
     * write is posted once more, after the retry hold (path.c), before the path is declared dead again */
    fi_addr_t revived_dests[FLC_MAX_DEAD_PATHS];
    int revived_paths, revived_all;
    fl_op *held;            /* writes waiting for that second try, posted from held_until_ns on */
    uint32_t held_len, held_cap;
    uint64_t held_until_ns;
    uint32_t free_head;
    int last_had_more;
    fl_op last_more;     /* the last write posted with FI_MORE: where a flush write goes if the next is refused */
    struct group *group; /* the group that drives this NIC during a write run */
} __attribute__((aligned(64))) nic_state; /* NICs of different threads never share a line */

/* Per-thread counters for chapters 13 (sharded: packed, four threads' pairs to a cache line) and beyond
 * (padded: a line each). */
typedef struct { volatile uint64_t posted, finished; } packed_shard;
typedef struct { volatile uint64_t posted, finished; char pad[48]; } __attribute__((aligned(64))) padded_shard;

typedef struct engine_state {
    nic_state *nics;
    /* chapters 11-12: every thread updates these, on a line of their own (the pointer above is read at every
     * post and poll: sharing their line would make each of those a miss too) */
    _Alignas(64) _Atomic uint64_t shared_posted;
    _Atomic uint64_t shared_finished;
    char shared_pad[48];
    packed_shard packed[FL_MAX_THREADS];
    padded_shard padded[FL_MAX_THREADS];
    _Atomic int finished_threads;
    pthread_barrier_t start_line;
    uint64_t start_ns[FL_MAX_THREADS], end_ns[FL_MAX_THREADS]; /* each thread's own clock (course.c) */
    struct fi_sim_counts model[FL_MAX_THREADS];
    uint64_t timed_bytes[FL_MAX_THREADS];
    /* service mode */
    int service_threads;
    pthread_t service_tids[FL_MAX_THREADS];
    struct thread_ctx *service_ctx;
    inbox inboxes[FL_MAX_THREADS];
    fl_service_config service_cfg;
    /* finished transfers, for fl_service_wait. An id is told at most twice per use (when its writes are all
     * finished, and when the last of its abandoned writes is reported), but a caller that settles a transfer
     * itself (fl_transfer_wait) may free and reuse its id before the reaper took an earlier notice of it out:
     * should FLC_DONE_CAPACITY entries ever be waiting, a notice is not queued but `done_lost` set, and the
     * waiter then looks at every transfer instead (fl_service_wait returns -1) */
    _Atomic int park_request[FL_MAX_THREADS], parked[FL_MAX_THREADS]; /* fl_worker_park */
    _Atomic uint64_t last_arrival_ns; /* when a peer's write last landed on any worker's NICs (resting.c) */
    /* Stopping (fl_service_stop). A worker clears its worker_running flag as the last thing it does; one
     * still set at the stop's deadline is stuck inside a provider call (why: service.h, fl_service_stop):
     * it is detached, and everything it may touch stays allocated (stranded_threads:
     * how many flags fl_engine_free still has to find cleared before it frees the engine). `callers`:
     * threads inside fl_service_submit, _wait, _wake or fl_worker_park, which the stop waits for before it
     * frees the inboxes and the finished queue; `closing`: set by the stop, after which they stay out. */
    _Atomic int worker_running[FL_MAX_THREADS];
    int stranded_threads;
    _Atomic int callers, closing;
    pthread_mutex_t done_lock;
    pthread_cond_t done_cond;
    uint32_t *done_ids;
    uint64_t done_head, done_tail;
    int woken, done_lost;
} engine_state;

typedef struct group {
    int id, nnics;
    int nics[FL_MAX_NICS];
    uint32_t rr;
    uint64_t quota, issued, completed; /* timed writes: to do, enqueued, completed */
    uint64_t mark_from;                /* with fl_run_config.mark_last: the first of its writes that is marked */
} __attribute__((aligned(64))) group; /* a thread's counts never share a line with another's group */

/* A write waiting for room on one of its group's NICs after its own link went down. */
typedef struct spilled {
    struct group *group;
    uint64_t seq;
} spilled;

struct flc_failover;

typedef struct thread_ctx {
    fl_engine *e;
    const fl_run_config *cfg; /* a write run's (course.c); NULL on a service worker */
    engine_state *st;
    const struct flc_failover *failover; /* what this thread's user does when a write fails */
    int id, ngroups;
    group *groups;
    /* what the core takes from the user's configuration */
    int fi_more;          /* FI_MORE on all but the last write of each run posted to one NIC */
    int shard;            /* timed runs: count in my_posted/my_finished, not the shared atomics */
    uint64_t op_flags;    /* on every write: FI_COMPLETION, and FI_DELIVERY_COMPLETE where the user asks */
    double link_timeout_s; /* no completion on a NIC with work for this long: its link stalled (0: never) */
    uint64_t warmup_from; /* timed runs: writes numbered from here on are warm-up writes, not counted */
    volatile uint64_t *my_posted, *my_finished;
    const struct fi_sim_host_ops *host; /* the provider's modeled host, told of the counters' lines (or NULL) */
    uint64_t last_progress_ns, timeout_ns;
    uint64_t now_ns; /* the clock, read once per pass or wait-loop turn (flc_tick): completion and posting
                      * times are for link timeouts of a second or more, and reading the clock at every
                      * completion cost the hot loop more than that grain is worth */
    int timed;
    uint64_t remaining; /* timed writes of this thread's groups not yet completed */
    uint64_t timed_bytes;
    uint32_t pages;
    spilled *spill;     /* grows only when a link goes down, never on the hot path */
    size_t spill_len, spill_cap;
    uint32_t revive_seen; /* service: the e->service.revive_epoch this worker's dead paths belong to */
    uint32_t reroute_rr;
    int incoming;         /* service: a peer's write landed on this worker's NICs since it last looked */
} __attribute__((aligned(64))) thread_ctx; /* written at every pass: a line of its own (flc_calloc_lines) */

/* ------------------------------------------------------------------------------ return codes */

/* What posting one write came to (post_write, and a user's post_failed/imm_refused). */
enum flc_post {
    FLC_POST_FAILED = -1,    /* the engine failed (e->error says why) */
    FLC_POSTED = 0,
    FLC_POST_AGAIN = 1,      /* the provider said -FI_EAGAIN, or no context is free: try again later */
    FLC_POST_REFUSED = 2,    /* refused for good: its transfer failed, or it was moved to another NIC or held
                              * for a second try */
    FLC_POST_LINK_DOWN = 3,  /* the NIC's link was declared down (its writes moved to other NICs) */
};

/* What a completion error came to (a user's write_failed). */
enum flc_reap {
    FLC_REAP_FAILED = -1,    /* the engine must stop */
    FLC_REAP_GO_ON = 0,      /* handled (a service transfer failed, or the write went elsewhere) */
    FLC_REAP_LINK_DOWN = 1,  /* the NIC's link was declared down: stop reading it */
};

/* Whether a NIC still reaches a peer (flc_path_dead), and why not. */
enum flc_path {
    FLC_PATH_ALIVE = 0,
    FLC_PATH_FAILED = 1,     /* marked dead after an error (or the whole NIC is down) */
    FLC_PATH_STALLED = 2,    /* marked dead after a stall: no completion came, no error either */
};

/* What the core does when a write fails or a NIC goes quiet: each user of the core hands it its own table
 * (thread_ctx.failover), so that the core never calls up into its users. */
typedef struct flc_failover {
    /* fi_writemsg refused `op` (not a flush write) with `err` (negative, never -FI_EAGAIN) */
    enum flc_post (*post_failed)(thread_ctx *t, int nic_index, const fl_op *op, int err);
    /* `op`'s immediate data does not fit the provider's cq_data_size */
    enum flc_post (*imm_refused)(thread_ctx *t, int nic_index, const fl_op *op);
    /* a completion error on NIC `nic_index`: `slot` is the write's (in flight or abandoned), or NULL when the
     * completion is a peer's, or no write of ours in flight */
    enum flc_reap (*write_failed)(thread_ctx *t, int nic_index, op_slot *slot, const struct fi_cq_err_entry *err);
    /* while a flush waits for the provider: the NIC went quiet for link_timeout_s (0 go on, -1 failed) */
    int (*link_quiet)(thread_ctx *t, int nic_index);
    /* while a flush waits and nothing came back: -1 once the thread's deadline passed (NULL: the user keeps
     * its deadlines elsewhere) */
    int (*check_deadline)(thread_ctx *t, int nic_index);
    /* a queued write about to be posted on a NIC that has dead paths: 1 when its path is dead and it went
     * elsewhere (asked only while a NIC has dead paths: a user that marks none leaves it NULL) */
    int (*moved_if_dead)(thread_ctx *t, int nic_index, const fl_op *op);
} flc_failover;

/* ------------------------------------------------------------------------------ inline helpers */

/* calloc for the line-aligned types above (thread_ctx, group, nic_state): NULL when out of memory. */
static inline void *flc_calloc_lines(size_t n, size_t size) {
    size_t bytes = (n * size + 63) / 64 * 64;
    if (!bytes) bytes = 64;
    void *p = aligned_alloc(64, bytes);
    if (p) memset(p, 0, bytes);
    return p;
}

static inline int stopping(const fl_engine *e) { return __atomic_load_n(&e->stop, __ATOMIC_RELAXED); }

static inline uint64_t page_length(const fl_run_config *cfg, uint32_t page) {
    uint64_t off = (uint64_t)page * cfg->page_size;
    uint64_t rest = cfg->buffer_bytes - off;
    return rest < cfg->page_size ? rest : cfg->page_size;
}

static inline int ring_full(const fl_nic *n) { return n->ring_tail - n->ring_head >= n->ring_capacity; }

static inline fl_op *ring_slot(fl_nic *n) { return &n->ring[n->ring_tail % n->ring_capacity]; }

/* thread_ctx.op_flags: every write asks for a completion, and with `delivery_complete` for one that means its
 * bytes are in the peer's memory. */
static inline uint64_t flc_op_flags(int delivery_complete) {
    return FI_COMPLETION | (delivery_complete ? FI_DELIVERY_COMPLETE : 0);
}

/* A slot's context is free again. */
static inline void flc_free_slot(nic_state *ns, op_slot *slot) {
    slot->next_free = ns->free_head;
    ns->free_head = (uint32_t)(slot - ns->slots);
}

/* Read the clock for this pass of the thread's loop (see thread_ctx.now_ns); returns it. */
static inline uint64_t flc_tick(thread_ctx *t) {
    return t->now_ns = fl_now_ns();
}

/* A NIC with writes in flight and no completion for link_timeout_s: its link (a write run) or the paths of
 * its writes (the service) are down. */
static inline int link_stalled(const thread_ctx *t, int nic_index, uint64_t now) {
    const fl_nic *n = &t->e->nics[nic_index];
    uint64_t last = t->st->nics[nic_index].last_ok_ns;
    return t->link_timeout_s > 0 && !n->down && n->in_flight > 0 && now > last &&
           now - last > (uint64_t)(t->link_timeout_s * 1e9);
}

/* ------------------------------------------------------------------------------ defined in core.c */

FL_INTERNAL void flc_fail(fl_engine *e, int code, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
/* `writes` of a service transfer finished (core.c): the reaper is told at its last, unless a caller looks. */
FL_INTERNAL void flc_transfer_finished_writes(fl_engine *e, uint32_t transfer, int64_t writes);
FL_INTERNAL int flc_prepare_slots(fl_engine *e);
/* reaping, posting, and moving pending writes to the provider */
FL_INTERNAL int poll_nic(thread_ctx *t, int nic_index);
FL_INTERNAL enum flc_post post_write(thread_ctx *t, int nic_index, const fl_op *op, uint64_t extra_flags);
FL_INTERNAL int progress_pending(thread_ctx *t, int nic_index);
/* service transfers: accounting, and waking fl_service_wait */
FL_INTERNAL void flc_notify(fl_engine *e, uint32_t finished);
FL_INTERNAL void flc_abandon(fl_engine *e, fl_nic *n, op_slot *slot);
FL_INTERNAL void flc_abandoned_done(fl_engine *e, fl_nic *n, op_slot *slot);
FL_INTERNAL void flc_transfer_done(fl_engine *e, uint32_t transfer, int error);

/* ------------------------------------------------------------------------------ defined in imm.c, for core.c */

/* A write that landed carrying `imm`: 1 when it was counted (or its loss recorded), 0 when not ours to count. */
FL_INTERNAL int flc_count_imm(fl_engine *e, uint64_t imm);
FL_INTERNAL void flc_imm_detach(fl_engine *e);

/* ------------------------------------------ defined in resting.c: idle service workers nap (see there) */

typedef struct rest_state {
    uint32_t idle, waiting; /* passes in a row with nothing to do, or only completions to wait for */
    uint64_t quiet_since;   /* when the worker last had anything of its own to do */
} rest_state;
FL_INTERNAL void flc_rest_begin(rest_state *r); /* on the worker's thread, before its loop */
/* A service transfer's counters (core.h, fl_service_data) */
#define FLC_LEFT(e, id) (&(e)->service.transfers[FL_TRANSFER_FIELDS * (uint64_t)(id)])
#define FLC_FIRST_ERROR(e, id) (&(e)->service.transfers[FL_TRANSFER_FIELDS * (uint64_t)(id) + 1])
#define FLC_ABANDONED(e, id) (&(e)->service.transfers[FL_TRANSFER_FIELDS * (uint64_t)(id) + 2])
#define FLC_WAITERS(e, id) (&(e)->service.transfers[FL_TRANSFER_FIELDS * (uint64_t)(id) + 3])

static inline int flc_is_transfer(const fl_engine *e, uint32_t transfer) {
    return transfer != FL_NO_TRANSFER && e->service.transfers && transfer < e->service.transfer_capacity;
}

/* after each pass of the worker's loop: yield, spin on, or nap */
FL_INTERNAL void flc_rest_after_pass(thread_ctx *t, rest_state *r, int busy, uint32_t outstanding);
/* worker w was given something to do (writes in its inbox, a park request, the stop): wake it if it rests */
FL_INTERNAL void flc_wake_worker(engine_state *st, int w);
/* where a transfer of fewer writes than NICs starts: the first NIC, from `turn` on in the request's order,
 * whose worker is awake; `turn` when all rest (any NIC reaches the peer: the request routes each) */
FL_INTERNAL uint32_t flc_awake_turn(const fl_engine *e, const fl_request *r, uint32_t turn, uint32_t span);

/* ------------------------------------------ defined in path.c: the service's per-path failover, for service.c */

FL_INTERNAL extern const flc_failover flc_service_failover;
FL_INTERNAL enum flc_path flc_path_dead(const fl_engine *e, const nic_state *ns, int nic_index, fi_addr_t dest);
/* send a write through another NIC that still reaches its peer; fail its transfer when none does */
FL_INTERNAL void flc_reroute(thread_ctx *t, const fl_op *failed);
/* a write moved off a dead path, carrying why that path died */
FL_INTERNAL fl_op flc_moved_off(const fl_op *op, enum flc_path why);
FL_INTERNAL void flc_paths_down(thread_ctx *t, int nic_index);
FL_INTERNAL void flc_release_held(thread_ctx *t, int nic_index);
FL_INTERNAL void flc_revive(thread_ctx *t);

/* --------------------------------------------- defined in service.c, for engine.c */

/* after a stop that left threads behind: free the service once they are gone (0), else how many remain */
FL_INTERNAL int flc_service_release_stranded(fl_engine *e);

/* ------------------------------------------ defined in course_failover.c: a write run's writes, for course.c */

/* a write run's thread: its configuration, and how the core posts and fails over for it */
FL_INTERNAL void flc_run_posting(thread_ctx *t, const fl_run_config *cfg);
FL_INTERNAL void page_op(const thread_ctx *t, int nic_index, uint64_t seq, fl_op *op);
FL_INTERNAL int requeue(thread_ctx *t, group *g, uint64_t seq);
/* the whole run's and one link's deadlines: 0 go on, -1 the engine failed */
FL_INTERNAL int check_timeout(thread_ctx *t, int nic_index);
FL_INTERNAL int check_link(thread_ctx *t, int nic_index);
#endif
