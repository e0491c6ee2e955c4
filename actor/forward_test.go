package actor

import (
	"strconv"
	"strings"
	"testing"
	"time"

	pa "github.com/asynkron/protoactor-go/actor"
)

// A message from another rank that its actor forwards (Context.Forward) to
// an actor of the same rank returns its sender's credits once: protoactor
// forwards the envelope itself, with its credit header, and both mailboxes
// returned the credits, so the sender's window grew by the cost of every
// forwarded message. The forwarded copy still names its source rank.
func TestForwardLocalReturnsCreditsOnce(t *testing.T) {
	const credits = 64 // returned in batches of 16
	const n = 20       // half of one unit, half of several (about 40 units)
	rts := startLocalWith(t, 2, Options{Credits: credits})
	badSource := make(chan string, n)
	back, err := rts[1].Root().SpawnNamed(rts[1].PropsFromFunc(func(c pa.Context) {
		p, ok := c.Message().(*ping)
		if !ok {
			return
		}
		if p.N < 0 {
			c.Respond(&pong{N: p.N})
			return
		}
		if src := c.MessageHeader().Get(HeaderSourceRank); src != "0" {
			badSource <- src
		}
	}), "back")
	if err != nil {
		t.Fatal(err)
	}
	// The front adds up the cost of the messages it forwards and reports
	// it with what rank 1 has given back for rank 0's messages (sent in
	// credit messages or owed), read once both actors have processed
	// every forwarded message. (Each credit message carries one batch:
	// only the front's mailbox returns rank 0's credits, one message at a
	// time. Two mailboxes returning them at once could merge batches.)
	type report struct{ taken, returned int64 }
	reports := make(chan report, 1)
	var taken int64
	if _, err := rts[1].Root().SpawnNamed(rts[1].PropsFromFunc(func(c pa.Context) {
		p, ok := c.Message().(*ping)
		if !ok {
			return
		}
		if p.N >= 0 {
			cost, err := strconv.Atoi(c.MessageHeader().Get(headerCost))
			if err != nil {
				t.Errorf("message %d: no cost in its header: %v", p.N, err)
			}
			taken += int64(cost)
			c.Forward(back)
			return
		}
		// The front's mailbox has returned the credits of the messages
		// before this one; the back answers after its mailbox has done
		// the same for all the forwarded ones.
		if _, err := c.RequestFuture(back, &ping{N: -1}, 10*time.Second).Result(); err != nil {
			t.Errorf("the back actor did not answer: %v", err)
		}
		in := rts[1].in[0]
		reports <- report{taken, int64(rts[1].Stats().CreditsBack.Load())*in.batch + in.owed.Load()}
	}), "front"); err != nil {
		t.Fatal(err)
	}
	front := rts[0].PID(1, "front")
	big := strings.Repeat("x", 2*CreditBytes+100)
	for i := range n {
		p := &ping{N: i}
		if i%2 == 1 {
			p.Text = big
		}
		if err := rts[0].Send(front, p); err != nil {
			t.Fatal(err)
		}
	}
	if err := rts[0].Send(front, &ping{N: -1}); err != nil {
		t.Fatal(err)
	}
	select {
	case r := <-reports:
		if r.taken <= n {
			t.Fatalf("the messages cost %d units, want some of several units", r.taken)
		}
		if r.returned != r.taken {
			t.Fatalf("rank 1 returned %d credit units for %d units of messages forwarded on the rank", r.returned, r.taken)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("the front actor sent no report")
	}
	select {
	case src := <-badSource:
		t.Fatalf("a forwarded message came from rank %q, want 0", src)
	default:
	}
	// The sender's window settles at its size: what it has not got back
	// is what rank 1 still owes it (the report's unit at least).
	out, in := rts[0].out[1], rts[1].in[0]
	waitFor(t, func() bool {
		out.mu.Lock()
		defer out.mu.Unlock()
		return in.owed.Load() > 0 && int64(out.avail)+in.owed.Load() == credits
	})
}
