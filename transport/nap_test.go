package transport

import (
	"runtime"
	"testing"
	"time"
)

// A nap ends when another goroutine wakes it, long before its timeout.
func TestNapWake(t *testing.T) {
	var n nap
	done := make(chan struct{})
	go func() {
		defer close(done)
		n.sleep(time.Hour)
	}()
	for !n.napping() {
		runtime.Gosched()
	}
	n.wake()
	select {
	case <-done:
	case <-testCtx(t).Done():
		t.Fatal("a woken nap did not end")
	}
	if n.napping() {
		t.Fatal("napping after the nap ended")
	}
}

// A nap nobody wakes ends at its timeout, and a wake with no nap in
// progress does nothing (the next nap still sleeps).
func TestNapTimeout(t *testing.T) {
	var n nap
	n.wake()
	start := time.Now()
	n.sleep(2 * time.Millisecond)
	if d := time.Since(start); d < 2*time.Millisecond {
		t.Fatalf("a 2 ms nap ended after %v", d)
	}
	if n.napping() {
		t.Fatal("napping after the nap ended")
	}
}
