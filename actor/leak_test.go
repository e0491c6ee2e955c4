package actor

import (
	"context"
	"testing"
	"time"

	pa "github.com/asynkron/protoactor-go/actor"
	"go.uber.org/goleak"
)

// TestLeakShutdown runs a 3-rank job in this process with traffic of every
// kind (sends, requests, a rendezvous payload, a remote watch, a request to
// a missing actor that ends in dead letters), shuts it down, and requires
// that no goroutine started since is left: the runtimes' own (peer
// watchers, rendezvous receivers), the transports' progress goroutines and
// protoactor's actors all end with Shutdown.
//
// goleak.IgnoreCurrent leaves out goroutines of earlier tests. The only
// goroutines protoactor-go leaves behind are its dead-letter log
// throttle's: the first dead letter of each interval starts a goroutine
// that waits on a ticker for DeadLetterThrottleInterval (1 s by default)
// and then ends on its own; ActorSystem.Shutdown has no way to stop it.
// Exactly that function is ignored (its name as the compiler inlines it
// into NewDeadLetter, and as it reads without inlining).
func TestLeakShutdown(t *testing.T) {
	opts := []goleak.Option{
		goleak.IgnoreCurrent(),
		goleak.IgnoreTopFunction("github.com/asynkron/protoactor-go/actor.NewDeadLetter.NewThrottle.func4.1"),
		goleak.IgnoreTopFunction("github.com/asynkron/protoactor-go/actor.NewThrottle.func1.1"),
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	rts, stop, err := StartLocal(ctx, 3, Options{})
	if err != nil {
		t.Fatal(err)
	}
	stopped := false
	defer func() {
		if !stopped {
			stop()
		}
	}()
	for _, rt := range rts {
		if _, err := rt.Root().SpawnNamed(echoProps(rt), "echo"); err != nil {
			t.Fatal(err)
		}
	}
	for i, rt := range rts {
		peer := (i + 1) % len(rts)
		res, err := rt.Request(rt.PID(peer, "echo"), &ping{N: i, Text: string(make([]byte, 256<<10))}, 10*time.Second)
		if err != nil || res.(*pong).N != i+1 {
			t.Fatalf("rank %d: request: %v %v", i, res, err)
		}
		f, err := rt.RequestFuture(rt.PID(peer, "echo"), &ping{N: i}, 10*time.Second)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := Result(f); err != nil {
			t.Fatal(err)
		}
		if _, err := rt.Request(rt.PID(peer, "nobody"), &ping{}, 10*time.Second); err == nil {
			t.Fatal("request to a missing actor succeeded")
		}
		if err := rt.Send(rt.PID(peer, "echo"), &propMsg{Data: make(Payload, 1<<20)}); err != nil {
			t.Fatal(err)
		}
	}
	// A remote watch, and the watched actor stopped from its watcher's rank.
	term := make(chan *pa.Terminated, 1)
	w, err := rts[0].Root().SpawnNamed(rts[0].PropsFromFunc(func(c pa.Context) {
		switch m := c.Message().(type) {
		case *pa.PID:
			c.Watch(m)
			c.Respond(true) // the Watch is on its way to m's rank
		case *pa.Terminated:
			term <- m
		}
	}), "watcher")
	if err != nil {
		t.Fatal(err)
	}
	target := rts[0].PID(2, "echo")
	// Once the watcher has answered, its Watch was sent; the request behind
	// it on the same pair of ranks arrives after it, so the watch is there.
	if _, err := rts[0].Root().RequestFuture(w, target, 10*time.Second).Result(); err != nil {
		t.Fatal(err)
	}
	if _, err := rts[0].Request(target, &ping{}, 10*time.Second); err != nil {
		t.Fatal(err)
	}
	rts[0].Root().Stop(target)
	select {
	case m := <-term:
		if m.Who.Id != "echo" || m.Why != pa.TerminatedReason_Stopped {
			t.Fatalf("Terminated %v", m)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("no Terminated for the stopped remote actor")
	}

	stop()
	stopped = true
	for i, rt := range rts {
		if err := rt.Send(rt.PID((i+1)%len(rts), "echo"), &ping{}); err != ErrClosed {
			t.Errorf("rank %d: send after Shutdown: %v, want ErrClosed", i, err)
		}
	}
	goleak.VerifyNone(t, opts...)
}
