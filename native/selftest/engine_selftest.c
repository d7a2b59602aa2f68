/* The engine on its own, for the sanitizer builds the test suite makes: one process holds a target and
 * a writer on the shm provider (each with its own fabric, as two processes would), runs the target loop in
 * a thread and a multi-threaded, batched, lazy write run in another, then checks every page landed once
 * and byte for byte; then once more as the article's receiver (only each NIC's last write marked, the
 * target waiting for those), checking the marks and the bytes. Exit status 0 = all good. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <pthread.h>
#include <rdma/fabric.h>
#include <rdma/fi_cm.h>
#include <rdma/fi_domain.h>
#include <rdma/fi_endpoint.h>
#include <rdma/fi_eq.h>
#include "../course.h"

#define NICS 4
#define PAGES 257
#define PAGE 4096

#define CHECK(call) do { int _rc = (int)(call); if (_rc) { fprintf(stderr, "%s: %s\n", #call, fi_strerror(-_rc)); exit(2); } } while (0)

typedef struct side {
    struct fid_fabric *fabric;
    struct fid_domain *domain;
    struct fid_cq *cq[NICS];
    struct fid_av *av[NICS];
    struct fid_ep *ep[NICS];
    struct fid_mr *mr;
    char *buffer;
    fl_engine *engine;
} side;

static struct fi_info *info;

static void open_side(side *s) {
    CHECK(fi_fabric(info->fabric_attr, &s->fabric, NULL));
    CHECK(fi_domain(s->fabric, info, &s->domain, NULL));
    s->buffer = aligned_alloc(4096, (size_t)PAGES * PAGE);
    CHECK(fi_mr_reg(s->domain, s->buffer, (size_t)PAGES * PAGE, FI_WRITE | FI_REMOTE_WRITE, 0, 1, 0, &s->mr, NULL));
    s->engine = fl_engine_new(NICS, 1024);
    for (int i = 0; i < NICS; i++) {
        struct fi_cq_attr cq_attr = {.format = FI_CQ_FORMAT_DATA, .wait_obj = FI_WAIT_NONE};
        struct fi_av_attr av_attr = {.type = FI_AV_UNSPEC};
        CHECK(fi_cq_open(s->domain, &cq_attr, &s->cq[i], NULL));
        CHECK(fi_av_open(s->domain, &av_attr, &s->av[i], NULL));
        CHECK(fi_endpoint(s->domain, info, &s->ep[i], NULL));
        CHECK(fi_ep_bind(s->ep[i], &s->cq[i]->fid, FI_TRANSMIT | FI_RECV));
        CHECK(fi_ep_bind(s->ep[i], &s->av[i]->fid, 0));
        CHECK(fi_enable(s->ep[i]));
        fl_nic *n = &s->engine->nics[i];
        n->ep = s->ep[i];
        n->cq = s->cq[i];
        n->desc = fi_mr_desc(s->mr);
        n->group = i % 2;
        n->max_in_flight = 8;
        n->cq_data_size = info->domain_attr->cq_data_size;
    }
}

static void close_side(side *s) {
    fl_engine_free(s->engine);
    for (int i = 0; i < NICS; i++) {
        fi_close(&s->ep[i]->fid);
        fi_close(&s->av[i]->fid);
        fi_close(&s->cq[i]->fid);
    }
    fi_close(&s->mr->fid);
    fi_close(&s->domain->fid);
    fi_close(&s->fabric->fid);
    free(s->buffer);
}

static void *run_target(void *arg) {
    fl_engine *e = arg;
    fl_target_run(e, -1, 1, 10.0); /* unpinned; shm moves writes only while the target polls */
    return NULL;
}

/* One write run of every page into the target, its loop in a thread until `expected` writes (or marks) landed;
 * nonzero if either side failed or the bytes differ. */
static int run_once(side *writer, side *target, int mark_last, uint64_t expected) {
    target->engine->course.expected_arrivals = expected;
    target->engine->course.arrivals = 0;
    pthread_t tid;
    pthread_create(&tid, NULL, run_target, target->engine);
    fl_run_config cfg = {.threads = 2, .groups = 2, .warmup = 0, .pin = 0, .shard = 1, .pad = 1, .batch = 16,
                     .lazy = 1, .fi_more = 1, .mark_last = mark_last, .total_writes = PAGES, .page_size = PAGE,
                     .buffer_bytes = (uint64_t)PAGES * PAGE, .local_base = (uint64_t)(uintptr_t)writer->buffer,
                     .timeout_s = 10.0};
    int rc = fl_write_run(writer->engine, &cfg);
    pthread_join(tid, NULL);
    if (rc) fprintf(stderr, "writer: %s\n", writer->engine->error);
    if (target->engine->error_code) fprintf(stderr, "target: %s\n", target->engine->error);
    return rc != 0 || target->engine->error_code != 0 || memcmp(writer->buffer, target->buffer, (size_t)PAGES * PAGE);
}

int main(void) {
    struct fi_info *hints = fi_allocinfo();
    hints->caps = FI_MSG | FI_RMA;
    hints->ep_attr->type = FI_EP_RDM;
    hints->mode = FI_CONTEXT | FI_CONTEXT2;
    hints->domain_attr->mr_mode = FI_MR_VIRT_ADDR | FI_MR_LOCAL | FI_MR_ALLOCATED | FI_MR_PROV_KEY;
    hints->fabric_attr->prov_name = strdup("shm");
    CHECK(fi_getinfo(FI_VERSION(1, 9), NULL, NULL, 0, hints, &info));
    side target = {0}, writer = {0};
    open_side(&target);
    open_side(&writer);
    for (size_t i = 0; i < (size_t)PAGES * PAGE; i++) writer.buffer[i] = (char)(i * 7 + i / PAGE);
    memset(target.buffer, 0, (size_t)PAGES * PAGE);
    uint64_t remote_base = (info->domain_attr->mr_mode & FI_MR_VIRT_ADDR) ? (uint64_t)(uintptr_t)target.buffer : 0;
    for (int i = 0; i < NICS; i++) {
        char name[256];
        size_t len = sizeof name;
        fi_addr_t dest;
        CHECK(fi_getname(&target.ep[i]->fid, name, &len));
        if (fi_av_insert(writer.av[i], name, 1, &dest, 0, NULL) != 1) return 3;
        writer.engine->nics[i].dest = dest;
        writer.engine->nics[i].remote_base = remote_base;
        writer.engine->nics[i].rkey = fi_mr_key(target.mr);
    }
    uint32_t counts[PAGES] = {0};
    target.engine->course.page_counts = counts;
    target.engine->course.pages = PAGES;
    int bad = run_once(&writer, &target, 0, PAGES);
    for (int p = 0; p < PAGES; p++) bad |= counts[p] != 1;
    printf("engine selftest: %llu writes, %s\n", (unsigned long long)writer.engine->course.timed_writes, bad ? "FAILED" : "ok");
    /* the article's receiver: 2 groups of 2 NICs, so each group's last 2 writes are marked */
    for (size_t i = 0; i < (size_t)PAGES * PAGE; i++) writer.buffer[i] = (char)(i * 13 + 5);
    memset(target.buffer, 0, (size_t)PAGES * PAGE);
    target.engine->course.marks_only = 1;
    int marks_bad = run_once(&writer, &target, 1, 4) || writer.engine->course.marked_writes != 4 ||
                    target.engine->course.arrivals != 4;
    for (int p = 0; p < PAGES; p++) marks_bad |= counts[p] != 1; /* marks are not counted per page */
    printf("engine selftest, last writes marked: %llu writes, %llu marks, %s\n",
           (unsigned long long)writer.engine->course.timed_writes, (unsigned long long)target.engine->course.arrivals,
           marks_bad ? "FAILED" : "ok");
    bad |= marks_bad;
    close_side(&writer);
    close_side(&target);
    fi_freeinfo(info);
    fi_freeinfo(hints);
    return bad;
}
