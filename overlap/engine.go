package overlap

import (
	"errors"
	"fmt"
	"time"
)

// Errors returned by Step, wrapped with the event's kind and id. A Step that
// returns an error leaves the engine as it was, except that time advances.
var (
	ErrUnknownEvent    = errors.New("overlap: unknown event kind")
	ErrUnknownTransfer = errors.New("overlap: unknown transfer id")
	ErrDuplicate       = errors.New("overlap: duplicate event for transfer")
	ErrOrder           = errors.New("overlap: event out of order for transfer")
)

// transfer is the engine's record of one message on this rank.
type transfer struct {
	peer     int
	size     int64 // message size once the header arrived, else buffer size
	posted   bool
	postAt   time.Duration
	header   bool
	headerAt time.Duration
	expected bool   // header arrived after the receive was posted
	mode     Action // None until decided; Offload/Onload/Prefetch
	rndv     bool   // counted in the outstanding set (K)
	kbytes   int64  // its bytes in K (size, at most maxKBytes)
	started  bool
	complete bool
	slot     int
	inPlace  bool // unexpected, and a prefetch lands in its destination
	// revisit: an expected transfer onloaded at its header with a
	// Decision.Revisit; its mode is not final (not counted yet) until it
	// starts, is cancelled, or a Revisit offloads it. seenAt is the time
	// from which the receiver's activity says it is back: the header's
	// arrival, or the last Revisit that found it back.
	revisit bool
	seenAt  time.Duration
}

// peerState is what the engine learns about one sending peer.
type peerState struct {
	delta    float64 // EWMA of delta in ns
	hasDelta bool
	hist     []bool // ring of recent prefetch outcomes (true = useful)
	next     int
	n        int
	useful   int
}

func (p *peerState) record(useful bool, window int) {
	if p.hist == nil {
		p.hist = make([]bool, window)
	}
	if p.n == window {
		if p.hist[p.next] {
			p.useful--
		}
	} else {
		p.n++
	}
	p.hist[p.next] = useful
	if useful {
		p.useful++
	}
	p.next = (p.next + 1) % window
}

// shadowDelta is an offloaded expected transfer waiting for the receiver's
// next activity, which tells what its onload delay would have been.
type shadowDelta struct {
	peer     int
	postAt   time.Duration
	headerAt time.Duration
}

// maxShadows bounds the shadow-delta list for a receiver that stays away.
const maxShadows = 64

// Engine is the overlap decision state machine. Create it with New and feed
// it events with Step; it is not safe for concurrent use.
type Engine struct {
	cfg Config
	now time.Duration

	// cancellation throttle, per period
	period         int64
	periodOffloads int
	periodCancels  int
	throttled      bool

	// receiver activity and delta
	lastActivity   time.Duration
	hasActivity    bool
	globalDelta    float64
	hasGlobalDelta bool

	// outstanding rendezvous transfers (for K)
	outstanding      int
	outstandingBytes int64
	// pending: expected transfers onloaded with a revisit, not yet counted
	pending int

	// shadows are offloaded expected transfers whose onload delay is
	// still unknown: it is sampled at the receiver's next activity.
	shadows []shadowDelta

	transfers map[TransferID]*transfer
	peers     map[int]*peerState
	pool      pool
	stats     Stats
}

// New returns an engine for cfg, or the validation error.
func New(cfg Config) (*Engine, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	return &Engine{
		cfg:       cfg,
		transfers: make(map[TransferID]*transfer),
		peers:     make(map[int]*peerState),
		pool:      newPool(cfg.PoolSlots),
	}, nil
}

// Config returns the engine's configuration.
func (e *Engine) Config() Config { return e.cfg }

// Now returns the latest event time the engine has seen.
func (e *Engine) Now() time.Duration { return e.now }

// K returns the current K: the sum over outstanding rendezvous transfers
// of alpha*size + beta.
func (e *Engine) K() time.Duration { return time.Duration(e.k()) }

// Delta returns the smoothed delta (receive posted -> transfer start) for
// peer, falling back to the rank-wide average; ok is false before any
// sample.
func (e *Engine) Delta(peer int) (d time.Duration, ok bool) {
	v, ok := e.deltaEstimate(peer)
	return time.Duration(v), ok
}

// SetCost replaces alpha (ns per byte) and beta (per message), typically
// with the result of Calibrate measured after the engine was created. It
// rejects the values Config.Validate would.
func (e *Engine) SetCost(alpha float64, beta time.Duration) error {
	c := e.cfg
	c.Alpha, c.Beta = alpha, beta
	if err := c.Validate(); err != nil {
		return err
	}
	e.cfg = c
	return nil
}

// Stats returns a snapshot of the counters.
func (e *Engine) Stats() Stats {
	s := e.stats
	s.Throttled = e.throttled
	s.PoolSlots = e.cfg.PoolSlots
	s.PoolInUse = e.pool.inUse
	s.PoolHighWater = e.pool.highWater
	s.Outstanding = e.outstanding
	s.OnloadPending = e.pending
	s.K = e.k()
	s.Tracked = len(e.transfers)
	return s
}

// Step feeds one event to the engine and returns its decision. Events that
// decide nothing return a Decision with Action None.
func (e *Engine) Step(ev Event) (Decision, error) {
	e.advance(ev.At)
	var (
		d   Decision
		err error
	)
	switch ev.Kind {
	case RecvPosted:
		d, err = e.recvPosted(ev)
	case HeaderArrived:
		d, err = e.headerArrived(ev)
	case TransferStarted:
		err = e.transferStarted(ev)
	case TransferCompleted:
		err = e.transferCompleted(ev)
	case RecvCancelled:
		err = e.recvCancelled(ev)
	case Progress:
		e.activity()
	case Tick:
	case PrefetchConsumed:
		err = e.prefetchConsumed(ev)
	case PrefetchDropped:
		err = e.prefetchDropped(ev)
	case OnloadDropped:
		err = e.onloadDropped(ev)
	case Revisit:
		d, err = e.revisit(ev)
	default:
		return none(ev.ID), fmt.Errorf("%w: %d", ErrUnknownEvent, ev.Kind)
	}
	if err != nil {
		return none(ev.ID), fmt.Errorf("%w (%v id=%d)", err, ev.Kind, ev.ID)
	}
	if d.Action == None {
		d = none(ev.ID)
	}
	return d, nil
}

func none(id TransferID) Decision { return Decision{Action: None, ID: id, Slot: NoSlot} }

func decide(id TransferID, a Action, r Reason) Decision {
	return Decision{Action: a, ID: id, Slot: NoSlot, Reason: r}
}

// advance moves the clock (never backwards) and rolls the period.
func (e *Engine) advance(at time.Duration) {
	if at > e.now {
		e.now = at
	}
	p := int64(e.now / e.cfg.Period)
	if p > e.period {
		e.stats.Periods += uint64(p - e.period)
		e.period = p
		e.periodOffloads, e.periodCancels = 0, 0
		e.throttled = false
	}
}

func (e *Engine) activity() {
	e.lastActivity = e.now
	e.hasActivity = true
	// The receiver is back: an onload of the offloaded transfers whose
	// header arrived before now would have started now.
	kept := e.shadows[:0]
	for _, s := range e.shadows {
		if s.headerAt < e.now {
			e.sampleDelta(s.peer, e.now-s.postAt)
			e.stats.ShadowDeltas++
		} else {
			kept = append(kept, s)
		}
	}
	e.shadows = kept
}

func (e *Engine) k() float64 {
	return e.cfg.Alpha*float64(e.outstandingBytes) + float64(e.cfg.Beta)*float64(e.outstanding)
}

func (e *Engine) peer(p int) *peerState {
	ps := e.peers[p]
	if ps == nil {
		ps = &peerState{}
		e.peers[p] = ps
	}
	return ps
}

func (e *Engine) deltaEstimate(peer int) (float64, bool) {
	if ps := e.peers[peer]; peer != AnyPeer && ps != nil && ps.hasDelta {
		return ps.delta, true
	}
	return e.globalDelta, e.hasGlobalDelta
}

func ewma(old float64, has bool, sample, w float64) float64 {
	if !has {
		return sample
	}
	return old + w*(sample-old)
}

func (e *Engine) sampleDelta(peer int, d time.Duration) {
	if !e.cfg.Enabled {
		return // engine off: nothing is learned
	}
	s := float64(d)
	w := e.cfg.DeltaWeight
	e.globalDelta = ewma(e.globalDelta, e.hasGlobalDelta, s, w)
	e.hasGlobalDelta = true
	if peer != AnyPeer {
		ps := e.peer(peer)
		ps.delta = ewma(ps.delta, ps.hasDelta, s, w)
		ps.hasDelta = true
	}
}

// maxKBytes caps one transfer's bytes in the sum behind K, so that sizes
// from a corrupt header cannot overflow it (2^40 B costs seconds at any
// calibrated alpha: far above every delta the rule compares K with).
const maxKBytes = 1 << 40

func (e *Engine) addOutstanding(t *transfer) {
	t.rndv = true
	t.kbytes = min(t.size, maxKBytes)
	e.outstanding++
	e.outstandingBytes += t.kbytes
}

func (e *Engine) removeOutstanding(t *transfer) {
	if t.rndv {
		t.rndv = false
		e.outstanding--
		e.outstandingBytes -= t.kbytes
	}
}

// prefetchAllowed applies the per-peer history rule.
func (e *Engine) prefetchAllowed(peer int) bool {
	ps := e.peers[peer]
	if ps == nil || ps.n == 0 || ps.n < e.cfg.PrefetchMinSamples {
		return true
	}
	return float64(ps.useful) >= e.cfg.PrefetchUsefulRatio*float64(ps.n)
}

// learnPrefetch records a (real or shadow) prefetch outcome in the peer's
// history, except for in-place transfers: their prefetch costs no copy, so
// their outcome says nothing about the copies the rule avoids.
func (e *Engine) learnPrefetch(t *transfer, useful bool) {
	if !t.inPlace {
		e.recordPrefetch(t.peer, useful)
	}
}

func (e *Engine) recordPrefetch(peer int, useful bool) {
	e.peer(peer).record(useful, e.cfg.PrefetchWindow)
}

func (e *Engine) offload(t *transfer) {
	t.mode = Offload
	e.stats.Offloaded++
	e.periodOffloads++
	// Cancels seen before the period had CancelMinOffloads offloads were
	// not judged then: judge them now.
	e.checkThrottle()
}

func (e *Engine) onload(t *transfer, r Reason) {
	t.mode = Onload
	e.countOnload(r)
}

func (e *Engine) countOnload(r Reason) {
	e.stats.Onloaded++
	switch r {
	case ReasonDisabled:
		e.stats.OnloadDisabled++
	case ReasonDelayBelowK:
		e.stats.OnloadDelayBelowK++
	case ReasonThrottled:
		e.stats.OnloadThrottled++
	case ReasonTooLarge:
		e.stats.OnloadTooLarge++
	case ReasonPeerHistory:
		e.stats.OnloadPeerHistory++
	case ReasonPoolFull:
		e.stats.OnloadPoolFull++
	}
}

func (e *Engine) recvPosted(ev Event) (Decision, error) {
	t, ok := e.transfers[ev.ID]
	if ok {
		return e.matchUnexpected(ev, t)
	}
	e.activity()
	t = &transfer{peer: ev.Peer, size: ev.Size, posted: true, postAt: e.now, slot: NoSlot}
	e.transfers[ev.ID] = t
	switch {
	case !e.cfg.Enabled:
		return decide(ev.ID, Onload, ReasonDisabled), nil
	case ev.Size < e.cfg.RendezvousThreshold:
		return decide(ev.ID, Onload, ReasonEager), nil
	case e.throttled:
		return decide(ev.ID, Onload, ReasonThrottled), nil
	}
	// Arm at post time only on history: the receiver is in the library
	// now, so the only evidence of a long delay is past deltas.
	est, ok := e.deltaEstimate(ev.Peer)
	if ok && est > e.cfg.OffloadRatio*(e.k()+e.cfg.cost(ev.Size)) {
		e.offload(t)
		return decide(ev.ID, Offload, ReasonDelayAboveK), nil
	}
	return decide(ev.ID, Onload, ReasonDelayBelowK), nil
}

// matchUnexpected handles the RecvPosted that matches a header that
// arrived first.
func (e *Engine) matchUnexpected(ev Event, t *transfer) (Decision, error) {
	if t.posted {
		return Decision{}, ErrDuplicate
	}
	e.activity()
	t.posted, t.postAt = true, e.now
	switch t.mode {
	case Prefetch:
		useful := t.complete
		e.learnPrefetch(t, useful)
		if useful {
			e.stats.PrefetchUseful++
		} else {
			e.stats.PrefetchUseless++
		}
		return Decision{Action: Prefetch, ID: ev.ID, Slot: t.slot, Reason: ReasonPrefetched}, nil
	case Onload:
		if e.cfg.Enabled && e.cfg.PoolSlots > 0 && t.size <= e.cfg.maxPrefetch() {
			// Shadow outcome: would a prefetch started at header arrival
			// have finished before this receive was posted?
			useful := float64(e.now-t.headerAt) >= e.cfg.cost(t.size)
			e.learnPrefetch(t, useful)
			if useful {
				e.stats.ShadowUseful++
			} else {
				e.stats.ShadowUseless++
			}
		}
		return decide(ev.ID, Onload, ReasonMatched), nil
	default: // eager: the data came with the header; nothing left to track
		delete(e.transfers, ev.ID)
		return decide(ev.ID, Onload, ReasonEager), nil
	}
}

func (e *Engine) headerArrived(ev Event) (Decision, error) {
	if ev.Expected {
		return e.expectedHeader(ev)
	}
	if _, ok := e.transfers[ev.ID]; ok {
		return Decision{}, ErrDuplicate
	}
	t := &transfer{peer: ev.Peer, size: ev.Size, header: true, headerAt: e.now, slot: NoSlot, inPlace: ev.InPlace}
	e.transfers[ev.ID] = t
	if ev.Size < e.cfg.RendezvousThreshold {
		e.stats.Eager++
		return decide(ev.ID, Onload, ReasonEager), nil
	}
	e.addOutstanding(t)
	var r Reason
	switch {
	case !e.cfg.Enabled:
		r = ReasonDisabled
	case e.cfg.PoolSlots == 0:
		r = ReasonPoolFull
	case ev.Size > e.cfg.maxPrefetch():
		r = ReasonTooLarge
	case !ev.InPlace && !e.prefetchAllowed(ev.Peer):
		r = ReasonPeerHistory
	default:
		slot, ok := e.pool.acquire()
		if !ok {
			r = ReasonPoolFull
			break
		}
		t.mode, t.slot = Prefetch, slot
		e.stats.Prefetched++
		return Decision{Action: Prefetch, ID: ev.ID, Slot: slot, Reason: ReasonPrefetch}, nil
	}
	e.onload(t, r)
	return decide(ev.ID, Onload, r), nil
}

func (e *Engine) expectedHeader(ev Event) (Decision, error) {
	t, ok := e.transfers[ev.ID]
	if !ok {
		return Decision{}, ErrUnknownTransfer
	}
	if t.header {
		return Decision{}, ErrDuplicate
	}
	t.header, t.headerAt, t.expected = true, e.now, true
	t.peer, t.size = ev.Peer, ev.Size
	armed := t.mode == Offload
	if ev.Size < e.cfg.RendezvousThreshold {
		delete(e.transfers, ev.ID)
		e.stats.Eager++
		if armed {
			// Already in the transport's hands since the post.
			return decide(ev.ID, Offload, ReasonArmed), nil
		}
		return decide(ev.ID, Onload, ReasonEager), nil
	}
	e.addOutstanding(t)
	if armed {
		return decide(ev.ID, Offload, ReasonArmed), nil
	}
	if !e.cfg.Enabled {
		e.onload(t, ReasonDisabled)
		return decide(ev.ID, Onload, ReasonDisabled), nil
	}
	if e.throttled {
		e.onload(t, ReasonThrottled)
		return decide(ev.ID, Onload, ReasonThrottled), nil
	}
	// Expected onload delay: the larger of the learned delta and how long
	// the receiver has already been away from the library.
	est, ok := e.deltaEstimate(ev.Peer)
	if e.hasActivity {
		if away := float64(e.now - e.lastActivity); !ok || away > est {
			est, ok = away, true
		}
	}
	if ok && est > e.cfg.OffloadRatio*e.k() {
		e.offload(t)
		return decide(ev.ID, Offload, ReasonDelayAboveK), nil
	}
	// Onloaded, but not for good: if the receiver stays away longer than
	// predicted, a Revisit offloads it (counted when its mode is final).
	t.mode, t.revisit, t.seenAt = Onload, true, e.now
	e.pending++
	return e.heldOnload(ev.ID, ReasonDelayBelowK, e.revisitAfter()), nil
}

// heldOnload is an Onload decision that asks for a Revisit after d.
func (e *Engine) heldOnload(id TransferID, r Reason, d time.Duration) Decision {
	dec := decide(id, Onload, r)
	dec.Revisit = d
	return dec
}

// maxRevisit bounds a revisit delay so that a huge K (sizes from a corrupt
// header) cannot overflow a Duration.
const maxRevisit = time.Duration(1<<62 - 1)

// revisitAfter is the revisit delay of a transfer onloaded now: the time
// left until the receiver's absence reaches OffloadRatio * K, the point at
// which the offload rule would have offloaded it, at least MinRevisit.
func (e *Engine) revisitAfter() time.Duration {
	d := e.cfg.OffloadRatio * e.k()
	if e.hasActivity {
		d -= float64(e.now - e.lastActivity)
	}
	if d >= float64(maxRevisit) {
		return maxRevisit
	}
	return max(time.Duration(d), e.cfg.MinRevisit)
}

// settle counts a transfer onloaded with a revisit once its mode is final
// (it starts, completes or is cancelled while still onloaded).
func (e *Engine) settle(t *transfer) {
	if t.revisit {
		t.revisit = false
		e.pending--
		e.countOnload(ReasonDelayBelowK)
	}
}

// revisit handles a Revisit event: offload the held transfer unless the
// receiver was active since its header (or its last revisit), or offloads
// are throttled; in both cases it stays onloaded and is revisited again.
func (e *Engine) revisit(ev Event) (Decision, error) {
	t, ok := e.transfers[ev.ID]
	if !ok {
		return Decision{}, ErrUnknownTransfer
	}
	if !t.revisit {
		// Not an expected transfer onloaded with a revisit, or already
		// started, cancelled or offloaded.
		return Decision{}, ErrOrder
	}
	if e.hasActivity && e.lastActivity > t.seenAt {
		// The receiver is back and starts held transfers at its calls; if
		// it left again meanwhile, ask again when this absence reaches the
		// threshold.
		t.seenAt = e.now
		return e.heldOnload(ev.ID, ReasonDelayBelowK, e.revisitAfter()), nil
	}
	if e.throttled {
		// Offloads are being cancelled: leave the throttle alone and ask
		// again in the next period.
		next := time.Duration(e.period+1)*e.cfg.Period - e.now
		return e.heldOnload(ev.ID, ReasonThrottled, max(next, e.cfg.MinRevisit)), nil
	}
	t.revisit = false
	e.pending--
	e.offload(t)
	e.stats.Revisited++
	return decide(ev.ID, Offload, ReasonRevisited), nil
}

func (e *Engine) transferStarted(ev Event) error {
	t, ok := e.transfers[ev.ID]
	if !ok {
		return ErrUnknownTransfer
	}
	if !t.header {
		return ErrOrder
	}
	if t.started {
		return nil
	}
	t.started = true
	e.settle(t)
	if !t.expected {
		return nil
	}
	if t.mode == Offload {
		// An offloaded transfer starts as soon as its header arrives, so
		// its start time says how late the sender was, not how long the
		// receiver stays away. Sample the delay an onload would have had
		// at the receiver's next activity instead (troupe's addition:
		// without it, offloading teaches the engine a small delta and
		// the next transfer is onloaded, and the decisions alternate).
		if len(e.shadows) == maxShadows {
			copy(e.shadows, e.shadows[1:])
			e.shadows = e.shadows[:maxShadows-1]
		}
		e.shadows = append(e.shadows, shadowDelta{peer: t.peer, postAt: t.postAt, headerAt: t.headerAt})
		return nil
	}
	e.sampleDelta(t.peer, e.now-t.postAt)
	return nil
}

func (e *Engine) transferCompleted(ev Event) error {
	t, ok := e.transfers[ev.ID]
	if !ok {
		return ErrUnknownTransfer
	}
	if t.complete {
		return ErrOrder
	}
	if !t.header {
		// Only an armed receive may complete without a reported header:
		// a transport that offloads by posting the receive to UCX at once
		// does not see the RTS of that message.
		if t.mode != Offload {
			return ErrOrder
		}
		delete(e.transfers, ev.ID)
		return nil
	}
	t.complete = true
	e.settle(t)
	e.removeOutstanding(t)
	if t.mode != Prefetch {
		delete(e.transfers, ev.ID)
	}
	return nil
}

func (e *Engine) recvCancelled(ev Event) error {
	t, ok := e.transfers[ev.ID]
	if !ok {
		return ErrUnknownTransfer
	}
	if !t.posted || (t.header && !t.expected) {
		// Not a receive, or a receive already matched to an unexpected
		// message: too late to cancel.
		return ErrOrder
	}
	e.stats.Cancelled++
	e.settle(t)
	if t.mode == Offload {
		e.stats.OffloadCancelled++
		e.periodCancels++
		e.checkThrottle()
	}
	e.removeOutstanding(t)
	delete(e.transfers, ev.ID)
	return nil
}

func (e *Engine) checkThrottle() {
	if e.throttled || e.periodOffloads == 0 || e.periodOffloads < e.cfg.CancelMinOffloads {
		return
	}
	if float64(e.periodCancels) > e.cfg.CancelRateThreshold*float64(e.periodOffloads) {
		e.throttled = true
		e.stats.ThrottledPeriods++
	}
}

func (e *Engine) prefetchConsumed(ev Event) error {
	t, ok := e.transfers[ev.ID]
	if !ok {
		return ErrUnknownTransfer
	}
	if t.mode != Prefetch || !t.posted || !t.complete {
		return ErrOrder
	}
	e.pool.release(t.slot)
	delete(e.transfers, ev.ID)
	return nil
}

func (e *Engine) prefetchDropped(ev Event) error {
	t, ok := e.transfers[ev.ID]
	if !ok {
		return ErrUnknownTransfer
	}
	if t.mode != Prefetch {
		return ErrOrder
	}
	if !t.posted {
		e.learnPrefetch(t, false)
		e.stats.PrefetchUseless++
	}
	e.stats.PrefetchDropped++
	e.removeOutstanding(t)
	e.pool.release(t.slot)
	delete(e.transfers, ev.ID)
	return nil
}

func (e *Engine) onloadDropped(ev Event) error {
	t, ok := e.transfers[ev.ID]
	if !ok {
		return ErrUnknownTransfer
	}
	if t.mode == Prefetch || t.mode == Offload || t.expected || t.posted || t.started {
		return ErrOrder
	}
	if t.mode == Onload {
		e.stats.OnloadDropped++
	}
	e.removeOutstanding(t)
	delete(e.transfers, ev.ID)
	return nil
}
