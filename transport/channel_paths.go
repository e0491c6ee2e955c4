package transport

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"unsafe"

	"github.com/troupe-hpc/troupe/gpu"
	"github.com/troupe-hpc/troupe/transport/ucx"
)

// ---- locality -------------------------------------------------------------

// localRanks maps the worker address of every rank started in this process
// by StartLocal to its transport: the same-process transfer path needs to
// know, identically at both ends, that the peer lives here.
var localRanks sync.Map // string(worker address) -> *Transport

// registerLocal records the ranks of an in-process job; unregisterLocal
// forgets them.
func registerLocal(ts []*Transport) {
	for _, t := range ts {
		localRanks.Store(string(t.addrs[t.rank]), t)
	}
}

func unregisterLocal(ts []*Transport) {
	for _, t := range ts {
		if t != nil {
			localRanks.Delete(string(t.addrs[t.rank]))
		}
	}
}

// noLocalPath makes channels created afterwards ignore locality, so that
// tests can drive the UCX paths between the ranks of one process.
var noLocalPath bool

// inProcess returns the transport of rank peer when it lives in this
// process (the rank itself, or a rank of the same StartLocal job).
func (t *Transport) inProcess(peer int) *Transport {
	if noLocalPath {
		return nil
	}
	if peer == t.rank {
		return t
	}
	if _, ok := localRanks.Load(string(t.addrs[t.rank])); !ok {
		return nil
	}
	if v, ok := localRanks.Load(string(t.addrs[peer])); ok {
		return v.(*Transport)
	}
	return nil
}

// memTypes caches what each transport's UCX context reports it can access.
var memTypes sync.Map // *Transport -> ucx.MemoryTypes

// deviceDirect reports whether UCX can move b's device or managed memory
// itself: only on the cuda backend, and only when the UCX context reports
// support for the memory type (UCX built with CUDA). The host backend's
// device memory is host memory that only the gpu API may touch, so it takes
// the staged path that a GPU without UCX support takes.
func (t *Transport) deviceDirect(b gpu.Buffer) bool {
	if b.System() == nil || b.System().Backend() != gpu.BackendCUDA {
		return false
	}
	v, ok := memTypes.Load(t)
	if !ok {
		mt, err := t.ctx.MemoryTypes()
		if err != nil {
			t.log.Warn("ucp_context_query failed; staging device memory")
		}
		v, _ = memTypes.LoadOrStore(t, mt)
	}
	mt := v.(ucx.MemoryTypes)
	if b.Kind() == gpu.KindManaged {
		return mt.Has(ucx.MemoryCUDAManaged)
	}
	return mt.Has(ucx.MemoryCUDA)
}

// ---- raw channel-tag operations ------------------------------------------

// chanSinkKey is the seqKey of channel receives. Channel receives carry
// their own tags; the key only gives the transport's bookkeeping for
// cancelled receives (which channel receives never reuse) a place that no
// user (peer, tag) pair can have.
var chanSinkKey = seqKey{peer: -1, tag: -1}

// errChunkCancelled marks chunk receives withdrawn after an earlier chunk of
// the same message failed.
var errChunkCancelled = errors.New("transport: channel chunk receive withdrawn after an earlier chunk failed")

// rawSend posts a tagged send of n bytes at p with a channel tag.
func (t *Transport) rawSend(peer int, chanID uint32, tag uint64, p unsafe.Pointer, n int) *Request {
	r := t.newRequest("channel send", peer, int(chanID), n)
	r.b = ucx.Buffer{Ptr: p, Len: n}
	t.exec(func() {
		ep, err := t.peerLocked(peer, r.op)
		if err != nil {
			t.fail(r, err)
			return
		}
		ureq, err := t.w.TagSend(ep.ep, r.b, tag)
		t.settle(r, ureq, err)
	})
	return r
}

// chanSend is one message of a channel being sent over UCX. Its chunks
// are posted one by one (sendChunk), possibly as staging frees its pinned
// buffers; the first whose post fails ends the message, and its later
// chunks are failed without being posted. The worker lock guards out and
// failed (they are set before the message's first post, or in its posts).
type chanSend struct {
	c   *Channel
	ctr uint32 // the message's number
	tag uint64
	// out: something went out under the message's number (a chunk, or the
	// header or CUDA IPC descriptor of an IPC channel).
	out    bool
	failed error // the message's error once one of its posts failed
}

// newChanSend starts the sending of message ctr of c over UCX. On an IPC
// channel the message's header or descriptor has gone out already.
func (c *Channel) newChanSend(ctr uint32, tag uint64) *chanSend {
	return &chanSend{c: c, ctr: ctr, tag: tag, out: c.ipc}
}

// sendChunk posts chunk i of the message, n bytes at p. A message of a
// channel broken before it (Channel.sendBroken), or one whose earlier post
// failed, posts nothing more: the chunk fails with that error.
func (m *chanSend) sendChunk(i int, p unsafe.Pointer, n int) *Request {
	c, t := m.c, m.c.t
	r := t.newRequest("channel send", c.peer, int(c.id), n)
	r.b = ucx.Buffer{Ptr: p, Len: n}
	t.exec(func() {
		if m.failed == nil {
			if b := c.sendBroken.Load(); b != nil && int32(m.ctr-b.Message) > 0 {
				m.failed = b
			}
		}
		if m.failed != nil {
			t.fail(r, m.failed)
			return
		}
		ep, err := t.peerLocked(c.peer, r.op)
		var ureq ucx.Request
		if err == nil {
			if f := t.chanPostFault; f != nil {
				err = f(c.id, m.ctr, i)
			}
		}
		if err == nil {
			ureq, err = t.w.TagSend(ep.ep, r.b, m.tag)
		}
		if err != nil {
			m.failed = c.dropSend(m.ctr, m.out, fmt.Errorf("transport: %s rank %d: %w", r.op, r.peer, err))
			t.fail(r, m.failed)
			return
		}
		m.out = true
		t.settle(r, ureq, nil)
	})
	return r
}

// rawChunk is the memory of one chunk receive: n bytes at p, and dev, the
// same memory as a gpu.Buffer when UCX writes device memory directly (else
// the zero Buffer).
type rawChunk struct {
	p   unsafe.Pointer
	n   int
	dev gpu.Buffer
}

// rawRecv posts the receives of chunks first, first+1, ... of the channel
// message with this tag, in order and at once (one turn of the worker lock).
// whole says that they are all the chunks of the message.
//
// With the overlap engine on, a chunk the engine has already taken off
// UCX's queue is matched to its receive at once. Otherwise, when whole, the
// receive is posted to UCX: the destination is known, so UCX moves the
// data as soon as it arrives, from the progress goroutine (the offload
// decision, without the engine's table). A receive of part of a message
// (the staged path posts chunk receives as staging slots free up) waits in
// the engine's table instead, because the engine numbers a tag's chunks by
// the order in which it takes them off UCX's queue, and a chunk UCX
// matched directly would be missing from that count.
func (t *Transport) rawRecv(peer int, chanID uint32, tag uint64, first int, chunks []rawChunk, whole bool) []*Request {
	rs := make([]*Request, len(chunks))
	for i, c := range chunks {
		r := t.newRequest("channel recv", peer, int(chanID), c.n)
		r.recv = true
		r.key = chanSinkKey
		r.b = ucx.Buffer{Ptr: c.p, Len: c.n}
		r.dev = c.dev
		rs[i] = r
	}
	t.exec(func() {
		for i, r := range rs {
			t.postChunkRecv(r, chanID, ovKey{wire: tag, chunk: uint32(first + i)}, whole)
		}
	})
	return rs
}

// postChunkRecv posts r, the receive of channel message chunk k (see
// rawRecv); the lock is held.
func (t *Transport) postChunkRecv(r *Request, chanID uint32, k ovKey, whole bool) {
	// The endpoint exists so that the peer's death is noticed; a message
	// that arrived before the peer was lost can still be received.
	if _, err := t.peerLocked(r.peer, r.op); err != nil {
		var lost *PeerLostError
		if !errors.As(err, &lost) {
			t.fail(r, err)
			return
		}
		_, taken := t.ovHasKey(k)
		if _, _, ok := t.w.TagProbe(k.wire, FullMask, false); !ok && !taken {
			t.fail(r, err)
			return
		}
	}
	if t.ov != nil {
		if t.ovRecvKey(r, k, whole) {
			return
		}
		// UCX matches this chunk and the later ones of the tag.
		delete(t.ov.chunks, k.wire)
	}
	ureq, err := t.w.TagRecv(r.b, k.wire, FullMask)
	switch {
	case err != nil:
		t.fail(r, fmt.Errorf("transport: channel %d recv from rank %d: %w", chanID, r.peer, err))
	case !ureq.Pending():
		t.fail(r, fmt.Errorf("transport: channel %d recv from rank %d: UCX completed a receive without reporting it", chanID, r.peer))
	default:
		t.track(r, ureq)
	}
}

// cancelAll withdraws the receives among rs that have not matched yet; rs
// may hold nils (chunk receives a staged transfer had not posted yet).
func (t *Transport) cancelAll(rs []*Request) {
	for _, r := range rs {
		if r == nil || !r.recv || r.fin.Load() {
			continue
		}
		t.exec(func() {
			switch {
			case r.fin.Load():
			case r.ov != nil && t.ov != nil:
				t.ovCancel(r, errChunkCancelled)
			case r.ureq.Pending():
				r.failErr = errChunkCancelled
				t.w.Cancel(r.ureq)
			}
		})
	}
	t.wake()
}

// withdrawRecvs withdraws, for each message of msgs (its chunk receives,
// the first one first), the receives that no message has matched: when the
// first chunk's receive still waits, in UCX's expected queue or the overlap
// engine's table of posted receives, all of the message's chunk receives
// complete with err. A message whose first chunk has matched (in UCX, or in
// the engine, which may hold it for the receiver to start) is left to
// complete, since its sender is sending it; a message's chunks match their
// receives in order, so none of the others has matched when the first has
// not.
func (t *Transport) withdrawRecvs(msgs [][]*Request, err error) {
	if len(msgs) == 0 {
		return
	}
	t.exec(func() {
		if t.closed {
			return // Close failed every receive
		}
		for _, rs := range msgs {
			t.withdrawMessage(rs, err)
		}
	})
	t.wake()
}

// withdrawMessage is withdrawRecvs for one message; the lock is held.
func (t *Transport) withdrawMessage(rs []*Request, err error) {
	r0 := rs[0]
	switch {
	case r0.fin.Load():
		return
	case r0.ov != nil && t.ov != nil:
		if t.ov.posted[r0.ov.key()] != r0 {
			return // matched
		}
	case r0.ureq.Pending():
		prev := r0.failErr
		r0.failErr = err
		if !t.w.CancelNow(r0.ureq) {
			r0.failErr = prev // matched
			return
		}
	default:
		return
	}
	for _, r := range rs {
		switch {
		case r == nil || r.fin.Load():
		case r.ov != nil && t.ov != nil:
			t.ovCancel(r, err)
		case r != r0 && r.ureq.Pending():
			r.failErr = err
			t.w.Cancel(r.ureq)
		}
	}
}

// discardLeftovers: the receive of message counter on channel chanID (from
// peer) failed with a size mismatch at the first of rs, and rs, its chunk
// receives from there on, have all finished. A chunk the sender sent that
// none of them took would otherwise stay for good: with the overlap engine
// on, in the engine's unexpected table (a prefetched one holding a pool
// slot, an onloaded one holding its sender); without it, in UCX's
// unexpected queue (a rendezvous one holding its sender's Send open). The
// sender's last chunk is the only one shorter than ChannelChunkSize
// (chunkLen), so when one of rs took a short chunk nothing is left.
// Otherwise the engine drops the message's chunks it holds and those still
// to come, up to the short one (ovDiscardRest); without the engine a
// goroutine receives them into scratch memory (drainChunks).
func (t *Transport) discardLeftovers(chanID uint32, peer int, counter uint32, rs []*Request) {
	for _, q := range rs {
		if n, ok := chunkArrived(q); ok && n < ChannelChunkSize {
			return
		}
	}
	wire, err := MakeChannelTag(chanID, counter)
	if err != nil {
		return
	}
	if t.ov == nil {
		go t.drainChunks(chanID, peer, wire)
		return
	}
	t.exec(func() {
		if !t.closed {
			t.ovDiscardRest(wire, peer)
		}
	})
}

// drainChunks receives, one at a time into scratch memory, the chunks of the
// channel message with tag wire that peer still sends, up to and including
// its short last chunk, and counts them (ChannelStats.Discarded). It ends
// early when a receive fails (the transport closed, the peer was lost).
func (t *Transport) drainChunks(chanID uint32, peer int, wire uint64) {
	scratch := make([]byte, ChannelChunkSize)
	for {
		rs := t.rawRecv(peer, chanID, wire, 0, []rawChunk{{p: bytesPtr(scratch), n: len(scratch)}}, true)
		st, err := rs[0].Wait(context.Background())
		if err != nil {
			return
		}
		t.chanDiscarded.Add(1)
		if st.Size < ChannelChunkSize {
			return
		}
	}
}

// ChannelStats are a transport's channel counters.
type ChannelStats struct {
	// Discarded counts leftover chunks of channel messages whose receive
	// failed with a size mismatch, received and dropped without the
	// overlap engine (with it they are OverlapTable.Discarded).
	Discarded uint64
	// IPC: transfers between processes of this host that went by CUDA
	// IPC, and the mapping cache (GPUIPCStats).
	IPC GPUIPCStats
}

// ChannelStats returns the transport's channel counters.
func (t *Transport) ChannelStats() ChannelStats {
	return ChannelStats{Discarded: t.chanDiscarded.Load(), IPC: t.GPUIPCStats()}
}

// chunkArrived returns the size of the sender's chunk that the finished
// chunk receive q took, and false when it took none (withdrawn, failed).
func chunkArrived(q *Request) (int, bool) {
	if q == nil || !q.fin.Load() {
		return 0, false
	}
	var trunc *TruncatedError
	switch {
	case errors.As(q.err, &trunc):
		return trunc.Size, true
	case q.err != nil:
		return 0, false
	}
	return q.status.Size, true
}

// waitRequest waits for r like Request.Wait but never cancels it: when ctx
// ends first it returns ctx's error and r goes on. Channel transfers cannot be
// recalled, since their counters are spent.
func waitRequest(ctx context.Context, r *Request) (Status, error) {
	if ctx.Done() == nil || !r.recv {
		return r.Wait(ctx) // nothing to cancel
	}
	if r.fin.Load() {
		return r.status, r.err
	}
	t := r.t
	if err := t.waitInHandler(r.op, -1, 0); err != nil {
		return Status{}, err
	}
	if t.spinWait(r.fin.Load) {
		return r.status, r.err
	}
	done := r.Done()
	t.park()
	defer t.parked.Add(-1)
	select {
	case <-done:
		return r.status, r.err
	case <-ctx.Done():
		return Status{}, ctx.Err()
	}
}

// ---- direct path ----------------------------------------------------------

// startDirect posts one UCX operation per chunk straight on the memory.
func (c *Channel) startDirect(send bool, ctr uint32, e endBuf, cr *ChannelRequest) error {
	tag, err := MakeChannelTag(c.id, ctr)
	if err != nil {
		return err
	}
	var base unsafe.Pointer
	var addr uintptr
	device := false
	switch {
	case !e.isG:
		base = bytesPtr(e.b)
	case e.g.Kind().HostAccessible():
		b, err := e.g.Bytes()
		if err != nil {
			return fmt.Errorf("transport: channel %d %s: %w", c.id, cr.op, err)
		}
		base = bytesPtr(b)
	default:
		addr, device = e.g.Ptr(), true
	}
	k := chunkCount(cr.n)
	cr.reqs = make([]*Request, k)
	chunks := make([]rawChunk, k)
	var m *chanSend
	if send {
		m = c.newChanSend(ctr, tag)
	}
	off := 0
	var unready error // e.ready failed: the chunks from there go empty
	for i := 0; i < k; i++ {
		n := chunkLen(cr.n, i)
		if send && e.ready != nil && unready == nil {
			unready = e.ready(i)
		}
		if unready != nil {
			// The receiver takes an empty chunk as a size mismatch and
			// withdraws the rest: nothing unfilled is delivered, and
			// nobody waits for chunks that will not come.
			n = 0
		}
		ch := rawChunk{n: n}
		switch {
		case n == 0:
		case device:
			ch.p = ucx.AddrPointer(addr + uintptr(off))
			ch.dev, _ = e.g.Slice(off, n) // in range: chunks tile the buffer
		default:
			ch.p = unsafe.Add(base, off)
		}
		if send {
			cr.reqs[i] = m.sendChunk(i, ch.p, n)
		}
		chunks[i] = ch
		off += n
	}
	if !send {
		cr.reqs = c.t.rawRecv(c.peer, c.id, tag, 0, chunks, true)
	}
	return nil
}

// ---- same-process path ------------------------------------------------------

// postOffice pairs the sends and receives of channels whose two ends live in
// this process. Once a transport has closed (Transport.poClosed, which
// postOffice.mu guards), a transfer it posted waits no more, and none is
// posted to or from it.
var postOffice = struct {
	mu sync.Mutex
	m  map[poKey]*poEntry
}{m: map[poKey]*poEntry{}}

type poKey struct {
	dst *Transport // the receiving end's transport
	id  uint32
	ctr uint32
}

type poEntry struct {
	send, recv *localEnd
}

type localEnd struct {
	e  endBuf
	cr *ChannelRequest
}

// postLocal matches a same-process transfer with its other end, or leaves
// it for the other end to find. The copy runs on its own goroutine.
func (c *Channel) postLocal(send bool, ctr uint32, e endBuf, cr *ChannelRequest) {
	key := poKey{dst: c.t, id: c.id, ctr: ctr}
	if send {
		key.dst = c.local
	}
	me := &localEnd{e: e, cr: cr}
	postOffice.mu.Lock()
	if err := localEndError(c, cr.op); err != nil {
		postOffice.mu.Unlock()
		cr.finish(err)
		return
	}
	pe := postOffice.m[key]
	if pe == nil {
		pe = &poEntry{}
		postOffice.m[key] = pe
	}
	var err error
	switch {
	case send && pe.send != nil, !send && pe.recv != nil:
		// Another end with this id and peer (ids must be unique in the
		// job), or a closed one's send still waiting: taking its place
		// would leave its request uncompleted.
		err = fmt.Errorf("%w: channel %d %s (message %d) with rank %d: another end's %s of that message waits already",
			ErrChannelInUse, c.id, cr.op, ctr, c.peer, cr.op)
	case !send && pe.send == nil && c.isClosed():
		// Close ran since the counter was taken and found no receive
		// to withdraw (withdrawLocal).
		err = fmt.Errorf("transport: channel %d recv (message %d): %w", c.id, ctr, errRecvWithdrawn)
	case send:
		pe.send = me
	default:
		pe.recv = me
	}
	if err != nil {
		if pe.send == nil && pe.recv == nil {
			delete(postOffice.m, key)
		}
		postOffice.mu.Unlock()
		cr.finish(err)
		return
	}
	ready := pe.send != nil && pe.recv != nil
	if ready {
		delete(postOffice.m, key)
	}
	postOffice.mu.Unlock()
	if ready {
		go localTransfer(pe.send, pe.recv)
	}
}

// localEndError is the error of a same-process transfer on c whose own
// transport or whose peer's has closed; postOffice.mu is held.
func localEndError(c *Channel, op string) error {
	switch {
	case c.t.poClosed:
		return fmt.Errorf("transport: channel %d %s: %w", c.id, op, ErrClosed)
	case c.local.poClosed:
		return &PeerLostError{Rank: c.peer, Op: fmt.Sprintf("channel %d %s", c.id, op), Reason: "its transport closed"}
	}
	return nil
}

// closeLocalChannels fails the same-process transfers waiting for their
// other end that t, closing, posted or would have completed; the ones
// posted later fail at once (postLocal).
func closeLocalChannels(t *Transport) {
	postOffice.mu.Lock()
	t.poClosed = true
	var failed []*localEnd
	var errs []error
	for key, pe := range postOffice.m {
		for _, end := range []*localEnd{pe.send, pe.recv} {
			if end == nil {
				continue
			}
			if err := localEndError(end.cr.c, end.cr.op); err != nil {
				failed, errs = append(failed, end), append(errs, err)
				delete(postOffice.m, key)
			}
		}
	}
	postOffice.mu.Unlock()
	for i, end := range failed {
		end.cr.finish(errs[i])
	}
}

// withdrawLocal withdraws c's same-process receives that no send has
// matched; they fail with errRecvWithdrawn.
func (c *Channel) withdrawLocal() {
	var gone []*localEnd
	postOffice.mu.Lock()
	for key, pe := range postOffice.m {
		if key.dst != c.t || key.id != c.id || pe.recv == nil || pe.recv.cr.c != c || pe.send != nil {
			continue
		}
		gone = append(gone, pe.recv)
		delete(postOffice.m, key)
	}
	postOffice.mu.Unlock()
	for _, end := range gone {
		end.cr.finish(fmt.Errorf("transport: channel %d recv (message %d): %w", c.id, end.cr.counter, errRecvWithdrawn))
	}
}

func localTransfer(s, r *localEnd) {
	if sn, rn := s.e.n(), r.e.n(); sn != rn {
		s.cr.finish(&SizeMismatchError{Channel: s.cr.c.id, Peer: s.cr.c.peer, Op: "send", Want: sn, Got: rn})
		r.cr.finish(&SizeMismatchError{Channel: r.cr.c.id, Peer: r.cr.c.peer, Op: "recv", Want: rn, Got: sn})
		return
	}
	err := copyEnds(r.e, s.e)
	if err != nil {
		err = fmt.Errorf("transport: channel %d same-process copy: %w", s.cr.c.id, err)
	}
	s.cr.finish(err)
	r.cr.finish(err)
}

// copyEnds copies src into dst (equal sizes): a device-to-device copy when
// both are gpu.Buffers of one system.
func copyEnds(dst, src endBuf) error {
	switch {
	case !dst.isG && !src.isG:
		copy(dst.b, src.b)
		return nil
	case dst.isG && !src.isG:
		return gpu.CopyFromHost(dst.g, src.b)
	case !dst.isG && src.isG:
		return gpu.CopyToHost(dst.b, src.g)
	case dst.g.System() == src.g.System():
		return gpu.Copy(dst.g, src.g)
	default:
		// Two systems in one process (two ranks that each opened one):
		// bounce through host memory.
		tmp := make([]byte, src.g.Len())
		if err := gpu.CopyToHost(tmp, src.g); err != nil {
			return err
		}
		return gpu.CopyFromHost(dst.g, tmp)
	}
}

// ---- staged path ------------------------------------------------------------

// stagingPools holds one pinned pool per gpu.System for staged transfers.
var stagingPools sync.Map // *gpu.System -> *gpu.PinnedPool

func stagingPool(sys *gpu.System) (*gpu.PinnedPool, error) {
	if v, ok := stagingPools.Load(sys); ok {
		return v.(*gpu.PinnedPool), nil
	}
	p, err := sys.NewPinnedPool(gpu.PoolConfig{MinSize: ChannelChunkSize, MaxSize: ChannelChunkSize, MaxBytes: 64 << 20, MaxIdlePerClass: 32})
	if err != nil {
		return nil, err
	}
	if v, loaded := stagingPools.LoadOrStore(sys, p); loaded {
		_ = p.Close()
		return v.(*gpu.PinnedPool), nil
	}
	return p, nil
}

// stage is the pinned buffers, events and stream of one staged transfer.
type stage struct {
	pool   *gpu.PinnedPool
	stream *gpu.Stream
	slots  []gpu.Buffer
	bytes  [][]byte
	events []*gpu.Event
	// own: slots[0] was allocated for this transfer alone (the pool had
	// none free) and is freed, not put back.
	own bool
}

// newStage takes up to min(stageDepth, chunks) pinned chunk buffers, those
// of the pool that are free. When none is, the first is allocated for this
// transfer alone: waiting for one could deadlock, since a transfer holding
// slots may wait for a peer transfer that waits for a slot (40 channels
// each staging a send and a receive took all 128 on both ranks and hung).
func (c *Channel) newStage(buf gpu.Buffer, chunks int, send bool) (*stage, error) {
	dev := buf.Device()
	if dev == nil {
		return nil, fmt.Errorf("transport: channel %d: staged transfer of %s memory", c.id, buf.Kind())
	}
	pool, err := stagingPool(buf.System())
	if err != nil {
		return nil, err
	}
	s, err := c.stream(dev, send)
	if err != nil {
		return nil, err
	}
	st := &stage{pool: pool, stream: s}
	want := min(stageDepth, chunks)
	for i := 0; i < want; i++ {
		b, err := pool.Get(ChannelChunkSize)
		if i == 0 && errors.Is(err, gpu.ErrPoolExhausted) {
			b, err = buf.System().AllocHost(ChannelChunkSize)
			st.own = err == nil
		}
		if err != nil {
			if i > 0 && errors.Is(err, gpu.ErrPoolExhausted) {
				break
			}
			st.release()
			return nil, err
		}
		bs, err := b.Bytes()
		var ev *gpu.Event
		if err == nil {
			ev, err = dev.NewEvent()
		}
		if err != nil {
			st.putSlot(i, b)
			st.release()
			return nil, err
		}
		st.slots, st.bytes, st.events = append(st.slots, b), append(st.bytes, bs), append(st.events, ev)
	}
	return st, nil
}

// putSlot gives back b, the stage's slot i.
func (st *stage) putSlot(i int, b gpu.Buffer) {
	if i == 0 && st.own {
		_ = gpu.Free(b)
		return
	}
	_ = st.pool.Put(b)
}

func (st *stage) release() {
	for i, b := range st.slots {
		st.putSlot(i, b)
	}
	for _, e := range st.events {
		_ = e.Destroy()
	}
}

// eagerStageMax is the largest staged message handled in the caller's
// goroutine: a synchronous copy into one pinned buffer and one UCX
// operation, with no pipeline goroutine (small messages are latency bound).
const eagerStageMax = ChannelChunkSize - 1

// startEagerStaged stages a small message without a goroutine: a send copies
// the data to a pinned buffer now and sends it; a receive lands in a pinned
// buffer and is copied to the device when the request is completed (Wait,
// Test, Done). It reports false when no pinned buffer is free, for the
// pipelined path to wait for one.
func (c *Channel) startEagerStaged(send bool, ctr uint32, buf gpu.Buffer, cr *ChannelRequest) (bool, error) {
	tag, err := MakeChannelTag(c.id, ctr)
	if err != nil {
		return false, err
	}
	pool, err := stagingPool(buf.System())
	if err != nil {
		return false, fmt.Errorf("transport: channel %d %s: %w", c.id, cr.op, err)
	}
	whole, err := pool.Get(ChannelChunkSize)
	if errors.Is(err, gpu.ErrPoolExhausted) {
		return false, nil
	}
	if err != nil {
		return false, fmt.Errorf("transport: channel %d %s: %w", c.id, cr.op, err)
	}
	slot, _ := whole.Slice(0, cr.n)
	bs, err := whole.Bytes()
	if err == nil && send {
		err = gpu.Copy(slot, buf)
	}
	if err != nil {
		_ = pool.Put(whole)
		return false, fmt.Errorf("transport: channel %d %s: staging: %w", c.id, cr.op, err)
	}
	p := unsafe.Pointer(unsafe.SliceData(bs))
	if cr.n == 0 {
		p = nil
	}
	if send {
		cr.reqs = []*Request{c.newChanSend(ctr, tag).sendChunk(0, p, cr.n)}
		cr.post = func(err error) error {
			_ = pool.Put(whole)
			return err
		}
		return true, nil
	}
	cr.reqs = c.t.rawRecv(c.peer, c.id, tag, 0, []rawChunk{{p: p, n: cr.n}}, true)
	cr.post = func(err error) error {
		if err == nil && cr.n > 0 {
			if err = gpu.Copy(buf, slot); err != nil {
				err = fmt.Errorf("transport: channel %d recv: unstaging: %w", c.id, err)
			}
		}
		_ = pool.Put(whole)
		return err
	}
	return true, nil
}

// runStagedSend: chunked asynchronous device-to-host copies into pinned
// buffers, each chunk sent as soon as its copy has landed while the copies of
// the next chunks run.
func (c *Channel) runStagedSend(ctr uint32, buf gpu.Buffer, n int) error {
	tag, err := MakeChannelTag(c.id, ctr)
	if err != nil {
		return err
	}
	k := chunkCount(n)
	st, err := c.newStage(buf, k, true)
	if err != nil {
		// Nothing of the message went out (on an IPC channel its header
		// did).
		return c.dropSend(ctr, c.ipc, fmt.Errorf("transport: channel %d send (message %d): %w", c.id, ctr, err))
	}
	defer st.release()
	d := len(st.slots)
	m := c.newChanSend(ctr, tag)
	sends := make([]*Request, k)
	var firstErr error
	keep := func(err error) {
		if err != nil && firstErr == nil {
			firstErr = err
		}
	}
	// copyChunk enqueues chunk i's copy into slot i%d and records its event.
	copyChunk := func(i int) error {
		l := chunkLen(n, i)
		if l == 0 {
			return nil
		}
		src, err := buf.Slice(i*ChannelChunkSize, l)
		if err != nil {
			return err
		}
		slot, err := st.slots[i%d].Slice(0, l)
		if err != nil {
			return err
		}
		if err := gpu.CopyAsync(st.stream, slot, src); err != nil {
			return err
		}
		return st.events[i%d].Record(st.stream)
	}
	posted := 0 // chunks whose sends are posted
	for i := 0; i < min(d-1, k); i++ {
		if err := copyChunk(i); err != nil {
			keep(fmt.Errorf("transport: channel %d send: staging chunk %d: %w", c.id, i, err))
			break
		}
	}
	for i := 0; i < k && firstErr == nil; i++ {
		if d == 1 && i > 0 {
			// One slot: it is free once the previous chunk's send is done.
			_, e := waitRequest(context.Background(), sends[i-1])
			keep(e)
		}
		if d == 1 {
			if err := copyChunk(i); err != nil {
				keep(err)
				break
			}
		}
		if err := st.events[i%d].Synchronize(); err != nil {
			keep(fmt.Errorf("transport: channel %d send: staging chunk %d: %w", c.id, i, err))
			break
		}
		l := chunkLen(n, i)
		var p unsafe.Pointer
		if l > 0 {
			p = unsafe.Pointer(unsafe.SliceData(st.bytes[i%d]))
		}
		sends[i] = m.sendChunk(i, p, l)
		posted = i + 1
		// Chunk i+d-1 reuses the slot of chunk i-1, whose send was posted
		// one step ago.
		if j := i + d - 1; d > 1 && j < k {
			if i > 0 {
				_, e := waitRequest(context.Background(), sends[i-1])
				keep(e)
			}
			if err := copyChunk(j); err != nil {
				keep(err)
				break
			}
		}
	}
	if firstErr != nil {
		// The receiver waits for every chunk: the rest go empty, which
		// it reports as a size mismatch (and drains), as a typed send
		// whose piece failed does. The stream is retired if it failed.
		for j := posted; j < k; j++ {
			sends[j] = m.sendChunk(j, nil, 0)
		}
		c.retireFailed(streamKey{dev: buf.Device(), send: true}, st.stream)
	}
	for _, s := range sends {
		if s != nil {
			_, e := waitRequest(context.Background(), s)
			keep(e)
		}
	}
	if firstErr != nil {
		return fmt.Errorf("transport: channel %d send (message %d): %w", c.id, ctr, firstErr)
	}
	return nil
}

// runStagedRecv: chunks arrive in pinned buffers and are copied host to
// device while the next chunks arrive. withdrawable: Close may withdraw the
// receive while no chunk has matched (not after an IPC channel's header).
func (c *Channel) runStagedRecv(ctr uint32, buf gpu.Buffer, cr *ChannelRequest, withdrawable bool) error {
	n := cr.n
	tag, err := MakeChannelTag(c.id, ctr)
	if err != nil {
		return err
	}
	k := chunkCount(n)
	st, err := c.newStage(buf, k, false)
	if err != nil {
		return fmt.Errorf("transport: channel %d recv: %w", c.id, err)
	}
	defer st.release()
	d := len(st.slots)
	recvs := make([]*Request, k)
	post := func(i int) {
		l := chunkLen(n, i)
		var p unsafe.Pointer
		if l > 0 {
			p = unsafe.Pointer(unsafe.SliceData(st.bytes[i%d]))
		}
		recvs[i] = c.t.rawRecv(c.peer, c.id, tag, i, []rawChunk{{p: p, n: l}}, k == 1)[0]
	}
	// A failure withdraws the chunk receives still posted and waits for
	// the copies already enqueued.
	// The sender's chunks from the failed one on that no receive took are
	// drained (discardLeftovers), so that its send completes, and a stream
	// whose work failed is retired.
	abort := func(i int, err error) error {
		c.t.cancelAll(recvs)
		for _, r := range recvs {
			if r != nil {
				_, _ = waitRequest(context.Background(), r)
			}
		}
		_ = st.stream.Synchronize()
		c.retireFailed(streamKey{dev: buf.Device(), send: false}, st.stream)
		if !errors.Is(err, errRecvWithdrawn) {
			// (A withdrawn receive took nothing: the sender's message
			// is for the channel next opened with this id.)
			c.t.discardLeftovers(c.id, c.peer, ctr, recvs[i:])
		}
		return err
	}
	for i := 0; i < min(d, k); i++ {
		post(i)
	}
	if withdrawable {
		c.postedRecv(recvs[:min(d, k)])
	}
	rq := &ChannelRequest{c: c, op: "recv", n: n, counter: ctr, reqs: recvs}
	for i := 0; i < k; i++ {
		_, _ = waitRequest(context.Background(), recvs[i])
		if e := rq.chunkErr(i, recvs[i]); e != nil {
			return abort(i, e)
		}
		if l := chunkLen(n, i); l > 0 {
			dst, err := buf.Slice(i*ChannelChunkSize, l)
			if err == nil {
				var slot gpu.Buffer
				if slot, err = st.slots[i%d].Slice(0, l); err == nil {
					err = gpu.CopyAsync(st.stream, dst, slot)
				}
			}
			if err == nil {
				err = st.events[i%d].Record(st.stream)
			}
			if err != nil {
				return abort(i, fmt.Errorf("transport: channel %d recv: unstaging chunk %d: %w", c.id, i, err))
			}
		}
		// Chunk i+d reuses slot i%d once its copy to the device is done.
		if j := i + d; j < k {
			if err := st.events[i%d].Synchronize(); err != nil {
				return abort(i, fmt.Errorf("transport: channel %d recv: unstaging chunk %d: %w", c.id, i, err))
			}
			post(j)
		}
	}
	if err := st.stream.Synchronize(); err != nil {
		c.retireFailed(streamKey{dev: buf.Device(), send: false}, st.stream)
		return fmt.Errorf("transport: channel %d recv: unstaging: %w", c.id, err)
	}
	return nil
}
