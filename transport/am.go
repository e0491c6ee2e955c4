package transport

import (
	"bytes"
	"fmt"
	"time"

	"go.uber.org/zap"

	"github.com/troupe-hpc/troupe/transport/ucx"
)

// AMHandler handles an active message. It runs on whichever goroutine
// progressed the worker (the progress goroutine, or a waiter), one message
// at a time and in arrival order, without the worker lock: it may call the
// transport to start operations (sends, receives, PostAM, RecvData), but
// not wait for one (Wait, Recv, Send, Probe, WaitAny, Await...): nothing
// would progress the worker meanwhile, so such a wait fails at once with
// ErrInHandler; hand the waiting to another goroutine. The message's
// header and eager data are valid only until the handler returns, unless
// it calls Keep.
type AMHandler func(m *AMMessage)

// AMMessage is an arrived active message.
type AMMessage struct {
	t        *Transport
	ev       ucx.Event
	kept     bool
	consumed bool
	// Header is the message header.
	Header []byte
	// Size is the data length in bytes.
	Size int
	// Rendezvous reports that the data has not moved yet: fetch it with RecvData.
	Rendezvous bool

	cma *cmaAM   // the data stays in the sender's memory (cma.go)
	id  uint16   // the handler's id
	ov  *amTrack // the overlap engine's record (Plan)
	// bundled: the message came in a bundle (coalesce.go); its header and
	// data point into the bundle, which is released with its batch, or
	// into copies once kept. ev is then the zero Event.
	bundled bool
	data    []byte
}

// Data returns eager data (nil for rendezvous messages).
func (m *AMMessage) Data() []byte {
	if m.bundled {
		return m.data
	}
	if m.cma != nil {
		return nil
	}
	return m.ev.AMData()
}

// Keep keeps the message (header and data) valid after the handler returns;
// the caller must then call RecvData or Release exactly once.
func (m *AMMessage) Keep() {
	if m.bundled && !m.kept {
		// The bundle is released once its last message is handled.
		m.Header, m.data = bytes.Clone(m.Header), bytes.Clone(m.data)
	}
	m.kept = true
}

// amRecvOp is the op of RecvData's requests.
const amRecvOp = "am-recv"

// RecvData moves the message's data into dst: for rendezvous messages the
// data is fetched straight into dst (zero copy); eager data is copied. The
// returned request completes when dst holds the data. dst must be exactly
// Size bytes long.
func (m *AMMessage) RecvData(dst []byte) (*Request, error) {
	if m.consumed {
		return nil, fmt.Errorf("%w: active message data already received or released", ErrInvalid)
	}
	if len(dst) != m.Size {
		return nil, fmt.Errorf("%w: active message of %d bytes into a buffer of %d", ErrInvalid, m.Size, len(dst))
	}
	m.consumed = true
	t := m.t
	r := t.newRequest(amRecvOp, -1, 0, len(dst))
	if m.ov != nil {
		t.mu.Lock()
		t.amStarted(m.ov)
		r.amov = m.ov
		t.mu.Unlock()
	}
	if m.cma != nil {
		t.cmaRecvAM(m, r, dst)
		return r, nil
	}
	if !m.Rendezvous {
		copy(dst, m.Data())
		t.mu.Lock()
		if t.w != nil {
			m.ev.ReleaseData(t.w)
		}
		m.ev.FreeHeader()
		t.complete(r)
		t.mu.Unlock()
		return r, nil
	}
	ev := m.ev
	t.exec(func() {
		defer ev.FreeHeader()
		if t.closed {
			if t.w != nil { // Close destroys the worker, and its descriptors with it
				t.w.AMDataRelease(ev.AMDescriptor())
			}
			t.fail(r, fmt.Errorf("transport: %s: %w", amRecvOp, ErrClosed))
			return
		}
		ureq, n, err := t.w.AMRecvData(ev.AMDescriptor(), ucx.Buffer{Ptr: bytesPtr(dst), Len: len(dst)})
		r.status.Size = n
		t.settle(r, ureq, err, bytesPtr(dst))
	})
	return r, nil
}

// Release drops the message without receiving its data.
func (m *AMMessage) Release() {
	if m.consumed {
		return
	}
	m.consumed = true
	t := m.t
	t.mu.Lock()
	defer t.mu.Unlock()
	if m.ov != nil {
		t.amDropped(m.ov)
	}
	if m.cma != nil && !t.closed {
		t.cmaAck(m.cma.from, m.cma.d.word, 0) // dropped: the sender may go on
	}
	if t.w != nil {
		if m.Rendezvous && m.cma == nil {
			t.w.AMDataRelease(m.ev.AMDescriptor())
		} else {
			m.ev.ReleaseData(t.w)
		}
	}
	m.ev.FreeHeader()
}

// Active-message ids ReservedAMLow to ReservedAMHigh are the transport's
// own (CMA acknowledgements and data, bundles of posted messages, window
// set retirements): SetAMHandler, SendAM and PostAM refuse them.
const (
	ReservedAMLow  uint16 = 0x30
	ReservedAMHigh uint16 = 0x3f
)

// checkAMID refuses the transport's reserved ids to the API.
func checkAMID(id uint16, op string) error {
	if id >= ReservedAMLow && id <= ReservedAMHigh {
		return fmt.Errorf("%w: %s: active-message id %#x is reserved for the transport (%#x-%#x)", ErrInvalid, op, id, ReservedAMLow, ReservedAMHigh)
	}
	return nil
}

// SetAMHandler installs h for active messages with id. Install handlers
// before peers may send them: a message without a handler is dropped by UCX.
func (t *Transport) SetAMHandler(id uint16, h AMHandler) error {
	if err := checkAMID(id, "set-am-handler"); err != nil {
		return err
	}
	return t.setAMHandler(id, amHandler{h: h})
}

// SetInlineAMHandler is SetAMHandler for a handler that is quick, never
// blocks and takes no lock a sending goroutine may hold while it sends: it
// may also run on a goroutine inside PostAM (when nothing but such
// messages waits for delivery), sparing the progress goroutine a wake-up.
// The actor runtime's credit messages are handled this way.
func (t *Transport) SetInlineAMHandler(id uint16, h AMHandler) error {
	if err := checkAMID(id, "set-am-handler"); err != nil {
		return err
	}
	return t.setAMHandler(id, amHandler{h: h, inline: true})
}

// amHandler is an installed handler.
type amHandler struct {
	h      AMHandler
	inline bool // may run inside PostAM (SetInlineAMHandler)
}

func (t *Transport) setAMHandler(id uint16, h amHandler) error {
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.closed {
		return ErrClosed
	}
	old := *t.amh.Load()
	if _, ok := old[id]; !ok {
		if err := t.w.SetAMHandler(id); err != nil {
			return fmt.Errorf("transport: %w", err)
		}
	}
	// Handlers are read on every message without a lock: the map is
	// replaced, never changed.
	m := make(map[uint16]amHandler, len(old)+1)
	for k, v := range old {
		m[k] = v
	}
	m[id] = h
	t.amh.Store(&m)
	return nil
}

// AM send modes.
const (
	AMAuto  uint32 = 0               // UCX picks eager or rendezvous by size
	AMEager uint32 = ucx.AMSendEager // force eager
	AMRndv  uint32 = ucx.AMSendRndv  // force rendezvous
	// AMPull, added to AMAuto or AMRndv, asks that the data of a send of
	// PullMin bytes or more to a process of this host be read by the
	// receiver (CMA, cma.go) whatever Options.CMAThreshold says, so that
	// it moves while this rank computes: UCX's rendezvous over shared
	// memory waits for the sender's progress once the receiver asks for
	// the data (docs/transport.md, "Receiver-driven actor messages").
	// TROUPE_CMA=off still turns CMA off.
	AMPull uint32 = 1 << 31
)

// PullMin is the smallest data size AMPull reads by CMA: sizes below go
// eager, copied as they are sent.
const PullMin = MaxPostAM

// SendAM starts sending an active message with header and data to dst.
// Neither may be modified until the request completes. The header must be
// at most MaxAMHeader bytes long.
func (t *Transport) SendAM(dst int, id uint16, header, data []byte, mode uint32) (*Request, error) {
	if err := checkAMID(id, "am-send"); err != nil {
		return nil, err
	}
	return t.sendAM(dst, id, header, data, mode)
}

// MaxAMHeader is the longest header SendAM and PostAM take: the worker's
// limit as UCX reports it (about 8 KiB over shared memory and TCP with UCX
// 1.13). Put longer data in the message's data part.
func (t *Transport) MaxAMHeader() int { return t.maxAMHeader }

// checkAMHeader refuses a header longer than MaxAMHeader: UCX aborts the
// process on one rather than failing the send.
func (t *Transport) checkAMHeader(dst int, header []byte) error {
	if len(header) > t.maxAMHeader {
		return fmt.Errorf("%w: am-send rank %d: a header of %d bytes exceeds the worker's %d", ErrInvalid, dst, len(header), t.maxAMHeader)
	}
	return nil
}

// sendAM is SendAM for any id, the transport's own included.
func (t *Transport) sendAM(dst int, id uint16, header, data []byte, mode uint32) (*Request, error) {
	if err := t.checkRank(dst, "am-send"); err != nil {
		return nil, err
	}
	if err := t.checkAMHeader(dst, header); err != nil {
		return nil, err
	}
	pull := mode&AMPull != 0
	mode &^= AMPull
	r := t.newRequest("am-send", dst, int(id), len(header)+len(data))
	r.eager = mode == AMEager
	if mode != AMEager && t.useCMA(dst, len(data), pull) {
		r.b = ucx.Buffer{Ptr: bytesPtr(data), Len: len(data)}
		t.exec(func() { t.startCMAAM(r, id, header) })
		return r, nil
	}
	t.exec(func() {
		p, err := t.peerLocked(dst, "am-send")
		if err != nil {
			t.fail(r, err)
			return
		}
		t.bundleFlush(dst) // posts before this send leave before it
		ureq, err := t.w.AMSend(p.ep, id, header, ucx.Buffer{Ptr: bytesPtr(data), Len: len(data)}, mode)
		t.settle(r, ureq, err, bytesPtr(header), bytesPtr(data))
	})
	return r, nil
}

// MaxPostAM is the largest header plus data PostAM takes: it copies them.
const MaxPostAM = 16 << 10

// postMode is how PostAM sends: eager. UCX's own choice (AMAuto) turns to
// its rendezvous above one shared-memory segment (8 KiB), whose data moves
// only while the sender progresses, and gains nothing here, where the data
// is a copy already: a 10 KiB actor round trip took 117-127 us that way and
// 11-15 us eager, and a flood of them ran at 38-79 thousand messages a
// second against 108-157 thousand eager (docs/transport.md, "Posted
// messages go eager").
const postMode = AMEager

// PostAM sends an active message with header and data to dst, eagerly
// (postMode), without a request: header and data are copied before PostAM
// returns, so the caller may reuse them at once, and nothing reports the
// send's completion. An error that UCX reports at once (the
// peer is lost, the transport closed) is returned; one that comes later is
// only counted (PostFailed). Sends from one goroutine to one rank,
// by PostAM and SendAM alike, leave in call order. len(header)+len(data)
// must be at most MaxPostAM, and len(header) at most MaxAMHeader.
//
// When UCX has to queue the send (the peer's receive queue is full: it is
// not keeping up), PostAM progresses the worker once itself, and the
// progress goroutine stands aside while sends keep coming that way: the
// queue moves on the sender's own thread instead of a second spinning one
// (docs/actor.md, Measurements). PostAM never runs handlers: what arrived
// meanwhile is left to the progress goroutine.
func (t *Transport) PostAM(dst int, id uint16, header, data []byte) error {
	if err := checkAMID(id, "am-send"); err != nil {
		return err
	}
	if err := t.checkRank(dst, "am-send"); err != nil {
		return err
	}
	if len(header)+len(data) > MaxPostAM {
		return fmt.Errorf("%w: am-send of %d bytes exceeds PostAM's %d", ErrInvalid, len(header)+len(data), MaxPostAM)
	}
	if err := t.checkAMHeader(dst, header); err != nil {
		return err
	}
	if t.opts.Progress == ProgressQueue {
		// Calls run on the progress goroutine in submission order: this one
		// must queue behind them too. What is known to fail now fails now.
		t.mu.Lock()
		var err error
		if t.closed {
			err = fmt.Errorf("transport: am-send rank %d: %w", dst, ErrClosed)
		} else if p := t.peers[dst]; p != nil && p.lost != nil {
			err = &PeerLostError{Rank: dst, Op: "am-send", Reason: p.lost.Reason}
		}
		t.mu.Unlock()
		if err != nil {
			return err
		}
		r, err := t.sendAM(dst, id, bytes.Clone(header), bytes.Clone(data), postMode)
		if err != nil {
			return err
		}
		if done, err := r.Finished(); done {
			return err
		}
		return nil
	}
	t.callers.Add(1)
	t.mu.Lock()
	t.callers.Add(-1)
	p, err := t.peerLocked(dst, "am-send")
	wakeLoop := false
	if err == nil {
		var done bool
		var perr error
		if t.canCoalesce(p, len(header)+len(data)) {
			// Earlier posts still wait for the peer: join its bundle
			// (coalesce.go). Progress only if the bundle, full, went out
			// into UCX's queue.
			var queued bool
			started := p.bundled == 0
			queued, perr = t.bundleAdd(p, id, header, data)
			done = !queued
			// The progress goroutine must come to send it: kick it even
			// when it looks awake, since one between its last look at
			// the bundles and going to sleep would otherwise sleep through
			// (up to idleWaitMax) with this bundle waiting.
			wakeLoop = started
		} else {
			t.bundleFlush(dst) // a larger post leaves after the bundle
			done, perr = t.w.AMPost(p.ep, id, header, data, postMode)
		}
		if perr == nil {
			t.traffic.amPosted(len(header) + len(data))
		}
		switch {
		case perr != nil:
			err = fmt.Errorf("transport: am-send rank %d: %w", dst, perr)
		case !done:
			t.postsQueued.Add(1)
			switch t.postProgress() {
			case postWake:
				t.mu.Unlock()
				t.wake()
				return nil
			case postInline:
				t.mu.Unlock()
				t.deliverInline()
				return nil
			}
		}
	}
	handOff := t.ov != nil && (len(t.cma.jobs) > 0 || len(t.amq) > 0)
	t.mu.Unlock()
	if handOff || wakeLoop {
		t.wake()
	}
	return err
}

// PostFailed is the number of PostAM sends that failed after PostAM had
// returned (a peer lost with messages still queued to it, say).
func (t *Transport) PostFailed() uint64 {
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.w == nil {
		return t.postFailed + t.bundleFailed
	}
	return t.w.PostFailed() + t.bundleFailed
}

// asidePosting is how long the progress goroutine stands aside after a
// PostAM found the peer's queue full and progressed the worker itself.
const asidePosting = 50 * time.Microsecond

// posting reports whether a PostAM progressed the worker within
// asidePosting.
func (t *Transport) posting() bool {
	at := t.postPendingAt.Load()
	return at != 0 && time.Now().UnixNano()-at < int64(asidePosting)
}

// What postProgress leaves to do once the worker lock is released.
const (
	postDone   = iota // nothing
	postWake          // wake the progress goroutine: work only it may do
	postInline        // deliver the active messages that arrived, all inline handlers'
)

// postProgress runs when UCX queued a posted send (the peer is not keeping
// up): only progress moves the queue, and the posting goroutine is here
// with the worker lock, so it progresses the worker once and, while sends
// keep coming this way, the progress goroutine stands aside (posting).
// Completions are handled here. Active messages for inline handlers are
// delivered by the caller (postInline); anything else that must run
// outside the lock (other active messages, which may run any handler, CMA
// jobs, a parked Probe, the overlap engine's work) is left to the progress
// goroutine, which is then not asked to stand aside (postWake). The worker
// lock is held.
func (t *Transport) postProgress() int {
	evs, progressed := t.w.Progress()
	handled := len(evs) > 0
	for len(evs) > 0 {
		t.handle(evs)
		evs = t.w.Drain()
	}
	if len(t.bundling) > 0 {
		t.bundlesFlush(false)
	}
	t.postsInFlight.Store(int64(t.w.PostsInFlight()))
	if progressed || handled {
		// Something may have arrived: this pass, not the progress
		// goroutine's next one, is the one that saw it.
		t.noteArrivals()
	}
	if len(t.cma.jobs) > 0 || t.ov != nil || (len(t.amq) > 0 && !t.amqInline()) {
		t.postPendingAt.Store(0)
		return postWake
	}
	t.postPendingAt.Store(time.Now().UnixNano())
	if len(t.amq) > 0 {
		return postInline
	}
	return postDone
}

// amqInline reports whether every queued active message has an inline
// handler; the worker lock is held.
func (t *Transport) amqInline() bool {
	hs := *t.amh.Load()
	for i := range t.amq {
		if id := t.amq[i].AMID(); id == amCMAData || !hs[id].inline {
			return false
		}
	}
	return true
}

// deliverInline delivers the queued active messages on the calling
// goroutine if they all have inline handlers and no delivery is under way
// (which would deliver them, in order); else it leaves them to the
// progress goroutine.
func (t *Transport) deliverInline() {
	if !t.amMu.TryLock() {
		t.wake()
		return
	}
	defer t.amMu.Unlock()
	t.mu.Lock()
	if !t.amqInline() {
		t.mu.Unlock()
		t.wake()
		return
	}
	q := t.amq
	t.amq = t.amSpare[:0]
	t.amSpare = nil
	t.mu.Unlock()
	t.inlineDelivered.Add(int64(len(q)))
	t.deliverBatch(q)
}

// deliverAM runs handlers for queued active messages, in arrival order.
// What the handlers leave behind (header copies, eager data) is released in
// one call per batch, under one worker lock, rather than one per message.
func (t *Transport) deliverAM() {
	t.amMu.Lock()
	defer t.amMu.Unlock()
	for {
		t.mu.Lock()
		q := t.amq
		t.amq = t.amSpare[:0]
		t.amSpare = nil
		t.mu.Unlock()
		if len(q) == 0 {
			t.amSpare = q
			return
		}
		t.deliverBatch(q)
	}
}

// deliverBatch runs the handlers of the messages taken from amq, then
// releases what they left and keeps q's memory as amq's spare; amMu is
// held.
func (t *Transport) deliverBatch(q []ucx.Event) {
	done := q[:0] // the events handled and left for release, in place
	t.handling.Store(true)
	for i := range q {
		if t.deliverOne(&q[i]) {
			done = append(done, q[i])
		}
	}
	t.handling.Store(false)
	t.mu.Lock()
	if t.w != nil {
		t.w.AMRelease(done)
	}
	if t.amSpare == nil {
		t.amSpare = q[:0]
	}
	t.mu.Unlock()
}

// deliverOne runs the handler of one active message. It reports whether the
// message was left untouched (not kept, its data neither received nor
// released) for deliverAM to release with the rest of its batch; it
// releases a CMA message itself, which owes its sender an acknowledgement.
func (t *Transport) deliverOne(ev *ucx.Event) bool {
	if ev.AMID() == amBundle {
		// Its messages are delivered one by one; the bundle is released
		// with the batch. (A CMA descriptor naming amBundle is no bundle:
		// it goes below, to the placeholder handler, and is released.)
		t.deliverBundle(ev)
		return true
	}
	// One AMMessage serves every message whose handler neither keeps it nor
	// plans it with the overlap engine (amMu is held): handlers may not use
	// it after they return.
	m := t.amMsg
	if m == nil {
		m = new(AMMessage)
	}
	*m = AMMessage{t: t, ev: *ev, Header: ev.AMHeader(), Size: ev.Length(), Rendezvous: ev.AMRendezvous()}
	id := ev.AMID()
	if id == amCMAData {
		c, err := t.decodeCMAAM(ev.AMData())
		if err != nil {
			t.log.Warn("malformed CMA active message dropped", zap.Error(err))
			t.mu.Lock()
			if t.w != nil { // else Close released it with the worker
				ev.Discard(t.w)
			}
			t.mu.Unlock()
			return false
		}
		m.cma, m.Size, m.Rendezvous, id = c, int(c.d.n), true, c.amID
	}
	m.id = id
	t.traffic.amDelivered(1, len(m.Header)+m.Size)
	if h := (*t.amh.Load())[id].h; h != nil {
		h(m)
	}
	if m.kept || m.ov != nil {
		// Kept, or planned with the overlap engine (the runtime claims it
		// later): the message lives on.
		t.amMsg = nil
	} else {
		t.amMsg = m
	}
	if m.kept {
		return false
	}
	if m.consumed || m.cma != nil || m.ov != nil {
		m.Release()
		return false
	}
	m.consumed = true
	return true
}
