package transport

import (
	"fmt"
	"sync"
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
// one run. A typed transfer given the stage (TypedOptions.Stage) packs or
// unpacks it itself, piece by piece as its chunks travel. Release returns
// the staging buffer; a stage is not safe for concurrent use.
type TypedStage struct {
	Bytes []byte         // the packed bytes: Count elements of Twin
	Twin  *datatype.Type // the layout's packed twin
	Count int64          // elements

	t        *Transport
	e        *typedEnd
	k        stageKey
	stage    gpu.Buffer
	released atomic.Bool

	// A typed transfer that carries the stage (TypedOptions.Stage) moves
	// it piece by piece: a send packs range after range on st, an event
	// after each (pending, oldest first; Bytes[:packed] are done); a
	// receive enqueues the unpack of each range as it lands (unpacking)
	// and settles once at the end. err is a piece's first failure.
	// mu orders fill with readsDone, the one call from another goroutine,
	// which reads only what fill sets under mu (filling, fillSt), never st,
	// which the send's ready changes without mu.
	mu        sync.Mutex
	filling   bool        // fill has run
	prefilled bool        // readsDone packed the stage before fill ran
	fillSt    *gpu.Stream // the stream fill enqueued its pieces on
	st        *gpu.Stream
	pending   []stagePiece
	packed    int64
	unpacking bool
	err       error
}

// stagePiece is a range of Bytes being packed: done when ev has completed,
// Bytes[:hi] are packed then.
type stagePiece struct {
	hi int64
	ev *gpu.Event
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

// Release gives the staging buffer back, once the pieces of a transfer
// that carried the stage are done with it; Bytes must not be used after
// it. A second Release does nothing.
func (s *TypedStage) Release() {
	if s.released.Swap(true) || s.stage.IsZero() {
		return
	}
	s.mu.Lock() // a readsDone packing now finishes first
	defer s.mu.Unlock()
	s.drain()
	_ = s.settle()
	s.t.ctyped.unstage(s.k, s.stage)
}

// fill starts packing the layout into Bytes in pieces of chunk bytes, for
// a send that carries the stage: on the device, each piece is a kernel on
// the transport's pack stream followed by an event, so the first pieces
// can be sent while the next are packed (ready waits for them). A layout
// in host-accessible memory is packed at once.
func (s *TypedStage) fill(chunk int64) error {
	if err := s.usable(); err != nil {
		return err
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	s.drain()
	s.packed, s.err, s.filling, s.fillSt = 0, nil, true, nil
	n := int64(len(s.Bytes))
	if n == 0 {
		return nil
	}
	if s.prefilled {
		s.packed = n
		return nil
	}
	if s.stage.IsZero() {
		if err := s.move(s.e, false); err != nil {
			return err
		}
		s.packed = n
		return nil
	}
	st, err := s.stream()
	if err != nil {
		return err
	}
	s.fillSt = st
	for lo := int64(0); lo < n; lo += chunk {
		m := min(chunk, n-lo)
		ev, err := s.e.packPiece(st, s.stage, lo, m)
		if err != nil {
			s.drain()
			_ = st.Synchronize() // the pieces enqueued before the failure
			s.retire()
			return err
		}
		s.pending = append(s.pending, stagePiece{lo + m, ev})
	}
	s.t.ctyped.stats.dev.Add(1)
	s.t.ctyped.stats.pipelined.Add(1)
	return nil
}

// readsDone returns once the stage's layout is read no more by a send
// that carries it, for a caller that leaves before the send completes: a
// stage whose send has not filled it yet is packed whole now (fill then
// finds it packed), one being filled is waited for. Safe beside the
// send's own calls.
func (s *TypedStage) readsDone() error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if !s.filling {
		if err := s.Pack(); err != nil {
			return err
		}
		s.prefilled = true
		return nil
	}
	if st := s.fillSt; st != nil {
		// The send's ready may meet the same failure and retire the
		// stream meanwhile; retiring is idempotent.
		err := st.Synchronize()
		if err != nil {
			s.t.ctyped.retireFailed(s.e.buf.Device(), st)
		}
		return err
	}
	return nil
}

// ready waits until Bytes[:hi] are packed (fill started them).
func (s *TypedStage) ready(hi int64) error {
	for s.packed < hi && len(s.pending) > 0 && s.err == nil {
		p := s.pending[0]
		s.pending = s.pending[1:]
		err := p.ev.Synchronize()
		_ = p.ev.Destroy()
		if err != nil {
			s.err = err
			s.drain()
			s.retire()
			break
		}
		s.packed = p.hi
	}
	if s.err != nil {
		return s.err
	}
	if s.packed < hi {
		return fmt.Errorf("%w: typed stage: bytes up to %d wanted, %d packed", ErrInvalid, hi, s.packed)
	}
	return nil
}

// drain waits for the pieces still being packed and forgets them.
func (s *TypedStage) drain() {
	for _, p := range s.pending {
		_ = p.ev.Synchronize()
		_ = p.ev.Destroy()
	}
	s.pending = nil
}

// landed unpacks Bytes[lo:lo+n], which a receive that carries the stage
// has filled, into the layout: enqueued on the pack stream for a device
// layout (settle waits for it), at once for one in host-accessible
// memory.
func (s *TypedStage) landed(lo, n int64) error {
	if s.err != nil || n == 0 {
		return s.err
	}
	if s.stage.IsZero() {
		s.t.ctyped.stats.host.Add(1)
		if _, err := s.e.t.UnpackRange(s.e.host, s.Bytes[lo:lo+n], s.e.base, s.e.count, lo); err != nil {
			s.err = err
		}
		return s.err
	}
	st, err := s.stream()
	if err == nil {
		if !s.unpacking {
			s.t.ctyped.stats.dev.Add(1)
			s.t.ctyped.stats.pipelined.Add(1)
		}
		s.unpacking = true
		err = s.e.movePiece(st, s.stage, lo, n, true)
	}
	if err != nil {
		s.err = err
	}
	return s.err
}

// settle waits for the unpacks landed enqueued and returns the first
// failure of a piece.
func (s *TypedStage) settle() error {
	if s.unpacking {
		s.unpacking = false
		if err := s.st.Synchronize(); err != nil && s.err == nil {
			s.err = err
		}
	}
	if s.err != nil {
		s.retire()
	}
	return s.err
}

// retire hands the pack stream back for retirement if its work failed
// (chanTyped.retireFailed); the stage's next transfer takes the
// transport's pack stream anew.
func (s *TypedStage) retire() {
	if s.st != nil {
		s.t.ctyped.retireFailed(s.e.buf.Device(), s.st)
		s.st = nil
	}
}

// stream returns the pack stream of the layout's device.
func (s *TypedStage) stream() (*gpu.Stream, error) {
	if s.st == nil {
		st, err := s.t.ctyped.stream(s.e.buf.Device())
		if err != nil {
			return nil, err
		}
		s.st = st
	}
	return s.st, nil
}
