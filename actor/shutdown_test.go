package actor

import (
	"context"
	"errors"
	"runtime"
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
