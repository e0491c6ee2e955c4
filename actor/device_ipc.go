package actor

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"reflect"
	"sync"

	"go.uber.org/zap"

	"github.com/troupe-hpc/troupe/gpu"
	"github.com/troupe-hpc/troupe/transport"
)

// CUDA IPC for the GPU Messaging API (docs/gpu.md, "GPU Messaging API").
//
// When a message's gpu.Buffer field is cuda device memory and its target
// lives in another process of this host that takes part in CUDA IPC
// (transport.DeviceIPCPeer), the bytes do not travel: the active message's
// data is an IPC descriptor of the buffer (transport.ExportDevice) and a
// sequence number. The receiver picks the landing buffer as for any device
// message (PostReceiveDevice, else an allocation on its device), copies
// from the sender's memory through a cached mapping in a goroutine
// (transport.ImportDevice), delivers the message in its turn, and
// acknowledges with an amDeviceAck message carrying the sequence number and
// the outcome. The sender's Completion is done on that acknowledgement: only
// then may it reuse its buffer. A receiver that cannot take the copy by
// CUDA IPC at all (landing memory that is not cuda memory, a handle the
// driver refuses) gets the bytes from the sender instead
// (device_fallback.go). A copy that fails otherwise (a landing buffer of
// the wrong size, a failing driver) makes the message undeliverable on the
// receiver (dead letters, with the reason) and fails the sender's
// Completion with the same reason.

// amDeviceAck is the active message acknowledging a CUDA IPC device
// message.
const amDeviceAck uint16 = 0x43

// deviceIPCData is the size of an IPC device message's data: the
// descriptor, then the sender's sequence number.
const deviceIPCData = transport.DeviceDescSize + 8

// maxAckReason bounds the reason an acknowledgement carries.
const maxAckReason = 512

// clipReason cuts a reason to maxAckReason bytes for the wire.
func clipReason(s string) string {
	if len(s) > maxAckReason {
		return s[:maxAckReason]
	}
	return s
}

// Completion reports when the gpu.Buffer of a message sent with SendDevice
// may be reused: Done is closed then, and Err says whether the receiver got
// the bytes.
type Completion struct {
	done chan struct{}
	err  error
	rank int                  // the receiving rank
	t    *transport.Transport // the sender's, while an acknowledgement is to come
	buf  gpu.Buffer           // the buffer sent, for a receiver that declines the descriptor
}

// completed is a Completion that is already done.
func completed(err error) *Completion {
	c := &Completion{done: make(chan struct{}), err: err}
	close(c.done)
	return c
}

// Done is closed when the message's buffer may be reused.
func (c *Completion) Done() <-chan struct{} { return c.done }

// Err is the outcome once Done is closed (nil: the receiver has the bytes),
// nil before.
func (c *Completion) Err() error {
	select {
	case <-c.done:
		return c.err
	default:
		return nil
	}
}

// Wait waits for the Completion, or for ctx. The caller does not progress
// the transport itself (the acknowledgement follows the receiver's copy,
// not a transfer in flight here, and Await would take a core that copy may
// need); it only keeps the progress goroutine polling for the
// acknowledgement (transport.ExpectReply) instead of sleeping on the event
// fd, whose wake-up cost a device message about 200 us on a GPU virtual
// machine.
func (c *Completion) Wait(ctx context.Context) error {
	select {
	case <-c.done:
		return c.err
	default:
	}
	if c.t != nil {
		defer c.t.ExpectReply()()
	}
	select {
	case <-c.done:
		return c.err
	case <-ctx.Done():
		return ctx.Err()
	}
}

// DeviceIPCError is the failure of a message whose gpu.Buffer the receiver
// was to copy by CUDA IPC, as the receiver reported it.
type DeviceIPCError struct {
	Rank   int    // the receiving rank
	Reason string // the receiver's reason
}

func (e *DeviceIPCError) Error() string {
	return fmt.Sprintf("actor: rank %d could not take a device buffer by CUDA IPC: %s", e.Rank, e.Reason)
}

// deviceSends tracks the IPC device messages whose acknowledgement has not
// come, and the goroutines sending the bytes of those a receiver declined.
type deviceSends struct {
	mu      sync.Mutex
	seq     uint64
	pending map[uint64]*Completion
	closed  bool           // no more resends
	resends sync.WaitGroup // resendBytes goroutines
}

// add registers a Completion for buf's message to rank r sent through t;
// its sequence number goes in the message.
func (d *deviceSends) add(r int, t *transport.Transport, buf gpu.Buffer) (uint64, *Completion) {
	c := &Completion{done: make(chan struct{}), rank: r, t: t, buf: buf}
	d.mu.Lock()
	d.seq++
	seq := d.seq
	if d.pending == nil {
		d.pending = map[uint64]*Completion{}
	}
	d.pending[seq] = c
	d.mu.Unlock()
	return seq, c
}

// finish completes the Completion of seq with err; false if there is none
// (already finished, or a forged number) or it was for another rank.
func (d *deviceSends) finish(seq uint64, r int, err error) bool {
	d.mu.Lock()
	c := d.pending[seq]
	if c == nil || (r >= 0 && c.rank != r) {
		d.mu.Unlock()
		return false
	}
	delete(d.pending, seq)
	d.mu.Unlock()
	c.err = err
	close(c.done)
	return true
}

// buffer returns the buffer of pending message seq to rank r (the zero
// Buffer if there is none).
func (d *deviceSends) buffer(seq uint64, r int) gpu.Buffer {
	d.mu.Lock()
	defer d.mu.Unlock()
	if c := d.pending[seq]; c != nil && c.rank == r {
		return c.buf
	}
	return gpu.Buffer{}
}

// goResend runs f in a goroutine that closeResends waits for; false (and f
// does not run) once closeResends was called.
func (d *deviceSends) goResend(f func()) bool {
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.closed {
		return false
	}
	d.resends.Add(1)
	go func() {
		defer d.resends.Done()
		f()
	}()
	return true
}

// closeResends refuses further resends and waits for those under way.
func (d *deviceSends) closeResends() {
	d.mu.Lock()
	d.closed = true
	d.mu.Unlock()
	d.resends.Wait()
}

// failRank fails the Completions of messages to rank r (r < 0: all).
func (d *deviceSends) failRank(r int, err error) {
	d.mu.Lock()
	var cs []*Completion
	for seq, c := range d.pending {
		if r < 0 || c.rank == r {
			cs = append(cs, c)
			delete(d.pending, seq)
		}
	}
	d.mu.Unlock()
	for _, c := range cs {
		c.err = err
		close(c.done)
	}
}

// deviceSend is a message's gpu.Buffer field that does not travel as the
// active message's data: by CUDA IPC (data is the descriptor), or on the
// pair channel (pair is set, device_pair.go).
type deviceSend struct {
	data []byte // CUDA IPC: the active message's data, descriptor and sequence number
	n    int    // the buffer's length
	seq  uint64 // CUDA IPC: the acknowledgement's number
	c    *Completion

	pair *transport.Channel // the pair channel the buffer follows on
	buf  gpu.Buffer         // the buffer, for the pair channel
}

// withoutDevice returns msg (v is its value) with its gpu.Buffer field
// zeroed, as a copy of the same shape (pointer or value).
func withoutDevice(ct *codecType, v reflect.Value, ptr bool) any {
	cp := reflect.New(ct.typ)
	cp.Elem().Set(v)
	cp.Elem().Field(ct.device).SetZero()
	if ptr {
		return cp.Interface()
	}
	return cp.Elem().Interface()
}

// deviceIPC prepares msg's gpu.Buffer field to go to rank r by CUDA IPC and
// returns msg with the field zeroed. A nil *deviceSend: the field goes
// otherwise.
func (rt *Runtime) deviceIPC(r int, ct *codecType, msg any, ptr bool) (*deviceSend, any) {
	if ct.device < 0 || !rt.t.DeviceIPCPeer(r) {
		return nil, msg
	}
	v := reflect.ValueOf(msg)
	if ptr {
		v = v.Elem()
	}
	b := v.Field(ct.device).Interface().(gpu.Buffer)
	if b.IsZero() || b.Len() == 0 || b.Kind() != gpu.KindDevice {
		return nil, msg
	}
	desc, err := rt.t.ExportDevice(b)
	if err != nil {
		rt.log.Debug("device buffer not exported; sending its bytes", zap.Error(err))
		return nil, msg
	}
	seq, c := rt.devSends.add(r, rt.t, b)
	x := &deviceSend{data: binary.LittleEndian.AppendUint64(desc, seq), n: b.Len(), seq: seq, c: c}
	return x, withoutDevice(ct, v, ptr)
}

// receiveDeviceIPC receives an IPC device message: it lands the bytes by
// a CUDA IPC copy in a goroutine and delivers the message in its turn.
func (rt *Runtime) receiveDeviceIPC(in *inPeer, m *transport.AMMessage, it *inItem, ct *codecType) {
	it.e.Body = append([]byte(nil), it.e.Body...) // the header dies when we return
	var desc []byte
	seq, haveSeq := uint64(0), false
	switch {
	case m.Rendezvous || m.Size != deviceIPCData:
		it.err = fmt.Sprintf("CUDA IPC device message with %d bytes of data, want %d", m.Size, deviceIPCData)
	default:
		data := m.Data()
		desc = append([]byte(nil), data[:transport.DeviceDescSize]...)
		seq, haveSeq = binary.LittleEndian.Uint64(data[transport.DeviceDescSize:]), true
	}
	var dst gpu.Buffer
	owned := false         // dst was allocated here, not named by the hook
	landingFailed := false // the message was well formed; its landing failed
	switch {
	case it.err != "":
	case ct == nil:
		it.err = fmt.Sprintf("unknown message type id 0x%08x (not registered on rank %d)", it.e.Type, rt.rank)
	case ct.device < 0:
		it.err = fmt.Sprintf("CUDA IPC device message of type %s, which has no gpu.Buffer field", ct.name)
	default:
		// The landing buffer is allocated only for a length the
		// descriptor confirms, from a rank that may send descriptors.
		n, err := transport.DeviceDescLength(desc)
		switch {
		case err != nil:
			it.err = err.Error()
		case !rt.t.DeviceIPCPeer(in.rank):
			it.err = fmt.Sprintf("CUDA IPC device message from rank %d, which is not a CUDA IPC peer of rank %d", in.rank, rt.rank)
		case n != it.e.PayloadLen:
			it.err = fmt.Sprintf("CUDA IPC descriptor of %d bytes for a payload of %d", n, it.e.PayloadLen)
		default:
			if dst, owned, err = rt.deviceLanding(it, n); err != nil {
				it.err = "device payload: " + err.Error()
				landingFailed = true
			}
		}
	}
	if it.err != "" {
		if !landingFailed {
			rt.stats.DecodeErrors.Add(1) // the message itself was wrong
		}
		if haveSeq {
			rt.ackDevice(in.rank, seq, it.err)
		}
		in.pushReady(it)
		return
	}
	// A small copy from a mapping already open, by the device's copy
	// agent, takes a few microseconds: do it here rather than pay a
	// goroutine hand-off for it (transport.ImportDeviceNow).
	if done, err := rt.t.ImportDeviceNow(in.rank, desc, dst); done {
		rt.landedIPC(in, it, ct, dst, owned, seq, false, err)
		in.pushReady(it)
		return
	}
	// The copy takes the GPU some microseconds; keep the progress goroutine
	// polling meanwhile so that the acknowledgement and the messages behind
	// this one do not wait for it to wake.
	expecting := rt.t.ExpectReply()
	declined := false // the bytes came instead (device_fallback.go)
	in.await(it, func(context.Context) (transport.Status, error) {
		err := rt.t.ImportDevice(in.rank, desc, dst)
		if errors.Is(err, transport.ErrIPCDeclined) {
			declined = true
			err = rt.fetchDeclined(in.rank, seq, dst, err)
		}
		return transport.Status{}, err
	}, func(_ transport.Status, err error) {
		defer expecting()
		rt.landedIPC(in, it, ct, dst, owned, seq, declined, err)
	})
}

// landedIPC decodes IPC device message it once its bytes landed in dst (or
// failed with err), marks it ready and acknowledges it. owned: dst was
// allocated for it (freed on failure); declined: the bytes came by the
// fallback, not by CUDA IPC.
func (rt *Runtime) landedIPC(in *inPeer, it *inItem, ct *codecType, dst gpu.Buffer, owned bool, seq uint64, declined bool, err error) {
	it.ready = true
	if err != nil {
		it.err = "device payload: " + err.Error()
	} else if msg, derr := decodeBodyDevice(ct, it.e.Body, it.e.Flags&flagPointer != 0, nil, dst); derr != nil {
		rt.stats.DecodeErrors.Add(1)
		it.err = derr.Error()
	} else {
		rt.stats.DeviceLanded.Add(1)
		if !declined {
			rt.stats.DeviceIPC.Add(1)
		}
		it.msg = msg
		if owned {
			it.landed = dst
		}
	}
	if it.err != "" && owned {
		_ = gpu.Free(dst)
	}
	rt.ackDevice(in.rank, seq, it.err)
}

// ackDevice tells rank r the outcome of its IPC device message seq ("":
// copied).
func (rt *Runtime) ackDevice(r int, seq uint64, reason string) {
	reason = clipReason(reason)
	hdr := appendUint(appendUint(make([]byte, 0, 24+len(reason)), uint64(rt.rank)), seq)
	hdr = appendString(hdr, reason)
	if _, err := rt.t.SendAM(r, amDeviceAck, hdr, nil, transport.AMEager); err != nil {
		rt.log.Debug("device acknowledgement not sent", zap.Int("peer", r), zap.Error(err))
	}
}

// onDeviceAck completes the Completion of an IPC device message.
func (rt *Runtime) onDeviceAck(m *transport.AMMessage) {
	src, seq, reason, err := decodeDeviceReply(m.Header, rt.size)
	if err != nil {
		rt.stats.DecodeErrors.Add(1)
		rt.log.Warn("malformed device acknowledgement", zap.Binary("header", m.Header), zap.Error(err))
		return
	}
	if reason != "" {
		err = &DeviceIPCError{Rank: src, Reason: reason}
	}
	if !rt.devSends.finish(seq, src, err) {
		rt.stats.DecodeErrors.Add(1)
		rt.log.Warn("device acknowledgement for no message", zap.Int("src", src), zap.Uint64("seq", seq))
	}
}

// waitDevice waits for c (Completion.Wait). Peer loss and Shutdown finish
// every Completion.
func (rt *Runtime) waitDevice(c *Completion) error {
	return c.Wait(context.Background())
}
