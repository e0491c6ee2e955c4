package gpu

import (
	"context"
	"fmt"
	"os"
	"strconv"
	"sync"
	"sync/atomic"
	"syscall"
	"unsafe"
)

// EnvHostDevices sets how many devices the host backend emulates (default 1).
const EnvHostDevices = "TROUPE_GPU_HOST_DEVICES"

// hostBackend emulates devices with host memory allocated off the Go heap
// and streams with one goroutine each.
type hostBackend struct {
	ndev int

	abortCh   chan struct{}
	abortOnce sync.Once
	wg        sync.WaitGroup

	bus       valueBus
	allocated atomic.Int64
}

func newHostBackend() *hostBackend {
	n := 1
	if v, err := strconv.Atoi(os.Getenv(EnvHostDevices)); err == nil && v > 0 && v <= 64 {
		n = v
	}
	return &hostBackend{ndev: n, abortCh: make(chan struct{}), bus: valueBus{ch: make(chan struct{})}}
}

func (h *hostBackend) name() string { return BackendHost }

func (h *hostBackend) devices() ([]devInfo, error) {
	_, total := sysMem()
	out := make([]devInfo, h.ndev)
	for i := range out {
		out[i] = devInfo{name: "troupe host device", total: total}
	}
	return out, nil
}

func sysMem() (free, total uint64) {
	var si syscall.Sysinfo_t
	if syscall.Sysinfo(&si) != nil {
		return 0, 0
	}
	u := uint64(si.Unit)
	if u == 0 {
		u = 1
	}
	return uint64(si.Freeram) * u, uint64(si.Totalram) * u
}

func (h *hostBackend) memInfo(int) (uint64, uint64, error) {
	free, total := sysMem()
	return free, total, nil
}

// mapAnon allocates n bytes of zeroed memory outside the Go heap: stable
// addresses usable by UCX and by code packing raw memory.
func (h *hostBackend) mapAnon(n int, what string) (*allocation, error) {
	page := syscall.Getpagesize()
	size := (n + page - 1) / page * page
	m, err := syscall.Mmap(-1, 0, size, syscall.PROT_READ|syscall.PROT_WRITE, syscall.MAP_PRIVATE|syscall.MAP_ANON)
	if err != nil {
		return nil, fmt.Errorf("gpu: host: mmap %d bytes for %s: %w", size, what, err)
	}
	h.allocated.Add(int64(size))
	a := &allocation{base: addrOf(m), mem: m[:n:n]}
	a.releaseFn = func() error {
		h.allocated.Add(-int64(size))
		if err := syscall.Munmap(m); err != nil {
			return fmt.Errorf("gpu: host: munmap: %w", err)
		}
		return nil
	}
	return a, nil
}

func (h *hostBackend) alloc(_ int, n int, k Kind) (*allocation, error) {
	return h.mapAnon(n, k.String()+" memory")
}

func (h *hostBackend) allocHost(n int) (*allocation, error) {
	return h.mapAnon(n, "pinned memory")
}

// hold acquires the allocations of bufs for an operation.
func hold(bufs ...Buffer) ([]*allocation, error) {
	held := make([]*allocation, 0, len(bufs))
	for _, b := range bufs {
		if err := b.a.acquire(); err != nil {
			for _, a := range held {
				a.release()
			}
			return nil, fmt.Errorf("gpu: %s buffer at %#x: %w", b.a.kind, b.ptr, err)
		}
		held = append(held, b.a)
	}
	return held, nil
}

func unhold(held []*allocation) {
	for _, a := range held {
		a.release()
	}
}

func word(b Buffer) *uint64 { return (*uint64)(unsafe.Pointer(&b.view()[0])) }

func fill(p []byte, v byte) {
	if v == 0 {
		clear(p)
		return
	}
	if len(p) == 0 {
		return
	}
	p[0] = v
	for n := 1; n < len(p); n *= 2 {
		copy(p[n:], p[:n])
	}
}

func (h *hostBackend) copy(dst, src Buffer) error {
	held, err := hold(dst, src)
	if err != nil {
		return err
	}
	copy(dst.view(), src.view())
	unhold(held)
	h.bus.notify()
	return nil
}

func (h *hostBackend) memset(dst Buffer, v byte) error {
	held, err := hold(dst)
	if err != nil {
		return err
	}
	fill(dst.view(), v)
	unhold(held)
	h.bus.notify()
	return nil
}

func (h *hostBackend) copyAsync(s streamImpl, dst, src Buffer) error {
	return s.(*hostStream).enqueue(func(<-chan struct{}) error {
		copy(dst.view(), src.view())
		h.bus.notify()
		return nil
	}, dst, src)
}

func (h *hostBackend) memsetAsync(s streamImpl, dst Buffer, v byte) error {
	return s.(*hostStream).enqueue(func(<-chan struct{}) error {
		fill(dst.view(), v)
		h.bus.notify()
		return nil
	}, dst)
}

func (h *hostBackend) writeValue64(s streamImpl, dst Buffer, v uint64) error {
	return s.(*hostStream).enqueue(func(<-chan struct{}) error {
		atomic.StoreUint64(word(dst), v)
		h.bus.notify()
		return nil
	}, dst)
}

func (h *hostBackend) waitValue64(s streamImpl, dst Buffer, v uint64, c Cond) error {
	return s.(*hostStream).enqueue(func(abort <-chan struct{}) error {
		return h.bus.wait(word(dst), v, c, abort, nil, nil)
	}, dst)
}

func (h *hostBackend) hostWrite64(dst Buffer, v uint64) error {
	held, err := hold(dst)
	if err != nil {
		return err
	}
	atomic.StoreUint64(word(dst), v)
	unhold(held)
	h.bus.notify()
	return nil
}

func (h *hostBackend) hostRead64(src Buffer) (uint64, error) {
	held, err := hold(src)
	if err != nil {
		return 0, err
	}
	v := atomic.LoadUint64(word(src))
	unhold(held)
	return v, nil
}

func (h *hostBackend) hostWait64(ctx context.Context, src Buffer, v uint64, c Cond) error {
	held, err := hold(src)
	if err != nil {
		return err
	}
	defer unhold(held)
	return h.bus.wait(word(src), v, c, h.abortCh, ctx.Done(), ctx.Err)
}

func (h *hostBackend) pointerKind(uintptr) (Kind, int, bool) { return KindHost, -1, false }

func (h *hostBackend) ipcGet(Buffer) ([64]byte, error) {
	return [64]byte{}, fmt.Errorf("gpu: host backend: IPC handles: %w (use UCX between processes)", ErrNotSupported)
}

func (h *hostBackend) ipcOpen(int, [64]byte) (*allocation, error) {
	return nil, fmt.Errorf("gpu: host backend: IPC handles: %w (use UCX between processes)", ErrNotSupported)
}

func (h *hostBackend) ipcClose(*allocation) error { return ErrNotSupported }

func (h *hostBackend) abort() { h.abortOnce.Do(func() { close(h.abortCh) }) }
func (h *hostBackend) wait()  { h.wg.Wait() }
func (h *hostBackend) close() error {
	h.abort()
	h.wg.Wait()
	return nil
}

// valueBus wakes goroutines waiting for a 64-bit word to satisfy a
// condition. Every write through the backend calls notify; waiters re-check
// their word. No one spins.
type valueBus struct {
	mu      sync.Mutex
	waiters int
	ch      chan struct{} // closed and replaced by notify when waiters > 0
}

func (vb *valueBus) notify() {
	vb.mu.Lock()
	if vb.waiters > 0 {
		close(vb.ch)
		vb.ch = make(chan struct{})
	}
	vb.mu.Unlock()
}

// wait blocks until c holds for *p against v, abort is closed (ErrClosed) or
// done is closed (cause()).
func (vb *valueBus) wait(p *uint64, v uint64, c Cond, abort, done <-chan struct{}, cause func() error) error {
	vb.mu.Lock()
	vb.waiters++
	defer func() {
		vb.mu.Lock()
		vb.waiters--
		vb.mu.Unlock()
	}()
	for {
		ch := vb.ch
		vb.mu.Unlock()
		// A write that lands after this load closes ch: it notifies after
		// storing, and we registered before loading.
		if c.holds(atomic.LoadUint64(p), v) {
			return nil
		}
		select {
		case <-ch:
		case <-abort:
			return fmt.Errorf("gpu: wait value: %w", ErrClosed)
		case <-done:
			return cause()
		}
		vb.mu.Lock()
	}
}

// hostOp is one enqueued stream operation.
type hostOp struct {
	run  func(abort <-chan struct{}) error
	held []*allocation
	// mark, set for an event's record instead of run, is called with the
	// stream's sticky error, if any, when the work before it is done.
	mark func(streamErr error)
}

// hostStream runs its operations in order, one at a time: on its worker
// goroutine, or in the goroutine of a Synchronize that finds the worker
// idle and work queued (it would only wait for that work; running it
// itself saves two goroutine hand-offs, which cost more than a small copy
// or kernel). Either way the work is asynchronous to the host until a
// synchronization, as on a GPU.
type hostStream struct {
	h *hostBackend

	mu        sync.Mutex
	cond      *sync.Cond
	q         []hostOp
	enq, done uint64
	err       error // first error, sticky
	destroyed bool
	running   bool // an operation is being run (by the worker or a Synchronize)
}

func (h *hostBackend) newStream(int) (streamImpl, error) {
	s := &hostStream{h: h}
	s.cond = sync.NewCond(&s.mu)
	h.wg.Add(1)
	go s.worker()
	return s, nil
}

func (s *hostStream) enqueue(run func(abort <-chan struct{}) error, bufs ...Buffer) error {
	held, err := hold(bufs...)
	if err != nil {
		return err
	}
	return s.push(hostOp{run: run, held: held})
}

// enqueueMark enqueues an event's record and returns its position: the
// stream's done count once it has run.
func (s *hostStream) enqueueMark(mark func(streamErr error)) (uint64, error) {
	return s.pushAt(hostOp{mark: mark})
}

// push appends op to the stream's queue, or releases what it holds if the
// stream is destroyed.
func (s *hostStream) push(op hostOp) error {
	_, err := s.pushAt(op)
	return err
}

// pushAt is push, returning op's position.
func (s *hostStream) pushAt(op hostOp) (uint64, error) {
	s.mu.Lock()
	if s.destroyed {
		s.mu.Unlock()
		unhold(op.held)
		return 0, fmt.Errorf("gpu: stream: %w", ErrDestroyed)
	}
	s.q = append(s.q, op)
	s.enq++
	pos := s.enq
	s.cond.Broadcast()
	s.mu.Unlock()
	return pos, nil
}

func (s *hostStream) worker() {
	defer s.h.wg.Done()
	s.mu.Lock()
	defer s.mu.Unlock()
	for {
		switch {
		case len(s.q) > 0 && !s.running:
			s.runNext()
		case len(s.q) == 0 && s.destroyed:
			return
		default:
			s.cond.Wait()
		}
	}
}

// runNext runs the first queued operation; s.mu is held on entry and on
// return, released while the operation runs.
func (s *hostStream) runNext() {
	op := s.q[0]
	s.q[0] = hostOp{}
	s.q = s.q[1:]
	failed := s.err
	s.running = true
	s.mu.Unlock()

	// After a failure the rest of the stream's work is skipped, as a GPU
	// runs no more work after a faulting kernel; events still complete,
	// reporting the failure.
	var err error
	switch {
	case op.mark != nil:
		op.mark(failed)
	case failed == nil:
		err = op.run(s.h.abortCh)
	}
	unhold(op.held)

	s.mu.Lock()
	s.running = false
	s.done++
	if err != nil && s.err == nil {
		s.err = err
	}
	s.cond.Broadcast()
}

// help runs queued operations in the caller's goroutine, while the worker
// is not running one, until the operation at position pos has run; it
// returns early, without waiting, when the worker is busy.
func (s *hostStream) help(pos uint64) {
	s.mu.Lock()
	defer s.mu.Unlock()
	for s.done < pos && len(s.q) > 0 && !s.running {
		s.runNext()
	}
}

// synchronize waits for the work enqueued so far, running it itself while
// the worker is not running any.
func (s *hostStream) synchronize() error {
	s.mu.Lock()
	defer s.mu.Unlock()
	target := s.enq
	for s.done < target {
		if len(s.q) > 0 && !s.running {
			s.runNext()
			continue
		}
		s.cond.Wait()
	}
	return s.err
}

func (s *hostStream) query() (bool, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.done == s.enq, s.err
}

func (s *hostStream) waitEvent(e eventImpl) error {
	m := e.(*hostEvent).current()
	if m == nil {
		return nil
	}
	return s.enqueue(func(abort <-chan struct{}) error {
		select {
		case <-m.done:
			return nil
		case <-abort:
			return fmt.Errorf("gpu: stream wait event: %w", ErrClosed)
		}
	})
}

func (s *hostStream) destroy() error {
	s.mu.Lock()
	s.destroyed = true
	s.cond.Broadcast()
	s.mu.Unlock()
	return nil
}

// hostEvent holds the mark of its latest Record.
type hostEvent struct {
	h   *hostBackend
	mu  sync.Mutex
	cur *hostMark
}

// hostMark is the point of a stream an event recorded: done is closed when
// the work before it has completed, err is then the stream's error.
type hostMark struct {
	done chan struct{}
	err  error
	s    *hostStream // the recording stream, and the mark's position in it
	pos  uint64
}

func (h *hostBackend) newEvent(int) (eventImpl, error) { return &hostEvent{h: h}, nil }

func (e *hostEvent) current() *hostMark {
	e.mu.Lock()
	defer e.mu.Unlock()
	return e.cur
}

func (e *hostEvent) record(si streamImpl) error {
	hs := si.(*hostStream)
	m := &hostMark{done: make(chan struct{}), s: hs}
	pos, err := hs.enqueueMark(func(streamErr error) {
		m.err = streamErr
		close(m.done)
	})
	if err != nil {
		return err
	}
	m.pos = pos
	e.mu.Lock()
	e.cur = m
	e.mu.Unlock()
	return nil
}

func (e *hostEvent) synchronize() error {
	m := e.current()
	if m == nil {
		return nil
	}
	// As a stream's Synchronize does: run the work up to the mark here
	// while the stream's goroutine is idle.
	m.s.help(m.pos)
	select {
	case <-m.done:
		return m.err
	case <-e.h.abortCh:
		return fmt.Errorf("gpu: event synchronize: %w", ErrClosed)
	}
}

func (e *hostEvent) query() (bool, error) {
	m := e.current()
	if m == nil {
		return true, nil
	}
	select {
	case <-m.done:
		return true, m.err
	default:
		return false, nil
	}
}

func (e *hostEvent) destroy() error { return nil }
