package transport

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"testing"

	"github.com/troupe-hpc/troupe/datatype"
)

// smallVector is a typed layout under lazyStartMax (8 blocks of 64 B).
func smallVector(t *testing.T) *datatype.Type {
	t.Helper()
	vec, err := datatype.Vector(8, 8, 16, datatype.Float64)
	if err != nil {
		t.Fatal(err)
	}
	return vec
}

// nonblockingCount sums the nonblocking typed requests the ranks ran.
func nonblockingCount(ts []*Transport) (inline, started int64) {
	for _, tr := range ts {
		s := tr.NoncontigStats()
		inline += s.NonblockingInline
		started += s.NonblockingStarted
	}
	return inline, started
}

// Each rank posts a typed send to the other, then a typed receive from
// it, and waits for the receive first, with a context that cannot end:
// the receive runs in the waiting goroutine, and the send it has not
// waited for yet must run too (the Wait starts it; the progress goroutine
// would after deferGrace) for the peer's receive to finish. Every
// request is counted once, inline or started.
func TestTypedNonblockingCrossedWaits(t *testing.T) {
	forModes(t, func(t *testing.T, mode ProgressMode) {
		ts := localJob(t, 2, mode)
		ctx := testCtx(t)
		vec := smallVector(t)
		span := int(vec.Extent())
		const rounds = 20
		for round := 0; round < rounds; round++ {
			done := make(chan error, 2)
			got := [2][]byte{bytes.Repeat([]byte{0xee}, span), bytes.Repeat([]byte{0xee}, span)}
			for r := 0; r < 2; r++ {
				go func(r int) {
					done <- crossedWaits(ts[r], 1-r, pattern(span, 10*round+r), got[r], vec)
				}(r)
			}
			for range 2 {
				select {
				case err := <-done:
					if err != nil {
						t.Fatalf("round %d: %v", round, err)
					}
				case <-ctx.Done():
					t.Fatalf("round %d: the ranks wait for each other's sends (a Wait ran only its own request)", round)
				}
			}
			for r := 0; r < 2; r++ {
				if d := blockDiff(got[r], pattern(span, 10*round+1-r), 64, 128); d != "" {
					t.Fatalf("round %d, rank %d: %s", round, r, d)
				}
			}
		}
		inline, started := nonblockingCount(ts)
		if inline+started != 4*rounds {
			t.Fatalf("%d requests run inline and %d started, want %d in all", inline, started, 4*rounds)
		}
		t.Logf("%d of %d nonblocking typed requests ran in their Wait", inline, 4*rounds)
	})
}

// crossedWaits is one rank's part in TestTypedNonblockingCrossedWaits.
func crossedWaits(tr *Transport, peer int, src, dst []byte, vec *datatype.Type) error {
	s, err := tr.IsendTyped(peer, 5, src, vec, 1)
	if err != nil {
		return err
	}
	r, err := tr.IrecvTyped(peer, 5, dst, vec, 1)
	if err != nil {
		return err
	}
	if _, err := r.Wait(context.Background()); err != nil {
		return fmt.Errorf("receive: %w", err)
	}
	if _, err := s.Wait(context.Background()); err != nil {
		return fmt.Errorf("send: %w", err)
	}
	return nil
}

// A small nonblocking typed request nobody waits for still runs: the peer's
// blocking call completes while the rank that posted it makes no call.
func TestTypedNonblockingUnwaited(t *testing.T) {
	forModes(t, func(t *testing.T, mode ProgressMode) {
		ts := localJob(t, 2, mode)
		ctx := testCtx(t)
		vec := smallVector(t)
		span := int(vec.Extent())
		for round := 0; round < 5; round++ {
			want := pattern(span, round)
			s, err := ts[0].IsendTyped(1, 6, want, vec, 1)
			if err != nil {
				t.Fatal(err)
			}
			got := bytes.Repeat([]byte{0xee}, span)
			if _, err := ts[1].RecvTyped(ctx, 0, 6, got, vec, 1); err != nil {
				t.Fatalf("round %d: receive of a send nobody waits for: %v", round, err)
			}
			if d := blockDiff(got, want, 64, 128); d != "" {
				t.Fatalf("round %d: %s", round, d)
			}
			r, err := ts[1].IrecvTyped(0, 7, got, vec, 1)
			if err != nil {
				t.Fatal(err)
			}
			if err := ts[0].SendTyped(ctx, 1, 7, want, vec, 1); err != nil {
				t.Fatalf("round %d: send to a receive nobody waits for: %v", round, err)
			}
			if _, err := s.Wait(ctx); err != nil {
				t.Fatal(err)
			}
			if _, err := r.Wait(ctx); err != nil {
				t.Fatal(err)
			}
		}
	})
}

// A nonblocking typed request above lazyStartMax starts its goroutine in
// the call (overlap: it moves while the caller computes).
func TestTypedNonblockingLargeStartsAtOnce(t *testing.T) {
	ts := localJob(t, 2, ProgressDirect)
	ctx := testCtx(t)
	vec, err := datatype.Vector(2*lazyStartMax/64, 8, 16, datatype.Float64)
	if err != nil {
		t.Fatal(err)
	}
	span := int(vec.Extent())
	want := pattern(span, 3)
	r, err := ts[0].IsendTyped(1, 8, want, vec, 1)
	if err != nil {
		t.Fatal(err)
	}
	if s := ts[0].NoncontigStats(); s.NonblockingStarted != 1 {
		t.Fatalf("NonblockingStarted %d after a send of %d packed bytes, want 1", s.NonblockingStarted, 2*lazyStartMax)
	}
	got := bytes.Repeat([]byte{0xee}, span)
	if _, err := ts[1].RecvTyped(ctx, 0, 8, got, vec, 1); err != nil {
		t.Fatal(err)
	}
	if _, err := r.Wait(ctx); err != nil {
		t.Fatal(err)
	}
	if d := blockDiff(got, want, 64, 128); d != "" {
		t.Fatal(d)
	}
}

// Small nonblocking typed requests still waiting when their rank closes
// fail with ErrClosed, as started ones do: a receive nobody sends to, and
// a send nobody receives, neither of them waited for before Close.
func TestTypedNonblockingClose(t *testing.T) {
	forModes(t, func(t *testing.T, mode ProgressMode) {
		ctx := testCtx(t)
		ts, stop, err := StartLocal(ctx, 2, Options{Progress: mode})
		if err != nil {
			t.Fatal(err)
		}
		defer stop()
		vec := smallVector(t)
		span := int(vec.Extent())
		r, err := ts[0].IrecvTyped(1, 9, make([]byte, span), vec, 1)
		if err != nil {
			t.Fatal(err)
		}
		s, err := ts[0].IsendTyped(1, 10, pattern(span, 1), vec, 1)
		if err != nil {
			t.Fatal(err)
		}
		if err := ts[0].Close(); err != nil {
			t.Fatal(err)
		}
		for _, q := range []*Request{r, s} {
			select {
			case <-q.Done():
			case <-ctx.Done():
				t.Fatalf("%s still pending after Close", q.op)
			}
			if _, err := q.Wait(ctx); !errors.Is(err, ErrClosed) {
				t.Fatalf("%s after Close: %v, want ErrClosed", q.op, err)
			}
		}
	})
}

// Test and Done start a deferred request: once either has returned, the
// request is no longer waiting to be started (whoever started it), and it
// completes while the caller only polls or selects.
func TestTypedNonblockingTestAndDoneStart(t *testing.T) {
	ts := localJob(t, 2, ProgressDirect)
	ctx := testCtx(t)
	vec := smallVector(t)
	span := int(vec.Extent())
	for _, useDone := range []bool{false, true} {
		before := ts[0].NoncontigStats()
		s, err := ts[0].IsendTyped(1, 11, pattern(span, 4), vec, 1)
		if err != nil {
			t.Fatal(err)
		}
		var done <-chan struct{}
		finished := false
		if useDone {
			done = s.Done()
		} else {
			finished, _, _ = s.Test()
		}
		after := ts[0].NoncontigStats()
		if started := after.NonblockingStarted - before.NonblockingStarted; started != 1 || after.NonblockingInline != before.NonblockingInline {
			t.Fatalf("Done %v: %d started and %d run inline after the first call, want 1 started", useDone, started, after.NonblockingInline-before.NonblockingInline)
		}
		got := make(chan error, 1)
		go func() {
			_, err := ts[1].RecvTyped(ctx, 0, 11, make([]byte, span), vec, 1)
			got <- err
		}()
		for !finished {
			if useDone {
				select {
				case <-done:
					finished = true
				case <-ctx.Done():
					t.Fatal("Done never closed")
				}
				continue
			}
			if ctx.Err() != nil {
				t.Fatal("Test never reported completion")
			}
			finished, _, _ = s.Test()
		}
		if err := <-got; err != nil {
			t.Fatal(err)
		}
		if _, err := s.Wait(ctx); err != nil {
			t.Fatal(err)
		}
	}
}
