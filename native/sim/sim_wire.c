/* The model's parameters, the shared segment through which processes meet, whether a peer lives, its ports
 * (one single-producer/single-consumer ring per sending endpoint) and the timing of the lines. */
#include "sim.h"

#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

struct sim_model sim_model;

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

void sim_model_read(void) {
    sim_model.nics = (int)env_double("FABRICLAB_SIM_NICS", 32);
    if (sim_model.nics > 1024) sim_model.nics = 1024;
    sim_model.ns_per_byte = 8.0 / env_double("FABRICLAB_SIM_GBPS", 100);
    sim_model.latency_ns = (uint64_t)(env_double("FABRICLAB_SIM_LATENCY_US", 2.0) * 1000);
    const char *p = getenv("FABRICLAB_SIM_PAYLOAD");
    sim_model.payload = p && *p && strcmp(p, "0") != 0;
    const char *o = getenv("FABRICLAB_SIM_ORDERED");
    sim_model.ordered = o && *o && strcmp(o, "0") != 0;
    const char *t = getenv("FABRICLAB_SIM_TIME");
    sim_model.wall = t && strcmp(t, "wall") == 0;
    if (t && *t && !sim_model.wall && strcmp(t, "modeled") != 0)
        fprintf(stderr, "libfabric sim: ignoring FABRICLAB_SIM_TIME=%s (modeled or wall)\n", t);
}

uint32_t sim_next_serial(void) {
    static _Atomic uint32_t serial;
    uint32_t next;
    do next = (atomic_fetch_add(&serial, 1) + 1) & SIM_SERIAL_MASK; /* never 0 */
    while (!next);
    return next;
}

/* -------------------------------------------------------------------------------- shared segment */

size_t sim_segment_size(void) {
    return sizeof(struct sim_segment) + (size_t)SIM_EPS * SIM_PORTS * SIM_DATA_BYTES;
}

char *sim_port_data(struct sim_segment *s, int slot, int port) {
    return (char *)s + sizeof(struct sim_segment) + ((size_t)slot * SIM_PORTS + port) * SIM_DATA_BYTES;
}

/* The address a peer inserts: text, so that fi_av_straddr and fabriclab's describe() can print it, in the
 * 32 bytes of EFA's: the NIC, then the process, its segment's descriptor and serial, and the endpoint's slot. */
int sim_format_addr(char *out, int nic, int pid, int fd, uint32_t serial, int slot) {
    memset(out, 0, SIM_ADDR_LEN);
    int n = snprintf(out, SIM_ADDR_LEN, "sim:%x/%x/%x/%x/%x", (unsigned)nic, (unsigned)pid, (unsigned)fd, serial,
                     (unsigned)slot);
    return n > 0 && n < SIM_ADDR_LEN ? 0 : -FI_ENOSPC;
}

int sim_parse_addr(const void *addr, int *nic, int *pid, int *fd, uint32_t *serial, int *slot) {
    char text[SIM_ADDR_LEN + 1];
    unsigned v[5];
    int end = -1;
    memcpy(text, addr, SIM_ADDR_LEN);
    text[SIM_ADDR_LEN] = 0;
    if (sscanf(text, "sim:%x/%x/%x/%x/%x%n", &v[0], &v[1], &v[2], &v[3], &v[4], &end) != 5 || text[end] ||
        v[1] > INT32_MAX || v[2] > INT32_MAX || v[4] >= SIM_EPS)
        return -FI_EINVAL;
    *nic = (int)v[0], *pid = (int)v[1], *fd = (int)v[2], *serial = v[3], *slot = (int)v[4];
    return 0;
}

/* A NIC's own address (fi_getinfo's source address, as EFA's names its device before any endpoint exists). */
void sim_format_nic_addr(char *out, int nic) {
    memset(out, 0, SIM_ADDR_LEN);
    snprintf(out, SIM_ADDR_LEN, "sim:%x", (unsigned)nic);
}

/* The NIC an address (a NIC's or an endpoint's) names, or -1. */
int sim_parse_nic(const void *addr, size_t len) {
    char text[SIM_ADDR_LEN + 1];
    unsigned nic;
    int end = -1;
    if (!addr || len > SIM_ADDR_LEN) return -1;
    memcpy(text, addr, len);
    text[len] = 0;
    if (sscanf(text, "sim:%x%n", &nic, &end) != 1 || (text[end] && text[end] != '/')) return -1;
    if (text[end] == '/') {
        int n, pid, fd, slot;
        uint32_t serial;
        if (len != SIM_ADDR_LEN || sim_parse_addr(addr, &n, &pid, &fd, &serial, &slot)) return -1;
    }
    return nic < 1024 ? (int)nic : -1;
}

/* Is the process gone: exited, killed, or a zombie its parent has not reaped (its NIC takes nothing more)?
 * With a pidfd one poll says so, and a pid used again by another process cannot fool it; else /proc. */
int sim_process_gone(int pid, int pidfd) {
    if (pidfd >= 0) {
        struct pollfd p = {.fd = pidfd, .events = POLLIN};
        return poll(&p, 1, 0) > 0;
    }
    char path[40], stat[512];
    snprintf(path, sizeof path, "/proc/%d/stat", pid);
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return errno == ENOENT || errno == ESRCH;
    ssize_t n = read(fd, stat, sizeof stat - 1);
    close(fd);
    if (n <= 0) return 1;
    stat[n] = 0;
    const char *state = strrchr(stat, ')'); /* "pid (comm) S ...": comm may itself hold ')' */
    return !state || state[1] != ' ' || state[2] == 'Z' || state[2] == 'X';
}

struct sim_segment *sim_map_peer(int pid, int fd, uint32_t serial) {
    char path[64];
    snprintf(path, sizeof path, "/proc/%d/fd/%d", pid, fd);
    int local = open(path, O_RDWR | O_CLOEXEC);
    if (local < 0) return NULL;
    void *p = mmap(NULL, sim_segment_size(), PROT_READ | PROT_WRITE, MAP_SHARED, local, 0);
    close(local);
    if (p == MAP_FAILED) return NULL;
    struct sim_segment *seg = p;
    if (seg->magic != SIM_MAGIC || seg->pid != pid || seg->serial != serial) {
        munmap(p, sim_segment_size());
        return NULL;
    }
    return seg;
}

/* ------------------------------------------------------------------------------------- liveness */

/* A peer process, looked at through one pidfd however many AV entries name it (an engine inserts each
 * peer once per NIC), and the time until which a look vouches for it. */
struct sim_watch {
    int pid, pidfd, refs; /* pidfd: -1 where pidfd_open is not offered */
    _Atomic uint64_t alive_until_ns;
};
static struct sim_watch this_process = {.pidfd = -1}; /* alive while we ask */
static struct sim_watch **watches;
static int watch_count;
static pthread_mutex_t watch_lock = PTHREAD_MUTEX_INITIALIZER;

struct sim_watch *sim_watch_open(int pid) {
    if (pid == getpid()) return &this_process;
    pthread_mutex_lock(&watch_lock);
    struct sim_watch *w = NULL;
    for (int i = 0; i < watch_count && !w; i++) /* the same process, not an earlier holder of its pid */
        if (watches[i]->pid == pid && !sim_process_gone(pid, watches[i]->pidfd)) w = watches[i];
    struct sim_watch **grown = w ? NULL : realloc(watches, (watch_count + 1) * sizeof *watches);
    if (grown) {
        watches = grown;
        if ((w = calloc(1, sizeof *w))) {
            /* its segment was just mapped: alive then */
            *w = (struct sim_watch){.pid = pid, .pidfd = (int)syscall(SYS_pidfd_open, pid, 0),
                                    .alive_until_ns = sim_wall_ns()};
            watches[watch_count++] = w;
        }
    }
    if (w) w->refs++;
    pthread_mutex_unlock(&watch_lock);
    return w;
}

void sim_watch_close(struct sim_watch *w) {
    if (w == &this_process) return;
    pthread_mutex_lock(&watch_lock);
    if (--w->refs == 0) {
        for (int i = 0; i < watch_count; i++)
            if (watches[i] == w) watches[i] = watches[--watch_count];
        if (w->pidfd >= 0) close(w->pidfd);
        free(w);
    }
    if (!watch_count) { /* nothing left for the library to hold when libfabric unloads it */
        free(watches);
        watches = NULL;
    }
    pthread_mutex_unlock(&watch_lock);
}

/* Was the peer alive at `when` (a time already past)? Signs of life: its own last poll of a CQ on that NIC,
 * and our last look at its process, which vouches for it SIM_VOUCH_NS on (the model learns of a death
 * within 1 ms; looking at every poll would cost a system call each). Only when neither covers `when` do we
 * look again: a peer found gone is judged at its last sign of life, so a write that landed before it died
 * still succeeds, however late its writer asks, and one that landed after fails. A peer in this process is
 * alive while we ask: while its domain is open that answers first, without reading the line its poller
 * rewrites at every poll (a cache miss per completion, where the course's target thread polls). */
int sim_peer_alive_at(struct sim_peer *p, uint64_t when, uint64_t now) {
    uint64_t dead_after = atomic_load_explicit(&p->dead_after_ns, memory_order_relaxed);
    if (dead_after) return when <= dead_after;
    struct sim_watch *w = p->watch;
    if (w == &this_process && atomic_load_explicit(&p->seg->alive, memory_order_acquire)) return 1;
    uint64_t seen = atomic_load_explicit(&w->alive_until_ns, memory_order_relaxed);
    if (when <= seen) return 1;
    uint64_t polled = atomic_load_explicit(&p->seg->polled_ns, memory_order_relaxed);
    if (polled > seen) seen = polled;
    if (when <= seen) return 1;
    int open = atomic_load_explicit(&p->seg->alive, memory_order_acquire); /* its domain is not closed */
    if (open && (w == &this_process || !sim_process_gone(w->pid, w->pidfd))) {
        if (w != &this_process) atomic_store_explicit(&w->alive_until_ns, now + SIM_VOUCH_NS, memory_order_relaxed);
        return 1;
    }
    uint64_t expected = 0;
    if (seen > now) seen = now; /* vouched for beyond what has passed: gone by now */
    atomic_compare_exchange_strong(&p->dead_after_ns, &expected, seen ? seen : 1);
    return when <= atomic_load(&p->dead_after_ns);
}

/* ----------------------------------------------------------------------------------------- ports */

static uint64_t port_owner(const struct sim_ep *ep) { return ((uint64_t)getpid() << 32) | ep->domain->serial; }

/* Claim a port in the peer's endpoint: this endpoint is then its only producer. -FI_ENOSPC when the peer's
 * endpoint already hears SIM_PORTS senders. */
int sim_claim_port(struct sim_ep *ep, fi_addr_t dest) {
    struct sim_peer *peer = &ep->av->peers[dest];
    uint64_t me = port_owner(ep);
    for (int i = 0; i < SIM_PORTS; i++) {
        struct sim_port *port = &peer->seg->ports[peer->slot][i];
        uint64_t owner = atomic_load(&port->owner);
        if (owner != 0 && !sim_process_gone((int)(owner >> 32), -1)) continue;
        /* a port of a killed sender is taken over once its entries are read */
        if (owner != 0 && atomic_load(&port->tail) != atomic_load(&port->head)) continue;
        if (!atomic_compare_exchange_strong(&port->owner, &owner, me)) continue;
        atomic_store(&port->closed, 0);
        port->data_head = atomic_load(&port->data_tail);
        port->posted = atomic_load(&port->tail);
        atomic_store(&port->head, port->posted);
        atomic_fetch_or(&peer->seg->ports_used[peer->slot][i / 64], 1ull << (i % 64));
        ep->port_of[dest] = (int16_t)(i + 1);
        return 0;
    }
    return -FI_ENOSPC;
}

/* This endpoint sends no more to dest: the target frees the port once it has read what is there. */
void sim_release_port(struct sim_ep *ep, fi_addr_t dest) {
    struct sim_port *port = ep->av->peers[dest].seg ? sim_port_of(ep, dest) : NULL;
    if (port) atomic_store_explicit(&port->closed, 1, memory_order_release);
    ep->port_of[dest] = 0;
}

/* Reserve len contiguous bytes of the port's data ring (a message never wraps): their position in the
 * port's data stream, or -1 while the ring is full. */
int64_t sim_reserve_data(struct sim_port *port, size_t len) {
    uint64_t tail = atomic_load_explicit(&port->data_tail, memory_order_acquire);
    uint64_t head = port->data_head;
    uint64_t at = head % SIM_DATA_BYTES;
    if (at + len > SIM_DATA_BYTES) head += SIM_DATA_BYTES - at; /* skip to the start of the ring */
    if (head + len - tail > SIM_DATA_BYTES) return -1;
    port->data_head = head + len;
    return (int64_t)head;
}

/* ----------------------------------------------------------------------------------------- lines */

/* The write or message takes this NIC's transmit line (shared by its endpoints) once it is free, and not
 * before `now`: returns when its first byte leaves. */
uint64_t sim_occupy_tx(struct sim_domain *d, size_t len, uint64_t now) {
    uint64_t wire = (uint64_t)(len * sim_model.ns_per_byte);
    uint64_t free_ns = atomic_load_explicit(&d->tx_free_ns, memory_order_relaxed), start;
    do {
        start = free_ns > now ? free_ns : now;
    } while (!atomic_compare_exchange_weak_explicit(&d->tx_free_ns, &free_ns, start + wire, memory_order_relaxed,
                                                    memory_order_relaxed));
    return start;
}

/* Once it has started to leave, it takes the target NIC's receive line, shared by every sender to it, in
 * the order bytes arrive there: after whatever arrived before, never behind what is still queued at
 * another sender. Returns when its last byte lands. */
uint64_t sim_occupy_rx(struct sim_peer *peer, size_t len, uint64_t tx_start) {
    uint64_t wire = (uint64_t)(len * sim_model.ns_per_byte);
    uint64_t first_byte = tx_start + sim_model.latency_ns, last_byte = first_byte + wire;
    uint64_t rx_free = atomic_load_explicit(&peer->seg->rx_free_ns, memory_order_relaxed), rx_end;
    do {
        uint64_t start = rx_free > first_byte ? rx_free : first_byte;
        rx_end = start + wire > last_byte ? start + wire : last_byte;
    } while (!atomic_compare_exchange_weak_explicit(&peer->seg->rx_free_ns, &rx_free, rx_end, memory_order_relaxed,
                                                    memory_order_relaxed));
    return rx_end;
}
