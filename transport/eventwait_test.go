package transport

import (
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// waitReturns runs e.wait in a goroutine and reports whether it returned
// before the guard (far longer than any wake-up).
func waitReturns(t *testing.T, e *eventWait, timeout time.Duration, viaPoller bool) bool {
	t.Helper()
	done := make(chan struct{})
	go func() {
		e.wait(timeout, viaPoller)
		close(done)
	}()
	select {
	case <-done:
		return true
	case <-time.After(20 * time.Second):
		return false
	}
}

// The worker's event fd is an epoll fd; an eventfd stands in for it (any
// fd poll(2) and Go's poller can wait on).
func TestEventWait(t *testing.T) {
	efd, err := unix.Eventfd(0, unix.EFD_CLOEXEC)
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Close(efd)
	e := newEventWait(efd)
	if e.conn == nil {
		t.Fatal("the event fd did not join Go's network poller")
	}
	signal := func() {
		if _, err := unix.Write(efd, []byte{1, 0, 0, 0, 0, 0, 0, 0}); err != nil {
			t.Fatal(err)
		}
	}
	drain := func() {
		var b [8]byte
		if _, err := unix.Read(efd, b[:]); err != nil {
			t.Fatal(err)
		}
	}
	for _, viaPoller := range []bool{true, false} {
		// Readiness that came before the wait (after the worker was armed)
		// must not be lost: the wait returns at once, not at its timeout.
		// The pause lets the runtime's poller take the edge first, as it
		// may in a real rank; the wait must still see the fd readable.
		signal()
		time.Sleep(5 * time.Millisecond)
		if !waitReturns(t, e, time.Hour, viaPoller) {
			t.Fatalf("viaPoller=%v: wait missed an event that came before it", viaPoller)
		}
		drain()
		// An event during the wait ends it.
		done := make(chan struct{})
		go func() {
			e.wait(time.Hour, viaPoller)
			close(done)
		}()
		signal()
		select {
		case <-done:
		case <-time.After(20 * time.Second):
			t.Fatalf("viaPoller=%v: wait missed an event during it", viaPoller)
		}
		drain()
		// Nothing happens: the timeout ends it.
		if !waitReturns(t, e, 10*time.Millisecond, viaPoller) {
			t.Fatalf("viaPoller=%v: wait outlived its timeout", viaPoller)
		}
	}
	e.close()
	// The duplicate is closed, the original is not.
	if _, err := unix.FcntlInt(uintptr(efd), unix.F_GETFD, 0); err != nil {
		t.Fatalf("closing the wait closed the original fd: %v", err)
	}
	if !waitReturns(t, e, 10*time.Millisecond, true) {
		t.Fatal("a closed wait (poll(2) on the original) outlived its timeout")
	}
}
