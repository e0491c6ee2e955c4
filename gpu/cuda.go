//go:build cgo && linux

package gpu

import (
	"context"
	"errors"
	"fmt"
	"runtime"
	"sync"
	"sync/atomic"
	"time"
	"unsafe"
)

// cudaBackend implements the model with the CUDA driver API (cuda_loader.go).
type cudaBackend struct {
	l    *cuLib
	devs []cudaDev

	abortCh   chan struct{}
	abortOnce sync.Once

	// draining counts the goroutines holding the Go memory of destroyed
	// streams until their work has completed (cudaStream.destroy).
	draining sync.WaitGroup
}

type cudaDev struct {
	dev   cuDevice
	ctx   cuContext
	name  string
	total uint64
}

func openCUDA() (backend, error) {
	l, err := loadCUDA()
	if err != nil {
		return nil, err
	}
	n, err := l.deviceCount()
	if err != nil {
		return nil, err
	}
	if n == 0 {
		return nil, errors.New("gpu: cuda: cuDeviceGetCount: no CUDA device")
	}
	b := &cudaBackend{l: l, abortCh: make(chan struct{})}
	for i := range n {
		var d cudaDev
		if d.dev, err = l.deviceGet(i); err == nil {
			if d.name, err = l.deviceName(d.dev); err == nil {
				if d.total, err = l.deviceTotalMem(d.dev); err == nil {
					d.ctx, err = l.primaryCtxRetain(d.dev)
				}
			}
		}
		if err != nil {
			_ = b.close()
			return nil, fmt.Errorf("gpu: cuda: device %d: %w", i, err)
		}
		b.devs = append(b.devs, d)
	}
	return b, nil
}

// cudaDriverCheck loads and initialises the driver and counts devices,
// creating no context.
func cudaDriverCheck() error {
	l, err := loadCUDA()
	if err != nil {
		return err
	}
	n, err := l.deviceCount()
	if err != nil {
		return err
	}
	if n == 0 {
		return errors.New("gpu: cuda: cuDeviceGetCount: no CUDA device")
	}
	return nil
}

func (b *cudaBackend) name() string { return BackendCUDA }

func (b *cudaBackend) devices() ([]devInfo, error) {
	out := make([]devInfo, len(b.devs))
	for i, d := range b.devs {
		out[i] = devInfo{name: d.name, total: d.total}
	}
	return out, nil
}

func (b *cudaBackend) memInfo(ord int) (uint64, uint64, error) {
	return b.l.memGetInfo(b.devs[ord].ctx)
}

// ctxOf returns the context to use for operations on buf (its device's, or
// device 0's for host memory).
func (b *cudaBackend) ctxOf(bufs ...Buffer) cuContext {
	for _, x := range bufs {
		if x.a != nil && x.a.dev != nil {
			return b.devs[x.a.dev.ord].ctx
		}
	}
	return b.devs[0].ctx
}

func (b *cudaBackend) alloc(ord int, n int, k Kind) (*allocation, error) {
	ctx := b.devs[ord].ctx
	var p uint64
	var err error
	switch k {
	case KindManaged:
		if !b.l.hasManaged() {
			return nil, fmt.Errorf("gpu: cuda: cuMemAllocManaged: %w by this driver", ErrNotSupported)
		}
		p, err = b.l.memAllocManaged(ctx, n)
	default:
		p, err = b.l.memAlloc(ctx, n)
	}
	if err != nil {
		return nil, err
	}
	return &allocation{base: uintptr(p), releaseFn: func() error { return b.l.memFree(ctx, p) }}, nil
}

func (b *cudaBackend) allocHost(n int) (*allocation, error) {
	ctx := b.devs[0].ctx
	mem, err := b.l.memHostAlloc(ctx, n)
	if err != nil {
		return nil, err
	}
	return &allocation{base: addrOf(mem), mem: mem, releaseFn: func() error { return b.l.memFreeHost(ctx, mem) }}, nil
}

func (b *cudaBackend) copy(dst, src Buffer) error {
	if dst.a.mem != nil && src.a.mem != nil {
		copy(dst.view(), src.view())
		return nil
	}
	err := b.l.memcpy(b.ctxOf(dst, src), uint64(dst.ptr), uint64(src.ptr), dst.n)
	runtime.KeepAlive(dst.a)
	runtime.KeepAlive(src.a)
	return err
}

func (b *cudaBackend) memset(dst Buffer, v byte) error {
	if dst.a.mem != nil {
		fill(dst.view(), v)
		return nil
	}
	return b.l.memsetD8(b.ctxOf(dst), uint64(dst.ptr), v, dst.n)
}

func (b *cudaBackend) copyAsync(si streamImpl, dst, src Buffer) error {
	s := si.(*cudaStream)
	return s.enqueue(func() error {
		return b.l.memcpyAsync(s.ctx, uint64(dst.ptr), uint64(src.ptr), dst.n, s.s)
	}, dst, src)
}

func (b *cudaBackend) memsetAsync(si streamImpl, dst Buffer, v byte) error {
	s := si.(*cudaStream)
	return b.l.memsetD8Async(s.ctx, uint64(dst.ptr), v, dst.n, s.s)
}

func (b *cudaBackend) writeValue64(si streamImpl, dst Buffer, v uint64) error {
	s := si.(*cudaStream)
	return b.l.streamWriteValue64(s.ctx, s.s, uint64(dst.ptr), v)
}

// launchHost: the cuda backend runs no Go kernels, and it has no compiled
// device code of its own yet (LaunchHost).
func (b *cudaBackend) launchHost(streamImpl, HostKernel, []Buffer) error {
	return fmt.Errorf("gpu: cuda: launch: %w: %s", ErrNotSupported, errCUDAKernels)
}

// cudaModule is a loaded module with the context it was loaded in.
type cudaModule struct {
	b   *cudaBackend
	ctx cuContext
	m   cuModule
}

type cudaFunc struct {
	ctx cuContext
	f   cuFunction
}

func (b *cudaBackend) loadModule(ord int, image []byte) (moduleImpl, error) {
	ctx := b.devs[ord].ctx
	m, err := b.l.moduleLoad(ctx, image)
	if err != nil {
		return nil, err
	}
	return &cudaModule{b: b, ctx: ctx, m: m}, nil
}

func (m *cudaModule) function(name string) (funcImpl, error) {
	f, err := m.b.l.moduleFunction(m.ctx, m.m, name)
	if err != nil {
		return nil, err
	}
	return cudaFunc{ctx: m.ctx, f: f}, nil
}

func (m *cudaModule) unload() error { return m.b.l.moduleUnload(m.ctx, m.m) }

func (b *cudaBackend) launch(si streamImpl, fi funcImpl, dims [6]uint32, p kernelParams) error {
	s := si.(*cudaStream)
	f := fi.(cudaFunc)
	err := s.enqueue(func() error {
		return b.l.launch(f.ctx, f.f, dims, s.s, p.data, p.offs)
	}, p.bufs...)
	runtime.KeepAlive(p.bufs)
	return err
}

// Cond's values are CUstreamWaitValue_flags' (GEQ 0, EQ 1, AND 2, NOR 3).
func (b *cudaBackend) waitValue64(si streamImpl, dst Buffer, v uint64, c Cond) error {
	s := si.(*cudaStream)
	return b.l.streamWaitValue64(s.ctx, s.s, uint64(dst.ptr), v, uint32(c))
}

func (b *cudaBackend) hostWrite64(dst Buffer, v uint64) error {
	if dst.a.mem != nil {
		atomic.StoreUint64(word(dst), v)
		return nil
	}
	// v goes to the driver as a pointer (cgo keeps it in place), not as a
	// uintptr, which a stack growth before the C call would leave stale.
	return b.l.memcpyHtoD(b.ctxOf(dst), uint64(dst.ptr), unsafe.Pointer(&v), 8)
}

func (b *cudaBackend) hostRead64(src Buffer) (uint64, error) {
	if src.a.mem != nil {
		return atomic.LoadUint64(word(src)), nil
	}
	var v uint64
	err := b.l.memcpyDtoH(b.ctxOf(src), unsafe.Pointer(&v), uint64(src.ptr), 8)
	return v, err
}

// hostWait64 polls: the host cannot be notified of a stream's write.
func (b *cudaBackend) hostWait64(ctx context.Context, src Buffer, v uint64, c Cond) error {
	d := time.Microsecond
	for {
		cur, err := b.hostRead64(src)
		if err != nil {
			return err
		}
		if c.holds(cur, v) {
			return nil
		}
		t := time.NewTimer(d)
		select {
		case <-t.C:
		case <-ctx.Done():
			t.Stop()
			return ctx.Err()
		case <-b.abortCh:
			t.Stop()
			return fmt.Errorf("gpu: wait value: %w", ErrClosed)
		}
		d = min(2*d, time.Millisecond)
	}
}

func (b *cudaBackend) pointerKind(p uintptr) (Kind, int, bool) {
	mt, ord, managed, err := b.l.pointerMemoryType(b.devs[0].ctx, uint64(p))
	if err != nil {
		return KindHost, -1, false
	}
	switch {
	case managed || mt == cuMemoryTypeUnified:
		return KindManaged, ord, true
	case mt == cuMemoryTypeDevice:
		return KindDevice, ord, true
	case mt == cuMemoryTypeHost:
		return KindPinned, -1, true
	}
	return KindHost, -1, false
}

func (b *cudaBackend) ipcGet(buf Buffer) ([64]byte, error) {
	return b.l.ipcGetMemHandle(b.ctxOf(buf), uint64(buf.a.base))
}

func (b *cudaBackend) ipcOpen(ord int, h [64]byte) (*allocation, error) {
	ctx := b.devs[ord].ctx
	p, err := b.l.ipcOpenMemHandle(ctx, h)
	if err != nil {
		return nil, err
	}
	base, size, err := b.l.addressRange(ctx, p)
	if err != nil {
		_ = b.l.ipcCloseMemHandle(ctx, p)
		return nil, err
	}
	return &allocation{base: uintptr(base), size: int(size)}, nil
}

func (b *cudaBackend) ipcClose(a *allocation) error {
	return b.l.ipcCloseMemHandle(b.ctxOf(Buffer{a: a}), uint64(a.base))
}

func (b *cudaBackend) abort() { b.abortOnce.Do(func() { close(b.abortCh) }) }

// wait waits until the work of destroyed streams that uses Go memory has
// completed and that memory is released (cudaStream.destroy), so that
// System.Close releases no context under it.
func (b *cudaBackend) wait() { b.draining.Wait() }

func (b *cudaBackend) close() error {
	b.abort()
	var errs []error
	for _, d := range b.devs {
		if d.ctx != nil {
			errs = append(errs, b.l.primaryCtxRelease(d.dev))
		}
	}
	return errors.Join(errs...)
}

type cudaStream struct {
	b   *cudaBackend
	ctx cuContext
	s   cuStream

	// mu orders enqueueing work that uses Go memory (enqueue) with taking
	// marks: an operation enqueued before a mark was taken is ahead of the
	// mark in the stream.
	mu   sync.Mutex
	ops  uint64    // operations enqueued with enqueue
	kept []keptMem // Go memory used by them, oldest first
	dead bool      // destroyed: enqueue refuses work
}

// keptMem is Go memory that operation number op of a stream uses: it is
// kept alive until that operation is known to have completed.
type keptMem struct {
	a  *allocation
	op uint64
}

func (b *cudaBackend) newStream(ord int) (streamImpl, error) {
	ctx := b.devs[ord].ctx
	s, err := b.l.streamCreate(ctx)
	if err != nil {
		return nil, err
	}
	return &cudaStream{b: b, ctx: ctx, s: s}, nil
}

// enqueue runs f, which enqueues one operation using bufs on s, and keeps
// bufs' Go memory alive until the operation is known to have completed
// (release).
func (s *cudaStream) enqueue(f func() error, bufs ...Buffer) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.dead {
		return fmt.Errorf("gpu: stream: %w", ErrDestroyed)
	}
	s.ops++
	for _, x := range bufs {
		if x.a.goMem {
			s.kept = append(s.kept, keptMem{a: x.a, op: s.ops})
		}
	}
	return f()
}

// mark runs f (nil, or a call enqueueing a marker such as an event record)
// and returns the number of the last operation enqueued before it: once the
// stream's work up to the marker has completed, release(mark) may drop the
// memory kept for operations up to it.
func (s *cudaStream) mark(f func() error) (uint64, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	var err error
	if f != nil {
		err = f()
	}
	return s.ops, err
}

// release drops the Go memory kept for operations up to number op, which
// have completed.
func (s *cudaStream) release(op uint64) {
	s.mu.Lock()
	defer s.mu.Unlock()
	i := 0
	for i < len(s.kept) && s.kept[i].op <= op {
		i++
	}
	if i == 0 {
		return
	}
	n := copy(s.kept, s.kept[i:])
	clear(s.kept[n:])
	s.kept = s.kept[:n]
}

func (s *cudaStream) synchronize() error {
	m, _ := s.mark(nil)
	if err := s.b.l.streamSynchronize(s.ctx, s.s); err != nil {
		return err
	}
	s.release(m)
	return nil
}

func (s *cudaStream) query() (bool, error) {
	m, _ := s.mark(nil)
	idle, err := s.b.l.streamQuery(s.ctx, s.s)
	if idle && err == nil {
		s.release(m)
	}
	return idle, err
}

func (s *cudaStream) waitEvent(e eventImpl) error {
	return s.b.l.streamWaitEvent(s.ctx, s.s, e.(*cudaEvent).e)
}

// destroy destroys the stream at once, like cuStreamDestroy; the work
// already enqueued still runs. The Go memory kept for that work stays alive
// until it has completed: an event recorded after it is waited for by a
// goroutine (cuEventSynchronize on a CU_EVENT_BLOCKING_SYNC event sleeps in
// the driver), which then drops the memory. If the event cannot be made,
// destroy synchronizes the stream first.
func (s *cudaStream) destroy() error {
	s.mu.Lock()
	s.dead = true
	kept := s.kept
	s.kept = nil
	var ev cuEvent
	var errs []error
	if len(kept) > 0 {
		e, err := s.b.l.eventCreate(s.ctx, cuEventBlockingSync|cuEventDisableTiming)
		if err == nil {
			if err = s.b.l.eventRecord(s.ctx, e, s.s); err == nil {
				ev = e
			} else {
				_ = s.b.l.eventDestroy(s.ctx, e)
			}
		}
		if ev == nil {
			if serr := s.b.l.streamSynchronize(s.ctx, s.s); serr != nil {
				strand(kept)
				errs = append(errs, serr)
			}
			kept = nil
		}
	}
	s.mu.Unlock()
	if ev != nil {
		s.b.draining.Add(1)
		go s.drain(ev, kept)
	}
	errs = append(errs, s.b.l.streamDestroy(s.ctx, s.s))
	return errors.Join(errs...)
}

// drain keeps kept, the Go memory of a destroyed stream's work, alive until
// ev, recorded after that work, has completed, then drops it.
func (s *cudaStream) drain(ev cuEvent, kept []keptMem) {
	defer s.b.draining.Done()
	if err := s.b.l.eventSynchronize(s.ctx, ev); err != nil {
		strand(kept)
	}
	_ = s.b.l.eventDestroy(s.ctx, ev)
	runtime.KeepAlive(kept)
}

// stranded holds, for the life of the process, Go memory used by stream work
// whose completion the driver failed to report: it may still be running,
// and a leak is better than the collector reusing memory under a copy.
var stranded struct {
	sync.Mutex
	mem [][]keptMem
}

func strand(kept []keptMem) {
	stranded.Lock()
	stranded.mem = append(stranded.mem, kept)
	stranded.Unlock()
}

type cudaEvent struct {
	b   *cudaBackend
	ctx cuContext
	e   cuEvent

	// The stream and mark (cudaStream.mark) of the latest record, and how
	// many records there have been: when the event completes, the Go memory
	// its stream kept for the work before it is released.
	mu   sync.Mutex
	st   *cudaStream
	op   uint64
	recs uint64
}

func (b *cudaBackend) newEvent(ord int) (eventImpl, error) {
	ctx := b.devs[ord].ctx
	e, err := b.l.eventCreate(ctx, cuEventDisableTiming)
	if err != nil {
		return nil, err
	}
	return &cudaEvent{b: b, ctx: ctx, e: e}, nil
}

func (e *cudaEvent) record(si streamImpl) error {
	s := si.(*cudaStream)
	e.mu.Lock()
	defer e.mu.Unlock()
	op, err := s.mark(func() error { return e.b.l.eventRecord(e.ctx, e.e, s.s) })
	if err == nil {
		e.st, e.op = s, op
		e.recs++
	}
	return err
}

// recorded returns the latest record's stream, mark and number.
func (e *cudaEvent) recorded() (*cudaStream, uint64, uint64) {
	e.mu.Lock()
	defer e.mu.Unlock()
	return e.st, e.op, e.recs
}

// completed releases the Go memory kept for the work before the record
// numbered recs, which has completed, unless the event has been recorded
// again since (the driver's answer may then be about the new record).
func (e *cudaEvent) completed(st *cudaStream, op, recs uint64) {
	e.mu.Lock()
	again := e.recs != recs
	e.mu.Unlock()
	if st != nil && !again {
		st.release(op)
	}
}

func (e *cudaEvent) synchronize() error {
	st, op, recs := e.recorded()
	if err := e.b.l.eventSynchronize(e.ctx, e.e); err != nil {
		return err
	}
	e.completed(st, op, recs)
	return nil
}

func (e *cudaEvent) query() (bool, error) {
	st, op, recs := e.recorded()
	done, err := e.b.l.eventQuery(e.ctx, e.e)
	if done && err == nil {
		e.completed(st, op, recs)
	}
	return done, err
}

func (e *cudaEvent) destroy() error { return e.b.l.eventDestroy(e.ctx, e.e) }
