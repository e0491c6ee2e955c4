package actor

import (
	"context"
	"fmt"
	"sync"

	"go.uber.org/zap"

	"github.com/troupe-hpc/troupe/gpu"
	"github.com/troupe-hpc/troupe/transport"
)

// Fallback for CUDA IPC device messages (docs/gpu.md, "GPU Messaging
// API"). A receiver that cannot take a descriptor by CUDA IPC at all
// (transport.ErrIPCDeclined: its landing buffer is not cuda memory, or the
// driver will not open the handle, as for a device this process cannot
// reach) asks the sender for the bytes instead, with an amDeviceResend
// message naming the sequence number. The sender, whose buffer is still
// untouched (its Completion is not done), copies it to host memory and
// sends it as an amDeviceBytes message; the receiver copies the bytes to
// its landing buffer, delivers the message in its turn (the messages behind
// it waited), and acknowledges as for an IPC copy. Nothing is lost, and the
// sender's Completion is done on that acknowledgement as always.

const (
	// amDeviceResend asks a sender for the bytes of an IPC device message.
	amDeviceResend uint16 = 0x44
	// amDeviceBytes carries them, or the sender's reason for failing.
	amDeviceBytes uint16 = 0x45
)

// resend is the sender's answer to an amDeviceResend: the bytes (a
// transport request that lands them in host), or the reason it failed.
type resend struct {
	req  *transport.Request
	host []byte
	err  error
}

// deviceResends holds the receivers waiting for the bytes of IPC device
// messages they declined, by sending rank and sequence number.
type deviceResends struct {
	mu      sync.Mutex
	waiting map[resendKey]resendWait
}

type resendKey struct {
	rank int
	seq  uint64
}

type resendWait struct {
	ch chan resend
	n  int // the bytes expected
}

// add registers a waiter for the n bytes of message seq of rank r.
func (d *deviceResends) add(r int, seq uint64, n int) (chan resend, error) {
	d.mu.Lock()
	defer d.mu.Unlock()
	k := resendKey{r, seq}
	if d.waiting == nil {
		d.waiting = map[resendKey]resendWait{}
	}
	if _, ok := d.waiting[k]; ok {
		return nil, fmt.Errorf("device message %d from rank %d is already waiting for its bytes", seq, r)
	}
	ch := make(chan resend, 1)
	d.waiting[k] = resendWait{ch, n}
	return ch, nil
}

// take removes and returns the waiter for message seq of rank r (a nil
// channel if there is none).
func (d *deviceResends) take(r int, seq uint64) resendWait {
	d.mu.Lock()
	defer d.mu.Unlock()
	k := resendKey{r, seq}
	w := d.waiting[k]
	delete(d.waiting, k)
	return w
}

// failRank ends the waits for messages from rank r (r < 0: all) with err.
func (d *deviceResends) failRank(r int, err error) {
	d.mu.Lock()
	defer d.mu.Unlock()
	for k, w := range d.waiting {
		if r < 0 || k.rank == r {
			w.ch <- resend{err: err}
			delete(d.waiting, k)
		}
	}
}

// fetchDeclined runs, in the receiver's landing goroutine, when the import
// of message seq from rank r into dst was declined (why): it asks the
// sender for the bytes, waits for them and copies them into dst.
func (rt *Runtime) fetchDeclined(r int, seq uint64, dst gpu.Buffer, why error) error {
	ch, err := rt.devResends.add(r, seq, dst.Len())
	if err != nil {
		return err
	}
	if lost := rt.out[r].lostErr(); lost != nil {
		// peerLost closes the rank's outPeer before it fails the waiters:
		// it may have failed them before this one was added.
		if rt.devResends.take(r, seq).ch != nil {
			return lost
		}
	}
	reason := why.Error()
	reason = clipReason(reason)
	hdr := appendString(appendUint(appendUint(nil, uint64(rt.rank)), seq), reason)
	if _, err := rt.t.SendAM(r, amDeviceResend, hdr, nil, transport.AMEager); err != nil {
		rt.devResends.take(r, seq)
		return fmt.Errorf("asking rank %d for the bytes after %v: %w", r, why, err)
	}
	rt.log.Debug("CUDA IPC declined; asked the sender for the bytes", zap.Int("peer", r), zap.Uint64("seq", seq), zap.Error(why))
	var res resend
	select {
	case res = <-ch:
	case <-rt.stop:
		if rt.devResends.take(r, seq).ch != nil {
			return ErrClosed
		}
		res = <-ch // failRank or the bytes got there first
	}
	if res.err != nil {
		return res.err
	}
	if _, err := res.req.Wait(context.Background()); err != nil {
		return fmt.Errorf("receiving the bytes from rank %d: %w", r, err)
	}
	if err := gpu.CopyFromHost(dst, res.host); err != nil {
		return fmt.Errorf("copying the bytes from rank %d to the device: %w", r, err)
	}
	rt.stats.DeviceIPCDeclined.Add(1)
	return nil
}

// onDeviceResend (sender) sends the bytes of a declined IPC device message.
func (rt *Runtime) onDeviceResend(m *transport.AMMessage) {
	src, seq, why, err := decodeDeviceReply(m.Header, rt.size)
	var buf gpu.Buffer
	if err == nil {
		buf = rt.devSends.buffer(seq, src)
	}
	if buf.IsZero() {
		rt.stats.DecodeErrors.Add(1)
		rt.log.Warn("request for the bytes of no device message", zap.Binary("header", m.Header))
		return
	}
	rank := src
	rt.log.Debug("the receiver declined CUDA IPC; sending the bytes", zap.Int("peer", rank), zap.Uint64("seq", seq), zap.String("why", why))
	// The copy to host memory waits for the device: not on the progress
	// goroutine.
	if !rt.devSends.goResend(func() { rt.resendBytes(rank, seq, buf) }) {
		return // shutting down: Shutdown fails the Completion
	}
}

// resendBytes copies the device buffer of message seq to host memory and
// sends it to rank, which declined it by CUDA IPC.
func (rt *Runtime) resendBytes(rank int, seq uint64, buf gpu.Buffer) {
	hdr := appendUint(appendUint(nil, uint64(rt.rank)), seq)
	host := make([]byte, buf.Len())
	failed := ""
	if err := gpu.CopyToHost(host, buf); err != nil {
		failed = fmt.Sprintf("the sender could not copy its device buffer to host memory: %v", err)
		host = nil
	}
	failed = clipReason(failed)
	req, err := rt.t.SendAM(rank, amDeviceBytes, appendString(hdr, failed), host, transport.AMAuto)
	if err == nil {
		_, err = req.Wait(context.Background())
	}
	switch {
	case err != nil:
		rt.devSends.finish(seq, rank, fmt.Errorf("actor: sending a device buffer's bytes to rank %d after it declined CUDA IPC: %w", rank, err))
	case failed != "":
		// The receiver fails the message with our reason and acknowledges
		// it, as after any landing: that acknowledgement completes the
		// Completion (finishing it here made the acknowledgement one for
		// no message, counted as forged).
	default:
		rt.stats.DeviceIPCResent.Add(1)
	}
}

// onDeviceBytes (receiver) hands the bytes of a declined IPC device
// message to its landing goroutine.
func (rt *Runtime) onDeviceBytes(m *transport.AMMessage) {
	src, seq, failed, err := decodeDeviceReply(m.Header, rt.size)
	var w resendWait
	if err == nil {
		w = rt.devResends.take(src, seq)
	}
	switch {
	case w.ch == nil:
		rt.stats.DecodeErrors.Add(1)
		rt.log.Warn("bytes for no declined device message", zap.Binary("header", m.Header))
		m.Release()
	case failed != "":
		m.Release()
		w.ch <- resend{err: fmt.Errorf("rank %d could not send the bytes: %s", src, failed)}
	case m.Size != w.n:
		m.Release()
		rt.stats.DecodeErrors.Add(1)
		w.ch <- resend{err: fmt.Errorf("rank %d sent %d bytes for a device payload of %d", src, m.Size, w.n)}
	default:
		host := make([]byte, m.Size)
		req, err := m.RecvData(host)
		w.ch <- resend{req: req, host: host, err: err}
	}
}
