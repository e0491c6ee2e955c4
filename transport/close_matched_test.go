package transport

import (
	"context"
	"errors"
	"testing"

	"github.com/troupe-hpc/troupe/transport/ucx"
)

// TestCloseMatchedRendezvousRecv: a receive that has matched a rendezvous
// send but not finished it when its transport closes. Rank 0 sends 1 MiB
// and closes (discarding its send); rank 1 then posts the receive, which
// matches the message already announced, and closes with it in flight.
// Cancel cannot take a matched receive back, and its protocol state hung
// on the endpoint to rank 0: Close flushed that endpoint instead of forcing
// it, and destroying the worker aborted the process (ucp_ep_destroy_base:
// "Assertion ucs_hlist_is_empty(proto_reqs)", found 2026-12-06 when a
// queue test failed with transfers outstanding). Now Close returns, and the
// receive ends with ErrClosed, or with its data where it finished first.
func TestCloseMatchedRendezvousRecv(t *testing.T) {
	for _, tls := range []string{"tcp", "shm,tcp"} {
		t.Run(tls, func(t *testing.T) {
			t.Setenv("UCX_TLS", tls)
			t.Setenv("TROUPE_CMA", "off") // the rendezvous is UCX's, not troupe's own CMA protocol
			inFlight := 0
			for round := 0; round < 8; round++ {
				ts := localJob(t, 2, ProgressDirect)
				ctx := testCtx(t)
				if err := exchange(ctx, ts[1], ts[0]); err != nil { // rank 1's endpoint to rank 0 is up
					t.Fatal(err)
				}
				const n = 1 << 20
				want := pattern(n, round)
				s, err := ts[0].Isend(1, 7, want)
				if err != nil {
					t.Fatal(err)
				}
				if _, err := ts[1].Probe(ctx, 0, 7); err != nil { // the announcement has arrived
					t.Fatal(err)
				}
				if err := ts[0].Close(); err != nil {
					t.Fatalf("rank 0's Close: %v", err)
				}
				if _, err := s.Wait(ctx); err != nil && !errors.Is(err, ErrClosed) {
					t.Fatalf("rank 0's send: %v, want nil or ErrClosed", err)
				}
				got := make([]byte, n)
				r, err := ts[1].Irecv(0, 7, got)
				if err != nil {
					t.Fatal(err)
				}
				ts[1].mu.Lock()
				if r.ureq.Pending() && r.ureq.Status() == ucx.StatusInProgress {
					inFlight++
				}
				ts[1].mu.Unlock()
				if err := ts[1].Close(); err != nil {
					t.Fatalf("rank 1's Close: %v", err)
				}
				if _, err := r.Wait(ctx); err == nil {
					if string(got) != string(want) {
						t.Fatal("the receive finished with other bytes than were sent")
					}
				} else if !errors.Is(err, ErrClosed) && !errors.Is(err, ErrPeerLost) {
					t.Fatalf("rank 1's receive: %v, want nil, ErrClosed or ErrPeerLost", err)
				}
			}
			t.Logf("UCX_TLS=%s: %d of 8 receives were still in flight at Close", tls, inFlight)
			// Over shared memory the receive waits for rank 0 every time;
			// over TCP it has often failed already (the connection reset).
			if tls == "shm,tcp" && inFlight == 0 {
				t.Error("no receive was in flight at Close: the case is not exercised")
			}
		})
	}
}

// exchange sends one byte from a to b, so that a holds an endpoint to b.
func exchange(ctx context.Context, a, b *Transport) error {
	r, err := b.Irecv(a.Rank(), 6, make([]byte, 1))
	if err != nil {
		return err
	}
	if err := a.Send(ctx, b.Rank(), 6, []byte{1}); err != nil {
		return err
	}
	_, err = r.Wait(ctx)
	return err
}
