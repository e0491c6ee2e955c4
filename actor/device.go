package actor

import (
	"fmt"
	"reflect"
	"sync/atomic"

	"github.com/troupe-hpc/troupe/gpu"
)

// This file is the GPU Messaging API (paper 002, section 3.2.1): a message
// field of type gpu.Buffer never enters the msgpack body. Its bytes travel
// as the active message's data (rendezvous when large) and land in device
// memory on the receiver: in the buffer the target actor's
// PostReceiveDevice hook names, else in a buffer the runtime allocates on
// its device. The receiving actor's Receive then runs with the message,
// whose gpu.Buffer field refers to the receiver's device memory.
//
// Transfer paths: cuda device memory for another process of this host goes
// by CUDA IPC (device_ipc.go: the receiver copies from the sender's
// memory; SendDevice's Completion says when the buffer may be reused).
// Otherwise a buffer of PairDeviceMin bytes or more follows the message on
// the pair channel (device_pair.go: pipelined staging through pinned host
// memory, or UCX on the memory, or a copy within the process), and a
// smaller one is staged through host memory (a copy to the host at the
// sender, inside Send, and to the device at the receiver). Either way the
// sender may reuse its device buffer when Send returns.

var deviceType = reflect.TypeFor[gpu.Buffer]()

// DevicePostReceiver is implemented by actors that choose the device buffer
// a message's gpu.Buffer field lands in. It runs on the runtime's progress
// goroutine (see PostReceiver), or on the actor's own goroutine before its
// Receive when the overlap engine deferred the message's data
// (docs/overlap.md, section 7); the buffer must be exactly in.Size bytes, or
// the message is undeliverable. Returning the zero Buffer lets the runtime
// allocate on its device.
type DevicePostReceiver interface {
	PostReceiveDevice(in *Incoming) gpu.Buffer
}

// stageDevice copies a gpu.Buffer field's bytes to host memory.
func stageDevice(f reflect.Value) ([]byte, error) {
	b := f.Interface().(gpu.Buffer)
	if b.IsZero() {
		return nil, nil
	}
	host := getBuf(b.Len()) // post returns it to the pool (codecType.stagesPayload)
	if err := gpu.CopyToHost(host, b); err != nil {
		putBuf(host)
		return nil, fmt.Errorf("staging a %d-byte device buffer: %w", b.Len(), err)
	}
	return host, nil
}

// deviceLanding returns the device buffer a message's bytes land in, and
// whether the runtime allocated it (else the hook named it).
func (rt *Runtime) deviceLanding(it *inItem, size int) (gpu.Buffer, bool, error) {
	if la, ok := rt.local.Load(it.e.Target); ok {
		if h, ok := la.(*localActor).actor.(DevicePostReceiver); ok {
			in := &Incoming{Target: rt.PID(rt.rank, it.e.Target), Size: size}
			if it.e.Sender != "" {
				in.Sender = rt.PID(it.e.SenderRank, it.e.Sender)
			}
			if ct := lookupID(it.e.Type); ct != nil {
				in.Type = ct.name
			}
			if b := h.PostReceiveDevice(in); !b.IsZero() {
				if b.Len() != size {
					return gpu.Buffer{}, false, fmt.Errorf("PostReceiveDevice returned %d bytes for a device payload of %d", b.Len(), size)
				}
				return b, false, nil
			}
		}
	}
	dev, err := rt.device()
	if err != nil {
		return gpu.Buffer{}, false, err
	}
	b, err := dev.Alloc(size)
	return b, err == nil, err
}

// landedDevice is a message whose gpu.Buffer field landed in device memory
// the runtime allocated, on its way through its actor's mailbox (the
// runtime's Props). The receiver middleware hands the message to the actor,
// which then owns the memory; a message the actor never takes (it stopped
// first, and protoactor drops what is left in its mailbox) has that memory
// freed by the mailbox's middleware, as deferred data is dropped.
type landedDevice struct {
	msg   any
	buf   gpu.Buffer
	taken atomic.Bool // the actor took it, or it was dropped
}

// take returns the message for the actor, or false if it was dropped.
func (l *landedDevice) take() (any, bool) {
	if l.taken.Swap(true) {
		return nil, false
	}
	return l.msg, true
}

// drop frees the device memory of a message its actor never took; it
// reports false if the actor had taken it.
func (l *landedDevice) drop() bool {
	if l.taken.Swap(true) {
		return false
	}
	_ = gpu.Free(l.buf)
	return true
}

// device returns the runtime's GPU device (Options.Device, else device 0 of
// the default system), opened on first use.
func (rt *Runtime) device() (*gpu.Device, error) {
	rt.devOnce.Do(func() {
		if rt.dev != nil {
			return
		}
		sys, err := gpu.Default()
		if err != nil {
			rt.devErr = err
			return
		}
		rt.dev, rt.devErr = sys.Device(0)
	})
	return rt.dev, rt.devErr
}
