/* shim.h: the small C side of troupe's UCX binding.
 *
 * UCX completion callbacks, endpoint error callbacks and active-message
 * handlers never call into Go. They append an event to a per-worker queue,
 * which Go drains after each progress call. Every UCX call on a worker is
 * serialised by the Go side, so the queue needs no lock of its own. */
#ifndef TROUPE_UCX_SHIM_H
#define TROUPE_UCX_SHIM_H

#include <stdint.h>
#include <stddef.h>
#include <ucp/api/ucp.h>

enum {
    TROUPE_EV_SEND     = 1, /* send, put, get, flush, am send completed */
    TROUPE_EV_RECV     = 2, /* tag receive completed */
    TROUPE_EV_AM       = 3, /* active message arrived */
    TROUPE_EV_AM_DATA  = 4, /* ucp_am_recv_data_nbx completed */
    TROUPE_EV_EP_ERROR = 5  /* endpoint failed */
};

typedef struct {
    uint32_t kind;
    int32_t  status;
    void    *req;         /* request (SEND, RECV, AM_DATA) or ep (EP_ERROR) */
    uint64_t tag;         /* RECV: sender tag */
    uint64_t length;      /* RECV, AM_DATA: bytes received; AM: data length */
    /* AM only */
    uint32_t am_id;
    uint32_t am_flags;    /* UCP_AM_RECV_ATTR_FLAG_* */
    void    *header;      /* malloc'd copy, freed by troupe_free */
    uint64_t header_len;
    void    *data;        /* eager data (held) or rendezvous descriptor */
    uintptr_t reply_ep;
    /* RECV by troupe_tag_recv_peek only */
    uint32_t peek_len;
    uint8_t  peek[32];    /* the message's bytes, copied as it completed */
} troupe_ev_t;

typedef struct {
    troupe_ev_t *ev;
    size_t n, cap;
    int oom;             /* set if an event could not be queued */
    unsigned progressed; /* last ucp_worker_progress result */
    void *peek_free;     /* recycled troupe_tag_recv_peek arguments */
    uint64_t post_failed; /* troupe_am_post sends that failed after they started */
    uint64_t post_inflight; /* troupe_am_post sends not completed yet */
} troupe_queue_t;

troupe_queue_t *troupe_queue_new(void);
void troupe_queue_free(troupe_queue_t *q);

/* Progress the worker (again while it makes progress and the queue has
 * room, up to 8 times) and move up to max queued events to out.
 * Requests of completion events are freed as they are moved.
 * *progressed receives ucp_worker_progress's return value. Returns the number
 * of events copied. */
size_t troupe_progress_drain(ucp_worker_h w, troupe_queue_t *q, troupe_ev_t *out,
                             size_t max);
size_t troupe_drain(troupe_queue_t *q, troupe_ev_t *out, size_t max);

/* The same two calls with their pointers passed as integers: they are C
 * memory, and cgo would otherwise check every argument of the hottest
 * call in troupe (each progress poll) for Go pointers. */
static inline size_t troupe_progress_drain_u(uintptr_t w, uintptr_t q, uintptr_t out,
                                             size_t max) {
    return troupe_progress_drain((ucp_worker_h)w, (troupe_queue_t *)q, (troupe_ev_t *)out, max);
}
static inline size_t troupe_drain_u(uintptr_t q, uintptr_t out, size_t max) {
    return troupe_drain((troupe_queue_t *)q, (troupe_ev_t *)out, max);
}

ucs_status_t troupe_ep_create(ucp_worker_h w, const void *addr, troupe_queue_t *q,
                              int err_mode_peer, ucp_ep_h *ep);
ucs_status_t troupe_set_am_handler(ucp_worker_h w, uint16_t id, troupe_queue_t *q);

ucs_status_ptr_t troupe_tag_send(ucp_ep_h ep, const void *buf, size_t len, int iov,
                                 uint64_t tag, troupe_queue_t *q);
ucs_status_ptr_t troupe_tag_recv(ucp_worker_h w, void *buf, size_t len, int iov,
                                 uint64_t tag, uint64_t mask, troupe_queue_t *q);
/* Like troupe_tag_recv, but a message whose sender tag has a bit of
 * peek_bits set and which is at most 32 bytes long is also copied into its
 * event as the receive completes, before a later receive into the same
 * memory can overwrite it. */
ucs_status_ptr_t troupe_tag_recv_peek(ucp_worker_h w, void *buf, size_t len, int iov,
                                      uint64_t tag, uint64_t mask, uint64_t peek_bits,
                                      troupe_queue_t *q);
ucs_status_ptr_t troupe_tag_msg_recv(ucp_worker_h w, void *buf, size_t len, int iov,
                                     ucp_tag_message_h msg, troupe_queue_t *q);
ucs_status_ptr_t troupe_am_send(ucp_ep_h ep, uint16_t id, const void *hdr, size_t hdr_len,
                                const void *buf, size_t len, int iov, uint32_t flags,
                                troupe_queue_t *q);
/* troupe_am_post sends an active message from a copy of header and data
 * (one malloc'd block), so that the caller's memory is free again when it
 * returns. No request comes back and no event is queued: the block is freed
 * at once when the send completes immediately (UCS_OK), else in the send's
 * callback (UCS_INPROGRESS), which counts a failure in q->post_failed. Any
 * other status is an error and nothing was sent. A send in flight is counted
 * in q->post_inflight and, when ep_inflight is not NULL, in *ep_inflight
 * (the endpoint's own count). */
ucs_status_t troupe_am_post(ucp_ep_h ep, uint16_t id, const void *hdr, size_t hdr_len,
                            const void *buf, size_t len, uint32_t flags, troupe_queue_t *q,
                            uint64_t *ep_inflight);
/* troupe_am_release frees what n AM events hold: their header copies and
 * their eager data (held by UCX or copied). Rendezvous descriptors are
 * dropped (ucp_am_data_release). */
void troupe_am_release(ucp_worker_h w, troupe_ev_t *ev, size_t n);
/* The two calls with their pointers passed as integers (see troupe_drain_u):
 * the header, data and events may be Go memory without Go pointers, read
 * or written only during the call. */
static inline int troupe_am_post_u(uintptr_t ep, uint16_t id, uintptr_t hdr, size_t hdr_len,
                                   uintptr_t buf, size_t len, uint32_t flags, uintptr_t q,
                                   uintptr_t ep_inflight) {
    return (int)troupe_am_post((ucp_ep_h)ep, id, (const void *)hdr, hdr_len, (const void *)buf,
                               len, flags, (troupe_queue_t *)q, (uint64_t *)ep_inflight);
}
static inline void troupe_am_release_u(uintptr_t w, uintptr_t ev, size_t n) {
    troupe_am_release((ucp_worker_h)w, (troupe_ev_t *)ev, n);
}
ucs_status_ptr_t troupe_am_recv_data(ucp_worker_h w, void *desc, void *buf, size_t len,
                                     int iov, troupe_queue_t *q, size_t *imm_len);
ucs_status_ptr_t troupe_put(ucp_ep_h ep, const void *buf, size_t len, uint64_t raddr,
                            ucp_rkey_h rkey, troupe_queue_t *q);
ucs_status_ptr_t troupe_get(ucp_ep_h ep, void *buf, size_t len, uint64_t raddr,
                            ucp_rkey_h rkey, troupe_queue_t *q);
ucs_status_ptr_t troupe_ep_flush(ucp_ep_h ep, troupe_queue_t *q);
ucs_status_ptr_t troupe_worker_flush(ucp_worker_h w, troupe_queue_t *q);
ucs_status_ptr_t troupe_ep_close(ucp_ep_h ep, int force, troupe_queue_t *q);
ucs_status_t troupe_mem_map(ucp_context_h ctx, uintptr_t addr, size_t len, ucp_mem_h *memh);

/* Returns a malloc'd description of the context (ucp_context_print_info). */
char *troupe_context_info(ucp_context_h ctx);

static inline int troupe_is_ptr(ucs_status_ptr_t p) { return !UCS_PTR_IS_ERR(p) && p != NULL; }
static inline int troupe_ptr_status(ucs_status_ptr_t p) { return (int)UCS_PTR_STATUS(p); }


#endif
