package actor

import (
	"errors"
	"fmt"
	"testing"
	"time"

	pa "github.com/asynkron/protoactor-go/actor"

	"github.com/troupe-hpc/troupe/gpu"
)

// lateResponder answers a ping, once released, with a halo whose face is
// face: a device message answering a request.
type lateResponder struct {
	face    gpu.Buffer
	release chan struct{}
}

func (l *lateResponder) Receive(c pa.Context) {
	if p, ok := c.Message().(*ping); ok {
		<-l.release
		c.Respond(&halo{Iter: p.N, Face: l.face})
	}
}

// spawnLateResponder spawns on rt, as name, a lateResponder answering with
// a device buffer of n bytes (face, for the test to free).
func spawnLateResponder(t *testing.T, dev *gpu.Device, rt *Runtime, name string, n int) (*lateResponder, gpu.Buffer) {
	t.Helper()
	face, err := dev.Alloc(n)
	if err != nil {
		t.Fatal(err)
	}
	l := &lateResponder{face: face, release: make(chan struct{})}
	if _, err := rt.Root().SpawnNamed(rt.Props(func() pa.Actor { return l }), name); err != nil {
		t.Fatal(err)
	}
	return l, face
}

// TestLateDeviceReplyFreed: a device message answering a request across
// ranks (Runtime.Request, Runtime.RequestFuture) that comes after the
// request timed out reaches no one: the device memory the runtime
// allocated for it is freed, and it is a dead letter.
func TestLateDeviceReplyFreed(t *testing.T) {
	dev := hostDevice(t)
	rts := startLocalWith(t, 2, Options{Device: dev})
	for _, n := range []int{100, 256 << 10} { // in the message; pair channel
		for _, future := range []bool{false, true} {
			name := fmt.Sprintf("late-%d-%v", n, future)
			l, face := spawnLateResponder(t, dev, rts[1], name, n)
			to := rts[0].PID(1, name)
			base := dev.LiveAllocs()
			dead := rts[0].Stats().DeadLetters.Load()
			if future {
				f, err := rts[0].RequestFuture(to, &ping{N: n}, 50*time.Millisecond)
				if err != nil {
					t.Fatal(err)
				}
				if _, err := Result(f); !errors.Is(err, pa.ErrTimeout) {
					t.Fatalf("%s: request answered with %v before the release, want a timeout", name, err)
				}
			} else if _, err := rts[0].Request(to, &ping{N: n}, 50*time.Millisecond); !errors.Is(err, pa.ErrTimeout) {
				t.Fatalf("%s: request answered with %v before the release, want a timeout", name, err)
			}
			close(l.release)
			waitFor(t, func() bool { return rts[0].Stats().DeadLetters.Load() == dead+1 })
			if got := dev.LiveAllocs(); got != base {
				t.Fatalf("%s: %d live device allocations after the late answer, want %d (its runtime-allocated device buffer is still held)", name, got, base)
			}
			if err := gpu.Free(face); err != nil {
				t.Fatal(err)
			}
		}
	}
}

// TestDeviceReplyAtTimeoutNotLost: a device message answering a request
// across ranks, taken for the request at the instant it timed out (the
// Request's reply taken from the request table before the Request
// withdrew; the future found before it timed out, handed the answer after),
// was held for ever: Request returned the timeout with the answer, and
// its runtime-allocated device memory, in its waiter; the future kept it
// as the result of a timed-out future. Request now returns that answer
// (the caller owns it), and the runtime frees the memory of an answer a
// future did not take (a dead letter).
func TestDeviceReplyAtTimeoutNotLost(t *testing.T) {
	dev := hostDevice(t)
	rts := startLocalWith(t, 2, Options{Device: dev})
	// The answer to a future is held until the test has seen the future
	// time out.
	timedOut := make(chan chan struct{}, 1)
	held := func(target *pa.PID) {
		select {
		case c := <-timedOut:
			<-c
		case <-time.After(10 * time.Second):
			t.Errorf("answer to %s held with no future to wait for", target)
		}
	}
	rts[0].answerHeld.Store(&held)
	for _, n := range []int{100, 256 << 10} { // in the message; pair channel
		for _, future := range []bool{false, true} {
			name := fmt.Sprintf("atdeadline-%d-%v", n, future)
			l, face := spawnLateResponder(t, dev, rts[1], name, n)
			to := rts[0].PID(1, name)
			base := dev.LiveAllocs()
			dead := rts[0].Stats().DeadLetters.Load()
			if future {
				c := make(chan struct{})
				timedOut <- c
				f, err := rts[0].RequestFuture(to, &ping{N: n}, time.Second)
				if err != nil {
					t.Fatal(err)
				}
				close(l.release) // the answer is held until the future timed out
				_, err = Result(f)
				close(c)
				if !errors.Is(err, pa.ErrTimeout) {
					t.Fatalf("%s: future settled with %v, want a timeout", name, err)
				}
				waitFor(t, func() bool { return rts[0].Stats().DeadLetters.Load() == dead+1 })
			} else {
				rts[0].requestTimedOut = func(rp *replyProcess) {
					// The answer comes and is taken for the request
					// before the request withdraws.
					close(l.release)
					select {
					case <-rp.done:
					case <-time.After(10 * time.Second):
						t.Errorf("%s: no answer after the release", name)
					}
				}
				res, err := rts[0].Request(to, &ping{N: n}, 50*time.Millisecond)
				rts[0].requestTimedOut = nil
				h, ok := res.(*halo)
				if err != nil || !ok {
					t.Fatalf("%s: request taken its answer at the deadline returned %v, %v; want the answer", name, res, err)
				}
				if h.Face.Len() != n {
					t.Fatalf("%s: answer's face has %d bytes, want %d", name, h.Face.Len(), n)
				}
				if err := gpu.Free(h.Face); err != nil { // the caller's
					t.Fatal(err)
				}
			}
			if got := dev.LiveAllocs(); got != base {
				t.Fatalf("%s: %d live device allocations after the answer, want %d (its runtime-allocated device buffer is still held)", name, got, base)
			}
			if err := gpu.Free(face); err != nil {
				t.Fatal(err)
			}
		}
	}
}
