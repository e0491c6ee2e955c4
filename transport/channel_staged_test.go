package transport

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"runtime"
	"sync"
	"testing"
	"time"

	"github.com/troupe-hpc/troupe/gpu"
)

// Tests of staged channel transfers around Close and device faults, from a
// review of 2026-12-07.

// waitCond polls cond (under no lock of the test's) until it holds.
func waitCond(t *testing.T, what string, cond func() bool) {
	t.Helper()
	for deadline := time.Now().Add(5 * time.Second); !cond(); {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
		runtime.Gosched()
	}
}

// TestChannelCloseStagedQueued: two staged transfers posted before
// Channel.Close both complete ("transfers in flight complete"), on either
// end. The second waits for the first's turn and had not taken the
// channel's stream when Close ran: it failed with ErrClosed without moving
// a byte, and the peer's matching transfer never completed. On the
// receiving end the peer's messages have arrived before Close (a receive
// that no message has matched is withdrawn by Close,
// TestChannelCloseWithdrawsRecv): the first receive has matched its
// message and is held up by its stream (a kernel waiting for the test),
// the second's message waits in the overlap engine's table.
func TestChannelCloseStagedQueued(t *testing.T) {
	for _, closeSender := range []bool{false, true} {
		t.Run(fmt.Sprintf("close-sender=%v", closeSender), func(t *testing.T) {
			sys := hostSystem(t)
			ts := channelJob(t, false, !closeSender, ProgressDirect)
			ctx := testCtx(t)
			a, _ := ts[0].Channel(27, 1)
			b, _ := ts[1].Channel(27, 0)
			n := 2 * ChannelChunkSize // 3 chunks (the tail empty)
			closing := b              // the end whose staged transfers are queued
			if closeSender {
				closing = a
			} else {
				defer a.Close()
			}
			if closeSender {
				defer b.Close()
			}
			release := func() {}
			if !closeSender {
				release = holdStream(t, sys, b, false)
			}
			var mine [2]*ChannelRequest
			var dsts [2]gpu.Buffer
			for i := range mine {
				var err error
				if closeSender {
					mine[i], err = a.Send(devBuf(t, sys, n, pattern(n, i)))
				} else {
					dsts[i] = devBuf(t, sys, n, nil)
					mine[i], err = b.Recv(dsts[i])
				}
				if err != nil {
					t.Fatal(err)
				}
				if i > 0 {
					continue
				}
				// The first is running: it has its stream, or has posted
				// its chunk receives.
				if closeSender {
					waitCond(t, "the first staged transfer to start", func() bool {
						closing.mu.Lock()
						defer closing.mu.Unlock()
						return len(closing.streams) > 0
					})
				} else {
					waitCond(t, "the first staged receive to post its chunk receives", func() bool {
						return ts[1].OverlapTable().Posted == 3
					})
				}
			}
			var peer [2]*ChannelRequest
			got := [2][]byte{make([]byte, n), make([]byte, n)}
			if !closeSender {
				for i := range peer {
					var err error
					if peer[i], err = a.SendBytes(pattern(n, i)); err != nil {
						t.Fatal(err)
					}
				}
				// The second message's chunks, which no receive is
				// posted for yet.
				waitUnexpected(ctx, t, ts[1], 3)
			}
			closed := make(chan error, 1)
			go func() { closed <- closing.Close() }()
			waitCond(t, "Close to start", func() bool {
				closing.mu.Lock()
				defer closing.mu.Unlock()
				return closing.closed
			})
			if closeSender {
				for i := range peer {
					var err error
					if peer[i], err = b.RecvBytes(got[i]); err != nil {
						t.Fatal(err)
					}
				}
			} else {
				release()
			}
			wctx, cancel := context.WithTimeout(ctx, 5*time.Second)
			defer cancel()
			for i := range mine {
				merr, perr := mine[i].Wait(wctx), peer[i].Wait(wctx)
				if merr != nil || perr != nil {
					t.Fatalf("transfer %d posted before Channel.Close: closing end %v; peer %v", i, merr, perr)
				}
				if !closeSender && !bytes.Equal(readDev(t, dsts[i]), pattern(n, i)) || closeSender && !bytes.Equal(got[i], pattern(n, i)) {
					t.Fatalf("transfer %d: data differs", i)
				}
			}
			if err := <-closed; err != nil {
				t.Fatal(err)
			}
		})
	}
}

// holdStream puts a stream in c's place for one direction whose work waits
// behind a kernel until the returned function is called (at the end of the
// test at the latest).
func holdStream(t *testing.T, sys *gpu.System, c *Channel, send bool) func() {
	t.Helper()
	dev := sys.Devices()[0]
	st, err := dev.NewStream()
	if err != nil {
		t.Fatal(err)
	}
	gate := make(chan struct{})
	var once sync.Once
	release := func() { once.Do(func() { close(gate) }) }
	t.Cleanup(release)
	scratch := devBuf(t, sys, 16, nil)
	if err := gpu.LaunchHost(st, func([][]byte) error { <-gate; return nil }, scratch); err != nil {
		t.Fatal(err)
	}
	c.mu.Lock()
	if c.streams == nil {
		c.streams = map[streamKey]*gpu.Stream{}
	}
	c.streams[streamKey{dev: dev, send: send}] = st
	c.mu.Unlock()
	return release
}

// TestChannelRefusedSendKeepsCounters: a Send refused with an error (here:
// device memory of a closed System) must not spend a counter, or every later message of the channel goes to
// the wrong receive (the peer's next receive waits for a message that will
// never come).
func TestChannelRefusedSendKeepsCounters(t *testing.T) {
	for _, n := range []int{100, 2 * ChannelChunkSize} {
		t.Run(fmt.Sprint(n), func(t *testing.T) {
			ts := channelJob(t, false, false, ProgressDirect)
			ctx := testCtx(t)
			sys2, err := gpu.OpenBackend(gpu.BackendHost)
			if err != nil {
				t.Fatal(err)
			}
			bad := devBuf(t, sys2, n, nil)
			_ = sys2.Close()
			a, _ := ts[0].Channel(31, 1)
			b, _ := ts[1].Channel(31, 0)
			defer a.Close()
			defer b.Close()
			q, err := a.Send(bad)
			if err == nil {
				err = q.Wait(ctx)
				t.Logf("bad send accepted, completed with %v", err)
			} else {
				t.Logf("bad send refused: %v", err)
			}
			got := make([]byte, 8)
			rr, _ := b.RecvBytes(got)
			sr, _ := a.SendBytes([]byte("12345678"))
			wctx, cancel := context.WithTimeout(ctx, 3*time.Second)
			defer cancel()
			if err := sr.Wait(wctx); err != nil {
				t.Fatalf("next send: %v", err)
			}
			if err := rr.Wait(wctx); err != nil || string(got) != "12345678" {
				t.Fatalf("receive of the next message: %v, got %q", err, got)
			}
		})
	}
}

// faultStream puts a stream with a sticky error (a faulted kernel, as after
// a device fault) in c's place for key.
func faultStream(t *testing.T, sys *gpu.System, c *Channel, send bool) {
	t.Helper()
	dev := sys.Devices()[0]
	st, err := dev.NewStream()
	if err != nil {
		t.Fatal(err)
	}
	scratch := devBuf(t, sys, 16, nil)
	if err := gpu.LaunchHost(st, func([][]byte) error { return errors.New("injected device fault") }, scratch); err != nil {
		t.Fatal(err)
	}
	_ = st.Synchronize()
	c.mu.Lock()
	if c.streams == nil {
		c.streams = map[streamKey]*gpu.Stream{}
	}
	c.streams[streamKey{dev: dev, send: send}] = st
	c.mu.Unlock()
}

// TestChannelStagedStreamFault: a staged transfer that fails on its copy
// stream (a device fault) fails its own request; the other end does not
// wait for ever (a failed send sends its remaining chunks empty; a failed
// receive drains the sender's), and the next transfer over the channel
// works (the failed stream is retired, as the typed path does).
func TestChannelStagedStreamFault(t *testing.T) {
	for _, c := range []struct {
		sendSide bool
		n        int
	}{{true, 2*ChannelChunkSize + 100}, {false, 2*ChannelChunkSize + 100}, {false, 6*ChannelChunkSize + 100}} {
		sendSide, n := c.sendSide, c.n
		t.Run(fmt.Sprintf("fault-on-send=%v/%d", sendSide, n), func(t *testing.T) {
			sys := hostSystem(t)
			ts := channelJob(t, false, false, ProgressDirect)
			ctx := testCtx(t)
			a, _ := ts[0].Channel(32, 1)
			b, _ := ts[1].Channel(32, 0)
			defer a.Close()
			defer b.Close()
			if sendSide {
				faultStream(t, sys, a, true)
			} else {
				faultStream(t, sys, b, false)
			}
			for round := 0; round < 2; round++ {
				var sr, rr *ChannelRequest
				var err error
				got := make([]byte, n)
				dst := devBuf(t, sys, n, nil)
				if sendSide {
					sr, err = a.Send(devBuf(t, sys, n, pattern(n, round)))
					if err == nil {
						rr, err = b.RecvBytes(got)
					}
				} else {
					rr, err = b.Recv(dst)
					if err == nil {
						sr, err = a.SendBytes(pattern(n, round))
					}
				}
				if err != nil {
					t.Fatal(err)
				}
				wctx, cancel := context.WithTimeout(ctx, 4*time.Second)
				serr, rerr := sr.Wait(wctx), rr.Wait(wctx)
				cancel()
				t.Logf("round %d: send %v; recv %v", round, serr, rerr)
				if errors.Is(serr, context.DeadlineExceeded) || errors.Is(rerr, context.DeadlineExceeded) {
					t.Fatalf("round %d: a request never completes: send %v; recv %v", round, serr, rerr)
				}
				if round == 1 && (serr != nil || rerr != nil) {
					t.Fatalf("transfer after the fault: send %v; recv %v", serr, rerr)
				}
			}
		})
	}
}

// Transport.Close with staged and direct transfers in flight on both
// directions: every request completes (with an error), Channel.Close
