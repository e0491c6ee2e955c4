package transport

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"

	"github.com/troupe-hpc/troupe/datatype"
	"github.com/troupe-hpc/troupe/gpu"
	"github.com/troupe-hpc/troupe/gpupack"
)

// Typed channel transfers: a channel message made of count elements of a
// derived datatype in any memory kind (docs/gpu.md). What travels is the
// layout's packed stream, exactly datatype's Pack, so the two ends may use
// different layouts of one packed size, host or device memory on either
// side. A layout that is one run of bytes travels from the buffer itself;
// any other is packed into a staging buffer of the same memory kind first:
// on the device by gpupack's kernels, in host memory by datatype's Pack.
// The message is then an ordinary channel message of the packed size (its
// path, counters and size checks are the channel's).

// StagePoolBytes bounds the staging buffers a transport keeps for reuse by
// typed channel transfers, per transport; beyond it they are freed.
const StagePoolBytes = 64 << 20

// ChannelTypedStats counts typed channel transfers (DevicePacked and
// StageAllocs also count SendTypedBuffer's and RecvTypedBuffer's).
type ChannelTypedStats struct {
	// Run: the layout was one run of bytes, sent or received in place.
	Run int64
	// DevicePacked and HostPacked: packed into (or unpacked from) a staging
	// buffer by gpupack's kernels or by datatype's Pack.
	DevicePacked, HostPacked int64
	// StageAllocs: staging buffers allocated (the others were reused).
	StageAllocs int64
	// Pipelined: device layouts packed (unpacked) chunk by chunk as their
	// chunks went (landed), by channel sends and receives of more than
	// one chunk in pinned staging and by typed tagged transfers of device
	// memory (TypedOptions.Stage); also counted in DevicePacked. A channel
	// receive counts once it has succeeded.
	Pipelined int64
}

// chanTyped is a transport's state for typed channel transfers.
type chanTyped struct {
	mu      sync.Mutex
	closed  bool
	packers map[*gpu.Device]*gpupack.Packer
	free    map[stageKey][]gpu.Buffer         // staging buffers for reuse
	bytes   int                               // bytes held in free
	twins   map[*datatype.Type]*datatype.Type // packed twins (typed_device.go)
	streams map[*gpu.Device]*gpu.Stream       // pack streams of the tagged API (typed_device.go)
	failed  []*gpu.Stream                     // pack streams retired after a failure (retireFailed)
	stats   struct{ run, dev, host, allocs, pipelined atomic.Int64 }
}

// stageKey names staging buffers of one size: device memory of dev, or
// pinned host memory of dev's system.
type stageKey struct {
	dev    *gpu.Device
	n      int
	pinned bool
}

// packer returns the transport's gpupack.Packer for dev.
func (s *chanTyped) packer(dev *gpu.Device) (*gpupack.Packer, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closed {
		return nil, ErrClosed
	}
	return perDevice(&s.packers, dev, func() (*gpupack.Packer, error) { return gpupack.New(dev, gpupack.Options{}) })
}

// perDevice returns (*m)[dev], made by mk on first use. The caller holds
// the lock that guards *m.
func perDevice[T comparable](m *map[*gpu.Device]T, dev *gpu.Device, mk func() (T, error)) (T, error) {
	var zero T
	if v := (*m)[dev]; v != zero {
		return v, nil
	}
	v, err := mk()
	if err != nil {
		return zero, err
	}
	if *m == nil {
		*m = map[*gpu.Device]T{}
	}
	(*m)[dev] = v
	return v, nil
}

// newPackStream makes a stream on dev for pack and unpack kernels.
func newPackStream(dev *gpu.Device) func() (*gpu.Stream, error) {
	return func() (*gpu.Stream, error) {
		st, err := dev.NewStream()
		if err != nil {
			return nil, fmt.Errorf("pack stream: %w", err)
		}
		return st, nil
	}
}

// stage returns a staging buffer of k.
func (s *chanTyped) stage(k stageKey) (gpu.Buffer, error) {
	n := k.n
	s.mu.Lock()
	if l := s.free[k]; len(l) > 0 {
		b := l[len(l)-1]
		s.free[k] = l[:len(l)-1]
		s.bytes -= n
		s.mu.Unlock()
		return b, nil
	}
	s.mu.Unlock()
	s.stats.allocs.Add(1)
	if k.pinned {
		return k.dev.System().AllocHost(n)
	}
	return k.dev.Alloc(n)
}

// unstage keeps b, a staging buffer of k, for reuse, or frees it.
func (s *chanTyped) unstage(k stageKey, b gpu.Buffer) {
	s.mu.Lock()
	if !s.closed && s.bytes+b.Len() <= StagePoolBytes {
		if s.free == nil {
			s.free = map[stageKey][]gpu.Buffer{}
		}
		s.free[k] = append(s.free[k], b)
		s.bytes += b.Len()
		s.mu.Unlock()
		return
	}
	s.mu.Unlock()
	_ = gpu.Free(b)
}

// close frees the kept buffers and closes the packers; buffers in use are
// freed when their transfers end.
func (s *chanTyped) close() error {
	s.mu.Lock()
	s.closed = true
	free, packers, streams, failed := s.free, s.packers, s.streams, s.failed
	s.free, s.packers, s.streams, s.failed, s.bytes = nil, nil, nil, nil, 0
	s.mu.Unlock()
	var first error
	keep := func(err error) {
		// A closed system has freed its memory and modules itself.
		if err != nil && !errors.Is(err, gpu.ErrClosed) && first == nil {
			first = err
		}
	}
	for _, l := range free {
		for _, b := range l {
			keep(gpu.Free(b))
		}
	}
	for _, st := range streams {
		keep(st.Destroy())
	}
	for _, st := range failed {
		_ = st.Destroy() // its failure was reported to its transfers
	}
	for _, p := range packers {
		keep(p.Close())
	}
	return first
}

// ChannelTypedStats returns the typed channel transfer counters so far.
func (t *Transport) ChannelTypedStats() ChannelTypedStats {
	s := &t.ctyped.stats
	return ChannelTypedStats{Run: s.run.Load(), DevicePacked: s.dev.Load(), HostPacked: s.host.Load(),
		StageAllocs: s.allocs.Load(), Pipelined: s.pipelined.Load()}
}

// typedEnd is one end's layout: count elements of t whose origin is byte
// base of buf.
type typedEnd struct {
	buf   gpu.Buffer
	t     *datatype.Type
	base  int64
	count int64
	size  int64      // packed size
	run   gpu.Buffer // the layout as one run of bytes, when it is one
	host  []byte     // buf's bytes, when host-accessible
	p     *gpupack.Packer
}

// typedLayout validates a typed transfer's buffer and layout, as a receive
// must before it takes a message; what names the transfer in errors.
func (t *Transport) typedLayout(what string, buf gpu.Buffer, dt *datatype.Type, count int) (*typedEnd, error) {
	return t.typedLayoutAt(what, buf, dt, 0, int64(count))
}

// typedLayoutAt is typedLayout for a layout whose origin is byte base of
// buf.
func (t *Transport) typedLayoutAt(what string, buf gpu.Buffer, dt *datatype.Type, base, count int64) (*typedEnd, error) {
	e := &typedEnd{buf: buf, t: dt, base: base, count: count}
	fail := func(err error) (*typedEnd, error) {
		return nil, fmt.Errorf("%w: %s %d of %v: %w", ErrInvalid, what, count, dt, err)
	}
	switch {
	case buf.IsZero() || dt == nil:
		return nil, fmt.Errorf("%w: %s: zero gpu.Buffer or nil type", ErrInvalid, what)
	case buf.Freed():
		return fail(gpu.ErrFreed)
	}
	if buf.Kind().HostAccessible() {
		b, err := buf.Bytes()
		if err != nil {
			return fail(err)
		}
		lo, hi, err := dt.DataBounds(e.count)
		if err != nil {
			return fail(err)
		}
		if e.size, err = dt.PackedSize(e.count); err != nil {
			return fail(err)
		}
		if e.size > 0 && (base < 0 || base+lo < 0 || base+hi > int64(len(b))) {
			return fail(fmt.Errorf("layout touches bytes [%d, %d) of a %d-byte buffer", base+lo, base+hi, len(b)))
		}
		e.host = b
	} else {
		p, err := t.ctyped.packer(buf.Device())
		if err != nil {
			return nil, fmt.Errorf("transport: %s: device packer: %w", what, err)
		}
		if e.size, err = p.Check(buf, dt, base, e.count); err != nil {
			return fail(err)
		}
		e.p = p
	}
	if e.size == 0 {
		e.run, _ = buf.Slice(0, 0)
		return e, nil
	}
	if off, ok := oneRun(dt, e.count, e.size); ok {
		e.run, _ = buf.Slice(int(base+off), int(e.size))
	}
	return e, nil
}

// typedLayout is the transport's typedLayout for a transfer of the channel.
func (c *Channel) typedLayout(op string, buf gpu.Buffer, t *datatype.Type, count int) (*typedEnd, error) {
	return c.t.typedLayout(fmt.Sprintf("channel %d %s", c.id, op), buf, t, count)
}

// move packs e into stage, or unpacks stage into e, on stream st (device
// layouts) or in host memory, and waits for it.
func (e *typedEnd) move(st *gpu.Stream, stage gpu.Buffer, unpack bool) error {
	if e.host != nil {
		b, err := stage.Bytes()
		if err != nil {
			return err
		}
		if unpack {
			_, err = e.t.Unpack(e.host, b, e.base, e.count)
		} else {
			_, err = e.t.Pack(b, e.host, e.base, e.count)
		}
		return err
	}
	var err error
	if unpack {
		_, err = e.p.Unpack(st, e.buf, stage, e.t, e.base, e.count)
	} else {
		_, err = e.p.Pack(st, stage, e.buf, e.t, e.base, e.count)
	}
	if err == nil {
		err = st.Synchronize()
	}
	return err
}

// movePiece enqueues on st the packing of bytes [off, off+n) of device
// layout e's packed stream into the same bytes of stage, or with unpack
// their unpacking from stage into the layout.
func (e *typedEnd) movePiece(st *gpu.Stream, stage gpu.Buffer, off, n int64, unpack bool) error {
	piece, err := stage.Slice(int(off), int(n))
	if err != nil {
		return err
	}
	if hook := testPieceKernel; hook != nil {
		if k := hook(unpack, off); k != nil {
			// A test's kernel before the piece's: one that fails makes the
			// stream skip its later work, as after a faulting kernel on a
			// GPU.
			if err := gpu.LaunchHost(st, func([][]byte) error { return k() }, piece); err != nil {
				return err
			}
		}
	}
	switch {
	case unpack:
		_, err = e.p.UnpackRange(st, e.buf, piece, e.t, e.base, e.count, off, n)
	default:
		_, err = e.p.PackRange(st, piece, e.buf, e.t, e.base, e.count, off, n)
	}
	return err
}

// packPiece enqueues on st the packing of bytes [off, off+n) of device
// layout e's packed stream into the same bytes of stage, and an event
// after it, which the caller synchronizes (done) and destroys.
func (e *typedEnd) packPiece(st *gpu.Stream, stage gpu.Buffer, off, n int64) (*gpu.Event, error) {
	if err := e.movePiece(st, stage, off, n, false); err != nil {
		return nil, err
	}
	ev, err := st.Device().NewEvent()
	if err != nil {
		return nil, err
	}
	if err := ev.Record(st); err != nil {
		_ = ev.Destroy()
		return nil, err
	}
	return ev, nil
}

// testPieceKernel, set by tests only, is called as the packing (or
// unpacking) of the device piece at packed offset off is enqueued; a
// kernel it returns runs on the stream just before the piece's (one that
// fails faults the stream).
var testPieceKernel func(unpack bool, off int64) func() error

// oneRun reports whether count elements of t are one run of size bytes in
// packed order, and where it starts.
func oneRun(t *datatype.Type, count, size int64) (int64, bool) {
	segs, err := t.Segments(count, 0, size)
	if err != nil {
		return 0, false
	}
	var first datatype.Segment
	n := 0
	for s := range segs {
		if n++; n > 1 {
			return 0, false
		}
		first = s
	}
	return first.Off, n == 1 && first.Len == size
}

// SendTyped starts sending count elements of t whose origin is buf's first
// byte (any memory kind) as the channel's next message, and returns a
// request that completes when buf may be reused. The peer receives it with
// RecvTyped (any layout of the same packed size) or with Recv into a buffer
// of the packed size. A layout that is one run of bytes is sent in place;
// any other is packed before SendTyped returns (on the device by gpupack's
// kernels, on a stream of the channel's), so buf may already be modified
// then, though the request completes only when the packed copy has gone.
// As for Send, device data must be complete when SendTyped is called.
func (c *Channel) SendTyped(buf gpu.Buffer, t *datatype.Type, count int) (*ChannelRequest, error) {
	e, err := c.typedLayout("typed send", buf, t, count)
	if err != nil {
		return nil, err
	}
	if !e.run.IsZero() {
		c.t.ctyped.stats.run.Add(1)
		return c.Send(e.run)
	}
	if e.host != nil {
		packed := make([]byte, e.size)
		if _, err := t.Pack(packed, e.host, e.base, e.count); err != nil {
			return nil, fmt.Errorf("transport: channel %d typed send: %w", c.id, err)
		}
		c.t.ctyped.stats.host.Add(1)
		return c.SendBytes(packed)
	}
	k := c.stageKey(e)
	stage, err := c.t.ctyped.stage(k)
	if err != nil {
		return nil, fmt.Errorf("transport: channel %d typed send: staging buffer: %w", c.id, err)
	}
	var inner *ChannelRequest
	var packErr error // a piece that failed to pack
	if k.pinned && chunkCount(int(e.size)) > 1 && !typedChannelWhole {
		inner, err = c.sendPieces(e, stage, &packErr)
	} else {
		if err = c.deviceMove(e, stage, false); err == nil {
			inner, err = c.Send(stage)
		}
	}
	if err != nil {
		c.t.ctyped.unstage(k, stage)
		return nil, err
	}
	return c.after(inner, "typed send", func(err error) error {
		c.t.ctyped.unstage(k, stage)
		if packErr != nil {
			return fmt.Errorf("transport: channel %d typed send: packing: %w", c.id, packErr)
		}
		return err
	}), nil
}

// sendPieces sends device layout e through pinned stage chunk by chunk on
// the direct path: the pack kernel of each channel chunk is enqueued at
// once on the pack stream, an event after each, and chunk i is posted as
// soon as its event has completed, while the later chunks are packed. It
// returns when every chunk is posted, so the layout may then be modified.
// A piece that fails to pack is recorded in *packErr and it and the later
// chunks go empty, which the receiver reports as a size mismatch.
func (c *Channel) sendPieces(e *typedEnd, stage gpu.Buffer, packErr *error) (*ChannelRequest, error) {
	dev := e.buf.Device()
	key := streamKey{dev: dev, send: true, pack: true}
	st, done := c.useStreamKey(key)
	if st == nil {
		return nil, fmt.Errorf("transport: channel %d typed send: %w", c.id, ErrClosed)
	}
	defer done()
	n := int(e.size)
	evs := make([]*gpu.Event, 0, chunkCount(n))
	defer func() {
		for _, ev := range evs {
			_ = ev.Synchronize()
			_ = ev.Destroy()
		}
	}()
	for i, off := 0, 0; i < chunkCount(n); i++ {
		m := chunkLen(n, i)
		ev, err := e.packPiece(st, stage, int64(off), int64(m))
		if err != nil {
			_ = st.Synchronize()
			c.retireFailed(key, st)
			return nil, fmt.Errorf("transport: channel %d typed send: %w", c.id, err) // nothing sent
		}
		evs = append(evs, ev)
		off += m
	}
	c.t.ctyped.stats.dev.Add(1)
	c.t.ctyped.stats.pipelined.Add(1)
	return c.start(true, endBuf{g: stage, isG: true, ready: func(i int) error {
		if err := evs[i].Synchronize(); err != nil {
			*packErr = err
			c.retireFailed(key, st)
			return err
		}
		return nil
	}})
}

// stageKey returns the staging buffers for device layout e: device memory
// where the channel moves device memory as it is (same process, CUDA IPC,
// UCX with support for the memory), else pinned host memory, which the
// kernels write and read through the bus and UCX sends as host memory (one
// copy fewer than device staging and the staged path's chunk copies).
func (c *Channel) stageKey(e *typedEnd) stageKey {
	dev := e.buf.Device()
	pinned := c.local == nil && !c.ipc && !c.t.deviceDirect(e.buf)
	return stageKey{dev: dev, n: int(e.size), pinned: pinned}
}

// RecvTyped starts receiving the channel's next message into count
// elements of t whose origin is buf's first byte (any memory kind). The
// message must have the layout's packed size: another size fails the
// request with a *SizeMismatchError, as Recv's (the sender learns of it on
// the same-process path only). Bytes of buf outside
// the layout are left as they are. A device layout received through
// pinned staging over more than one channel chunk is unpacked chunk by
// chunk as they land, so after a failure (a size mismatch, which shows
// only at the shorter framing's tail chunk) the layout may hold the
// chunks that arrived whole before it; as MPI, a failed receive leaves its
// buffer undefined. An invalid layout or buffer is refused before the
// message is taken.
func (c *Channel) RecvTyped(buf gpu.Buffer, t *datatype.Type, count int) (*ChannelRequest, error) {
	e, err := c.typedLayout("typed recv", buf, t, count)
	if err != nil {
		return nil, err
	}
	if !e.run.IsZero() {
		c.t.ctyped.stats.run.Add(1)
		return c.Recv(e.run)
	}
	if e.host != nil {
		packed := make([]byte, e.size)
		inner, err := c.RecvBytes(packed)
		if err != nil {
			return nil, err
		}
		return c.after(inner, "typed recv", func(err error) error {
			if err != nil {
				return err
			}
			c.t.ctyped.stats.host.Add(1)
			if _, err := t.Unpack(e.host, packed, e.base, e.count); err != nil {
				return fmt.Errorf("transport: channel %d typed recv: %w", c.id, err)
			}
			return nil
		}), nil
	}
	k := c.stageKey(e)
	stage, err := c.t.ctyped.stage(k)
	if err != nil {
		return nil, fmt.Errorf("transport: channel %d typed recv: staging buffer: %w", c.id, err)
	}
	inner, err := c.Recv(stage)
	if err != nil {
		c.t.ctyped.unstage(k, stage)
		return nil, err
	}
	if len(inner.reqs) > 1 && !typedChannelWhole {
		// The direct path over more than one chunk: each is unpacked
		// as it lands.
		u := &pieceUnpack{c: c, e: e, stage: stage, key: streamKey{dev: e.buf.Device(), pack: true}}
		inner.landed = u.land
		return c.after(inner, "typed recv", func(err error) error {
			err = u.settle(err)
			c.t.ctyped.unstage(k, stage)
			return err
		}), nil
	}
	return c.after(inner, "typed recv", func(err error) error {
		if err == nil {
			err = c.deviceMove(e, stage, true)
		}
		c.t.ctyped.unstage(k, stage)
		return err
	}), nil
}

// typedChannelWhole, set by benchmarks only, packs and unpacks every typed
// channel transfer whole, as before the chunk by chunk pipelines, to
// compare them in one run.
var typedChannelWhole bool

// pieceUnpack unpacks a typed receive's stage into its device layout
// chunk by chunk, as the chunks land (ChannelRequest.landed): each chunk's
// unpack kernel is enqueued on the channel's receive pack stream, and an
// event recorded after the latest, which settle waits for.
type pieceUnpack struct {
	c     *Channel
	e     *typedEnd
	stage gpu.Buffer
	key   streamKey
	st    *gpu.Stream // the stream of the latest chunk's unpack
	ev    *gpu.Event  // recorded after it
}

// land enqueues the unpack of chunk i.
func (u *pieceUnpack) land(i int) error {
	if err := u.enqueue(i); err != nil {
		return fmt.Errorf("transport: channel %d typed recv: unpacking chunk %d: %w", u.c.id, i, err)
	}
	return nil
}

func (u *pieceUnpack) enqueue(i int) error {
	n := int(u.e.size)
	off, m := i*ChannelChunkSize, chunkLen(n, i)
	if m == 0 {
		return nil
	}
	st, done := u.c.useStreamKey(u.key)
	if st == nil {
		return ErrClosed
	}
	defer done()
	if u.st != nil && u.st != st {
		// The stream was retired since the last chunk (another transfer
		// failed on it): the event follows the new one.
		if err := u.ev.Synchronize(); err != nil {
			return err
		}
	}
	if err := u.e.movePiece(st, u.stage, int64(off), int64(m), true); err != nil {
		u.c.retireFailed(u.key, st)
		return err
	}
	if u.ev == nil {
		ev, err := st.Device().NewEvent()
		if err != nil {
			// settle has no event to wait on: wait for the unpack just
			// enqueued here, before the stage can go back to its pool.
			if serr := st.Synchronize(); serr != nil {
				u.c.retireFailed(u.key, st)
			}
			return err
		}
		u.ev = ev
	}
	u.st = st
	return u.ev.Record(st)
}

// settle waits for the unpacks enqueued, retires the stream if they
// failed, and returns the receive's outcome: err (its chunks' or
// landing's), else an unpack's failure.
func (u *pieceUnpack) settle(err error) error {
	if u.ev != nil {
		if uerr := u.ev.Synchronize(); uerr != nil {
			u.c.retireFailed(u.key, u.st)
			if err == nil {
				err = fmt.Errorf("transport: channel %d typed recv: unpacking: %w", u.c.id, uerr)
			}
		}
		_ = u.ev.Destroy()
	}
	if err != nil {
		return err
	}
	u.c.t.ctyped.stats.dev.Add(1)
	u.c.t.ctyped.stats.pipelined.Add(1)
	return nil
}

// deviceMove packs e into stage, or unpacks stage into e, on the channel's
// pack stream of the device, and waits for it.
func (c *Channel) deviceMove(e *typedEnd, stage gpu.Buffer, unpack bool) error {
	op := "typed send"
	if unpack {
		op = "typed recv"
	}
	key := streamKey{dev: e.buf.Device(), send: !unpack, pack: true}
	st, done := c.useStreamKey(key)
	if st == nil {
		return fmt.Errorf("transport: channel %d %s: %w", c.id, op, ErrClosed)
	}
	defer done()
	if err := e.move(st, stage, unpack); err != nil {
		c.retireFailed(key, st)
		return fmt.Errorf("transport: channel %d %s: %w", c.id, op, err)
	}
	c.t.ctyped.stats.dev.Add(1)
	return nil
}

// after returns a request that completes when inner has completed and then
// fin has run with its outcome (fin's result is the request's).
func (c *Channel) after(inner *ChannelRequest, op string, fin func(error) error) *ChannelRequest {
	if inner.reqs != nil {
		// The direct path (UCX on the packed bytes, in pinned or Go
		// memory): fin runs where the chunks' outcome is computed
		// (finalize, in the Wait, Test or Done that completes the
		// request, in its caller's goroutine), not in a goroutine of its
		// own, which would wake a thread for it (docs/gpu.md, "Typed
		// channel transfers").
		prev := inner.post
		inner.post = func(err error) error {
			if prev != nil {
				err = prev(err)
			}
			return fin(err)
		}
		return inner
	}
	r := &ChannelRequest{c: c, op: op, n: inner.n, counter: inner.counter, path: inner.path, inner: inner, done: make(chan struct{})}
	go func() { r.finish(fin(inner.Wait(context.Background()))) }()
	return r
}
