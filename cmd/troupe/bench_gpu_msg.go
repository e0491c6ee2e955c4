package main

import (
	"context"
	"time"

	pa "github.com/asynkron/protoactor-go/actor"
	"go.uber.org/zap"

	"github.com/troupe-hpc/troupe/actor"
	"github.com/troupe-hpc/troupe/gpu"
)

// The GPU Messaging API column of troupe bench gpu: actor messages whose
// gpu.Buffer field travels as the message's data and lands in device
// memory named by the receiving actor's PostReceiveDevice hook.

// gpuBenchMsg carries one device buffer. Echo asks the receiver to send it
// straight back (latency); otherwise the receiver counts it and
// acknowledges each window with a gpuBenchAck (bandwidth).
type gpuBenchMsg struct {
	Seq  int
	Echo bool
	Buf  gpu.Buffer
}

type gpuBenchAck struct{ N int }

func init() {
	actor.MustRegister[gpuBenchMsg]()
	actor.MustRegister[gpuBenchAck]()
}

const gpuMsgActorName = "bench-gpu"

// gpuMsgActor is one rank's end of the measurement.
type gpuMsgActor struct {
	b     *gpuBench
	rt    *actor.Runtime
	peer  *pa.PID
	slot  int           // next landing buffer (PostReceiveDevice, one goroutine)
	got   chan struct{} // rank 0: an echo or an acknowledgement arrived
	count int           // rank 1: messages of the current window
}

// PostReceiveDevice lands messages in the window's device buffers in turn,
// so the measurement allocates nothing per message.
func (a *gpuMsgActor) PostReceiveDevice(in *actor.Incoming) gpu.Buffer {
	buf, err := a.b.dev[a.slot].Slice(0, in.Size)
	a.slot = (a.slot + 1) % len(a.b.dev)
	if err != nil {
		return gpu.Buffer{} // the runtime allocates
	}
	return buf
}

func (a *gpuMsgActor) Receive(c pa.Context) {
	switch m := c.Message().(type) {
	case *gpuBenchMsg:
		switch {
		case a.got != nil:
			a.got <- struct{}{}
		case m.Echo:
			a.reply(&gpuBenchMsg{Seq: m.Seq, Echo: true, Buf: m.Buf})
		default:
			if a.count++; a.count == a.b.f.window {
				a.count = 0
				a.reply(&gpuBenchAck{N: m.Seq})
			}
		}
	case *gpuBenchAck:
		if a.got != nil {
			a.got <- struct{}{}
		}
	}
}

func (a *gpuMsgActor) reply(msg any) {
	if err := a.rt.Send(a.peer, msg); err != nil {
		a.rt.Logger().Warn("bench gpu: reply not sent", zap.Error(err))
	}
}

// startMessaging starts the actor runtime on the benchmark's transport and
// spawns this rank's end; the caller shuts the runtime down.
func (b *gpuBench) startMessaging(ctx context.Context) error {
	rt, err := actor.Init(ctx, actor.Options{Transport: b.t, Device: b.sys.Devices()[0]})
	if err != nil {
		return err
	}
	a := &gpuMsgActor{b: b, rt: rt, peer: rt.PID(b.peer, gpuMsgActorName)}
	if b.t.Rank() == 0 {
		a.got = make(chan struct{}, b.f.window+1)
	}
	if _, err := rt.Root().SpawnNamed(rt.Props(func() pa.Actor { return a }), gpuMsgActorName); err != nil {
		_ = rt.Shutdown(ctx)
		return err
	}
	b.rt, b.msg = rt, a
	return nil
}

// measureMessaging measures on rank 0 (rank 1's actor answers by itself):
// latency as half the round trip of an echoed message, bandwidth as windows
// of messages each acknowledged once.
func (b *gpuBench) measureMessaging(ctx context.Context, size int) (latUs, bwMBps float64, err error) {
	if b.t.Rank() != 0 || size == 0 {
		return 0, 0, nil
	}
	lat, bw := b.iterations(size)
	// wait takes one arrival, progressing the transport meanwhile as
	// Request and the channel requests' Wait do (transport.Await receives
	// from got; a value it takes is the arrival waited for).
	wait := func() error { return b.t.Await(ctx, b.msg.got) }
	pingpong := func(n int) ([]time.Duration, error) {
		src, err := b.dev[0].Slice(0, size)
		if err != nil {
			return nil, err
		}
		rts := make([]time.Duration, n)
		for i := range rts {
			start := time.Now()
			if err := b.rt.Send(b.msg.peer, &gpuBenchMsg{Seq: i, Echo: true, Buf: src}); err != nil {
				return nil, err
			}
			if err := wait(); err != nil {
				return nil, err
			}
			rts[i] = time.Since(start)
		}
		return rts, nil
	}
	cs := make([]*actor.Completion, b.f.window)
	stream := func(n int) (time.Duration, error) {
		start := time.Now()
		for it := 0; it < n; it++ {
			for i := 0; i < b.f.window; i++ {
				src, err := b.dev[i].Slice(0, size)
				if err != nil {
					return 0, err
				}
				// SendDevice: by CUDA IPC the window's buffers are all in
				// flight at once (Send would wait for each copy).
				c, err := b.rt.SendDevice(nil, b.msg.peer, &gpuBenchMsg{Seq: i, Buf: src})
				if err != nil {
					return 0, err
				}
				cs[i] = c
			}
			for _, c := range cs {
				if err := c.Wait(ctx); err != nil {
					return 0, err
				}
			}
			if err := wait(); err != nil {
				return 0, err
			}
		}
		return time.Since(start), nil
	}
	if _, err := pingpong(max(lat/10, 2)); err != nil {
		return 0, 0, err
	}
	rts, err := pingpong(lat)
	if err != nil {
		return 0, 0, err
	}
	latUs = oneWayUs(rts, b.f.stat)
	if _, err := stream(1); err != nil {
		return 0, 0, err
	}
	d, err := stream(bw)
	if err != nil {
		return 0, 0, err
	}
	return latUs, float64(size) * float64(bw*b.f.window) / d.Seconds() / 1e6, nil
}
