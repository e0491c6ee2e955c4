package transport

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"runtime"
	"testing"
	"time"
)

// recvString waits for r and returns the message it received.
func recvString(t *testing.T, ctx context.Context, r *Request, buf []byte) (Status, string) {
	t.Helper()
	st, err := r.Wait(ctx)
	if err != nil {
		t.Fatalf("receive: %v", err)
	}
	return st, string(buf[:st.Size])
}

// Any-source receives posted before anything was sent get one message
// each, and their Status names the sender.
func TestAnySourceReceives(t *testing.T) {
	forModes(t, func(t *testing.T, mode ProgressMode) {
		ts := localJob(t, 3, mode)
		ctx := testCtx(t)
		bufs := [][]byte{make([]byte, 16), make([]byte, 16)}
		rs := make([]*Request, 2)
		for i := range rs {
			var err error
			if rs[i], err = ts[0].Irecv(AnySource, 4, bufs[i]); err != nil {
				t.Fatal(err)
			}
		}
		for src := 1; src <= 2; src++ {
			if err := ts[src].Send(ctx, 0, 4, []byte(fmt.Sprintf("from %d", src))); err != nil {
				t.Fatal(err)
			}
		}
		seen := map[int]bool{}
		for i, r := range rs {
			st, got := recvString(t, ctx, r, bufs[i])
			if want := fmt.Sprintf("from %d", st.Source); got != want || st.Tag != 4 {
				t.Fatalf("receive %d: status %+v, data %q, want %q", i, st, got, want)
			}
			seen[st.Source] = true
		}
		if !seen[1] || !seen[2] {
			t.Fatalf("sources seen %v, want ranks 1 and 2", seen)
		}
	})
}

// MPI matches receives in the order they were posted: an exact receive
// posted after an any-source receive for the same tag gets the second
// message, not the first (trace-based matching alone would hand it the
// first, whose sequence number it would take).
func TestAnySourcePostOrder(t *testing.T) {
	forModes(t, func(t *testing.T, mode ProgressMode) {
		ts := localJob(t, 2, mode)
		ctx := testCtx(t)
		wb, eb := make([]byte, 8), make([]byte, 8)
		w, err := ts[1].Irecv(AnySource, 5, wb)
		if err != nil {
			t.Fatal(err)
		}
		e, err := ts[1].Irecv(0, 5, eb)
		if err != nil {
			t.Fatal(err)
		}
		for _, m := range []string{"first", "second"} {
			if err := ts[0].Send(ctx, 1, 5, []byte(m)); err != nil {
				t.Fatal(err)
			}
		}
		if st, got := recvString(t, ctx, w, wb); got != "first" || st.Source != 0 {
			t.Fatalf("any-source receive: %+v %q, want rank 0 \"first\"", st, got)
		}
		if _, got := recvString(t, ctx, e, eb); got != "second" {
			t.Fatalf("exact receive posted after it: %q, want \"second\"", got)
		}
	})
}

// Messages from one rank with one tag arrive through any-source receives
// in the order they were sent, interleaved with another rank's.
func TestAnySourceKeepsPerSourceOrder(t *testing.T) {
	forModes(t, func(t *testing.T, mode ProgressMode) {
		ts := localJob(t, 3, mode)
		ctx := testCtx(t)
		const each = 20
		errs := make(chan error, 2)
		for src := 1; src <= 2; src++ {
			go func(src int) {
				for i := 0; i < each; i++ {
					if err := ts[src].Send(ctx, 0, 6, []byte{byte(src), byte(i)}); err != nil {
						errs <- err
						return
					}
				}
				errs <- nil
			}(src)
		}
		next := map[int]int{}
		buf := make([]byte, 2)
		for i := 0; i < 2*each; i++ {
			st, err := ts[0].Recv(ctx, AnySource, 6, buf)
			if err != nil {
				t.Fatal(err)
			}
			if int(buf[0]) != st.Source || int(buf[1]) != next[st.Source] {
				t.Fatalf("message %d: status %+v data %v, want rank %d's message %d", i, st, buf, st.Source, next[st.Source])
			}
			next[st.Source]++
		}
		for range 2 {
			if err := <-errs; err != nil {
				t.Fatal(err)
			}
		}
	})
}

// A cancelled any-source receive leaves the queue, and the receive posted
// behind it starts and gets the first message.
func TestAnySourceCancel(t *testing.T) {
	forModes(t, func(t *testing.T, mode ProgressMode) {
		ts := localJob(t, 2, mode)
		ctx := testCtx(t)
		cctx, cancel := context.WithCancel(ctx)
		w, err := ts[1].Irecv(AnySource, 7, make([]byte, 8))
		if err != nil {
			t.Fatal(err)
		}
		eb := make([]byte, 8)
		e, err := ts[1].Irecv(0, 7, eb)
		if err != nil {
			t.Fatal(err)
		}
		cancel()
		if _, err := w.Wait(cctx); !errors.Is(err, context.Canceled) {
			t.Fatalf("cancelled any-source receive: %v", err)
		}
		if err := ts[0].Send(ctx, 1, 7, []byte("only")); err != nil {
			t.Fatal(err)
		}
		if _, got := recvString(t, ctx, e, eb); got != "only" {
			t.Fatalf("receive behind the cancelled one: %q", got)
		}
	})
}

// Iprobe and Probe with AnySource name the rank whose message is there,
// and a receive from that rank gets it.
func TestAnySourceProbe(t *testing.T) {
	ts := localJob(t, 3, ProgressDirect)
	ctx := testCtx(t)
	if _, ok, err := ts[0].Iprobe(AnySource, 8); ok || err != nil {
		t.Fatalf("probe before any send: %v %v", ok, err)
	}
	if err := ts[2].Send(ctx, 0, 8, []byte("probed")); err != nil {
		t.Fatal(err)
	}
	st, err := ts[0].Probe(ctx, AnySource, 8)
	if err != nil || st.Source != 2 || st.Size != 6 || st.Tag != 8 {
		t.Fatalf("probe: %+v %v", st, err)
	}
	buf := make([]byte, st.Size)
	if _, err := ts[0].Recv(ctx, st.Source, 8, buf); err != nil || string(buf) != "probed" {
		t.Fatalf("receive after probe: %q %v", buf, err)
	}
}

// A large message between ranks of one host travels as a CMA descriptor,
// whose size is known once the descriptor is fetched: Iprobe with
// AnySource reported it with size 0 meanwhile. Every report must carry the
// real size, in both progress modes.
func TestAnySourceProbeSizeOfCMAMessage(t *testing.T) {
	forModes(t, func(t *testing.T, mode ProgressMode) {
		ts := localJob(t, 2, mode)
		ctx := testCtx(t)
		const n = 300 << 10
		sr, err := ts[1].Isend(0, 8, pattern(n, 1))
		if err != nil {
			t.Fatal(err)
		}
		for {
			st, ok, err := ts[0].Iprobe(AnySource, 8)
			if err != nil {
				t.Fatal(err)
			}
			if ok {
				if st.Source != 1 || st.Size != n {
					t.Fatalf("Iprobe(AnySource): %+v, want source 1, %d bytes", st, n)
				}
				break
			}
			if ctx.Err() != nil {
				t.Fatal("the message was never found")
			}
			runtime.Gosched()
		}
		got := make([]byte, n)
		if st, err := ts[0].Recv(ctx, 1, 8, got); err != nil || st.Size != n || !bytes.Equal(got, pattern(n, 1)) {
			t.Fatalf("receive: %+v %v", st, err)
		}
		if _, err := sr.Wait(ctx); err != nil {
			t.Fatal(err)
		}
	})
}

// Any-tag receives and probes are refused with a typed error; a
// receive from a rank outside the job still is too.
func TestAnyTagRefused(t *testing.T) {
	ts := localJob(t, 2, ProgressDirect)
	ctx := testCtx(t)
	if _, err := ts[0].Irecv(1, AnyTag, nil); !errors.Is(err, ErrAnyTag) || !errors.Is(err, ErrInvalid) {
		t.Fatalf("any-tag Irecv: %v", err)
	}
	if _, err := ts[0].Recv(ctx, AnySource, AnyTag, nil); !errors.Is(err, ErrAnyTag) {
		t.Fatalf("any-tag Recv: %v", err)
	}
	if _, _, err := ts[0].Iprobe(AnySource, AnyTag); !errors.Is(err, ErrAnyTag) {
		t.Fatalf("any-tag Iprobe: %v", err)
	}
	if _, err := ts[0].Irecv(-2, 1, nil); !errors.Is(err, ErrInvalid) {
		t.Fatalf("receive from rank -2: %v", err)
	}
}

// Close fails an any-source receive still waiting, and the receive held
// behind it, with ErrClosed.
func TestAnySourceClose(t *testing.T) {
	ctx := testCtx(t)
	ts, stop, err := StartLocal(ctx, 2, Options{})
	if err != nil {
		t.Fatal(err)
	}
	defer stop()
	w, err := ts[0].Irecv(AnySource, 9, make([]byte, 8))
	if err != nil {
		t.Fatal(err)
	}
	e, err := ts[0].Irecv(1, 9, make([]byte, 8))
	if err != nil {
		t.Fatal(err)
	}
	if err := ts[0].Close(); err != nil {
		t.Fatal(err)
	}
	for name, r := range map[string]*Request{"any-source": w, "held": e} {
		if _, err := r.Wait(ctx); !errors.Is(err, ErrClosed) {
			t.Fatalf("%s receive after Close: %v", name, err)
		}
	}
}

// Receives cancelled in the reverse order of posting give their sequence
// numbers back oldest first: the next receives still get the messages in
// the order they were sent.
func TestCancelledSequencesReusedInOrder(t *testing.T) {
	ts := localJob(t, 2, ProgressDirect)
	ctx := testCtx(t)
	type posted struct {
		r      *Request
		ctx    context.Context
		cancel context.CancelFunc
	}
	var ps []posted
	for i := 0; i < 3; i++ {
		cctx, cancel := context.WithCancel(ctx)
		r, err := ts[1].Irecv(0, 10, make([]byte, 8))
		if err != nil {
			t.Fatal(err)
		}
		ps = append(ps, posted{r, cctx, cancel})
	}
	for i := 2; i >= 0; i-- {
		ps[i].cancel()
		if _, err := ps[i].r.Wait(ps[i].ctx); !errors.Is(err, context.Canceled) {
			t.Fatalf("cancelled receive %d: %v", i, err)
		}
	}
	for _, m := range []string{"a", "b", "c"} {
		if err := ts[0].Send(ctx, 1, 10, []byte(m)); err != nil {
			t.Fatal(err)
		}
	}
	buf := make([]byte, 8)
	for _, want := range []string{"a", "b", "c"} {
		st, err := ts[1].Recv(ctx, 0, 10, buf)
		if err != nil || string(buf[:st.Size]) != want {
			t.Fatalf("receive: %q %v, want %q", buf[:st.Size], err, want)
		}
	}
}

// With an overlap policy that prefetches, a large message that arrived
// before any receive sits in a prefetch slot, out of UCX: an any-source
// receive must still find it there.
func TestAnySourcePrefetched(t *testing.T) {
	ctx := testCtx(t)
	pol := &recordingPolicy{}
	ts := localJobWith(t, 2, Options{Overlap: pol})
	want := pattern(1<<20, 3)
	sr, err := ts[0].Isend(1, 11, want)
	if err != nil {
		t.Fatal(err)
	}
	// Wait until the receiver's engine has taken the message into its slot.
	for deadline := time.Now().Add(10 * time.Second); pol.Stats().PoolInUse == 0; {
		if time.Now().After(deadline) {
			t.Fatal("the message was never prefetched")
		}
		if _, _, err := ts[1].Iprobe(0, 11); err != nil {
			t.Fatal(err)
		}
	}
	got := make([]byte, len(want))
	st, err := ts[1].Recv(ctx, AnySource, 11, got)
	if err != nil || st.Source != 0 || st.Size != len(want) || !bytes.Equal(got, want) {
		t.Fatalf("any-source receive of a prefetched message: %+v %v (bytes equal: %v)", st, err, bytes.Equal(got, want))
	}
	if _, err := sr.Wait(ctx); err != nil {
		t.Fatal(err)
	}
}

// An any-source receive posted before its message arrived is matched in
// UCX (source masked); one posted after its message arrived is matched in
// software. Either way the sender's next exact receive gets the message
// after it: the sequence numbers stayed in step.
func TestAnySourceMatchPaths(t *testing.T) {
	forModes(t, func(t *testing.T, mode ProgressMode) {
		ts := localJob(t, 3, mode)
		ctx := testCtx(t)
		sendAll := func(src int, msgs ...string) {
			t.Helper()
			for _, m := range msgs {
				if err := ts[src].Send(ctx, 0, 12, []byte(m)); err != nil {
					t.Fatal(err)
				}
			}
		}
		expect := func(src, from int, want string, stats AnySourceStats) {
			t.Helper()
			buf := make([]byte, 8)
			st, err := ts[0].Recv(ctx, src, 12, buf)
			if err != nil || string(buf[:st.Size]) != want || st.Source != from {
				t.Fatalf("receive from %s: %+v %q %v, want %q", sourceName(src), st, buf[:st.Size], err, want)
			}
			if got := ts[0].AnySourceStats(); got != stats {
				t.Fatalf("after receiving %q: any-source stats %+v, want %+v", want, got, stats)
			}
		}

		// Posted first: UCX matches it.
		w := make([]byte, 8)
		r, err := ts[0].Irecv(AnySource, 12, w)
		if err != nil {
			t.Fatal(err)
		}
		sendAll(2, "a1", "a2")
		if st, got := recvString(t, ctx, r, w); got != "a1" || st.Source != 2 {
			t.Fatalf("any-source receive posted first: %+v %q, want rank 2 \"a1\"", st, got)
		}
		expect(2, 2, "a2", AnySourceStats{InUCX: 1})

		// Arrived first: matched in software.
		sendAll(1, "b1", "b2")
		if _, err := ts[0].Probe(ctx, 1, 12); err != nil {
			t.Fatal(err)
		}
		expect(AnySource, 1, "b1", AnySourceStats{InUCX: 1, Arrived: 1})
		expect(1, 1, "b2", AnySourceStats{InUCX: 1, Arrived: 1})
	})
}

// A receive cancelled before its message came gives its sequence number
// back; an any-source receive matched in UCX then gets that message, its
// sender's next, and takes the number, so that the exact receive after it
// gets the following message.
func TestAnySourceTakesFreedSequence(t *testing.T) {
	ts := localJob(t, 2, ProgressDirect)
	ctx := testCtx(t)
	cctx, cancel := context.WithCancel(ctx)
	e, err := ts[1].Irecv(0, 13, make([]byte, 8))
	if err != nil {
		t.Fatal(err)
	}
	cancel()
	if _, err := e.Wait(cctx); !errors.Is(err, context.Canceled) {
		t.Fatalf("cancelled receive: %v", err)
	}
	wb := make([]byte, 8)
	w, err := ts[1].Irecv(AnySource, 13, wb)
	if err != nil {
		t.Fatal(err)
	}
	for _, m := range []string{"x", "y"} {
		if err := ts[0].Send(ctx, 1, 13, []byte(m)); err != nil {
			t.Fatal(err)
		}
	}
	if st, got := recvString(t, ctx, w, wb); got != "x" || st.Source != 0 {
		t.Fatalf("any-source receive: %+v %q, want rank 0 \"x\"", st, got)
	}
	if s := ts[1].AnySourceStats(); s.InUCX != 1 {
		t.Fatalf("any-source stats %+v: the receive was not matched in UCX", s)
	}
	buf := make([]byte, 8)
	st, err := ts[1].Recv(ctx, 0, 13, buf)
	if err != nil || string(buf[:st.Size]) != "y" {
		t.Fatalf("exact receive after it: %q %v, want \"y\"", buf[:st.Size], err)
	}
}

// With the overlap engine on, a large exact receive waits in the engine's
// table, out of UCX's sight: an any-source receive posted after it must
// not go to UCX, where it would match the exact receive's message.
func TestAnySourceBehindEngineReceive(t *testing.T) {
	ctx := testCtx(t)
	ts := localJobWith(t, 2, Options{Overlap: &recordingPolicy{}})
	const size = 1 << 20
	eb, wb := make([]byte, size), make([]byte, size)
	e, err := ts[1].Irecv(0, 14, eb)
	if err != nil {
		t.Fatal(err)
	}
	w, err := ts[1].Irecv(AnySource, 14, wb)
	if err != nil {
		t.Fatal(err)
	}
	first, second := pattern(size, 1), pattern(size, 2)
	var sends []*Request
	for _, m := range [][]byte{first, second} {
		r, err := ts[0].Isend(1, 14, m)
		if err != nil {
			t.Fatal(err)
		}
		sends = append(sends, r)
	}
	if _, err := e.Wait(ctx); err != nil || !bytes.Equal(eb, first) {
		t.Fatalf("exact receive: %v (got the first message: %v)", err, bytes.Equal(eb, first))
	}
	if st, err := w.Wait(ctx); err != nil || st.Source != 0 || !bytes.Equal(wb, second) {
		t.Fatalf("any-source receive posted after it: %+v %v (got the second message: %v)", st, err, bytes.Equal(wb, second))
	}
	for _, r := range sends {
		if _, err := r.Wait(ctx); err != nil {
			t.Fatal(err)
		}
	}
}
