package actor

import (
	"sync"
	"sync/atomic"

	"github.com/troupe-hpc/troupe/transport"
)

// largeSends takes back the buffers that messages too large to be posted
// were encoded into (post): a buffer goes back to the landing pool (getBuf)
// as soon as the transport has finished reading it, so that the next large
// message of the rank is encoded into memory already touched. Fresh memory
// is what such a message used to cost most: each new page faults, about
// 10 us a page on a virtual machine, 50 us for an 18 KiB message
// (docs/actor.md, "Large messages reuse their buffers").
//
// Sends still in flight wait in a short list, looked at before each large
// message is encoded; no goroutine watches them. A buffer whose send has
// not completed when the list is full is left to the garbage collector.
type largeSends struct {
	mu      sync.Mutex
	pending []heldBuf
	waiting atomic.Int32 // len(pending), read without mu by reclaim
}

// heldBuf is an encoding buffer and the send that reads it.
type heldBuf struct {
	buf []byte
	req *transport.Request
}

// maxHeldBufs bounds largeSends' list: more sends than this in flight at
// once are rare, and their buffers are simply not reused.
const maxHeldBufs = 64

// release hands b back once req (nil: nothing reads b any more) has
// completed. Buffers of at most MaxPostAM bytes are the small pool's
// (putSendBuf) and are left alone.
func (l *largeSends) release(b []byte, req *transport.Request) {
	if cap(b) <= transport.MaxPostAM {
		return
	}
	l.hold(b, req)
}

// hold hands b back to the landing pool once req (nil: nothing reads b any
// more) has completed, whatever its size: the staged copies of Typed and
// gpu.Buffer fields come from that pool (codecType.stagesPayload).
func (l *largeSends) hold(b []byte, req *transport.Request) {
	if req != nil {
		if done, _ := req.Finished(); !done {
			l.mu.Lock()
			if len(l.pending) < maxHeldBufs {
				l.pending = append(l.pending, heldBuf{buf: b, req: req})
				l.waiting.Store(int32(len(l.pending)))
			}
			l.mu.Unlock()
			return
		}
	}
	putBuf(b[:0])
}

// reclaim returns the buffers of completed sends to the pool. It runs
// before every message of a type that stages its payload, so with nothing
// held it takes no lock.
func (l *largeSends) reclaim() {
	if l.waiting.Load() == 0 {
		return
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	kept := l.pending[:0]
	for _, h := range l.pending {
		if done, _ := h.req.Finished(); done {
			putBuf(h.buf[:0])
			continue
		}
		kept = append(kept, h)
	}
	clear(l.pending[len(kept):])
	l.pending = kept
	l.waiting.Store(int32(len(kept)))
}

// held reports how many buffers wait for their sends to complete.
func (l *largeSends) held() int {
	l.mu.Lock()
	defer l.mu.Unlock()
	return len(l.pending)
}
