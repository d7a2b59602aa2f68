/* Resting: what an idle service worker (service.c) does between passes, and how callers wake it.
 *
 * A worker with nothing of its own to do (empty inbox; no write queued, held or in flight) polls on for
 * SPIN_NS, and while its engine took a peer's write in the last SPIN_AFTER_ARRIVAL_NS on any NIC; then it
 * rests: it sleeps on its inbox's `resting` word and polls its NICs once per nap. Without rest, several
 * engines on one host (many writer processes into one target) keep every idle worker of every engine on a
 * core, and a target whose provider needs its polls to move a write (shm) starves among them.
 *
 * A caller that hands a resting worker writes wakes it at once (wake_worker: one look at a word while the
 * worker is awake), and a small transfer starts at a NIC whose worker is awake (awake_turn), so that a
 * caller writing a page at a time keeps one worker busy rather than waking each in turn: a wake costs tens
 * of microseconds on a busy or virtual host, and each woken worker spins SPIN_NS before it rests again.
 *
 * Nothing wakes a worker for a peer's incoming write — a software provider moves it only when the target
 * polls — so the engine's arrivals keep all its workers polling (writers spread their pages over every
 * NIC: a trickle on each is a stream on all), and naps start at REST_MIN_NS and grow to a quarter of the
 * rest so far, at most REST_MAX_NS: a write after a quiet gap G is noticed at most (G -
 * SPIN_AFTER_ARRIVAL_NS) / 4 and REST_MAX_NS late (a closed-loop writer's gaps cannot run away), and a
 * worker quiet for long costs one poll per REST_MAX_NS. */
#define _GNU_SOURCE
#include "core_internal.h"
#include "service.h"

#include <linux/futex.h>
#include <sched.h>
#include <sys/prctl.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#define SPIN_NS 200000ull
#define SPIN_AFTER_ARRIVAL_NS 2000000ull
#define REST_MIN_NS 20000ull
#define REST_MAX_NS 1000000ull
#define REST_TIMER_SLACK_NS 5000 /* naps of REST_MIN_NS would last 70 us with the default 50 us of slack */
#define ARRIVAL_STAMP_NS 100000ull /* how stale the engine's last-arrival time may get while writes land */

void flc_rest_begin(rest_state *r) {
    prctl(PR_SET_TIMERSLACK, REST_TIMER_SLACK_NS, 0, 0, 0); /* this thread's timers only */
    *r = (rest_state){.quiet_since = fl_now_ns()};
}

void flc_wake_worker(engine_state *st, int w) {
    inbox *box = &st->inboxes[w];
    /* pairs with rest_worker's fence: either the worker sees the new work before it sleeps, or this sees
     * `resting` set */
    atomic_thread_fence(memory_order_seq_cst);
    if (atomic_load_explicit(&box->resting, memory_order_relaxed) && atomic_exchange(&box->resting, 0))
        syscall(SYS_futex, &box->resting, FUTEX_WAKE_PRIVATE, 1, NULL, NULL, 0);
}

/* One nap of `ns`, unless something to do came in meanwhile. */
static void flc_rest_worker(thread_ctx *t, uint64_t ns) {
    engine_state *st = t->st;
    inbox *box = &st->inboxes[t->id];
    atomic_store(&box->resting, 1);
    atomic_thread_fence(memory_order_seq_cst);
    int work = atomic_load_explicit(&box->tail, memory_order_relaxed) !=
                   atomic_load_explicit(&box->head, memory_order_relaxed) ||
               atomic_load_explicit(&st->park_request[t->id], memory_order_relaxed) || stopping(t->e) ||
               __atomic_load_n(&t->e->service.revive_epoch, __ATOMIC_RELAXED) != t->revive_seen;
    if (!work) {
        struct timespec nap = {(time_t)(ns / 1000000000ull), (long)(ns % 1000000000ull)};
        syscall(SYS_futex, &box->resting, FUTEX_WAIT_PRIVATE, 1, &nap, NULL, 0);
    }
    atomic_store_explicit(&box->resting, 0, memory_order_relaxed);
}

/* A peer's write landed on this worker's NICs: the engine's workers keep polling. The shared time is
 * written at most once per ARRIVAL_STAMP_NS. */
static void flc_stamp_arrival(thread_ctx *t) {
    uint64_t now = fl_now_ns();
    t->incoming = 0;
    if (now - atomic_load_explicit(&t->st->last_arrival_ns, memory_order_relaxed) > ARRIVAL_STAMP_NS)
        atomic_store_explicit(&t->st->last_arrival_ns, now, memory_order_relaxed);
}

void flc_rest_after_pass(thread_ctx *t, rest_state *r, int busy, uint32_t outstanding) {
    if (t->incoming) flc_stamp_arrival(t);
    if (busy) {
        r->idle = r->waiting = 0;
        return;
    }
    if (outstanding) { /* waiting for completions: a peer on this host may need this core to make them (shm) */
        r->idle = 0;
        if ((++r->waiting & 63) == 0) sched_yield();
        return;
    }
    if ((++r->idle & 63) != 0) return;
    /* Nothing to do for now: let a thread that waits for this core (the caller's, a staging thread, a peer's
     * worker) run at once rather than at the scheduler's next tick; rest once calm. */
    uint64_t now = fl_now_ns();
    if (r->idle == 64) r->quiet_since = now; /* give or take 64 passes */
    uint64_t calm = r->quiet_since + SPIN_NS;
    uint64_t after_arrival = atomic_load_explicit(&t->st->last_arrival_ns, memory_order_relaxed) + SPIN_AFTER_ARRIVAL_NS;
    if (after_arrival > calm) calm = after_arrival;
    if (now < calm) {
        sched_yield();
        return;
    }
    uint64_t nap = (now - calm) / 4;
    flc_rest_worker(t, nap < REST_MIN_NS ? REST_MIN_NS : nap > REST_MAX_NS ? REST_MAX_NS : nap);
    r->idle = 127; /* after the nap, one pass and then the next nap (or back to work) */
}

uint32_t flc_awake_turn(const fl_engine *e, const fl_request *r, uint32_t turn, uint32_t span) {
    engine_state *st = e->state;
    for (uint32_t k = 0; k < span; k++) {
        uint32_t at = (turn + k) % span, nic = r->nic_order ? r->nic_order[at] : at;
        if (!atomic_load_explicit(&st->inboxes[e->nics[nic].group].resting, memory_order_relaxed)) return at;
    }
    return turn;
}
