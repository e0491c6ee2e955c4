package transport

import (
	"context"
	"fmt"
	"slices"
	"sync/atomic"

	"github.com/troupe-hpc/troupe/datatype"
)

// Matched probes of typed messages (MPI_Mprobe, MPI_Improbe, MPI_Get_count
// and MPI_Mrecv with derived datatypes).
//
// A typed message is announced by its sender's RTS (noncontig_proto.go), a
// tagged message of the typed space that Iprobe and Improbe, which look at
// the plain tagged space, do not see. A matched typed probe is the first
// half of a typed receive: it takes its place in its tag's order as a
// typed receive posted now would (a sequence number, or a place behind a
// pending any-source typed receive), receives the RTS, and stops. The RTS
// tells the sender and the packed size, so the caller can size its buffer
// and count (TypedMessage.Count); TypedMessage.Recv runs the second half,
// the transfer, with whatever layout the caller gives, checked against the
// sender's type signature as any typed receive is.

// TypedMessage is a typed message a matched typed probe (MprobeTyped,
// ImprobeTyped) has taken: no other receive can match it, and its own Recv
// or Irecv receives it. Receive every TypedMessage once: its sender waits
// until it is received (the transfer needs the receiver's answer).
type TypedMessage struct {
	nc    *noncontig
	st    Status
	hdr   []byte // the sender's RTS
	taken atomic.Bool
}

// Status is the message's source and tag; Size is its packed size in
// bytes (count times the size of the sender's datatype).
func (m *TypedMessage) Status() Status { return m.st }

// Count is MPI_Get_count: how many elements of dt the message holds, and
// false when its size is not a whole number of dt's (MPI_UNDEFINED) or dt
// is nil or empty. It does not compare type signatures; Recv does.
func (m *TypedMessage) Count(dt *datatype.Type) (int, bool) {
	if dt == nil || dt.Size() <= 0 || int64(m.st.Size)%dt.Size() != 0 {
		return 0, false
	}
	return int(int64(m.st.Size) / dt.Size()), true
}

// MprobeTyped waits until a typed message from src (or AnySource) with tag
// has arrived and takes it (MPI_Mprobe for messages sent with SendTyped).
// It matches in order with the typed receives of the tag, as a typed
// receive posted now would. When ctx ends first it returns ctx's error and
// gives its place back; a message IprobeTyped or ProbeTyped has already
// found (parked) it takes whatever ctx does.
func (t *Transport) MprobeTyped(ctx context.Context, src, tag int) (*TypedMessage, error) {
	nc, c, err := t.typedProbeCall(src, tag)
	if err != nil {
		return nil, err
	}
	seq, w, p := nc.placeRecv(c)
	if p != nil {
		// The parked message is this probe's now (placeRecv took it out
		// of nc.parked): it waits for its RTS, which has arrived, whatever
		// ctx does. Giving up there lost the message for good.
		if err := p.wait(context.WithoutCancel(ctx), nc); err != nil {
			return nil, err
		}
		return nc.typedMessage(p.src, tag, p.hdr)
	}
	bp := nc.rtsBufs.Get().(*[]byte)
	defer nc.rtsBufs.Put(bp)
	peer, n, err := nc.matchRTS(ctx, c, seq, w, *bp)
	if err != nil {
		return nil, err
	}
	return nc.typedMessage(peer, tag, (*bp)[:n])
}

// ImprobeTyped is MprobeTyped that does not wait (MPI_Improbe): it returns
// nil and false when no typed message from src (or AnySource) with tag has
// arrived, or while typed receives of the tag posted earlier wait behind an
// any-source one (they come first).
func (t *Transport) ImprobeTyped(src, tag int) (*TypedMessage, bool, error) {
	nc, p, found, err := t.probeRTS(src, tag, true)
	if err != nil || !found {
		return nil, false, err
	}
	m, err := nc.typedMessage(p.src, tag, p.hdr)
	return m, err == nil, err
}

// IprobeTyped reports whether a typed message from src (or AnySource) with
// tag has arrived, and its Status (Size: its packed bytes), without
// receiving it (MPI_Iprobe for messages sent with SendTyped): the next
// typed receive, or matched typed probe, that may take it gets it. A
// message reported once is reported again until received. It finds
// nothing while typed receives of the tag posted earlier wait behind an
// any-source one (they come first). Probing and receiving one (source,
// tag) from several goroutines at once is racy, as with Iprobe: use
// MprobeTyped there.
func (t *Transport) IprobeTyped(src, tag int) (Status, bool, error) {
	_, p, found, err := t.probeRTS(src, tag, false)
	if err != nil || !found {
		return Status{}, false, err
	}
	return p.st, true, nil
}

// probeRTS finds the next typed message from src (or any rank) with tag
// for a probe and waits for its RTS: a parked one (taken out of nc.parked
// when take), else one that arrived in UCX's queue (parked unless take).
func (t *Transport) probeRTS(src, tag int, take bool) (*noncontig, *parkedRTS, bool, error) {
	nc, _, err := t.typedProbeCall(src, tag)
	if err != nil {
		return nil, nil, false, err
	}
	if t.opts.Progress == ProgressDirect {
		t.progressOnce()
	}
	nc.mu.Lock()
	p := nc.parkedLocked(src, tag, take)
	nc.mu.Unlock()
	if p == nil {
		var found bool
		if p, found, err = nc.arrivedRTS(src, tag, !take); err != nil || !found {
			return nil, nil, false, err
		}
	}
	if err := p.wait(context.Background(), nc); err != nil {
		return nil, nil, false, err
	}
	return nc, p, true, nil
}

// ProbeTyped waits until a typed message from src (or AnySource) with tag
// has arrived and reports it as IprobeTyped does (MPI_Probe).
func (t *Transport) ProbeTyped(ctx context.Context, src, tag int) (Status, error) {
	var st Status
	err := t.probeWait(ctx, func() (ok bool, err error) {
		st, ok, err = t.IprobeTyped(src, tag)
		return ok, err
	})
	return st, err
}

// parkedRTS is a typed message whose sequence number a probe has taken
// and whose RTS it receives: ready is closed once hdr (the RTS) and st,
// or err, are set. IprobeTyped leaves it in nc.parked for the next receive
// that may take it.
type parkedRTS struct {
	src   int
	ready chan struct{}
	hdr   []byte
	st    Status
	err   error
}

// wait waits until p's RTS has been received and returns its error.
func (p *parkedRTS) wait(ctx context.Context, nc *noncontig) error {
	if err := nc.await(ctx, p.ready); err != nil {
		return err
	}
	return p.err
}

// parkedLocked returns the first parked message with tag from src (or any
// rank), or nil, and with take removes it from nc.parked; nc.mu is held.
func (nc *noncontig) parkedLocked(src, tag int, take bool) *parkedRTS {
	q := nc.parked[tag]
	for i, p := range q {
		if src != AnySource && p.src != src {
			continue
		}
		if take {
			if q = slices.Delete(q, i, i+1); len(q) == 0 {
				delete(nc.parked, tag)
			} else {
				nc.parked[tag] = q
			}
		}
		return p
	}
	return nil
}

// arrivedRTS looks for the RTS of the next typed message from src (or any
// rank) with tag in UCX's queue and, when it is there, takes its sequence
// number and starts receiving the RTS into the returned parkedRTS, which
// park puts in nc.parked in the same step (no receive can take a later
// number in between). It takes the worker lock itself, as Improbe does
// (exec would only queue the look in queue mode).
func (nc *noncontig) arrivedRTS(src, tag int, park bool) (*parkedRTS, bool, error) {
	p := &parkedRTS{ready: make(chan struct{})}
	seq, found, err := nc.lookRTS(src, tag, p, park)
	if err != nil || !found {
		return nil, false, err
	}
	from := p.src
	c := typedCall{peer: from, tag: tag, space: KindTyped}
	bp := nc.rtsBufs.Get().(*[]byte)
	rr := nc.postExactRTS(c, seq, *bp)
	go func() {
		// The RTS has arrived: its receive completes at once (or, for a
		// large inline RTS, as soon as the sender, which waits for the
		// answer, moves it).
		defer close(p.ready)
		defer nc.rtsBufs.Put(bp)
		n, err := nc.awaitExactRTS(context.Background(), rr)
		if err != nil {
			p.err = err
			return
		}
		p.hdr = slices.Clone((*bp)[:n])
		p.st, p.err = nc.rtsStatus(from, tag, p.hdr)
	}()
	return p, true, nil
}

// lookRTS is arrivedRTS's look, under the worker lock and nc.mu: it
// sets p.src to the sender, parks p if park, and returns the sequence
// number it took.
func (nc *noncontig) lookRTS(src, tag int, p *parkedRTS, park bool) (seq uint32, found bool, err error) {
	t := nc.t
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.closed {
		return 0, false, ErrClosed
	}
	nc.mu.Lock()
	defer nc.mu.Unlock()
	if len(nc.gates[tag]) > 0 || src == AnySource && nc.unposted[tag] > 0 {
		// Receives placed earlier come first; an any-source look is sound
		// only once every number handed out has its RTS receive in UCX
		// (noncontig_any.go).
		return 0, false, nil
	}
	want, mask := ncRTSTag(KindTyped, 0, uint16(tag), 0), FullMask&^(uint64(ncRankMask)<<(UserTagBits+ncSeqBits)|ncSeqMask)
	if src != AnySource {
		want, mask = ncRTSTag(KindTyped, uint32(src), uint16(tag), nc.recvCounter(seqKey{src, tag}).peek()), FullMask
	}
	_, info, ok := t.w.TagProbe(want, mask, false)
	if !ok {
		if src != AnySource {
			if pe := t.peers[src]; pe != nil && pe.lost != nil {
				return 0, false, &PeerLostError{Rank: src, Op: "typed probe", Reason: pe.lost.Reason}
			}
		}
		return 0, false, nil
	}
	from, _, s := splitRTSTag(info.Tag)
	if t.dropForeign(from, info.Tag) {
		return 0, false, nil // the next look finds the next RTS
	}
	k := seqKey{from, tag}
	if nc.recvCounter(k).peek() != s {
		// Not its sender's next: a receive placed earlier owns it and is
		// about to post its RTS receive.
		return 0, false, nil
	}
	p.src = from
	if park {
		nc.parked[tag] = append(nc.parked[tag], p)
	}
	return nc.takeRecvSeqLocked(k), true, nil
}

// typedProbeCall checks a typed probe's arguments and returns the
// transport's typed state and the probe as a receive of no data.
func (t *Transport) typedProbeCall(src, tag int) (*noncontig, typedCall, error) {
	c := typedCall{peer: src, tag: tag, space: KindTyped}
	if err := t.checkRecvSource(src, tag, "typed probe"); err != nil {
		return nil, c, err
	}
	nc, err := t.noncontig()
	return nc, c, err
}

// typedMessage makes the TypedMessage of an RTS received from peer.
func (nc *noncontig) typedMessage(peer, tag int, hdr []byte) (*TypedMessage, error) {
	st, err := nc.rtsStatus(peer, tag, hdr)
	if err != nil {
		return nil, err
	}
	return &TypedMessage{nc: nc, st: st, hdr: slices.Clone(hdr)}, nil
}

// rtsStatus is the Status of the typed message whose RTS, hdr, came from
// peer: Size is its packed bytes. An RTS that does not decode fails the
// probe, and its sender is answered with a failure as a receive answers it
// (failMalformedRTS); before, the sender waited for ever.
func (nc *noncontig) rtsStatus(peer, tag int, hdr []byte) (Status, error) {
	var h rts
	if err := h.decode(hdr); err != nil {
		nc.failMalformedRTS(context.Background(), peer, hdr, 0)
		return Status{}, fmt.Errorf("transport: typed probe rank %d tag %d: %w", peer, tag, err)
	}
	return Status{Source: peer, Tag: tag, Size: int(h.bytes)}, nil
}

// Recv receives the message into count elements of dt whose origin is
// buf[0] and waits (MPI_Mrecv). The message's type signature must match
// (the first elements of) dt's and its size must fit; otherwise both sides
// fail with a *TypeMismatchError. Invalid arguments fail with ErrInvalid
// and leave the message to be received.
func (m *TypedMessage) Recv(ctx context.Context, buf []byte, dt *datatype.Type, count int) (Status, error) {
	return m.RecvWith(ctx, buf, dt, count, TypedOptions{})
}

// RecvWith is Recv with a scheme and origin of its own (TypedOptions;
// Runtime is not allowed: the message belongs to the MPI-style space).
func (m *TypedMessage) RecvWith(ctx context.Context, buf []byte, dt *datatype.Type, count int, o TypedOptions) (Status, error) {
	nc, c, err := m.call(buf, dt, count, o)
	if err != nil {
		return Status{}, err
	}
	if err := nc.t.waitInHandler("typed matched recv", -1, 0); err != nil {
		return Status{}, err // the message stays to be received
	}
	// The probe matched it: the transfer runs to completion whatever ctx
	// does, or the message would be lost (recvPlaced).
	return nc.recvMatched(context.WithoutCancel(ctx), c, m.hdr)
}

// Irecv starts receiving the message as Recv does (MPI_Imrecv); the
// request completes when the data has landed.
func (m *TypedMessage) Irecv(buf []byte, dt *datatype.Type, count int) (*Request, error) {
	return m.IrecvWith(buf, dt, count, TypedOptions{})
}

// IrecvWith is Irecv with a scheme and origin of its own.
func (m *TypedMessage) IrecvWith(buf []byte, dt *datatype.Type, count int, o TypedOptions) (*Request, error) {
	nc, c, err := m.call(buf, dt, count, o)
	if err != nil {
		return nil, err
	}
	t := nc.t
	r := t.newRequest("typed recv", c.peer, c.tag, len(buf))
	t.startTyped(r, c.bytes, func() (Status, error) { return nc.recvMatched(context.Background(), c, m.hdr) })
	return r, nil
}

// call checks a receive of m and takes m for it.
func (m *TypedMessage) call(buf []byte, dt *datatype.Type, count int, o TypedOptions) (*noncontig, typedCall, error) {
	if m == nil {
		return nil, typedCall{}, fmt.Errorf("%w: typed recv: nil TypedMessage", ErrInvalid)
	}
	if o.Runtime {
		return nil, typedCall{}, fmt.Errorf("%w: typed recv: a probed message is not in the runtimes' space", ErrInvalid)
	}
	nc, c, err := m.nc.t.typedCall("typed recv", m.st.Source, m.st.Tag, buf, dt, count, o)
	if err != nil {
		return nil, c, err
	}
	if !m.taken.CompareAndSwap(false, true) {
		return nil, c, fmt.Errorf("%w: typed recv: the probed message was already received", ErrInvalid)
	}
	return nc, c, nil
}
