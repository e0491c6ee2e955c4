package transport

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"
)

// TestRendezvousLostUnconnectedPeer: the bootstrapper reports rank 2 lost
// (bootstrap.LossNotifier) although rank 0 never connected to it, so no
// endpoint of rank 0's could fail. Rank 0's PeerLost subscribers get the
// event, sends to and receives from rank 2 fail at once with ErrPeerLost,
// a second report changes nothing, and rank 0 keeps talking to rank 1.
func TestRendezvousLostUnconnectedPeer(t *testing.T) {
	forModes(t, func(t *testing.T, mode ProgressMode) {
		ts := localJob(t, 3, mode)
		ctx := testCtx(t)
		lost := ts[0].PeerLost()
		ts[0].mu.Lock()
		unconnected := ts[0].peers[2] == nil
		ts[0].mu.Unlock()
		if !unconnected {
			t.Fatal("rank 0 already has a peer record for rank 2")
		}
		ts[0].rendezvousLost(2, "killed by the test")
		select {
		case ev := <-lost:
			if ev.Rank != 2 || !strings.Contains(ev.Reason, "rendezvous: killed by the test") {
				t.Fatalf("PeerLost event %+v, want rank 2 lost through the rendezvous", ev)
			}
		case <-time.After(10 * time.Second):
			t.Fatal("no PeerLost event")
		}
		var pl *PeerLostError
		if err := ts[0].Send(ctx, 2, 1, []byte{1}); !errors.As(err, &pl) || pl.Rank != 2 {
			t.Fatalf("send to the lost rank: %v, want a *PeerLostError for rank 2", err)
		}
		if _, err := ts[0].Recv(ctx, 2, 1, make([]byte, 1)); !errors.Is(err, ErrPeerLost) {
			t.Fatalf("receive from the lost rank: %v, want ErrPeerLost", err)
		}
		// A second report of the same rank changes nothing.
		ts[0].rendezvousLost(2, "again")
		select {
		case ev := <-lost:
			t.Fatalf("second PeerLost event %+v", ev)
		default:
		}
		done := make(chan error, 1)
		go func() {
			_, err := ts[1].Recv(ctx, 0, 2, make([]byte, 1))
			done <- err
		}()
		if err := ts[0].Send(ctx, 1, 2, []byte{1}); err != nil {
			t.Fatalf("send to rank 1: %v", err)
		}
		if err := <-done; err != nil {
			t.Fatalf("rank 1's receive: %v", err)
		}
	})
}

// TestRendezvousLostFailsPendingRecv: a receive from rank 2 pending at rank
// 1 fails with ErrPeerLost when the bootstrapper reports rank 2 lost (the
// progress goroutine may be asleep on the worker's event fd: it is woken).
func TestRendezvousLostFailsPendingRecv(t *testing.T) {
	forModes(t, func(t *testing.T, mode ProgressMode) {
		ts := localJob(t, 3, mode)
		ctx := testCtx(t)
		r, err := ts[1].Irecv(2, 3, make([]byte, 8))
		if err != nil {
			t.Fatal(err)
		}
		ts[1].rendezvousLost(2, "killed by the test")
		if _, err := r.Wait(ctx); !errors.Is(err, ErrPeerLost) {
			t.Fatalf("pending receive: %v, want ErrPeerLost", err)
		}
	})
}

// TestRendezvousLostWakesBlockedProbe: a Probe of a rank this one never
// connected to, parked until something arrives, returns ErrPeerLost when
// the bootstrapper reports that rank lost. The loss closes no endpoint and
// so queues no UCX event, and nothing woke the probe: it waited for its
// context although Iprobe already reported the loss (found by review).
func TestRendezvousLostWakesBlockedProbe(t *testing.T) {
	forModes(t, func(t *testing.T, mode ProgressMode) {
		ts := localJob(t, 3, mode)
		ctx, cancel := context.WithTimeout(testCtx(t), 5*time.Second)
		defer cancel()
		done := make(chan error, 1)
		go func() {
			_, err := ts[0].Probe(ctx, 2, 4)
			done <- err
		}()
		// Wait until the probe has stopped spinning and waits for an
		// arrival.
		for {
			ts[0].mu.Lock()
			parked := ts[0].arrival != nil
			ts[0].mu.Unlock()
			if parked {
				break
			}
			select {
			case err := <-done:
				t.Fatalf("probe returned before the loss: %v", err)
			case <-time.After(time.Millisecond):
			}
		}
		ts[0].rendezvousLost(2, "killed by the test")
		if err := <-done; !errors.Is(err, ErrPeerLost) {
			t.Fatalf("probe of the lost rank: %v, want ErrPeerLost", err)
		}
	})
}

// TestPeerLostFailsManyPendingRecvs: every one of many receives pending
// from a rank that is lost fails with ErrPeerLost. The loss cancels them
// all in UCX at once, and their cancellations arrive in more than one
// batch of events; the renumbering that followed the first batch took the
// receives whose cancellation was still queued for unmatched ones, posted
// them again with new numbers and dropped their cancellations, so they
// waited for ever (found by review).
func TestPeerLostFailsManyPendingRecvs(t *testing.T) {
	forModes(t, func(t *testing.T, mode ProgressMode) {
		ts := localJob(t, 3, mode)
		ctx, cancel := context.WithTimeout(testCtx(t), 10*time.Second)
		defer cancel()
		const n = 300 // more than one batch of events (128)
		reqs := make([]*Request, n)
		for i := range reqs {
			r, err := ts[1].Irecv(2, 3, make([]byte, 8))
			if err != nil {
				t.Fatal(err)
			}
			reqs[i] = r
		}
		ts[1].rendezvousLost(2, "killed by the test")
		stuck := 0
		for i, r := range reqs {
			if _, err := r.Wait(ctx); !errors.Is(err, ErrPeerLost) {
				if ctx.Err() == nil {
					t.Fatalf("receive %d: %v, want ErrPeerLost", i, err)
				}
				stuck++
			}
		}
		if stuck > 0 {
			t.Fatalf("%d of %d receives from the lost rank never completed", stuck, n)
		}
	})
}
