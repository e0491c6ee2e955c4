#include "shim.h"
#include <stdlib.h>
#include <string.h>
#include <stdio.h>

troupe_queue_t *troupe_queue_new(void) {
    return calloc(1, sizeof(troupe_queue_t));
}

/* peek_arg_t is defined with troupe_tag_recv_peek below; its first field
 * links recycled arguments. */
static void peek_free_all(troupe_queue_t *q);

void troupe_queue_free(troupe_queue_t *q) {
    if (q == NULL) return;
    peek_free_all(q);
    free(q->ev);
    free(q);
}

static troupe_ev_t *push(troupe_queue_t *q) {
    if (q->n == q->cap) {
        size_t cap = q->cap ? q->cap * 2 : 256;
        troupe_ev_t *ev = realloc(q->ev, cap * sizeof(*ev));
        if (ev == NULL) { q->oom = 1; return NULL; }
        q->ev = ev;
        q->cap = cap;
    }
    troupe_ev_t *e = &q->ev[q->n++];
    memset(e, 0, sizeof(*e));
    return e;
}

size_t troupe_drain(troupe_queue_t *q, troupe_ev_t *out, size_t max) {
    size_t k = q->n < max ? q->n : max;
    if (k == 0) return 0;
    memcpy(out, q->ev, k * sizeof(*out));
    /* Completed requests are released here, saving Go a call each; their
     * address stays in the event only as the request's identity. */
    for (size_t i = 0; i < k; i++) {
        if (out[i].kind == TROUPE_EV_SEND || out[i].kind == TROUPE_EV_RECV ||
            out[i].kind == TROUPE_EV_AM_DATA) {
            ucp_request_free(out[i].req);
        }
    }
    if (k < q->n) memmove(q->ev, q->ev + k, (q->n - k) * sizeof(*out));
    q->n -= k;
    return k;
}

/* progressRounds bounds the ucp_worker_progress calls of one
 * troupe_progress_drain: a shared-memory transport hands over at most
 * UCX_*_FIFO_MAX_POLL (16) messages per call, and each return to Go hands
 * what arrived to other goroutines (a wake-up each time). */
enum { progressRounds = 8 };

size_t troupe_progress_drain(ucp_worker_h w, troupe_queue_t *q, troupe_ev_t *out,
                             size_t max) {
    unsigned total = 0;
    for (int i = 0; i < progressRounds; i++) {
        unsigned n = ucp_worker_progress(w);
        total += n;
        if (n == 0 || q->n >= max) break;
    }
    q->progressed = total;
    return troupe_drain(q, out, max);
}

static void send_cb(void *req, ucs_status_t status, void *user) {
    troupe_ev_t *e = push((troupe_queue_t *)user);
    if (e == NULL) return;
    e->kind = TROUPE_EV_SEND;
    e->status = status;
    e->req = req;
}

/* push_recv queues a receive completion; NULL if it could not. */
static troupe_ev_t *push_recv(troupe_queue_t *q, void *req, ucs_status_t status,
                              const ucp_tag_recv_info_t *info) {
    troupe_ev_t *e = push(q);
    if (e == NULL) return NULL;
    e->kind = TROUPE_EV_RECV;
    e->status = status;
    e->req = req;
    if (info != NULL) {
        e->tag = info->sender_tag;
        e->length = info->length;
    }
    return e;
}

static void recv_cb(void *req, ucs_status_t status, const ucp_tag_recv_info_t *info,
                    void *user) {
    push_recv((troupe_queue_t *)user, req, status, info);
}

static void am_data_cb(void *req, ucs_status_t status, size_t length, void *user) {
    troupe_ev_t *e = push((troupe_queue_t *)user);
    if (e == NULL) return;
    e->kind = TROUPE_EV_AM_DATA;
    e->status = status;
    e->req = req;
    e->length = length;
}

static void ep_err_cb(void *arg, ucp_ep_h ep, ucs_status_t status) {
    troupe_ev_t *e = push((troupe_queue_t *)arg);
    if (e == NULL) return;
    e->kind = TROUPE_EV_EP_ERROR;
    e->status = status;
    e->req = (void *)ep;
}

typedef struct { troupe_queue_t *q; uint16_t id; } am_arg_t;

static ucs_status_t am_cb(void *arg, const void *header, size_t header_len, void *data,
                          size_t length, const ucp_am_recv_param_t *param) {
    am_arg_t *a = arg;
    troupe_ev_t *e = push(a->q);
    if (e == NULL) return UCS_OK; /* dropped; q->oom tells Go */
    e->kind = TROUPE_EV_AM;
    e->am_id = a->id;
    e->am_flags = (uint32_t)param->recv_attr;
    e->length = length;
    e->reply_ep = (param->recv_attr & UCP_AM_RECV_ATTR_FIELD_REPLY_EP) ? (uintptr_t)param->reply_ep : 0;
    if (header_len > 0) {
        e->header = malloc(header_len);
        if (e->header == NULL) { a->q->n--; a->q->oom = 1; return UCS_OK; }
        memcpy(e->header, header, header_len);
    }
    e->header_len = header_len;
    if (param->recv_attr & (UCP_AM_RECV_ATTR_FLAG_DATA | UCP_AM_RECV_ATTR_FLAG_RNDV)) {
        e->data = data;            /* held until released or received */
        return UCS_INPROGRESS;
    }
    /* Volatile eager data: copy it out now. */
    if (length > 0) {
        e->data = malloc(length);
        if (e->data == NULL) { free(e->header); a->q->n--; a->q->oom = 1; return UCS_OK; }
        memcpy(e->data, data, length);
    }
    return UCS_OK;
}

ucs_status_t troupe_ep_create(ucp_worker_h w, const void *addr, troupe_queue_t *q,
                              int err_mode_peer, ucp_ep_h *ep) {
    ucp_ep_params_t p;
    memset(&p, 0, sizeof(p));
    p.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE |
                   UCP_EP_PARAM_FIELD_ERR_HANDLER;
    p.address = (const ucp_address_t *)addr;
    p.err_mode = err_mode_peer ? UCP_ERR_HANDLING_MODE_PEER : UCP_ERR_HANDLING_MODE_NONE;
    p.err_handler.cb = ep_err_cb;
    p.err_handler.arg = q;
    return ucp_ep_create(w, &p, ep);
}

ucs_status_t troupe_set_am_handler(ucp_worker_h w, uint16_t id, troupe_queue_t *q) {
    /* The argument lives as long as the process: handlers are registered once
     * per worker and id, and re-registration replaces them. */
    am_arg_t *a = malloc(sizeof(*a));
    if (a == NULL) return UCS_ERR_NO_MEMORY;
    a->q = q;
    a->id = id;
    ucp_am_handler_param_t p;
    memset(&p, 0, sizeof(p));
    p.field_mask = UCP_AM_HANDLER_PARAM_FIELD_ID | UCP_AM_HANDLER_PARAM_FIELD_FLAGS |
                   UCP_AM_HANDLER_PARAM_FIELD_CB | UCP_AM_HANDLER_PARAM_FIELD_ARG;
    p.id = id;
    p.flags = UCP_AM_FLAG_WHOLE_MSG | UCP_AM_FLAG_PERSISTENT_DATA;
    p.cb = am_cb;
    p.arg = a;
    return ucp_worker_set_am_recv_handler(w, &p);
}

static void send_param(ucp_request_param_t *p, troupe_queue_t *q, int iov) {
    memset(p, 0, sizeof(*p));
    p->op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
    p->cb.send = send_cb;
    p->user_data = q;
    if (iov) {
        p->op_attr_mask |= UCP_OP_ATTR_FIELD_DATATYPE;
        p->datatype = ucp_dt_make_iov();
    }
}

ucs_status_ptr_t troupe_tag_send(ucp_ep_h ep, const void *buf, size_t len, int iov,
                                 uint64_t tag, troupe_queue_t *q) {
    ucp_request_param_t p;
    send_param(&p, q, iov);
    return ucp_tag_send_nbx(ep, buf, len, tag, &p);
}

static void recv_param(ucp_request_param_t *p, troupe_queue_t *q, int iov) {
    memset(p, 0, sizeof(*p));
    /* UCX 1.13 does not fill recv_info on every immediate-completion path,
     * so receives always complete through the callback, which reports the
     * sender tag and the message's length. */
    p->op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA |
                      UCP_OP_ATTR_FLAG_NO_IMM_CMPL;
    p->cb.recv = recv_cb;
    p->user_data = q;
    if (iov) {
        p->op_attr_mask |= UCP_OP_ATTR_FIELD_DATATYPE;
        p->datatype = ucp_dt_make_iov();
    }
}

ucs_status_ptr_t troupe_tag_recv(ucp_worker_h w, void *buf, size_t len, int iov,
                                 uint64_t tag, uint64_t mask, troupe_queue_t *q) {
    ucp_request_param_t p;
    recv_param(&p, q, iov);
    return ucp_tag_recv_nbx(w, buf, len, tag, mask, &p);
}

typedef struct peek_arg {
    struct peek_arg *next; /* on q->peek_free while unused */
    troupe_queue_t *q;
    void *buf;       /* contiguous buffer, or ucp_dt_iov_t array */
    size_t len;      /* bytes, or iov entries */
    int iov;
    uint64_t bits;
} peek_arg_t;

/* Arguments are recycled through the queue (every call on a worker is
 * serialised), so a receive costs no malloc. */
static peek_arg_t *peek_get(troupe_queue_t *q) {
    peek_arg_t *a = q->peek_free;
    if (a != NULL) {
        q->peek_free = a->next;
        return a;
    }
    return malloc(sizeof(*a));
}

static void peek_put(peek_arg_t *a) {
    a->next = a->q->peek_free;
    a->q->peek_free = a;
}

static void peek_free_all(troupe_queue_t *q) {
    for (peek_arg_t *a = q->peek_free; a != NULL;) {
        peek_arg_t *n = a->next;
        free(a);
        a = n;
    }
    q->peek_free = NULL;
}

static void peek_copy(uint8_t *dst, const peek_arg_t *a, size_t n) {
    if (!a->iov) {
        memcpy(dst, a->buf, n);
        return;
    }
    const ucp_dt_iov_t *v = a->buf;
    for (size_t i = 0; i < a->len && n > 0; i++) {
        size_t k = v[i].length < n ? v[i].length : n;
        memcpy(dst, v[i].buffer, k);
        dst += k;
        n -= k;
    }
}

static void recv_peek_cb(void *req, ucs_status_t status, const ucp_tag_recv_info_t *info,
                         void *user) {
    peek_arg_t *a = user;
    troupe_ev_t *e = push_recv(a->q, req, status, info);
    if (e != NULL && info != NULL && status == UCS_OK && (info->sender_tag & a->bits) &&
        info->length <= sizeof(e->peek)) {
        peek_copy(e->peek, a, info->length);
        e->peek_len = (uint32_t)info->length;
    }
    peek_put(a);
}

ucs_status_ptr_t troupe_tag_recv_peek(ucp_worker_h w, void *buf, size_t len, int iov,
                                      uint64_t tag, uint64_t mask, uint64_t peek_bits,
                                      troupe_queue_t *q) {
    peek_arg_t *a = peek_get(q);
    if (a == NULL) return UCS_STATUS_PTR(UCS_ERR_NO_MEMORY);
    a->q = q;
    a->buf = buf;
    a->len = len;
    a->iov = iov;
    a->bits = peek_bits;
    ucp_request_param_t p;
    recv_param(&p, q, iov);
    p.cb.recv = recv_peek_cb;
    p.user_data = a;
    ucs_status_ptr_t r = ucp_tag_recv_nbx(w, buf, len, tag, mask, &p);
    if (UCS_PTR_IS_ERR(r)) peek_put(a);
    return r;
}

ucs_status_ptr_t troupe_tag_msg_recv(ucp_worker_h w, void *buf, size_t len, int iov,
                                     ucp_tag_message_h msg, troupe_queue_t *q) {
    ucp_request_param_t p;
    recv_param(&p, q, iov);
    return ucp_tag_msg_recv_nbx(w, buf, len, msg, &p);
}

ucs_status_ptr_t troupe_am_send(ucp_ep_h ep, uint16_t id, const void *hdr, size_t hdr_len,
                                const void *buf, size_t len, int iov, uint32_t flags,
                                troupe_queue_t *q) {
    ucp_request_param_t p;
    send_param(&p, q, iov);
    p.op_attr_mask |= UCP_OP_ATTR_FIELD_FLAGS;
    p.flags = flags;
    return ucp_am_send_nbx(ep, id, hdr, hdr_len, buf, len, &p);
}

/* A posted active message: its header and data, copied into one block that
 * lives until UCX is done with it. */
typedef struct {
    troupe_queue_t *q;
    uint64_t *ep_inflight; /* the endpoint's count of posts in flight, or NULL */
    size_t hdr_len;
} post_block_t;

static void post_cb(void *req, ucs_status_t status, void *user) {
    post_block_t *b = user;
    if (status != UCS_OK) b->q->post_failed++;
    b->q->post_inflight--;
    if (b->ep_inflight != NULL) (*b->ep_inflight)--;
    free(b);
    ucp_request_free(req);
}

ucs_status_t troupe_am_post(ucp_ep_h ep, uint16_t id, const void *hdr, size_t hdr_len,
                            const void *buf, size_t len, uint32_t flags, troupe_queue_t *q,
                            uint64_t *ep_inflight) {
    post_block_t *b = malloc(sizeof(*b) + hdr_len + len);
    if (b == NULL) return UCS_ERR_NO_MEMORY;
    b->q = q;
    b->ep_inflight = ep_inflight;
    b->hdr_len = hdr_len;
    char *h = (char *)(b + 1), *d = h + hdr_len;
    if (hdr_len > 0) memcpy(h, hdr, hdr_len);
    if (len > 0) memcpy(d, buf, len);
    ucp_request_param_t p;
    memset(&p, 0, sizeof(p));
    p.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA |
                     UCP_OP_ATTR_FIELD_FLAGS;
    p.cb.send = post_cb;
    p.user_data = b;
    p.flags = flags;
    ucs_status_ptr_t r = ucp_am_send_nbx(ep, id, hdr_len > 0 ? h : NULL, hdr_len,
                                         len > 0 ? d : NULL, len, &p);
    if (UCS_PTR_IS_PTR(r)) { /* post_cb frees the block */
        q->post_inflight++;
        if (ep_inflight != NULL) (*ep_inflight)++;
        return UCS_INPROGRESS;
    }
    free(b);
    return UCS_PTR_STATUS(r);
}

void troupe_am_release(ucp_worker_h w, troupe_ev_t *ev, size_t n) {
    for (size_t i = 0; i < n; i++) {
        troupe_ev_t *e = &ev[i];
        free(e->header);
        e->header = NULL;
        if (e->data == NULL) continue;
        if (e->am_flags & (UCP_AM_RECV_ATTR_FLAG_DATA | UCP_AM_RECV_ATTR_FLAG_RNDV)) {
            ucp_am_data_release(w, e->data);
        } else {
            free(e->data);
        }
        e->data = NULL;
    }
}

ucs_status_ptr_t troupe_am_recv_data(ucp_worker_h w, void *desc, void *buf, size_t len,
                                     int iov, troupe_queue_t *q, size_t *imm_len) {
    ucp_request_param_t p;
    memset(&p, 0, sizeof(p));
    p.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA |
                     UCP_OP_ATTR_FIELD_RECV_INFO;
    p.cb.recv_am = am_data_cb;
    p.user_data = q;
    p.recv_info.length = imm_len;
    if (iov) {
        p.op_attr_mask |= UCP_OP_ATTR_FIELD_DATATYPE;
        p.datatype = ucp_dt_make_iov();
    }
    return ucp_am_recv_data_nbx(w, desc, buf, len, &p);
}

ucs_status_ptr_t troupe_put(ucp_ep_h ep, const void *buf, size_t len, uint64_t raddr,
                            ucp_rkey_h rkey, troupe_queue_t *q) {
    ucp_request_param_t p;
    send_param(&p, q, 0);
    return ucp_put_nbx(ep, buf, len, raddr, rkey, &p);
}

ucs_status_ptr_t troupe_get(ucp_ep_h ep, void *buf, size_t len, uint64_t raddr,
                            ucp_rkey_h rkey, troupe_queue_t *q) {
    ucp_request_param_t p;
    send_param(&p, q, 0);
    return ucp_get_nbx(ep, buf, len, raddr, rkey, &p);
}

ucs_status_ptr_t troupe_ep_flush(ucp_ep_h ep, troupe_queue_t *q) {
    ucp_request_param_t p;
    send_param(&p, q, 0);
    return ucp_ep_flush_nbx(ep, &p);
}

ucs_status_ptr_t troupe_worker_flush(ucp_worker_h w, troupe_queue_t *q) {
    ucp_request_param_t p;
    send_param(&p, q, 0);
    return ucp_worker_flush_nbx(w, &p);
}

ucs_status_ptr_t troupe_ep_close(ucp_ep_h ep, int force, troupe_queue_t *q) {
    ucp_request_param_t p;
    send_param(&p, q, 0);
    p.op_attr_mask |= UCP_OP_ATTR_FIELD_FLAGS;
    p.flags = force ? UCP_EP_CLOSE_FLAG_FORCE : 0;
    return ucp_ep_close_nbx(ep, &p);
}

ucs_status_t troupe_mem_map(ucp_context_h ctx, uintptr_t addr, size_t len, ucp_mem_h *memh) {
    ucp_mem_map_params_t p;
    memset(&p, 0, sizeof(p));
    p.field_mask = UCP_MEM_MAP_PARAM_FIELD_ADDRESS | UCP_MEM_MAP_PARAM_FIELD_LENGTH;
    p.address = (void *)addr;
    p.length = len;
    return ucp_mem_map(ctx, &p, memh);
}

char *troupe_context_info(ucp_context_h ctx) {
    char *buf = NULL;
    size_t n = 0;
    FILE *f = open_memstream(&buf, &n);
    if (f == NULL) return NULL;
    ucp_context_print_info(ctx, f);
    fclose(f);
    return buf;
}
