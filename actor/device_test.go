package actor

import (
	"bytes"
	"errors"
	"testing"
	"time"

	pa "github.com/asynkron/protoactor-go/actor"

	"github.com/troupe-hpc/troupe/gpu"
)

type halo struct {
	Iter int
	Face gpu.Buffer
}

func init() { MustRegister[halo]() }

type deviceSink struct {
	dst  gpu.Buffer // where faces land; zero: the runtime allocates
	seen chan halo
}

func (d *deviceSink) PostReceiveDevice(in *Incoming) gpu.Buffer { return d.dst }

func (d *deviceSink) Receive(c pa.Context) {
	if h, ok := c.Message().(*halo); ok {
		if c.Sender() != nil {
			c.Respond(&pong{N: h.Iter})
		}
		d.seen <- *h
	}
}

// hostDevice opens device 0 of a host-backend system, closed with the test.
func hostDevice(t *testing.T) *gpu.Device {
	t.Helper()
	sys, err := gpu.OpenBackend(gpu.BackendHost)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { sys.Close() })
	dev, err := sys.Device(0)
	if err != nil {
		t.Fatal(err)
	}
	return dev
}

func TestDeviceBufferMessages(t *testing.T) {
	dev := hostDevice(t)
	rts := startLocal(t, 2)
	const n = 256 << 10 // rendezvous-sized
	src, err := dev.Alloc(n)
	if err != nil {
		t.Fatal(err)
	}
	want := bytes.Repeat([]byte{1, 2, 3, 4}, n/4)
	if err := gpu.CopyFromHost(src, want); err != nil {
		t.Fatal(err)
	}
	dst, err := dev.Alloc(n)
	if err != nil {
		t.Fatal(err)
	}
	sink := &deviceSink{dst: dst, seen: make(chan halo, 2)}
	if _, err := rts[1].Root().SpawnNamed(rts[1].Props(func() pa.Actor { return sink }), "sink"); err != nil {
		t.Fatal(err)
	}
	target := rts[0].PID(1, "sink")
	check := func(what string, h halo) {
		t.Helper()
		if h.Face.Len() != n {
			t.Fatalf("%s: face of %d bytes", what, h.Face.Len())
		}
		got := make([]byte, n)
		if err := gpu.CopyToHost(got, h.Face); err != nil {
			t.Fatal(err)
		}
		if !bytes.Equal(got, want) {
			t.Fatalf("%s: device bytes differ", what)
		}
	}
	// Into the hook's buffer.
	if err := rts[0].Send(target, &halo{Iter: 1, Face: src}); err != nil {
		t.Fatal(err)
	}
	select {
	case h := <-sink.seen:
		check("hook", h)
		if h.Face.Ptr() != dst.Ptr() {
			t.Fatal("face did not land in the hook's device buffer")
		}
	case <-time.After(10 * time.Second):
		t.Fatal("no message")
	}
	// Without a hook buffer the runtime allocates on its device.
	sink.dst = gpu.Buffer{}
	if _, err := rts[0].Request(target, &halo{Iter: 2, Face: src}, 10*time.Second); err != nil {
		t.Fatal(err)
	}
	h := <-sink.seen
	check("allocated", h)
	if h.Face.Ptr() == dst.Ptr() || h.Face.Kind() == gpu.KindHost {
		t.Fatalf("runtime landing: %v", h.Face)
	}
	// A hook buffer of the wrong size: the requester hears why.
	small, _ := dev.Alloc(n / 2)
	sink.dst = small
	_, err = rts[0].Request(target, &halo{Iter: 3, Face: src}, 10*time.Second)
	var ue *UndeliverableError
	if !errors.As(err, &ue) {
		t.Fatalf("size mismatch: got %v, want an UndeliverableError", err)
	}
	if rts[1].Stats().DeviceLanded.Load() != 2 {
		t.Fatalf("DeviceLanded = %d", rts[1].Stats().DeviceLanded.Load())
	}
}
