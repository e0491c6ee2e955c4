package actor

import (
	"bytes"
	"errors"
	"fmt"
	"strings"
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
func hostDevice(t testing.TB) *gpu.Device {
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

// TestDeviceLandingRejected: a device message whose bytes cannot land (the
// hook's buffer has the wrong size) on the staged path is a dead letter on
// the receiver, and the sender hears of it either way: a sender actor gets
// the *UndeliverableError, and a message sent without one is counted on
// the sending rank and published there as a dead letter.
func TestDeviceLandingRejected(t *testing.T) {
	dev := hostDevice(t)
	rts := startLocalWith(t, 2, Options{Device: dev})
	src, err := dev.Alloc(100)
	if err != nil {
		t.Fatal(err)
	}
	small, err := dev.Alloc(99)
	if err != nil {
		t.Fatal(err)
	}
	sink := &deviceSink{dst: small, seen: make(chan halo, 1)}
	if _, err := rts[1].Root().SpawnNamed(rts[1].Props(func() pa.Actor { return sink }), "sink"); err != nil {
		t.Fatal(err)
	}
	target := rts[0].PID(1, "sink")
	const why = "PostReceiveDevice returned 99 bytes for a device payload of 100"

	// Without a sender: the sending rank's event stream and counter.
	dead := make(chan *UndeliverableError, 1)
	sub := rts[0].System().EventStream.Subscribe(func(ev any) {
		if dl, ok := ev.(*pa.DeadLetterEvent); ok {
			if ue, ok := dl.Message.(*UndeliverableError); ok {
				dead <- ue
			}
		}
	})
	defer rts[0].System().EventStream.Unsubscribe(sub)
	if err := rts[0].Send(target, &halo{Iter: 1, Face: src}); err != nil {
		t.Fatal(err)
	}
	select {
	case ue := <-dead:
		if !strings.Contains(ue.Reason, why) || !strings.Contains(ue.Target, "sink") {
			t.Fatalf("dead letter on the sending rank: %v", ue)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("the sending rank did not hear that its device message could not land")
	}
	if n := rts[0].Stats().DeviceRejected.Load(); n != 1 {
		t.Fatalf("DeviceRejected = %d, want 1", n)
	}

	// With a sender actor: it gets the error itself.
	got := make(chan *UndeliverableError, 1)
	from, err := rts[0].Root().SpawnNamed(rts[0].PropsFromFunc(func(c pa.Context) {
		if ue, ok := c.Message().(*UndeliverableError); ok {
			got <- ue
		}
	}), "from")
	if err != nil {
		t.Fatal(err)
	}
	if err := rts[0].SendFrom(from, target, &halo{Iter: 2, Face: src}); err != nil {
		t.Fatal(err)
	}
	select {
	case ue := <-got:
		if !strings.Contains(ue.Reason, why) {
			t.Fatalf("sender actor got %v", ue)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("the sender actor did not hear that its device message could not land")
	}
	if n := rts[0].Stats().DeviceRejected.Load(); n != 1 {
		t.Fatalf("DeviceRejected = %d after a send with a sender actor, want still 1", n)
	}
	select {
	case h := <-sink.seen:
		t.Fatalf("the sink received %+v", h)
	default:
	}
}

// TestEmptyDeviceField: a gpu.Buffer field of no bytes (a slice of length 0
// of real device memory) arrives as an empty field on another rank, as it
// does on this one. The receiver tried to allocate 0 bytes of device
// memory, which is refused, and the message was undeliverable.
func TestEmptyDeviceField(t *testing.T) {
	dev := hostDevice(t)
	rts := startLocalWith(t, 2, Options{Device: dev})
	src, err := dev.Alloc(64)
	if err != nil {
		t.Fatal(err)
	}
	empty, err := src.Slice(0, 0)
	if err != nil {
		t.Fatal(err)
	}
	sink := &deviceSink{seen: make(chan halo, 1)}
	if _, err := rts[1].Root().SpawnNamed(rts[1].Props(func() pa.Actor { return sink }), "empty-sink"); err != nil {
		t.Fatal(err)
	}
	if _, err := rts[0].Request(rts[0].PID(1, "empty-sink"), &halo{Iter: 3, Face: empty}, 10*time.Second); err != nil {
		t.Fatalf("a message with an empty device buffer: %v", err)
	}
	if h := <-sink.seen; h.Iter != 3 || h.Face.Len() != 0 {
		t.Fatalf("got iteration %d with a field of %d bytes, want 3 and 0", h.Iter, h.Face.Len())
	}
}

// TestDeviceMessageToNoActorFreed: a device message for an actor that does
// not exist is a dead letter without its message: the device memory the
// runtime allocated for its bytes is freed (the dead letter carried the
// message, holding that memory for ever, since nobody owned it).
func TestDeviceMessageToNoActorFreed(t *testing.T) {
	dev := hostDevice(t)
	rts := startLocalWith(t, 2, Options{Device: dev})
	for _, n := range []int{100, 256 << 10} { // in the message; rendezvous
		src, err := dev.Alloc(n)
		if err != nil {
			t.Fatal(err)
		}
		dead := make(chan any, 4)
		sub := rts[1].System().EventStream.Subscribe(func(ev any) {
			if dl, ok := ev.(*pa.DeadLetterEvent); ok && dl.PID != nil && dl.PID.Id == "nobody" {
				dead <- dl.Message
			}
		})
		if err := rts[0].Send(rts[0].PID(1, "nobody"), &halo{Iter: n, Face: src}); err != nil {
			t.Fatal(err)
		}
		select {
		case m := <-dead:
			if h, ok := m.(*halo); ok {
				t.Fatalf("%d bytes: the dead letter holds the message and its runtime-allocated device buffer %v", n, h.Face)
			}
		case <-time.After(10 * time.Second):
			t.Fatalf("%d bytes: no dead letter on the receiving rank", n)
		}
		rts[1].System().EventStream.Unsubscribe(sub)
	}
}

// gatedSink reports the first halo it takes and waits for release before
// it returns; with dst set, faces land there (its PostReceiveDevice hook).
type gatedSink struct {
	dst     gpu.Buffer
	got     chan halo
	release chan struct{}
}

func (g *gatedSink) PostReceiveDevice(*Incoming) gpu.Buffer { return g.dst }

func (g *gatedSink) Receive(c pa.Context) {
	if h, ok := c.Message().(*halo); ok {
		g.got <- *h
		<-g.release
	}
}

// TestDeviceMessageDroppedByStoppedActorFreed: a device message still in
// the mailbox of an actor that stops is dropped, and the device memory the
// runtime allocated for its bytes is freed (it was held for ever: nobody
// owned it). Memory a PostReceiveDevice hook named is the hook's and is not
// touched. Both paths: in the message, and on the pair channel.
func TestDeviceMessageDroppedByStoppedActorFreed(t *testing.T) {
	dev := hostDevice(t)
	rts := startLocalWith(t, 2, Options{Device: dev})
	for _, n := range []int{100, 256 << 10} { // in the message; pair channel
		for _, hooked := range []bool{false, true} {
			name := fmt.Sprintf("gated-%d-%v", n, hooked)
			g := &gatedSink{got: make(chan halo, 2), release: make(chan struct{})}
			if hooked {
				var err error
				if g.dst, err = dev.Alloc(n); err != nil {
					t.Fatal(err)
				}
			}
			pid, err := rts[1].Root().SpawnNamed(rts[1].Props(func() pa.Actor { return g }), name)
			if err != nil {
				t.Fatal(err)
			}
			var mbox *mailbox
			waitFor(t, func() bool {
				if v, ok := rts[1].local.Load(name); ok {
					mbox = v.(*localActor).run.mbox.Load()
				}
				return mbox != nil
			})
			src, err := dev.Alloc(n)
			if err != nil {
				t.Fatal(err)
			}
			to := rts[0].PID(1, name)
			if err := rts[0].Send(to, &halo{Iter: 1, Face: src}); err != nil {
				t.Fatal(err)
			}
			var first halo
			select {
			case first = <-g.got:
			case <-time.After(10 * time.Second):
				t.Fatalf("%s: the first message did not arrive", name)
			}
			if !hooked {
				// The actor's to free, as any message it takes.
				if err := gpu.Free(first.Face); err != nil {
					t.Fatal(err)
				}
			}
			base := dev.LiveAllocs()
			// The actor is busy with the first message: the device message
			// waits in its mailbox, and a ping behind it.
			if err := rts[0].Send(to, &halo{Iter: 2, Face: src}); err != nil {
				t.Fatal(err)
			}
			if err := rts[0].Send(to, &ping{N: 3}); err != nil {
				t.Fatal(err)
			}
			waitFor(t, func() bool { return mbox.userPending() == 2 })
			want := base + 1 // its landing, allocated by the runtime
			if hooked {
				want = base
			}
			if got := dev.LiveAllocs(); got != want {
				t.Fatalf("%s: %d live device allocations with the message queued, want %d", name, got, want)
			}
			// Stop overtakes the queued messages (a system message); the
			// stopped actor drops them. The ping taken means the device
			// message before it was dropped.
			rts[1].Root().Stop(pid)
			close(g.release)
			waitFor(t, func() bool { return mbox.userPending() == 0 })
			select {
			case h := <-g.got:
				t.Fatalf("%s: the stopped actor took message %d", name, h.Iter)
			default:
			}
			if got := dev.LiveAllocs(); got != base {
				t.Fatalf("%s: %d live device allocations after the actor dropped the message, want %d (its runtime-allocated device buffer is still held)", name, got, base)
			}
			if hooked && g.dst.Freed() {
				t.Fatalf("%s: the hook's device buffer was freed", name)
			}
			if err := gpu.Free(src); err != nil {
				t.Fatal(err)
			}
		}
	}
}
