/* Completion queues: where progress puts completions and error entries, and how the application reads them. */
#include "sim.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

/* The text of an error completion for a post refused before it left, where strerror would not say why. */
const char *sim_error_text(int err) {
    switch (err) {
    case FI_ENOSPC:
        return "the target endpoint hears " SIM_STR(SIM_PORTS) " sending endpoints already, the most the model "
               "gives one endpoint (docs/model.md): a port frees when one of them closes its endpoint";
    case FI_EHOSTUNREACH:
        return "the peer process is gone (closed or killed)";
    default:
        return strerror(err);
    }
}

/* Queue an error entry: 0, or -1 when the queue is full. A caller then keeps the operation where it is and
 * reports it once the application has read the errors ahead of it: none is ever dropped. */
int sim_cq_push_error(struct sim_cq *cq, void *context, uint64_t flags, size_t len, int err, const char *fmt, ...) {
    if (cq->err_tail - cq->err_head >= SIM_ERRS) return -1;
    uint64_t i = cq->err_tail % SIM_ERRS;
    struct fi_cq_err_entry *e = &cq->errs[i];
    memset(e, 0, sizeof *e);
    e->op_context = context;
    e->flags = flags;
    e->len = len;
    e->err = err;
    e->prov_errno = err;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(cq->err_text[i], sizeof cq->err_text[i], fmt, ap);
    va_end(ap);
    cq->err_tail++;
    return 0;
}

void sim_cq_fill(struct sim_cq *cq, void *buf, size_t i, void *context, uint64_t flags, size_t len, void *data_buf,
                 uint64_t data) {
    switch (cq->format) {
    case FI_CQ_FORMAT_CONTEXT:
        ((struct fi_cq_entry *)buf)[i] = (struct fi_cq_entry){context};
        break;
    case FI_CQ_FORMAT_MSG:
        ((struct fi_cq_msg_entry *)buf)[i] = (struct fi_cq_msg_entry){context, flags, len};
        break;
    default:
        ((struct fi_cq_data_entry *)buf)[i] = (struct fi_cq_data_entry){context, flags, len, data_buf, data};
    }
}

/* Whether a poll through cq has anything of the endpoint's to look at: an operation posted and not completed
 * (it may leave, or be due, whichever CQ is polled), or, on its receive CQ, a sender with a port into it. A
 * poll that finds none of these reads no clock: a NIC the application drives but has nothing in flight on
 * (most of chapter 9's 32, one write each per pass) costs its poll no more than the locks. */
static int has_work(struct sim_ep *ep, const struct sim_cq *cq) {
    if (ep->tx_head != ep->tx_tail) return 1;
    if (ep->rx_cq != cq) return 0;
    struct sim_segment *seg = ep->seg;
    for (int w = 0; w < SIM_PORT_WORDS; w++)
        if (atomic_load_explicit(&seg->ports_used[ep->slot][w], memory_order_relaxed)) return 1;
    return 0;
}

/* Progress every endpoint bound to the CQ (its receive side if the CQ is its receive CQ, its transmit side if
 * its transmit CQ, and its departures whichever it is), starting with a different one each time so that none
 * starves the others; completions fill buf up to count. count 0 (fi_cq_readerr) queues only what needs no
 * room in buf: the errors of its transmit sides. The caller holds the CQ's lock. */
static size_t progress(struct sim_cq *cq, void *buf, size_t count, uint64_t *next_due) {
    size_t n = 0;
    uint64_t now = 0; /* read once, at the first endpoint with work */
    *next_due = UINT64_MAX;
    unsigned first = cq->next++ % (unsigned)cq->neps;
    for (int i = 0; i < cq->neps && (n < count || !count); i++) {
        struct sim_ep *ep = cq->eps[(first + (unsigned)i) % (unsigned)cq->neps];
        if (!ep->enabled) continue;
        sim_ep_lock(ep);
        if (has_work(ep, cq)) {
            if (!now) now = sim_now_ns();
            sim_send_due(ep, now); /* a poll of either CQ lets what is due leave the writer's NIC */
            int rx = ep->rx_cq == cq && count, tx = ep->tx_cq == cq;
            if (rx) n = sim_progress_rx(ep, buf, count, n, now);
            if (tx) n = sim_progress_tx(ep, buf, count, n, now);
            uint64_t next = sim_next_event(ep, rx, tx);
            if (next < *next_due) *next_due = next;
        }
        sim_ep_unlock(ep);
    }
    return n;
}

/* libfabric's rule: while an error is queued, a read answers -FI_EAVAIL (and progresses nothing, so that no
 * completion overtakes it); once the application has read them all, reads progress again. */
static ssize_t cq_read(struct fid_cq *fid, void *buf, size_t count) {
    struct sim_cq *cq = (struct sim_cq *)fid;
    sim_enter();
    pthread_mutex_lock(&cq->lock);
    size_t n = 0;
    uint64_t next_due = UINT64_MAX;
    if (cq->err_head == cq->err_tail && cq->neps && count) n = progress(cq, buf, count, &next_due);
    int errors = cq->err_head != cq->err_tail;
    sim_charge_poll(cq, errors && !n ? 1 : n, next_due);
    pthread_mutex_unlock(&cq->lock);
    sim_leave();
    if (n) return (ssize_t)n;
    return errors ? -FI_EAVAIL : -FI_EAGAIN;
}

static ssize_t cq_readfrom(struct fid_cq *fid, void *buf, size_t count, fi_addr_t *src) {
    ssize_t n = cq_read(fid, buf, count);
    for (ssize_t i = 0; src && i < n; i++) src[i] = FI_ADDR_NOTAVAIL;
    return n;
}

/* An error is readable as soon as it is due: with none queued, the read progresses the transmit sides first
 * (an application that drains errors until -FI_EAGAIN gets every one due, past the queue's SIM_ERRS). */
static ssize_t cq_readerr(struct fid_cq *fid, struct fi_cq_err_entry *buf, uint64_t flags) {
    struct sim_cq *cq = (struct sim_cq *)fid;
    uint64_t next_due;
    sim_enter();
    pthread_mutex_lock(&cq->lock);
    if (cq->err_head == cq->err_tail && cq->neps) progress(cq, NULL, 0, &next_due);
    sim_charge_poll(cq, cq->err_head != cq->err_tail, UINT64_MAX);
    sim_leave();
    if (cq->err_head == cq->err_tail) {
        pthread_mutex_unlock(&cq->lock);
        return -FI_EAGAIN;
    }
    uint64_t i = cq->err_head++ % SIM_ERRS;
    void *err_data = buf->err_data;
    size_t err_data_size = buf->err_data_size;
    *buf = cq->errs[i];
    /* the text lives with the CQ; a caller that gave a buffer of its own gets a copy */
    if (err_data && err_data_size) {
        size_t len = strlen(cq->err_text[i]) + 1;
        memcpy(err_data, cq->err_text[i], len < err_data_size ? len : err_data_size);
        buf->err_data = err_data;
        buf->err_data_size = len < err_data_size ? len : err_data_size;
    } else {
        buf->err_data = cq->err_text[i];
        buf->err_data_size = strlen(cq->err_text[i]) + 1;
    }
    pthread_mutex_unlock(&cq->lock);
    return 1;
}

static const char *cq_strerror(struct fid_cq *fid, int prov_errno, const void *err_data, char *buf, size_t len) {
    const char *text = err_data ? (const char *)err_data : fi_strerror(prov_errno);
    if (buf && len) {
        snprintf(buf, len, "%s", text);
        return buf;
    }
    return text;
}

/* Waiting: nothing interrupts the application in the model (no thread runs behind its back), so a waiting
 * read polls, sleeping between polls, until a completion, an error, fi_cq_signal or the timeout (ms, -1: none). */
static ssize_t cq_sreadfrom(struct fid_cq *fid, void *buf, size_t count, fi_addr_t *src, const void *cond,
                            int timeout) {
    struct sim_cq *cq = (struct sim_cq *)fid;
    if (cq->wait_obj == FI_WAIT_NONE) return -FI_ENOSYS; /* fi_cq(3): no wait object, no waiting */
    uint64_t deadline = timeout < 0 ? UINT64_MAX : sim_wall_ns() + (uint64_t)timeout * 1000000;
    for (;;) {
        ssize_t n = cq_readfrom(fid, buf, count, src);
        if (n != -FI_EAGAIN) return n;
        if (atomic_exchange(&cq->signaled, 0) || sim_wall_ns() >= deadline) return -FI_EAGAIN;
        nanosleep(&(struct timespec){0, 20000}, NULL);
    }
}

static ssize_t cq_sread(struct fid_cq *fid, void *buf, size_t count, const void *cond, int timeout) {
    return cq_sreadfrom(fid, buf, count, NULL, cond, timeout);
}

static int cq_signal(struct fid_cq *fid) {
    struct sim_cq *cq = (struct sim_cq *)fid;
    if (cq->wait_obj == FI_WAIT_NONE) return -FI_ENOSYS;
    atomic_store(&cq->signaled, 1);
    return 0;
}

/* An endpoint reads through the CQ from now on (it may bind it for both directions: once in the list). */
int sim_cq_bind(struct sim_cq *cq, struct sim_ep *ep) {
    int rc = 0;
    pthread_mutex_lock(&cq->lock);
    int i = 0;
    while (i < cq->neps && cq->eps[i] != ep) i++;
    if (i == cq->neps) {
        if (cq->neps == SIM_EPS) rc = -FI_ENOSPC; /* a domain has no more endpoints than that */
        else cq->eps[cq->neps++] = ep;
    }
    pthread_mutex_unlock(&cq->lock);
    return rc;
}

void sim_cq_unbind(struct sim_cq *cq, struct sim_ep *ep) {
    pthread_mutex_lock(&cq->lock);
    for (int i = 0; i < cq->neps; i++)
        if (cq->eps[i] == ep) cq->eps[i] = cq->eps[--cq->neps];
    pthread_mutex_unlock(&cq->lock);
}

static int cq_close(struct fid *fid) {
    struct sim_cq *cq = (struct sim_cq *)fid;
    pthread_mutex_lock(&cq->lock);
    int bound = cq->neps;
    pthread_mutex_unlock(&cq->lock);
    if (bound) return -FI_EBUSY;
    struct sim_domain *d = cq->domain;
    pthread_mutex_lock(&d->lock);
    d->cqs--;
    pthread_mutex_unlock(&d->lock);
    atomic_fetch_sub(&d->refs, 1);
    pthread_mutex_destroy(&cq->lock);
    free(cq);
    return 0;
}

static struct fi_ops cq_fi_ops = {.size = sizeof(struct fi_ops), .close = cq_close, .bind = sim_no_bind,
                                  .control = sim_no_control, .ops_open = sim_host_ops_open, .ops_set = sim_no_ops_set};
static struct fi_ops_cq cq_ops = {.size = sizeof(struct fi_ops_cq), .read = cq_read, .readfrom = cq_readfrom,
                                  .readerr = cq_readerr, .sread = cq_sread, .sreadfrom = cq_sreadfrom,
                                  .signal = cq_signal, .strerror = cq_strerror};

int sim_cq_open(struct fid_domain *dfid, struct fi_cq_attr *attr, struct fid_cq **out, void *context) {
    struct sim_domain *d = (struct sim_domain *)dfid;
    int wait = attr ? attr->wait_obj : FI_WAIT_NONE;
    if (wait != FI_WAIT_NONE && wait != FI_WAIT_UNSPEC && wait != FI_WAIT_YIELD) return -FI_ENOSYS;
    if (attr && attr->format != FI_CQ_FORMAT_UNSPEC && attr->format != FI_CQ_FORMAT_CONTEXT &&
        attr->format != FI_CQ_FORMAT_MSG && attr->format != FI_CQ_FORMAT_DATA)
        return -FI_ENOSYS;
    if (attr && (attr->flags & FI_AFFINITY)) return -FI_ENOSYS;
    struct sim_cq *cq = calloc(1, sizeof *cq);
    if (!cq) return -FI_ENOMEM;
    pthread_mutex_lock(&d->lock);
    int full = d->cqs == SIM_CQS;
    if (!full) d->cqs++;
    pthread_mutex_unlock(&d->lock);
    if (full) {
        free(cq);
        return -FI_ENOSPC; /* cq_cnt */
    }
    atomic_fetch_add(&d->refs, 1);
    pthread_mutex_init(&cq->lock, NULL);
    cq->fid.fid = (struct fid){.fclass = FI_CLASS_CQ, .context = context, .ops = &cq_fi_ops};
    cq->fid.ops = &cq_ops;
    cq->domain = d;
    cq->wait_obj = wait;
    cq->format = attr && attr->format != FI_CQ_FORMAT_UNSPEC ? attr->format : FI_CQ_FORMAT_DATA;
    *out = &cq->fid;
    return 0;
}
