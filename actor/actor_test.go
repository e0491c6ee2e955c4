package actor

import (
	"context"
	"errors"
	"testing"
	"time"

	pa "github.com/asynkron/protoactor-go/actor"
)

type ping struct {
	N    int
	Text string
}

type pong struct{ N int }

type unregistered struct{ X int }

func init() {
	MustRegister[ping]()
	MustRegister[pong]()
}

func startLocal(t testing.TB, n int) []*Runtime {
	t.Helper()
	return startLocalWith(t, n, Options{})
}

func startLocalWith(t testing.TB, n int, o Options) []*Runtime {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	rts, stop, err := StartLocal(ctx, n, o)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(stop)
	return rts
}

func echoProps(rt *Runtime) *pa.Props {
	return rt.PropsFromFunc(func(c pa.Context) {
		if p, ok := c.Message().(*ping); ok {
			c.Respond(&pong{N: p.N + 1})
		}
	})
}

func TestRequestAcrossRanks(t *testing.T) {
	rts := startLocal(t, 3)
	pid, err := rts[1].System().Root.SpawnNamed(echoProps(rts[1]), "echo")
	if err != nil {
		t.Fatal(err)
	}
	remote := rts[0].PID(1, pid.Id)
	for i := 0; i < 100; i++ {
		res, err := rts[0].Request(remote, &ping{N: i}, 5*time.Second)
		if err != nil {
			t.Fatalf("request %d: %v", i, err)
		}
		if p, ok := res.(*pong); !ok || p.N != i+1 {
			t.Fatalf("request %d: got %#v", i, res)
		}
	}
	// protoactor's own API goes through the resolver too.
	res, err := rts[2].Root().RequestFuture(remote, &ping{N: 41}, 5*time.Second).Result()
	if err != nil || res.(*pong).N != 42 {
		t.Fatalf("protoactor request: %v %v", res, err)
	}
}

// TestRequestAnsweredFromOwnRank: rank 1's actor forwards rank 0's request
// to an actor on rank 0, which answers it there; the answer reaches the
// Request although its reply id is not in the process registry.
func TestRequestAnsweredFromOwnRank(t *testing.T) {
	rts := startLocal(t, 2)
	local, err := rts[0].System().Root.SpawnNamed(echoProps(rts[0]), "echo0")
	if err != nil {
		t.Fatal(err)
	}
	back := rts[0].PID(0, local.Id)
	fwd, err := rts[1].System().Root.SpawnNamed(rts[1].PropsFromFunc(func(c pa.Context) {
		if _, ok := c.Message().(*ping); ok {
			c.Forward(back)
		}
	}), "forward")
	if err != nil {
		t.Fatal(err)
	}
	for i := 0; i < 3; i++ {
		res, err := rts[0].Request(rts[0].PID(1, fwd.Id), &ping{N: 10 * i}, 5*time.Second)
		if err != nil {
			t.Fatalf("request %d: %v", i, err)
		}
		if p, ok := res.(*pong); !ok || p.N != 10*i+1 {
			t.Fatalf("request %d: got %#v, want pong %d", i, res, 10*i+1)
		}
	}
	if n := rts[0].nreqs.Load(); n != 0 {
		t.Fatalf("%d requests still tracked", n)
	}
}

// TestRequestTimeoutLateReply times a request out, then lets its answer
// arrive: the late answer is a dead letter, the request table is empty, and
// the next request gets its own answer.
func TestRequestTimeoutLateReply(t *testing.T) {
	rts := startLocal(t, 2)
	release := make(chan struct{})
	slow := rts[1].PropsFromFunc(func(c pa.Context) {
		if p, ok := c.Message().(*ping); ok {
			if p.N == 0 {
				<-release
			}
			c.Respond(&pong{N: p.N + 1})
		}
	})
	pid, err := rts[1].System().Root.SpawnNamed(slow, "slow")
	if err != nil {
		t.Fatal(err)
	}
	remote := rts[0].PID(1, pid.Id)
	if _, err := rts[0].Request(remote, &ping{N: 0}, 20*time.Millisecond); !errors.Is(err, pa.ErrTimeout) {
		t.Fatalf("request to a stalled actor: %v, want a timeout", err)
	}
	if n := rts[0].nreqs.Load(); n != 0 {
		t.Fatalf("%d requests still tracked after the timeout", n)
	}
	dead := rts[0].Stats().DeadLetters.Load()
	close(release)
	res, err := rts[0].Request(remote, &ping{N: 5}, 5*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	if p, ok := res.(*pong); !ok || p.N != 6 {
		t.Fatalf("request after the late answer got %#v, want pong 6", res)
	}
	// The late answer (pong 1) came before pong 6: it was a dead letter.
	if got := rts[0].Stats().DeadLetters.Load(); got != dead+1 {
		t.Fatalf("dead letters went from %d to %d, want one more (the late answer)", dead, got)
	}
	if n := rts[0].nreqs.Load(); n != 0 {
		t.Fatalf("%d requests still tracked", n)
	}
}

func TestUnknownActorAndUnregisteredType(t *testing.T) {
	rts := startLocal(t, 2)
	start := time.Now()
	_, err := rts[0].Request(rts[0].PID(1, "nobody"), &ping{}, 10*time.Second)
	if !errors.Is(err, ErrNoActor) {
		t.Fatalf("request to a missing actor: %v", err)
	}
	if d := time.Since(start); d > 5*time.Second {
		t.Fatalf("missing actor answered after %v, want at once", d)
	}
	err = rts[0].Send(rts[0].PID(1, "nobody"), &unregistered{X: 1})
	if !errors.Is(err, ErrUnregistered) {
		t.Fatalf("unregistered type: %v", err)
	}
}

func TestSendOrder(t *testing.T) {
	rts := startLocal(t, 2)
	const n = 5000
	done := make(chan error, 1)
	next := 0
	_, err := rts[1].Root().SpawnNamed(rts[1].PropsFromFunc(func(c pa.Context) {
		p, ok := c.Message().(*ping)
		if !ok {
			return
		}
		if p.N != next {
			done <- errors.New("out of order")
			return
		}
		next++
		if next == n {
			done <- nil
		}
	}), "sink")
	if err != nil {
		t.Fatal(err)
	}
	sink := rts[0].PID(1, "sink")
	for i := 0; i < n; i++ {
		// Mix small and large (rendezvous) bodies: order must hold anyway.
		msg := &ping{N: i}
		if i%500 == 7 {
			msg.Text = string(make([]byte, 256<<10))
		}
		if err := rts[0].Send(sink, msg); err != nil {
			t.Fatal(err)
		}
	}
	select {
	case err := <-done:
		if err != nil {
			t.Fatal(err)
		}
	case <-time.After(30 * time.Second):
		t.Fatalf("only %d of %d messages arrived", next, n)
	}
}

// TestTargetCacheAcrossStopAndRespawn: deliveries cache the target's
// process; once the actor stops, requests to its name get ErrNoActor (not
// a dead mailbox), and a new actor spawned under the name gets them.
func TestTargetCacheAcrossStopAndRespawn(t *testing.T) {
	rts := startLocal(t, 2)
	pid, err := rts[1].System().Root.SpawnNamed(echoProps(rts[1]), "echo")
	if err != nil {
		t.Fatal(err)
	}
	remote := rts[0].PID(1, "echo")
	for i := 0; i < 10; i++ { // cached by now
		if _, err := rts[0].Request(remote, &ping{N: i}, 5*time.Second); err != nil {
			t.Fatal(err)
		}
	}
	if err := rts[1].System().Root.StopFuture(pid).Wait(); err != nil {
		t.Fatal(err)
	}
	if _, err := rts[0].Request(remote, &ping{}, 5*time.Second); !errors.Is(err, ErrNoActor) {
		t.Fatalf("request to the stopped actor: %v, want ErrNoActor", err)
	}
	if _, err := rts[1].System().Root.SpawnNamed(rts[1].PropsFromFunc(func(c pa.Context) {
		if p, ok := c.Message().(*ping); ok {
			c.Respond(&pong{N: p.N + 100})
		}
	}), "echo"); err != nil {
		t.Fatal(err)
	}
	res, err := rts[0].Request(remote, &ping{N: 1}, 5*time.Second)
	if err != nil || res.(*pong).N != 101 {
		t.Fatalf("request to the new actor: %v %v", res, err)
	}
}
