/* The model's parameters, the shared segment through which processes meet, its ports (one
 * single-producer/single-consumer ring per sending endpoint) and the timing of the lines. */
#include "sim.h"

#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

struct sim_model sim_model;

uint64_t sim_now_ns(void) {
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

void sim_model_read(void) {
    sim_model.nics = (int)env_double("FABRICLAB_SIM_NICS", 32);
    if (sim_model.nics > 1024) sim_model.nics = 1024;
    sim_model.ns_per_byte = 8.0 / env_double("FABRICLAB_SIM_GBPS", 100);
    sim_model.latency_ns = (uint64_t)(env_double("FABRICLAB_SIM_LATENCY_US", 2.0) * 1000);
    const char *p = getenv("FABRICLAB_SIM_PAYLOAD");
    sim_model.payload = p && *p && strcmp(p, "0") != 0;
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

int sim_process_gone(int pid) { return kill(pid, 0) < 0 && errno == ESRCH; }

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

/* Is the process behind a peer gone? Asked only while writes to it are pending, at most every 10 ms. */
int sim_peer_dead(struct sim_peer *p, uint64_t now) {
    if (atomic_load_explicit(&p->dead, memory_order_relaxed)) return 1;
    if (now - atomic_load_explicit(&p->checked_ns, memory_order_relaxed) < SIM_LIVENESS_NS) return 0;
    atomic_store_explicit(&p->checked_ns, now, memory_order_relaxed);
    int dead = !atomic_load_explicit(&p->seg->alive, memory_order_acquire) || sim_process_gone(p->pid);
    if (dead) atomic_store_explicit(&p->dead, 1, memory_order_relaxed);
    return dead;
}

/* ----------------------------------------------------------------------------------------- ports */

/* Claim a port in the peer's segment for this endpoint: it is then the port's only producer. Its index, or
 * -FI_EAGAIN. */
int sim_claim_port(struct sim_ep *ep, struct sim_peer *peer) {
    uint64_t me = ((uint64_t)getpid() << 32) | ep->domain->serial;
    for (int i = 0; i < SIM_PORTS; i++) {
        struct sim_port *port = &peer->seg->ports[peer->slot][i];
        uint64_t owner = atomic_load(&port->owner);
        if (owner != 0 && !sim_process_gone((int)(owner >> 32))) continue;
        /* a port of a killed sender is taken over once its entries are read */
        if (owner != 0 && atomic_load(&port->tail) != atomic_load(&port->head)) continue;
        if (!atomic_compare_exchange_strong(&port->owner, &owner, me)) continue;
        atomic_store(&port->closed, 0);
        port->data_head = atomic_load(&port->data_tail);
        atomic_store(&port->head, atomic_load(&port->tail));
        atomic_fetch_or(&peer->seg->ports_used[peer->slot], 1ull << i);
        return i;
    }
    return -FI_EAGAIN;
}

void sim_release_port(struct sim_peer *p, int port) {
    if (p->seg && port >= 0) atomic_store_explicit(&p->seg->ports[p->slot][port].closed, 1, memory_order_release);
}

/* Reserve len contiguous bytes of the port's data ring (a message never wraps); offset or -1 when full. */
int64_t sim_reserve_data(struct sim_port *port, size_t len) {
    uint64_t tail = atomic_load_explicit(&port->data_tail, memory_order_acquire);
    uint64_t head = port->data_head;
    uint64_t at = head % SIM_DATA_BYTES;
    if (at + len > SIM_DATA_BYTES) head += SIM_DATA_BYTES - at; /* skip to the start of the ring */
    if (head + len - tail > SIM_DATA_BYTES) return -1;
    port->data_head = head + len;
    return (int64_t)(head % SIM_DATA_BYTES);
}

/* ----------------------------------------------------------------------------------------- lines */

/* The wire: the write or message occupies this NIC's transmit line and then the target NIC's receive line
 * (shared by every sender to it). Returns when the last byte lands at the target. */
uint64_t sim_occupy_lines(struct sim_ep *ep, struct sim_peer *peer, size_t len, uint64_t now) {
    struct sim_domain *d = ep->domain;
    uint64_t wire = (uint64_t)(len * sim_model.ns_per_byte);
    /* the domain's endpoints share its transmit line and may post from several threads (FI_THREAD_SAFE) */
    uint64_t tx_free = atomic_load_explicit(&d->tx_free_ns, memory_order_relaxed), tx_start, tx_end;
    do {
        tx_start = tx_free > now ? tx_free : now;
        tx_end = tx_start + wire;
    } while (!atomic_compare_exchange_weak_explicit(&d->tx_free_ns, &tx_free, tx_end, memory_order_relaxed,
                                                    memory_order_relaxed));
    uint64_t first_byte = tx_start + sim_model.latency_ns, last_byte = tx_end + sim_model.latency_ns;
    uint64_t rx_free = atomic_load_explicit(&peer->seg->rx_free_ns, memory_order_relaxed), rx_end;
    do {
        uint64_t start = rx_free > first_byte ? rx_free : first_byte;
        rx_end = start + wire > last_byte ? start + wire : last_byte;
    } while (!atomic_compare_exchange_weak_explicit(&peer->seg->rx_free_ns, &rx_free, rx_end, memory_order_relaxed,
                                                    memory_order_relaxed));
    return rx_end;
}
