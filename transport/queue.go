package transport

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"unsafe"

	"github.com/troupe-hpc/troupe/datatype"
	"github.com/troupe-hpc/troupe/gpu"
	"github.com/troupe-hpc/troupe/transport/ucx"
)

// The stream-triggered queue lives in transport, not in gpu: it issues
// transport operations, and gpu imports nothing of troupe (DESIGN 3). The
// gpu package provides what a queue needs of a stream (WriteValue64,
// WaitValue64, WaitValue64Host, WriteValue64Host), so no interface has to be
// threaded back into gpu.

// ErrQueueFreed: the queue was freed before the operation completed.
var ErrQueueFreed = errors.New("transport: queue freed")

// Queue is a stream-triggered communication queue (MPIX_Queue of the
// stream-triggered MPI proposal): sends and receives are enqueued by the
// host, started and waited for by the GPU stream. Start enqueues a stream
// write of the queue's trigger counter; a progress agent (a goroutine of the
// queue, playing the role of the NIC's triggered operations) sleeps until the
// counter reaches a started batch, then issues the batch's operations through
// the tagged API; when they have completed it advances the completion
// counter, which the stream waits on after Wait. Host calls never block on
// the stream or the network.
//
// Operations use the tagged API's (peer, tag) matching and sequence numbers,
// so an enqueued send matches an ordinary Recv/Irecv and an enqueued receive
// matches an ordinary Send/Isend. Operations of one queue are issued in the
// order they were enqueued. There are no wildcards.
//
// Errors are sticky, as a stream's are: the first operation that fails (its
// peer lost, the transport closed, a truncated receive, a staging failure)
// puts the queue in error. The completion counter still advances, so the
// stream's waits end, but the failed operation's buffer holds no data, and
// Err, Start, Wait and the Enqueue calls report the error from then on.
// Batches triggered after the failure are not issued: their operations fail
// with the same error at once (a GPU runs nothing more after a fault).
type Queue struct {
	t      *Transport
	stream *gpu.Stream
	sys    *gpu.System
	words  gpu.Buffer // pinned: trigger counter, completion counter
	trig   gpu.Buffer
	comp   gpu.Buffer
	pool   *gpu.PinnedPool

	ctx    context.Context
	cancel context.CancelFunc
	wg     sync.WaitGroup

	mu        sync.Mutex
	pending   []*QueueOp // enqueued since the last Start
	started   []*qbatch  // started, not yet triggered
	issued    []*qbatch  // issued, not yet complete
	starts    uint64     // Start calls so far: the last trigger value
	freed     bool
	freeDone  chan struct{} // closed when Free has finished
	err       error         // first operation failure: sticky
	kickStart chan struct{}
	kickDone  chan struct{}

	packStreams map[*gpu.Device]*gpu.Stream // typed operations' kernels (packStream)
}

type qbatch struct {
	seq uint64
	ops []*QueueOp
}

// QueueOp is one enqueued send or receive.
type QueueOp struct {
	q    *Queue
	send bool
	peer int
	tag  int
	buf  gpu.Buffer

	req  *Request
	slot gpu.Buffer // pinned staging buffer, for device memory

	typed *typedEnd // EnqueueSendTyped, EnqueueRecvTyped: the layout, packed through slot

	done   chan struct{}
	status Status
	err    error
}

// QueueMaxMessage is the largest device-memory message a queue stages
// through pinned host memory.
const QueueMaxMessage = 64 << 20

// NewQueue creates a queue bound to stream: its Start and Wait operations
// are ordered with the stream's other work.
func (t *Transport) NewQueue(stream *gpu.Stream) (*Queue, error) {
	if stream == nil {
		return nil, fmt.Errorf("%w: NewQueue: nil stream", ErrInvalid)
	}
	sys := stream.Device().System()
	words, err := sys.AllocHost(16)
	if err != nil {
		return nil, fmt.Errorf("transport: NewQueue: counters: %w", err)
	}
	q := &Queue{t: t, stream: stream, sys: sys, words: words, freeDone: make(chan struct{}),
		kickStart: make(chan struct{}, 1), kickDone: make(chan struct{}, 1)}
	q.trig, _ = words.Slice(0, 8)
	q.comp, _ = words.Slice(8, 8)
	for _, w := range []gpu.Buffer{q.trig, q.comp} {
		if err := gpu.WriteValue64Host(w, 0); err != nil {
			_ = gpu.Free(words)
			return nil, fmt.Errorf("transport: NewQueue: counters: %w", err)
		}
	}
	// Keep up to 64 idle staging buffers per size class (MaxBytes still
	// bounds them): with the pool's default of 8, a batch of more staged
	// operations than that (Faces has 12) freed the surplus and allocated
	// it again on every batch, pinned memory allocation in the trigger
	// agent's path and, on cuda, a cuMemFreeHost that waits for the device.
	q.pool, err = sys.NewPinnedPool(gpu.PoolConfig{MinSize: 64 << 10, MaxSize: QueueMaxMessage,
		MaxBytes: 4 * QueueMaxMessage, MaxIdlePerClass: 64})
	if err != nil {
		_ = gpu.Free(words)
		return nil, fmt.Errorf("transport: NewQueue: staging pool: %w", err)
	}
	q.ctx, q.cancel = context.WithCancel(context.Background())
	q.wg.Add(2)
	go q.triggerAgent()
	go q.completionAgent()
	return q, nil
}

// EnqueueSend adds a send of buf to rank dst with a user tag to the queue.
// It runs when the stream reaches the queue's next Start. buf must not be
// changed between that point and the completion of the next Wait.
func (q *Queue) EnqueueSend(buf gpu.Buffer, dst, tag int) (*QueueOp, error) {
	return q.enqueue(true, buf, dst, tag)
}

// EnqueueRecv adds a receive into buf from rank src with a user tag to the
// queue. Wildcards (negative src or tag) are refused. The data is in buf
// when the stream passes the Wait that follows the Start triggering it.
func (q *Queue) EnqueueRecv(buf gpu.Buffer, src, tag int) (*QueueOp, error) {
	return q.enqueue(false, buf, src, tag)
}

// EnqueueSendTyped adds a send of count elements of dt whose origin is
// buf's first byte (device, managed or host memory) to rank dst with a user
// tag. When the stream reaches the queue's next Start the agent packs the
// layout into pinned staging memory (on the device by gpupack's kernels)
// and sends the packed stream as a tagged message: it matches a Recv (or
// EnqueueRecv) into a buffer of the packed size, or EnqueueRecvTyped of any
// layout with that packed size; not the typed API's RecvTyped, whose
// protocol carries the type signature.
func (q *Queue) EnqueueSendTyped(buf gpu.Buffer, dt *datatype.Type, count, dst, tag int) (*QueueOp, error) {
	return q.enqueueTyped(true, buf, dt, count, dst, tag)
}

// EnqueueRecvTyped adds a receive of count elements of dt whose origin is
// buf's first byte from rank src with a user tag. The message must have the
// layout's packed size (another size fails the operation with an error
// wrapping ErrTruncated). The agent unpacks it before the completion
// counter advances, so the data is in buf when the stream passes the Wait
// that follows the Start triggering it. The layout is checked when it is
// enqueued. A layout that is one run of bytes is sent or received in
// place, as EnqueueSend or EnqueueRecv of that part of buf (a shorter
// message is then received as EnqueueRecv receives it).
func (q *Queue) EnqueueRecvTyped(buf gpu.Buffer, dt *datatype.Type, count, src, tag int) (*QueueOp, error) {
	return q.enqueueTyped(false, buf, dt, count, src, tag)
}

func (q *Queue) enqueueTyped(send bool, buf gpu.Buffer, dt *datatype.Type, count, peer, tag int) (*QueueOp, error) {
	op := "EnqueueRecvTyped"
	if send {
		op = "EnqueueSendTyped"
	}
	if !buf.IsZero() && buf.System() != q.sys {
		return nil, fmt.Errorf("%w: %s: buffer of another gpu.System than the queue's stream", ErrInvalid, op)
	}
	e, err := q.t.typedLayout(fmt.Sprintf("queue %s rank %d tag %d", op, peer, tag), buf, dt, count)
	if err != nil {
		return nil, err
	}
	if !e.run.IsZero() {
		return q.enqueueOp(send, e.run, peer, tag, nil)
	}
	if e.size > QueueMaxMessage {
		return nil, fmt.Errorf("%w: %s: %d packed bytes over the %d-byte staging limit", ErrInvalid, op, e.size, QueueMaxMessage)
	}
	if e.p != nil {
		if _, err := q.packStream(buf.Device()); err != nil {
			return nil, fmt.Errorf("transport: %s: %w", op, err)
		}
	}
	return q.enqueueOp(send, buf, peer, tag, e)
}

// packStream returns the queue's stream for the pack and unpack kernels of
// typed operations on dev (one per device, made on first use; Free
// destroys them).
func (q *Queue) packStream(dev *gpu.Device) (*gpu.Stream, error) {
	q.mu.Lock()
	defer q.mu.Unlock()
	if s := q.packStreams[dev]; s != nil {
		return s, nil
	}
	if q.freed {
		return nil, ErrQueueFreed
	}
	return perDevice(&q.packStreams, dev, newPackStream(dev))
}

func (q *Queue) enqueue(send bool, buf gpu.Buffer, peer, tag int) (*QueueOp, error) {
	return q.enqueueOp(send, buf, peer, tag, nil)
}

func (q *Queue) enqueueOp(send bool, buf gpu.Buffer, peer, tag int, typed *typedEnd) (*QueueOp, error) {
	op := "EnqueueRecv"
	if send {
		op = "EnqueueSend"
	}
	if typed != nil {
		op += "Typed"
	}
	if !send && (peer < 0 || tag < 0) {
		return nil, fmt.Errorf("%w: %s: source %d tag %d: stream-triggered receives take no wildcards", ErrInvalid, op, peer, tag)
	}
	if err := q.t.checkRank(peer, op); err != nil {
		return nil, err
	}
	if err := checkTag(tag, op); err != nil {
		return nil, err
	}
	if buf.IsZero() || buf.Freed() {
		return nil, fmt.Errorf("%w: %s: buffer is zero or freed", ErrInvalid, op)
	}
	if buf.System() != q.sys {
		return nil, fmt.Errorf("%w: %s: buffer of another gpu.System than the queue's stream", ErrInvalid, op)
	}
	if typed == nil && q.staged(buf) && buf.Len() > QueueMaxMessage {
		return nil, fmt.Errorf("%w: %s: %d-byte device message over the %d-byte staging limit", ErrInvalid, op, buf.Len(), QueueMaxMessage)
	}
	o := &QueueOp{q: q, send: send, peer: peer, tag: tag, buf: buf, typed: typed, done: make(chan struct{})}
	q.mu.Lock()
	defer q.mu.Unlock()
	if q.freed {
		return nil, fmt.Errorf("transport: %s: %w", op, ErrQueueFreed)
	}
	if q.err != nil {
		return nil, fmt.Errorf("transport: %s: queue in error: %w", op, q.err)
	}
	q.pending = append(q.pending, o)
	return o, nil
}

// staged reports whether buf travels through pinned host memory.
func (q *Queue) staged(buf gpu.Buffer) bool {
	return !buf.Kind().HostAccessible() && !q.t.deviceDirect(buf)
}

// Start enqueues on the stream the trigger of every operation enqueued since
// the previous Start: a stream write of the trigger counter. It returns at
// once. Once the queue is in error (Err) it enqueues nothing and returns
// that error.
func (q *Queue) Start() error {
	q.mu.Lock()
	defer q.mu.Unlock()
	if q.freed {
		return fmt.Errorf("transport: queue Start: %w", ErrQueueFreed)
	}
	if q.err != nil {
		return fmt.Errorf("transport: queue Start: queue in error: %w", q.err)
	}
	seq := q.starts + 1
	if err := gpu.WriteValue64(q.stream, q.trig, seq); err != nil {
		return fmt.Errorf("transport: queue Start: %w", err)
	}
	q.starts = seq
	q.started = append(q.started, &qbatch{seq: seq, ops: q.pending})
	q.pending = nil
	kick(q.kickStart)
	return nil
}

// Wait enqueues on the stream a wait until every operation started so far
// has completed: a stream wait on the completion counter. Work enqueued on
// the stream afterwards sees received data. It returns at once. Once the
// queue is in error (Err) it still enqueues the wait (the counter advances
// over failed operations too, so that later stream work never runs
// alongside an operation still in flight) and returns that error.
func (q *Queue) Wait() error {
	q.mu.Lock()
	defer q.mu.Unlock()
	if q.freed {
		return fmt.Errorf("transport: queue Wait: %w", ErrQueueFreed)
	}
	if err := gpu.WaitValue64(q.stream, q.comp, q.starts, gpu.GEQ); err != nil {
		return fmt.Errorf("transport: queue Wait: %w", err)
	}
	if q.err != nil {
		return fmt.Errorf("transport: queue Wait: queue in error: %w", q.err)
	}
	return nil
}

// Err returns the first failure of an operation of the queue (a
// *PeerLostError, ErrClosed, a *TruncatedError, ...), or nil. It is set
// before the completion counter covering that operation advances: after
// the stream passes a Wait (Synchronize returned), Err reports any failure
// of the operations that Wait covered. Operations ended by Free do not set
// it.
func (q *Queue) Err() error {
	q.mu.Lock()
	defer q.mu.Unlock()
	return q.err
}

// Free stops the queue's agent and releases its counters. Operations not
// completed yet fail with ErrQueueFreed (receives not matched are
// withdrawn), except sends already handed to the transport, which cannot
// be recalled: they end as they would have (Wait reports how) and their
// staging buffers go back then. Stream waits on the queue are released. As
// with MPIX_Free_queue the caller should first let the stream pass the
// last Wait. Free may be called from any goroutine, for instance when a
// context ends while the stream waits for a peer that never sends: it then
// ends that wait. A second call waits until the first has finished.
func (q *Queue) Free() error {
	q.mu.Lock()
	if q.freed {
		q.mu.Unlock()
		<-q.freeDone
		return nil
	}
	q.freed = true
	q.mu.Unlock()
	defer close(q.freeDone)
	q.cancel()
	q.wg.Wait()
	q.mu.Lock()
	var left []*QueueOp
	for _, b := range append(q.started, q.issued...) {
		left = append(left, b.ops...)
	}
	left = append(left, q.pending...)
	q.started, q.issued, q.pending = nil, nil, nil
	last := q.starts
	q.mu.Unlock()
	for _, o := range left {
		select {
		case <-o.done:
			continue
		default:
		}
		if o.send && o.req != nil && o.err == nil {
			go o.settle()
			continue
		}
		if !o.send && o.req != nil && !o.req.fin.Load() {
			// Issued and posted (the agent stopped at a send still in
			// flight before it): withdraw it, so that it does not take the
			// next message of its tag, or wait for the one it matched.
			withdraw, cancel := context.WithCancel(context.Background())
			cancel()
			_, _ = o.req.Wait(withdraw)
		}
		o.releaseSlot()
		o.finish(o.freedErr())
	}
	errs := []error{gpu.WriteValue64Host(q.comp, last)}
	q.mu.Lock()
	streams := q.packStreams
	q.packStreams = nil
	q.mu.Unlock()
	for _, s := range streams {
		errs = append(errs, s.Destroy())
	}
	errs = append(errs, gpu.Free(q.words), q.pool.Close())
	return errors.Join(errs...)
}

func kick(ch chan struct{}) {
	select {
	case ch <- struct{}{}:
	default:
	}
}

// triggerAgent waits, asleep, for the stream to write each started batch's
// trigger value and then issues the batch.
func (q *Queue) triggerAgent() {
	defer q.wg.Done()
	for {
		q.mu.Lock()
		var b *qbatch
		if len(q.started) > 0 {
			b = q.started[0]
		}
		q.mu.Unlock()
		if b == nil {
			select {
			case <-q.kickStart:
				continue
			case <-q.ctx.Done():
				return
			}
		}
		if err := gpu.WaitValue64Host(q.ctx, q.trig, b.seq, gpu.GEQ); err != nil {
			return // freed (or the gpu system closed): Free fails what is left
		}
		q.mu.Lock()
		sticky := q.err
		q.mu.Unlock()
		for _, o := range b.ops {
			if sticky != nil {
				// The queue is in error: later work is skipped.
				o.fail(fmt.Errorf("transport: queue %s rank %d tag %d: not issued, queue in error: %w", o.kind(), o.peer, o.tag, sticky))
				continue
			}
			o.issue()
		}
		q.mu.Lock()
		q.started = q.started[1:]
		q.issued = append(q.issued, b)
		q.mu.Unlock()
		kick(q.kickDone)
	}
}

// completionAgent waits for each issued batch's operations in order and
// then advances the completion counter to the batch's trigger value.
func (q *Queue) completionAgent() {
	defer q.wg.Done()
	for {
		q.mu.Lock()
		var b *qbatch
		if len(q.issued) > 0 {
			b = q.issued[0]
		}
		q.mu.Unlock()
		if b == nil {
			select {
			case <-q.kickDone:
				continue
			case <-q.ctx.Done():
				return
			}
		}
		for _, o := range b.ops {
			if !o.complete(q.ctx) {
				return // freed
			}
		}
		q.mu.Lock()
		q.issued = q.issued[1:]
		q.mu.Unlock()
		if err := gpu.WriteValue64Host(q.comp, b.seq); err != nil {
			q.t.log.Warn("stream-triggered queue: writing the completion counter failed")
		}
	}
}

func (o *QueueOp) kind() string {
	if o.send {
		return "send"
	}
	return "recv"
}

// issue starts the operation through the tagged API (agent goroutine).
func (o *QueueOp) issue() {
	q, t := o.q, o.q.t
	if o.buf.Freed() {
		// Freed after it was enqueued (the caller's bug): the transport
		// would move bytes at an address unmapped by now.
		o.fail(fmt.Errorf("transport: queue %s rank %d tag %d: %w", o.kind(), o.peer, o.tag, gpu.ErrFreed))
		return
	}
	n := o.buf.Len()
	var p unsafe.Pointer
	if o.typed != nil {
		n = int(o.typed.size)
		slot, err := q.pool.Get(max(n, 1))
		if err == nil {
			o.slot, _ = slot.Slice(0, n)
			if o.send {
				// The stream reached the trigger: the data is final.
				err = o.move(false)
			}
		}
		if err != nil {
			o.fail(fmt.Errorf("transport: queue typed %s rank %d tag %d: %w", o.kind(), o.peer, o.tag, err))
			return
		}
		p = o.ptr(o.slot)
	} else if q.staged(o.buf) {
		slot, err := q.pool.Get(max(n, 1))
		if err == nil {
			o.slot, _ = slot.Slice(0, n)
			if o.send {
				// The stream reached the trigger: the data is final.
				err = gpu.Copy(o.slot, o.buf)
			}
		}
		if err != nil {
			o.fail(fmt.Errorf("transport: queue %s rank %d tag %d: staging: %w", o.kind(), o.peer, o.tag, err))
			return
		}
		p = o.ptr(o.slot)
	} else {
		p = o.ptr(o.buf)
	}
	r := t.newRequest(o.kind(), o.peer, o.tag, n)
	r.b = ucx.Buffer{Ptr: p, Len: n}
	if o.slot.Len() == 0 && n > 0 && !o.buf.Kind().HostAccessible() {
		r.dev = o.buf // UCX moves device memory itself (deviceDirect)
	}
	o.req = r
	if o.send {
		t.execReq(r, startSend)
	} else {
		r.recv = true
		t.execReq(r, startRecv)
	}
}

// move packs the operation's layout into its slot, or unpacks the slot
// into the layout (agent goroutines).
func (o *QueueOp) move(unpack bool) error {
	if o.typed.size == 0 {
		return nil
	}
	var st *gpu.Stream
	if o.typed.p != nil {
		var err error
		if st, err = o.q.packStream(o.buf.Device()); err != nil {
			return err
		}
	}
	return o.typed.move(st, o.slot, unpack)
}

// ptr is the address UCX uses for b.
func (o *QueueOp) ptr(b gpu.Buffer) unsafe.Pointer {
	if b.Len() == 0 {
		return nil
	}
	if bs, err := b.Bytes(); err == nil {
		return unsafe.Pointer(unsafe.SliceData(bs))
	}
	return ucx.AddrPointer(b.Ptr())
}

// fail records an issue failure; complete reports it.
func (o *QueueOp) fail(err error) { o.err = err }

// complete waits for the operation (agent goroutine), unstages received
// data and finishes it. It reports false when the queue was freed first.
func (o *QueueOp) complete(ctx context.Context) bool {
	if o.err != nil {
		o.releaseSlot()
		o.q.setErr(o.err)
		o.finish(o.err)
		return true
	}
	st, err := o.req.Wait(ctx)
	if err != nil && ctx.Err() != nil {
		if !o.req.fin.Load() {
			return false // a send still in flight: Free settles it
		}
		// Finished after all: its own result (a send that completed as
		// ctx ended was delivered, not freed).
		st, err = o.req.status, o.req.err
		if err != nil && errors.Is(err, ctx.Err()) {
			err = o.freedErr() // a receive Free withdrew
		}
	}
	if err == nil && !o.send && o.typed != nil {
		if st.Size != int(o.typed.size) {
			err = fmt.Errorf("%w: queue typed recv rank %d tag %d: %d bytes arrived, the layout packs %d", ErrTruncated, o.peer, o.tag, st.Size, o.typed.size)
		} else if err = o.move(true); err != nil {
			err = fmt.Errorf("transport: queue typed recv rank %d tag %d: %w", o.peer, o.tag, err)
		}
	} else if err == nil && !o.send && !o.slot.IsZero() && st.Size > 0 {
		var src, dst gpu.Buffer
		if src, err = o.slot.Slice(0, st.Size); err == nil {
			if dst, err = o.buf.Slice(0, st.Size); err == nil {
				err = gpu.Copy(dst, src)
			}
		}
		if err != nil {
			err = fmt.Errorf("transport: queue recv rank %d tag %d: unstaging: %w", o.peer, o.tag, err)
		}
	}
	o.releaseSlot()
	o.status = st
	if err != nil && !errors.Is(err, ErrQueueFreed) {
		o.q.setErr(err)
	}
	o.finish(err)
	return true
}

// setErr records the queue's first operation failure.
func (q *Queue) setErr(err error) {
	q.mu.Lock()
	if q.err == nil {
		q.err = err
	}
	q.mu.Unlock()
}

// settle waits for a send the queue was freed under and finishes it with
// its own result.
func (o *QueueOp) settle() {
	st, err := o.req.Wait(context.Background())
	o.releaseSlot()
	o.status = st
	o.finish(err)
}

// freedErr is the error of an operation Free ended.
func (o *QueueOp) freedErr() error {
	return fmt.Errorf("transport: queue %s rank %d tag %d: %w", o.kind(), o.peer, o.tag, ErrQueueFreed)
}

func (o *QueueOp) releaseSlot() {
	if !o.slot.IsZero() {
		_ = o.q.pool.Put(o.slot)
		o.slot = gpu.Buffer{}
	}
}

func (o *QueueOp) finish(err error) {
	select {
	case <-o.done:
		return
	default:
	}
	o.err = err
	close(o.done)
}

// Done returns a channel closed when the operation has completed (before the
// completion counter that covers it advances).
func (o *QueueOp) Done() <-chan struct{} { return o.done }

// Wait blocks the calling goroutine until the operation completes (the host
// side of MPI_Wait on a stream-triggered request) and returns a receive's
// status.
func (o *QueueOp) Wait(ctx context.Context) (Status, error) {
	select {
	case <-o.done:
		return o.status, o.err
	default:
	}
	if t := o.q.t; t.handling.Load() { // (no formatting on the way of every wait)
		if err := t.waitInHandler("queue "+o.kind(), o.peer, o.tag); err != nil {
			return Status{}, err // the queue's agents need the worker progressed
		}
	}
	select {
	case <-o.done:
		return o.status, o.err
	case <-ctx.Done():
		return Status{}, fmt.Errorf("transport: queue %s rank %d tag %d: %w", o.kind(), o.peer, o.tag, ctx.Err())
	}
}
