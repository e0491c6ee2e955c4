// Package transport is troupe's UCX transport: one UCP context and worker per
// rank, progressed by one goroutine (locked to an OS thread only with
// Options.LockThread), with an MPI-style
// tagged API (Send, Recv, Probe and their non-blocking forms), RMA over
// registered memory, and active messages for the actor runtime.
//
// Every UCX call on the worker is serialised by one lock (the worker lock).
// In the default direct progress mode, callers take the lock and call UCX
// themselves, and a goroutine waiting for a request progresses the worker
// itself for a short while before parking; the progress goroutine covers the
// time nobody waits, spinning briefly after activity and then sleeping on the
// worker's event file descriptor. In queue mode every call is handed to the
// progress goroutine instead. docs/transport.md compares the two.
package transport

import (
	"context"
	"fmt"
	"reflect"
	"runtime"
	"slices"
	"sync"
	"sync/atomic"
	"time"
	"unsafe"

	"go.uber.org/zap"

	"github.com/troupe-hpc/troupe/gpu"
	"github.com/troupe-hpc/troupe/transport/bootstrap"
	"github.com/troupe-hpc/troupe/transport/ucx"
)

// ProgressMode chooses how calls into the worker are serialised.
type ProgressMode int

const (
	// ProgressDirect: callers lock the worker and call UCX directly; waiters
	// progress the worker themselves before parking. The default.
	ProgressDirect ProgressMode = iota
	// ProgressQueue: calls are queued to the progress goroutine, which alone
	// touches the worker; waiters spin on their request, then park.
	ProgressQueue
)

func (m ProgressMode) String() string {
	if m == ProgressQueue {
		return "queue"
	}
	return "direct"
}

// EnvKeepHeap, set to "off", leaves glibc's heap trimming as it is: by
// default New asks glibc to keep freed memory (ucx.KeepHeap), since UCX
// allocates a buffer for every fragmented active message it receives.
const EnvKeepHeap = "TROUPE_KEEP_HEAP"

// Options configure a Transport.
type Options struct {
	// Bootstrap tells the rank who it is and exchanges worker addresses. Required.
	Bootstrap bootstrap.Bootstrapper
	// Progress selects the progress mode (default ProgressDirect).
	Progress ProgressMode
	// Spin is how long the progress goroutine keeps polling after its last
	// activity before it sleeps on the event fd (default 5µs in direct
	// mode, where waiters progress for themselves, 50µs in queue mode).
	Spin time.Duration
	// WaitSpin is how long Wait progresses (direct) or spins (queue) before
	// parking the calling goroutine (default 200µs in direct mode; 1ns in
	// queue mode, where only the progress goroutine completes requests).
	WaitSpin time.Duration
	// KeepAlive is UCX's keepalive interval, which bounds how quickly a dead
	// peer is noticed on transports without a connection (default 200ms;
	// UCX_KEEPALIVE_INTERVAL in the environment wins).
	KeepAlive time.Duration
	// Overlap, when set, is the rendezvous policy (an *overlap.Engine)
	// consulted for large tagged receives and unexpected messages
	// (docs/overlap.md). nil keeps the engine off: today's behaviour.
	Overlap RendezvousPolicy
	// LockThread locks the progress goroutine to an OS thread (also
	// TROUPE_PROGRESS_LOCK=1). Off by default: it costs two thread
	// switches every time the goroutine hands work to another goroutine.
	LockThread bool
	// CMAThreshold is the smallest tagged message sent to a rank on the
	// same host by cross-memory attach (transport/cma.go; default
	// DefaultCMAThreshold; TROUPE_CMA_THRESHOLD in the environment wins,
	// TROUPE_CMA=off turns the path off).
	CMAThreshold int
	// DisableGPUIPC turns off the CUDA IPC path of channels between
	// processes on one host (also TROUPE_GPU_IPC=off); both ends of a
	// channel must agree, which the start-up exchange ensures
	// (channel_ipc.go, docs/gpu.md).
	DisableGPUIPC bool
	// CPUYield says whether idle polls of the progress goroutine give the
	// processor away (sched_yield) before it sleeps: by default
	// (CPUYieldAuto) when the host has more ranks than processors.
	// TROUPE_CPU_YIELD=auto|on|off in the environment wins.
	CPUYield CPUYield
	// NoCoalesce sends every PostAM as its own active message, even when
	// the peer is not keeping up (also TROUPE_COALESCE=off); by default
	// small posts to such a peer leave in bundles (coalesce.go).
	NoCoalesce bool
	// Log receives transport logs (every entry carries a "rank" field); nil
	// means LoggerFromEnv: standard error, warn level unless TROUPE_LOG says
	// otherwise.
	Log *zap.Logger
}

func (o *Options) defaults() {
	if o.Spin == 0 {
		o.Spin = 50 * time.Microsecond
		if o.Progress == ProgressDirect {
			// Waiters progress for themselves: the loop only bridges gaps.
			o.Spin = 5 * time.Microsecond
		}
	}
	if o.WaitSpin == 0 {
		o.WaitSpin = 200 * time.Microsecond
		if o.Progress == ProgressQueue {
			// Only the progress goroutine can complete a request: a waiter
			// that spins too just competes with it for a core.
			o.WaitSpin = time.Nanosecond
		}
	}
	if v, ok := syscallGetenv("TROUPE_PROGRESS_LOCK"); ok && (v == "1" || v == "y" || v == "on") {
		o.LockThread = true
	}
	if v, ok := syscallGetenv("TROUPE_COALESCE"); ok && (v == "0" || v == "n" || v == "off") {
		o.NoCoalesce = true
	}
	if o.KeepAlive == 0 {
		o.KeepAlive = 200 * time.Millisecond
	}
	if o.Log == nil {
		o.Log = LoggerFromEnv()
	}
}

// asideInFlight is how long the progress goroutine stands aside for a
// spinning waiter before it looks again, while operations are in flight.
// Kicking it the moment the waiter leaves instead made every Wait of a
// bandwidth window hand the worker over, halving 64 KiB bandwidth. A
// waiter that spun for longSpin or more does end the nap when it leaves
// (spinDone).
const asideInFlight = 50 * time.Microsecond

// longSpin is how long a waiter must have spun for its leaving to end the
// progress goroutine's nap (nap.go). A waiter whose request completed at
// once is in a loop of its own (a window of Waits) and comes back; one
// that waited long was all that progressed the worker, and what arrives
// after it leaves (an actor message for a runtime that serves requests)
// would wait for the rest of the nap: 50 to 100 us on this kind of host,
// as the kernel's timer slack lengthens it. With the wake, a 32 KiB GPU
// Messaging API round trip between processes went from 86 to 38 us
// (docs/gpu.md).
const longSpin = 10 * time.Microsecond

// slowPeerPoll is how often the progress goroutine progresses the worker
// while nothing but posted sends waiting for slow peers keeps it busy. Only
// progress moves UCX's queue into a peer's receive queue once it has room,
// and no event says when; polling without a pause would take a core the
// peer may need (on a small machine, the receiving rank itself), while the
// messages already in the peer's queue keep it busy for far longer than
// this (docs/transport.md, "Coalescing posted messages").
const slowPeerPoll = 20 * time.Microsecond

// slowPeer reports whether posted sends wait in UCX's queue or in bundles
// for a peer that is not keeping up.
func (t *Transport) slowPeer() bool {
	return t.postsInFlight.Load() > 0 || t.bundlesPending.Load() > 0
}

// idleWaitMax bounds the progress goroutine's sleep on the event fd (in
// nanoseconds): the timeout lets UCX run its keepalive while endpoints
// exist. Tests lengthen it to tell a wake-up from the timeout.
var idleWaitMax atomic.Int64

func init() { idleWaitMax.Store(int64(100 * time.Millisecond)) }

// parkedSpin is how long the progress goroutine keeps polling after its last
// activity while a waiter is parked.
const parkedSpin = time.Millisecond

// heldSpin is how long the progress goroutine keeps polling after its last
// activity while the overlap engine's pool holds prefetched messages: a
// receive posted for one of them needs this goroutine's copy at once, and
// waking it from the event fd costs tens of microseconds on a VM.
const heldSpin = time.Millisecond

// PeerEvent reports that a peer was lost.
type PeerEvent struct {
	Rank   int
	Reason string
}

// Transport is one rank's endpoint into the job.
type Transport struct {
	opts Options
	log  *zap.Logger
	rank int
	size int

	ctx *ucx.Context
	w   *ucx.Worker
	efd int
	// maxAMHeader is the longest active-message header the worker takes
	// (MaxAMHeader).
	maxAMHeader int

	mu            sync.Mutex // the worker lock: guards w and everything below
	addrs         [][]byte
	peers         []*peer
	epOwner       map[uintptr]int
	ops           map[ucx.Request]*Request
	evbuf         []ucx.Event
	sendSeq       map[seqKey]uint32
	recvSeq       map[seqKey]*recvCounter
	renumber      renumbering // receives renumbered after a cancellation (renumber.go)
	wild          wildcards   // any-source receives and those behind them (wildcard.go)
	amq           []ucx.Event
	submit        []submission // queue mode: calls waiting for the progress goroutine
	arrival       chan struct{}
	reg           *regCache
	lostSubs      []chan PeerEvent
	closed        bool
	loopGone      bool          // queue mode: the progress goroutine has ended; calls run at once
	poClosed      bool          // closed, for same-process channels (postOffice.mu guards it)
	ov            *ovState      // the overlap engine's state; nil when off
	chanOpen      atomic.Int32  // channels open on this rank (ovProbe takes their messages)
	chanDiscarded atomic.Uint64 // leftover channel chunks drained without the engine
	traffic       traffic       // messages and bytes moved (traffic.go)
	cma           cmaState      // same-host zero copy (cma.go)
	sameHost      []bool        // by rank: shares this rank's host (read-only after New)
	sameProcess   []bool        // by rank: runs in this process (StartLocal; read-only after New)
	hostCPUs      int           // processors this host's ranks may run on, together (0: unknown)
	cpuYield      bool          // idle polls call sched_yield (yield.go; read-only after New)
	gipc          gpuIPCState   // CUDA IPC for channels (channel_ipc.go)
	dimp          deviceImports // CUDA IPC copies for the layers above (device_ipc.go)
	ctyped        chanTyped     // typed channel transfers' packers and staging (channel_typed.go)

	amMu    sync.Mutex  // orders active-message delivery; guards the two below
	amSpare []ucx.Event // the other of amq's two buffers (also under mu)
	amMsg   *AMMessage  // reused for messages their handlers do not keep
	amh     atomic.Pointer[map[uint16]amHandler]
	// handling: deliverBatch is running handlers (waitInHandler).
	handling atomic.Bool

	postFailed    uint64        // PostFailed's count once the worker is gone
	foreign       atomic.Uint64 // messages dropped for naming a rank outside the job
	bundleFailed  uint64        // posts lost in bundles that were not sent (coalesce.go)
	bundling      []int         // ranks whose peers have a bundle waiting
	postPendingAt atomic.Int64  // when a PostAM last progressed the worker itself (unix ns)
	postsInFlight atomic.Int64  // PostAM sends UCX had not completed at the last look
	postsQueued   atomic.Int64  // PostAM sends UCX queued (the peer's queue was full)

	inlineDelivered atomic.Int64 // active messages delivered inside PostAM

	bundlesPending atomic.Int32 // len(bundling), for the progress goroutine
	bundlesSent    atomic.Int64 // bundles sent (CoalesceStats)
	bundledMsgs    atomic.Int64 // the messages they carried

	spinners atomic.Int32 // waiters progressing the worker themselves
	// prefetchHeld: the overlap engine's pool holds prefetched messages
	// whose receives are still to come (the progress goroutine polls
	// longer, heldSpin).
	prefetchHeld atomic.Bool
	callers      atomic.Int32 // direct-mode calls waiting for the worker lock
	parked       atomic.Int32 // waiters parked until their request completes
	// entered: queue mode, the overlap engine on: a Test call asks the
	// progress goroutine to do what ovEnter does (it cannot itself).
	entered  atomic.Bool
	sleeping atomic.Bool
	// sigW is the worker wake signals (any goroutine, no lock) go to,
	// until Close destroys it; sigMu orders the two.
	sigMu    sync.RWMutex
	sigW     *ucx.Worker
	deferred deferredSet // nonblocking typed requests not started yet (deferred.go)
	// asideLong: the progress goroutine stands aside for a millisecond
	// (loop) because nothing was in flight; an operation that starts then
	// (track) calls it back, since its completion may need this side's
	// progress (a rendezvous send answers the receiver's request for data).
	asideLong atomic.Bool
	stopping  atomic.Bool
	kick      chan struct{}
	aside     nap          // the progress goroutine standing aside for a short while
	pace      nap          // the progress goroutine pacing its polls for a slow peer (slowPeerPoll)
	paceNaps  atomic.Int64 // naps taken pacing (tests)
	loopDone  chan struct{}
	closeDone chan struct{} // closed when the first Close returns
	// sendPostFault, set by tests only (the lock guards it), is asked
	// before a USER tagged send or CMA descriptor is posted; an error it
	// returns stands for the post's own failure at that instant.
	sendPostFault func(dst, tag int) error
	// chanPostFault, set by tests only (the lock guards it), is asked
	// before chunk chunk of message msg of channel chanID is posted; an
	// error it returns stands for the post's own failure at that instant.
	chanPostFault func(chanID, msg uint32, chunk int) error
	// rtsPostFault, set by tests only (the lock guards it), is asked
	// before a typed send's RTS to (dst, user tag tag) is posted; an error
	// it returns stands for the post's own failure at that instant.
	rtsPostFault func(dst, tag int) error
	// eventsLost: the shim reported an event lost for lack of memory
	// (logged once); the lock guards it.
	eventsLost bool
}

type seqKey struct {
	peer int
	tag  int
}

// recvCounter is the receive side of trace-based matching for one (peer,
// tag): the next sequence number, plus numbers freed by cancelled receives,
// which the next receives reuse first so that no message is skipped.
type recvCounter struct {
	next  uint32
	freed []uint32
	mask  uint32 // numbers wrap at mask+1: userSeqMask, or ncSeqMask for typed transfers
	// waiting: the receives that took a number and have not completed,
	// in the order they were posted (plain tagged receives; renumber.go),
	// or the typed receives' RTS receives in UCX, in the order UCX got
	// them; the worker lock guards it.
	waiting []*Request
	// unposted: typed counters only, numbers handed out whose RTS receive
	// is not in UCX yet, oldest first (renumber.go); nc.mu guards it.
	unposted []uint32
	// returning: typed counters only, numbers given back whose
	// renumbering has not run yet; nobody takes them meanwhile (a receive
	// or probe placed in between would take the message owed to a
	// receive pending behind: renumber.go). nc.mu guards it.
	returning []uint32
}

func (c *recvCounter) take() uint32 {
	if len(c.freed) > 0 {
		s := c.freed[0]
		c.freed = c.freed[1:]
		return s
	}
	s := c.next
	c.next = (c.next + 1) & c.mask
	return s
}

// give takes back a sequence number a cancelled receive had taken. The
// freed numbers are handed out again oldest first, whatever order the
// receives were cancelled in, so that messages are still received in the
// order they were sent.
func (c *recvCounter) give(s uint32) {
	i := 0
	for i < len(c.freed) && c.age(c.freed[i]) < c.age(s) {
		i++
	}
	c.freed = slices.Insert(c.freed, i, s)
}

// age orders numbers taken from the counter: older ones (taken earlier,
// their messages sent earlier) are smaller, across the wrap at mask+1.
func (c *recvCounter) age(x uint32) uint32 { return (x - c.next) & c.mask }

// claim takes s, the sequence number of a message an any-source receive
// matched in UCX: a freed or returning number, or the next one. It
// reports false if s was none of them (already taken).
func (c *recvCounter) claim(s uint32) bool {
	if i := slices.Index(c.returning, s); i >= 0 {
		c.returning = slices.Delete(c.returning, i, i+1)
		return true
	}
	if i := slices.Index(c.freed, s); i >= 0 {
		c.freed = slices.Delete(c.freed, i, i+1)
		return true
	}
	if s != c.next {
		return false
	}
	c.next = (c.next + 1) & c.mask
	return true
}

func (c *recvCounter) peek() uint32 {
	if len(c.freed) > 0 {
		return c.freed[0]
	}
	return c.next
}

type peer struct {
	rank    int
	ep      *ucx.Endpoint
	lost    *PeerLostError
	pending map[*Request]struct{}
	rkeys   map[string]*ucx.Rkey
	// ncRkeys are the remote keys unpacked for typed zero-copy puts, kept
	// apart from the RMA API's so that a retired window set can destroy
	// its own (noncontig_retire.go).
	ncRkeys map[string]*ucx.Rkey
	bundle  []byte // posts waiting to leave as one bundle (coalesce.go)
	bundled int    // how many
}

// destroyRkeys destroys the peer's unpacked remote keys; the worker lock is
// held.
func (p *peer) destroyRkeys() {
	for _, k := range p.rkeys {
		k.Destroy()
	}
	for _, k := range p.ncRkeys {
		k.Destroy()
	}
}

// New creates the rank's UCX context and worker, exchanges worker addresses
// through the bootstrapper and starts the progress goroutine.
func New(ctx context.Context, opts Options) (*Transport, error) {
	if opts.Bootstrap == nil {
		return nil, fmt.Errorf("%w: Options.Bootstrap is nil", ErrInvalid)
	}
	if n := opts.Bootstrap.Size(); n < 1 || n > MaxUserRanks || opts.Bootstrap.Rank() < 0 || opts.Bootstrap.Rank() >= n {
		// Wire tags carry the source rank in 24 bits: ranks 2^24 apart
		// would take each other's messages.
		return nil, fmt.Errorf("%w: rank %d of a job of %d ranks (1..%d)", ErrInvalid, opts.Bootstrap.Rank(), n, MaxUserRanks)
	}
	opts.defaults()
	if opts.Overlap == nil {
		p, err := overlapFromEnv()
		if err != nil {
			return nil, err
		}
		opts.Overlap = p
	}
	t := &Transport{
		opts:      opts,
		rank:      opts.Bootstrap.Rank(),
		size:      opts.Bootstrap.Size(),
		epOwner:   map[uintptr]int{},
		ops:       map[ucx.Request]*Request{},
		evbuf:     make([]ucx.Event, 128),
		sendSeq:   map[seqKey]uint32{},
		recvSeq:   map[seqKey]*recvCounter{},
		kick:      make(chan struct{}, 1),
		loopDone:  make(chan struct{}),
		closeDone: make(chan struct{}),
	}
	t.log = opts.Log.With(zap.Int("rank", t.rank))
	t.amh.Store(&map[uint16]amHandler{})
	// Shared-memory transports serve endpoints with peer-failure handling
	// only when asked to; without it UCX would refuse them for troupe's
	// endpoints and fall back to TCP (or fail with UCX_TLS=sm).
	for _, k := range []string{"UCX_POSIX_ERROR_HANDLING", "UCX_SYSV_ERROR_HANDLING"} {
		if !envSet(k) {
			if err := syscallSetenv(k, "y"); err != nil {
				return nil, fmt.Errorf("transport: setting %s: %w", k, err)
			}
		}
	}
	if v, _ := syscallGetenv(EnvKeepHeap); v != "off" && !ucx.KeepHeap() {
		t.log.Debug("glibc refused the heap settings (ucx.KeepHeap)")
	}
	cfg := map[string]string{}
	if !envSet("UCX_KEEPALIVE_INTERVAL") {
		cfg["KEEPALIVE_INTERVAL"] = fmt.Sprintf("%dus", opts.KeepAlive.Microseconds())
	}
	uc, err := ucx.NewContext(ucx.FeatureTag|ucx.FeatureRMA|ucx.FeatureAM|ucx.FeatureWakeup, cfg)
	if err != nil {
		return nil, fmt.Errorf("transport: rank %d: %w", t.rank, err)
	}
	t.ctx = uc
	w, err := uc.NewWorker(ucx.ThreadSerialized)
	if err != nil {
		uc.Close()
		return nil, fmt.Errorf("transport: rank %d: %w", t.rank, err)
	}
	t.w, t.sigW = w, w
	fail := func(err error) (*Transport, error) {
		w.Close()
		uc.Close()
		return nil, fmt.Errorf("transport: rank %d: %w", t.rank, err)
	}
	if t.efd, err = w.EventFD(); err != nil {
		return fail(err)
	}
	if t.maxAMHeader, err = w.MaxAMHeader(); err != nil {
		return fail(err)
	}
	addr, err := w.Address()
	if err != nil {
		return fail(err)
	}
	t.addrs, err = opts.Bootstrap.AllGather(ctx, "troupe.transport.worker-address", addr)
	if err != nil {
		return fail(fmt.Errorf("exchanging worker addresses: %w", err))
	}
	if len(t.addrs) != t.size {
		return fail(fmt.Errorf("address exchange returned %d addresses for %d ranks", len(t.addrs), t.size))
	}
	if err := t.cmaSetup(func(b []byte) ([][]byte, error) {
		return opts.Bootstrap.AllGather(ctx, "troupe.transport.cma", b)
	}); err != nil {
		return fail(err)
	}
	if err := t.setupCPUYield(); err != nil {
		return fail(err)
	}
	t.peers = make([]*peer, t.size)
	if opts.Overlap != nil {
		t.ov = newOvState(opts.Overlap)
		if runtime.GOMAXPROCS(0) == 1 {
			t.log.Info("overlap engine on with GOMAXPROCS=1: transfers move only while no other goroutine runs, so computation hides none of them (docs/overlap.md, \"One P per rank\")")
		}
	}
	t.reg = newRegCache(defaultRegCacheUnused, t.mapMemory, t.unmapMemory)
	go t.loop()
	// Never called: deliverOne hands each message of a bundle to its own
	// handler.
	if err := t.setAMHandler(amBundle, amHandler{h: func(*AMMessage) {}}); err != nil {
		t.Close()
		return nil, fmt.Errorf("transport: rank %d: %w", t.rank, err)
	}
	if err := t.setAMHandler(amWinRetire, amHandler{h: t.onWinRetire}); err != nil {
		t.Close()
		return nil, fmt.Errorf("transport: rank %d: %w", t.rank, err)
	}
	if t.cma.on {
		err := t.setAMHandler(amCMAAck, amHandler{h: t.onCMAAck})
		if err == nil {
			// Never called: deliverOne hands these messages to the
			// handler of the id their descriptor names.
			err = t.setAMHandler(amCMAData, amHandler{h: func(*AMMessage) {}})
		}
		if err != nil {
			t.Close()
			return nil, fmt.Errorf("transport: rank %d: %w", t.rank, err)
		}
	}
	if ln, ok := opts.Bootstrap.(bootstrap.LossNotifier); ok {
		// Ranks this one never connected to have no endpoint to fail:
		// the bootstrapper tells of those too (rendezvousLost).
		ln.NotifyLost(t.rendezvousLost)
	}
	t.log.Debug("transport up", zap.Int("size", t.size), zap.String("ucx", ucx.Version()), zap.Stringer("progress", opts.Progress))
	return t, nil
}

func envSet(k string) bool { _, ok := syscallGetenv(k); return ok }

// Rank is this process's rank in the job.
func (t *Transport) Rank() int { return t.rank }

// Size is the number of ranks in the job.
func (t *Transport) Size() int { return t.size }

// Bootstrap returns the bootstrapper the transport was created with.
func (t *Transport) Bootstrap() bootstrap.Bootstrapper { return t.opts.Bootstrap }

// PeerLost returns a channel that receives an event for every peer lost from
// now on. It is buffered for every rank of the job, so no event is dropped.
// A peer is lost when its UCX endpoint fails or, endpoint or not, when the
// bootstrapper reports it (bootstrap.LossNotifier, see rendezvousLost).
func (t *Transport) PeerLost() <-chan PeerEvent {
	ch := make(chan PeerEvent, t.size)
	t.mu.Lock()
	t.lostSubs = append(t.lostSubs, ch)
	t.mu.Unlock()
	return ch
}

// submission is a call waiting for the worker lock: fn, or start(t, r).
type submission struct {
	fn    func()
	start func(*Transport, *Request)
	r     *Request
}

func (s submission) run(t *Transport) {
	if s.fn != nil {
		s.fn()
	} else {
		s.start(t, s.r)
	}
}

// runSubmitted runs the calls queued for the progress goroutine (queue
// mode), in order, and reports whether there were any. A probe runs them
// first, so that a receive started before it is placed before it looks
// (MPI: the receive posted first gets the message). The worker lock is
// held.
func (t *Transport) runSubmitted() bool {
	if len(t.submit) == 0 {
		return false
	}
	calls := t.submit
	t.submit = nil
	for _, c := range calls {
		c.run(t)
	}
	return true
}

// exec runs fn with the worker lock held: directly in direct mode, on the
// progress goroutine in queue mode. fn must report its outcome through the
// request it serves.
func (t *Transport) exec(fn func()) { t.submitCall(submission{fn: fn}) }

// execReq is exec for the hot paths: start is a plain function, so nothing
// is allocated to capture the call's arguments, which live in r.
func (t *Transport) execReq(r *Request, start func(*Transport, *Request)) {
	t.submitCall(submission{start: start, r: r})
}

func (t *Transport) submitCall(s submission) {
	if t.opts.Progress == ProgressQueue {
		t.mu.Lock()
		if t.loopGone {
			s.run(t)
			t.mu.Unlock()
			return
		}
		t.submit = append(t.submit, s)
		t.mu.Unlock()
		t.wake()
		return
	}
	// Tell the progress goroutine to leave the lock alone: if it keeps
	// re-locking while it polls, a plain sync.Mutex lets it barge ahead of
	// this caller for up to a millisecond (until starvation mode).
	t.callers.Add(1)
	t.mu.Lock()
	t.callers.Add(-1)
	s.run(t)
	// With the overlap engine on, same-host reads the call queued (a
	// receive matched a CMA message that was already there) belong to the
	// progress goroutine, so that the caller goes on computing while the
	// bytes move (docs/overlap.md); so do active messages the call's event
	// handling queued. Without the engine they wait for the next progress
	// call, which is the caller's own Wait in a ping-pong: handing the read
	// to another thread would add a wake-up to its latency.
	handOff := t.ov != nil && (len(t.cma.jobs) > 0 || len(t.amq) > 0)
	t.mu.Unlock()
	if handOff {
		t.wake()
	}
}

// park tells the progress goroutine that a goroutine parks until a request
// completes: it takes over the worker at once, keeps polling while
// somebody is parked (parkedSpin), and ends a nap in which it stood aside
// for a spinning waiter (the waiter parking may be that waiter).
func (t *Transport) park() {
	t.parked.Add(1)
	t.aside.wake()
	t.wake()
}

// wake makes sure the progress goroutine is not asleep.
func (t *Transport) wake() {
	select {
	case t.kick <- struct{}{}:
	default:
	}
	t.pace.wake()
	if t.sleeping.Load() {
		// Not t.w: Close may be destroying the worker meanwhile (a
		// goroutine that saw the progress goroutine asleep just before it
		// stopped signalled a destroyed worker; found by -race in
		// TestCloseWakesBlockedCalls).
		t.sigMu.RLock()
		if t.sigW != nil {
			_ = t.sigW.Signal()
		}
		t.sigMu.RUnlock()
	}
}

// InHandler reports whether the caller runs inside an active-message
// handler, where every wait fails with ErrInHandler: a runtime checks it
// before it commits to an operation it would then have to wait for.
func (t *Transport) InHandler() bool { return t.handling.Load() && onHandlerStack() }

// waitInHandler refuses a wait made by an active-message handler (see
// AMHandler): the goroutine running it is the one that would have to
// progress the worker, and it holds the delivery lock that progress takes.
// It looks at the caller's stack only while handlers run.
func (t *Transport) waitInHandler(op string, peer, tag int) error {
	if !t.handling.Load() || !onHandlerStack() {
		return nil
	}
	if peer < 0 {
		return fmt.Errorf("transport: %s: %w", op, ErrInHandler)
	}
	return fmt.Errorf("transport: %s rank %d tag %d: %w", op, peer, tag, ErrInHandler)
}

// deliverBatchName is the name runtime.Frame gives deliverBatch.
var deliverBatchName = runtime.FuncForPC(reflect.ValueOf((*Transport).deliverBatch).Pointer()).Name()

// onHandlerStack reports whether deliverBatch is among the calling
// goroutine's frames (within 512 of them).
func onHandlerStack() bool {
	var pcs [512]uintptr
	frames := runtime.CallersFrames(pcs[:runtime.Callers(3, pcs[:])])
	for {
		f, more := frames.Next()
		if f.Function == deliverBatchName {
			return true
		}
		if !more {
			return false
		}
	}
}

// eagerSendPending reports whether an eager active message's send is in
// flight, which means that UCX queues it (PostAM in queue mode); the
// worker lock is held. Other sends pending are no sign of a slow peer (a
// rendezvous send waits for its receiver, a CMA send for its
// acknowledgement). It stops at the first one found.
func (t *Transport) eagerSendPending() bool {
	for _, r := range t.ops {
		if r != nil && r.eager {
			return true
		}
	}
	return false
}

// kicked reports whether a kick waits for the progress goroutine.
func (t *Transport) kicked() bool { return len(t.kick) > 0 }

// progressOnce progresses the worker once and handles what it produced.
// It reports whether anything happened.
func (t *Transport) progressOnce() bool {
	active, _ := t.progressHandled()
	return active
}

// progressHandled is progressOnce that also reports whether it handed
// anything to other goroutines: completed requests, arrived active messages,
// finished overlap copies. A rendezvous moving its fragments is active but
// hands nothing over.
func (t *Transport) progressHandled() (active, handed bool) {
	t.mu.Lock()
	if t.w == nil {
		t.mu.Unlock()
		return false, false
	}
	if t.runSubmitted() {
		active = true
	}
	evs, progressed := t.w.Progress()
	for len(evs) > 0 {
		active, handed = true, true
		t.handle(evs)
		evs = t.w.Drain()
	}
	if _, lost := t.w.Pending(); lost && !t.eventsLost {
		// The shim could not queue an event (malloc failed): a completion
		// or message is gone, and what waits for it waits for ever.
		t.eventsLost = true
		t.log.Error("UCX events lost for lack of memory: operations waiting for them will not complete")
	}
	if len(t.bundling) > 0 && t.bundlesFlush(false) {
		active = true
	}
	t.postsInFlight.Store(int64(t.w.PostsInFlight()))
	if progressed {
		active = true
	}
	if progressed || handed {
		// Handled events count too: a probe's receive of a CMA descriptor
		// completes as an event without new traffic, and only then is the
		// descriptor there to match.
		t.noteArrivals()
	}
	var copies []*Request
	if t.ov != nil {
		t.ovPoll(active)
		copies = t.ovTakeCopies()
	}
	am := len(t.amq) > 0
	jobs := t.cma.jobs
	t.cma.jobs = nil
	t.mu.Unlock()
	if jobs != nil {
		t.runCMAJobs(jobs)
		active, handed = true, true
	}
	if copies != nil {
		t.ovRunCopies(copies)
		active, handed = true, true
	}
	if am {
		t.deliverAM()
		handed = true
	}
	return active, handed
}

// loop is the progress goroutine. It is locked to its OS thread only with
// Options.LockThread: a locked goroutine cannot hand its processor to the
// goroutines its handlers wake without two thread switches, which made an
// actor round trip 26-28 us instead of 8 us (docs/transport.md).
func (t *Transport) loop() {
	if t.opts.LockThread {
		runtime.LockOSThread()
		defer runtime.UnlockOSThread()
	}
	defer close(t.loopDone)
	ew := newEventWait(t.efd)
	defer ew.close()
	timer := time.NewTimer(time.Hour)
	defer timer.Stop()
	direct := t.opts.Progress == ProgressDirect
	var idle time.Time
	polls := 0
	pacing := false
	// oneP: the process runs Go code on one thread at a time (GOMAXPROCS
	// 1, as a rank bound to one core gets), so this goroutine and the ones
	// it serves take turns on it: it yields instead of spinning or
	// sleeping on the thread, and waits for events in Go's network poller
	// (docs/transport.md, "One processor per rank"). Read again whenever
	// it is about to sleep (GOMAXPROCS may change).
	oneP := runtime.GOMAXPROCS(0) == 1
	for !t.stopping.Load() {
		t.flushDeferred(nil, deferGrace)
		if pacing {
			if t.spinners.Load() == 0 {
				// Until something is done (progressHandled active), or a
				// waiter spins. A kick (a call submitted, a waiter
				// parking) ends the nap at once.
				select {
				case <-t.kick: // go round at once
				default:
					t.paceNaps.Add(1)
					t.pace.sleepUnless(slowPeerPoll, t.kicked)
				}
			} else {
				pacing = false
			}
		}
		if direct && (t.spinners.Load() > 0 || t.posting()) {
			// A waiter is progressing the worker itself; competing for the
			// worker lock would only slow it down. Come back when it parks
			// (it kicks us), or after asideInFlight while operations are in
			// flight (the waiter may have left to compute while a receive it
			// posted is still to come: its message must not wait for the
			// caller's next call), else after a millisecond.
			// A poster (PostAM) has sends in flight by definition, and
			// holds the worker lock often: do not queue up for it.
			aside := time.Millisecond
			if t.posting() || t.inFlight() {
				aside = asideInFlight
			}
			if aside == asideInFlight {
				// A Go timer this short fires a millisecond late once the
				// process has nothing else to run (the runtime's poller
				// sleeps in whole milliseconds), and what is in flight may
				// need this side's progress: a rendezvous send waits for
				// the receiver's request for its data, which does not wake
				// the event fd. Sleep the thread instead; a kick that came
				// meanwhile is answered by going round now.
				if oneP {
					// The waiter runs only while this goroutine does not:
					// a thread asleep in a system call keeps the P until
					// sysmon takes it back (up to 10 ms), which made each
					// of the spinning waiter's yields cost it 50 us or more.
					runtime.Gosched()
				} else {
					t.aside.sleep(asideInFlight)
				}
				select {
				case <-t.kick:
				default:
				}
			} else {
				timer.Reset(aside)
				t.asideLong.Store(true)
				// A spinner that left before asideLong was set did not
				// call us back (spinDone).
				if t.spinners.Load() > 0 {
					select {
					case <-t.kick:
					case <-timer.C:
					}
				}
				t.asideLong.Store(false)
			}
			idle = time.Time{}
			continue
		}
		if t.callers.Load() > 0 {
			// A direct call wants the worker lock: let it have it.
			runtime.Gosched()
			continue
		}
		if active, handed := t.progressHandled(); active {
			idle, polls, pacing = time.Time{}, 0, false
			if handed {
				// Handlers may have made goroutines runnable (an actor's
				// mailbox, a waiter's channel): they were queued on this
				// goroutine's P, which a spinning goroutine would keep to
				// itself until another P steals them. Yielding hands them
				// over at once (docs/actor.md). Only then: with LockThread
				// a yield costs two thread switches, and a rendezvous that
				// yielded after each of its fragments crawled (1 MiB
				// bandwidth fell to 1.6 GB/s).
				runtime.Gosched()
			}
			continue
		}
		polls++
		if oneP || (!direct && t.parked.Load() > 0) {
			// One P: whatever else is runnable (a waiter, an actor, the
			// caller computing) would otherwise wait for this spin to end,
			// or for the runtime to preempt it after 10 ms. Queue mode with
			// a parked waiter: the waiter's next call is what this goroutine
			// waits for, and without the yield its thread found a core only
			// after hundreds of microseconds on a small machine (8 B one
			// way 300-600 us instead of 3-7; docs/transport.md).
			runtime.Gosched()
		}
		if t.cpuYield {
			// An oversubscribed host: the thread this rank waits for
			// may need this processor (yield.go).
			yieldCPU()
		}
		if polls&31 != 0 {
			continue // read the clock only every 32 idle polls
		}
		now := time.Now()
		if idle.IsZero() {
			idle = now
			continue
		}
		spin := t.opts.Spin
		if t.parked.Load() > 0 {
			// Somebody waits for an operation in flight (a long rendezvous,
			// say): keep it moving without an event-fd round trip per
			// step, but not forever if the peer is simply slow.
			spin = max(spin, parkedSpin)
		}
		if t.prefetchHeld.Load() {
			// A prefetched message waits for its receive, and the copy
			// into the receive's buffer is this goroutine's once it is
			// posted (the caller goes on computing): be polling then,
			// not asleep (docs/overlap.md, "Waking for prefetched
			// messages").
			spin = max(spin, heldSpin)
		}
		if now.Sub(idle) < spin || (!direct && t.spinners.Load() > 0) {
			// Spin briefly after activity; in queue mode, never sleep while
			// somebody waits for a result only this goroutine can produce.
			continue
		}
		if t.slowPeer() {
			// Only posted sends for a slow peer are left, and the worker
			// cannot sleep on its event fd while UCX queues sends (arming
			// reports busy): poll at a pace instead (slowPeerPoll), in
			// both modes and with waiters parked too (before 2026-11-25
			// only in direct mode with none parked, and a rank spun a
			// whole core otherwise).
			pacing = true
			continue
		}
		idle = time.Time{}
		oneP = runtime.GOMAXPROCS(0) == 1 // it takes the scheduler's lock: not on every pass
		t.mu.Lock()
		if len(t.bundling) > 0 {
			// Do not sleep on posts waiting in a bundle: send them, into
			// UCX's queue if need be.
			t.bundlesFlush(true)
			t.mu.Unlock()
			continue
		}
		err := t.w.Arm()
		pending := len(t.submit) > 0
		busy := ucx.StatusOf(err) == ucx.StatusBusy
		// The overlap engine's held transfers: sleep no longer than until
		// the first one is to be revisited (ovPoll does that).
		revisitIn, revisit := t.ovRevisitIn()
		if busy && !pending && t.eagerSendPending() {
			// UCX has work it will not wake us for with an eager send
			// still pending: queue mode's posts (requests, which slowPeer
			// does not count) waiting for a peer that is not taking them.
			// Arm also reports busy in ordinary traffic, with receives,
			// rendezvous or CMA sends pending: that is not paced (their
			// completion would wait for the nap).
			pacing = true
		}
		t.mu.Unlock()
		if pending || busy || (revisit && revisitIn <= 0) {
			continue
		}
		if err != nil {
			t.log.Warn("ucp_worker_arm failed; polling instead", zap.Error(err))
			continue
		}
		sleep := time.Duration(idleWaitMax.Load())
		if revisit {
			sleep = min(sleep, revisitIn)
		}
		t.sleeping.Store(true)
		t.flushDeferred(nil, 0) // nothing made before sleeping stays behind (startTyped)
		t.mu.Lock()
		pending = len(t.submit) > 0
		t.mu.Unlock()
		// A wake between Arm and sleeping's store saw the goroutine awake
		// and only kicked: take the kick now rather than sleep through it
		// (wake kicks before it reads sleeping, so one of the two sees the
		// other).
		kicked := false
		select {
		case <-t.kick:
			kicked = true
		default:
		}
		if !kicked && !pending && !t.stopping.Load() && (direct || t.spinners.Load() == 0) {
			// The timeout lets UCX run its keepalive while endpoints exist.
			// With one P, in the network poller, so that the P stays
			// free for the rest of the process (eventwait.go).
			ew.wait(sleep, oneP)
		}
		t.sleeping.Store(false)
		pacing = false
		select {
		case <-t.kick:
		default:
		}
	}
}

// handle processes queued UCX events; the worker lock is held.
func (t *Transport) handle(evs []ucx.Event) {
	for i := range evs {
		e := &evs[i]
		switch e.Kind() {
		case ucx.EventSend, ucx.EventRecv, ucx.EventAMData:
			req := e.Request()
			r := t.ops[req]
			delete(t.ops, req)
			switch {
			case r == nil:
			case r.anyPosted && t.wildMatched(r, e):
			case r.rtsAny:
				t.ncAnyFinished(r, e)
			case r.probe != nil:
				r.probe(e.Status(), e.Length())
				t.complete(r)
			case r.userRecv && t.cmaRecvFinished(r, e):
			default:
				t.finish(r, e.Status(), e.Length())
			}
		case ucx.EventEPError:
			if rank, ok := t.epOwner[e.Endpoint()]; ok {
				t.peerFailed(rank, e.Status().String())
			}
		case ucx.EventAM:
			t.amq = append(t.amq, *e)
		}
	}
	// Only now, evs being spent: starting receives may drain events.
	t.runRenumbers()
	t.wildAdvanceMatched()
}

// Status describes a completed receive or probe.
type Status struct {
	Source int // sender's rank
	Tag    int // user tag
	Size   int // message size in bytes
}

// Request is a non-blocking operation in flight.
type Request struct {
	t      *Transport
	op     string
	peer   int
	tag    int
	bufLen int
	recv   bool
	key    seqKey
	seq    uint32
	// fixedSeq: seq was taken when the message was matched (Mprobe); the
	// receive must not take another.
	fixedSeq bool
	// counter: the (source, tag) counter r took its number from, while r
	// waits in its list of pending receives (renumber.go).
	counter *recvCounter
	// anyPosted: an any-source receive UCX holds with the source and
	// sequence masked; the sender's tag names both when it completes
	// (wildcard.go).
	anyPosted bool
	// rtsAny: an any-source typed receive's RTS receive; wire is the
	// sender's tag once UCX handed it a message (noncontig_any.go).
	rtsAny bool
	wire   uint64
	// rtsSeq: a typed receive's exact RTS receive in UCX, holding number
	// seq of key's typed counter, which renumbering may change
	// (renumber.go).
	rtsSeq bool
	ureq   ucx.Request
	b      ucx.Buffer       // the operation's memory
	pins   []unsafe.Pointer // what to pin if it goes asynchronous (nil: b.Ptr)
	pooled bool             // a blocking call's request, recycled after Wait
	eager  bool             // an eager active message's send (SendAM): pending only while UCX queues it
	pin    runtime.Pinner
	pinned bool
	iov    *ucx.IOV
	ov     *ovRecv  // overlap engine state (Options.Overlap)
	amov   *amTrack // an active message's data transfer the engine follows
	// dev is the receive buffer as device memory, when UCX writes device
	// memory directly (queues, channels): copies into it go through gpu.
	dev gpu.Buffer

	cma      *cmaSend              // a CMA send's state (cma.go)
	userRecv bool                  // a USER receive that may get a CMA descriptor
	seqd     bool                  // a receive owning r.seq of r.key's counter (freeSeq gives it back)
	scratch  []byte                // where a receive too small for a descriptor lands
	bufs     [][]byte              // an IOV receive's buffers
	probe    func(ucx.Status, int) // an internal probe's completion
	deferred *deferredRun          // a nonblocking typed request not started yet (deferred.go)

	fin     atomic.Bool
	done    chan struct{}
	status  Status
	err     error
	failErr error
}

func (t *Transport) newRequest(op string, peer, tag, bufLen int) *Request {
	return &Request{t: t, op: op, peer: peer, tag: tag, bufLen: bufLen}
}

// requestPool recycles the requests of blocking Send and Recv calls, which
// never escape to the caller.
var requestPool = sync.Pool{New: func() any { return new(Request) }}

func (t *Transport) pooledRequest(op string, peer, tag, bufLen int) *Request {
	r := requestPool.Get().(*Request)
	r.t, r.op, r.peer, r.tag, r.bufLen, r.pooled = t, op, peer, tag, bufLen, true
	return r
}

// recycle returns a completed pooled request to the pool.
func (r *Request) recycle() {
	if !r.pooled || !r.fin.Load() {
		return
	}
	*r = Request{}
	requestPool.Put(r)
}

// Test reports whether the request has completed, without blocking; it makes
// one progress pass first in direct mode.
func (r *Request) Test() (bool, Status, error) {
	if r.deferred != nil && !r.fin.Load() {
		r.t.startDeferred(r.deferred)
	}
	if !r.fin.Load() {
		r.t.testPass()
	}
	if !r.fin.Load() {
		return false, Status{}, nil
	}
	return true, r.status, r.err
}

// testPass is the progress a Test call makes: one pass of the worker in
// direct mode; in queue mode, with the overlap engine on, a nudge to the
// progress goroutine to start what the engine left for the receiver's next
// call (ovPoll), so that a poller is not left waiting for a transfer nobody
// starts.
func (t *Transport) testPass() {
	switch {
	case t.opts.Progress == ProgressDirect:
		if t.ov != nil {
			t.mu.Lock()
			if !t.closed {
				t.ovEnter()
			}
			t.mu.Unlock()
		}
		t.progressOnce()
	case t.ov != nil:
		if t.entered.CompareAndSwap(false, true) {
			t.wake()
		}
	}
}

// Finished reports whether the request has completed, and its error, without
// progressing the worker: unlike Test it is safe inside an AMHandler.
func (r *Request) Finished() (bool, error) {
	if !r.fin.Load() {
		return false, nil
	}
	return true, r.err
}

// Done returns a channel closed when the request completes.
func (r *Request) Done() <-chan struct{} {
	if r.deferred != nil && !r.fin.Load() {
		r.t.startDeferred(r.deferred)
	}
	t := r.t
	t.mu.Lock()
	if r.done == nil {
		r.done = make(chan struct{})
		if r.fin.Load() {
			close(r.done)
		}
	}
	// A caller that selects on Done does not progress: work its call left
	// for the next progress call (the read of a same-host message that had
	// arrived, active messages to deliver; submitCall) is the progress
	// goroutine's now, which might otherwise sleep on the event fd until
	// its 100 ms timeout.
	wake := !r.fin.Load() && (len(t.cma.jobs) > 0 || len(t.amq) > 0)
	done := r.done
	t.mu.Unlock()
	if wake {
		t.wake()
	}
	return done
}

// spinWait progresses the worker (direct mode) or yields (queue mode) until
// done reports true or WaitSpin has passed, and reports done. While it
// spins the progress goroutine stands aside.
func (t *Transport) spinWait(done func() bool) bool {
	start := time.Now()
	deadline := start.Add(t.opts.WaitSpin)
	t.spinners.Add(1)
	t.flushDeferred(nil, 0) // this goroutine is about to wait: what it may wait for must run
	i := 0
	// Only a waiter that spun a while has the progress goroutine woken when
	// it leaves (spinDone); i counts the passes, and the clock is read only
	// after 16.
	defer func() { t.spinDone(i >= 16 && time.Since(start) >= longSpin) }()
	handed := false
	for ; !done(); i++ {
		if handed && (t.spinners.Load() > 1 || t.parked.Load() > 0) {
			// The last pass handed something to another goroutine (a
			// request it completed, an active message) while other
			// waiters are about: the goroutine it woke was queued on this
			// goroutine's P, where it would wait for this spin's next
			// yield (up to 64 passes on) with its bytes already landed.
			// Hand it the P now, as the progress goroutine does. Only
			// then: a lone caller in a loop of its own gains nothing from
			// the yield.
			// GPU Messaging API, 128 KiB: 110 -> 61 us (docs/gpu.md).
			runtime.Gosched()
		}
		if t.opts.Progress == ProgressDirect {
			_, handed = t.progressHandled()
		}
		if i&63 == 63 {
			// Goroutines made runnable on this P (the one an Isend started,
			// say) would otherwise wait for the spin to end.
			runtime.Gosched()
		}
		if i&15 == 15 {
			// The progress goroutine stands aside for this spin: start
			// the deferred requests made meanwhile as it would.
			t.flushDeferred(nil, deferGrace)
			if time.Now().After(deadline) {
				return done()
			}
		}
	}
	return true
}

// spinDone ends a spinWait. The last spinner out calls back a progress
// goroutine that stands aside for it: otherwise nobody would progress the
// worker until its millisecond timer fired (late, in an idle process), and
// a message arriving meanwhile would wait for it. From the 50 us nap of
// the in-flight case it is called back only by a waiter that spun for
// longSpin or more (long) and leaves nobody to progress: somebody is
// parked, or nothing is in flight (a receive still posted means the
// caller is in a loop of Waits and will be back).
func (t *Transport) spinDone(long bool) {
	if t.spinners.Add(-1) != 0 {
		return
	}
	if long && t.aside.napping() && (t.parked.Load() > 0 || !t.inFlight()) {
		t.aside.wake()
	}
	if t.asideLong.Load() {
		select {
		case t.kick <- struct{}{}:
		default:
		}
	}
}

// inFlight reports whether operations are in flight that the progress
// goroutine could move: UCX requests, CMA sends waiting for their
// acknowledgement, any-source receives waiting for a message (as an exact
// receive waits in UCX), receives in the overlap engine's table.
func (t *Transport) inFlight() bool {
	t.mu.Lock()
	defer t.mu.Unlock()
	return len(t.ops) > 0 || len(t.cma.sends) > 0 || t.wild.n > 0 || (t.ov != nil && len(t.ov.posted) > 0) || (t.w != nil && t.w.PostsInFlight() > 0)
}

// Await blocks until done is closed or ctx ends. In direct mode the caller
// progresses the worker itself for up to WaitSpin first, exactly as Wait
// does, so that a reply produced by another rank is picked up without
// waking the progress goroutine; then it parks. Runtimes built on the
// transport (actor requests) use it to wait for results that a message
// handler delivers.
func (t *Transport) Await(ctx context.Context, done <-chan struct{}) error {
	select {
	case <-done:
		return nil
	default:
	}
	if err := t.waitInHandler("await", -1, 0); err != nil {
		return err
	}
	if t.awaitSpin(done) {
		return nil
	}
	t.park()
	defer t.parked.Add(-1)
	select {
	case <-done:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}

// AwaitFor is Await with a timeout in place of a context: it reports
// whether done closed within about d (never less). It makes a timer only
// when it parks, so a quick answer costs none; a request-response runtime
// waits this way for every reply.
func (t *Transport) AwaitFor(done <-chan struct{}, d time.Duration) bool {
	start := time.Now()
	select {
	case <-done:
		return true
	default:
	}
	if t.waitInHandler("await", -1, 0) != nil {
		return false // the wait could never end (ErrInHandler)
	}
	if t.awaitSpin(done) {
		return true
	}
	t.park()
	defer t.parked.Add(-1)
	timer := time.NewTimer(d - time.Since(start))
	defer timer.Stop()
	select {
	case <-done:
		return true
	case <-timer.C:
		return false
	}
}

// awaitSpin is Await's first phase: it progresses (direct mode) or spins
// for up to WaitSpin, and reports whether done closed meanwhile.
func (t *Transport) awaitSpin(done <-chan struct{}) bool {
	return t.spinWait(func() bool {
		select {
		case <-done:
			return true
		default:
			return false
		}
	})
}

// ExpectReply tells the progress goroutine that the caller waits for a
// message another rank will send soon (an acknowledgement, a reply) without
// progressing the worker itself: until the returned function is called, the
// progress goroutine keeps polling for up to a millisecond after its last
// activity instead of sleeping on the worker's event fd, as it does for a
// parked Wait. Waking a sleeping progress goroutine costs tens to hundreds
// of microseconds on a virtual machine (docs/gpu.md).
func (t *Transport) ExpectReply() (done func()) {
	t.park()
	var once sync.Once
	return func() { once.Do(func() { t.parked.Add(-1) }) }
}

// Wait blocks until the request completes or ctx ends. A receive is cancelled
// when ctx ends (unless it completed first) and reports ctx's error; a send,
// put or get cannot be recalled: Wait returns ctx's error while the operation
// goes on, and its buffer stays in use until Done is closed.
func (r *Request) Wait(ctx context.Context) (Status, error) {
	return r.wait(ctx, true)
}

// wait is Wait; a receive whose ctx ends is cancelled if cancel is set,
// else left posted (as a send is left in flight).
func (r *Request) wait(ctx context.Context, cancel bool) (Status, error) {
	if r.fin.Load() {
		return r.status, r.err
	}
	t := r.t
	// Not r.peer: an any-source receive's changes meanwhile.
	if err := t.waitInHandler(r.op, -1, 0); err != nil {
		return Status{}, err // the operation goes on
	}
	if t.waitDeferred(r, ctx) {
		return r.status, r.err
	}
	if t.spinWait(r.fin.Load) {
		return r.status, r.err
	}
	done := r.Done()
	t.park() // the progress goroutine takes over while this goroutine parks
	select {
	case <-done:
		t.parked.Add(-1)
		return r.status, r.err
	case <-ctx.Done():
	}
	t.parked.Add(-1)
	if !r.recv || !cancel {
		return Status{}, fmt.Errorf("transport: %s rank %d tag %d: %w (operation still in flight)", r.op, r.peer, r.tag, ctx.Err())
	}
	// The cancellation may run on the progress goroutine (queue mode),
	// where it reads r after r completes: the caller may recycle r only
	// once it is over.
	cancelled := make(chan struct{})
	t.exec(func() {
		t.cancelRecv(r, ctx.Err())
		close(cancelled)
	})
	t.wake()
	<-cancelled
	<-done
	return r.status, r.err
}

// finish completes r with a UCX status; the worker lock is held.
func (t *Transport) finish(r *Request, st ucx.Status, length int) {
	if r.ov != nil && t.ov != nil && t.ovFinish(r, st) {
		return
	}
	if r.cma != nil && t.cmaSendFinished(r, st) {
		return
	}
	switch {
	case st == ucx.StatusOK:
		if r.recv {
			r.status = Status{Source: r.peer, Tag: r.tag, Size: length}
		}
	case st == ucx.StatusCanceled && r.failErr != nil:
		r.err = r.failErr
		if r.recv {
			t.cancelledSeq(r)
		}
	case st == ucx.StatusTruncated:
		r.status = Status{Source: r.peer, Tag: r.tag, Size: length}
		r.err = &TruncatedError{Source: r.peer, Tag: r.tag, Size: length, BufLen: r.bufLen}
	default:
		if p := t.peerOf(r.peer); p != nil && p.lost != nil {
			r.err = &PeerLostError{Rank: r.peer, Op: r.op, Reason: p.lost.Reason}
		} else if r.failErr != nil {
			r.err = r.failErr
		} else {
			r.err = fmt.Errorf("transport: %s rank %d: %w", r.op, r.peer, &ucx.Error{Op: r.op, Status: st})
		}
	}
	t.complete(r)
}

// complete marks r done; the worker lock is held.
func (t *Transport) complete(r *Request) {
	if r.fin.Load() {
		return
	}
	if r.err == nil {
		t.traffic.countCompleted(r)
	}
	if r.cma != nil {
		t.cmaSendComplete(r.cma) // withdraws the message unless acknowledged
	}
	if r.amov != nil {
		t.amDone(r.amov)
		r.amov = nil
	}
	if r.pinned {
		r.pin.Unpin()
		r.pinned = false
	}
	if r.iov != nil {
		r.iov.Free()
		r.iov = nil
	}
	r.b, r.pins = ucx.Buffer{}, nil
	if r.counter != nil {
		r.counter.leave(r)
		r.counter = nil
	}
	if p := t.peerOf(r.peer); p != nil {
		delete(p.pending, r)
	}
	r.ureq = ucx.Request{}
	// Once fin is set the waiter may return and recycle r: read done first.
	done := r.done
	r.fin.Store(true)
	if done != nil {
		close(done)
	}
}

// fail completes r with err; the worker lock is held.
func (t *Transport) fail(r *Request, err error) {
	r.err = err
	t.complete(r)
}

// track records an in-flight UCX request for r and pins what it uses (pins,
// or else r's own buffer); the worker lock is held.
func (t *Transport) track(r *Request, ureq ucx.Request, pins ...unsafe.Pointer) {
	r.ureq = ureq
	if len(pins) == 0 {
		pins = r.pins
	}
	if len(pins) == 0 && r.b.Ptr != nil {
		r.pin.Pin(r.b.Ptr)
		r.pinned = true
	}
	for _, p := range pins {
		if p != nil {
			r.pin.Pin(p)
			r.pinned = true
		}
	}
	t.ops[ureq] = r
	if t.asideLong.Load() {
		select {
		case t.kick <- struct{}{}:
		default:
		}
	}
	if r.peer < 0 {
		return // not tied to one peer (an active message's data)
	}
	if p := t.peers[r.peer]; p != nil {
		p.pending[r] = struct{}{}
	}
}

// settle finishes starting r after its UCX call: an error fails r, an
// immediate completion completes it, and an operation in flight is tracked
// with pins pinned. The worker lock is held.
func (t *Transport) settle(r *Request, ureq ucx.Request, err error, pins ...unsafe.Pointer) {
	switch {
	case err != nil:
		t.fail(r, fmt.Errorf("transport: %s rank %d: %w", r.op, r.peer, err))
	case !ureq.Pending():
		t.complete(r)
	default:
		t.track(r, ureq, pins...)
	}
}

// peerLocked returns the peer, connecting on first use; the worker lock is held.
func (t *Transport) peerLocked(rank int, op string) (*peer, error) {
	if t.closed {
		return nil, fmt.Errorf("transport: %s rank %d: %w", op, rank, ErrClosed)
	}
	p := t.peerRecord(rank)
	if p.lost != nil {
		return nil, &PeerLostError{Rank: rank, Op: op, Reason: p.lost.Reason}
	}
	if p.ep == nil {
		ep, err := t.w.Connect(t.addrs[rank], true)
		if err != nil {
			return nil, fmt.Errorf("transport: connecting to rank %d: %w", rank, err)
		}
		p.ep = ep
		t.epOwner[ep.Handle()] = rank
	}
	return p, nil
}

// peerRecord returns rank's peer record, creating it (unconnected) on
// first use; the worker lock is held.
func (t *Transport) peerRecord(rank int) *peer {
	p := t.peers[rank]
	if p == nil {
		p = &peer{rank: rank, pending: map[*Request]struct{}{}, rkeys: map[string]*ucx.Rkey{}, ncRkeys: map[string]*ucx.Rkey{}}
		t.peers[rank] = p
	}
	return p
}

// peerFailed declares rank lost and fails everything pending on it; the
// worker lock is held.
func (t *Transport) peerFailed(rank int, reason string) {
	p := t.peers[rank]
	if p == nil || p.lost != nil {
		return
	}
	p.lost = &PeerLostError{Rank: rank, Op: "endpoint", Reason: reason}
	t.bundleDrop(p)
	t.log.Warn("peer lost", zap.Int("peer", rank), zap.String("reason", reason))
	for r := range p.pending {
		r.failErr = &PeerLostError{Rank: rank, Op: r.op, Reason: reason}
		if r.recv && r.ureq.Pending() {
			t.w.Cancel(r.ureq)
		}
	}
	t.cmaPeerLost(rank, &PeerLostError{Rank: rank, Op: "send", Reason: reason})
	p.destroyRkeys()
	p.rkeys, p.ncRkeys = map[string]*ucx.Rkey{}, map[string]*ucx.Rkey{}
	if v, ok := noncontigs.Load(t); ok { // its window keys will not be used again
		nc := v.(*noncontig)
		nc.mu.Lock()
		delete(nc.remote, rank)
		nc.mu.Unlock()
	}
	if t.ov != nil {
		t.ovPeerLost(rank, reason)
	}
	if p.ep != nil {
		delete(t.epOwner, p.ep.Handle())
		if req, err := t.w.CloseEndpoint(p.ep, true); err == nil && req.Pending() {
			t.ops[req] = nil
		}
		p.ep = nil
	}
	if t.arrival != nil {
		// Probes parked until something arrives look again and report
		// the loss: a peer never connected has no endpoint whose failure
		// or closing would queue an event to wake them.
		close(t.arrival)
		t.arrival = nil
	}
	ev := PeerEvent{Rank: rank, Reason: reason}
	for _, ch := range t.lostSubs {
		select {
		case ch <- ev:
		default:
		}
	}
}

// rendezvousLost is the bootstrapper's report that rank is lost
// (bootstrap.LossNotifier): the peer fails as it does when its endpoint
// fails, whether or not one was ever connected. It runs on the
// bootstrapper's reading goroutine and does not wait for the progress
// goroutine (in queue mode it leaves the work to it).
func (t *Transport) rendezvousLost(rank int, reason string) {
	if rank < 0 || rank >= t.size || rank == t.rank {
		return
	}
	reason = "rendezvous: " + reason
	done := false
	t.exec(func() {
		if t.closed {
			return
		}
		t.peerRecord(rank)
		t.peerFailed(rank, reason)
		done = true
	})
	if t.opts.Progress != ProgressQueue && done { // queue mode: done is the progress goroutine's
		// Direct mode: receives the loss cancelled complete on the
		// progress goroutine's next pass; it may be asleep.
		t.wake()
	}
}

func (t *Transport) checkRank(rank int, op string) error {
	if rank < 0 || rank >= t.size {
		return fmt.Errorf("%w: %s: rank %d outside job of %d ranks", ErrInvalid, op, rank, t.size)
	}
	return nil
}

func checkTag(tag int, op string) error {
	if tag < 0 || tag > MaxUserTag {
		return fmt.Errorf("%w: %s: tag %d outside 0..%d", ErrInvalid, op, tag, MaxUserTag)
	}
	return nil
}

// Close fails pending operations with ErrClosed, closes endpoints (flushing
// what is in flight, for at most a second), stops the progress goroutine and
// releases UCX. It is safe to call twice.
func (t *Transport) Close() error {
	if err := t.waitInHandler("close", -1, 0); err != nil {
		return err // it would wait for the progress goroutine, which runs the handler
	}
	t.flushDeferred(nil, 0) // they fail with ErrClosed as started ones do
	// Device imports use no UCX: wait for those in flight and close their
	// mappings first.
	if err := t.dimp.close(); err != nil {
		t.log.Warn("closing CUDA IPC device imports", zap.Error(err))
	}
	if err := t.ctyped.close(); err != nil {
		t.log.Warn("closing typed channel staging", zap.Error(err))
	}
	t.mu.Lock()
	if t.closed {
		t.mu.Unlock()
		<-t.closeDone // a Close running meanwhile: returns when it is done
		return nil
	}
	t.closed = true
	defer close(t.closeDone)
	if t.arrival != nil { // probes waiting for an arrival look again, and find the transport closed
		close(t.arrival)
		t.arrival = nil
	}
	closeLocalChannels(t)
	t.wildClose()
	if t.ov != nil {
		t.ovClose()
	}
	t.cmaClose()
	// A receive that has matched a rendezvous goes on after Cancel, and its
	// protocol state hangs on the sender's endpoint: destroying the worker
	// with it there aborts the process (ucp_ep_destroy_base asserts the
	// endpoint's request list is empty), and the peer, closing too, may
	// never finish it. Those endpoints are closed by force, which fails
	// the receive instead (an any-source one forces them all).
	forced := make(map[int]bool)
	forceAll := false
	var fetches []*Request
	for _, r := range t.ops {
		if r != nil && r.op == amRecvOp && r.ureq.Pending() {
			// An active message's data fetch (RecvData) hangs on an
			// endpoint UCX made for the sender's, which Close cannot
			// force: it must end before the worker goes (below).
			r.failErr = fmt.Errorf("transport: %s: %w", r.op, ErrClosed)
			if !t.w.CancelNow(r.ureq) && r.ureq.Status() == ucx.StatusInProgress {
				fetches = append(fetches, r)
			}
			continue
		}
		if r != nil && r.recv && r.ureq.Pending() {
			r.failErr = fmt.Errorf("transport: %s rank %d: %w", r.op, r.peer, ErrClosed)
			if !t.w.CancelNow(r.ureq) && r.ureq.Status() == ucx.StatusInProgress {
				if r.peer >= 0 {
					forced[r.peer] = true
				} else {
					forceAll = true
				}
			}
		}
	}
	t.bundlesFlush(true) // posted before Close: they leave with the rest
	var closing []ucx.Request
	for _, p := range t.peers {
		if p == nil || p.ep == nil {
			continue
		}
		p.destroyRkeys()
		p.rkeys, p.ncRkeys = nil, nil
		delete(t.epOwner, p.ep.Handle())
		// Flush what was posted, unless sends to the peer, or a matched
		// receive from it, are still in flight: a rendezvous send its peer
		// has not taken would outlive the flush, and UCX aborts the
		// process when the worker is destroyed with it (an assertion in
		// ucp_ep_destroy_base). Those are discarded instead; Close fails
		// them below.
		force := forceAll || forced[p.rank]
		for r := range p.pending {
			if !r.recv {
				force = true
				r.failErr = fmt.Errorf("transport: %s rank %d: %w", r.op, r.peer, ErrClosed)
			}
		}
		if req, err := t.w.CloseEndpoint(p.ep, force); err == nil && req.Pending() {
			t.ops[req] = nil
			closing = append(closing, req)
		}
		p.ep = nil
	}
	t.mu.Unlock()
	deadline := time.Now().Add(time.Second)
	fetching := 0 // fetches still in flight
	for time.Now().Before(deadline) {
		t.mu.Lock()
		left := 0
		for _, req := range closing {
			if _, ok := t.ops[req]; ok {
				left++
			}
		}
		fetching = 0
		for _, r := range fetches {
			if t.ops[r.ureq] == r {
				fetching++
			}
		}
		t.mu.Unlock()
		if left == 0 && fetching == 0 {
			break
		}
		t.progressOnce()
	}
	t.stopping.Store(true)
	t.wake()
	_ = t.w.Signal()
	<-t.loopDone
	t.mu.Lock()
	defer t.mu.Unlock()
	// Calls still queued (queue mode) see the transport closed and fail
	// their requests; later ones run at once (submitCall).
	t.loopGone = true
	for _, c := range t.submit {
		c.run(t)
	}
	t.submit = nil
	for req, r := range t.ops {
		if r != nil {
			t.fail(r, fmt.Errorf("transport: %s rank %d: %w", r.op, r.peer, ErrClosed))
		}
		delete(t.ops, req)
	}
	t.reg.closeAll()
	for evs := t.w.Drain(); len(evs) > 0; evs = t.w.Drain() {
		for i := range evs {
			evs[i].Discard(t.w)
		}
	}
	for _, e := range t.amq {
		e.Discard(t.w)
	}
	t.amq = nil
	t.postFailed = t.w.PostFailed()
	t.sigMu.Lock()
	t.sigW = nil
	t.sigMu.Unlock()
	if fetching > 0 {
		// UCX aborts the process when a worker is destroyed with a data
		// fetch still on an endpoint (ucp_ep_destroy_base asserts its
		// request list is empty): a sender that made no progress for a
		// second leaves the worker behind, unprogressed, instead.
		t.log.Warn("closing with active-message data fetches in flight: the UCX worker is left, not destroyed", zap.Int("fetches", fetching))
		t.w = nil
		return nil
	}
	t.w.Close()
	t.ctx.Close()
	t.w = nil
	return nil
}
