/* The modeled p5 host: each calling thread's modeled clock, what a p5's CPU pays for each provider call (the
 * cost table, every entry with its source), where a thread runs (pinned, or placed and moved by the modeled
 * scheduler) and the cache lines several threads write. docs/model.md ("Modeled time") describes it whole.
 *
 * A thread's clock starts at the wall clock at its first provider call. From then on it advances by the
 * thread's own CPU time between calls (what other threads and processes do on its core does not count), by
 * the modeled cost of each call, never by what the call costs on this box, and, while the thread only polls
 * queues that hold nothing due yet, straight to the first thing due (a p5's thread would spin until then). */
#include "sim.h"

#include <stdio.h>
#include <string.h>

/* The cost table. A value comes from a single-NIC figure, a published figure for the p5's CPUs, or a
 * measurement; never from chapters 9-15, which are what the model predicts. tests/test_sim_model.py checks
 * that every entry has a source and that docs/model.md lists it with the same value. */
const struct sim_cost sim_costs[SIM_COSTS] = {
    /* One write's host cost on EFA: fi_rma_bw on one p5 NIC (../shared/reference/figures.md) moves 0.75-0.81 M
     * writes/s up to 4 KiB, one thread: 1/0.8 M = 1250 ns a write. Up to EFA's inject size (4 KiB) fabtests
     * posts them with fi_inject_write (fabtests/benchmarks/benchmark_shared.c, bandwidth_rma), so the
     * figure holds the post, its doorbell and the provider's own progress that reaps the write's completion
     * on the device, not the application's read of a completion entry, which the model charges at the same
     * price as that progress. No published figure splits it: the model gives the doorbell UCX's figure and
     * the rest half to the post, half to the read, and half of the read's to the pass over the queue (what
     * an empty read costs too) and half to handling the entry. */
    [SIM_COST_POST] = {"post", 605, "ns", "fi_rma_bw on one p5 EFA NIC, 0.80 M writes/s up to 4 KiB: (1250 - 40) / 2"},
    [SIM_COST_DOORBELL] = {"doorbell", 40, "ns",
                           "UCX's cost model for a doorbell (db:40ns, src/uct/ib/base/ib_iface.h)"},
    [SIM_COST_POLL] = {"poll", 302, "ns", "fi_rma_bw on one p5 EFA NIC: half of the read's (1250 - 40) / 2"},
    [SIM_COST_POLL_EMPTY] = {"empty poll", 302, "ns",
                             "as a poll: the same pass over the queue that finds nothing (no figure separates them)"},
    [SIM_COST_ENTRY] = {"completion", 303, "ns", "fi_rma_bw on one p5 EFA NIC: the other half of the read's"},
    [SIM_COST_FUTILE] = {"futile post", 302, "ns",
                         "as an empty poll: the endpoint's lock and queue check that end in -FI_EAGAIN (no figure)"},
    /* The p5's CPUs: 2 x AMD EPYC 7R13 (Milan, 48 cores each in 6 core complexes of 8 that share an L3;
     * an AWS p5 reports "AMD EPYC 7R13 Processor" in /proc/cpuinfo: github.com/mlmon/surveyor's example
     * capture). The line figures are medians of the core-to-core CAS latency matrix measured on an AWS
     * c6a.metal, 2 x EPYC 7R13 (github.com/nviennot/core-to-core-latency, results/AMD EPYC 7R13
     * 48-Core Processor.csv; its README gives 23 ns, 107 ns and 197 ns). */
    [SIM_COST_FAR] = {"far socket", 90, "ns",
                      "EPYC 7R13 on c6a.metal: a line from the other socket 197 ns - from another core complex of "
                      "the socket 107 ns, the hop between the sockets (github.com/nviennot/core-to-core-latency)"},
    [SIM_COST_LINE_CCX] = {"line from a core of the core complex", 23, "ns",
                           "EPYC 7R13 on c6a.metal: core-to-core latency within a core complex of 8, median "
                           "(github.com/nviennot/core-to-core-latency)"},
    [SIM_COST_LINE_SOCKET] = {"line from another core complex of the socket", 107, "ns",
                              "EPYC 7R13 on c6a.metal: core-to-core latency across core complexes of the first "
                              "socket, median (github.com/nviennot/core-to-core-latency)"},
    [SIM_COST_LINE_CROSS] = {"line from the other socket", 197, "ns",
                             "EPYC 7R13 on c6a.metal: core-to-core latency across the sockets, median "
                             "(github.com/nviennot/core-to-core-latency)"},
    [SIM_COST_REFILL] = {"cache refill after a move", 10000, "ns",
                         "a context switch's cost with its cache refill, about 10 us (T. Downs, A Concurrency Cost "
                         "Hierarchy, 2020)"},
    [SIM_COST_BALANCE] = {"scheduler move interval", 96000000, "ns",
                          "Linux's load balancing across a socket's CPUs: at most every span-in-ms (96 CPUs: 96 ms) "
                          "(kernel/sched/topology.c, sd_init)"},
};

#define SIM_HOST_CORES 96      /* the recorded p5: 2 sockets of 48 cores (fabriclab.recorded, chapter 8) */
#define SIM_HOST_CCX_CORES 8   /* an EPYC 7R13's core complex: cores 0-7, 8-15, ... share an L3 */
#define SIM_HOST_GROUPS 8      /* GPU groups, 4 per socket, each with its NICs and 12 cores */
#define SIM_GAP_CHECK_NS 20000 /* a gap between calls longer than this is checked against the CPU clock */
#define SIM_LINES 256          /* shared lines the model follows */
#define SIM_SHARERS 16         /* threads it follows per line */
#define SIM_SHARER_ACTIVE_NS 100000000ull /* a thread that touched a line within this (wall) still shares it */

__thread struct sim_thread sim_self;

static _Atomic uint32_t thread_serials;

static uint64_t cpu_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

/* What reading the wall clock costs this box, measured once: each gap between calls holds about one read
 * (the one that ends a call, or the one that starts the next) that is the model's, not the caller's. */
static uint64_t clock_cost_ns(void) {
    static _Atomic uint64_t measured = UINT64_MAX;
    uint64_t least = atomic_load_explicit(&measured, memory_order_relaxed);
    if (least != UINT64_MAX) return least;
    for (int i = 0; i < 64; i++) {
        uint64_t a = sim_wall_ns(), b = sim_wall_ns();
        if (b - a < least) least = b - a;
    }
    atomic_store_explicit(&measured, least, memory_order_relaxed);
    return least;
}

static uint64_t cost(enum sim_cost_id id) { return (uint64_t)sim_costs[id].value; }

/* splitmix64: the scheduler's placements, the same on every box for the same thread */
static uint64_t next_random(uint64_t *state) {
    uint64_t z = (*state += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

static int socket_of_core(int core) { return core * 2 / SIM_HOST_CORES; }
static int ccx_of_core(int core) { return core / SIM_HOST_CCX_CORES; }

/* A NIC's socket: the recorded p5's GPU groups 0-3 (and their NICs) hang off socket 0, 4-7 off socket 1. */
static int socket_of_nic(int nic) {
    int nics = sim_model.nics > 0 ? sim_model.nics : 1;
    int group = nics >= SIM_HOST_GROUPS ? nic * SIM_HOST_GROUPS / nics : nic;
    return group * 2 / SIM_HOST_GROUPS;
}

/* The modeled scheduler moves an unpinned thread to a core drawn at random among the host's, every
 * SIM_COST_BALANCE of its time; the move costs a refill of what it had cached. */
static void schedule(struct sim_thread *me) {
    while (!me->pinned && me->now >= me->next_move) {
        int core = (int)(next_random(&me->random) % SIM_HOST_CORES);
        if (me->next_move && core != me->core) {
            me->counts.migrations++;
            me->now += cost(SIM_COST_REFILL);
            me->counts.host_ns += cost(SIM_COST_REFILL);
        }
        me->core = core;
        me->next_move = me->now + cost(SIM_COST_BALANCE);
    }
}

void sim_enter(void) {
    struct sim_thread *me = &sim_self;
    if (sim_model.wall) return;
    uint64_t wall = sim_wall_ns();
    if (!me->serial) {
        me->serial = atomic_fetch_add(&thread_serials, 1) + 1;
        me->random = me->serial;
        me->core = -1;
        me->now = me->wall_out = me->wall_sample = wall;
        me->cpu_sample = cpu_ns();
        me->streak = (uint64_t)me->serial << 32;
        me->streak_due = UINT64_MAX;
        schedule(me);
        return;
    }
    uint64_t overhead = clock_cost_ns() + me->excluded;
    uint64_t gap = wall > me->wall_out + overhead ? wall - me->wall_out - overhead : 0;
    me->excluded = 0;
    if (gap > SIM_GAP_CHECK_NS) { /* the thread may have waited for its core, or slept: that is no CPU time */
        uint64_t cpu = cpu_ns(), ran = cpu - me->cpu_sample, passed = wall - me->wall_sample;
        uint64_t lost = passed > ran ? passed - ran : 0;
        gap = gap > lost ? gap - lost : 0;
        me->cpu_sample = cpu;
        me->wall_sample = wall;
    }
    me->now += gap;
    me->counts.app_ns += gap;
    schedule(me);
}

void sim_leave(void) {
    if (!sim_model.wall) sim_self.wall_out = sim_wall_ns();
}

static void charge(uint64_t *bucket, uint64_t ns) {
    sim_self.now += ns;
    *bucket += ns;
}

/* The far socket: the NIC hangs off the other socket than the thread's core. */
static int far_from(int nic) { return sim_self.core >= 0 && socket_of_core(sim_self.core) != socket_of_nic(nic); }

void sim_charge_post(int nic, ssize_t rc, int rang) {
    struct sim_thread *me = &sim_self;
    if (sim_model.wall) return;
    if (rc == -FI_EAGAIN) {
        me->counts.futile_posts++;
        charge(&me->counts.provider_ns, cost(SIM_COST_FUTILE));
        return;
    }
    me->counts.posts++;
    charge(&me->counts.provider_ns, cost(SIM_COST_POST));
    if (rc == 0) sim_busy();
    if (!rang) return;
    me->counts.doorbells++;
    charge(&me->counts.provider_ns, cost(SIM_COST_DOORBELL));
    if (far_from(nic)) {
        me->counts.far_accesses++;
        charge(&me->counts.host_ns, cost(SIM_COST_FAR));
    }
}

void sim_busy(void) {
    struct sim_thread *me = &sim_self;
    me->streak++;
    me->streak_due = UINT64_MAX;
    me->streak_polls = 0;
    me->streak_start = me->now;
}

void sim_charge_poll(struct sim_cq *cq, size_t entries, uint64_t next_due) {
    struct sim_thread *me = &sim_self;
    if (sim_model.wall) return;
    me->counts.cq_reads++;
    if (entries) {
        me->counts.entries += entries;
        charge(&me->counts.provider_ns, cost(SIM_COST_POLL) + entries * cost(SIM_COST_ENTRY));
        if (far_from(cq->domain->index)) {
            me->counts.far_accesses += entries;
            charge(&me->counts.host_ns, entries * cost(SIM_COST_FAR));
        }
        sim_busy();
        return;
    }
    me->counts.empty_reads++;
    charge(&me->counts.provider_ns, cost(SIM_COST_POLL_EMPTY));
    /* Back at a queue this streak of empty polls has looked at: the thread has gone round everything it
     * polls and found nothing. On a p5 it would go round again until the first of them is due; the model
     * moves its clock there, counts the polls that took, and a new streak starts with this poll. */
    if (cq->streak == me->streak) {
        if (me->streak_due != UINT64_MAX && me->streak_due > me->now) {
            uint64_t skip = me->streak_due - me->now, round = me->now - me->streak_start;
            uint64_t polls = round ? skip * me->streak_polls / round : 0;
            me->counts.cq_reads += polls;
            me->counts.empty_reads += polls;
            charge(&me->counts.idle_ns, skip);
        }
        sim_busy();
    }
    cq->streak = me->streak;
    me->streak_polls++;
    if (next_due < me->streak_due) me->streak_due = next_due;
}

/* ------------------------------------------------------------------------------ shared cache lines */

struct sim_sharer { /* a line each: the model's own bookkeeping must not make lines move on this box */
    _Atomic uint32_t serial;
    _Atomic int core;
    _Atomic uint64_t wall_ns;
    char pad[SIM_CACHELINE - 16];
};

struct sim_line {
    _Atomic uintptr_t key; /* the line's address >> 6, 0: free */
    struct sim_sharer sharers[SIM_SHARERS];
};

static struct sim_line lines[SIM_LINES];

/* A line no thread has touched for SIM_SHARER_ACTIVE_NS belongs to a run that is over: the model may follow
 * another line in its place (a process that runs one write run after another never runs out of them). */
static int line_done_with(struct sim_line *l, uint64_t wall) {
    for (int i = 0; i < SIM_SHARERS; i++) {
        uint64_t seen = atomic_load_explicit(&l->sharers[i].wall_ns, memory_order_relaxed);
        if (seen && wall - seen <= SIM_SHARER_ACTIVE_NS) return 0;
    }
    return 1;
}

static struct sim_line *line_of(uintptr_t key, uint64_t wall) {
    struct sim_line *done_with = NULL;
    uintptr_t done_key = 0;
    for (unsigned i = 0, at = (unsigned)(key * 0x9e3779b1u) % SIM_LINES; i < SIM_LINES; i++) {
        struct sim_line *l = &lines[(at + i) % SIM_LINES];
        uintptr_t seen = atomic_load_explicit(&l->key, memory_order_acquire);
        if (seen == key) return l;
        if (!seen && atomic_compare_exchange_strong(&l->key, &seen, key)) return l;
        if (seen == key) return l;
        if (!done_with && seen && line_done_with(l, wall)) {
            done_with = l;
            done_key = seen;
        }
    }
    if (!done_with || !atomic_compare_exchange_strong(&done_with->key, &done_key, key))
        return NULL; /* more lines in use at once than the model follows: charged nothing */
    for (int i = 0; i < SIM_SHARERS; i++) { /* the old line's sharers are not this one's */
        atomic_store_explicit(&done_with->sharers[i].serial, 0, memory_order_relaxed);
        atomic_store_explicit(&done_with->sharers[i].wall_ns, 0, memory_order_relaxed);
    }
    return done_with;
}

/* The thread read or wrote a line other threads write: where one of them wrote it last it comes from that
 * core. Threads that share a line each write it about as often (every thread runs the same loop), so
 * between two accesses of one thread another has written it: each access fetches the line, from a core
 * of the same core complex, of another complex of the socket or of the other socket, in the proportion
 * of the sharers there. Judged by who shares the line, never by how the threads happened to interleave on
 * this box. */
static void charge_line(struct sim_thread *me, const volatile void *address, uint64_t wall) {
    struct sim_line *l = line_of((uintptr_t)address >> 6, wall);
    if (!l) return;
    uint64_t moves = 0, sum = 0;
    struct sim_sharer *mine = &l->sharers[me->serial % SIM_SHARERS];
    atomic_store_explicit(&mine->serial, me->serial, memory_order_relaxed);
    atomic_store_explicit(&mine->core, me->core, memory_order_relaxed);
    atomic_store_explicit(&mine->wall_ns, wall, memory_order_relaxed);
    for (int i = 0; i < SIM_SHARERS; i++) {
        struct sim_sharer *s = &l->sharers[i];
        uint32_t serial = atomic_load_explicit(&s->serial, memory_order_relaxed);
        uint64_t seen = atomic_load_explicit(&s->wall_ns, memory_order_relaxed);
        if (!serial || serial == me->serial || wall - seen > SIM_SHARER_ACTIVE_NS) continue;
        int core = atomic_load_explicit(&s->core, memory_order_relaxed);
        moves++;
        sum += core == me->core                                   ? 0
               : ccx_of_core(core) == ccx_of_core(me->core)       ? cost(SIM_COST_LINE_CCX)
               : socket_of_core(core) == socket_of_core(me->core) ? cost(SIM_COST_LINE_SOCKET)
                                                                  : cost(SIM_COST_LINE_CROSS);
    }
    if (!moves) return;
    me->counts.line_moves++;
    charge(&me->counts.host_ns, sum / moves);
}

/* The engine brackets each access to such a line with these (fi_sim_ext.h): the access is charged as a move,
 * and what it took on this box is kept out of the thread's time. */
static void access_begin(void) {
    if (sim_model.wall) return;
    if (!sim_self.serial) sim_enter(); /* a thread the model meets here first: its clock starts now */
    sim_self.access_wall = sim_wall_ns();
}

static void access_end(const volatile void *address) {
    struct sim_thread *me = &sim_self;
    if (sim_model.wall || !me->serial) return;
    charge_line(me, address, sim_wall_ns());
    /* the access and the model's look at the line, on this box: none of it is the thread's time */
    me->excluded += sim_wall_ns() - me->access_wall + clock_cost_ns();
}

/* ------------------------------------------------------------------------------------- the extension */

/* The clock as of this moment: the thread's own time since its last provider call counts (as the next call
 * would count it), so that a reading between calls is not the last call's. */
static uint64_t host_now(void) {
    sim_enter();
    sim_leave();
    return sim_self.now;
}

static void place(int core) {
    struct sim_thread *me = &sim_self;
    if (!me->serial) sim_enter();
    if (core < 0 || core >= SIM_HOST_CORES) { /* scheduled: -1 - n places the n-th thread of a run, as every run */
        me->pinned = 0;
        me->random = core < 0 ? (uint64_t)(-(int64_t)core) : me->serial;
        me->next_move = 0;
        schedule(me);
        return;
    }
    me->pinned = 1;
    me->core = core;
}

static void counts(struct fi_sim_counts *out) { *out = sim_self.counts; }

static void reset(void) { memset(&sim_self.counts, 0, sizeof sim_self.counts); }

static struct fi_sim_host_ops host_ops = {.size = sizeof host_ops, .now_ns = host_now, .place = place,
                                          .access_begin = access_begin, .access_end = access_end,
                                          .counts = counts, .reset = reset};

int sim_host_ops_open(struct fid *fid, const char *name, uint64_t flags, void **ops, void *context) {
    (void)fid, (void)flags, (void)context;
    if (!name || strcmp(name, FI_SIM_HOST_OPS) || sim_model.wall) return -FI_ENOSYS;
    *ops = &host_ops;
    return 0;
}
