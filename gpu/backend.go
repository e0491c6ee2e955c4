package gpu

import "context"

// devInfo describes one device of a backend.
type devInfo struct {
	name  string
	total uint64
}

// backend is what a memory backend implements. The front end (System,
// Device, Buffer, Stream, Event and the package functions) validates
// arguments — system, liveness, bounds, sizes, kinds, alignment — before it
// calls a backend, so backends only do the work.
type backend interface {
	name() string
	devices() ([]devInfo, error)
	memInfo(ord int) (free, total uint64, err error)

	// alloc and allocHost return an allocation with base, mem (when
	// host-accessible) and releaseFn set.
	alloc(ord int, n int, k Kind) (*allocation, error)
	allocHost(n int) (*allocation, error)

	newStream(ord int) (streamImpl, error)
	newEvent(ord int) (eventImpl, error)

	copy(dst, src Buffer) error
	memset(dst Buffer, v byte) error
	copyAsync(s streamImpl, dst, src Buffer) error
	memsetAsync(s streamImpl, dst Buffer, v byte) error
	writeValue64(s streamImpl, dst Buffer, v uint64) error
	waitValue64(s streamImpl, dst Buffer, v uint64, c Cond) error
	// launchHost enqueues a HostKernel over bufs (LaunchHost), or reports
	// ErrNotSupported.
	launchHost(s streamImpl, k HostKernel, bufs []Buffer) error
	// loadModule loads device code (Device.LoadModule), or reports
	// ErrNotSupported; launch enqueues one of its kernels (Launch).
	loadModule(ord int, image []byte) (moduleImpl, error)
	launch(s streamImpl, f funcImpl, dims [6]uint32, p kernelParams) error

	hostWrite64(dst Buffer, v uint64) error
	hostRead64(src Buffer) (uint64, error)
	hostWait64(ctx context.Context, src Buffer, v uint64, c Cond) error

	// pointerKind classifies a pointer the registry does not know; ok is
	// false when the backend cannot tell (then it is KindHost).
	pointerKind(p uintptr) (k Kind, ordinal int, ok bool)

	ipcGet(b Buffer) ([64]byte, error)
	ipcOpen(ord int, h [64]byte) (*allocation, error)
	ipcClose(a *allocation) error

	// abort releases blocked stream work (System.Close); wait waits for the
	// backend's goroutines to exit; close releases the backend.
	abort()
	wait()
	close() error
}

type streamImpl interface {
	synchronize() error
	query() (done bool, err error)
	waitEvent(e eventImpl) error
	destroy() error
}

type eventImpl interface {
	record(s streamImpl) error
	synchronize() error
	query() (done bool, err error)
	destroy() error
}
