/* The gates of gate.h. A slot is {key, state, inside}; a key that differs is a gate shut (the slot was
 * given to another region since the writer read its descriptor). Stands alone: calls no other file. */
#include "gate.h"

#include <stdatomic.h>

enum { FLG_SHUT = 0, FLG_OPEN = 1 };

typedef struct flg_slot {
    _Atomic uint64_t key;
    _Atomic uint32_t state;
    _Atomic uint32_t inside; /* writers between enter and leave */
} flg_slot;

_Static_assert(sizeof(flg_slot) <= FL_GATE_BYTES, "a gate fits its slot");

void fl_gate_open(void *slot, uint64_t key)
{
    flg_slot *g = slot;
    atomic_store(&g->inside, 0);
    atomic_store(&g->key, key);
    atomic_store(&g->state, FLG_OPEN);
}

int fl_gate_enter(void *slot, uint64_t key)
{
    flg_slot *g = slot;
    atomic_fetch_add(&g->inside, 1);
    if (atomic_load(&g->state) != FLG_OPEN || atomic_load(&g->key) != key) {
        atomic_fetch_sub(&g->inside, 1);
        return FL_GATE_SHUT;
    }
    return FL_GATE_PASSED;
}

void fl_gate_leave(void *slot)
{
    flg_slot *g = slot;
    atomic_fetch_sub(&g->inside, 1);
}

uint32_t fl_gate_shut(void *slot)
{
    flg_slot *g = slot;
    atomic_store(&g->state, FLG_SHUT);
    return atomic_load(&g->inside);
}

uint32_t fl_gate_inside(void *slot)
{
    flg_slot *g = slot;
    return atomic_load(&g->inside);
}
