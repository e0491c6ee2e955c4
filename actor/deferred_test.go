package actor

import (
	"bytes"
	"context"
	"runtime"
	"testing"
	"time"

	pa "github.com/asynkron/protoactor-go/actor"

	"github.com/troupe-hpc/troupe/transport"
)

// blobData is the i-th test payload: size bytes, different for every i.
func blobData(i, size int) []byte {
	b := make([]byte, size)
	for j := range b {
		b[j] = byte(i*31 + j*7)
	}
	return b
}

// checkEngineBooks fails unless the rank's overlap engine has forgotten
// every transfer (nothing outstanding, no pool slot held, no policy error).
func checkEngineBooks(t *testing.T, tr *transport.Transport) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for {
		s, ok := tr.OverlapStats()
		if !ok {
			t.Fatal("the overlap engine is off")
		}
		errs := tr.OverlapTable().PolicyErrors
		if s.Tracked == 0 && s.Outstanding == 0 && s.PoolInUse == 0 && errs == 0 {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("engine books not clean: tracked %d outstanding %d pool in use %d policy errors %d (%+v)",
				s.Tracked, s.Outstanding, s.PoolInUse, errs, s)
		}
		time.Sleep(time.Millisecond)
	}
}

// With the engine on, large payloads to an actor on its own goroutine go
// through the engine (prefetched or onloaded), arrive intact, in order, in
// the hook's buffers, and leave the engine's books clean.
func TestPayloadsThroughEngine(t *testing.T) {
	t.Setenv(transport.OverlapEnv, "on")
	rts := startLocal(t, 2)
	const n, size = 24, 96 << 10
	bufs := make([][]byte, n)
	next := 0
	seen := make(chan blob, n)
	hooked := &hookFunc{
		dst: func(in *Incoming) Payload {
			b := make(Payload, in.Size)
			bufs[next%n] = b
			next++
			return b
		},
		recv: func(c pa.Context) {
			if b, ok := c.Message().(*blob); ok {
				if b.Name == "slow" {
					time.Sleep(2 * time.Millisecond) // let later messages arrive while busy
				}
				seen <- *b
			}
		},
	}
	pid, err := rts[1].Root().SpawnNamed(rts[1].Props(func() pa.Actor { return hooked }), "engine")
	if err != nil {
		t.Fatal(err)
	}
	waitOwnGoroutine(t, rts[1], pid.Id)
	for i := 0; i < n; i++ {
		name := "fast"
		if i%4 == 0 {
			name = "slow"
		}
		if err := rts[0].Send(rts[0].PID(1, "engine"), &blob{Name: name, Data: blobData(i, size)}); err != nil {
			t.Fatal(err)
		}
	}
	for i := 0; i < n; i++ {
		select {
		case b := <-seen:
			if !bytes.Equal(b.Data, blobData(i, size)) {
				t.Fatalf("message %d: payload corrupted or out of order", i)
			}
			if &b.Data[0] != &bufs[i][0] {
				t.Fatalf("message %d: payload not in the hook's buffer", i)
			}
		case <-time.After(20 * time.Second):
			t.Fatalf("message %d never arrived", i)
		}
	}
	st := rts[1].Stats()
	if got := st.DataPrefetched.Load() + st.DataOnloaded.Load(); got != n {
		t.Fatalf("engine planned %d of %d rendezvous payloads (prefetched %d, onloaded %d)", got, n, st.DataPrefetched.Load(), st.DataOnloaded.Load())
	}
	s, _ := rts[1].Transport().OverlapStats()
	t.Logf("prefetched %d (useful %d, useless %d), onloaded %d", s.Prefetched, s.PrefetchUseful, s.PrefetchUseless, s.Onloaded)
	if s.Prefetched+s.Onloaded < n {
		t.Fatalf("engine counted %d prefetches and %d onloads for %d messages", s.Prefetched, s.Onloaded, n)
	}
	checkEngineBooks(t, rts[1].Transport())
}

// An actor on a synchronized dispatcher runs on the delivering goroutine:
// its large messages arrive complete, without the engine's deferral.
func TestPayloadsInlineActorNotDeferred(t *testing.T) {
	t.Setenv(transport.OverlapEnv, "on")
	rts := startLocal(t, 2)
	seen := make(chan blob, 4)
	props := rts[1].PropsFromFunc(func(c pa.Context) {
		if b, ok := c.Message().(*blob); ok {
			seen <- *b
		}
	}, pa.WithDispatcher(pa.NewSynchronizedDispatcher(300)))
	pid, err := rts[1].Root().SpawnNamed(props, "inline")
	if err != nil {
		t.Fatal(err)
	}
	for i := 0; i < 3; i++ {
		if err := rts[0].Send(rts[0].PID(1, "inline"), &blob{Name: "x", Data: blobData(i, 200<<10)}); err != nil {
			t.Fatal(err)
		}
		b := <-seen
		if !bytes.Equal(b.Data, blobData(i, 200<<10)) {
			t.Fatalf("message %d corrupted", i)
		}
	}
	if rts[1].ownGoroutine(pid.Id) {
		t.Fatal("an actor on a synchronized dispatcher was taken for one on its own goroutine")
	}
	if st := rts[1].Stats(); st.DataPrefetched.Load()+st.DataOnloaded.Load() != 0 {
		t.Fatalf("an inline actor's messages were deferred (prefetched %d, onloaded %d)", st.DataPrefetched.Load(), st.DataOnloaded.Load())
	}
	checkEngineBooks(t, rts[1].Transport())
}

// Messages still in the mailbox of an actor that stops are dropped with
// their data: the engine forgets them, they count as dead letters.
func TestDeferredDroppedWhenActorStops(t *testing.T) {
	t.Setenv(transport.OverlapEnv, "on")
	rts := startLocal(t, 2)
	block, blocked := make(chan struct{}), make(chan struct{})
	props := rts[1].PropsFromFunc(func(c pa.Context) {
		if b, ok := c.Message().(*blob); ok && b.Name == "block" {
			close(blocked)
			<-block
		}
	})
	pid, err := rts[1].Root().SpawnNamed(props, "stopper")
	if err != nil {
		t.Fatal(err)
	}
	waitOwnGoroutine(t, rts[1], pid.Id)
	target := rts[0].PID(1, "stopper")
	if err := rts[0].Send(target, &blob{Name: "block"}); err != nil {
		t.Fatal(err)
	}
	<-blocked
	const n = 12 // more than the prefetch pool's 8 slots: some are onloaded
	for i := 0; i < n; i++ {
		if err := rts[0].Send(target, &blob{Name: "late", Data: blobData(i, 128<<10)}); err != nil {
			t.Fatal(err)
		}
	}
	st := rts[1].Stats()
	deadline := time.Now().Add(10 * time.Second)
	for st.DataPrefetched.Load()+st.DataOnloaded.Load() < n {
		if time.Now().After(deadline) {
			t.Fatalf("only %d of %d messages planned", st.DataPrefetched.Load()+st.DataOnloaded.Load(), n)
		}
		time.Sleep(time.Millisecond)
	}
	if st.DataOnloaded.Load() == 0 {
		t.Fatalf("no message was onloaded (prefetched %d): the drop of onloaded data is not exercised", st.DataPrefetched.Load())
	}
	dead := st.DeadLetters.Load()
	stopped := rts[1].Root().StopFuture(pid)
	close(block)
	if err := stopped.Wait(); err != nil {
		t.Fatal(err)
	}
	for st.DeadLetters.Load() < dead+n {
		if time.Now().After(deadline) {
			t.Fatalf("%d dead letters after the stop, want %d", st.DeadLetters.Load()-dead, n)
		}
		time.Sleep(time.Millisecond)
	}
	checkEngineBooks(t, rts[1].Transport())
	s, _ := rts[1].Transport().OverlapStats()
	if s.OnloadDropped == 0 {
		t.Fatalf("no onloaded message was dropped in the engine: %+v", s)
	}
	// The sender is free: its sends completed although the data was
	// never received.
	if err := rts[0].Transport().Flush(t.Context(), 1); err != nil {
		t.Fatalf("flush after the drop: %v", err)
	}
}

// hookFunc is an actor made of a PostReceive function and a receive
// function.
type hookFunc struct {
	dst  func(*Incoming) Payload
	recv func(pa.Context)
}

func (h *hookFunc) PostReceive(in *Incoming) Payload { return h.dst(in) }
func (h *hookFunc) Receive(c pa.Context)             { h.recv(c) }

// waitOwnGoroutine waits until the runtime has learned that the actor runs
// on its own goroutine (at its Started).
func waitOwnGoroutine(t *testing.T, rt *Runtime, id string) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for !rt.ownGoroutine(id) {
		if time.Now().After(deadline) {
			t.Fatal("the runtime never learned that the actor runs on its own goroutine")
		}
		time.Sleep(time.Millisecond)
	}
}

// TestShutdownOnloadedData: with the overlap engine on, messages to a busy
// actor may be onloaded (their data stays at the sender until the actor
// takes them). Both ranks shut down while the actor is still busy; the
// sending rank closes its transport as soon as its Shutdown returns. Every
// message still arrives: Shutdown returns only once every rank's actors
// have stopped, having read that data. Before, the sender's Shutdown
// returned after the first barrier, and the data it withdrew by closing
// made the messages dead letters.
func TestShutdownOnloadedData(t *testing.T) {
	t.Setenv(transport.OverlapEnv, "on")
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	ts, stopT, err := transport.StartLocal(ctx, 2, transport.Options{})
	if err != nil {
		t.Fatal(err)
	}
	defer stopT()
	rts := runtimesOn(ctx, t, ts)
	block, blocked := make(chan struct{}), make(chan struct{})
	const n, size = 12, 128 << 10
	got := make(chan blob, n+1)
	pid, err := rts[1].Root().SpawnNamed(rts[1].PropsFromFunc(func(c pa.Context) {
		if b, ok := c.Message().(*blob); ok {
			if b.Name == "block" {
				close(blocked)
				<-block
				return
			}
			got <- *b
		}
	}), "busy")
	if err != nil {
		t.Fatal(err)
	}
	waitOwnGoroutine(t, rts[1], pid.Id)
	target := rts[0].PID(1, "busy")
	if err := rts[0].Send(target, &blob{Name: "block"}); err != nil {
		t.Fatal(err)
	}
	<-blocked
	for i := range n {
		if err := rts[0].Send(target, &blob{Name: "late", Data: blobData(i, size)}); err != nil {
			t.Fatal(err)
		}
	}
	st := rts[1].Stats()
	for st.DataPrefetched.Load()+st.DataOnloaded.Load() < n { // every header planned
		if ctx.Err() != nil {
			t.Fatal("the messages' headers were never planned")
		}
		runtime.Gosched()
	}
	done := make([]chan error, 2)
	for i := range rts {
		done[i] = make(chan error, 1)
		go func() { done[i] <- rts[i].Shutdown(ctx) }()
	}
	for !rts[0].closed.Load() || !rts[1].closed.Load() { // both shutting down
		runtime.Gosched()
	}
	close(block)
	if err := <-done[0]; err != nil {
		t.Logf("rank 0 Shutdown: %v", err)
	}
	if err := ts[0].Close(); err != nil { // as Shutdown does when it owns the transport
		t.Fatal(err)
	}
	if err := <-done[1]; err != nil {
		t.Logf("rank 1 Shutdown: %v", err)
	}
	close(got)
	i := 0
	for b := range got {
		if !bytes.Equal(b.Data, blobData(i, size)) {
			t.Fatalf("message %d damaged", i)
		}
		i++
	}
	if i != n {
		t.Fatalf("%d of %d messages sent before Shutdown reached the actor (prefetched %d, onloaded %d, dead letters on rank 1: %d)",
			i, n, st.DataPrefetched.Load(), st.DataOnloaded.Load(), st.DeadLetters.Load())
	}
	if st.DataOnloaded.Load() == 0 {
		t.Logf("no message was onloaded this time (prefetched %d): the case was not exercised", st.DataPrefetched.Load())
	}
}
