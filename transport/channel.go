package transport

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"

	"github.com/troupe-hpc/troupe/gpu"
	"github.com/troupe-hpc/troupe/overlap"
)

// ChannelChunkSize is the framing unit of channel messages. A message of n
// bytes travels as one UCX message when n < ChannelChunkSize, otherwise as
// n/ChannelChunkSize full chunks followed by one tail chunk of
// n%ChannelChunkSize bytes (possibly empty), all under the message's tag.
// Both ends derive the framing from their own buffer length, so a staged end
// can pipeline chunk by chunk without telling the other end, and a
// difference in sizes always shows at the receiver as a short or truncated
// chunk (the tail is always shorter than a full chunk).
const ChannelChunkSize = 512 << 10

// stageDepth is how many pinned chunk buffers one staged transfer uses at
// most: copies of the next chunks overlap the send of the current one.
const stageDepth = 4

// ErrSizeMismatch: the two ends of a channel transfer used buffers of
// different sizes.
var ErrSizeMismatch = errors.New("transport: channel message size mismatch")

// ErrChannelInUse: a channel with that id already exists on this rank, or,
// in this process, another rank's end of it goes to the same peer.
var ErrChannelInUse = errors.New("transport: channel id in use")

// errRecvWithdrawn completes the receives that Channel.Close withdraws
// because no message had matched them.
var errRecvWithdrawn = fmt.Errorf("withdrawn by Close before a message matched it: %w", ErrClosed)

// ErrChannelBroken: a channel's sends are broken (*ChannelBrokenError).
var ErrChannelBroken = errors.New("transport: channel broken")

// ChannelBrokenError reports a channel end whose sends are broken: the post
// of message Message failed when its number could not be given back,
// because part of it had gone out (Partial) or a later message had taken
// the next number. The peer's receive of that message never completes, and
// the later messages would not match the peer's receives: that message,
// and every later send of this end, fail with this error. Cause is the
// post's failure. errors.Is(err, ErrChannelBroken) is true.
type ChannelBrokenError struct {
	Channel uint32
	Peer    int
	Message uint32 // the counter of the message whose post failed
	Partial bool   // part of that message had gone out
	Cause   error
}

func (e *ChannelBrokenError) Error() string {
	why := "a later message had taken the next number"
	if e.Partial {
		why = "part of it had gone out"
	}
	return fmt.Sprintf("transport: channel %d to rank %d broken: the post of message %d failed after %s, so the peer cannot receive it: %v", e.Channel, e.Peer, e.Message, why, e.Cause)
}

// Unwrap makes errors.Is(err, ErrChannelBroken) true, and true for the
// post's failure too.
func (e *ChannelBrokenError) Unwrap() []error { return []error{ErrChannelBroken, e.Cause} }

// SizeMismatchError reports a channel transfer whose two buffers differ in
// size. The receiver always detects it; on the same-process path the sender
// is told too. Got is the other end's size when it is known exactly, -1
// otherwise (Detail then says what was seen).
type SizeMismatchError struct {
	Channel uint32
	Peer    int
	Op      string // "send" or "recv"
	Want    int    // this end's buffer size
	Got     int    // the other end's size, or -1
	Detail  string
	cause   error
}

func (e *SizeMismatchError) Error() string {
	got := "a different size"
	if e.Got >= 0 {
		got = fmt.Sprintf("%d bytes", e.Got)
	}
	s := fmt.Sprintf("transport: channel %d %s with rank %d: this end's buffer is %d bytes, the other end's is %s", e.Channel, e.Op, e.Peer, e.Want, got)
	if e.Detail != "" {
		s += " (" + e.Detail + ")"
	}
	return s
}

// Unwrap makes errors.Is(err, ErrSizeMismatch) true, and ErrTruncated too
// when UCX reported truncation.
func (e *SizeMismatchError) Unwrap() []error {
	if e.cause != nil {
		return []error{ErrSizeMismatch, e.cause}
	}
	return []error{ErrSizeMismatch}
}

// TransferPath names how a channel transfer moves its bytes.
type TransferPath string

// Transfer paths (docs/gpu.md).
const (
	// PathLocal: both ends live in this process; one copy, device to
	// device when both buffers are device memory.
	PathLocal TransferPath = "local"
	// PathDirect: UCX reads or writes the buffer itself (host memory, or
	// device memory when UCX reports support for its memory type).
	PathDirect TransferPath = "direct"
	// PathStaged: chunks are copied through pinned host buffers, the
	// copies overlapping the UCX transfers of earlier chunks.
	PathStaged TransferPath = "staged"
)

// Channel is one end of a two-sided channel between this rank and a peer
// (the Channel API of the GPU-aware runtime paper). Both ranks create it with
// the same id, which must be unique in the job. Each end counts its sends and
// its receives; the n-th Send of one end matches the n-th Recv of the other,
// through a tag made of the channel id and that counter (DESIGN 5.2), so no
// metadata message is exchanged. Methods are safe for concurrent use; the
// order of calls fixes the counters.
type Channel struct {
	t     *Transport
	id    uint32
	peer  int
	local *Transport // the peer's transport when it lives in this process
	ipc   bool       // another process on this host: the CUDA IPC protocol (channel_ipc.go)

	mu      sync.Mutex
	sendCtr uint32
	recvCtr uint32
	// sendBroken, once set (under mu), fails the sends after the message
	// it names (dropSend).
	sendBroken atomic.Pointer[ChannelBrokenError]
	closed     bool
	streams    map[streamKey]*gpu.Stream
	retired    []*gpu.Stream // streams whose work failed (retireFailed)
	// lastStaged[send] is closed when the latest staged transfer of that
	// direction has finished: staged transfers of one direction run one at a
	// time, in call order (a receive must not wait for a message whose
	// sender waits for an earlier receive).
	lastStaged [2]chan struct{}
	// streamUsers counts CUDA IPC copies using the streams (Close waits).
	streamUsers sync.WaitGroup
	// streamsGone: Close has taken the streams away, after the transfers
	// posted before it were done with them.
	streamsGone bool
	ipcMaps     ipcCache // mappings kept open (channel_ipc.go)
	// unmatched holds, for each receive posted over UCX, its chunk
	// receives (the first one first), for Close to withdraw those that no
	// message has matched (postedRecv); entries whose first chunk has
	// completed are dropped once len reaches unmatchedCap.
	unmatched    [][]*Request
	unmatchedCap int
}

// streamKey names a channel's copy stream: one per device and direction, so
// that sends and receives do not wait for each other's copies.
type streamKey struct {
	dev  *gpu.Device
	send bool
	pack bool // typed transfers' pack and unpack kernels (channel_typed.go)
}

type channelKey struct {
	t  *Transport
	id uint32
}

// channels holds the open channels of every transport in the process.
var channels sync.Map // channelKey -> *Channel

// localEnds holds the open same-process channels by the transport their
// sends go to (the peer's) and id: two ends there would share the
// post office's slots (postLocal).
var localEnds sync.Map // channelKey{peer's transport, id} -> *Channel

// PairChannelBase is the first channel id reserved for pair channels
// (PairChannel): Channel refuses ids from there on.
const PairChannelBase = 1 << (ChannelBits - 1)

// Channel creates this rank's end of channel id with peer. The peer creates
// its end with the same id and this rank as its peer. peer may be this rank:
// the channel then connects the rank with itself. id must be below
// PairChannelBase and not be open already on this rank.
func (t *Transport) Channel(id uint32, peer int) (*Channel, error) {
	if id >= PairChannelBase {
		return nil, fmt.Errorf("%w: channel id %d: ids from %d on are reserved for pair channels", ErrInvalid, id, PairChannelBase)
	}
	return t.openChannel(id, peer)
}

// PairChannel creates this rank's end of the pair channel with peer: a
// channel whose id, from the range Channel refuses, is derived from the two
// ranks, so that both ends find it without agreeing on an id. There is one
// per pair of ranks; the actor runtime carries large gpu.Buffer fields of
// messages on it (docs/gpu.md), so other code must not open it beside a
// runtime. A job too large for the reserved range (more than about 11,500
// ranks) gets an error wrapping ErrInvalid.
func (t *Transport) PairChannel(peer int) (*Channel, error) {
	if err := t.checkRank(peer, "pair channel"); err != nil {
		return nil, err
	}
	lo, hi := min(t.rank, peer), max(t.rank, peer)
	idx := uint64(lo)*uint64(t.size) + uint64(hi)
	if idx >= 1<<ChannelBits-PairChannelBase {
		return nil, fmt.Errorf("%w: no pair channel id for ranks %d and %d of %d", ErrInvalid, lo, hi, t.size)
	}
	return t.openChannel(PairChannelBase+uint32(idx), peer)
}

// openChannel creates this rank's end of channel id with peer.
func (t *Transport) openChannel(id uint32, peer int) (*Channel, error) {
	if err := t.checkRank(peer, "channel"); err != nil {
		return nil, err
	}
	if _, err := MakeChannelTag(id, 0); err != nil {
		return nil, fmt.Errorf("%w: %v", ErrInvalid, err)
	}
	t.mu.Lock()
	closed := t.closed
	t.mu.Unlock()
	if closed {
		return nil, fmt.Errorf("transport: channel %d: %w", id, ErrClosed)
	}
	c := &Channel{t: t, id: id, peer: peer, local: t.inProcess(peer)}
	c.ipcMaps.st = &t.gipc
	c.ipc = c.local == nil && t.gpuIPCPeer(peer)
	if _, loaded := channels.LoadOrStore(channelKey{t, id}, c); loaded {
		return nil, fmt.Errorf("%w: channel %d on rank %d", ErrChannelInUse, id, t.rank)
	}
	if c.local != nil {
		if v, loaded := localEnds.LoadOrStore(channelKey{c.local, id}, c); loaded {
			channels.Delete(channelKey{t, id})
			return nil, fmt.Errorf("%w: channel %d towards rank %d: rank %d of this process has an end of it towards that rank already (ids must be unique in the job)",
				ErrChannelInUse, id, peer, v.(*Channel).t.rank)
		}
	}
	t.chanOpen.Add(1)
	if t.ov != nil {
		// Chunks of the id taken before are the peer's: they go if it is
		// lost, even once the channel is closed (ovPeerLost).
		t.mu.Lock()
		t.ovChannelOpened(id, peer)
		t.mu.Unlock()
	}
	return c, nil
}

// channelPeer returns the peer of channel id on this rank, or
// overlap.AnyPeer when the channel is not open (yet).
func (t *Transport) channelPeer(id uint32) int {
	if v, ok := channels.Load(channelKey{t, id}); ok {
		return v.(*Channel).peer
	}
	return overlap.AnyPeer
}

// ID returns the channel id.
func (c *Channel) ID() uint32 { return c.id }

// Peer returns the rank at the other end.
func (c *Channel) Peer() int { return c.peer }

// Close releases the channel id on this rank, the channel's streams and the
// CUDA IPC mappings it keeps open. Receives that no message has matched
// yet are withdrawn: they fail with an error wrapping ErrClosed, and the
// peer's messages they would have taken go to the channel next opened with
// this id (its counters start again at zero). Other transfers in flight
// complete (Close waits for the staged ones, which use the streams: those
// posted before it, even those still queued behind another, run and end as
// they would have); later calls fail with ErrClosed.
func (c *Channel) Close() error {
	c.mu.Lock()
	if c.closed {
		c.mu.Unlock()
		return nil
	}
	c.closed = true
	last := c.lastStaged
	unmatched := c.unmatched
	c.unmatched = nil
	c.mu.Unlock()
	c.t.withdrawRecvs(unmatched, errRecvWithdrawn)
	if c.local != nil {
		c.withdrawLocal()
	}
	for _, ch := range last {
		if ch != nil {
			<-ch
		}
	}
	c.streamUsers.Wait()
	c.mu.Lock()
	streams, retired := c.streams, c.retired
	c.streams, c.retired = nil, nil
	c.streamsGone = true
	c.mu.Unlock()
	errs := []error{c.ipcMaps.release()}
	for _, s := range streams {
		errs = append(errs, s.Destroy())
	}
	for _, s := range retired {
		_ = s.Destroy() // its failure was reported to its transfers
	}
	if c.local != nil {
		localEnds.CompareAndDelete(channelKey{c.local, c.id}, c)
	}
	channels.Delete(channelKey{c.t, c.id})
	c.t.chanOpen.Add(-1)
	return errors.Join(errs...)
}

// next takes the next counter of one direction.
func (c *Channel) next(send bool) (uint32, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.closed {
		return 0, fmt.Errorf("transport: channel %d: %w", c.id, ErrClosed)
	}
	if send {
		if b := c.sendBroken.Load(); b != nil {
			return 0, b
		}
		c.sendCtr++
		return c.sendCtr - 1, nil
	}
	c.recvCtr++
	return c.recvCtr - 1, nil
}

// dropSend: the post of send message ctr failed with err before it was
// done; out says whether something of it went out. It returns the error to
// fail the message with. When nothing went out and no later send has taken
// a number, the number is given back, so that the next send takes it and
// the peer's next receive matches it: err. Otherwise the peer's receive
// of message ctr can never complete, and the channel's sends are broken
// from ctr on: a *ChannelBrokenError.
func (c *Channel) dropSend(ctr uint32, out bool, err error) error {
	c.mu.Lock()
	defer c.mu.Unlock()
	if !out && c.sendBroken.Load() == nil && c.sendCtr == ctr+1 {
		c.sendCtr = ctr
		return err
	}
	b := &ChannelBrokenError{Channel: c.id, Peer: c.peer, Message: ctr, Partial: out, Cause: err}
	if c.sendBroken.Load() == nil {
		c.sendBroken.Store(b)
	}
	return b
}

// stream returns the channel's copy stream on dev for one direction,
// creating it on first use.
func (c *Channel) stream(dev *gpu.Device, send bool) (*gpu.Stream, error) {
	return c.streamFor(streamKey{dev: dev, send: send})
}

// streamFor returns the channel's stream of key, creating it on first use.
func (c *Channel) streamFor(key streamKey) (*gpu.Stream, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.streamsGone {
		return nil, fmt.Errorf("transport: channel %d: %w", c.id, ErrClosed)
	}
	dev := key.dev
	if s := c.streams[key]; s != nil {
		return s, nil
	}
	s, err := dev.NewStream()
	if err != nil {
		return nil, fmt.Errorf("transport: channel %d: staging stream: %w", c.id, err)
	}
	if c.streams == nil {
		c.streams = map[streamKey]*gpu.Stream{}
	}
	c.streams[key] = s
	return s, nil
}

// retireFailed retires st, the channel's stream of key, if work on it has
// failed, so that the next transfer gets a new one (chanTyped.retireFailed).
func (c *Channel) retireFailed(key streamKey, st *gpu.Stream) {
	retireFailed(&c.mu, &c.streams, key, st, &c.retired)
}

// endBuf is one end's memory: Go bytes or a gpu.Buffer.
type endBuf struct {
	b   []byte
	g   gpu.Buffer
	isG bool
	// ready, for a send on the direct path, returns once chunk i of the
	// memory is filled (a typed send packing its stage chunk by chunk);
	// nil: all of it is.
	ready func(i int) error
}

func (e endBuf) n() int {
	if e.isG {
		return e.g.Len()
	}
	return len(e.b)
}

// Send starts sending buf (any memory kind) as the channel's next message
// and returns a request that completes when buf may be reused. The peer
// receives it with its matching Recv or RecvBytes into a buffer of the same
// size.
func (c *Channel) Send(buf gpu.Buffer) (*ChannelRequest, error) {
	if buf.IsZero() {
		return nil, fmt.Errorf("%w: channel %d send: zero gpu.Buffer", ErrInvalid, c.id)
	}
	return c.start(true, endBuf{g: buf, isG: true})
}

// SendBytes is Send for Go memory. b must not be modified until the request
// completes.
func (c *Channel) SendBytes(b []byte) (*ChannelRequest, error) {
	return c.start(true, endBuf{b: b})
}

// Recv starts receiving the channel's next message into buf (any memory
// kind), which must have the sender's size: a different size fails the
// request with a *SizeMismatchError.
func (c *Channel) Recv(buf gpu.Buffer) (*ChannelRequest, error) {
	if buf.IsZero() {
		return nil, fmt.Errorf("%w: channel %d recv: zero gpu.Buffer", ErrInvalid, c.id)
	}
	return c.start(false, endBuf{g: buf, isG: true})
}

// RecvBytes is Recv for Go memory.
func (c *Channel) RecvBytes(b []byte) (*ChannelRequest, error) {
	return c.start(false, endBuf{b: b})
}

func (c *Channel) start(send bool, e endBuf) (*ChannelRequest, error) {
	op := "recv"
	if send {
		op = "send"
	}
	if e.isG && e.g.Freed() {
		return nil, fmt.Errorf("transport: channel %d %s: %w", c.id, op, gpu.ErrFreed)
	}
	ctr, err := c.next(send)
	if err != nil {
		return nil, err
	}
	cr := &ChannelRequest{c: c, op: op, n: e.n(), counter: ctr}
	switch {
	case c.local != nil:
		cr.path = PathLocal
		cr.done = make(chan struct{})
		c.postLocal(send, ctr, e, cr)
	case c.ipc:
		if err := c.startIPCChannel(send, ctr, e, cr); err != nil {
			if send {
				err = c.dropSend(ctr, true, err) // its header may have gone out
			}
			return nil, err
		}
	default:
		if err := c.startPath(send, ctr, e, cr); err != nil {
			if send { // refused before anything was posted
				err = c.dropSend(ctr, false, err)
			}
			return nil, err
		}
		if !send && cr.reqs != nil {
			c.postedRecv(cr.reqs) // direct, or small staged
		}
	}
	return cr, nil
}

// postedRecv records rs, the chunk receives of one message just posted over
// UCX (the first one first), for Close to withdraw while no message has
// matched them; on a channel closed meanwhile they are withdrawn at once.
func (c *Channel) postedRecv(rs []*Request) {
	c.mu.Lock()
	if c.closed {
		c.mu.Unlock()
		c.t.withdrawRecvs([][]*Request{rs}, errRecvWithdrawn)
		return
	}
	if len(c.unmatched) >= c.unmatchedCap {
		live := c.unmatched[:0]
		for _, m := range c.unmatched {
			if !m[0].fin.Load() {
				live = append(live, m)
			}
		}
		clear(c.unmatched[len(live):])
		c.unmatched = live
		c.unmatchedCap = max(16, 2*len(live))
	}
	c.unmatched = append(c.unmatched, rs)
	c.mu.Unlock()
}

// isClosed reports whether Close has been called.
func (c *Channel) isClosed() bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.closed
}

// startPath starts a transfer between processes: direct, or staged.
func (c *Channel) startPath(send bool, ctr uint32, e endBuf, cr *ChannelRequest) error {
	if !e.isG || e.g.Kind().HostAccessible() || c.t.deviceDirect(e.g) {
		cr.path = PathDirect
		return c.startDirect(send, ctr, e, cr)
	}
	cr.path = PathStaged
	if cr.n <= eagerStageMax {
		ok, err := c.startEagerStaged(send, ctr, e.g, cr)
		if err != nil || ok {
			return err
		}
	}
	cr.done = make(chan struct{})
	prev, mine := c.stagedTurn(send)
	go func() {
		defer close(mine)
		if prev != nil {
			<-prev
		}
		if send {
			cr.finish(c.runStagedSend(ctr, e.g, cr.n))
		} else {
			cr.finish(c.runStagedRecv(ctr, e.g, cr, true))
		}
	}()
	return nil
}

// stagedTurn returns the channel closed when the previous staged transfer of
// the direction has finished, and the one this transfer closes.
func (c *Channel) stagedTurn(send bool) (prev, mine chan struct{}) {
	i := 0
	if send {
		i = 1
	}
	mine = make(chan struct{})
	c.mu.Lock()
	prev, c.lastStaged[i] = c.lastStaged[i], mine
	c.mu.Unlock()
	return prev, mine
}

// chunkCount and chunkLen give the framing of an n-byte message
// (ChannelChunkSize).
func chunkCount(n int) int {
	if n < ChannelChunkSize {
		return 1
	}
	return n/ChannelChunkSize + 1
}

func chunkLen(n, i int) int {
	if n < ChannelChunkSize {
		return n
	}
	if i < n/ChannelChunkSize {
		return ChannelChunkSize
	}
	return n % ChannelChunkSize
}

// ChannelRequest is a channel Send or Recv in flight: a future.
type ChannelRequest struct {
	c       *Channel
	op      string
	n       int
	counter uint32
	path    TransferPath
	late    atomic.Pointer[TransferPath] // IPC channels: the path, once known

	reqs []*Request // direct path: one UCX request per chunk

	done chan struct{} // local and staged paths: closed when err is final

	inner *ChannelRequest // typed transfers: the packed message's request

	post func(error) error // direct path: runs once when the chunks are done

	// landed, for a receive on the direct path, takes chunk i once it has
	// arrived whole (a typed receive unpacking its stage chunk by chunk):
	// called once per chunk, in order, by the Wait, Test or finalize that
	// sees it (land). A failure stops the landing; the chunks are still
	// received, and the request fails with landErr.
	landed  func(i int) error
	landMu  sync.Mutex
	nLanded int
	landErr error

	resOnce     sync.Once
	res         chan struct{} // direct path: closed when err is final (Done)
	discardOnce sync.Once     // a failed receive's leftover chunks are discarded once
	finOnce     sync.Once
	err         error
}

// Path reports how the transfer moves its bytes. On a channel to another
// process of this host that may use CUDA IPC, a receive learns the path
// when its message arrives: until then Path reports the path its own memory
// would take without IPC.
func (r *ChannelRequest) Path() TransferPath {
	if r.inner != nil {
		return r.inner.Path()
	}
	if p := r.late.Load(); p != nil {
		return *p
	}
	return r.path
}

// Size returns the request's buffer size in bytes.
func (r *ChannelRequest) Size() int { return r.n }

// Wait blocks until the transfer completes or ctx ends, and returns its
// outcome. Every request must be completed through Wait, Test or Done: a
// small staged receive copies its data to the device, and returns its pinned
// buffer, there. Channel transfers cannot be recalled: when ctx ends first, Wait
// returns ctx's error and the transfer goes on (its buffer stays in use until
// Done is closed).
func (r *ChannelRequest) Wait(ctx context.Context) error {
	if r.reqs == nil {
		select {
		case <-r.done:
			return r.err
		default:
		}
		if t := r.c.t; t.handling.Load() { // (no formatting on the way of every wait)
			if err := t.waitInHandler(fmt.Sprintf("channel %d %s", r.c.id, r.op), -1, 0); err != nil {
				return err
			}
		}
		select {
		case <-r.done:
			return r.err
		case <-ctx.Done():
			return fmt.Errorf("transport: channel %d %s: %w (transfer still in flight)", r.c.id, r.op, ctx.Err())
		}
	}
	for i, q := range r.reqs {
		_, err := waitRequest(ctx, q)
		if !q.fin.Load() {
			if ctx.Err() == nil { // ErrInHandler
				return fmt.Errorf("transport: channel %d %s: %w (transfer still in flight)", r.c.id, r.op, err)
			}
			return fmt.Errorf("transport: channel %d %s: %w (transfer still in flight)", r.c.id, r.op, ctx.Err())
		}
		if err := r.chunkErr(i, q); err != nil {
			// The remaining chunk receives may never match: withdraw them.
			r.withdrawRest(i, err)
			break
		}
		r.land(i)
	}
	return r.finalize()
}

// Test reports whether the transfer has completed, and its outcome, without
// blocking.
func (r *ChannelRequest) Test() (bool, error) {
	if r.reqs == nil {
		select {
		case <-r.done:
			return true, r.err
		default:
			return false, nil
		}
	}
	for i, q := range r.reqs {
		if ok, _, _ := q.Test(); !ok {
			return false, nil
		}
		if err := r.chunkErr(i, q); err != nil {
			r.withdrawRest(i, err)
			break
		}
		r.land(i)
	}
	return true, r.finalize()
}

// land hands chunks up to i, which have arrived whole, to r.landed, each
// once and in order.
func (r *ChannelRequest) land(i int) {
	if r.landed == nil {
		return
	}
	r.landMu.Lock()
	defer r.landMu.Unlock()
	for ; r.landErr == nil && r.nLanded <= i; r.nLanded++ {
		r.landErr = r.landed(r.nLanded)
	}
}

// withdrawRest runs when chunk i of the direct path failed with err: it
// withdraws the later chunk receives, waits until they have finished, and
// after a size mismatch has the sender's chunks that no receive took
// discarded (discardLeftovers).
func (r *ChannelRequest) withdrawRest(i int, err error) {
	t := r.c.t
	rest := r.reqs[i+1:]
	t.cancelAll(rest)
	for _, q := range rest {
		_, _ = waitRequest(context.Background(), q)
	}
	if r.op == "recv" && errors.Is(err, ErrSizeMismatch) {
		r.discardOnce.Do(func() { t.discardLeftovers(r.c.id, r.c.peer, r.counter, r.reqs[i:]) })
	}
}

// Done returns a channel closed when the transfer has completed.
func (r *ChannelRequest) Done() <-chan struct{} {
	if r.reqs == nil {
		return r.done
	}
	r.resOnce.Do(func() {
		r.res = make(chan struct{})
		go func() {
			_ = r.Wait(context.Background())
			close(r.res)
		}()
	})
	return r.res
}

// finalize computes the direct path's outcome from its completed chunk
// requests.
func (r *ChannelRequest) finalize() error {
	r.finOnce.Do(func() {
		var first error
		for i, q := range r.reqs {
			err := r.chunkErr(i, q)
			if err != nil && first == nil {
				first = err
			}
		}
		if first == nil && r.landed != nil {
			r.land(len(r.reqs) - 1)
			first = r.landErr
		}
		if r.post != nil {
			first = r.post(first)
		}
		r.err = first
	})
	return r.err
}

func (r *ChannelRequest) chunkErr(i int, q *Request) error {
	c := r.c
	want := chunkLen(r.n, i)
	var trunc *TruncatedError
	switch {
	case errors.As(q.err, &trunc):
		got := -1
		if len(r.reqs) == 1 {
			got = trunc.Size
		}
		return &SizeMismatchError{Channel: c.id, Peer: c.peer, Op: r.op, Want: r.n, Got: got,
			Detail: fmt.Sprintf("chunk %d of %d: %d bytes arrived for %d", i, len(r.reqs), trunc.Size, want), cause: q.err}
	case errors.Is(q.err, errChunkCancelled):
		return nil // an earlier chunk reports the mismatch
	case q.err != nil:
		return fmt.Errorf("transport: channel %d %s (message %d): %w", c.id, r.op, r.counter, q.err)
	case r.op == "recv" && q.status.Size != want:
		got := -1
		if len(r.reqs) == 1 {
			got = q.status.Size
		}
		return &SizeMismatchError{Channel: c.id, Peer: c.peer, Op: r.op, Want: r.n, Got: got,
			Detail: fmt.Sprintf("chunk %d of %d: %d bytes arrived for %d", i, len(r.reqs), q.status.Size, want)}
	}
	return nil
}

// finish completes a local or staged request.
func (r *ChannelRequest) finish(err error) {
	r.err = err
	close(r.done)
}
