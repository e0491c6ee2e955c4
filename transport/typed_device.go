package transport

import (
	"context"
	"fmt"
	"sync"

	"go.uber.org/zap"

	"github.com/troupe-hpc/troupe/datatype"
	"github.com/troupe-hpc/troupe/gpu"
)

// Typed transfers of the MPI-style API in any memory kind (CUDA-aware MPI's
// MPI_Send with a derived datatype on a device buffer). A layout in host
// memory goes as SendTyped's and RecvTyped's do. A layout in device memory is
// packed by gpupack's kernels into pinned host memory and sent by the typed
// protocol as count elements of its packed twin: a type of the same type
// signature whose elements lie back to back (one struct of the signature's
// runs, resized to its size). So the receiver's signature check is the
// ordinary one, any receive layout of a matching signature takes the
// message (host memory with RecvTyped, device memory with
// RecvTypedBuffer), and the twin's single run moves as one block. A receive
// into device memory lands in pinned memory as its own twin and is
// unpacked by the kernels.

// TwinMaxRuns bounds the runs of equal basic types in one element's type
// signature of a device layout sent or received by SendTypedBuffer and
// RecvTypedBuffer (a struct of that many blocks is its packed twin).
const TwinMaxRuns = 1024

// SendTypedBuffer sends count elements of dt whose origin is buf's first
// byte (any memory kind) to rank dst with a user tag, and waits until the
// receiver accepted them, as SendTyped does for Go memory. Device data must
// be complete when it is called; it is packed chunk by chunk on a stream of
// the transport while the chunks before go. buf may be modified once
// SendTypedBuffer has returned: when ctx ends first the transfer goes on,
// as SendTyped's does, but the call returns only once the packing (which
// does not wait for the receiver) is done.
func (t *Transport) SendTypedBuffer(ctx context.Context, dst, tag int, buf gpu.Buffer, dt *datatype.Type, count int) error {
	what := fmt.Sprintf("typed send rank %d tag %d", dst, tag)
	e, err := t.typedLayout(what, buf, dt, count)
	if err != nil {
		return err
	}
	if e.host != nil {
		return t.SendTyped(ctx, dst, tag, e.host, dt, count)
	}
	s, err := t.stageEnd(what, e)
	if err != nil {
		return err
	}
	// Packed piece by piece as the chunks go (TypedOptions.Stage).
	r, err := t.IsendTypedWith(dst, tag, s.Bytes, s.Twin, count, TypedOptions{Stage: s})
	if err != nil {
		s.Release()
		return err
	}
	_, err = t.typedWait(ctx, r, func(Status, error) error {
		s.Release()
		return nil
	})
	if err != nil && !r.fin.Load() {
		// Left in flight: its layout is read no more once this returns.
		if perr := s.readsDone(); perr != nil {
			t.log.Debug("typed send left by its caller: packing failed", zap.Int("peer", dst), zap.Int("tag", tag), zap.Error(perr))
		}
	}
	return err
}

// typedWait waits for r and then runs fin with its outcome, whose error is
// the result. When ctx ends first it returns ctx's error at once, the
// transfer still in flight, and fin runs when r completes (the staging
// buffer stays in use until then, as a Go buffer would).
func (t *Transport) typedWait(ctx context.Context, r *Request, fin func(Status, error) error) (Status, error) {
	st, err := r.Wait(ctx)
	if err != nil && !r.fin.Load() {
		go func() { _ = fin(r.Wait(context.Background())) }()
		return st, err
	}
	if ferr := fin(st, err); ferr != nil && err == nil {
		err = ferr
	}
	return st, err
}

// RecvTypedBuffer receives the next typed message from rank src (or
// AnySource) with a user tag into count elements of dt whose origin is
// buf's first byte (any memory kind), as RecvTyped does for Go memory: the
// message's signature must match that of dt's first elements (a message
// of fewer elements fills the first ones, Status.Size saying how many
// bytes came). The buffer and layout are checked
// before the message is taken. As with RecvTyped, a receive cannot be
// withdrawn once posted: when ctx ends first it returns ctx's error, and
// the message, when it comes, is still unpacked into buf.
func (t *Transport) RecvTypedBuffer(ctx context.Context, src, tag int, buf gpu.Buffer, dt *datatype.Type, count int) (Status, error) {
	what := fmt.Sprintf("typed recv rank %d tag %d", src, tag)
	e, err := t.typedLayout(what, buf, dt, count)
	if err != nil {
		return Status{}, err
	}
	if e.host != nil {
		return t.RecvTyped(ctx, src, tag, e.host, dt, count)
	}
	s, err := t.stageEnd(what, e)
	if err != nil {
		return Status{}, err
	}
	// Unpacked piece by piece as the chunks land (TypedOptions.Stage).
	r, err := t.IrecvTypedWith(src, tag, s.Bytes, s.Twin, count, TypedOptions{Stage: s})
	if err != nil {
		s.Release()
		return Status{}, err
	}
	return t.typedWait(ctx, r, func(_ Status, err error) error {
		s.Release()
		return err
	})
}

// pinnedStage returns a pinned staging buffer of k and its bytes.
func (t *Transport) pinnedStage(k stageKey) (gpu.Buffer, []byte, error) {
	stage, err := t.ctyped.stage(k)
	if err != nil {
		return gpu.Buffer{}, nil, err
	}
	b, err := stage.Bytes()
	if err != nil {
		t.ctyped.unstage(k, stage)
		return gpu.Buffer{}, nil, err
	}
	return stage, b, nil
}

// twin returns dt's packed twin: one element of the same type signature
// whose basic elements lie back to back from byte 0, extent dt.Size().
// Twins are kept per type while it lives.
func (s *chanTyped) twin(dt *datatype.Type) (*datatype.Type, error) {
	s.mu.Lock()
	for k := range s.twins { // forget types freed since
		if k.Freed() {
			_ = s.twins[k].Free()
			delete(s.twins, k)
		}
	}
	tw := s.twins[dt]
	s.mu.Unlock()
	if tw != nil {
		return tw, nil
	}
	runs, err := dt.TypeSignature(TwinMaxRuns)
	if err != nil {
		return nil, err
	}
	lens, disps, types := make([]int64, len(runs)), make([]int64, len(runs)), make([]*datatype.Type, len(runs))
	off := int64(0)
	for i, r := range runs {
		lens[i], disps[i], types[i] = r.Count, off, r.Type
		off += r.Count * r.Type.Size()
	}
	st, err := datatype.Struct(lens, disps, types)
	if err != nil {
		return nil, err
	}
	tw, err = datatype.Resized(st, 0, dt.Size())
	if err != nil {
		return nil, err
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if old := s.twins[dt]; old != nil {
		_ = tw.Free()
		return old, nil
	}
	if s.twins == nil {
		s.twins = map[*datatype.Type]*datatype.Type{}
	}
	s.twins[dt] = tw
	return tw, nil
}

// deviceMove packs layout e into stage, or unpacks stage into it, on the
// transport's pack stream of the layout's device (in host memory when the
// layout is host-accessible), and waits.
func (s *chanTyped) deviceMove(e *typedEnd, stage gpu.Buffer, unpack bool) error {
	st, err := s.stream(e.buf.Device())
	if err != nil {
		return err
	}
	if err := e.move(st, stage, unpack); err != nil {
		s.retireFailed(e.buf.Device(), st)
		return err
	}
	s.stats.dev.Add(1)
	return nil
}

// stream returns the transport's pack stream on dev.
func (s *chanTyped) stream(dev *gpu.Device) (*gpu.Stream, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closed {
		return nil, ErrClosed
	}
	return perDevice(&s.streams, dev, newPackStream(dev))
}

// retireFailed retires st, dev's pack stream, if work on it has failed:
// a stream skips all work after a failure, as a GPU's does after a
// faulting kernel, so the next transfer gets a new one. st is destroyed at
// close, once the transfers that hold it are done with it.
func (s *chanTyped) retireFailed(dev *gpu.Device, st *gpu.Stream) {
	retireFailed(&s.mu, &s.streams, dev, st, &s.failed)
}

// retireFailed moves st from (*streams)[k] to *retired if work on it has
// failed; mu guards both (and the map variable itself, which a close may
// take away meanwhile).
func retireFailed[K comparable](mu *sync.Mutex, streams *map[K]*gpu.Stream, k K, st *gpu.Stream, retired *[]*gpu.Stream) {
	if _, err := st.Query(); err == nil {
		return
	}
	mu.Lock()
	defer mu.Unlock()
	if (*streams)[k] == st {
		delete(*streams, k)
		*retired = append(*retired, st)
	}
}
