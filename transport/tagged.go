package transport

import (
	"context"
	"errors"
	"fmt"
	"time"
	"unsafe"

	"github.com/troupe-hpc/troupe/transport/ucx"
)

func bytesPtr(b []byte) unsafe.Pointer {
	if len(b) == 0 {
		return nil
	}
	return unsafe.Pointer(unsafe.SliceData(b))
}

// iovOf builds a C IOV list over bufs and the pointers to pin.
func iovOf(bufs [][]byte) (*ucx.IOV, []unsafe.Pointer, int) {
	v := ucx.NewIOV(len(bufs))
	pins := make([]unsafe.Pointer, 0, len(bufs))
	total := 0
	for i, b := range bufs {
		p := bytesPtr(b)
		v.Set(i, p, len(b))
		pins = append(pins, p)
		total += len(b)
	}
	return v, pins, total
}

// Isend starts sending buf to rank dst with a user tag (0..MaxUserTag). buf
// must not be modified until the request completes.
func (t *Transport) Isend(dst, tag int, buf []byte) (*Request, error) {
	if err := t.checkSend(dst, tag); err != nil {
		return nil, err
	}
	r := t.newRequest("send", dst, tag, len(buf))
	r.b = ucx.Buffer{Ptr: bytesPtr(buf), Len: len(buf)}
	t.execReq(r, t.sendStart(dst, len(buf)))
	return r, nil
}

// sendStart picks how a contiguous tagged send of n bytes to dst starts:
// by CMA to a rank on the same host (cma.go), else through UCX.
func (t *Transport) sendStart(dst, n int) func(*Transport, *Request) {
	if t.useCMA(dst, n, false) {
		return startCMASend
	}
	return startSend
}

// IsendIOV starts sending the concatenation of bufs as one message.
func (t *Transport) IsendIOV(dst, tag int, bufs [][]byte) (*Request, error) {
	if err := t.checkSend(dst, tag); err != nil {
		return nil, err
	}
	v, pins, total := iovOf(bufs)
	r := t.newRequest("send", dst, tag, total)
	r.b, r.pins, r.iov = ucx.Buffer{IOV: v, Len: total}, pins, v
	t.execReq(r, startSend)
	return r, nil
}

func (t *Transport) checkSend(dst, tag int) error {
	if err := t.checkRank(dst, "send"); err != nil {
		return err
	}
	return checkTag(tag, "send")
}

// startSend posts r's tagged send; the worker lock is held.
func startSend(t *Transport, r *Request) {
	p, wire, ok := t.sendTo(r)
	if !ok {
		return
	}
	ureq, err := t.postUserSend(p, r, r.b, wire)
	if err != nil {
		t.unsend(r, wire)
	}
	t.settle(r, ureq, err)
}

// postUserSend posts a USER tagged send of b for r to p under wire; the
// worker lock is held.
func (t *Transport) postUserSend(p *peer, r *Request, b ucx.Buffer, wire uint64) (ucx.Request, error) {
	if f := t.sendPostFault; f != nil {
		if err := f(r.peer, r.tag); err != nil {
			return ucx.Request{}, err
		}
	}
	return t.w.TagSend(p.ep, b, wire)
}

// sendTo connects to r's peer and takes the next sequence number for r's
// tag, returning the peer and the USER wire tag; on failure r has failed.
// The worker lock is held.
func (t *Transport) sendTo(r *Request) (*peer, uint64, bool) {
	p, err := t.peerLocked(r.peer, "send")
	if err != nil {
		t.fail(r, err)
		return nil, 0, false
	}
	key := seqKey{r.peer, r.tag}
	seq := t.sendSeq[key]
	t.sendSeq[key] = (seq + 1) & userSeqMask
	return p, MakeUserTag(uint32(t.rank), uint16(r.tag), seq), true
}

// unsend gives back the sequence number of wire, which a send of r took
// from sendTo, when the send's post failed at once: nothing went out under
// it, so the next send to r's (peer, tag) takes it and the peer's receives,
// which match exact sequence numbers, see no gap. The number was taken and
// the post failed under one hold of the worker lock, so no later number
// has been handed out. The worker lock is held.
func (t *Transport) unsend(r *Request, wire uint64) {
	key := seqKey{r.peer, r.tag}
	_, _, seq := SplitUserTag(wire)
	if t.sendSeq[key] == (seq+1)&userSeqMask {
		t.sendSeq[key] = seq
	}
}

// Send sends buf to rank dst with a user tag and waits until buf may be reused.
func (t *Transport) Send(ctx context.Context, dst, tag int, buf []byte) error {
	if err := t.checkSend(dst, tag); err != nil {
		return err
	}
	r := t.pooledRequest("send", dst, tag, len(buf))
	r.b = ucx.Buffer{Ptr: bytesPtr(buf), Len: len(buf)}
	t.execReq(r, t.sendStart(dst, len(buf)))
	_, err := r.Wait(ctx)
	r.recycle()
	return err
}

// SendIOV sends the concatenation of bufs as one message and waits.
func (t *Transport) SendIOV(ctx context.Context, dst, tag int, bufs [][]byte) error {
	r, err := t.IsendIOV(dst, tag, bufs)
	if err != nil {
		return err
	}
	_, err = r.Wait(ctx)
	return err
}

// Irecv starts receiving the next message from rank src (or AnySource) with
// a user tag into buf. Messages from one source with one tag are received in
// the order they were sent, and receives for one tag match in the order they
// were posted. A message larger than buf fails with a *TruncatedError.
func (t *Transport) Irecv(src, tag int, buf []byte) (*Request, error) {
	if err := t.checkRecv(src, tag); err != nil {
		return nil, err
	}
	r := t.newRequest("recv", src, tag, len(buf))
	r.recv = true
	r.b = ucx.Buffer{Ptr: bytesPtr(buf), Len: len(buf)}
	t.execReq(r, startRecv)
	return r, nil
}

// IrecvIOV starts receiving one message scattered over bufs in order.
func (t *Transport) IrecvIOV(src, tag int, bufs [][]byte) (*Request, error) {
	if err := t.checkRecv(src, tag); err != nil {
		return nil, err
	}
	v, pins, total := iovOf(bufs)
	r := t.newRequest("recv", src, tag, total)
	r.recv = true
	r.b, r.pins, r.iov, r.bufs = ucx.Buffer{IOV: v, Len: total}, pins, v, bufs
	t.execReq(r, startRecv)
	return r, nil
}

func (t *Transport) checkRecv(src, tag int) error {
	return t.checkRecvSource(src, tag, "recv")
}

// startRecv posts r's tagged receive, or keeps it in software while it is
// an any-source receive or waits behind one (wildcard.go); the worker lock
// is held.
func startRecv(t *Transport, r *Request) {
	if t.wildHold(r) {
		return
	}
	startRecvNow(t, r)
}

// startRecvNow posts r's tagged receive from r.peer; the worker lock is
// held.
func startRecvNow(t *Transport, r *Request) {
	r.key = seqKey{r.peer, r.tag}
	c := t.recvCounter(r.key)
	// The endpoint exists so that the peer's death is noticed. A message that
	// arrived before its sender was lost can still be received.
	if _, err := t.peerLocked(r.peer, "recv"); err != nil {
		var lost *PeerLostError
		if !errors.As(err, &lost) {
			t.fail(r, err)
			return
		}
		seq := c.peek()
		if r.fixedSeq {
			seq = r.seq
		}
		wire := MakeUserTag(uint32(r.peer), uint16(r.tag), seq)
		_, taken := t.ovHas(wire)
		_, held := t.cma.held[wire]
		_, probing := t.cma.probing[wire]
		if _, _, ok := t.w.TagProbe(wire, t.userMask(), false); !ok && !taken && !held && !probing {
			t.fail(r, err)
			return
		}
	}
	if !r.fixedSeq {
		r.seq = c.take()
		c.waiting = append(c.waiting, r)
		r.counter = c
	}
	r.seqd = true
	t.postNumbered(r)
}

// postNumbered posts r, a receive that owns sequence number r.seq of its
// (source, tag); the worker lock is held.
func (t *Transport) postNumbered(r *Request) {
	wire := MakeUserTag(uint32(r.peer), uint16(r.tag), r.seq)
	// A descriptor Iprobe took out of UCX serves the receive first.
	if t.cma.on && t.cmaTakeHeld(r, wire) {
		return
	}
	if t.ov != nil && t.ovRecv(r) {
		return
	}
	if err := t.postUserRecv(r, wire, 0); err != nil {
		t.freeSeq(r)
		t.fail(r, fmt.Errorf("transport: recv from rank %d tag %d: %w", r.peer, r.tag, err))
	}
}

// postUserRecv posts r to UCX as a receive of wire, with the fields in
// ignore left out of the match (an any-source receive ignores the source
// and sequence), and tracks it. The worker lock is held.
func (t *Transport) postUserRecv(r *Request, wire, ignore uint64) error {
	var ureq ucx.Request
	var err error
	if t.cma.on {
		ureq, err = t.w.TagRecvPeek(t.cmaRecvBuffer(r), wire, userRecvMask&^ignore, cmaBit)
	} else {
		ureq, err = t.w.TagRecv(r.b, wire, FullMask&^ignore)
	}
	switch {
	case err != nil:
		return err
	case !ureq.Pending():
		return errors.New("UCX completed a receive without reporting it")
	case r.scratch != nil:
		t.track(r, ureq, unsafe.Pointer(&r.scratch[0]))
	default:
		t.track(r, ureq)
	}
	if t.cma.on {
		// A descriptor that was waiting in UCX's queue matched at once:
		// handle it now, so that its read is queued at once (with the
		// overlap engine on, submitCall hands it to the progress
		// goroutine) rather than when the event is next drained.
		t.drainEvents()
	}
	return nil
}

func (t *Transport) recvCounter(k seqKey) *recvCounter {
	c := t.recvSeq[k]
	if c == nil {
		c = &recvCounter{mask: userSeqMask}
		t.recvSeq[k] = c
	}
	return c
}

// drainEvents handles the events UCX has queued, without progressing it;
// the worker lock is held, and no events are in hand.
func (t *Transport) drainEvents() {
	for evs := t.w.Drain(); len(evs) > 0; evs = t.w.Drain() {
		t.handle(evs)
	}
}

// freeSeq returns a cancelled receive's sequence number for reuse; the worker
// lock is held.
func (t *Transport) freeSeq(r *Request) {
	if !r.seqd || r.key == chanSinkKey {
		return // none taken (an internal receive), or a spent channel counter
	}
	r.seqd = false
	t.recvCounter(r.key).give(r.seq)
}

// Recv receives the next message from rank src with a user tag into buf.
func (t *Transport) Recv(ctx context.Context, src, tag int, buf []byte) (Status, error) {
	if err := t.checkRecv(src, tag); err != nil {
		return Status{}, err
	}
	if err := t.waitInHandler("recv", src, tag); err != nil {
		return Status{}, err // refused before the receive is posted: it could take a message nobody waits for
	}
	r := t.pooledRequest("recv", src, tag, len(buf))
	r.recv = true
	r.b = ucx.Buffer{Ptr: bytesPtr(buf), Len: len(buf)}
	t.execReq(r, startRecv)
	st, err := r.Wait(ctx)
	r.recycle()
	return st, err
}

// Sendrecv sends sendBuf to rank dst with sendTag and receives a message
// from src (which may be AnySource) with recvTag into recvBuf, both in
// flight at once (MPI_Sendrecv), so that ranks exchanging with each other,
// in pairs or around a ring, cannot deadlock on the order of their calls.
// It returns the receive's Status once both have completed. If ctx ends
// first, the receive is cancelled as Recv's would be and the send goes on,
// as Send's does: sendBuf stays in use until it is done. Its error joins
// the receive's and the send's.
func (t *Transport) Sendrecv(ctx context.Context, dst, sendTag int, sendBuf []byte, src, recvTag int, recvBuf []byte) (Status, error) {
	if err := t.checkSend(dst, sendTag); err != nil {
		return Status{}, err
	}
	if err := t.waitInHandler("sendrecv", src, recvTag); err != nil {
		return Status{}, err
	}
	rr, err := t.Irecv(src, recvTag, recvBuf)
	if err != nil {
		return Status{}, err
	}
	sr, err := t.Isend(dst, sendTag, sendBuf)
	if err != nil {
		cancelled, cancel := context.WithCancel(ctx)
		cancel()
		_, _ = rr.Wait(cancelled) // withdraws the receive
		return Status{}, err
	}
	st, rerr := rr.Wait(ctx)
	_, serr := sr.Wait(ctx)
	return st, errors.Join(rerr, serr)
}

// RecvIOV receives one message scattered over bufs.
func (t *Transport) RecvIOV(ctx context.Context, src, tag int, bufs [][]byte) (Status, error) {
	if err := t.waitInHandler("recv", src, tag); err != nil {
		return Status{}, err
	}
	r, err := t.IrecvIOV(src, tag, bufs)
	if err != nil {
		return Status{}, err
	}
	return r.Wait(ctx)
}

// Iprobe reports whether the next message from src (or, with AnySource,
// from some rank: Status.Source says which) with tag has arrived, and its
// size, without receiving it.
func (t *Transport) Iprobe(src, tag int) (Status, bool, error) {
	if err := t.checkRecvSource(src, tag, "probe"); err != nil {
		return Status{}, false, err
	}
	if t.opts.Progress == ProgressDirect {
		t.progressOnce()
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.closed {
		return Status{}, false, ErrClosed
	}
	t.runSubmitted()
	if src == AnySource {
		// A CMA message's size is known once its descriptor is fetched:
		// until then it is not reported (it was, with size 0).
		if src, ok, _ := t.anyArrived(tag); ok {
			if size, ok := t.arrived(src, tag); ok {
				return Status{Source: src, Tag: tag, Size: size}, true, nil
			}
		}
		return Status{}, false, nil
	}
	size, ok := t.arrived(src, tag)
	if !ok {
		if p := t.peers[src]; p != nil && p.lost != nil {
			return Status{}, false, &PeerLostError{Rank: src, Op: "probe", Reason: p.lost.Reason}
		}
		return Status{}, false, nil
	}
	return Status{Source: src, Tag: tag, Size: size}, true, nil
}

// Probe waits until the next message from src (or AnySource) with tag has
// arrived and returns its source and size without receiving it.
func (t *Transport) Probe(ctx context.Context, src, tag int) (Status, error) {
	var st Status
	err := t.probeWait(ctx, func() (ok bool, err error) {
		st, ok, err = t.Iprobe(src, tag)
		return ok, err
	})
	return st, err
}

// probeWait calls look until it finds something or fails: for WaitSpin
// at once, then each time something has arrived, until ctx ends.
func (t *Transport) probeWait(ctx context.Context, look func() (bool, error)) error {
	if err := t.waitInHandler("probe", -1, 0); err != nil {
		return err
	}
	spinUntil := time.Now().Add(t.opts.WaitSpin)
	for {
		ok, err := look()
		if err != nil || ok {
			return err
		}
		if time.Now().Before(spinUntil) {
			continue
		}
		t.mu.Lock()
		if t.arrival == nil {
			t.arrival = make(chan struct{})
		}
		ch := t.arrival
		t.mu.Unlock()
		// Look once more now that ch is in place: whatever arrived between
		// the last look and now closed no channel, and nothing else might.
		if ok, err := look(); err != nil || ok {
			return err
		}
		t.wake()
		select {
		case <-ch:
		case <-ctx.Done():
			return ctx.Err()
		}
	}
}

// noteArrivals runs after every progress pass in which something may have
// arrived, whoever made it (the progress goroutine, a waiter, a caller
// posting an active message): it wakes Probe's waiters and starts the
// any-source receives that can now match. The worker lock is held.
func (t *Transport) noteArrivals() {
	if t.arrival != nil {
		close(t.arrival)
		t.arrival = nil
	}
	t.wildAdvanceAll()
}
