/* fabriclab's count of immediate data: see imm.h.
 *
 * An open-addressing table (linear probing) of one 64-bit word per slot: the key (value + 1) above
 * FL_IMM_COUNT_BITS bits of count; 0 is a slot never used since the last rebuild (it ends a search), TOMB
 * one given up. Key and count in one word make every change of a count one compare-and-swap that also
 * checks whose count it is, so the hot path (a worker counting a write that landed) takes no lock when the
 * value already holds a slot. Everything that changes which value holds which slot (claiming a slot,
 * giving one up, rebuilding) happens under the table's lock; so do the takes and the waiter counts, off
 * the hot path. Why a lock-free add stays exact:
 *   - only lock holders put keys in slots, after searching under the lock: a key is never in two slots;
 *   - a slot is given up by swapping its word (key, 0) for TOMB: it fails if an add came first, and an add
 *     after it fails its swap, finds no slot and counts under the lock;
 *   - a rebuild takes each word out with an exchange, so an add either landed before (and moves with the
 *     word) or fails and waits for the lock; a word put back where it was is the value's whole state, so
 *     an add that swaps it then is still right.
 * Writes into a staged target's landing lanes are counted apart, a counter per lane: never lost.
 *
 * Values that hold pages nobody awaits are queued in `unclaimed`, oldest first (a ring of (key, seq, since):
 * an entry stands while its slot's `seqs` still names it; one that no longer does, because the value was
 * awaited or given up meanwhile, is skipped when met, and dropped from the ring when it is full). A place
 * for a new value, when every one is held, comes from the oldest of them (its pages dropped), and
 * fl_imm_expire drops those that waited longer than an age: so arrivals nobody expects, a flood of them
 * or the late pages of expect()s that timed out, never hold the table for good. Only values awaited are
 * never dropped. */
#define _GNU_SOURCE
#include "core_internal.h"

#include <stdlib.h>

#define COUNT_MASK FL_IMM_MAX_COUNT
#define TOMB 1ull /* key 0, so no value's; not 0, so a search goes on past it */
#define VALUE_MASK ((1ull << FL_IMM_VALUE_BITS) - 1)
#define MAX_MOST (1u << 22)

typedef struct imm_unclaimed {
    uint64_t since_ns; /* when its pages began waiting for nobody (flc_imm_clock) */
    uint32_t key, seq;
    uint32_t slot;     /* where it was then: still there unless a rebuild moved it */
} imm_unclaimed;

typedef struct imm_table {
    _Atomic uint64_t *words;
    uint32_t *waiters;        /* per slot, under the lock: fl_imm_await calls not yet released */
    uint32_t slots, shift;    /* slots: a power of two, twice `most`; shift: 64 - log2(slots) */
    uint32_t most, live, tombs; /* live: slots held (under the lock); tombs: slots given up since the rebuild */
    uint32_t *seqs;           /* per slot, under the lock: its entry in `unclaimed` (0: none: awaited, or free) */
    imm_unclaimed *unclaimed; /* a ring of `slots` entries, oldest first, under the lock (see above) */
    uint32_t ring_head, ring_count, next_seq;
    uint64_t dropped, last_dropped; /* values whose pages nobody awaited were dropped; the last such value */
    uint64_t *moving;         /* a rebuild's live words with their waiters and seqs (room for `most`) */
    uint32_t *moving_waiters, *moving_seqs;
    uint8_t *lost;            /* a bit per value: an arrival of it was not counted (under the lock) */
    uint64_t lost_values, last_lost;
    _Atomic uint64_t lost_arrivals;
    pthread_mutex_t lock;
    _Atomic uint64_t lanes[FL_IMM_LANES];
} imm_table;

static inline uint64_t flc_imm_key_of(uint64_t word) { return word >> FL_IMM_COUNT_BITS; }

static inline uint32_t flc_imm_home(const imm_table *t, uint64_t key) {
    return (uint32_t)((key * 0x9E3779B97F4A7C15ull) >> t->shift); /* Fibonacci hashing: the high bits */
}

/* The slot holding `key` (and its word, as read), or -1. Safe without the lock: a miss there is settled
 * under it. */
static int64_t flc_imm_find_word(imm_table *t, uint64_t key, uint64_t *word) {
    uint32_t mask = t->slots - 1, i = flc_imm_home(t, key);
    for (uint32_t probe = 0; probe < t->slots; probe++, i = (i + 1) & mask) {
        *word = atomic_load_explicit(&t->words[i], memory_order_acquire);
        if (*word == 0) return -1;
        if (flc_imm_key_of(*word) == key) return i;
    }
    return -1;
}

static int64_t flc_imm_find(imm_table *t, uint64_t key) {
    uint64_t word;
    return flc_imm_find_word(t, key, &word);
}

/* Add `pages` to the slot of `key` if it holds one: 1; 0 when it holds none (or lost it meanwhile); -1 when
 * the count would pass FL_IMM_MAX_COUNT. */
static int flc_imm_add_if_held(imm_table *t, uint64_t key, uint64_t pages) {
    uint64_t word;
    int64_t i = flc_imm_find_word(t, key, &word);
    if (i < 0) return 0;
    while (flc_imm_key_of(word) == key) {
        if ((word & COUNT_MASK) + pages > COUNT_MASK) return -1;
        if (atomic_compare_exchange_weak_explicit(&t->words[i], &word, word + pages, memory_order_acq_rel,
                                                  memory_order_acquire))
            return 1;
    }
    return 0;
}

/* Put `word` in the first free slot of its key's probe sequence (the key holds none). Under the lock. */
static uint32_t flc_imm_place(imm_table *t, uint64_t word, uint32_t waiters, uint32_t seq) {
    uint32_t mask = t->slots - 1, i = flc_imm_home(t, flc_imm_key_of(word));
    for (;;) {
        uint64_t seen = atomic_load_explicit(&t->words[i], memory_order_relaxed);
        if (seen == 0 || seen == TOMB) {
            t->tombs -= seen == TOMB;
            t->waiters[i] = waiters;
            t->seqs[i] = seq;
            atomic_store_explicit(&t->words[i], word, memory_order_release);
            t->live++;
            return i;
        }
        i = (i + 1) & mask;
    }
}

/* Searches end at a never-used slot: once held and given-up slots fill three quarters of the table, put the
 * held ones back afresh. At most `most` are held (half the slots), so this comes at most once per quarter of
 * the table's slots claimed. Under the lock. */
static void flc_imm_rebuild_if_crowded(imm_table *t) {
    if ((uint64_t)(t->live + t->tombs + 1) * 4 <= (uint64_t)t->slots * 3) return;
    uint32_t n = 0;
    for (uint32_t i = 0; i < t->slots; i++) {
        uint64_t word = atomic_exchange_explicit(&t->words[i], TOMB, memory_order_acq_rel);
        if (flc_imm_key_of(word)) {
            t->moving[n] = word;
            t->moving_seqs[n] = t->seqs[i];
            t->moving_waiters[n++] = t->waiters[i];
        }
    }
    for (uint32_t i = 0; i < t->slots; i++) {
        t->waiters[i] = 0;
        atomic_store_explicit(&t->words[i], 0, memory_order_release);
    }
    t->live = t->tombs = 0;
    for (uint32_t k = 0; k < n; k++) flc_imm_place(t, t->moving[k], t->moving_waiters[k], t->moving_seqs[k]);
}

/* The clock of the ring: ages are seconds, and the coarse clock costs a few ns where the precise one costs
 * tens (a value's first arrival reads it). */
static uint64_t flc_imm_clock(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC_COARSE, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

/* The slot `entry` of the ring stands for, or -1 (a stale entry). Under the lock. */
static int64_t flc_imm_unclaimed_slot(imm_table *t, const imm_unclaimed *entry) {
    uint64_t word = atomic_load_explicit(&t->words[entry->slot], memory_order_relaxed);
    int64_t i = flc_imm_key_of(word) == entry->key ? entry->slot : flc_imm_find(t, entry->key);
    return i >= 0 && t->seqs[i] == entry->seq ? i : -1;
}

/* The oldest entry of the ring, taken out: the slot it stood for (-1: it was stale). The ring is not empty.
 * Under the lock. */
static int64_t flc_imm_pop_unclaimed(imm_table *t) {
    imm_unclaimed entry = t->unclaimed[t->ring_head];
    t->ring_head = (t->ring_head + 1) & (t->slots - 1);
    t->ring_count--;
    return flc_imm_unclaimed_slot(t, &entry);
}

/* Slot `i` holds pages nobody awaits from now on: the newest of the ring. A full ring first loses its stale
 * entries: those that stand hold a slot each, at most `most` (half the ring), so that frees half of it. Under
 * the lock. */
static void flc_imm_unclaimed(imm_table *t, uint32_t i) {
    uint32_t mask = t->slots - 1;
    if (t->ring_count == t->slots) {
        uint32_t kept = 0;
        for (uint32_t k = 0; k < t->ring_count; k++) {
            imm_unclaimed entry = t->unclaimed[(t->ring_head + k) & mask];
            if (flc_imm_unclaimed_slot(t, &entry) >= 0) t->unclaimed[(t->ring_head + kept++) & mask] = entry;
        }
        t->ring_count = kept;
    }
    t->seqs[i] = ++t->next_seq ? t->next_seq : ++t->next_seq; /* never 0 */
    t->unclaimed[(t->ring_head + t->ring_count++) & mask] = (imm_unclaimed){
        .since_ns = flc_imm_clock(),
        .key = (uint32_t)flc_imm_key_of(atomic_load_explicit(&t->words[i], memory_order_relaxed)),
        .seq = t->seqs[i], .slot = i};
}

/* Drop the pages slot `i` holds for nobody: its place is free. An add racing with it fails its swap and
 * counts under the lock, in a slot of its own. Under the lock. */
static void flc_imm_drop(imm_table *t, uint32_t i) {
    uint64_t word = atomic_exchange_explicit(&t->words[i], TOMB, memory_order_acq_rel);
    t->seqs[i] = 0;
    t->live--;
    t->tombs++;
    t->dropped++;
    t->last_dropped = flc_imm_key_of(word) - 1;
}

/* The slot of `key`, claimed (count 0) when it holds none, in the place of the value that has held pages for
 * nobody the longest when every slot is held: -1 when every slot is awaited. Under the lock. */
static int64_t flc_imm_hold(imm_table *t, uint64_t key) {
    int64_t i = flc_imm_find(t, key);
    if (i >= 0) return i;
    while (t->live >= t->most && t->ring_count) {
        int64_t oldest = flc_imm_pop_unclaimed(t);
        if (oldest >= 0) flc_imm_drop(t, (uint32_t)oldest);
    }
    if (t->live >= t->most) return -1;
    flc_imm_rebuild_if_crowded(t);
    return flc_imm_place(t, key << FL_IMM_COUNT_BITS, 0, 0);
}

/* Give up slot `i` if nothing awaits it and it holds no arrival (an add that comes first keeps it). */
static void flc_imm_give_up_if_idle(imm_table *t, uint32_t i) {
    uint64_t word = atomic_load_explicit(&t->words[i], memory_order_acquire);
    if (t->waiters[i] || (word & COUNT_MASK) || !flc_imm_key_of(word)) return;
    if (atomic_compare_exchange_strong_explicit(&t->words[i], &word, TOMB, memory_order_acq_rel,
                                                memory_order_acquire)) {
        t->live--;
        t->tombs++;
    }
}

static void flc_imm_mark_lost(imm_table *t, uint64_t value) {
    atomic_fetch_add_explicit(&t->lost_arrivals, 1, memory_order_relaxed);
    t->last_lost = value;
    uint8_t bit = (uint8_t)(1u << (value & 7));
    if (!(t->lost[value >> 3] & bit)) {
        t->lost[value >> 3] |= bit;
        t->lost_values++;
    }
}

/* Count `pages` of caller value `value`: FL_IMM_OK, or FL_IMM_LOST (marked). */
static int flc_imm_add(imm_table *t, uint64_t value, uint64_t pages) {
    uint64_t key = value + 1;
    int done = flc_imm_add_if_held(t, key, pages);
    if (done > 0) return FL_IMM_OK;
    pthread_mutex_lock(&t->lock);
    done = done < 0 ? -1 : flc_imm_add_if_held(t, key, pages); /* another thread may have claimed it meanwhile */
    if (done == 0) {
        int64_t i = flc_imm_hold(t, key);
        done = i < 0 ? -1 : 1;
        if (i >= 0) {
            atomic_fetch_add_explicit(&t->words[i], pages, memory_order_acq_rel);
            flc_imm_unclaimed(t, (uint32_t)i); /* a slot of its own, just claimed: nobody awaits it */
        }
    }
    if (done < 0) flc_imm_mark_lost(t, value);
    pthread_mutex_unlock(&t->lock);
    return done < 0 ? FL_IMM_LOST : FL_IMM_OK;
}

/* The hot path (poll_nic, for each write that landed with immediate data): 1 when it was counted or marked
 * lost (someone waiting should look), 0 when it is not a count of ours. A write counts as the pages it
 * carries; a landing lane's once, for its lane. The wire carries 32 bits: more come only from a foreign
 * writer, and are not ours to read. */
int flc_count_imm(fl_engine *e, uint64_t imm) {
    imm_table *t = e->service.imms;
    imm &= 0xffffffffull;
    if (!t || imm == FL_NO_IMM) return 0;
    uint64_t value = imm & VALUE_MASK, high = imm >> FL_IMM_VALUE_BITS;
    if (value == FL_LANDING_VALUE) {
        atomic_fetch_add_explicit(&t->lanes[high], 1, memory_order_acq_rel);
        return 1;
    }
    flc_imm_add(t, value, high + 1);
    return 1;
}

int fl_imm_attach(fl_engine *e, uint32_t most) {
    if (e->service.imms || most == 0 || most > MAX_MOST) return -FI_EINVAL;
    imm_table *t = calloc(1, sizeof *t);
    if (!t) return -FI_ENOMEM;
    pthread_mutex_init(&t->lock, NULL);
    e->service.imms = t;
    t->most = most;
    t->slots = 2;
    t->shift = 63;
    while (t->slots < 2 * most) {
        t->slots *= 2;
        t->shift--;
    }
    t->words = calloc(t->slots, sizeof *t->words);
    t->waiters = calloc(t->slots, sizeof *t->waiters);
    t->seqs = calloc(t->slots, sizeof *t->seqs);
    t->unclaimed = calloc(t->slots, sizeof *t->unclaimed);
    t->moving = calloc(most, sizeof *t->moving);
    t->moving_waiters = calloc(most, sizeof *t->moving_waiters);
    t->moving_seqs = calloc(most, sizeof *t->moving_seqs);
    t->lost = calloc((VALUE_MASK + 1) / 8, 1); /* 2 MiB, untouched (no memory) until a value is lost */
    if (t->words && t->waiters && t->seqs && t->unclaimed && t->moving && t->moving_waiters && t->moving_seqs &&
        t->lost)
        return 0;
    flc_imm_detach(e);
    return -FI_ENOMEM;
}

void flc_imm_detach(fl_engine *e) {
    imm_table *t = e->service.imms;
    if (!t) return;
    pthread_mutex_destroy(&t->lock);
    free((void *)t->words);
    free(t->waiters);
    free(t->seqs);
    free(t->unclaimed);
    free(t->moving);
    free(t->moving_waiters);
    free(t->moving_seqs);
    free(t->lost);
    free(t);
    e->service.imms = NULL;
}

static inline int flc_imm_caller_value(const fl_engine *e, uint32_t value) {
    return e->service.imms && value < FL_LANDING_VALUE;
}

int fl_imm_await(fl_engine *e, uint32_t value, int report_lost) {
    if (!flc_imm_caller_value(e, value)) return FL_IMM_BAD;
    imm_table *t = e->service.imms;
    int status = FL_IMM_OK;
    pthread_mutex_lock(&t->lock);
    uint8_t bit = (uint8_t)(1u << (value & 7));
    if (report_lost && (t->lost[value >> 3] & bit)) {
        t->lost[value >> 3] &= (uint8_t)~bit;
        t->lost_values--;
        status = FL_IMM_LOST;
    } else {
        int64_t i = flc_imm_hold(t, value + 1ull);
        if (i < 0) {
            status = FL_IMM_FULL;
        } else {
            t->waiters[i]++;
            t->seqs[i] = 0; /* awaited: never dropped (its entry in the ring, if any, no longer stands) */
        }
    }
    pthread_mutex_unlock(&t->lock);
    return status;
}

void fl_imm_release(fl_engine *e, uint32_t value) {
    if (!flc_imm_caller_value(e, value)) return;
    imm_table *t = e->service.imms;
    pthread_mutex_lock(&t->lock);
    int64_t i = flc_imm_find(t, value + 1ull);
    if (i >= 0 && t->waiters[i]) {
        t->waiters[i]--;
        flc_imm_give_up_if_idle(t, (uint32_t)i);
        if (!t->waiters[i] && flc_imm_key_of(atomic_load_explicit(&t->words[i], memory_order_acquire)))
            flc_imm_unclaimed(t, (uint32_t)i); /* pages left that nobody awaits now */
    }
    pthread_mutex_unlock(&t->lock);
}

int fl_imm_take(fl_engine *e, uint32_t value, uint64_t count) {
    if (!flc_imm_caller_value(e, value) || count > COUNT_MASK) return 0;
    imm_table *t = e->service.imms;
    uint64_t key = value + 1ull;
    int took = 0;
    pthread_mutex_lock(&t->lock);
    int64_t i = flc_imm_find(t, key);
    if (i >= 0) {
        uint64_t word = atomic_load_explicit(&t->words[i], memory_order_acquire);
        while (flc_imm_key_of(word) == key && (word & COUNT_MASK) >= count) {
            if (atomic_compare_exchange_weak_explicit(&t->words[i], &word, word - count, memory_order_acq_rel,
                                                      memory_order_acquire)) {
                took = 1;
                flc_imm_give_up_if_idle(t, (uint32_t)i);
                break;
            }
        }
    }
    pthread_mutex_unlock(&t->lock);
    return took;
}

int fl_imm_credit(fl_engine *e, uint32_t value, uint64_t count) {
    if (!flc_imm_caller_value(e, value)) return FL_IMM_BAD;
    return count ? flc_imm_add(e->service.imms, value, count) : FL_IMM_OK;
}

int fl_lane_take(fl_engine *e, uint32_t lane, uint64_t count) {
    imm_table *t = e->service.imms;
    if (!t || lane >= FL_IMM_LANES) return 0;
    uint64_t have = atomic_load_explicit(&t->lanes[lane], memory_order_acquire);
    while (have >= count)
        if (atomic_compare_exchange_weak_explicit(&t->lanes[lane], &have, have - count, memory_order_acq_rel,
                                                  memory_order_acquire))
            return 1;
    return 0;
}

uint64_t fl_lane_drain(fl_engine *e, uint32_t lane) {
    imm_table *t = e->service.imms;
    if (!t || lane >= FL_IMM_LANES) return 0;
    return atomic_exchange_explicit(&t->lanes[lane], 0, memory_order_acq_rel);
}

uint64_t fl_imm_expire(fl_engine *e, uint64_t age_ns) {
    imm_table *t = e->service.imms;
    if (!t) return 0;
    uint64_t dropped = 0, now = flc_imm_clock();
    pthread_mutex_lock(&t->lock);
    while (t->ring_count && now - t->unclaimed[t->ring_head].since_ns >= age_ns) {
        int64_t i = flc_imm_pop_unclaimed(t);
        if (i >= 0) {
            flc_imm_drop(t, (uint32_t)i);
            dropped++;
        }
    }
    pthread_mutex_unlock(&t->lock);
    return dropped;
}

void fl_imm_usage_get(fl_engine *e, fl_imm_usage *out) {
    imm_table *t = e->service.imms;
    *out = (fl_imm_usage){0};
    if (!t) return;
    pthread_mutex_lock(&t->lock);
    *out = (fl_imm_usage){.values = t->live, .most = t->most, .lost_values = t->lost_values,
                          .last_lost = t->last_lost, .dropped = t->dropped, .last_dropped = t->last_dropped,
                          .lost = atomic_load_explicit(&t->lost_arrivals, memory_order_relaxed)};
    pthread_mutex_unlock(&t->lock);
}
