package actor

import (
	"time"

	pa "github.com/asynkron/protoactor-go/actor"
)

// workerIdle is how long a mailbox goroutine waits for another mailbox to
// run before it ends.
const workerIdle = time.Second

// poolDispatcher runs the mailboxes of the runtime's actors (Props) like
// protoactor's default dispatcher, a goroutine per scheduling, except that
// a goroutine whose mailbox ran dry waits a while to run the next one
// scheduled. A goroutine fresh from `go` starts on a small stack, and an
// actor that answers a remote sender (Respond, Send) needs more: the stack
// grew, and was copied, on every message that found its mailbox idle,
// which was most of the cost of a remote round trip on the receiving side.
// A waiting goroutine keeps its grown stack. As many goroutines run as
// mailboxes are scheduled at once, exactly as with `go`: a blocked actor
// never holds up another.
type poolDispatcher struct {
	throughput int
	handoff    chan func() // unbuffered: a send succeeds only to a waiting goroutine
	stop       <-chan struct{}
}

var _ pa.Dispatcher = (*poolDispatcher)(nil)

func newPoolDispatcher(throughput int, stop <-chan struct{}) *poolDispatcher {
	return &poolDispatcher{throughput: throughput, handoff: make(chan func()), stop: stop}
}

// Schedule runs fn on a waiting goroutine, or on a new one.
func (d *poolDispatcher) Schedule(fn func()) {
	select {
	case d.handoff <- fn:
	default:
		go d.work(fn)
	}
}

// Throughput is how many messages a mailbox processes before it yields.
func (d *poolDispatcher) Throughput() int { return d.throughput }

// work runs fn, then the mailboxes handed to it, until it has waited
// workerIdle for one or the runtime shuts down.
func (d *poolDispatcher) work(fn func()) {
	var idle *time.Timer
	for {
		fn()
		if idle == nil {
			idle = time.NewTimer(workerIdle)
		} else {
			idle.Reset(workerIdle)
		}
		select {
		case fn = <-d.handoff:
		case <-idle.C:
			return
		case <-d.stop:
			idle.Stop()
			return
		}
	}
}
