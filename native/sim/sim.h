/* libsim-fi.so: a libfabric provider ("sim") that models the NICs of an AWS p5 host.
 *
 * The model, and only the model, is physical (docs/model.md describes it whole): each domain is one NIC
 * with a line rate, a one-way latency and queue depths. A write or send posted on a NIC occupies its
 * transmit line for bytes * 8 / rate after the line is free, and the target NIC's receive line for as
 * long (several writers on one target NIC share it in the order their bytes arrive). The target reads the completion
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
 *
 * This is the provider's private header, laid out as libfabric's providers are: one file per object
 * (sim_fabric.c: provider entry, getinfo, fabric, domain; sim_ep.c: endpoint object; sim_post.c: the post
 * paths; sim_progress.c: turning what is due into completions; sim_cq.c, sim_av.c, sim_mr.c; sim_wire.c:
 * the model, the shared segment, ports and the timing of the lines). Names shared between files are
 * prefixed sim_; everything else is static. Only fi_prov_ini leaves the library.
 */
#ifndef FABRICLAB_SIM_H
#define FABRICLAB_SIM_H

#define _GNU_SOURCE
#include <pthread.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>
#include <sys/uio.h>
#include <time.h>

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

#include "fi_sim_ext.h"

#define SIM_NAME "sim"
#define SIM_FABRIC "modeled-p5"
#define SIM_FABRIC_PAYLOAD "modeled-p5-payload"
#define SIM_MAGIC 0x31504d49534c4600ULL /* "\0FLSIMP1" */
#define SIM_EPS 8                        /* endpoints per domain (NIC) */
#define SIM_PORTS 256                    /* sending endpoints one endpoint can hear at once */
#define SIM_PORT_WORDS (SIM_PORTS / 64)
#define SIM_RING 8192                    /* entries per port: the receive queue depth (rx 8192) */
#define SIM_MRS 262144                   /* registrations per domain, as EFA reports (mr_cnt) */
#define SIM_MR_SLOT_BITS 18              /* a 4-byte key (EFA's mr_key_size): slot, then generation */
#define SIM_MR_CLAIMED UINT32_MAX        /* a slot being filled (no key has every generation bit set) */
#define SIM_DATA_BYTES (8u << 20)        /* per port: the bytes of messages in flight; the largest message */
#define SIM_TX 4096                      /* tx queue depth, as EFA reports */
#define SIM_RX 8192
#define SIM_INJECT 4096
#define SIM_IOV 4                        /* iov_limit, as EFA reports (rma_iov_limit 1) */
#define SIM_CQ_DATA 4
#define SIM_CQS 512                      /* CQs per domain, as EFA reports (cq_cnt) */
#define SIM_MAX_AV 4096
#define SIM_ADDR_LEN 32                  /* as EFA's addresses: "sim:<nic>/<pid>/<fd>/<serial>/<slot>" in hex */
#define SIM_SERIAL_MASK 0xffffffu        /* a domain's serial, as it fits its address */
#define SIM_CAPS (FI_MSG | FI_RMA | FI_SEND | FI_RECV | FI_WRITE | FI_REMOTE_WRITE | FI_LOCAL_COMM | FI_REMOTE_COMM)
#define SIM_CACHELINE 64
#define SIM_ERRS 256
#define SIM_VOUCH_NS 1000000ull         /* a look that finds a peer's process alive vouches for it this long (1 ms) */
#define SIM_ERR_TEXT 256                 /* an error completion's text (max_err_data) */
#define SIM_HELD UINT64_MAX              /* tx_start_ns of an operation posted with FI_MORE, until the doorbell */
#define SIM_XSTR(x) #x
#define SIM_STR(x) SIM_XSTR(x)

/* What a ring entry announces; SIM_KIND_TAKEN once the target has read it (it may read past a message that
 * waits for a receive, so entries are taken out of order and the ring's tail follows the taken ones). */
enum sim_kind { SIM_KIND_WRITE_DATA = 1, SIM_KIND_SEND = 2, SIM_KIND_TAKEN = 3, SIM_KIND_SEND_DATA = 4 };

/* ------------------------------------------------------------------------------------- the model */

struct sim_model {
    int nics;
    double ns_per_byte; /* 8e9 / line rate */
    uint64_t latency_ns;
    int payload;
    int ordered; /* FABRICLAB_SIM_ORDERED=1: local completions in posting order (for teaching) */
    int wall;    /* FABRICLAB_SIM_TIME=wall: the wall clock and this box's costs, not the modeled host's */
};

extern struct sim_model sim_model;

/* -------------------------------------------------------------------------------- shared segment */

struct sim_entry { /* 32 bytes: one message or write announced to the target, once its bytes left the sender */
    uint64_t due_ns; /* when its last byte has landed */
    uint64_t len;
    uint64_t data_at; /* messages: where their bytes start in the port's data stream (at data_at % SIM_DATA_BYTES) */
    uint32_t kind;
    uint32_t imm;
};

/* Positions (head, tail, data_*) count from the port's claim and never wrap: a slot is position % size. */
struct sim_port {
    _Atomic uint64_t owner; /* 0: free; else the sender's pid << 32 | its domain's serial */
    _Atomic int closed;     /* the sender is gone: the target frees the port once it is drained */
    char pad0[SIM_CACHELINE - 12];
    _Atomic uint64_t head; /* producer: entries published (their bytes left the sender) */
    uint64_t posted;       /* producer: entries posted, published or not (posted - tail <= SIM_RING) */
    uint64_t data_head;    /* producer: bytes of messages placed in the data ring */
    char pad1[SIM_CACHELINE - 24];
    _Atomic uint64_t tail;      /* consumer: entries before it are taken */
    _Atomic uint64_t data_tail; /* consumer: message bytes before it are read */
    char pad2[SIM_CACHELINE - 16];
    struct sim_entry ring[SIM_RING];
};

struct sim_mr_slot {
    _Atomic uint32_t key; /* 0: free; SIM_MR_CLAIMED: being filled; else generation << SIM_MR_SLOT_BITS | slot */
    uint32_t generation;  /* of the last key the slot had: a stale key never matches its next registration */
    uint64_t addr, len, access;
};

struct sim_segment {
    uint64_t magic;
    int32_t pid;
    uint32_t serial;
    _Atomic int alive;
    char pad0[SIM_CACHELINE - 20];
    _Atomic uint64_t rx_free_ns; /* when this NIC's receive line is next free */
    char pad1[SIM_CACHELINE - 8];
    _Atomic uint64_t polled_ns; /* when this process last polled a CQ of this domain: it was alive then */
    char pad2[SIM_CACHELINE - 8];
    _Atomic uint64_t ports_used[SIM_EPS][SIM_PORT_WORDS]; /* per endpoint, bit i: its port i was claimed */
    struct sim_mr_slot mrs[SIM_MRS];
    struct sim_port ports[SIM_EPS][SIM_PORTS];
    /* then SIM_EPS * SIM_PORTS data rings of SIM_DATA_BYTES */
};

/* ------------------------------------------------------------------------------------------ objects */

struct sim_fabric {
    struct fid_fabric fid;
    _Atomic int refs; /* domains and event queues opened on it */
};

struct sim_domain {
    struct fid_domain fid;
    struct sim_fabric *fabric;
    int index;
    int memfd;
    uint32_t serial;
    struct sim_segment *seg;
    _Atomic uint64_t tx_free_ns; /* when this NIC's transmit line is next free (its endpoints post from any thread) */
    pthread_mutex_t lock;        /* endpoint slots and CQ count */
    unsigned slots_used;         /* bit i: an endpoint of this domain has slot i */
    int cqs;
    _Atomic int refs;            /* AVs, CQs and counters opened on it */
    _Atomic int registrations;
    _Atomic uint32_t mr_hint;    /* where the next registration starts looking for a free slot */
};

struct sim_mr {
    struct fid_mr fid;
    struct sim_domain *domain;
    int slot;
};

struct sim_watch;

struct sim_peer {
    struct sim_segment *seg;
    int pid;
    struct sim_watch *watch; /* its process, looked at by every AV entry that names it */
    uint32_t serial;
    int slot;                       /* its endpoint's slot in the segment */
    _Atomic uint64_t dead_after_ns; /* 0 while alive; once found gone (or its domain closed), its last sign of life */
    char addr[SIM_ADDR_LEN];        /* as inserted, for fi_av_lookup */
    int gone;                       /* its endpoint was gone when inserted (seg is NULL): sends to it fail */
};

struct sim_av {
    struct fid_av fid;
    struct sim_domain *domain;
    pthread_mutex_t lock;         /* inserts, removes and the bound endpoints */
    struct sim_ep *eps[SIM_EPS];  /* bound endpoints: fi_close(av) is -FI_EBUSY while there are any */
    int neps;
    _Atomic int count;            /* peers[0, count) are filled */
    struct sim_peer peers[SIM_MAX_AV];
};

struct sim_pending { /* a posted operation whose local completion is not due yet */
    uint64_t tx_start_ns; /* when its first byte leaves this NIC */
    uint64_t landed_ns;   /* when its last byte lands at the target; 0 until it has left */
    uint64_t left_wall_ns; /* the wall clock when it left: whether its peer was alive is judged then */
    uint64_t due_ns;      /* its acknowledgement, once it has left */
    void *context;
    uint64_t flags;
    uint64_t len;
    uint64_t data_at; /* messages: where their bytes are in the port's data stream */
    uint32_t dest;
    uint32_t imm;
    int kind;     /* 0: refused at post (err says why) */
    int announce; /* sends and writes with immediate data leave an entry in the target's port */
    int err;
    int done; /* completed ahead of older operations: tx_head passes it once they have */
};

struct sim_rx_port { /* the target's own view of one of its ports */
    uint64_t scan;    /* entries before it were looked at: taken, or messages waiting for a receive */
    uint64_t waiting; /* messages among them waiting for a receive */
};

struct sim_recv {
    struct iovec iov[SIM_IOV];
    size_t count;
    size_t len;
    void *context;
    uint64_t flags; /* FI_COMPLETION: it completes into the receive CQ */
};

struct sim_cq;

struct sim_eq;

/* What every poll and post looks at comes first, on the lines right after the fid, ahead of the queues: a
 * thread driving many NICs (chapter 9's 32) touches as few lines of each endpoint per poll as it can. */
struct sim_ep {
    struct fid_ep fid;
    struct sim_domain *domain;
    struct sim_segment *seg; /* the domain's */
    struct sim_cq *tx_cq, *rx_cq;
    int slot;
    int enabled;
    atomic_flag lock; /* posting and progress of one endpoint from several threads (FI_THREAD_SAFE) */
    uint64_t tx_head, tx_sent, tx_tail; /* completed | left the NIC | waiting for the line | free */
    uint64_t tx_held;                   /* from it to tx_tail: posted with FI_MORE, the doorbell not rung yet */
    uint64_t tx_failed;                 /* operations in the queue that failed (err) and whose error is not queued */
    uint64_t last_due_ns;             /* the latest acknowledgement of what has left */
    uint64_t dip_at;                  /* the last operation that left due before an older one (unordered) */
    uint64_t next_due_ns;             /* no operation that left is due before it (0: look) */
    uint64_t rx_next_due_ns;          /* after a receive-side poll: when the first entry it found not due is */
    uint64_t rx_head, rx_tail;
    struct sim_av *av;
    struct sim_eq *eq;
    uint64_t tx_op_flags, rx_op_flags; /* defaults of the calls without flags (fi_endpoint's info) */
    int tx_selective, rx_selective;    /* bound with FI_SELECTIVE_COMPLETION */
    int nic;
    struct sim_pending tx[SIM_TX];
    struct sim_recv rx[SIM_RX];
    int16_t port_of[SIM_MAX_AV];      /* per AV entry: our port in that peer's endpoint + 1, 0 until claimed */
    uint64_t met_ns[SIM_MAX_AV];      /* per AV entry: when the handshake with it is done, 0 before the first write */
    struct sim_rx_port rx_ports[SIM_PORTS];
};

struct sim_cq { /* what a read looks at first (its lock, endpoints and error count), ahead of the error queue */
    struct fid_cq fid;
    struct sim_domain *domain;
    pthread_mutex_t lock;        /* readers, and the endpoints binding and leaving */
    int neps;
    unsigned next;               /* the endpoint the next read starts with, for fairness */
    uint64_t err_head, err_tail;
    struct sim_ep *eps[SIM_EPS]; /* bound endpoints (transmit, receive or both), progressed when it is read */
    int format;
    int wait_obj;
    _Atomic int signaled;        /* fi_cq_signal: a waiting fi_cq_sread returns */
    uint64_t streak;             /* the streak of empty polls that last found it empty (sim_host.c) */
    struct fi_cq_err_entry errs[SIM_ERRS];
    char err_text[SIM_ERRS][SIM_ERR_TEXT];
};

/* ---------------------------------------------------------------- sim_wire.c: model, segment, lines */

void sim_model_read(void);

/* The wall clock: what liveness and waits' timeouts are judged by. */
static inline uint64_t sim_wall_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

/* ---------------------------------------------------------------- sim_host.c: the modeled host */

enum sim_cost_id {
    SIM_COST_POST,        /* the provider's work to take one write or send */
    SIM_COST_DOORBELL,    /* ringing the NIC (a post without FI_MORE) */
    SIM_COST_FUTILE,      /* a post answered -FI_EAGAIN (the NIC's queue is full) */
    SIM_COST_POLL,        /* a CQ read that returns completions, before the completions */
    SIM_COST_POLL_EMPTY,  /* a CQ read that finds nothing */
    SIM_COST_ENTRY,       /* each completion it returns */
    SIM_COST_FAR,         /* what crossing to the other socket adds to a doorbell or a completion's line */
    SIM_COST_LINE_CCX,    /* a cache line fetched from another core of the same core complex (shared L3) */
    SIM_COST_LINE_SOCKET, /* a cache line fetched from another core complex of the same socket */
    SIM_COST_LINE_CROSS,  /* a cache line fetched from a core of the other socket */
    SIM_COST_REFILL,      /* refilling a moved thread's cache */
    SIM_COST_BALANCE,     /* how long the modeled scheduler leaves an unpinned thread on one core */
    SIM_COSTS
};

struct sim_cost {
    const char *name;
    double value;
    const char *unit;
    const char *source;
};
extern const struct sim_cost sim_costs[SIM_COSTS];

/* A thread that calls the provider, as the model sees it. */
struct sim_thread {
    uint32_t serial;                    /* 0 until its first call */
    int core, pinned;                   /* its core on the modeled host (-1 before it is placed) */
    uint64_t now;                       /* its modeled clock */
    uint64_t wall_out;                  /* the wall clock when it last left the provider */
    uint64_t cpu_sample, wall_sample;   /* its CPU clock, and the wall clock, when last compared */
    uint64_t next_move, random;         /* the modeled scheduler's */
    uint64_t streak, streak_due, streak_start, streak_polls; /* empty polls since it last did something */
    uint64_t access_wall, excluded;     /* a shared line's access on this box (fi_sim_ext.h: access_begin) */
    struct fi_sim_counts counts;
};

extern __thread struct sim_thread sim_self;

/* The model's time: the calling thread's modeled clock (the wall clock with FABRICLAB_SIM_TIME=wall). */
static inline uint64_t sim_now_ns(void) { return sim_model.wall ? sim_wall_ns() : sim_self.now; }
void sim_enter(void); /* at the start of each post and poll: the thread's own time since its last call */
void sim_leave(void);
void sim_busy(void);  /* the thread did something: its streak of empty polls ends */
void sim_charge_post(int nic, ssize_t rc, int rang);
void sim_charge_poll(struct sim_cq *cq, size_t entries, uint64_t next_due);
int sim_host_ops_open(struct fid *fid, const char *name, uint64_t flags, void **ops, void *context);
uint32_t sim_next_serial(void);
size_t sim_segment_size(void);
char *sim_port_data(struct sim_segment *s, int slot, int port);
int sim_format_addr(char *out, int nic, int pid, int fd, uint32_t serial, int slot);
int sim_parse_addr(const void *addr, int *nic, int *pid, int *fd, uint32_t *serial, int *slot);
void sim_format_nic_addr(char *out, int nic);
int sim_parse_nic(const void *addr, size_t len);
int sim_process_gone(int pid, int pidfd);
struct sim_segment *sim_map_peer(int pid, int fd, uint32_t serial);
struct sim_watch *sim_watch_open(int pid);
void sim_watch_close(struct sim_watch *w);
int sim_peer_alive_at(struct sim_peer *p, uint64_t when, uint64_t now);
int sim_claim_port(struct sim_ep *ep, fi_addr_t dest);
void sim_release_port(struct sim_ep *ep, fi_addr_t dest);
int64_t sim_reserve_data(struct sim_port *port, size_t len);
uint64_t sim_occupy_tx(struct sim_domain *d, size_t len, uint64_t now);
uint64_t sim_occupy_rx(struct sim_peer *peer, size_t len, uint64_t tx_start);

/* The peer was found gone and its last sign of life came before `when`: nothing of ours lands there after. */
static inline int sim_peer_known_dead(struct sim_peer *p, uint64_t when) {
    uint64_t dead_after = atomic_load_explicit(&p->dead_after_ns, memory_order_relaxed);
    return dead_after && when > dead_after;
}

/* Our port into the endpoint an AV entry names; NULL until the first message or immediate datum to it. */
static inline struct sim_port *sim_port_of(struct sim_ep *ep, fi_addr_t dest) {
    struct sim_peer *peer = &ep->av->peers[dest];
    int port = ep->port_of[dest] - 1;
    return port < 0 ? NULL : &peer->seg->ports[peer->slot][port];
}

/* ------------------------------------------------------------------- sim_getinfo.c: fi_getinfo */

int sim_getinfo(uint32_t version, const char *node, const char *service, uint64_t flags,
                const struct fi_info *hints, struct fi_info **out);
const char *sim_fabric_name(void);
int sim_domain_index(const char *name);

/* -------------------------------------------------------------------- the objects' constructors */

int sim_eq_open(struct fid_fabric *fabric, struct fi_eq_attr *attr, struct fid_eq **out, void *context);
int sim_av_open(struct fid_domain *dfid, struct fi_av_attr *attr, struct fid_av **out, void *context);
int sim_cq_open(struct fid_domain *dfid, struct fi_cq_attr *attr, struct fid_cq **out, void *context);
int sim_cntr_open(struct fid_domain *dfid, struct fi_cntr_attr *attr, struct fid_cntr **out, void *context);
int sim_ep_open(struct fid_domain *dfid, struct fi_info *info, struct fid_ep **out, void *context);
extern struct fi_ops_mr sim_mr_ops;

/* ------------------------------------------------------------------- what objects lend each other */

int sim_eq_bind(struct sim_eq *eq, int delta); /* an endpoint binds (+1) or leaves (-1) */
int sim_eq_trywait(struct fid *fid);
int sim_av_bind(struct sim_av *av, struct sim_ep *ep);
void sim_av_unbind(struct sim_av *av, struct sim_ep *ep);
int sim_cq_bind(struct sim_cq *cq, struct sim_ep *ep);
void sim_cq_unbind(struct sim_cq *cq, struct sim_ep *ep);
struct sim_mr_slot *sim_mr_find(struct sim_segment *seg, uint64_t key);

/* ------------------------------------------------------------ sim_ep.c, sim_post.c, sim_progress.c */

void sim_ep_lock(struct sim_ep *ep);
void sim_ep_unlock(struct sim_ep *ep);
extern struct fi_ops_msg sim_msg_ops;
extern struct fi_ops_rma sim_rma_ops;
void sim_send_due(struct sim_ep *ep, uint64_t now);
size_t sim_progress_rx(struct sim_ep *ep, void *buf, size_t count, size_t n, uint64_t now);
size_t sim_progress_tx(struct sim_ep *ep, void *buf, size_t count, size_t n, uint64_t now);
uint64_t sim_next_event(const struct sim_ep *ep, int rx, int tx);

/* ------------------------------------------------------------------------------------ sim_cq.c */

const char *sim_error_text(int err);
int sim_cq_push_error(struct sim_cq *cq, void *context, uint64_t flags, size_t len, int err, const char *fmt, ...)
    __attribute__((format(printf, 6, 7)));
void sim_cq_fill(struct sim_cq *cq, void *buf, size_t i, void *context, uint64_t flags, size_t len, void *data_buf,
                 uint64_t data);

/* ---------------------------------------------------- sim_unsupported.c: what the model does not offer */

int sim_no_bind(struct fid *fid, struct fid *bfid, uint64_t flags);
int sim_no_control(struct fid *fid, int command, void *arg);
int sim_no_ops_open(struct fid *fid, const char *name, uint64_t flags, void **ops, void *context);
int sim_no_ops_set(struct fid *fid, const char *name, uint64_t flags, void *ops, void *context);
int sim_no_passive_ep(struct fid_fabric *fabric, struct fi_info *info, struct fid_pep **pep, void *context);
int sim_no_wait_open(struct fid_fabric *fabric, struct fi_wait_attr *attr, struct fid_wait **waitset);
int sim_no_scalable_ep(struct fid_domain *domain, struct fi_info *info, struct fid_ep **sep, void *context);
int sim_no_poll_open(struct fid_domain *domain, struct fi_poll_attr *attr, struct fid_poll **pollset);
int sim_no_stx_ctx(struct fid_domain *domain, struct fi_tx_attr *attr, struct fid_stx **stx, void *context);
int sim_no_srx_ctx(struct fid_domain *domain, struct fi_rx_attr *attr, struct fid_ep **rx_ep, void *context);
int sim_no_query_atomic(struct fid_domain *domain, enum fi_datatype datatype, enum fi_op op,
                        struct fi_atomic_attr *attr, uint64_t flags);
int sim_no_query_collective(struct fid_domain *domain, enum fi_collective_op coll, struct fi_collective_attr *attr,
                            uint64_t flags);
int sim_no_av_set(struct fid_av *av, struct fi_av_set_attr *attr, struct fid_av_set **set, void *context);
extern struct fi_ops_tagged sim_no_tagged_ops;
extern struct fi_ops_atomic sim_no_atomic_ops;
extern struct fi_ops_collective sim_no_collective_ops;
ssize_t sim_no_read(struct fid_ep *ep, void *buf, size_t len, void *desc, fi_addr_t src, uint64_t addr, uint64_t key,
                    void *context);
ssize_t sim_no_readv(struct fid_ep *ep, const struct iovec *iov, void **desc, size_t count, fi_addr_t src,
                     uint64_t addr, uint64_t key, void *context);
ssize_t sim_no_readmsg(struct fid_ep *ep, const struct fi_msg_rma *msg, uint64_t flags);
/* connection management on a connectionless endpoint; scalable endpoints' contexts */
int sim_no_setname(fid_t fid, void *addr, size_t addrlen);
int sim_no_getpeer(struct fid_ep *ep, void *addr, size_t *addrlen);
int sim_no_connect(struct fid_ep *ep, const void *addr, const void *param, size_t paramlen);
int sim_no_listen(struct fid_pep *pep);
int sim_no_accept(struct fid_ep *ep, const void *param, size_t paramlen);
int sim_no_reject(struct fid_pep *pep, fid_t handle, const void *param, size_t paramlen);
int sim_no_shutdown(struct fid_ep *ep, uint64_t flags);
int sim_no_join(struct fid_ep *ep, const void *addr, uint64_t flags, struct fid_mc **mc, void *context);
int sim_no_tx_ctx(struct fid_ep *sep, int index, struct fi_tx_attr *attr, struct fid_ep **tx_ep, void *context);
int sim_no_rx_ctx(struct fid_ep *sep, int index, struct fi_rx_attr *attr, struct fid_ep **rx_ep, void *context);

#endif
