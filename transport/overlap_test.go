package transport

import (
	"bytes"
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
