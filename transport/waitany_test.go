package transport

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"runtime"
	"slices"
	"strings"
	"testing"
	"time"
)

// recvTags posts n receives of size bytes from rank 0 on tr, with tags
// tag0, tag0+1, ...
func recvTags(t *testing.T, tr *Transport, tag0, n, size int) ([]*Request, [][]byte) {
	t.Helper()
	reqs := make([]*Request, n)
	bufs := make([][]byte, n)
	for i := range reqs {
		bufs[i] = make([]byte, size)
		var err error
		if reqs[i], err = tr.Irecv(0, tag0+i, bufs[i]); err != nil {
			t.Fatal(err)
		}
	}
	return reqs, bufs
}

// WaitAny returns the receive whose message came, whichever was posted
// first; with that one set to nil, the next; with none left, -1.
// WaitAll then collects the rest in order.
func TestWaitAnyAndAll(t *testing.T) {
	forModes(t, func(t *testing.T, mode ProgressMode) {
		ts := localJob(t, 2, mode)
		ctx := testCtx(t)
		reqs, bufs := recvTags(t, ts[1], 20, 4, 1)
		for _, tag := range []int{22, 20} {
			if err := ts[0].Send(ctx, 1, tag, []byte{byte(tag)}); err != nil {
				t.Fatal(err)
			}
			i, st, err := WaitAny(ctx, reqs)
			if err != nil || i != tag-20 || st.Tag != tag || bufs[i][0] != byte(tag) {
				t.Fatalf("WaitAny after a send with tag %d: index %d %+v %v, want index %d", tag, i, st, err, tag-20)
			}
			reqs[i] = nil
		}
		for _, tag := range []int{21, 23} {
			if err := ts[0].Send(ctx, 1, tag, []byte{byte(tag)}); err != nil {
				t.Fatal(err)
			}
		}
		sts, err := WaitAll(ctx, reqs)
		if err != nil || sts[1].Tag != 21 || sts[3].Tag != 23 || sts[0] != (Status{}) || bufs[1][0] != 21 || bufs[3][0] != 23 {
			t.Fatalf("WaitAll: %+v %v", sts, err)
		}
		if i, _, err := WaitAny(ctx, []*Request{nil, nil}); i != -1 || err != nil {
			t.Fatalf("WaitAny of no requests: %d %v, want -1", i, err)
		}
	})
}

// When its context ends, WaitAny returns the context's error and cancels
// nothing: the receive still gets its message afterwards. WaitAll names
// the index of a request that failed.
func TestWaitAnyContext(t *testing.T) {
	ts := localJob(t, 2, ProgressDirect)
	ctx := testCtx(t)
	buf := make([]byte, 4)
	r, err := ts[1].Irecv(0, 30, buf)
	if err != nil {
		t.Fatal(err)
	}
	short, cancel := context.WithTimeout(ctx, 20*time.Millisecond)
	defer cancel()
	if i, _, err := WaitAny(short, []*Request{r}); i != -1 || !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("WaitAny past its deadline: %d %v", i, err)
	}
	if err := ts[0].Send(ctx, 1, 30, []byte("late")); err != nil {
		t.Fatal(err)
	}
	if st, err := r.Wait(ctx); err != nil || string(buf[:st.Size]) != "late" {
		t.Fatalf("receive after WaitAny gave up: %q %v", buf[:st.Size], err)
	}
	// A WaitAny that has parked wakes when the message comes.
	buf2 := make([]byte, 8)
	r2, err := ts[1].Irecv(0, 32, buf2)
	if err != nil {
		t.Fatal(err)
	}
	sent := make(chan error, 1)
	go func() {
		for ts[1].parked.Load() == 0 {
			runtime.Gosched()
		}
		sent <- ts[0].Send(ctx, 1, 32, []byte("parked"))
	}()
	wctx, wcancel := context.WithTimeout(ctx, 10*time.Second)
	defer wcancel()
	if i, st, err := WaitAny(wctx, []*Request{nil, r2}); i != 1 || err != nil || string(buf2[:st.Size]) != "parked" {
		t.Fatalf("WaitAny woken from parking: %d %q %v", i, buf2[:st.Size], err)
	}
	if wctx.Err() != nil {
		t.Fatal("WaitAny returned only once its context had ended: the message's arrival did not wake it")
	}
	if err := <-sent; err != nil {
		t.Fatal(err)
	}
	small, err := ts[1].Irecv(0, 31, make([]byte, 1))
	if err != nil {
		t.Fatal(err)
	}
	if err := ts[0].Send(ctx, 1, 31, []byte("too long")); err != nil {
		t.Fatal(err)
	}
	if _, err := WaitAll(ctx, []*Request{nil, small}); !errors.Is(err, ErrTruncated) || !strings.Contains(err.Error(), "request 1") {
		t.Fatalf("WaitAll with a truncated receive: %v", err)
	}
}

// TestAny and TestAll report nothing until requests complete and do not
// block; WaitSome returns every request completed so far, lowest index
// first, then the others on the next call; failed requests are named.
func TestWaitSomeTestAnyAll(t *testing.T) {
	forModes(t, func(t *testing.T, mode ProgressMode) {
		ts := localJob(t, 2, mode)
		ctx := testCtx(t)
		reqs, bufs := recvTags(t, ts[1], 40, 4, 2)
		if i, _, err := TestAny(reqs); i != -1 || err != nil {
			t.Fatalf("TestAny before any send: %d %v", i, err)
		}
		if ok, sts, err := TestAll(reqs); ok || sts != nil || err != nil {
			t.Fatalf("TestAll before any send: %v %v %v", ok, sts, err)
		}
		// Tags 43 and 41; 42 gets a message too long for its buffer.
		for _, m := range []struct {
			tag  int
			data string
		}{{43, "c"}, {41, "a"}, {42, "too long"}} {
			if err := ts[0].Send(ctx, 1, m.tag, []byte(m.data)); err != nil {
				t.Fatal(err)
			}
		}
		// The three messages have been sent, but a receive completes in
		// a progress pass: wait for the last one sent, then all three are
		// done.
		if _, err := reqs[2].Wait(ctx); err == nil {
			t.Fatal("a 8-byte message into a 2-byte buffer did not fail")
		}
		for _, i := range []int{1, 3} {
			if _, err := reqs[i].Wait(ctx); err != nil {
				t.Fatal(err)
			}
		}
		i, st, err := TestAny(reqs)
		if i != 1 || st.Tag != 41 || err != nil {
			t.Fatalf("TestAny: %d %+v %v, want index 1", i, st, err)
		}
		idx, sts, err := WaitSome(ctx, reqs)
		if !slices.Equal(idx, []int{1, 2, 3}) || len(sts) != 3 || sts[0].Tag != 41 || sts[2].Tag != 43 || string(bufs[3][:sts[2].Size]) != "c" {
			t.Fatalf("WaitSome: %v %+v, want indices 1 2 3", idx, sts)
		}
		if err == nil || !strings.Contains(err.Error(), "request 2:") {
			t.Fatalf("WaitSome's error %v does not name request 2", err)
		}
		if ok, _, _ := TestAll(reqs); ok {
			t.Fatal("TestAll with request 0 still pending reported true")
		}
		reqs[1], reqs[2], reqs[3] = nil, nil, nil
		if err := ts[0].Send(ctx, 1, 40, []byte("z")); err != nil {
			t.Fatal(err)
		}
		idx, sts, err = WaitSome(ctx, reqs)
		if !slices.Equal(idx, []int{0}) || sts[0].Tag != 40 || err != nil {
			t.Fatalf("WaitSome for the last one: %v %+v %v", idx, sts, err)
		}
		ok, all, err := TestAll(reqs)
		if !ok || len(all) != 4 || all[0].Tag != 40 || all[1] != (Status{}) || err != nil {
			t.Fatalf("TestAll once all completed: %v %+v %v", ok, all, err)
		}
		reqs[0] = nil
		if idx, _, err := WaitSome(ctx, reqs); idx != nil || err != nil {
			t.Fatalf("WaitSome of no requests: %v %v", idx, err)
		}
	})
}

// Three ranks pass messages around a ring with Sendrecv, every rank
// sending to its right and receiving from its left at once (in MPI, a
// blocking send then receive in this order may deadlock); one round
// receives from AnySource. A bad destination fails before anything
// is posted and the rank goes on.
func TestSendrecvRing(t *testing.T) {
	forModes(t, func(t *testing.T, mode ProgressMode) {
		const n = 3
		ts := localJob(t, n, mode)
		ctx := testCtx(t)
		for _, size := range []int{8, 256 << 10} {
			for _, anySource := range []bool{false, true} {
				errs := make(chan error, n)
				for r := range n {
					go func() {
						right, left := (r+1)%n, (r+n-1)%n
						src := left
						if anySource {
							src = AnySource
						}
						got := make([]byte, size)
						st, err := ts[r].Sendrecv(ctx, right, 7, pattern(size, r), src, 7, got)
						switch {
						case err != nil:
						case st.Source != left || st.Size != size:
							err = fmt.Errorf("rank %d: status %+v, want source %d size %d", r, st, left, size)
						case !bytes.Equal(got, pattern(size, left)):
							err = fmt.Errorf("rank %d: wrong bytes from rank %d", r, left)
						}
						errs <- err
					}()
				}
				for range n {
					if err := <-errs; err != nil {
						t.Fatalf("size %d any source %v: %v", size, anySource, err)
					}
				}
			}
		}
		if _, err := ts[0].Sendrecv(ctx, n, 7, []byte("x"), 1, 7, make([]byte, 1)); !errors.Is(err, ErrInvalid) {
			t.Fatalf("Sendrecv to rank %d of %d: %v", n, n, err)
		}
		// Nothing was left posted: the next exchange on the same tag
		// between ranks 0 and 1 pairs as it should.
		errs := make(chan error, 2)
		for r := range 2 {
			go func() {
				got := make([]byte, 1)
				_, err := ts[r].Sendrecv(ctx, 1-r, 7, []byte{byte(r)}, 1-r, 7, got)
				if err == nil && got[0] != byte(1-r) {
					err = fmt.Errorf("rank %d got %d", r, got[0])
				}
				errs <- err
			}()
		}
		for range 2 {
			if err := <-errs; err != nil {
				t.Fatal(err)
			}
		}
	})
}
