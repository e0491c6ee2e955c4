package transport

import (
	"errors"
	"fmt"
	"slices"
)

// Any-source receives (MPI_ANY_SOURCE) and the software matcher behind them.
//
// A user receive normally goes to UCX at once with its exact wire tag:
// (source, tag, sequence), the sequence being the next one of its (source,
// tag) (trace-based matching, DESIGN 5.2). An any-source receive cannot be
// given a wire tag when it is posted, since which rank's message it gets is
// decided by arrival. So it waits in software, in a per-tag list, until some
// rank's next message with that tag has arrived (the same test as Iprobe);
// then it takes that rank's next sequence number and is posted like an
// exact receive, which matches the message at once.
//
// MPI matches receives in the order they were posted. A receive for the
// same tag posted after a pending any-source receive could otherwise take
// the message the any-source receive is owed, or a sequence number it will
// need, so it waits in the same list behind it; the list is started in
// order as far as its head allows. While receives wait there, none of
// them is visible to UCX or to the overlap engine: a pending wildcard turns
// offload off for its tag, as DESIGN 5.2 asks.
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
	held map[int][]*Request // per user tag: receives waiting, in post order
	n    int                // receives waiting in all lists
	next int                // the rank an any-source search starts from (fairness)
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
// has arrived. It stops at an any-source receive with nothing to take.
// The worker lock is held.
func (t *Transport) wildAdvance(tag int) {
	q := t.wild.held[tag]
	for len(q) > 0 {
		r := q[0]
		if r.peer == AnySource {
			src, ok := t.anyArrived(tag)
			if !ok {
				break
			}
			r.peer = src
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
			t.fail(r, fmt.Errorf("transport: recv from %s tag %d: %w", sourceName(r.peer), tag, ErrClosed))
		}
	}
	t.wild.held, t.wild.n = nil, 0
}

// anyArrived looks for a rank whose next message with tag (the one a
// receive posted now would get) has arrived. The worker lock is held.
//
// One masked probe finds the earliest message with the tag still in UCX's
// queue, from any rank; it will do if it is its sender's next. Messages
// taken out of UCX (a prefetch slot, a descriptor a probe fetched) are
// looked up in those tables. Only when UCX's earliest message is not its
// sender's next (that one was taken out) might another rank's be hidden
// behind it: then every rank is asked in turn, starting after the one the
// previous such search chose, so that no sender is starved.
func (t *Transport) anyArrived(tag int) (int, bool) {
	_, info, ok := t.w.TagProbe(MakeUserTag(0, uint16(tag), 0), t.userMask()&^anyUserSourceMask, false)
	if ok {
		src, _, seq := SplitUserTag(info.Tag)
		if seq == t.peekSeq(int(src), tag) {
			return int(src), true
		}
	}
	if src, found := t.anyTakenOut(tag); found {
		return src, true
	}
	if !ok {
		return 0, false
	}
	for i := 0; i < t.size; i++ {
		src := (t.wild.next + i) % t.size
		if _, ok := t.arrived(src, tag); ok {
			t.wild.next = (src + 1) % t.size
			return src, true
		}
	}
	return 0, false
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
