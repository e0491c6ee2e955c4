package actor

import (
	"context"
	"errors"
	"fmt"
	"os"
	"reflect"
	"strconv"
	"sync"

	"go.uber.org/zap"

	"github.com/troupe-hpc/troupe/gpu"
	"github.com/troupe-hpc/troupe/transport"
)

// The pair channel for large gpu.Buffer fields (docs/gpu.md, "GPU
// Messaging API").
//
// A gpu.Buffer field of at least PairDeviceMin bytes that does not go by
// CUDA IPC travels on the transport's pair channel between the two ranks
// (transport.PairChannel) instead of as the active message's data. The
// message goes out flagged flagDevicePair with no data, and the buffer
// follows as the channel's next Send, under the same lock (outPeer.orderMu):
// the receiver posts the channel's Recvs in the order the messages arrive,
// so the n-th message meets the n-th Send. The channel picks the transfer
// path: a copy between ranks of one process, UCX on the memory itself when
// UCX can reach it, otherwise pipelined staging through pinned host
// buffers (chunked copies to the host overlapped with the sends, copies to
// the device at the receiver), which is what DESIGN 7 asks of the path
// between hosts. Smaller fields stay in the message: one eager active
// message is quicker than a message and a channel transfer.
//
// The sender's Completion is done when the channel Send is, so SendDevice
// returns at once and Send returns when the buffer may be reused. The
// receiver lands the bytes where PostReceiveDevice says (else in memory it
// allocates) and delivers the message in its turn. When it cannot land them
// (a hook buffer of the wrong size, no device memory) it still receives the
// Send, into nothing: the channel discards the bytes and keeps its counters
// in step, and the message is undeliverable as on the other paths.

// PairDeviceMin is the smallest gpu.Buffer field that travels on the pair
// channel by default; smaller ones go in the active message.
// TROUPE_DEVICE_PAIR=<bytes> sets another threshold, TROUPE_DEVICE_PAIR=off
// keeps every field in the message (the staged path before the pair
// channel, for comparison).
const PairDeviceMin = 16 << 10

// errPairDeclined: the receiver could not land a pair-channel device
// buffer. The sender hears why as for any undeliverable message, so a
// blocking send does not fail with it.
var errPairDeclined = errors.New("device buffer declined")

// pairChannels are a runtime's pair channels, opened on first use.
type pairChannels struct {
	mu     sync.Mutex
	min    int // the smallest field sent on the pair channel; 0: none is
	chans  map[int]*transport.Channel
	closed bool
	sends  sync.WaitGroup // goroutines completing pair sends
}

// get returns the pair channel with rank r.
func (p *pairChannels) get(t *transport.Transport, r int) (*transport.Channel, error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.closed {
		return nil, ErrClosed
	}
	if c := p.chans[r]; c != nil {
		return c, nil
	}
	c, err := t.PairChannel(r)
	if err != nil {
		return nil, err
	}
	if p.chans == nil {
		p.chans = map[int]*transport.Channel{}
	}
	p.chans[r] = c
	return c, nil
}

// close waits for the sends in flight and closes the channels.
func (p *pairChannels) close() error {
	p.mu.Lock()
	p.closed = true
	chans := p.chans
	p.chans = nil
	p.mu.Unlock()
	p.sends.Wait()
	var errs []error
	for _, c := range chans {
		errs = append(errs, c.Close())
	}
	return errors.Join(errs...)
}

// devicePair prepares msg's gpu.Buffer field to follow on the pair channel
// to rank r and returns msg with the field zeroed. A nil *deviceSend: the
// field goes in the message.
func (rt *Runtime) devicePair(r int, ct *codecType, msg any, ptr bool) (*deviceSend, any) {
	if ct.device < 0 || rt.pairs.min == 0 {
		return nil, msg
	}
	v := reflect.ValueOf(msg)
	if ptr {
		v = v.Elem()
	}
	b := v.Field(ct.device).Interface().(gpu.Buffer)
	if b.IsZero() || b.Len() < rt.pairs.min || b.Freed() {
		return nil, msg
	}
	c, err := rt.pairs.get(rt.t, r)
	if err != nil {
		rt.log.Debug("no pair channel; the device buffer goes in the message", zap.Int("peer", r), zap.Error(err))
		return nil, msg
	}
	return &deviceSend{n: b.Len(), pair: c, buf: b}, withoutDevice(ct, v, ptr)
}

// sendPair starts d's channel send, right after its message, and sets
// d.c to the Completion that finishes with it. When the send cannot start,
// an empty one keeps the receiver's count (it rejects it as short).
func (rt *Runtime) sendPair(d *deviceSend) error {
	cr, err := d.pair.Send(d.buf)
	if err != nil {
		if x, xerr := d.pair.SendBytes(nil); xerr == nil {
			rt.pairs.sends.Add(1)
			go func() {
				defer rt.pairs.sends.Done()
				_ = x.Wait(context.Background())
			}()
		}
		return err
	}
	c := &Completion{done: make(chan struct{}), rank: d.pair.Peer()}
	rt.pairs.sends.Add(1)
	go func() {
		defer rt.pairs.sends.Done()
		switch err := cr.Wait(context.Background()); {
		case errors.Is(err, transport.ErrSizeMismatch):
			// Only a receiver that could not land the bytes takes a
			// pair-channel message with another size (nothing).
			c.err = fmt.Errorf("actor: rank %d did not take a %d-byte device buffer (its landing failed; the message is undeliverable there): %w", c.rank, d.n, errPairDeclined)
		case err != nil:
			c.err = fmt.Errorf("actor: sending a %d-byte device buffer to rank %d: %w", d.n, c.rank, err)
		}
		close(c.done)
	}()
	d.c = c
	return nil
}

// receiveDevicePair receives a message whose gpu.Buffer field follows on
// the pair channel: it posts the channel receive now, in arrival order,
// and delivers the message in its turn once the bytes have landed.
func (rt *Runtime) receiveDevicePair(in *inPeer, m *transport.AMMessage, it *inItem, ct *codecType) {
	it.e.Body = append([]byte(nil), it.e.Body...) // the header dies when we return
	n := it.e.PayloadLen
	switch {
	case m.Size != 0:
		it.err = fmt.Sprintf("pair-channel device message with %d bytes of data", m.Size)
	case ct == nil:
		it.err = fmt.Sprintf("unknown message type id 0x%08x (not registered on rank %d)", it.e.Type, rt.rank)
	case ct.device < 0:
		it.err = fmt.Sprintf("pair-channel device message of type %s, which has no gpu.Buffer field", ct.name)
	}
	if it.err != "" {
		rt.stats.DecodeErrors.Add(1)
	}
	ch, err := rt.pairs.get(rt.t, in.rank)
	if err != nil {
		if it.err == "" {
			it.err = "device payload: no pair channel: " + err.Error()
		}
		in.pushReady(it)
		return
	}
	var dst gpu.Buffer
	owned := false
	if it.err == "" {
		if dst, owned, err = rt.deviceLanding(it, n); err != nil {
			it.err = "device payload: " + err.Error()
			it.landFailed = true
		}
	}
	var cr *transport.ChannelRequest
	if it.err == "" {
		if cr, err = ch.Recv(dst); err != nil {
			it.err = "device payload: " + err.Error()
		}
	}
	if cr == nil {
		// The Send still comes: an empty receive takes it and the
		// channel discards its bytes (a size mismatch).
		if owned {
			_ = gpu.Free(dst)
			owned = false
		}
		if cr, err = ch.RecvBytes(nil); err != nil {
			in.pushReady(it)
			return
		}
	}
	// Not await's context: a channel transfer cannot be recalled, and its
	// memory (freed below on failure) would stay in use; Shutdown waits
	// for it without a bound.
	in.await(it, func(context.Context) (transport.Status, error) {
		return transport.Status{}, cr.Wait(context.Background())
	}, func(_ transport.Status, werr error) {
		it.ready = true
		switch {
		case it.err != "":
		case werr != nil:
			it.err = "device payload: " + werr.Error()
		default:
			msg, derr := decodeBodyDevice(ct, it.e.Body, it.e.Flags&flagPointer != 0, nil, dst)
			if derr != nil {
				rt.stats.DecodeErrors.Add(1)
				it.err = derr.Error()
				break
			}
			rt.stats.DeviceLanded.Add(1)
			rt.stats.DevicePair.Add(1)
			it.msg = msg
			if owned {
				it.landed = dst
			}
		}
		if it.err != "" && owned {
			_ = gpu.Free(dst)
		}
	})
}

// pairMin returns the pair channel's threshold from TROUPE_DEVICE_PAIR
// (unset or invalid: PairDeviceMin; off: 0, never).
func pairMin() int {
	switch v := os.Getenv("TROUPE_DEVICE_PAIR"); v {
	case "", "on":
		return PairDeviceMin
	case "off":
		return 0
	default:
		if n, err := strconv.Atoi(v); err == nil && n > 0 {
			return n
		}
		return PairDeviceMin
	}
}
