package transport

import (
	"context"
	"errors"
	"fmt"
	"os"
	"strconv"
	"sync"
	"sync/atomic"
	"time"
	"unsafe"

	"github.com/troupe-hpc/troupe/datatype"
)

// Typed (noncontiguous) transfers of the MPI-style API: a message is count
// elements of a derived datatype in a byte slice, moved with one of four
// schemes (docs/noncontig.md):
//
//   - pack: pipelined through pooled, pre-registered bounce buffers;
//   - sgl: UCP IOV lists on both sides, chunked by MaxIOVsPerOp;
//   - zcopy: RMA writes into UMR-style windows of the receiver's memory;
//   - adaptive (the default): the layout-aware choice between them.
//
// Every transfer starts with an RTS carrying the sender's type signature,
// size, minimum block and proposed scheme; the receiver checks the signature
// and answers (CTS or ACK), so a mismatch fails on both sides.

// ErrTypeMismatch: the receiver's type signature does not match the sender's.
var ErrTypeMismatch = errors.New("transport: datatype signature mismatch")

// TypeMismatchError reports a typed transfer whose two sides do not fit:
// signatures that differ, or a receive layout smaller than the message
// (TooSmall; then errors.Is(err, ErrTruncated) holds instead of
// ErrTypeMismatch). Both the sender and the receiver get one.
type TypeMismatchError struct {
	Op        string // "typed send" or "typed recv"
	Peer, Tag int
	SendBytes int64 // packed bytes the sender sends
	RecvBytes int64 // packed bytes the receive layout holds
	SendSig   datatype.Signature
	RecvSig   datatype.Signature // zero when TooSmall
	TooSmall  bool
}

func (e *TypeMismatchError) Error() string {
	if e.TooSmall {
		return fmt.Sprintf("transport: %s rank %d tag %d: message of %d packed bytes does not fit the receive layout of %d bytes",
			e.Op, e.Peer, e.Tag, e.SendBytes, e.RecvBytes)
	}
	return fmt.Sprintf("transport: %s rank %d tag %d: datatype signature mismatch: sender %v (%d bytes), receiver %v (%d bytes)",
		e.Op, e.Peer, e.Tag, e.SendSig, e.SendBytes, e.RecvSig, e.RecvBytes)
}

// Unwrap gives ErrTruncated for a receive layout too small, ErrTypeMismatch
// otherwise.
func (e *TypeMismatchError) Unwrap() error {
	if e.TooSmall {
		return ErrTruncated
	}
	return ErrTypeMismatch
}

// NoncontigOptions tune typed transfers. Zero fields take the defaults of
// DefaultNoncontigOptions; environment variables (NoncontigOptionsFromEnv)
// override them.
type NoncontigOptions struct {
	// Scheme is the scheme of calls that do not name one (default
	// SchemeAuto, the layout-aware adaptive scheme). TROUPE_NC_SCHEME.
	Scheme datatype.Scheme
	// Thresholds steer the adaptive scheme and the chunk size:
	// TROUPE_NC_T (ZCopyAvgBlock), TROUPE_NC_WINDOW_SEGMENTS,
	// TROUPE_NC_WINDOW_MIN_BLOCK, TROUPE_NC_SGL_SEGMENTS,
	// TROUPE_NC_MAX_IOVS, TROUPE_NC_CROSSOVER_BAND,
	// TROUPE_NC_CROSSOVER_TRIALS, TROUPE_NC_CROSSOVER_REUSE (a Go
	// duration, such as 1s).
	Thresholds datatype.Thresholds
	// PackChunk is the size of one pipelined pack message and of the pooled
	// bounce buffers (default 128 KiB). TROUPE_NC_PACK_CHUNK.
	PackChunk int
	// PackDepth is how many pack chunks (and SGL chunks) are in flight per
	// transfer (default 4). TROUPE_NC_PACK_DEPTH.
	PackDepth int
	// PackWorkers bounds the goroutines that pack or unpack one chunk of a
	// page-bound layout (datatype.Type.Workers: small blocks about a page
	// apart over 32 MiB or more); every other layout uses one. Default 0:
	// GOMAXPROCS; 1 turns parallel packing off. TROUPE_NC_PACK_WORKERS.
	PackWorkers int
	// PackBuffers is the number of pooled bounce buffers registered up
	// front (default 16). TROUPE_NC_PACK_BUFFERS.
	PackBuffers int
	// EagerLimit: pack payloads up to this size travel inside the RTS
	// (default 8 KiB, at most 32 KiB; negative turns it off).
	// TROUPE_NC_EAGER.
	EagerLimit int
	// KeyPool is the capacity of the window key pool; a background
	// goroutine refills it when it falls to half (default 256).
	// TROUPE_NC_KEY_POOL.
	KeyPool int
	// MaxLayouts bounds the layouts whose registration and windows are kept
	// (default 1024). TROUPE_NC_MAX_LAYOUTS.
	MaxLayouts int
	// FailRegistration makes every layout registration fail, to exercise
	// the fallback to pack (TROUPE_NC_FAULT=register). For tests.
	FailRegistration bool
}

// DefaultNoncontigOptions returns the defaults (docs/noncontig.md).
func DefaultNoncontigOptions() NoncontigOptions {
	return NoncontigOptions{
		Scheme:      datatype.SchemeAuto,
		Thresholds:  datatype.DefaultThresholds(),
		PackChunk:   128 << 10,
		PackDepth:   4,
		PackBuffers: 16,
		EagerLimit:  8 << 10,
		KeyPool:     256,
		MaxLayouts:  1024,
	}
}

func (o *NoncontigOptions) fill() {
	d := DefaultNoncontigOptions()
	if o.Thresholds == (datatype.Thresholds{}) {
		o.Thresholds = d.Thresholds
	}
	if o.PackChunk == 0 {
		o.PackChunk = d.PackChunk
	}
	if o.PackDepth == 0 {
		o.PackDepth = d.PackDepth
	}
	if o.PackBuffers == 0 {
		o.PackBuffers = d.PackBuffers
	}
	if o.EagerLimit == 0 {
		o.EagerLimit = d.EagerLimit
	}
	if o.KeyPool == 0 {
		o.KeyPool = d.KeyPool
	}
	if o.MaxLayouts == 0 {
		o.MaxLayouts = d.MaxLayouts
	}
}

// Validate reports options that cannot work.
func (o NoncontigOptions) Validate() error {
	if err := o.Thresholds.Validate(); err != nil {
		return fmt.Errorf("%w: noncontig thresholds: %v", ErrInvalid, err)
	}
	switch {
	case o.Scheme > datatype.SchemeZCopy:
		return fmt.Errorf("%w: noncontig scheme %d", ErrInvalid, o.Scheme)
	case o.PackChunk < 1 || o.PackDepth < 1 || o.PackBuffers < 0 || o.PackWorkers < 0 || o.KeyPool < 2 || o.MaxLayouts < 1:
		return fmt.Errorf("%w: noncontig options %+v", ErrInvalid, o)
	case o.EagerLimit > ncEagerMax:
		return fmt.Errorf("%w: noncontig EagerLimit %d above %d", ErrInvalid, o.EagerLimit, ncEagerMax)
	case o.PackChunk > maxWireChunk:
		// Every RTS carries it, and a receiver refuses a larger one.
		return fmt.Errorf("%w: noncontig PackChunk %d above %d", ErrInvalid, o.PackChunk, maxWireChunk)
	case o.PackDepth > ncMaxCount || o.PackBuffers > ncMaxCount || o.PackWorkers > ncMaxCount || o.KeyPool > ncMaxCount:
		// Each is allocated up front or per transfer.
		return fmt.Errorf("%w: noncontig PackDepth %d, PackBuffers %d, PackWorkers %d, KeyPool %d: each at most %d",
			ErrInvalid, o.PackDepth, o.PackBuffers, o.PackWorkers, o.KeyPool, ncMaxCount)
	case o.MaxLayouts > ncMaxLayouts:
		return fmt.Errorf("%w: noncontig MaxLayouts %d above %d", ErrInvalid, o.MaxLayouts, ncMaxLayouts)
	case int64(o.PackBuffers)*int64(o.PackChunk) > ncMaxBounce:
		return fmt.Errorf("%w: noncontig PackBuffers %d x PackChunk %d: more than %d bytes of bounce buffers", ErrInvalid, o.PackBuffers, o.PackChunk, int64(ncMaxBounce))
	}
	return nil
}

// Bounds of NoncontigOptions' counts (slices of them are allocated up
// front or per transfer) and of the bounce buffers' memory.
const (
	ncMaxCount   = 1 << 16
	ncMaxLayouts = 1 << 20
	ncMaxBounce  = 1 << 36
)

// NoncontigOptionsFromEnv applies the TROUPE_NC_* environment variables
// (sizes in bytes, counts as integers) to o.
func NoncontigOptionsFromEnv(o NoncontigOptions) (NoncontigOptions, error) {
	ints := []struct {
		name string
		dst  *int64
	}{
		{"TROUPE_NC_T", &o.Thresholds.ZCopyAvgBlock},
		{"TROUPE_NC_WINDOW_SEGMENTS", &o.Thresholds.WindowMaxSegments},
		{"TROUPE_NC_WINDOW_MIN_BLOCK", &o.Thresholds.WindowMinBlock},
		{"TROUPE_NC_SGL_SEGMENTS", &o.Thresholds.SGLMaxSegments},
		{"TROUPE_NC_CROSSOVER_BAND", &o.Thresholds.CrossoverBand},
	}
	for _, e := range ints {
		if v, ok := os.LookupEnv(e.name); ok {
			n, err := strconv.ParseInt(v, 10, 64)
			if err != nil {
				return o, fmt.Errorf("%w: %s=%q: %v", ErrInvalid, e.name, v, err)
			}
			*e.dst = n
		}
	}
	small := []struct {
		name string
		dst  *int
	}{
		{"TROUPE_NC_MAX_IOVS", &o.Thresholds.MaxIOVsPerOp},
		{"TROUPE_NC_CROSSOVER_TRIALS", &o.Thresholds.CrossoverTrials},
		{"TROUPE_NC_CROSSOVER_RUN", &o.Thresholds.CrossoverRun},
		{"TROUPE_NC_PACK_CHUNK", &o.PackChunk},
		{"TROUPE_NC_PACK_DEPTH", &o.PackDepth},
		{"TROUPE_NC_PACK_WORKERS", &o.PackWorkers},
		{"TROUPE_NC_PACK_BUFFERS", &o.PackBuffers},
		{"TROUPE_NC_EAGER", &o.EagerLimit},
		{"TROUPE_NC_KEY_POOL", &o.KeyPool},
		{"TROUPE_NC_MAX_LAYOUTS", &o.MaxLayouts},
	}
	for _, e := range small {
		if v, ok := os.LookupEnv(e.name); ok {
			n, err := strconv.Atoi(v)
			if err != nil {
				return o, fmt.Errorf("%w: %s=%q: %v", ErrInvalid, e.name, v, err)
			}
			*e.dst = n
		}
	}
	if v, ok := os.LookupEnv("TROUPE_NC_CROSSOVER_REUSE"); ok {
		d, err := time.ParseDuration(v)
		if err != nil {
			return o, fmt.Errorf("%w: TROUPE_NC_CROSSOVER_REUSE=%q: %v", ErrInvalid, v, err)
		}
		o.Thresholds.CrossoverReuse = d
	}
	if v, ok := os.LookupEnv("TROUPE_NC_SCHEME"); ok {
		s, err := datatype.ParseScheme(v)
		if err != nil {
			return o, fmt.Errorf("%w: TROUPE_NC_SCHEME: %v", ErrInvalid, err)
		}
		o.Scheme = s
	}
	if v := os.Getenv("TROUPE_NC_FAULT"); v == "register" {
		o.FailRegistration = true
	} else if v != "" {
		return o, fmt.Errorf("%w: TROUPE_NC_FAULT=%q (only \"register\" is known)", ErrInvalid, v)
	}
	return o, o.Validate()
}

// SchemeCounts counts transfers by the scheme they finally used.
type SchemeCounts struct {
	Pack, SGL int64
	ZCopy     int64 `metric:"zcopy"`
}

// NoncontigStats are the counters of typed transfers, readable in-process
// with Transport.NoncontigStats.
type NoncontigStats struct {
	Sent, Received SchemeCounts // completed transfers by final scheme
	Eager          int64        // pack sends carried inside the RTS
	Errors         int64        // transfers failed by a signature or size mismatch
	// ParallelChunks counts pack chunks packed (sender) or unpacked
	// (receiver) on several goroutines (NoncontigOptions.PackWorkers).
	ParallelChunks int64
	// LayoutHits and LayoutMisses count lookups of the layout state (a
	// miss is a layout's first use).
	LayoutHits, LayoutMisses int64
	// Registrations counts layout registrations made (each covers one
	// layout's memory through the registration cache); RegistrationFailures
	// those that failed; Fallbacks the transfers that went pack because a
	// registration failed.
	Registrations, RegistrationFailures, Fallbacks int64
	// WindowMaps counts window sets mapped (local window cache misses),
	// WindowHits reuses.
	WindowMaps, WindowHits int64
	// KeyExchanges counts CTS messages that carried window keys (receiver
	// side); KeysOmitted CTS messages that left them out because the peer's
	// bit was set; RemoteKeyHits transfers whose sender took the keys from
	// its remote window cache.
	KeyExchanges, KeysOmitted, RemoteKeyHits int64
	// KeyPoolRefills counts background refills of the window key pool,
	// KeyPoolEmpty keys made synchronously because the pool was empty.
	KeyPoolRefills, KeyPoolEmpty int64
	// CrossoverTrials counts the receives made to measure a layout pair's
	// pack/SGL crossover (all timed but the first after each change of
	// scheme), CrossoverVerdicts the pairs measured.
	// CrossoverAdopted counts receives that took a verdict measured
	// before: in a symmetric exchange the one the lower-ranked peer
	// measured for the other direction, or this rank's own for an earlier
	// layout pair of the same shape.
	CrossoverTrials, CrossoverVerdicts, CrossoverAdopted int64
	// Puts counts the RMA writes of zero-copy transfers.
	Puts int64
	// WindowSetsRetired counts window sets this rank dropped (with their
	// layouts) whose keys a peer held, once per peer told to forget them;
	// RemoteSetsForgotten the remote window cache entries this rank
	// dropped when a peer retired them; RemoteSets the entries it holds.
	WindowSetsRetired, RemoteSetsForgotten int64
	RemoteSets                             int64 `metric:",gauge"`
	// RenumberSkipped counts cancelled typed receives after which the
	// typed receives pending behind them kept their sequence numbers (one
	// had matched its RTS, a number was not yet posted, a message was
	// parked by IprobeTyped), or after which a receive that took a later
	// number had matched its message already: the message the cancelled
	// receive was owed went to the next typed receive placed instead of
	// the earliest one pending, a departure from MPI's order
	// (docs/noncontig.md).
	RenumberSkipped int64
	// NonblockingInline counts nonblocking typed requests (IsendTyped,
	// IrecvTyped, TypedMessage.Irecv) whose protocol ran in their Wait's
	// goroutine, NonblockingStarted those run in a goroutine of their own
	// (deferred.go; docs/noncontig.md, "Nonblocking typed calls").
	NonblockingInline, NonblockingStarted int64
}

type ncCounters struct {
	sent, recv                                  [4]atomic.Int64
	eager, errors, layoutHits, layoutMisses     atomic.Int64
	parallelChunks                              atomic.Int64
	regs, regFails, fallbacks                   atomic.Int64
	winMaps, winHits, keyX, keysOmitted, rkHits atomic.Int64
	refills, poolEmpty, puts                    atomic.Int64
	crossTrials, crossVerdicts, crossAdopted    atomic.Int64
	setsRetired, remoteForgotten                atomic.Int64
}

// TypedOptions choose how one typed call runs.
type TypedOptions struct {
	// Scheme forces a scheme on this side; SchemeAuto means the transport's
	// default (NoncontigOptions.Scheme). The receiver has the last word:
	// pack if either side asks for pack, zcopy only if both do, else SGL.
	Scheme datatype.Scheme
	// Base is the index of the datatype's origin in the buffer (MPI's buf
	// pointer), so that types with negative displacements can be used.
	Base int
	// Runtime puts the call in the tag space reserved for runtimes built on
	// the transport (the actor runtime's Typed fields): its messages never
	// match the MPI-style API's, and the two number their sequences apart.
	Runtime bool
	// Packed, on a receive, accepts a message of any type signature and
	// leaves its packed stream in the receive layout (MPI_PACKED); the
	// message must still fit. Sends ignore it.
	Packed bool
	// Refuse, on a receive, takes the next message of its (source, tag)
	// and refuses it: nothing lands (the buffer may be nil, the count 0),
	// pack data are drained, the sender's transfer fails ("the receiver
	// failed the transfer") and the receive's with ErrRefused. For a
	// runtime that must keep its receives in step with messages it cannot
	// deliver. Sends ignore it.
	Refuse bool
	// Stage, when set, is a stage from this transport's StageTyped whose
	// Bytes, Twin and Count the call passes as its buffer, type and count
	// (Base 0): the transfer
	// fills Bytes from the stage's layout (a send) or empties them into it
	// (a receive) piece by piece, as the typed protocol moves them, instead
	// of the caller calling Pack before or Unpack after. On a device, the
	// pack kernel of one piece runs while the pieces before it travel, and
	// the unpack of a piece while the next ones arrive. Such a transfer
	// always takes the pack scheme, whose chunks are sent from, and land
	// in, Bytes itself (no bounce buffer). A send's layout must not change
	// until the send completes, a receive's holds the message's elements
	// when it completes; the caller releases the stage after that.
	Stage *TypedStage
}

// ErrRefused: a typed receive with TypedOptions.Refuse refused its message.
var ErrRefused = errors.New("transport: typed transfer refused by the receiver")

// noncontigs holds each transport's typed-transfer state, created on first
// use and dropped when the transport's progress goroutine ends (Close).
var noncontigs sync.Map // *Transport -> *noncontig

// SetNoncontigOptions sets the options of typed transfers. It must be called
// before the first typed call; environment variables are not applied on top.
func (t *Transport) SetNoncontigOptions(o NoncontigOptions) error {
	o.fill()
	if err := o.Validate(); err != nil {
		return err
	}
	nc := newNoncontig(t, o)
	if _, loaded := noncontigs.LoadOrStore(t, nc); loaded {
		return fmt.Errorf("%w: SetNoncontigOptions after the first typed transfer", ErrInvalid)
	}
	nc.start()
	return nil
}

var ncInitMu sync.Mutex

// noncontig returns t's typed-transfer state, creating it from the
// environment on first use.
func (t *Transport) noncontig() (*noncontig, error) {
	if v, ok := noncontigs.Load(t); ok {
		return v.(*noncontig), nil
	}
	ncInitMu.Lock()
	defer ncInitMu.Unlock()
	if v, ok := noncontigs.Load(t); ok {
		return v.(*noncontig), nil
	}
	o, err := NoncontigOptionsFromEnv(DefaultNoncontigOptions())
	if err != nil {
		return nil, err
	}
	nc := newNoncontig(t, o)
	noncontigs.Store(t, nc)
	nc.start()
	return nc, nil
}

// NoncontigOptions returns the options typed transfers use.
func (t *Transport) NoncontigOptions() (NoncontigOptions, error) {
	nc, err := t.noncontig()
	if err != nil {
		return NoncontigOptions{}, err
	}
	return nc.opts, nil
}

// NoncontigStats returns the counters of typed transfers.
func (t *Transport) NoncontigStats() NoncontigStats {
	v, ok := noncontigs.Load(t)
	if !ok {
		return NoncontigStats{}
	}
	nc := v.(*noncontig)
	c := &nc.c
	nc.mu.Lock()
	var remote, skipped int64
	for _, m := range nc.remote {
		remote += int64(len(m))
	}
	for _, n := range nc.renumberSkips {
		skipped += int64(n)
	}
	nc.mu.Unlock()
	return NoncontigStats{
		Sent:                 SchemeCounts{Pack: c.sent[datatype.SchemePack].Load(), SGL: c.sent[datatype.SchemeSGL].Load(), ZCopy: c.sent[datatype.SchemeZCopy].Load()},
		Received:             SchemeCounts{Pack: c.recv[datatype.SchemePack].Load(), SGL: c.recv[datatype.SchemeSGL].Load(), ZCopy: c.recv[datatype.SchemeZCopy].Load()},
		Eager:                c.eager.Load(),
		ParallelChunks:       c.parallelChunks.Load(),
		Errors:               c.errors.Load(),
		LayoutHits:           c.layoutHits.Load(),
		LayoutMisses:         c.layoutMisses.Load(),
		Registrations:        c.regs.Load(),
		RegistrationFailures: c.regFails.Load(),
		Fallbacks:            c.fallbacks.Load(),
		WindowMaps:           c.winMaps.Load(),
		WindowHits:           c.winHits.Load(),
		KeyExchanges:         c.keyX.Load(),
		KeysOmitted:          c.keysOmitted.Load(),
		RemoteKeyHits:        c.rkHits.Load(),
		KeyPoolRefills:       c.refills.Load(),
		KeyPoolEmpty:         c.poolEmpty.Load(),
		Puts:                 c.puts.Load(),
		CrossoverTrials:      c.crossTrials.Load(),
		CrossoverVerdicts:    c.crossVerdicts.Load(),
		CrossoverAdopted:     c.crossAdopted.Load(),
		NonblockingInline:    t.deferred.inline.Load(),
		NonblockingStarted:   t.deferred.started.Load(),
		WindowSetsRetired:    c.setsRetired.Load(),
		RemoteSetsForgotten:  c.remoteForgotten.Load(),
		RemoteSets:           remote,
		RenumberSkipped:      skipped,
	}
}

// typedCall is one typed send or receive, checked.
type typedCall struct {
	peer, tag int
	buf       []byte
	dt        *datatype.Type
	count     int64
	base      int64
	scheme    datatype.Scheme
	bytes     int64 // packed size
	origin    uintptr
	space     Kind        // KindTyped, or KindDDT for TypedOptions.Runtime
	packed    bool        // TypedOptions.Packed (receives)
	refuse    bool        // TypedOptions.Refuse (receives)
	stage     *TypedStage // TypedOptions.Stage: buf is its Bytes
}

// seqKey numbers a call's sequence: runtime-space tags count apart from
// the application's (as negative tags, which the API never accepts).
func (c typedCall) seqKey() seqKey {
	if c.space == KindDDT {
		return seqKey{c.peer, -1 - c.tag}
	}
	return seqKey{c.peer, c.tag}
}

func (t *Transport) typedCall(op string, peer, tag int, buf []byte, dt *datatype.Type, count int, o TypedOptions) (*noncontig, typedCall, error) {
	c := typedCall{peer: peer, tag: tag, buf: buf, dt: dt, count: int64(count), base: int64(o.Base), scheme: o.Scheme,
		space: KindTyped, packed: o.Packed, refuse: o.Refuse}
	if o.Runtime {
		c.space = KindDDT
	}
	if tag == AnyTag || peer == AnySource && (op != "typed recv" || o.Runtime) {
		// Only the MPI-style API's receives take AnySource
		// (noncontig_any.go); no typed transfer takes AnyTag.
		return nil, c, fmt.Errorf("%w: %s: wildcard not allowed here (source %d, tag %d)", ErrInvalid, op, peer, tag)
	}
	if peer != AnySource {
		if err := t.checkRank(peer, op); err != nil {
			return nil, c, err
		}
	}
	if err := checkTag(tag, op); err != nil {
		return nil, c, err
	}
	if dt == nil {
		return nil, c, fmt.Errorf("%w: %s: nil datatype", ErrInvalid, op)
	}
	if count < 0 || o.Base < 0 || o.Base > len(buf) {
		return nil, c, fmt.Errorf("%w: %s: count %d, base %d, buffer of %d bytes", ErrInvalid, op, count, o.Base, len(buf))
	}
	if o.Scheme > datatype.SchemeZCopy {
		return nil, c, fmt.Errorf("%w: %s: scheme %d", ErrInvalid, op, o.Scheme)
	}
	if s := o.Stage; s != nil {
		if err := s.usable(); err != nil {
			return nil, c, fmt.Errorf("%s: %w", op, err)
		}
		if s.t != t || dt != s.Twin || c.count != s.Count || o.Base != 0 || o.Packed || o.Refuse ||
			len(buf) != len(s.Bytes) || unsafe.SliceData(buf) != unsafe.SliceData(s.Bytes) {
			return nil, c, fmt.Errorf("%w: %s: a staged call passes its transport's stage's Bytes, Twin and Count, base 0, and neither Packed nor Refuse", ErrInvalid, op)
		}
		c.stage = s
	}
	n, err := dt.PackedSize(c.count)
	if err != nil {
		return nil, c, fmt.Errorf("%w: %s: %v", ErrInvalid, op, err)
	}
	c.bytes = n
	lo, hi, err := dt.DataBounds(c.count)
	if err != nil {
		return nil, c, fmt.Errorf("%w: %s: %v", ErrInvalid, op, err)
	}
	if n > 0 && (c.base+lo < 0 || c.base+hi > int64(len(buf))) {
		return nil, c, fmt.Errorf("%w: %s: data at [%d, %d) relative to base %d outside buffer of %d bytes", ErrInvalid, op, lo, hi, c.base, len(buf))
	}
	nc, err := t.noncontig()
	if err != nil {
		return nil, c, err
	}
	if c.scheme == datatype.SchemeAuto {
		c.scheme = nc.opts.Scheme
	}
	c.origin = uintptr(unsafe.Pointer(unsafe.SliceData(buf)))
	return nc, c, nil
}

// IsendTyped starts sending count elements of dt whose origin is buf[0] to
// rank dst with a user tag, with the default scheme. buf must not be
// modified until the request completes. The request completes when the
// receiver has accepted the message (its signature matched) and buf may be
// reused; a mismatch fails it with a *TypeMismatchError. A request of at
// most 64 KiB packed runs its protocol when it is needed: in the goroutine
// of a Wait with a context that cannot end, else in a goroutine started by
// another wait, Test, Done or the progress goroutine (docs/noncontig.md,
// "Nonblocking typed calls"); IrecvTyped's alike.
func (t *Transport) IsendTyped(dst, tag int, buf []byte, dt *datatype.Type, count int) (*Request, error) {
	return t.IsendTypedWith(dst, tag, buf, dt, count, TypedOptions{})
}

// IsendTypedWith is IsendTyped with a scheme and origin of its own.
func (t *Transport) IsendTypedWith(dst, tag int, buf []byte, dt *datatype.Type, count int, o TypedOptions) (*Request, error) {
	nc, c, err := t.typedCall("typed send", dst, tag, buf, dt, count, o)
	if err != nil {
		return nil, err
	}
	r := t.newRequest("typed send", dst, tag, len(buf))
	seq := nc.nextSendSeq(c.seqKey())
	t.startTyped(r, c.bytes, func() (Status, error) { return nc.send(context.Background(), c, seq) })
	return r, nil
}

// SendTyped sends count elements of dt whose origin is buf[0] to rank dst
// and waits until the receiver accepted them and buf may be reused.
func (t *Transport) SendTyped(ctx context.Context, dst, tag int, buf []byte, dt *datatype.Type, count int) error {
	return t.SendTypedWith(ctx, dst, tag, buf, dt, count, TypedOptions{})
}

// SendTypedWith is SendTyped with a scheme and origin of its own. Once
// called, the message goes, as a Send's does: when ctx ends while the
// send waits for the receiver, SendTypedWith returns ctx's error (the
// transfer still in flight) while the transfer runs to completion in the
// background, and buf must not be modified until then (IsendTypedWith's
// request tells when). Once the receiver has matched the message, the
// data moves at the receiver's pace whatever ctx does.
func (t *Transport) SendTypedWith(ctx context.Context, dst, tag int, buf []byte, dt *datatype.Type, count int, o TypedOptions) error {
	nc, c, err := t.typedCall("typed send", dst, tag, buf, dt, count, o)
	if err != nil {
		return err
	}
	if err := t.waitInHandler("typed send", dst, tag); err != nil {
		return err // refused before it takes its number
	}
	_, err = nc.send(ctx, c, nc.nextSendSeq(c.seqKey()))
	return err
}

// IrecvTyped starts receiving the next typed message from rank src (or
// AnySource: Status.Source names the sender) with a user tag into count
// elements of dt whose origin is buf[0]. The message's
// type signature must match (the first elements of) dt's, and its packed
// size must fit; otherwise both sides fail with a *TypeMismatchError. The
// request's Status.Size is the number of packed bytes received. Once posted,
// a typed receive cannot be cancelled (Wait with an ended context returns
// while the receive stays posted).
func (t *Transport) IrecvTyped(src, tag int, buf []byte, dt *datatype.Type, count int) (*Request, error) {
	return t.IrecvTypedWith(src, tag, buf, dt, count, TypedOptions{})
}

// IrecvTypedWith is IrecvTyped with a scheme and origin of its own.
func (t *Transport) IrecvTypedWith(src, tag int, buf []byte, dt *datatype.Type, count int, o TypedOptions) (*Request, error) {
	nc, c, err := t.typedCall("typed recv", src, tag, buf, dt, count, o)
	if err != nil {
		return nil, err
	}
	r := t.newRequest("typed recv", src, tag, len(buf))
	seq, w, p := nc.placeRecv(c)
	t.startTyped(r, c.bytes, func() (Status, error) { return nc.recvPlaced(context.Background(), c, seq, w, p) })
	return r, nil
}

// RecvTyped receives the next typed message from rank src (or AnySource)
// with a user tag into count elements of dt whose origin is buf[0].
func (t *Transport) RecvTyped(ctx context.Context, src, tag int, buf []byte, dt *datatype.Type, count int) (Status, error) {
	return t.RecvTypedWith(ctx, src, tag, buf, dt, count, TypedOptions{})
}

// RecvTypedWith is RecvTyped with a scheme and origin of its own. It runs
// the protocol in the calling goroutine; ctx can cancel it until the
// message is matched.
func (t *Transport) RecvTypedWith(ctx context.Context, src, tag int, buf []byte, dt *datatype.Type, count int, o TypedOptions) (Status, error) {
	nc, c, err := t.typedCall("typed recv", src, tag, buf, dt, count, o)
	if err != nil {
		return Status{}, err
	}
	if err := t.waitInHandler("typed recv", src, tag); err != nil {
		return Status{}, err // refused before it takes its number
	}
	seq, w, p := nc.placeRecv(c)
	return nc.recvPlaced(ctx, c, seq, w, p)
}

// TypedTransfer is a typed send or receive that has taken its place in its
// (peer, tag) sequence but not run yet: a runtime that must order its
// transfers with other messages (the actor runtime's Typed fields) takes
// the place where the order is known and runs the transfer elsewhere, in
// a goroutine that waits for it anyway (no protocol goroutine beside it).
type TypedTransfer struct {
	nc   *noncontig
	c    typedCall
	seq  uint32
	send bool
	wait *typedWaiter // a receive placed behind an any-source one (noncontig_any.go)
	rts  *Request     // a receive with its number: its RTS receive, posted when prepared
	hbuf *[]byte      // where that RTS lands (nc.rtsBufs)
	// parked: a receive placed on a message IprobeTyped parked
	// (typedprobe.go).
	parked *parkedRTS
	ran    atomic.Bool
}

// PrepareSendTyped is SendTypedWith split in two: the send takes its
// sequence number now; Run sends. In the MPI-style space the typed sends
// to one (rank, tag) post their RTS messages in sequence order
// (rtsturn.go), so until Run the later ones wait to post.
func (t *Transport) PrepareSendTyped(dst, tag int, buf []byte, dt *datatype.Type, count int, o TypedOptions) (*TypedTransfer, error) {
	nc, c, err := t.typedCall("typed send", dst, tag, buf, dt, count, o)
	if err != nil {
		return nil, err
	}
	return &TypedTransfer{nc: nc, c: c, seq: nc.nextSendSeq(c.seqKey()), send: true}, nil
}

// PrepareRecvTyped is RecvTypedWith split in two: the receive takes its
// sequence number now and, in the MPI-style space, posts the receive of
// the sender's RTS; Run receives. Placed behind a pending any-source typed
// receive of the tag, it takes its number when that one has matched and
// posts in Run, holding back the any-source typed receives placed after
// it until then. src must be a rank, not AnySource.
func (t *Transport) PrepareRecvTyped(src, tag int, buf []byte, dt *datatype.Type, count int, o TypedOptions) (*TypedTransfer, error) {
	nc, c, err := t.typedCall("typed recv", src, tag, buf, dt, count, o)
	if err != nil {
		return nil, err
	}
	if src == AnySource {
		return nil, fmt.Errorf("%w: prepared typed receives take no wildcards", ErrInvalid)
	}
	seq, w, p := nc.placeRecv(c)
	x := &TypedTransfer{nc: nc, c: c, seq: seq, wait: w, parked: p}
	if w == nil && p == nil && c.space == KindTyped {
		// Posted now, the RTS receive is in UCX before any any-source
		// typed receive of the tag placed after it: those need not wait
		// for Run (noncontig_any.go). The runtimes' space has no
		// any-source receives, and there the runtime that prepares (the
		// actor runtime, in an active-message handler) leaves the post
		// to Run's goroutine: posting in the handler made its 1 KiB
		// Typed ping-pong 8.5-8.6 us one way against 7.8-8.0 (troupe
		// bench noncontig --actor, vec_64x16, adaptive, three
		// alternated runs).
		x.hbuf = nc.rtsBufs.Get().(*[]byte)
		x.rts = nc.postExactRTS(c, seq, *x.hbuf)
	}
	return x, nil
}

// Run carries the transfer out as SendTypedWith or RecvTypedWith would
// (in the calling goroutine, but for a send with a context that can end);
// it may be called once. Until Run, the message
// the transfer sends or receives waits (a prepared receive's RTS may have
// landed; its sender waits for the answer); transfers with other sequence
// numbers go on.
func (x *TypedTransfer) Run(ctx context.Context) (Status, error) {
	if err := x.nc.t.waitInHandler("typed transfer", x.c.peer, x.c.tag); err != nil {
		return Status{}, err // refused before anything is posted: it can still run elsewhere
	}
	if x.ran.Swap(true) {
		return Status{}, fmt.Errorf("%w: typed transfer run twice", ErrInvalid)
	}
	if x.send {
		return x.nc.send(ctx, x.c, x.seq)
	}
	if x.rts == nil {
		return x.nc.recvPlaced(ctx, x.c, x.seq, x.wait, x.parked)
	}
	defer x.nc.rtsBufs.Put(x.hbuf)
	n, err := x.nc.awaitExactRTS(ctx, x.rts)
	if err != nil {
		return Status{}, err
	}
	return x.nc.recvMatched(context.WithoutCancel(ctx), x.c, (*x.hbuf)[:n]) // matched: runs to completion (recvPlaced)
}

// ncComplete completes a typed request from its protocol goroutine.
func (t *Transport) ncComplete(r *Request, st Status, err error) {
	t.mu.Lock()
	r.status, r.err = st, err
	t.complete(r)
	t.mu.Unlock()
}
