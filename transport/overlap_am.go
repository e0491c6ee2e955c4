package transport

import "github.com/troupe-hpc/troupe/overlap"

// AMPlan is the overlap engine's decision for the data of a rendezvous
// active message whose consumer takes it later, as an actor takes a message
// from its mailbox (docs/overlap.md, section 7).
type AMPlan uint8

const (
	// AMUntracked: the engine is off, or the message is eager or below its
	// rendezvous threshold. Move the data at once (RecvData), as without
	// the engine.
	AMUntracked AMPlan = iota
	// AMPrefetch: move the data now (RecvData at once); Claim when the
	// consumer takes the message.
	AMPrefetch
	// AMOnload: leave the data at the sender. Keep the message; when the
	// consumer takes it, Claim, then RecvData from the consumer's
	// goroutine. Release instead if the consumer is gone.
	AMOnload
)

func (p AMPlan) String() string {
	switch p {
	case AMPrefetch:
		return "prefetch"
	case AMOnload:
		return "onload"
	}
	return "untracked"
}

// amTrack is the engine's record of one planned active message; guarded by
// the worker lock.
type amTrack struct {
	id        uint64
	peer      int
	size      int
	mode      AMPlan
	claimed   bool
	started   bool
	completed bool
}

// Plan reports a rendezvous message from peer to the rank's overlap engine
// as unexpected (its header is here, its consumer has not asked for it
// yet) and in place (a prefetch lands in the buffer later given to
// RecvData, not in a pool slot) and returns the engine's decision. Call it at most once, from the
// handler, before RecvData; the engine then also sees the consumer's Claim,
// the transfer's start and completion, and a Release without data. Without
// an engine, for eager messages and below the engine's threshold it returns
// AMUntracked and records nothing.
func (m *AMMessage) Plan(peer int) AMPlan {
	if !m.Rendezvous || m.consumed || m.ov != nil {
		return AMUntracked
	}
	t := m.t
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.ov == nil || t.closed || m.Size < t.ov.thresh {
		return AMUntracked
	}
	t.ov.nextID++
	tr := &amTrack{id: t.ov.nextID, peer: peer, size: m.Size, mode: AMOnload}
	d := t.step(overlap.Event{Kind: overlap.HeaderArrived, ID: tr.id, Peer: peer, Tag: uint64(m.id), Size: int64(m.Size), InPlace: true})
	if d.Action == overlap.Prefetch {
		tr.mode = AMPrefetch
	}
	m.ov = tr
	return tr.mode
}

// Claim tells the engine that the consumer took the message: the receive is
// posted now. For an AMOnload message call it before RecvData. It does
// nothing for messages Plan did not track, and after the first call.
func (m *AMMessage) Claim() {
	tr := m.ov
	if tr == nil {
		return
	}
	t := m.t
	t.mu.Lock()
	defer t.mu.Unlock()
	if tr.claimed || t.ov == nil {
		return
	}
	tr.claimed = true
	t.step(overlap.Event{Kind: overlap.RecvPosted, ID: tr.id, Peer: tr.peer, Tag: uint64(m.id), Size: int64(tr.size)})
	if tr.mode == AMPrefetch && tr.completed {
		t.step(overlap.Event{Kind: overlap.PrefetchConsumed, ID: tr.id})
	}
}

// amStarted records that the data transfer of tr begins; the lock is held.
func (t *Transport) amStarted(tr *amTrack) {
	if tr.started || t.ov == nil {
		return
	}
	tr.started = true
	t.step(overlap.Event{Kind: overlap.TransferStarted, ID: tr.id})
}

// amDone records that the data of tr is in place (or failed to come); the
// lock is held.
func (t *Transport) amDone(tr *amTrack) {
	if tr.completed || t.ov == nil {
		return
	}
	tr.completed = true
	t.step(overlap.Event{Kind: overlap.TransferCompleted, ID: tr.id})
	if tr.mode == AMPrefetch && tr.claimed {
		t.step(overlap.Event{Kind: overlap.PrefetchConsumed, ID: tr.id})
	}
}

// amDropped makes the engine forget a tracked message released without its
// data; the lock is held.
func (t *Transport) amDropped(tr *amTrack) {
	if tr.started || t.ov == nil {
		return
	}
	if tr.mode == AMPrefetch {
		t.step(overlap.Event{Kind: overlap.PrefetchDropped, ID: tr.id}) // nothing was written
		return
	}
	if tr.claimed {
		// Matched to its consumer already: the engine forgets it when its
		// (empty) transfer ends.
		t.amStarted(tr)
		t.amDone(tr)
		return
	}
	t.step(overlap.Event{Kind: overlap.OnloadDropped, ID: tr.id})
}
