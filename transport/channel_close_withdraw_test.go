package transport

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"testing"
	"time"
)

// TestChannelCloseWithdrawsRecv: receives pending on a channel that no
// message has matched are withdrawn by Close, each failing with ErrClosed,
// and the channel reopened with the same id receives the peer's messages.
// Rank 0 posts two receives, closes the channel before rank 1 sends
// anything, reopens the id and posts two receives again; rank 1 (one
// channel, never closed) then sends twice, and the reopened receives get
// the bytes in order. Over UCX (with and without the overlap engine) and on
// the same-process path, for host bytes and device memory (direct,
// small staged and pipelined staged receives), one message and several
// chunks. The old receives used to stay posted and take the messages.
func TestChannelCloseWithdrawsRecv(t *testing.T) {
	sizes := []int{64, 2*ChannelChunkSize + 123}
	for _, v := range channelVariants {
		t.Run(v.name, func(t *testing.T) {
			sys := hostSystem(t)
			ts := channelJob(t, v.local, v.engine, v.progress)
			ctx := testCtx(t)
			id := uint32(40)
			for _, n := range sizes {
				for _, device := range []bool{false, true} {
					id++
					name := fmt.Sprintf("%d B device=%v", n, device)
					recv := func(c *Channel) (*ChannelRequest, func() []byte) {
						t.Helper()
						if device {
							b := devBuf(t, sys, n, nil)
							r, err := c.Recv(b)
							if err != nil {
								t.Fatalf("%s: %v", name, err)
							}
							return r, func() []byte { return readDev(t, b) }
						}
						b := make([]byte, n)
						r, err := c.RecvBytes(b)
						if err != nil {
							t.Fatalf("%s: %v", name, err)
						}
						return r, func() []byte { return b }
					}
					a, err := ts[0].Channel(id, 1)
					if err != nil {
						t.Fatal(err)
					}
					b, err := ts[1].Channel(id, 0)
					if err != nil {
						t.Fatal(err)
					}
					old1, _ := recv(a)
					old2, _ := recv(a)
					if err := a.Close(); err != nil {
						t.Fatalf("%s: close: %v", name, err)
					}
					// The peer has sent nothing: only a withdrawal ends them.
					for i, r := range []*ChannelRequest{old1, old2} {
						wctx, cancel := context.WithTimeout(ctx, 5*time.Second)
						err := r.Wait(wctx)
						cancel()
						if !errors.Is(err, ErrClosed) {
							t.Fatalf("%s: receive %d pending at Close (%s): %v, want ErrClosed", name, i, r.Path(), err)
						}
					}
					a2, err := ts[0].Channel(id, 1)
					if err != nil {
						t.Fatalf("%s: reopen: %v", name, err)
					}
					new1, got1 := recv(a2)
					new2, got2 := recv(a2)
					var sends []*ChannelRequest
					for i := 0; i < 2; i++ {
						s, err := b.SendBytes(pattern(n, i+1))
						if err != nil {
							t.Fatal(err)
						}
						sends = append(sends, s)
					}
					for _, r := range append(sends, new1, new2) {
						if err := r.Wait(ctx); err != nil {
							t.Fatalf("%s: %s after reopening (%s): %v", name, r.op, r.Path(), err)
						}
					}
					for i, got := range []func() []byte{got1, got2} {
						if !bytes.Equal(got(), pattern(n, i+1)) {
							t.Fatalf("%s: reopened channel's receive %d got other bytes than the peer's message %d", name, i, i)
						}
					}
					if err := a2.Close(); err != nil {
						t.Fatal(err)
					}
					if err := b.Close(); err != nil {
						t.Fatal(err)
					}
				}
			}
			checkEngineBooks(t, ts[0])
			checkEngineBooks(t, ts[1])
		})
	}
}

// TestChannelDuplicateLocalEnd: two ranks of one process opening one id
// towards the same peer (ids must be unique in the job) get
// ErrChannelInUse for the second open, on the same-process path, where the
// second end's transfers used to take the first one's place and leave its
// request uncompleted; once the first end is closed the id may be opened
// again.
func TestChannelDuplicateLocalEnd(t *testing.T) {
	ts := localJob(t, 3, ProgressDirect)
	ctx := testCtx(t)
	first, err := ts[0].Channel(12, 1)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := ts[2].Channel(12, 1); !errors.Is(err, ErrChannelInUse) {
		t.Fatalf("rank 2 opening channel 12 towards rank 1, which rank 0 has open towards it: %v, want ErrChannelInUse", err)
	}
	if _, err := ts[1].Channel(12, 1); !errors.Is(err, ErrChannelInUse) {
		t.Fatalf("rank 1 opening channel 12 towards itself, which rank 0 has open towards it: %v, want ErrChannelInUse", err)
	}
	peer, err := ts[1].Channel(12, 0)
	if err != nil {
		t.Fatal(err)
	}
	if err := first.Close(); err != nil {
		t.Fatal(err)
	}
	second, err := ts[2].Channel(12, 1)
	if err != nil {
		t.Fatalf("reopening channel 12 on rank 2 after rank 0 closed its end: %v", err)
	}
	buf := make([]byte, 100)
	rr, _ := peer.RecvBytes(buf)
	sr, err := second.SendBytes(pattern(100, 3))
	if err != nil {
		t.Fatal(err)
	}
	for _, r := range []*ChannelRequest{sr, rr} {
		if err := r.Wait(ctx); err != nil {
			t.Fatal(err)
		}
	}
	if !bytes.Equal(buf, pattern(100, 3)) {
		t.Fatal("data differs")
	}
	_ = second.Close()
	_ = peer.Close()

	// A send of a closed end still waits for its receive: the reopened
	// end's send of the same message is refused instead of displacing it.
	old, _ := ts[0].Channel(13, 1)
	pending, err := old.SendBytes(pattern(100, 4))
	if err != nil {
		t.Fatal(err)
	}
	_ = old.Close()
	again, err := ts[0].Channel(13, 1)
	if err != nil {
		t.Fatal(err)
	}
	refused, err := again.SendBytes(pattern(100, 5))
	if err == nil {
		err = refused.Wait(ctx)
	}
	if !errors.Is(err, ErrChannelInUse) {
		t.Fatalf("send of message 0 while a closed end's message 0 waits: %v, want ErrChannelInUse", err)
	}
	end, _ := ts[1].Channel(13, 0)
	rr, _ = end.RecvBytes(buf)
	for _, r := range []*ChannelRequest{pending, rr} {
		if err := r.Wait(ctx); err != nil {
			t.Fatal(err)
		}
	}
	if !bytes.Equal(buf, pattern(100, 4)) {
		t.Fatal("the closed end's message did not arrive")
	}
	_ = again.Close()
	_ = end.Close()
}
