package transport

import (
	"os"
	"syscall"
	"time"

	"golang.org/x/sys/unix"
)

// eventWait is how the progress goroutine sleeps on the worker's event fd
// once it has armed the worker.
//
// poll(2) blocks the goroutine's thread, and a thread in a system call
// keeps its P until the runtime's monitor takes it back, after 20 us to 10
// ms. With several Ps the rest of the process runs on the others; with one
// (GOMAXPROCS=1, a rank bound to one core, a service in a one-CPU
// container) nothing else runs meanwhile: a 1 ms ticker in an idle rank fired
// up to 10-19 ms late. So with one P the goroutine waits in Go's network
// poller instead, on a duplicate of the fd, and the P stays free
// (docs/transport.md, "One processor per rank").
type eventWait struct {
	fds  []unix.PollFd
	file *os.File        // the duplicate in the network poller; nil: poll(2) only
	conn syscall.RawConn // file's raw access
}

// newEventWait prepares waiting on efd. If the fd cannot be put in Go's
// network poller, every wait uses poll(2).
func newEventWait(efd int) *eventWait {
	e := &eventWait{fds: []unix.PollFd{{Fd: int32(efd), Events: unix.POLLIN}}}
	dup, err := unix.FcntlInt(uintptr(efd), unix.F_DUPFD_CLOEXEC, 0)
	if err != nil {
		return e
	}
	// O_NONBLOCK belongs to the open file, shared with UCX's fd; UCX only
	// waits on it with epoll_wait, which the flag does not change.
	if err := unix.SetNonblock(dup, true); err != nil {
		unix.Close(dup)
		return e
	}
	f := os.NewFile(uintptr(dup), "ucx-worker-event-fd")
	conn, err := f.SyscallConn()
	if err != nil || f.SetReadDeadline(time.Time{}) != nil { // not pollable
		f.Close()
		return e
	}
	e.file, e.conn = f, conn
	return e
}

// wait sleeps until the fd is readable or timeout passes, in the network
// poller when viaPoller is set and the fd is in it, else in poll(2).
func (e *eventWait) wait(timeout time.Duration, viaPoller bool) {
	if !viaPoller || e.conn == nil {
		e.poll(timeout)
		return
	}
	if e.file.SetReadDeadline(time.Now().Add(timeout)) != nil {
		e.poll(timeout)
		return
	}
	first := true
	_ = e.conn.Read(func(uintptr) bool {
		if !first {
			return true // the poller saw the fd readable, or a stale edge: go round
		}
		first = false
		// Read forgets a readiness the poller noted before it was called,
		// so an event after the worker was armed and before this point
		// would be lost: look at the fd itself once (level-triggered)
		// before waiting for the next edge.
		n, _ := unix.Poll(e.fds, 0)
		return n > 0
	})
}

// poll waits in ppoll(2), whose timeout has nanosecond precision: poll(2)
// takes whole milliseconds, and a wait bounded by a revisit of the overlap
// engine less than a millisecond away would not sleep at all.
func (e *eventWait) poll(timeout time.Duration) {
	ts := unix.NsecToTimespec(int64(timeout))
	_, _ = unix.Ppoll(e.fds, &ts, nil)
}

// close releases the duplicate fd (never UCX's own).
func (e *eventWait) close() {
	if e.file != nil {
		e.file.Close()
		e.file, e.conn = nil, nil
	}
}
