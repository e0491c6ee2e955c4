package actor

import (
	"context"
	"os"
	"testing"
	"time"

	pa "github.com/asynkron/protoactor-go/actor"

	"github.com/troupe-hpc/troupe/datatype"
	"github.com/troupe-hpc/troupe/gpu"
)

func BenchmarkRequest(b *testing.B) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	o := Options{}
	if d, err := time.ParseDuration(os.Getenv("BSPIN")); err == nil {
		o.TransportOptions.Spin = d
	}
	rts, stop, err := StartLocal(ctx, 2, o)
	if err != nil {
		b.Fatal(err)
	}
	defer stop()
	pid, err := rts[1].Root().SpawnNamed(echoProps(rts[1]), "echo")
	if err != nil {
		b.Fatal(err)
	}
	remote := rts[0].PID(1, pid.Id)
	msg := &ping{N: 1}
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		if _, err := rts[0].Request(remote, msg, 5*time.Second); err != nil {
			b.Fatal(err)
		}
	}
}

// BenchmarkSend64 floods an actor on another rank (same process, real UCX)
// with messages of a 64 B Payload: ns/op is the one-way cost per message,
// allocs/op and B/op are both ranks' allocations per message.
func BenchmarkSend64(b *testing.B) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	rts, stop, err := StartLocal(ctx, 2, Options{})
	if err != nil {
		b.Fatal(err)
	}
	defer stop()
	n, want := 0, b.N
	done := make(chan struct{})
	if _, err := rts[1].Root().SpawnNamed(rts[1].PropsFromFunc(func(c pa.Context) {
		if _, ok := c.Message().(*blob); ok {
			if n++; n == want {
				close(done)
			}
		}
	}), "sink"); err != nil {
		b.Fatal(err)
	}
	sink := rts[0].PID(1, "sink")
	data := make(Payload, 64)
	b.ReportAllocs()
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		if err := rts[0].Send(sink, &blob{Data: data}); err != nil {
			b.Fatal(err)
		}
	}
	<-done
}

// BenchmarkLocalPingPong bounces a message between two actors of one
// runtime: every hop finds the receiver's mailbox idle, so ns/op is the
// cost of a local send plus scheduling a mailbox and running it.
func BenchmarkLocalPingPong(b *testing.B) {
	rts := startLocal(b, 1)
	rt := rts[0]
	done := make(chan struct{})
	want := b.N
	var peer [2]*pa.PID
	for i := range peer {
		p, err := rt.Root().SpawnNamed(rt.PropsFromFunc(func(c pa.Context) {
			if m, ok := c.Message().(*ping); ok {
				if m.N >= want {
					close(done)
					return
				}
				m.N++
				c.Send(peer[1-i], m)
			}
		}), "pp"+string(rune('a'+i)))
		if err != nil {
			b.Fatal(err)
		}
		peer[i] = p
	}
	b.ResetTimer()
	rt.Root().Send(peer[0], &ping{N: 1})
	<-done
}

// BenchmarkTypedPacked sends a Typed field of 128 KiB packed (64 blocks of
// 2 KiB, stride 4 KiB) to an actor on another rank (same process, real UCX)
// that unpacks it into its own layout, packed into the active message
// (TypedDirectMin -1), and waits for the answer: B/op shows whether the
// packed copies reuse pooled memory (far below 128 KiB) or are fresh.
func BenchmarkTypedPacked(b *testing.B) {
	benchTypedRequests(b, startLocalWith(b, 2, Options{TypedDirectMin: -1}))
}

// BenchmarkTypedInProcess is BenchmarkTypedPacked's request and answer
// with the field packed into the active message ("am") and by the
// typed-transfer protocol under each scheme, between two ranks of one
// process: they share its Ps, and the protocol's waiters and progress
// goroutines then compete for them (docs/noncontig.md, "Packed fields in
// pooled memory, and the threshold per peer").
func BenchmarkTypedInProcess(b *testing.B) {
	for _, way := range []struct {
		name   string
		min    int
		scheme datatype.Scheme
	}{{"am", -1, datatype.SchemeAuto}, {"pack", 1, datatype.SchemePack}, {"sgl", 1, datatype.SchemeSGL}, {"adaptive", 1, datatype.SchemeAuto}} {
		b.Run(way.name, func(b *testing.B) {
			rts := startLocalWith(b, 2, Options{TypedDirectMin: way.min, TypedScheme: way.scheme})
			benchTypedRequests(b, rts)
		})
	}
}

// BenchmarkTypedDevice is BenchmarkTypedPacked's request and answer with
// both layouts in Go memory and in device memory (Typed.Dev, host backend),
// on both paths: what staging a device layout through pinned memory costs.
func BenchmarkTypedDevice(b *testing.B) {
	for _, path := range []struct {
		name string
		min  int
	}{{"am", -1}, {"protocol", 1}} {
		for _, onDev := range []bool{false, true} {
			mem := "go-memory"
			if onDev {
				mem = "device"
			}
			b.Run(path.name+"/"+mem, func(b *testing.B) {
				var dev *gpu.Device
				if onDev {
					dev = hostDevice(b)
				}
				benchTypedRequestsIn(b, startLocalWith(b, 2, Options{TypedDirectMin: path.min}), dev)
			})
		}
	}
}

// benchTypedRequests times requests carrying a 128 KiB (packed) Typed field
// from rts[0] to an actor of rts[1] that unpacks it into its own layout.
func benchTypedRequests(b *testing.B, rts []*Runtime) { benchTypedRequestsIn(b, rts, nil) }

// benchTypedRequestsIn is benchTypedRequests with both layouts in dev's
// memory, or in Go memory when dev is nil.
func benchTypedRequestsIn(b *testing.B, rts []*Runtime, dev *gpu.Device) {
	ty, err := datatype.Vector(64, 2048, 4096, datatype.Byte)
	if err != nil {
		b.Fatal(err)
	}
	field := func() Typed {
		if dev == nil {
			return Typed{Buf: make([]byte, 64*4096), Type: ty, Count: 1}
		}
		return Typed{Dev: devGrid(b, dev, make([]byte, 64*4096)), Type: ty, Count: 1}
	}
	sink := &faceSink{dst: field(), seen: make(chan face, 1)}
	if _, err := rts[1].Root().SpawnNamed(rts[1].Props(func() pa.Actor { return sink }), "faces"); err != nil {
		b.Fatal(err)
	}
	target := rts[0].PID(1, "faces")
	msg := &face{Col: field()}
	b.SetBytes(64 * 2048)
	b.ReportAllocs()
	for b.Loop() {
		if _, err := rts[0].Request(target, msg, 5*time.Second); err != nil {
			b.Fatal(err)
		}
		<-sink.seen
	}
}
