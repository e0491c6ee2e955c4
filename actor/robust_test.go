package actor

import (
	"context"
	"encoding/binary"
	"errors"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	pa "github.com/asynkron/protoactor-go/actor"

	"github.com/troupe-hpc/troupe/transport"
)

// Fixes from a review of the runtime's semantics; each test failed before
// its fix.

// A message that makes its actor panic still gives its sender's credits
// back: four large ones (a quarter of the window each) used to block the
// sender for good although the supervisor restarted the actor.
func TestCreditsComeBackAfterPanic(t *testing.T) {
	rts := startLocal(t, 2)
	got := make(chan int, 1)
	if _, err := rts[1].Root().SpawnNamed(rts[1].PropsFromFunc(func(c pa.Context) {
		if p, ok := c.Message().(*ping); ok {
			if p.Text != "" {
				panic("boom")
			}
			got <- p.N
		}
	}), "fragile"); err != nil {
		t.Fatal(err)
	}
	dst := rts[0].PID(1, "fragile")
	big := string(make([]byte, 4<<20))
	for range 4 {
		if err := rts[0].Send(dst, &ping{N: -1, Text: big}); err != nil {
			t.Fatal(err)
		}
	}
	if err := rts[0].Send(dst, &ping{N: 7}); err != nil {
		t.Fatal(err)
	}
	select {
	case n := <-got:
		if n != 7 {
			t.Fatalf("got %d", n)
		}
	case <-time.After(10 * time.Second):
		t.Fatalf("nothing after four failing messages (credit waits %d, credits back %d)",
			rts[0].Stats().CreditWaits.Load(), rts[1].Stats().CreditsBack.Load())
	}
}

// A mailbox option given to Props does not replace the runtime's mailbox,
// which returns the senders' credits (with it replaced, a sender blocked
// after one window).
func TestPropsMailboxOptionKeepsCredits(t *testing.T) {
	rts := startLocalWith(t, 2, Options{Credits: 64})
	const n = 200
	got := make(chan int, n)
	if _, err := rts[1].Root().SpawnNamed(rts[1].PropsFromFunc(func(c pa.Context) {
		if p, ok := c.Message().(*ping); ok {
			got <- p.N
		}
	}, pa.WithMailbox(pa.Unbounded())), "sink"); err != nil {
		t.Fatal(err)
	}
	for i := range n {
		if err := rts[0].Send(rts[0].PID(1, "sink"), &ping{N: i}); err != nil {
			t.Fatal(err)
		}
	}
	for i := range n {
		select {
		case v := <-got:
			if v != i {
				t.Fatalf("message %d came as %d", i, v)
			}
		case <-time.After(10 * time.Second):
			t.Fatalf("%d of %d messages came", i, n)
		}
	}
}

// A reduction completes when some ranks host no elements (Block placement
// of one element on three ranks): their parents no longer wait for them.
func TestReduceRankWithoutElements(t *testing.T) {
	rts := startLocal(t, 3)
	as := newArrays(t, rts, ArrayConfig{Name: "tiny", Dims: []int{1},
		New: func(el *Element) pa.Actor { return &element{el: el} }})
	f := pa.NewFuture(rts[0].System(), 10*time.Second)
	if err := as[0].Broadcast(&reduceAll{Op: Sum, Target: f.PID()}); err != nil {
		t.Fatal(err)
	}
	res, err := f.Result()
	if err != nil {
		t.Fatalf("reduction of a one-element array on three ranks: %v", err)
	}
	if v, err := res.(*Reduced).Result(); err != nil || v != float64(0) {
		t.Fatalf("got %v %v, want 0", v, err)
	}
}

// Min and Max compare uint64 values as unsigned (2^63 was below 1).
func TestReduceUint64MinMax(t *testing.T) {
	mx, _ := lookupOp(Max)
	mn, _ := lookupOp(Min)
	big, small := uint64(1)<<63, uint64(1)
	if v, err := mx(big, small); err != nil || v != big {
		t.Errorf("Max(2^63, 1) = %v %v", v, err)
	}
	if v, err := mn(big, small); err != nil || v != small {
		t.Errorf("Min(2^63, 1) = %v %v", v, err)
	}
}

type robustOpElem struct{ el *Element }

func (e *robustOpElem) Receive(c pa.Context) {
	if m, ok := c.Message().(*reduceAll); ok {
		if err := e.el.Contribute(float64(e.el.Linear), m.Op, m.Target); err != nil {
			panic(err)
		}
	}
}

func init() {
	// An op whose result is not a registered type: it cannot travel.
	if err := RegisterOp("robust-unregistered", func(a, b any) (any, error) {
		return &unregistered{X: int(a.(float64) + b.(float64))}, nil
	}); err != nil {
		panic(err)
	}
}

// A round whose combined value cannot be sent up the tree fails at the
// target with ErrReduce (it was lost, and the target waited forever).
func TestReduceUnsendableValue(t *testing.T) {
	rts := startLocal(t, 2)
	as := newArrays(t, rts, ArrayConfig{Name: "unsendable", Dims: []int{4},
		Placement: func(Index, int, []int, int) int { return 1 },
		New:       func(el *Element) pa.Actor { return &robustOpElem{el: el} }})
	f := pa.NewFuture(rts[0].System(), 10*time.Second)
	if err := as[0].Broadcast(&reduceAll{Op: "robust-unregistered", Target: f.PID()}); err != nil {
		t.Fatal(err)
	}
	res, err := f.Result()
	if err != nil {
		t.Fatalf("round whose partial cannot be sent: %v, want a Reduced", err)
	}
	if _, err := res.(*Reduced).Result(); !errors.Is(err, ErrReduce) {
		t.Fatalf("round result: %v, want ErrReduce", err)
	}
}

// A broadcast whose message cannot travel nested (it has a Payload, a
// gpu.Buffer or a Typed field, which travel beside the body) fails before
// any element gets it: the caller's own elements got a Payload message
// while the remote ranks' failed, and gpu.Buffer and Typed fields reached
// the remote elements empty, without an error. Each element's first
// message here is the ping broadcast after them.
func TestBroadcastRefusedReachesNobody(t *testing.T) {
	rts := startLocal(t, 2)
	first := make(chan string, 8)
	as := newArrays(t, rts, ArrayConfig{Name: "refused", Dims: []int{4},
		New: func(el *Element) pa.Actor {
			var seen atomic.Bool
			return pa.ReceiveFunc(func(c pa.Context) {
				var what string
				switch c.Message().(type) {
				case *seqBlob, *halo, *face:
					what = "refused"
				case *ping:
					what = "ping"
				default:
					return
				}
				if !seen.Swap(true) {
					first <- what
				}
			})
		}})
	for _, msg := range []any{&seqBlob{N: 1, Data: make(Payload, 8)}, &halo{Iter: 1}, &face{Step: 1}} {
		if err := as[0].Broadcast(msg); err == nil || !strings.Contains(err.Error(), "cannot be nested") {
			t.Fatalf("a broadcast of %T: %v, want it refused", msg, err)
		}
	}
	if err := as[0].Broadcast(&ping{N: 1}); err != nil {
		t.Fatal(err)
	}
	for range as[0].Len() {
		select {
		case what := <-first:
			if what != "ping" {
				t.Fatalf("an element's first message was the refused broadcast")
			}
		case <-time.After(10 * time.Second):
			t.Fatal("the ping broadcast did not reach every element")
		}
	}
}

// A nested value whose type has a gpu.Buffer or Typed field, which only a
// forged body carries now, is a *DecodeError, not a message with the field
// empty.
func TestNestedDeviceOrTypedRefused(t *testing.T) {
	outer, _, err := lookupType(&arrayBroadcast{})
	if err != nil {
		t.Fatal(err)
	}
	for _, msg := range []any{&halo{}, &face{}} {
		ct, _, err := lookupType(msg)
		if err != nil {
			t.Fatal(err)
		}
		body := []byte{0x81, 0xa5, 'V', 'a', 'l', 'u', 'e', 0x93, 0xce} // {"Value": [id, ptr, bin]}
		body = binary.BigEndian.AppendUint32(body, ct.id)
		body = append(body, 0xc3, 0xc4, 1, 0x80) // pointer; the empty map {}
		_, err = decodeBody(outer, body, false, nil)
		var de *DecodeError
		if !errors.As(err, &de) || !strings.Contains(err.Error(), "cannot be nested") {
			t.Errorf("nested %T: %v, want a *DecodeError", msg, err)
		}
	}
}

// An answer that cannot be sent (its type is not registered) is reported
// to the requester as an *UndeliverableError, not left to its timeout.
func TestRespondUnsendable(t *testing.T) {
	rts := startLocal(t, 2)
	if _, err := rts[1].Root().SpawnNamed(rts[1].PropsFromFunc(func(c pa.Context) {
		if _, ok := c.Message().(*ping); ok {
			c.Respond(&unregistered{X: 1})
		}
	}), "bad"); err != nil {
		t.Fatal(err)
	}
	_, err := rts[0].Request(rts[0].PID(1, "bad"), &ping{}, 20*time.Second)
	var ue *UndeliverableError
	if !errors.As(err, &ue) || !strings.Contains(ue.Reason, "answer could not be sent") {
		t.Fatalf("request answered with an unsendable type: %v, want an *UndeliverableError", err)
	}
}

// At Shutdown, a Request still waiting gets an *UndeliverableError at
// once (it waited out its timeout), and the messages already in an
// actor's mailbox are processed (Stop overtook them and protoactor dropped
// them without a dead letter).
func TestShutdownSettlesRequestsAndMailboxes(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	rts, stop, err := StartLocal(ctx, 2, Options{})
	if err != nil {
		t.Fatal(err)
	}
	defer stop()
	gate := make(chan struct{})
	asked := make(chan struct{})
	var processed atomic.Int64
	if _, err := rts[1].Root().SpawnNamed(rts[1].PropsFromFunc(func(c pa.Context) {
		switch m := c.Message().(type) {
		case *pong: // asked, never answered
			close(asked)
		case *ping:
			if m.N == 0 {
				<-gate // the rest queue up behind it
			}
			processed.Add(1)
		}
	}), "slow"); err != nil {
		t.Fatal(err)
	}
	const n = 50
	for i := range n {
		if err := rts[0].Send(rts[0].PID(1, "slow"), &ping{N: i}); err != nil {
			t.Fatal(err)
		}
	}
	reqErr := make(chan error, 1)
	go func() {
		_, err := rts[0].Request(rts[0].PID(1, "slow"), &pong{}, 60*time.Second)
		reqErr <- err
	}()
	close(gate)
	<-asked
	done := make(chan error, 2)
	for _, rt := range rts {
		go func() { done <- rt.Shutdown(ctx) }()
	}
	for range rts {
		if err := <-done; err != nil {
			t.Fatal(err)
		}
	}
	if got := processed.Load(); got != n {
		t.Fatalf("%d of %d queued messages processed by Shutdown", got, n)
	}
	select {
	case err := <-reqErr:
		var ue *UndeliverableError
		if !errors.As(err, &ue) {
			t.Fatalf("request pending at shutdown: %v, want an *UndeliverableError", err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("a request pending at shutdown still waits")
	}
}

// With the overlap engine on, a device message that cannot land (the
// hook's buffer has the wrong size) is reported to the sending rank, as
// without it.
func TestDeviceLandingRejectedWithEngine(t *testing.T) {
	t.Setenv("TROUPE_DEVICE_PAIR", "off")
	t.Setenv(transport.OverlapEnv, "on")
	dev := hostDevice(t)
	rts := startLocalWith(t, 2, Options{Device: dev})
	const n = 64 << 10
	src, _ := dev.Alloc(n)
	small, _ := dev.Alloc(n - 1)
	if _, err := rts[1].Root().SpawnNamed(rts[1].Props(func() pa.Actor {
		return &deviceSink{dst: small, seen: make(chan halo, 1)}
	}), "sink"); err != nil {
		t.Fatal(err)
	}
	dead := make(chan *UndeliverableError, 1)
	rts[0].System().EventStream.Subscribe(func(ev any) {
		if dl, ok := ev.(*pa.DeadLetterEvent); ok {
			if ue, ok := dl.Message.(*UndeliverableError); ok {
				select {
				case dead <- ue:
				default:
				}
			}
		}
	})
	if err := rts[0].Send(rts[0].PID(1, "sink"), &halo{Iter: 1, Face: src}); err != nil {
		t.Fatal(err)
	}
	select {
	case ue := <-dead:
		if !strings.Contains(ue.Reason, "PostReceiveDevice returned") {
			t.Fatalf("dead letter on the sending rank: %v", ue)
		}
	case <-time.After(10 * time.Second):
		t.Fatalf("the sending rank was not told (DeviceRejected %d)", rts[0].Stats().DeviceRejected.Load())
	}
}

// A PID naming no rank of the job (a rank beyond its size, or an address
// that is no troupe rank) is refused by Send, SendDevice, Request and
// RequestFuture with ErrNotInJob; the message used to go to the dead
// letters while the call returned nil. PIDs of this rank and of the other
// ranks are still accepted.
func TestSendToPIDOutsideJob(t *testing.T) {
	rts := startLocal(t, 2)
	if _, err := rts[1].Root().SpawnNamed(rts[1].PropsFromFunc(func(c pa.Context) {
		if p, ok := c.Message().(*ping); ok {
			c.Respond(&ping{N: p.N + 1})
		}
	}), "echo"); err != nil {
		t.Fatal(err)
	}
	for _, pid := range []*pa.PID{pa.NewPID(Address(2), "echo"), pa.NewPID(Address(999), "echo"), pa.NewPID("10.0.0.1:8080", "echo")} {
		if err := rts[0].Send(pid, &ping{N: 1}); !errors.Is(err, ErrNotInJob) {
			t.Errorf("Send to %s: %v, want ErrNotInJob", pid, err)
		}
		if _, err := rts[0].SendDevice(nil, pid, &ping{N: 1}); !errors.Is(err, ErrNotInJob) {
			t.Errorf("SendDevice to %s: %v, want ErrNotInJob", pid, err)
		}
		if _, err := rts[0].Request(pid, &ping{N: 1}, time.Second); !errors.Is(err, ErrNotInJob) {
			t.Errorf("Request to %s: %v, want ErrNotInJob", pid, err)
		}
		if _, err := rts[0].RequestFuture(pid, &ping{N: 1}, time.Second); !errors.Is(err, ErrNotInJob) {
			t.Errorf("RequestFuture to %s: %v, want ErrNotInJob", pid, err)
		}
	}
	got, err := rts[0].Request(rts[0].PID(1, "echo"), &ping{N: 1}, 10*time.Second)
	if p, ok := got.(*ping); err != nil || !ok || p.N != 2 {
		t.Fatalf("request to rank 1: %v %v", got, err)
	}
	local, err := rts[1].Request(rts[1].PID(1, "echo"), &ping{N: 5}, 10*time.Second)
	if p, ok := local.(*ping); err != nil || !ok || p.N != 6 {
		t.Fatalf("request on rank 1 itself: %v %v", local, err)
	}
}

// A rank lost while the runtime runs closes Lost, and LostErr names the
// first rank lost; a rank leaving while the runtime shuts down does not
// count. (watchPeers calls peerLost with each of the transport's PeerLost
// events.)
func TestLostRank(t *testing.T) {
	rts := startLocal(t, 3)
	rt := rts[0]
	select {
	case <-rt.Lost():
		t.Fatal("Lost closed before any rank was lost")
	default:
	}
	if err := rt.LostErr(); err != nil {
		t.Fatalf("LostErr before any loss: %v", err)
	}
	rt.peerLost(transport.PeerEvent{Rank: 2, Reason: "killed by the test"})
	rt.peerLost(transport.PeerEvent{Rank: 1, Reason: "lost second"})
	select {
	case <-rt.Lost():
	default:
		t.Fatal("Lost still open after rank 2 was lost")
	}
	err := rt.LostErr()
	var pl *transport.PeerLostError
	if !errors.As(err, &pl) || pl.Rank != 2 || !errors.Is(err, transport.ErrPeerLost) ||
		!strings.Contains(err.Error(), "rank 2 lost: killed by the test") {
		t.Fatalf("LostErr = %v, want rank 2's loss", err)
	}

	// Shutdown marks the runtime closed first; ranks leaving the job then
	// look like lost peers.
	rts[1].closed.Store(true)
	rts[1].peerLost(transport.PeerEvent{Rank: 2, Reason: "left at shutdown"})
	if err := rts[1].LostErr(); err != nil {
		t.Fatalf("rank leaving at shutdown: LostErr = %v, want nil", err)
	}
}
