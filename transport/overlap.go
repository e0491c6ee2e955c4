package transport

import (
	"errors"
	"fmt"
	"strconv"
	"time"
	"unsafe"

	"go.uber.org/zap"

	"github.com/troupe-hpc/troupe/gpu"
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

// ovKey names one message in the engine's tables: its wire tag, and for
// channel messages the chunk index (the chunks of a channel message share
// its tag and arrive in order, docs/gpu.md). Trace-based matching makes
// the key unique.
type ovKey struct {
	wire  uint64
	chunk uint32
}

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
	posted map[ovKey]*Request
	// unexp: messages taken off UCX's unexpected queue before their
	// receive was posted, by wire tag; a matched one stays until delivered.
	unexp map[ovKey]*ovMsg
	// chunks counts the chunks probed so far of each channel message whose
	// last (short) chunk has not been probed yet, with the rank sending
	// them (ovChunks).
	chunks map[uint64]ovChunks
	// held: expected messages the policy onloaded; the receiver's next call
	// into the transport starts them, or ovRevisit once their revisit time
	// has come and the policy offloads them. Entries started or cancelled
	// otherwise stay until the next ovStartHeld or ovRevisit (their
	// r.ov.held is false).
	held []*Request
	// revisitAt: the earliest revisit time of a held transfer (on the
	// engine's clock, time since start), 0 when none; it may be early
	// (that transfer started or was cancelled since), never late.
	revisitAt time.Duration
	// copies: receives matched to a prefetched message, waiting for a
	// goroutine outside the lock to copy the slot into their buffer.
	copies []*Request
	// discard: channel messages whose receive failed with a size mismatch
	// while some of their chunks were still to come, by wire tag, with the
	// sending rank: ovProbe drops every chunk of such a tag it takes, until
	// the short last chunk (docs/overlap.md, section 7).
	discard   map[uint64]int
	discarded uint64 // channel chunks dropped that way (cumulative)
	errs      uint64
	dirty     bool // UCX may hold unexpected messages not taken yet
	// startedSince: a transfer started since the last Progress event, so
	// the engine may wait for the receiver's next activity to sample how
	// late an onload of it would have started (ovPoll).
	startedSince bool
}

// ovChunks is what the engine knows of a channel message of which it has
// taken some chunks off UCX's queue, and not the last one yet: how many,
// and the rank sending them, known from the channel of the message's id
// open on this rank when one chunk was taken or since (openChannel), else
// overlap.AnyPeer. The rank is kept with the count because the channel may
// be closed before the rank is lost: a channel tag does not name its
// sender, and the count must then still go (ovPeerLost).
type ovChunks struct {
	n    uint32
	peer int
}

// ovRecv is the overlap state of a receive (or of an internal prefetch).
type ovRecv struct {
	id      uint64
	wire    uint64
	chunk   uint32      // channel messages: the chunk index
	msg     ucx.Message // onloaded: the probed header, received when started
	size    int         // message size, once its header was probed
	held    bool
	revisit time.Duration // held: when to send the policy Revisit (engine clock), 0: never
	started bool          // a UCX receive runs for it
	m       *ovMsg        // matched message (unexpected path)
	fetch   *ovMsg        // set on the internal request that fills m
	cma     *cmaDesc      // a CMA message's descriptor, until its read starts
}

// ovMsg is a message taken off UCX's unexpected queue before its receive
// was posted.
type ovMsg struct {
	id        uint64
	wire      uint64
	chunk     uint32 // channel messages: the chunk index
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
	// copying: its copy into r runs outside the lock (ovRunCopies), which
	// completes r; nothing else may complete r meanwhile (Close did, and
	// the copy then wrote into a buffer handed back, or read a freed IOV).
	copying bool
	// cma: the data stays in the sender's memory (overlap_cma.go) until
	// read into a slot (Prefetch) or the receive's buffer (Onload).
	cma         bool
	desc        cmaDesc
	descPending bool // the descriptor itself is still being received
	// drop: a prefetched leftover chunk of a failed channel receive; its
	// slot is given back when the write into it is done.
	drop bool
}

func (o *ovRecv) key() ovKey { return ovKey{o.wire, o.chunk} }
func (m *ovMsg) key() ovKey  { return ovKey{m.wire, m.chunk} }

func newOvState(pol RendezvousPolicy) *ovState {
	cfg := pol.Config()
	return &ovState{
		pol:      pol,
		thresh:   int(cfg.RendezvousThreshold),
		slotSize: int(cfg.SlotSize),
		slots:    make([][]byte, cfg.PoolSlots),
		start:    time.Now(),
		posted:   map[ovKey]*Request{},
		unexp:    map[ovKey]*ovMsg{},
		chunks:   map[uint64]ovChunks{},
		discard:  map[uint64]int{},
	}
}

// step feeds the policy one event; errors are integration bugs, logged and
// counted, and the transfer carries on as an onload.
func (t *Transport) step(ev overlap.Event) overlap.Decision {
	ov := t.ov
	ev.At = time.Since(ov.start)
	d, err := ov.pol.Step(ev)
	switch ev.Kind {
	case overlap.TransferStarted:
		ov.startedSince = true
	case overlap.Progress:
		ov.startedSince = false
	}
	if d.Action == overlap.Prefetch || ev.Kind == overlap.PrefetchConsumed || ev.Kind == overlap.PrefetchDropped {
		t.prefetchHeld.Store(ov.pol.Stats().PoolInUse > 0)
	}
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
// receiver is in the transport, or (queue mode) called Test since the last
// pass, and revisits the onloaded transfers whose revisit time has come
// (ovRevisit).
func (t *Transport) ovPoll(active bool) {
	ov := t.ov
	if active {
		ov.dirty = true
	}
	if t.entered.Load() && t.entered.Swap(false) {
		// Queue mode: a Test call entered the transport (Request.Test).
		t.ovEnter()
	}
	spinning := t.spinners.Load() > 0
	if ov.dirty && (!spinning || len(ov.posted) > 0) {
		t.ovProbe()
	}
	if t.receiverIn() {
		// The engine reads the receiver's activity only when a header
		// arrives for a receive in its table (posted says so, and posting
		// it was activity already) and to sample the delay of an
		// offloaded transfer that started since (startedSince): a small
		// message's pass needs no event, and no clock read.
		if spinning && active && (len(ov.posted) > 0 || ov.startedSince) {
			t.step(overlap.Event{Kind: overlap.Progress})
		}
		t.ovStartHeld()
	}
	t.ovRevisit()
}

// ovEnter records that the application entered the transport (a receive,
// test or wait call) and starts what was left for it; the lock is held.
func (t *Transport) ovEnter() {
	t.step(overlap.Event{Kind: overlap.Progress})
	t.ovProbe()
	t.ovStartHeld()
}

// ovProbe takes every tagged (USER kind) message and every typed transfer's
// data message off UCX's unexpected queue, and every channel message while
// this rank has channels open, and matches
// them against the engine's posted receives by their exact wire tag (and
// chunk index); trace-based sequence numbers (channel counters) make the
// match unique, so taking messages in any order keeps MPI ordering. CMA
// descriptors (USER kind with cmaBit) are taken too and handled in
// overlap_cma.go. The lock is held.
func (t *Transport) ovProbe() {
	kindMask := uint64(0xf) << kindShift
	t.ov.dirty = false
	for {
		msg, info, ok := t.w.TagProbe(uint64(KindUser)<<kindShift, kindMask&^cmaBit, true)
		if !ok {
			break
		}
		src, utag, _ := SplitUserTag(info.Tag &^ cmaBit)
		if int(src) >= t.size {
			t.foreignMsg(msg, int(src), info.Tag)
			continue
		}
		if info.Tag&cmaBit != 0 {
			t.ovCMATake(msg, info.Tag&^cmaBit, int(src), int(utag), info.Length)
			continue
		}
		t.ovTaken(msg, ovKey{wire: info.Tag}, int(src), int(utag), info.Length)
	}
	for {
		msg, info, ok := t.w.TagProbe(ncDataTag, ncDataMask, true)
		if !ok {
			break
		}
		src, idx := ncXferSource(info.Tag)
		if src >= t.size {
			t.foreignMsg(msg, src, info.Tag)
			continue
		}
		t.ovTaken(msg, ovKey{wire: info.Tag}, src, idx, info.Length)
	}
	if t.chanOpen.Load() == 0 {
		return
	}
	for {
		msg, info, ok := t.w.TagProbe(uint64(KindChannel)<<kindShift, kindMask, true)
		if !ok {
			return
		}
		if _, ok := t.ov.discard[info.Tag]; ok {
			// A leftover chunk of a message whose receive failed.
			t.drainMsg(msg, "channel chunk")
			t.ov.discarded++
			if info.Length < ChannelChunkSize {
				delete(t.ov.discard, info.Tag)
			}
			continue
		}
		// The chunks of one message share its tag and arrive in order;
		// the last one is shorter than a full chunk.
		id, _ := SplitChannelTag(info.Tag)
		src := t.channelPeer(id)
		c, ok := t.ov.chunks[info.Tag]
		if !ok {
			c.peer = overlap.AnyPeer
		}
		k := ovKey{wire: info.Tag, chunk: c.n}
		if info.Length < ChannelChunkSize {
			delete(t.ov.chunks, info.Tag)
		} else {
			c.n++
			if src != overlap.AnyPeer {
				c.peer = src
			}
			t.ov.chunks[info.Tag] = c
		}
		t.ovTaken(msg, k, src, int(id), info.Length)
	}
}

// ovTaken hands a message taken off UCX's queue to the receive waiting for
// it in the engine's table, or keeps it as unexpected; the lock is held.
func (t *Transport) ovTaken(msg ucx.Message, k ovKey, src, tag, length int) {
	r := t.ov.posted[k]
	if r == nil {
		t.ovUnexpected(msg, k, src, tag, length)
		return
	}
	delete(t.ov.posted, k)
	d := t.step(overlap.Event{Kind: overlap.HeaderArrived, ID: r.ov.id, Peer: src, Tag: k.wire,
		Size: int64(length), Expected: true})
	r.ov.msg, r.ov.size = msg, length
	if d.Action == overlap.Offload || length < t.ov.thresh || t.receiverIn() {
		t.ovStart(r)
		return
	}
	t.ovHold(r, d.Revisit)
}

// ovHold keeps r's probed header (or CMA descriptor) for the receiver's
// next call, to be revisited after rev if it is still held then (0:
// never); the lock is held.
func (t *Transport) ovHold(r *Request, rev time.Duration) {
	ov := t.ov
	r.ov.held, r.ov.revisit = true, 0
	if rev > 0 {
		r.ov.revisit = time.Since(ov.start) + rev
		if ov.revisitAt == 0 || r.ov.revisit < ov.revisitAt {
			ov.revisitAt = r.ov.revisit
		}
	}
	ov.held = append(ov.held, r)
}

// ovRevisit reports Revisit to the policy for the held transfers whose
// revisit time has come (the receiver has not called in since their
// header arrived) and starts those it now offloads; the others wait for
// their next revisit time, if the policy gave one, or for the receiver.
// ovPoll calls it on every progress pass; the lock is held.
func (t *Transport) ovRevisit() {
	ov := t.ov
	if ov.revisitAt == 0 {
		return
	}
	now := time.Since(ov.start)
	if now < ov.revisitAt {
		return
	}
	var start []*Request
	kept := ov.held[:0]
	ov.revisitAt = 0
	for _, r := range ov.held {
		if !r.ov.held {
			continue // started or cancelled since
		}
		if r.ov.revisit != 0 && now >= r.ov.revisit {
			d := t.step(overlap.Event{Kind: overlap.Revisit, ID: r.ov.id})
			if d.Action == overlap.Offload {
				start = append(start, r)
				continue
			}
			r.ov.revisit = 0
			if d.Revisit > 0 {
				r.ov.revisit = now + d.Revisit
			}
		}
		if r.ov.revisit != 0 && (ov.revisitAt == 0 || r.ov.revisit < ov.revisitAt) {
			ov.revisitAt = r.ov.revisit
		}
		kept = append(kept, r)
	}
	clear(ov.held[len(kept):])
	ov.held = kept
	for _, r := range start {
		t.ovStart(r)
	}
}

// ovRevisitIn returns how long until the earliest revisit of a held
// transfer, and false when none is due; the lock is held. The progress
// goroutine sleeps no longer than that.
func (t *Transport) ovRevisitIn() (time.Duration, bool) {
	if t.ov == nil || t.ov.revisitAt == 0 {
		return 0, false
	}
	return t.ov.revisitAt - time.Since(t.ov.start), true
}

// ovUnexpected handles a message that arrived before its receive; the lock
// is held.
func (t *Transport) ovUnexpected(msg ucx.Message, k ovKey, src, tag, size int) {
	ov := t.ov
	ov.nextID++
	m := &ovMsg{id: ov.nextID, wire: k.wire, chunk: k.chunk, peer: src, tag: tag, size: size, msg: msg, slot: overlap.NoSlot}
	ov.unexp[k] = m
	d := t.step(overlap.Event{Kind: overlap.HeaderArrived, ID: m.id, Peer: src, Tag: k.wire, Size: int64(size)})
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
		// Started before the receive is: one that fails at once reports
		// PrefetchDropped inside ovFetch, after which the engine knows
		// the transfer no more (as ovCMAUnexpected orders them).
		t.step(overlap.Event{Kind: overlap.TransferStarted, ID: m.id})
		t.ovFetch(m)
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
	r.ov = &ovRecv{id: m.id, wire: m.wire, chunk: m.chunk, fetch: m}
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
		if err != nil || m.drop {
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
	// The engine forgets a message below the threshold at its header.
	tracked := r.ov.size >= t.ov.thresh
	r.ov.held, r.ov.started = false, tracked
	ureq, err := t.w.TagMsgRecv(r.b, r.ov.msg)
	r.ov.msg = ucx.Message{}
	if tracked {
		t.step(overlap.Event{Kind: overlap.TransferStarted, ID: r.ov.id})
	}
	if err != nil {
		t.ovTransferDone(r, nil)
		t.fail(r, fmt.Errorf("transport: %s from rank %d tag %d: %w", r.op, r.peer, r.tag, err))
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
	t.ov.held, t.ov.revisitAt = nil, 0
	for _, r := range held {
		if r.ov.held {
			t.ovStart(r)
		}
	}
}

// ovRecv routes a tagged receive through the engine once its sequence
// number is taken; it reports false when the receive should be posted to
// UCX as usual. The lock is held.
func (t *Transport) ovRecv(r *Request) bool {
	wire := MakeUserTag(uint32(r.peer), uint16(r.tag), r.seq)
	return t.ovRecvKey(r, ovKey{wire: wire}, r.bufLen < t.ov.thresh)
}

// ovRecvKey routes the receive of message k through the engine. small says
// that r may go to UCX when k is not in the engine's hands: UCX matches a
// message still in its queue itself. It reports false when r should be
// posted to UCX. The lock is held.
func (t *Transport) ovRecvKey(r *Request, k ovKey, small bool) bool {
	ov := t.ov
	if !small && ov.dirty {
		t.ovProbe()
	}
	m := ov.unexp[k]
	if m != nil && m.r == nil && !m.descPending {
		r.ov = &ovRecv{id: m.id, wire: k.wire, chunk: k.chunk, m: m}
		if m.tracked {
			t.step(overlap.Event{Kind: overlap.RecvPosted, ID: m.id, Peer: r.peer, Tag: k.wire, Size: int64(r.bufLen)})
		}
		if m.mode == overlap.Onload && !m.eager {
			// Onloaded: the receiver starts it now, into its buffer (a CMA
			// message: the progress goroutine reads it, the call returns).
			delete(ov.unexp, k)
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
	if small && (m == nil || !m.descPending) {
		return false
	}
	ov.nextID++
	r.ov = &ovRecv{id: ov.nextID, wire: k.wire, chunk: k.chunk}
	t.step(overlap.Event{Kind: overlap.RecvPosted, ID: r.ov.id, Peer: r.peer, Tag: k.wire, Size: int64(r.bufLen)})
	ov.posted[k] = r
	t.ovStartHeld()
	return true
}

// ovHas reports whether a message with this wire tag was taken off UCX's
// queue and waits for its receive; the lock is held.
func (t *Transport) ovHas(wire uint64) (*ovMsg, bool) {
	return t.ovHasKey(ovKey{wire: wire})
}

// ovHasKey is ovHas for any message key.
func (t *Transport) ovHasKey(k ovKey) (*ovMsg, bool) {
	if t.ov == nil {
		return nil, false
	}
	m := t.ov.unexp[k]
	return m, m != nil && m.r == nil && !m.descPending
}

// ovDeliver completes r from message m once m's data is in place: small
// copies at once, large ones by a goroutine outside the lock (the progress
// goroutine when the caller computes). The lock is held.
func (t *Transport) ovDeliver(r *Request, m *ovMsg) {
	if m.err != nil {
		t.ovForget(m)
		t.fail(r, m.err)
		return
	}
	if m.size < copyOffloadMin {
		t.ovDelivered(r, m, ovCopy(r, m, 0, r.bufLen))
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
	for _, r := range c {
		r.ov.m.copying = true
	}
	return c
}

// ovRunCopies copies prefetched messages into their receives without the
// lock, except their first cmaDescSize bytes, which it copies under the
// lock before completing them (a descriptor of a later message may land
// there; see runCMAJobs).
func (t *Transport) ovRunCopies(rs []*Request) {
	errs := make([]error, len(rs))
	for i, r := range rs {
		errs[i] = ovCopy(r, r.ov.m, cmaDescSize, r.bufLen)
	}
	t.mu.Lock()
	for i, r := range rs {
		errs[i] = errors.Join(errs[i], ovCopy(r, r.ov.m, 0, cmaDescSize))
		t.ovDelivered(r, r.ov.m, errs[i])
	}
	t.mu.Unlock()
}

// ovCopy copies bytes [lo, hi) of m's data into the same bytes of r's
// buffer (contiguous, IOV or device memory), within the buffer's length.
func ovCopy(r *Request, m *ovMsg, lo, hi int) error {
	hi = min(hi, len(m.data), r.bufLen)
	if lo >= hi {
		return nil
	}
	src := m.data[lo:hi]
	switch {
	case r.dev.Len() > 0:
		dst, err := r.dev.Slice(lo, hi-lo)
		if err == nil {
			err = gpu.CopyFromHost(dst, src)
		}
		if err != nil {
			return fmt.Errorf("transport: %s from rank %d: copying a prefetched message to device memory: %w", r.op, r.peer, err)
		}
	case r.b.IOV == nil:
		copy(unsafe.Slice((*byte)(r.b.Ptr), r.b.Len)[lo:], src)
	default:
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
	return nil
}

// ovDelivered completes r after its copy (which failed with copyErr, if
// not nil) and gives m's slot back; the lock is held.
func (t *Transport) ovDelivered(r *Request, m *ovMsg, copyErr error) {
	t.ovForget(m)
	if m.mode == overlap.Prefetch {
		t.step(overlap.Event{Kind: overlap.PrefetchConsumed, ID: m.id})
		m.mode = overlap.None
	}
	m.data = nil
	if r.fin.Load() { // failed meanwhile (closed)
		return
	}
	r.status = Status{Source: r.peer, Tag: r.tag, Size: m.size}
	switch {
	case copyErr != nil:
		r.err = copyErr
	case m.size > r.bufLen:
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
			if p := t.peerOf(m.peer); p != nil && p.lost != nil {
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
// started). A receive whose transfer has started, or that matched a taken
// message, can no longer be cancelled and completes normally. It always
// reports true: a receive with engine state is never UCX's to cancel (one
// whose transfer started must not be cancelled there). The lock is held.
func (t *Transport) ovCancel(r *Request, err error) bool {
	if r.fin.Load() {
		return true
	}
	ov := t.ov
	switch {
	case ov.posted[r.ov.key()] == r:
		delete(ov.posted, r.ov.key())
	case r.ov.held && r.ov.cma != nil:
		r.ov.held = false
		t.step(overlap.Event{Kind: overlap.RecvCancelled, ID: r.ov.id})
		t.cancelledSeq(r)
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
		t.cancelledSeq(r)
		t.fail(r, err)
		t.ovUnexpected(msg, r.ov.key(), r.peer, r.tag, r.ov.size)
		return true
	default:
		return true
	}
	t.step(overlap.Event{Kind: overlap.RecvCancelled, ID: r.ov.id})
	t.cancelledSeq(r)
	t.fail(r, err)
	return true
}

// ovForget removes m from the unexpected table, unless another message
// took its key meanwhile (a leftover chunk of a failed channel receive,
// numbered after the table receives of its message went to UCX); the lock
// is held.
func (t *Transport) ovForget(m *ovMsg) {
	if t.ov.unexp[m.key()] == m {
		delete(t.ov.unexp, m.key())
	}
}

// ovDiscardRest drops the chunks of the channel message with this wire tag
// (sent by rank peer) that no receive took: its receive failed with a size
// mismatch, every chunk receive of it has finished, and the chunks it
// received did not include the short last one, so at least one chunk is
// left. Chunks already in the unexpected table are dropped now (a
// prefetched one gives its slot back, an onloaded one is received into
// nothing, which releases the sender); unless the last chunk was among
// them, ovProbe drops the ones still to come until the last one. The lock
// is held.
func (t *Transport) ovDiscardRest(wire uint64, peer int) {
	ov := t.ov
	if ov.dirty {
		t.ovProbe()
	}
	last := false
	for k, m := range ov.unexp {
		if k.wire != wire || m.r != nil || m.cma {
			continue
		}
		last = last || m.size < ChannelChunkSize
		t.ovDrop(m)
	}
	delete(ov.chunks, wire)
	if !last {
		ov.discard[wire] = peer
		t.ovProbe()
	}
}

// ovDrop drops m, an unmatched message of the unexpected table, and tells
// the engine; the lock is held.
func (t *Transport) ovDrop(m *ovMsg) {
	ov := t.ov
	delete(ov.unexp, m.key())
	ov.discarded++
	switch {
	case m.mode == overlap.Prefetch && !m.done:
		m.drop = true // ovFetched gives the slot back
		return
	case m.mode == overlap.Prefetch:
		t.step(overlap.Event{Kind: overlap.PrefetchDropped, ID: m.id})
	case m.tracked: // onloaded or eager
		t.step(overlap.Event{Kind: overlap.OnloadDropped, ID: m.id})
	}
	if m.mode == overlap.Onload && !m.eager {
		t.drainMsg(m.msg, "channel chunk")
	}
	m.mode, m.tracked, m.msg, m.data = overlap.None, false, ucx.Message{}, nil
}

// drainMsg receives the message whose header is msg into nothing: UCX
// reports it truncated and releases its sender (a rendezvous sender gets
// its acknowledgement). what names it in logs. The lock is held.
func (t *Transport) drainMsg(msg ucx.Message, what string) {
	r := t.newRequest(what+" discard", -1, 0, 0)
	r.probe = func(ucx.Status, int) {} // truncated, as intended
	ureq, err := t.w.TagMsgRecv(ucx.Buffer{}, msg)
	switch {
	case err != nil:
		t.log.Warn("discarding a message failed", zap.String("what", what), zap.Error(err))
	case ureq.Pending():
		t.track(r, ureq)
	}
}

// dropForeign discards the message of wire tag wire waiting in UCX's
// queue, and reports true, when the source rank its tag names (src) is
// outside the job: only a corrupt or hostile peer sends one, and nothing
// may use that rank (an any-source receive would answer it). The lock is
// held.
func (t *Transport) dropForeign(src int, wire uint64) bool {
	if src >= 0 && src < t.size {
		return false
	}
	if msg, _, ok := t.w.TagProbe(wire, FullMask, true); ok {
		t.foreignMsg(msg, src, wire)
	}
	return true
}

// foreignMsg discards msg, taken out of UCX's queue, whose tag (wire)
// names src, a rank outside the job; it is counted (ForeignDropped) and
// logged. The lock is held.
func (t *Transport) foreignMsg(msg ucx.Message, src int, wire uint64) {
	t.drainMsg(msg, "foreign")
	t.noteForeign(src, wire)
}

// noteForeign counts and logs a message dropped for naming src, a rank
// outside the job.
func (t *Transport) noteForeign(src int, wire uint64) {
	t.foreign.Add(1)
	t.log.Warn("message naming a rank outside the job dropped", zap.Int("source", src), zap.Int("size", t.size),
		zap.Uint64("tag", wire))
}

// ForeignDropped counts the messages dropped because their tag named a
// source rank outside the job (a corrupt or hostile peer; each is logged
// at warn level).
func (t *Transport) ForeignDropped() uint64 { return t.foreign.Load() }

// ovChannelOpened records peer, to which channel id was just opened on
// this rank, as the sender of the chunks of that id the engine counts
// without knowing their sender (taken before the channel was open); the
// lock is held.
func (t *Transport) ovChannelOpened(id uint32, peer int) {
	for w, c := range t.ov.chunks {
		if cid, _ := SplitChannelTag(w); cid == id && c.peer == overlap.AnyPeer {
			c.peer = peer
			t.ov.chunks[w] = c
		}
	}
}

// ovPeerLost fails the engine's receives waiting for rank's messages; the
// lock is held.
func (t *Transport) ovPeerLost(rank int, reason string) {
	ov := t.ov
	for w, p := range ov.discard {
		if p == rank { // the rest of its chunks will not come
			delete(ov.discard, w)
		}
	}
	for w, c := range ov.chunks {
		// Nor will the rest of this message's: the rank recorded with its
		// count (its channel may be closed by now; before 2026-12-08 only
		// the counts of channels still open went, and the others stayed
		// for good, TestOverlapPeerLostDropsChunkCounts), or the one its
		// channel goes to.
		id, _ := SplitChannelTag(w)
		if c.peer == rank || (c.peer == overlap.AnyPeer && t.channelPeer(id) == rank) {
			delete(ov.chunks, w)
		}
	}
	for k, r := range ov.posted {
		if r.peer == rank {
			delete(ov.posted, k)
			t.step(overlap.Event{Kind: overlap.RecvCancelled, ID: r.ov.id})
			// Its sequence number goes back, as a receive UCX held does
			// when peerFailed cancels it: a message the dead rank sent
			// before is still the next receive's.
			t.cancelledSeq(r)
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
	for k, r := range ov.posted {
		delete(ov.posted, k)
		t.fail(r, closed(r))
	}
	for _, r := range ov.held {
		if r.ov.held {
			r.ov.held = false
			t.fail(r, closed(r))
		}
	}
	ov.held, ov.revisitAt = nil, 0
	for _, m := range ov.unexp {
		if m.r != nil && !m.r.fin.Load() && !m.copying { // a copy in flight completes its receive
			t.fail(m.r, closed(m.r))
			// A prefetch still running ends later (ovFetched): it must not
			// hand its data or error to the receive, which is its
			// caller's again (and a pooled one may be recycled).
			m.r = nil
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
//
// Discarding counts channel messages whose receive failed with a size
// mismatch and whose remaining chunks are still to come (they are dropped
// as they arrive); Discarded is the number of such leftover chunks dropped
// since the transport started (cumulative, like PolicyErrors).
type OverlapTable struct {
	Posted, Held, Unexpected, Copies, Discarding int `metric:",gauge"`
	PolicyErrors, Discarded                      uint64
}

// OverlapTable returns the current sizes of the engine's tables.
func (t *Transport) OverlapTable() OverlapTable {
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.ov == nil {
		return OverlapTable{}
	}
	return OverlapTable{Posted: len(t.ov.posted), Held: len(t.ov.held), Unexpected: len(t.ov.unexp),
		Copies: len(t.ov.copies), Discarding: len(t.ov.discard), PolicyErrors: t.ov.errs, Discarded: t.ov.discarded}
}

// peerOf returns rank's peer state, or nil for a rank that is not a peer
// (AnyPeer: a channel message taken before its channel was open).
func (t *Transport) peerOf(rank int) *peer {
	if rank < 0 || rank >= len(t.peers) {
		return nil
	}
	return t.peers[rank]
}
