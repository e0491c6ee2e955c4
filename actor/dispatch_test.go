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
