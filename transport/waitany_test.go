package transport

import (
	"context"
	"errors"
	"runtime"
	"strings"
	"testing"
	"time"
)

// WaitAny returns the receive whose message came, whichever was posted
// first; with that one set to nil, the next; with none left, -1.
// WaitAll then collects the rest in order.
func TestWaitAnyAndAll(t *testing.T) {
	forModes(t, func(t *testing.T, mode ProgressMode) {
		ts := localJob(t, 2, mode)
		ctx := testCtx(t)
		reqs := make([]*Request, 4)
		bufs := make([][]byte, 4)
		for i := range reqs {
			bufs[i] = make([]byte, 1)
			var err error
			if reqs[i], err = ts[1].Irecv(0, 20+i, bufs[i]); err != nil {
				t.Fatal(err)
			}
		}
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
