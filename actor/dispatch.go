package actor

import (
	"sync"
	"sync/atomic"
	"time"

	pa "github.com/asynkron/protoactor-go/actor"
)

// workerIdle is how long a mailbox goroutine beyond the first keepIdle
// idle ones stays waiting for another mailbox to run before it ends:
// between one and two workerIdle (a variable for the tests).
var workerIdle = time.Second

// keepIdle idle goroutines wait for work however long; those idle beyond
// them end after about workerIdle.
const keepIdle = 8

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
//
// Waiting goroutines sit in a stack (the most recently idle is handed the
// next mailbox: its stack is warm) and each waits on a channel of its own:
// a plain receive, where a select over a shared channel, a stop channel
// and a timer reset on every wait cost about a quarter of a local message
// (BenchmarkLocalPingPong). No waiting goroutine holds a timer: while more
// than keepIdle wait, one timer (trim) ends, every workerIdle, those at the
// bottom of the stack that no Schedule reached since the timer's last run
// (the stack's low-water mark says which), keeping keepIdle; the runtime's
// shutdown ends the others (close). Until 2026-11-24 each goroutine idle
// beyond keepIdle armed a timer of its own, and those were the most
// recently idle ones, the next to be handed work: a rank of more than
// keepIdle busy actors (Jacobi3D's 16 blocks a rank) reset a timer and
// selected on every message.
type poolDispatcher struct {
	throughput int

	mu       sync.Mutex
	idle     []*poolWorker // waiting, most recently idle last
	lowWater int           // the fewest idle since trim last ran: idle[:lowWater] waited all along
	trimming bool          // trim's timer is armed
	stopped  bool

	live atomic.Int32 // goroutines, running or waiting
}

// poolWorker is a waiting goroutine's mailbox slot: Schedule sends it the
// next mailbox to run, a nil func when it is to end.
type poolWorker struct {
	run chan func() // capacity 1: whoever pops the worker sends once
}

var _ pa.Dispatcher = (*poolDispatcher)(nil)

// newPoolDispatcher returns a dispatcher; close ends its goroutines.
func newPoolDispatcher(throughput int) *poolDispatcher {
	return &poolDispatcher{throughput: throughput}
}

// close ends the waiting goroutines, and each running one once its mailbox
// is done.
func (d *poolDispatcher) close() {
	d.mu.Lock()
	d.stopped = true
	idle := d.idle
	d.idle = nil
	d.mu.Unlock()
	for _, w := range idle {
		w.run <- nil
	}
}

// Schedule runs fn on a waiting goroutine, or on a new one.
func (d *poolDispatcher) Schedule(fn func()) {
	d.mu.Lock()
	if n := len(d.idle); n > 0 {
		w := d.idle[n-1]
		d.idle[n-1] = nil
		d.idle = d.idle[:n-1]
		d.lowWater = min(d.lowWater, n-1)
		d.mu.Unlock()
		w.run <- fn
		return
	}
	d.mu.Unlock()
	go d.work(fn)
}

// Throughput is how many messages a mailbox processes before it yields.
func (d *poolDispatcher) Throughput() int { return d.throughput }

// work runs fn, then the mailboxes handed to it, until the runtime shuts
// down or trim ends it (it waited at the bottom of a stack of more than
// keepIdle for a whole workerIdle).
func (d *poolDispatcher) work(fn func()) {
	d.live.Add(1)
	defer d.live.Add(-1)
	w := &poolWorker{run: make(chan func(), 1)}
	for fn != nil {
		fn()
		fn = d.wait(w)
	}
}

// wait puts w on the idle stack and returns the next mailbox handed to it,
// or nil when the goroutine is to end.
func (d *poolDispatcher) wait(w *poolWorker) func() {
	d.mu.Lock()
	if d.stopped {
		d.mu.Unlock()
		return nil
	}
	d.idle = append(d.idle, w)
	if len(d.idle) > keepIdle && !d.trimming {
		d.trimming = true
		d.lowWater = len(d.idle)
		time.AfterFunc(workerIdle, d.trim)
	}
	d.mu.Unlock()
	return <-w.run
}

// trim ends the idle goroutines beyond keepIdle that waited since its last
// run (or since it was armed), oldest first, and runs again in workerIdle
// while more than keepIdle wait.
func (d *poolDispatcher) trim() {
	d.mu.Lock()
	var ended []*poolWorker
	if n := min(d.lowWater, len(d.idle)-keepIdle); n > 0 && !d.stopped {
		ended = append(ended, d.idle[:n]...)
		rest := copy(d.idle, d.idle[n:])
		clear(d.idle[rest:])
		d.idle = d.idle[:rest]
	}
	d.lowWater = len(d.idle)
	d.trimming = len(d.idle) > keepIdle && !d.stopped
	if d.trimming {
		time.AfterFunc(workerIdle, d.trim)
	}
	d.mu.Unlock()
	for _, w := range ended {
		w.run <- nil
	}
}
