package main

import (
	"context"
	"fmt"
	"os"
	"runtime"
	"sync/atomic"
	"time"

	pa "github.com/asynkron/protoactor-go/actor"

	"github.com/troupe-hpc/troupe/actor"
	"github.com/troupe-hpc/troupe/datatype"
	"github.com/troupe-hpc/troupe/gpu"
	"github.com/troupe-hpc/troupe/transport"
	"github.com/troupe-hpc/troupe/transport/bootstrap"
)

// `troupe bench noncontig --actor`: the same layouts as actor messages with a
// Typed field, ping-ponged between an actor on each rank that lands every
// message in its own layout (PostReceiveTyped) and sends it back. Columns:
// the field packed into the active message ("am"), and by the typed-transfer
// protocol with each scheme forced on both sides and with the adaptive
// default; with --device, both paths with the layouts in Go memory and in
// device memory.

// ncActorMsg is the benchmark's message.
type ncActorMsg struct{ Data actor.Typed }

// ncActorStart starts n round trips from rank 0's actor; done hears the end.
type ncActorStart struct {
	n    int
	done chan error
}

func init() { actor.MustRegister[ncActorMsg]() }

// ncActorWay is one column of the actor benchmark: how the field travels
// (actor.Options.TypedDirectMin and the scheme forced on both sides) and
// whether both ranks' layouts are in device memory.
type ncActorWay struct {
	name   string
	min    int // actor.Options.TypedDirectMin
	scheme datatype.Scheme
	dev    bool
}

// ncActorWays are the actor columns: the protocol off, then forced schemes.
var ncActorWays = []ncActorWay{
	{"am", -1, datatype.SchemeAuto, false},
	{"pack", 1, datatype.SchemePack, false},
	{"sgl", 1, datatype.SchemeSGL, false},
	{"zcopy", 1, datatype.SchemeZCopy, false},
	{"adaptive", 1, datatype.SchemeAuto, false},
}

// ncActorDeviceWays are the columns of --device: both paths with the
// layouts in Go memory and in device memory (Typed.Dev), so that one run
// gives the cost of device memory as a ratio.
var ncActorDeviceWays = []ncActorWay{
	{"am", -1, datatype.SchemeAuto, false},
	{"adaptive", 1, datatype.SchemeAuto, false},
	{"dev-am", -1, datatype.SchemeAuto, true},
	{"dev-adaptive", 1, datatype.SchemeAuto, true},
}

// ncActorTurns and ncActorDeviceTurns are the balanced cycles in which the
// ways take turns.
var (
	ncActorTurns       = balancedTurns(len(ncActorWays))
	ncActorDeviceTurns = balancedTurns(len(ncActorDeviceWays))
)

// ncPinger is the actor on each rank: its layout is where messages land and
// what it sends back, burst messages at a time once burst have arrived.
type ncPinger struct {
	field atomic.Pointer[actor.Typed]
	peer  *pa.PID
	burst int
	got   int // messages of the current burst arrived
	left  int
	done  chan error
}

// sendBurst sends burst messages of the current layout to the peer.
func (p *ncPinger) sendBurst(c pa.Context) {
	for range p.burst {
		c.Send(p.peer, &ncActorMsg{Data: *p.field.Load()})
	}
}

func (p *ncPinger) PostReceiveTyped(*actor.Incoming) actor.Typed { return *p.field.Load() }

func (p *ncPinger) Receive(c pa.Context) {
	switch m := c.Message().(type) {
	case *ncActorStart:
		p.left, p.done = m.n, m.done
		p.sendBurst(c)
	case *ncActorMsg:
		if p.got++; p.got < p.burst {
			return
		}
		p.got = 0
		if p.done != nil {
			if p.left--; p.left == 0 {
				p.done <- nil
				p.done = nil
				return
			}
		}
		p.sendBurst(c)
	}
}

func noncontigActorRank(ctx context.Context, f noncontigFlags, boot bootstrap.Bootstrapper, t *transport.Transport, cases []ncCase) error {
	rt, err := actor.Init(ctx, actor.Options{Transport: t})
	if err != nil {
		return err
	}
	defer shutdownRank(rt)
	enc, closeOut, err := benchOut(t.Rank())
	if err != nil {
		return err
	}
	defer closeOut()
	peer := 1 - t.Rank()
	p := &ncPinger{peer: rt.PID(peer, "pinger"), burst: max(f.burst, 1)}
	p.field.Store(&actor.Typed{})
	self, err := rt.Root().SpawnNamed(rt.Props(func() pa.Actor { return p }), "pinger")
	if err != nil {
		return err
	}
	ways, turns := ncActorWays, ncActorTurns
	var dev *gpu.Device
	backend := ""
	if f.device {
		ways, turns = ncActorDeviceWays, ncActorDeviceTurns
		sys, err := gpu.Open()
		if err != nil {
			return err
		}
		defer sys.Close()
		if dev, err = sys.Device(0); err != nil {
			return err
		}
		backend = sys.Backend()
	}
	var devBuf gpu.Buffer // the current layout's device copy (--device)
	defer func() { freeDevice(devBuf) }()
	for _, c := range cases {
		r, err := c.prepare(f.scale)
		if err != nil {
			return err
		}
		host := &actor.Typed{Buf: r.buf, Type: c.dt, Base: c.base, Count: 1}
		onDev := host
		if dev != nil {
			freeDevice(devBuf)
			if devBuf, err = dev.Alloc(len(r.buf)); err != nil {
				return err
			}
			if err := gpu.CopyFromHost(devBuf, r.buf); err != nil {
				return err
			}
			onDev = &actor.Typed{Dev: devBuf, Type: c.dt, Base: c.base, Count: 1}
		}
		p.field.Store(host)
		// The ways take turns batch by batch in a balanced cycle, each batch
		// from a collected heap after untimed round trips, as the tagged
		// benchmark does (ncTurns); each way's best batch is reported.
		batch, warmup := max(r.iters/4, 3), r.warmup
		best := map[string]float64{}
		var used transport.SchemeCounts // the adaptive batches' schemes (rank 0)
		settle := newNCSettle(boot, c.name, f)
		rounds := 0
		for round := 0; ; round++ {
			for turn, k := range turns {
				w := ways[k]
				if err := rt.SetTypedTransfer(w.min, w.scheme); err != nil {
					return err
				}
				if w.dev {
					p.field.Store(onDev)
				} else {
					p.field.Store(host)
				}
				runtime.GC()
				if err := boot.Barrier(ctx, fmt.Sprintf("nc.%s.%d.%d", c.name, round, turn)); err != nil {
					return err
				}
				var u *transport.SchemeCounts
				if w.scheme == datatype.SchemeAuto && w.min > 0 {
					u = &used
				}
				if err := ncActorRun(ctx, t, rt, self, w.name, warmup, batch, p.burst, best, u); err != nil {
					return fmt.Errorf("%s %s: %w", c.name, w.name, err)
				}
				if err := boot.Barrier(ctx, fmt.Sprintf("nc.%s.%d.%d.end", c.name, round, turn)); err != nil {
					return err
				}
			}
			rounds++
			bests := make([]float64, len(ways))
			for k, w := range ways {
				bests[k] = best[w.name]
			}
			if more, err := settle.more(ctx, round, bests); err != nil || !more {
				if err != nil {
					return err
				}
				break
			}
		}
		if enc != nil {
			for _, w := range ways {
				pt := ncPoint{Layout: c.name, Scheme: w.name, LatUs: best[w.name], Bytes: r.bytes, Blocks: r.segments,
					Batches: rounds * len(turns) / len(ways), Backend: backend}
				if w.name == "adaptive" {
					pt.Used = &used
				}
				if err := enc.Encode(pt); err != nil {
					return err
				}
			}
		}
		fmt.Fprintf(os.Stderr, "rank %d: %s done\n", t.Rank(), c.name)
	}
	if t.Rank() == 0 {
		fmt.Fprintf(os.Stderr, "rank 0 counters: %+v; Typed fields sent by the protocol %d, packed from device memory %d\n",
			t.NoncontigStats(), rt.Stats().TypedSent.Load(), rt.Stats().TypedDevicePacked.Load())
	}
	return boot.Barrier(ctx, "bench.noncontig.done")
}

// ncActorRun runs, on rank 0, warmup and then iters round trips (of burst
// messages each way) from its actor, and records the one-way latency per
// message in best[way] if it is the best; used (when not nil) counts the
// timed round trips' transfers by scheme.
func ncActorRun(ctx context.Context, t *transport.Transport, rt *actor.Runtime, self *pa.PID, way string, warmup, iters, burst int, best map[string]float64, used *transport.SchemeCounts) error {
	if t.Rank() != 0 {
		return nil
	}
	run := func(n int) error {
		done := make(chan error, 1)
		rt.Root().Send(self, &ncActorStart{n: n, done: done})
		select {
		case err := <-done:
			return err
		case <-ctx.Done():
			return ctx.Err()
		}
	}
	if err := run(warmup); err != nil {
		return fmt.Errorf("warm-up: %w", err)
	}
	before := t.NoncontigStats()
	start := time.Now()
	if err := run(iters); err != nil {
		return err
	}
	lat := float64(time.Since(start).Nanoseconds()) / float64(2e3*iters*burst)
	if used != nil {
		addUsed(used, before, t.NoncontigStats())
	}
	if b, ok := best[way]; !ok || lat < b {
		best[way] = lat
	}
	return nil
}

// freeDevice frees b unless it is the zero Buffer.
func freeDevice(b gpu.Buffer) {
	if !b.IsZero() {
		_ = gpu.Free(b)
	}
}
