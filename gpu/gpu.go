// Package gpu is troupe's memory model: devices, buffers (zero-copy
// references to host, pinned, device or managed memory), streams, events,
// stream memory operations (WriteValue64/WaitValue64), copies, memset,
// a pinned host buffer pool and pointer-kind detection.
//
// Two backends implement the model behind one internal interface:
//
//   - "host": always available. Device memory is host memory allocated off
//     the Go heap (mmap) and reachable only through this API; streams are
//     ordered executors with CUDA's semantics.
//   - "cuda": the CUDA driver API, loaded at run time with
//     dlopen("libcuda.so.1"); no CUDA toolkit is needed to build.
//
// Open picks the backend (TROUPE_GPU=auto|host|cuda overrides). See
// docs/gpu.md for the semantics and how they compare with CUDA.
//
// The package imports nothing of troupe.
package gpu

import (
	"errors"
	"fmt"
	"os"
	"strings"
	"sync"
	"sync/atomic"
	"time"
)

// EnvBackend names the environment variable that selects the backend:
// "auto" (or empty), "host" or "cuda".
const EnvBackend = "TROUPE_GPU"

// EnvCUDALibrary overrides the path of the CUDA driver library the cuda
// backend loads (default "libcuda.so.1", found by the dynamic loader).
const EnvCUDALibrary = "TROUPE_CUDA_LIBRARY"

// Backend names.
const (
	BackendHost = "host"
	BackendCUDA = "cuda"
)

// Errors returned by the package. Errors wrap these sentinels; test with
// errors.Is.
var (
	ErrClosed          = errors.New("gpu: system closed")
	ErrFreed           = errors.New("gpu: use of freed buffer")
	ErrOutOfBounds     = errors.New("gpu: out of bounds")
	ErrSizeMismatch    = errors.New("gpu: buffer sizes differ")
	ErrZeroBuffer      = errors.New("gpu: zero Buffer")
	ErrNotHostMemory   = errors.New("gpu: buffer is not host-accessible through a Go slice (use CopyToHost)")
	ErrUnsupportedKind = errors.New("gpu: operation not supported for this memory kind")
	ErrMisaligned      = errors.New("gpu: address not 8-byte aligned")
	ErrNotAllocation   = errors.New("gpu: not the base of an allocation made by this system")
	ErrForeign         = errors.New("gpu: object belongs to another system")
	ErrDestroyed       = errors.New("gpu: stream or event destroyed")
	ErrPoolExhausted   = errors.New("gpu: pinned pool exhausted")
	ErrNotSupported    = errors.New("gpu: not supported by this backend")
	ErrUnknownPointer  = errors.New("gpu: pointer not known to this system")
	ErrUnavailable     = errors.New("gpu: backend unavailable")
)

// CUDAError is a failed driver call.
type CUDAError struct {
	Call   string // the driver entry point, e.g. "cuMemAlloc_v2"
	Result int    // the CUresult
	Name   string // cuGetErrorName, when available
	Text   string // cuGetErrorString, when available
}

func (e *CUDAError) Error() string {
	s := fmt.Sprintf("gpu: cuda: %s failed: CUresult %d", e.Call, e.Result)
	if e.Name != "" {
		s += " (" + e.Name
		if e.Text != "" {
			s += ": " + e.Text
		}
		s += ")"
	}
	return s
}

// cudaErrorNotSupported is CUDA_ERROR_NOT_SUPPORTED.
const cudaErrorNotSupported = 801

// Is makes a driver call that failed with CUDA_ERROR_NOT_SUPPORTED (801),
// for example a stream memory operation the device does not support, match
// ErrNotSupported, like the package's own refusals.
func (e *CUDAError) Is(target error) bool {
	return target == ErrNotSupported && e.Result == cudaErrorNotSupported
}

// Kind is the kind of memory a pointer refers to.
type Kind uint8

const (
	// KindHost is ordinary (pageable) host memory, for example Go memory.
	KindHost Kind = iota
	// KindPinned is page-locked host memory allocated through the backend
	// (AllocHost); host-accessible and usable by stream operations.
	KindPinned
	// KindDevice is device memory; never exposed as a Go slice.
	KindDevice
	// KindManaged is unified (managed) memory; treated like device memory by
	// this API (read it with explicit copies).
	KindManaged
)

func (k Kind) String() string {
	switch k {
	case KindHost:
		return "host"
	case KindPinned:
		return "pinned"
	case KindDevice:
		return "device"
	case KindManaged:
		return "managed"
	}
	return fmt.Sprintf("Kind(%d)", uint8(k))
}

// HostAccessible reports whether memory of this kind may be viewed as a Go
// slice (Buffer.Bytes).
func (k Kind) HostAccessible() bool { return k == KindHost || k == KindPinned }

// Cond is the condition of a WaitValue64, with CUDA's meanings.
type Cond uint8

const (
	// GEQ waits until (int64)(*addr - value) >= 0 (wrap-around aware).
	GEQ Cond = iota
	// EQ waits until *addr == value.
	EQ
	// AND waits until (*addr & value) != 0.
	AND
	// NOR waits until ^(*addr | value) != 0.
	NOR
)

func (c Cond) String() string {
	switch c {
	case GEQ:
		return "GEQ"
	case EQ:
		return "EQ"
	case AND:
		return "AND"
	case NOR:
		return "NOR"
	}
	return fmt.Sprintf("Cond(%d)", uint8(c))
}

func (c Cond) holds(cur, v uint64) bool {
	switch c {
	case GEQ:
		return int64(cur-v) >= 0
	case EQ:
		return cur == v
	case AND:
		return cur&v != 0
	case NOR:
		return ^(cur | v) != 0
	}
	return false
}

func (c Cond) valid() bool { return c <= NOR }

// System is one opened backend with its devices, allocations and streams.
// All methods are safe for concurrent use.
type System struct {
	be      backend
	devices []*Device

	closed atomic.Bool
	// life admits the creation of streams, events and allocations
	// (enter); Close waits for those admitted, so that everything it must
	// release is registered by the time it looks, and admits none after.
	life sync.RWMutex

	// ipcMu makes the driver's mapping and unmapping of IPC handles one at
	// a time (cuIpcOpenMemHandle maps a handle once per context, and
	// fails with CUDA_ERROR_ALREADY_MAPPED while a mapping of it is still
	// there, being closed or being opened by another goroutine). Taken
	// before mu. ipcOpening counts the IPCOpen calls that wait for it or
	// hold it to map (for tests).
	ipcMu      sync.Mutex
	ipcOpening atomic.Int32

	mu      sync.Mutex
	reg     registry
	kcache  kindCache
	streams map[*Stream]struct{}
	events  map[*Event]struct{}
	ipc     map[ipcKey]*ipcMapping
	// ipcStats counts IPC mappings (Open and Refs are computed).
	ipcStats IPCStats

	agentOn    bool          // copy agents may run (agent.go)
	agentIdle  time.Duration // how long an idle agent stays resident
	agentStats agentStats
}

// Open opens the backend selected by TROUPE_GPU (auto when unset).
func Open() (*System, error) {
	return OpenBackend(os.Getenv(EnvBackend))
}

// OpenBackend opens the named backend: "auto" or "" (cuda when the driver
// loads and a device exists, else host), "host" or "cuda". Asking for cuda
// where it is unavailable is an error naming the failing call.
func OpenBackend(name string) (*System, error) {
	switch strings.ToLower(strings.TrimSpace(name)) {
	case "", "auto":
		if be, err := openCUDA(); err == nil {
			return newSystem(be)
		}
		return newSystem(newHostBackend())
	case BackendHost:
		return newSystem(newHostBackend())
	case BackendCUDA:
		be, err := openCUDA()
		if err != nil {
			return nil, fmt.Errorf("%w: %s=cuda: %w", ErrUnavailable, EnvBackend, err)
		}
		return newSystem(be)
	}
	return nil, fmt.Errorf("gpu: %s=%q: want auto, host or cuda", EnvBackend, name)
}

// CUDAAvailable reports why the cuda backend cannot be used (nil when it
// can): the driver does not load, a call fails, or there is no device.
func CUDAAvailable() error {
	be, err := openCUDA()
	if err != nil {
		return err
	}
	return be.close()
}

// CUDADriverPresent reports why the CUDA driver cannot be used (nil when it
// can): it loads and initialises the driver (honouring TROUPE_CUDA_LIBRARY)
// and counts devices, but creates no context, so it is cheaper than
// CUDAAvailable on a GPU machine, where a context costs time and device
// memory. The cuda backend may still fail to open later (CUDAAvailable
// tells for sure).
func CUDADriverPresent() error {
	return cudaDriverCheck()
}

var (
	defaultOnce sync.Once
	defaultSys  *System
	defaultErr  error
)

// Default returns the process-wide System opened with Open on first use. It
// is never closed.
func Default() (*System, error) {
	defaultOnce.Do(func() { defaultSys, defaultErr = Open() })
	return defaultSys, defaultErr
}

func newSystem(be backend) (*System, error) {
	infos, err := be.devices()
	if err != nil {
		_ = be.close()
		return nil, err
	}
	s := &System{
		be:      be,
		streams: map[*Stream]struct{}{},
		events:  map[*Event]struct{}{},
		ipc:     map[ipcKey]*ipcMapping{},
	}
	s.kcache.init(defaultKindCacheSize)
	for i, in := range infos {
		d := &Device{sys: s, ord: i, name: in.name, total: in.total}
		d.agent.dev = d
		s.devices = append(s.devices, d)
	}
	s.agentOn = agentWanted(be.name())
	s.agentIdle = agentIdleTime()
	if s.agentOn {
		for _, d := range s.devices {
			d.agent.prepare()
		}
	}
	return s, nil
}

// Backend returns the backend name: "host" or "cuda".
func (s *System) Backend() string { return s.be.name() }

// Devices returns the devices of this system (at least one).
func (s *System) Devices() []*Device { return append([]*Device(nil), s.devices...) }

// Device returns the device with the given ordinal.
func (s *System) Device(ordinal int) (*Device, error) {
	if ordinal < 0 || ordinal >= len(s.devices) {
		return nil, fmt.Errorf("gpu: device %d: %w (have %d)", ordinal, ErrOutOfBounds, len(s.devices))
	}
	return s.devices[ordinal], nil
}

func (s *System) check() error {
	if s == nil {
		return ErrZeroBuffer
	}
	if s.closed.Load() {
		return ErrClosed
	}
	return nil
}

// enter admits the creation of a stream, an event or an allocation, which
// must be registered before the returned function is called; it fails once
// the system is closed.
func (s *System) enter() (leave func(), err error) {
	if err := s.check(); err != nil {
		return nil, err
	}
	s.life.RLock()
	if s.closed.Load() {
		s.life.RUnlock()
		return nil, ErrClosed
	}
	return s.life.RUnlock, nil
}

// Close destroys all streams and events (aborting work that has not run:
// stream waits are released, their streams report ErrClosed), waits for the
// backend's goroutines to exit and releases all memory allocated through the
// system. Buffers of the system must not be used afterwards (operations on
// them report ErrClosed). Transfers that hold raw pointers into its memory
// (a transport's receive or queue operation in flight) must have ended
// first, as with cudaFree under a running RDMA: close transports before
// the System.
func (s *System) Close() error {
	if s == nil || !s.closed.CompareAndSwap(false, true) {
		return nil
	}
	s.life.Lock() // creations admitted before closed was set are done
	s.life.Unlock()
	var errs []error
	for _, d := range s.devices {
		if err := d.agent.stop(); err != nil {
			errs = append(errs, err)
		}
	}
	s.mu.Lock()
	streams := make([]*Stream, 0, len(s.streams))
	for st := range s.streams {
		streams = append(streams, st)
	}
	events := make([]*Event, 0, len(s.events))
	for ev := range s.events {
		events = append(events, ev)
	}
	s.streams = map[*Stream]struct{}{}
	s.events = map[*Event]struct{}{}
	ipcs := make([]*ipcMapping, 0, len(s.ipc))
	for _, m := range s.ipc {
		ipcs = append(ipcs, m)
	}
	s.ipc = map[ipcKey]*ipcMapping{}
	s.ipcStats.Closed += uint64(len(ipcs))
	allocs := s.reg.all()
	s.reg = registry{}
	s.kcache.clear()
	s.mu.Unlock()

	s.be.abort()
	for _, st := range streams {
		if err := st.impl.destroy(); err != nil {
			errs = append(errs, err)
		}
	}
	for _, ev := range events {
		if err := ev.impl.destroy(); err != nil {
			errs = append(errs, err)
		}
	}
	for _, m := range ipcs {
		if err := s.be.ipcClose(m.alloc); err != nil {
			errs = append(errs, err)
		}
		m.alloc.freed.Store(true)
	}
	s.be.wait()
	for _, a := range allocs {
		if a.kind == KindDevice && a.ipc {
			continue
		}
		if err := a.free(); err != nil && !errors.Is(err, ErrFreed) {
			errs = append(errs, err)
		}
	}
	if err := s.be.close(); err != nil {
		errs = append(errs, err)
	}
	return errors.Join(errs...)
}

// Device is one GPU (cuda backend) or one emulated device (host backend).
type Device struct {
	sys   *System
	ord   int
	name  string
	total uint64
	agent copyAgent
}

// System returns the system the device belongs to.
func (d *Device) System() *System { return d.sys }

// Ordinal returns the device's ordinal within its system.
func (d *Device) Ordinal() int { return d.ord }

// Name returns the device's name as the backend reports it.
func (d *Device) Name() string { return d.name }

// Backend returns the backend name of the device's system.
func (d *Device) Backend() string { return d.sys.be.name() }

// String describes the device.
func (d *Device) String() string {
	return fmt.Sprintf("%s:%d (%s)", d.sys.be.name(), d.ord, d.name)
}

// MemInfo returns the free and total device memory in bytes.
func (d *Device) MemInfo() (free, total uint64, err error) {
	if err := d.sys.check(); err != nil {
		return 0, 0, err
	}
	return d.sys.be.memInfo(d.ord)
}

// LiveAllocs returns the number of allocations of this device's memory
// (Alloc, AllocManaged; not IPC mappings) not yet freed: a leak check for
// code that allocates device memory on its users' behalf.
func (d *Device) LiveAllocs() int {
	d.sys.mu.Lock()
	defer d.sys.mu.Unlock()
	n := 0
	for _, a := range d.sys.reg.allocs {
		if a.dev == d && !a.ipc && (a.kind == KindDevice || a.kind == KindManaged) {
			n++
		}
	}
	return n
}

// Alloc allocates n bytes of device memory.
func (d *Device) Alloc(n int) (Buffer, error) { return d.alloc(n, KindDevice) }

// AllocManaged allocates n bytes of managed (unified) memory.
func (d *Device) AllocManaged(n int) (Buffer, error) { return d.alloc(n, KindManaged) }

func (d *Device) alloc(n int, k Kind) (Buffer, error) {
	leave, err := d.sys.enter()
	if err != nil {
		return Buffer{}, err
	}
	defer leave()
	if n <= 0 {
		return Buffer{}, fmt.Errorf("gpu: alloc %d bytes: %w", n, ErrOutOfBounds)
	}
	a, err := d.sys.be.alloc(d.ord, n, k)
	if err != nil {
		return Buffer{}, err
	}
	a.sys, a.dev, a.kind, a.size = d.sys, d, k, n
	d.sys.register(a)
	return Buffer{a: a, ptr: a.base, n: n}, nil
}

// AllocHost allocates n bytes of pinned host memory, zeroed (the driver
// reuses pinned memory a process freed, with its old contents). The memory
// is host-accessible (Buffer.Bytes) and usable by stream operations.
func (s *System) AllocHost(n int) (Buffer, error) {
	leave, err := s.enter()
	if err != nil {
		return Buffer{}, err
	}
	defer leave()
	if n <= 0 {
		return Buffer{}, fmt.Errorf("gpu: alloc host %d bytes: %w", n, ErrOutOfBounds)
	}
	a, err := s.be.allocHost(n)
	if err != nil {
		return Buffer{}, err
	}
	a.sys, a.kind, a.size = s, KindPinned, n
	s.register(a)
	b := Buffer{a: a, ptr: a.base, n: n}
	clear(b.view())
	return b, nil
}

// HostBuffer wraps Go memory as a KindHost Buffer of this system. The Buffer
// keeps b alive; b must not be resized. Stream operations on it must complete
// (Synchronize) before b is reused by Go code.
func (s *System) HostBuffer(b []byte) Buffer {
	if len(b) == 0 {
		return Buffer{a: &allocation{sys: s, kind: KindHost, goMem: true}}
	}
	a := &allocation{sys: s, kind: KindHost, mem: b, base: addrOf(b), size: len(b), goMem: true}
	return Buffer{a: a, ptr: a.base, n: len(b)}
}

// Free releases memory obtained from Alloc, AllocManaged or AllocHost. b must
// be the whole allocation (not a slice of it). Later operations on any Buffer
// of the allocation report ErrFreed. Work already enqueued on streams that
// uses the allocation still completes against valid memory: the host backend
// defers the release until that work has run, the cuda backend relies on the
// driver (cuMemFree/cuMemFreeHost wait for outstanding device work).
func Free(b Buffer) error {
	if b.a == nil {
		return ErrZeroBuffer
	}
	s := b.a.sys
	if err := s.check(); err != nil {
		return err
	}
	a := b.a
	if a.goMem || a.ipc || a.pool != nil {
		return fmt.Errorf("gpu: free %s buffer: %w", a.origin(), ErrNotAllocation)
	}
	if b.ptr != a.base || b.n != a.size {
		return fmt.Errorf("gpu: free of a slice at offset %d: %w", b.ptr-a.base, ErrNotAllocation)
	}
	s.mu.Lock()
	if a.freed.Load() {
		s.mu.Unlock()
		return fmt.Errorf("gpu: double free: %w", ErrFreed)
	}
	s.reg.remove(a)
	s.kcache.invalidate(a.base, a.size)
	s.mu.Unlock()
	err := a.free()
	// Again, now that the memory is gone: a KindOf while it was being
	// released asked the backend, which still had it, and cached that.
	s.mu.Lock()
	s.kcache.invalidate(a.base, a.size)
	s.mu.Unlock()
	return err
}

func (s *System) register(a *allocation) {
	s.mu.Lock()
	s.reg.add(a)
	s.kcache.invalidate(a.base, a.size)
	s.mu.Unlock()
}

// KindOf reports the kind of memory at ptr and its device (nil for host and
// pinned memory). Memory allocated through this system is found in its
// allocation registry; other pointers are asked of the backend (cuda:
// cuPointerGetAttribute); unknown pointers are KindHost. Results are cached
// per address; Alloc and Free invalidate the cache for their range.
func (s *System) KindOf(ptr uintptr) (Kind, *Device) {
	if s.check() != nil {
		return KindHost, nil
	}
	s.mu.Lock()
	if e, ok := s.kcache.get(ptr); ok {
		s.mu.Unlock()
		return e.kind, e.dev
	}
	gen := s.kcache.gen
	a := s.reg.find(ptr)
	s.mu.Unlock()
	kind, dev := KindHost, (*Device)(nil)
	if a != nil {
		kind, dev = a.kind, a.dev
	} else if k, ord, ok := s.be.pointerKind(ptr); ok {
		kind = k
		if ord >= 0 && ord < len(s.devices) && (k == KindDevice || k == KindManaged) {
			dev = s.devices[ord]
		}
	}
	s.mu.Lock()
	s.kcache.putIf(gen, ptr, kindEntry{kind: kind, dev: dev})
	s.mu.Unlock()
	return kind, dev
}

// KindCacheStats returns the number of KindOf cache hits and misses so far.
func (s *System) KindCacheStats() (hits, misses uint64) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.kcache.hits, s.kcache.misses
}

// BufferAt returns a Buffer for n bytes at ptr inside memory allocated
// through this system (Alloc, AllocHost, IPC mappings). It never
// dereferences ptr; a range not inside one live allocation is an error.
func (s *System) BufferAt(ptr uintptr, n int) (Buffer, error) {
	if err := s.check(); err != nil {
		return Buffer{}, err
	}
	s.mu.Lock()
	a := s.reg.find(ptr)
	s.mu.Unlock()
	if a == nil {
		return Buffer{}, fmt.Errorf("gpu: buffer at %#x: %w", ptr, ErrUnknownPointer)
	}
	whole := Buffer{a: a, ptr: a.base, n: a.size}
	return whole.Slice(int(ptr-a.base), n)
}
