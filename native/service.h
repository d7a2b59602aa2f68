/* The library's service over the engine core: what fabriclab.Engine (fabriclab/_native.py) calls. */
#ifndef FABRICLAB_SERVICE_H
#define FABRICLAB_SERVICE_H
#include "core.h"

/* How the service's workers post: `threads` workers (worker w owns the NICs whose fl_nic.group is w), each
 * moving up to 64 * `batch` writes from its inbox per pass and pinned to cores[w] with `pin`. */
typedef struct fl_service_config {
    int threads;
    int batch;
    int fi_more;            /* FI_MORE on all but the last write of each run posted to one NIC */
    int pin;
    int cores[FL_MAX_THREADS];
    double timeout_s;       /* the longest a flush write waits for the provider to take it */
    double link_timeout_s;  /* no completion on a NIC with writes in flight for this long: the paths of those
                             * writes are down, and their writes go over other NICs (0: never). With
                             * failover on, writes ask for FI_DELIVERY_COMPLETE */
} fl_service_config;

/* Service mode: worker threads that post what fl_service_submit hands them, reap completions (counting
 * them against their transfer) and count arriving immediate data, until fl_service_stop. Worker w owns
 * the NICs whose fl_nic.group is w (fabriclab.nics.group_nics: grouped by topology): set every NIC's group,
 * in 0..threads-1, before starting. */
int fl_service_start(fl_engine *e, const fl_service_config *cfg);
/* One request of fabriclab.Engine: `count` writes, write i from local_base + src[i] * stride to
 * dst[i] * stride of the peer's region, lengths[i] bytes (or `length` when lengths is NULL), over NIC
 * (first_nic + i) % nnics through routes[that NIC] — or, with `nic_order`, over NIC
 * nic_order[(first_nic + i) % nic_count] (a GPU region leaves through its own GPU's NICs). A batch of
 * transfers (Peer.write_batch) is one request whose writes each name their transfer and immediate data. */
typedef struct fl_request {
    const fl_route *routes;
    uint64_t local_base;
    const int64_t *src, *dst;
    uint64_t stride;
    const uint64_t *lengths;
    uint64_t length;
    uint64_t count;
    uint64_t imm;
    uint32_t transfer;
    uint32_t first_nic;
    uint32_t pages_in_imm;  /* write i's immediate data also says it moves lengths[i] / stride pages */
    const uint16_t *nic_order; /* NULL: every NIC in turn */
    uint32_t nic_count;
    const uint32_t *transfers; /* NULL: every write counts against `transfer`; else write i against transfers[i] */
    const uint64_t *imms;      /* NULL: every write carries `imm`; else write i carries imms[i] */
} fl_request;
/* Queue writes [start, count) of a request to the worker threads; returns how many were taken (fewer
 * when the inboxes are full: submit the rest later). */
uint64_t fl_service_submit(fl_engine *e, const fl_request *r, uint64_t start);
/* Wait up to timeout_s for transfers to finish (every write completed or failed); writes their ids to
 * `ids` (at most max) and returns how many. Returns early, with 0, on fl_service_wake or when
 * immediate data arrives while e->imm_watch is set; with -1 when notices were lost (engine_state.done_lost:
 * the caller then looks at every transfer). Call without holding Python's GIL. */
int fl_service_wait(fl_engine *e, uint32_t *ids, int max, double timeout_s);
/* The calling thread looks for the end of `transfer` itself, up to spin_s (yielding its core between looks):
 * 1 once every write of it finished (the caller then settles it; nobody else was told, unless writes it
 * gave up on are still posted), 0 when the time ran out or the service is stopping (the reaper is told as
 * usual). Call without holding Python's GIL. */
int fl_transfer_wait(fl_engine *e, uint32_t transfer, double spin_s);
void fl_service_wake(fl_engine *e);
/* Stop the workers and wait up to timeout_s for them, and for callers of fl_service_submit, _wait, _wake
 * and fl_worker_park, to leave; then free what fl_service_start allocated. Returns 0, or how many threads
 * were still inside: those workers are detached at idle priority, nothing they may touch is freed, and
 * fl_engine_free leaves the whole engine allocated as long as they are there.
 *
 * Why a thread is given up on rather than waited for (the one statement of it; the rest of fabriclab, C
 * and Python, refers here): a healthy thread leaves within microseconds; one still inside after
 * FL_STOP_TIMEOUT_S is stuck in a provider call that never returns (shm spins for ever on a lock its
 * killed peer held), and waiting longer would not help. What it may still touch (its NICs, endpoints,
 * registrations, buffers) must never be closed or freed under it: closing shm's endpoints unmaps the
 * peer region it spins on. */
int fl_service_stop(fl_engine *e, double timeout_s);
/* How long anything in fabriclab waits for one of its threads to leave a provider call before it takes it
 * for stuck (above): fl_engine_free's stop, and in Python fabriclab._native.WORKER_EXIT_TIMEOUT. */
#define FL_STOP_TIMEOUT_S 5.0
/* Revival (Engine.connect): every worker forgets the paths it had marked dead and swaps in the fresh
 * endpoints handed over with fl_nic_renew, on its own thread, before it posts anything else. */
void fl_service_revive(fl_engine *e);
/* Park the worker that owns NIC slot `nic` (it sleeps, touching none of its NICs, until fl_worker_unpark), so
 * that Python can open an endpoint bound to that slot's CQ and AV: shm progresses every endpoint bound to a
 * CQ it reads, even one not enabled yet. 1 once parked; 0 after timeout_s or when the engine stops. */
int fl_worker_park(fl_engine *e, int nic, double timeout_s);
void fl_worker_unpark(fl_engine *e, int nic);
/* Hand NIC slot `nic` a fresh endpoint (same domain, bound to the slot's CQ and AV, enabled), swapped in by
 * its worker at the next fl_service_revive. The old endpoint must stay open (late completions, and peers
 * writing to its address). 0 when one is already waiting (the caller keeps ep), else 1. */
int fl_nic_renew(fl_engine *e, int nic, struct fid_ep *ep);
#endif
