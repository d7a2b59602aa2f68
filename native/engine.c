/* The engine's life: fl_engine_new allocates an engine for both its users, fl_engine_free frees it once its
 * service (if any ran) has stopped and every thread it left behind is gone. At the top of the native files
 * (core_internal.h) because freeing needs the service's stop. */
#define _GNU_SOURCE
#include "core_internal.h"

#include <stdlib.h>
#include <string.h>

fl_engine *fl_engine_new(int nnics, uint32_t ring_capacity) {
    if (nnics <= 0 || nnics > FL_MAX_NICS || ring_capacity == 0) return NULL;
    fl_engine *e = calloc(1, sizeof(*e));
    engine_state *st = NULL;
    if (!e || posix_memalign((void **)&e->nics, 64, sizeof(fl_nic) * nnics) ||
        posix_memalign((void **)&st, 64, sizeof(*st))) {
        fl_engine_free(e);
        return NULL;
    }
    memset(e->nics, 0, sizeof(fl_nic) * nnics);
    memset(st, 0, sizeof(*st));
    e->state = st;
    e->nnics = nnics;
    st->nics = flc_calloc_lines(nnics, sizeof(nic_state));
    for (int i = 0; st->nics && i < nnics; i++) {
        e->nics[i].ring = calloc(ring_capacity, sizeof(fl_op));
        e->nics[i].ring_capacity = ring_capacity;
        if (!e->nics[i].ring) break;
        if (i == nnics - 1) return e;
    }
    fl_engine_free(e);
    return NULL;
}

int fl_engine_free(fl_engine *e) {
    if (!e) return 0;
    int left = fl_service_stop(e, FL_STOP_TIMEOUT_S);
    if (!left) left = flc_service_release_stranded(e);
    if (!left) left = e->course.target_stranded;
    if (left) return left; /* threads stuck in the engine may still touch any of it: it stays allocated */
    engine_state *st = e->state;
    for (int i = 0; e->nics && i < e->nnics; i++) {
        free(e->nics[i].ring);
        if (st && st->nics) {
            free(st->nics[i].slots);
            free(st->nics[i].held);
        }
    }
    if (st) free(st->nics);
    free(st);
    flc_imm_detach(e);
    free(e->nics);
    free(e);
    return 0;
}
