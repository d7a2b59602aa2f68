/* Event queues: the model has no connections and inserts addresses at once, so nothing of its own arrives
 * here; an EQ holds what the application writes (fi_eq_write), which is what tools that open one need.
 * With a wait object, an eventfd is readable while events wait (FI_WAIT_FD hands it out: FI_GETWAIT). */
#include "sim.h"

#include <errno.h>
#include <poll.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <unistd.h>

struct sim_event {
    uint32_t event;
    size_t len;
    void *data;
};

struct sim_eq {
    struct fid_eq fid;
    struct sim_fabric *fabric;
    pthread_mutex_t lock;
    int wait_obj;
    int efd;            /* readable while events wait (-1 without a wait object) */
    size_t size;        /* events it holds */
    struct sim_event *ring;
    uint64_t head, tail;
    _Atomic int bound;  /* endpoints bound to it */
};

static void signal_fd(struct sim_eq *eq, int set) {
    uint64_t one = 1;
    if (eq->efd < 0) return;
    if (set) (void)!write(eq->efd, &one, sizeof one);
    else (void)!read(eq->efd, &one, sizeof one); /* non-blocking: clears the count */
}

static ssize_t eq_read(struct fid_eq *fid, uint32_t *event, void *buf, size_t len, uint64_t flags) {
    struct sim_eq *eq = (struct sim_eq *)fid;
    pthread_mutex_lock(&eq->lock);
    ssize_t rc = -FI_EAGAIN;
    if (eq->head != eq->tail) {
        struct sim_event *e = &eq->ring[eq->head % eq->size];
        rc = -FI_ETOOSMALL;
        if (len >= e->len) {
            if (event) *event = e->event;
            if (buf) memcpy(buf, e->data, e->len);
            rc = (ssize_t)e->len;
            if (!(flags & FI_PEEK)) {
                free(e->data);
                if (++eq->head == eq->tail) signal_fd(eq, 0);
            }
        }
    }
    pthread_mutex_unlock(&eq->lock);
    return rc;
}

static ssize_t eq_readerr(struct fid_eq *fid, struct fi_eq_err_entry *buf, uint64_t flags) {
    return -FI_EAGAIN; /* the model raises no asynchronous errors */
}

static ssize_t eq_write(struct fid_eq *fid, uint32_t event, const void *buf, size_t len, uint64_t flags) {
    struct sim_eq *eq = (struct sim_eq *)fid;
    if (!buf && len) return -FI_EINVAL;
    void *copy = malloc(len ? len : 1);
    if (!copy) return -FI_ENOMEM;
    memcpy(copy, buf, len);
    pthread_mutex_lock(&eq->lock);
    ssize_t rc = -FI_EAGAIN; /* full: it holds attr->size events */
    if (eq->tail - eq->head < eq->size) {
        eq->ring[eq->tail++ % eq->size] = (struct sim_event){event, len, copy};
        if (eq->tail - eq->head == 1) signal_fd(eq, 1);
        rc = (ssize_t)len;
    }
    pthread_mutex_unlock(&eq->lock);
    if (rc < 0) free(copy);
    return rc;
}

static ssize_t eq_sread(struct fid_eq *fid, uint32_t *event, void *buf, size_t len, int timeout, uint64_t flags) {
    struct sim_eq *eq = (struct sim_eq *)fid;
    if (eq->efd < 0) return -FI_ENOSYS; /* FI_WAIT_NONE: no waiting (fi_eq(3)) */
    uint64_t deadline = timeout < 0 ? UINT64_MAX : sim_wall_ns() + (uint64_t)timeout * 1000000;
    for (;;) {
        ssize_t rc = eq_read(fid, event, buf, len, flags);
        if (rc != -FI_EAGAIN) return rc;
        uint64_t now = sim_wall_ns();
        if (now >= deadline) return -FI_EAGAIN;
        struct pollfd p = {.fd = eq->efd, .events = POLLIN};
        uint64_t left_ms = (deadline - now + 999999) / 1000000;
        if (poll(&p, 1, timeout < 0 ? -1 : (int)(left_ms > 1000000 ? 1000000 : left_ms)) < 0 && errno != EINTR)
            return -errno;
    }
}

static const char *eq_strerror(struct fid_eq *fid, int prov_errno, const void *err_data, char *buf, size_t len) {
    const char *text = fi_strerror(prov_errno);
    if (buf && len) {
        strncpy(buf, text, len - 1);
        buf[len - 1] = 0;
        return buf;
    }
    return text;
}

static int eq_control(struct fid *fid, int command, void *arg) {
    struct sim_eq *eq = (struct sim_eq *)fid;
    if (command != FI_GETWAIT) return -FI_ENOSYS;
    if (eq->wait_obj != FI_WAIT_FD || !arg) return -FI_EINVAL;
    *(int *)arg = eq->efd;
    return 0;
}

int sim_eq_bind(struct sim_eq *eq, int delta) {
    atomic_fetch_add(&eq->bound, delta);
    return 0;
}

/* fi_trywait: 0 if the application may block on the EQ's fd, -FI_EAGAIN if events wait already. */
int sim_eq_trywait(struct fid *fid) {
    struct sim_eq *eq = (struct sim_eq *)fid;
    pthread_mutex_lock(&eq->lock);
    int empty = eq->head == eq->tail;
    pthread_mutex_unlock(&eq->lock);
    return empty ? 0 : -FI_EAGAIN;
}

static int eq_close(struct fid *fid) {
    struct sim_eq *eq = (struct sim_eq *)fid;
    if (atomic_load(&eq->bound)) return -FI_EBUSY;
    for (uint64_t i = eq->head; i != eq->tail; i++) free(eq->ring[i % eq->size].data);
    if (eq->efd >= 0) close(eq->efd);
    atomic_fetch_sub(&eq->fabric->refs, 1);
    pthread_mutex_destroy(&eq->lock);
    free(eq->ring);
    free(eq);
    return 0;
}

static struct fi_ops eq_fi_ops = {.size = sizeof(struct fi_ops), .close = eq_close, .bind = sim_no_bind,
                                  .control = eq_control, .ops_open = sim_no_ops_open, .ops_set = sim_no_ops_set};
static struct fi_ops_eq eq_ops = {.size = sizeof(struct fi_ops_eq), .read = eq_read, .readerr = eq_readerr,
                                  .write = eq_write, .sread = eq_sread, .strerror = eq_strerror};

int sim_eq_open(struct fid_fabric *fabric, struct fi_eq_attr *attr, struct fid_eq **out, void *context) {
    int wait = attr ? attr->wait_obj : FI_WAIT_NONE;
    if (wait != FI_WAIT_NONE && wait != FI_WAIT_UNSPEC && wait != FI_WAIT_FD) return -FI_ENOSYS;
    if (attr && (attr->flags & FI_AFFINITY)) return -FI_ENOSYS;
    struct sim_eq *eq = calloc(1, sizeof *eq);
    if (!eq) return -FI_ENOMEM;
    eq->size = attr && attr->size ? attr->size : 256;
    eq->ring = calloc(eq->size, sizeof *eq->ring);
    eq->efd = wait == FI_WAIT_NONE ? -1 : eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    if (!eq->ring || (wait != FI_WAIT_NONE && eq->efd < 0)) {
        int err = eq->ring ? errno : ENOMEM;
        free(eq->ring);
        free(eq);
        return -err;
    }
    pthread_mutex_init(&eq->lock, NULL);
    eq->wait_obj = wait;
    eq->fabric = (struct sim_fabric *)fabric;
    atomic_fetch_add(&eq->fabric->refs, 1);
    eq->fid.fid = (struct fid){.fclass = FI_CLASS_EQ, .context = context, .ops = &eq_fi_ops};
    eq->fid.ops = &eq_ops;
    *out = &eq->fid;
    return 0;
}
