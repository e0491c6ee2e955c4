package actor

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"math/bits"
	"reflect"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"
	"unsafe"

	pa "github.com/asynkron/protoactor-go/actor"
	"go.uber.org/zap"

	"github.com/troupe-hpc/troupe/datatype"
	"github.com/troupe-hpc/troupe/gpu"
	"github.com/troupe-hpc/troupe/transport"
)

// remoteProcess is the protoactor Process of every actor on one other rank:
// the address resolver hands it out, and it turns sends into active messages.
type remoteProcess struct {
	rt   *Runtime
	rank int
}

var _ pa.Process = (*remoteProcess)(nil)

// SendUserMessage sends a user message. protoactor's Send has no error
// result: a message that cannot be sent goes to the local dead letters with
// the reason, and a request's sender gets an *UndeliverableError at once.
func (p *remoteProcess) SendUserMessage(pid *pa.PID, message any) {
	_, msg, sender := pa.UnwrapEnvelope(message)
	// A protoactor future (RootContext or Context.RequestFuture) waiting for
	// an answer from this rank is tracked like Runtime.RequestFuture's, so
	// that it fails at once if the rank is lost instead of by its timeout.
	future := sender != nil && sender.Address == p.rt.addrs[p.rt.rank] && strings.HasPrefix(sender.Id, "future")
	if future {
		p.rt.trackRequest(sender.Id, p.rank, nil)
	}
	if err := p.rt.send(p.rank, pid, msg, sender, 0); err != nil {
		if future {
			p.rt.answered(sender.Id)
		}
		p.rt.undeliverable(pid, msg, sender, err.Error())
		if sender == nil && pid != nil && (strings.HasPrefix(pid.Id, requestPrefix) || strings.HasPrefix(pid.Id, "future")) {
			// An answer (Respond) that could not be sent: tell the
			// requester, which would otherwise wait out its timeout.
			ue := &UndeliverableError{Target: pid.String(), Reason: "the answer could not be sent: " + err.Error()}
			_ = p.rt.send(p.rank, pid, ue, nil, 0)
		}
	}
}

// SendSystemMessage sends a system message (watch, unwatch, terminated, stop).
func (p *remoteProcess) SendSystemMessage(pid *pa.PID, message any) {
	switch m := message.(type) {
	case *pa.Watch:
		p.rt.noteWatch(p.rank, pid, m.Watcher, true)
	case *pa.Unwatch:
		p.rt.noteWatch(p.rank, pid, m.Watcher, false)
	}
	err := p.rt.send(p.rank, pid, message, nil, flagSystem|flagNoCredit)
	if err == nil {
		return
	}
	if w, ok := message.(*pa.Watch); ok && w.Watcher != nil && RankOf(w.Watcher) == p.rt.rank {
		// The watchee's rank is gone (or we are): the watcher hears so now.
		p.rt.noteWatch(p.rank, pid, w.Watcher, false)
		p.rt.deliverSystem(w.Watcher, &pa.Terminated{Who: pid, Why: pa.TerminatedReason_AddressTerminated})
		return
	}
	p.rt.log.Debug("system message not sent", zap.Stringer("to", pid), zap.Error(err))
}

// Stop stops a remote actor.
func (p *remoteProcess) Stop(pid *pa.PID) { p.SendSystemMessage(pid, &pa.Stop{}) }

// undeliverable reports a message that could not be delivered: dead letters
// get it with the reason and a waiting sender gets an *UndeliverableError.
func (rt *Runtime) undeliverable(target *pa.PID, msg any, sender *pa.PID, reason string) {
	rt.stats.DeadLetters.Add(1)
	ue := &UndeliverableError{Target: target.String(), Reason: reason}
	rt.log.Debug("undeliverable message", zap.Stringer("to", target), zap.String("reason", reason))
	rt.sys.EventStream.Publish(&pa.DeadLetterEvent{PID: target, Message: ue, Sender: nil})
	if sender == nil {
		return
	}
	if RankOf(sender) == rt.rank {
		if rp := rt.takeReply(sender.Id); rp != nil {
			rp.SendUserMessage(sender, ue)
			return
		}
		proc, _ := rt.sys.ProcessRegistry.GetLocal(sender.Id)
		proc.SendUserMessage(sender, ue)
		return
	}
	if r := RankOf(sender); r >= 0 && r < rt.size {
		_ = rt.send(r, sender, ue, nil, flagNoCredit)
	}
}

// send encodes msg and sends it to target on rank r. A gpu.Buffer field
// sent by CUDA IPC or on the pair channel may be reused when send returns.
func (rt *Runtime) send(r int, target *pa.PID, msg any, sender *pa.PID, flags uint32) error {
	c, err := rt.sendAsync(r, target, msg, sender, flags)
	if err != nil || c == nil {
		return err
	}
	if err := rt.waitDevice(c); err != nil && !errors.Is(err, errPairDeclined) {
		return err
	}
	return nil
}

// sendAsync is send returning at once; a non-nil Completion is done when
// the message's gpu.Buffer, sent by CUDA IPC, may be reused.
func (rt *Runtime) sendAsync(r int, target *pa.PID, msg any, sender *pa.PID, flags uint32) (*Completion, error) {
	if rt.closed.Load() {
		return nil, ErrClosed
	}
	ct, ptr, err := lookupType(msg)
	if err != nil {
		return nil, err
	}
	// A large Typed field follows the message by the typed-transfer
	// protocol, and a cuda device buffer for a process of this host goes as
	// a CUDA IPC descriptor: the body carries the field zeroed.
	msg, stage, err := rt.stageTyped(ct, msg, ptr)
	if err != nil {
		return nil, err
	}
	if stage != nil {
		// post has sent the field's packed bytes when it returns.
		defer stage.Release()
	}
	direct, msg, err := rt.typedDirect(r, ct, msg, ptr)
	if err != nil {
		return nil, err
	}
	if stage != nil {
		if direct != nil {
			direct.stage = stage // packed as its transfer goes
		} else if err := stage.Pack(); err != nil {
			return nil, fmt.Errorf("actor: %s: packing a device Typed field: %w", ct.name, err)
		}
	}
	dev, msg := rt.deviceIPC(r, ct, msg, ptr)
	if dev == nil {
		dev, msg = rt.devicePair(r, ct, msg, ptr)
	}
	c, err := rt.post(r, target, msg, sender, flags, ct, ptr, direct, dev)
	if err != nil && dev != nil && dev.pair == nil {
		rt.devSends.finish(dev.seq, -1, err)
	}
	return c, err
}

// post encodes and sends the message sendAsync prepared.
func (rt *Runtime) post(r int, target *pa.PID, msg any, sender *pa.PID, flags uint32, ct *codecType, ptr bool, direct *directTyped, dev *deviceSend) (*Completion, error) {
	// The body, then the envelope, go into one pooled buffer: a message
	// small enough to be posted is copied by the transport before PostAM
	// returns, so the buffer serves the next message.
	//
	// A type whose last message was too large to be posted is encoded into
	// a buffer of that size from the landing pool instead, which returns
	// to the pool once the transport is done with it (largeSends): growing
	// the small buffer took new memory for every such message, and a page
	// touched for the first time costs about 10 us on a virtual machine
	// (docs/actor.md).
	sb := sendBufs.Get().(*[]byte)
	defer putSendBuf(sb)
	start, reused := (*sb)[:0], false
	if n := ct.lastLarge.Load(); n > 0 {
		rt.large.reclaim()
		start, reused = takeBuf(int(n))
		start = start[:0]
	} else if ct.stagesPayload() {
		rt.large.reclaim() // the staged copies of earlier messages
	}
	var held *transport.Request // the send that still reads b
	b, payload, err := appendBody(start, ct, msg, ptr)
	defer func() { rt.large.release(b, held) }()
	if cap(b) <= transport.MaxPostAM {
		*sb = b
	}
	if err != nil {
		return nil, err
	}
	body := b[:len(b):len(b)]
	e := envelope{Flags: flags, Source: rt.rank, Target: target.Id, TargetReq: target.RequestId, Type: ct.id}
	if ptr {
		e.Flags |= flagPointer
	}
	if sender != nil {
		sr := RankOf(sender)
		if sr < 0 || sr >= rt.size {
			return nil, fmt.Errorf("actor: sender %s is not an actor of this job", sender)
		}
		e.SenderRank, e.Sender = sr, sender.Id
	}
	data := body
	staged := false // data is the runtime's copy of a Typed or gpu.Buffer field
	switch {
	case direct != nil:
		e.Flags |= flagBodyHdr | flagTypedXfer
		e.Body, e.PayloadLen, data = body, int(direct.bytes), nil
	case dev != nil && dev.pair != nil:
		e.Flags |= flagBodyHdr | flagDevicePair
		e.Body, e.PayloadLen, data = body, dev.n, nil
	case dev != nil:
		e.Flags |= flagBodyHdr | flagDeviceIPC
		e.Body, e.PayloadLen, data = body, dev.n, dev.data
	case payload != nil:
		e.Flags |= flagBodyHdr
		e.Body, e.PayloadLen, data = body, len(payload), payload
		staged = ct.stagesPayload()
	}
	b = appendEnvelope(b, &e)
	if cap(b) <= transport.MaxPostAM {
		*sb = b
	}
	hdr := b[len(body):]
	if max := rt.t.MaxAMHeader(); len(hdr) > max {
		// Only a body that travels in the header (flagBodyHdr) can be
		// this long; UCX would abort the process on it.
		return nil, fmt.Errorf("actor: sending %s to %s: %w: its other fields take %d bytes encoded, at most %d fit", ct.name, target, ErrFieldsTooLarge, len(body), max-(len(hdr)-len(body)))
	}
	ct.noteSize(len(b))
	if reused && unsafe.SliceData(b) == unsafe.SliceData(start) {
		rt.stats.LargeReused.Add(1)
	}
	if direct != nil && rt.t.InHandler() {
		// An actor running inline in the transport's handler could not
		// run the transfer: refused before the message and its
		// transfer's place go out, which would leave the receiver waiting
		// for it and every later message from this rank behind it.
		return nil, fmt.Errorf("actor: sending %s to %s: its Typed field: %w", ct.name, target, transport.ErrInHandler)
	}
	out := rt.out[r]
	cost := creditCost(len(body)+e.PayloadLen, out.window)
	if dev != nil {
		cost = creditCost(len(body)+len(data), out.window) // the receiver's memory holds the descriptor at most
	}
	if e.Flags&flagNoCredit == 0 {
		if err := out.acquire(cost, &rt.stats); err != nil {
			return nil, err
		}
	}
	out.used.Store(true)
	var xfer *transport.TypedTransfer
	// sent is the send's request while the transport still reads its data.
	var sent *transport.Request
	pooled := payload == nil && direct == nil && dev == nil // data is body, in the pooled buffer
	if direct != nil {
		// The receiver takes its typed receives' places in the order the
		// messages arrive: the message and its transfer's place go out
		// under one lock; the transfer itself runs after, in this
		// goroutine.
		out.orderMu.Lock()
		if sent, err = rt.postAM(r, hdr, data, pooled); err == nil {
			f := direct.f
			o := rt.typedOptions(f.Base)
			o.Stage = direct.stage
			xfer, err = rt.t.PrepareSendTyped(r, 0, f.Buf, f.Type, int(f.Count), o)
			if err != nil {
				// The message is out: keep the receiver's sequence in step
				// with an empty transfer, which it rejects as short.
				if x, ferr := rt.t.PrepareSendTyped(r, 0, nil, datatype.Byte, 0, rt.typedOptions(0)); ferr == nil {
					go func() { _, _ = x.Run(context.Background()) }()
				}
				out.orderMu.Unlock()
				return nil, fmt.Errorf("actor: sending %s to %s: its Typed field: %w", ct.name, target, err)
			}
		}
		out.orderMu.Unlock()
	} else if dev != nil && dev.pair != nil {
		// The receiver posts the pair channel's receives in the order the
		// messages arrive: the message and the channel send go out under
		// one lock.
		out.orderMu.Lock()
		if sent, err = rt.postAM(r, hdr, data, pooled); err == nil {
			if err = rt.sendPair(dev); err != nil {
				out.orderMu.Unlock()
				return nil, fmt.Errorf("actor: sending %s to %s: its gpu.Buffer field: %w", ct.name, target, err)
			}
		}
		out.orderMu.Unlock()
	} else {
		sent, err = rt.postAM(r, hdr, data, pooled)
	}
	if pooled {
		held = sent
	}
	if staged {
		// Back to the pool when the send is done with it: a fresh buffer
		// for every message cost a page fault a page (largeSends).
		rt.large.hold(payload, sent)
	}
	if err != nil {
		if e.Flags&flagNoCredit == 0 {
			out.release(cost)
		}
		return nil, fmt.Errorf("actor: sending %s to %s: %w", ct.name, target, err)
	}
	if xfer != nil {
		// Send returns when the elements have been read (Typed's
		// contract); the message itself is sent, so its credits come back
		// from the receiver whatever the transfer's outcome.
		if _, err := xfer.Run(context.Background()); err != nil {
			return nil, fmt.Errorf("actor: sending %s to %s: its Typed field: %w", ct.name, target, err)
		}
		rt.stats.TypedSent.Add(1)
	}
	rt.stats.Sent.Add(1)
	switch {
	case dev != nil && dev.pair != nil:
		rt.stats.DevicePairSent.Add(1)
	case dev != nil:
		rt.stats.DeviceIPCSent.Add(1)
	}
	if dev != nil {
		return dev.c, nil
	}
	return nil, nil
}

// postAM sends one actor message's header and data; pooled says data is in
// the encoding buffer, as hdr is. It returns the send's request when the
// transport goes on reading data after the call.
func (rt *Runtime) postAM(r int, hdr, data []byte, pooled bool) (*transport.Request, error) {
	if len(hdr)+len(data) <= transport.MaxPostAM {
		// Small messages are copied as they are posted: no request to
		// track, nothing to pin.
		return nil, rt.t.PostAM(r, amActor, hdr, data)
	}
	// The transport reads header and data until the send completes. When
	// they are the encoding buffer (pooled), that buffer is larger than
	// MaxPostAM, so putSendBuf does not keep it: it is the send's own (no
	// copy) until largeSends takes it back. Otherwise the header is copied
	// out of it.
	if !pooled {
		hdr = bytes.Clone(hdr)
	}
	mode := rt.amMode
	if rt.out[r].sparse(len(hdr)+len(data), rt.eagerMax, sinceLargeEpoch()) {
		mode = transport.AMEager
		rt.stats.LargeEager.Add(1)
	}
	req, err := rt.t.SendAM(r, amActor, hdr, data, mode)
	if err != nil {
		return nil, err
	}
	if done, rerr := req.Finished(); done && rerr != nil {
		return nil, rerr
	}
	return req, nil
}

// sendBufs holds the buffers send encodes into.
var sendBufs = sync.Pool{New: func() any { b := make([]byte, 0, 512); return &b }}

// putSendBuf returns a buffer to sendBufs, unless it grew big.
func putSendBuf(b *[]byte) {
	if cap(*b) > transport.MaxPostAM {
		return
	}
	*b = (*b)[:0]
	sendBufs.Put(b)
}

// creditCost is the price in credit units of a message of n bytes to a rank
// whose window is window: 1 plus 1 per CreditBytes, capped so that any
// message fits in a quarter of the window. Sender and receiver compute it
// with the receiver's window (Options.Credits of the receiving rank).
func creditCost(n, window int) int {
	return min(1+n/CreditBytes, window/4)
}

// outPeer holds the eager credits for sending to one rank.
type outPeer struct {
	orderMu sync.Mutex // orders messages with Typed transfers or pair channel sends (send)
	// window is the receiving rank's Options.Credits, learnt at start
	// (fixed after it): what the rank accepts from this one.
	window  int
	mu      sync.Mutex
	avail   int
	err     error         // set when sends to the rank can no longer succeed
	changed chan struct{} // closed (and replaced) whenever credits come back
	used    atomic.Bool
	// lastLarge is when the last message above MaxPostAM to the rank was
	// sent (monotonic nanoseconds since the process's first large send).
	lastLarge atomic.Int64
}

// largeEpoch is the origin of outPeer.lastLarge.
var largeEpoch = time.Now()

// sinceLargeEpoch is the clock of outPeer.sparse: nanoseconds since
// largeEpoch, plus EagerGap so that it is never within EagerGap of 0 (a
// rank's first large message is sparse).
func sinceLargeEpoch() int64 { return int64(time.Since(largeEpoch) + EagerGap) }

// sparse reports whether a large message of n bytes sent at now
// (sinceLargeEpoch) goes eager (Options.EagerMax): n is at most eagerMax
// and the previous large message to the rank left at least EagerGap
// before. It records the send either way.
func (o *outPeer) sparse(n, eagerMax int, now int64) bool {
	last := o.lastLarge.Swap(now)
	return n <= eagerMax && now-last >= int64(EagerGap)
}

// newOutPeer returns the credits for sending to a rank whose window is
// window.
func newOutPeer(window int) *outPeer {
	return &outPeer{window: window, avail: window, changed: make(chan struct{})}
}

// acquire takes n credits, blocking while the peer has not processed
// enough of what it was sent. The credits come back in an active message,
// which the progress goroutine handles. The blocked sender neither spins
// nor progresses the worker itself: it would take a core the receiving
// rank may need to catch up (on a small machine, the two share them), and
// with a window of DefaultCredits the peer still has three quarters of a
// window to process when the credits leave it.
func (o *outPeer) acquire(n int, st *Stats) error {
	waited := false
	for {
		o.mu.Lock()
		if o.err != nil {
			o.mu.Unlock()
			return o.err
		}
		if o.avail >= n {
			o.avail -= n
			o.mu.Unlock()
			return nil
		}
		ch := o.changed
		o.mu.Unlock()
		if !waited {
			st.CreditWaits.Add(1)
			waited = true
		}
		<-ch
	}
}

// signal wakes blocked senders; o.mu is held.
func (o *outPeer) signal() {
	close(o.changed)
	o.changed = make(chan struct{})
}

func (o *outPeer) release(n int) {
	o.mu.Lock()
	o.avail += n
	o.signal()
	o.mu.Unlock()
}

func (o *outPeer) close(err error) {
	o.mu.Lock()
	if o.err == nil {
		o.err = err
	}
	o.signal()
	o.mu.Unlock()
}

func (o *outPeer) lostErr() error {
	o.mu.Lock()
	defer o.mu.Unlock()
	if _, ok := o.err.(*transport.PeerLostError); ok {
		return o.err
	}
	return nil
}

// onCredit takes credits a receiver returns.
func (rt *Runtime) onCredit(m *transport.AMMessage) {
	src, n, err := decodeCredit(m.Header, rt.size)
	if err == nil && n > uint64(rt.out[src].window) {
		err = &DecodeError{Reason: fmt.Sprintf("%d credits returned, window %d", n, rt.out[src].window)}
	}
	if err != nil {
		rt.stats.DecodeErrors.Add(1)
		rt.log.Warn("malformed credit message", zap.Binary("header", m.Header), zap.Error(err))
		return
	}
	rt.out[src].release(int(n))
}

// inPeer keeps the messages from one rank in arrival order while some wait
// for their rendezvous data, and returns credits to that rank.
//
// The delivering goroutine takes mu per message and the actors' goroutines
// add to owed per message: each on a cache line of its own, apart from the
// fields both only read (sharing one line, the actors' goroutines' loads of
// those fields stood out in profiles of a 64 B flood).
type inPeer struct {
	rt    *Runtime
	rank  int
	hdr   map[string]string // the credit header of a one-unit message
	batch int64             // credits returned in one message
	// srcHdr is the header of a copy of a message from the rank: its
	// source, no credits (mailbox.PostUserMessage).
	srcHdr map[string]string
	// costHdrs are the credit headers of messages of up to
	// len(costHdrs)-1 units, made at first use (costHdr).
	costHdrs [maxSharedCost + 1]atomic.Pointer[map[string]string]

	_       [cacheLine]byte
	mu      sync.Mutex
	q       []*inItem
	pending sync.WaitGroup

	_    [cacheLine]byte
	owed atomic.Int64
	_    [cacheLine]byte
}

func newInPeer(rt *Runtime, r int) *inPeer {
	return &inPeer{
		rt: rt, rank: r, batch: int64(rt.credits / 4),
		hdr:    map[string]string{HeaderSourceRank: strconv.Itoa(r), headerCost: "1"},
		srcHdr: map[string]string{HeaderSourceRank: strconv.Itoa(r)},
	}
}

// maxSharedCost is the largest message cost whose credit header is shared
// by all such messages from a rank (64 KiB of body and payload).
const maxSharedCost = 128

// costHdr returns the credit header of a message of cost units from this
// rank. Headers are read only (protoactor's ReadonlyMessageHeader), so
// messages of one cost share one map: a map per message was the largest
// allocation of a rank receiving halos (docs/actor.md).
func (in *inPeer) costHdr(cost int) map[string]string {
	if cost == 1 {
		return in.hdr
	}
	if cost > maxSharedCost || cost < 1 {
		return in.newCostHdr(cost)
	}
	if h := in.costHdrs[cost].Load(); h != nil {
		return *h
	}
	h := in.newCostHdr(cost)
	in.costHdrs[cost].Store(&h)
	return h
}

func (in *inPeer) newCostHdr(cost int) map[string]string {
	return map[string]string{HeaderSourceRank: in.hdr[HeaderSourceRank], headerCost: strconv.Itoa(cost)}
}

// HeaderSourceRank is the message header that tells an actor which rank a
// message came from (protoactor's Context.MessageHeader).
const HeaderSourceRank = "troupe.src"

const headerCost = "troupe.cost"

// inItem is one received message on its way to delivery.
type inItem struct {
	e        envelope
	target   *target // the target's cache entry, when it has no request id (shared)
	msg      any
	err      string // why it cannot be delivered
	ready    bool
	cost     int
	hooked   bool                // its data lands in the PostReceive hook's buffer
	deferred *deferredData       // its actor completes it (deferred.go)
	env      *pa.MessageEnvelope // the envelope allocated with it (box.go), or nil
	// landFailed: its device payload could not land (wrong size, no
	// memory, a failed copy); the sending rank hears of it even when no
	// sender actor does (device_reject.go).
	landFailed bool
	// landed is the device buffer the runtime allocated for its payload
	// (none when a hook named the buffer): freed if the message finds no
	// actor, which would have kept it for ever.
	landed gpu.Buffer
}

func (in *inPeer) wait() { in.pending.Wait() }

// push delivers it, or queues it behind messages still waiting for data.
// Call with in.mu held.
func (in *inPeer) push(it *inItem) {
	if len(in.q) == 0 && it.ready {
		in.rt.deliver(it)
		return
	}
	in.q = append(in.q, it)
	in.drain()
}

// pushReady marks it ready (its data landed, or it failed with it.err) and
// pushes it; in.mu must not be held.
func (in *inPeer) pushReady(it *inItem) {
	it.ready = true
	in.mu.Lock()
	in.push(it)
	in.mu.Unlock()
}

// drain delivers ready messages at the head of the queue. Call with in.mu held.
func (in *inPeer) drain() {
	n := 0
	for n < len(in.q) && in.q[n].ready {
		in.rt.deliver(in.q[n])
		in.q[n] = nil
		n++
	}
	in.q = in.q[n:]
}

// credit returns n units to the sending rank, in batches.
func (in *inPeer) credit(n int) {
	v := in.owed.Add(int64(n))
	if v < in.batch || !in.owed.CompareAndSwap(v, 0) {
		return
	}
	rt := in.rt
	if rt.closed.Load() {
		return
	}
	hdr := appendUint(appendUint(make([]byte, 0, 12), uint64(rt.rank)), uint64(v))
	if _, err := rt.t.SendAM(in.rank, amCredit, hdr, nil, transport.AMEager); err != nil {
		rt.log.Debug("credit message not sent", zap.Int("peer", in.rank), zap.Error(err))
		return
	}
	rt.stats.CreditsBack.Add(1)
}

// onMessage receives one actor message.
func (rt *Runtime) onMessage(m *transport.AMMessage) {
	var it inItem // on the stack unless it must wait in the queue
	if err := decodeEnvelopeInto(&it.e, m.Header, rt.size, &rt.targets); err != nil {
		rt.stats.DecodeErrors.Add(1)
		rt.log.Warn("malformed actor message dropped", zap.Error(err))
		return
	}
	e := &it.e
	rt.stats.Received.Add(1)
	in := rt.in[e.Source]
	if e.TargetReq == 0 {
		it.target = rt.targets.last
	}
	it.cost = creditCost(m.Size+len(e.Body), rt.credits)
	if e.Flags&flagTypedXfer != 0 {
		it.cost = creditCost(e.PayloadLen+len(e.Body), rt.credits)
	}
	if e.Flags&flagNoCredit != 0 {
		it.cost = 0
	}
	ct := rt.lastType.ct
	if ct == nil || rt.lastType.id != e.Type {
		// A type's codec never changes once registered: keep the last one.
		if ct = lookupID(e.Type); ct != nil {
			rt.lastType.id, rt.lastType.ct = e.Type, ct
		}
	}
	if e.Flags&flagTypedXfer != 0 {
		q := new(inItem)
		*q = it
		rt.receiveTyped(in, m, q, ct)
		return
	}
	if e.Flags&flagDeviceIPC != 0 {
		q := new(inItem)
		*q = it
		rt.receiveDeviceIPC(in, m, q, ct)
		return
	}
	if e.Flags&flagDevicePair != 0 {
		q := new(inItem)
		*q = it
		rt.receiveDevicePair(in, m, q, ct)
		return
	}
	if !m.Rendezvous {
		// Eager: header and data are here until we return, so the message
		// is decoded now, straight from them.
		if e.Flags&flagBodyHdr == 0 {
			rt.decode(&it, ct, m.Data(), nil)
		} else {
			if e.PayloadLen != m.Size {
				it.err = fmt.Sprintf("payload of %d bytes announced, %d arrived", e.PayloadLen, m.Size)
			}
			if !rt.decodeBoxed(&it, ct, m.Data()) {
				dst := rt.landing(&it, ct, m.Size)
				copy(dst, m.Data())
				rt.landed(&it, ct, dst, nil)
			}
		}
		e.Body = nil // the header's memory goes back to the transport
		in.mu.Lock()
		if len(in.q) == 0 {
			rt.deliver(&it)
		} else {
			// Behind a message still waiting for its data.
			q := new(inItem)
			*q = it
			in.q = append(in.q, q)
			in.drain()
		}
		in.mu.Unlock()
		return
	}
	rt.stats.Rendezvous.Add(1)
	q := new(inItem)
	*q = it
	rt.receiveData(in, m, q, ct)
}

// receiveData fetches a rendezvous message's data and delivers it in its
// turn.
func (rt *Runtime) receiveData(in *inPeer, m *transport.AMMessage, it *inItem, ct *codecType) {
	if it.e.Flags&flagBodyHdr != 0 {
		it.e.Body = append([]byte(nil), it.e.Body...) // the header dies with RecvData
		if it.e.PayloadLen != m.Size {
			it.err = fmt.Sprintf("payload of %d bytes announced, %d arrived", it.e.PayloadLen, m.Size)
		}
	} else {
		it.e.Body = nil
	}
	if ct == nil && it.err == "" {
		it.err = fmt.Sprintf("unknown message type id 0x%08x (not registered on rank %d)", it.e.Type, rt.rank)
	}
	if it.err != "" {
		// Undeliverable already (a type this rank does not know, a
		// payload of another length than announced): its data is dropped
		// unfetched, so a size a faulty peer announced is never allocated,
		// and it is delivered as undeliverable in its turn.
		m.Release()
		in.pushReady(it)
		return
	}
	dst := rt.landing(it, ct, m.Size)
	if rt.planData(m, in, it, ct, dst) {
		return
	}
	req, rerr := m.RecvData(dst)
	if rerr != nil {
		it.err = "receiving data: " + rerr.Error()
		in.pushReady(it)
		return
	}
	if done, werr := req.Finished(); done {
		rt.landed(it, ct, dst, werr)
		in.mu.Lock()
		in.push(it)
		in.mu.Unlock()
		return
	}
	in.await(it, req.Wait, func(_ transport.Status, werr error) { rt.landed(it, ct, dst, werr) })
}

// await queues it behind the messages before it and, in a goroutine, waits
// for its data (wait), lands it (land, with in.mu held) and delivers what
// is ready. wait's context is the runtime's recvCtx: Shutdown cancels it
// when its own context ends first, and a wait that ends so counts as
// abandoned.
func (in *inPeer) await(it *inItem, wait func(context.Context) (transport.Status, error), land func(transport.Status, error)) {
	in.mu.Lock()
	in.q = append(in.q, it)
	in.mu.Unlock()
	in.pending.Add(1)
	go func() {
		defer in.pending.Done()
		ctx := in.rt.recvCtx
		st, err := wait(ctx)
		if err != nil && ctx.Err() != nil && errors.Is(err, context.Canceled) {
			in.rt.abandoned.Add(1)
			err = fmt.Errorf("abandoned at Shutdown: %w", err)
		}
		in.mu.Lock()
		defer in.mu.Unlock()
		land(st, err)
		in.drain()
	}()
}

// landed decodes item it once its data has landed in dst (or failed with
// werr) and marks it ready for delivery.
func (rt *Runtime) landed(it *inItem, ct *codecType, dst []byte, werr error) {
	switch {
	case werr != nil:
		it.err = "receiving data: " + werr.Error()
	case it.e.Flags&flagBodyHdr != 0 && ct != nil && ct.device >= 0:
		rt.decodeDevice(it, ct, dst)
	case it.e.Flags&flagBodyHdr != 0 && ct != nil && ct.typed >= 0:
		rt.decodeTyped(it, ct, dst)
	case it.e.Flags&flagBodyHdr != 0:
		rt.decode(it, ct, it.e.Body, dst)
	default:
		rt.decode(it, ct, dst, nil)
		putBuf(dst)
	}
	it.ready = true
}

// landing picks the memory a message's data lands in: the target actor's
// PostReceive hook for a payload, else pooled memory.
func (rt *Runtime) landing(it *inItem, ct *codecType, size int) []byte {
	if it.e.Flags&flagBodyHdr == 0 || ct == nil || it.err != "" || ct.device >= 0 || ct.typed >= 0 {
		return getBuf(size)
	}
	var tp targetProc
	if lt := rt.localTarget(it.target, it.e.Target, &tp); lt.hook {
		la := lt.la
		inc := &Incoming{
			Target: rt.PID(rt.rank, it.e.Target),
			Type:   ct.name,
			Size:   size,
		}
		if it.e.Sender != "" {
			inc.Sender = rt.PID(it.e.SenderRank, it.e.Sender)
		}
		if dst := la.hook.PostReceive(inc); dst != nil {
			if len(dst) == size {
				rt.stats.HookLanded.Add(1)
				it.hooked = true
				return dst
			}
			it.err = fmt.Sprintf("PostReceive returned %d bytes for a payload of %d", len(dst), size)
		}
	}
	return getBuf(size)
}

// decode turns a body into the message; failures become the item's error.
func (rt *Runtime) decode(it *inItem, ct *codecType, body []byte, payload []byte) {
	it.ready = true
	if it.err != "" {
		return
	}
	if ct == nil {
		it.err = fmt.Sprintf("unknown message type id 0x%08x (not registered on rank %d)", it.e.Type, rt.rank)
		return
	}
	msg, err := decodeBody(ct, body, it.e.Flags&flagPointer != 0, payload)
	if err != nil {
		rt.stats.DecodeErrors.Add(1)
		it.err = err.Error()
		return
	}
	it.msg = msg
}

// decodeDevice moves a landed device payload (host bytes) into device
// memory and decodes the message around it.
func (rt *Runtime) decodeDevice(it *inItem, ct *codecType, host []byte) {
	defer putBuf(host)
	it.ready = true
	if it.err != "" {
		return
	}
	var dst gpu.Buffer // an empty field lands nowhere (device memory of 0 bytes is refused)
	var owned bool
	var err error
	if len(host) > 0 {
		dst, owned, err = rt.deviceLanding(it, len(host))
	}
	if err == nil && len(host) > 0 {
		if err = gpu.CopyFromHost(dst, host); err != nil && owned {
			_ = gpu.Free(dst)
		}
	}
	if err != nil {
		it.err = "device payload: " + err.Error()
		it.landFailed = true
		return
	}
	msg, err := decodeBodyDevice(ct, it.e.Body, it.e.Flags&flagPointer != 0, nil, dst)
	if err != nil {
		if owned {
			_ = gpu.Free(dst)
		}
		rt.stats.DecodeErrors.Add(1)
		it.err = err.Error()
		return
	}
	rt.stats.DeviceLanded.Add(1)
	it.msg = msg
	if owned {
		it.landed = dst
	}
}

// deliver hands a received message to its local target.
func (rt *Runtime) deliver(it *inItem) {
	e := &it.e
	in := rt.in[e.Source]
	if e.Flags&flagSystem == 0 {
		if rp := rt.takeReply(e.Target); rp != nil {
			// The answer to a Request: no mailbox, no PIDs to build.
			in.credit(it.cost)
			if it.err != "" {
				rt.stats.DeadLetters.Add(1)
				rp.SendUserMessage(nil, &UndeliverableError{Target: rt.PID(rt.rank, e.Target).String(), Reason: it.err})
				return
			}
			rp.SendUserMessage(nil, it.msg)
			return
		}
	}
	var target *pa.PID
	if it.target != nil {
		target = it.target.pid
	} else {
		target = pa.NewPID(rt.addrs[rt.rank], e.Target)
		target.RequestId = e.TargetReq
	}
	var sender *pa.PID
	if e.Sender != "" {
		sender = pa.NewPID(rt.addrs[e.SenderRank], e.Sender)
	}
	if it.err != "" {
		in.credit(it.cost)
		rt.undeliverable(target, nil, sender, it.err)
		if sender == nil && it.landFailed {
			rt.rejectDevice(e.Source, target, it.err)
		}
		return
	}
	msg := it.msg
	if it.deferred != nil {
		msg = it.deferred
	}
	var tp targetProc
	lt := rt.localTarget(it.target, e.Target, &tp)
	proc, found, tracked := lt.proc, lt.found, lt.la != nil
	if e.Flags&flagSystem != 0 {
		if t, ok := it.msg.(*pa.Terminated); ok && t.Who != nil {
			rt.dropWatch(e.Source, t.Who.Id, e.Target)
		}
		if !found {
			rt.stats.DeadLetters.Add(1)
		}
		proc.SendSystemMessage(target, it.msg)
		return
	}
	if !found {
		in.credit(it.cost)
		rt.stats.DeadLetters.Add(1)
		if it.deferred != nil {
			it.deferred.drop()
			msg = nil
		}
		if !it.landed.IsZero() {
			// The device memory the runtime allocated for it would be
			// nobody's: freed, and the dead letter carries no message (as
			// for deferred data).
			_ = gpu.Free(it.landed)
			msg = nil
		}
		proc.SendUserMessage(target, &pa.MessageEnvelope{Message: msg, Sender: sender})
		return
	}
	rt.answered(e.Target)
	if !tracked && !it.landed.IsZero() {
		if f := rt.answerHeld.Load(); f != nil {
			(*f)(target)
		}
	}
	if tracked && !it.landed.IsZero() {
		// The actor owns the memory once it takes the message; if it
		// stops first, the mailbox frees it (landedDevice).
		msg = &landedDevice{msg: msg, buf: it.landed}
	}
	var hdr map[string]string
	switch {
	case !tracked || it.cost == 0:
		in.credit(it.cost)
	case lt.mbox == nil:
		// The runtime's actor, its mailbox not yet registered (the
		// message came during its spawn): posted through its process,
		// the message would lose its credit header (PostUserMessage
		// strips it from copies), so its credits come back now.
		in.credit(it.cost)
		hdr = in.srcHdr
	default:
		// The target's mailbox returns the credits once the actor has
		// processed the message (creditMiddleware); only this delivery
		// carries them (mailbox.deliver).
		hdr = in.costHdr(it.cost)
	}
	if hdr == nil && sender == nil {
		proc.SendUserMessage(target, msg)
		if !tracked && !it.landed.IsZero() {
			rt.dropUnclaimed(proc, target, msg, it.landed)
		}
		return
	}
	env := it.env
	if env == nil {
		env = new(pa.MessageEnvelope)
	}
	*env = pa.MessageEnvelope{Header: hdr, Message: msg, Sender: sender}
	if lt.mbox != nil {
		// What proc.SendUserMessage does, without reading proc.
		lt.mbox.deliver(env)
		return
	}
	proc.SendUserMessage(target, env)
	if !tracked && !it.landed.IsZero() {
		rt.dropUnclaimed(proc, target, msg, it.landed)
	}
}

// futureResult is what a protoactor future's process offers: the result
// it settled with.
type futureResult interface{ Result() (any, error) }

// dropUnclaimed frees landed, the device memory the runtime allocated for
// msg, a message just handed to proc, a process that is not one of the
// runtime's actors, if proc is a future that settled without it (it timed
// out, or was stopped, as the answer came): no one else would free it. A
// future settles on any message, so its Result does not wait here.
func (rt *Runtime) dropUnclaimed(proc pa.Process, target *pa.PID, msg any, landed gpu.Buffer) {
	f, ok := proc.(futureResult)
	if !ok || !strings.HasPrefix(target.Id, "future") {
		return
	}
	res, err := f.Result()
	if err == nil && sameMessage(res, msg) {
		return // the future's taker owns it
	}
	_ = gpu.Free(landed)
	rt.stats.DeadLetters.Add(1)
}

// sameMessage reports whether a and b are the same message; a message of
// a type that cannot be compared counts as the same.
func sameMessage(a, b any) bool {
	ta := reflect.TypeOf(a)
	if ta == nil || ta != reflect.TypeOf(b) {
		return false
	}
	return !ta.Comparable() || a == b
}

// localTarget finds what a delivery needs to know about the local process
// with id (targetProc), through the target's cache entry when there is one
// (tg may be nil). The runtime's actors are cached: their starts and stops
// change localEpoch, which voids the cache. The result is the cache's
// record, shared and read only, or, found anew, *scratch.
func (rt *Runtime) localTarget(tg *target, id string, scratch *targetProc) *targetProc {
	epoch := rt.localEpoch.Load()
	if tg != nil {
		if c := tg.proc.Load(); c != nil && c.epoch == epoch {
			return &c.targetProc
		}
	}
	c := scratch
	*c = targetProc{epoch: epoch}
	c.proc, c.found = rt.sys.ProcessRegistry.GetLocal(id)
	if v, ok := rt.local.Load(id); ok {
		c.la = v.(*localActor)
		c.hook = c.la.hook != nil
		c.mbox = c.la.run.mbox.Load()
	}
	if tg != nil && c.found && c.la != nil {
		tg.proc.Store(&cachedProc{targetProc: *c})
	}
	return c
}

// Buffer pool for landing data: power-of-two classes from 4 KiB. Smaller
// sizes are plain allocations, cheaper than a pooled 4 KiB buffer
// (ReleasePayload ignores them).
const minBufShift = 12

// minPooled is the smallest size getBuf takes from the pool.
const minPooled = 1 << 10

// The pools hold a pointer to each buffer's first byte: Put(&b) would
// allocate a slice header per call.
var bufPools [40]sync.Pool

func bufClass(n int) int {
	if n <= 1<<minBufShift {
		return 0
	}
	return bits.Len(uint(n-1)) - minBufShift
}

// getBuf returns a buffer of exactly n bytes, pooled from minPooled up.
func getBuf(n int) []byte {
	b, _ := takeBuf(n)
	return b
}

// takeBuf is getBuf, also reporting whether the buffer came from the pool.
func takeBuf(n int) (b []byte, pooled bool) {
	if n < minPooled {
		return make([]byte, n), false
	}
	c := bufClass(n)
	if c >= len(bufPools) {
		return make([]byte, n), false
	}
	if p, ok := bufPools[c].Get().(*byte); ok {
		return unsafe.Slice(p, 1<<(c+minBufShift))[:n], true
	}
	return make([]byte, n, 1<<(c+minBufShift)), false
}

// putBuf returns a buffer from getBuf to the pool.
func putBuf(b []byte) {
	c := bufClass(cap(b))
	if c >= len(bufPools) || cap(b) != 1<<(c+minBufShift) {
		return
	}
	bufPools[c].Put(unsafe.SliceData(b))
}

// ReleasePayload gives a payload the runtime allocated (when the receiving
// actor had no PostReceive hook) back to the runtime's pool. Calling it is
// optional; the payload must not be used afterwards.
func ReleasePayload(p Payload) { putBuf(p) }
