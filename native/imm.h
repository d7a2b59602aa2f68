/* The count behind fabriclab.Engine.expect: how many pages carrying each immediate value have landed and
 * not been taken yet, and how many pages each landing lane of a staged target has received (imm.c).
 *
 * A value holds a slot of the table only while it is awaited (an expect(), or a staged target's copy that
 * will count for it) or holds arrivals nobody took: the table is sized by what is counted at once, never by
 * history. Arrivals nobody awaits never hold a slot for good: when a value needs a slot and every one is
 * held, the value that has held arrivals for nobody the longest gives its slot up (those arrivals are
 * dropped, and counted as dropped), and fl_imm_expire drops those that waited for nobody longer than an age.
 * Only when every slot is awaited can an arrival not be counted: the value is marked lost, and the next
 * fl_imm_await for it says so (FL_IMM_LOST) instead of waiting for a count that will never come. */
#ifndef FABRICLAB_IMM_H
#define FABRICLAB_IMM_H
#include <stdint.h>

struct fl_engine;

/* A value's count is at most FL_IMM_MAX_COUNT pages (more arriving untaken is a lost count). */
#define FL_IMM_COUNT_BITS 40
#define FL_IMM_MAX_COUNT ((1ull << FL_IMM_COUNT_BITS) - 1)
/* Landing lanes counted on their own (fabriclab.landing): lane numbers below this. */
#define FL_IMM_LANES 256

enum fl_imm_status {
    FL_IMM_OK = 0,
    FL_IMM_FULL = 1, /* every slot is held by a value awaited */
    FL_IMM_LOST = 2, /* arrivals of the value came while the table was full: they were not counted */
    FL_IMM_BAD = 3,  /* not a caller's value (FL_LANDING_VALUE or above), or no table */
};

typedef struct fl_imm_usage {
    uint64_t values;       /* values holding a slot now */
    uint64_t most;         /* how many values may hold one at once */
    uint64_t lost;         /* arrivals (writes, staged copies) not counted since attached: every slot awaited,
                            * or a count past FL_IMM_MAX_COUNT */
    uint64_t lost_values;  /* values marked lost and not yet reported by an fl_imm_await */
    uint64_t last_lost;    /* the last value an arrival of which was not counted */
    uint64_t dropped;      /* values whose arrivals nobody awaited were dropped (for a new value, or expired) */
    uint64_t last_dropped; /* the last such value */
} fl_imm_usage;

/* Count immediate data for fl_service users: at most `most` values at once (1 .. 2^22). 0, or a negative
 * libfabric code (-FI_ENOMEM, -FI_EINVAL). Attach before the service starts; fl_engine_free frees it. */
int fl_imm_attach(struct fl_engine *e, uint32_t most);
/* Await `value`: its slot is kept (arrivals before and after count) until as many fl_imm_release. With
 * `report_lost`, a value marked lost is reported (FL_IMM_LOST, and unmarked) instead of awaited. */
int fl_imm_await(struct fl_engine *e, uint32_t value, int report_lost);
void fl_imm_release(struct fl_engine *e, uint32_t value);
/* If at least `count` pages carrying `value` have arrived, consume `count` of them and return 1; else 0. */
int fl_imm_take(struct fl_engine *e, uint32_t value, uint64_t count);
/* Count `count` more pages of `value` (a staged target copied them to their place): FL_IMM_OK, FL_IMM_LOST
 * (not counted: the table was full, or the count would exceed FL_IMM_MAX_COUNT) or FL_IMM_BAD. */
int fl_imm_credit(struct fl_engine *e, uint32_t value, uint64_t count);
/* A landing lane's writes: take `count` of them (1, else 0), or every one counted so far (how many). */
int fl_lane_take(struct fl_engine *e, uint32_t lane, uint64_t count);
uint64_t fl_lane_drain(struct fl_engine *e, uint32_t lane);
/* Drop the arrivals of values nobody has awaited for `age_ns` (since they arrived, or since their last
 * fl_imm_release): how many values. */
uint64_t fl_imm_expire(struct fl_engine *e, uint64_t age_ns);
void fl_imm_usage_get(struct fl_engine *e, fl_imm_usage *out);
#endif
