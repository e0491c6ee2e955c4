package transport

import (
	"bytes"
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
