package transport

import (
	"cmp"
	"errors"
	"fmt"
	"slices"

	"github.com/troupe-hpc/troupe/overlap"
	"github.com/troupe-hpc/troupe/transport/ucx"
)

// Renumbering after a cancelled receive.
//
// A receive takes the next sequence number of its (source, tag) when it is
// posted and matches exactly the message the sender numbered alike
// (trace-based matching, DESIGN 5.2). MPI matches a (source, tag)'s
// messages to its receives in the order the receives were posted, passing
// over cancelled ones: the message a cancelled receive was owed goes to the
// earliest receive still pending. So when a receive is cancelled while
// receives posted after it for the same (source, tag) are pending, each of
// them takes over the number of the one before it, and the newest number
// is given back for the next receive posted.
//
// A pending receive can be given another number only while it has not
// matched its message. Each counter keeps its receives in post order while
// they are pending (recvCounter.waiting). Those holding a number newer than
// the oldest one given back are renumbered only if every one of them waits
// in UCX's expected queue, where it is cancelled at once if it has not
// matched (Worker.CancelNow) and posted again with its new number, or in
// the overlap engine's table of posted receives, where it is re-keyed. All
// of it happens in one step under the worker lock, which UCX needs to
// progress, and a UCX receive the user cancels is handled at once so that
// the step follows it directly (cancelRecv). Otherwise (one of them has
// matched, or a masked any-source receive in UCX could take the numbers'
// messages and would then come before the receives posted again) the
// numbers stay as they are, as before this existed: the message the
// cancelled receive was owed goes to the next receive posted.

// renumbering is the state of the renumbering; the worker lock guards it.
type renumbering struct {
	queue []seqKey // (source, tag)s with a number given back, to renumber
	typed []seqKey // the same for typed receives (renumberTyped)
}

// leave takes r, completed, off the counter's list of pending receives;
// the oldest is usually first.
func (c *recvCounter) leave(r *Request) {
	if i := slices.Index(c.waiting, r); i >= 0 {
		c.waiting = slices.Delete(c.waiting, i, i+1)
	}
}

// cancelRecv withdraws r, a pending receive, and fails it with err unless
// it completes first; the worker lock is held.
func (t *Transport) cancelRecv(r *Request, err error) {
	switch {
	case t.wildCancel(r, err):
	case r.ov != nil && t.ov != nil && t.ovCancel(r, err):
	case !r.fin.Load() && r.ureq.Pending():
		r.failErr = err
		t.w.Cancel(r.ureq)
		// Handle the cancellation before UCX progresses again, so that
		// the receives posted after r can be renumbered.
		t.drainEvents()
	}
	t.runRenumbers()
}

// cancelledSeq gives back the number of r, a cancelled receive, and
// queues its (source, tag) to be renumbered; the worker lock is held.
func (t *Transport) cancelledSeq(r *Request) {
	if r.rtsSeq {
		t.cancelledRTS(r)
		return
	}
	numbered, k := r.seqd && r.key != chanSinkKey, r.key
	t.freeSeq(r)
	if numbered && !t.closed {
		t.renumber.queue = append(t.renumber.queue, k)
	}
}

// runRenumbers renumbers the (source, tag)s queued by cancellations; the
// worker lock is held, and no events are in hand (posting a receive may
// drain events).
func (t *Transport) runRenumbers() {
	for len(t.renumber.queue) > 0 {
		k := t.renumber.queue[0]
		t.renumber.queue = t.renumber.queue[1:]
		t.renumberKey(k)
	}
	for len(t.renumber.typed) > 0 {
		k := t.renumber.typed[0]
		t.renumber.typed = t.renumber.typed[1:]
		t.renumberTyped(k)
	}
}

// renumberKey gives k's pending receives the oldest numbers, in the order
// they were posted, when it is sound (above); the worker lock is held.
func (t *Transport) renumberKey(k seqKey) {
	c := t.recvSeq[k]
	if t.closed || c == nil || len(c.freed) == 0 {
		return
	}
	rs, ok := t.numberedAfter(c, c.freed[0]) // freed numbers are kept oldest first
	if !ok || len(rs) == 0 {
		return
	}
	nums := heldAndFreed(c, rs)
	if !renumbers(rs, nums) {
		return // each holds its number already
	}
	// A masked any-source receive UCX holds for the tag was posted after
	// the receives (those posted after it wait behind it in software), and
	// must still come after them in UCX's queue: it is withdrawn too, and
	// posted again last.
	var masked *Request
	if q := t.wild.held[k.tag]; len(q) > 0 && q[0].anyPosted {
		masked = q[0]
		if !t.withdrawMasked(masked) {
			return // it matched a message: its claim decides, numbers as they are
		}
	}
	var moved []*Request
	for i, r := range rs {
		if r.seq == nums[i] {
			continue
		}
		if !t.withdrawNumbered(r) {
			// UCX matched it meanwhile: put back the ones withdrawn,
			// numbers unchanged.
			for _, m := range moved {
				t.repostNumbered(m)
			}
			t.repostMasked(masked)
			return
		}
		moved = append(moved, r)
	}
	for i, r := range rs {
		r.seq = nums[i]
	}
	c.freed = append(c.freed[:0], nums[len(rs):]...)
	for _, r := range moved {
		t.repostNumbered(r)
	}
	t.repostMasked(masked)
}

// numberedAfter returns, in post order, the pending receives of c that
// hold a number newer than s. It reports false if one of them is in a
// state that cannot be renumbered: anywhere but UCX's expected queue or the
// overlap engine's table of posted receives, it has matched its message.
// A receive in UCX's queue may have matched too; withdrawNumbered finds
// out. The worker lock is held.
func (t *Transport) numberedAfter(c *recvCounter, s uint32) ([]*Request, bool) {
	var rs []*Request
	for _, r := range c.waiting {
		if c.age(r.seq) <= c.age(s) {
			continue
		}
		inUCX := r.ov == nil && r.probe == nil && !r.anyPosted && r.ureq.Pending() && t.ops[r.ureq] == r
		inTable := r.ov != nil && t.ov != nil && t.ov.posted[r.ov.key()] == r
		if !inUCX && !inTable {
			return nil, false
		}
		rs = append(rs, r)
	}
	return rs, true
}

// withdrawNumbered takes r, an unmatched receive, out of UCX's expected
// queue or the overlap engine's table, to be posted again; it reports false
// if UCX had matched it meanwhile. The worker lock is held.
func (t *Transport) withdrawNumbered(r *Request) bool {
	if r.ov != nil {
		delete(t.ov.posted, r.ov.key())
		return true
	}
	return t.cancelInUCX(r)
}

// cancelInUCX cancels r's UCX receive at once if it has not matched, and
// reports whether it did; r's cancellation event is then ignored. The
// worker lock is held.
func (t *Transport) cancelInUCX(r *Request) bool {
	old := r.ureq
	delete(t.ops, old)
	if !t.w.CancelNow(old) {
		t.ops[old] = r
		return false
	}
	r.ureq = ucx.Request{}
	return true
}

// renumbers reports whether some receive of rs is to take another number
// than it holds.
func renumbers(rs []*Request, nums []uint32) bool {
	for i, r := range rs {
		if r.seq != nums[i] {
			return true
		}
	}
	return false
}

// repostNumbered posts r again after withdrawNumbered, with the number it
// now holds; the worker lock is held, and no events are in hand.
func (t *Transport) repostNumbered(r *Request) {
	if r.ov != nil {
		wire := MakeUserTag(uint32(r.peer), uint16(r.tag), r.seq)
		k := ovKey{wire: wire}
		if t.ov.unexp[k] == nil {
			// The engine keeps its record of the receive; only the key
			// it waits under changes.
			r.ov.wire = wire
			t.ov.posted[k] = r
			return
		}
		// Its message is already in the engine's hands: the receive is
		// routed anew, as a fresh one.
		t.step(overlap.Event{Kind: overlap.RecvCancelled, ID: r.ov.id})
		r.ov = nil
	}
	t.postNumbered(r)
}

// withdrawMasked takes r, a masked any-source receive UCX holds, out of
// UCX's queue; it reports false if UCX had matched it meanwhile. r stays
// at the head of its tag's list. The worker lock is held.
func (t *Transport) withdrawMasked(r *Request) bool {
	if !t.cancelInUCX(r) {
		return false
	}
	r.anyPosted = false
	return true
}

// repostMasked starts r, an any-source receive withdrawMasked took out
// of UCX, as the head of its tag's list: matched to a message that has
// arrived, posted masked again, or left waiting in software
// (wildAdvance). The worker lock is held, and no events are in hand.
func (t *Transport) repostMasked(r *Request) {
	if r != nil {
		t.wildAdvance(r.tag)
	}
}

// Typed receives.
//
// A typed receive takes its number from its (source, tag)'s typed counter
// (noncontig.go) and posts the receive of the sender's RTS with that
// number in the tag; the RTS receive is in the counter's list of pending
// receives while UCX holds it (noncontig.rtsPostedReq). When one is
// cancelled, the receives pending behind it take over the numbers before
// theirs as plain receives do, so that the message the cancelled one was
// owed goes to the earliest typed receive still pending. Their RTS
// receives are withdrawn from UCX and posted again with the new numbers;
// the goroutines running them wait on the same requests and learn nothing
// of it (the number is only in the RTS tag). It is done only when it is
// sound, else the numbers stay as they are and the owed message goes to
// the next typed receive posted, as before 2026-12-02:
//
//   - every number of the counter handed out behind the one given back
//     has its RTS receive in UCX (a receive placed but not posted yet,
//     such as a prepared receive of the runtimes' space before Run, cannot
//     be renumbered);
//   - none of the pending receives has matched its RTS (found when it is
//     withdrawn: then the ones withdrawn go back unchanged);
//   - no message of the (source, tag) is parked by IprobeTyped.
//
// An any-source typed receive of the tag placed after them whose masked RTS
// receive UCX holds must stay behind them in UCX's queue: it is withdrawn
// first and posted again last (if it has matched an RTS, the numbers stay
// as they are). A number given back by a receive that gave up before
// posting its RTS receive (noncontig.leave) starts the same renumbering.
// A number given back waits in the counter's returning list, where no
// receive or probe takes it, until its renumbering runs (in the same step
// as a cancellation under the worker lock, or on the progress goroutine
// after leave): before 2026-12-03 it went straight to the freed numbers,
// and an ImprobeTyped in between took the message owed to the receive
// pending behind (found by TestRandomMatching, queue-on-typed).
// Each time the numbers stay as they are with a receive pending behind,
// NoncontigStats.RenumberSkipped counts it, and also each time a receive
// that took a later number had matched its message already (a receive
// placed behind an any-source one and not posted when its turn came, then
// given up: the message it was owed has to go to a receive placed later).

// cancelledRTS gives back the number of r, a typed receive's cancelled
// RTS receive, and queues its (source, tag) to be renumbered; the worker
// lock is held.
func (t *Transport) cancelledRTS(r *Request) {
	v, ok := noncontigs.Load(t)
	if !ok {
		return
	}
	nc := v.(*noncontig)
	r.rtsSeq = false
	nc.mu.Lock()
	c := nc.recvCounter(r.key)
	c.returning = append(c.returning, r.seq)
	nc.mu.Unlock()
	if !t.closed {
		t.renumber.typed = append(t.renumber.typed, r.key)
	}
}

// renumberTyped gives k's pending typed receives the oldest numbers, in
// the order they took theirs, when it is sound (above); the worker lock is
// held, and no events are in hand.
func (t *Transport) renumberTyped(k seqKey) {
	v, ok := noncontigs.Load(t)
	if !ok || t.closed {
		return
	}
	nc := v.(*noncontig)
	nc.mu.Lock()
	defer nc.mu.Unlock()
	c := nc.recvSeq[k]
	if c == nil {
		return
	}
	for _, s := range c.returning { // in the renumbering's step
		c.give(s)
	}
	c.returning = c.returning[:0]
	if len(c.freed) == 0 {
		return
	}
	// rs: the pending receives behind the oldest number given back; a
	// number behind it not posted yet cannot be renumbered.
	var rs []*Request
	sound := k.tag < 0 || nc.parkedLocked(k.peer, k.tag, false) == nil
	unpostedBehind := slices.ContainsFunc(c.unposted, func(u uint32) bool { return c.age(u) > c.age(c.freed[0]) })
	if unpostedBehind {
		sound = false
	}
	for _, r := range c.waiting {
		if c.age(r.seq) <= c.age(c.freed[0]) {
			continue
		}
		if !r.rtsSeq || r.fin.Load() || !r.ureq.Pending() || t.ops[r.ureq] != r {
			sound = false
		}
		rs = append(rs, r)
	}
	if matchedBehind(c, c.freed[0], len(rs)) {
		// A receive that took a later number has matched its message
		// already: MPI would have given the one owed to the number given
		// back to the receive that gave it back (placed first), which could
		// then not have been cancelled. The order departed; the receives
		// still pending are renumbered all the same.
		nc.skippedRenumber(k)
	}
	if len(rs) == 0 && !unpostedBehind {
		return // nobody behind it: the number goes to the next receive placed
	}
	if !sound || len(rs) == 0 {
		nc.skippedRenumber(k)
		return
	}
	// Numbers are taken in post order, so ordering the receives by their
	// numbers' age orders them as they were placed.
	slices.SortFunc(rs, func(a, b *Request) int { return cmp.Compare(c.age(a.seq), c.age(b.seq)) })
	nums := heldAndFreed(c, rs)
	if !renumbers(rs, nums) {
		return
	}
	// The masked RTS receive of a pending any-source typed receive of the
	// tag (placed after every exact receive holding a number: those placed
	// after it wait in the gate without one).
	var masked *Request
	if m := nc.anyRTS[k.tag]; k.tag >= 0 && m != nil && !m.fin.Load() && m.ureq.Pending() && t.ops[m.ureq] == m {
		if !t.cancelInUCX(m) {
			nc.skippedRenumber(k)
			return // it matched an RTS: its claim decides, numbers as they are
		}
		masked = m
	}
	var moved []*Request
	for i, r := range rs {
		if r.seq == nums[i] {
			continue
		}
		if !t.cancelInUCX(r) {
			// It matched its RTS meanwhile: the ones withdrawn go back
			// with their numbers.
			for _, m := range moved {
				t.repostRTS(nc, m)
			}
			t.repostMaskedRTS(nc, masked)
			nc.skippedRenumber(k)
			return
		}
		moved = append(moved, r)
	}
	for i, r := range rs {
		r.seq = nums[i]
	}
	c.freed = append(c.freed[:0], nums[len(rs):]...)
	for _, r := range moved {
		t.repostRTS(nc, r)
	}
	t.repostMaskedRTS(nc, masked)
}

// matchedBehind reports whether a number of c handed out after s, besides
// the pending receives behind it, is neither waiting to be posted nor
// given back: a receive that took it has matched its message. nc.mu is
// held.
func matchedBehind(c *recvCounter, s uint32, pending int) bool {
	newer := int((c.next - s - 1) & c.mask) // handed out after s
	for _, u := range c.unposted {
		if c.age(u) > c.age(s) {
			newer--
		}
	}
	for _, f := range c.freed {
		if c.age(f) > c.age(s) {
			newer--
		}
	}
	return newer > pending
}

// skippedRenumber counts a cancellation after which k's typed receives
// kept their numbers although one was pending behind the number given
// back (NoncontigStats.RenumberSkipped); nc.mu is held.
func (nc *noncontig) skippedRenumber(k seqKey) {
	if nc.renumberSkips == nil {
		nc.renumberSkips = map[seqKey]int{}
	}
	nc.renumberSkips[k]++
}

// repostMaskedRTS posts r, a masked RTS receive renumberTyped withdrew
// (none if nil), again, behind the exact ones. The worker lock and nc.mu
// are held.
func (t *Transport) repostMaskedRTS(nc *noncontig, r *Request) {
	if r == nil {
		return
	}
	if err := t.postMaskedRTS(r, r.tag); err != nil {
		delete(nc.anyRTS, r.tag)
		t.fail(r, fmt.Errorf("transport: typed recv from any rank tag %d: %w", r.tag, err))
	}
}

// repostRTS posts r, an RTS receive renumberTyped withdrew, again with the
// number it now holds. The worker lock and nc.mu are held.
func (t *Transport) repostRTS(nc *noncontig, r *Request) {
	space, tag := KindTyped, r.key.tag
	if tag < 0 {
		space, tag = KindDDT, -1-tag
	}
	ureq, err := t.w.TagRecv(r.b, ncRTSTag(space, uint32(r.key.peer), uint16(tag), r.seq), FullMask)
	switch {
	case err == nil && ureq.Pending():
		t.track(r, ureq)
		return
	case err == nil:
		err = errors.New("UCX completed a receive without reporting it")
	}
	// Its number goes back, as a receive that failed to post gives it.
	r.rtsSeq = false
	nc.recvCounter(r.key).give(r.seq)
	t.fail(r, fmt.Errorf("transport: typed recv rank %d tag %d: %w", r.key.peer, tag, err))
}

// heldAndFreed returns the numbers rs hold and c's freed ones, oldest
// first: the numbers rs, in post order, are to hold (the oldest ones), the
// rest going back to c.freed.
func heldAndFreed(c *recvCounter, rs []*Request) []uint32 {
	nums := make([]uint32, 0, len(rs)+len(c.freed))
	for _, r := range rs {
		nums = append(nums, r.seq)
	}
	nums = append(nums, c.freed...)
	slices.SortFunc(nums, func(a, b uint32) int { return cmp.Compare(c.age(a), c.age(b)) })
	return nums
}
