package transport

import (
	"fmt"
	"sync/atomic"

	"github.com/troupe-hpc/troupe/datatype"
	"github.com/troupe-hpc/troupe/gpu"
)

// TypedStage is a layout in any memory kind (count elements of a datatype
// in a gpu.Buffer) together with a pinned host buffer that holds its packed
// bytes: what SendTypedBuffer and RecvTypedBuffer move through, for callers
// that send or receive those bytes by other means (the actor runtime's
// Typed fields in device memory). Pack fills Bytes from the layout, on the
// device by gpupack's kernels; Unpack writes Bytes back into it. Bytes are
// pinned host memory for a layout in device memory, Go memory for one in
// host-accessible memory. Bytes hold
// Count elements of Twin, the layout's packed twin (same type signature,
// elements back to back), so a typed send or receive of Twin moves them as
// one run. Release returns the staging buffer; a stage is not safe for
// concurrent use.
type TypedStage struct {
	Bytes []byte         // the packed bytes: Count elements of Twin
	Twin  *datatype.Type // the layout's packed twin
	Count int64          // elements

	t        *Transport
	e        *typedEnd
	k        stageKey
	stage    gpu.Buffer
	released atomic.Bool
}

// StageTyped checks count elements of dt whose origin is byte base of buf
// (any memory kind) and returns a stage for them whose Bytes are not yet
// filled. Errors wrap ErrInvalid for a bad layout or buffer.
func (t *Transport) StageTyped(buf gpu.Buffer, dt *datatype.Type, base, count int64) (*TypedStage, error) {
	const what = "typed stage"
	e, err := t.typedLayoutAt(what, buf, dt, base, count)
	if err != nil {
		return nil, err
	}
	return t.stageEnd(what, e)
}

// stageEnd returns a stage for the checked layout e.
func (t *Transport) stageEnd(what string, e *typedEnd) (*TypedStage, error) {
	twin, err := t.ctyped.twin(e.t)
	if err != nil {
		return nil, fmt.Errorf("%w: %s: %w", ErrInvalid, what, err)
	}
	s := &TypedStage{Twin: twin, Count: e.count, t: t, e: e}
	if e.size == 0 {
		s.Bytes = []byte{}
		return s, nil
	}
	if e.host != nil {
		// Host-accessible memory (Go memory has no device): staged in Go
		// memory, packed by datatype.
		s.Bytes = make([]byte, e.size)
		return s, nil
	}
	s.k = stageKey{dev: e.buf.Device(), n: int(e.size), pinned: true}
	if s.stage, s.Bytes, err = t.pinnedStage(s.k); err != nil {
		return nil, fmt.Errorf("transport: %s: staging buffer: %w", what, err)
	}
	return s, nil
}

// Pack packs the layout into Bytes and waits for it.
func (s *TypedStage) Pack() error {
	if err := s.usable(); err != nil || len(s.Bytes) == 0 {
		return err
	}
	return s.move(s.e, false)
}

// Unpack unpacks the whole elements of the first n bytes of Bytes into the
// layout (a message shorter than the stage fills the first elements) and
// waits for it.
func (s *TypedStage) Unpack(n int64) error {
	if err := s.usable(); err != nil {
		return err
	}
	if n < 0 || n > int64(len(s.Bytes)) {
		return fmt.Errorf("%w: typed stage: unpacking %d bytes of %d", ErrInvalid, n, len(s.Bytes))
	}
	if n == 0 {
		return nil
	}
	e := *s.e
	e.count = min(e.count, n/e.t.Size())
	return s.move(&e, true)
}

// move packs layout e into Bytes or unpacks Bytes into it.
func (s *TypedStage) move(e *typedEnd, unpack bool) error {
	if !s.stage.IsZero() {
		return s.t.ctyped.deviceMove(e, s.stage, unpack)
	}
	s.t.ctyped.stats.host.Add(1)
	var err error
	if unpack {
		_, err = e.t.Unpack(e.host, s.Bytes, e.base, e.count)
	} else {
		_, err = e.t.Pack(s.Bytes, e.host, e.base, e.count)
	}
	return err
}

// usable reports a released stage.
func (s *TypedStage) usable() error {
	if s.released.Load() {
		return fmt.Errorf("%w: typed stage used after Release", ErrInvalid)
	}
	return nil
}

// Release gives the staging buffer back; Bytes must not be used after it.
// A second Release does nothing.
func (s *TypedStage) Release() {
	if s.released.Swap(true) || s.stage.IsZero() {
		return
	}
	s.t.ctyped.unstage(s.k, s.stage)
}
