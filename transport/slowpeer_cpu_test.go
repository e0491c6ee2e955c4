package transport

import (
	"context"
	"fmt"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// cpuTime is the CPU time (user and system) the process has used so far.
func cpuTime(t *testing.T) time.Duration {
	t.Helper()
	var ru unix.Rusage
	if err := unix.Getrusage(unix.RUSAGE_SELF, &ru); err != nil {
		t.Fatal(err)
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

// A rank with thousands of posted messages queued in UCX for a peer that
// does not take them (its progress goroutine is held in a handler) paces
// its polls instead of spinning, in both progress modes, with a waiter
// parked in Recv or with the caller blocked outside the transport: over
// the second until another rank's message ends the wait, the process uses
// well under half a core (before 2026-11-25 a parked waiter, or queue
// mode, made it spin a whole core; found by review). The interval is
// ended by a message from rank 1, sent a second after the wait begins.
func TestSlowPeerPacing(t *testing.T) {
	for _, mode := range []ProgressMode{ProgressDirect, ProgressQueue} {
		for _, block := range []string{"recv", "chan"} {
			t.Run(fmt.Sprintf("%v/%s", mode, block), func(t *testing.T) {
				ts := localJob(t, 3, mode)
				ctx := testCtx(t)
				release := make(chan struct{})
				entered := make(chan struct{}, 1)
				if err := ts[2].SetAMHandler(20, func(m *AMMessage) {
					select {
					case entered <- struct{}{}:
						<-release // rank 2's progress goroutine stops here
					default:
					}
				}); err != nil {
					t.Fatal(err)
				}
				woke := make(chan struct{}, 1)
				if err := ts[0].SetAMHandler(21, func(m *AMMessage) { woke <- struct{}{} }); err != nil {
					t.Fatal(err)
				}
				defer close(release)
				if err := ts[1].Send(ctx, 0, 1, []byte("hi")); err != nil { // rank 1 -> 0 connected
					t.Fatal(err)
				}
				if _, err := ts[0].Recv(ctx, 1, 1, make([]byte, 2)); err != nil {
					t.Fatal(err)
				}
				if err := ts[0].PostAM(2, 20, nil, make([]byte, 100)); err != nil {
					t.Fatal(err)
				}
				<-entered
				for range 20000 {
					if err := ts[0].PostAM(2, 20, nil, make([]byte, 4000)); err != nil {
						t.Fatal(err)
					}
				}
				if mode == ProgressDirect && ts[0].postsQueued.Load() == 0 {
					t.Fatal("no post was queued by UCX: the peer is not slow")
				}
				end := time.AfterFunc(time.Second, func() {
					if block == "recv" {
						_ = ts[1].Send(context.Background(), 0, 2, []byte("wake"))
					} else {
						_ = ts[1].PostAM(0, 21, nil, nil)
					}
				})
				defer end.Stop()
				c0, w0 := cpuTime(t), time.Now()
				if block == "recv" {
					if _, err := ts[0].Recv(ctx, 1, 2, make([]byte, 4)); err != nil {
						t.Fatal(err)
					}
				} else {
					select {
					case <-woke:
					case <-ctx.Done():
						t.Fatal("rank 1's message never reached rank 0's handler")
					}
				}
				used, wall := cpuTime(t)-c0, time.Since(w0)
				t.Logf("CPU %v over %v blocked (%.0f%% of a core); posts in flight %d, in bundles %d", used, wall, 100*float64(used)/float64(wall), ts[0].postsInFlight.Load(), ts[0].bundlesPending.Load())
				if mode == ProgressDirect && !ts[0].slowPeer() {
					t.Fatal("the posts for the slow peer left: nothing was measured")
				}
				if ts[0].paceNaps.Load() == 0 {
					t.Error("rank 0 never paced")
				}
				if used > wall/2 {
					t.Errorf("rank 0, blocked while its posts wait for a slow peer, used %v CPU in %v", used, wall)
				}
			})
		}
	}
}

// Ordinary traffic is never paced: round trips of blocking Send/Recv
// (8 B, and 4 MiB whose sends wait for the receiver) and of active messages answered by a handler, with the requester parked in
// Await, each after a quiet gap in which the progress goroutines go idle
// (ucp_worker_arm reports busy then too), take no pacing nap (found by
// review, 2026-11-25: a first version paced whenever Arm reported busy
// twice, 2,000-5,600 naps in 300 such round trips, and the first message
// after a gap waited for one; a second paced whenever a send request was
// pending, and 4 MiB round trips took up to twice as long).
func TestQuietTrafficNotPaced(t *testing.T) {
	const iters = 40
	for _, mode := range []ProgressMode{ProgressDirect, ProgressQueue} {
		for _, kind := range []string{"recv", "large", "am"} {
			t.Run(fmt.Sprintf("%v/%s", mode, kind), func(t *testing.T) {
				ts := localJob(t, 2, mode)
				ctx := testCtx(t)
				size := 8
				if kind == "large" {
					size = 4 << 20 // rendezvous or CMA: the send waits for the receiver
				}
				buf := make([]byte, size)
				replies := make(chan chan struct{}, 1)
				if kind != "am" {
					go func() {
						b := make([]byte, size)
						for range iters {
							if _, err := ts[1].Recv(ctx, 0, 1, b); err != nil {
								return
							}
							if err := ts[1].Send(ctx, 0, 2, b); err != nil {
								return
							}
						}
					}()
				} else {
					if err := ts[1].SetAMHandler(40, func(m *AMMessage) { _ = ts[1].PostAM(0, 41, nil, buf) }); err != nil {
						t.Fatal(err)
					}
					if err := ts[0].SetAMHandler(41, func(m *AMMessage) { close(<-replies) }); err != nil {
						t.Fatal(err)
					}
				}
				for range iters {
					time.Sleep(2 * time.Millisecond) // the quiet gap (the scenario), not synchronisation
					if kind != "am" {
						if err := ts[0].Send(ctx, 1, 1, buf); err != nil {
							t.Fatal(err)
						}
						if _, err := ts[0].Recv(ctx, 1, 2, buf); err != nil {
							t.Fatal(err)
						}
						continue
					}
					done := make(chan struct{})
					replies <- done
					if err := ts[0].PostAM(1, 40, nil, buf); err != nil {
						t.Fatal(err)
					}
					if err := ts[0].Await(ctx, done); err != nil {
						t.Fatal(err)
					}
				}
				if n := ts[0].paceNaps.Load() + ts[1].paceNaps.Load(); n != 0 {
					t.Fatalf("%d pacing naps in %d quiet round trips with no slow peer", n, iters)
				}
			})
		}
	}
}
