package transport

import (
	"bytes"
	"context"
	"errors"
	"runtime"
	"sync"
	"testing"
	"time"

	"github.com/troupe-hpc/troupe/overlap"
)

// onloadPolicy onloads every transfer and never prefetches: the receiver's
// next call into the transport must start every large transfer. It keeps
// no state, so the ranks of one process may share it.
type onloadPolicy struct{}

func (onloadPolicy) Step(ev overlap.Event) (overlap.Decision, error) {
	if ev.Kind == overlap.HeaderArrived || ev.Kind == overlap.RecvPosted {
		return overlap.Decision{Action: overlap.Onload, ID: ev.ID, Slot: overlap.NoSlot}, nil
	}
	return overlap.Decision{Action: overlap.None, ID: ev.ID, Slot: overlap.NoSlot}, nil
}

func (onloadPolicy) Config() overlap.Config {
	c := overlap.DefaultConfig()
	c.PoolSlots = 0
	return c
}

func (onloadPolicy) SetCost(float64, time.Duration) error { return nil }
func (onloadPolicy) Stats() overlap.Stats                 { return overlap.Stats{} }

// TestOverlapTestPolling: a receiver that polls Request.Test (never Wait)
// counts as entering the transport, in direct and in queue progress mode,
// so the transfers the policy onloaded start and complete. In queue mode
// Test cannot touch the worker; it asks the progress goroutine to.
func TestOverlapTestPolling(t *testing.T) {
	for _, mode := range []ProgressMode{ProgressDirect, ProgressQueue} {
		t.Run(mode.String(), func(t *testing.T) {
			ctx := testCtx(t)
			ts, stop, err := StartLocal(ctx, 2, Options{Progress: mode, Overlap: onloadPolicy{}})
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(stop)
			for i, n := range []int{64 << 10, 1 << 20, 100} {
				want := pattern(n, i)
				got := make([]byte, n)
				rr, err := ts[1].Irecv(0, 4, got)
				if err != nil {
					t.Fatal(err)
				}
				sr, err := ts[0].Isend(1, 4, want)
				if err != nil {
					t.Fatal(err)
				}
				for deadline := time.Now().Add(5 * time.Second); ; {
					done, _, err := rr.Test()
					if err != nil {
						t.Fatalf("%d B: %v", n, err)
					}
					if done {
						break
					}
					if time.Now().After(deadline) {
						t.Fatalf("%d B: a receiver polling Test never got its onloaded message (table %+v)", n, ts[1].OverlapTable())
					}
					time.Sleep(50 * time.Microsecond)
				}
				if _, err := sr.Wait(ctx); err != nil {
					t.Fatalf("%d B send: %v", n, err)
				}
				if !bytes.Equal(got, want) {
					t.Fatalf("%d B: data differs", n)
				}
			}
			if tab := ts[1].OverlapTable(); tab != (OverlapTable{}) {
				t.Fatalf("engine tables not empty: %+v", tab)
			}
		})
	}
}

// recordingPolicy prefetches unexpected messages of at least the threshold
// (and at most slotSize, if set) into its one slot, of slotSize bytes or
// the default size, while the slot is free, onloads the rest, and counts
// the Progress events it is given. Mutex-guarded: the ranks of one process
// share it.
type recordingPolicy struct {
	mu       sync.Mutex
	slotSize int64 // 0: the default
	progress int
	inUse    int
}

func (p *recordingPolicy) Step(ev overlap.Event) (overlap.Decision, error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	d := overlap.Decision{Action: overlap.None, ID: ev.ID, Slot: overlap.NoSlot}
	switch ev.Kind {
	case overlap.Progress:
		p.progress++
	case overlap.RecvPosted:
		d.Action = overlap.Onload
	case overlap.HeaderArrived:
		d.Action = overlap.Onload
		if !ev.Expected && ev.Size >= overlap.DefaultConfig().RendezvousThreshold && (p.slotSize == 0 || ev.Size <= p.slotSize) && p.inUse == 0 {
			p.inUse++
			d.Action, d.Slot = overlap.Prefetch, 0
		}
	case overlap.PrefetchConsumed, overlap.PrefetchDropped:
		p.inUse--
	}
	return d, nil
}

func (p *recordingPolicy) Config() overlap.Config {
	c := overlap.DefaultConfig()
	c.PoolSlots = 1
	if p.slotSize > 0 {
		c.SlotSize, c.MaxPrefetchSize = p.slotSize, p.slotSize
	}
	return c
}

func (p *recordingPolicy) SetCost(float64, time.Duration) error { return nil }

func (p *recordingPolicy) Stats() overlap.Stats {
	p.mu.Lock()
	defer p.mu.Unlock()
	return overlap.Stats{PoolInUse: p.inUse}
}

func (p *recordingPolicy) progressEvents() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.progress
}

// TestOverlapSmallMessagesAndPrefetchHold: a ping-pong of small messages
// gives the engine no Progress events (nothing in its table would read
// them, and each costs a clock read on the latency path); a prefetched
// message raises prefetchHeld, which keeps the progress goroutine polling,
// until its receive consumes it.
func TestOverlapSmallMessagesAndPrefetchHold(t *testing.T) {
	ctx := testCtx(t)
	pol := &recordingPolicy{}
	ts := localJobWith(t, 2, Options{Overlap: pol})
	small := make([]byte, 8)
	for i := 0; i < 200; i++ {
		me := i % 2
		if err := ts[me].Send(ctx, 1-me, 3, small); err != nil {
			t.Fatal(err)
		}
		if _, err := ts[1-me].Recv(ctx, me, 3, small); err != nil {
			t.Fatal(err)
		}
	}
	if n := pol.progressEvents(); n != 0 {
		t.Fatalf("small messages gave the engine %d Progress events, want 0", n)
	}

	n := int(pol.Config().RendezvousThreshold) * 2
	want := pattern(n, 7)
	sr, err := ts[0].Isend(1, 5, want)
	if err != nil {
		t.Fatal(err)
	}
	for deadline := time.Now().Add(5 * time.Second); !ts[1].prefetchHeld.Load(); {
		if time.Now().After(deadline) {
			t.Fatalf("the unexpected %d B message was never prefetched (table %+v)", n, ts[1].OverlapTable())
		}
		time.Sleep(50 * time.Microsecond)
	}
	got := make([]byte, n)
	if _, err := ts[1].Recv(ctx, 0, 5, got); err != nil {
		t.Fatal(err)
	}
	if _, err := sr.Wait(ctx); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(got, want) {
		t.Fatal("prefetched message delivered wrong bytes")
	}
	if ts[1].prefetchHeld.Load() {
		t.Fatalf("prefetchHeld still set after the prefetched message was received (pool in use %d)", pol.Stats().PoolInUse)
	}
}

// waitTable waits (no sleeping) until cond holds for rank t's engine
// tables, or fails the test after ten seconds.
func waitTable(t *testing.T, tr *Transport, what string, cond func(OverlapTable) bool) {
	t.Helper()
	for deadline := time.Now().Add(10 * time.Second); !cond(tr.OverlapTable()); {
		if time.Now().After(deadline) {
			t.Fatalf("waiting for %s: tables %+v", what, tr.OverlapTable())
		}
		runtime.Gosched()
	}
}

// TestOverlapPeerLostGivesSequenceBack: with the engine on, a receive that
// waited in the engine's table and failed because its peer was reported
// lost gives its sequence number back, as a receive UCX held does with the
// engine off: a message the rank had sent before is the next receive's.
// It stayed in the table for good, and that receive failed with
// ErrPeerLost.
func TestOverlapPeerLostGivesSequenceBack(t *testing.T) {
	t.Setenv("TROUPE_CMA", "off")
	for _, engine := range []string{"off", "on"} {
		t.Run("engine-"+engine, func(t *testing.T) {
			t.Setenv(OverlapEnv, engine)
			ts := localJob(t, 3, ProgressDirect)
			ctx := testCtx(t)
			const tag, n = 3, 20 << 10
			ra, err := ts[0].Irecv(1, tag, make([]byte, n)) // engine on: in its table
			if err != nil {
				t.Fatal(err)
			}
			ts[0].rendezvousLost(1, "reported lost by the test")
			if _, err := ra.Wait(ctx); !errors.Is(err, ErrPeerLost) {
				t.Fatalf("receive from the rank reported lost: %v, want ErrPeerLost", err)
			}
			want := matchPayload(1, tag, 0, 100)
			if err := ts[1].Send(ctx, 0, tag, want); err != nil { // sent before it "died"
				t.Fatal(err)
			}
			for deadline := time.Now().Add(10 * time.Second); ; runtime.Gosched() {
				if _, ok, _ := ts[0].Iprobe(1, tag); ok || ts[0].OverlapTable().Unexpected > 0 {
					break
				}
				if time.Now().After(deadline) {
					t.Fatal("the message never arrived")
				}
			}
			got := make([]byte, n)
			st, err := ts[0].Recv(ctx, 1, tag, got)
			if err != nil || !bytes.Equal(got[:st.Size], want) {
				t.Fatalf("receive of the message sent before the loss: %+v %v", st, err)
			}
			if tab := ts[0].OverlapTable(); tab.Unexpected != 0 || tab.Posted != 0 {
				t.Fatalf("engine tables after: %+v", tab)
			}
		})
	}
}

// TestOverlapHeldHeaderBeforeAnySource: an any-source receive posted while
// an exact receive of its tag holds its message's header (onloaded) is not
// handed to UCX with the source masked: if the exact receive is then
// cancelled, the header goes back to the unexpected table and is the
// any-source receive's, as MPI's order asks. Before, the masked receive in
// UCX took the sender's next message and the owed one went to a later
// receive.
func TestOverlapHeldHeaderBeforeAnySource(t *testing.T) {
	t.Setenv("TROUPE_CMA", "off")
	ts := localJobWith(t, 3, Options{Overlap: onloadPolicy{}})
	ctx := testCtx(t)
	const n, tag = 64 << 10, 4
	r1, err := ts[0].Irecv(1, tag, make([]byte, n))
	if err != nil {
		t.Fatal(err)
	}
	s0, err := ts[1].Isend(0, tag, matchPayload(1, tag, 0, n))
	if err != nil {
		t.Fatal(err)
	}
	waitTable(t, ts[0], "the header to be held", func(s OverlapTable) bool { return s.Held == 1 })
	b2 := make([]byte, n)
	r2, err := ts[0].Irecv(AnySource, tag, b2)
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan struct{})
	ts[0].exec(func() { ts[0].cancelRecv(r1, context.Canceled); close(done) }) // what Wait does when its ctx ends
	<-done
	if _, err := r1.Wait(ctx); !errors.Is(err, context.Canceled) {
		t.Fatalf("the cancelled receive: %v", err)
	}
	s1, err := ts[1].Isend(0, tag, matchPayload(1, tag, 1, n))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := r2.Wait(ctx); err != nil {
		t.Fatal(err)
	}
	b3 := make([]byte, n)
	if _, err := ts[0].Recv(ctx, 1, tag, b3); err != nil {
		t.Fatal(err)
	}
	for _, s := range []*Request{s0, s1} {
		if _, err := s.Wait(ctx); err != nil {
			t.Fatal(err)
		}
	}
	if !bytes.Equal(b2, matchPayload(1, tag, 0, n)) || !bytes.Equal(b3, matchPayload(1, tag, 1, n)) {
		t.Fatalf("out of order: the any-source receive got message %d, the next receive %d; want 0 and 1", b2[2], b3[2])
	}
}
