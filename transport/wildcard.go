package transport

import (
	"errors"
	"fmt"
	"slices"

	"go.uber.org/zap"

	"github.com/troupe-hpc/troupe/transport/ucx"
)

// Any-source receives (MPI_ANY_SOURCE) and the software matcher behind them.
//
// A user receive normally goes to UCX at once with its exact wire tag:
// (source, tag, sequence), the sequence being the next one of its (source,
// tag) (trace-based matching, DESIGN 5.2). An any-source receive cannot be
// given a wire tag when it is posted, since which rank's message it gets is
// decided by arrival. If some rank's next message with that tag has
// already arrived (the same test as Iprobe), the receive takes that rank's
// next sequence number and is posted like an exact receive, which matches
// the message at once. If nothing with the tag has arrived, it goes to UCX
// with the source and sequence fields masked, so that the first message
// with the tag to arrive matches it in UCX as an exact receive's would;
// the sender's tag then names the rank and the sequence number it took.
// That is sound only while every message with the tag that UCX could hand
// it is its sender's next: no message with the tag waits in UCX's queue or
// outside it (overlap prefetch slots, CMA descriptors a probe fetched), and
// no exact receive with the tag waits outside UCX (the overlap engine's
// table), where UCX cannot see that it was posted first (anyPostable).
// Otherwise the receive waits in software, in a per-tag list, until a
// message for it has arrived.
//
// MPI matches receives in the order they were posted. A receive for the
// same tag posted after a pending any-source receive could otherwise take
// the message the any-source receive is owed, or a sequence number it will
// need, so it waits in the same list behind it, also while the any-source
// receive at its head is in UCX; the list is started in order as far as
// its head allows. While receives wait there, none of them is visible to
// the overlap engine: a pending wildcard turns offload off for its tag, as
// DESIGN 5.2 asks.
//
// There is no any-tag receive: the wire tag orders messages per (source,
// tag) only, and a message the overlap engine or a probe has already taken
// out of UCX no longer shows when it arrived relative to a source's
// messages with other tags, so the earliest of them cannot be told.

// AnySource as the source of Irecv, IrecvIOV, Recv, RecvIOV, Iprobe or
// Probe matches the next message with the tag from any rank. The Status of
// the completed receive names the rank. Messages from one rank with one tag
// are still received in the order they were sent, and receives for one tag
// match in the order they were posted.
const AnySource = -1

// AnyTag is MPI_ANY_TAG's value. This transport refuses it: see
// ErrAnyTag.
const AnyTag = -1

// ErrAnyTag: any-tag receives and probes are not supported (the wire tag
// orders messages per source and tag only; docs/transport.md).
var ErrAnyTag = errors.New("transport: any-tag receives are not supported")

// wildcards is the software matcher's state; the worker lock guards it.
type wildcards struct {
	held    map[int][]*Request // per user tag: receives waiting, in post order
	n       int                // receives waiting in all lists
	next    int                // the rank an any-source search starts from (fairness)
	matched []int              // tags whose masked head matched: start those behind it
	stats   AnySourceStats
}

// AnySourceStats counts how any-source receives found their messages.
type AnySourceStats struct {
	// InUCX: posted to UCX with the source masked (nothing with the tag
	// had arrived) and matched there as the first message to arrive.
	InUCX int64
	// Arrived: matched in software to a message that had arrived before
	// the receive could be posted.
	Arrived int64
}

// AnySourceStats reports how any-source receives were matched so far.
func (t *Transport) AnySourceStats() AnySourceStats {
	t.mu.Lock()
	defer t.mu.Unlock()
	return t.wild.stats
}

// wildHold keeps r in software when it is an any-source receive or one
// posted behind such a receive for its tag, and starts what it can; it
// reports whether it took r. The worker lock is held.
func (t *Transport) wildHold(r *Request) bool {
	if r.peer != AnySource && len(t.wild.held[r.tag]) == 0 {
		return false
	}
	if t.closed {
		t.fail(r, fmt.Errorf("transport: recv from %s tag %d: %w", sourceName(r.peer), r.tag, ErrClosed))
		return true
	}
	if t.wild.held == nil {
		t.wild.held = map[int][]*Request{}
	}
	t.wild.held[r.tag] = append(t.wild.held[r.tag], r)
	t.wild.n++
	t.wildAdvance(r.tag)
	return true
}

// wildAdvance starts the receives waiting for tag from the head of its
// list: exact ones as they are, an any-source one once a message for it
// has arrived. It stops at an any-source receive with nothing to take,
// which goes to UCX with the source masked if it can (wildPost) and stays
// at the head until it matches. The worker lock is held.
func (t *Transport) wildAdvance(tag int) {
	q := t.wild.held[tag]
	for len(q) > 0 {
		r := q[0]
		if r.anyPosted {
			break // in UCX: wildMatched starts those behind it
		}
		if r.peer == AnySource {
			src, ok, none := t.anyArrived(tag)
			if !ok {
				if none {
					t.wildPost(r)
				}
				break
			}
			r.peer = src
			t.wild.stats.Arrived++
		}
		q[0] = nil
		q = q[1:]
		t.wild.n--
		startRecvNow(t, r)
	}
	if len(q) == 0 {
		delete(t.wild.held, tag)
		return
	}
	t.wild.held[tag] = q
}

// wildAdvanceAll runs wildAdvance for every tag with receives waiting,
// after something arrived. The worker lock is held.
func (t *Transport) wildAdvanceAll() {
	if t.wild.n == 0 {
		return
	}
	tags := make([]int, 0, len(t.wild.held))
	for tag := range t.wild.held {
		tags = append(tags, tag)
	}
	for _, tag := range tags {
		t.wildAdvance(tag)
	}
}

// wildCancel withdraws r if it still waits in software, fails it with err
// and starts the receives it held up; it reports whether r was waiting.
// The worker lock is held.
func (t *Transport) wildCancel(r *Request, err error) bool {
	if r.anyPosted {
		return false // UCX holds it: cancelled there
	}
	q := t.wild.held[r.tag]
	i := slices.Index(q, r)
	if i < 0 {
		return false
	}
	t.wild.held[r.tag] = slices.Delete(q, i, i+1)
	t.wild.n--
	t.fail(r, err)
	t.wildAdvance(r.tag)
	return true
}

// wildClose fails every receive still waiting in software; the worker
// lock is held.
func (t *Transport) wildClose() {
	for tag, q := range t.wild.held {
		for _, r := range q {
			if r.anyPosted {
				continue // UCX holds it: Close cancels it there
			}
			t.fail(r, fmt.Errorf("transport: recv from %s tag %d: %w", sourceName(r.peer), tag, ErrClosed))
		}
	}
	t.wild.held, t.wild.n, t.wild.matched = nil, 0, nil
}

// wildPost hands r, the any-source receive at the head of its tag's list,
// to UCX with the source and sequence masked, when that is sound
// (anyPostable); r stays at the head until it completes. The caller has
// just found no message with the tag in UCX's queue. The worker lock is
// held.
func (t *Transport) wildPost(r *Request) {
	if t.closed || !t.anyPostable(r.tag) {
		return
	}
	r.anyPosted = true
	if err := t.postUserRecv(r, MakeUserTag(0, uint16(r.tag), 0), anyUserSourceMask); err != nil {
		// Nothing was posted: r waits in software as before.
		r.anyPosted = false
		t.log.Debug("posting an any-source receive to UCX failed; matching it in software", zap.Int("tag", r.tag), zap.Error(err))
	}
}

// anyPostable reports whether a receive matching any rank's messages with
// tag may be posted to UCX: no message with the tag is out of UCX's queue
// (prefetched by the overlap engine, a CMA descriptor a probe fetched or
// is fetching), and no exact receive with the tag waits in the overlap
// engine's table or holds its message's header there. Then the first message with the tag UCX can match is its
// sender's next, and no receive posted before is passed over. The worker
// lock is held.
func (t *Transport) anyPostable(tag int) bool {
	ours := func(wire uint64) bool {
		if Kind(wire>>kindShift)&7 != KindUser {
			return false
		}
		_, tg, _ := SplitUserTag(wire)
		return int(tg) == tag
	}
	for wire := range t.cma.held {
		if ours(wire) {
			return false
		}
	}
	for wire := range t.cma.probing {
		if ours(wire) {
			return false
		}
	}
	if t.ov != nil {
		for k := range t.ov.unexp {
			if ours(k.wire) {
				return false
			}
		}
		for k := range t.ov.posted {
			if ours(k.wire) {
				return false
			}
		}
		for _, r := range t.ov.held {
			// A held header goes back to the unexpected table if its
			// receive is cancelled: it must be there to be found first.
			if r.ov.held && ours(r.ov.wire) {
				return false
			}
		}
	}
	return true
}

// wildMatched handles the completion of an any-source receive UCX held
// (wildPost): the sender's tag names the rank and the sequence number the
// message took, which the receive now owns. It takes r off its list; the
// receives behind it start once the events in hand are handled
// (wildAdvanceMatched). It reports whether it handled r itself: completed
// it (a cancelled or failed receive, which matched no message), or put it
// back at the head of its list (it matched a message naming a rank outside
// the job, which is dropped). The worker lock is held.
func (t *Transport) wildMatched(r *Request, e *ucx.Event) bool {
	r.anyPosted = false
	if q := t.wild.held[r.tag]; len(q) > 0 {
		if i := slices.Index(q, r); i >= 0 {
			t.wild.held[r.tag] = slices.Delete(q, i, i+1)
			t.wild.n--
			t.wild.matched = append(t.wild.matched, r.tag)
		}
	}
	wire := e.SenderTag() &^ cmaBit
	st := e.Status()
	if (st != ucx.StatusOK && st != ucx.StatusTruncated) || Kind(wire>>kindShift)&7 != KindUser {
		err := r.failErr
		if err == nil {
			err = fmt.Errorf("transport: recv from any rank tag %d: %s", r.tag, st)
		}
		t.fail(r, err)
		return true
	}
	src, _, seq := SplitUserTag(wire)
	if int(src) >= t.size {
		// A message naming a rank outside the job, spent: r goes back
		// to the head of its list and waits for a real one.
		t.noteForeign(int(src), wire)
		t.wild.held[r.tag] = append([]*Request{r}, t.wild.held[r.tag]...)
		t.wild.n++
		return true
	}
	r.peer, r.key, r.seq, r.seqd = int(src), seqKey{int(src), r.tag}, seq, true
	t.wild.stats.InUCX++
	if !t.recvCounter(r.key).claim(seq) {
		// Cannot happen while anyPostable's conditions hold; say so
		// rather than lose track quietly.
		t.log.Error("any-source receive matched a message that was not its sender's next",
			zap.Int("source", r.peer), zap.Int("tag", r.tag), zap.Uint32("seq", seq))
	}
	return false
}

// wildAdvanceMatched starts the receives that waited behind any-source
// receives UCX has matched. The worker lock is held, and no events are in
// hand (starting a receive may drain more).
func (t *Transport) wildAdvanceMatched() {
	for len(t.wild.matched) > 0 {
		tags := t.wild.matched
		t.wild.matched = nil
		for _, tag := range tags {
			t.wildAdvance(tag)
		}
	}
}

// anyArrived looks for a rank whose next message with tag (the one a
// receive posted now would get) has arrived; none reports that UCX's queue
// holds no message with the tag at all. The worker lock is held.
//
// One masked probe finds the earliest message with the tag still in UCX's
// queue, from any rank; it will do if it is its sender's next. Messages
// taken out of UCX (a prefetch slot, a descriptor a probe fetched) are
// looked up in those tables. Only when UCX's earliest message is not its
// sender's next (that one was taken out) might another rank's be hidden
// behind it: then every rank is asked in turn, starting after the one the
// previous such search chose, so that no sender is starved.
func (t *Transport) anyArrived(tag int) (src int, found, none bool) {
	_, info, ok := t.w.TagProbe(MakeUserTag(0, uint16(tag), 0), t.userMask()&^anyUserSourceMask, false)
	for ok {
		s, _, _ := SplitUserTag(info.Tag &^ cmaBit)
		if !t.dropForeign(int(s), info.Tag) {
			break
		}
		_, info, ok = t.w.TagProbe(MakeUserTag(0, uint16(tag), 0), t.userMask()&^anyUserSourceMask, false)
	}
	if ok {
		src, _, seq := SplitUserTag(info.Tag)
		if seq == t.peekSeq(int(src), tag) {
			return int(src), true, false
		}
	}
	if src, found := t.anyTakenOut(tag); found {
		return src, true, false
	}
	if !ok {
		return 0, false, true
	}
	for i := 0; i < t.size; i++ {
		src := (t.wild.next + i) % t.size
		if _, ok := t.arrived(src, tag); ok {
			t.wild.next = (src + 1) % t.size
			return src, true, false
		}
	}
	return 0, false, false
}

// anyUserSourceMask covers the source and sequence fields of a USER tag:
// a probe with it cleared matches one user tag from any rank.
const anyUserSourceMask = (MaxUserRanks-1)<<(UserTagBits+UserSeqBits) | userSeqMask

// anyTakenOut finds a rank whose next message with tag waits outside UCX's
// queue: in an overlap prefetch slot, or as a CMA descriptor a probe
// fetched. The worker lock is held.
func (t *Transport) anyTakenOut(tag int) (int, bool) {
	next := func(wire uint64) (int, bool) {
		if Kind(wire>>kindShift)&7 != KindUser {
			return 0, false
		}
		src, tg, seq := SplitUserTag(wire)
		return int(src), int(tg) == tag && seq == t.peekSeq(int(src), tag)
	}
	for wire := range t.cma.held {
		if src, ok := next(wire); ok {
			return src, true
		}
	}
	if t.ov != nil {
		for k, m := range t.ov.unexp {
			if m.r != nil || m.descPending || k.chunk != 0 {
				continue
			}
			if src, ok := next(k.wire); ok {
				return src, true
			}
		}
	}
	return 0, false
}

// peekSeq is the sequence number of the next message from src with tag
// (the one a receive posted now would take). The worker lock is held.
func (t *Transport) peekSeq(src, tag int) uint32 {
	if c := t.recvSeq[seqKey{src, tag}]; c != nil {
		return c.peek()
	}
	return 0
}

// arrived reports whether the next message from src with tag has arrived,
// and its size: waiting in UCX, in an overlap slot, or as a CMA descriptor
// a probe took out. The worker lock is held.
func (t *Transport) arrived(src, tag int) (int, bool) {
	wire := MakeUserTag(uint32(src), uint16(tag), t.peekSeq(src, tag))
	if m, ok := t.ovHas(wire); ok {
		return m.size, true
	}
	if t.cma.on {
		return t.cmaProbe(wire)
	}
	_, info, ok := t.w.TagProbe(wire, FullMask, false)
	return info.Length, ok
}

// checkRecvSource checks the source and tag of a receive or probe, which
// may be AnySource.
func (t *Transport) checkRecvSource(src, tag int, op string) error {
	if src != AnySource {
		if err := t.checkRank(src, op); err != nil {
			return err
		}
	}
	if tag == AnyTag {
		return fmt.Errorf("%w: %s: %w", ErrInvalid, op, ErrAnyTag)
	}
	return checkTag(tag, op)
}

// sourceName is how messages name a receive's source.
func sourceName(src int) string {
	if src == AnySource {
		return "any rank"
	}
	return fmt.Sprintf("rank %d", src)
}
