package transport

import (
	"sync/atomic"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"
)

// nap is a sleep of the calling OS thread that another goroutine can cut
// short. The progress goroutine naps while it stands aside for a waiter
// that progresses the worker itself (loop: a Go timer that short would
// fire a millisecond late); a waiter that leaves after spinning a while
// (spinDone) or a goroutine that parks (Transport.park) ends the nap, so
// that nothing arriving next waits for the rest of it. It is a futex on
// state, which is 1 while a thread naps.
type nap struct {
	state atomic.Int32
}

const (
	futexWaitPrivate = 128 | 0 // FUTEX_WAIT | FUTEX_PRIVATE_FLAG
	futexWakePrivate = 128 | 1 // FUTEX_WAKE | FUTEX_PRIVATE_FLAG
)

// sleep blocks the calling thread for d, or until wake.
func (n *nap) sleep(d time.Duration) { n.sleepUnless(d, nil) }

// sleepUnless is sleep that does not begin if woken reports true once the
// nap has begun: a wake that came before the nap and left a sign woken can
// read (a kick) is not lost.
func (n *nap) sleepUnless(d time.Duration, woken func() bool) {
	n.state.Store(1)
	if woken != nil && woken() {
		n.state.Store(0)
		return
	}
	end := time.Now().Add(d)
	for {
		ts := unix.NsecToTimespec(d.Nanoseconds())
		// 0 (woken), EAGAIN (woken before the wait began) and ETIMEDOUT
		// end the nap; a signal (EINTR) only interrupts it.
		_, _, errno := unix.Syscall6(unix.SYS_FUTEX, uintptr(unsafe.Pointer(&n.state)), futexWaitPrivate, 1, uintptr(unsafe.Pointer(&ts)), 0, 0)
		if errno != unix.EINTR || n.state.Load() != 1 {
			break
		}
		if d = time.Until(end); d <= 0 {
			break
		}
	}
	n.state.Store(0)
}

// napping reports whether a thread naps.
func (n *nap) napping() bool { return n.state.Load() == 1 }

// wake ends a nap in progress, if any.
func (n *nap) wake() {
	if n.state.Load() == 1 && n.state.CompareAndSwap(1, 0) {
		_, _, _ = unix.Syscall6(unix.SYS_FUTEX, uintptr(unsafe.Pointer(&n.state)), futexWakePrivate, 1, 0, 0, 0)
	}
}
