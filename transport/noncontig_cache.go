package transport

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"math"
	"math/bits"
	"sync"
	"sync/atomic"
	"time"

	"go.uber.org/zap"

	"github.com/troupe-hpc/troupe/datatype"
)

// Caches of typed transfers: the layout state (flattened layout, statistics
// and the layout-based registration: one lookup gives the registration of a
// whole layout), the local window cache keyed by (layout, base, chunk) with
// its per-peer bitmap, the remote window cache per peer, the window key pool
// and the pool of pre-registered bounce buffers. Lock order: ls.regMu, then
// the worker lock, then nc.mu (posting a typed receive's RTS receive counts
// it under both); code holding nc.mu takes no other lock but a TryLock of
// ls.regMu (before 2026-11-25 evicting a layout took the worker lock under
// nc.mu, and deadlocked against a receive being posted).

type layoutKey struct {
	t     *datatype.Type
	base  uintptr
	count int64
}

// layoutState is one layout's entry in the layout-based registration cache.
type layoutState struct {
	key    layoutKey
	lay    *datatype.Layout
	lo, hi uintptr // memory the layout's blocks span

	wanted     atomic.Bool // the registrar should register it
	registered atomic.Bool
	failed     atomic.Bool

	regMu   sync.Mutex // serialises registration and eviction
	reg     *regEntry  // one registration covering [lo, hi)
	evicted bool       // guarded by regMu

	busy int // transfers using it; guarded by nc.mu

	// The pack/SGL crossover of layouts near T (datatype.Crossover):
	// measured on the receiving side per peer and sender layout shape, and
	// the verdicts this layout's sends were told, per peer; held counts the
	// receives in which a verdict was kept back (holdVerdict).
	crossMu  sync.Mutex
	crosses  map[crossKey]*datatype.Crossover
	verdicts map[int]datatype.Scheme
	held     map[crossKey]int
	// adopted are the verdicts this layout's receives took from another
	// measurement (a symmetric peer's, or one of a pair of the same
	// shapes), per peer and sender layout shape: once taken, kept.
	adopted map[crossKey]datatype.Scheme
}

// keptVerdict is a crossover verdict and when it was measured or told.
type keptVerdict struct {
	v  datatype.Scheme
	at time.Time
}

// crossKey names the layout pair a receive's crossover is measured for:
// the peer and the shape of its layout (minimum block, segments, packed
// bytes).
type crossKey struct {
	peer                      int
	minBlock, segments, bytes int64
}

// shapeKey is a crossKey with the shape of the receiving side's layout:
// two layout pairs with equal shapes (the same types on other buffers, say)
// share one verdict (noteShapeVerdict).
type shapeKey struct {
	crossKey
	minBlock, segments int64
}

// noteShapeVerdict records the verdict a receive measured for a layout
// pair of this shape.
func (nc *noncontig) noteShapeVerdict(k shapeKey, v datatype.Scheme) {
	nc.mu.Lock()
	defer nc.mu.Unlock()
	if len(nc.shapeVerdicts) >= nc.maxVerdicts() {
		clear(nc.shapeVerdicts) // measured again when next needed
	}
	nc.shapeVerdicts[k] = keptVerdict{v, time.Now()}
}

// reusable reports whether a verdict kept since at may still be taken for
// a layout pair that has none (Thresholds.CrossoverReuse).
func (nc *noncontig) reusable(at time.Time) bool {
	d := nc.opts.Thresholds.CrossoverReuse
	return d <= 0 || time.Since(at) <= d
}

// maxVerdicts bounds each of the verdict maps (sentVerdicts,
// shapeVerdicts): four per layout kept. A program that keeps making layouts
// of new shapes would otherwise grow them without end; past the bound a map
// starts over, and its pairs are measured again.
func (nc *noncontig) maxVerdicts() int { return 4 * max(nc.opts.MaxLayouts, 1) }

// shapeVerdict is the verdict measured for a layout pair of this shape, if
// there is one recent enough to reuse.
func (nc *noncontig) shapeVerdict(k shapeKey) (datatype.Scheme, bool) {
	nc.mu.Lock()
	defer nc.mu.Unlock()
	kv, ok := nc.shapeVerdicts[k]
	return kv.v, ok && nc.reusable(kv.at)
}

// measuring reports whether this layout has a crossover measurement for k
// (under way or decided).
func (ls *layoutState) measuring(k crossKey) bool {
	ls.crossMu.Lock()
	defer ls.crossMu.Unlock()
	return ls.crosses[k] != nil
}

// crossover returns the measurement for receives from peer of a sender
// layout with this shape, made on first use.
func (ls *layoutState) crossover(k crossKey, th datatype.Thresholds, prefer datatype.Scheme) *datatype.Crossover {
	ls.crossMu.Lock()
	defer ls.crossMu.Unlock()
	if ls.crosses == nil {
		ls.crosses = map[crossKey]*datatype.Crossover{}
	}
	c := ls.crosses[k]
	if c == nil {
		c = datatype.NewCrossover(th.CrossoverTrials, th.CrossoverRun, prefer)
		ls.crosses[k] = c
	}
	return c
}

// verdict returns what peer's receiver measured for sends of this layout.
func (ls *layoutState) verdict(peer int) (datatype.Scheme, bool) {
	ls.crossMu.Lock()
	defer ls.crossMu.Unlock()
	v, ok := ls.verdicts[peer]
	return v, ok
}

// noteSentVerdict records the verdict peer's receiver told this rank for
// sends of a layout of this shape.
func (nc *noncontig) noteSentVerdict(k crossKey, v datatype.Scheme) {
	nc.mu.Lock()
	defer nc.mu.Unlock()
	if len(nc.sentVerdicts) >= nc.maxVerdicts() {
		clear(nc.sentVerdicts)
	}
	nc.sentVerdicts[k] = keptVerdict{v, time.Now()}
}

// noteRTT records a round trip from this rank's RTS to peer until its CTS.
func (nc *noncontig) noteRTT(peer int, d time.Duration) {
	if peer >= 0 && peer < len(nc.rtts) {
		nc.rtts[peer].Store(uint32(min(max(d, 0), time.Duration(math.MaxUint32))))
	}
}

// rtt is the latest round trip noteRTT recorded for peer (0: none).
func (nc *noncontig) rtt(peer int) uint32 {
	if peer < 0 || peer >= len(nc.rtts) {
		return 0
	}
	return nc.rtts[peer].Load()
}

// sentVerdict is what peer's receiver measured for sends of a layout of
// this shape from this rank, if it was told recently enough to reuse.
func (nc *noncontig) sentVerdict(k crossKey) (datatype.Scheme, bool) {
	nc.mu.Lock()
	defer nc.mu.Unlock()
	kv, ok := nc.sentVerdicts[k]
	return kv.v, ok && nc.reusable(kv.at)
}

// adoptedVerdict is the verdict this layout's receives from k took before.
func (ls *layoutState) adoptedVerdict(k crossKey) (datatype.Scheme, bool) {
	ls.crossMu.Lock()
	defer ls.crossMu.Unlock()
	v, ok := ls.adopted[k]
	return v, ok
}

// adopt keeps v as the verdict of this layout's receives from k.
func (ls *layoutState) adopt(k crossKey, v datatype.Scheme) {
	ls.crossMu.Lock()
	defer ls.crossMu.Unlock()
	if ls.adopted == nil {
		ls.adopted = map[crossKey]datatype.Scheme{}
	}
	ls.adopted[k] = v
}

// holdVerdict counts one more receive in which this side keeps its verdict
// for k to itself and reports whether it still may (at most n); ls.crossMu
// is held.
func (ls *layoutState) holdVerdict(k crossKey, n int) bool {
	if ls.held == nil {
		ls.held = map[crossKey]int{}
	}
	ls.held[k]++
	return ls.held[k] <= n
}

func (ls *layoutState) setVerdict(peer int, v datatype.Scheme) {
	ls.crossMu.Lock()
	defer ls.crossMu.Unlock()
	if ls.verdicts == nil {
		ls.verdicts = map[int]datatype.Scheme{}
	}
	ls.verdicts[peer] = v
}

type winKey struct {
	layout layoutKey
	chunk  int64
}

// windowKey is one slot of the window key pool. On hardware with UMR a slot
// is a pre-created memory key; UCX has no UMR, so a slot here is the window's
// descriptor (address and span inside the layout's registration), filled
// when a window is mapped.
type windowKey struct {
	id         uint64
	addr, span uint64
}

// windowSet is a layout cut into windows of one chunk size: the local
// window cache entry.
type windowSet struct {
	id    uint64
	chunk int64
	wins  []datatype.Window
	keys  []*windowKey
	rkey  []byte
	mu    sync.Mutex
	blob  []byte   // encoded keys for peers (receiver side), built once
	sent  []uint64 // bitmap of peers that hold the keys
	owner layoutKey
}

func (ws *windowSet) hasSent(peer int) bool {
	ws.mu.Lock()
	defer ws.mu.Unlock()
	return ws.sent[peer/64]&(1<<(peer%64)) != 0
}

func (ws *windowSet) markSent(peer int) {
	ws.mu.Lock()
	ws.sent[peer/64] |= 1 << (peer % 64)
	ws.mu.Unlock()
}

// remoteSet is a peer's window set as the sender sees it: the receiver's
// registration key and, per window, the receiver's memory pieces.
type remoteSet struct {
	rkey []byte
	wins [][]datatype.IOV
}

// remoteEntry is a remote window cache entry; it becomes ready when the
// keys have arrived (another transfer may be receiving them).
type remoteEntry struct {
	once  sync.Once
	ready chan struct{}
	set   *remoteSet
	err   error
}

type noncontig struct {
	t    *Transport
	opts NoncontigOptions
	c    ncCounters

	mu      sync.Mutex
	layouts map[layoutKey]*layoutState
	wsets   map[winKey]*windowSet
	remote  map[int]map[uint64]*remoteEntry
	sendSeq map[seqKey]uint32
	recvSeq map[seqKey]*recvCounter
	xids    map[int]uint32
	// Any-source typed receives (noncontig_any.go), per user tag: the
	// receives waiting behind one, in post order; how many sequence
	// numbers handed out still have no RTS receive in UCX; and a channel
	// closed (and replaced) when such a count falls to zero while an
	// any-source receive waits for that (postedWanted).
	gates map[int][]*typedWaiter
	// anyRTS: per tag, the masked RTS receive of the any-source typed
	// receive heading the tag's gate, once posted (renumber.go withdraws
	// it while it renumbers the exact ones it must stay behind).
	anyRTS       map[int]*Request
	unposted     map[int]int
	postedCh     chan struct{}
	postedWanted bool
	// parked: typed messages IprobeTyped found, per user tag in the order
	// found, each waiting for the next typed receive that may take it
	// (typedprobe.go).
	parked map[int][]*parkedRTS
	// renumberSkips counts, per (source, tag), the cancellations after
	// which the typed receives behind the number given back kept theirs
	// (renumber.go).
	renumberSkips map[seqKey]int
	// turns order the RTS posts of the MPI-style space's typed sends per
	// (peer, tag) (rtsturn.go).
	turns map[seqKey]*rtsTurn
	// sentVerdicts are the crossover verdicts peers' receivers told this
	// rank as a sender, by peer and the shape of this rank's layout.
	sentVerdicts map[crossKey]keptVerdict
	// shapeVerdicts are the verdicts this rank's receives measured, by the
	// shapes of both layouts.
	shapeVerdicts map[shapeKey]keptVerdict
	// rtts are this rank's latest RTS-to-CTS round trips as a sender, in
	// nanoseconds, by peer rank (rts.rtt): atomics, read on every typed
	// send without the mutex.
	rtts []atomic.Uint32
	// trialTransfers is how many transfers a layout pair's crossover
	// trials take (Thresholds.CrossoverTransfers): as many receives a
	// higher rank keeps its own verdict to itself (holdVerdict).
	trialTransfers int
	nextID         uint64
	keys           []*windowKey

	refill  chan struct{}
	regWake chan struct{}
	// retired is signalled (without blocking) each time a peer's window
	// set retirement has been handled; tests wait on it.
	retired chan struct{}
	stop    chan struct{}

	bounceOnce sync.Once
	bounce     chan []byte
	// pooled holds the pool's buffers (their first bytes), registered at
	// init; written once by initBounce, read-only after.
	pooled  map[*byte]struct{}
	rtsBufs sync.Pool
}

func newNoncontig(t *Transport, o NoncontigOptions) *noncontig {
	nc := &noncontig{
		t: t, opts: o,
		layouts:       map[layoutKey]*layoutState{},
		wsets:         map[winKey]*windowSet{},
		remote:        map[int]map[uint64]*remoteEntry{},
		sendSeq:       map[seqKey]uint32{},
		recvSeq:       map[seqKey]*recvCounter{},
		xids:          map[int]uint32{},
		gates:         map[int][]*typedWaiter{},
		anyRTS:        map[int]*Request{},
		unposted:      map[int]int{},
		postedCh:      make(chan struct{}),
		parked:        map[int][]*parkedRTS{},
		turns:         map[seqKey]*rtsTurn{},
		sentVerdicts:  map[crossKey]keptVerdict{},
		shapeVerdicts: map[shapeKey]keptVerdict{},
		rtts:          make([]atomic.Uint32, t.size),
		refill:        make(chan struct{}, 1),
		regWake:       make(chan struct{}, 1),
		retired:       make(chan struct{}, 1),
		stop:          make(chan struct{}),
	}
	nc.trialTransfers, _ = o.Thresholds.CrossoverTransfers()
	nc.rtsBufs.New = func() any { b := make([]byte, rtsHdrLen+ncEagerMax); return &b }
	// The key pool starts full, as an MPI library creates its memory keys
	// at init.
	for len(nc.keys) < o.KeyPool {
		nc.nextID++
		nc.keys = append(nc.keys, &windowKey{id: nc.nextID})
	}
	return nc
}

// start runs the background goroutines: the registrar (Algorithm 2), the
// key pool refiller, and a watcher that ends both when the transport closes.
func (nc *noncontig) start() {
	go nc.registrar()
	go nc.refiller()
	go func() {
		<-nc.t.loopDone
		close(nc.stop)
		noncontigs.Delete(nc.t)
	}()
}

// Sequence numbers and transfer ids.

func (nc *noncontig) nextSendSeq(k seqKey) uint32 {
	nc.mu.Lock()
	defer nc.mu.Unlock()
	s := nc.sendSeq[k]
	nc.sendSeq[k] = (s + 1) & ncSeqMask
	return s
}

func (nc *noncontig) nextXid(peer int) uint32 {
	nc.mu.Lock()
	defer nc.mu.Unlock()
	x := nc.xids[peer]
	nc.xids[peer] = (x + 1) & ncXidMask
	return x
}

// Layout states.

// state returns the layout state of a call, flattening the layout on its
// first use (known = false). The caller must call done.
func (nc *noncontig) state(c typedCall) (*layoutState, bool, error) {
	k := layoutKey{c.dt, c.origin + uintptr(c.base), c.count}
	nc.mu.Lock()
	if ls := nc.layouts[k]; ls != nil {
		ls.busy++
		nc.mu.Unlock()
		nc.c.layoutHits.Add(1)
		return ls, true, nil
	}
	nc.mu.Unlock()
	nc.c.layoutMisses.Add(1)
	lay, err := datatype.Flatten(c.dt, k.base, c.count)
	if err != nil {
		return nil, false, fmt.Errorf("%w: flattening %v: %v", ErrInvalid, c.dt, err)
	}
	ls := &layoutState{key: k, lay: lay}
	for i, v := range lay.IOVs {
		if i == 0 || v.Addr < ls.lo {
			ls.lo = v.Addr
		}
		if end := v.Addr + uintptr(v.Len); end > ls.hi {
			ls.hi = end
		}
	}
	nc.mu.Lock()
	if old := nc.layouts[k]; old != nil {
		old.busy++
		nc.mu.Unlock()
		return old, true, nil
	}
	nc.layouts[k] = ls
	ls.busy++
	var d dropped
	nc.evictLocked(&d)
	nc.mu.Unlock()
	nc.finishDrop(d)
	return ls, false, nil
}

func (nc *noncontig) done(ls *layoutState) {
	if ls == nil {
		return
	}
	nc.mu.Lock()
	ls.busy--
	nc.mu.Unlock()
}

// dropped is what dropping layouts left for finishDrop: their
// registrations, and per peer the ids of window sets whose keys the peer
// holds.
type dropped struct {
	regs    []*regEntry
	retired map[int][]uint64
}

// evictLocked drops idle layouts (with their window sets) while there are
// more than MaxLayouts, into d; nc.mu is held.
func (nc *noncontig) evictLocked(d *dropped) {
	for k, ls := range nc.layouts {
		if len(nc.layouts) <= nc.opts.MaxLayouts {
			break
		}
		if ls.busy > 0 || !ls.regMu.TryLock() {
			continue
		}
		nc.dropLocked(k, ls, d)
	}
}

// dropLocked drops layout k, idle, with its window sets, into d; nc.mu and
// ls.regMu are held, and dropLocked unlocks ls.regMu.
func (nc *noncontig) dropLocked(k layoutKey, ls *layoutState, d *dropped) {
	ls.evicted = true
	if ls.reg != nil {
		d.regs = append(d.regs, ls.reg)
	}
	ls.reg = nil
	ls.regMu.Unlock()
	delete(nc.layouts, k)
	for wk, ws := range nc.wsets {
		if wk.layout != k {
			continue
		}
		nc.keys = append(nc.keys, ws.keys...)
		delete(nc.wsets, wk)
		for i, w := range ws.sent {
			for ; w != 0; w &= w - 1 {
				peer := i*64 + bits.TrailingZeros64(w)
				if d.retired == nil {
					d.retired = map[int][]uint64{}
				}
				d.retired[peer] = append(d.retired[peer], ws.id)
			}
		}
	}
}

// forgetRange drops the idle layouts whose memory overlaps [lo, hi), with
// their registrations and window sets (Deregister: the memory may be freed
// and reused), so that the next transfer registers it anew and sends fresh
// window keys; before 2026-11-25 they kept the invalidated registration and
// its keys. A layout in use by a transfer is left alone.
func (nc *noncontig) forgetRange(lo, hi uintptr) {
	var d dropped
	nc.mu.Lock()
	for k, ls := range nc.layouts {
		if ls.hi <= lo || ls.lo >= hi || ls.busy > 0 || !ls.regMu.TryLock() {
			continue
		}
		nc.dropLocked(k, ls, &d)
	}
	nc.mu.Unlock()
	nc.finishDrop(d)
}

// finishDrop releases the registrations of dropped layouts and tells the
// peers holding keys of their window sets to forget them (retireSets);
// nc.mu is not held.
func (nc *noncontig) finishDrop(d dropped) {
	if len(d.regs) == 0 && len(d.retired) == 0 {
		return
	}
	t := nc.t
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.closed {
		return
	}
	for _, e := range d.regs {
		t.reg.release(e)
	}
	for peer, ids := range d.retired {
		t.retireSets(peer, ids)
	}
}

// register registers the memory of a layout through the registration cache
// (one registration covering its blocks), once. It reports success; a
// failure is counted and remembered, and the layout then goes pack.
func (nc *noncontig) register(ls *layoutState) bool {
	if ls.registered.Load() {
		return true
	}
	ls.regMu.Lock()
	defer ls.regMu.Unlock()
	if ls.registered.Load() {
		return true
	}
	if ls.failed.Load() || ls.evicted {
		return false
	}
	var err error
	var e *regEntry
	if nc.opts.FailRegistration {
		err = errors.New("injected failure (TROUPE_NC_FAULT=register)")
	} else {
		t := nc.t
		t.mu.Lock()
		if t.closed {
			err = ErrClosed
		} else {
			e, err = t.reg.acquire(ls.lo, int(max(ls.hi-ls.lo, 1)))
		}
		t.mu.Unlock()
	}
	if err != nil {
		ls.failed.Store(true)
		nc.c.regFails.Add(1)
		nc.t.log.Warn("typed transfer: layout registration failed; the layout goes pack",
			zap.Stringer("type", ls.key.t), zap.Int64("bytes", ls.lay.Stats.Bytes), zap.Error(err))
		return false
	}
	ls.reg = e
	nc.c.regs.Add(1)
	ls.registered.Store(true)
	return true
}

// registrar is Algorithm 2: it sleeps until woken, then registers every
// layout that asked for it.
func (nc *noncontig) registrar() {
	for {
		select {
		case <-nc.stop:
			return
		case <-nc.regWake:
		}
		nc.mu.Lock()
		var todo []*layoutState
		for _, ls := range nc.layouts {
			if ls.wanted.Load() && !ls.registered.Load() && !ls.failed.Load() {
				todo = append(todo, ls)
			}
		}
		nc.mu.Unlock()
		for _, ls := range todo {
			nc.register(ls)
		}
	}
}

func (nc *noncontig) wakeRegistrar() {
	select {
	case nc.regWake <- struct{}{}:
	default:
	}
}

// Window key pool.

// takeKeys takes n key slots from the pool (making the missing ones at once
// if it runs dry) and wakes the refiller when the pool falls to half.
func (nc *noncontig) takeKeys(n int) []*windowKey {
	nc.mu.Lock()
	out := make([]*windowKey, 0, n)
	k := min(n, len(nc.keys))
	out = append(out, nc.keys[len(nc.keys)-k:]...)
	nc.keys = nc.keys[:len(nc.keys)-k]
	for len(out) < n {
		nc.nextID++
		out = append(out, &windowKey{id: nc.nextID})
		nc.c.poolEmpty.Add(1)
	}
	low := len(nc.keys) <= nc.opts.KeyPool/2
	nc.mu.Unlock()
	if low {
		select {
		case nc.refill <- struct{}{}:
		default:
		}
	}
	return out
}

// refiller tops the key pool up in the background.
func (nc *noncontig) refiller() {
	for {
		select {
		case <-nc.stop:
			return
		case <-nc.refill:
		}
		nc.mu.Lock()
		added := false
		for len(nc.keys) < nc.opts.KeyPool {
			nc.nextID++
			nc.keys = append(nc.keys, &windowKey{id: nc.nextID})
			added = true
		}
		nc.mu.Unlock()
		if added {
			nc.c.refills.Add(1)
		}
	}
}

// Local window cache.

// windows returns the window set of a registered layout for chunk, mapping
// it on a miss.
func (nc *noncontig) windows(ls *layoutState, chunk int64) (*windowSet, error) {
	k := winKey{ls.key, chunk}
	nc.mu.Lock()
	if ws := nc.wsets[k]; ws != nil {
		nc.mu.Unlock()
		nc.c.winHits.Add(1)
		return ws, nil
	}
	nc.mu.Unlock()
	wins, err := datatype.Windows(ls.lay.IOVs, chunk)
	if err != nil {
		return nil, fmt.Errorf("%w: windows: %v", ErrInvalid, err)
	}
	ls.regMu.Lock()
	reg := ls.reg
	ls.regMu.Unlock()
	if reg == nil {
		return nil, fmt.Errorf("transport: typed transfer: windows of an unregistered layout")
	}
	keys := nc.takeKeys(len(wins))
	for i, w := range wins {
		keys[i].addr, keys[i].span = uint64(w.Addr), uint64(w.End-w.Addr)
	}
	ws := &windowSet{chunk: chunk, wins: wins, keys: keys, rkey: reg.handle.(*regHandle).rkey,
		sent: make([]uint64, (nc.t.size+63)/64), owner: ls.key}
	nc.mu.Lock()
	defer nc.mu.Unlock()
	if old := nc.wsets[k]; old != nil {
		nc.keys = append(nc.keys, keys...)
		nc.c.winHits.Add(1)
		return old, nil
	}
	nc.nextID++
	ws.id = nc.nextID
	nc.wsets[k] = ws
	nc.c.winMaps.Add(1)
	return ws, nil
}

// keyBlob encodes a window set for a peer: set id, registration key, and
// per window the receiver's memory pieces (the offset list that stands in
// for a UMR key's scatter list).
func (ws *windowSet) keyBlob(iovs []datatype.IOV) []byte {
	ws.mu.Lock()
	defer ws.mu.Unlock()
	if ws.blob != nil {
		return ws.blob
	}
	le := binary.LittleEndian
	b := make([]byte, 0, 16+len(ws.rkey)+len(ws.wins)*24)
	b = le.AppendUint64(b, ws.id)
	b = le.AppendUint32(b, uint32(len(ws.wins)))
	b = le.AppendUint32(b, uint32(len(ws.rkey)))
	b = append(b, ws.rkey...)
	var ps []datatype.IOV
	for _, w := range ws.wins {
		ps = w.Pieces(iovs, ps[:0])
		b = le.AppendUint32(b, uint32(len(ps)))
		for _, p := range ps {
			b = le.AppendUint64(b, uint64(p.Addr))
			b = le.AppendUint64(b, uint64(p.Len))
		}
	}
	ws.blob = b
	return b
}

// maxKeyBlob bounds the window keys (keyBlob) of a receive layout of
// rbytes bytes: the header, a registration key (64 KiB at most), and per
// window a piece count and per piece an address and a length, every
// window and piece at least a byte long.
func maxKeyBlob(rbytes int64) int64 {
	const slack = 16 + 64<<10
	if rbytes > (math.MaxInt64-slack)/20 {
		return math.MaxInt64
	}
	return slack + 20*rbytes
}

func decodeKeyBlob(b []byte, wantID uint64) (*remoteSet, error) {
	le := binary.LittleEndian
	bad := func(what string) (*remoteSet, error) {
		return nil, fmt.Errorf("%w: window keys: %s", ErrInvalid, what)
	}
	if len(b) < 16 {
		return bad("short header")
	}
	if id := le.Uint64(b); id != wantID {
		return bad(fmt.Sprintf("set %d, CTS announced %d", id, wantID))
	}
	nwin, nk := int(le.Uint32(b[8:])), int(le.Uint32(b[12:]))
	b = b[16:]
	if nk == 0 || nk > len(b) {
		return bad("registration key length")
	}
	rs := &remoteSet{rkey: append([]byte(nil), b[:nk]...)}
	b = b[nk:]
	if nwin > len(b)/4 {
		return bad("window count")
	}
	rs.wins = make([][]datatype.IOV, nwin)
	for w := range rs.wins {
		if len(b) < 4 {
			return bad("truncated window")
		}
		np := int(le.Uint32(b))
		b = b[4:]
		if np > len(b)/16 {
			return bad("piece count")
		}
		ps := make([]datatype.IOV, np)
		for i := range ps {
			ps[i] = datatype.IOV{Addr: uintptr(le.Uint64(b)), Len: int64(le.Uint64(b[8:]))}
			if ps[i].Len < 0 {
				return bad("negative piece")
			}
			b = b[16:]
		}
		rs.wins[w] = ps
	}
	if len(b) != 0 {
		return bad("trailing bytes")
	}
	return rs, nil
}

// Remote window cache.

// remoteEntry returns the cache entry for a peer's window set, creating an
// empty one that the transfer receiving the keys fills. A transfer whose
// CTS carries the keys (keys) replaces an entry whose keys failed to
// arrive; one whose CTS left them out takes that entry and its error: the
// peer will not send them again.
func (nc *noncontig) remoteEntry(peer int, id uint64, keys bool) *remoteEntry {
	nc.mu.Lock()
	defer nc.mu.Unlock()
	m := nc.remote[peer]
	if m == nil {
		m = map[uint64]*remoteEntry{}
		nc.remote[peer] = m
	}
	e := m[id]
	if e == nil || keys && e.failed() {
		e = &remoteEntry{ready: make(chan struct{})}
		m[id] = e
	}
	return e
}

// fill completes a remote entry once (later fills are ignored).
func (e *remoteEntry) fill(rs *remoteSet, err error) {
	e.once.Do(func() {
		e.set, e.err = rs, err
		close(e.ready)
	})
}

// failed reports whether the entry's keys failed to arrive.
func (e *remoteEntry) failed() bool {
	select {
	case <-e.ready:
		return e.err != nil
	default:
		return false
	}
}

func (e *remoteEntry) wait(ctx context.Context) (*remoteSet, error) {
	select {
	case <-e.ready:
		return e.set, e.err
	case <-ctx.Done():
		return nil, ctx.Err()
	}
}

// Bounce buffers for pack.

func (nc *noncontig) initBounce() {
	nc.bounce = make(chan []byte, nc.opts.PackBuffers)
	nc.pooled = make(map[*byte]struct{}, nc.opts.PackBuffers)
	t := nc.t
	for i := 0; i < nc.opts.PackBuffers; i++ {
		b := make([]byte, nc.opts.PackChunk)
		nc.pooled[&b[0]] = struct{}{}
		// Pre-registered through the registration cache (the registration
		// stays cached with the buffer for the transport's life).
		t.mu.Lock()
		if !t.closed {
			if _, err := t.reg.acquire(uintptr(bytesPtr(b)), len(b)); err != nil {
				t.log.Warn("typed transfer: registering a bounce buffer failed", zap.Error(err))
			}
		}
		t.mu.Unlock()
		nc.bounce <- b
	}
}

// getBounce returns a buffer of at least n bytes: a pooled one when n fits.
func (nc *noncontig) getBounce(n int64) []byte {
	nc.bounceOnce.Do(nc.initBounce)
	if n <= int64(nc.opts.PackChunk) {
		select {
		case b := <-nc.bounce:
			return b[:n]
		default:
		}
	}
	return make([]byte, n)
}

// putBounce gives a pooled buffer back. Others (made when the pool was
// empty, unregistered) are left to the collector: one of PackChunk bytes
// taken in a registered one's place would have dropped the registered one,
// whose registration then stayed held over freed memory.
func (nc *noncontig) putBounce(b []byte) {
	if cap(b) != nc.opts.PackChunk {
		return
	}
	if _, ok := nc.pooled[&b[:1][0]]; !ok {
		return
	}
	select {
	case nc.bounce <- b[:cap(b)]:
	default:
	}
}
