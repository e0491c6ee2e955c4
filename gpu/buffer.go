package gpu

import (
	"fmt"
	"sort"
	"sync"
	"sync/atomic"
	"unsafe"
)

// Buffer is a zero-copy reference to memory: its system and device, a
// pointer, a length and a memory kind. A Buffer is a small value; copying it
// copies the reference, not the bytes. The zero Buffer refers to nothing.
//
// The pointer is an address in the process (a CUDA device pointer for device
// memory on the cuda backend). The package never dereferences a pointer that
// did not come from its own allocations: a Buffer can only be made by
// allocating, by wrapping Go memory (HostBuffer), by slicing another Buffer
// or by BufferAt, which checks the range against live allocations.
type Buffer struct {
	a   *allocation
	ptr uintptr
	n   int
}

// Ptr returns the address of the first byte.
func (b Buffer) Ptr() uintptr { return b.ptr }

// Len returns the length in bytes.
func (b Buffer) Len() int { return b.n }

// IsZero reports whether b is the zero Buffer.
func (b Buffer) IsZero() bool { return b.a == nil }

// Kind returns the memory kind.
func (b Buffer) Kind() Kind {
	if b.a == nil {
		return KindHost
	}
	return b.a.kind
}

// Device returns the device owning the memory (nil for host and pinned
// memory).
func (b Buffer) Device() *Device {
	if b.a == nil {
		return nil
	}
	return b.a.dev
}

// System returns the system the Buffer belongs to (nil for the zero Buffer).
func (b Buffer) System() *System {
	if b.a == nil {
		return nil
	}
	return b.a.sys
}

// Offset returns the offset of b within its allocation.
func (b Buffer) Offset() int {
	if b.a == nil {
		return 0
	}
	return int(b.ptr - b.a.base)
}

// Freed reports whether the allocation behind b has been freed.
func (b Buffer) Freed() bool { return b.a != nil && b.a.freed.Load() }

// Slice returns the n bytes of b starting at off. It never touches memory.
func (b Buffer) Slice(off, n int) (Buffer, error) {
	if b.a == nil {
		return Buffer{}, ErrZeroBuffer
	}
	if off < 0 || n < 0 || off > b.n || n > b.n-off {
		return Buffer{}, fmt.Errorf("gpu: slice [%d:%d+%d] of %d-byte buffer: %w", off, off, n, b.n, ErrOutOfBounds)
	}
	return Buffer{a: b.a, ptr: b.ptr + uintptr(off), n: n}, nil
}

// Bytes returns b as a Go slice. Only host-accessible kinds (KindHost and
// KindPinned) have one; device and managed memory must be read with
// CopyToHost. The slice aliases the memory: it is invalid after Free.
func (b Buffer) Bytes() ([]byte, error) {
	if err := b.valid(); err != nil {
		return nil, err
	}
	if !b.a.kind.HostAccessible() || b.a.mem == nil {
		return nil, fmt.Errorf("gpu: Bytes of %s buffer: %w", b.a.kind, ErrNotHostMemory)
	}
	return b.view(), nil
}

// String describes b.
func (b Buffer) String() string {
	if b.a == nil {
		return "gpu.Buffer{}"
	}
	dev := "-"
	if b.a.dev != nil {
		dev = fmt.Sprint(b.a.dev.ord)
	}
	return fmt.Sprintf("gpu.Buffer{%s dev=%s ptr=%#x len=%d}", b.a.kind, dev, b.ptr, b.n)
}

// valid checks that b may be used now.
func (b Buffer) valid() error {
	if b.a == nil {
		return ErrZeroBuffer
	}
	if b.a.sys == nil {
		return ErrZeroBuffer
	}
	if b.a.sys.closed.Load() {
		return ErrClosed
	}
	if b.a.freed.Load() {
		return fmt.Errorf("gpu: %s buffer at %#x: %w", b.a.kind, b.ptr, ErrFreed)
	}
	return nil
}

// view is the host-accessible slice of b (backends that keep one).
func (b Buffer) view() []byte {
	off := int(b.ptr - b.a.base)
	return b.a.mem[off : off+b.n : off+b.n]
}

// allocation is one region of memory known to a System.
type allocation struct {
	sys  *System
	dev  *Device // nil for host/pinned
	kind Kind
	base uintptr
	size int
	// mem is a host-accessible view of the whole allocation, or nil (cuda
	// device and managed memory).
	mem   []byte
	goMem bool        // wraps Go memory (HostBuffer)
	ipc   bool        // opened from an IPC handle
	pool  *PinnedPool // owned by a pinned pool
	// releaseFn returns the memory to the backend.
	releaseFn func() error

	freed atomic.Bool

	mu       sync.Mutex
	pending  int // enqueued stream operations using the allocation (host backend)
	released bool
	ipcH     *[64]byte // the allocation's IPC handle, once asked for (System.IPCGetHandle)
}

func (a *allocation) origin() string {
	switch {
	case a.goMem:
		return "Go-memory"
	case a.ipc:
		return "IPC-mapped"
	case a.pool != nil:
		return "pooled"
	}
	return a.kind.String()
}

// acquire records an enqueued operation using a; it fails once a is freed.
func (a *allocation) acquire() error {
	a.mu.Lock()
	defer a.mu.Unlock()
	if a.freed.Load() {
		return ErrFreed
	}
	a.pending++
	return nil
}

// release ends an operation started with acquire; the last one releases the
// memory of a freed allocation.
func (a *allocation) release() {
	a.mu.Lock()
	a.pending--
	fn := a.takeReleaseLocked()
	a.mu.Unlock()
	if fn != nil {
		_ = fn()
	}
}

func (a *allocation) takeReleaseLocked() func() error {
	if a.freed.Load() && a.pending == 0 && !a.released {
		a.released = true
		return a.releaseFn
	}
	return nil
}

// free marks a freed and releases it now, or when its pending operations
// have run.
func (a *allocation) free() error {
	a.mu.Lock()
	if a.freed.Load() {
		a.mu.Unlock()
		return ErrFreed
	}
	a.freed.Store(true)
	fn := a.takeReleaseLocked()
	a.mu.Unlock()
	if fn != nil {
		if a.sys != nil {
			a.sys.quiesceAgents()
		}
		return fn()
	}
	return nil
}

func addrOf(b []byte) uintptr { return uintptr(unsafe.Pointer(unsafe.SliceData(b))) }

// registry holds live allocations sorted by base address.
type registry struct{ allocs []*allocation }

func (r *registry) add(a *allocation) {
	i := sort.Search(len(r.allocs), func(i int) bool { return r.allocs[i].base >= a.base })
	r.allocs = append(r.allocs, nil)
	copy(r.allocs[i+1:], r.allocs[i:])
	r.allocs[i] = a
}

func (r *registry) remove(a *allocation) {
	for i, x := range r.allocs {
		if x == a {
			r.allocs = append(r.allocs[:i], r.allocs[i+1:]...)
			return
		}
	}
}

// find returns the allocation containing ptr, or nil.
func (r *registry) find(ptr uintptr) *allocation {
	i := sort.Search(len(r.allocs), func(i int) bool { return r.allocs[i].base > ptr }) - 1
	if i < 0 {
		return nil
	}
	a := r.allocs[i]
	if ptr-a.base < uintptr(a.size) {
		return a
	}
	return nil
}

func (r *registry) all() []*allocation { return append([]*allocation(nil), r.allocs...) }

// kindCache memoizes KindOf per address. It is bounded: when full it starts
// over (a cache miss only costs a registry lookup or a driver query).
type kindCache struct {
	max          int
	m            map[uintptr]kindEntry
	hits, misses uint64
	// gen counts invalidations, so that an answer worked out while an
	// Alloc or Free ran is not stored (putIf).
	gen uint64
}

type kindEntry struct {
	kind Kind
	dev  *Device
}

const defaultKindCacheSize = 4096

func (c *kindCache) init(max int) { c.max, c.m = max, make(map[uintptr]kindEntry) }

func (c *kindCache) get(p uintptr) (kindEntry, bool) {
	e, ok := c.m[p]
	if ok {
		c.hits++
	} else {
		c.misses++
	}
	return e, ok
}

// putIf stores e for p unless the cache was invalidated since gen was read.
func (c *kindCache) putIf(gen uint64, p uintptr, e kindEntry) {
	if gen != c.gen {
		return
	}
	if len(c.m) >= c.max {
		clear(c.m)
	}
	c.m[p] = e
}

// invalidate drops cached entries for addresses in [base, base+n).
func (c *kindCache) invalidate(base uintptr, n int) {
	c.gen++
	for p := range c.m {
		if p-base < uintptr(n) {
			delete(c.m, p)
		}
	}
}

func (c *kindCache) clear() {
	c.gen++
	clear(c.m)
}
