package transport

import (
	"bytes"
	"context"
	"errors"
	"testing"
	"time"
)

// cmaClosedSend sends n bytes from buf by CMA from ts[0] to ts[1] under
// tag 5, waits until ts[1] holds the descriptor (arrived(ts[1]) reports
// true), closes ts[0], checks that the send failed with ErrClosed and
// overwrites buf, as the application may once its send failed. It returns
// the send's error.
func cmaClosedSend(t *testing.T, ts []*Transport, buf []byte, arrived func() bool) error {
	t.Helper()
	ctx := testCtx(t)
	// A first message connects rank 1 to rank 0 (and back).
	if err := ts[1].Send(ctx, 0, 9, []byte("hi")); err != nil {
		t.Fatal(err)
	}
	if _, err := ts[0].Recv(ctx, 1, 9, make([]byte, 2)); err != nil {
		t.Fatal(err)
	}
	s, err := ts[0].Isend(1, 5, buf)
	if err != nil {
		t.Fatal(err)
	}
	for !arrived() {
		if ctx.Err() != nil {
			t.Fatal("descriptor never arrived")
		}
	}
	if err := ts[0].Close(); err != nil {
		t.Fatal(err)
	}
	_, serr := s.Wait(ctx)
	if !errors.Is(serr, ErrClosed) {
		t.Fatalf("send after Close: %v, want ErrClosed", serr)
	}
	for i := range buf {
		buf[i] = 0xEE
	}
	return serr
}

// A CMA send failed by Close hands its buffer back to the application,
// while its descriptor, taken out of UCX by Iprobe, waits at the receiver.
// A later receive must not read what the application wrote since as if it
// were the message: it fails with ErrWithdrawn (it completed with the
// overwritten bytes before the descriptor named a validity word).
func TestCMASendClosedThenReceived(t *testing.T) {
	forModes(t, func(t *testing.T, mode ProgressMode) {
		ts := cmaJob2(t, mode)
		ctx := testCtx(t)
		const n = 256 << 10
		want := pattern(n, 1)
		serr := cmaClosedSend(t, ts, bytes.Clone(want), func() bool {
			st, ok, err := ts[1].Iprobe(0, 5)
			if err != nil {
				t.Fatal(err)
			}
			if ok && st.Size != n {
				t.Fatalf("probe: %+v", st)
			}
			return ok
		})
		recvWithdrawn(ctx, t, ts[1], want, serr)
	})
}

// The same with the descriptor still in UCX's unexpected queue when the
// sender closes (no probe took it out).
func TestCMASendClosedInUCXQueueThenReceived(t *testing.T) {
	forModes(t, func(t *testing.T, mode ProgressMode) {
		ts := cmaJob2(t, mode)
		ctx := testCtx(t)
		const n = 256 << 10
		want := pattern(n, 2)
		wire := MakeUserTag(0, 5, 0)
		serr := cmaClosedSend(t, ts, bytes.Clone(want), func() bool {
			// Progress rank 1 without touching tag 5, then look into UCX's
			// queue without taking the descriptor out.
			if _, _, err := ts[1].Iprobe(0, 77); err != nil {
				t.Fatal(err)
			}
			ts[1].mu.Lock()
			defer ts[1].mu.Unlock()
			_, info, ok := ts[1].w.TagProbe(wire, ts[1].userMask(), false)
			return ok && info.Tag&cmaBit != 0
		})
		recvWithdrawn(ctx, t, ts[1], want, serr)
	})
}

// The sender closes while the receiver may be reading its message, then
// overwrites the buffer its failed send gave back. Whatever the timing, the
// receive gets the message whole or fails; it never succeeds with bytes the
// sender wrote after its send failed.
func TestCMASendClosedWhileRead(t *testing.T) {
	forModes(t, func(t *testing.T, mode ProgressMode) {
		const n, rounds = 16 << 20, 16
		want := pattern(n, 3)
		buf := make([]byte, n)
		got := make([]byte, n)
		var whole, withdrawn, other int
		for i := 0; i < rounds; i++ {
			ts := cmaJob2(t, mode)
			ctx := testCtx(t)
			copy(buf, want)
			clear(got)
			rr, err := ts[1].Irecv(0, 5, got)
			if err != nil {
				t.Fatal(err)
			}
			var st Status
			var rerr error
			done := make(chan struct{})
			go func() { // progresses rank 1, which reads
				defer close(done)
				st, rerr = rr.Wait(ctx)
			}()
			s, err := ts[0].Isend(1, 5, buf)
			if err != nil {
				t.Fatal(err)
			}
			for ts[0].CMAStats().Sent == 0 { // the descriptor left
				if mode == ProgressDirect {
					ts[0].progressOnce()
				}
			}
			// Close at a different point of the read each round (16 MiB
			// take a few milliseconds).
			deadline := time.Now().Add(time.Duration(i) * 250 * time.Microsecond)
			for time.Now().Before(deadline) {
			}
			if err := ts[0].Close(); err != nil {
				t.Fatal(err)
			}
			_, serr := s.Wait(ctx)
			for j := range buf {
				buf[j] = 0xEE
			}
			<-done
			switch {
			case rerr == nil && !bytes.Equal(got, want):
				t.Fatalf("round %d: send %v, receive succeeded (%+v) with bytes the sender wrote after its send completed", i, serr, st)
			case rerr == nil:
				whole++
			case errors.Is(rerr, ErrWithdrawn):
				withdrawn++
			default:
				other++
				t.Logf("round %d: send %v, receive %v", i, serr, rerr)
			}
		}
		t.Logf("%d rounds: %d received whole, %d withdrawn, %d failed otherwise", rounds, whole, withdrawn, other)
	})
}

// The same for an active message sent by CMA: the handler keeps it, the
// sender closes and overwrites the data its failed send gave back, and
// RecvData then fails with ErrWithdrawn.
func TestCMAActiveMessageClosedThenReceived(t *testing.T) {
	forModes(t, func(t *testing.T, mode ProgressMode) {
		ts := cmaJob2(t, mode)
		ctx := testCtx(t)
		const n = 200 << 10
		kept := make(chan *AMMessage, 1)
		if err := ts[1].SetAMHandler(9, func(m *AMMessage) {
			m.Keep()
			kept <- m
		}); err != nil {
			t.Fatal(err)
		}
		want := pattern(n, 4)
		buf := bytes.Clone(want)
		s, err := ts[0].SendAM(1, 9, []byte("keep"), buf, AMAuto)
		if err != nil {
			t.Fatal(err)
		}
		var m *AMMessage
		select {
		case m = <-kept:
		case <-ctx.Done():
			t.Fatal(ctx.Err())
		}
		if err := ts[0].Close(); err != nil {
			t.Fatal(err)
		}
		if _, err := s.Wait(ctx); !errors.Is(err, ErrClosed) {
			t.Fatalf("send after Close: %v, want ErrClosed", err)
		}
		for i := range buf {
			buf[i] = 0xEE
		}
		got := make([]byte, n)
		r, err := m.RecvData(got)
		if err != nil {
			t.Fatal(err)
		}
		_, rerr := r.Wait(ctx)
		if rerr == nil && !bytes.Equal(got, want) {
			t.Fatal("send failed, yet RecvData succeeded with the bytes the sender wrote after its send failed")
		}
		if !errors.Is(rerr, ErrWithdrawn) {
			t.Fatalf("RecvData of a withdrawn message: %v, want ErrWithdrawn", rerr)
		}
	})
}

// recvWithdrawn receives rank 0's message with tag 5 on tr, whose send
// failed with serr after its descriptor reached tr: the receive must fail
// with ErrWithdrawn, and above all not succeed with other bytes than want.
func recvWithdrawn(ctx context.Context, t *testing.T, tr *Transport, want []byte, serr error) {
	t.Helper()
	got := make([]byte, len(want))
	st, rerr := tr.Recv(ctx, 0, 5, got)
	if rerr == nil && !bytes.Equal(got, want) {
		t.Fatalf("send failed with %q, yet the receive succeeded (%+v) with the bytes the sender wrote after its send failed (got[0]=%#x, want %#x)", serr, st, got[0], want[0])
	}
	if !errors.Is(rerr, ErrWithdrawn) {
		t.Fatalf("receive of a withdrawn message: %+v %v, want ErrWithdrawn", st, rerr)
	}
}
