// Package ucx is troupe's thin cgo binding of libucp, the UCX protocol layer.
//
// It is the only package in troupe that imports "C" for UCX. Names follow the
// C API (ucp_tag_send_nbx becomes Worker.TagSend). The binding does no
// locking: every call on a Worker, and on the endpoints, requests and memory
// handles that belong to it, must be serialised by the caller. Completion
// callbacks never enter Go: they queue an Event in C, and Worker.Progress
// returns the queued events after ucp_worker_progress.
//
// Buffers passed to non-blocking calls must stay valid (and, for Go memory,
// pinned with runtime.Pinner) until the request completes.
package ucx

/*
#cgo pkg-config: ucx
#include <malloc.h>
#include <stdlib.h>
#include "shim.h"
*/
import "C"

import (
	"errors"
	"fmt"
	"runtime"
	"sync"
	"unsafe"
)

// Status is a UCX status code (ucs_status_t).
type Status int32

// Status codes troupe inspects by value.
const (
	StatusOK              Status = C.UCS_OK
	StatusInProgress      Status = C.UCS_INPROGRESS
	StatusNoMessage       Status = C.UCS_ERR_NO_MESSAGE
	StatusBusy            Status = C.UCS_ERR_BUSY
	StatusCanceled        Status = C.UCS_ERR_CANCELED
	StatusTruncated       Status = C.UCS_ERR_MESSAGE_TRUNCATED
	StatusUnreachable     Status = C.UCS_ERR_UNREACHABLE
	StatusConnReset       Status = C.UCS_ERR_CONNECTION_RESET
	StatusEndpointTimeout Status = C.UCS_ERR_ENDPOINT_TIMEOUT
	StatusTimedOut        Status = C.UCS_ERR_TIMED_OUT
)

// String returns UCX's own description of the status.
func (s Status) String() string { return C.GoString(C.ucs_status_string(C.ucs_status_t(s))) }

// Error is a failed UCX call: the operation that failed and UCX's status.
type Error struct {
	Op     string
	Status Status
}

func (e *Error) Error() string {
	return fmt.Sprintf("ucx: %s: %s (status %d)", e.Op, e.Status, int(e.Status))
}

// StatusOf returns the UCX status inside err, or StatusOK when err carries none.
func StatusOf(err error) Status {
	var ue *Error
	if errors.As(err, &ue) {
		return ue.Status
	}
	return StatusOK
}

func check(op string, s C.ucs_status_t) error {
	if s == C.UCS_OK {
		return nil
	}
	return &Error{Op: op, Status: Status(s)}
}

// Version returns the version of the loaded libucp, for example "1.13.1".
func Version() string {
	var maj, min, rel C.uint
	C.ucp_get_version(&maj, &min, &rel)
	return fmt.Sprintf("%d.%d.%d", maj, min, rel)
}

// Feature selects the UCP features a context provides.
type Feature uint64

// UCP features.
const (
	FeatureTag    Feature = C.UCP_FEATURE_TAG
	FeatureRMA    Feature = C.UCP_FEATURE_RMA
	FeatureAMO64  Feature = C.UCP_FEATURE_AMO64
	FeatureWakeup Feature = C.UCP_FEATURE_WAKEUP
	FeatureAM     Feature = C.UCP_FEATURE_AM
)

// Heap settings KeepHeap gives glibc's allocator.
const (
	heapTrimThreshold = 256 << 20 // free memory kept at the heap's top
	heapTopPad        = 16 << 20  // extra memory taken each time a heap grows
)

var keepHeap sync.Once

// KeepHeap asks glibc's allocator, once per process, to keep the memory
// it frees (trim threshold 256 MiB, top pad 16 MiB) instead of handing it
// back to the kernel as soon as 128 KiB lie free at a heap's top. UCX
// allocates and frees a buffer for every active message it reassembles
// from fragments; with the default, the heap of the progress thread's
// arena shrank and grew again around them, and every page it grew into was
// a page fault (about 11 us on a virtual machine). MPI libraries commonly
// do the same. The first call reports whether glibc took both settings,
// later ones report true.
func KeepHeap() bool {
	ok := true
	keepHeap.Do(func() {
		ok = C.mallopt(C.M_TRIM_THRESHOLD, heapTrimThreshold) == 1 &&
			C.mallopt(C.M_TOP_PAD, heapTopPad) == 1
	})
	return ok
}

// Context is a UCP application context (ucp_context_h).
type Context struct {
	h C.ucp_context_h
}

// NewContext reads UCX's configuration from the environment (UCX_*), applies
// the overrides in config (names without the UCX_ prefix) and initialises a
// context with the given features.
func NewContext(features Feature, config map[string]string) (*Context, error) {
	var cfg *C.ucp_config_t
	if err := check("ucp_config_read", C.ucp_config_read(nil, nil, &cfg)); err != nil {
		return nil, err
	}
	defer C.ucp_config_release(cfg)
	for k, v := range config {
		ck, cv := C.CString(k), C.CString(v)
		st := C.ucp_config_modify(cfg, ck, cv)
		C.free(unsafe.Pointer(ck))
		C.free(unsafe.Pointer(cv))
		if err := check("ucp_config_modify "+k+"="+v, st); err != nil {
			return nil, err
		}
	}
	var p C.ucp_params_t
	p.field_mask = C.UCP_PARAM_FIELD_FEATURES
	p.features = C.uint64_t(features)
	c := &Context{}
	if err := check("ucp_init", C.ucp_init_version(C.UCP_API_MAJOR, C.UCP_API_MINOR, &p, cfg, &c.h)); err != nil {
		return nil, err
	}
	return c, nil
}

// Close releases the context (ucp_cleanup). All workers must be closed first.
func (c *Context) Close() {
	if c.h != nil {
		C.ucp_cleanup(c.h)
		c.h = nil
	}
}

// ThreadMode is the worker's thread mode (ucs_thread_mode_t).
type ThreadMode int

// Thread modes.
const (
	ThreadSingle     ThreadMode = C.UCS_THREAD_MODE_SINGLE
	ThreadSerialized ThreadMode = C.UCS_THREAD_MODE_SERIALIZED
	ThreadMulti      ThreadMode = C.UCS_THREAD_MODE_MULTI
)

// Worker is a UCP worker (ucp_worker_h) with its event queue.
type Worker struct {
	h   C.ucp_worker_h
	q   *C.troupe_queue_t
	ctx *Context
	// ev is a C array events are drained into: a Go array would make cgo
	// scan every entry's pointer fields on every call.
	ev  *C.troupe_ev_t
	nev int
	// counts are the endpoints' posts-in-flight counters (C memory, which
	// send callbacks decrement): freed with the worker, after which no
	// callback runs.
	counts []*C.uint64_t
}

// eventBatch is how many events one Progress or Drain call returns at most.
const eventBatch = 128

// NewWorker creates a worker on the context.
func (c *Context) NewWorker(mode ThreadMode) (*Worker, error) {
	var p C.ucp_worker_params_t
	p.field_mask = C.UCP_WORKER_PARAM_FIELD_THREAD_MODE
	p.thread_mode = C.ucs_thread_mode_t(mode)
	w := &Worker{ctx: c, q: C.troupe_queue_new(), nev: eventBatch}
	w.ev = (*C.troupe_ev_t)(C.calloc(C.size_t(w.nev), C.size_t(unsafe.Sizeof(C.troupe_ev_t{}))))
	if w.q == nil || w.ev == nil {
		C.troupe_queue_free(w.q)
		C.free(unsafe.Pointer(w.ev))
		return nil, &Error{Op: "troupe_queue_new", Status: C.UCS_ERR_NO_MEMORY}
	}
	if err := check("ucp_worker_create", C.ucp_worker_create(c.h, &p, &w.h)); err != nil {
		C.troupe_queue_free(w.q)
		C.free(unsafe.Pointer(w.ev))
		return nil, err
	}
	return w, nil
}

// Close destroys the worker. Endpoints must be closed first; queued events
// are discarded (their held AM data is released).
func (w *Worker) Close() {
	if w.h == nil {
		return
	}
	for ev := w.Drain(); len(ev) > 0; ev = w.Drain() {
		for i := range ev {
			ev[i].Discard(w)
		}
	}
	C.ucp_worker_destroy(w.h)
	for _, c := range w.counts {
		C.free(unsafe.Pointer(c))
	}
	w.counts = nil
	C.troupe_queue_free(w.q)
	C.free(unsafe.Pointer(w.ev))
	w.h, w.q, w.ev = nil, nil, nil
}

// Address returns the worker's address, to be sent to peers.
func (w *Worker) Address() ([]byte, error) {
	var a *C.ucp_address_t
	var n C.size_t
	if err := check("ucp_worker_get_address", C.ucp_worker_get_address(w.h, &a, &n)); err != nil {
		return nil, err
	}
	defer C.ucp_worker_release_address(w.h, a)
	return C.GoBytes(unsafe.Pointer(a), C.int(n)), nil
}

// EventFD returns the worker's event file descriptor (ucp_worker_get_efd).
func (w *Worker) EventFD() (int, error) {
	var fd C.int
	if err := check("ucp_worker_get_efd", C.ucp_worker_get_efd(w.h, &fd)); err != nil {
		return -1, err
	}
	return int(fd), nil
}

// Arm arms the event fd (ucp_worker_arm). It returns an error with StatusBusy
// when events are pending and the caller must progress instead of sleeping.
func (w *Worker) Arm() error { return check("ucp_worker_arm", C.ucp_worker_arm(w.h)) }

// Signal wakes a thread sleeping on the event fd (ucp_worker_signal). It is
// the one call that is safe without serialisation.
func (w *Worker) Signal() error { return check("ucp_worker_signal", C.ucp_worker_signal(w.h)) }

// Progress calls ucp_worker_progress (again while it makes progress and
// fewer than eventBatch events are queued, up to 8 times) and returns up to
// eventBatch queued events, and whether UCX reported progress. The events live in the worker's
// C memory: they are valid until the next Progress or Drain call.
func (w *Worker) Progress() ([]Event, bool) {
	n := C.troupe_progress_drain_u(C.uintptr_t(uintptr(unsafe.Pointer(w.h))), C.uintptr_t(uintptr(unsafe.Pointer(w.q))), C.uintptr_t(uintptr(unsafe.Pointer(w.ev))), C.size_t(w.nev))
	return w.events(int(n)), w.q.progressed != 0
}

// Drain returns up to eventBatch queued events without progressing, valid
// until the next Progress or Drain call.
func (w *Worker) Drain() []Event {
	return w.events(int(C.troupe_drain_u(C.uintptr_t(uintptr(unsafe.Pointer(w.q))), C.uintptr_t(uintptr(unsafe.Pointer(w.ev))), C.size_t(w.nev))))
}

func (w *Worker) events(n int) []Event {
	if n == 0 {
		return nil
	}
	return unsafe.Slice((*Event)(unsafe.Pointer(w.ev)), n)
}

// Pending reports the number of queued events and whether an event was lost
// for lack of memory.
func (w *Worker) Pending() (int, bool) { return int(w.q.n), w.q.oom != 0 }

// EventKind says what an Event reports.
type EventKind uint32

// Event kinds.
const (
	EventSend    EventKind = C.TROUPE_EV_SEND
	EventRecv    EventKind = C.TROUPE_EV_RECV
	EventAM      EventKind = C.TROUPE_EV_AM
	EventAMData  EventKind = C.TROUPE_EV_AM_DATA
	EventEPError EventKind = C.TROUPE_EV_EP_ERROR
)

// Event is one queued completion, arrival or endpoint failure.
type Event C.troupe_ev_t

// Kind says what the event reports.
func (e *Event) Kind() EventKind { return EventKind(e.kind) }

// Status is the operation's or endpoint's status.
func (e *Event) Status() Status { return Status(e.status) }

// Request identifies the request that completed (send, receive and AM-data
// events). The request itself was already released when the event was
// drained: use the value only to look it up, never pass it to UCX.
func (e *Event) Request() Request { return Request{e.req} }

// Endpoint is the endpoint that failed (EventEPError).
func (e *Event) Endpoint() uintptr { return uintptr(e.req) }

// SenderTag is the tag of a received message (EventRecv).
func (e *Event) SenderTag() uint64 { return uint64(e.tag) }

// Peek returns the bytes TagRecvPeek copied, or nil.
func (e *Event) Peek() []byte {
	if e.peek_len == 0 {
		return nil
	}
	return C.GoBytes(unsafe.Pointer(&e.peek[0]), C.int(e.peek_len))
}

// Length is the received length (EventRecv, EventAMData) or the AM data length (EventAM).
func (e *Event) Length() int { return int(e.length) }

// AMID is the active message id (EventAM).
func (e *Event) AMID() uint16 { return uint16(e.am_id) }

// AMRendezvous reports whether the AM data must be fetched with AMRecvData.
func (e *Event) AMRendezvous() bool { return e.am_flags&C.UCP_AM_RECV_ATTR_FLAG_RNDV != 0 }

// AMHeld reports whether the AM data is held by UCX (to release with
// AMDataRelease or receive with AMRecvData) rather than copied by troupe.
func (e *Event) AMHeld() bool {
	return e.am_flags&(C.UCP_AM_RECV_ATTR_FLAG_DATA|C.UCP_AM_RECV_ATTR_FLAG_RNDV) != 0
}

// AMHeader returns the AM header (valid until Discard).
func (e *Event) AMHeader() []byte {
	if e.header == nil {
		return nil
	}
	return unsafe.Slice((*byte)(e.header), int(e.header_len))
}

// AMData returns the eager AM data (valid until Discard); nil for rendezvous.
func (e *Event) AMData() []byte {
	if e.data == nil || e.AMRendezvous() {
		return nil
	}
	return unsafe.Slice((*byte)(e.data), int(e.length))
}

// AMDescriptor is the rendezvous data descriptor for AMRecvData.
func (e *Event) AMDescriptor() unsafe.Pointer { return e.data }

// AMReplyEP identifies the endpoint to reply on, if the sender asked for one.
func (e *Event) AMReplyEP() uintptr { return uintptr(e.reply_ep) }

// FreeHeader frees the AM header copy.
func (e *Event) FreeHeader() {
	if e.header != nil {
		C.free(e.header)
		e.header = nil
	}
}

// ReleaseData releases eager AM data (held or copied). Rendezvous data must be
// received with AMRecvData or dropped with Discard.
func (e *Event) ReleaseData(w *Worker) {
	if e.data == nil {
		return
	}
	if e.AMHeld() {
		C.ucp_am_data_release(w.h, e.data)
	} else {
		C.free(e.data)
	}
	e.data = nil
}

// Discard frees everything an AM event holds, dropping its data. Other
// events hold nothing.
func (e *Event) Discard(w *Worker) {
	if e.Kind() == EventAM {
		e.FreeHeader()
		e.ReleaseData(w)
	}
}

// Request is an in-flight UCX request; the zero Request means the operation
// completed at once.
type Request struct{ p unsafe.Pointer }

// Pending reports whether the operation is still in flight.
func (r Request) Pending() bool { return r.p != nil }

// Status returns the status of a request still in flight
// (ucp_request_check_status): StatusInProgress until it completes. Once its
// completion event has been drained the request is gone and must not be asked.
func (r Request) Status() Status {
	if r.p == nil {
		return StatusOK
	}
	return Status(C.ucp_request_check_status(r.p))
}

// Free releases a completed request (ucp_request_free).
func (r Request) Free() {
	if r.p != nil {
		C.ucp_request_free(r.p)
	}
}

// Cancel asks UCX to cancel the request (ucp_request_cancel); its completion
// event then reports StatusCanceled unless it had already completed.
func (w *Worker) Cancel(r Request) {
	if r.p != nil {
		C.ucp_request_cancel(w.h, r.p)
	}
}

// CancelNow cancels r, a tag receive, and reports whether it is cancelled
// now: a receive that has not matched a message leaves UCX's expected queue
// at once (its completion event, reporting StatusCanceled, is queued before
// CancelNow returns). A receive that has matched, or completed (cancelled
// by an earlier Cancel included, its event still queued), goes on, and
// CancelNow reports false.
func (w *Worker) CancelNow(r Request) bool {
	if r.p == nil {
		return false
	}
	if Status(C.ucp_request_check_status(r.p)) != StatusInProgress {
		return false // completed before this call: its event is queued already
	}
	C.ucp_request_cancel(w.h, r.p)
	return Status(C.ucp_request_check_status(r.p)) == StatusCanceled
}

func result(op string, p C.ucs_status_ptr_t) (Request, error) {
	if p == nil {
		return Request{}, nil
	}
	if C.troupe_is_ptr(p) != 0 {
		return Request{unsafe.Pointer(p)}, nil
	}
	return Request{}, &Error{Op: op, Status: Status(C.troupe_ptr_status(p))}
}

// Endpoint is a UCP endpoint (ucp_ep_h).
type Endpoint struct {
	h     C.ucp_ep_h
	posts *C.uint64_t // AMPost sends to this endpoint in flight
}

// PostsInFlight is the number of AMPost sends to the endpoint that UCX has
// not completed yet (queued because the peer's receive queue was full, or
// still moving).
func (ep *Endpoint) PostsInFlight() int { return int(*ep.posts) }

// Handle identifies the endpoint in EventEPError events.
func (ep *Endpoint) Handle() uintptr { return uintptr(unsafe.Pointer(ep.h)) }

// Connect creates an endpoint to the worker whose address is addr. With
// peerErrors the endpoint uses UCP_ERR_HANDLING_MODE_PEER and its failure is
// reported as an EventEPError.
func (w *Worker) Connect(addr []byte, peerErrors bool) (*Endpoint, error) {
	if len(addr) == 0 {
		return nil, &Error{Op: "ucp_ep_create", Status: C.UCS_ERR_INVALID_PARAM}
	}
	ca := C.CBytes(addr)
	defer C.free(ca)
	pe := C.int(0)
	if peerErrors {
		pe = 1
	}
	ep := &Endpoint{posts: (*C.uint64_t)(C.calloc(1, C.size_t(unsafe.Sizeof(C.uint64_t(0)))))}
	if ep.posts == nil {
		return nil, &Error{Op: "ucp_ep_create", Status: C.UCS_ERR_NO_MEMORY}
	}
	if err := check("ucp_ep_create", C.troupe_ep_create(w.h, ca, w.q, pe, &ep.h)); err != nil {
		C.free(unsafe.Pointer(ep.posts))
		return nil, err
	}
	w.counts = append(w.counts, ep.posts)
	return ep, nil
}

// CloseEndpoint starts closing ep (ucp_ep_close_nbx); force skips flushing
// (for failed endpoints).
func (w *Worker) CloseEndpoint(ep *Endpoint, force bool) (Request, error) {
	f := C.int(0)
	if force {
		f = 1
	}
	return result("ucp_ep_close_nbx", C.troupe_ep_close(ep.h, f, w.q))
}

// IOV is a C-allocated array of ucp_dt_iov_t entries, stable until Free.
type IOV struct {
	p *C.ucp_dt_iov_t
	n int
}

// NewIOV allocates an IOV list with n entries. An empty list still gets
// one (unused, zeroed) entry: UCX 1.13 asserts that an IOV pointer is not
// NULL even when the count is 0, and aborts the process.
func NewIOV(n int) *IOV {
	p := (*C.ucp_dt_iov_t)(C.calloc(C.size_t(max(n, 1)), C.size_t(unsafe.Sizeof(C.ucp_dt_iov_t{}))))
	return &IOV{p: p, n: n}
}

// Set sets entry i.
func (v *IOV) Set(i int, p unsafe.Pointer, n int) {
	e := (*C.ucp_dt_iov_t)(unsafe.Add(unsafe.Pointer(v.p), uintptr(i)*unsafe.Sizeof(C.ucp_dt_iov_t{})))
	e.buffer = p
	e.length = C.size_t(n)
}

// Len is the number of entries.
func (v *IOV) Len() int { return v.n }

// Entry returns entry i's buffer and length.
func (v *IOV) Entry(i int) (unsafe.Pointer, int) {
	e := (*C.ucp_dt_iov_t)(unsafe.Add(unsafe.Pointer(v.p), uintptr(i)*unsafe.Sizeof(C.ucp_dt_iov_t{})))
	return e.buffer, int(e.length)
}

// Free releases the list.
func (v *IOV) Free() {
	if v != nil && v.p != nil {
		C.free(unsafe.Pointer(v.p))
		v.p = nil
	}
}

// Buffer describes the data of an operation: a contiguous buffer, or an IOV list.
type Buffer struct {
	Ptr unsafe.Pointer
	Len int
	IOV *IOV
}

func (b Buffer) args() (unsafe.Pointer, C.size_t, C.int) {
	if b.IOV != nil {
		return unsafe.Pointer(b.IOV.p), C.size_t(b.IOV.n), 1
	}
	return b.Ptr, C.size_t(b.Len), 0
}

// TagSend sends b with tag on ep (ucp_tag_send_nbx).
func (w *Worker) TagSend(ep *Endpoint, b Buffer, tag uint64) (Request, error) {
	p, n, iov := b.args()
	return result("ucp_tag_send_nbx", C.troupe_tag_send(ep.h, p, n, iov, C.uint64_t(tag), w.q))
}

// RecvInfo describes a received or probed message.
type RecvInfo struct {
	Tag    uint64
	Length int
}

// TagRecv posts a receive for tag under mask (ucp_tag_recv_nbx). Receives
// never complete at once: the outcome, with the sender's tag and the
// message's length, always arrives as an EventRecv.
func (w *Worker) TagRecv(b Buffer, tag, mask uint64) (Request, error) {
	p, n, iov := b.args()
	return result("ucp_tag_recv_nbx", C.troupe_tag_recv(w.h, p, n, iov, C.uint64_t(tag), C.uint64_t(mask), w.q))
}

// Message is a probed message removed from UCX's unexpected queue.
type Message struct{ p unsafe.Pointer }

// TagRecvPeek is TagRecv that also copies a message of at most 32 bytes
// whose sender tag has a bit of peekBits set into its event (Event.Peek),
// as the receive completes.
func (w *Worker) TagRecvPeek(b Buffer, tag, mask, peekBits uint64) (Request, error) {
	p, n, iov := b.args()
	return result("ucp_tag_recv_nbx", C.troupe_tag_recv_peek(w.h, p, n, iov, C.uint64_t(tag), C.uint64_t(mask), C.uint64_t(peekBits), w.q))
}

// TagProbe looks for a message matching tag under mask (ucp_tag_probe_nb).
// With remove the message is taken from the queue and must be received with
// TagMsgRecv.
func (w *Worker) TagProbe(tag, mask uint64, remove bool) (Message, RecvInfo, bool) {
	var info C.ucp_tag_recv_info_t
	rm := C.int(0)
	if remove {
		rm = 1
	}
	m := C.ucp_tag_probe_nb(w.h, C.uint64_t(tag), C.uint64_t(mask), rm, &info)
	if m == nil {
		return Message{}, RecvInfo{}, false
	}
	return Message{unsafe.Pointer(m)}, RecvInfo{Tag: uint64(info.sender_tag), Length: int(info.length)}, true
}

// TagMsgRecv receives a message taken with TagProbe (ucp_tag_msg_recv_nbx);
// like TagRecv, its outcome always arrives as an EventRecv.
func (w *Worker) TagMsgRecv(b Buffer, m Message) (Request, error) {
	p, n, iov := b.args()
	return result("ucp_tag_msg_recv_nbx", C.troupe_tag_msg_recv(w.h, p, n, iov, C.ucp_tag_message_h(m.p), w.q))
}

// AM send flags.
const (
	AMSendReply = C.UCP_AM_SEND_FLAG_REPLY
	AMSendEager = C.UCP_AM_SEND_FLAG_EAGER
	AMSendRndv  = C.UCP_AM_SEND_FLAG_RNDV
)

// SetAMHandler registers troupe's queueing handler for active message id
// (ucp_worker_set_am_recv_handler, whole messages, persistent data).
func (w *Worker) SetAMHandler(id uint16) error {
	return check("ucp_worker_set_am_recv_handler", C.troupe_set_am_handler(w.h, C.uint16_t(id), w.q))
}

// AMSend sends an active message (ucp_am_send_nbx). header must stay valid
// until the request completes.
func (w *Worker) AMSend(ep *Endpoint, id uint16, header []byte, b Buffer, flags uint32) (Request, error) {
	var hp unsafe.Pointer
	if len(header) > 0 {
		hp = unsafe.Pointer(&header[0])
	}
	p, n, iov := b.args()
	return result("ucp_am_send_nbx", C.troupe_am_send(ep.h, C.uint16_t(id), hp, C.size_t(len(header)), p, n, iov, C.uint32_t(flags), w.q))
}

// AMPost sends an active message from a copy of header and data made in C
// memory, so both may be reused as soon as it returns (troupe_am_post). No
// request comes back and no event is queued: the caller never hears of the
// send again, except as a count of sends that failed after they had
// started (PostFailed). It returns whether the send completed at once.
func (w *Worker) AMPost(ep *Endpoint, id uint16, header, data []byte, flags uint32) (bool, error) {
	var hp, dp uintptr
	if len(header) > 0 {
		hp = uintptr(unsafe.Pointer(&header[0]))
	}
	if len(data) > 0 {
		dp = uintptr(unsafe.Pointer(&data[0]))
	}
	// The pointers go as integers: cgo would otherwise check both for Go
	// pointers on every message. The memory is only read during the call
	// (the goroutine's stack cannot move while it is in C), and the slices
	// stay alive until the call returns.
	st := C.troupe_am_post_u(C.uintptr_t(uintptr(unsafe.Pointer(ep.h))), C.uint16_t(id), C.uintptr_t(hp), C.size_t(len(header)), C.uintptr_t(dp), C.size_t(len(data)), C.uint32_t(flags), C.uintptr_t(uintptr(unsafe.Pointer(w.q))), C.uintptr_t(uintptr(unsafe.Pointer(ep.posts))))
	runtime.KeepAlive(header)
	runtime.KeepAlive(data)
	switch Status(st) {
	case StatusOK:
		return true, nil
	case StatusInProgress:
		return false, nil
	}
	return false, &Error{Op: "ucp_am_send_nbx", Status: Status(st)}
}

// PostsInFlight is the number of AMPost sends UCX has not completed yet.
func (w *Worker) PostsInFlight() int { return int(w.q.post_inflight) }

// PostFailed is the number of AMPost sends that failed after they had
// started (their completion reported an error).
func (w *Worker) PostFailed() uint64 { return uint64(w.q.post_failed) }

// AMRelease frees what the AM events hold (header copies, eager data,
// rendezvous descriptors), in one call for the lot.
func (w *Worker) AMRelease(evs []Event) {
	if len(evs) == 0 {
		return
	}
	C.troupe_am_release_u(C.uintptr_t(uintptr(unsafe.Pointer(w.h))), C.uintptr_t(uintptr(unsafe.Pointer(&evs[0]))), C.size_t(len(evs)))
	runtime.KeepAlive(evs)
}

// AMRecvData receives rendezvous AM data described by desc into b
// (ucp_am_recv_data_nbx). When it completes at once, the Request is 0 and the
// length is returned.
func (w *Worker) AMRecvData(desc unsafe.Pointer, b Buffer) (Request, int, error) {
	var n C.size_t
	p, ln, iov := b.args()
	r, err := result("ucp_am_recv_data_nbx", C.troupe_am_recv_data(w.h, desc, p, ln, iov, w.q, &n))
	return r, int(n), err
}

// AMDataRelease drops held AM data or a rendezvous descriptor (ucp_am_data_release).
func (w *Worker) AMDataRelease(data unsafe.Pointer) {
	if data != nil {
		C.ucp_am_data_release(w.h, data)
	}
}

// Flush flushes outstanding RMA on ep (ucp_ep_flush_nbx).
func (w *Worker) Flush(ep *Endpoint) (Request, error) {
	return result("ucp_ep_flush_nbx", C.troupe_ep_flush(ep.h, w.q))
}

// FlushWorker flushes all outstanding operations of the worker (ucp_worker_flush_nbx).
func (w *Worker) FlushWorker() (Request, error) {
	return result("ucp_worker_flush_nbx", C.troupe_worker_flush(w.h, w.q))
}

// MemHandle is mapped memory (ucp_mem_h).
type MemHandle struct {
	h    C.ucp_mem_h
	ctx  *Context
	Addr uintptr
	Len  int
}

// MemMap registers the address range [addr, addr+n) with UCX (ucp_mem_map).
// The memory must stay allocated, and Go memory pinned, until Unmap.
func (c *Context) MemMap(addr uintptr, n int) (*MemHandle, error) {
	m := &MemHandle{ctx: c, Addr: addr, Len: n}
	if err := check("ucp_mem_map", C.troupe_mem_map(c.h, C.uintptr_t(addr), C.size_t(n), &m.h)); err != nil {
		return nil, err
	}
	return m, nil
}

// Unmap releases the registration (ucp_mem_unmap).
func (m *MemHandle) Unmap() error {
	if m.h == nil {
		return nil
	}
	err := check("ucp_mem_unmap", C.ucp_mem_unmap(m.ctx.h, m.h))
	m.h = nil
	return err
}

// PackRkey returns the packed remote key of the registration (ucp_rkey_pack).
func (m *MemHandle) PackRkey() ([]byte, error) {
	var buf unsafe.Pointer
	var n C.size_t
	if err := check("ucp_rkey_pack", C.ucp_rkey_pack(m.ctx.h, m.h, &buf, &n)); err != nil {
		return nil, err
	}
	defer C.ucp_rkey_buffer_release(buf)
	return C.GoBytes(buf, C.int(n)), nil
}

// Rkey is an unpacked remote key (ucp_rkey_h), usable on the endpoint it was unpacked for.
type Rkey struct {
	h C.ucp_rkey_h
}

// UnpackRkey unpacks a peer's packed remote key for use on ep (ucp_ep_rkey_unpack).
func (ep *Endpoint) UnpackRkey(packed []byte) (*Rkey, error) {
	if len(packed) == 0 {
		return nil, &Error{Op: "ucp_ep_rkey_unpack", Status: C.UCS_ERR_INVALID_PARAM}
	}
	cb := C.CBytes(packed)
	defer C.free(cb)
	k := &Rkey{}
	if err := check("ucp_ep_rkey_unpack", C.ucp_ep_rkey_unpack(ep.h, cb, &k.h)); err != nil {
		return nil, err
	}
	return k, nil
}

// Destroy releases the remote key (ucp_rkey_destroy).
func (k *Rkey) Destroy() {
	if k.h != nil {
		C.ucp_rkey_destroy(k.h)
		k.h = nil
	}
}

// Put writes n bytes from local memory to raddr on the peer (ucp_put_nbx).
func (w *Worker) Put(ep *Endpoint, p unsafe.Pointer, n int, raddr uint64, k *Rkey) (Request, error) {
	return result("ucp_put_nbx", C.troupe_put(ep.h, p, C.size_t(n), C.uint64_t(raddr), k.h, w.q))
}

// Get reads n bytes from raddr on the peer into local memory (ucp_get_nbx).
func (w *Worker) Get(ep *Endpoint, p unsafe.Pointer, n int, raddr uint64, k *Rkey) (Request, error) {
	return result("ucp_get_nbx", C.troupe_get(ep.h, p, C.size_t(n), C.uint64_t(raddr), k.h, w.q))
}

// Info describes the context's transports and devices (ucp_context_print_info).
func (c *Context) Info() string {
	p := C.troupe_context_info(c.h)
	if p == nil {
		return ""
	}
	defer C.free(unsafe.Pointer(p))
	return C.GoString(p)
}
