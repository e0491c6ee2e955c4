package actor

import (
	"context"
	"errors"
	"runtime"
	"strconv"
	"sync/atomic"
	"testing"
	"time"

	pa "github.com/asynkron/protoactor-go/actor"

	"github.com/troupe-hpc/troupe/transport"
)

// A message whose Typed field a faulty peer announces and never sends
// (the envelope of the typed-transfer protocol, and no transfer) held
// Shutdown for good: it waited for the receiving goroutine without a
// bound. Shutdown's context now bounds that wait: when it ends, the
// receive is cancelled, the message is undeliverable, the messages queued
// behind it still reach their actor, and Shutdown returns a
// *ShutdownError counting the abandoned transfer.
func TestShutdownAbandonsTransferThatNeverComes(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	rts, stop, err := StartLocal(ctx, 2, Options{})
	if err != nil {
		t.Fatal(err)
	}
	pings := make(chan int, 4)
	if _, err := rts[0].Root().SpawnNamed(rts[0].PropsFromFunc(func(c pa.Context) {
		if p, ok := c.Message().(*ping); ok {
			pings <- p.N
		}
	}), "sink"); err != nil {
		stop()
		t.Fatal(err)
	}
	ct, _, err := lookupType(&face{})
	if err != nil {
		stop()
		t.Fatal(err)
	}
	body, _, err := appendBody(nil, ct, &face{Step: 1}, true)
	if err != nil {
		stop()
		t.Fatal(err)
	}
	// Rank 1 announces a Typed field of 4 KiB by the protocol and never
	// runs the transfer, then sends a ping that queues behind it.
	e := envelope{Flags: flagPointer | flagBodyHdr | flagTypedXfer | flagNoCredit, Source: 1, SenderRank: 1,
		Target: "sink", Type: ct.id, PayloadLen: 4096, Body: body}
	r, err := rts[1].Transport().SendAM(0, amActor, appendEnvelope(nil, &e), nil, transport.AMEager)
	if err != nil {
		stop()
		t.Fatal(err)
	}
	if _, err := r.Wait(ctx); err != nil {
		stop()
		t.Fatal(err)
	}
	if err := rts[1].Send(rts[1].PID(0, "sink"), &ping{N: 7}); err != nil {
		stop()
		t.Fatal(err)
	}
	for rts[0].Stats().Received.Load() < 2 { // both arrived
		if ctx.Err() != nil {
			stop()
			t.Fatal("rank 0 did not receive both messages")
		}
		runtime.Gosched()
	}
	select {
	case n := <-pings:
		stop()
		t.Fatalf("ping %d delivered before the message in front of it", n)
	default:
	}
	dead := rts[0].Stats().DeadLetters.Load()

	const bound = 2 * time.Second
	sctx, scancel := context.WithTimeout(context.Background(), bound)
	defer scancel()
	done := make([]chan error, len(rts))
	for i, rt := range rts {
		done[i] = make(chan error, 1)
		go func() { done[i] <- rt.Shutdown(sctx) }()
	}
	var shutErr error
	select {
	case shutErr = <-done[0]:
	case <-time.After(bound + 20*time.Second):
		// Not stop(): it would wait on the same Shutdown.
		t.Fatalf("rank 0's Shutdown still waits %v after its context ended", 20*time.Second)
	}
	<-done[1]
	stop()
	var se *ShutdownError
	if !errors.As(shutErr, &se) || se.Abandoned != 1 {
		t.Fatalf("rank 0's Shutdown: %v, want a *ShutdownError with 1 abandoned transfer", shutErr)
	}
	if !errors.Is(shutErr, context.DeadlineExceeded) {
		t.Fatalf("rank 0's Shutdown: %v, want it to wrap the context's error", shutErr)
	}
	select {
	case n := <-pings:
		if n != 7 {
			t.Fatalf("the sink got ping %d, want 7", n)
		}
	default:
		t.Fatal("the ping queued behind the abandoned message was lost")
	}
	if n := rts[0].Stats().DeadLetters.Load() - dead; n != 1 {
		t.Fatalf("%d dead letters at shutdown, want 1 (the abandoned message)", n)
	}
}

// mailboxOf returns the runtime's mailbox of local actor id, or nil.
func mailboxOf(rt *Runtime, id string) *mailbox {
	v, ok := rt.local.Load(id)
	if !ok {
		return nil
	}
	return v.(*localActor).run.mbox.Load()
}

// Shutdown poisoned every actor at once: a parent took its poison pill
// and stopped its children (protoactor's Stop, a system message, which
// overtakes their user messages), and the messages still queued in their
// mailboxes were dropped without a dead letter. Shutdown now poisons
// leaves first: the children process what their mailboxes hold and stop
// before their parent gets its poison pill.
func TestShutdownStopsChildrenFirst(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	rts, stop, err := StartLocal(ctx, 2, Options{})
	if err != nil {
		t.Fatal(err)
	}
	gate := make(chan struct{})
	var processed atomic.Int64
	child := rts[0].PropsFromFunc(func(c pa.Context) {
		if p, ok := c.Message().(*ping); ok {
			if p.N == 0 {
				<-gate // the rest queue up behind it
			}
			processed.Add(1)
		}
	})
	const children = 4
	spawned := make(chan error, children)
	if _, err := rts[0].Root().SpawnNamed(rts[0].PropsFromFunc(func(c pa.Context) {
		if _, ok := c.Message().(*pa.Started); ok {
			for i := range children {
				_, err := c.SpawnNamed(child, "child"+strconv.Itoa(i))
				spawned <- err
			}
		}
	}), "parent"); err != nil {
		stop()
		t.Fatal(err)
	}
	for range children {
		if err := <-spawned; err != nil {
			stop()
			t.Fatal(err)
		}
	}
	const n = 200 // per child
	mbs := make([]*mailbox, children)
	for i := range mbs {
		id := "parent/child" + strconv.Itoa(i)
		for j := range n {
			if err := rts[1].Send(rts[1].PID(0, id), &ping{N: j}); err != nil {
				stop()
				t.Fatal(err)
			}
		}
		if mbs[i] = mailboxOf(rts[0], id); mbs[i] == nil {
			stop()
			t.Fatalf("%s has no runtime mailbox", id)
		}
	}
	// posted waits until each child's mailbox has had want user messages
	// posted.
	posted := func(want int64) bool {
		for _, mb := range mbs {
			for mb.posted.Load() < want {
				if ctx.Err() != nil {
					return false
				}
				runtime.Gosched()
			}
		}
		return true
	}
	if !posted(n) { // every ping is in its child's mailbox
		stop()
		t.Fatal("the pings did not all reach the children's mailboxes")
	}
	done := make(chan error, len(rts))
	for _, rt := range rts {
		go func() { done <- rt.Shutdown(ctx) }()
	}
	// Each child's poison pill, queued behind its pings, lets them go on.
	if !posted(n + 1) {
		close(gate)
		stop()
		t.Fatal("the children never got their poison pills")
	}
	close(gate)
	for range rts {
		if err := <-done; err != nil {
			t.Error(err)
		}
	}
	stop()
	if got := processed.Load(); got != children*n {
		t.Fatalf("the children processed %d of the %d messages queued at Shutdown", got, children*n)
	}
}
