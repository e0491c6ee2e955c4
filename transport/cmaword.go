package transport

// Validity words of CMA sends (cma.go).
//
// Every CMA send owns an 8-byte word of this process's memory from the
// moment its descriptor is built until the send completes. The word holds
// cmaValid meanwhile; the descriptor carries its address, which also names
// the send in the acknowledgement. A receiver reads the word right after
// the message's bytes (cmaReadWithWord) and fails the receive with
// ErrWithdrawn if it no longer holds cmaValid.
//
// When the send completes (complete, with the worker lock held), the word
// is cleared before the request is marked done: a send that completes
// without its acknowledgement (Close, the peer lost, its descriptor's send
// failed) hands its buffer back to the application while its descriptor
// may still wait at the receiver, in UCX's unexpected queue or held after a
// probe. A word whose send was acknowledged goes back to the idle words:
// the receiver is done with its descriptor. Any other word is never used
// again (8 bytes lost per such send), so no later send can make a stale
// descriptor's word valid again. Words are never freed: a descriptor may be
// read after its sender's transport closed. They live in anonymous mappings
// outside the Go heap, a page at a time: a send's state holds its word's
// pointer and is passed to cgo with its descriptor, which must hold no Go
// pointer.
//
// Cost per message: taking a word from the transport's idle list and
// putting it back (under the worker lock the send already holds), two
// atomic stores, and 8 more bytes in the receiver's process_vm_readv (a
// second remote range in the same call).

import (
	"fmt"
	"sync"
	"sync/atomic"
	"unsafe"

	"golang.org/x/sys/unix"
)

// cmaValid is a validity word's value while its send waits for its
// acknowledgement; any other value means withdrawn.
const cmaValid = 1

// cmaSlabBytes is how much word memory is mapped at a time.
const cmaSlabBytes = 4096

// cmaWordPool is the process's store of idle words, shared by its
// transports; each transport keeps a few idle words of its own
// (cmaState.words) and draws from here when it has none.
var cmaWordPool struct {
	mu   sync.Mutex
	idle []*uint64
}

// cmaWordsRefill appends up to 64 idle words to dst, mapping a slab when
// the pool has none.
func cmaWordsRefill(dst []*uint64) ([]*uint64, error) {
	p := &cmaWordPool
	p.mu.Lock()
	defer p.mu.Unlock()
	if len(p.idle) == 0 {
		// Never unmapped.
		slab, err := unix.Mmap(-1, 0, cmaSlabBytes, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_PRIVATE|unix.MAP_ANONYMOUS)
		if err != nil {
			return dst, fmt.Errorf("transport: mapping CMA validity words: %w", err)
		}
		for i := 0; i < len(slab); i += 8 {
			p.idle = append(p.idle, (*uint64)(unsafe.Pointer(&slab[i])))
		}
	}
	k := min(len(p.idle), 64)
	dst = append(dst, p.idle[len(p.idle)-k:]...)
	clear(p.idle[len(p.idle)-k:])
	p.idle = p.idle[:len(p.idle)-k]
	return dst, nil
}

// cmaWordsReturn gives idle words back to the process's pool.
func cmaWordsReturn(words []*uint64) {
	if len(words) == 0 {
		return
	}
	p := &cmaWordPool
	p.mu.Lock()
	p.idle = append(p.idle, words...)
	p.mu.Unlock()
}

// cmaNewSend returns the state of a new CMA send, its validity word valid;
// the worker lock is held. It fails only if no word memory can be mapped.
func (t *Transport) cmaNewSend() (*cmaSend, error) {
	if len(t.cma.words) == 0 {
		var err error
		if t.cma.words, err = cmaWordsRefill(t.cma.words); err != nil {
			return nil, err
		}
	}
	w := t.cma.words[len(t.cma.words)-1]
	t.cma.words[len(t.cma.words)-1] = nil
	t.cma.words = t.cma.words[:len(t.cma.words)-1]
	atomic.StoreUint64(w, cmaValid) // before the descriptor naming it leaves
	return &cmaSend{word: w, id: uint64(uintptr(unsafe.Pointer(w)))}, nil
}

// cmaWordIdle gives back the word of a send whose descriptor never left;
// the worker lock is held.
func (t *Transport) cmaWordIdle(c *cmaSend) {
	c.acked = true // nobody can read it: as good as acknowledged
	t.cmaSendComplete(c)
}

// cmaSendComplete withdraws c's word as its send completes, before the
// request is marked done; the worker lock is held. An acknowledged send's
// word is idle again; any other is dropped for good.
func (t *Transport) cmaSendComplete(c *cmaSend) {
	w := c.word
	if w == nil {
		return
	}
	c.word = nil
	atomic.StoreUint64(w, 0)
	if !c.acked {
		return // its descriptor may still be read: never valid again
	}
	if t.closed {
		cmaWordsReturn([]*uint64{w})
		return
	}
	t.cma.words = append(t.cma.words, w)
}
