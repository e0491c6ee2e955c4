package transport

import "context"

// RTS turns: the typed sends of the MPI-style space to one (peer, tag)
// post their RTS messages in the order of their sequence numbers.
//
// A typed send takes its sequence number in the caller's goroutine, in
// call order, but IsendTyped runs the protocol apart from the call (in a
// goroutine of its own, or later in a Wait: deferred.go),
// so two sends started one after the other could post their RTS messages
// in either order. Exact receives do not mind (they match the sequence
// number in the tag), but an any-source typed receive is matched by UCX
// to the first RTS with its tag to arrive, and a typed probe looks at the
// first in UCX's queue: with the RTS of a sender's second message ahead
// of its first, the receive took the second message out of turn (MPI's
// non-overtaking rule broken; found 2026-11-24 by TestTypedIprobe, and
// TestTypedAnySourceConcurrentSends). UCX keeps a sender's tagged messages
// in the order they were posted, so posting the RTS messages in sequence
// order is enough. The runtimes' space has no any-source receives and is
// left alone.

// rtsTurn is the turn of one (peer, tag); nc.mu guards it.
type rtsTurn struct {
	next uint32          // the sequence number whose RTS goes next
	gone map[uint32]bool // later numbers given up before their turn
	ch   chan struct{}   // closed, and replaced, when next moves
}

func (nc *noncontig) turnLocked(k seqKey) *rtsTurn {
	tn := nc.turns[k]
	if tn == nil {
		tn = &rtsTurn{gone: map[uint32]bool{}, ch: make(chan struct{})}
		nc.turns[k] = tn
	}
	return tn
}

// awaitRTSTurn waits until the send with sequence number seq to k may post
// its RTS: every earlier send's RTS has been posted, or given up. When ctx
// ends or the transport closes first, it gives the turn up and returns the
// reason.
func (nc *noncontig) awaitRTSTurn(ctx context.Context, k seqKey, seq uint32) error {
	for {
		nc.mu.Lock()
		tn := nc.turnLocked(k)
		if tn.next == seq {
			nc.mu.Unlock()
			return nil
		}
		ch := tn.ch
		nc.mu.Unlock()
		select {
		case <-ch:
		case <-ctx.Done():
			nc.endRTSTurn(k, seq)
			return ctx.Err()
		case <-nc.stop:
			nc.endRTSTurn(k, seq)
			return ErrClosed
		}
	}
}

// endRTSTurn ends the turn of sequence number seq to k: its RTS has been
// posted, or never will be. A number whose turn has not come yet is
// skipped when it comes.
func (nc *noncontig) endRTSTurn(k seqKey, seq uint32) {
	nc.mu.Lock()
	defer nc.mu.Unlock()
	tn := nc.turnLocked(k)
	if tn.next != seq {
		tn.gone[seq] = true
		return
	}
	tn.next = (seq + 1) & ncSeqMask
	for tn.gone[tn.next] {
		delete(tn.gone, tn.next)
		tn.next = (tn.next + 1) & ncSeqMask
	}
	close(tn.ch)
	tn.ch = make(chan struct{})
}

// rtsTurnNow reports whether the send with sequence number seq to k may
// post its RTS at once.
func (nc *noncontig) rtsTurnNow(k seqKey, seq uint32) bool {
	nc.mu.Lock()
	defer nc.mu.Unlock()
	return nc.turnLocked(k).next == seq
}
