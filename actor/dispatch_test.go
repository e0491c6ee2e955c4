package actor

import (
	"bytes"
	"runtime"
	"strconv"
	"testing"
	"time"

	pa "github.com/asynkron/protoactor-go/actor"
)

// goid is the calling goroutine's id.
func goid() int {
	b := make([]byte, 64)
	b = b[:runtime.Stack(b, false)]
	b = bytes.TrimPrefix(b, []byte("goroutine "))
	n, _ := strconv.Atoi(string(b[:bytes.IndexByte(b, ' ')]))
	return n
}

// TestPoolDispatcher: a mailbox that ran dry leaves its goroutine waiting
// for the next one (the same goroutine runs the next message, its stack
// grown already), and an actor blocked in Receive holds up no other actor.
func TestPoolDispatcher(t *testing.T) {
	rts := startLocal(t, 1)
	rt := rts[0]
	ran := make(chan int, 10)
	release := make(chan struct{})
	pid, err := rt.Root().SpawnNamed(rt.PropsFromFunc(func(c pa.Context) {
		switch m := c.Message().(type) {
		case *ping:
			if m.Text == "block" {
				<-release
			}
			ran <- goid()
		}
	}), "worker")
	if err != nil {
		t.Fatal(err)
	}
	wait := func() int {
		t.Helper()
		select {
		case g := <-ran:
			return g
		case <-time.After(10 * time.Second):
			t.Fatal("message not processed")
			return 0
		}
	}
	rt.Root().Send(pid, &ping{N: 1})
	first := wait()
	time.Sleep(10 * time.Millisecond) // the mailbox is idle, its goroutine waiting
	rt.Root().Send(pid, &ping{N: 2})
	if again := wait(); again != first {
		t.Fatalf("second message ran on goroutine %d, the first on %d: not reused", again, first)
	}
	// Block the actor; another one must still run.
	rt.Root().Send(pid, &ping{N: 3, Text: "block"})
	other, err := rt.Root().SpawnNamed(rt.PropsFromFunc(func(c pa.Context) {
		if _, ok := c.Message().(*ping); ok {
			ran <- -1
		}
	}), "other")
	if err != nil {
		t.Fatal(err)
	}
	rt.Root().Send(other, &ping{N: 4})
	if g := wait(); g != -1 {
		t.Fatalf("got %d, want the other actor's message", g)
	}
	close(release)
	wait()
}

// TestPoolDispatcherIdle: of the goroutines left idle by a burst, keepIdle
// stay and the others end after about workerIdle, the longest idle first:
// the goroutine that runs mailboxes all the while is never the one ended;
// the next mailbox runs on the most recently idle goroutine; close ends
// the waiting ones and a mailbox scheduled after close still runs.
func TestPoolDispatcherIdle(t *testing.T) {
	saved := workerIdle
	workerIdle = 20 * time.Millisecond
	defer func() { workerIdle = saved }()
	d := newPoolDispatcher(10)
	const burst = keepIdle + 4
	release := make(chan struct{})
	started := make(chan int, burst)
	for range burst {
		d.Schedule(func() {
			started <- goid()
			<-release
		})
	}
	for range burst {
		<-started
	}
	if n := d.live.Load(); n != burst {
		t.Fatalf("%d goroutines for %d blocked mailboxes", n, burst)
	}
	close(release)
	// Until the goroutines idle beyond keepIdle have ended, keep one busy:
	// every mailbox runs on the same goroutine, which survives the trims.
	// settled waits until every goroutine is back on the idle stack: the
	// one that ran last is then on top, the next to be handed a mailbox.
	settled := func() {
		for {
			d.mu.Lock()
			n := len(d.idle)
			d.mu.Unlock()
			if int32(n) == d.live.Load() {
				return
			}
			runtime.Gosched()
		}
	}
	hot := make(chan int)
	runHot := func() int {
		d.Schedule(func() { hot <- goid() })
		g := <-hot
		settled()
		return g
	}
	settled()
	first := runHot()
	deadline := time.Now().Add(10 * time.Second)
	for d.live.Load() > keepIdle {
		if time.Now().After(deadline) {
			t.Fatalf("%d goroutines after workerIdle, want %d", d.live.Load(), keepIdle)
		}
		if g := runHot(); g != first {
			t.Fatalf("a mailbox ran on goroutine %d, the busy one is %d: the trim ended the busy goroutine", g, first)
		}
		time.Sleep(time.Millisecond)
	}
	if g := runHot(); g != first {
		t.Fatalf("after the trims a mailbox ran on goroutine %d, not the busy %d", g, first)
	}
	d.mu.Lock()
	idle := len(d.idle)
	d.mu.Unlock()
	if idle != keepIdle {
		t.Fatalf("%d goroutines on the idle stack, want %d", idle, keepIdle)
	}
	// The next mailbox runs on a waiting goroutine: none is started (a new
	// one would still be running when it sends).
	ran := make(chan int32)
	d.Schedule(func() { ran <- d.live.Load() })
	if n := <-ran; n != keepIdle {
		t.Fatalf("%d goroutines while a mailbox ran on a waiting one, want %d", n, keepIdle)
	}
	d.close()
	for d.live.Load() > 0 {
		if time.Now().After(deadline) {
			t.Fatalf("%d goroutines after close", d.live.Load())
		}
		time.Sleep(time.Millisecond)
	}
	d.Schedule(func() { ran <- 0 })
	<-ran // a mailbox scheduled after close still runs
}
