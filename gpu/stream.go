package gpu

import (
	"context"
	"fmt"
	"sync/atomic"
)

// Stream is an ordered queue of asynchronous operations on a device, like a
// CUDA stream created with CU_STREAM_NON_BLOCKING: operations run in the
// order they were enqueued, enqueueing never waits for earlier work, and
// there is no implicit synchronization with other streams or with the
// synchronous functions (Copy, Memset).
type Stream struct {
	dev       *Device
	impl      streamImpl
	destroyed atomic.Bool
}

// NewStream creates a stream on the device.
func (d *Device) NewStream() (*Stream, error) {
	leave, err := d.sys.enter()
	if err != nil {
		return nil, err
	}
	defer leave()
	impl, err := d.sys.be.newStream(d.ord)
	if err != nil {
		return nil, err
	}
	st := &Stream{dev: d, impl: impl}
	d.sys.mu.Lock()
	d.sys.streams[st] = struct{}{}
	d.sys.mu.Unlock()
	return st, nil
}

// Device returns the stream's device.
func (s *Stream) Device() *Device { return s.dev }

func (s *Stream) check() error {
	if s == nil || s.dev == nil {
		return fmt.Errorf("gpu: nil or zero stream: %w", ErrDestroyed)
	}
	if err := s.dev.sys.check(); err != nil {
		return err
	}
	if s.destroyed.Load() {
		return fmt.Errorf("gpu: stream: %w", ErrDestroyed)
	}
	return nil
}

// Synchronize blocks until all work enqueued so far has completed and
// returns the first error the stream's work reported. Errors are sticky:
// as after a faulting kernel on a GPU, the work enqueued after a failed
// operation does not run (events recorded after it complete, reporting
// the error).
func (s *Stream) Synchronize() error {
	if err := s.check(); err != nil {
		return err
	}
	return s.impl.synchronize()
}

// Query reports whether all work enqueued so far has completed, without
// blocking.
func (s *Stream) Query() (bool, error) {
	if err := s.check(); err != nil {
		return false, err
	}
	return s.impl.query()
}

// WaitEvent makes all work enqueued on s after this call wait until the work
// captured by e's most recent Record has completed. It does not block the
// host. An event never recorded is complete.
func (s *Stream) WaitEvent(e *Event) error {
	if err := s.check(); err != nil {
		return err
	}
	if err := e.check(); err != nil {
		return err
	}
	if e.dev.sys != s.dev.sys {
		return ErrForeign
	}
	return s.impl.waitEvent(e.impl)
}

// Destroy releases the stream. Like cuStreamDestroy it returns at once; work
// already enqueued still runs. Further use of s reports ErrDestroyed.
func (s *Stream) Destroy() error {
	if s == nil || s.dev == nil || !s.destroyed.CompareAndSwap(false, true) {
		return fmt.Errorf("gpu: stream: %w", ErrDestroyed)
	}
	sys := s.dev.sys
	sys.mu.Lock()
	_, live := sys.streams[s]
	delete(sys.streams, s)
	sys.mu.Unlock()
	if !live { // System.Close destroyed it
		return nil
	}
	return s.impl.destroy()
}

// Event marks a point in a stream's work.
type Event struct {
	dev       *Device
	impl      eventImpl
	destroyed atomic.Bool
}

// NewEvent creates an event on the device.
func (d *Device) NewEvent() (*Event, error) {
	leave, err := d.sys.enter()
	if err != nil {
		return nil, err
	}
	defer leave()
	impl, err := d.sys.be.newEvent(d.ord)
	if err != nil {
		return nil, err
	}
	e := &Event{dev: d, impl: impl}
	d.sys.mu.Lock()
	d.sys.events[e] = struct{}{}
	d.sys.mu.Unlock()
	return e, nil
}

func (e *Event) check() error {
	if e == nil || e.dev == nil {
		return fmt.Errorf("gpu: nil or zero event: %w", ErrDestroyed)
	}
	if err := e.dev.sys.check(); err != nil {
		return err
	}
	if e.destroyed.Load() {
		return fmt.Errorf("gpu: event: %w", ErrDestroyed)
	}
	return nil
}

// Record captures the work enqueued on s so far; the event completes when
// that work has completed. Recording again replaces the captured point.
func (e *Event) Record(s *Stream) error {
	if err := e.check(); err != nil {
		return err
	}
	if err := s.check(); err != nil {
		return err
	}
	if e.dev.sys != s.dev.sys {
		return ErrForeign
	}
	return e.impl.record(s.impl)
}

// Synchronize blocks until the recorded work has completed, and returns
// the error of the stream's work up to that point if some failed.
func (e *Event) Synchronize() error {
	if err := e.check(); err != nil {
		return err
	}
	return e.impl.synchronize()
}

// Query reports whether the recorded work has completed, without blocking,
// with the error of that work if some failed.
func (e *Event) Query() (bool, error) {
	if err := e.check(); err != nil {
		return false, err
	}
	return e.impl.query()
}

// Destroy releases the event.
func (e *Event) Destroy() error {
	if e == nil || e.dev == nil || !e.destroyed.CompareAndSwap(false, true) {
		return fmt.Errorf("gpu: event: %w", ErrDestroyed)
	}
	sys := e.dev.sys
	sys.mu.Lock()
	_, live := sys.events[e]
	delete(sys.events, e)
	sys.mu.Unlock()
	if !live {
		return nil
	}
	return e.impl.destroy()
}

// checkPair validates a copy.
func checkPair(dst, src Buffer) error {
	if err := dst.valid(); err != nil {
		return fmt.Errorf("gpu: copy destination: %w", err)
	}
	if err := src.valid(); err != nil {
		return fmt.Errorf("gpu: copy source: %w", err)
	}
	if dst.a.sys != src.a.sys {
		return fmt.Errorf("gpu: copy between systems: %w", ErrForeign)
	}
	if dst.n != src.n {
		return fmt.Errorf("gpu: copy %d bytes into %d: %w", src.n, dst.n, ErrSizeMismatch)
	}
	return nil
}

func checkStream(s *Stream, bufs ...Buffer) error {
	if err := s.check(); err != nil {
		return err
	}
	for _, b := range bufs {
		if b.a != nil && b.a.sys != s.dev.sys {
			return fmt.Errorf("gpu: buffer and stream of different systems: %w", ErrForeign)
		}
	}
	return nil
}

// Copy copies src into dst (same length, any kinds) and returns when the
// bytes have landed. It is not ordered with any stream. On the cuda backend
// small copies between device and pinned memory may be done by the
// device's copy agent (agent.go) instead of the copy engine.
func Copy(dst, src Buffer) error {
	if err := checkPair(dst, src); err != nil {
		return err
	}
	if dst.n == 0 {
		return nil
	}
	if done, err := agentCopy(dst, src); done {
		return err
	}
	return dst.a.sys.be.copy(dst, src)
}

// CopyAsync enqueues a copy of src into dst (same length, any kinds) on s
// and returns at once. Neither buffer may be reused by the host until the
// copy has completed (Synchronize, or an Event recorded after it).
func CopyAsync(s *Stream, dst, src Buffer) error {
	if err := checkPair(dst, src); err != nil {
		return err
	}
	if err := checkStream(s, dst, src); err != nil {
		return err
	}
	if dst.n == 0 {
		return nil
	}
	return s.dev.sys.be.copyAsync(s.impl, dst, src)
}

// CopyToHost copies src (any kind) into Go memory dst; len(dst) must equal
// src.Len(). This is the way to read device memory from Go.
func CopyToHost(dst []byte, src Buffer) error {
	if err := src.valid(); err != nil {
		return err
	}
	return Copy(src.a.sys.HostBuffer(dst), src)
}

// CopyFromHost copies Go memory src into dst (any kind); len(src) must equal
// dst.Len().
func CopyFromHost(dst Buffer, src []byte) error {
	if err := dst.valid(); err != nil {
		return err
	}
	return Copy(dst, dst.a.sys.HostBuffer(src))
}

// Memset sets every byte of dst to v and returns when done.
func Memset(dst Buffer, v byte) error {
	if err := dst.valid(); err != nil {
		return err
	}
	if dst.n == 0 {
		return nil
	}
	return dst.a.sys.be.memset(dst, v)
}

// MemsetAsync enqueues a memset of dst on s. dst must be pinned, device or
// managed memory (not Go memory).
func MemsetAsync(s *Stream, dst Buffer, v byte) error {
	if err := dst.valid(); err != nil {
		return err
	}
	if err := checkStream(s, dst); err != nil {
		return err
	}
	if dst.a.kind == KindHost {
		return fmt.Errorf("gpu: MemsetAsync on Go memory: %w", ErrUnsupportedKind)
	}
	if dst.n == 0 {
		return nil
	}
	return s.dev.sys.be.memsetAsync(s.impl, dst, v)
}

// valueWord validates the 8-byte word at the start of b for a value
// operation and returns it.
func valueWord(b Buffer, streamOp bool) (Buffer, error) {
	if err := b.valid(); err != nil {
		return Buffer{}, err
	}
	if b.n < 8 {
		return Buffer{}, fmt.Errorf("gpu: value operation on %d-byte buffer: %w", b.n, ErrOutOfBounds)
	}
	if b.ptr%8 != 0 {
		return Buffer{}, fmt.Errorf("gpu: value operation at %#x: %w", b.ptr, ErrMisaligned)
	}
	if streamOp && b.a.kind == KindHost {
		return Buffer{}, fmt.Errorf("gpu: stream value operation on Go memory (use AllocHost or device memory): %w", ErrUnsupportedKind)
	}
	// cuda.h: "None of the operations accepts pointers to managed memory
	// buffers (cuMemAllocManaged)". The host backend refuses them too.
	if streamOp && b.a.kind == KindManaged {
		return Buffer{}, fmt.Errorf("gpu: stream value operation on managed memory (CUDA's stream memory operations refuse it; use AllocHost or device memory): %w", ErrUnsupportedKind)
	}
	return Buffer{a: b.a, ptr: b.ptr, n: 8}, nil
}

// WriteValue64 enqueues on s a 64-bit write of v to the first 8 bytes of
// addr (8-byte aligned; pinned or device memory: Go and managed memory are
// refused with ErrUnsupportedKind, as CUDA's stream memory operations refuse
// managed memory). The write happens when the stream reaches it, after all
// earlier work on s has completed.
func WriteValue64(s *Stream, addr Buffer, v uint64) error {
	w, err := valueWord(addr, true)
	if err != nil {
		return err
	}
	if err := checkStream(s, w); err != nil {
		return err
	}
	return s.dev.sys.be.writeValue64(s.impl, w, v)
}

// WaitValue64 enqueues on s a wait until the 64-bit word at addr satisfies
// cond against v; work enqueued on s afterwards does not start before the
// condition holds. The host is not blocked. addr is as for WriteValue64:
// pinned or device memory, 8-byte aligned.
func WaitValue64(s *Stream, addr Buffer, v uint64, cond Cond) error {
	if !cond.valid() {
		return fmt.Errorf("gpu: WaitValue64: invalid condition %v", cond)
	}
	w, err := valueWord(addr, true)
	if err != nil {
		return err
	}
	if err := checkStream(s, w); err != nil {
		return err
	}
	return s.dev.sys.be.waitValue64(s.impl, w, v, cond)
}

// WriteValue64Host stores v into the 64-bit word at addr from the host, now
// (an atomic store for host-accessible memory), and wakes stream and host
// waiters. It is how a host agent, for example a progress engine, signals a
// completion counter that streams wait on.
func WriteValue64Host(addr Buffer, v uint64) error {
	w, err := valueWord(addr, false)
	if err != nil {
		return err
	}
	return w.a.sys.be.hostWrite64(w, v)
}

// ReadValue64 loads the 64-bit word at addr from the host, now.
func ReadValue64(addr Buffer) (uint64, error) {
	w, err := valueWord(addr, false)
	if err != nil {
		return 0, err
	}
	return w.a.sys.be.hostRead64(w)
}

// WaitValue64Host blocks the calling goroutine until the 64-bit word at addr
// satisfies cond against v, ctx is done or the system is closed. The host
// backend sleeps until a write wakes it; the cuda backend polls with a
// growing back-off (a stream write is invisible to the host otherwise).
func WaitValue64Host(ctx context.Context, addr Buffer, v uint64, cond Cond) error {
	if !cond.valid() {
		return fmt.Errorf("gpu: WaitValue64Host: invalid condition %v", cond)
	}
	w, err := valueWord(addr, false)
	if err != nil {
		return err
	}
	return w.a.sys.be.hostWait64(ctx, w, v, cond)
}
