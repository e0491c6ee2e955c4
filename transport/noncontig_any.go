package transport

import (
	"context"
	"errors"
	"fmt"
	"slices"

	"go.uber.org/zap"

	"github.com/troupe-hpc/troupe/transport/ucx"
)

// Any-source typed receives (IrecvTyped and RecvTyped with AnySource).
//
// A typed transfer starts with the sender's RTS, a tagged message carrying
// the (source, tag) sequence number (noncontig_wire.go). An any-source
// typed receive posts the RTS receive to UCX with the source and sequence
// fields masked; the first RTS with its tag to arrive, or the earliest one
// already waiting in UCX's queue, matches it, and the sender's tag names
// the rank and the sequence number the receive then owns. From there the
// transfer runs as an exact one with that rank.
//
// That is sound while every RTS UCX could hand it is its sender's next:
// RTS messages are never taken out of UCX's queue, so it only has to wait
// until every sequence number of its tag already handed to an exact typed
// receive has that receive's RTS receive in UCX (unposted), where UCX sees
// it was posted first. And MPI matches receives in post order: a typed
// receive of the tag posted after an any-source one waits behind it in a
// per-tag gate and takes its sequence number only once the any-source
// receive has matched.

// typedWaiter is a typed receive waiting in a tag's gate.
type typedWaiter struct {
	any   bool          // an any-source receive (else exact, from peer)
	peer  int           // exact waiters: the source
	seq   uint32        // exact waiters: the sequence number taken on release
	ready chan struct{} // closed when it may go on
}

// errRTSNotYet: an any-source RTS receive found sequence numbers of its tag
// still to be posted; it tries again once they are.
var errRTSNotYet = errors.New("transport: typed receives of the tag are still being posted")

// placeRecv takes a typed receive's place in its tag's order: a message
// IprobeTyped parked that it may take (p), else a sequence number at once,
// or a place in the gate behind a pending any-source receive (then the
// number comes with the waiter's release).
func (nc *noncontig) placeRecv(c typedCall) (seq uint32, w *typedWaiter, p *parkedRTS) {
	nc.mu.Lock()
	defer nc.mu.Unlock()
	if c.space == KindTyped {
		if p := nc.parkedLocked(c.peer, c.tag, true); p != nil {
			return 0, nil, p
		}
	}
	if c.space == KindTyped && (c.peer == AnySource || len(nc.gates[c.tag]) > 0) {
		w := &typedWaiter{any: c.peer == AnySource, peer: c.peer, ready: make(chan struct{})}
		if len(nc.gates[c.tag]) == 0 {
			close(w.ready) // an any-source receive at the head goes on at once
		}
		nc.gates[c.tag] = append(nc.gates[c.tag], w)
		return 0, w, nil
	}
	return nc.takeRecvSeqLocked(c.seqKey()), nil, nil
}

// recvPlaced runs a typed receive placed by placeRecv. It can be cancelled
// through ctx until its RTS has matched; from then on the message is this
// receive's, and the transfer runs to completion (or the peer's loss)
// whatever ctx does: a receive that gave up there lost the message (the
// next receive of its source and tag waited for it for ever, and so did
// its sender).
func (nc *noncontig) recvPlaced(ctx context.Context, c typedCall, seq uint32, w *typedWaiter, p *parkedRTS) (Status, error) {
	if p != nil { // taken from nc.parked: matched already
		run := context.WithoutCancel(ctx)
		if err := p.wait(run, nc); err != nil {
			return Status{}, err
		}
		c.peer = p.src
		return nc.recvMatched(run, c, p.hdr)
	}
	bp := nc.rtsBufs.Get().(*[]byte)
	defer nc.rtsBufs.Put(bp)
	peer, n, err := nc.matchRTS(ctx, c, seq, w, *bp)
	if err != nil {
		return Status{}, err
	}
	c.peer = peer
	return nc.recvMatched(context.WithoutCancel(ctx), c, (*bp)[:n])
}

// matchRTS receives the RTS of a typed receive placed by placeRecv into
// hbuf, and reports the sender and the RTS's length: the first half of a
// typed receive, which a matched typed probe stops after (typedprobe.go).
func (nc *noncontig) matchRTS(ctx context.Context, c typedCall, seq uint32, w *typedWaiter, hbuf []byte) (peer, n int, err error) {
	switch {
	case w == nil:
	case w.any:
		return nc.matchAnyRTS(ctx, c, w, hbuf)
	default:
		if err := nc.await(ctx, w.ready); err != nil {
			nc.leave(c.tag, w)
			return 0, 0, err
		}
		seq = w.seq
	}
	n, err = nc.matchExactRTS(ctx, c, seq, hbuf)
	return c.peer, n, err
}

// await waits for ch, ctx or the transport's end.
func (nc *noncontig) await(ctx context.Context, ch <-chan struct{}) error {
	select {
	case <-ch:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	case <-nc.stop:
		return ErrClosed
	}
}

// matchAnyRTS is matchRTS for an any-source typed receive: it waits to
// head its tag's gate, posts the masked RTS receive once no sequence
// number of the tag is still to be posted, and reports the rank that
// matched.
func (nc *noncontig) matchAnyRTS(ctx context.Context, c typedCall, w *typedWaiter, hbuf []byte) (peer, n int, err error) {
	if err := nc.await(ctx, w.ready); err != nil {
		nc.leave(c.tag, w)
		return 0, 0, err
	}
	for {
		var posted <-chan struct{}
		r := nc.postAnyRTS(c.tag, bufOf(hbuf), &posted)
		st, err := r.Wait(ctx)
		if errors.Is(err, errRTSNotYet) {
			if err := nc.await(ctx, posted); err != nil {
				nc.leave(c.tag, w)
				return 0, 0, err
			}
			continue
		}
		nc.mu.Lock()
		if nc.anyRTS[c.tag] == r {
			delete(nc.anyRTS, c.tag)
		}
		if r.wire != 0 {
			// UCX handed it an RTS (even one too long, which is lost):
			// the receive owns that sequence number.
			src, _, seq := splitRTSTag(r.wire)
			if src >= nc.t.size {
				// Spent, naming a rank outside the job (nobody to
				// answer): dropped, and the receive waits for a real RTS.
				nc.mu.Unlock()
				nc.t.noteForeign(src, r.wire)
				continue
			}
			if !nc.recvCounter(seqKey{src, c.tag}).claim(seq) {
				nc.t.log.Error("any-source typed receive matched an RTS that was not its sender's next",
					zap.Int("source", src), zap.Int("tag", c.tag), zap.Uint32("seq", seq))
			}
			peer = src
		}
		nc.advanceGate(c.tag)
		nc.mu.Unlock()
		if err != nil {
			return 0, 0, err
		}
		return peer, st.Size, nil
	}
}

// leave takes a waiter that gave up out of its tag's gate. An exact one
// released meanwhile gives its sequence number back, and the typed
// receives pending behind that number are renumbered as after a cancelled
// RTS receive (renumber.go); an any-source one at the head releases those
// behind it.
func (nc *noncontig) leave(tag int, w *typedWaiter) {
	nc.mu.Lock()
	q := nc.gates[tag]
	i := slices.Index(q, w)
	switch {
	case i < 0 && !w.any:
		k := seqKey{w.peer, tag}
		c := nc.recvSeq[k]
		c.returning = append(c.returning, w.seq)
		nc.rtsPostedLocked(k, w.seq)
		nc.mu.Unlock()
		t := nc.t
		t.exec(func() {
			if !t.closed {
				t.renumber.typed = append(t.renumber.typed, k)
				t.runRenumbers()
			}
		})
		return
	case i == 0:
		nc.advanceGate(tag)
	case i > 0:
		nc.gates[tag] = slices.Delete(q, i, i+1)
	}
	nc.mu.Unlock()
}

// advanceGate removes the any-source receive at the head of tag's gate
// (matched, or given up) and releases what follows: exact receives up to
// the next any-source one take their sequence numbers in order; that one
// heads the gate. nc.mu is held.
func (nc *noncontig) advanceGate(tag int) {
	q := nc.gates[tag]
	if len(q) == 0 {
		return
	}
	q = q[1:]
	for len(q) > 0 && !q[0].any {
		w := q[0]
		w.seq = nc.takeRecvSeqLocked(seqKey{w.peer, tag})
		close(w.ready)
		q = q[1:]
	}
	if len(q) == 0 {
		delete(nc.gates, tag)
		return
	}
	close(q[0].ready)
	nc.gates[tag] = q
}

// takeRecvSeqLocked hands out the next sequence number of k; for the
// MPI-style space it counts as unposted until its RTS receive is in UCX.
// nc.mu is held.
func (nc *noncontig) takeRecvSeqLocked(k seqKey) uint32 {
	if k.tag >= 0 {
		nc.unposted[k.tag]++
	}
	c := nc.recvCounter(k)
	s := c.take()
	c.unposted = append(c.unposted, s)
	return s
}

// recvCounter returns k's receive counter, creating it; nc.mu is held.
func (nc *noncontig) recvCounter(k seqKey) *recvCounter {
	c := nc.recvSeq[k]
	if c == nil {
		c = &recvCounter{mask: ncSeqMask}
		nc.recvSeq[k] = c
	}
	return c
}

// rtsPostedReq records that r, the RTS receive of sequence number seq of
// k, is in UCX (or failed before getting there); while it waits there it
// is one of k's pending receives, which renumbering may give other
// numbers (renumber.go). The worker lock is held.
func (nc *noncontig) rtsPostedReq(k seqKey, seq uint32, r *Request) {
	nc.mu.Lock()
	defer nc.mu.Unlock()
	nc.rtsPostedLocked(k, seq)
	if r.fin.Load() || !r.ureq.Pending() {
		return
	}
	c := nc.recvCounter(k)
	r.rtsSeq, r.key, r.seq, r.counter = true, k, seq, c
	c.waiting = append(c.waiting, r)
}

func (nc *noncontig) rtsPostedLocked(k seqKey, seq uint32) {
	c := nc.recvCounter(k)
	if i := slices.Index(c.unposted, seq); i >= 0 {
		c.unposted = slices.Delete(c.unposted, i, i+1)
	}
	if k.tag < 0 {
		return // runtimes' space: no any-source receives
	}
	if nc.unposted[k.tag]--; nc.unposted[k.tag] > 0 {
		return
	}
	delete(nc.unposted, k.tag)
	if nc.postedWanted {
		close(nc.postedCh)
		nc.postedCh, nc.postedWanted = make(chan struct{}), false
	}
}

// postAnyRTS posts the RTS receive of an any-source typed receive with
// tag into b, with the source and sequence masked. While sequence numbers
// of the tag are still to be posted it posts nothing: the request fails
// with errRTSNotYet and *posted is a channel closed when some tag's count
// falls to zero.
func (nc *noncontig) postAnyRTS(tag int, b ucx.Buffer, posted *<-chan struct{}) *Request {
	t := nc.t
	r := t.newRequest("typed recv", AnySource, tag, b.Len)
	r.recv, r.rtsAny = true, true
	r.b = b
	t.exec(func() {
		if t.closed {
			t.fail(r, fmt.Errorf("transport: typed recv from any rank tag %d: %w", tag, ErrClosed))
			return
		}
		nc.mu.Lock()
		waiting := nc.unposted[tag] > 0
		if waiting {
			*posted, nc.postedWanted = nc.postedCh, true
		}
		nc.mu.Unlock()
		if waiting {
			t.fail(r, errRTSNotYet)
			return
		}
		if err := t.postMaskedRTS(r, tag); err != nil {
			t.fail(r, fmt.Errorf("transport: typed recv from any rank tag %d: %w", tag, err))
			return
		}
		nc.mu.Lock()
		nc.anyRTS[tag] = r
		nc.mu.Unlock()
	})
	return r
}

// ncAnyRTSMask matches the RTS tags of one user tag from any rank with any
// sequence number.
const ncAnyRTSMask = FullMask &^ (uint64(ncRankMask)<<(UserTagBits+ncSeqBits) | ncSeqMask)

// postMaskedRTS posts r, an any-source typed receive's RTS receive, to UCX
// with the source and sequence of tag masked, and tracks it; the worker
// lock is held.
func (t *Transport) postMaskedRTS(r *Request, tag int) error {
	ureq, err := t.w.TagRecv(r.b, ncRTSTag(KindTyped, 0, uint16(tag), 0), ncAnyRTSMask)
	switch {
	case err != nil:
		return err
	case !ureq.Pending():
		return errors.New("UCX completed a receive without reporting it")
	}
	t.track(r, ureq)
	return nil
}

// ncAnyFinished completes an any-source RTS receive; the sender's tag is
// kept in r.wire when UCX handed it a message. The worker lock is held.
func (t *Transport) ncAnyFinished(r *Request, e *ucx.Event) {
	st := e.Status()
	if st == ucx.StatusOK || st == ucx.StatusTruncated {
		r.wire = e.SenderTag()
		src, _, _ := splitRTSTag(r.wire)
		r.status = Status{Source: src, Tag: r.tag, Size: e.Length()}
	}
	switch {
	case st == ucx.StatusOK:
		t.complete(r)
	case st == ucx.StatusTruncated:
		t.fail(r, &TruncatedError{Source: r.status.Source, Tag: r.tag, Size: e.Length(), BufLen: r.bufLen})
	case st == ucx.StatusCanceled && r.failErr != nil:
		t.fail(r, r.failErr)
	default:
		t.fail(r, fmt.Errorf("transport: typed recv from any rank tag %d: %s", r.tag, st))
	}
}

// splitRTSTag is the inverse of ncRTSTag.
func splitRTSTag(tag uint64) (src, userTag int, seq uint32) {
	return int(tag>>(UserTagBits+ncSeqBits)) & ncRankMask, int(uint16(tag >> ncSeqBits)), uint32(tag & ncSeqMask)
}
