package transport

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"runtime"
	"testing"
	"time"

	"github.com/troupe-hpc/troupe/datatype"
)

// probeVector is the vector the typed probe tests send: 64 blocks of 1 KiB
// at a stride of 2 KiB (64 KiB of data, more than an RTS carries inline).
func probeVector(t *testing.T) *datatype.Type {
	t.Helper()
	vec, err := datatype.Vector(64, 128, 256, datatype.Float64)
	if err != nil {
		t.Fatal(err)
	}
	return vec
}

// improbeTypedUntil calls ImprobeTyped until it finds a message (no
// sleeping: each call progresses the worker), failing t when ctx ends.
func improbeTypedUntil(ctx context.Context, t *testing.T, tr *Transport, src, tag int) *TypedMessage {
	t.Helper()
	for {
		m, ok, err := tr.ImprobeTyped(src, tag)
		if err != nil {
			t.Fatalf("ImprobeTyped(%d, %d): %v", src, tag, err)
		}
		if ok {
			return m
		}
		if ctx.Err() != nil {
			t.Fatalf("ImprobeTyped(%d, %d) found nothing: %v", src, tag, ctx.Err())
		}
		runtime.Gosched()
	}
}

// A matched typed probe reports the sender, tag and packed size of a typed
// message, small (its data inline in the RTS) or large; Count divides it
// by a datatype as MPI_Get_count does; the message is then received with
// a layout of its own (here contiguous, sized from the count) and only
// once.
func TestTypedMprobe(t *testing.T) {
	forModes(t, func(t *testing.T, mode ProgressMode) {
		ts := localJob(t, 2, mode)
		ctx := testCtx(t)
		vec := probeVector(t)
		small, err := datatype.Vector(4, 2, 4, datatype.Int16) // 16 bytes inline
		if err != nil {
			t.Fatal(err)
		}
		for _, c := range []struct {
			name string
			dt   *datatype.Type
			elem *datatype.Type
		}{{"inline", small, datatype.Int16}, {"rendezvous", vec, datatype.Float64}} {
			span := int(c.dt.Extent())
			src := pattern(span, 3)
			sent := sendTypedAsync(ctx, ts[0], 1, 5, src, c.dt, TypedOptions{})
			m, err := ts[1].MprobeTyped(ctx, 0, 5)
			if err != nil {
				t.Fatalf("%s: MprobeTyped: %v", c.name, err)
			}
			size := int(c.dt.Size())
			if st := m.Status(); st != (Status{Source: 0, Tag: 5, Size: size}) {
				t.Fatalf("%s: probed status %+v, want size %d from rank 0 tag 5", c.name, st, size)
			}
			n, ok := m.Count(c.elem)
			if !ok || n*int(c.elem.Size()) != size {
				t.Fatalf("%s: Count(%v) = %d, %v", c.name, c.elem, n, ok)
			}
			odd, _ := datatype.Contiguous(3, datatype.Byte)
			if _, ok := m.Count(odd); ok != (size%3 == 0) {
				t.Fatalf("%s: Count of a 3-byte type: ok %v for %d bytes", c.name, ok, size)
			}
			if _, ok := m.Count(nil); ok {
				t.Fatalf("%s: Count(nil) ok", c.name)
			}
			// Invalid arguments leave the message to be received.
			if _, err := m.Recv(ctx, nil, nil, 1); !errors.Is(err, ErrInvalid) {
				t.Fatalf("%s: Recv with a nil datatype: %v", c.name, err)
			}
			dst := make([]byte, size)
			st, err := m.Recv(ctx, dst, c.elem, n)
			if err != nil || st.Size != size || st.Source != 0 {
				t.Fatalf("%s: Recv: %+v %v", c.name, st, err)
			}
			want := src[:0:0]
			for i := 0; i < span; i++ {
				if c.dt == vec && i%2048 < 1024 || c.dt == small && i%8 < 4 {
					want = append(want, src[i])
				}
			}
			if !bytes.Equal(dst, want) {
				t.Fatalf("%s: received bytes differ from the sender's packed data", c.name)
			}
			if err := <-sent; err != nil {
				t.Fatalf("%s: typed send: %v", c.name, err)
			}
			if _, err := m.Recv(ctx, dst, c.elem, n); !errors.Is(err, ErrInvalid) {
				t.Fatalf("%s: second Recv: %v, want ErrInvalid", c.name, err)
			}
		}
	})
}

// ImprobeTyped finds nothing before a typed message is sent, and each
// message once after; with AnySource it finds the messages of two ranks,
// one each, and Irecv receives them into the sender's layout.
func TestTypedImprobe(t *testing.T) {
	forModes(t, testTypedImprobe)
}

func testTypedImprobe(t *testing.T, mode ProgressMode) {
	ts := localJob(t, 3, mode)
	ctx := testCtx(t)
	vec := probeVector(t)
	span := int(vec.Extent())
	if m, ok, err := ts[0].ImprobeTyped(1, 6); m != nil || ok || err != nil {
		t.Fatalf("ImprobeTyped with nothing sent: %v %v %v", m, ok, err)
	}
	if m, ok, err := ts[0].ImprobeTyped(AnySource, 6); m != nil || ok || err != nil {
		t.Fatalf("ImprobeTyped(AnySource) with nothing sent: %v %v %v", m, ok, err)
	}
	// A plain message with the tag is not a typed one.
	if err := ts[1].Send(ctx, 0, 6, []byte("plain")); err != nil {
		t.Fatal(err)
	}
	if _, ok, err := ts[0].ImprobeTyped(1, 6); ok || err != nil {
		t.Fatalf("ImprobeTyped found a plain message: %v %v", ok, err)
	}
	if _, err := ts[0].Recv(ctx, 1, 6, make([]byte, 5)); err != nil {
		t.Fatal(err)
	}

	srcs := map[int][]byte{}
	var sends []<-chan error
	for r := 1; r <= 2; r++ {
		srcs[r] = pattern(span, 20+r)
		sends = append(sends, sendTypedAsync(ctx, ts[r], 0, 6, srcs[r], vec, TypedOptions{}))
	}
	seen := map[int]bool{}
	for i := 0; i < 2; i++ {
		m := improbeTypedUntil(ctx, t, ts[0], AnySource, 6)
		st := m.Status()
		if srcs[st.Source] == nil || seen[st.Source] || st.Size != 64<<10 {
			t.Fatalf("probe %d: status %+v (seen %v)", i, st, seen)
		}
		seen[st.Source] = true
		dst := bytes.Repeat([]byte{0xee}, span)
		r, err := m.Irecv(dst, vec, 1)
		if err != nil {
			t.Fatal(err)
		}
		if st, err := r.Wait(ctx); err != nil || st.Size != 64<<10 {
			t.Fatalf("Irecv of a probed message from rank %d: %+v %v", m.Status().Source, st, err)
		}
		if d := vectorDiff(dst, srcs[st.Source]); d != "" {
			t.Fatalf("message from rank %d: %s", st.Source, d)
		}
	}
	for _, c := range sends {
		if err := <-c; err != nil {
			t.Fatalf("typed send: %v", err)
		}
	}
	if _, ok, err := ts[0].ImprobeTyped(AnySource, 6); ok || err != nil {
		t.Fatalf("ImprobeTyped after both were taken: %v %v", ok, err)
	}
}

// A probed message is out of the matching order: a typed receive posted
// after the probe gets the sender's next message, even while the probed
// one is still to be received. A probe whose context ends gives its place
// back, exact or any-source, and the receive after it gets the message.
func TestTypedProbeOrderAndCancel(t *testing.T) {
	ts := localJob(t, 2, ProgressDirect)
	ctx := testCtx(t)
	b, msg := eightByteMessages(t)
	var sends []*Request
	for _, s := range []string{"first", "second"} {
		r, err := ts[0].IsendTyped(1, 8, msg(s), b, 1)
		if err != nil {
			t.Fatal(err)
		}
		sends = append(sends, r)
	}
	m, err := ts[1].MprobeTyped(ctx, 0, 8)
	if err != nil {
		t.Fatal(err)
	}
	later := make([]byte, 8)
	if _, err := ts[1].RecvTyped(ctx, 0, 8, later, b, 1); err != nil || !bytes.Equal(later, msg("second")) {
		t.Fatalf("typed receive after the probe: %v %q, want the second message", err, later)
	}
	got := make([]byte, 8)
	if _, err := m.Recv(ctx, got, b, 1); err != nil || !bytes.Equal(got, msg("first")) {
		t.Fatalf("probed message: %v %q, want the first", err, got)
	}
	for _, r := range sends {
		if _, err := r.Wait(ctx); err != nil {
			t.Fatal(err)
		}
	}

	for _, src := range []int{0, AnySource} {
		short, cancel := context.WithTimeout(ctx, 20*time.Millisecond)
		_, err := ts[1].MprobeTyped(short, src, 9)
		cancel()
		if !errors.Is(err, context.DeadlineExceeded) {
			t.Fatalf("MprobeTyped(%d) with nothing sent: %v, want the context's error", src, err)
		}
		sent := sendTypedAsync(ctx, ts[0], 1, 9, msg("after"), b, TypedOptions{})
		if _, err := ts[1].RecvTyped(ctx, 0, 9, got, b, 1); err != nil || !bytes.Equal(got, msg("after")) {
			t.Fatalf("typed receive after a cancelled probe (%d): %v %q", src, err, got)
		}
		if err := <-sent; err != nil {
			t.Fatal(err)
		}
	}
}

// A probed message received with another type signature fails on both
// sides, as any typed receive does.
func TestTypedProbeMismatch(t *testing.T) {
	ts := localJob(t, 2, ProgressDirect)
	ctx := testCtx(t)
	vec := probeVector(t)
	sent := sendTypedAsync(ctx, ts[0], 1, 10, pattern(int(vec.Extent()), 1), vec, TypedOptions{})
	m, err := ts[1].MprobeTyped(ctx, 0, 10)
	if err != nil {
		t.Fatal(err)
	}
	n, ok := m.Count(datatype.Int32)
	if !ok {
		t.Fatalf("Count(Int32) of %d bytes not ok", m.Status().Size)
	}
	_, rerr := m.Recv(ctx, make([]byte, m.Status().Size), datatype.Int32, n)
	serr := <-sent
	var me *TypeMismatchError
	if !errors.As(rerr, &me) || !errors.Is(serr, ErrTypeMismatch) {
		t.Fatalf("float64 data received as int32: recv %v, send %v", rerr, serr)
	}
}

// Wildcards and bad arguments are refused with ErrInvalid.
func TestTypedProbeRefused(t *testing.T) {
	ts := localJob(t, 2, ProgressDirect)
	ctx := testCtx(t)
	if _, _, err := ts[0].ImprobeTyped(1, AnyTag); !errors.Is(err, ErrAnyTag) {
		t.Fatalf("AnyTag: %v", err)
	}
	if _, err := ts[0].MprobeTyped(ctx, 7, 1); !errors.Is(err, ErrInvalid) {
		t.Fatalf("rank out of range: %v", err)
	}
	if _, _, err := ts[0].ImprobeTyped(1, -3); !errors.Is(err, ErrInvalid) {
		t.Fatalf("negative tag: %v", err)
	}
}

// IprobeTyped reports a typed message's sender and packed size without
// receiving it, and the same message again until it is received; the next
// typed receive takes it whatever form it has (exact or any-source
// receive, matched probe, prepared receive), and the messages of a sender
// still arrive in the order sent.
func TestTypedIprobe(t *testing.T) {
	forModes(t, func(t *testing.T, mode ProgressMode) {
		ts := localJob(t, 2, mode)
		ctx := testCtx(t)
		vec := probeVector(t)
		span, size := int(vec.Extent()), int(vec.Size())
		if _, ok, err := ts[1].IprobeTyped(0, 13); ok || err != nil {
			t.Fatalf("IprobeTyped with nothing sent: %v %v", ok, err)
		}
		// Four messages of 1, 2, 3 and 4 vectors, each through another kind
		// of receive after a probe.
		var sends []*Request
		srcs := make([][]byte, 4)
		for i := range srcs {
			srcs[i] = pattern((i+1)*span, 60+i)
			r, err := ts[0].IsendTyped(1, 13, srcs[i], vec, i+1)
			if err != nil {
				t.Fatal(err)
			}
			sends = append(sends, r)
		}
		packed := func(b []byte, n int) []byte {
			t.Helper()
			out := make([]byte, n*size)
			if _, err := vec.Pack(out, b, 0, int64(n)); err != nil {
				t.Fatal(err)
			}
			return out
		}
		check := func(i int, got []byte) {
			t.Helper()
			if !bytes.Equal(packed(got, i+1), packed(srcs[i], i+1)) {
				t.Fatalf("message %d: received data differs from the sender's", i)
			}
		}
		probe := func(i, src int) {
			t.Helper()
			var st Status
			for {
				var ok bool
				var err error
				if st, ok, err = ts[1].IprobeTyped(src, 13); err != nil {
					t.Fatalf("IprobeTyped(%d): %v", src, err)
				} else if ok {
					break
				}
				if ctx.Err() != nil {
					t.Fatalf("IprobeTyped(%d) found nothing: %v", src, ctx.Err())
				}
				runtime.Gosched()
			}
			if st != (Status{Source: 0, Tag: 13, Size: (i + 1) * size}) {
				t.Fatalf("probe of message %d: %+v", i, st)
			}
			if again, ok, err := ts[1].IprobeTyped(AnySource, 13); !ok || err != nil || again != st {
				t.Fatalf("second probe of message %d: %+v %v %v", i, again, ok, err)
			}
		}
		dst := func(i int) []byte { return bytes.Repeat([]byte{0xee}, (i+1)*span) }

		probe(0, 0)
		got := dst(0)
		if st, err := ts[1].RecvTyped(ctx, 0, 13, got, vec, 1); err != nil || st.Size != size {
			t.Fatalf("receive after the probe: %+v %v", st, err)
		}
		check(0, got)

		if st, err := ts[1].ProbeTyped(ctx, AnySource, 13); err != nil || st.Size != 2*size {
			t.Fatalf("ProbeTyped: %+v %v", st, err)
		}
		got = dst(1)
		r, err := ts[1].IrecvTyped(AnySource, 13, got, vec, 2)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := r.Wait(ctx); err != nil {
			t.Fatal(err)
		}
		check(1, got)

		probe(2, 0)
		m, err := ts[1].MprobeTyped(ctx, AnySource, 13)
		if err != nil || m.Status().Size != 3*size {
			t.Fatalf("MprobeTyped after IprobeTyped: %v %v", m, err)
		}
		got = dst(2)
		if _, err := m.Recv(ctx, got, vec, 3); err != nil {
			t.Fatal(err)
		}
		check(2, got)

		probe(3, AnySource)
		got = dst(3)
		x, err := ts[1].PrepareRecvTyped(0, 13, got, vec, 4, TypedOptions{})
		if err != nil {
			t.Fatal(err)
		}
		if _, err := x.Run(ctx); err != nil {
			t.Fatal(err)
		}
		check(3, got)
		for _, r := range sends {
			if _, err := r.Wait(ctx); err != nil {
				t.Fatal(err)
			}
		}
		if _, ok, err := ts[1].IprobeTyped(AnySource, 13); ok || err != nil {
			t.Fatalf("IprobeTyped after all were received: %v %v", ok, err)
		}
	})
}

// Closing ranks while sends are in flight that their peers never took
// (typed sends streaming their data, a plain rendezvous send) ends every
// request with an error and returns. It used to end the process instead:
// the endpoints were closed in flush mode, the rendezvous sends outlived
// the flush, and UCX aborted in ucp_worker_destroy (an assertion that the
// endpoint had no protocol requests left).
func TestCloseWithSendsInFlight(t *testing.T) {
	vec := probeVector(t)
	for round := 0; round < 5; round++ {
		ctx := testCtx(t)
		ts, stop, err := StartLocal(ctx, 2, Options{})
		if err != nil {
			t.Fatal(err)
		}
		var sends []*Request
		for i := 0; i < 4; i++ {
			r, err := ts[0].IsendTyped(1, 13, make([]byte, (i+1)*int(vec.Extent())), vec, i+1)
			if err != nil {
				t.Fatal(err)
			}
			sends = append(sends, r)
		}
		r, err := ts[0].Isend(1, 14, make([]byte, 4<<20))
		if err != nil {
			t.Fatal(err)
		}
		sends = append(sends, r)
		// The first typed message's RTS has arrived: its data is on the way.
		for {
			if _, ok, err := ts[1].IprobeTyped(0, 13); err != nil {
				t.Fatal(err)
			} else if ok {
				break
			}
			if ctx.Err() != nil {
				t.Fatal(ctx.Err())
			}
			runtime.Gosched()
		}
		stop()
		for i, r := range sends {
			if _, err := r.Wait(ctx); !errors.Is(err, ErrClosed) && !errors.Is(err, ErrPeerLost) {
				t.Fatalf("round %d: send %d after Close: %v, want ErrClosed (or ErrPeerLost)", round, i, err)
			}
		}
	}
}

// A typed receive whose context has ended when its message is already
// matched (parked by a probe) receives the message: it used to fail with
// the message consumed, and the next receive and the sender waited for
// ever.
func TestTypedRecvCancelledAfterMatchLosesNothing(t *testing.T) {
	for _, n := range []int{8, 64 << 10} {
		forModes(t, func(t *testing.T, mode ProgressMode) {
			ts := localJob(t, 2, mode)
			ctx := testCtx(t)
			dt, err := datatype.Contiguous(int64(n), datatype.Byte)
			if err != nil {
				t.Fatal(err)
			}
			want := pattern(n, 1)
			sr, err := ts[0].IsendTyped(1, 5, want, dt, 1)
			if err != nil {
				t.Fatal(err)
			}
			if _, err := ts[1].ProbeTyped(ctx, 0, 5); err != nil { // parks it
				t.Fatal(err)
			}
			ended, cancel := context.WithCancel(ctx)
			cancel()
			got := make([]byte, n)
			if _, err := ts[1].RecvTyped(ended, 0, 5, got, dt, 1); err != nil || !bytes.Equal(got, want) {
				t.Fatalf("%d B: a receive of a parked message with an ended context: %v", n, err)
			}
			if _, err := sr.Wait(ctx); err != nil {
				t.Fatal(err)
			}
		})
	}
}

// A matched typed probe on a message IprobeTyped or ProbeTyped parked takes
// it, whatever its context does: the parked message is the probe's once
// placed. With an ended context it gave up half the time (select between
// the message's arrival and ctx), and the message it had taken out of the
// parked list was lost: no receive could get it, and its sender waited for
// ever.
func TestMprobeTypedOnParkedMessageEndedContext(t *testing.T) {
	ts := localJob(t, 2, ProgressDirect)
	ctx := testCtx(t)
	b, msg := eightByteMessages(t)
	ended, cancel := context.WithCancel(ctx)
	cancel()
	for i := range 32 {
		want := msg(fmt.Sprintf("m%d", i))
		s, err := ts[0].IsendTyped(1, 21, want, b, 1)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := ts[1].ProbeTyped(ctx, 0, 21); err != nil { // parks it
			t.Fatal(err)
		}
		m, err := ts[1].MprobeTyped(ended, 0, 21)
		if err != nil {
			t.Fatalf("message %d: MprobeTyped with an ended context on a parked message: %v", i, err)
		}
		got := make([]byte, 8)
		if _, err := m.Recv(ctx, got, b, 1); err != nil || !bytes.Equal(got, want) {
			t.Fatalf("message %d: %v %q, want %q", i, err, got, want)
		}
		if _, err := s.Wait(ctx); err != nil {
			t.Fatal(err)
		}
	}
}
