package actor

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"log/slog"
	"math"
	"os"
	"reflect"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"
	"unsafe"

	pa "github.com/asynkron/protoactor-go/actor"
	"go.uber.org/zap"
	"go.uber.org/zap/exp/zapslog"

	"github.com/troupe-hpc/troupe/datatype"
	"github.com/troupe-hpc/troupe/gpu"
	"github.com/troupe-hpc/troupe/transport"
	"github.com/troupe-hpc/troupe/transport/bootstrap"
	"github.com/troupe-hpc/troupe/transport/metrics"
)

// ErrClosed is returned by calls on a runtime that has shut down.
var ErrClosed = errors.New("actor: runtime shut down")

// ShutdownError is Shutdown's error when its context ended while the data
// of messages already received was still on its way (a transfer a faulty
// peer announced and never sent): Shutdown cancelled those receives, and
// their messages went to the dead letters as undeliverable.
type ShutdownError struct {
	Abandoned int   // transfers given up
	Err       error // the context's error
}

// Error says how many transfers were abandoned, and why.
func (e *ShutdownError) Error() string {
	return fmt.Sprintf("actor: shutdown: %d incoming transfer(s) abandoned: %v", e.Abandoned, e.Err)
}

// Unwrap returns the context's error.
func (e *ShutdownError) Unwrap() error { return e.Err }

// Active message ids the runtime uses on the transport.
const (
	amActor  uint16 = 0x41 // one actor message
	amCredit uint16 = 0x42 // eager credits returned to a sender
)

// DefaultCredits is the default per-peer eager credit window, in units: a
// message costs 1 unit plus 1 per CreditBytes of body and payload.
const DefaultCredits = 16384

// CreditBytes is how many message bytes cost one extra credit unit.
const CreditBytes = 512

// DefaultSpin is how long an actor rank's progress goroutine keeps polling
// after its last activity before it sleeps on the worker's event fd. Actor
// traffic has no waiter that progresses the worker itself (unlike a blocking
// Recv), so the progress goroutine is what answers the next message: polling
// a little longer than a round trip keeps request/response exchanges off the
// event-fd wake-up path, and an idle rank still sleeps.
const DefaultSpin = 200 * time.Microsecond

// defaultThroughput is how many messages a mailbox processes before it
// yields, protoactor's default.
const defaultThroughput = 300

// EnvSpin overrides DefaultSpin (a Go duration, for example "500us"). The
// launcher sets it for jobs with more ranks than processors
// (bootstrap.OversubscribedSpin).
const EnvSpin = bootstrap.EnvSpin

// Options configure a Runtime.
type Options struct {
	// Transport is an existing transport to run on (for example one of
	// transport.StartLocal's). Nil: Init joins the job described by the
	// environment (the embedded launcher's, or PMIx) and owns the transport.
	Transport *transport.Transport
	// TransportOptions configure the transport Init creates (Bootstrap and
	// Log are filled in when nil).
	TransportOptions transport.Options
	// Credits is the per-peer eager credit window (default DefaultCredits).
	// It bounds what a receiving rank holds for messages its actors have not
	// processed yet: about Credits x CreditBytes bytes per sending rank.
	// Ranks may use different windows: each sends to a rank within that
	// rank's window (learnt at start). Values below 4 count as 4.
	Credits int
	// Log receives the runtime's logs and protoactor's (nil: TROUPE_LOG).
	Log *zap.Logger
	// Device is where gpu.Buffer message fields land when the receiving
	// actor names no buffer (nil: device 0 of gpu.Default()).
	Device *gpu.Device
	// TypedDirectMin is the packed size from which a message's Typed field
	// goes through the transport's typed-transfer protocol (pipelined pack,
	// scatter-gather or zero-copy windows, chosen per layout) instead of
	// being packed into the active message (0: DefaultTypedDirectMinCMA
	// to ranks in other processes of this host that large messages reach
	// by same-host zero copy, transport.Transport.CMAPeer, and
	// DefaultTypedDirectMin to the others; negative: never). See Typed.
	TypedDirectMin int
	// TypedScheme forces the typed-transfer scheme of Typed fields that go
	// by the protocol, on this rank's side (SchemeAuto: the transport's
	// default, normally the layout-aware adaptive scheme; the receiver has
	// the last word, see transport.TypedOptions).
	TypedScheme datatype.Scheme
	// SenderDriven leaves the data of messages from transport.PullMin up to
	// the transport's CMA threshold (64 KiB) to UCX's rendezvous, as for
	// tagged sends. By default a process of the same host reads it
	// (transport.AMPull), because UCX's rendezvous moves the data only
	// while the sender progresses, and an actor that computes after
	// sending holds up every receiver of its messages. Sender-driven
	// transfers give shorter round trips at those sizes (docs/actor.md,
	// "Receiver-driven large messages"). TROUPE_ACTOR_PULL=off sets it.
	SenderDriven bool
	// EagerMax is the largest message (header and data) above
	// transport.MaxPostAM that goes eager when it is sparse: when the
	// previous large message to the same rank left at least EagerGap
	// before. UCX copies it through at once, so it moves whatever either
	// side does next, and the receiver is spared the pull's read and
	// acknowledgement (an 18 KiB round trip 22-25 -> 14 us). A dense
	// stream of large messages is pulled (or sender-driven) instead: each
	// eager one costs its receiver a reassembly and two copies, and a flood
	// of them ran at half the rate (docs/actor.md, "Sparse large messages
	// go eager"). 0 means DefaultEagerMax, a negative value turns it off;
	// TROUPE_ACTOR_EAGER_MAX sets it for Init's runtime.
	EagerMax int
	// MetricsAddr, host:port, makes the rank serve its counters (the
	// transport's and the runtime's, Collector) as Prometheus metrics at
	// http://host:port+rank/metrics until Shutdown; port 0 lets the
	// system choose a port for each rank (MetricsURL tells which). Empty:
	// the environment's TROUPE_METRICS_ADDR (metrics.AddrEnv), and no
	// endpoint without it. Init fails if the address cannot be listened
	// on (docs/metrics.md).
	MetricsAddr string
}

// DefaultEagerMax is the default Options.EagerMax: 32 KiB.
const DefaultEagerMax = 32 << 10

// EagerGap is how long after the previous large message to a rank a large
// message of at most Options.EagerMax bytes goes eager.
const EagerGap = 8 * time.Microsecond

// EnvActorEagerMax sets Options.EagerMax for Init's runtime (bytes; 0 or
// negative: off).
const EnvActorEagerMax = "TROUPE_ACTOR_EAGER_MAX"

// EnvActorPull, set to "off", makes Init's runtime SenderDriven.
const EnvActorPull = "TROUPE_ACTOR_PULL"

// DefaultTypedDirectMin is the default Options.TypedDirectMin toward ranks
// on other hosts, on this one without same-host zero copy, or in this
// process: there the protocol's extra round trip (or, in one process, its
// goroutines competing with the other rank's for the Ps) costs more than
// packing the field into the active message up to about this size
// (docs/noncontig.md).
const DefaultTypedDirectMin = 256 << 10

// DefaultTypedDirectMinCMA is the default Options.TypedDirectMin toward
// ranks in other processes of this host that large messages reach by
// cross-memory attach (transport.Transport.CMAPeer): from here the
// protocol's pipelined pack beats one whole-field pack, a copy and an
// unpack (docs/noncontig.md).
const DefaultTypedDirectMinCMA = 32 << 10

// Runtime is one rank's actor system: a protoactor-go ActorSystem whose
// address names the rank, with every other rank's actors reachable through
// UCX active messages.
type Runtime struct {
	sys     *pa.ActorSystem
	t       *transport.Transport
	ownT    bool
	rank    int
	size    int
	log     *zap.Logger
	addrs   []string
	credits int
	// typedMin is Options.TypedDirectMin resolved (math.MaxInt64: never)
	// and typedMinCMA the same toward CMA peers, typedScheme
	// Options.TypedScheme; SetTypedTransfer changes them.
	typedMin    atomic.Int64
	typedMinCMA atomic.Int64
	typedScheme atomic.Int32

	remotes  []*remoteProcess
	out      []*outPeer
	in       []*inPeer
	unitHdrs map[unsafe.Pointer]*inPeer // each in[r].hdr, by the map's identity (creditMiddleware)
	local    sync.Map                   // actor id -> *localActor, for actors spawned with Props
	// mailboxes holds the mailbox of each actor spawned with Props, by the
	// actor's own *pa.PID, from its registration (mailbox.RegisterHandlers)
	// until it stops: a stopping actor finds its own mailbox here even when
	// a new actor of the same name already holds the name's record in local
	// (trackMiddleware).
	mailboxes sync.Map
	// stoppedHook, when set (by tests, before any actor is spawned), runs
	// on a stopping actor's goroutine after protoactor has freed its name
	// and before the runtime handles its Stopped.
	stoppedHook func(pid *pa.PID)

	// The delivering goroutine writes these per message: they keep to
	// cache lines of their own, away from the fields actors' goroutines
	// read per message (in, size).
	_        [cacheLine]byte
	targets  targetCache
	lastType struct { // the codec onMessage looked up last (delivering goroutine only)
		id uint32
		ct *codecType
	}
	_ [cacheLine]byte
	// localEpoch changes whenever one of the runtime's actors starts or stops:
	// processes cached in targets are trusted only within one epoch.
	localEpoch atomic.Uint64
	dispatcher *poolDispatcher // runs the mailboxes of actors spawned with Props

	reqMu  sync.Mutex
	reqs   map[string]pendingRequest // pending remote requests by reply id
	nreqs  atomic.Int64
	reqSeq atomic.Uint64 // numbers Request's reply ids
	// Set by tests only, before any request: requestTimedOut runs when a
	// Request to another rank has timed out, before it withdraws from the
	// request table; answerHeld runs when a device message answering a
	// future (a process not the runtime's) was found, before it is handed
	// over.
	requestTimedOut func(rp *replyProcess)
	answerHeld      atomic.Pointer[func(target *pa.PID)]

	watchMu sync.Mutex
	watches []map[watchKey]*pa.PID // per rank: remote watchee + local watcher

	devSends   deviceSends   // CUDA IPC device messages awaiting acknowledgement
	pairs      pairChannels  // where large gpu.Buffer fields travel (device_pair.go)
	large      largeSends    // buffers of large messages in flight (largesend.go)
	amMode     uint32        // how large messages are sent (Options.SenderDriven)
	eagerMax   int           // Options.EagerMax, resolved (0: off)
	devResends deviceResends // declined CUDA IPC device messages awaiting their bytes
	devOnce    sync.Once
	dev        *gpu.Device
	devErr     error

	closed   atomic.Bool
	stop     chan struct{}
	lost     chan struct{} // closed when the first rank is lost (Lost)
	lostOnce sync.Once
	lostErr  error // that rank's *transport.PeerLostError, set before lost closes
	bg       sync.WaitGroup
	stats    Stats
	metrics  *metrics.Server // Options.MetricsAddr's endpoint, or nil
	shutOnce sync.Once
	// recvCtx is the context of the goroutines receiving the data of
	// messages already taken (inPeer.await); Shutdown cancels it
	// (recvCancel) when its own context ends first, and abandoned counts
	// the receives that cancellation ended.
	recvCtx    context.Context
	recvCancel context.CancelFunc
	abandoned  atomic.Int64
}

// Stats are the runtime's counters.
type Stats struct {
	Sent       atomic.Uint64 // actor messages sent to other ranks
	Received   atomic.Uint64 // actor messages received from other ranks
	Rendezvous atomic.Uint64 // received messages whose data came by rendezvous
	// Of those, the overlap engine's decisions (docs/overlap.md, section 7):
	DataPrefetched atomic.Uint64 // data moved at arrival, taken later by the actor
	DataOnloaded   atomic.Uint64 // data moved by the actor's goroutine when it took the message
	HookLanded     atomic.Uint64 // payloads landed in hook-provided memory
	DeviceLanded   atomic.Uint64 // gpu.Buffer fields landed in device memory
	DeviceIPC      atomic.Uint64 // of those, copied from the sender's memory by CUDA IPC
	DeviceIPCSent  atomic.Uint64 // gpu.Buffer fields sent as CUDA IPC descriptors
	DevicePair     atomic.Uint64 // gpu.Buffer fields landed from the pair channel (device_pair.go)
	DevicePairSent atomic.Uint64 // gpu.Buffer fields sent on the pair channel
	// DeviceIPCDeclined counts CUDA IPC descriptors this rank could not
	// take (its landing memory, or its driver, refused) and received the
	// bytes of instead; DeviceIPCResent the bytes this rank sent for
	// descriptors a receiver declined.
	DeviceIPCDeclined atomic.Uint64
	DeviceIPCResent   atomic.Uint64
	// DeviceRejected counts device messages this rank sent without a
	// sender actor that could not land on their receiver (device_reject.go).
	DeviceRejected atomic.Uint64
	TypedUnpacked  atomic.Uint64 // Typed fields unpacked into PostReceiveTyped buffers
	TypedSent      atomic.Uint64 // Typed fields sent by the typed-transfer protocol
	TypedReceived  atomic.Uint64 // Typed fields received by the typed-transfer protocol
	// TypedDevicePacked counts Typed fields in device memory packed for
	// sending (Typed.Dev).
	TypedDevicePacked atomic.Uint64
	DeadLetters       atomic.Uint64 // undeliverable received messages
	CreditWaits       atomic.Uint64 // sends that waited for credits
	CreditsBack       atomic.Uint64 // credit messages sent back to senders
	DecodeErrors      atomic.Uint64 // malformed envelopes or bodies received
	// LargeReused counts messages larger than transport.MaxPostAM encoded
	// into the buffer of an earlier one whose send had completed.
	LargeReused atomic.Uint64
	// LargeEager counts messages larger than transport.MaxPostAM sent
	// eager because they were sparse (Options.EagerMax).
	LargeEager    atomic.Uint64
	WatchesByLoss atomic.Uint64 // Terminated messages generated for lost ranks
}

// Address returns the actor-system address of rank r.
func Address(r int) string { return "rank/" + strconv.Itoa(r) }

// rankOf parses an address made by Address.
func rankOf(addr string) (int, bool) {
	s, ok := strings.CutPrefix(addr, "rank/")
	if !ok {
		return 0, false
	}
	r, err := strconv.Atoi(s)
	return r, err == nil && r >= 0
}

// Init joins the job and starts this rank's runtime. Every rank calls Init;
// it returns once every rank can receive actor messages.
func Init(ctx context.Context, opts Options) (*Runtime, error) {
	if opts.TypedScheme > datatype.SchemeZCopy {
		return nil, fmt.Errorf("actor: Options.TypedScheme %d", opts.TypedScheme)
	}
	t, own := opts.Transport, false
	if t == nil {
		to := opts.TransportOptions
		if to.Bootstrap == nil {
			b, err := bootstrap.FromEnv(ctx)
			if err != nil {
				return nil, fmt.Errorf("actor: joining the job: %w", err)
			}
			to.Bootstrap = b
		}
		if to.Log == nil {
			to.Log = opts.Log
		}
		if to.Spin == 0 {
			to.Spin = DefaultSpin
			if v := os.Getenv(EnvSpin); v != "" {
				d, err := time.ParseDuration(v)
				if err != nil || d <= 0 {
					return nil, fmt.Errorf("actor: %s=%q: want a positive duration such as 200us", EnvSpin, v)
				}
				to.Spin = d
			}
		}
		var err error
		if t, err = transport.New(ctx, to); err != nil {
			return nil, fmt.Errorf("actor: %w", err)
		}
		own = true
	}
	rt, err := start(ctx, t, opts)
	if err != nil && own {
		_ = t.Close()
		_ = t.Bootstrap().Close()
	}
	if rt != nil {
		rt.ownT = own
	}
	return rt, err
}

// StartLocal starts a job of n ranks inside this process (for tests and
// examples): n transports really talking through UCX, a runtime on each.
// The returned stop function shuts them all down.
func StartLocal(ctx context.Context, n int, opts Options) ([]*Runtime, func(), error) {
	ts, stopT, err := transport.StartLocal(ctx, n, opts.TransportOptions)
	if err != nil {
		return nil, nil, err
	}
	rts := make([]*Runtime, n)
	errs := make(chan error, n)
	for i := range ts {
		go func(i int) {
			o := opts
			o.Transport = ts[i]
			var err error
			rts[i], err = Init(ctx, o)
			errs <- err
		}(i)
	}
	var all []error
	for range ts {
		if err := <-errs; err != nil {
			all = append(all, err)
		}
	}
	stop := func() {
		var wg sync.WaitGroup
		for _, rt := range rts {
			if rt != nil {
				wg.Add(1)
				go func() {
					defer wg.Done()
					sctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
					defer cancel()
					_ = rt.Shutdown(sctx)
				}()
			}
		}
		wg.Wait()
		stopT()
	}
	if len(all) > 0 {
		stop()
		return nil, nil, errors.Join(all...)
	}
	return rts, stop, nil
}

func start(ctx context.Context, t *transport.Transport, opts Options) (*Runtime, error) {
	log := opts.Log
	if log == nil {
		log = transport.LoggerFromEnv()
	}
	rt := &Runtime{
		t:       t,
		rank:    t.Rank(),
		size:    t.Size(),
		log:     log.With(zap.Int("rank", t.Rank())),
		credits: opts.Credits,
		stop:    make(chan struct{}),
		lost:    make(chan struct{}),
		dev:     opts.Device,
		reqs:    map[string]pendingRequest{},
	}
	rt.recvCtx, rt.recvCancel = context.WithCancel(context.Background())
	if rt.credits <= 0 {
		rt.credits = DefaultCredits
	}
	_ = rt.SetTypedTransfer(opts.TypedDirectMin, opts.TypedScheme) // checked above
	rt.credits = min(max(rt.credits, 4), math.MaxInt32)
	rt.pairs.min = pairMin()
	rt.amMode = transport.AMAuto | transport.AMPull
	if opts.SenderDriven || os.Getenv(EnvActorPull) == "off" {
		rt.amMode = transport.AMAuto
	}
	rt.eagerMax = opts.EagerMax
	if v := os.Getenv(EnvActorEagerMax); v != "" {
		switch n, err := strconv.Atoi(v); {
		case err != nil:
			rt.log.Warn("ignoring "+EnvActorEagerMax, zap.String("value", v), zap.Error(err))
		case n > 0:
			rt.eagerMax = n
		default:
			rt.eagerMax = -1 // 0 from the environment means off
		}
	}
	switch {
	case rt.eagerMax == 0:
		rt.eagerMax = DefaultEagerMax
	case rt.eagerMax < 0:
		rt.eagerMax = 0
	}
	core := rt.log.Core()
	rt.sys = pa.NewActorSystem(pa.WithLoggerFactory(func(*pa.ActorSystem) *slog.Logger {
		return slog.New(zapslog.NewHandler(core, zapslog.WithName("protoactor")))
	}))
	rt.sys.ProcessRegistry.Address = Address(rt.rank)
	rt.targets = targetCache{addr: Address(rt.rank), m: map[string]*target{}}
	rt.dispatcher = newPoolDispatcher(defaultThroughput)
	rt.addrs = make([]string, rt.size)
	rt.remotes = make([]*remoteProcess, rt.size)
	rt.out = make([]*outPeer, rt.size)
	rt.in = make([]*inPeer, rt.size)
	rt.unitHdrs = make(map[unsafe.Pointer]*inPeer, rt.size)
	rt.watches = make([]map[watchKey]*pa.PID, rt.size)
	for r := 0; r < rt.size; r++ {
		rt.addrs[r] = Address(r)
		rt.remotes[r] = &remoteProcess{rt: rt, rank: r}
		rt.out[r] = newOutPeer(rt.credits)
		rt.in[r] = newInPeer(rt, r)
		rt.unitHdrs[reflect.ValueOf(rt.in[r].hdr).UnsafePointer()] = rt.in[r]
	}
	rt.sys.ProcessRegistry.RegisterAddressResolver(func(pid *pa.PID) (pa.Process, bool) {
		r, ok := rankOf(pid.Address)
		if !ok || r >= rt.size || r == rt.rank {
			return nil, false
		}
		return rt.remotes[r], true
	})
	// A Request's reply id is not in the process registry (requestPrefix):
	// an answer sent to it from this rank (the remote actor forwarded the
	// request to one here) reaches the dead letters, and goes on from there
	// to the waiting Request.
	rt.sys.EventStream.Subscribe(func(ev any) {
		if d, ok := ev.(*pa.DeadLetterEvent); ok && d.PID != nil && d.PID.Address == rt.addrs[rt.rank] {
			if rp := rt.takeReply(d.PID.Id); rp != nil {
				rp.SendUserMessage(d.PID, d.Message)
			}
		}
	})
	if err := t.SetAMHandler(amActor, rt.onMessage); err != nil {
		return nil, fmt.Errorf("actor: %w", err)
	}
	// Credits may be taken by a sending goroutine that progresses the
	// worker itself (transport.PostAM): onCredit only takes outPeer.mu,
	// which no sender holds while it sends.
	if err := t.SetInlineAMHandler(amCredit, rt.onCredit); err != nil {
		return nil, fmt.Errorf("actor: %w", err)
	}
	if err := t.SetInlineAMHandler(amDeviceAck, rt.onDeviceAck); err != nil {
		return nil, fmt.Errorf("actor: %w", err)
	}
	if err := t.SetAMHandler(amDeviceResend, rt.onDeviceResend); err != nil {
		return nil, fmt.Errorf("actor: %w", err)
	}
	if err := t.SetAMHandler(amDeviceBytes, rt.onDeviceBytes); err != nil {
		return nil, fmt.Errorf("actor: %w", err)
	}
	if err := t.SetAMHandler(amDeviceRejected, rt.onDeviceRejected); err != nil {
		return nil, fmt.Errorf("actor: %w", err)
	}
	lost := t.PeerLost()
	rt.bg.Add(1)
	go rt.watchPeers(lost)
	// The ranks tell each other their credit windows (and wait for each
	// other): a rank sends to another within the receiver's window.
	windows, err := t.Bootstrap().AllGather(ctx, "troupe.actor.init", binary.LittleEndian.AppendUint64(nil, uint64(rt.credits)))
	if err == nil {
		err = rt.setWindows(windows)
	}
	if err != nil {
		rt.abortStart()
		return nil, fmt.Errorf("actor: waiting for the other ranks: %w", err)
	}
	// After the barrier, so that a rank that cannot serve its metrics
	// fails alone instead of leaving the others waiting in it.
	if err := rt.serveMetrics(opts.MetricsAddr); err != nil {
		rt.abortStart()
		return nil, err
	}
	rt.log.Debug("actor runtime started", zap.Int("size", rt.size))
	return rt, nil
}

// setWindows sets the credit window of sends to each rank from the
// ranks' Options.Credits, as gathered at start (8 bytes each).
func (rt *Runtime) setWindows(windows [][]byte) error {
	if len(windows) != rt.size {
		return fmt.Errorf("credit windows of %d ranks gathered, want %d", len(windows), rt.size)
	}
	for r, b := range windows {
		if len(b) != 8 {
			return fmt.Errorf("rank %d's credit window is %d bytes long, want 8", r, len(b))
		}
		w := binary.LittleEndian.Uint64(b)
		if w < 4 || w > math.MaxInt32 {
			return fmt.Errorf("rank %d's credit window %d is out of range", r, w)
		}
		o := rt.out[r]
		o.mu.Lock()
		o.window, o.avail = int(w), int(w) // nothing was sent yet
		o.mu.Unlock()
	}
	return nil
}

// abortStart stops what start started, for a start that fails at its end.
func (rt *Runtime) abortStart() {
	rt.closed.Store(true)
	close(rt.stop)
	rt.dispatcher.close()
	rt.bg.Wait()
	rt.recvCancel()
}

// SetTypedTransfer changes Options.TypedDirectMin and Options.TypedScheme
// for the Typed fields sent and received from now on (for benchmarks that
// compare them in one job; both ranks of a transfer should agree).
func (rt *Runtime) SetTypedTransfer(directMin int, scheme datatype.Scheme) error {
	if scheme > datatype.SchemeZCopy {
		return fmt.Errorf("actor: Typed scheme %d", scheme)
	}
	m, near := int64(directMin), int64(directMin)
	switch {
	case m == 0:
		m, near = DefaultTypedDirectMin, DefaultTypedDirectMinCMA
	case m < 0:
		m, near = math.MaxInt64, math.MaxInt64
	}
	rt.typedMin.Store(m)
	rt.typedMinCMA.Store(near)
	rt.typedScheme.Store(int32(scheme))
	return nil
}

// Rank is this rank's number.
func (rt *Runtime) Rank() int { return rt.rank }

// Size is the number of ranks in the job.
func (rt *Runtime) Size() int { return rt.size }

// System is the rank's protoactor ActorSystem.
func (rt *Runtime) System() *pa.ActorSystem { return rt.sys }

// Root is the system's root context.
func (rt *Runtime) Root() *pa.RootContext { return rt.sys.Root }

// Transport is the transport the runtime runs on.
func (rt *Runtime) Transport() *transport.Transport { return rt.t }

// Logger is the runtime's zap logger (with the rank field).
func (rt *Runtime) Logger() *zap.Logger { return rt.log }

// Stats returns the runtime's counters.
func (rt *Runtime) Stats() *Stats { return &rt.stats }

// PID names actor id on rank r.
func (rt *Runtime) PID(r int, id string) *pa.PID { return pa.NewPID(Address(r), id) }

// RankOf returns the rank that hosts pid, or -1 if pid is not a troupe PID.
func RankOf(pid *pa.PID) int {
	if pid == nil {
		return -1
	}
	r, ok := rankOf(pid.Address)
	if !ok {
		return -1
	}
	return r
}

// Shutdown leaves the job: new sends fail with ErrClosed, messages already
// sent are flushed to their ranks, every rank waits for the others (so no
// rank tears down a worker a peer still sends to), local actors are stopped
// after processing what their mailboxes hold (children before their
// parents, which would drop what the children still hold), every rank waits for the
// others' actors to have stopped (they may still read message data from
// this rank until then) and, if the runtime owns its transport, UCX
// resources are released. ctx bounds the waits for the other ranks and
// for the data of messages already received: if it ends while such data
// is still on its way, those receives are cancelled and Shutdown returns
// a *ShutdownError (docs/actor.md).
func (rt *Runtime) Shutdown(ctx context.Context) error {
	var err error
	rt.shutOnce.Do(func() { err = rt.shutdown(ctx) })
	return err
}

func (rt *Runtime) shutdown(ctx context.Context) error {
	var errs []error
	rt.closed.Store(true)
	for r, o := range rt.out {
		o.close(ErrClosed)
		if r != rt.rank && o.used.Load() && !rt.lostRank(r) {
			if err := rt.t.Flush(ctx, r); err != nil && !errors.Is(err, transport.ErrPeerLost) {
				errs = append(errs, fmt.Errorf("actor: flushing to rank %d: %w", r, err))
			}
		}
	}
	if err := rt.t.Bootstrap().Barrier(ctx, "troupe.actor.shutdown"); err != nil {
		rt.log.Debug("shutdown barrier", zap.Error(err))
	}
	close(rt.stop)
	rt.dispatcher.close()
	rt.bg.Wait()
	rt.devResends.failRank(-1, ErrClosed) // landing goroutines waiting for bytes
	if err := rt.awaitReceives(ctx); err != nil {
		errs = append(errs, err)
	}
	rt.devSends.closeResends()
	rt.devSends.failRank(-1, ErrClosed)
	if err := rt.pairs.close(); err != nil {
		errs = append(errs, fmt.Errorf("actor: closing pair channels: %w", err))
	}
	// Nothing arrives any more: a Request still waiting gets its answer
	// now rather than at its timeout.
	rt.failRequests(-1, "the runtime shut down before the answer came", ErrClosed)
	rt.stopLocalActors()
	// The actors took what was in their mailboxes, and with it the data of
	// messages the overlap engine left at their senders (onloaded): only
	// now may a rank release its transport, or return for its caller to,
	// since a peer's actors may read from it until here (before
	// 2026-12-07 such messages became dead letters, withdrawn by a sender
	// that had closed).
	if err := rt.t.Bootstrap().Barrier(ctx, "troupe.actor.stopped"); err != nil {
		rt.log.Debug("shutdown barrier after the actors stopped", zap.Error(err))
	}
	rt.sys.Shutdown()
	if err := rt.closeMetrics(); err != nil {
		errs = append(errs, fmt.Errorf("actor: closing the metrics endpoint: %w", err))
	}
	if rt.ownT {
		if err := rt.t.Close(); err != nil {
			errs = append(errs, err)
		}
		_ = rt.t.Bootstrap().Close()
	}
	rt.recvCancel()
	return errors.Join(errs...)
}

// awaitReceives waits for the goroutines receiving the data of messages
// already taken (rendezvous data, Typed fields), which deliver them in
// their turn. If ctx ends first, it cancels their receives (a transfer a
// faulty peer announced and never sent would hold Shutdown for good),
// waits for the goroutines to end (their messages become undeliverable,
// and those queued behind them are delivered), and returns a
// *ShutdownError counting the receives abandoned.
func (rt *Runtime) awaitReceives(ctx context.Context) error {
	done := make(chan struct{})
	go func() {
		for _, in := range rt.in {
			in.wait()
		}
		close(done)
	}()
	select {
	case <-done:
		return nil
	case <-ctx.Done():
	}
	rt.recvCancel()
	<-done
	if n := rt.abandoned.Load(); n > 0 {
		rt.log.Warn("shutdown abandoned incoming transfers", zap.Int64("transfers", n), zap.Error(ctx.Err()))
		return &ShutdownError{Abandoned: int(n), Err: ctx.Err()}
	}
	return nil
}

// stopLocalActors stops the actors spawned through Props and waits for
// them. Nothing arrives any more, and each actor first processes the
// messages already in its mailbox (a poison pill, not Stop: Stop is a
// system message that overtakes them, and protoactor drops what a stopped
// actor still had queued without a dead letter); one that takes more than
// protoactor's 10 s future timeout to get there is stopped.
//
// Leaves go first: a parent that takes its poison pill stops its children
// with Stop, so an actor is poisoned only once its descendants among these
// actors have stopped. protoactor names a child after its parent (the
// parent's id, "/", the child's name), so the descendants of an actor are
// the actors whose ids extend its own past a "/"; those ids are poisoned
// in waves, deepest first.
func (rt *Runtime) stopLocalActors() {
	pids := map[string]*pa.PID{}
	rt.local.Range(func(k, v any) bool {
		pids[k.(string)] = v.(*localActor).pid
		return true
	})
	var waves [][]*pa.PID // by depth: how many of the actors are ancestors
	for id, pid := range pids {
		depth := 0
		for i := range len(id) {
			if id[i] == '/' {
				if _, ok := pids[id[:i]]; ok {
					depth++
				}
			}
		}
		for len(waves) <= depth {
			waves = append(waves, nil)
		}
		waves[depth] = append(waves[depth], pid)
	}
	for d := len(waves) - 1; d >= 0; d-- {
		rt.poison(waves[d])
	}
}

// poison stops pids with a poison pill each, all at once, and waits for
// them; one whose future fails (protoactor's 10 s timeout) is stopped.
func (rt *Runtime) poison(pids []*pa.PID) {
	fs := make([]*pa.Future, len(pids))
	for i, pid := range pids {
		fs[i] = rt.sys.Root.PoisonFuture(pid)
	}
	for i, f := range fs {
		if f.Wait() != nil {
			_ = rt.sys.Root.StopFuture(pids[i]).Wait()
		}
	}
}

// Lost returns a channel that is closed when a rank of the job is lost
// (its process died or its connection broke) while the runtime runs; it
// stays closed. A program whose ranks wait for one another (for messages
// only another rank sends) should also wait on it: the runtime fails sends
// and Requests to a lost rank at once, but nothing else tells an actor
// waiting for a message that will not come. Ranks leaving at Shutdown do
// not count. LostErr says which rank it was.
//
// A rank this one never exchanged a message with counts too when the
// transport's bootstrapper reports losses (bootstrap.LossNotifier: the
// rendezvous of troupe run does, within milliseconds); with one that does
// not, such a rank is noticed only once something is sent to it.
func (rt *Runtime) Lost() <-chan struct{} { return rt.lost }

// LostErr returns the loss that closed Lost (a *transport.PeerLostError
// naming the first rank lost, errors.Is ErrPeerLost), or nil while no rank
// was lost.
func (rt *Runtime) LostErr() error {
	select {
	case <-rt.lost:
		return rt.lostErr
	default:
		return nil
	}
}

// lostRank reports whether rank r was lost.
func (rt *Runtime) lostRank(r int) bool { return rt.out[r].lostErr() != nil }

// watchPeers turns lost ranks into Terminated messages and failed sends.
func (rt *Runtime) watchPeers(lost <-chan transport.PeerEvent) {
	defer rt.bg.Done()
	for {
		select {
		case <-rt.stop:
			return
		case ev, ok := <-lost:
			if !ok {
				return
			}
			rt.peerLost(ev)
		}
	}
}

func (rt *Runtime) peerLost(ev transport.PeerEvent) {
	if ev.Rank < 0 || ev.Rank >= rt.size {
		return
	}
	if rt.closed.Load() {
		// Ranks leaving the job at shutdown look like lost peers to UCX.
		rt.log.Debug("rank gone at shutdown", zap.Int("peer", ev.Rank), zap.String("reason", ev.Reason))
	} else {
		rt.log.Warn("rank lost", zap.Int("peer", ev.Rank), zap.String("reason", ev.Reason))
		rt.lostOnce.Do(func() {
			rt.lostErr = &transport.PeerLostError{Rank: ev.Rank, Op: "actor", Reason: ev.Reason}
			close(rt.lost)
		})
	}
	rt.out[ev.Rank].close(&transport.PeerLostError{Rank: ev.Rank, Op: "actor-send", Reason: ev.Reason})
	rt.devSends.failRank(ev.Rank, &transport.PeerLostError{Rank: ev.Rank, Op: "actor-send-device", Reason: ev.Reason})
	rt.devResends.failRank(ev.Rank, &transport.PeerLostError{Rank: ev.Rank, Op: "actor-recv-device", Reason: ev.Reason})
	rt.watchMu.Lock()
	ws := rt.watches[ev.Rank]
	rt.watches[ev.Rank] = nil
	rt.watchMu.Unlock()
	rt.failRequests(ev.Rank, fmt.Sprintf("rank %d lost: %s", ev.Rank, ev.Reason),
		&transport.PeerLostError{Rank: ev.Rank, Op: "actor-request", Reason: ev.Reason})
	for k, watcher := range ws {
		who := rt.PID(ev.Rank, k.watchee)
		rt.stats.WatchesByLoss.Add(1)
		rt.deliverSystem(watcher, &pa.Terminated{Who: who, Why: pa.TerminatedReason_AddressTerminated})
	}
}

// deliverSystem hands a system message to a local process.
func (rt *Runtime) deliverSystem(pid *pa.PID, msg any) {
	proc, _ := rt.sys.ProcessRegistry.GetLocal(pid.Id)
	proc.SendSystemMessage(pid, msg)
}

// watchKey is one remote watch: a remote watchee and a local watcher.
type watchKey struct {
	watchee string // actor id on the remote rank
	watcher string // local actor id
}

func (rt *Runtime) noteWatch(rank int, watchee *pa.PID, watcher *pa.PID, add bool) {
	if watcher == nil || RankOf(watcher) != rt.rank {
		return
	}
	k := watchKey{watchee.Id, watcher.Id}
	rt.watchMu.Lock()
	defer rt.watchMu.Unlock()
	if add {
		if rt.watches[rank] == nil {
			rt.watches[rank] = map[watchKey]*pa.PID{}
		}
		rt.watches[rank][k] = watcher
	} else {
		delete(rt.watches[rank], k)
	}
}

// dropWatches forgets every watch of watchee by a local watcher (it
// terminated, and the Terminated message is on its way).
func (rt *Runtime) dropWatch(rank int, watchee, watcher string) {
	rt.watchMu.Lock()
	delete(rt.watches[rank], watchKey{watchee, watcher})
	rt.watchMu.Unlock()
}

// maxTrackedRequests triggers a sweep of requests whose futures are gone.
const maxTrackedRequests = 4096

// requestPrefix begins the ids of Request's reply processes. They are not in
// protoactor's process registry (adding and removing an entry there cost
// about a microsecond of every round trip) but in the runtime's request
// table, where the reply's arrival finds them. Actor names must not begin
// with it.
const requestPrefix = "request#"

// pendingRequest is a request waiting for an answer from another rank.
type pendingRequest struct {
	rank  int           // the rank that should answer
	reply *replyProcess // Request's waiter; nil for a future (in the registry)
}

// trackRequest remembers a request waiting for an answer from rank r, so it
// can fail at once if r is lost. reply is Request's waiter, nil for a
// future.
func (rt *Runtime) trackRequest(id string, r int, reply *replyProcess) {
	rt.reqMu.Lock()
	defer rt.reqMu.Unlock()
	if len(rt.reqs) >= maxTrackedRequests {
		for k, p := range rt.reqs {
			if _, ok := rt.sys.ProcessRegistry.GetLocal(k); !ok && p.reply == nil {
				delete(rt.reqs, k)
			}
		}
	}
	rt.reqs[id] = pendingRequest{rank: r, reply: reply}
	rt.nreqs.Store(int64(len(rt.reqs)))
}

// answered forgets a tracked request once something was delivered to it,
// and returns it (the zero pendingRequest if it was not tracked).
func (rt *Runtime) answered(id string) pendingRequest {
	if rt.nreqs.Load() == 0 {
		return pendingRequest{}
	}
	rt.reqMu.Lock()
	defer rt.reqMu.Unlock()
	p := rt.reqs[id]
	delete(rt.reqs, id)
	rt.nreqs.Store(int64(len(rt.reqs)))
	return p
}

// takeReply returns Request's waiter with reply id and forgets the request,
// or nil if id names no pending Request (not one, or answered already).
func (rt *Runtime) takeReply(id string) *replyProcess {
	if !strings.HasPrefix(id, requestPrefix) {
		return nil
	}
	return rt.answered(id).reply
}

// failRequests answers every request pending on rank r (every rank if r
// is -1) with an error.
func (rt *Runtime) failRequests(r int, reason string, cause error) {
	rt.reqMu.Lock()
	var failed []pendingRequest
	var ids []string
	for id, p := range rt.reqs {
		if p.rank == r || r == -1 {
			ids = append(ids, id)
			failed = append(failed, p)
			delete(rt.reqs, id)
		}
	}
	rt.nreqs.Store(int64(len(rt.reqs)))
	rt.reqMu.Unlock()
	for i, id := range ids {
		ue := &UndeliverableError{Target: Address(failed[i].rank), Reason: reason, cause: cause}
		if p := failed[i].reply; p != nil {
			p.SendUserMessage(nil, ue)
		} else if proc, ok := rt.sys.ProcessRegistry.GetLocal(id); ok {
			proc.SendUserMessage(rt.PID(rt.rank, id), ue)
		}
	}
}
