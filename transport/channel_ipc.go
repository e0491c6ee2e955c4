package transport

// CUDA IPC for channels between processes on one host (docs/gpu.md,
// "Transfer paths").
//
// A channel whose two ends are different processes on one host, both taking
// part (the cuda driver is present, TROUPE_GPU is not host, TROUPE_GPU_IPC
// is not off, Options.DisableGPUIPC unset: published in the start-up
// exchange, so both ends know it identically), is an IPC channel. On it,
// every message starts with a control message under the message's own tag
// with the top kind bit set (KindChannelCtl), so that the receiver, which
// does not know what memory the sender uses, learns how the bytes travel:
//
//   - a header (the sender's memory is not cuda device memory): the data
//     follows under the message's tag exactly as on any other channel
//     (direct or staged), and the receiver posts its receives on the header;
//   - an IPC descriptor (cuda device memory): the allocation's IPC handle,
//     the buffer's offset and length, and the exporter's allocation range.
//     The receiver opens the handle (cached per channel), copies into its
//     buffer on its stream, waits for the copy, and acknowledges
//     (KindChannelAck, same id and counter) so that the sender may reuse
//     its buffer. A size mismatch is acknowledged as such: both ends fail
//     with a *SizeMismatchError naming both sizes. A receiver that cannot
//     use the handle (its memory is Go memory or of another backend, or
//     the driver refuses the handle) acknowledges "fallback" and both ends
//     move the message as they would without IPC; nothing is lost.
//
// Mappings: each transfer holds its own reference (gpu.Device.IPCOpen)
// until its copy is done; the channel keeps one more per handle so that the
// next message from the same allocation opens nothing. A cached mapping is
// closed when a descriptor shows that the exporter's allocation range now
// belongs to another allocation (it was freed and the range reused), when
// more than ipcCacheMax are cached (least recently used first), and when
// the channel closes.

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"math"
	"strings"
	"sync"
	"sync/atomic"
	"unsafe"

	"go.uber.org/zap"

	"github.com/troupe-hpc/troupe/gpu"
	"github.com/troupe-hpc/troupe/transport/ucx"
)

// EnvGPUIPC names the environment variable that turns the CUDA IPC path of
// channels off ("off", "0", "n", "no", "false") or leaves it to detection
// ("on", "auto" or unset: on when the cuda driver is present and
// TROUPE_GPU is not "host").
const EnvGPUIPC = "TROUPE_GPU_IPC"

// PathIPC: the receiver copied the sender's device memory through a CUDA
// IPC mapping (same host, different processes, cuda backend).
const PathIPC TransferPath = "ipc"

const (
	// chanCtlBit marks a CHANNEL tag whose message is a control message
	// (KindChannelCtl).
	chanCtlBit = uint64(1) << 63

	ipcDescSize = 112
	ipcAckSize  = 256
	ipcMagic    = "troupe-g"

	// ipcCacheMax bounds the mappings one channel keeps open.
	ipcCacheMax = 64
)

// Control message kinds.
const (
	ctlHeader = 1 // the data follows under the message's tag
	ctlIPC    = 2 // a CUDA IPC descriptor
)

// Acknowledgement codes.
const (
	ackDone     = 0 // copied: the sender's buffer is free
	ackFallback = 1 // not by IPC: send the data as without IPC
	ackSize     = 2 // size mismatch: nothing was copied
	ackFailed   = 3 // the copy failed: nothing to retry
)

// gpuIPCState is the transport's CUDA IPC state.
type gpuIPCState struct {
	on    bool   // this rank takes part (read-only after New)
	off   string // why not (read-only after New)
	peers []bool // by rank: channels to it are IPC channels (read-only after New)

	sent, received, fallbacks, misses, hits, evicted atomic.Int64
	exported, imported                               atomic.Int64 // ExportDevice, ImportDevice
	importedNow                                      atomic.Int64 // ImportDeviceNow
}

// GPUIPCStats counts channel transfers that went by CUDA IPC.
type GPUIPCStats struct {
	Enabled bool   // this rank takes part
	Off     string // why it does not ("" when it does)
	Peers   int    `metric:",gauge"` // ranks with which this rank's channels are IPC channels
	// Sent: sends whose buffer the receiver copied by IPC. Received:
	// receives served by IPC.
	Sent, Received int64
	// Fallbacks: IPC descriptors that this rank, as a receiver, declined
	// (its memory is not cuda memory, or the handle did not open); the
	// data then travelled as without IPC.
	Fallbacks int64
	// MapMisses: IPC receives that found no mapping of the sender's
	// allocation cached in their channel (a gpu.Device.IPCOpen that may
	// open a mapping); MapHits: receives served by a cached mapping.
	MapMisses, MapHits int64
	// Evicted: cached mappings closed because the sender's allocation
	// range was reused or the cache was full.
	Evicted int64
	// Exported, Imported: device buffers exported (ExportDevice) and
	// copied in (ImportDevice) outside channels, for the actor runtime's
	// GPU Messaging API. MapMisses, MapHits and Evicted count their
	// mappings too.
	Exported, Imported int64
	// ImportedNow: imports of those done at once where the message
	// arrived (ImportDeviceNow: mapping cached, copy by the copy agent).
	ImportedNow int64
}

// GPUIPCStats reports the CUDA IPC path's use.
func (t *Transport) GPUIPCStats() GPUIPCStats {
	g := &t.gipc
	s := GPUIPCStats{Enabled: g.on, Off: g.off, Sent: g.sent.Load(), Received: g.received.Load(),
		Fallbacks: g.fallbacks.Load(), MapMisses: g.misses.Load(), MapHits: g.hits.Load(), Evicted: g.evicted.Load(),
		Exported: g.exported.Load(), Imported: g.imported.Load(),
		ImportedNow: g.importedNow.Load()}
	for _, p := range g.peers {
		if p {
			s.Peers++
		}
	}
	return s
}

// SameHost reports whether rank peer runs on this rank's host (the rank
// itself included), as both ranks learnt it at start-up.
func (t *Transport) SameHost(peer int) bool {
	return peer >= 0 && peer < len(t.sameHost) && t.sameHost[peer]
}

// cudaDriver caches gpu.CUDADriverPresent: it loads the driver once per
// process.
var cudaDriver struct {
	once sync.Once
	err  error
}

// gpuIPCWanted reports whether this process takes part in CUDA IPC for
// channels, and why not.
func gpuIPCWanted(opts Options) (bool, string) {
	if opts.DisableGPUIPC {
		return false, "Options.DisableGPUIPC"
	}
	if v, ok := syscallGetenv(EnvGPUIPC); ok {
		switch strings.ToLower(strings.TrimSpace(v)) {
		case "off", "0", "n", "no", "false":
			return false, EnvGPUIPC + "=" + v
		case "", "on", "auto", "1", "y", "yes", "true":
		default:
			return false, fmt.Sprintf("%s=%q is not off, on or auto", EnvGPUIPC, v)
		}
	}
	if v, _ := syscallGetenv(gpu.EnvBackend); strings.EqualFold(strings.TrimSpace(v), gpu.BackendHost) {
		return false, gpu.EnvBackend + "=" + v
	}
	cudaDriver.once.Do(func() { cudaDriver.err = gpu.CUDADriverPresent() })
	if cudaDriver.err != nil {
		return false, cudaDriver.err.Error()
	}
	return true, ""
}

// gpuIPCSetup records this rank's decision and its IPC peers (usable(rank):
// the peer takes part, shares the host and is another process).
func (t *Transport) gpuIPCSetup(on bool, why string, usable func(rank int) bool) {
	t.gipc.on, t.gipc.off = on, why
	if !on {
		t.log.Debug("CUDA IPC for channels off", zap.String("why", why))
		return
	}
	t.gipc.peers = make([]bool, t.size)
	n := 0
	for rank := range t.gipc.peers {
		if usable(rank) {
			t.gipc.peers[rank] = true
			n++
		}
	}
	t.log.Debug("CUDA IPC for channels on", zap.Int("peers", n))
}

// gpuIPCPeer reports whether channels to peer are IPC channels.
func (t *Transport) gpuIPCPeer(peer int) bool {
	return t.gipc.on && peer >= 0 && peer < len(t.gipc.peers) && t.gipc.peers[peer]
}

// ipcDesc is a decoded control message.
type ipcDesc struct {
	kind   uint64
	length uint64 // the sender's message size
	h      gpu.IPCHandle
	base   uint64 // the exporter's allocation address (ctlIPC)
}

func (d *ipcDesc) encode() []byte {
	b := make([]byte, ipcDescSize)
	copy(b, ipcMagic)
	binary.LittleEndian.PutUint64(b[8:], d.kind)
	binary.LittleEndian.PutUint64(b[16:], d.length)
	copy(b[24:88], d.h.Handle[:])
	binary.LittleEndian.PutUint64(b[88:], d.h.Offset)
	binary.LittleEndian.PutUint64(b[96:], d.h.Size)
	binary.LittleEndian.PutUint64(b[104:], d.base)
	return b
}

// decodeIPCDesc reads a control message encode wrote. Every failure wraps
// ErrProtocol: a message of the wrong size or magic, an unknown kind, a
// length of 2^63 bytes or more (an int could not hold it), an IPC
// descriptor reaching past its allocation.
func decodeIPCDesc(b []byte) (ipcDesc, error) {
	if len(b) != ipcDescSize || string(b[:8]) != ipcMagic {
		return ipcDesc{}, fmt.Errorf("%w: malformed channel control message (%d bytes)", ErrProtocol, len(b))
	}
	d := ipcDesc{kind: binary.LittleEndian.Uint64(b[8:]), length: binary.LittleEndian.Uint64(b[16:]), base: binary.LittleEndian.Uint64(b[104:])}
	copy(d.h.Handle[:], b[24:88])
	d.h.Offset = binary.LittleEndian.Uint64(b[88:])
	d.h.Length = d.length
	d.h.Size = binary.LittleEndian.Uint64(b[96:])
	if d.kind != ctlHeader && d.kind != ctlIPC {
		return ipcDesc{}, fmt.Errorf("%w: channel control message of unknown kind %d", ErrProtocol, d.kind)
	}
	if d.length > math.MaxInt64 {
		return ipcDesc{}, fmt.Errorf("%w: channel control message for %d bytes", ErrProtocol, d.length)
	}
	if d.kind == ctlIPC && (d.h.Size == 0 || d.h.Offset > d.h.Size || d.length > d.h.Size-d.h.Offset) {
		return ipcDesc{}, fmt.Errorf("%w: CUDA IPC descriptor of %d bytes at offset %d of a %d-byte allocation", ErrProtocol, d.length, d.h.Offset, d.h.Size)
	}
	return d, nil
}

func ipcAckTag(chanID, ctr uint32) uint64 {
	return uint64(KindChannelAck)<<kindShift | uint64(chanID)<<ChannelCounterBits | uint64(ctr)
}

func encodeAck(code uint64, size int, msg string) []byte {
	b := make([]byte, 16, ipcAckSize)
	binary.LittleEndian.PutUint64(b, code)
	binary.LittleEndian.PutUint64(b[8:], uint64(size))
	if len(msg) > ipcAckSize-16 {
		msg = msg[:ipcAckSize-16]
	}
	return append(b, msg...)
}

// rawRecvCtl posts a receive of a channel control message or
// acknowledgement into b, straight to UCX (the overlap engine takes only
// KindChannel messages).
func (t *Transport) rawRecvCtl(peer int, chanID uint32, tag uint64, b []byte) *Request {
	r := t.newRequest("channel recv", peer, int(chanID), len(b))
	r.recv = true
	r.key = chanSinkKey
	r.b = ucx.Buffer{Ptr: unsafe.Pointer(unsafe.SliceData(b)), Len: len(b)}
	t.exec(func() {
		if _, err := t.peerLocked(peer, r.op); err != nil {
			var lost *PeerLostError
			if !errors.As(err, &lost) {
				t.fail(r, err)
				return
			}
			if _, _, ok := t.w.TagProbe(tag, FullMask, false); !ok {
				t.fail(r, err)
				return
			}
		}
		ureq, err := t.w.TagRecv(r.b, tag, FullMask)
		switch {
		case err != nil:
			t.fail(r, fmt.Errorf("transport: channel %d recv from rank %d: %w", chanID, peer, err))
		case !ureq.Pending():
			t.fail(r, fmt.Errorf("transport: channel %d recv from rank %d: UCX completed a receive without reporting it", chanID, peer))
		default:
			t.track(r, ureq)
		}
	})
	return r
}

// sendCtl sends b (a control message or acknowledgement). Nobody waits for
// it: a failure (the peer is lost) shows in the operations that follow.
func (c *Channel) sendCtl(tag uint64, b []byte) *Request {
	return c.t.rawSend(c.peer, c.id, tag, unsafe.Pointer(unsafe.SliceData(b)), len(b))
}

// ipcDevice returns the device through which this end's memory can take a
// CUDA IPC copy: its own device for cuda device or managed memory, device 0
// of its system for other cuda gpu.Buffers; nil for Go memory and other
// backends.
func ipcDevice(e endBuf) *gpu.Device {
	if !e.isG || e.g.System() == nil || e.g.System().Backend() != gpu.BackendCUDA {
		return nil
	}
	if d := e.g.Device(); d != nil {
		return d
	}
	if ds := e.g.System().Devices(); len(ds) > 0 {
		return ds[0]
	}
	return nil
}

// stagedEnd reports whether e would take the pipelined staged path.
func (c *Channel) stagedEnd(e endBuf) bool {
	return e.isG && !e.g.Kind().HostAccessible() && !c.t.deviceDirect(e.g)
}

// startIPCChannel starts a transfer on an IPC channel.
func (c *Channel) startIPCChannel(send bool, ctr uint32, e endBuf, cr *ChannelRequest) error {
	tag, err := MakeChannelTag(c.id, ctr)
	if err != nil {
		return err
	}
	if send {
		d := ipcDesc{kind: ctlHeader, length: uint64(cr.n)}
		if ipcDevice(e) != nil && e.g.Kind() == gpu.KindDevice && cr.n > 0 {
			if h, err := e.g.System().IPCGetHandle(e.g); err == nil {
				d = ipcDesc{kind: ctlIPC, length: uint64(cr.n), h: h, base: uint64(e.g.Ptr() - uintptr(e.g.Offset()))}
			} else {
				c.t.log.Debug("channel send: no CUDA IPC handle; sending the data", zap.Uint32("channel", c.id), zap.Error(err))
			}
		}
		if d.kind == ctlHeader {
			c.sendCtl(tag|chanCtlBit, d.encode())
			return c.startPath(true, ctr, e, cr)
		}
		cr.path = PathIPC
		cr.done = make(chan struct{})
		var prev, mine chan struct{}
		if c.stagedEnd(e) {
			prev, mine = c.stagedTurn(true)
		}
		ack := make([]byte, ipcAckSize)
		areq := c.t.rawRecvCtl(c.peer, c.id, ipcAckTag(c.id, ctr), ack)
		dreq := c.sendCtl(tag|chanCtlBit, d.encode())
		go func() {
			err := c.runIPCSend(ctr, e, cr, dreq, areq, ack, &prev)
			endTurn(prev, mine)
			cr.finish(err)
		}()
		return nil
	}
	cr.done = make(chan struct{})
	cr.path = PathDirect
	var prev, mine chan struct{}
	if c.stagedEnd(e) {
		cr.path = PathStaged
		prev, mine = c.stagedTurn(false)
	}
	hdr := make([]byte, ipcDescSize)
	hreq := c.t.rawRecvCtl(c.peer, c.id, tag|chanCtlBit, hdr)
	c.postedRecv([]*Request{hreq}) // Close may withdraw it until the control message matches
	go func() {
		err := c.runIPCRecv(ctr, e, cr, hreq, hdr, &prev)
		endTurn(prev, mine)
		cr.finish(err)
	}()
	return nil
}

// endTurn ends a staged transfer's turn (stagedTurn): once the previous
// transfer of the direction has ended, mine is closed. Transfers that took
// no turn pass a nil mine.
func endTurn(prev, mine chan struct{}) {
	if mine == nil {
		return
	}
	if prev != nil {
		<-prev
	}
	close(mine)
}

// runIPCSend waits for the receiver's acknowledgement of an IPC descriptor
// and, when it asks for it, sends the data as without IPC. *prev is the
// staged turn to wait for before staging (set to nil once waited for).
func (c *Channel) runIPCSend(ctr uint32, e endBuf, cr *ChannelRequest, dreq, areq *Request, ack []byte, prev *chan struct{}) error {
	ctx := context.Background()
	if _, err := waitRequest(ctx, dreq); err != nil {
		c.t.cancelAll([]*Request{areq})
		_, _ = waitRequest(ctx, areq)
		return fmt.Errorf("transport: channel %d send (message %d): CUDA IPC descriptor: %w", c.id, ctr, err)
	}
	st, err := waitRequest(ctx, areq)
	if err != nil {
		return fmt.Errorf("transport: channel %d send (message %d): waiting for the receiver's CUDA IPC acknowledgement: %w", c.id, ctr, err)
	}
	if st.Size < 16 {
		return fmt.Errorf("%w: channel %d send (message %d): CUDA IPC acknowledgement of %d bytes", ErrProtocol, c.id, ctr, st.Size)
	}
	code := binary.LittleEndian.Uint64(ack)
	size := int(binary.LittleEndian.Uint64(ack[8:]))
	msg := string(ack[16:st.Size])
	switch code {
	case ackDone:
		c.t.gipc.sent.Add(1)
		return nil
	case ackSize:
		return &SizeMismatchError{Channel: c.id, Peer: c.peer, Op: "send", Want: cr.n, Got: size, Detail: "CUDA IPC: nothing was copied"}
	case ackFailed:
		return fmt.Errorf("transport: channel %d send (message %d): the receiver's CUDA IPC copy failed: %s", c.id, ctr, msg)
	case ackFallback:
		c.t.log.Debug("channel send: receiver declined CUDA IPC; sending the data", zap.Uint32("channel", c.id), zap.String("why", msg))
		return c.runPlain(true, ctr, e, cr, prev)
	}
	return fmt.Errorf("%w: channel %d send (message %d): CUDA IPC acknowledgement code %d", ErrProtocol, c.id, ctr, code)
}

// runPlain moves a message of an IPC channel as a channel without IPC does
// (after a header, or after a declined descriptor), in the calling
// goroutine, and records its path.
func (c *Channel) runPlain(send bool, ctr uint32, e endBuf, cr *ChannelRequest, prev *chan struct{}) error {
	if c.stagedEnd(e) {
		cr.setPath(PathStaged)
		if *prev != nil {
			<-*prev
			*prev = nil
		}
		if send {
			return c.runStagedSend(ctr, e.g, cr.n)
		}
		return c.runStagedRecv(ctr, e.g, cr, false)
	}
	cr.setPath(PathDirect)
	inner := &ChannelRequest{c: c, op: cr.op, n: cr.n, counter: ctr, path: PathDirect}
	if err := c.startDirect(send, ctr, e, inner); err != nil {
		return err
	}
	return inner.Wait(context.Background())
}

// runIPCRecv receives a message of an IPC channel: its control message
// first, then the data as the sender announced it.
func (c *Channel) runIPCRecv(ctr uint32, e endBuf, cr *ChannelRequest, hreq *Request, hdr []byte, prev *chan struct{}) error {
	ackTag := ipcAckTag(c.id, ctr)
	st, err := waitRequest(context.Background(), hreq)
	var trunc *TruncatedError
	switch {
	case errors.As(err, &trunc):
		err = fmt.Errorf("%w: %v", ErrProtocol, err)
		c.sendCtl(ackTag, encodeAck(ackFailed, cr.n, err.Error())) // in case the sender waits
		return fmt.Errorf("transport: channel %d recv (message %d): %w", c.id, ctr, err)
	case err != nil:
		return fmt.Errorf("transport: channel %d recv (message %d): %w", c.id, ctr, err)
	}
	d, err := decodeIPCDesc(hdr[:st.Size])
	if err != nil {
		c.sendCtl(ackTag, encodeAck(ackFailed, cr.n, err.Error())) // in case the sender waits
		return fmt.Errorf("transport: channel %d recv (message %d) from rank %d: %w", c.id, ctr, c.peer, err)
	}
	if d.kind == ctlIPC {
		if int(d.length) != cr.n {
			c.sendCtl(ackTag, encodeAck(ackSize, cr.n, ""))
			return &SizeMismatchError{Channel: c.id, Peer: c.peer, Op: "recv", Want: cr.n, Got: int(d.length), Detail: "CUDA IPC: nothing was copied"}
		}
		done, why, err := c.ipcReceive(e, d)
		switch {
		case done:
			cr.setPath(PathIPC)
			c.sendCtl(ackTag, encodeAck(ackDone, cr.n, ""))
			c.t.gipc.received.Add(1)
			return nil
		case err != nil:
			c.sendCtl(ackTag, encodeAck(ackFailed, cr.n, err.Error()))
			return fmt.Errorf("transport: channel %d recv (message %d): %w", c.id, ctr, err)
		}
		c.t.gipc.fallbacks.Add(1)
		c.t.log.Debug("channel recv: CUDA IPC declined; receiving the data", zap.Uint32("channel", c.id), zap.String("why", why))
		c.sendCtl(ackTag, encodeAck(ackFallback, cr.n, why))
	}
	err = c.runPlain(false, ctr, e, cr, prev)
	var sm *SizeMismatchError
	if errors.As(err, &sm) && sm.Got < 0 {
		sm.Got = int(d.length) // the header told the sender's size
	}
	return err
}

// ipcReceive copies the message described by d into e. It reports done, or
// why it declined (the data must come the other way), or the copy's error.
func (c *Channel) ipcReceive(e endBuf, d ipcDesc) (done bool, why string, err error) {
	dev := ipcDevice(e)
	if dev == nil {
		return false, "the receive buffer is not cuda memory", nil
	}
	src, err := c.ipcMaps.open(dev, d)
	if err != nil {
		return false, err.Error(), nil
	}
	err = c.ipcCopy(dev, e.g, src)
	// This transfer's reference; the channel's cache keeps the mapping.
	if cerr := gpu.IPCClose(src); cerr != nil {
		c.t.log.Debug("closing a CUDA IPC mapping", zap.Error(cerr))
	}
	if err != nil {
		return false, "", fmt.Errorf("CUDA IPC copy: %w", err)
	}
	return true, "", nil
}

// ipcCopy copies src (a mapping) into dst on the channel's receive stream
// of dev and waits for the copy; synchronously when the channel closed.
func (c *Channel) ipcCopy(dev *gpu.Device, dst, src gpu.Buffer) error {
	if dst.Kind() == gpu.KindHost {
		return gpu.Copy(dst, src)
	}
	s, release := c.useStream(dev)
	if s == nil {
		return gpu.Copy(dst, src)
	}
	defer release()
	return copyAndWait(s, dst, src)
}

// useStream returns the channel's receive stream on dev and a function to
// call when done with it (Close waits for that), or nil once the channel is
// closed or the stream cannot be made.
func (c *Channel) useStream(dev *gpu.Device) (*gpu.Stream, func()) {
	return c.useStreamKey(streamKey{dev: dev})
}

// useStreamKey is useStream for the channel's stream of key.
func (c *Channel) useStreamKey(key streamKey) (*gpu.Stream, func()) {
	s, err := c.streamFor(key)
	if err != nil {
		return nil, nil
	}
	c.mu.Lock()
	if c.closed {
		c.mu.Unlock()
		return nil, nil
	}
	c.streamUsers.Add(1)
	c.mu.Unlock()
	return s, c.streamUsers.Done
}

// setPath records the path a transfer of an IPC channel took once it is
// known.
func (r *ChannelRequest) setPath(p TransferPath) { r.late.Store(&p) }
