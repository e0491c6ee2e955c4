package actor

import (
	"testing"
	"time"

	pa "github.com/asynkron/protoactor-go/actor"
)

// Defects found by a second review; each test failed before its fix.

// An actor its supervisor stops after a failure (its mailbox suspended by
// the failure) still gives back the credits of the remote messages left in
// its mailbox: they held the sending rank's window for good, and every
// later message from that rank to any actor of the rank blocked.
func TestCreditsComeBackFromStoppedFailedActor(t *testing.T) {
	const credits = 8 // small pings cost one unit each
	rts := startLocalWith(t, 2, Options{Credits: credits})
	release := make(chan struct{})
	stopOnFailure := pa.NewOneForOneStrategy(0, time.Second, func(any) pa.Directive { return pa.StopDirective })
	parent := rts[1].PropsFromFunc(func(c pa.Context) {
		if _, ok := c.Message().(*pa.Started); ok {
			c.SpawnNamed(rts[1].PropsFromFunc(func(c pa.Context) {
				if p, ok := c.Message().(*ping); ok && p.N == 0 {
					<-release
					panic("boom")
				}
			}), "child")
		}
	}, pa.WithSupervisor(stopOnFailure))
	if _, err := rts[1].Root().SpawnNamed(parent, "parent"); err != nil {
		t.Fatal(err)
	}
	got := make(chan int, 1)
	if _, err := rts[1].Root().SpawnNamed(rts[1].PropsFromFunc(func(c pa.Context) {
		if p, ok := c.Message().(*ping); ok {
			got <- p.N
		}
	}), "sink"); err != nil {
		t.Fatal(err)
	}
	var mbox *mailbox
	waitFor(t, func() bool {
		if v, ok := rts[1].local.Load("parent/child"); ok {
			mbox = v.(*localActor).run.mbox.Load()
		}
		return mbox != nil
	})
	// The whole window goes to the child: one message it fails on, the
	// others behind it in its mailbox.
	child := rts[0].PID(1, "parent/child")
	for i := range credits {
		if err := rts[0].Send(child, &ping{N: i}); err != nil {
			t.Fatal(err)
		}
	}
	waitFor(t, func() bool { return mbox.userPending() == credits-1 }) // the first is running
	close(release)
	waitFor(t, func() bool { _, ok := rts[1].local.Load("parent/child"); return !ok })

	sent := make(chan error, 1)
	go func() { sent <- rts[0].Send(rts[0].PID(1, "sink"), &ping{N: 42}) }()
	select {
	case err := <-sent:
		if err != nil {
			t.Fatal(err)
		}
	case <-time.After(10 * time.Second):
		t.Fatalf("a send to another actor of the rank still blocked 10 s after the failed actor stopped (credit waits %d, credits back %d)",
			rts[0].Stats().CreditWaits.Load(), rts[1].Stats().CreditsBack.Load())
	}
	select {
	case n := <-got:
		if n != 42 {
			t.Fatalf("sink got %d", n)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("the sink got nothing")
	}
}
