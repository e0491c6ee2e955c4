package transport

import (
	"fmt"
	"strconv"
	"time"
	"unsafe"

	"go.uber.org/zap"

	"github.com/troupe-hpc/troupe/overlap"
	"github.com/troupe-hpc/troupe/transport/ucx"
)

// RendezvousPolicy decides, transfer by transfer, how large tagged messages
// progress on this rank (DESIGN 3 and 8): offloaded to the progress
// goroutine, onloaded to the receiver's next call, or prefetched into a pool
// slot when no receive is posted yet. *overlap.Engine implements it; tests
// may plug in their own. The transport calls it with the worker lock held,
// from one goroutine at a time, so an implementation needs no locking of its
// own, and a policy must not be shared by two transports.
type RendezvousPolicy interface {
	// Step reports one event and returns the decision (docs/overlap.md,
	// section 4, lists which event when).
	Step(overlap.Event) (overlap.Decision, error)
	// Config returns the thresholds and pool geometry the transport needs:
	// RendezvousThreshold, PoolSlots and SlotSize.
	Config() overlap.Config
	// SetCost replaces the LogGP cost (alpha ns/byte, beta per message),
	// for example after CalibrateOverlap.
	SetCost(alpha float64, beta time.Duration) error
	// Stats returns the policy's counters.
	Stats() overlap.Stats
}

// Environment variables that turn the engine on for a transport created
// without Options.Overlap (for example under troupe run or troupe bench
// pingpong): TROUPE_OVERLAP=on uses overlap.DefaultConfig();
// TROUPE_OVERLAP_SLOTS=n overrides its prefetch pool size.
const (
	OverlapEnv      = "TROUPE_OVERLAP"
	OverlapSlotsEnv = "TROUPE_OVERLAP_SLOTS"
)

// overlapFromEnv returns the policy the environment asks for, or nil.
func overlapFromEnv() (RendezvousPolicy, error) {
	v, _ := syscallGetenv(OverlapEnv)
	switch v {
	case "", "off", "0":
		return nil, nil
	case "on", "1":
	default:
		return nil, fmt.Errorf("%w: %s=%q (want on or off)", ErrInvalid, OverlapEnv, v)
	}
	cfg := overlap.DefaultConfig()
	if s, ok := syscallGetenv(OverlapSlotsEnv); ok {
		n, err := strconv.Atoi(s)
		if err != nil || n < 0 {
			return nil, fmt.Errorf("%w: %s=%q (want a count >= 0)", ErrInvalid, OverlapSlotsEnv, s)
		}
		cfg.PoolSlots = n
	}
	e, err := overlap.New(cfg)
	if err != nil {
		return nil, fmt.Errorf("transport: %s: %w", OverlapEnv, err)
	}
	return e, nil
}

// copyOffloadMin is the size from which a prefetched message is copied out
// of its slot by the progress goroutine rather than by the receiving call,
// so that the copy overlaps the caller's computation.
const copyOffloadMin = 32 << 10

// maxLoggedPolicyErrors bounds the warnings logged for policy lifecycle
// errors (integration bugs); OverlapStats counts all of them.
const maxLoggedPolicyErrors = 10

// ovState is the transport side of the overlap engine; every field is
// guarded by the worker lock.
type ovState struct {
	pol      RendezvousPolicy
	thresh   int
	slotSize int
	slots    [][]byte // prefetch pool, each slot allocated on first use
	start    time.Time
	nextID   uint64
	// posted: receives of at least thresh bytes waiting for their message,
	// kept out of UCX and matched by wire tag when the header is probed.
	posted map[uint64]*Request
	// unexp: messages taken off UCX's unexpected queue before their
	// receive was posted, by wire tag; a matched one stays until delivered.
	unexp map[uint64]*ovMsg
	// held: expected messages the policy onloaded; the receiver's next call
	// into the transport starts them.
	held []*Request
	// copies: receives matched to a prefetched message, waiting for a
	// goroutine outside the lock to copy the slot into their buffer.
	copies []*Request
	errs   uint64
	dirty  bool // UCX may hold unexpected messages not taken yet
}

// ovRecv is the overlap state of a receive (or of an internal prefetch).
type ovRecv struct {
	id      uint64
	wire    uint64
	msg     ucx.Message // onloaded: the probed header, received when started
	size    int         // message size, once its header was probed
	held    bool
	started bool     // a UCX receive runs for it
	m       *ovMsg   // matched message (unexpected path)
	fetch   *ovMsg   // set on the internal request that fills m
	cma     *cmaDesc // a CMA message's descriptor, until its read starts
}

// ovMsg is a message taken off UCX's unexpected queue before its receive
// was posted.
type ovMsg struct {
	id        uint64
	wire      uint64
	peer, tag int
	size      int
	mode      overlap.Action // Prefetch or Onload
	eager     bool           // below the threshold: data copied out at once
	tracked   bool           // the engine keeps a record of it
	msg       ucx.Message    // Onload: the header, still in UCX
	slot      int
	data      []byte // Prefetch: slot memory; eager: a private copy
	done      bool   // data is in place (or err is set)
	err       error
	r         *Request // the receive that matched it, until delivered
	// cma: the data stays in the sender's memory (overlap_cma.go) until
	// read into a slot (Prefetch) or the receive's buffer (Onload).
	cma         bool
	desc        cmaDesc
	descPending bool // the descriptor itself is still being received
}

func newOvState(pol RendezvousPolicy) *ovState {
	cfg := pol.Config()
	return &ovState{
		pol:      pol,
		thresh:   int(cfg.RendezvousThreshold),
		slotSize: int(cfg.SlotSize),
		slots:    make([][]byte, cfg.PoolSlots),
		start:    time.Now(),
		posted:   map[uint64]*Request{},
		unexp:    map[uint64]*ovMsg{},
	}
}

// step feeds the policy one event; errors are integration bugs, logged and
// counted, and the transfer carries on as an onload.
func (t *Transport) step(ev overlap.Event) overlap.Decision {
	ov := t.ov
	ev.At = time.Since(ov.start)
	d, err := ov.pol.Step(ev)
	if err != nil {
		ov.errs++
		if ov.errs <= maxLoggedPolicyErrors {
			t.log.Warn("overlap policy rejected an event", zap.Error(err))
		}
		return overlap.Decision{Action: overlap.Onload, ID: ev.ID, Slot: overlap.NoSlot}
	}
	return d
}

// receiverIn reports whether the application is inside the transport,
// waiting (spinning or parked): "the receiver's next call" is now.
func (t *Transport) receiverIn() bool {
	return t.spinners.Load() > 0 || t.parked.Load() > 0
}

// ovPoll runs after each progress pass with the worker lock held. A pass
// that did something may have queued messages in UCX's unexpected queue;
// they are taken (ovProbe) by the next pass of a goroutine that is not
// spinning in Wait, or at once when engine receives wait for headers, so
// that a waiter spinning for small messages pays no probe. It also reports
// the waiting receiver's activity and starts onloaded transfers when the
// receiver is in the transport.
func (t *Transport) ovPoll(active bool) {
	ov := t.ov
	if active {
		ov.dirty = true
	}
	spinning := t.spinners.Load() > 0
	if ov.dirty && (!spinning || len(ov.posted) > 0) {
		t.ovProbe()
	}
	if t.receiverIn() {
		if spinning && active {
			t.step(overlap.Event{Kind: overlap.Progress})
		}
		t.ovStartHeld()
	}
}

// ovEnter records that the application entered the transport (a receive,
// test or wait call) and starts what was left for it; the lock is held.
func (t *Transport) ovEnter() {
	t.step(overlap.Event{Kind: overlap.Progress})
	t.ovProbe()
	t.ovStartHeld()
}

// ovProbe takes every tagged (USER kind) message off UCX's unexpected queue
// and matches it against the engine's posted receives by its exact wire
// tag; trace-based sequence numbers make the match unique, so taking
// messages in any order keeps MPI ordering. CMA descriptors (USER kind with
// cmaBit) are taken too and handled in overlap_cma.go. The lock is held.
func (t *Transport) ovProbe() {
	kindMask := uint64(0xf) << kindShift &^ cmaBit
	t.ov.dirty = false
	for {
		msg, info, ok := t.w.TagProbe(uint64(KindUser)<<kindShift, kindMask, true)
		if !ok {
			return
		}
		src, utag, _ := SplitUserTag(info.Tag &^ cmaBit)
		if info.Tag&cmaBit != 0 {
			t.ovCMATake(msg, info.Tag&^cmaBit, int(src), int(utag), info.Length)
			continue
		}
		if r := t.ov.posted[info.Tag]; r != nil {
			delete(t.ov.posted, info.Tag)
			d := t.step(overlap.Event{Kind: overlap.HeaderArrived, ID: r.ov.id, Peer: int(src), Tag: info.Tag,
				Size: int64(info.Length), Expected: true})
			r.ov.msg, r.ov.size = msg, info.Length
			if d.Action == overlap.Offload || info.Length < t.ov.thresh || t.receiverIn() {
				t.ovStart(r)
			} else {
				r.ov.held = true
				t.ov.held = append(t.ov.held, r)
			}
			continue
		}
		t.ovUnexpected(msg, info.Tag, int(src), int(utag), info.Length)
	}
}

// ovUnexpected handles a message that arrived before its receive; the lock
// is held.
func (t *Transport) ovUnexpected(msg ucx.Message, wire uint64, src, tag, size int) {
	ov := t.ov
	ov.nextID++
	m := &ovMsg{id: ov.nextID, wire: wire, peer: src, tag: tag, size: size, msg: msg, slot: overlap.NoSlot}
	ov.unexp[wire] = m
	d := t.step(overlap.Event{Kind: overlap.HeaderArrived, ID: m.id, Peer: src, Tag: wire, Size: int64(size)})
	m.tracked = true
	switch {
	case size < ov.thresh:
		// Eager: the data is here already; copy it out so the unexpected
		// queue never hides a later message.
		m.eager = true
		m.data = make([]byte, size)
		t.ovFetch(m)
	case d.Action == overlap.Prefetch && d.Slot >= 0 && d.Slot < len(ov.slots) && size <= ov.slotSize:
		if ov.slots[d.Slot] == nil {
			ov.slots[d.Slot] = make([]byte, ov.slotSize)
		}
		m.mode, m.slot = overlap.Prefetch, d.Slot
		m.data = ov.slots[d.Slot][:size]
		t.ovFetch(m)
		t.step(overlap.Event{Kind: overlap.TransferStarted, ID: m.id})
	default:
		m.mode = overlap.Onload
	}
}

// ovFetch receives m's data into m.data with an internal request; the lock
// is held.
func (t *Transport) ovFetch(m *ovMsg) {
	r := t.newRequest("prefetch", m.peer, m.tag, len(m.data))
	r.recv = true
	r.b = ucx.Buffer{Ptr: bytesPtr(m.data), Len: len(m.data)}
	r.ov = &ovRecv{id: m.id, wire: m.wire, fetch: m}
	ureq, err := t.w.TagMsgRecv(r.b, m.msg)
	m.msg = ucx.Message{}
	if err != nil {
		t.ovFetched(m, fmt.Errorf("transport: prefetch from rank %d tag %d: %w", m.peer, m.tag, err))
		return
	}
	t.track(r, ureq)
}

// ovFetched records the end of m's internal transfer and hands the data to
// the receive that matched it, if any; the lock is held.
func (t *Transport) ovFetched(m *ovMsg, err error) {
	m.done, m.err = true, err
	if m.mode == overlap.Prefetch {
		if err != nil {
			t.step(overlap.Event{Kind: overlap.PrefetchDropped, ID: m.id})
			m.mode, m.data, m.tracked = overlap.None, nil, false // slot given back: never read it
		} else {
			t.step(overlap.Event{Kind: overlap.TransferCompleted, ID: m.id})
		}
	}
	if m.r != nil {
		t.ovDeliver(m.r, m)
	}
}

// ovStart starts the UCX receive of r's probed header into r's buffer; the
// lock is held.
func (t *Transport) ovStart(r *Request) {
	if r.ov.cma != nil {
		t.ovCMAStart(r)
		return
	}
	r.ov.held, r.ov.started = false, true
	ureq, err := t.w.TagMsgRecv(r.b, r.ov.msg)
	r.ov.msg = ucx.Message{}
	t.step(overlap.Event{Kind: overlap.TransferStarted, ID: r.ov.id})
	if err != nil {
		t.step(overlap.Event{Kind: overlap.TransferCompleted, ID: r.ov.id})
		t.fail(r, fmt.Errorf("transport: recv from rank %d tag %d: %w", r.peer, r.tag, err))
		return
	}
	t.track(r, ureq)
}

// ovStartHeld starts every onloaded transfer; the lock is held.
func (t *Transport) ovStartHeld() {
	if len(t.ov.held) == 0 {
		return
	}
	held := t.ov.held
	t.ov.held = nil
	for _, r := range held {
		if r.ov.held {
			t.ovStart(r)
		}
	}
}

// ovRecv routes a receive through the engine once its sequence number is
// taken; it reports false when the receive should be posted to UCX as
// usual. The lock is held.
func (t *Transport) ovRecv(r *Request) bool {
	ov := t.ov
	wire := MakeUserTag(uint32(r.peer), uint16(r.tag), r.seq)
	if r.bufLen >= ov.thresh && ov.dirty {
		t.ovProbe()
	}
	// A small receive whose message is still in UCX's queue is matched by
	// UCX itself when it is posted there.
	m := ov.unexp[wire]
	if m != nil && m.r == nil && !m.descPending {
		r.ov = &ovRecv{id: m.id, wire: wire, m: m}
		if m.tracked {
			t.step(overlap.Event{Kind: overlap.RecvPosted, ID: m.id, Peer: r.peer, Tag: wire, Size: int64(r.bufLen)})
		}
		if m.mode == overlap.Onload && !m.eager {
			// Onloaded: the receiver starts it now, into its buffer (a CMA
			// message: the progress goroutine reads it, the call returns).
			delete(ov.unexp, wire)
			r.ov.msg, r.ov.m, r.ov.size = m.msg, nil, m.size
			if m.cma {
				d := m.desc
				r.ov.cma = &d
			}
			t.ovStart(r)
		} else {
			m.r = r
			if m.done {
				t.ovDeliver(r, m)
			}
		}
		t.ovStartHeld()
		return true
	}
	// A CMA message whose descriptor is still being received is no longer
	// in UCX: even a small receive waits for it in the table.
	if r.bufLen < ov.thresh && (m == nil || !m.descPending) {
		return false
	}
	ov.nextID++
	r.ov = &ovRecv{id: ov.nextID, wire: wire}
	t.step(overlap.Event{Kind: overlap.RecvPosted, ID: r.ov.id, Peer: r.peer, Tag: wire, Size: int64(r.bufLen)})
	ov.posted[wire] = r
	t.ovStartHeld()
	return true
}

// ovHas reports whether a message with this wire tag was taken off UCX's
// queue and waits for its receive; the lock is held.
func (t *Transport) ovHas(wire uint64) (*ovMsg, bool) {
	if t.ov == nil {
		return nil, false
	}
	m := t.ov.unexp[wire]
	return m, m != nil && m.r == nil && !m.descPending
}

// ovDeliver completes r from message m once m's data is in place: small
// copies at once, large ones by a goroutine outside the lock (the progress
// goroutine when the caller computes). The lock is held.
func (t *Transport) ovDeliver(r *Request, m *ovMsg) {
	if m.err != nil {
		delete(t.ov.unexp, m.wire)
		t.fail(r, m.err)
		return
	}
	if m.size < copyOffloadMin {
		ovCopy(r, m, 0, r.bufLen)
		t.ovDelivered(r, m)
		return
	}
	t.ov.copies = append(t.ov.copies, r)
	t.wake()
}

// ovTakeCopies hands the pending copies to the caller; the lock is held.
func (t *Transport) ovTakeCopies() []*Request {
	if t.ov == nil || len(t.ov.copies) == 0 {
		return nil
	}
	c := t.ov.copies
	t.ov.copies = nil
	return c
}

// ovRunCopies copies prefetched messages into their receives without the
// lock, except their first cmaDescSize bytes, which it copies under the
// lock before completing them (a descriptor of a later message may land
// there; see runCMAJobs).
func (t *Transport) ovRunCopies(rs []*Request) {
	for _, r := range rs {
		ovCopy(r, r.ov.m, cmaDescSize, r.bufLen)
	}
	t.mu.Lock()
	for _, r := range rs {
		ovCopy(r, r.ov.m, 0, cmaDescSize)
		t.ovDelivered(r, r.ov.m)
	}
	t.mu.Unlock()
}

// ovCopy copies bytes [lo, hi) of m's data into the same bytes of r's
// buffer (contiguous or IOV), within the buffer's length.
func ovCopy(r *Request, m *ovMsg, lo, hi int) {
	hi = min(hi, len(m.data), r.bufLen)
	if lo >= hi {
		return
	}
	src := m.data[lo:hi]
	if r.b.IOV == nil {
		copy(unsafe.Slice((*byte)(r.b.Ptr), r.b.Len)[lo:], src)
		return
	}
	off := 0 // position of entry i in the buffer
	for i := 0; i < r.b.IOV.Len() && len(src) > 0; i++ {
		p, n := r.b.IOV.Entry(i)
		if off+n <= lo {
			off += n
			continue
		}
		skip := max(lo-off, 0)
		k := copy(unsafe.Slice((*byte)(p), n)[skip:], src)
		src = src[k:]
		lo += k
		off += n
	}
}

// ovDelivered completes r after its copy and gives m's slot back; the lock
// is held.
func (t *Transport) ovDelivered(r *Request, m *ovMsg) {
	delete(t.ov.unexp, m.wire)
	if m.mode == overlap.Prefetch {
		t.step(overlap.Event{Kind: overlap.PrefetchConsumed, ID: m.id})
		m.mode = overlap.None
	}
	m.data = nil
	if r.fin.Load() { // failed meanwhile (closed)
		return
	}
	r.status = Status{Source: r.peer, Tag: r.tag, Size: m.size}
	if m.size > r.bufLen {
		r.err = &TruncatedError{Source: r.peer, Tag: r.tag, Size: m.size, BufLen: r.bufLen}
	}
	t.complete(r)
}

// ovFinish sees every completion of a request with overlap state before
// finish does; it reports true when it handled the completion entirely.
// The lock is held.
func (t *Transport) ovFinish(r *Request, st ucx.Status) bool {
	var err error
	if m := r.ov.fetch; m != nil {
		switch {
		case st == ucx.StatusOK:
		case st == ucx.StatusTruncated: // cannot happen: the buffer is the message's size
			err = fmt.Errorf("transport: prefetch from rank %d tag %d: %w", m.peer, m.tag, &ucx.Error{Op: "ucp_tag_msg_recv_nbx", Status: st})
		default:
			if p := t.peers[m.peer]; p != nil && p.lost != nil {
				err = &PeerLostError{Rank: m.peer, Op: "recv", Reason: p.lost.Reason}
			} else {
				err = fmt.Errorf("transport: prefetch from rank %d tag %d: %w", m.peer, m.tag, &ucx.Error{Op: "ucp_tag_msg_recv_nbx", Status: st})
			}
		}
	}
	return t.ovTransferDone(r, err)
}

// ovTransferDone records the end of r's transfer (a UCX receive or a CMA
// read) for the engine; it reports true when r was an internal prefetch,
// which it has then completed, handing err to the prefetched message.
func (t *Transport) ovTransferDone(r *Request, err error) bool {
	if m := r.ov.fetch; m != nil {
		t.complete(r)
		t.ovFetched(m, err)
		return true
	}
	if r.ov.started {
		r.ov.started = false
		t.step(overlap.Event{Kind: overlap.TransferCompleted, ID: r.ov.id})
	}
	return false
}

// ovCancel cancels a receive the engine holds (posted or onloaded, not yet
// started); it reports false when UCX owns the receive, or it can no longer
// be cancelled (it then completes normally). The lock is held.
func (t *Transport) ovCancel(r *Request, err error) bool {
	if r.fin.Load() {
		return true
	}
	ov := t.ov
	switch {
	case ov.posted[r.ov.wire] == r:
		delete(ov.posted, r.ov.wire)
	case r.ov.held && r.ov.cma != nil:
		r.ov.held = false
		t.step(overlap.Event{Kind: overlap.RecvCancelled, ID: r.ov.id})
		t.freeSeq(r)
		t.fail(r, err)
		t.ovCMAGiveBack(r)
		return true
	case r.ov.held:
		// Give the header back as an unexpected message for the next
		// receive with this sequence number.
		r.ov.held = false
		msg := r.ov.msg
		r.ov.msg = ucx.Message{}
		t.step(overlap.Event{Kind: overlap.RecvCancelled, ID: r.ov.id})
		t.freeSeq(r)
		t.fail(r, err)
		src, utag, _ := SplitUserTag(r.ov.wire)
		t.ovUnexpected(msg, r.ov.wire, int(src), int(utag), r.ov.size)
		return true
	default:
		return true
	}
	t.step(overlap.Event{Kind: overlap.RecvCancelled, ID: r.ov.id})
	t.freeSeq(r)
	t.fail(r, err)
	return true
}

// ovPeerLost fails the engine's receives waiting for rank's messages; the
// lock is held.
func (t *Transport) ovPeerLost(rank int, reason string) {
	ov := t.ov
	for wire, r := range ov.posted {
		if r.peer == rank {
			delete(ov.posted, wire)
			t.step(overlap.Event{Kind: overlap.RecvCancelled, ID: r.ov.id})
			t.fail(r, &PeerLostError{Rank: rank, Op: r.op, Reason: reason})
		}
	}
	for _, r := range ov.held {
		if r.ov.held && r.peer == rank {
			// Its data is still at the dead sender: receiving it fails.
			t.ovStart(r)
		}
	}
}

// ovClose fails everything the engine holds; the lock is held.
func (t *Transport) ovClose() {
	ov := t.ov
	closed := func(r *Request) error { return fmt.Errorf("transport: %s rank %d: %w", r.op, r.peer, ErrClosed) }
	for wire, r := range ov.posted {
		delete(ov.posted, wire)
		t.fail(r, closed(r))
	}
	for _, r := range ov.held {
		if r.ov.held {
			r.ov.held = false
			t.fail(r, closed(r))
		}
	}
	ov.held = nil
	for _, m := range ov.unexp {
		if m.r != nil && !m.r.fin.Load() {
			t.fail(m.r, closed(m.r))
		}
	}
	ov.copies = nil
}

// OverlapStats returns the rendezvous policy's counters; ok is false when
// the transport runs without one.
func (t *Transport) OverlapStats() (s overlap.Stats, ok bool) {
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.ov == nil {
		return overlap.Stats{}, false
	}
	return t.ov.pol.Stats(), true
}

// OverlapTable describes what the transport side of the engine holds now:
// receives waiting for their header, onloaded headers, and messages taken
// before their receive (prefetched, eager or onloaded). For tests and
// diagnostics; all zero without a policy.
type OverlapTable struct {
	Posted, Held, Unexpected, Copies int
	PolicyErrors                     uint64
}

// OverlapTable returns the current sizes of the engine's tables.
func (t *Transport) OverlapTable() OverlapTable {
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.ov == nil {
		return OverlapTable{}
	}
	return OverlapTable{Posted: len(t.ov.posted), Held: len(t.ov.held), Unexpected: len(t.ov.unexp),
		Copies: len(t.ov.copies), PolicyErrors: t.ov.errs}
}
