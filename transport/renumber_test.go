package transport

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"testing"
)

// MPI matches a (source, tag)'s messages to its receives in the order the
// receives were posted, passing over cancelled ones: the message a
// cancelled receive was owed goes to the earliest receive still pending.
// Posted receives are cancelled in various orders before any message is
// sent; every remaining receive, and then fresh ones, must get the
// messages in order, for small (eager) and large (rendezvous or CMA)
// messages, with the overlap engine off and on, in both progress modes.
func TestCancelledReceiveOwedMessageGoesToEarliestPending(t *testing.T) {
	cases := []struct {
		posted int
		cancel []int // indices of the posted receives, in cancel order
	}{
		{3, []int{0}},
		{3, []int{1}},
		{4, []int{0, 2}},
		{4, []int{2, 0}},
		{4, []int{3, 1}},
		{3, []int{0, 1, 2}},
	}
	for _, mode := range []ProgressMode{ProgressDirect, ProgressQueue} {
		for _, engine := range []string{"off", "on"} {
			for _, size := range []int{8, 1 << 20} {
				t.Run(fmt.Sprintf("%s/engine-%s/%dB", mode, engine, size), func(t *testing.T) {
					t.Setenv(OverlapEnv, engine)
					ts := localJob(t, 2, mode)
					for i, c := range cases {
						cancelledThenReceived(t, ts, 20+i, size, c.posted, c.cancel)
					}
				})
			}
		}
	}
}

func cancelledThenReceived(t *testing.T, ts []*Transport, tag, size, posted int, cancel []int) {
	t.Helper()
	ctx := testCtx(t)
	type recv struct {
		r   *Request
		buf []byte
	}
	rs := make([]recv, posted)
	for i := range rs {
		rs[i].buf = make([]byte, size)
		r, err := ts[1].Irecv(0, tag, rs[i].buf)
		if err != nil {
			t.Fatal(err)
		}
		rs[i].r = r
	}
	gone := map[int]bool{}
	done, stop := context.WithCancel(ctx)
	stop()
	for _, i := range cancel {
		if _, err := rs[i].r.Wait(done); !errors.Is(err, context.Canceled) {
			t.Fatalf("tag %d: cancelled receive %d: %v", tag, i, err)
		}
		gone[i] = true
	}
	var sends []*Request
	msgs := make([][]byte, posted)
	for m := range msgs {
		msgs[m] = pattern(size, tag*16+m)
		s, err := ts[0].Isend(1, tag, msgs[m])
		if err != nil {
			t.Fatal(err)
		}
		sends = append(sends, s)
	}
	next := 0
	for i, rc := range rs {
		if gone[i] {
			continue
		}
		st, err := rc.r.Wait(ctx)
		if err != nil || st.Size != size || !bytes.Equal(rc.buf, msgs[next]) {
			t.Fatalf("tag %d, receives %d cancelled %v: receive %d got %d B (%v), want message %d", tag, posted, cancel, i, st.Size, err, next)
		}
		next++
	}
	buf := make([]byte, size)
	for ; next < posted; next++ {
		st, err := ts[1].Recv(ctx, 0, tag, buf)
		if err != nil || st.Size != size || !bytes.Equal(buf, msgs[next]) {
			t.Fatalf("tag %d, receives %d cancelled %v: a receive posted afterwards did not get message %d (%d B, %v)", tag, posted, cancel, next, st.Size, err)
		}
	}
	for _, s := range sends {
		if _, err := s.Wait(ctx); err != nil {
			t.Fatal(err)
		}
	}
}

// An any-source receive posted after two exact ones goes to UCX with the
// source masked; when the first exact receive is cancelled, the second
// must get the first message and the any-source receive the second, as
// MPI has it. (Renumbering re-posts the exact receive, which would then
// queue behind the masked one in UCX, unless that is re-posted too.)
func TestCancelledReceiveBeforeMaskedAnySource(t *testing.T) {
	for _, mode := range []ProgressMode{ProgressDirect, ProgressQueue} {
		for _, size := range []int{8, 1 << 20} {
			t.Run(fmt.Sprintf("%s/%dB", mode, size), func(t *testing.T) {
				ts := localJob(t, 2, mode)
				ctx := testCtx(t)
				const tag = 5
				bufs := [][]byte{make([]byte, size), make([]byte, size), make([]byte, size)}
				var rs []*Request
				for i, src := range []int{0, 0, AnySource} {
					r, err := ts[1].Irecv(src, tag, bufs[i])
					if err != nil {
						t.Fatal(err)
					}
					rs = append(rs, r)
				}
				tr := ts[1]
				tr.mu.Lock()
				tr.runSubmitted() // queue mode: the receives' starts
				q := tr.wild.held[tag]
				masked := len(q) == 1 && q[0] == rs[2] && q[0].anyPosted
				tr.mu.Unlock()
				if !masked {
					t.Fatal("the any-source receive is not in UCX with the source masked")
				}
				done, stop := context.WithCancel(ctx)
				stop()
				if _, err := rs[0].Wait(done); !errors.Is(err, context.Canceled) {
					t.Fatalf("cancelled receive: %v", err)
				}
				msgs := [][]byte{pattern(size, 1), pattern(size, 2)}
				for _, m := range msgs {
					if _, err := ts[0].Isend(1, tag, m); err != nil {
						t.Fatal(err)
					}
				}
				for i, want := range msgs {
					st, err := rs[i+1].Wait(ctx)
					if err != nil || st.Source != 0 || !bytes.Equal(bufs[i+1], want) {
						t.Fatalf("receive %d (posted %s): %+v %v, want message %d", i+1, []string{"second", "third, any-source"}[i], st, err, i)
					}
				}
			})
		}
	}
}

// Receives whose context has ended race with their messages' arrival:
// each either completes with its message or is cancelled having taken
// none, so every message is received once, in order. In queue mode the
// cancellation runs on the progress goroutine; Recv's pooled request must
// not be recycled (and reused) before it is over (run with -race).
func TestRecvCancelRacesArrival(t *testing.T) {
	for _, mode := range []ProgressMode{ProgressDirect, ProgressQueue} {
		t.Run(mode.String(), func(t *testing.T) {
			ts := localJob(t, 2, mode)
			ctx := testCtx(t)
			ended, stop := context.WithCancel(ctx)
			stop()
			const n, tag = 300, 9
			go func() {
				for i := range n {
					if err := ts[0].Send(ctx, 1, tag, []byte{byte(i), byte(i >> 8)}); err != nil {
						t.Error(err)
						return
					}
				}
			}()
			buf := make([]byte, 2)
			next := 0
			check := func(st Status) {
				if got := int(buf[0]) | int(buf[1])<<8; st.Size != 2 || got != next {
					t.Fatalf("received message %d (%d B), want %d", got, st.Size, next)
				}
				next++
			}
			for range n {
				st, err := ts[1].Recv(ended, 0, tag, buf)
				switch {
				case err == nil:
					check(st)
				case !errors.Is(err, context.Canceled):
					t.Fatal(err)
				}
			}
			for next < n {
				st, err := ts[1].Recv(ctx, 0, tag, buf)
				if err != nil {
					t.Fatal(err)
				}
				check(st)
			}
		})
	}
}
