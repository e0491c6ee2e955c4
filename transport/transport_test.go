package transport

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"testing"
	"time"
)

func localJob(t testing.TB, n int, mode ProgressMode) []*Transport {
	t.Helper()
	return localJobWith(t, n, Options{Progress: mode})
}

// localJobWith starts n in-process ranks with opts, closed when the test
// ends.
func localJobWith(t testing.TB, n int, opts Options) []*Transport {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	ts, stop, err := StartLocal(ctx, n, opts)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(stop)
	return ts
}

func testCtx(t *testing.T) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	t.Cleanup(cancel)
	return ctx
}

func pattern(n, seed int) []byte {
	b := make([]byte, n)
	for i := range b {
		b[i] = byte(i*131 + seed*7 + 3)
	}
	return b
}

func forModes(t *testing.T, f func(t *testing.T, mode ProgressMode)) {
	for _, m := range []ProgressMode{ProgressDirect, ProgressQueue} {
		t.Run(m.String(), func(t *testing.T) { f(t, m) })
	}
}

func TestSendRecvSizes(t *testing.T) {
	forModes(t, func(t *testing.T, mode ProgressMode) {
		ts := localJob(t, 2, mode)
		ctx := testCtx(t)
		for _, n := range []int{0, 1, 8191, 8192, 8193, 1 << 20} {
			want := pattern(n, n)
			got := make([]byte, n)
			rr, err := ts[1].Irecv(0, 7, got)
			if err != nil {
				t.Fatal(err)
			}
			if err := ts[0].Send(ctx, 1, 7, want); err != nil {
				t.Fatalf("send %d: %v", n, err)
			}
			st, err := rr.Wait(ctx)
			if err != nil {
				t.Fatalf("recv %d: %v", n, err)
			}
			if st.Size != n || st.Source != 0 || st.Tag != 7 || !bytes.Equal(got, want) {
				t.Fatalf("size %d: status %+v, data equal %v", n, st, bytes.Equal(got, want))
			}
		}
	})
}

func TestTruncated(t *testing.T) {
	forModes(t, func(t *testing.T, mode ProgressMode) {
		ts := localJob(t, 2, mode)
		ctx := testCtx(t)
		for _, n := range []int{100, 1 << 20} {
			sr, err := ts[0].Isend(1, 3, pattern(n, 1))
			if err != nil {
				t.Fatal(err)
			}
			_, err = ts[1].Recv(ctx, 0, 3, make([]byte, n/2))
			var te *TruncatedError
			if !errors.As(err, &te) || !errors.Is(err, ErrTruncated) {
				t.Fatalf("recv of %d into %d: got %v, want *TruncatedError", n, n/2, err)
			}
			if te.Size != n || te.BufLen != n/2 {
				t.Fatalf("truncation reports size %d buf %d, want %d and %d", te.Size, te.BufLen, n, n/2)
			}
			if _, err := sr.Wait(ctx); err != nil {
				t.Logf("sender of truncated %d-byte message: %v", n, err)
			}
			// The pair keeps working after a truncation.
			if err := ts[0].Send(ctx, 1, 3, []byte("ok")); err != nil {
				t.Fatal(err)
			}
			buf := make([]byte, 2)
			if _, err := ts[1].Recv(ctx, 0, 3, buf); err != nil || string(buf) != "ok" {
				t.Fatalf("after truncation: %v %q", err, buf)
			}
		}
	})
}

func TestOrderAndTags(t *testing.T) {
	ts := localJob(t, 2, ProgressDirect)
	ctx := testCtx(t)
	const n = 2100 // a multiple of 3: every tag gets n/3 messages
	done := make(chan error, 1)
	go func() {
		for i := 0; i < n; i++ {
			if err := ts[0].Send(ctx, 1, i%3, []byte(fmt.Sprint(i))); err != nil {
				done <- err
				return
			}
		}
		done <- nil
	}()
	next := [3]int{0, 1, 2}
	buf := make([]byte, 16)
	// Receive tags in a different interleaving than they were sent.
	for k := 0; k < n; k++ {
		tag := []int{2, 0, 1}[k%3]
		st, err := ts[1].Recv(ctx, 0, tag, buf)
		if err != nil {
			t.Fatalf("message %d (tag %d): %v", k, tag, err)
		}
		if got := string(buf[:st.Size]); got != fmt.Sprint(next[tag]) {
			t.Fatalf("tag %d: got message %s, want %d", tag, got, next[tag])
		}
		next[tag] += 3
	}
	if err := <-done; err != nil {
		t.Fatal(err)
	}
}

func TestIOV(t *testing.T) {
	forModes(t, func(t *testing.T, mode ProgressMode) {
		ts := localJob(t, 2, mode)
		ctx := testCtx(t)
		for _, n := range []int{64, 300 << 10} {
			parts := [][]byte{pattern(n, 1), pattern(3, 2), pattern(n/2, 3)}
			want := bytes.Join(parts, nil)
			got := make([]byte, len(want))
			r, _ := ts[1].Irecv(0, 1, got)
			if err := ts[0].SendIOV(ctx, 1, 1, parts); err != nil {
				t.Fatal(err)
			}
			if _, err := r.Wait(ctx); err != nil || !bytes.Equal(got, want) {
				t.Fatalf("IOV into contiguous (%d): %v", n, err)
			}
			// And contiguous into an IOV list.
			outs := [][]byte{make([]byte, 5), make([]byte, len(want)-5)}
			r, _ = ts[0].IrecvIOV(1, 2, outs)
			if err := ts[1].Send(ctx, 0, 2, want); err != nil {
				t.Fatal(err)
			}
			if st, err := r.Wait(ctx); err != nil || st.Size != len(want) || !bytes.Equal(bytes.Join(outs, nil), want) {
				t.Fatalf("contiguous into IOV (%d): %v", n, err)
			}
		}
	})
}

func TestProbeAndCancel(t *testing.T) {
	ts := localJob(t, 2, ProgressDirect)
	ctx := testCtx(t)
	// A cancelled receive gives its sequence number back: the next receive
	// gets the first message.
	cctx, cancel := context.WithCancel(ctx)
	r, _ := ts[1].Irecv(0, 9, make([]byte, 8))
	cancel()
	if _, err := r.Wait(cctx); !errors.Is(err, context.Canceled) {
		t.Fatalf("cancelled receive: %v", err)
	}
	if _, ok, _ := ts[1].Iprobe(0, 9); ok {
		t.Fatal("probe found a message nobody sent")
	}
	if err := ts[0].Send(ctx, 1, 9, []byte("first")); err != nil {
		t.Fatal(err)
	}
	st, err := ts[1].Probe(ctx, 0, 9)
	if err != nil || st.Size != 5 {
		t.Fatalf("probe: %+v %v", st, err)
	}
	buf := make([]byte, st.Size)
	if _, err := ts[1].Recv(ctx, 0, 9, buf); err != nil || string(buf) != "first" {
		t.Fatalf("recv after cancel: %q %v", buf, err)
	}
}

func TestRMA(t *testing.T) {
	forModes(t, func(t *testing.T, mode ProgressMode) {
		ts := localJob(t, 2, mode)
		ctx := testCtx(t)
		mem := make([]byte, 1<<16)
		reg, err := ts[1].Register(mem)
		if err != nil {
			t.Fatal(err)
		}
		defer reg.Release()
		wire, _ := reg.Key().MarshalBinary()
		var key RemoteKey
		if err := key.UnmarshalBinary(wire); err != nil {
			t.Fatal(err)
		}
		src := pattern(4096, 5)
		if err := ts[0].Put(ctx, key, 100, src); err != nil {
			t.Fatal(err)
		}
		if err := ts[0].Flush(ctx, 1); err != nil {
			t.Fatal(err)
		}
		if !bytes.Equal(mem[100:100+4096], src) {
			t.Fatal("put: remote memory does not hold the data")
		}
		got := make([]byte, 4096)
		if err := ts[0].Get(ctx, key, 100, got); err != nil || !bytes.Equal(got, src) {
			t.Fatalf("get: %v", err)
		}
		err = ts[0].Put(ctx, key, len(mem)-10, src)
		var be *BoundsError
		if !errors.As(err, &be) || !errors.Is(err, ErrOutOfBounds) {
			t.Fatalf("out-of-bounds put: %v", err)
		}
		if _, err := ts[0].Iget(key, -1, got); !errors.Is(err, ErrOutOfBounds) {
			t.Fatalf("negative offset get: %v", err)
		}
	})
}

func TestClosedAndInvalid(t *testing.T) {
	ts := localJob(t, 2, ProgressDirect)
	ctx := testCtx(t)
	if _, err := ts[0].Isend(5, 0, nil); !errors.Is(err, ErrInvalid) {
		t.Fatalf("send to rank 5 of 2: %v", err)
	}
	if _, err := ts[0].Isend(1, MaxUserTag+1, nil); !errors.Is(err, ErrInvalid) {
		t.Fatalf("tag too large: %v", err)
	}
	r, _ := ts[1].Irecv(0, 4, make([]byte, 4))
	if err := ts[1].Close(); err != nil {
		t.Fatal(err)
	}
	if _, err := r.Wait(ctx); !errors.Is(err, ErrClosed) {
		t.Fatalf("pending receive at close: %v", err)
	}
	if err := ts[1].Send(ctx, 0, 1, []byte("x")); !errors.Is(err, ErrClosed) {
		t.Fatalf("send after close: %v", err)
	}
}

// TestExpectReply: the progress goroutine counts an expected reply as a
// parked waiter until the returned function runs (once, however often it
// is called), and messages still flow meanwhile.
func TestExpectReply(t *testing.T) {
	ts := localJob(t, 2, ProgressDirect)
	done := ts[0].ExpectReply()
	done2 := ts[0].ExpectReply()
	if got := ts[0].parked.Load(); got != 2 {
		t.Fatalf("parked = %d with two replies expected, want 2", got)
	}
	ctx := context.Background()
	r, err := ts[0].Irecv(1, 7, make([]byte, 4))
	if err != nil {
		t.Fatal(err)
	}
	if err := ts[1].Send(ctx, 0, 7, []byte("ping")); err != nil {
		t.Fatal(err)
	}
	if _, err := r.Wait(ctx); err != nil {
		t.Fatal(err)
	}
	done()
	done()
	if got := ts[0].parked.Load(); got != 1 {
		t.Fatalf("parked = %d after one done (called twice), want 1", got)
	}
	done2()
	if got := ts[0].parked.Load(); got != 0 {
		t.Fatalf("parked = %d after both, want 0", got)
	}
}

// TestEmptyIOVLists: an empty IOV list sends an empty message and
// receives one, with CMA and without (then UCX gets the list). UCX 1.13
// asserts a non-NULL IOV pointer even for no entries, and the process
// aborted before NewIOV gave empty lists an entry.
func TestEmptyIOVLists(t *testing.T) {
	for _, cma := range []string{"on", "off"} {
		t.Run("cma-"+cma, func(t *testing.T) {
			t.Setenv("TROUPE_CMA", cma)
			ts := localJob(t, 2, ProgressDirect)
			ctx := testCtx(t)
			r, err := ts[1].Irecv(0, 2, make([]byte, 8))
			if err != nil {
				t.Fatal(err)
			}
			if err := ts[0].SendIOV(ctx, 1, 2, nil); err != nil {
				t.Fatalf("SendIOV of no buffers: %v", err)
			}
			if st, err := r.Wait(ctx); err != nil || st.Size != 0 {
				t.Fatalf("receive of an empty IOV message: %+v %v", st, err)
			}
			r, err = ts[1].IrecvIOV(0, 3, [][]byte{})
			if err != nil {
				t.Fatal(err)
			}
			if err := ts[0].Send(ctx, 1, 3, nil); err != nil {
				t.Fatal(err)
			}
			if st, err := r.Wait(ctx); err != nil || st.Size != 0 {
				t.Fatalf("empty message into no buffers: %+v %v", st, err)
			}
		})
	}
}
