/* Conformance checks of the modeled-NIC provider (sim) through the raw libfabric API, written from libfabric's
 * man pages (fi_getinfo(3), fi_eq(3), fi_cq(3), fi_cntr(3), fi_av(3), fi_endpoint(3), fi_msg(3), fi_rma(3)):
 * what fabtests' RDM and RMA tests exercise. One check per run (`sim_conformance <check>`), so that a crash
 * names its check; `sim_conformance list` prints them. Prints "ok" and exits 0, or prints each failure. */
#define _GNU_SOURCE
#include <errno.h>
#include <poll.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <rdma/fabric.h>
#include <rdma/fi_atomic.h>
#include <rdma/fi_cm.h>
#include <rdma/fi_collective.h>
#include <rdma/fi_domain.h>
#include <rdma/fi_endpoint.h>
#include <rdma/fi_eq.h>
#include <rdma/fi_errno.h>
#include <rdma/fi_rma.h>
#include <rdma/fi_tagged.h>

#include "../native/sim/fi_sim_ext.h" /* the provider's extension, as fi_ext_efa.h is efa's */

#define API FI_VERSION(1, 17)
#define TIMEOUT_MS 5000

static int failures;

static void fail(const char *where, int line, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    printf("FAIL %s:%d: ", where, line);
    vprintf(fmt, ap);
    printf("\n");
    va_end(ap);
    failures++;
}
#define CHECK(cond, ...) do { if (!(cond)) fail(__func__, __LINE__, __VA_ARGS__); } while (0)
#define EXPECT(call, want) do { long long got_ = (long long)(call); \
        CHECK(got_ == (long long)(want), "%s returned %lld (%s), expected %lld", #call, got_, \
              fi_strerror((int)-got_), (long long)(want)); } while (0)
#define MUST(call) do { long long rc_ = (long long)(call); \
        if (rc_) { fail(__func__, __LINE__, "%s: %lld (%s)", #call, rc_, fi_strerror((int)-rc_)); exit(1); } } while (0)

static uint64_t now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000 + (uint64_t)ts.tv_nsec / 1000000;
}

/* ------------------------------------------------------------------------------------------ plumbing */

static struct fi_info *hints_for(int nic) {
    struct fi_info *hints = fi_allocinfo();
    hints->fabric_attr->prov_name = strdup("sim");
    hints->ep_attr->type = FI_EP_RDM;
    hints->caps = FI_MSG | FI_RMA;
    hints->domain_attr->mr_mode = FI_MR_LOCAL | FI_MR_VIRT_ADDR | FI_MR_ALLOCATED | FI_MR_PROV_KEY;
    if (nic >= 0) {
        char name[32];
        snprintf(name, sizeof name, "rdmap%ds0-rdm", 16 + nic);
        hints->domain_attr->name = strdup(name);
    }
    return hints;
}

static struct fi_info *info_for(int nic) {
    struct fi_info *hints = hints_for(nic), *info = NULL;
    MUST(fi_getinfo(API, NULL, NULL, 0, hints, &info));
    fi_freeinfo(hints);
    return info;
}

struct nic {
    struct fi_info *info;
    struct fid_fabric *fabric;
    struct fid_domain *domain;
    struct fid_av *av;
};

struct node { /* one endpoint with its own transmit and receive CQs (which may be the same) */
    struct nic *nic;
    struct fid_cq *txcq, *rxcq;
    struct fid_ep *ep;
    char addr[64];
    size_t addrlen;
};

static void nic_open(struct nic *n, int index) {
    n->info = info_for(index);
    MUST(fi_fabric(n->info->fabric_attr, &n->fabric, NULL));
    MUST(fi_domain(n->fabric, n->info, &n->domain, NULL));
    struct fi_av_attr av_attr = {.type = FI_AV_TABLE};
    MUST(fi_av_open(n->domain, &av_attr, &n->av, NULL));
}

static void nic_close(struct nic *n) {
    EXPECT(fi_close(&n->av->fid), 0);
    EXPECT(fi_close(&n->domain->fid), 0);
    EXPECT(fi_close(&n->fabric->fid), 0);
    fi_freeinfo(n->info);
}

static struct fid_cq *cq_new(struct nic *n) {
    struct fi_cq_attr attr = {.format = FI_CQ_FORMAT_DATA, .wait_obj = FI_WAIT_NONE};
    struct fid_cq *cq;
    MUST(fi_cq_open(n->domain, &attr, &cq, NULL));
    return cq;
}

/* An endpoint bound to txcq for transmits and rxcq for receives (flags added to each binding). */
static void node_open(struct node *x, struct nic *n, struct fid_cq *txcq, struct fid_cq *rxcq, uint64_t txflags,
                      uint64_t rxflags) {
    x->nic = n;
    x->txcq = txcq;
    x->rxcq = rxcq;
    MUST(fi_endpoint(n->domain, n->info, &x->ep, NULL));
    MUST(fi_ep_bind(x->ep, &n->av->fid, 0));
    if (txcq == rxcq) {
        MUST(fi_ep_bind(x->ep, &txcq->fid, FI_TRANSMIT | FI_RECV | txflags | rxflags));
    } else {
        MUST(fi_ep_bind(x->ep, &txcq->fid, FI_TRANSMIT | txflags));
        MUST(fi_ep_bind(x->ep, &rxcq->fid, FI_RECV | rxflags));
    }
    MUST(fi_enable(x->ep));
    x->addrlen = sizeof x->addr;
    MUST(fi_getname(&x->ep->fid, x->addr, &x->addrlen));
}

static fi_addr_t insert(struct nic *n, struct node *peer) {
    fi_addr_t a = FI_ADDR_NOTAVAIL;
    EXPECT(fi_av_insert(n->av, peer->addr, 1, &a, 0, NULL), 1);
    return a;
}

/* Two NICs, an endpoint on each with one CQ for both directions, and x knowing y. */
struct pair {
    struct nic a, b;
    struct fid_cq *cqa, *cqb;
    struct node x, y;
    fi_addr_t to_y;
};

static void pair_open(struct pair *p) {
    nic_open(&p->a, 0);
    nic_open(&p->b, 1);
    p->cqa = cq_new(&p->a);
    p->cqb = cq_new(&p->b);
    node_open(&p->x, &p->a, p->cqa, p->cqa, 0, 0);
    node_open(&p->y, &p->b, p->cqb, p->cqb, 0, 0);
    p->to_y = insert(&p->a, &p->y);
}

static void pair_close(struct pair *p) {
    EXPECT(fi_close(&p->x.ep->fid), 0);
    EXPECT(fi_close(&p->y.ep->fid), 0);
    EXPECT(fi_close(&p->cqa->fid), 0);
    EXPECT(fi_close(&p->cqb->fid), 0);
    nic_close(&p->a);
    nic_close(&p->b);
}

/* Reads completions from the given CQs until `want` arrived on `cq` (others are drained into `spill`). */
static int poll_cq(struct fid_cq *cq, struct fi_cq_data_entry *out, int want, struct fid_cq **others, int nothers,
                   int *spill) {
    int got = 0;
    uint64_t deadline = now_ms() + TIMEOUT_MS;
    while (got < want && now_ms() < deadline) {
        ssize_t n = fi_cq_read(cq, out + got, (size_t)(want - got));
        if (n > 0) got += (int)n;
        if (n == -FI_EAVAIL) {
            struct fi_cq_err_entry err = {0};
            fi_cq_readerr(cq, &err, 0);
            printf("error completion: %s\n", fi_strerror(err.err));
            return -1;
        }
        for (int i = 0; i < nothers; i++) {
            struct fi_cq_data_entry e[16];
            ssize_t m = fi_cq_read(others[i], e, 16);
            if (m > 0 && spill) *spill += (int)m;
        }
    }
    return got;
}

/* Nothing more arrives on cq within a while (its peers' CQs are polled meanwhile). */
static int quiet(struct fid_cq *cq, struct fid_cq **others, int nothers, int ms) {
    struct fi_cq_data_entry e[16];
    int spill = 0, n = 0;
    uint64_t deadline = now_ms() + ms;
    while (now_ms() < deadline) {
        ssize_t m = fi_cq_read(cq, e, 16);
        if (m > 0) n += (int)m;
        for (int i = 0; i < nothers; i++) fi_cq_read(others[i], e, 16);
    }
    (void)spill;
    return n;
}

/* ---------------------------------------------------------------------------------- event queue */

static void check_eq(void) {
    struct nic n;
    nic_open(&n, 0);
    for (int wait = 0; wait < 3; wait++) {
        enum fi_wait_obj obj = wait == 0 ? FI_WAIT_NONE : wait == 1 ? FI_WAIT_UNSPEC : FI_WAIT_FD;
        struct fi_eq_attr attr = {.size = 4, .flags = FI_WRITE, .wait_obj = obj};
        struct fid_eq *eq;
        EXPECT(fi_eq_open(n.fabric, &attr, &eq, NULL), 0);
        uint32_t event;
        struct fi_eq_entry entry = {.fid = &eq->fid, .context = &n}, got;
        EXPECT(fi_eq_read(eq, &event, &got, sizeof got, 0), -FI_EAGAIN);
        struct fi_eq_err_entry err = {0};
        EXPECT(fi_eq_readerr(eq, &err, 0), -FI_EAGAIN);
        for (int i = 0; i < 4; i++) EXPECT(fi_eq_write(eq, FI_NOTIFY, &entry, sizeof entry, 0), sizeof entry);
        EXPECT(fi_eq_write(eq, FI_NOTIFY, &entry, sizeof entry, 0), -FI_EAGAIN); /* the EQ holds `size` */
        if (obj == FI_WAIT_FD) {
            int fd = -1;
            EXPECT(fi_control(&eq->fid, FI_GETWAIT, &fd), 0);
            struct pollfd p = {.fd = fd, .events = POLLIN};
            EXPECT(poll(&p, 1, 0), 1);
        }
        memset(&got, 0, sizeof got);
        EXPECT(fi_eq_read(eq, &event, &got, sizeof got, FI_PEEK), sizeof got);
        CHECK(event == FI_NOTIFY && got.context == &n, "peeked event %u context %p", event, got.context);
        EXPECT(fi_eq_read(eq, &event, &got, 1, 0), -FI_ETOOSMALL);
        for (int i = 0; i < 4; i++) EXPECT(fi_eq_read(eq, &event, &got, sizeof got, 0), sizeof got);
        EXPECT(fi_eq_read(eq, &event, &got, sizeof got, 0), -FI_EAGAIN);
        if (obj != FI_WAIT_NONE) {
            uint64_t start = now_ms();
            EXPECT(fi_eq_sread(eq, &event, &got, sizeof got, 100, 0), -FI_EAGAIN);
            CHECK(now_ms() - start >= 90, "fi_eq_sread returned after %llu ms of its 100",
                  (unsigned long long)(now_ms() - start));
            EXPECT(fi_eq_write(eq, FI_NOTIFY, &entry, sizeof entry, 0), sizeof entry);
            EXPECT(fi_eq_sread(eq, &event, &got, sizeof got, 2000, 0), sizeof got);
            if (obj == FI_WAIT_FD) {
                int fd = -1;
                fi_control(&eq->fid, FI_GETWAIT, &fd);
                struct pollfd p = {.fd = fd, .events = POLLIN};
                EXPECT(poll(&p, 1, 0), 0);
            }
        } else {
            EXPECT(fi_eq_sread(eq, &event, &got, sizeof got, 10, 0), -FI_ENOSYS);
        }
        char text[64];
        CHECK(fi_eq_strerror(eq, FI_EIO, NULL, text, sizeof text) != NULL, "fi_eq_strerror gave NULL");
        EXPECT(fi_close(&n.fabric->fid), -FI_EBUSY); /* the EQ and the domain are still open */
        EXPECT(fi_close(&eq->fid), 0);
    }
    nic_close(&n);
}

/* ------------------------------------------------------------------------------------- counters */

static void check_cntr(void) {
    struct nic n;
    nic_open(&n, 0);
    struct fi_cntr_attr attr = {.events = FI_CNTR_EVENTS_COMP, .wait_obj = FI_WAIT_UNSPEC};
    struct fid_cntr *c;
    EXPECT(fi_cntr_open(n.domain, &attr, &c, NULL), 0);
    EXPECT(fi_cntr_read(c), 0);
    EXPECT(fi_cntr_add(c, 5), 0);
    EXPECT(fi_cntr_read(c), 5);
    EXPECT(fi_cntr_set(c, 2), 0);
    EXPECT(fi_cntr_read(c), 2);
    EXPECT(fi_cntr_adderr(c, 3), 0);
    EXPECT(fi_cntr_readerr(c), 3);
    EXPECT(fi_cntr_seterr(c, 0), 0);
    EXPECT(fi_cntr_readerr(c), 0);
    EXPECT(fi_cntr_wait(c, 2, 100), 0);
    uint64_t start = now_ms();
    EXPECT(fi_cntr_wait(c, 3, 100), -FI_ETIMEDOUT);
    CHECK(now_ms() - start >= 90, "fi_cntr_wait returned after %llu ms of its 100",
          (unsigned long long)(now_ms() - start));
    /* counting an endpoint's completions is not modeled: binding one says so */
    struct fid_cq *cq = cq_new(&n);
    struct fid_ep *ep;
    EXPECT(fi_endpoint(n.domain, n.info, &ep, NULL), 0);
    EXPECT(fi_ep_bind(ep, &c->fid, FI_SEND), -FI_ENOSYS);
    EXPECT(fi_close(&ep->fid), 0);
    EXPECT(fi_close(&cq->fid), 0);
    EXPECT(fi_close(&n.domain->fid), -FI_EBUSY); /* the counter is still open */
    EXPECT(fi_close(&c->fid), 0);
    nic_close(&n);
}

/* --------------------------------------------------------------------- completion queue entry points */

static void check_cq_wait(void) {
    struct nic n;
    nic_open(&n, 0);
    struct fi_cq_attr attr = {.format = FI_CQ_FORMAT_DATA, .wait_obj = FI_WAIT_UNSPEC, .size = 16};
    struct fid_cq *cq;
    EXPECT(fi_cq_open(n.domain, &attr, &cq, NULL), 0);
    struct fi_cq_data_entry e;
    fi_addr_t src;
    uint64_t start = now_ms();
    EXPECT(fi_cq_sread(cq, &e, 1, NULL, 100), -FI_EAGAIN);
    CHECK(now_ms() - start >= 90, "fi_cq_sread returned after %llu ms of its 100",
          (unsigned long long)(now_ms() - start));
    EXPECT(fi_cq_sreadfrom(cq, &e, 1, &src, NULL, 50), -FI_EAGAIN);
    EXPECT(fi_cq_signal(cq), 0);
    start = now_ms();
    EXPECT(fi_cq_sread(cq, &e, 1, NULL, 2000), -FI_EAGAIN);
    CHECK(now_ms() - start < 1000, "fi_cq_signal did not wake fi_cq_sread (%llu ms)",
          (unsigned long long)(now_ms() - start));
    char text[64];
    CHECK(fi_cq_strerror(cq, FI_EIO, NULL, text, sizeof text) != NULL, "fi_cq_strerror gave NULL");
    EXPECT(fi_close(&cq->fid), 0);
    /* a CQ opened without a wait object cannot be waited on (fi_cq(3)) */
    attr.wait_obj = FI_WAIT_NONE;
    EXPECT(fi_cq_open(n.domain, &attr, &cq, NULL), 0);
    EXPECT(fi_cq_sread(cq, &e, 1, NULL, 10), -FI_ENOSYS);
    EXPECT(fi_cq_signal(cq), -FI_ENOSYS);
    EXPECT(fi_close(&cq->fid), 0);
    nic_close(&n);
}

/* ------------------------------------------------------ what the model does not offer answers, never crashes */

static void check_unsupported_answer(void) {
    struct pair p;
    pair_open(&p);
    char buf[64] = {0};
    struct iovec iov = {buf, 8};
    struct fi_ioc ioc = {buf, 1};
    struct fi_rma_ioc rioc = {0, 1, 0};
    struct fi_msg_tagged tmsg = {.msg_iov = &iov, .iov_count = 1, .addr = p.to_y};
    struct fi_msg_atomic amsg = {.msg_iov = &ioc, .iov_count = 1, .addr = p.to_y, .rma_iov = &rioc, .rma_iov_count = 1,
                                 .datatype = FI_UINT64, .op = FI_SUM};
    struct fi_rma_iov riov = {0, 8, 0};
    struct fi_msg_rma rmsg = {.msg_iov = &iov, .iov_count = 1, .addr = p.to_y, .rma_iov = &riov, .rma_iov_count = 1};
    size_t count;
    /* tagged messages */
    EXPECT(fi_tsend(p.x.ep, buf, 8, NULL, p.to_y, 1, NULL), -FI_ENOSYS);
    EXPECT(fi_tsendv(p.x.ep, &iov, NULL, 1, p.to_y, 1, NULL), -FI_ENOSYS);
    EXPECT(fi_tsendmsg(p.x.ep, &tmsg, 0), -FI_ENOSYS);
    EXPECT(fi_tinject(p.x.ep, buf, 8, p.to_y, 1), -FI_ENOSYS);
    EXPECT(fi_tsenddata(p.x.ep, buf, 8, NULL, 1, p.to_y, 1, NULL), -FI_ENOSYS);
    EXPECT(fi_tinjectdata(p.x.ep, buf, 8, 1, p.to_y, 1), -FI_ENOSYS);
    EXPECT(fi_trecv(p.x.ep, buf, 8, NULL, p.to_y, 1, 0, NULL), -FI_ENOSYS);
    EXPECT(fi_trecvv(p.x.ep, &iov, NULL, 1, p.to_y, 1, 0, NULL), -FI_ENOSYS);
    EXPECT(fi_trecvmsg(p.x.ep, &tmsg, 0), -FI_ENOSYS);
    /* atomics */
    EXPECT(fi_atomic(p.x.ep, buf, 1, NULL, p.to_y, 0, 0, FI_UINT64, FI_SUM, NULL), -FI_ENOSYS);
    EXPECT(fi_atomicv(p.x.ep, &ioc, NULL, 1, p.to_y, 0, 0, FI_UINT64, FI_SUM, NULL), -FI_ENOSYS);
    EXPECT(fi_atomicmsg(p.x.ep, &amsg, 0), -FI_ENOSYS);
    EXPECT(fi_inject_atomic(p.x.ep, buf, 1, p.to_y, 0, 0, FI_UINT64, FI_SUM), -FI_ENOSYS);
    EXPECT(fi_fetch_atomic(p.x.ep, buf, 1, NULL, buf + 8, NULL, p.to_y, 0, 0, FI_UINT64, FI_SUM, NULL), -FI_ENOSYS);
    EXPECT(fi_fetch_atomicv(p.x.ep, &ioc, NULL, 1, &ioc, NULL, 1, p.to_y, 0, 0, FI_UINT64, FI_SUM, NULL), -FI_ENOSYS);
    EXPECT(fi_fetch_atomicmsg(p.x.ep, &amsg, &ioc, NULL, 1, 0), -FI_ENOSYS);
    EXPECT(fi_compare_atomic(p.x.ep, buf, 1, NULL, buf, NULL, buf + 8, NULL, p.to_y, 0, 0, FI_UINT64, FI_CSWAP, NULL),
           -FI_ENOSYS);
    EXPECT(fi_compare_atomicv(p.x.ep, &ioc, NULL, 1, &ioc, NULL, 1, &ioc, NULL, 1, p.to_y, 0, 0, FI_UINT64, FI_CSWAP,
                              NULL), -FI_ENOSYS);
    EXPECT(fi_compare_atomicmsg(p.x.ep, &amsg, &ioc, NULL, 1, &ioc, NULL, 1, 0), -FI_ENOSYS);
    EXPECT(fi_atomicvalid(p.x.ep, FI_UINT64, FI_SUM, &count), -FI_ENOSYS);
    EXPECT(fi_fetch_atomicvalid(p.x.ep, FI_UINT64, FI_SUM, &count), -FI_ENOSYS);
    EXPECT(fi_compare_atomicvalid(p.x.ep, FI_UINT64, FI_CSWAP, &count), -FI_ENOSYS);
    struct fi_atomic_attr aattr;
    EXPECT(fi_query_atomic(p.a.domain, FI_UINT64, FI_SUM, &aattr, 0), -FI_ENOSYS);
    /* reads */
    EXPECT(fi_read(p.x.ep, buf, 8, NULL, p.to_y, 0, 0, NULL), -FI_ENOSYS);
    EXPECT(fi_readv(p.x.ep, &iov, NULL, 1, p.to_y, 0, 0, NULL), -FI_ENOSYS);
    EXPECT(fi_readmsg(p.x.ep, &rmsg, 0), -FI_ENOSYS);
    /* connection management on a connectionless endpoint, scalable and shared contexts */
    size_t len = sizeof buf;
    EXPECT(fi_getpeer(p.x.ep, buf, &len), -FI_ENOSYS);
    EXPECT(fi_setname(&p.x.ep->fid, buf, 8), -FI_ENOSYS);
    EXPECT(fi_connect(p.x.ep, buf, NULL, 0), -FI_ENOSYS);
    EXPECT(fi_accept(p.x.ep, NULL, 0), -FI_ENOSYS);
    EXPECT(fi_shutdown(p.x.ep, 0), -FI_ENOSYS);
    struct fid_ep *ctx;
    EXPECT(fi_tx_context(p.x.ep, 0, NULL, &ctx, NULL), -FI_ENOSYS);
    EXPECT(fi_rx_context(p.x.ep, 0, NULL, &ctx, NULL), -FI_ENOSYS);
    EXPECT(fi_scalable_ep(p.a.domain, p.a.info, &ctx, NULL), -FI_ENOSYS);
    struct fid_stx *stx;
    EXPECT(fi_stx_context(p.a.domain, NULL, &stx, NULL), -FI_ENOSYS);
    EXPECT(fi_srx_context(p.a.domain, NULL, &ctx, NULL), -FI_ENOSYS);
    struct fi_poll_attr pattr = {0};
    struct fid_poll *pollset;
    EXPECT(fi_poll_open(p.a.domain, &pattr, &pollset), -FI_ENOSYS);
    struct fi_wait_attr wattr = {.wait_obj = FI_WAIT_UNSPEC};
    struct fid_wait *waitset;
    EXPECT(fi_wait_open(p.a.fabric, &wattr, &waitset), -FI_ENOSYS);
    struct fid_pep *pep;
    EXPECT(fi_passive_ep(p.a.fabric, p.a.info, &pep, NULL), -FI_ENOSYS);
    EXPECT(fi_barrier(p.x.ep, 0, NULL), -FI_ENOSYS);
    struct fi_av_set_attr sattr = {0};
    struct fid_av_set *set;
    EXPECT(fi_av_set(p.a.av, &sattr, &set, NULL), -FI_ENOSYS);
    EXPECT(fi_av_insertsvc(p.a.av, "localhost", "1", NULL, 0, NULL), -FI_ENOSYS);
    EXPECT(fi_av_insertsym(p.a.av, "localhost", 1, "1", 1, NULL, 0, NULL), -FI_ENOSYS);
    void *ops;
    EXPECT(fi_open_ops(&p.x.ep->fid, "none", 0, &ops, NULL), -FI_ENOSYS);
    EXPECT(fi_cancel(&p.x.ep->fid, NULL), -FI_ENOENT);
    /* a NULL address to insert is a bad argument, not a crash */
    fi_addr_t out;
    EXPECT(fi_av_insert(p.a.av, NULL, 1, &out, 0, NULL), -FI_EINVAL);
    pair_close(&p);
}

/* ---------------------------------------------------------------- the AV outlives its endpoints */

static void check_av_close_while_bound(void) {
    struct pair p;
    pair_open(&p);
    EXPECT(fi_close(&p.a.av->fid), -FI_EBUSY);
    char msg[16] = "still here";
    char got[16] = {0};
    EXPECT(fi_recv(p.y.ep, got, sizeof got, NULL, FI_ADDR_UNSPEC, NULL), 0);
    EXPECT(fi_send(p.x.ep, msg, sizeof msg, NULL, p.to_y, NULL), 0);
    struct fi_cq_data_entry e[2];
    struct fid_cq *others[] = {p.cqa};
    EXPECT(poll_cq(p.cqb, e, 1, others, 1, NULL), 1);
    CHECK(strcmp(got, msg) == 0, "received %s", got);
    EXPECT(fi_close(&p.a.domain->fid), -FI_EBUSY);
    EXPECT(fi_close(&p.cqa->fid), -FI_EBUSY); /* bound to x */
    pair_close(&p);
}

/* An address is inserted without asking its process (as EFA's address handles are made locally): a peer that
 * has already exited is in the AV, and what is sent to it completes with FI_EHOSTUNREACH. */
static void check_av_insert_gone_peer(void) {
    int fds[2];
    MUST(pipe(fds));
    pid_t child = fork();
    if (child == 0) { /* a peer that says its address and exits */
        struct nic n;
        nic_open(&n, 1);
        struct fid_cq *cq = cq_new(&n);
        struct node y;
        node_open(&y, &n, cq, cq, 0, 0);
        _exit(write(fds[1], y.addr, y.addrlen) == (ssize_t)y.addrlen ? 0 : 1);
    }
    char addr[64] = {0};
    CHECK(read(fds[0], addr, sizeof addr) == 32, "the peer's address");
    int status;
    waitpid(child, &status, 0);
    close(fds[0]);
    close(fds[1]);
    struct nic a;
    nic_open(&a, 0);
    struct fid_cq *cq = cq_new(&a);
    struct node x;
    node_open(&x, &a, cq, cq, 0, 0);
    fi_addr_t gone = FI_ADDR_NOTAVAIL;
    EXPECT(fi_av_insert(a.av, addr, 1, &gone, 0, NULL), 1);
    CHECK(gone != FI_ADDR_NOTAVAIL, "no fi_addr for a well-formed address");
    char text[64];
    size_t len = sizeof text;
    EXPECT(fi_av_lookup(a.av, gone, text, &len), 0);
    CHECK(len == 32 && !memcmp(text, addr, 32), "looked up %s", text);
    EXPECT(fi_send(x.ep, "bye", 4, NULL, gone, (void *)1), 0);
    struct fi_cq_data_entry e;
    EXPECT(fi_cq_read(cq, &e, 1), -FI_EAVAIL);
    struct fi_cq_err_entry err = {0};
    EXPECT(fi_cq_readerr(cq, &err, 0), 1);
    CHECK(err.err == FI_EHOSTUNREACH && err.op_context == (void *)1, "error %d context %p", err.err, err.op_context);
    EXPECT(fi_av_remove(a.av, &gone, 1, 0), 0);
    EXPECT(fi_close(&x.ep->fid), 0);
    EXPECT(fi_close(&cq->fid), 0);
    nic_close(&a);
}

/* ------------------------------------------------------------------ separate and shared CQs */

static void check_separate_cqs(void) {
    struct nic a, b;
    nic_open(&a, 0);
    nic_open(&b, 1);
    struct fid_cq *txa = cq_new(&a), *rxa = cq_new(&a), *txb = cq_new(&b), *rxb = cq_new(&b);
    struct node x, y;
    node_open(&x, &a, txa, rxa, 0, 0);
    node_open(&y, &b, txb, rxb, 0, 0);
    EXPECT(fi_ep_bind(x.ep, &txa->fid, FI_TRANSMIT), -FI_EOPBADSTATE); /* bindings come before fi_enable */
    struct fid_ep *z;
    MUST(fi_endpoint(a.domain, a.info, &z, NULL));
    EXPECT(fi_ep_bind(z, &txb->fid, FI_TRANSMIT), -FI_EINVAL); /* a CQ of another domain */
    EXPECT(fi_ep_bind(z, &txa->fid, FI_TRANSMIT), 0);
    EXPECT(fi_ep_bind(z, &rxa->fid, FI_TRANSMIT), -FI_EINVAL); /* it has a transmit CQ already */
    EXPECT(fi_ep_bind(z, &rxa->fid, 0), -FI_EBADFLAGS);       /* neither direction */
    EXPECT(fi_enable(z), -FI_ENOAV);
    EXPECT(fi_close(&z->fid), 0);
    fi_addr_t to_y = insert(&a, &y), to_x = insert(&b, &x);
    int msg = 7, got = 0, back = 0;
    EXPECT(fi_recv(y.ep, &got, sizeof got, NULL, FI_ADDR_UNSPEC, &got), 0);
    EXPECT(fi_recv(x.ep, &back, sizeof back, NULL, FI_ADDR_UNSPEC, &back), 0);
    EXPECT(fi_send(x.ep, &msg, sizeof msg, NULL, to_y, &msg), 0);
    struct fi_cq_data_entry e[4];
    struct fid_cq *ys[] = {txb};
    EXPECT(poll_cq(rxb, e, 1, ys, 1, NULL), 1);
    CHECK(e[0].op_context == &got && (e[0].flags & FI_RECV) && got == 7, "receive completion %p flags %llx got %d",
          e[0].op_context, (unsigned long long)e[0].flags, got);
    EXPECT(poll_cq(txa, e, 1, NULL, 0, NULL), 1);
    CHECK(e[0].op_context == &msg && (e[0].flags & FI_SEND), "send completion %p flags %llx", e[0].op_context,
          (unsigned long long)e[0].flags);
    EXPECT(fi_send(y.ep, &msg, sizeof msg, NULL, to_x, &msg), 0);
    struct fid_cq *rest[] = {txb};
    EXPECT(poll_cq(rxa, e, 1, rest, 1, NULL), 1);
    CHECK(e[0].op_context == &back && back == 7, "the reply's completion %p", e[0].op_context);
    struct fid_cq *none[] = {rxb, txb};
    EXPECT(quiet(txa, none, 2, 20), 0); /* nothing on the wrong queue */
    /* a writer that reads only its receive CQ still gets its queued writes out: 8 MiB wait for the line */
    enum { MIB = 1 << 20, WRITES = 8 };
    char *region = calloc(1, MIB);
    struct fid_mr *mr;
    MUST(fi_mr_reg(b.domain, region, MIB, FI_REMOTE_WRITE, 0, 0, 0, &mr, NULL));
    for (int i = 0; i < WRITES; i++)
        EXPECT(fi_writedata(x.ep, region, MIB, NULL, i, to_y, (uint64_t)(uintptr_t)region, fi_mr_key(mr), NULL), 0);
    struct fi_cq_data_entry data[WRITES];
    struct fid_cq *writer_rx[] = {rxa};
    EXPECT(poll_cq(rxb, data, WRITES, writer_rx, 1, NULL), WRITES);
    EXPECT(poll_cq(txa, data, WRITES, NULL, 0, NULL), WRITES);
    EXPECT(fi_close(&mr->fid), 0);
    free(region);
    EXPECT(fi_close(&x.ep->fid), 0);
    EXPECT(fi_close(&y.ep->fid), 0);
    struct fid_cq *cqs[] = {txa, rxa, txb, rxb};
    for (int i = 0; i < 4; i++) EXPECT(fi_close(&cqs[i]->fid), 0);
    nic_close(&a);
    nic_close(&b);
}

static void check_shared_cq(void) {
    struct nic a, b;
    nic_open(&a, 0);
    nic_open(&b, 1);
    struct fid_cq *shared = cq_new(&a), *cqb = cq_new(&b);
    struct node x1, x2, y;
    node_open(&x1, &a, shared, shared, 0, 0);
    node_open(&x2, &a, shared, shared, 0, 0); /* a second endpoint on the same CQ (the Engine's renewal) */
    node_open(&y, &b, cqb, cqb, 0, 0);
    fi_addr_t to_x1 = insert(&b, &x1), to_x2 = insert(&b, &x2), to_y = insert(&a, &y);
    char buf[4096];
    struct fid_mr *mr;
    MUST(fi_mr_reg(a.domain, buf, sizeof buf, FI_REMOTE_WRITE, 0, 0, 0, &mr, NULL));
    uint64_t key = fi_mr_key(mr);
    EXPECT(fi_writedata(y.ep, buf, 64, NULL, 1, to_x1, (uint64_t)(uintptr_t)buf, key, NULL), 0);
    EXPECT(fi_writedata(y.ep, buf, 64, NULL, 2, to_x2, (uint64_t)(uintptr_t)buf, key, NULL), 0);
    EXPECT(fi_send(x1.ep, buf, 8, NULL, to_y, (void *)1), 0);
    EXPECT(fi_send(x2.ep, buf, 8, NULL, to_y, (void *)2), 0);
    char sink[2][8];
    EXPECT(fi_recv(y.ep, sink[0], 8, NULL, FI_ADDR_UNSPEC, NULL), 0);
    EXPECT(fi_recv(y.ep, sink[1], 8, NULL, FI_ADDR_UNSPEC, NULL), 0);
    struct fi_cq_data_entry e[4];
    struct fid_cq *others[] = {cqb};
    EXPECT(poll_cq(shared, e, 4, others, 1, NULL), 4);
    int data = 0, sends = 0;
    for (int i = 0; i < 4; i++) {
        if (e[i].flags & FI_REMOTE_CQ_DATA) data |= 1 << e[i].data;
        if (e[i].flags & FI_SEND) sends |= 1 << (uintptr_t)e[i].op_context;
    }
    CHECK(data == 6 && sends == 6, "immediate data from both endpoints %x, sends of both %x", data, sends);
    EXPECT(fi_close(&shared->fid), -FI_EBUSY);
    EXPECT(fi_close(&x1.ep->fid), 0);
    EXPECT(fi_close(&shared->fid), -FI_EBUSY); /* x2 still uses it */
    EXPECT(fi_close(&x2.ep->fid), 0);
    EXPECT(fi_close(&mr->fid), 0);
    EXPECT(fi_close(&shared->fid), 0);
    EXPECT(fi_close(&y.ep->fid), 0);
    EXPECT(fi_close(&cqb->fid), 0);
    (void)to_x2;
    nic_close(&a);
    nic_close(&b);
}

/* --------------------------------------------------------------------------- selective completion */

static void check_selective_completion(void) {
    struct nic a, b;
    nic_open(&a, 0);
    nic_open(&b, 1);
    struct fid_cq *cqa = cq_new(&a), *cqs = cq_new(&a), *cqb = cq_new(&b);
    struct node all, sel, y;
    node_open(&all, &a, cqa, cqa, 0, 0);
    a.info->tx_attr->op_flags = FI_COMPLETION; /* the default flags of sel's calls without flags (fi_write) */
    node_open(&sel, &a, cqs, cqs, FI_SELECTIVE_COMPLETION, 0);
    node_open(&y, &b, cqb, cqb, 0, 0);
    fi_addr_t to_y = insert(&a, &y);
    char buf[4096];
    struct fid_mr *mr;
    MUST(fi_mr_reg(b.domain, buf, sizeof buf, FI_REMOTE_WRITE, 0, 0, 0, &mr, NULL));
    struct iovec iov = {buf, 64};
    struct fi_rma_iov riov = {(uint64_t)(uintptr_t)buf, 64, fi_mr_key(mr)};
    struct fi_msg_rma m = {.msg_iov = &iov, .iov_count = 1, .addr = to_y, .rma_iov = &riov, .rma_iov_count = 1,
                           .context = (void *)1};
    struct fi_cq_data_entry e[4];
    struct fid_cq *others[] = {cqb};
    /* without FI_SELECTIVE_COMPLETION every operation completes, FI_COMPLETION or not (fi_endpoint(3)) */
    EXPECT(fi_writemsg(all.ep, &m, 0), 0);
    EXPECT(poll_cq(cqa, e, 1, others, 1, NULL), 1);
    CHECK(e[0].op_context == (void *)1, "completion context %p", e[0].op_context);
    /* with it, only those posted with FI_COMPLETION (and fi_write, whose flags are the endpoint's defaults) */
    EXPECT(fi_writemsg(sel.ep, &m, 0), 0);
    m.context = (void *)2;
    EXPECT(fi_writemsg(sel.ep, &m, FI_COMPLETION), 0);
    EXPECT(fi_write(sel.ep, buf, 64, NULL, to_y, riov.addr, riov.key, (void *)3), 0);
    struct iovec siov = {buf, 8};
    struct fi_msg s = {.msg_iov = &siov, .iov_count = 1, .addr = to_y, .context = (void *)4};
    char sink[8];
    EXPECT(fi_recv(y.ep, sink, 8, NULL, FI_ADDR_UNSPEC, NULL), 0);
    EXPECT(fi_sendmsg(sel.ep, &s, 0), 0);
    EXPECT(poll_cq(cqs, e, 2, others, 1, NULL), 2);
    CHECK(e[0].op_context == (void *)2 && e[1].op_context == (void *)3, "completions %p %p", e[0].op_context,
          e[1].op_context);
    EXPECT(quiet(cqs, others, 1, 20), 0);
    EXPECT(fi_close(&all.ep->fid), 0);
    EXPECT(fi_close(&sel.ep->fid), 0);
    EXPECT(fi_close(&y.ep->fid), 0);
    EXPECT(fi_close(&mr->fid), 0);
    EXPECT(fi_close(&cqa->fid), 0);
    EXPECT(fi_close(&cqs->fid), 0);
    EXPECT(fi_close(&cqb->fid), 0);
    nic_close(&a);
    nic_close(&b);
}

/* ------------------------------------------------------- write and writedata with verification */

static void check_write_verified(void) {
    setenv("FABRICLAB_SIM_PAYLOAD", "1", 1); /* the model moves bytes only in payload mode */
    struct pair p;
    pair_open(&p);
    enum { SIZE = 1 << 20 };
    unsigned char *src = malloc(SIZE), *dst = calloc(1, SIZE);
    for (int i = 0; i < SIZE; i++) src[i] = (unsigned char)(i * 7 + 3);
    struct fid_mr *ms, *md;
    MUST(fi_mr_reg(p.a.domain, src, SIZE, FI_WRITE, 0, 0, 0, &ms, NULL));
    MUST(fi_mr_reg(p.b.domain, dst, SIZE, FI_REMOTE_WRITE, 0, 0, 0, &md, NULL));
    uint64_t base = (uint64_t)(uintptr_t)dst, key = fi_mr_key(md);
    EXPECT(fi_write(p.x.ep, src, SIZE / 2, fi_mr_desc(ms), p.to_y, base, key, (void *)1), 0);
    EXPECT(fi_writedata(p.x.ep, src + SIZE / 2, SIZE / 2, fi_mr_desc(ms), 0xabcd, p.to_y, base + SIZE / 2, key,
                        (void *)2), 0);
    struct fi_cq_data_entry e[2];
    struct fid_cq *others[] = {p.cqb};
    int spill = 0;
    EXPECT(poll_cq(p.cqa, e, 2, NULL, 0, NULL), 2);
    EXPECT(poll_cq(p.cqb, e, 1, NULL, 0, &spill), 1);
    CHECK((e[0].flags & FI_REMOTE_CQ_DATA) && e[0].data == 0xabcd && e[0].len == SIZE / 2,
          "target completion flags %llx data %llx len %zu", (unsigned long long)e[0].flags,
          (unsigned long long)e[0].data, e[0].len);
    CHECK(memcmp(src, dst, SIZE) == 0, "the written bytes differ from the source");
    EXPECT(quiet(p.cqb, others, 0, 10), 0); /* a write without data leaves nothing at the target */
    EXPECT(fi_close(&ms->fid), 0);
    EXPECT(fi_close(&md->fid), 0);
    pair_close(&p);
    free(src);
    free(dst);
}

/* ------------------------------------------------------------------- failed writes' error completions */

enum { FAILED_WRITES = 1000, TX_DEPTH = 4096 };

/* Read error completions with fi_cq_readerr alone (no fi_cq_read between) until `want` came or TIMEOUT_MS * 2
 * passed: each must be a refused write (FI_EKEYREJECTED) of context 1..want, read once. Returns how many came. */
static int read_failed_writes(struct fid_cq *cq, int want) {
    static unsigned char seen[FAILED_WRITES + 1];
    memset(seen, 0, sizeof seen);
    int errors = 0;
    uint64_t deadline = now_ms() + 2 * TIMEOUT_MS; /* a bound on a hang, not a speed: errors are due at once */
    while (errors < want && now_ms() < deadline) {
        struct fi_cq_err_entry err = {0};
        if (fi_cq_readerr(cq, &err, 0) != 1) continue;
        uintptr_t at = (uintptr_t)err.op_context;
        CHECK(err.err == FI_EKEYREJECTED && at >= 1 && at <= (uintptr_t)want && !seen[at],
              "error %d (%s) context %p", err.err, fi_strerror(err.err), err.op_context);
        if (at >= 1 && at <= (uintptr_t)want) seen[at] = 1;
        errors++;
        /* libfabric's rule: while an error is available, fi_cq_read answers -FI_EAVAIL */
        struct fi_cq_data_entry e;
        if (errors == 1) EXPECT(fi_cq_read(cq, &e, 1), -FI_EAVAIL);
    }
    return errors;
}

/* Sends (more than the transmit queue holds) complete and arrive once the errors are read: normal reads resume.
 * With nothing older in the queue (`extra` 0) the failed writes' transmit slots are all free: it takes as many
 * sends as it holds before any poll. The `extra` older operations' completions come among the sends'. */
static void sends_complete(struct pair *p, int sends, int extra) {
    static char msg[64], landing[64];
    int posted = 0, done = 0, received = 0;
    for (int i = 0; i < sends; i++) EXPECT(fi_recv(p->y.ep, landing, sizeof landing, NULL, FI_ADDR_UNSPEC, NULL), 0);
    while (posted < sends && fi_send(p->x.ep, msg, sizeof msg, NULL, p->to_y, NULL) == 0) posted++;
    CHECK(extra || posted == TX_DEPTH, "%d sends taken before a poll: the failed writes' transmit slots are not free",
          posted);
    uint64_t deadline = now_ms() + 2 * TIMEOUT_MS;
    while ((done < sends + extra || received < sends) && now_ms() < deadline) {
        while (posted < sends && fi_send(p->x.ep, msg, sizeof msg, NULL, p->to_y, NULL) == 0) posted++;
        struct fi_cq_data_entry e[16];
        ssize_t n = fi_cq_read(p->cqa, e, 16);
        if (n > 0) done += (int)n;
        CHECK(n > 0 || n == -FI_EAGAIN, "fi_cq_read during the sends: %zd (%s)", n, fi_strerror((int)-n));
        if (n < 0 && n != -FI_EAGAIN) return;
        n = fi_cq_read(p->cqb, e, 16);
        if (n > 0) received += (int)n;
    }
    CHECK(posted == sends && done == sends + extra && received == sends,
          "%d of %d sends posted, %d of %d completions, %d received", posted, sends, done, sends + extra, received);
}

/* 1,000 writes the remote NIC refuses (a bad key), behind a write whose doorbell has not rung (FI_MORE), then
 * alone: every error completion is due at its post, waits for no older operation (no ordering promise) and
 * is readable through fi_cq_readerr alone, also past the CQ's 256 error entries. After them fi_cq_read
 * answers -FI_EAGAIN (no error left), and more sends than the transmit queue holds complete, the held write
 * among them once the first send rings the doorbell. */
static void check_failed_writes(void) {
    struct pair p;
    pair_open(&p);
    static char src[64], dst[4096];
    struct fid_mr *md;
    MUST(fi_mr_reg(p.b.domain, dst, sizeof dst, FI_REMOTE_WRITE, 0, 0, 0, &md, NULL));
    struct iovec iov = {src, sizeof src};
    struct fi_rma_iov rma = {(uint64_t)(uintptr_t)dst, sizeof src, fi_mr_key(md)};
    struct fi_msg_rma msg = {.msg_iov = &iov, .iov_count = 1, .addr = p.to_y, .rma_iov = &rma, .rma_iov_count = 1,
                             .context = (void *)(uintptr_t)(FAILED_WRITES + 1)};
    for (int held = 1; held >= 0; held--) {
        if (held) EXPECT(fi_writemsg(p.x.ep, &msg, FI_COMPLETION | FI_MORE), 0); /* a good write, held */
        rma.key ^= 1;
        for (int i = 1; i <= FAILED_WRITES; i++) {
            msg.context = (void *)(uintptr_t)i;
            ssize_t rc = fi_writemsg(p.x.ep, &msg, FI_COMPLETION | (held ? FI_MORE : 0));
            CHECK(rc == 0, "write %d: %zd (%s)", i, rc, fi_strerror((int)-rc));
            if (rc) break;
        }
        rma.key ^= 1;
        int errors = read_failed_writes(p.cqa, FAILED_WRITES);
        CHECK(errors == FAILED_WRITES, "%s: %d of %d error completions read", held ? "behind a held write" : "alone",
              errors, FAILED_WRITES);
        struct fi_cq_data_entry e;
        EXPECT(fi_cq_read(p.cqa, &e, 1), -FI_EAGAIN);
        sends_complete(&p, TX_DEPTH + 1000, held);
    }
    EXPECT(fi_close(&md->fid), 0);
    pair_close(&p);
}

/* ---------------------------------------------------------- gather and scatter up to the iov limits */

static void check_iov_limits(void) {
    setenv("FABRICLAB_SIM_PAYLOAD", "1", 1);
    struct nic a, b;
    nic_open(&a, 0);
    nic_open(&b, 1);
    CHECK(a.info->tx_attr->iov_limit == 4 && a.info->rx_attr->iov_limit == 4 && a.info->tx_attr->rma_iov_limit == 1,
          "iov limits %zu %zu %zu", a.info->tx_attr->iov_limit, a.info->rx_attr->iov_limit,
          a.info->tx_attr->rma_iov_limit);
    struct fid_cq *cqa = cq_new(&a), *cqb = cq_new(&b);
    struct node x, y;
    node_open(&x, &a, cqa, cqa, 0, 0);
    node_open(&y, &b, cqb, cqb, 0, 0);
    fi_addr_t to_y = insert(&a, &y);
    char src[4][16], dst[4][16], flat[64] = {0};
    struct iovec siov[5], riov[4];
    for (int i = 0; i < 4; i++) {
        memset(src[i], 'a' + i, 16);
        memset(dst[i], 0, 16);
        siov[i] = (struct iovec){src[i], i + 1};
        riov[i] = (struct iovec){dst[i], 3};
    }
    siov[4] = siov[3];
    EXPECT(fi_recvv(y.ep, riov, NULL, 4, FI_ADDR_UNSPEC, NULL), 0);
    EXPECT(fi_sendv(x.ep, siov, NULL, 4, to_y, NULL), 0);
    EXPECT(fi_sendv(x.ep, siov, NULL, 5, to_y, NULL), -FI_EINVAL);
    struct fi_cq_data_entry e[2];
    EXPECT(poll_cq(cqb, e, 1, NULL, 0, NULL), 1);
    CHECK(e[0].len == 10, "received %zu bytes of 10", e[0].len);
    /* 1 + 2 + 3 + 4 bytes, scattered 3 a receive piece: a bb cc | c dd | dd */
    CHECK(memcmp(dst[0], "abb", 3) == 0 && memcmp(dst[1], "ccc", 3) == 0 && memcmp(dst[2], "ddd", 3) == 0 &&
          dst[3][0] == 'd', "scattered %.3s %.3s %.3s %.1s", dst[0], dst[1], dst[2], dst[3]);
    struct fid_mr *md;
    MUST(fi_mr_reg(b.domain, flat, sizeof flat, FI_REMOTE_WRITE, 0, 0, 0, &md, NULL));
    EXPECT(fi_writev(x.ep, siov, NULL, 4, to_y, (uint64_t)(uintptr_t)flat, fi_mr_key(md), NULL), 0);
    struct fid_cq *peer[] = {cqb};
    EXPECT(poll_cq(cqa, e, 2, peer, 1, NULL), 2); /* the send's and the write's */
    CHECK(memcmp(flat, "abbcccdddd", 10) == 0, "gathered write %.10s", flat);
    EXPECT(fi_close(&md->fid), 0);
    EXPECT(fi_close(&x.ep->fid), 0);
    EXPECT(fi_close(&y.ep->fid), 0);
    EXPECT(fi_close(&cqa->fid), 0);
    EXPECT(fi_close(&cqb->fid), 0);
    nic_close(&a);
    nic_close(&b);
}

/* ------------------------------------------------------------------------- fi_getinfo's rules */

static struct fi_info *getinfo_with(uint64_t flags, const char *node, void (*edit)(struct fi_info *), int *rc) {
    struct fi_info *hints = hints_for(0), *info = NULL;
    if (edit) edit(hints);
    *rc = fi_getinfo(API, node, NULL, flags, hints, &info);
    fi_freeinfo(hints);
    return info;
}

static void hint_manual(struct fi_info *h) {
    h->domain_attr->data_progress = h->domain_attr->control_progress = FI_PROGRESS_MANUAL;
}
static void hint_waw(struct fi_info *h) { h->tx_attr->msg_order = FI_ORDER_WAW; }
static void hint_sas(struct fi_info *h) { h->tx_attr->msg_order = h->rx_attr->msg_order = FI_ORDER_SAS; }
static void hint_basic(struct fi_info *h) { h->domain_attr->mr_mode = FI_MR_BASIC; }
static void hint_no_prov_key(struct fi_info *h) {
    h->domain_attr->mr_mode = FI_MR_LOCAL | FI_MR_VIRT_ADDR | FI_MR_ALLOCATED;
}
static void hint_no_prov_key_any_caps(struct fi_info *h) {
    hint_no_prov_key(h);
    h->caps = 0;
}
static void hint_iov(struct fi_info *h) { h->tx_attr->iov_limit = 5; }
static void hint_tagged(struct fi_info *h) { h->caps |= FI_TAGGED; }
static void hint_msg_size(struct fi_info *h) { h->ep_attr->max_msg_size = (size_t)1 << 40; }

static void getinfo_fields(void) {
    /* the p5's fi_info -p efa, field by field (../shared/reference/figures.md), where the model offers it;
     * asked as fi_info asks: any mode, any registration mode */
    struct fi_info *hints = fi_allocinfo(), *info = NULL;
    hints->fabric_attr->prov_name = strdup("sim");
    hints->mode = ~0ull;
    hints->domain_attr->mr_mode = ~(FI_MR_BASIC | FI_MR_SCALABLE);
    EXPECT(fi_getinfo(API, NULL, NULL, 0, hints, &info), 0);
    fi_freeinfo(hints);
    int n = 0;
    for (struct fi_info *p = info; p; p = p->next) n++;
    CHECK(n == 32, "%d domains", n);
    struct fi_domain_attr *d = info->domain_attr;
    CHECK(d->mr_mode == (FI_MR_VIRT_ADDR | FI_MR_ALLOCATED | FI_MR_PROV_KEY | FI_MR_HMEM),
          "mr_mode %s", fi_tostr(&d->mr_mode, FI_TYPE_MR_MODE));
    CHECK(d->threading == FI_THREAD_SAFE && d->data_progress == FI_PROGRESS_AUTO &&
          d->control_progress == FI_PROGRESS_AUTO && d->resource_mgmt == FI_RM_ENABLED && d->av_type == FI_AV_TABLE,
          "threading/progress/rm/av");
    CHECK(d->mr_key_size == 4 && d->cq_data_size == 4 && d->cq_cnt == 512 && d->mr_iov_limit == 1 &&
          d->mr_cnt == 262144 && d->cntr_cnt == 0, "key %zu data %zu cq %zu mr_iov %zu mr_cnt %zu cntr %zu",
          d->mr_key_size, d->cq_data_size, d->cq_cnt, d->mr_iov_limit, d->mr_cnt, d->cntr_cnt);
    CHECK(info->tx_attr->msg_order == FI_ORDER_SAS && info->rx_attr->msg_order == FI_ORDER_SAS,
          "msg_order %llx %llx", (unsigned long long)info->tx_attr->msg_order,
          (unsigned long long)info->rx_attr->msg_order);
    CHECK(info->tx_attr->inject_size == 4096 && info->tx_attr->size == 4096 && info->rx_attr->size == 8192,
          "inject %zu tx %zu rx %zu", info->tx_attr->inject_size, info->tx_attr->size, info->rx_attr->size);
    CHECK(info->src_addr && info->src_addrlen == 32, "source address %p of %zu bytes", info->src_addr,
          info->src_addrlen);
    CHECK(info->mode == 0 && info->ep_attr->type == FI_EP_RDM, "mode %llx", (unsigned long long)info->mode);
    fi_freeinfo(info);
}

static void getinfo_hints(void) {
    int rc;
    struct fi_info *info;
    /* hints are honoured, and what cannot be had is no data (fi_getinfo(3)) */
    info = getinfo_with(0, NULL, hint_manual, &rc);
    CHECK(rc == 0 && info->domain_attr->data_progress == FI_PROGRESS_MANUAL &&
          info->domain_attr->control_progress == FI_PROGRESS_MANUAL, "manual progress: %d", rc);
    fi_freeinfo(info);
    info = getinfo_with(0, NULL, hint_waw, &rc);
    CHECK(rc == -FI_ENODATA, "write-after-write order offered: %d", rc);
    fi_freeinfo(info);
    info = getinfo_with(0, NULL, hint_sas, &rc);
    CHECK(rc == 0, "send-after-send order refused: %d", rc);
    fi_freeinfo(info);
    info = getinfo_with(0, NULL, hint_iov, &rc);
    CHECK(rc == -FI_ENODATA, "iov_limit 5 offered: %d", rc);
    fi_freeinfo(info);
    info = getinfo_with(0, NULL, hint_tagged, &rc);
    CHECK(rc == -FI_ENODATA, "FI_TAGGED offered: %d", rc);
    fi_freeinfo(info);
    info = getinfo_with(0, NULL, hint_msg_size, &rc);
    CHECK(rc == -FI_ENODATA, "a 1 TiB max_msg_size offered: %d", rc);
    fi_freeinfo(info);
    info = getinfo_with(0, NULL, hint_basic, &rc);
    CHECK(rc == 0 && info->domain_attr->mr_mode == FI_MR_BASIC, "FI_MR_BASIC: %d", rc);
    fi_freeinfo(info);
    /* an application that cannot use provider keys cannot be written to (libfabric's ofi_check_mr_mode and
     * ofi_get_info_caps): asking for RMA without them is no data; asking for no capability in particular
     * gets an answer without FI_REMOTE_WRITE */
    info = getinfo_with(0, NULL, hint_no_prov_key, &rc);
    CHECK(rc == -FI_ENODATA, "RMA target without FI_MR_PROV_KEY offered: %d", rc);
    fi_freeinfo(info);
    info = getinfo_with(0, NULL, hint_no_prov_key_any_caps, &rc);
    CHECK(rc == 0 && !(info->caps & FI_REMOTE_WRITE) && !(info->domain_attr->mr_mode & FI_MR_PROV_KEY),
          "mr_mode without FI_MR_PROV_KEY: %d caps %llx", rc, info ? (unsigned long long)info->caps : 0ull);
    fi_freeinfo(info);
}

static void getinfo_addresses(void) {
    int rc;
    struct fi_info *info;
    /* addresses: a source address always; a node is the peer's address (FI_SOURCE: our own NIC's) */
    info = getinfo_with(0, NULL, NULL, &rc);
    char nic_addr[64];
    snprintf(nic_addr, sizeof nic_addr, "%s", (char *)info->src_addr);
    fi_freeinfo(info);
    info = getinfo_with(FI_SOURCE, nic_addr, NULL, &rc);
    CHECK(rc == 0 && info->src_addr && !strcmp(info->src_addr, nic_addr), "FI_SOURCE %s: %d", nic_addr, rc);
    fi_freeinfo(info);
    info = getinfo_with(0, "localhost", NULL, &rc);
    CHECK(rc == -FI_ENODATA, "the node localhost is no sim address: %d", rc);
    fi_freeinfo(info);
    struct nic a;
    nic_open(&a, 0);
    struct fid_cq *cq = cq_new(&a);
    struct node x;
    node_open(&x, &a, cq, cq, 0, 0);
    CHECK(x.addrlen == 32, "fi_getname gave %zu bytes", x.addrlen);
    info = getinfo_with(0, x.addr, NULL, &rc);
    CHECK(rc == 0 && info->dest_addr && info->dest_addrlen == 32 && !memcmp(info->dest_addr, x.addr, 32),
          "destination %s: %d", x.addr, rc);
    fi_freeinfo(info);
    EXPECT(fi_close(&x.ep->fid), 0);
    EXPECT(fi_close(&cq->fid), 0);
    nic_close(&a);
}

static void check_getinfo(void) {
    getinfo_fields();
    getinfo_hints();
    getinfo_addresses();
}

/* -------------------------------------------------------------- FI_THREAD_SAFE across a domain */

#define THREAD_MSGS 2000
struct sender { struct node *node; fi_addr_t dest; int id; struct nic *nic; };

static void *send_many(void *arg) {
    struct sender *s = arg;
    int sent = 0, done = 0;
    uint32_t msg[2] = {(uint32_t)s->id, 0};
    uint64_t deadline = now_ms() + 4 * TIMEOUT_MS;
    while (done < THREAD_MSGS && now_ms() < deadline) {
        if (sent < THREAD_MSGS) {
            msg[1] = (uint32_t)sent;
            ssize_t rc = fi_inject(s->node->ep, msg, sizeof msg, s->dest);
            if (rc == 0) {
                sent++;
                done++; /* injects complete nothing */
            }
        }
        struct fi_cq_data_entry e[16];
        fi_cq_read(s->node->txcq, e, 16);
    }
    return NULL;
}

static void *register_many(void *arg) {
    struct nic *n = arg;
    static char region[64][64];
    for (int round = 0; round < 50; round++) {
        struct fid_mr *mr[64];
        for (int i = 0; i < 64; i++) MUST(fi_mr_reg(n->domain, region[i], 64, FI_REMOTE_WRITE, 0, 0, 0, &mr[i], NULL));
        for (int i = 0; i < 64; i++) fi_close(&mr[i]->fid);
    }
    return NULL;
}

/* ------------------------------------------------------------ the modeled host's extension */

#define HOST_LINES 600 /* more shared lines than the model follows at once */
static const struct fi_sim_host_ops *host;
static uint64_t host_line[64] __attribute__((aligned(64)));

struct line_share {
    uintptr_t which; /* an index into host_line: 0, 8, 16, ... are lines of their own */
    int core;        /* where the thread sits on the modeled host */
    uint64_t moves, host_ns;
};

/* A thread placed on its core accesses one line 20000 times; counts the line's moves and what they cost. */
static void *share_line(void *arg) {
    struct line_share *s = arg;
    struct fi_sim_counts before, after;
    host->place(s->core);
    host->counts(&before);
    for (int i = 0; i < 20000; i++) {
        host->access_begin();
        __atomic_fetch_add(&host_line[s->which], 1, __ATOMIC_RELAXED);
        host->access_end(&host_line[s->which]);
    }
    host->counts(&after);
    s->moves = after.line_moves - before.line_moves;
    s->host_ns = after.host_ns - before.host_ns;
    return NULL;
}

/* Two threads on the given cores share one line; returns the moves of both, and their mean cost in *ns. */
static uint64_t moves_on_one_line(uintptr_t which, int core_a, int core_b, double *ns) {
    pthread_t a, b;
    struct line_share sa = {which, core_a, 0, 0}, sb = {which, core_b, 0, 0};
    pthread_create(&a, NULL, share_line, &sa);
    pthread_create(&b, NULL, share_line, &sb);
    pthread_join(a, NULL);
    pthread_join(b, NULL);
    uint64_t moves = sa.moves + sb.moves;
    if (ns) *ns = moves ? (double)(sa.host_ns + sb.host_ns) / (double)moves : 0;
    return moves;
}

/* The extension answers (or, with FABRICLAB_SIM_TIME=wall, is refused): a thread's clock moves forward with
 * its polls, two threads that share a line move it, and lines of runs long over are reused, so that a
 * process running many runs keeps being charged. */
static void check_host(void) {
    struct nic a;
    nic_open(&a, 0);
    struct fid_cq *cq = cq_new(&a);
    const char *mode = getenv("FABRICLAB_SIM_TIME");
    int rc = fi_open_ops(&cq->fid, FI_SIM_HOST_OPS, 0, (void **)&host, NULL);
    if (mode && !strcmp(mode, "wall")) {
        CHECK(rc == -FI_ENOSYS, "with FABRICLAB_SIM_TIME=wall the modeled clock is refused: %d", rc);
    } else {
        EXPECT(rc, 0);
        EXPECT(fi_open_ops(&cq->fid, "no_such_ops", 0, (void **)&host, NULL), -FI_ENOSYS);
        EXPECT(fi_open_ops(&cq->fid, FI_SIM_HOST_OPS, 0, (void **)&host, NULL), 0);
        struct fi_cq_data_entry e;
        uint64_t t0 = host->now_ns();
        for (int i = 0; i < 10; i++) EXPECT(fi_cq_read(cq, &e, 1), -FI_EAGAIN);
        CHECK(host->now_ns() > t0, "ten empty polls moved the clock from %llu to %llu", (unsigned long long)t0,
              (unsigned long long)host->now_ns());
        /* a p5's EPYC 7R13: a line moves fastest within a core complex (cores 0-7), slower from another
         * complex of the socket (8-15), slowest from the other socket (48-95) */
        double complex_ns, socket_ns, cross_ns;
        CHECK(moves_on_one_line(0, 0, 1, &complex_ns) > 0, "two threads sharing a line never moved it");
        CHECK(moves_on_one_line(8, 0, 8, &socket_ns) > 0 && moves_on_one_line(16, 0, 48, &cross_ns) > 0,
              "two threads sharing a line never moved it");
        CHECK(0 < complex_ns && complex_ns < socket_ns && socket_ns < cross_ns,
              "a line's move costs %.0f ns within a core complex, %.0f from another, %.0f from the other socket",
              complex_ns, socket_ns, cross_ns);
        for (int i = 0; i < HOST_LINES; i++) { /* one thread alone: each a line the model then follows */
            host->access_begin();
            host->access_end((const char *)&host_line[0] + 4096 * (size_t)(i + 1));
        }
        struct timespec past = {0, 150 * 1000 * 1000}; /* past the model's 100 ms: those lines are done with */
        nanosleep(&past, NULL);
        CHECK(moves_on_one_line(24, -1, -2, NULL) > 0,
              "after %d lines were used once, a newly shared line was never moved", HOST_LINES);
    }
    EXPECT(fi_close(&cq->fid), 0);
    nic_close(&a);
}

/* Two endpoints of one domain, sharing one AV, send from two threads to one target while a third thread
 * registers memory: every message arrives exactly once (and under ThreadSanitizer, no data race). */
static void check_threads(void) {
    struct nic a, b;
    nic_open(&a, 0);
    nic_open(&b, 1);
    struct fid_cq *cq1 = cq_new(&a), *cq2 = cq_new(&a), *cqb = cq_new(&b);
    struct node x1, x2, y;
    node_open(&x1, &a, cq1, cq1, 0, 0);
    node_open(&x2, &a, cq2, cq2, 0, 0);
    node_open(&y, &b, cqb, cqb, 0, 0);
    fi_addr_t to_y = insert(&a, &y);
    enum { RX = 256 };
    static uint32_t rx[RX][2];
    for (int i = 0; i < RX; i++) EXPECT(fi_recv(y.ep, rx[i], sizeof rx[i], NULL, FI_ADDR_UNSPEC, rx[i]), 0);
    struct sender s1 = {&x1, to_y, 0, &a}, s2 = {&x2, to_y, 1, &a};
    pthread_t t1, t2, t3;
    pthread_create(&t1, NULL, send_many, &s1);
    pthread_create(&t2, NULL, send_many, &s2);
    pthread_create(&t3, NULL, register_many, &a);
    static unsigned char seen[2][THREAD_MSGS];
    int got = 0, dup = 0, bad = 0;
    uint64_t deadline = now_ms() + 4 * TIMEOUT_MS;
    while (got < 2 * THREAD_MSGS && now_ms() < deadline) {
        struct fi_cq_data_entry e[16];
        ssize_t n = fi_cq_read(cqb, e, 16);
        for (ssize_t i = 0; i < n; i++) {
            uint32_t *m = e[i].op_context;
            if (m[0] > 1 || m[1] >= THREAD_MSGS) bad++;
            else if (seen[m[0]][m[1]]++) dup++;
            got++;
            fi_recv(y.ep, m, 2 * sizeof(uint32_t), NULL, FI_ADDR_UNSPEC, m);
        }
    }
    pthread_join(t1, NULL);
    pthread_join(t2, NULL);
    pthread_join(t3, NULL);
    CHECK(got == 2 * THREAD_MSGS && !dup && !bad, "%d of %d messages, %d twice, %d garbled", got, 2 * THREAD_MSGS,
          dup, bad);
    EXPECT(fi_close(&x1.ep->fid), 0);
    EXPECT(fi_close(&x2.ep->fid), 0);
    EXPECT(fi_close(&y.ep->fid), 0);
    EXPECT(fi_close(&cq1->fid), 0);
    EXPECT(fi_close(&cq2->fid), 0);
    EXPECT(fi_close(&cqb->fid), 0);
    nic_close(&a);
    nic_close(&b);
}

/* ----------------------------------------------------------------------------------------- main */

static const struct { const char *name; void (*run)(void); } checks[] = {
    {"eq", check_eq},
    {"cntr", check_cntr},
    {"cq_wait", check_cq_wait},
    {"unsupported_answer", check_unsupported_answer},
    {"av_close_while_bound", check_av_close_while_bound},
    {"av_insert_gone_peer", check_av_insert_gone_peer},
    {"separate_cqs", check_separate_cqs},
    {"shared_cq", check_shared_cq},
    {"selective_completion", check_selective_completion},
    {"write_verified", check_write_verified},
    {"failed_writes", check_failed_writes},
    {"iov_limits", check_iov_limits},
    {"getinfo", check_getinfo},
    {"threads", check_threads},
    {"host", check_host},
};

int main(int argc, char **argv) {
    setvbuf(stdout, NULL, _IONBF, 0);
    if (argc != 2) {
        fprintf(stderr, "usage: %s list|<check>\n", argv[0]);
        return 2;
    }
    for (size_t i = 0; i < sizeof checks / sizeof checks[0]; i++) {
        if (!strcmp(argv[1], "list")) printf("%s\n", checks[i].name);
        else if (!strcmp(argv[1], checks[i].name)) {
            checks[i].run();
            if (!failures) printf("ok\n");
            return failures ? 1 : 0;
        }
    }
    return strcmp(argv[1], "list") ? 2 : 0;
}
