/*
 * memcpy_transport.c: kvrelay's sample transport plug-in (src/fabric/kvrelay_transport.h, ABI version 1).
 *
 * Every endpoint lives in this process. Registered regions are looked up by lkey (the sender's SGEs) and rkey (the
 * receiver's range) with bounds checks; a post executes each work request at once with memcpy and queues its
 * completions, so a completion is pollable as soon as `post` returns. The whole contract of the header is kept:
 * post order per QP, selective signalling, protection errors that write nothing, the error state and FLUSHED for
 * later work requests, RETRY_EXCEEDED when the peer QP is not connected back, WRITE_WITH_IMM notifications on the
 * receiver's CQ after the data, and deregistration revoking both keys.
 *
 * Build (C11, no dependencies):
 *     cc -std=c11 -Wall -Wextra -Werror -shared -fPIC -I src/fabric \
 *        -o libkvrelay_memcpy.so tests/plugins/memcpy/memcpy_transport.c
 *
 * The planted bug, for checking that certification catches a wrong transport: built with
 * -DKVRELAY_SAMPLE_PLANT_WRONG_OFFSET, a write whose remote offset within its region is at least 4096 bytes lands
 * 64 bytes further when it still fits inside the region (so no protection error hides it). Small conformance
 * cases still pass; real layouts land misplaced.
 *
 * Threads: none. The loader calls one function at a time (see the header), so the global state has no locks.
 */
#define _POSIX_C_SOURCE 200809L

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "kvrelay_transport.h"

#ifdef KVRELAY_SAMPLE_PLANT_WRONG_OFFSET
#define SAMPLE_NAME "memcpy-sample-planted"
#define SAMPLE_PLANTED "1"
#else
#define SAMPLE_NAME "memcpy-sample"
#define SAMPLE_PLANTED "0"
#endif

/* Test hooks, for kvrelay's loader tests only (tests/it/plugin.rs); a normal build defines none of them.
 *   SAMPLE_ABI_VERSION=N   announce ABI version N
 *   SAMPLE_MISBEHAVE=1     every completion carries an unknown status code (77)
 *   SAMPLE_MISBEHAVE=2     every completion names a QP the endpoint never created
 *   SAMPLE_MISBEHAVE=3     every successful completion reports one byte more than the work request moved
 *   SAMPLE_MISBEHAVE=4     info returns NULL
 *   SAMPLE_MISBEHAVE=5     the table's `post` is NULL */
#ifndef SAMPLE_ABI_VERSION
#define SAMPLE_ABI_VERSION KVRELAY_TRANSPORT_ABI_VERSION
#endif
#ifndef SAMPLE_MISBEHAVE
#define SAMPLE_MISBEHAVE 0
#endif

/* Offsets at or past this within a region are shifted by the planted bug. */
#define PLANT_FROM_OFFSET 4096u
#define PLANT_SHIFT 64u

/* The limits of this transport. */
#define SAMPLE_MAX_SGE 16u
#define SAMPLE_SQ_DEPTH 4096u
#define SAMPLE_MAX_MESSAGE (1ull << 30)
#define SAMPLE_MAX_REGISTERED (1ull << 40)

typedef struct region {
    uint8_t *base;
    uint64_t len;
    uint32_t lkey;
    uint32_t rkey;
} region;

typedef struct qp {
    uint32_t qpn;
    int connected;
    int failed;
    kvrelay_qp_info peer;
} qp;

struct kvrelay_endpoint {
    uint32_t node;
    kvrelay_caps caps;
    uint64_t registered;
    region *regions;
    size_t num_regions, cap_regions;
    qp *qps;
    size_t num_qps, cap_qps;
    /* The CQ: completions [cq_head, cq_head + cq_len) of cq. */
    kvrelay_completion *cq;
    size_t cq_head, cq_len, cq_cap;
    char error[256];
};

/* Every open endpoint of the process. */
static kvrelay_endpoint **endpoints;
static size_t num_endpoints, cap_endpoints;
/* Keys and QP numbers are unique across the process, so a key used on the wrong node never resolves. */
static uint32_t next_key = 0x100;
static uint32_t next_qpn = 0x40;
static char open_error[256];

static int fail(kvrelay_endpoint *ep, int code, const char *message) {
    if (ep) {
        snprintf(ep->error, sizeof ep->error, "%s", message);
    } else {
        snprintf(open_error, sizeof open_error, "%s", message);
    }
    return code;
}

/* Grows *array (of *cap elements of `size` bytes) to hold at least `need`; 0 on success. */
static int grow(void **array, size_t *cap, size_t need, size_t size) {
    if (need <= *cap) {
        return 0;
    }
    size_t next = *cap ? *cap * 2 : 8;
    while (next < need) {
        next *= 2;
    }
    void *bigger = realloc(*array, next * size);
    if (!bigger) {
        return -1;
    }
    *array = bigger;
    *cap = next;
    return 0;
}

static int push_completion(kvrelay_endpoint *ep, kvrelay_completion wc) {
    if (ep->cq_head + ep->cq_len == ep->cq_cap && ep->cq_head > 0) {
        memmove(ep->cq, ep->cq + ep->cq_head, ep->cq_len * sizeof *ep->cq);
        ep->cq_head = 0;
    }
    if (grow((void **)&ep->cq, &ep->cq_cap, ep->cq_head + ep->cq_len + 1, sizeof *ep->cq) != 0) {
        return -1;
    }
    ep->cq[ep->cq_head + ep->cq_len] = wc;
    ep->cq_len++;
    return 0;
}

static qp *find_qp(kvrelay_endpoint *ep, uint32_t qpn) {
    for (size_t i = 0; i < ep->num_qps; i++) {
        if (ep->qps[i].qpn == qpn) {
            return &ep->qps[i];
        }
    }
    return NULL;
}

static region *by_lkey(kvrelay_endpoint *ep, uint32_t lkey) {
    for (size_t i = 0; i < ep->num_regions; i++) {
        if (ep->regions[i].lkey == lkey) {
            return &ep->regions[i];
        }
    }
    return NULL;
}

static region *by_rkey(kvrelay_endpoint *ep, uint32_t rkey) {
    for (size_t i = 0; i < ep->num_regions; i++) {
        if (ep->regions[i].rkey == rkey) {
            return &ep->regions[i];
        }
    }
    return NULL;
}

/* Whether [addr, addr + len) lies inside `r`; sets *offset to addr's offset within it. */
static int inside(const region *r, uint64_t addr, uint64_t len, uint64_t *offset) {
    uint64_t base = (uint64_t)(uintptr_t)r->base;
    if (addr < base) {
        return 0;
    }
    uint64_t start = addr - base;
    if (start > r->len || len > r->len - start) {
        return 0;
    }
    *offset = start;
    return 1;
}

/* The endpoint of `node` holding QP `qpn`, and that QP. */
static qp *find_peer(uint32_t node, uint32_t qpn, kvrelay_endpoint **owner) {
    for (size_t i = 0; i < num_endpoints; i++) {
        if (endpoints[i]->node != node) {
            continue;
        }
        qp *found = find_qp(endpoints[i], qpn);
        if (found) {
            *owner = endpoints[i];
            return found;
        }
    }
    return NULL;
}

/* Runs one work request on `q` of `ep`: its status. */
static uint32_t execute(kvrelay_endpoint *ep, qp *q, const kvrelay_work_request *wr, uint64_t *moved) {
    *moved = 0;
    if (q->failed) {
        return KVRELAY_WC_FLUSHED;
    }
    kvrelay_endpoint *target = NULL;
    qp *back = find_peer(q->peer.node, q->peer.qpn, &target);
    if (!back || !back->connected || back->peer.node != ep->node || back->peer.qpn != q->qpn) {
        return KVRELAY_WC_RETRY_EXCEEDED;
    }
    uint64_t total = 0;
    for (uint32_t i = 0; i < wr->num_sge; i++) {
        const kvrelay_sge *sge = &wr->sges[i];
        region *source = by_lkey(ep, sge->lkey);
        uint64_t offset;
        if (!source || !inside(source, sge->addr, sge->len, &offset) || sge->len > UINT64_MAX - total) {
            return KVRELAY_WC_LOCAL_PROTECTION;
        }
        total += sge->len;
    }
    region *dest = by_rkey(target, wr->rkey);
    uint64_t at;
    if (!dest || !inside(dest, wr->remote_addr, total, &at)) {
        return KVRELAY_WC_REMOTE_ACCESS;
    }
#ifdef KVRELAY_SAMPLE_PLANT_WRONG_OFFSET
    if (at >= PLANT_FROM_OFFSET && total <= dest->len - at && dest->len - at - total >= PLANT_SHIFT) {
        at += PLANT_SHIFT; /* the planted bug: still inside the region, 64 bytes off */
    }
#endif
    /* Gather first (a source may overlap the destination on one node), then write. */
    uint8_t *staging = NULL;
    if (total > 0) {
        staging = malloc((size_t)total);
        if (!staging) {
            return KVRELAY_WC_LOCAL_PROTECTION;
        }
        uint64_t filled = 0;
        for (uint32_t i = 0; i < wr->num_sge; i++) {
            const kvrelay_sge *sge = &wr->sges[i];
            region *source = by_lkey(ep, sge->lkey);
            uint64_t offset = 0;
            inside(source, sge->addr, sge->len, &offset);
            memcpy(staging + filled, source->base + offset, (size_t)sge->len);
            filled += sge->len;
        }
        memcpy(dest->base + at, staging, (size_t)total);
        free(staging);
    }
    *moved = total;
    if (wr->flags & KVRELAY_WR_WITH_IMM) {
        kvrelay_completion note = {0, total, back->qpn, KVRELAY_WC_SUCCESS, KVRELAY_WC_RECV_IMM, wr->imm};
        if (push_completion(target, note) != 0) {
            return KVRELAY_WC_REMOTE_ACCESS;
        }
    }
    return KVRELAY_WC_SUCCESS;
}

static const char *sample_info(void) {
#if SAMPLE_MISBEHAVE == 4
    return NULL;
#endif
    return "name=" SAMPLE_NAME "\n"
           "version=1.0.0\n"
           "kind=in-process memcpy\n"
           "planted_wrong_offset=" SAMPLE_PLANTED "\n";
}

static int sample_capabilities(kvrelay_caps *out) {
    if (!out) {
        return KVRELAY_ERR_INVALID;
    }
    out->max_sge = SAMPLE_MAX_SGE;
    out->sq_depth = SAMPLE_SQ_DEPTH;
    out->max_message = SAMPLE_MAX_MESSAGE;
    out->max_registered_bytes = SAMPLE_MAX_REGISTERED;
    return KVRELAY_OK;
}

#define MIN(a, b) ((a) < (b) ? (a) : (b))

static int sample_open(uint32_t node, const kvrelay_caps *requested, kvrelay_caps *granted, kvrelay_endpoint **out) {
    if (!requested || !granted || !out) {
        return fail(NULL, KVRELAY_ERR_INVALID, "open: a NULL argument");
    }
    if (grow((void **)&endpoints, &cap_endpoints, num_endpoints + 1, sizeof *endpoints) != 0) {
        return fail(NULL, KVRELAY_ERR_EXHAUSTED, "open: out of memory");
    }
    kvrelay_endpoint *ep = calloc(1, sizeof *ep);
    if (!ep) {
        return fail(NULL, KVRELAY_ERR_EXHAUSTED, "open: out of memory");
    }
    ep->node = node;
    ep->caps.max_sge = MIN(requested->max_sge, SAMPLE_MAX_SGE);
    ep->caps.sq_depth = MIN(requested->sq_depth, SAMPLE_SQ_DEPTH);
    ep->caps.max_message = MIN(requested->max_message, SAMPLE_MAX_MESSAGE);
    ep->caps.max_registered_bytes = MIN(requested->max_registered_bytes, SAMPLE_MAX_REGISTERED);
    endpoints[num_endpoints++] = ep;
    *granted = ep->caps;
    *out = ep;
    return KVRELAY_OK;
}

static void sample_close(kvrelay_endpoint *ep) {
    for (size_t i = 0; i < num_endpoints; i++) {
        if (endpoints[i] == ep) {
            endpoints[i] = endpoints[--num_endpoints];
            break;
        }
    }
    if (ep) {
        free(ep->regions);
        free(ep->qps);
        free(ep->cq);
        free(ep);
    }
}

static uint32_t fresh_key(void) {
    return next_key++;
}

static int sample_register(kvrelay_endpoint *ep, void *ptr, uint64_t len, kvrelay_region *out) {
    if (!ep || !ptr || !out) {
        return fail(ep, KVRELAY_ERR_INVALID, "register_memory: a NULL argument");
    }
    if (len > ep->caps.max_registered_bytes - ep->registered || len > ep->caps.max_registered_bytes) {
        return fail(ep, KVRELAY_ERR_EXHAUSTED, "register_memory: over max_registered_bytes");
    }
    if (next_key > UINT32_MAX - 2) {
        return fail(ep, KVRELAY_ERR_EXHAUSTED, "register_memory: out of memory keys");
    }
    if (grow((void **)&ep->regions, &ep->cap_regions, ep->num_regions + 1, sizeof *ep->regions) != 0) {
        return fail(ep, KVRELAY_ERR_EXHAUSTED, "register_memory: out of memory");
    }
    region r = {ptr, len, 0, 0};
    r.lkey = fresh_key();
    r.rkey = fresh_key();
    ep->regions[ep->num_regions++] = r;
    ep->registered += len;
    out->addr = (uint64_t)(uintptr_t)ptr;
    out->len = len;
    out->lkey = r.lkey;
    out->rkey = r.rkey;
    return KVRELAY_OK;
}

static int sample_deregister(kvrelay_endpoint *ep, const kvrelay_region *target) {
    if (!ep || !target) {
        return fail(ep, KVRELAY_ERR_INVALID, "deregister_memory: a NULL argument");
    }
    for (size_t i = 0; i < ep->num_regions; i++) {
        region *r = &ep->regions[i];
        if ((uint64_t)(uintptr_t)r->base == target->addr && r->len == target->len && r->lkey == target->lkey &&
            r->rkey == target->rkey) {
            ep->registered -= r->len;
            ep->regions[i] = ep->regions[--ep->num_regions];
            return KVRELAY_OK;
        }
    }
    return fail(ep, KVRELAY_ERR_UNKNOWN_REGION, "deregister_memory: no such region on this endpoint");
}

static int sample_create_qp(kvrelay_endpoint *ep, kvrelay_qp_info *out) {
    if (!ep || !out) {
        return fail(ep, KVRELAY_ERR_INVALID, "create_qp: a NULL argument");
    }
    if (next_qpn == UINT32_MAX) {
        return fail(ep, KVRELAY_ERR_EXHAUSTED, "create_qp: out of QP numbers");
    }
    if (grow((void **)&ep->qps, &ep->cap_qps, ep->num_qps + 1, sizeof *ep->qps) != 0) {
        return fail(ep, KVRELAY_ERR_EXHAUSTED, "create_qp: out of memory");
    }
    qp q;
    memset(&q, 0, sizeof q);
    q.qpn = next_qpn++;
    ep->qps[ep->num_qps++] = q;
    memset(out, 0, sizeof *out);
    out->node = ep->node;
    out->qpn = q.qpn;
    return KVRELAY_OK;
}

static int sample_connect_qp(kvrelay_endpoint *ep, uint32_t local_qpn, const kvrelay_qp_info *remote) {
    if (!ep || !remote) {
        return fail(ep, KVRELAY_ERR_INVALID, "connect_qp: a NULL argument");
    }
    qp *q = find_qp(ep, local_qpn);
    if (!q) {
        return fail(ep, KVRELAY_ERR_UNKNOWN_QP, "connect_qp: no such QP");
    }
    if (q->connected) {
        return fail(ep, KVRELAY_ERR_ALREADY_CONNECTED, "connect_qp: the QP is connected already");
    }
    q->connected = 1;
    q->peer = *remote;
    return KVRELAY_OK;
}

static int sample_post(kvrelay_endpoint *ep, uint32_t qpn, const kvrelay_work_request *wrs, size_t count) {
    if (!ep || (count > 0 && !wrs)) {
        return fail(ep, KVRELAY_ERR_INVALID, "post: a NULL argument");
    }
    qp *q = find_qp(ep, qpn);
    if (!q) {
        return fail(ep, KVRELAY_ERR_UNKNOWN_QP, "post: no such QP");
    }
    if (!q->connected) {
        return fail(ep, KVRELAY_ERR_NOT_CONNECTED, "post: the QP is not connected");
    }
    for (size_t i = 0; i < count; i++) {
        if (wrs[i].num_sge > ep->caps.max_sge || (wrs[i].num_sge > 0 && !wrs[i].sges)) {
            return fail(ep, KVRELAY_ERR_INVALID, "post: a work request has a bad SGE list");
        }
    }
    /* Room for every completion up front, so that nothing below can fail half way. */
    if (grow((void **)&ep->cq, &ep->cq_cap, ep->cq_head + ep->cq_len + count, sizeof *ep->cq) != 0) {
        return fail(ep, KVRELAY_ERR_EXHAUSTED, "post: out of memory");
    }
    for (size_t i = 0; i < count; i++) {
        const kvrelay_work_request *wr = &wrs[i];
        uint64_t moved = 0;
        uint32_t status = execute(ep, q, wr, &moved);
        if (status != KVRELAY_WC_SUCCESS) {
            q->failed = 1;
        }
        if ((wr->flags & KVRELAY_WR_SIGNALED) || status != KVRELAY_WC_SUCCESS) {
            kvrelay_completion wc = {wr->wr_id, status == KVRELAY_WC_SUCCESS ? moved : 0, qpn, status,
                                     KVRELAY_WC_WRITE, 0};
#if SAMPLE_MISBEHAVE == 1
            wc.status = 77;
#elif SAMPLE_MISBEHAVE == 2
            wc.qpn += 1000;
#elif SAMPLE_MISBEHAVE == 3
            wc.byte_len += status == KVRELAY_WC_SUCCESS;
#endif
            push_completion(ep, wc);
        }
    }
    return KVRELAY_OK;
}

static int sample_poll(kvrelay_endpoint *ep, kvrelay_completion *out, size_t max, size_t *polled) {
    if (!ep || !polled || (max > 0 && !out)) {
        return fail(ep, KVRELAY_ERR_INVALID, "poll: a NULL argument");
    }
    size_t n = MIN(max, ep->cq_len);
    if (n > 0) {
        memcpy(out, ep->cq + ep->cq_head, n * sizeof *out);
    }
    ep->cq_head += n;
    ep->cq_len -= n;
    if (ep->cq_len == 0) {
        ep->cq_head = 0;
    }
    *polled = n;
    return KVRELAY_OK;
}

/* Work requests execute inside `post`, so nothing arrives while the caller waits: a pending completion answers at
 * once, otherwise the caller sleeps out its timeout (the header's "without spinning"). */
static int sample_wait(kvrelay_endpoint *ep, uint64_t timeout_us) {
    if (ep && ep->cq_len > 0) {
        return 1;
    }
    struct timespec pause = {(time_t)(timeout_us / 1000000u), (long)(timeout_us % 1000000u) * 1000L};
    nanosleep(&pause, NULL);
    return ep && ep->cq_len > 0;
}

static const char *sample_last_error(const kvrelay_endpoint *ep) {
    const char *text = ep ? ep->error : open_error;
    return text[0] ? text : NULL;
}

static const kvrelay_transport_ops sample_ops = {
    SAMPLE_ABI_VERSION,
    (uint32_t)sizeof(kvrelay_transport_ops),
    sample_info,
    sample_capabilities,
    sample_open,
    sample_close,
    sample_register,
    sample_deregister,
    sample_create_qp,
    sample_connect_qp,
#if SAMPLE_MISBEHAVE == 5
    0 ? sample_post : NULL,
#else
    sample_post,
#endif
    sample_poll,
    sample_wait,
    sample_last_error,
};

const kvrelay_transport_ops *kvrelay_transport_v1(void) {
    return &sample_ops;
}
