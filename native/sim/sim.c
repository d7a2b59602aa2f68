/* libsim-fi.so: a libfabric provider ("sim") that models the NICs of an AWS p5 host.
 *
 * The model, and only the model, is physical (docs/model.md describes it whole): each domain is one NIC
 * with a line rate, a one-way latency and queue depths. A write or send posted on a NIC occupies its
 * transmit line for bytes * 8 / rate after the line is free, and the target NIC's receive line for as
 * long (several writers on one target NIC queue behind each other). The target reads the completion
 * (immediate data, received message) once the last byte has landed; the writer reads its own one latency
 * later (the acknowledgement). Time is CLOCK_MONOTONIC, looked at when the application polls a CQ: no
 * thread runs behind the application's back.
 *
 * Processes meet through one memfd segment per domain (no file in /dev/shm, so nothing is left behind
 * when a process is killed): a peer maps it through /proc/<pid>/fd/<fd>. It holds the domain's memory
 * registrations (the writer checks key, range and access against them, as the remote NIC would) and one
 * single-producer/single-consumer ring per sending endpoint ("port"), through which immediate data and
 * messages travel. By default a write moves no bytes (on EFA the NIC's DMA costs the host nothing);
 * with FABRICLAB_SIM_PAYLOAD=1 the writer copies them into the target's memory with process_vm_writev.
 */
#define _GNU_SOURCE
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <signal.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>

#include <rdma/fabric.h>
#include <rdma/fi_cm.h>
#include <rdma/fi_domain.h>
#include <rdma/fi_endpoint.h>
#include <rdma/fi_eq.h>
#include <rdma/fi_errno.h>
#include <rdma/fi_rma.h>
#include <rdma/providers/fi_prov.h>

#define SIM_NAME "sim"
#define SIM_FABRIC "modeled-p5"
#define SIM_FABRIC_PAYLOAD "modeled-p5-payload"
#define SIM_MAGIC 0x31504d49534c4600ULL /* "\0FLSIMP1" */
#define SIM_EPS 8                        /* endpoints per domain (NIC) */
#define SIM_PORTS 32                     /* sending endpoints one endpoint can hear at once */
#define SIM_RING 8192                    /* entries per port: the receive queue depth (rx 8192) */
#define SIM_MRS 4096                     /* registrations per domain */
#define SIM_DATA_BYTES (8u << 20)        /* per port: the bytes of messages in flight; the largest message */
#define SIM_TX 4096                      /* tx queue depth, as EFA reports */
#define SIM_RX 8192
#define SIM_INJECT 4096
#define SIM_CQ_DATA 4
#define SIM_MAX_AV 4096
#define SIM_ADDR_LEN 48
#define LIVENESS_NS 10000000ull /* a peer's process is looked for at most every 10 ms */
#define SIM_CAPS (FI_MSG | FI_RMA | FI_SEND | FI_RECV | FI_WRITE | FI_REMOTE_WRITE | FI_LOCAL_COMM | FI_REMOTE_COMM)
#define SIM_MR_MODE (FI_MR_LOCAL | FI_MR_VIRT_ADDR | FI_MR_ALLOCATED | FI_MR_PROV_KEY)
#define CACHELINE 64

enum { KIND_WRITE_DATA = 1, KIND_SEND = 2 };

/* ------------------------------------------------------------------------------------- the model */

static struct {
    int nics;
    double ns_per_byte; /* 8e9 / line rate */
    uint64_t latency_ns;
    int payload;
} model;

static uint64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

static double env_double(const char *name, double fallback) {
    const char *v = getenv(name);
    if (!v || !*v) return fallback;
    char *end;
    double d = strtod(v, &end);
    if (*end || !(d > 0)) {
        fprintf(stderr, "libfabric sim: ignoring %s=%s (not a number larger than zero)\n", name, v);
        return fallback;
    }
    return d;
}

static void model_read(void) {
    model.nics = (int)env_double("FABRICLAB_SIM_NICS", 32);
    if (model.nics > 1024) model.nics = 1024;
    model.ns_per_byte = 8.0 / env_double("FABRICLAB_SIM_GBPS", 100);
    model.latency_ns = (uint64_t)(env_double("FABRICLAB_SIM_LATENCY_US", 2.0) * 1000);
    const char *p = getenv("FABRICLAB_SIM_PAYLOAD");
    model.payload = p && *p && strcmp(p, "0") != 0;
}

/* -------------------------------------------------------------------------------- shared segment */

struct sim_entry { /* 32 bytes: one message or write announced to the target */
    uint64_t due_ns;
    uint64_t len;
    uint32_t data_off; /* messages: where their bytes are in the port's data ring */
    uint32_t kind;
    uint64_t imm;
};

struct sim_port {
    _Atomic uint64_t owner; /* 0: free; else the sender's pid << 32 | its domain's serial */
    _Atomic int closed;     /* the sender is gone: the target frees the port once it is drained */
    char pad0[CACHELINE - 12];
    _Atomic uint64_t head; /* producer */
    uint64_t data_head;
    char pad1[CACHELINE - 16];
    _Atomic uint64_t tail; /* consumer */
    _Atomic uint64_t data_tail;
    char pad2[CACHELINE - 16];
    struct sim_entry ring[SIM_RING];
};

struct sim_mr_slot {
    _Atomic uint64_t key; /* 0: free */
    uint64_t addr, len, access;
};

struct sim_segment {
    uint64_t magic;
    int32_t pid;
    uint32_t serial;
    _Atomic int alive;
    char pad0[CACHELINE - 20];
    _Atomic uint64_t rx_free_ns; /* when this NIC's receive line is next free */
    char pad1[CACHELINE - 8];
    _Atomic uint64_t ports_used[SIM_EPS]; /* per endpoint, bit i: its port i was claimed (it scans only these) */
    struct sim_mr_slot mrs[SIM_MRS];
    struct sim_port ports[SIM_EPS][SIM_PORTS];
    /* then SIM_EPS * SIM_PORTS data rings of SIM_DATA_BYTES */
};

static size_t segment_size(void) {
    return sizeof(struct sim_segment) + (size_t)SIM_EPS * SIM_PORTS * SIM_DATA_BYTES;
}
static char *port_data(struct sim_segment *s, int slot, int port) {
    return (char *)s + sizeof(struct sim_segment) + ((size_t)slot * SIM_PORTS + port) * SIM_DATA_BYTES;
}

/* The address a peer inserts: text, so that fi_av_straddr and fabriclab's describe() can print it. */
static void format_addr(char *out, int pid, int fd, uint32_t serial, int slot) {
    memset(out, 0, SIM_ADDR_LEN);
    snprintf(out, SIM_ADDR_LEN, "sim://%d/%d/%u/%d", pid, fd, serial, slot);
}

static int parse_addr(const void *addr, int *pid, int *fd, uint32_t *serial, int *slot) {
    char text[SIM_ADDR_LEN + 1];
    memcpy(text, addr, SIM_ADDR_LEN);
    text[SIM_ADDR_LEN] = 0;
    return sscanf(text, "sim://%d/%d/%u/%d", pid, fd, serial, slot) == 4 && *slot >= 0 && *slot < SIM_EPS
               ? 0 : -FI_EINVAL;
}

static int process_gone(int pid) { return kill(pid, 0) < 0 && errno == ESRCH; }

/* ------------------------------------------------------------------------------------------ objects */

struct sim_fabric { struct fid_fabric fid; };

struct sim_domain {
    struct fid_domain fid;
    int index;
    int memfd;
    uint32_t serial;
    struct sim_segment *seg;
    uint64_t tx_free_ns; /* when this NIC's transmit line is next free (only its endpoint's thread posts) */
    unsigned slots_used; /* bit i: an endpoint of this domain has slot i */
    _Atomic int registrations;
};

struct sim_mr {
    struct fid_mr fid;
    struct sim_domain *domain;
    int slot;
};

struct sim_peer {
    struct sim_segment *seg;
    int pid;
    uint32_t serial;
    int slot;          /* its endpoint's slot in the segment */
    int port;          /* our port in its endpoint's slot, -1 until the first post */
    int dead;          /* its process is gone */
    uint64_t checked_ns;
};

struct sim_av {
    struct fid_av fid;
    struct sim_domain *domain;
    struct sim_peer peers[SIM_MAX_AV];
    int count;
};

struct sim_pending { /* a posted operation whose local completion is not due yet */
    uint64_t due_ns;
    void *context;
    uint64_t flags;
    uint64_t len;
    uint32_t dest;
    int err;
};

struct sim_recv {
    void *buf;
    size_t len;
    void *context;
};

struct sim_cq;

struct sim_ep {
    struct fid_ep fid;
    struct sim_domain *domain;
    struct sim_cq *cq;
    struct sim_av *av;
    int slot;
    int enabled;
    atomic_flag lock; /* posting and progress of one endpoint from several threads (FI_THREAD_SAFE) */
    struct sim_pending tx[SIM_TX];
    uint64_t tx_head, tx_tail;
    struct sim_recv rx[SIM_RX];
    uint64_t rx_head, rx_tail;
    uint64_t last_due_ns; /* local completions come in posting order */
    uint64_t next_liveness_ns;
};

#define SIM_ERRS 256
struct sim_cq {
    struct fid_cq fid;
    struct sim_domain *domain;
    struct sim_ep *ep;
    int format;
    struct fi_cq_err_entry errs[SIM_ERRS];
    char err_text[SIM_ERRS][96];
    uint64_t err_head, err_tail;
};

static uint32_t next_serial(void) {
    static _Atomic uint32_t serial;
    return atomic_fetch_add(&serial, 1) + 1;
}

static void lock(struct sim_ep *ep) { while (atomic_flag_test_and_set_explicit(&ep->lock, memory_order_acquire)) ; }
static void unlock(struct sim_ep *ep) { atomic_flag_clear_explicit(&ep->lock, memory_order_release); }

static int no_bind(struct fid *fid, struct fid *bfid, uint64_t flags) { return -FI_ENOSYS; }
static int no_control(struct fid *fid, int command, void *arg) { return -FI_ENOSYS; }
static int no_ops_open(struct fid *fid, const char *name, uint64_t flags, void **ops, void *context) {
    return -FI_ENOSYS;
}

/* --------------------------------------------------------------------------------------- completions */

static void push_error(struct sim_cq *cq, void *context, uint64_t flags, size_t len, int err, const char *fmt, ...) {
    if (cq->err_tail - cq->err_head >= SIM_ERRS) return; /* the oldest errors are already waiting to be read */
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
}

static void fill(struct sim_cq *cq, void *buf, size_t i, void *context, uint64_t flags, size_t len, void *data_buf,
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

/* Is the process behind a peer gone? Asked only while writes to it are pending, at most every 10 ms. */
static int peer_dead(struct sim_peer *p, uint64_t now) {
    if (p->dead) return 1;
    if (now - p->checked_ns < LIVENESS_NS) return 0;
    p->checked_ns = now;
    p->dead = !atomic_load_explicit(&p->seg->alive, memory_order_acquire) || process_gone(p->pid);
    return p->dead;
}

/* The target side: announcements whose last byte has landed become completions (messages need a posted
 * receive and are copied into it). */
static size_t progress_rx(struct sim_ep *ep, void *buf, size_t count, uint64_t now) {
    struct sim_segment *seg = ep->domain->seg;
    struct sim_cq *cq = ep->cq;
    size_t n = 0;
    uint64_t used = atomic_load_explicit(&seg->ports_used[ep->slot], memory_order_acquire);
    while (used && n < count) {
        int p = __builtin_ctzll(used);
        used &= used - 1;
        struct sim_port *port = &seg->ports[ep->slot][p];
        uint64_t tail = atomic_load_explicit(&port->tail, memory_order_relaxed);
        uint64_t head = atomic_load_explicit(&port->head, memory_order_acquire);
        while (tail != head && n < count) {
            struct sim_entry *e = &port->ring[tail % SIM_RING];
            if (e->due_ns > now) break;
            if (e->kind == KIND_SEND) {
                if (ep->rx_head == ep->rx_tail) break; /* no receive posted: the message waits */
                struct sim_recv *r = &ep->rx[ep->rx_head++ % SIM_RX];
                if (e->len > r->len) {
                    push_error(cq, r->context, FI_RECV | FI_MSG, r->len, FI_ETRUNC,
                               "message of %" PRIu64 " bytes into a %zu-byte receive", e->len, r->len);
                } else {
                    memcpy(r->buf, port_data(seg, ep->slot, p) + e->data_off, e->len);
                    fill(cq, buf, n++, r->context, FI_RECV | FI_MSG, e->len, NULL, 0);
                }
                atomic_store_explicit(&port->data_tail, e->data_off + e->len, memory_order_release);
            } else {
                fill(cq, buf, n++, NULL, FI_REMOTE_WRITE | FI_RMA | FI_REMOTE_CQ_DATA, e->len, NULL, e->imm);
            }
            tail++;
        }
        atomic_store_explicit(&port->tail, tail, memory_order_release);
        if (tail == head && atomic_load_explicit(&port->closed, memory_order_acquire)) {
            /* the sender closed and everything it sent is read: the port is free again */
            atomic_store(&port->closed, 0);
            atomic_store(&port->owner, 0);
        }
    }
    return n;
}

/* The writer side: operations whose acknowledgement is due complete, in posting order. */
static size_t progress_tx(struct sim_ep *ep, void *buf, size_t count, size_t n, uint64_t now) {
    while (ep->tx_head != ep->tx_tail && n < count) {
        struct sim_pending *t = &ep->tx[ep->tx_head % SIM_TX];
        if (t->err) {
            push_error(ep->cq, t->context, t->flags, t->len, t->err, "%s", strerror(t->err));
        } else {
            if (t->due_ns > now) break;
            struct sim_peer *peer = &ep->av->peers[t->dest];
            if (peer_dead(peer, now)) {
                push_error(ep->cq, t->context, t->flags, t->len, FI_EHOSTUNREACH,
                           "the peer process %d is gone (closed or killed)", peer->pid);
            } else if (t->flags & FI_COMPLETION) {
                fill(ep->cq, buf, n++, t->context, t->flags & (FI_RMA | FI_WRITE | FI_MSG | FI_SEND), t->len, NULL, 0);
            }
        }
        ep->tx_head++;
    }
    return n;
}

static ssize_t cq_read(struct fid_cq *fid, void *buf, size_t count) {
    struct sim_cq *cq = (struct sim_cq *)fid;
    struct sim_ep *ep = cq->ep;
    if (cq->err_head != cq->err_tail) return -FI_EAVAIL;
    if (!ep || !ep->enabled) return -FI_EAGAIN;
    uint64_t now = now_ns();
    lock(ep);
    size_t n = progress_rx(ep, buf, count, now);
    n = progress_tx(ep, buf, count, n, now);
    unlock(ep);
    if (n) return (ssize_t)n;
    return cq->err_head != cq->err_tail ? -FI_EAVAIL : -FI_EAGAIN;
}

static ssize_t cq_readfrom(struct fid_cq *fid, void *buf, size_t count, fi_addr_t *src) {
    ssize_t n = cq_read(fid, buf, count);
    for (ssize_t i = 0; src && i < n; i++) src[i] = FI_ADDR_NOTAVAIL;
    return n;
}

static ssize_t cq_readerr(struct fid_cq *fid, struct fi_cq_err_entry *buf, uint64_t flags) {
    struct sim_cq *cq = (struct sim_cq *)fid;
    if (cq->err_head == cq->err_tail) return -FI_EAGAIN;
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

static ssize_t cq_sread(struct fid_cq *cq, void *buf, size_t count, const void *cond, int timeout) {
    return -FI_ENOSYS;
}

static int cq_close(struct fid *fid) {
    struct sim_cq *cq = (struct sim_cq *)fid;
    if (cq->ep) return -FI_EBUSY;
    free(cq);
    return 0;
}

static struct fi_ops cq_fi_ops = {.size = sizeof(struct fi_ops), .close = cq_close, .bind = no_bind,
                                  .control = no_control, .ops_open = no_ops_open};
static struct fi_ops_cq cq_ops = {.size = sizeof(struct fi_ops_cq), .read = cq_read, .readfrom = cq_readfrom,
                                  .readerr = cq_readerr, .sread = cq_sread, .strerror = cq_strerror};

static int cq_open(struct fid_domain *dfid, struct fi_cq_attr *attr, struct fid_cq **out, void *context) {
    if (attr && attr->wait_obj != FI_WAIT_NONE && attr->wait_obj != FI_WAIT_UNSPEC) return -FI_ENOSYS;
    if (attr && attr->format != FI_CQ_FORMAT_UNSPEC && attr->format != FI_CQ_FORMAT_CONTEXT &&
        attr->format != FI_CQ_FORMAT_MSG && attr->format != FI_CQ_FORMAT_DATA)
        return -FI_ENOSYS;
    struct sim_cq *cq = calloc(1, sizeof *cq);
    if (!cq) return -FI_ENOMEM;
    cq->fid.fid = (struct fid){.fclass = FI_CLASS_CQ, .context = context, .ops = &cq_fi_ops};
    cq->fid.ops = &cq_ops;
    cq->domain = (struct sim_domain *)dfid;
    cq->format = attr && attr->format != FI_CQ_FORMAT_UNSPEC ? attr->format : FI_CQ_FORMAT_DATA;
    *out = &cq->fid;
    return 0;
}

/* -------------------------------------------------------------------------------------------- AV */

static struct sim_segment *map_peer(int pid, int fd, uint32_t serial) {
    char path[64];
    snprintf(path, sizeof path, "/proc/%d/fd/%d", pid, fd);
    int local = open(path, O_RDWR | O_CLOEXEC);
    if (local < 0) return NULL;
    void *p = mmap(NULL, segment_size(), PROT_READ | PROT_WRITE, MAP_SHARED, local, 0);
    close(local);
    if (p == MAP_FAILED) return NULL;
    struct sim_segment *seg = p;
    if (seg->magic != SIM_MAGIC || seg->pid != pid || seg->serial != serial) {
        munmap(p, segment_size());
        return NULL;
    }
    return seg;
}

static void release_port(struct sim_peer *p) {
    if (p->seg && p->port >= 0) atomic_store_explicit(&p->seg->ports[p->slot][p->port].closed, 1, memory_order_release);
    p->port = -1;
}

static int av_insert(struct fid_av *fid, const void *addr, size_t count, fi_addr_t *fi_addr, uint64_t flags,
                     void *context) {
    struct sim_av *av = (struct sim_av *)fid;
    const char *a = addr;
    int inserted = 0;
    for (size_t i = 0; i < count; i++, a += SIM_ADDR_LEN) {
        int pid, fd, slot;
        uint32_t serial;
        struct sim_segment *seg = NULL;
        if (av->count < SIM_MAX_AV && parse_addr(a, &pid, &fd, &serial, &slot) == 0) seg = map_peer(pid, fd, serial);
        if (!seg) {
            if (fi_addr) fi_addr[i] = FI_ADDR_NOTAVAIL;
            continue;
        }
        av->peers[av->count] = (struct sim_peer){.seg = seg, .pid = pid, .serial = serial, .slot = slot, .port = -1};
        if (fi_addr) fi_addr[i] = (fi_addr_t)av->count;
        av->count++;
        inserted++;
    }
    return inserted;
}

static int av_remove(struct fid_av *fid, fi_addr_t *fi_addr, size_t count, uint64_t flags) {
    struct sim_av *av = (struct sim_av *)fid;
    for (size_t i = 0; i < count; i++) {
        if (fi_addr[i] >= (fi_addr_t)av->count || !av->peers[fi_addr[i]].seg) return -FI_EINVAL;
        struct sim_peer *p = &av->peers[fi_addr[i]];
        release_port(p);
        munmap(p->seg, segment_size());
        p->seg = NULL;
    }
    return 0;
}

static int av_lookup(struct fid_av *fid, fi_addr_t fi_addr, void *addr, size_t *addrlen) {
    struct sim_av *av = (struct sim_av *)fid;
    if (fi_addr >= (fi_addr_t)av->count || !av->peers[fi_addr].seg) return -FI_EINVAL;
    return -FI_ENOSYS;
}

static const char *av_straddr(struct fid_av *fid, const void *addr, char *buf, size_t *len) {
    snprintf(buf, *len, "%.*s", SIM_ADDR_LEN, (const char *)addr);
    *len = strnlen(addr, SIM_ADDR_LEN) + 1;
    return buf;
}

static int av_close(struct fid *fid) {
    struct sim_av *av = (struct sim_av *)fid;
    for (int i = 0; i < av->count; i++)
        if (av->peers[i].seg) {
            release_port(&av->peers[i]);
            munmap(av->peers[i].seg, segment_size());
        }
    free(av);
    return 0;
}

static struct fi_ops av_fi_ops = {.size = sizeof(struct fi_ops), .close = av_close, .bind = no_bind,
                                  .control = no_control, .ops_open = no_ops_open};
static struct fi_ops_av av_ops = {.size = sizeof(struct fi_ops_av), .insert = av_insert, .remove = av_remove,
                                  .lookup = av_lookup, .straddr = av_straddr};

static int av_open(struct fid_domain *dfid, struct fi_av_attr *attr, struct fid_av **out, void *context) {
    if (attr && attr->type == FI_AV_MAP) return -FI_ENOSYS;
    struct sim_av *av = calloc(1, sizeof *av);
    if (!av) return -FI_ENOMEM;
    av->fid.fid = (struct fid){.fclass = FI_CLASS_AV, .context = context, .ops = &av_fi_ops};
    av->fid.ops = &av_ops;
    av->domain = (struct sim_domain *)dfid;
    *out = &av->fid;
    return 0;
}

/* --------------------------------------------------------------------------------------------- MR */

static int mr_close(struct fid *fid) {
    struct sim_mr *mr = (struct sim_mr *)fid;
    atomic_store(&mr->domain->seg->mrs[mr->slot].key, 0);
    mr->domain->registrations--;
    free(mr);
    return 0;
}

static struct fi_ops mr_fi_ops = {.size = sizeof(struct fi_ops), .close = mr_close, .bind = no_bind,
                                  .control = no_control, .ops_open = no_ops_open};

static int mr_regattr(struct fid *fid, const struct fi_mr_attr *attr, uint64_t flags, struct fid_mr **out) {
    struct sim_domain *d = (struct sim_domain *)fid;
    if (attr->iov_count != 1) return -FI_EINVAL;
    if (attr->iface != FI_HMEM_SYSTEM) return -FI_ENOSYS;
    /* a key names its slot and a generation: a stale key of a closed registration never matches again */
    static _Atomic uint32_t generation;
    uint64_t gen = (uint64_t)(atomic_fetch_add(&generation, 1) + 1) << 32;
    for (int i = 0; i < SIM_MRS; i++) {
        struct sim_mr_slot *s = &d->seg->mrs[i];
        uint64_t expected = 0, key = gen | (uint64_t)i;
        if (atomic_load(&s->key) != 0) continue;
        s->addr = (uint64_t)(uintptr_t)attr->mr_iov[0].iov_base;
        s->len = attr->mr_iov[0].iov_len;
        s->access = attr->access;
        if (!atomic_compare_exchange_strong(&s->key, &expected, key)) continue;
        struct sim_mr *mr = calloc(1, sizeof *mr);
        if (!mr) {
            atomic_store(&s->key, 0);
            return -FI_ENOMEM;
        }
        mr->fid.fid = (struct fid){.fclass = FI_CLASS_MR, .context = attr->context, .ops = &mr_fi_ops};
        mr->fid.mem_desc = mr;
        mr->fid.key = key;
        mr->domain = d;
        mr->slot = i;
        d->registrations++;
        *out = &mr->fid;
        return 0;
    }
    return -FI_ENOSPC;
}

static int mr_reg(struct fid *fid, const void *buf, size_t len, uint64_t access, uint64_t offset,
                  uint64_t requested_key, uint64_t flags, struct fid_mr **mr, void *context) {
    struct iovec iov = {(void *)buf, len};
    struct fi_mr_attr attr = {.mr_iov = &iov, .iov_count = 1, .access = access, .context = context,
                              .iface = FI_HMEM_SYSTEM};
    return mr_regattr(fid, &attr, flags, mr);
}

static int mr_regv(struct fid *fid, const struct iovec *iov, size_t count, uint64_t access, uint64_t offset,
                   uint64_t requested_key, uint64_t flags, struct fid_mr **mr, void *context) {
    struct fi_mr_attr attr = {.mr_iov = iov, .iov_count = count, .access = access, .context = context,
                              .iface = FI_HMEM_SYSTEM};
    return mr_regattr(fid, &attr, flags, mr);
}

static struct fi_ops_mr mr_ops = {.size = sizeof(struct fi_ops_mr), .reg = mr_reg, .regv = mr_regv,
                                  .regattr = mr_regattr};

/* --------------------------------------------------------------------------------------- endpoint */

/* Claim a port in the peer's segment for this endpoint: it is then the port's only producer. */
static int claim_port(struct sim_ep *ep, struct sim_peer *peer) {
    uint64_t me = ((uint64_t)getpid() << 32) | ep->domain->serial;
    for (int i = 0; i < SIM_PORTS; i++) {
        struct sim_port *port = &peer->seg->ports[peer->slot][i];
        uint64_t owner = atomic_load(&port->owner);
        if (owner != 0 && !process_gone((int)(owner >> 32))) continue;
        /* a port of a killed sender is taken over once its entries are read */
        if (owner != 0 && atomic_load(&port->tail) != atomic_load(&port->head)) continue;
        if (!atomic_compare_exchange_strong(&port->owner, &owner, me)) continue;
        atomic_store(&port->closed, 0);
        port->data_head = atomic_load(&port->data_tail);
        atomic_store(&port->head, atomic_load(&port->tail));
        atomic_fetch_or(&peer->seg->ports_used[peer->slot], 1ull << i);
        peer->port = i;
        return 0;
    }
    return -FI_EAGAIN;
}

/* Reserve len contiguous bytes of the port's data ring (a message never wraps); offset or -1 when full. */
static int64_t reserve_data(struct sim_port *port, size_t len) {
    uint64_t tail = atomic_load_explicit(&port->data_tail, memory_order_acquire);
    uint64_t head = port->data_head;
    uint64_t at = head % SIM_DATA_BYTES;
    if (at + len > SIM_DATA_BYTES) head += SIM_DATA_BYTES - at; /* skip to the start of the ring */
    if (head + len - tail > SIM_DATA_BYTES) return -1;
    port->data_head = head + len;
    return (int64_t)(head % SIM_DATA_BYTES);
}

/* Queue an error completion for a post the remote NIC (or this one) refuses. */
static ssize_t refuse(struct sim_ep *ep, void *context, uint64_t flags, size_t len, int err) {
    if (ep->tx_tail - ep->tx_head >= SIM_TX) return -FI_EAGAIN;
    ep->tx[ep->tx_tail++ % SIM_TX] = (struct sim_pending){.context = context, .flags = flags | FI_COMPLETION,
                                                          .len = len, .err = err};
    return 0;
}

/* The wire: the write or message occupies this NIC's transmit line and then the target NIC's receive line
 * (shared by every sender to it). Returns when the last byte lands at the target. */
static uint64_t occupy_lines(struct sim_ep *ep, struct sim_peer *peer, size_t len, uint64_t now) {
    struct sim_domain *d = ep->domain;
    uint64_t wire = (uint64_t)(len * model.ns_per_byte);
    uint64_t tx_start = d->tx_free_ns > now ? d->tx_free_ns : now;
    uint64_t tx_end = tx_start + wire;
    d->tx_free_ns = tx_end;
    uint64_t first_byte = tx_start + model.latency_ns, last_byte = tx_end + model.latency_ns;
    uint64_t rx_free = atomic_load_explicit(&peer->seg->rx_free_ns, memory_order_relaxed), rx_end;
    do {
        uint64_t start = rx_free > first_byte ? rx_free : first_byte;
        rx_end = start + wire > last_byte ? start + wire : last_byte;
    } while (!atomic_compare_exchange_weak_explicit(&peer->seg->rx_free_ns, &rx_free, rx_end, memory_order_relaxed,
                                                    memory_order_relaxed));
    return rx_end;
}

static ssize_t post(struct sim_ep *ep, int kind, const void *buf, size_t len, fi_addr_t dest, uint64_t raddr,
                    uint64_t key, uint64_t data, void *context, uint64_t flags) {
    uint64_t op_flags = (kind == KIND_SEND ? FI_MSG | FI_SEND : FI_RMA | FI_WRITE) | (flags & FI_COMPLETION);
    if (!ep->enabled) return -FI_EOPBADSTATE;
    if (dest >= (fi_addr_t)ep->av->count || !ep->av->peers[dest].seg) return -FI_EINVAL;
    struct sim_peer *peer = &ep->av->peers[dest];
    if (ep->tx_tail - ep->tx_head >= SIM_TX) return -FI_EAGAIN;
    uint64_t now = now_ns();
    if (peer_dead(peer, now)) return refuse(ep, context, op_flags, len, FI_EHOSTUNREACH);
    if (kind == KIND_SEND) {
        if (len > SIM_DATA_BYTES) return -FI_EMSGSIZE;
    } else {
        /* what the target NIC checks before it lets the write into memory */
        uint64_t slot = key & 0xffffffffu;
        struct sim_mr_slot *s = slot < SIM_MRS ? &peer->seg->mrs[slot] : NULL;
        if (!s || atomic_load_explicit(&s->key, memory_order_acquire) != key)
            return refuse(ep, context, op_flags, len, FI_EKEYREJECTED);
        if (!(s->access & FI_REMOTE_WRITE)) return refuse(ep, context, op_flags, len, FI_EACCES);
        if (raddr < s->addr || raddr + len > s->addr + s->len || raddr + len < raddr)
            return refuse(ep, context, op_flags, len, FI_EFAULT);
    }
    int announce = kind == KIND_SEND || (flags & FI_REMOTE_CQ_DATA);
    struct sim_port *port = NULL;
    int64_t data_off = 0;
    if (announce) {
        if (peer->port < 0 && claim_port(ep, peer) < 0) return -FI_EAGAIN;
        port = &peer->seg->ports[peer->slot][peer->port];
        uint64_t head = atomic_load_explicit(&port->head, memory_order_relaxed);
        if (head - atomic_load_explicit(&port->tail, memory_order_acquire) >= SIM_RING) return -FI_EAGAIN;
        if (kind == KIND_SEND) {
            data_off = reserve_data(port, len);
            if (data_off < 0) return -FI_EAGAIN;
            memcpy(port_data(peer->seg, peer->slot, peer->port) + data_off, buf, len);
        }
    }
    if (kind != KIND_SEND && model.payload && len) {
        struct iovec local = {(void *)buf, len}, remote = {(void *)(uintptr_t)raddr, len};
        if (process_vm_writev(peer->pid, &local, 1, &remote, 1, 0) != (ssize_t)len)
            return refuse(ep, context, op_flags, len, errno == EPERM ? FI_EPERM : FI_EIO);
    }
    uint64_t landed = occupy_lines(ep, peer, len, now);
    if (announce) {
        uint64_t head = atomic_load_explicit(&port->head, memory_order_relaxed);
        port->ring[head % SIM_RING] = (struct sim_entry){.due_ns = landed, .len = len, .data_off = (uint32_t)data_off,
                                                         .kind = (uint32_t)kind, .imm = data & 0xffffffffu};
        atomic_store_explicit(&port->head, head + 1, memory_order_release);
    }
    uint64_t due = landed + model.latency_ns;
    if (due < ep->last_due_ns) due = ep->last_due_ns;
    ep->last_due_ns = due;
    ep->tx[ep->tx_tail++ % SIM_TX] = (struct sim_pending){.due_ns = due, .context = context, .flags = op_flags,
                                                          .len = len, .dest = (uint32_t)dest};
    return 0;
}

static ssize_t locked_post(struct fid_ep *fid, int kind, const void *buf, size_t len, fi_addr_t dest, uint64_t raddr,
                           uint64_t key, uint64_t data, void *context, uint64_t flags) {
    struct sim_ep *ep = (struct sim_ep *)fid;
    lock(ep);
    ssize_t rc = post(ep, kind, buf, len, dest, raddr, key, data, context, flags);
    unlock(ep);
    return rc;
}

static ssize_t ep_writemsg(struct fid_ep *fid, const struct fi_msg_rma *msg, uint64_t flags) {
    if (msg->iov_count != 1 || msg->rma_iov_count != 1 || msg->msg_iov[0].iov_len != msg->rma_iov[0].len)
        return -FI_EINVAL; /* one contiguous piece each side, as fabriclab posts them */
    return locked_post(fid, KIND_WRITE_DATA, msg->msg_iov[0].iov_base, msg->msg_iov[0].iov_len, msg->addr,
                       msg->rma_iov[0].addr, msg->rma_iov[0].key, msg->data, msg->context, flags);
}

static ssize_t ep_write(struct fid_ep *fid, const void *buf, size_t len, void *desc, fi_addr_t dest, uint64_t addr,
                        uint64_t key, void *context) {
    return locked_post(fid, KIND_WRITE_DATA, buf, len, dest, addr, key, 0, context, FI_COMPLETION);
}

static ssize_t ep_writedata(struct fid_ep *fid, const void *buf, size_t len, void *desc, uint64_t data,
                            fi_addr_t dest, uint64_t addr, uint64_t key, void *context) {
    return locked_post(fid, KIND_WRITE_DATA, buf, len, dest, addr, key, data, context,
                       FI_COMPLETION | FI_REMOTE_CQ_DATA);
}

static ssize_t ep_inject_write(struct fid_ep *fid, const void *buf, size_t len, fi_addr_t dest, uint64_t addr,
                               uint64_t key) {
    if (len > SIM_INJECT) return -FI_EMSGSIZE;
    return locked_post(fid, KIND_WRITE_DATA, buf, len, dest, addr, key, 0, NULL, 0);
}

static ssize_t ep_injectdata(struct fid_ep *fid, const void *buf, size_t len, uint64_t data, fi_addr_t dest,
                             uint64_t addr, uint64_t key) {
    if (len > SIM_INJECT) return -FI_EMSGSIZE;
    return locked_post(fid, KIND_WRITE_DATA, buf, len, dest, addr, key, data, NULL, FI_REMOTE_CQ_DATA);
}

static ssize_t ep_writev(struct fid_ep *fid, const struct iovec *iov, void **desc, size_t count, fi_addr_t dest,
                         uint64_t addr, uint64_t key, void *context) {
    if (count != 1) return -FI_EINVAL;
    return ep_write(fid, iov[0].iov_base, iov[0].iov_len, desc ? desc[0] : NULL, dest, addr, key, context);
}

static ssize_t ep_send(struct fid_ep *fid, const void *buf, size_t len, void *desc, fi_addr_t dest, void *context) {
    return locked_post(fid, KIND_SEND, buf, len, dest, 0, 0, 0, context, FI_COMPLETION);
}

static ssize_t ep_sendmsg(struct fid_ep *fid, const struct fi_msg *msg, uint64_t flags) {
    if (msg->iov_count != 1) return -FI_EINVAL;
    return locked_post(fid, KIND_SEND, msg->msg_iov[0].iov_base, msg->msg_iov[0].iov_len, msg->addr, 0, 0, 0,
                       msg->context, flags | FI_COMPLETION);
}

static ssize_t ep_sendv(struct fid_ep *fid, const struct iovec *iov, void **desc, size_t count, fi_addr_t dest,
                        void *context) {
    if (count != 1) return -FI_EINVAL;
    return ep_send(fid, iov[0].iov_base, iov[0].iov_len, NULL, dest, context);
}

static ssize_t ep_inject(struct fid_ep *fid, const void *buf, size_t len, fi_addr_t dest) {
    if (len > SIM_INJECT) return -FI_EMSGSIZE;
    return locked_post(fid, KIND_SEND, buf, len, dest, 0, 0, 0, NULL, 0);
}

static ssize_t ep_recv(struct fid_ep *fid, void *buf, size_t len, void *desc, fi_addr_t src, void *context) {
    struct sim_ep *ep = (struct sim_ep *)fid;
    if (!ep->enabled) return -FI_EOPBADSTATE;
    lock(ep);
    ssize_t rc = -FI_EAGAIN;
    if (ep->rx_tail - ep->rx_head < SIM_RX) {
        ep->rx[ep->rx_tail++ % SIM_RX] = (struct sim_recv){buf, len, context};
        rc = 0;
    }
    unlock(ep);
    return rc;
}

static ssize_t ep_recvmsg(struct fid_ep *fid, const struct fi_msg *msg, uint64_t flags) {
    if (msg->iov_count != 1) return -FI_EINVAL;
    return ep_recv(fid, msg->msg_iov[0].iov_base, msg->msg_iov[0].iov_len, NULL, msg->addr, msg->context);
}

static ssize_t ep_recvv(struct fid_ep *fid, const struct iovec *iov, void **desc, size_t count, fi_addr_t src,
                        void *context) {
    if (count != 1) return -FI_EINVAL;
    return ep_recv(fid, iov[0].iov_base, iov[0].iov_len, NULL, src, context);
}

static ssize_t no_read(struct fid_ep *ep, void *buf, size_t len, void *desc, fi_addr_t src, uint64_t addr,
                       uint64_t key, void *context) {
    return -FI_ENOSYS;
}

static int ep_getname(fid_t fid, void *addr, size_t *addrlen) {
    struct sim_ep *ep = container_of(fid, struct sim_ep, fid.fid);
    size_t have = *addrlen;
    *addrlen = SIM_ADDR_LEN;
    if (have < SIM_ADDR_LEN) return -FI_ETOOSMALL;
    format_addr(addr, getpid(), ep->domain->memfd, ep->domain->serial, ep->slot);
    return 0;
}

static int ep_bind(struct fid *fid, struct fid *bfid, uint64_t flags) {
    struct sim_ep *ep = (struct sim_ep *)fid;
    if (bfid->fclass == FI_CLASS_CQ) {
        struct sim_cq *cq = (struct sim_cq *)bfid;
        if ((ep->cq && ep->cq != cq) || (cq->ep && cq->ep != ep)) return -FI_EINVAL; /* one CQ per endpoint */
        ep->cq = cq;
        cq->ep = ep;
        return 0;
    }
    if (bfid->fclass == FI_CLASS_AV) {
        ep->av = (struct sim_av *)bfid;
        return 0;
    }
    return -FI_EINVAL;
}

static int ep_control(struct fid *fid, int command, void *arg) {
    struct sim_ep *ep = (struct sim_ep *)fid;
    if (command != FI_ENABLE) return -FI_ENOSYS;
    if (!ep->cq || !ep->av) return -FI_ENOCQ;
    ep->enabled = 1;
    return 0;
}

static int ep_close(struct fid *fid) {
    struct sim_ep *ep = (struct sim_ep *)fid;
    if (ep->cq) ep->cq->ep = NULL;
    if (ep->av)
        for (int i = 0; i < ep->av->count; i++) release_port(&ep->av->peers[i]);
    atomic_store(&ep->domain->seg->ports_used[ep->slot], 0);
    ep->domain->slots_used &= ~(1u << ep->slot);
    free(ep);
    return 0;
}

static ssize_t ep_tx_left(struct fid_ep *fid) {
    struct sim_ep *ep = (struct sim_ep *)fid;
    return SIM_TX - (ssize_t)(ep->tx_tail - ep->tx_head);
}

static ssize_t ep_rx_left(struct fid_ep *fid) {
    struct sim_ep *ep = (struct sim_ep *)fid;
    return SIM_RX - (ssize_t)(ep->rx_tail - ep->rx_head);
}

static ssize_t ep_cancel(fid_t fid, void *context) { return -FI_ENOENT; }
static int ep_getopt(fid_t fid, int level, int optname, void *optval, size_t *optlen) { return -FI_ENOPROTOOPT; }
static int ep_setopt(fid_t fid, int level, int optname, const void *optval, size_t optlen) { return -FI_ENOPROTOOPT; }

static struct fi_ops ep_fi_ops = {.size = sizeof(struct fi_ops), .close = ep_close, .bind = ep_bind,
                                  .control = ep_control, .ops_open = no_ops_open};
static struct fi_ops_ep ep_ops = {.size = sizeof(struct fi_ops_ep), .cancel = ep_cancel, .getopt = ep_getopt,
                                  .setopt = ep_setopt, .rx_size_left = ep_rx_left, .tx_size_left = ep_tx_left};
static struct fi_ops_cm ep_cm_ops = {.size = sizeof(struct fi_ops_cm), .getname = ep_getname};
static struct fi_ops_msg ep_msg_ops = {.size = sizeof(struct fi_ops_msg), .recv = ep_recv, .recvv = ep_recvv,
                                       .recvmsg = ep_recvmsg, .send = ep_send, .sendv = ep_sendv,
                                       .sendmsg = ep_sendmsg, .inject = ep_inject};
static struct fi_ops_rma ep_rma_ops = {.size = sizeof(struct fi_ops_rma), .read = no_read, .write = ep_write,
                                       .writev = ep_writev, .writemsg = ep_writemsg, .inject = ep_inject_write,
                                       .writedata = ep_writedata, .injectdata = ep_injectdata};

static int ep_open(struct fid_domain *dfid, struct fi_info *info, struct fid_ep **out, void *context) {
    struct sim_domain *d = (struct sim_domain *)dfid;
    if (d->slots_used == (1u << SIM_EPS) - 1) return -FI_ENOSPC; /* the segment has ports for SIM_EPS */
    struct sim_ep *ep = calloc(1, sizeof *ep);
    if (!ep) return -FI_ENOMEM;
    ep->fid.fid = (struct fid){.fclass = FI_CLASS_EP, .context = context, .ops = &ep_fi_ops};
    ep->fid.ops = &ep_ops;
    ep->fid.cm = &ep_cm_ops;
    ep->fid.msg = &ep_msg_ops;
    ep->fid.rma = &ep_rma_ops;
    ep->domain = d;
    atomic_flag_clear(&ep->lock);
    ep->slot = __builtin_ctz(~d->slots_used);
    d->slots_used |= 1u << ep->slot;
    /* ports a closed endpoint of this slot left behind are free again */
    for (int i = 0; i < SIM_PORTS; i++) {
        struct sim_port *port = &d->seg->ports[ep->slot][i];
        atomic_store(&port->closed, 0);
        atomic_store(&port->owner, 0);
        atomic_store(&port->head, 0);
        atomic_store(&port->tail, 0);
        atomic_store(&port->data_tail, 0);
    }
    *out = &ep->fid;
    return 0;
}

/* ------------------------------------------------------------------------------ domain and fabric */

static int domain_close(struct fid *fid) {
    struct sim_domain *d = (struct sim_domain *)fid;
    if (d->slots_used || d->registrations) return -FI_EBUSY;
    atomic_store(&d->seg->alive, 0);
    munmap(d->seg, segment_size());
    close(d->memfd);
    free(d);
    return 0;
}

static struct fi_ops domain_fi_ops = {.size = sizeof(struct fi_ops), .close = domain_close, .bind = no_bind,
                                      .control = no_control, .ops_open = no_ops_open};
static struct fi_ops_domain domain_ops = {.size = sizeof(struct fi_ops_domain), .av_open = av_open,
                                          .cq_open = cq_open, .endpoint = ep_open};

static int domain_index(const char *name) {
    int index;
    char tail[8];
    if (!name || sscanf(name, "rdmap%ds0-rd%7s", &index, tail) != 2 || strcmp(tail, "m") != 0) return -1;
    index -= 16;
    return index >= 0 && index < model.nics ? index : -1;
}

static int domain_open(struct fid_fabric *ffid, struct fi_info *info, struct fid_domain **out, void *context) {
    int index = domain_index(info && info->domain_attr ? info->domain_attr->name : NULL);
    if (index < 0) return -FI_EINVAL;
    struct sim_domain *d = calloc(1, sizeof *d);
    if (!d) return -FI_ENOMEM;
    d->index = index;
    d->serial = next_serial();
    char name[32];
    snprintf(name, sizeof name, "fabriclab-sim-%d", index);
    d->memfd = memfd_create(name, 0); /* not MFD_CLOEXEC: peers open it through /proc/<pid>/fd */
    if (d->memfd < 0 || ftruncate(d->memfd, (off_t)segment_size()) < 0) goto fail;
    d->seg = mmap(NULL, segment_size(), PROT_READ | PROT_WRITE, MAP_SHARED, d->memfd, 0);
    if (d->seg == MAP_FAILED) goto fail;
    d->seg->pid = getpid();
    d->seg->serial = d->serial;
    atomic_store(&d->seg->alive, 1);
    atomic_store_explicit((_Atomic uint64_t *)&d->seg->magic, SIM_MAGIC, memory_order_release);
    if (model.payload) prctl(PR_SET_PTRACER, PR_SET_PTRACER_ANY); /* yama: let writers' process_vm_writev in */
    d->fid.fid = (struct fid){.fclass = FI_CLASS_DOMAIN, .context = context, .ops = &domain_fi_ops};
    d->fid.ops = &domain_ops;
    d->fid.mr = &mr_ops;
    *out = &d->fid;
    return 0;
fail: {
    int err = errno;
    if (d->memfd >= 0) close(d->memfd);
    free(d);
    return -err;
}
}

static int fabric_close(struct fid *fid) {
    free(fid);
    return 0;
}

static struct fi_ops fabric_fi_ops = {.size = sizeof(struct fi_ops), .close = fabric_close, .bind = no_bind,
                                      .control = no_control, .ops_open = no_ops_open};
static struct fi_ops_fabric fabric_ops = {.size = sizeof(struct fi_ops_fabric), .domain = domain_open};

static const char *fabric_name(void) { return model.payload ? SIM_FABRIC_PAYLOAD : SIM_FABRIC; }

static int fabric_open(struct fi_fabric_attr *attr, struct fid_fabric **out, void *context) {
    if (attr && attr->name && strcmp(attr->name, fabric_name()) != 0) return -FI_ENODATA;
    struct sim_fabric *f = calloc(1, sizeof *f);
    if (!f) return -FI_ENOMEM;
    f->fid.fid = (struct fid){.fclass = FI_CLASS_FABRIC, .context = context, .ops = &fabric_fi_ops};
    f->fid.ops = &fabric_ops;
    *out = &f->fid;
    return 0;
}

/* ------------------------------------------------------------------------------------------ getinfo */

static int fits(const struct fi_info *hints, const char *domain) {
    if (!hints) return 1;
    if (hints->caps & ~(uint64_t)(SIM_CAPS | FI_REMOTE_CQ_DATA)) return 0;
    if (hints->ep_attr && hints->ep_attr->type != FI_EP_UNSPEC && hints->ep_attr->type != FI_EP_RDM) return 0;
    if (hints->addr_format != FI_FORMAT_UNSPEC && hints->addr_format != FI_ADDR_STR) return 0;
    if (hints->fabric_attr && hints->fabric_attr->name && strcmp(hints->fabric_attr->name, fabric_name()) != 0)
        return 0;
    if (hints->domain_attr) {
        const struct fi_domain_attr *d = hints->domain_attr;
        if (d->name && strcmp(d->name, domain) != 0) return 0;
        if (d->mr_mode != FI_MR_UNSPEC && (d->mr_mode & SIM_MR_MODE) != SIM_MR_MODE) return 0;
        if (d->cq_data_size > SIM_CQ_DATA) return 0;
    }
    if (hints->tx_attr && hints->tx_attr->inject_size > SIM_INJECT) return 0;
    return 1;
}

/* The NIC behind a domain, as fi_info shows it: a name, the modeled line rate and MTU (EFA's 8760). */
struct sim_nic {
    struct fid_nic fid;
    struct fi_device_attr device;
    struct fi_link_attr link;
    char name[32];
};

static struct sim_nic *nic_new(const char *name);

static int nic_close(struct fid *fid) {
    free(fid);
    return 0;
}

static int nic_control(struct fid *fid, int command, void *arg) {
    if (command != FI_DUP) return -FI_ENOSYS;
    struct sim_nic *copy = nic_new(((struct sim_nic *)fid)->name);
    if (!copy) return -FI_ENOMEM;
    *(struct fid_nic **)arg = &copy->fid;
    return 0;
}

static struct fi_ops nic_fi_ops = {.size = sizeof(struct fi_ops), .close = nic_close, .bind = no_bind,
                                   .control = nic_control, .ops_open = no_ops_open};

static struct sim_nic *nic_new(const char *name) {
    struct sim_nic *nic = calloc(1, sizeof *nic);
    if (!nic) return NULL;
    snprintf(nic->name, sizeof nic->name, "%s", name);
    nic->fid.fid = (struct fid){.fclass = FI_CLASS_NIC, .ops = &nic_fi_ops};
    nic->device.name = nic->name;
    nic->link.mtu = 8760;
    nic->link.speed = (size_t)(8e9 / model.ns_per_byte);
    nic->link.state = FI_LINK_UP;
    nic->fid.device_attr = &nic->device;
    nic->fid.link_attr = &nic->link;
    return nic;
}

static struct fi_info *describe(int index) {
    struct fi_info *info = fi_allocinfo();
    if (!info) return NULL;
    char domain[32];
    snprintf(domain, sizeof domain, "rdmap%ds0-rdm", index + 16);
    info->caps = SIM_CAPS;
    info->mode = 0;
    info->addr_format = FI_ADDR_STR;
    info->ep_attr->type = FI_EP_RDM;
    info->ep_attr->protocol = FI_PROTO_UNSPEC;
    info->ep_attr->max_msg_size = SIM_DATA_BYTES;
    info->ep_attr->tx_ctx_cnt = 1;
    info->ep_attr->rx_ctx_cnt = 1;
    info->tx_attr->caps = FI_MSG | FI_RMA | FI_SEND | FI_WRITE;
    info->tx_attr->op_flags = FI_COMPLETION;
    info->tx_attr->msg_order = FI_ORDER_SAS;
    info->tx_attr->comp_order = FI_ORDER_STRICT;
    info->tx_attr->inject_size = SIM_INJECT;
    info->tx_attr->size = SIM_TX;
    info->tx_attr->iov_limit = 1;
    info->tx_attr->rma_iov_limit = 1;
    info->rx_attr->caps = FI_MSG | FI_RMA | FI_RECV | FI_REMOTE_WRITE;
    info->rx_attr->op_flags = FI_COMPLETION;
    info->rx_attr->msg_order = FI_ORDER_SAS;
    info->rx_attr->size = SIM_RX;
    info->rx_attr->iov_limit = 1;
    info->domain_attr->name = strdup(domain);
    info->domain_attr->threading = FI_THREAD_SAFE;
    info->domain_attr->control_progress = FI_PROGRESS_AUTO;
    info->domain_attr->data_progress = FI_PROGRESS_AUTO;
    info->domain_attr->resource_mgmt = FI_RM_ENABLED;
    info->domain_attr->av_type = FI_AV_TABLE;
    info->domain_attr->mr_mode = SIM_MR_MODE;
    info->domain_attr->mr_key_size = 8;
    info->domain_attr->cq_data_size = SIM_CQ_DATA;
    info->domain_attr->cq_cnt = 1;
    info->domain_attr->ep_cnt = 1;
    info->domain_attr->tx_ctx_cnt = 1;
    info->domain_attr->rx_ctx_cnt = 1;
    info->domain_attr->max_ep_tx_ctx = 1;
    info->domain_attr->max_ep_rx_ctx = 1;
    info->domain_attr->mr_iov_limit = 1;
    info->domain_attr->mr_cnt = SIM_MRS;
    info->fabric_attr->name = strdup(fabric_name());
    domain[strlen(domain) - 4] = 0; /* the device: rdmapNs0 */
    struct sim_nic *nic = nic_new(domain);
    if (!nic) {
        fi_freeinfo(info);
        return NULL;
    }
    info->nic = &nic->fid;
    info->fabric_attr->prov_version = FI_VERSION(1, 0);
    return info;
}

static int sim_getinfo(uint32_t version, const char *node, const char *service, uint64_t flags,
                       const struct fi_info *hints, struct fi_info **out) {
    struct fi_info *head = NULL, **tail = &head;
    for (int i = 0; i < model.nics; i++) {
        char domain[32];
        snprintf(domain, sizeof domain, "rdmap%ds0-rdm", i + 16);
        if (!fits(hints, domain)) continue;
        struct fi_info *info = describe(i);
        if (!info) {
            fi_freeinfo(head);
            return -FI_ENOMEM;
        }
        if (hints && hints->caps) info->caps = (hints->caps & FI_REMOTE_CQ_DATA) | SIM_CAPS;
        *tail = info;
        tail = &info->next;
    }
    *out = head;
    return head ? 0 : -FI_ENODATA;
}

static void sim_cleanup(void) {}

static struct fi_provider sim_provider = {
    .version = FI_VERSION(1, 0),
    .fi_version = FI_VERSION(FI_MAJOR_VERSION, FI_MINOR_VERSION),
    .name = SIM_NAME,
    .getinfo = sim_getinfo,
    .fabric = fabric_open,
    .cleanup = sim_cleanup,
};

struct fi_provider *fi_prov_ini(void) {
    model_read();
    return &sim_provider;
}
