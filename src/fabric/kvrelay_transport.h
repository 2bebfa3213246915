/*
 * kvrelay_transport.h: the C ABI of a kvrelay transport plug-in, version 1.
 *
 * A plug-in is a shared object that kvrelay loads with `--fabric plugin:PATH` (src/fabric/plugin.rs, the Rust
 * loader). It exports exactly one symbol:
 *
 *     const kvrelay_transport_ops *kvrelay_transport_v1(void);
 *
 * which returns a pointer to a static table of function pointers (kvrelay_transport_ops) that stays valid until
 * the shared object is unloaded. The loader checks `abi_version == KVRELAY_TRANSPORT_ABI_VERSION` and
 * `struct_size >= sizeof(kvrelay_transport_ops)` of this header, and that every required function pointer is
 * non-NULL, before it calls anything else; a mismatch refuses the plug-in with a message naming the fix.
 *
 * The model is RDMA verbs, reduced to what kvrelay posts: one endpoint per node (a protection domain with one
 * completion queue), memory registration with lkey/rkey, reliable-connected queue pairs (QPs), RDMA WRITE and
 * WRITE_WITH_IMM work requests with scatter-gather lists, selective signalling and a non-blocking completion queue.
 * The semantics are the contract of the Rust trait `Endpoint` in src/fabric/verbs.rs, restated here:
 *
 *  - Ordering. Completions of one QP are returned in post order; nothing is promised across QPs. A RECV_IMM
 *    completion at the receiver implies that the WRITE_WITH_IMM's bytes, and every earlier WRITE's bytes on that
 *    QP, have landed.
 *  - Posting. `post` is all or nothing: it either accepts every work request of the array (returning
 *    KVRELAY_OK) or none (returning an error code). Accepted work requests execute later or at once, as the
 *    transport likes; their completions become pollable when they have executed.
 *  - Selective signalling. A successful work request without KVRELAY_WR_SIGNALED produces no completion. A failed
 *    or flushed one always produces a completion, signalled or not.
 *  - Errors. The first work request of a QP that fails moves the QP to the error state: every later work request
 *    on it (already posted, or posted afterwards) completes KVRELAY_WC_FLUSHED without executing. Other QPs are
 *    unaffected. A QP in the error state stays there.
 *  - Protection. A WRITE with an SGE outside the local region of its lkey completes
 *    KVRELAY_WC_LOCAL_PROTECTION; one whose remote range [remote_addr, remote_addr + length) is outside the
 *    peer's region of its rkey completes KVRELAY_WC_REMOTE_ACCESS. Either way it writes no byte. A byte outside
 *    every target range is never changed.
 *  - Reachability. A work request on a QP whose peer QP does not exist, or is not connected back to this QP,
 *    completes KVRELAY_WC_RETRY_EXCEEDED.
 *  - Notifications. A successful WRITE_WITH_IMM gives the receiver a KVRELAY_WC_RECV_IMM completion on the
 *    receiver's QP carrying `imm` and the message length, once the data has landed.
 *  - Memory. Registered memory is owned by kvrelay and registered in place: the plug-in reads and writes it
 *    through the pointer it was given, only while it is registered. Deregistration revokes both keys at once:
 *    work requests that name them afterwards complete in error.
 *
 * What the loader does on the plug-in's behalf (so a plug-in need not, and must not rely on it being skipped):
 *
 *  - Send-queue credits and work-request limits. Before calling `post`, the loader refuses (without calling the
 *    plug-in) a batch on an unknown or unconnected QP, a work request with more than `max_sge` SGEs or more than
 *    `max_message` bytes, a batch that would overflow the send queue of `sq_depth`, and a batch that would leave
 *    `sq_depth` unsignalled work requests after the last signalled one. It frees send-queue slots as completions
 *    are handed to kvrelay. A plug-in therefore never sees more than `sq_depth` outstanding work requests per QP.
 *  - Work request ids. The `wr_id` a plug-in sees is the work request's position on its QP (0 for the first work
 *    request ever posted on that QP, then 1, 2, ...); the loader maps it back to the caller's id and length.
 *  - Checking completions. The loader checks every completion it polls: a status or kind outside the codes below,
 *    a position that is not outstanding or out of order, or a successful byte_len other than the work request's
 *    length turns into a completion in error (KVRELAY_WC_LOCAL_PROTECTION for that work request and
 *    KVRELAY_WC_FLUSHED for the QP's later ones, made by the loader) and the QP is no longer handed to the
 *    plug-in; a completion naming a QP the endpoint never created, or a failed `poll`, does that to every QP
 *    with work outstanding.
 *    Such faults are recorded and can be read back (PluginEndpoint::faults in Rust).
 *  - Reading registered memory back, handing it back on deregistration, and the registered-bytes limit
 *    (`max_registered_bytes`, checked before `register_memory`).
 *  - Region bookkeeping: `deregister_memory` is only called with a region `register_memory` returned on the same
 *    endpoint and not yet deregistered; `connect_qp` only with a QP of this endpoint that is not connected yet.
 *
 * Threads. The loader calls a plug-in from one thread at a time (the thread that loaded it, in practice), never
 * re-entrantly, and never concurrently on two endpoints. Endpoints of one plug-in may live in one process and reach
 * each other (the sample plug-in does exactly that), so a plug-in may keep process-global state without locks.
 * The dynamic loader keeps one instance of a shared object per process however often it is loaded, so kvrelay
 * uses every load of one plug-in from one thread at a time too. A plug-in that moves bytes from its own threads
 * must not write registered memory after deregister_memory has returned for it, nor after close has returned.
 *
 * Return codes. Every function returning `int` returns KVRELAY_OK (0) on success or one of the KVRELAY_ERR_*
 * codes below; any other value is treated as KVRELAY_ERR_INTERNAL. After an error, `last_error` (optional) may
 * return a human-readable message for it.
 *
 * All integers are in host byte order; all structs are plain C structs with the exact field order below (the
 * loader mirrors them with #[repr(C)]).
 */
#ifndef KVRELAY_TRANSPORT_H
#define KVRELAY_TRANSPORT_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* The ABI version of this header; `kvrelay_transport_ops.abi_version` must equal it. */
#define KVRELAY_TRANSPORT_ABI_VERSION 1u

/* The one exported symbol's name, as the loader looks it up. */
#define KVRELAY_TRANSPORT_ENTRY "kvrelay_transport_v1"

/* ---- Return codes of every `int` function ---- */
#define KVRELAY_OK 0                    /* success */
#define KVRELAY_ERR_INVALID 1           /* an argument is malformed (NULL pointer, bad length, ...) */
#define KVRELAY_ERR_UNKNOWN_QP 2        /* no such QP on this endpoint */
#define KVRELAY_ERR_NOT_CONNECTED 3     /* post on a QP that connect_qp was not called for */
#define KVRELAY_ERR_ALREADY_CONNECTED 4 /* connect_qp on a QP that is connected already */
#define KVRELAY_ERR_UNKNOWN_REGION 5    /* deregister of a region this endpoint does not hold */
#define KVRELAY_ERR_EXHAUSTED 6         /* out of keys, QP numbers, memory or another resource */
#define KVRELAY_ERR_UNSUPPORTED 7       /* the request needs something this transport does not do */
#define KVRELAY_ERR_INTERNAL 8          /* anything else (a device or driver failure) */

/* ---- Completion status (Rust: fabric::verbs::WcStatus, mirroring ibv_wc_status) ---- */
#define KVRELAY_WC_SUCCESS 0          /* every byte landed */
#define KVRELAY_WC_LOCAL_PROTECTION 1 /* an SGE is not inside the local region of its lkey */
#define KVRELAY_WC_REMOTE_ACCESS 2    /* the remote range is not inside the peer's region of the rkey */
#define KVRELAY_WC_RETRY_EXCEEDED 3   /* the peer QP does not exist or is not connected back to this QP */
#define KVRELAY_WC_FLUSHED 4          /* the QP was in the error state; the work request did not execute */

/* ---- Completion kind (Rust: fabric::verbs::WcKind) ---- */
#define KVRELAY_WC_WRITE 0    /* the sender's completion of a WRITE or WRITE_WITH_IMM */
#define KVRELAY_WC_RECV_IMM 1 /* the receiver's notification of a WRITE_WITH_IMM */

/* ---- Work request flags ---- */
#define KVRELAY_WR_SIGNALED 1u /* produce a completion on success too (IBV_SEND_SIGNALED) */
#define KVRELAY_WR_WITH_IMM 2u /* a WRITE_WITH_IMM: `imm` is delivered to the receiver's CQ */

/* An endpoint: one node's protection domain, CQ and QPs. Opaque to the loader. */
typedef struct kvrelay_endpoint kvrelay_endpoint;

/* Device and QP limits. */
typedef struct kvrelay_caps {
    uint32_t max_sge;              /* most SGEs per work request (>= 1) */
    uint32_t sq_depth;             /* send-queue depth per QP: work requests outstanding at once (>= 1) */
    uint64_t max_message;          /* largest message in bytes (the sum of a work request's SGE lengths) */
    uint64_t max_registered_bytes; /* most bytes registered at once per endpoint */
} kvrelay_caps;

/* A registered memory region. `addr` is the address of the first byte as the caller passed it
 * ((uint64_t)(uintptr_t)ptr): registration is in place. */
typedef struct kvrelay_region {
    uint64_t addr;
    uint64_t len;
    uint32_t lkey; /* names the region in this endpoint's own SGEs */
    uint32_t rkey; /* names the region in peers' work requests */
} kvrelay_region;

/* What the bootstrap exchanges so that two QPs can be connected. */
typedef struct kvrelay_qp_info {
    uint32_t node;    /* the node the QP belongs to (the node its endpoint was opened for) */
    uint32_t qpn;     /* QP number, unique within its node */
    uint16_t lid;     /* InfiniBand LID, or 0 */
    uint8_t gid[16];  /* RoCE GID, or zeros */
    uint8_t reserved[2];
} kvrelay_qp_info;

/* One scatter-gather entry: `len` bytes of local memory at `addr`, inside the region registered with `lkey`. */
typedef struct kvrelay_sge {
    uint64_t addr;
    uint64_t len;
    uint32_t lkey;
    uint32_t reserved;
} kvrelay_sge;

/* An RDMA WRITE (or WRITE_WITH_IMM) work request. The bytes of `sges[0..num_sge)`, gathered in order, land
 * contiguously at `remote_addr` in the peer's region of `rkey`. num_sge == 0 is a zero-byte write. */
typedef struct kvrelay_work_request {
    uint64_t wr_id;             /* returned as given in the sender's completion (the loader's position) */
    const kvrelay_sge *sges;    /* valid for the duration of the post call only */
    uint32_t num_sge;
    uint32_t flags;             /* KVRELAY_WR_SIGNALED | KVRELAY_WR_WITH_IMM */
    uint64_t remote_addr;
    uint32_t rkey;
    uint32_t imm;               /* meaningful with KVRELAY_WR_WITH_IMM only */
} kvrelay_work_request;

/* One completion queue entry. */
typedef struct kvrelay_completion {
    uint64_t wr_id;    /* the work request's wr_id for KVRELAY_WC_WRITE; 0 for KVRELAY_WC_RECV_IMM */
    uint64_t byte_len; /* the message length on KVRELAY_WC_SUCCESS, 0 otherwise */
    uint32_t qpn;      /* the local QP (the receiver's QP for KVRELAY_WC_RECV_IMM) */
    uint32_t status;   /* KVRELAY_WC_SUCCESS ... KVRELAY_WC_FLUSHED */
    uint32_t kind;     /* KVRELAY_WC_WRITE or KVRELAY_WC_RECV_IMM */
    uint32_t imm;      /* the immediate of a KVRELAY_WC_RECV_IMM; 0 for KVRELAY_WC_WRITE */
} kvrelay_completion;

/* The function table. Every pointer is required unless marked optional (NULL allowed). */
typedef struct kvrelay_transport_ops {
    /* KVRELAY_TRANSPORT_ABI_VERSION of the header the plug-in was built with. */
    uint32_t abi_version;
    /* sizeof(kvrelay_transport_ops) of the header the plug-in was built with. */
    uint32_t struct_size;

    /* Who the transport is: a static NUL-terminated UTF-8 text of `key=value` lines separated by '\n'. The keys
     * `name` (short, e.g. memcpy-sample) and `version` are required; every other line is a fact for the
     * certification report (device, driver, firmware, ...). Must not return NULL. */
    const char *(*info)(void);

    /* The transport's limits, whatever an endpoint asks for. Returns KVRELAY_OK and fills `*out`. */
    int (*capabilities)(kvrelay_caps *out);

    /* Opens an endpoint for `node` (nodes are numbered from 0), asking for `*requested`. Fills `*granted` with
     * what this endpoint grants (each field at most the requested one; the loader clamps it anyway) and `*out`
     * with the new endpoint. */
    int (*open)(uint32_t node, const kvrelay_caps *requested, kvrelay_caps *granted, kvrelay_endpoint **out);

    /* Closes an endpoint: destroys its QPs, revokes its registrations and frees it. Peers' QPs connected to its
     * QPs then complete KVRELAY_WC_RETRY_EXCEEDED. The registered memory itself belongs to the caller and is
     * freed by it after close returns. Never fails. */
    void (*close)(kvrelay_endpoint *ep);

    /* Registers `len` bytes at `ptr` in place (len may be 0; ptr is never NULL). Fills `*out` with
     * addr == (uint64_t)(uintptr_t)ptr, len, and fresh keys. The memory stays valid and unmoved until
     * deregister_memory or close. */
    int (*register_memory)(kvrelay_endpoint *ep, void *ptr, uint64_t len, kvrelay_region *out);

    /* Deregisters a region `register_memory` returned on this endpoint: both keys stop resolving at once.
     * KVRELAY_ERR_UNKNOWN_REGION if it is not registered here. */
    int (*deregister_memory)(kvrelay_endpoint *ep, const kvrelay_region *region);

    /* Creates a QP in the reset state and fills `*out` with what the peer needs to connect to it (`node` is the
     * endpoint's node; `qpn` must be new on this endpoint). */
    int (*create_qp)(kvrelay_endpoint *ep, kvrelay_qp_info *out);

    /* Connects local QP `local_qpn` to the peer QP `*remote` (RESET -> RTR -> RTS). The peer must connect its QP
     * back to this one; otherwise work requests complete KVRELAY_WC_RETRY_EXCEEDED. */
    int (*connect_qp)(kvrelay_endpoint *ep, uint32_t local_qpn, const kvrelay_qp_info *remote);

    /* Posts `count` work requests on QP `qpn`, in order, all or nothing (see Posting above). The arrays are valid
     * for the duration of the call only: copy what is needed later. */
    int (*post)(kvrelay_endpoint *ep, uint32_t qpn, const kvrelay_work_request *wrs, size_t count);

    /* Moves up to `max` available completions into `out[0..*polled)` and sets `*polled`; never blocks. A
     * completion handed out is never handed out again. */
    int (*poll)(kvrelay_endpoint *ep, kvrelay_completion *out, size_t max, size_t *polled);

    /* Optional. Blocks until a completion may be ready to poll or `timeout_us` microseconds have passed, without
     * spinning a core. Returns 1 when a completion may be ready, 0 on timeout. NULL: the loader polls instead. */
    int (*wait)(kvrelay_endpoint *ep, uint64_t timeout_us);

    /* Optional. The message of the last failed call on `ep` (on open failures, `ep` is NULL), or NULL; valid
     * until the next call into the plug-in. */
    const char *(*last_error)(const kvrelay_endpoint *ep);
} kvrelay_transport_ops;

/* The entry point: the plug-in's function table (static storage, never NULL). */
const kvrelay_transport_ops *kvrelay_transport_v1(void);

#ifdef __cplusplus
}
#endif

#endif /* KVRELAY_TRANSPORT_H */
