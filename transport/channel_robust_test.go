package transport

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/troupe-hpc/troupe/gpu"
)

// Each rank posts, on 40 channels, a staged receive and a staged send of 4
// chunks (non-blocking, then waits for all). Every transfer has a matching
// one at the peer, so all must complete. Each rank has its own gpu.System
// (as separate processes would), whose staging pool has 128 slots: the
// receives took them all on both ranks, and every transfer waited for a
// slot or for its peer's transfer, for ever.
func TestChannelStagedPoolNeverDeadlocks(t *testing.T) {
	sys := [2]*gpu.System{hostSystem(t), hostSystem(t)}
	ts := channelJob(t, false, false, ProgressDirect)
	const nch = 40
	n := 3 * ChannelChunkSize // 3 full chunks + empty tail: 4 chunks, 4 slots each
	var reqs []*ChannelRequest
	chs := [2][]*Channel{}
	for r := 0; r < 2; r++ {
		for i := 0; i < nch; i++ {
			c, err := ts[r].Channel(uint32(100+i), 1-r)
			if err != nil {
				t.Fatal(err)
			}
			chs[r] = append(chs[r], c)
		}
	}
	for r := 0; r < 2; r++ {
		for i := 0; i < nch; i++ {
			rr, err := chs[r][i].Recv(devBuf(t, sys[r], n, nil))
			if err != nil {
				t.Fatal(err)
			}
			reqs = append(reqs, rr)
		}
	}
	for r := 0; r < 2; r++ {
		for i := 0; i < nch; i++ {
			sr, err := chs[r][i].Send(devBuf(t, sys[r], n, pattern(n, i)))
			if err != nil {
				t.Fatal(err)
			}
			reqs = append(reqs, sr)
		}
	}
	ctx, cancel := context.WithTimeout(context.Background(), 15*time.Second)
	defer cancel()
	done := 0
	for _, q := range reqs {
		if err := q.Wait(ctx); err != nil {
			t.Fatalf("%d of %d requests completed; channel %d %s: %v", done, len(reqs), q.c.id, q.op, err)
		}
		done++
	}
}

// A receive pending on a channel when its own transport closes fails with
// ErrClosed, over UCX and on the same-process path (where it used to wait
// for ever), and a transfer posted afterwards fails at once.
func TestChannelOwnTransportClosed(t *testing.T) {
	forChannelPaths(t, func(t *testing.T, local bool) {
		ts := channelJob(t, local, false, ProgressDirect)
		b, rr := recvThenClose(t, ts, 1)
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		if err := rr.Wait(ctx); !errors.Is(err, ErrClosed) {
			t.Fatalf("path %s: receive pending when its transport closed: %v, want ErrClosed", rr.Path(), err)
		}
		if !local {
			return
		}
		late, err := b.RecvBytes(make([]byte, 64))
		if err == nil {
			err = late.Wait(ctx)
		}
		if !errors.Is(err, ErrClosed) {
			t.Fatalf("receive posted after Close: %v, want ErrClosed", err)
		}
	})
}

// A send on a channel whose peer's transport has closed (the peer is gone)
// fails: over UCX as the connection fails, on the same-process path with a
// *PeerLostError (it used to wait for ever).
func TestChannelPeerTransportClosed(t *testing.T) {
	forChannelPaths(t, func(t *testing.T, local bool) {
		ts := channelJob(t, local, false, ProgressDirect)
		a, rr := recvThenClose(t, ts, 0) // rr pending when the peer closes
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		sr, err := a.SendBytes(pattern(1<<20, 1))
		if err == nil {
			err = sr.Wait(ctx)
		}
		var lost *PeerLostError
		switch {
		case err == nil:
			t.Fatal("send to a closed peer succeeded")
		case local && !errors.As(err, &lost):
			t.Fatalf("same-process send to a closed peer: %v, want a *PeerLostError", err)
		}
		if !local {
			return // UCX notices the peer's loss when it next talks to it
		}
		if err := rr.Wait(ctx); !errors.As(err, &lost) {
			t.Fatalf("same-process receive pending when the peer closed: %v, want a *PeerLostError", err)
		}
	})
}

// forChannelPaths runs f over UCX between the ranks of one process and on
// the same-process path.
func forChannelPaths(t *testing.T, f func(t *testing.T, local bool)) {
	for _, local := range []bool{false, true} {
		name := "ucx"
		if local {
			name = "local"
		}
		t.Run(name, func(t *testing.T) { f(t, local) })
	}
}

// recvThenClose opens channel 7 on rank me of a two-rank job, posts a
// 64-byte receive on it, and closes rank 1's transport.
func recvThenClose(t *testing.T, ts []*Transport, me int) (*Channel, *ChannelRequest) {
	t.Helper()
	c, err := ts[me].Channel(7, 1-me)
	if err != nil {
		t.Fatal(err)
	}
	rr, err := c.RecvBytes(make([]byte, 64))
	if err != nil {
		t.Fatal(err)
	}
	if err := ts[1].Close(); err != nil {
		t.Fatal(err)
	}
	return c, rr
}

// A staged receive of more chunks than it has staging slots (9 chunks, 4
// slots) whose sender sent a shorter message fails with a
// *SizeMismatchError; withdrawing its chunk receives used to dereference
// the ones not yet posted and crash the process.
func TestChannelStagedRecvMismatchManyChunks(t *testing.T) {
	sys := hostSystem(t)
	ts := channelJob(t, false, false, ProgressDirect)
	ctx := testCtx(t)
	a, _ := ts[0].Channel(9, 1)
	b, _ := ts[1].Channel(9, 0)
	rr, err := b.Recv(devBuf(t, sys, 8*ChannelChunkSize+100, nil))
	if err != nil {
		t.Fatal(err)
	}
	sr, err := a.SendBytes(pattern(ChannelChunkSize+100, 1))
	if err != nil {
		t.Fatal(err)
	}
	if err := rr.Wait(ctx); !errors.Is(err, ErrSizeMismatch) {
		t.Fatalf("recv: %v, want ErrSizeMismatch", err)
	}
	if err := sr.Wait(ctx); err != nil {
		t.Fatalf("send: %v", err)
	}
}
