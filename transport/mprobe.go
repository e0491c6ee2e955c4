package transport

import (
	"context"
	"fmt"
	"sync/atomic"

	"github.com/troupe-hpc/troupe/transport/ucx"
)

// Matched probes (MPI_Improbe, MPI_Mprobe, MPI_Mrecv).
//
// Probe followed by Recv(st.Source, ...) is racy when several goroutines
// receive with the same tag: another goroutine's receive may take the
// probed message first. A matched probe takes the message out of the
// matching order instead, by taking its (source, tag) sequence number, so
// that only the returned Message can receive it.

// Message is a message a matched probe (Improbe, Mprobe) has taken: no
// receive can match it any more, and its own Recv or Irecv receives it.
// Receive every Message once; one never received leaves its sender's
// later messages with that tag to the receives that follow, as if it had
// been received.
type Message struct {
	t     *Transport
	st    Status
	seq   uint32
	taken atomic.Bool
}

// Status is the message's source, tag and size.
func (m *Message) Status() Status { return m.st }

// Improbe is Iprobe that takes the message it finds (MPI_Improbe): it
// returns nil and false when none has arrived. src may be AnySource. While
// receives posted earlier for the tag wait for messages (behind an
// any-source receive), it finds nothing: those receives come first.
func (t *Transport) Improbe(src, tag int) (*Message, bool, error) {
	if err := t.checkRecvSource(src, tag, "probe"); err != nil {
		return nil, false, err
	}
	if t.opts.Progress == ProgressDirect {
		t.progressOnce()
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.closed {
		return nil, false, ErrClosed
	}
	t.runSubmitted()
	if len(t.wild.held[tag]) > 0 {
		if t.wildAdvance(tag); len(t.wild.held[tag]) > 0 {
			return nil, false, nil
		}
	}
	if src == AnySource {
		s, ok, _ := t.anyArrived(tag)
		if !ok {
			return nil, false, nil
		}
		src = s
	}
	size, ok := t.arrived(src, tag)
	if !ok {
		if p := t.peers[src]; p != nil && p.lost != nil {
			return nil, false, &PeerLostError{Rank: src, Op: "probe", Reason: p.lost.Reason}
		}
		return nil, false, nil
	}
	seq := t.recvCounter(seqKey{src, tag}).take()
	return &Message{t: t, st: Status{Source: src, Tag: tag, Size: size}, seq: seq}, true, nil
}

// Mprobe waits until a message from src (or AnySource) with tag has
// arrived and takes it, as Improbe does (MPI_Mprobe).
func (t *Transport) Mprobe(ctx context.Context, src, tag int) (*Message, error) {
	var m *Message
	err := t.probeWait(ctx, func() (ok bool, err error) {
		m, ok, err = t.Improbe(src, tag)
		return ok, err
	})
	return m, err
}

// Irecv starts receiving the message into buf (MPI_Imrecv). A buffer
// smaller than the message fails with a *TruncatedError. A receive
// cancelled through Wait's context gives the message back to the
// matching order: the next receive for its source and tag gets it.
func (m *Message) Irecv(buf []byte) (*Request, error) {
	if m == nil {
		return nil, fmt.Errorf("%w: recv: no probed message (a nil *Message: Improbe found none)", ErrInvalid)
	}
	if !m.taken.CompareAndSwap(false, true) {
		return nil, fmt.Errorf("%w: recv: the probed message was already received", ErrInvalid)
	}
	t := m.t
	r := t.newRequest("recv", m.st.Source, m.st.Tag, len(buf))
	r.recv = true
	r.b = ucx.Buffer{Ptr: bytesPtr(buf), Len: len(buf)}
	r.seq, r.fixedSeq = m.seq, true
	t.execReq(r, startRecvNow)
	return r, nil
}

// Recv receives the message into buf and waits (MPI_Mrecv).
func (m *Message) Recv(ctx context.Context, buf []byte) (Status, error) {
	if m == nil {
		_, err := m.Irecv(buf)
		return Status{}, err
	}
	if err := m.t.waitInHandler("matched recv", -1, 0); err != nil {
		return Status{}, err // the message stays to be received
	}
	r, err := m.Irecv(buf)
	if err != nil {
		return Status{}, err
	}
	return r.Wait(ctx)
}
