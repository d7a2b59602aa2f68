/* What native/core.c, course.c and service.c share and nobody else sees: the engine's private state
 * (fl_engine.state), the per-thread context, and the functions one file calls in another. Never given to
 * cffi (native/fabric_cdef.h declares only the public headers' names), and hidden from the built module's
 * exported symbols (FL_INTERNAL), so calls between the files stay direct calls. */
#ifndef FABRICLAB_CORE_INTERNAL_H
#define FABRICLAB_CORE_INTERNAL_H
#include "core.h"

#include <pthread.h>
#include <stdatomic.h>
#include <rdma/fi_endpoint.h>
#include <rdma/fi_eq.h>
#include <rdma/fi_errno.h>
#include <rdma/fi_rma.h>

#define FL_INTERNAL __attribute__((visibility("hidden")))

#define CQ_BATCH 16

typedef struct op_slot {
    struct fi_context2 ctx; /* first: the completion's op_context points here */
    fl_op op;               /* what was posted: sent again elsewhere if its link goes down */
    uint32_t next_free;
    int in_flight;
    int abandoned;          /* sent again elsewhere: a late completion only frees the slot */
    uint32_t ep_gen;        /* the NIC's endpoint it was posted on (fl_nic.renewals at the time) */
} op_slot;

#define MAX_DEAD_PATHS 32
#define DONE_CAPACITY(e) (2 * (uint64_t)(e)->transfer_capacity)

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
     * MAX_DEAD_PATHS the whole NIC is taken as down */
    fi_addr_t dead_dests[MAX_DEAD_PATHS];
    uint8_t dead_stalled[MAX_DEAD_PATHS]; /* marked for a stall (no completion), not for an error */
    int dead_paths;
    /* the paths that were dead at the last revival and have not failed since (revived_all: the whole NIC
     * was down): a path error there may be the provider still tearing down the old connection, so the
     * write is posted once more, after RETRY_HOLD, before the path is declared dead again */
    fi_addr_t revived_dests[MAX_DEAD_PATHS];
    int revived_paths, revived_all;
    fl_op *held;            /* writes waiting for that second try, posted from held_until_ns on */
    uint32_t held_len, held_cap;
    uint64_t held_until_ns;
    uint32_t free_head;
    int last_had_more;
    fl_op last_more;     /* the last write posted with FI_MORE: where a flush write goes if the next is refused */
    struct group *group; /* the group that drives this NIC during a write run */
} nic_state;

/* Per-thread counters for chapters 13 (sharded: packed, four threads' pairs to a cache line) and beyond
 * (padded: a line each). */
typedef struct { volatile uint64_t posted, finished; } packed_shard;
typedef struct { volatile uint64_t posted, finished; char pad[48]; } __attribute__((aligned(64))) padded_shard;

typedef struct engine_state {
    nic_state *nics;
    /* chapters 11-12: every thread updates these */
    _Atomic uint64_t shared_posted, shared_finished;
    packed_shard packed[FL_MAX_THREADS];
    padded_shard padded[FL_MAX_THREADS];
    _Atomic int finished_threads;
    pthread_barrier_t start_line;
    uint64_t start_ns[FL_MAX_THREADS], end_ns[FL_MAX_THREADS];
    uint64_t timed_bytes[FL_MAX_THREADS];
    /* service mode */
    int service_threads;
    pthread_t service_tids[FL_MAX_THREADS];
    struct thread_ctx *service_ctx;
    inbox inboxes[FL_MAX_THREADS];
    fl_config service_cfg;
    /* finished transfers, for fl_service_wait: each id is in here at most twice (when its writes are all
     * finished, and when the last of its abandoned writes is reported; it is reused only after Python
     * took it out), so DONE_CAPACITY entries always suffice */
    _Atomic int park_request[FL_MAX_THREADS], parked[FL_MAX_THREADS]; /* fl_worker_park */
    _Atomic uint64_t last_arrival_ns; /* when a peer's write last landed on any worker's NICs (resting.c) */
    /* Stopping (fl_service_stop). A worker clears its worker_running flag as the last thing it does; one
     * still set at the stop's deadline is stuck inside a provider call (shm spins for ever on a lock that
     * its killed peer held): it is detached, and everything it may touch stays allocated (stranded_threads:
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
    int woken;
} engine_state;

typedef struct group {
    int id, nnics;
    int nics[FL_MAX_NICS];
    uint32_t rr;
    uint64_t quota, issued, completed; /* timed writes: to do, enqueued, completed */
    uint64_t mark_from;                /* with fl_config.mark_last: the first of its writes that is marked */
} group;

/* A write waiting for room on one of its group's NICs after its own link went down. */
typedef struct spilled {
    struct group *group;
    uint64_t seq;
} spilled;

typedef struct thread_ctx {
    fl_engine *e;
    const fl_config *cfg;
    engine_state *st;
    int id, ngroups;
    group *groups;
    volatile uint64_t *my_posted, *my_finished;
    uint64_t last_progress_ns, timeout_ns;
    int timed;
    int service;        /* a service worker: errors fail the transfer, not the engine */
    uint64_t remaining; /* timed writes of this thread's groups not yet completed */
    uint64_t timed_bytes;
    uint32_t pages;
    spilled *spill;     /* grows only when a link goes down, never on the hot path */
    size_t spill_len, spill_cap;
    uint32_t revive_seen; /* service: the e->revive_epoch this worker's dead paths belong to */
    uint32_t reroute_rr;
    int incoming;         /* service: a peer's write landed on this worker's NICs since it last looked */
} thread_ctx;

/* Does write `seq` of a run carry its sequence number as immediate data? In the checking mode every write
 * does (warm-up writes too: the target skips their numbers). With mark_last only the group's last writes,
 * one per NIC by round robin: a write sent again after a link failure keeps its mark, as it keeps its
 * number, so the target's count of marks never depends on failures. */
static inline int marked_write(const thread_ctx *t, int nic_index, uint64_t seq) {
    if (!t->cfg->mark_last) return 1;
    return seq < t->cfg->total_writes && seq / (uint64_t)t->cfg->groups >= t->st->nics[nic_index].group->mark_from;
}

static inline int stopping(const fl_engine *e) { return __atomic_load_n(&e->stop, __ATOMIC_RELAXED); }

static inline uint64_t page_length(const fl_config *cfg, uint32_t page) {
    uint64_t off = (uint64_t)page * cfg->page_size;
    uint64_t rest = cfg->buffer_bytes - off;
    return rest < cfg->page_size ? rest : cfg->page_size;
}

static inline int ring_full(const fl_nic *n) { return n->ring_tail - n->ring_head >= n->ring_capacity; }

static inline fl_op *ring_slot(fl_nic *n) { return &n->ring[n->ring_tail % n->ring_capacity]; }

/* A write moved off a dead path carries why that path died, so that a transfer failing for want of any
 * path can tell a stall (the peer may well be alive) from errors. */
static inline fl_op moved_off(const fl_op *op, int why) {
    fl_op out = *op;
    if (why == 2) out.flags |= FL_OP_STALLED;
    return out;
}

/* Failover (write runs): a link with writes in flight and no completion for link_timeout_s is down. */
static inline int link_stalled(const thread_ctx *t, int nic_index, uint64_t now) {
    const fl_nic *n = &t->e->nics[nic_index];
    uint64_t last = t->st->nics[nic_index].last_ok_ns;
    return t->cfg->link_timeout_s > 0 && !n->down && n->in_flight > 0 && now > last &&
           now - last > (uint64_t)(t->cfg->link_timeout_s * 1e9);
}

/* ---------------------------------------------------------- defined in core.c, for course.c and service.c */

FL_INTERNAL void fail(fl_engine *e, int code, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
FL_INTERNAL int prepare_slots(fl_engine *e);
/* reaping, posting, and moving pending writes to the provider (see core.c) */
FL_INTERNAL int poll_nic(thread_ctx *t, int nic_index);
FL_INTERNAL int post_write(thread_ctx *t, int nic_index, const fl_op *op, uint64_t extra_flags);
FL_INTERNAL int progress_pending(thread_ctx *t, int nic_index);
/* write runs: the run's writes, and the whole run's and one link's deadlines */
FL_INTERNAL void page_op(const thread_ctx *t, int nic_index, uint64_t seq, fl_op *op);
FL_INTERNAL int requeue(thread_ctx *t, group *g, uint64_t seq);
FL_INTERNAL int check_timeout(thread_ctx *t, int nic_index);
FL_INTERNAL int check_link(thread_ctx *t, int nic_index);
/* service transfers: accounting, and waking fl_service_wait */
FL_INTERNAL void notify(fl_engine *e, uint32_t finished);
FL_INTERNAL void abandon(fl_engine *e, fl_nic *n, op_slot *slot);
FL_INTERNAL void transfer_done(fl_engine *e, uint32_t transfer, int error);

/* ------------------------------------ defined in service.c: per-path failover, for the core's post and reap */

FL_INTERNAL int path_error(int err);
FL_INTERNAL int path_dead(const fl_engine *e, const nic_state *ns, int nic_index, fi_addr_t dest);
FL_INTERNAL void mark_path_dead(fl_engine *e, nic_state *ns, int nic_index, fi_addr_t dest, int stalled);
FL_INTERNAL int retry_after_revival(thread_ctx *t, int nic_index, const fl_op *op);
FL_INTERNAL void service_reroute(thread_ctx *t, const fl_op *failed);
FL_INTERNAL void reroute_dead_paths(thread_ctx *t, int nic_index, int stalled);
FL_INTERNAL void service_paths_down(thread_ctx *t, int nic_index);
/* after a stop that left threads behind: free the service once they are gone (0), else how many remain */
FL_INTERNAL int fl_service_release_stranded(fl_engine *e);

/* ------------------------------------------ defined in resting.c: idle service workers nap (see there) */

typedef struct rest_state {
    uint32_t idle, waiting; /* passes in a row with nothing to do, or only completions to wait for */
    uint64_t quiet_since;   /* when the worker last had anything of its own to do */
} rest_state;
struct fl_request;
FL_INTERNAL void rest_begin(rest_state *r); /* on the worker's thread, before its loop */
/* after each pass of the worker's loop: yield, spin on, or nap */
FL_INTERNAL void rest_after_pass(thread_ctx *t, rest_state *r, int busy, uint32_t outstanding);
/* worker w was given something to do (writes in its inbox, a park request, the stop): wake it if it rests */
FL_INTERNAL void wake_worker(engine_state *st, int w);
/* where a transfer of fewer writes than NICs starts: the first NIC, from `turn` on in the request's order,
 * whose worker is awake; `turn` when all rest (any NIC reaches the peer: the request routes each) */
FL_INTERNAL uint32_t awake_turn(const fl_engine *e, const struct fl_request *r, uint32_t turn, uint32_t span);

/* ------------------------------------------ defined in imm.c: counting immediate data, for the core's reap */

/* A write that landed carrying `imm`: 1 when it was counted (or its loss recorded), 0 when not ours to count. */
FL_INTERNAL int count_imm(fl_engine *e, uint64_t imm);
FL_INTERNAL void imm_detach(fl_engine *e);
#endif
