package transport

import (
	"context"
	"sync"
	"sync/atomic"
	"time"
)

// Lazy start of nonblocking typed requests.
//
// IsendTyped, IrecvTyped and TypedMessage.Irecv return at once and run the
// typed protocol (RTS, CTS, data, completion) apart from the call. They
// used to start a goroutine for it each time. Starting a goroutine while
// another processor is idle wakes a thread for it, and on a virtual machine
// that costs more than a small typed transfer itself: a ping-pong of
// IsendTyped/Wait and IrecvTyped/Wait took 1.5-1.9x the blocking calls'
// time at 4 KiB, and 1.0-1.45x once started lazily (docs/noncontig.md,
// "Nonblocking typed calls"). So a small request (at most lazyStartMax
// packed bytes) does not start its goroutine at once: it waits in the
// transport's deferred set, and the first of these runs it:
//
//   - Wait on it with a context that cannot end (context.Background):
//     the protocol runs in the caller's goroutine, which would only have
//     waited for the goroutine's result anyway (after starting every
//     other deferred request, whose progress this caller may need);
//   - any other wait in the transport (Wait with a context that can end,
//     WaitAny, a blocking call, Await), a Test or a Done on it: its
//     goroutine starts then;
//   - the progress goroutine, once the request has waited deferGrace (a
//     caller that posts and then computes gets its transfer going), and
//     before it sleeps on the worker's event fd; a request made while it
//     sleeps there starts at once, as a large one does.
//
// The order in which requests take their places (sequence numbers, RTS
// turns) is fixed by the calls, not by when their protocols start.

// lazyStartMax is the largest packed size whose nonblocking typed request
// starts lazily. Above it the transfer's own time dwarfs a goroutine start,
// and overlap (a transfer that progresses while the caller computes) is
// what matters.
const lazyStartMax = 64 << 10

// deferGrace is how long a deferred request waits for its caller's Wait
// before the progress goroutine starts it.
const deferGrace = 20 * time.Microsecond

// deferredRun is a nonblocking typed request's protocol, waiting to be run
// once, by whichever comes first (the comment above).
type deferredRun struct {
	r   *Request
	run func() (Status, error)
	at  time.Time // when the request was made
}

// deferredSet holds the deferred requests not started yet.
type deferredSet struct {
	mu      sync.Mutex
	pending map[*deferredRun]struct{}
	n       atomic.Int32 // len(pending), read without the lock
	// inline and started count the nonblocking typed requests run in
	// their Wait's goroutine and in goroutines of their own
	// (NoncontigStats).
	inline, started atomic.Int64
}

// startTyped runs a nonblocking typed request's protocol, now in a
// goroutine of its own or later (lazily) when bytes is small.
func (t *Transport) startTyped(r *Request, bytes int64, run func() (Status, error)) {
	d := &deferredRun{r: r, run: run}
	if bytes > lazyStartMax {
		t.deferred.started.Add(1)
		go t.runDeferred(d)
		return
	}
	d.at = time.Now()
	r.deferred = d // before d is published: whoever runs it completes r
	s := &t.deferred
	s.mu.Lock()
	if s.pending == nil {
		s.pending = make(map[*deferredRun]struct{})
	}
	s.pending[d] = struct{}{}
	s.n.Add(1)
	s.mu.Unlock()
	// The progress goroutine stores sleeping before it looks at the set
	// (loop): either it sees d, or d sees it asleep and starts now.
	if t.sleeping.Load() || t.stopping.Load() {
		t.startDeferred(d)
	}
}

// claim takes d out of the set; it reports false if another took it first.
func (s *deferredSet) claim(d *deferredRun) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	if _, ok := s.pending[d]; !ok {
		return false
	}
	delete(s.pending, d)
	s.n.Add(-1)
	return true
}

// runDeferred runs d's protocol in the calling goroutine and completes its
// request.
func (t *Transport) runDeferred(d *deferredRun) {
	st, err := d.run()
	t.ncComplete(d.r, st, err)
}

// startDeferred starts d's goroutine unless it was started already.
func (t *Transport) startDeferred(d *deferredRun) {
	if t.deferred.claim(d) {
		t.deferred.started.Add(1)
		go t.runDeferred(d)
	}
}

// flushDeferred starts the goroutines of the deferred requests other than
// except that have waited at least grace.
func (t *Transport) flushDeferred(except *deferredRun, grace time.Duration) {
	s := &t.deferred
	if s.n.Load() == 0 {
		return
	}
	var now time.Time
	if grace > 0 {
		now = time.Now()
	}
	var start []*deferredRun
	s.mu.Lock()
	for d := range s.pending {
		if d == except || (grace > 0 && now.Sub(d.at) < grace) {
			continue
		}
		delete(s.pending, d)
		start = append(start, d)
	}
	s.n.Add(int32(-len(start)))
	s.started.Add(int64(len(start)))
	s.mu.Unlock()
	for _, d := range start {
		go t.runDeferred(d)
	}
}

// waitDeferred is Wait's fast path for a deferred request: with a context
// that cannot end, it runs the protocol in the caller's goroutine, having
// started the other deferred requests first (the peer may need them to
// answer this one). It reports whether it did.
func (t *Transport) waitDeferred(r *Request, ctx context.Context) bool {
	d := r.deferred
	if d == nil || ctx.Done() != nil {
		return false
	}
	t.flushDeferred(d, 0)
	if !t.deferred.claim(d) {
		return false
	}
	t.deferred.inline.Add(1)
	t.runDeferred(d)
	return true
}
