package actor

import (
	"sync"
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
	f := fillFailingChild(t, rts, credits)
	close(f.release)
	waitFor(t, func() bool { _, ok := rts[1].local.Load("parent/child"); return !ok })
	f.sinkNotBlocked(t, rts)
}

// failingChild is rank 1 of rts with an actor "parent/child" that fails on
// its first message once release is closed (its supervisor then stops it),
// the sending rank's whole credit window in its mailbox, and an actor
// "sink" that reports the pings it gets.
type failingChild struct {
	release chan struct{}
	mbox    *mailbox // the child's
	got     chan int // the sink's pings
	child   *pa.PID  // the child, as rank 0 names it
}

// fillFailingChild sets up a failingChild: the child runs its first
// message (blocked until release) with credits-1 behind it.
func fillFailingChild(t *testing.T, rts []*Runtime, credits int) *failingChild {
	t.Helper()
	f := &failingChild{release: make(chan struct{}), got: make(chan int, 1), child: rts[0].PID(1, "parent/child")}
	stopOnFailure := pa.NewOneForOneStrategy(0, time.Second, func(any) pa.Directive { return pa.StopDirective })
	parent := rts[1].PropsFromFunc(func(c pa.Context) {
		if _, ok := c.Message().(*pa.Started); ok {
			c.SpawnNamed(rts[1].PropsFromFunc(func(c pa.Context) {
				if p, ok := c.Message().(*ping); ok && p.N == 0 {
					<-f.release
					panic("boom")
				}
			}), "child")
		}
	}, pa.WithSupervisor(stopOnFailure))
	if _, err := rts[1].Root().SpawnNamed(parent, "parent"); err != nil {
		t.Fatal(err)
	}
	if _, err := rts[1].Root().SpawnNamed(rts[1].PropsFromFunc(func(c pa.Context) {
		if p, ok := c.Message().(*ping); ok {
			f.got <- p.N
		}
	}), "sink"); err != nil {
		t.Fatal(err)
	}
	waitFor(t, func() bool {
		if v, ok := rts[1].local.Load("parent/child"); ok {
			f.mbox = v.(*localActor).run.mbox.Load()
		}
		return f.mbox != nil
	})
	// The whole window goes to the child: one message it fails on, the
	// others behind it in its mailbox.
	for i := range credits {
		if err := rts[0].Send(f.child, &ping{N: i}); err != nil {
			t.Fatal(err)
		}
	}
	waitFor(t, func() bool { return f.mbox.userPending() == int64(credits-1) }) // the first is running
	return f
}

// sinkNotBlocked checks that a send from rank 0 to the sink does not wait
// for credits, and arrives.
func (f *failingChild) sinkNotBlocked(t *testing.T, rts []*Runtime) {
	t.Helper()
	sent := make(chan error, 1)
	go func() { sent <- rts[0].Send(rts[0].PID(1, "sink"), &ping{N: 42}) }()
	select {
	case err := <-sent:
		if err != nil {
			t.Fatal(err)
		}
	case <-time.After(10 * time.Second):
		t.Fatalf("a send to another actor of the rank still blocked 10 s after the failed actor stopped (its mailbox: %d messages left, suspended %v; credit waits %d, credits back %d)",
			f.mbox.userPending(), f.mbox.suspended.Load(), rts[0].Stats().CreditWaits.Load(), rts[1].Stats().CreditsBack.Load())
	}
	select {
	case n := <-f.got:
		if n != 42 {
			t.Fatalf("sink got %d", n)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("the sink got nothing")
	}
}

// A failed actor that its supervisor stops still gives back the credits
// of the remote messages left in its mailbox when a new actor of the same
// name is spawned before it has finished stopping (protoactor frees the
// name just before the actor's Stopped): the stopping actor's mailbox was
// looked up through the name's record, which the new actor already held,
// so it stayed suspended and the sending rank's window stayed taken.
func TestCreditsComeBackFromStoppedFailedActorRespawned(t *testing.T) {
	const credits = 8 // small pings cost one unit each
	rts := startLocalWith(t, 2, Options{Credits: credits})
	f := fillFailingChild(t, rts, credits)
	oldMbox, child := f.mbox, f.child
	gotNew := make(chan int, 1)
	type respawn struct {
		old, pid *pa.PID
		err      error
	}
	respawned := make(chan respawn, 1)
	var once sync.Once
	// In the window between protoactor freeing the failed child's name and
	// its Stopped, an actor of the same id is spawned.
	rts[1].stoppedHook = func(pid *pa.PID) {
		if pid.Id != "parent/child" {
			return
		}
		once.Do(func() {
			p, err := rts[1].Root().SpawnNamed(rts[1].PropsFromFunc(func(c pa.Context) {
				if p, ok := c.Message().(*ping); ok {
					gotNew <- p.N
				}
			}), "parent/child")
			respawned <- respawn{old: pid, pid: p, err: err}
		})
	}
	close(f.release)
	var r respawn
	select {
	case r = <-respawned:
	case <-time.After(10 * time.Second):
		t.Fatal("the failed child did not stop")
	}
	if r.err != nil {
		t.Fatalf("spawning a new actor of the freed name: %v", r.err)
	}

	f.sinkNotBlocked(t, rts)
	waitFor(t, func() bool { return oldMbox.userPending() == 0 })
	if _, ok := rts[1].mailboxes.Load(r.old); ok {
		t.Error("the stopped actor's mailbox is still recorded")
	}
	// The new actor keeps its own record and mailbox, and gets messages.
	v, ok := rts[1].local.Load("parent/child")
	if !ok || v.(*localActor).pid != r.pid {
		t.Fatal("the new actor's record is gone")
	}
	if m := v.(*localActor).run.mbox.Load(); m == nil || m == oldMbox {
		t.Fatalf("the new actor's record has mailbox %p (the old one is %p)", m, oldMbox)
	}
	if err := rts[0].Send(child, &ping{N: 7}); err != nil {
		t.Fatal(err)
	}
	select {
	case n := <-gotNew:
		if n != 7 {
			t.Fatalf("the new actor got %d", n)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("the new actor got nothing")
	}
}
