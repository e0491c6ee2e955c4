package actor

import (
	"context"
	"testing"
	"time"

	pa "github.com/asynkron/protoactor-go/actor"

	"github.com/troupe-hpc/troupe/transport"
)

// Ranks with different Options.Credits: each rank's window is what it
// accepts, and senders use the receiving rank's window. Before, a sender
// used its own window and a receiver returned credits in quarters of its
// own, so a small-window sender blocked for good on a large-window
// receiver (which never owed a whole batch), and a large-window sender
// overfilled a small-window receiver.
func TestUnequalCreditWindows(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	ts, stopT, err := transport.StartLocal(ctx, 2, transport.Options{})
	if err != nil {
		t.Fatal(err)
	}
	defer stopT()
	windows := []int{16, 4096}
	rts := runtimesWith(ctx, t, ts, func(r int) Options { return Options{Credits: windows[r]} })
	defer shutdownAll(t, rts)
	for r, rt := range rts {
		if w := rt.out[1-r].window; w != windows[1-r] {
			t.Fatalf("rank %d sends to rank %d with a window of %d, want the receiver's %d", r, 1-r, w, windows[1-r])
		}
	}

	const n = 500 // many windows' worth for the small one
	got := make([]chan int, 2)
	for r, rt := range rts {
		ch := make(chan int, n)
		got[r] = ch
		if _, err := rt.Root().SpawnNamed(rt.PropsFromFunc(func(c pa.Context) {
			switch m := c.Message().(type) {
			case *ping:
				ch <- m.N
			case *seqBlob:
				ch <- m.N
			}
		}), "sink"); err != nil {
			t.Fatal(err)
		}
	}
	for r, rt := range rts {
		go func() {
			for i := range n {
				var msg any = &ping{N: i}
				if i%50 == 49 { // larger than the small window's quarter
					msg = &seqBlob{N: i, Data: make(Payload, 64*CreditBytes)}
				}
				if err := rt.Send(rt.PID(1-r, "sink"), msg); err != nil {
					t.Errorf("rank %d send %d: %v", r, i, err)
					return
				}
			}
		}()
	}
	for r := range rts {
		for i := range n {
			select {
			case k := <-got[r]:
				if k != i {
					t.Fatalf("rank %d: message %d arrived as %d", r, i, k)
				}
			case <-time.After(20 * time.Second):
				t.Fatalf("rank %d got %d of %d messages from rank %d (credit waits on the sender %d)",
					r, i, n, 1-r, rts[1-r].Stats().CreditWaits.Load())
			}
		}
	}
}
