package transport

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/troupe-hpc/troupe/overlap"
)

// prefetchStarted returns the prefetched message of tr's unexpected table,
// if there is one.
func prefetchStarted(tr *Transport) *ovMsg {
	tr.mu.Lock()
	defer tr.mu.Unlock()
	for _, m := range tr.ov.unexp {
		if m.mode == overlap.Prefetch {
			return m
		}
	}
	return nil
}

// TestCloseWithPrefetchInFlight: a receive matched to a message whose
// prefetch (a same-host read into the pool slot) is still running when
// its transport closes. Close failed the receive with ErrClosed, but the
// message kept it as its receive: when the read ended, the receive, long
// given back to its caller (a pooled one recycled), was queued for the
// copy out of the slot (OverlapTable().Copies stayed 1), and a progress
// pass taking that copy would have copied into the cleared buffer of a
// finished request (a slice-bounds panic on the progress goroutine, or a
// nil dereference for a recycled one). Now the message lets go of a
// receive Close failed.
func TestCloseWithPrefetchInFlight(t *testing.T) {
	const n = 32 << 20 // a read long enough to close beside
	for attempt := 0; attempt < 10; attempt++ {
		ctx := testCtx(t)
		pol := &recordingPolicy{slotSize: n}
		ts := localJobWith(t, 2, Options{Overlap: pol})
		if _, err := ts[0].Isend(1, 9, pattern(n, 1)); err != nil {
			t.Fatal(err)
		}
		var m *ovMsg
		for deadline := time.Now().Add(5 * time.Second); m == nil && time.Now().Before(deadline); {
			m = prefetchStarted(ts[1])
		}
		if m == nil {
			t.Fatal("the message was not prefetched")
		}
		rr, err := ts[1].Irecv(0, 9, make([]byte, n))
		if err != nil {
			t.Fatal(err)
		}
		ts[1].mu.Lock()
		inFlight := m.r == rr && !m.done
		ts[1].mu.Unlock()
		if !inFlight {
			t.Logf("attempt %d: the prefetch ended before the receive matched it", attempt)
			continue
		}
		if err := ts[1].Close(); err != nil {
			t.Fatal(err)
		}
		if _, err := rr.Wait(ctx); !errors.Is(err, ErrClosed) {
			t.Fatalf("Wait: %v, want ErrClosed", err)
		}
		for deadline := time.Now().Add(5 * time.Second); ; {
			ts[1].mu.Lock()
			done := m.done
			ts[1].mu.Unlock()
			if done {
				break
			}
			if time.Now().After(deadline) {
				t.Fatal("the prefetch never ended")
			}
			time.Sleep(time.Millisecond)
		}
		if tab := ts[1].OverlapTable(); tab.Copies != 0 {
			t.Fatalf("a receive Close failed is queued for a copy out of the slot (table %+v)", tab)
		}
		if _, err := rr.Wait(context.Background()); !errors.Is(err, ErrClosed) {
			t.Fatalf("the receive's result changed after Close: %v", err)
		}
		return
	}
	t.Skip("the prefetch always ended before the receive matched it (ten attempts)")
}
