package transport

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"runtime"
	"testing"

	"github.com/troupe-hpc/troupe/datatype"
)

// sendTypedAsync runs a typed send (which returns once the receiver has
// the data) on a goroutine; the returned channel gives its error.
func sendTypedAsync(ctx context.Context, tr *Transport, dst, tag int, buf []byte, dt *datatype.Type, o TypedOptions) <-chan error {
	done := make(chan error, 1)
	go func() { done <- tr.SendTypedWith(ctx, dst, tag, buf, dt, 1, o) }()
	return done
}

// eightByteMessages returns a type of 8 bytes and a function that makes an
// 8-byte message of a word (padded with spaces), for typed tests that tell
// messages apart by content.
func eightByteMessages(t *testing.T) (*datatype.Type, func(string) []byte) {
	t.Helper()
	b, err := datatype.Contiguous(8, datatype.Byte)
	if err != nil {
		t.Fatal(err)
	}
	return b, func(s string) []byte { return []byte(fmt.Sprintf("%-8s", s)) }
}

// Any-source typed receives posted before two ranks send get one message
// each, under every scheme: the status names the sender, the bytes are its
// vector's, and the gaps of the receive layout stay untouched.
func TestTypedAnySource(t *testing.T) {
	ts := localJob(t, 3, ProgressDirect)
	ctx := testCtx(t)
	vec, err := datatype.Vector(64, 128, 256, datatype.Float64) // 64 blocks of 1 KiB, stride 2 KiB
	if err != nil {
		t.Fatal(err)
	}
	span := int(vec.Extent())
	for _, s := range []datatype.Scheme{datatype.SchemePack, datatype.SchemeSGL, datatype.SchemeZCopy, datatype.SchemeAuto} {
		o := TypedOptions{Scheme: s}
		dsts := [][]byte{bytes.Repeat([]byte{0xee}, span), bytes.Repeat([]byte{0xee}, span)}
		rs := make([]*Request, 2)
		for i := range rs {
			if rs[i], err = ts[0].IrecvTypedWith(AnySource, 41, dsts[i], vec, 1, o); err != nil {
				t.Fatal(err)
			}
		}
		srcs := map[int][]byte{}
		var sends []<-chan error
		for r := 1; r <= 2; r++ {
			srcs[r] = pattern(span, 10*int(s)+r)
			sends = append(sends, sendTypedAsync(ctx, ts[r], 0, 41, srcs[r], vec, o))
		}
		seen := map[int]bool{}
		for i, r := range rs {
			st, err := r.Wait(ctx)
			if err != nil || st.Size != 64*1024 || srcs[st.Source] == nil || seen[st.Source] {
				t.Fatalf("%v: any-source typed receive %d: %+v %v", s, i, st, err)
			}
			seen[st.Source] = true
			if d := vectorDiff(dsts[i], srcs[st.Source]); d != "" {
				t.Fatalf("%v: any-source typed receive %d from rank %d: %s", s, i, st.Source, d)
			}
		}
		for _, c := range sends {
			if err := <-c; err != nil {
				t.Fatalf("%v: typed send: %v", s, err)
			}
		}
	}
}

// Typed receives match in the order posted: an exact typed receive posted
// after an any-source one for the same tag gets the sender's second
// message. A cancelled any-source typed receive lets the one behind it go
// on, and the sender's next exact receives stay in step.
func TestTypedAnySourceOrderAndCancel(t *testing.T) {
	ts := localJob(t, 2, ProgressDirect)
	ctx := testCtx(t)
	b, msg := eightByteMessages(t)

	wb, eb := make([]byte, 8), make([]byte, 8)
	w, err := ts[1].IrecvTyped(AnySource, 42, wb, b, 1)
	if err != nil {
		t.Fatal(err)
	}
	e, err := ts[1].IrecvTyped(0, 42, eb, b, 1)
	if err != nil {
		t.Fatal(err)
	}
	sent := make(chan error, 1)
	go func() {
		for _, m := range []string{"first", "second"} {
			if err := ts[0].SendTyped(ctx, 1, 42, msg(m), b, 1); err != nil {
				sent <- err
				return
			}
		}
		sent <- nil
	}()
	if st, err := w.Wait(ctx); err != nil || st.Source != 0 || !bytes.Equal(wb, msg("first")) {
		t.Fatalf("any-source typed receive posted first: %+v %v %q", st, err, wb)
	}
	if _, err := e.Wait(ctx); err != nil || !bytes.Equal(eb, msg("second")) {
		t.Fatalf("exact typed receive posted behind it: %v %q", err, eb)
	}
	if err := <-sent; err != nil {
		t.Fatal(err)
	}

	// Any-source, exact, any-source: the exact receive's place comes
	// between the two, even though both go on at the same moment (the
	// second any-source receive waits until the exact one's RTS receive
	// is in UCX).
	for round := range 20 {
		bufs := [][]byte{make([]byte, 8), make([]byte, 8), make([]byte, 8)}
		var rs []*Request
		for i, src := range []int{AnySource, 0, AnySource} {
			r, err := ts[1].IrecvTyped(src, 44, bufs[i], b, 1)
			if err != nil {
				t.Fatal(err)
			}
			rs = append(rs, r)
		}
		go func() {
			for _, m := range []string{"m1", "m2", "m3"} {
				if err := ts[0].SendTyped(ctx, 1, 44, msg(m), b, 1); err != nil {
					sent <- err
					return
				}
			}
			sent <- nil
		}()
		for i, r := range rs {
			if _, err := r.Wait(ctx); err != nil || !bytes.Equal(bufs[i], msg(fmt.Sprintf("m%d", i+1))) {
				t.Fatalf("round %d, receive %d of any, exact, any: %v %q", round, i, err, bufs[i])
			}
		}
		if err := <-sent; err != nil {
			t.Fatal(err)
		}
	}

	// Cancelled while waiting in UCX: the exact receive behind it goes on.
	cctx, cancel := context.WithCancel(ctx)
	gave := make(chan error, 1)
	go func() {
		_, err := ts[1].RecvTyped(cctx, AnySource, 43, make([]byte, 8), b, 1)
		gave <- err
	}()
	nc, err := ts[1].noncontig()
	if err != nil {
		t.Fatal(err)
	}
	for gated := false; !gated; runtime.Gosched() { // until the receive heads tag 43's gate
		nc.mu.Lock()
		gated = len(nc.gates[43]) == 1
		nc.mu.Unlock()
	}
	e2, err := ts[1].IrecvTyped(0, 43, eb, b, 1)
	if err != nil {
		t.Fatal(err)
	}
	cancel()
	if err := <-gave; !errors.Is(err, context.Canceled) {
		t.Fatalf("cancelled any-source typed receive: %v", err)
	}
	go func() { sent <- ts[0].SendTyped(ctx, 1, 43, msg("third"), b, 1) }()
	if _, err := e2.Wait(ctx); err != nil || !bytes.Equal(eb, msg("third")) {
		t.Fatalf("exact typed receive behind a cancelled any-source one: %v %q", err, eb)
	}
	if err := <-sent; err != nil {
		t.Fatal(err)
	}
}

// Typed transfers still refuse AnyTag, any-source prepared receives and
// any-source sends.
func TestTypedWildcardsRefused(t *testing.T) {
	ts := localJob(t, 2, ProgressDirect)
	b, err := datatype.Contiguous(8, datatype.Byte)
	if err != nil {
		t.Fatal(err)
	}
	buf := make([]byte, 8)
	if _, err := ts[1].IrecvTyped(0, AnyTag, buf, b, 1); !errors.Is(err, ErrInvalid) {
		t.Fatalf("typed receive with AnyTag: %v", err)
	}
	if _, err := ts[1].PrepareRecvTyped(AnySource, 1, buf, b, 1, TypedOptions{}); !errors.Is(err, ErrInvalid) {
		t.Fatalf("prepared any-source typed receive: %v", err)
	}
	if _, err := ts[1].IrecvTypedWith(AnySource, 1, buf, b, 1, TypedOptions{Runtime: true}); !errors.Is(err, ErrInvalid) {
		t.Fatalf("any-source typed receive in the runtimes' space: %v", err)
	}
	if err := ts[0].SendTyped(testCtx(t), AnySource, 1, buf, b, 1); !errors.Is(err, ErrInvalid) {
		t.Fatalf("typed send to AnySource: %v", err)
	}
}

// A prepared typed receive that has not run holds no any-source typed
// receive of its tag back: its RTS receive is in UCX from the start, so
// an any-source receive placed after it gets the sender's second message
// while the first waits for Run.
func TestPreparedTypedRecvDoesNotHoldBackAnySource(t *testing.T) {
	forModes(t, func(t *testing.T, mode ProgressMode) {
		ts := localJob(t, 2, mode)
		ctx := testCtx(t)
		b, msg := eightByteMessages(t)
		first := make([]byte, 8)
		x, err := ts[1].PrepareRecvTyped(0, 12, first, b, 1, TypedOptions{})
		if err != nil {
			t.Fatal(err)
		}
		second := make([]byte, 8)
		ar, err := ts[1].IrecvTyped(AnySource, 12, second, b, 1)
		if err != nil {
			t.Fatal(err)
		}
		var sends []*Request
		for _, s := range []string{"first", "second"} {
			r, err := ts[0].IsendTyped(1, 12, msg(s), b, 1)
			if err != nil {
				t.Fatal(err)
			}
			sends = append(sends, r)
		}
		if st, err := ar.Wait(ctx); err != nil || st.Source != 0 || !bytes.Equal(second, msg("second")) {
			t.Fatalf("any-source receive placed after an unrun prepared one: %+v %v %q", st, err, second)
		}
		if _, err := x.Run(ctx); err != nil || !bytes.Equal(first, msg("first")) {
			t.Fatalf("prepared receive: %v %q", err, first)
		}
		for _, r := range sends {
			if _, err := r.Wait(ctx); err != nil {
				t.Fatal(err)
			}
		}
	})
}

// Several typed sends to one rank and tag in flight at once (IsendTyped
// runs each protocol in a goroutine of its own) still reach any-source
// typed receives in the order they were started: their RTS messages leave
// in sequence order. Before, the second message's RTS could overtake the
// first's, and an any-source receive took it out of turn.
func TestTypedAnySourceConcurrentSends(t *testing.T) {
	forModes(t, func(t *testing.T, mode ProgressMode) {
		ts := localJob(t, 2, mode)
		ctx := testCtx(t)
		vec := probeVector(t)
		span := int(vec.Extent())
		for round := 0; round < 10; round++ {
			var srcs [][]byte
			var sends []*Request
			for i := 0; i < 4; i++ {
				srcs = append(srcs, pattern(span, 10*round+i))
				r, err := ts[0].IsendTyped(1, 3, srcs[i], vec, 1)
				if err != nil {
					t.Fatal(err)
				}
				sends = append(sends, r)
			}
			for i := range srcs {
				got := bytes.Repeat([]byte{0xee}, span)
				if _, err := ts[1].RecvTyped(ctx, AnySource, 3, got, vec, 1); err != nil {
					t.Fatalf("round %d, receive %d: %v", round, i, err)
				}
				if d := vectorDiff(got, srcs[i]); d != "" {
					t.Fatalf("round %d, receive %d (out of order?): %s", round, i, d)
				}
			}
			for _, r := range sends {
				if _, err := r.Wait(ctx); err != nil {
					t.Fatal(err)
				}
			}
		}
	})
}
