package transport

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"runtime"
	"time"
	"unsafe"

	"go.uber.org/zap"

	"github.com/troupe-hpc/troupe/datatype"
	"github.com/troupe-hpc/troupe/transport/ucx"
)

// The typed-transfer protocol. Sender: RTS (signature, size, minimum block,
// proposed scheme; a small pack payload inline). A pack proposal streams its
// chunks at once and waits for the receiver's ACK; an SGL or zero-copy
// proposal waits for the CTS, where the receiver decides (Algorithm 1) and
// gives the agreed chunk and, for zero-copy, the window keys.

// nearT reports whether a send under the adaptive default has a layout
// whose pack/SGL crossover is measured (datatype.Crossover): a known
// layout, not failed, in the band around T, that the thresholds would send
// pack or SGL.
func (nc *noncontig) nearT(c typedCall, ls *layoutState, known bool, proposal datatype.Scheme) bool {
	return c.scheme == datatype.SchemeAuto && ls != nil && known && !ls.failed.Load() &&
		(proposal == datatype.SchemePack || proposal == datatype.SchemeSGL) &&
		nc.opts.Thresholds.InCrossoverBand(ls.lay.Stats)
}

// choose is one side's local scheme for a call (Algorithm 1's
// SelectLocalScheme for the adaptive default).
func (nc *noncontig) choose(c typedCall, ls *layoutState, known bool) datatype.Scheme {
	if c.bytes == 0 || ls == nil || c.stage != nil {
		return datatype.SchemePack
	}
	switch c.scheme {
	case datatype.SchemeAuto:
		th := nc.opts.Thresholds
		if ls.failed.Load() {
			if ls.lay.Stats.AvgBlock > float64(th.ZCopyAvgBlock) {
				nc.c.fallbacks.Add(1)
			}
			return datatype.SchemePack
		}
		s, want := th.SelectLocal(ls.lay.Stats, known, ls.registered.Load())
		if want && ls.wanted.CompareAndSwap(false, true) {
			nc.wakeRegistrar()
		}
		return s
	case datatype.SchemeZCopy:
		if !nc.register(ls) {
			nc.c.fallbacks.Add(1)
			return datatype.SchemePack
		}
		return datatype.SchemeZCopy
	default:
		return c.scheme
	}
}

func (nc *noncontig) mismatch(op string, c typedCall, code uint8, sbytes, rbytes int64, ssig, rsig datatype.Signature) error {
	nc.c.errors.Add(1)
	e := &TypeMismatchError{Op: op, Peer: c.peer, Tag: c.tag, SendBytes: sbytes, RecvBytes: rbytes, SendSig: ssig, TooSmall: code == stTooSmall}
	if !e.TooSmall {
		e.RecvSig = rsig
	}
	return e
}

// sendPlan is a typed send made ready to post: its RTS (with the data
// when it travels inline) and the layout state it holds (nc.done).
type sendPlan struct {
	h      rts
	msg    []byte
	ls     *layoutState
	sig    datatype.Signature
	inline bool
}

// send runs the sender's side of one typed transfer for a caller waiting
// with ctx. Once its sequence number is taken, a typed send runs to
// completion, or until the transport closes or the peer is lost, whatever
// ctx does: given up before its RTS left, it would leave a hole in its
// (peer, tag) sequence, and after, a receiver that had matched the RTS
// waiting for its data for ever. It runs in the calling goroutine, which
// hands the rest to a goroutine of its own only when ctx ends while the
// transfer waits for the receiver (run); a send whose RTS must wait for
// its turn behind another send runs in such a goroutine from the start
// when ctx can end.
func (nc *noncontig) send(ctx context.Context, c typedCall, seq uint32) (Status, error) {
	p, err := nc.plan(c)
	if err != nil {
		if c.space == KindTyped {
			nc.endRTSTurn(c.seqKey(), seq)
		}
		return Status{}, err
	}
	if ctx.Done() == nil || c.space != KindTyped || nc.rtsTurnNow(c.seqKey(), seq) {
		st, err := nc.run(ctx, c, seq, p)
		if errors.Is(err, errPaused) {
			return st, inFlight(ctx, c)
		}
		return st, err
	}
	done := make(chan error, 1)
	go nc.runTurn(ctx, c, seq, p, done)
	select {
	case err := <-done:
		return Status{}, err
	case <-ctx.Done():
		select {
		case err := <-done:
			return Status{}, err
		default:
		}
		return Status{}, inFlight(ctx, c)
	}
}

// runTurn is run for a send that waits for its RTS's turn in a goroutine
// of its own: its result goes to done (logged if ctx, its caller's, has
// ended by then).
func (nc *noncontig) runTurn(ctx context.Context, c typedCall, seq uint32, p sendPlan, done chan<- error) {
	_, err := nc.run(context.Background(), c, seq, p)
	if err != nil && ctx.Err() != nil {
		nc.t.log.Debug("typed send left by its caller failed", zap.Int("peer", c.peer), zap.Int("tag", c.tag), zap.Error(err))
	}
	done <- err
}

// inFlight is the error of a typed send whose caller's ctx ended first.
func inFlight(ctx context.Context, c typedCall) error {
	return fmt.Errorf("transport: typed send rank %d tag %d: %w (transfer still in flight)", c.peer, c.tag, ctx.Err())
}

// plan chooses a typed send's scheme and builds its RTS.
func (nc *noncontig) plan(c typedCall) (p sendPlan, err error) {
	if p.sig, err = c.dt.SignatureHash(c.count); err != nil {
		return p, fmt.Errorf("%w: typed send: %v", ErrInvalid, err)
	}
	known := false
	if c.bytes > 0 {
		if p.ls, known, err = nc.state(c); err != nil {
			return p, err
		}
	}
	ls := p.ls
	proposal := nc.choose(c, ls, known)
	var flags uint8
	if nc.nearT(c, ls, known, proposal) {
		// Near T the receiver measures the crossover: propose SGL (so
		// that it may choose) until it has told its verdict.
		proposal, flags = datatype.SchemeSGL, rtsCrossover
		if v, ok := ls.verdict(c.peer); ok && v == datatype.SchemePack {
			proposal, flags = datatype.SchemePack, 0
		}
	}
	if n := datatype.Chunks(c.bytes, int64(nc.opts.PackChunk)); n > 1<<32 {
		// A receiver refuses the RTS (its chunks' tags would wrap).
		nc.done(ls)
		return sendPlan{}, fmt.Errorf("%w: typed send of %d bytes in %d chunks of %d: more chunks than a tag numbers (raise PackChunk)", ErrInvalid, c.bytes, n, nc.opts.PackChunk)
	}
	h := rts{proposal: proposal, flags: flags, xid: nc.nextXid(c.peer), bytes: c.bytes, sig: p.sig, chunk: int64(nc.opts.PackChunk), rtt: nc.rtt(c.peer)}
	if ls != nil {
		h.minBlock, h.segments = ls.lay.Stats.MinBlock, ls.lay.Stats.Segments
	}
	p.inline = proposal == datatype.SchemePack && c.bytes <= int64(nc.opts.EagerLimit)
	if c.stage != nil && c.bytes > 0 {
		// The pieces are packed while the chunks before them go
		// (packSender); an inline payload waits for all of them.
		err := c.stage.fill(int64(nc.opts.PackChunk))
		if err == nil && p.inline {
			err = c.stage.ready(c.bytes)
		}
		if err != nil {
			nc.done(ls)
			return sendPlan{}, fmt.Errorf("%w: typed send: packing: %v", ErrInvalid, err)
		}
	}
	p.msg = make([]byte, rtsHdrLen)
	if p.inline {
		h.flags |= rtsInline
		p.msg = make([]byte, rtsHdrLen+int(c.bytes))
		if c.bytes > 0 {
			if _, err := c.dt.PackRaw(datatype.SliceRegion(p.msg[rtsHdrLen:]), datatype.SliceRegion(c.buf), c.base, c.count, 0); err != nil {
				nc.done(ls)
				return sendPlan{}, fmt.Errorf("%w: typed send: packing: %v", ErrInvalid, err)
			}
		}
	}
	h.encode(p.msg)
	p.h = h
	return p, nil
}

// errPaused: a step of a typed send stopped because the caller's context
// ended while the step waited for the receiver; the step's state is
// intact and running it again goes on.
var errPaused = errors.New("transport: typed send paused")

// waitStep waits for r, one step of a typed send, with ctx: errPaused
// when ctx ends with r still running; else r's own result, also when ctx
// ended just as r finished (a paused step would be resumed, a failed one
// would not, so the two must not be confused).
func waitStep(ctx context.Context, r *Request) error {
	_, err := r.wait(ctx, false)
	switch {
	case err == nil:
		return nil
	case r.fin.Load():
		return r.err
	case ctx.Err() != nil && errors.Is(err, ctx.Err()):
		return errPaused
	}
	return err
}

// run posts a planned typed send's RTS when its turn comes (only Close
// stops that wait) and carries the transfer out, waiting with ctx until
// the receiver has matched the RTS: ctx ending before then hands the rest
// to a goroutine (the caller returns ctx's error, the message still
// goes), and after it the transfer runs to completion in the caller, its
// pace the receiver's (a matched receive runs to completion too). Waits
// left when ctx ends after the data has gone (the RTS's or last chunk's
// send completion, the receiver's acknowledgement) are left to finish by
// themselves.
func (nc *noncontig) run(ctx context.Context, c typedCall, seq uint32, p sendPlan) (Status, error) {
	t := nc.t
	ls := p.ls
	detached := false
	defer func() {
		if !detached {
			nc.done(ls)
		}
	}()
	// detach runs rest in a goroutine, which releases the layout. (What
	// the goroutines need is copied in the branches that detach, so that
	// a transfer that does not allocates none of it.)
	detach := func(rest func() error) error {
		detached = true
		go nc.runDetached(ls, c.peer, c.tag, rest)
		return inFlight(ctx, c)
	}
	h, proposal := p.h, p.h.proposal
	me := uint32(t.rank)
	replyIdx := uint32(idxCTS)
	if proposal == datatype.SchemePack {
		replyIdx = idxAck
	}
	reply := make([]byte, ctsLen)
	if c.space == KindTyped {
		err := nc.awaitRTSTurn(context.Background(), c.seqKey(), seq)
		if err != nil {
			return Status{}, err // closed; the turn is given up
		}
	}
	rr := t.ncRecv(c.peer, ncXferTag(dirReply, uint32(c.peer), h.xid, replyIdx), bufOf(reply), nil)
	sent := time.Now()
	sr := t.ncSendRTS(c.peer, c.tag, ncRTSTag(c.space, me, uint16(c.tag), seq), bufOf(p.msg), rr)
	if c.space == KindTyped {
		nc.endRTSTurn(c.seqKey(), seq)
	}
	x := sendXfer{nc: nc, c: c, p: p, sr: sr, rr: rr, reply: reply, sent: sent, final: proposal}
	if proposal == datatype.SchemePack {
		if p.inline {
			nc.c.eager.Add(1)
		} else {
			ps := nc.newPackSender(c, h.xid)
			ps.rts = sr // its chunks follow the RTS unless that failed at its post
			if err := ps.run(ctx); errors.Is(err, errPaused) {
				xd := x
				return Status{}, detach(func() error {
					if err := ps.run(context.Background()); err != nil {
						ps.settle(context.Background(), xd)
						return err
					}
					return xd.finish(context.Background())
				})
			} else if err != nil {
				ps.settle(ctx, x)
				return Status{}, err
			}
		}
	} else {
		m, err := x.awaitCTS(ctx)
		if errors.Is(err, errPaused) {
			xd := x
			xd.resumed = true
			return Status{}, detach(func() error {
				m, err := xd.awaitCTS(context.Background())
				if err != nil {
					return err
				}
				if err := xd.transfer(m); err != nil {
					return err
				}
				return xd.finish(context.Background())
			})
		}
		if err != nil {
			return Status{}, err
		}
		if err := x.transfer(m); err != nil {
			return Status{}, err
		}
	}
	return Status{}, x.finish(ctx)
}

// runDetached runs the rest of a typed send its caller left, then
// releases the layout.
func (nc *noncontig) runDetached(ls *layoutState, peer, tag int, rest func() error) {
	defer nc.done(ls)
	if err := rest(); err != nil {
		nc.t.log.Debug("typed send left by its caller failed", zap.Int("peer", peer), zap.Int("tag", tag), zap.Error(err))
	}
}

// sendXfer is a typed send whose RTS has left: what its remaining steps
// share, so that a goroutine can take them over (run's detach).
type sendXfer struct {
	nc      *noncontig
	c       typedCall
	p       sendPlan
	sr, rr  *Request // the RTS's send; the receive of the CTS or acknowledgement
	reply   []byte   // where rr lands
	sent    time.Time
	resumed bool // awaitCTS runs again in a goroutine that took over
	final   datatype.Scheme
}

// awaitCTS waits for the receiver's CTS (the RTS proposed SGL or
// zero-copy) and checks it; errPaused when ctx ends first.
func (x *sendXfer) awaitCTS(ctx context.Context) (cts, error) {
	nc, c := x.nc, x.c
	for _, r := range []*Request{x.sr, x.rr} {
		if err := waitStep(ctx, r); err != nil {
			return cts{}, err
		}
	}
	if !x.resumed { // else the time includes the receiver's lateness
		nc.noteRTT(c.peer, time.Since(x.sent))
	}
	var m cts
	if err := m.decode(x.reply); err != nil {
		return cts{}, err
	}
	if m.status != stOK {
		return cts{}, nc.replyError(c, m, x.p.sig)
	}
	x.final = m.scheme
	if ls := x.p.ls; m.flags&ctsVerdict != 0 && ls != nil {
		ls.setVerdict(c.peer, x.final)
		nc.noteSentVerdict(crossKey{c.peer, ls.lay.Stats.MinBlock, ls.lay.Stats.Segments, c.bytes}, x.final)
	}
	return m, nil
}

// transfer moves the data by the scheme the CTS chose. The receiver has
// matched: it runs to completion (its pace is the receiver's).
func (x *sendXfer) transfer(m cts) error {
	nc, c, ls, xid := x.nc, x.c, x.p.ls, x.p.h.xid
	ctx := context.Background()
	switch x.final {
	case datatype.SchemePack:
		x.rr = nc.t.ncRecv(c.peer, ncXferTag(dirReply, uint32(c.peer), xid, idxAck), bufOf(x.reply), nil)
		return nc.newPackSender(c, xid).run(ctx)
	case datatype.SchemeSGL:
		x.rr = nil
		return nc.sglSend(ctx, c, ls, xid, m.chunk)
	case datatype.SchemeZCopy:
		x.rr = nil
		return nc.zcopySend(ctx, c, ls, xid, m)
	}
	return nil
}

// finish waits for the RTS's send and the receiver's acknowledgement, if
// any, and counts the transfer. The data has gone: when ctx ends first
// they are left to finish by themselves.
func (x *sendXfer) finish(ctx context.Context) error {
	nc, c := x.nc, x.c
	if err := waitStep(ctx, x.sr); err != nil {
		return err // errPaused: left to finish by itself
	}
	if x.rr != nil {
		if err := waitStep(ctx, x.rr); err != nil {
			return err
		}
		var m cts
		if err := m.decode(x.reply); err != nil {
			return err
		}
		if m.status != stOK {
			return nc.replyError(c, m, x.p.sig)
		}
	}
	nc.c.sent[x.final].Add(1)
	return nil
}

func (nc *noncontig) replyError(c typedCall, m cts, sig datatype.Signature) error {
	if m.status == stFailed {
		return fmt.Errorf("transport: typed send rank %d tag %d: the receiver failed the transfer", c.peer, c.tag)
	}
	return nc.mismatch("typed send", c, m.status, c.bytes, m.rbytes, sig, m.rsig)
}

// packSend packs the payload chunk by chunk into bounce buffers and sends
// each, with PackDepth chunks in flight: chunk k+1 is packed while chunk k
// travels.
func (nc *noncontig) newPackSender(c typedCall, xid uint32) *packSender {
	return &packSender{nc: nc, c: c, xid: xid, n: datatype.Chunks(c.bytes, int64(nc.opts.PackChunk)), w: nc.packWorkers(c)}
}

// packSender is the sending side of a pack transfer. It can be resumed:
// run returns errPaused, its state intact, when ctx ends while a chunk's
// send still waits for the receiver, and running it again goes on.
type packSender struct {
	nc    *noncontig
	c     typedCall
	xid   uint32
	rts   *Request // the RTS the chunks follow unmatched (ncSendAfter); nil after a CTS
	n, k  int64    // chunks in all; the next to pack
	w     int      // pack workers
	q     []packFlight
	first error
	// withdrawn: a chunk failed to pack and the rest went empty; the
	// receiver still acknowledges the transfer.
	withdrawn bool
}

// packFlight is a chunk's send in flight and its bounce buffer.
type packFlight struct {
	r *Request
	b []byte
}

func (ps *packSender) run(ctx context.Context) error {
	nc, c := ps.nc, ps.c
	chunk := int64(nc.opts.PackChunk)
	drain := func(keep int) error {
		for len(ps.q) > keep {
			r := ps.q[0].r
			if err := waitStep(ctx, r); errors.Is(err, errPaused) {
				return err
			} else if err != nil && ps.first == nil {
				ps.first = err
			}
			if r.fin.Load() && c.stage == nil {
				nc.putBounce(ps.q[0].b)
			}
			ps.q = ps.q[1:]
		}
		return nil
	}
	if err := drain(nc.opts.PackDepth - 1); err != nil { // a resumed run's queue first
		return err
	}
	for ps.k < ps.n && ps.first == nil {
		off := ps.k * chunk
		n := min(chunk, c.bytes-off)
		var b []byte
		if c.stage != nil {
			// The stage's Bytes are the packed stream: the chunk goes from
			// them once its piece is packed.
			if err := c.stage.ready(off + n); err != nil {
				ps.withdraw(err)
				break
			}
			b = c.buf[off : off+n]
		} else {
			b = nc.getBounce(n)
			if _, err := c.dt.PackParallel(datatype.SliceRegion(b), datatype.SliceRegion(c.buf), c.base, c.count, off, ps.w); err != nil {
				nc.putBounce(b)
				ps.withdraw(err)
				break
			}
			nc.countParallel(ps.w, len(b))
		}
		r := nc.t.ncSendAfter(ps.rts, c.peer, ncXferTag(dirData, uint32(nc.t.rank), ps.xid, uint32(ps.k)), bufOf(b), nil)
		ps.q = append(ps.q, packFlight{r, b})
		ps.k++
		if err := drain(nc.opts.PackDepth - 1); err != nil {
			return err
		}
	}
	if err := drain(0); err != nil {
		return err
	}
	return ps.first
}

// settle takes the receiver's acknowledgement of a withdrawn transfer
// (its failure status), so that no receive of it is left posted.
func (ps *packSender) settle(ctx context.Context, x sendXfer) {
	if ps.withdrawn {
		_ = x.finish(ctx)
	}
}

// withdraw ends a pack transfer whose chunk ps.k failed to pack with err:
// that chunk and the later ones go empty, which the receiver, counting on
// full chunks, reports as ErrWithdrawn once it has taken them all (none is
// left in UCX's queue, and the receiver acknowledges as usual).
func (ps *packSender) withdraw(err error) {
	c := ps.c
	ps.first = fmt.Errorf("transport: typed send rank %d tag %d: packing chunk %d of %d: %w", c.peer, c.tag, ps.k, ps.n, err)
	ps.withdrawn = true
	for ; ps.k < ps.n; ps.k++ {
		r := ps.nc.t.ncSendAfter(ps.rts, c.peer, ncXferTag(dirData, uint32(ps.nc.t.rank), ps.xid, uint32(ps.k)), ucx.Buffer{}, nil)
		ps.q = append(ps.q, packFlight{r: r})
	}
}

// packWorkers returns how many goroutines pack or unpack one chunk of c:
// more than one only for page-bound layouts (datatype.Type.Workers), at most
// NoncontigOptions.PackWorkers (0: GOMAXPROCS).
func (nc *noncontig) packWorkers(c typedCall) int {
	limit := nc.opts.PackWorkers
	if limit == 0 {
		limit = runtime.GOMAXPROCS(0)
	}
	return c.dt.Workers(c.count, limit)
}

// countParallel counts a chunk of n bytes moved with w workers if
// PackParallel split it.
func (nc *noncontig) countParallel(w, n int) {
	if datatype.ParallelParts(int64(n), w) > 1 {
		nc.c.parallelChunks.Add(1)
	}
}

// packRecv receives n pack chunks with PackDepth receives posted ahead and
// unpacks each as it arrives (or drops them when discard is set). A chunk
// that fails is recorded and the rest are still taken, so that none is
// left behind in UCX's queue; if ctx ends, the receives in flight are
// cancelled and the first error returned.
func (nc *noncontig) packRecv(ctx context.Context, c typedCall, h rts, discard bool) error {
	t := nc.t
	n := datatype.Chunks(h.bytes, h.chunk)
	type flight struct {
		r *Request
		b []byte
	}
	q := make([]flight, 0, nc.opts.PackDepth)
	next := int64(0)
	// A staged receive lands its chunks in the stage's Bytes, the packed
	// stream, and unpacks each into the layout as it comes.
	staged := c.stage != nil && !discard
	putBounce := func(b []byte) {
		if !staged {
			nc.putBounce(b)
		}
	}
	post := func() {
		want := min(h.chunk, h.bytes-next*h.chunk)
		if staged {
			b := c.buf[next*h.chunk : next*h.chunk+want]
			q = append(q, flight{t.ncRecv(c.peer, ncXferTag(dirData, uint32(c.peer), h.xid, uint32(next)), bufOf(b), nil), b})
			next++
			return
		}
		if discard {
			// The sender's sizes were not checked against a receive
			// buffer: take the chunk into at most a pooled buffer (a
			// longer one is truncated, which discarding ignores).
			want = min(want, int64(nc.opts.PackChunk))
		}
		b := nc.getBounce(want)
		q = append(q, flight{t.ncRecv(c.peer, ncXferTag(dirData, uint32(c.peer), h.xid, uint32(next)), bufOf(b), nil), b})
		next++
	}
	for next < n && len(q) < nc.opts.PackDepth {
		post()
	}
	var first error
	w := nc.packWorkers(c)
	for k := int64(0); k < n; k++ {
		f := q[0]
		q = q[1:]
		st, err := f.r.Wait(ctx)
		switch {
		case err == nil && st.Size == 0:
			// Every chunk holds data: an empty one is a sender's
			// withdrawal (packSender.withdraw).
			err = fmt.Errorf("transport: typed recv rank %d tag %d: pack chunk %d of %d came empty, the sender's packing failed (the layout holds the chunks before it): %w",
				c.peer, c.tag, k, n, ErrWithdrawn)
		case err == nil && int64(st.Size) != int64(len(f.b)):
			err = fmt.Errorf("%w: typed recv: pack chunk %d of %d bytes, want %d", ErrInvalid, k, st.Size, len(f.b))
		}
		if err != nil {
			if first == nil {
				first = err
			}
			if ctx.Err() != nil {
				putBounce(f.b)
				for _, f := range q {
					_, _ = f.r.Wait(ctx) // cancels it
					putBounce(f.b)
				}
				return first
			}
		}
		switch {
		case err != nil || discard || first != nil:
		case staged:
			if err := c.stage.landed(k*h.chunk, int64(len(f.b))); err != nil {
				first = fmt.Errorf("%w: typed recv: unpacking: %v", ErrInvalid, err)
			}
		default:
			if _, err := c.dt.UnpackParallel(datatype.SliceRegion(c.buf), datatype.SliceRegion(f.b), c.base, c.count, k*h.chunk, w); err != nil {
				first = fmt.Errorf("%w: typed recv: unpacking: %v", ErrInvalid, err)
			}
			nc.countParallel(w, len(f.b))
		}
		putBounce(f.b)
		if next < n {
			post()
		}
	}
	return first
}

// sglDepth is how many SGL chunks are in flight per transfer.
func (nc *noncontig) sglDepth() int { return max(nc.opts.PackDepth, 16) }

// sglSend sends the layout window by window (chunk bytes each) as UCP IOV
// messages.
func (nc *noncontig) sglSend(ctx context.Context, c typedCall, ls *layoutState, xid uint32, chunk int64) error {
	t := nc.t
	wins, err := datatype.Windows(ls.lay.IOVs, chunk)
	if err != nil {
		return fmt.Errorf("%w: typed send: %v", ErrInvalid, err)
	}
	var q []*Request
	var first error
	var ps []datatype.IOV
	for k, w := range wins {
		ps = w.Pieces(ls.lay.IOVs, ps[:0])
		b, pins := iovList(c.buf, c.origin, ps)
		q = append(q, t.ncSend(c.peer, ncXferTag(dirData, uint32(t.rank), xid, uint32(k)), b, pins))
		for len(q) >= nc.sglDepth() {
			if _, err := q[0].Wait(ctx); err != nil && first == nil {
				first = err
			}
			q = q[1:]
		}
		if first != nil {
			break
		}
	}
	if err := waitAll(ctx, q); err != nil && first == nil {
		first = err
	}
	runtime.KeepAlive(c.buf)
	return first
}

// trimIOVs returns the prefix of iovs holding n bytes.
func trimIOVs(iovs []datatype.IOV, n int64) []datatype.IOV {
	var out []datatype.IOV
	for _, v := range iovs {
		if n <= 0 {
			break
		}
		l := min(v.Len, n)
		out = append(out, datatype.IOV{Addr: v.Addr, Len: l})
		n -= l
	}
	return out
}

// sglRecv receives bytes packed bytes window by window into the layout;
// ready runs once the first receives are posted (it sends the CTS).
func (nc *noncontig) sglRecv(ctx context.Context, c typedCall, ls *layoutState, h rts, chunk int64, ready func() error) error {
	t := nc.t
	iovs := ls.lay.IOVs
	if h.bytes < ls.lay.Stats.Bytes {
		iovs = trimIOVs(iovs, h.bytes)
	}
	wins, err := datatype.Windows(iovs, chunk)
	if err != nil {
		return fmt.Errorf("%w: typed recv: %v", ErrInvalid, err)
	}
	q := make([]*Request, 0, nc.sglDepth())
	next := 0
	var ps []datatype.IOV
	post := func() {
		w := wins[next]
		ps = w.Pieces(iovs, ps[:0])
		b, pins := iovList(c.buf, c.origin, ps)
		q = append(q, t.ncRecv(c.peer, ncXferTag(dirData, uint32(c.peer), h.xid, uint32(next)), b, pins))
		next++
	}
	for next < len(wins) && len(q) < nc.sglDepth() {
		post()
	}
	if err := ready(); err != nil {
		return err
	}
	var first error
	for k := 0; k < len(wins); k++ {
		r := q[0]
		q = q[1:]
		st, err := r.Wait(ctx)
		if err == nil && int64(st.Size) != wins[k].Len {
			err = fmt.Errorf("%w: typed recv: SGL chunk %d of %d bytes, want %d", ErrInvalid, k, st.Size, wins[k].Len)
		}
		if err != nil && first == nil {
			first = err
		}
		if next < len(wins) {
			post()
		}
	}
	runtime.KeepAlive(c.buf)
	return first
}

// zcopySend writes the payload into the receiver's windows: window k of the
// sender (same chunk) goes into window k of the receiver as puts of the
// sender's pieces (UCX 1.13's put takes contiguous buffers only, so one
// window write is a put per matching piece, issued back to back), then a
// flush and the completion message.
func (nc *noncontig) zcopySend(ctx context.Context, c typedCall, ls *layoutState, xid uint32, m cts) (err error) {
	t := nc.t
	finished := false // the completion message was sent (or failed to go)
	defer func() {
		if err != nil && !finished {
			// The receiver waits for the completion message: tell it the
			// windows were not written (it waited for ever).
			fin := make([]byte, finLen)
			fin[0] = finFailed
			_, _ = t.ncSend(c.peer, ncXferTag(dirData, uint32(t.rank), xid, idxFin), bufOf(fin), nil).Wait(ctx)
		}
	}()
	if m.flags&ctsKeys != 0 && m.keysLen > maxKeyBlob(m.rbytes) {
		// Not allocated: the CTS is inconsistent (it made the sender
		// allocate up to 16 GiB and wait for it).
		return fmt.Errorf("%w: typed send rank %d tag %d: CTS announces %d bytes of window keys for a %d-byte receive layout (at most %d)",
			ErrInvalid, c.peer, c.tag, m.keysLen, m.rbytes, maxKeyBlob(m.rbytes))
	}
	e := nc.remoteEntry(c.peer, m.setID, m.flags&ctsKeys != 0)
	if m.flags&ctsKeys != 0 {
		blob := make([]byte, m.keysLen)
		r := t.ncRecv(c.peer, ncXferTag(dirReply, uint32(c.peer), xid, idxKeys), bufOf(blob), nil)
		_, err := r.Wait(ctx)
		var rs *remoteSet
		if err == nil {
			rs, err = decodeKeyBlob(blob, m.setID)
		}
		if err != nil {
			err = fmt.Errorf("transport: typed send rank %d tag %d: window keys: %w", c.peer, c.tag, err)
			e.fill(nil, err) // transfers waiting for these keys fail too
			return err
		}
		e.fill(rs, nil)
	} else {
		// Keys omitted: this peer has them, or another transfer of ours is
		// receiving them right now.
		nc.c.rkHits.Add(1)
	}
	rs, err := e.wait(ctx)
	if err != nil {
		return err
	}
	ws, err := nc.windows(ls, m.chunk)
	if err != nil {
		return err
	}
	if len(ws.wins) > len(rs.wins) {
		return fmt.Errorf("%w: typed send: %d windows, receiver has %d", ErrInvalid, len(ws.wins), len(rs.wins))
	}
	var moves []datatype.Move
	var ps []datatype.IOV
	for k, w := range ws.wins {
		ps = w.Pieces(ls.lay.IOVs, ps[:0])
		if moves, err = datatype.Moves(ps, trimIOVs(rs.wins[k], w.Len), moves); err != nil {
			return fmt.Errorf("%w: typed send: window %d: %v", ErrInvalid, k, err)
		}
	}
	puts := t.ncPuts(c.peer, c.buf, c.origin, moves, rs.rkey)
	nc.c.puts.Add(int64(len(moves)))
	err = waitAll(ctx, puts)
	runtime.KeepAlive(c.buf)
	if err != nil {
		return err
	}
	finished = true
	fin := make([]byte, finLen)
	_, err = t.ncSend(c.peer, ncXferTag(dirData, uint32(t.rank), xid, idxFin), bufOf(fin), nil).Wait(ctx)
	return err
}

// ncPuts issues one put per move into the peer's registration rkey and then
// a flush, all under one hold of the worker lock; the last request is the
// flush.
func (t *Transport) ncPuts(peer int, buf []byte, origin uintptr, moves []datatype.Move, rkey []byte) []*Request {
	rs := make([]*Request, len(moves)+1)
	for i, mv := range moves {
		rs[i] = t.newRequest("typed put", peer, -1, int(mv.Len))
	}
	flush := t.newRequest("typed flush", peer, -1, 0)
	rs[len(moves)] = flush
	base := bytesPtr(buf)
	t.exec(func() {
		p, err := t.peerLocked(peer, "typed put")
		if err != nil {
			for _, r := range rs {
				t.fail(r, err)
			}
			return
		}
		rk := p.ncRkeys[string(rkey)]
		if rk == nil {
			if rk, err = p.ep.UnpackRkey(rkey); err != nil {
				for _, r := range rs {
					t.fail(r, fmt.Errorf("transport: typed put rank %d: %w", peer, err))
				}
				return
			}
			p.ncRkeys[string(rkey)] = rk
		}
		for i, mv := range moves {
			ptr := unsafe.Add(base, int(mv.Src-origin))
			ureq, err := t.w.Put(p.ep, ptr, int(mv.Len), uint64(mv.Dst), rk)
			t.settle(rs[i], ureq, err, base)
		}
		ureq, err := t.w.Flush(p.ep)
		t.settle(flush, ureq, err)
	})
	return rs
}

// matchExactRTS receives the RTS of sequence number seq of c's (source,
// tag) into hbuf and reports its length. A receive cancelled through ctx
// gives the number back.
func (nc *noncontig) matchExactRTS(ctx context.Context, c typedCall, seq uint32, hbuf []byte) (int, error) {
	return nc.awaitExactRTS(ctx, nc.postExactRTS(c, seq, hbuf))
}

// postExactRTS posts the receive of the RTS of sequence number seq of c's
// (source, tag) into hbuf.
func (nc *noncontig) postExactRTS(c typedCall, seq uint32, hbuf []byte) *Request {
	key := c.seqKey()
	return nc.t.ncRecvThen(c.peer, ncRTSTag(c.space, uint32(c.peer), uint16(c.tag), seq), ucx.Buffer{Ptr: bytesPtr(hbuf), Len: len(hbuf)}, nil,
		func(r *Request) { nc.rtsPostedReq(key, seq, r) })
}

// awaitExactRTS waits for rr, a receive postExactRTS posted, and reports
// the RTS's length. A receive cancelled through ctx has given its number
// back by then (Transport.cancelledSeq), and the receives of its (source,
// tag) pending behind it may have taken over the numbers before theirs
// (renumber.go).
func (nc *noncontig) awaitExactRTS(ctx context.Context, rr *Request) (int, error) {
	st, err := rr.Wait(ctx)
	if err != nil {
		return 0, err
	}
	return st.Size, nil
}

// recvMatched runs the rest of a typed receive once its RTS, hdr, has
// arrived from c.peer; a staged receive's unpacks are done when it
// returns.
func (nc *noncontig) recvMatched(ctx context.Context, c typedCall, hdr []byte) (Status, error) {
	st, err := nc.recvData(ctx, c, hdr)
	if c.stage != nil {
		if serr := c.stage.settle(); serr != nil && err == nil {
			err = fmt.Errorf("%w: typed recv: unpacking: %v", ErrInvalid, serr)
		}
	}
	return st, err
}

// recvData is recvMatched but for a staged receive's final wait.
func (nc *noncontig) recvData(ctx context.Context, c typedCall, hdr []byte) (Status, error) {
	t := nc.t
	var h rts
	reply := func(idx uint32, m cts) error {
		b := make([]byte, ctsLen)
		m.encode(b)
		_, err := t.ncSend(c.peer, ncXferTag(dirReply, uint32(t.rank), h.xid, idx), bufOf(b), nil).Wait(ctx)
		return err
	}
	if err := h.decode(hdr); err != nil {
		nc.failMalformedRTS(ctx, c.peer, hdr, c.bytes)
		return Status{}, fmt.Errorf("transport: typed recv rank %d tag %d: %w", c.peer, c.tag, err)
	}
	status := Status{Source: c.peer, Tag: c.tag, Size: int(h.bytes)}
	code, rsig, err := nc.check(c, h)
	switch {
	case c.refuse:
		code, err = stFailed, fmt.Errorf("%w: typed recv rank %d tag %d (%d bytes)", ErrRefused, c.peer, c.tag, h.bytes)
	case err != nil:
		code = stFailed
	}
	if code != stOK {
		m := cts{status: code, rbytes: c.bytes, rsig: rsig}
		if h.proposal == datatype.SchemePack {
			if h.flags&rtsInline == 0 {
				_ = nc.packRecv(ctx, c, h, true)
			}
			_ = reply(idxAck, m)
		} else {
			_ = reply(idxCTS, m)
		}
		if err != nil {
			return status, err
		}
		return status, nc.mismatch("typed recv", c, code, h.bytes, c.bytes, h.sig, rsig)
	}
	// Algorithm 1's RTS handler: the receiver's own choice for its layout
	// (which also wakes its background registration on first use).
	var ls *layoutState
	known := false
	if c.bytes > 0 {
		if ls, known, err = nc.state(c); err != nil {
			m := cts{status: stFailed, rbytes: c.bytes}
			if h.proposal == datatype.SchemePack {
				if h.flags&rtsInline == 0 {
					_ = nc.packRecv(ctx, c, h, true)
				}
				_ = reply(idxAck, m)
			} else {
				_ = reply(idxCTS, m)
			}
			return status, err
		}
		defer nc.done(ls)
	}
	local := nc.choose(c, ls, known)
	if h.proposal == datatype.SchemePack {
		if h.flags&rtsInline != 0 {
			if h.bytes > 0 {
				_, err := c.dt.UnpackRaw(datatype.SliceRegion(c.buf), datatype.SliceRegion(hdr[rtsHdrLen:rtsHdrLen+h.bytes]), c.base, c.count, 0)
				if err == nil && c.stage != nil {
					err = c.stage.landed(0, h.bytes)
				}
				if err != nil {
					err = fmt.Errorf("%w: typed recv: unpacking: %v", ErrInvalid, err)
					_ = reply(idxAck, cts{status: stFailed, rbytes: c.bytes})
					return status, err
				}
			}
		} else if err := nc.packRecv(ctx, c, h, false); err != nil {
			_ = reply(idxAck, cts{status: stFailed, rbytes: c.bytes})
			return status, err
		}
		if err := reply(idxAck, cts{status: stOK, scheme: datatype.SchemePack, rbytes: c.bytes}); err != nil {
			return status, err
		}
		nc.c.recv[datatype.SchemePack].Add(1)
		return status, nil
	}
	// An SGL or zero-copy proposal (so there are bytes): the receiver decides.
	final := datatype.Agree(h.proposal, local)
	// A sender near T asks for the crossover to be measured: the
	// receiver's measurement for this pair picks (and, once it knows,
	// tells the sender its verdict in the CTS).
	var cross *datatype.Crossover
	var sk shapeKey // the pair's shape, for the verdict of a timed receive
	var ctsFlags uint8
	if h.flags&rtsCrossover != 0 && h.proposal == datatype.SchemeSGL && c.scheme == datatype.SchemeAuto && c.stage == nil &&
		known && ls.lay.Stats.Segments <= nc.opts.Thresholds.SGLMaxSegments {
		// A symmetric exchange (the sender's layout has this side's
		// shape): the two directions are measured by their receivers
		// independently and may reach different verdicts, and a mixed
		// exchange was slower than either scheme (docs/noncontig.md). The
		// lower rank's receiver decides both: the higher rank takes the
		// verdict it was told as a sender to the lower one, and until it
		// knows it, keeps its own verdict to itself for as many receives
		// as the trials took, so that the sender keeps asking.
		// A pair of layouts shaped like one measured before (the same
		// types on other buffers) takes that verdict without trials, so
		// that the two directions, each told or remembering a verdict by
		// shape, cannot disagree; but only a verdict younger than
		// CrossoverReuse, because what the machine favours drifts. A
		// pair keeps the verdict it took (ls.adopted).
		k := crossKey{c.peer, h.minBlock, h.segments, h.bytes}
		sk = shapeKey{k, ls.lay.Stats.MinBlock, ls.lay.Stats.Segments}
		higher := c.peer < t.rank && h.minBlock == ls.lay.Stats.MinBlock && h.segments == ls.lay.Stats.Segments &&
			h.bytes == c.bytes
		if v, ok := ls.adoptedVerdict(k); ok {
			final, ctsFlags = v, ctsVerdict
			nc.c.crossAdopted.Add(1)
		} else if v, ok := nc.sentVerdict(k); ok && higher {
			ls.adopt(k, v)
			final, ctsFlags = v, ctsVerdict
			nc.c.crossAdopted.Add(1)
		} else if v, ok := nc.shapeVerdict(sk); ok && !higher && !ls.measuring(k) {
			ls.adopt(k, v)
			final, ctsFlags = v, ctsVerdict
			nc.c.crossAdopted.Add(1)
		} else {
			th := nc.opts.Thresholds
			prefer := datatype.SchemePack // what T alone says for this side's layout
			if ls.lay.Stats.AvgBlock > float64(th.ZCopyAvgBlock) {
				prefer = datatype.SchemeSGL
			}
			cross = ls.crossover(k, th, prefer)
			ls.crossMu.Lock()
			final = cross.Next()
			if _, ok := cross.Verdict(); ok {
				cross = nil
				if !higher || !ls.holdVerdict(k, nc.trialTransfers) {
					ctsFlags = ctsVerdict
				}
			}
			ls.crossMu.Unlock()
		}
	}
	var chunk int64
	if final != datatype.SchemePack {
		if chunk, err = datatype.AgreeChunk(nc.opts.Thresholds.MaxIOVsPerOp, h.minBlock, ls.lay.Stats.MinBlock); err != nil {
			final = datatype.SchemePack
		}
	}
	// A timed receive runs from its CTS until its data is in place (for
	// pack, before the ACK, which SGL has no counterpart of); only trials
	// read the clock.
	var start time.Time
	if cross != nil {
		start = time.Now()
	}
	var took time.Duration
	switch final {
	case datatype.SchemeSGL:
		err = nc.sglRecv(ctx, c, ls, h, chunk, func() error {
			return reply(idxCTS, cts{status: stOK, scheme: datatype.SchemeSGL, flags: ctsFlags, chunk: chunk, rbytes: c.bytes})
		})
		if cross != nil {
			// Every SGL transfer after the verdict waits for its CTS; a
			// pack verdict sends at once. The trials, timed from the CTS,
			// leave that round trip out of both, so SGL is charged the one
			// its sender measured (docs/noncontig.md, "Why the trials
			// picked SGL where pack is faster, and the round-trip charge").
			took = time.Since(start) + time.Duration(h.rtt)
		}
	case datatype.SchemeZCopy:
		err = nc.zcopyRecv(ctx, c, ls, h, chunk, reply)
	default:
		final = datatype.SchemePack
		if err = reply(idxCTS, cts{status: stOK, scheme: datatype.SchemePack, flags: ctsFlags, rbytes: c.bytes}); err == nil {
			if err = nc.packRecv(ctx, c, h, false); err != nil {
				_ = reply(idxAck, cts{status: stFailed, rbytes: c.bytes})
			} else {
				if cross != nil {
					took = time.Since(start)
				}
				err = reply(idxAck, cts{status: stOK, scheme: datatype.SchemePack, rbytes: c.bytes})
			}
		}
	}
	if err != nil {
		return status, err
	}
	if cross != nil {
		ls.crossMu.Lock()
		cross.Observe(final, took)
		v, decided := cross.Verdict()
		mp, ms := cross.Medians()
		ls.crossMu.Unlock()
		nc.c.crossTrials.Add(1)
		if decided {
			nc.c.crossVerdicts.Add(1)
			nc.noteShapeVerdict(sk, v)
			t.log.Debug("typed transfer: pack/SGL crossover measured", zap.Int("peer", c.peer),
				zap.Int64("sender_min_block", h.minBlock), zap.Int64("segments", h.segments),
				zap.Duration("pack_median", mp), zap.Duration("sgl_median", ms), zap.Stringer("verdict", v))
		}
	}
	nc.c.recv[final].Add(1)
	return status, nil
}

// failMalformedRTS answers the sender of hdr, an RTS from peer that did
// not decode, with a failure when its transfer id is readable (the header
// is whole and of this version): the sender waits for an answer, and
// would otherwise wait for ever. rbytes is the receive layout's size (0
// when there is none, as for a probe).
func (nc *noncontig) failMalformedRTS(ctx context.Context, peer int, hdr []byte, rbytes int64) {
	if len(hdr) < rtsHdrLen || hdr[0] != ncVersion {
		return
	}
	idx := uint32(idxCTS)
	if datatype.Scheme(hdr[1]) == datatype.SchemePack {
		idx = idxAck
	}
	xid := binary.LittleEndian.Uint32(hdr[4:])
	b := make([]byte, ctsLen)
	m := cts{status: stFailed, rbytes: rbytes}
	m.encode(b)
	_, _ = nc.t.ncSend(peer, ncXferTag(dirReply, uint32(nc.t.rank), xid, idx), bufOf(b), nil).Wait(ctx)
}

// zcopyRecv maps (or finds) the layout's windows for the agreed chunk, sends
// the CTS with the window keys unless this peer already holds them, and
// waits for the sender's completion message.
func (nc *noncontig) zcopyRecv(ctx context.Context, c typedCall, ls *layoutState, h rts, chunk int64, reply func(uint32, cts) error) error {
	t := nc.t
	ws, err := nc.windows(ls, chunk)
	if err != nil {
		_ = reply(idxCTS, cts{status: stFailed, rbytes: c.bytes})
		return err
	}
	fin := make([]byte, finLen)
	fr := t.ncRecv(c.peer, ncXferTag(dirData, uint32(c.peer), h.xid, idxFin), bufOf(fin), nil)
	m := cts{status: stOK, scheme: datatype.SchemeZCopy, nwin: uint32(len(ws.wins)), chunk: chunk, setID: ws.id, rbytes: c.bytes}
	var blob []byte
	if !ws.hasSent(c.peer) {
		blob = ws.keyBlob(ls.lay.IOVs)
		m.flags |= ctsKeys
		m.keysLen = int64(len(blob))
	}
	if err := reply(idxCTS, m); err != nil {
		return err
	}
	if blob != nil {
		if _, err := t.ncSend(c.peer, ncXferTag(dirReply, uint32(t.rank), h.xid, idxKeys), bufOf(blob), nil).Wait(ctx); err != nil {
			return err
		}
		ws.markSent(c.peer)
		nc.c.keyX.Add(1)
	} else {
		nc.c.keysOmitted.Add(1)
	}
	_, err = fr.Wait(ctx)
	runtime.KeepAlive(c.buf)
	if err == nil && fin[0] != finOK {
		err = fmt.Errorf("transport: typed recv rank %d tag %d: the sender could not write the zero-copy windows (some may hold its data): %w", c.peer, c.tag, ErrWithdrawn)
	}
	return err
}

// check compares the sender's signature and size with the receive layout's:
// the message must fit, and its signature must equal that of the receiver's
// first elements.
func (nc *noncontig) check(c typedCall, h rts) (uint8, datatype.Signature, error) {
	if h.bytes > c.bytes {
		return stTooSmall, datatype.Signature{}, nil
	}
	if c.packed {
		return stOK, h.sig, nil // MPI_PACKED: any signature lands as its packed stream
	}
	k := c.count
	if h.bytes < c.bytes {
		size := c.dt.Size()
		if size == 0 || h.bytes%size != 0 {
			rsig, err := c.dt.SignatureHash(c.count)
			return stMismatch, rsig, err
		}
		k = h.bytes / size
	}
	rsig, err := c.dt.SignatureHash(k)
	if err != nil {
		return stFailed, rsig, err
	}
	if rsig != h.sig {
		return stMismatch, rsig, nil
	}
	return stOK, rsig, nil
}
