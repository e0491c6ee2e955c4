package gpu

import (
	"context"
	"fmt"
	"math/bits"
	"sync"
)

// PoolConfig sizes a PinnedPool.
type PoolConfig struct {
	// MinSize is the smallest size class in bytes (rounded up to a power of
	// two; default 4 KiB).
	MinSize int
	// MaxSize is the largest size class (rounded up to a power of two;
	// default 4 MiB). Larger requests are refused. Neither size may exceed
	// the largest power of two an int holds (2^62 on 64-bit machines).
	MaxSize int
	// MaxBytes bounds the pinned memory the pool holds, in use and idle
	// (default 64 MiB).
	MaxBytes int
	// MaxIdlePerClass bounds the idle buffers kept per size class (default
	// 8); beyond it Put frees the memory.
	MaxIdlePerClass int
}

// PinnedPool recycles pinned host buffers in power-of-two size classes. It
// is bounded: Get fails with ErrPoolExhausted (GetWait waits) when a new
// buffer would take the pool over MaxBytes.
//
// The buffers the pool lets go (beyond MaxIdlePerClass, or to make room for
// another class) are freed by a goroutine of the pool, never by the caller
// of Put or Get: on CUDA, freeing pinned memory waits until the device is
// idle, and a transport agent that Puts a buffer may be what a stream on
// the device is waiting for (a stream-triggered queue's completion). Until
// that goroutine has freed them they are no longer counted in MaxBytes.
type PinnedPool struct {
	sys *System
	cfg PoolConfig
	min int // log2 of MinSize

	mu      sync.Mutex
	idle    [][]*allocation // per class
	inUse   map[*allocation]bool
	held    int // bytes allocated (in use + idle)
	changed chan struct{}
	closed  bool

	release     []*allocation // let go, not freed yet
	releaseDone chan struct{} // non-nil while a releaser runs; closed when it ends
}

// NewPinnedPool creates a pool of pinned host buffers.
func (s *System) NewPinnedPool(cfg PoolConfig) (*PinnedPool, error) {
	if err := s.check(); err != nil {
		return nil, err
	}
	if cfg.MinSize <= 0 {
		cfg.MinSize = 4 << 10
	}
	if cfg.MaxSize <= 0 {
		cfg.MaxSize = 4 << 20
	}
	if cfg.MaxBytes <= 0 {
		cfg.MaxBytes = 64 << 20
	}
	if cfg.MaxIdlePerClass <= 0 {
		cfg.MaxIdlePerClass = 8
	}
	// A size above the largest power of two an int holds has no class
	// (ceilPow2 would overflow to a negative size).
	if cfg.MinSize > maxClassSize || cfg.MaxSize > maxClassSize {
		return nil, fmt.Errorf("gpu: pinned pool: classes %d..%d bytes: %w (at most %d)", cfg.MinSize, cfg.MaxSize, ErrOutOfBounds, maxClassSize)
	}
	cfg.MinSize = ceilPow2(cfg.MinSize)
	cfg.MaxSize = ceilPow2(cfg.MaxSize)
	if cfg.MaxSize < cfg.MinSize || cfg.MaxSize > cfg.MaxBytes {
		return nil, fmt.Errorf("gpu: pinned pool: classes %d..%d bytes do not fit MaxBytes %d", cfg.MinSize, cfg.MaxSize, cfg.MaxBytes)
	}
	p := &PinnedPool{
		sys:     s,
		cfg:     cfg,
		min:     bits.Len(uint(cfg.MinSize)) - 1,
		inUse:   map[*allocation]bool{},
		changed: make(chan struct{}),
	}
	p.idle = make([][]*allocation, bits.Len(uint(cfg.MaxSize))-p.min)
	return p, nil
}

// maxClassSize is the largest size class a pool can have: the largest
// power of two an int holds.
const maxClassSize = 1 << (bits.UintSize - 2)

// ceilPow2 returns the smallest power of two >= n; n must be at most
// maxClassSize.
func ceilPow2(n int) int {
	if n <= 1 {
		return 1
	}
	return 1 << bits.Len(uint(n-1))
}

// Config returns the pool's effective configuration.
func (p *PinnedPool) Config() PoolConfig { return p.cfg }

// class returns the size-class index and size for n bytes.
func (p *PinnedPool) class(n int) (int, int) {
	size := max(ceilPow2(n), p.cfg.MinSize)
	return bits.Len(uint(size)) - 1 - p.min, size
}

// Get returns a pinned Buffer of exactly n bytes (its allocation is the
// size class above n). It fails with ErrPoolExhausted when the pool is at
// MaxBytes and nothing idle fits.
func (p *PinnedPool) Get(n int) (Buffer, error) {
	b, _, err := p.tryGet(n)
	return b, err
}

// GetWait is Get that waits for room (a Put) when the pool is exhausted.
func (p *PinnedPool) GetWait(ctx context.Context, n int) (Buffer, error) {
	for {
		b, ch, err := p.tryGet(n)
		if ch == nil {
			return b, err
		}
		select {
		case <-ch:
		case <-ctx.Done():
			return Buffer{}, ctx.Err()
		}
	}
}

// tryGet returns a buffer, or (when exhausted) a channel closed when room
// may have been made (a Put, a failed allocation giving its reservation
// back, Close) together with ErrPoolExhausted.
func (p *PinnedPool) tryGet(n int) (Buffer, chan struct{}, error) {
	if n <= 0 || n > p.cfg.MaxSize {
		return Buffer{}, nil, fmt.Errorf("gpu: pinned pool: %d bytes outside 1..%d: %w", n, p.cfg.MaxSize, ErrOutOfBounds)
	}
	ci, size := p.class(n)
	p.mu.Lock()
	if p.closed {
		p.mu.Unlock()
		return Buffer{}, nil, fmt.Errorf("gpu: pinned pool: %w", ErrClosed)
	}
	if l := len(p.idle[ci]); l > 0 {
		a := p.idle[ci][l-1]
		p.idle[ci] = p.idle[ci][:l-1]
		p.inUse[a] = true
		p.mu.Unlock()
		return Buffer{a: a, ptr: a.base, n: n}, nil, nil
	}
	// Make room by dropping idle buffers of other classes.
	for p.held+size > p.cfg.MaxBytes && p.dropIdleLocked() {
	}
	if p.held+size > p.cfg.MaxBytes {
		ch := p.changed
		p.mu.Unlock()
		return Buffer{}, ch, fmt.Errorf("gpu: pinned pool: %d bytes held of %d, need %d: %w", p.held, p.cfg.MaxBytes, size, ErrPoolExhausted)
	}
	p.held += size
	p.mu.Unlock()

	b, err := p.sys.AllocHost(size)
	if err != nil {
		p.mu.Lock()
		p.held -= size
		// The room given back may be what a GetWait waits for.
		p.changedLocked()
		p.mu.Unlock()
		return Buffer{}, nil, err
	}
	p.sys.mu.Lock()
	b.a.pool = p
	p.sys.mu.Unlock()
	p.mu.Lock()
	p.inUse[b.a] = true
	p.mu.Unlock()
	return Buffer{a: b.a, ptr: b.a.base, n: n}, nil, nil
}

// dropIdleLocked frees one idle buffer (largest class first).
func (p *PinnedPool) dropIdleLocked() bool {
	for ci := len(p.idle) - 1; ci >= 0; ci-- {
		if l := len(p.idle[ci]); l > 0 {
			a := p.idle[ci][l-1]
			p.idle[ci] = p.idle[ci][:l-1]
			p.held -= a.size
			p.freeLocked(a)
			return true
		}
	}
	return false
}

// freeLocked hands a to the releaser goroutine, starting it if needed.
func (p *PinnedPool) freeLocked(a *allocation) {
	p.release = append(p.release, a)
	if p.releaseDone == nil {
		p.releaseDone = make(chan struct{})
		go p.releaser()
	}
}

// releaser frees the allocations let go until none is left.
func (p *PinnedPool) releaser() {
	for {
		p.mu.Lock()
		list := p.release
		p.release = nil
		if len(list) == 0 {
			close(p.releaseDone)
			p.releaseDone = nil
			p.mu.Unlock()
			return
		}
		p.mu.Unlock()
		for _, a := range list {
			p.sys.mu.Lock()
			a.pool = nil
			p.sys.mu.Unlock()
			_ = Free(Buffer{a: a, ptr: a.base, n: a.size})
		}
	}
}

// Put returns a Buffer obtained from Get (any slice of it with the same
// allocation is accepted). Putting a buffer twice or one from elsewhere is
// an error.
func (p *PinnedPool) Put(b Buffer) error {
	if b.a == nil {
		return ErrZeroBuffer
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	if !p.inUse[b.a] {
		return fmt.Errorf("gpu: pinned pool: Put of a buffer not from this pool or already returned: %w", ErrNotAllocation)
	}
	delete(p.inUse, b.a)
	ci, _ := p.class(b.a.size)
	if p.closed || len(p.idle[ci]) >= p.cfg.MaxIdlePerClass {
		p.held -= b.a.size
		p.freeLocked(b.a)
	} else {
		p.idle[ci] = append(p.idle[ci], b.a)
	}
	p.changedLocked()
	return nil
}

// changedLocked wakes the GetWait calls waiting for room in the pool.
func (p *PinnedPool) changedLocked() {
	close(p.changed)
	p.changed = make(chan struct{})
}

// Stats returns the bytes the pool holds, the buffers in use and idle.
func (p *PinnedPool) Stats() (heldBytes, inUse, idle int) {
	p.mu.Lock()
	defer p.mu.Unlock()
	for _, c := range p.idle {
		idle += len(c)
	}
	return p.held, len(p.inUse), idle
}

// Close frees idle buffers and waits until the buffers let go so far are
// freed; buffers in use are freed when Put.
func (p *PinnedPool) Close() error {
	p.mu.Lock()
	p.closed = true
	for p.dropIdleLocked() {
	}
	// Wake the GetWait calls waiting for a Put: they find the pool closed.
	p.changedLocked()
	done := p.releaseDone
	p.mu.Unlock()
	if done != nil {
		<-done
	}
	return nil
}
