package transport

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/troupe-hpc/troupe/datatype"
)

// A quick in-process check of every scheme (two ranks in this process, each
// with its own UCX worker); the full matrix over real processes is in
// integration/noncontig_test.go.
func TestTypedSchemesLocal(t *testing.T) {
	ts := localJob(t, 2, ProgressDirect)
	ctx := testCtx(t)
	vec, err := datatype.Vector(64, 128, 256, datatype.Float64) // 64 blocks of 1 KiB, stride 2 KiB
	if err != nil {
		t.Fatal(err)
	}
	contig, err := datatype.Contiguous(64*128, datatype.Float64)
	if err != nil {
		t.Fatal(err)
	}
	span := int(vec.Extent())
	for _, s := range []datatype.Scheme{datatype.SchemePack, datatype.SchemeSGL, datatype.SchemeZCopy, datatype.SchemeAuto} {
		src := make([]byte, span)
		dst := make([]byte, span)
		s0, r0 := ts[0].NoncontigStats(), ts[1].NoncontigStats()
		for round := 0; round < 3; round++ {
			copy(src, pattern(span, round+int(s)))
			copy(dst, bytes.Repeat([]byte{0xee}, span))
			o := TypedOptions{Scheme: s}
			rr, err := ts[1].IrecvTypedWith(0, 3, dst, vec, 1, o)
			if err != nil {
				t.Fatal(err)
			}
			if err := ts[0].SendTypedWith(ctx, 1, 3, src, vec, 1, o); err != nil {
				t.Fatalf("%v round %d: send: %v", s, round, err)
			}
			st, err := rr.Wait(ctx)
			if err != nil {
				t.Fatalf("%v round %d: recv: %v", s, round, err)
			}
			if st.Size != 64*1024 {
				t.Fatalf("%v: size %d", s, st.Size)
			}
			if d := vectorDiff(dst, src); d != "" {
				t.Fatalf("%v round %d: %s", s, round, d)
			}
		}
		if s == datatype.SchemeZCopy {
			// Second and third use: no registration, no key exchange.
			s1, r1 := ts[0].NoncontigStats(), ts[1].NoncontigStats()
			if s1.Registrations-s0.Registrations != 1 || r1.Registrations-r0.Registrations != 1 ||
				r1.KeyExchanges-r0.KeyExchanges != 1 || r1.KeysOmitted-r0.KeysOmitted != 2 ||
				s1.RemoteKeyHits-s0.RemoteKeyHits != 2 || s1.Sent.ZCopy-s0.Sent.ZCopy != 3 {
				t.Fatalf("zcopy caches: sender %+v -> %+v, receiver %+v -> %+v", s0, s1, r0, r1)
			}
		}
		// Different layout, same signature: vector into contiguous.
		copy(src, pattern(span, 9))
		dst = make([]byte, 64*1024)
		rr, err := ts[1].IrecvTypedWith(0, 4, dst, contig, 1, TypedOptions{Scheme: s})
		if err != nil {
			t.Fatal(err)
		}
		if err := ts[0].SendTypedWith(ctx, 1, 4, src, vec, 1, TypedOptions{Scheme: s}); err != nil {
			t.Fatalf("%v: vector to contiguous: send: %v", s, err)
		}
		if _, err := rr.Wait(ctx); err != nil {
			t.Fatalf("%v: vector to contiguous: recv: %v", s, err)
		}
		packed := make([]byte, 64*1024)
		if _, err := vec.Pack(packed, src, 0, 1); err != nil {
			t.Fatal(err)
		}
		if !bytes.Equal(dst, packed) {
			t.Fatalf("%v: vector to contiguous: bytes differ", s)
		}
	}
	t.Logf("sender %+v", ts[0].NoncontigStats())
	t.Logf("receiver %+v", ts[1].NoncontigStats())

	// Signature mismatch fails on both sides.
	ints, err := datatype.Contiguous(64*128*2, datatype.Int32)
	if err != nil {
		t.Fatal(err)
	}
	rr, err := ts[1].IrecvTyped(0, 5, make([]byte, 64*1024), ints, 1)
	if err != nil {
		t.Fatal(err)
	}
	serr := ts[0].SendTyped(ctx, 1, 5, pattern(span, 1), vec, 1)
	_, rerr := rr.Wait(ctx)
	var me *TypeMismatchError
	if !errors.As(serr, &me) || !errors.Is(serr, ErrTypeMismatch) || !errors.Is(rerr, ErrTypeMismatch) {
		t.Fatalf("mismatch: send %v, recv %v", serr, rerr)
	}
}

// TestTypedThroughEngine: with the overlap engine on, the data messages of
// typed transfers whose receive is not posted yet are taken off UCX's queue
// and prefetched or onloaded like tagged messages; every scheme then
// delivers intact, in order, and leaves the engine's books clean. The two
// pack transfers of 1 MiB each stream at least PackDepth (4) of their
// eight 128 KiB chunks before any receive exists, so the engine must have
// taken and decided for at least eight.
func TestTypedThroughEngine(t *testing.T) {
	for _, mode := range []ProgressMode{ProgressDirect, ProgressQueue} {
		t.Run(mode.String(), func(t *testing.T) {
			t.Setenv(OverlapEnv, "on")
			ts := localJob(t, 2, mode)
			if _, on := ts[1].OverlapStats(); !on {
				t.Fatal("overlap engine off")
			}
			ctx := testCtx(t)
			vec, err := datatype.Vector(1024, 128, 256, datatype.Float64) // 1024 blocks of 1 KiB: 1 MiB
			if err != nil {
				t.Fatal(err)
			}
			span, size := int(vec.Extent()), 1<<20
			schemes := []datatype.Scheme{datatype.SchemePack, datatype.SchemePack, datatype.SchemeSGL, datatype.SchemeZCopy, datatype.SchemeAuto}
			var sends []*Request
			for i, s := range schemes {
				sr, err := ts[0].IsendTypedWith(1, 7, pattern(span, 40+i), vec, 1, TypedOptions{Scheme: s})
				if err != nil {
					t.Fatal(err)
				}
				sends = append(sends, sr)
			}
			// Without the engine nothing takes these chunks off UCX's queue.
			chunks := 2 * DefaultNoncontigOptions().PackDepth
			waitUnexpected(ctx, t, ts[1], chunks)
			for i, s := range schemes {
				src := pattern(span, 40+i)
				dst := bytes.Repeat([]byte{0xee}, span)
				st, err := ts[1].RecvTypedWith(ctx, 0, 7, dst, vec, 1, TypedOptions{Scheme: s})
				if err != nil {
					t.Fatalf("message %d (%v): %v", i, s, err)
				}
				if st.Size != size {
					t.Fatalf("message %d: size %d, want %d", i, st.Size, size)
				}
				if d := vectorDiff(dst, src); d != "" {
					t.Fatalf("message %d (%v): %s", i, s, d)
				}
			}
			for i, sr := range sends {
				if _, err := sr.Wait(ctx); err != nil {
					t.Fatalf("send %d: %v", i, err)
				}
			}
			st, _ := ts[1].OverlapStats()
			t.Logf("engine: prefetched %d onloaded %d eager %d offloaded %d, pool high water %d/%d",
				st.Prefetched, st.Onloaded, st.Eager, st.Offloaded, st.PoolHighWater, st.PoolSlots)
			if st.Prefetched+st.Onloaded < uint64(chunks) {
				t.Fatalf("engine decided for %d unexpected typed chunks, want >= %d: %+v", st.Prefetched+st.Onloaded, chunks, st)
			}
			checkEngineBooks(t, ts[1])
		})
	}
}

// vectorDiff checks a receive into the test's vector of 1 KiB blocks at a
// 2 KiB stride, filled with 0xee before: block bytes must equal src's, gap
// bytes must still be 0xee. It describes the first wrong byte, or returns "".
func vectorDiff(dst, src []byte) string { return blockDiff(dst, src, 1024, 2048) }

// blockDiff is vectorDiff for blocks of block bytes at a stride of stride.
func blockDiff(dst, src []byte, block, stride int) string {
	for i := range dst {
		want := byte(0xee)
		if i%stride < block {
			want = src[i]
		}
		if dst[i] != want {
			return fmt.Sprintf("byte %d = %#x, want %#x", i, dst[i], want)
		}
	}
	return ""
}

// Near T the adaptive default measures the pack/SGL crossover on a layout
// pair's first transfers: the receiver times both schemes (CrossoverTrials
// each, in runs of CrossoverRun), tells the sender its verdict, and from then on
// every transfer takes the verdict without timing, with identical bytes
// throughout.
// In a symmetric exchange (both ranks send layouts of one shape, here from
// and into separate buffers) the two receivers measure their directions
// independently; once the lower rank has its verdict, the higher rank takes
// it, so that after warm-up both directions move by one scheme.
// crossoverJob starts two in-process ranks with the crossover measured
// (band 4, the default, whatever the environment says) and returns them
// with a layout in the band, 16 blocks of 4 KiB at an 8 KiB stride, and the
// number of transfers the trials take and how many of them go SGL.
func crossoverJob(t *testing.T) ([]*Transport, context.Context, *datatype.Type, int, int) {
	t.Helper()
	ts := localJob(t, 2, ProgressDirect)
	for _, tr := range ts {
		o := DefaultNoncontigOptions()
		o.Thresholds.CrossoverBand = 4
		if err := tr.SetNoncontigOptions(o); err != nil {
			t.Fatal(err)
		}
	}
	vec, err := datatype.Vector(16, 512, 1024, datatype.Float64)
	if err != nil {
		t.Fatal(err)
	}
	n, sgl := datatype.DefaultThresholds().CrossoverTransfers()
	return ts, testCtx(t), vec, n, sgl
}

// crossoverTransfer moves one message of round's pattern from rank a to
// rank b (the receive posted first) with the crossover job's layout and
// checks that the blocks arrived and the gaps of dst stayed untouched.
func crossoverTransfer(t *testing.T, ctx context.Context, a, b *Transport, tag int, src, dst []byte, vec *datatype.Type, round int) {
	t.Helper()
	copy(src, pattern(len(src), round))
	copy(dst, bytes.Repeat([]byte{0xee}, len(dst)))
	rr, err := b.IrecvTypedWith(a.Rank(), tag, dst, vec, 1, TypedOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if err := a.SendTypedWith(ctx, b.Rank(), tag, src, vec, 1, TypedOptions{}); err != nil {
		t.Fatalf("round %d: send: %v", round, err)
	}
	if _, err := rr.Wait(ctx); err != nil {
		t.Fatalf("round %d: recv: %v", round, err)
	}
	if d := blockDiff(dst, src, 4096, 8192); d != "" {
		t.Fatalf("round %d: %s", round, d)
	}
}

func TestTypedCrossoverSymmetric(t *testing.T) {
	ts, ctx, vec, trials, _ := crossoverJob(t)
	span := int(vec.Extent())
	var src, dst [2][]byte
	for r := range 2 {
		src[r], dst[r] = make([]byte, span), make([]byte, span)
	}
	// one moves a message from rank a to rank b and checks it.
	one := func(a, b, round int) {
		t.Helper()
		copy(src[a], pattern(span, 2*round+a))
		copy(dst[b], bytes.Repeat([]byte{0xee}, span))
		rr, err := ts[b].IrecvTypedWith(a, 6, dst[b], vec, 1, TypedOptions{})
		if err != nil {
			t.Fatal(err)
		}
		if err := ts[a].SendTypedWith(ctx, b, 6, src[a], vec, 1, TypedOptions{}); err != nil {
			t.Fatalf("round %d: send %d->%d: %v", round, a, b, err)
		}
		if _, err := rr.Wait(ctx); err != nil {
			t.Fatalf("round %d: recv %d->%d: %v", round, a, b, err)
		}
		if d := blockDiff(dst[b], src[a], 4096, 8192); d != "" {
			t.Fatalf("round %d, %d->%d: %s", round, a, b, d)
		}
	}
	round := 0
	pingPongs := func(n int) {
		for end := round + n; round < end; round++ {
			one(0, 1, round)
			one(1, 0, round)
		}
	}
	// First use, the trials of both directions, and the rounds in which
	// the lower rank's verdict reaches the higher rank.
	pingPongs(1 + trials + 3)
	s0, s1 := ts[0].NoncontigStats(), ts[1].NoncontigStats()
	if s0.CrossoverVerdicts != 1 {
		t.Fatalf("rank 0 reached %d verdicts, want 1: %+v", s0.CrossoverVerdicts, s0)
	}
	pingPongs(5)
	e0, e1 := ts[0].NoncontigStats(), ts[1].NoncontigStats()
	p0, g0 := e0.Received.Pack-s0.Received.Pack, e0.Received.SGL-s0.Received.SGL
	p1, g1 := e1.Received.Pack-s1.Received.Pack, e1.Received.SGL-s1.Received.SGL
	if !(p0 == 5 && p1 == 5 && g0 == 0 && g1 == 0 || g0 == 5 && g1 == 5 && p0 == 0 && p1 == 0) {
		t.Fatalf("after warm-up rank 0 received %d pack and %d SGL, rank 1 %d pack and %d SGL: want one scheme both ways", p0, g0, p1, g1)
	}
	if e0.CrossoverTrials != s0.CrossoverTrials || e0.CrossoverAdopted != 0 {
		t.Fatalf("rank 0 timed %d receives after its verdict and adopted %d verdicts, want neither",
			e0.CrossoverTrials-s0.CrossoverTrials, e0.CrossoverAdopted)
	}
	// SGL proposals keep asking rank 1 to measure; it answers each with
	// rank 0's verdict. (A pack verdict on both sides needs no adoption:
	// the senders then propose pack outright.)
	if g1 == 5 && e1.CrossoverAdopted-s1.CrossoverAdopted != 5 {
		t.Fatalf("rank 1 took rank 0's verdict for %d of 5 SGL receives", e1.CrossoverAdopted-s1.CrossoverAdopted)
	}
	t.Logf("both directions: %d pack, %d SGL of 5", p0, g0)
}

func TestTypedCrossoverLocal(t *testing.T) {
	ts, ctx, vec, trials, sglTrials := crossoverJob(t)
	span := int(vec.Extent())
	src, dst := make([]byte, span), make([]byte, span) // reused: the layouts stay cached
	transfer := func(round int) {
		t.Helper()
		crossoverTransfer(t, ctx, ts[0], ts[1], 5, src, dst, vec, round)
	}
	r0 := ts[1].NoncontigStats()
	// The first use goes pack and leaves the layouts cached; then the
	// trials; then the verdict.
	round := 0
	for ; round < 1+trials; round++ {
		transfer(round)
	}
	r1 := ts[1].NoncontigStats()
	if n := r1.CrossoverTrials - r0.CrossoverTrials; n != int64(trials) {
		t.Fatalf("%d trial receives, want %d: %+v", n, trials, r1)
	}
	if r1.CrossoverVerdicts-r0.CrossoverVerdicts != 1 {
		t.Fatalf("no verdict after the trials: %+v", r1)
	}
	if sgl := r1.Received.SGL - r0.Received.SGL; sgl != int64(sglTrials) {
		t.Fatalf("%d SGL receives during the trials, want %d", sgl, sglTrials)
	}
	// The sender measured its RTS-to-CTS round trip (and carries it in its
	// RTS, where the receiver charges it to the SGL trials).
	nc0, err := ts[0].noncontig()
	if err != nil {
		t.Fatal(err)
	}
	if nc0.rtt(1) == 0 {
		t.Fatal("no RTS-to-CTS round trip recorded after the SGL trials")
	}
	for ; round < 1+trials+5; round++ {
		transfer(round)
	}
	r2 := ts[1].NoncontigStats()
	if r2.CrossoverTrials != r1.CrossoverTrials || r2.CrossoverVerdicts != r1.CrossoverVerdicts {
		t.Fatalf("timing went on after the verdict: %+v -> %+v", r1, r2)
	}
	pack, sgl := r2.Received.Pack-r1.Received.Pack, r2.Received.SGL-r1.Received.SGL
	if !(pack == 5 && sgl == 0 || pack == 0 && sgl == 5) {
		t.Fatalf("after the verdict: %d pack and %d SGL receives, want all 5 one scheme", pack, sgl)
	}
	t.Logf("verdict: %d pack, %d sgl of 5", pack, sgl)
}

// TestTypedCrossoverShape: once a receiver has a verdict for a layout pair,
// another pair of the same shape (the same type on other buffers) takes it
// without trials, so that layouts of one shape cannot end with different
// verdicts (and a symmetric exchange with one scheme each way). A pair keeps
// the verdict it took; a verdict older than CrossoverReuse is not taken by a
// new pair, which is measured anew.
func TestTypedCrossoverShape(t *testing.T) {
	ts, ctx, vec, trials, _ := crossoverJob(t)
	span := int(vec.Extent())
	// Rank 1 sends to rank 0, the lower rank, which decides for itself.
	transfers := func(src, dst []byte, n int) {
		t.Helper()
		for round := range n {
			crossoverTransfer(t, ctx, ts[1], ts[0], 7, src, dst, vec, round)
		}
	}
	transfers(make([]byte, span), make([]byte, span), 1+trials+2)
	r1 := ts[0].NoncontigStats()
	if r1.CrossoverVerdicts != 1 {
		t.Fatalf("%d verdicts after the first pair's trials, want 1: %+v", r1.CrossoverVerdicts, r1)
	}
	// The same type on new buffers: first use (pack), then the verdict.
	src2, dst2 := make([]byte, span), make([]byte, span)
	transfers(src2, dst2, 6)
	r2 := ts[0].NoncontigStats()
	if r2.CrossoverTrials != r1.CrossoverTrials || r2.CrossoverVerdicts != r1.CrossoverVerdicts {
		t.Fatalf("the second pair was timed again: %+v -> %+v", r1, r2)
	}
	if r2.CrossoverAdopted == r1.CrossoverAdopted {
		t.Fatalf("the second pair did not take the first one's verdict: %+v", r2)
	}
	pack, sgl := r2.Received.Pack-r1.Received.Pack, r2.Received.SGL-r1.Received.SGL
	if !(sgl == 0 || pack == 1) { // a pack verdict, or SGL after the first use's pack
		t.Fatalf("second pair: %d pack and %d SGL receives, want one scheme after the first use", pack, sgl)
	}
	// From now on every verdict is too old to reuse for a new pair.
	nc, err := ts[0].noncontig()
	if err != nil {
		t.Fatal(err)
	}
	nc.opts.Thresholds.CrossoverReuse = time.Nanosecond
	// The second pair keeps the verdict it took (a pack verdict at the
	// sender, which no longer asks; an SGL verdict at the receiver).
	transfers(src2, dst2, 4)
	r3 := ts[0].NoncontigStats()
	pack3, sgl3 := r3.Received.Pack-r2.Received.Pack, r3.Received.SGL-r2.Received.SGL
	if r3.CrossoverTrials != r2.CrossoverTrials || r3.CrossoverVerdicts != r2.CrossoverVerdicts ||
		(sgl == 0) != (pack3 == 4) || (sgl != 0) != (sgl3 == 4) {
		t.Fatalf("the second pair did not keep its verdict (%d pack, %d SGL of 4; before %d, %d): %+v -> %+v",
			pack3, sgl3, pack, sgl, r2, r3)
	}
	// A third pair of the same shape is measured anew.
	transfers(make([]byte, span), make([]byte, span), 1+trials+2)
	r4 := ts[0].NoncontigStats()
	if r4.CrossoverVerdicts != 2 || r4.CrossoverTrials-r3.CrossoverTrials != int64(trials) {
		t.Fatalf("the third pair, after the reuse time: %d verdicts, %d trials, want 2 and %d: %+v",
			r4.CrossoverVerdicts, r4.CrossoverTrials-r3.CrossoverTrials, trials, r4)
	}
}

// TestTypedParallelPack: a page-bound layout (8-byte blocks 4 KiB apart over
// 64 MiB) sent by host pack in two 64 KiB chunks is packed and unpacked on
// two goroutines per chunk (ParallelChunks on both sides) and arrives intact,
// with the gaps of the receive buffer untouched; with PackWorkers 1 the same
// transfer uses one goroutine.
func TestTypedParallelPack(t *testing.T) {
	vec, err := datatype.Vector(1<<14, 1, 512, datatype.Float64)
	if err != nil {
		t.Fatal(err)
	}
	if w := vec.Workers(1, 2); w != 2 {
		t.Fatalf("layout not page-bound: Workers = %d", w)
	}
	span := int(vec.Extent())
	src := make([]byte, span)
	for i := 0; i < span; i += 4096 { // the blocks: no zero bytes
		for j := range 8 {
			src[i+j] = byte(1 + (i/4096*8+j)%255)
		}
	}
	for _, workers := range []int{2, 1} {
		ts := localJob(t, 2, ProgressDirect)
		ctx := testCtx(t)
		for _, tr := range ts {
			o := DefaultNoncontigOptions()
			o.PackChunk = 64 << 10
			o.PackWorkers = workers
			if err := tr.SetNoncontigOptions(o); err != nil {
				t.Fatal(err)
			}
		}
		dst := make([]byte, span)
		o := TypedOptions{Scheme: datatype.SchemePack}
		rr, err := ts[1].IrecvTypedWith(0, 6, dst, vec, 1, o)
		if err != nil {
			t.Fatal(err)
		}
		if err := ts[0].SendTypedWith(ctx, 1, 6, src, vec, 1, o); err != nil {
			t.Fatalf("workers %d: send: %v", workers, err)
		}
		if _, err := rr.Wait(ctx); err != nil {
			t.Fatalf("workers %d: recv: %v", workers, err)
		}
		for i := 0; i < span; i += 4096 {
			if !bytes.Equal(dst[i:i+8], src[i:i+8]) {
				t.Fatalf("workers %d: block at %d: %x, want %x", workers, i, dst[i:i+8], src[i:i+8])
			}
		}
		if zeros, want := bytes.Count(dst, []byte{0}), span-(1<<14)*8; zeros != want {
			t.Fatalf("workers %d: %d zero bytes in the receive buffer, want %d: a gap was written", workers, zeros, want)
		}
		want := int64(2) // chunks
		if workers == 1 {
			want = 0
		}
		s, r := ts[0].NoncontigStats(), ts[1].NoncontigStats()
		if s.ParallelChunks != want || r.ParallelChunks != want || s.Sent.Pack != 1 || r.Received.Pack != 1 {
			t.Fatalf("workers %d: sender %+v, receiver %+v; want %d parallel chunks each", workers, s, r, want)
		}
	}
}

// Typed receives cancelled in the reverse of the order they took their
// places give their sequence numbers back oldest first, as tagged receives
// do: the next typed receives still get the messages in the order sent.
func TestTypedCancelledSequencesReusedInOrder(t *testing.T) {
	ts := localJob(t, 2, ProgressDirect)
	ctx := testCtx(t)
	bytesType, err := datatype.Contiguous(1, datatype.Byte)
	if err != nil {
		t.Fatal(err)
	}
	var prepared []*TypedTransfer
	for range 2 {
		x, err := ts[1].PrepareRecvTyped(0, 40, make([]byte, 1), bytesType, 1, TypedOptions{})
		if err != nil {
			t.Fatal(err)
		}
		prepared = append(prepared, x)
	}
	ended, cancel := context.WithCancel(ctx)
	cancel()
	for i := len(prepared) - 1; i >= 0; i-- {
		if _, err := prepared[i].Run(ended); !errors.Is(err, context.Canceled) {
			t.Fatalf("typed receive %d run with an ended context: %v", i, err)
		}
	}
	sent := make(chan error, 1)
	go func() { // a typed send returns once the receiver has its data
		for _, m := range []byte("ab") {
			if err := ts[0].SendTyped(ctx, 1, 40, []byte{m}, bytesType, 1); err != nil {
				sent <- err
				return
			}
		}
		sent <- nil
	}()
	for _, want := range []byte("ab") {
		got := make([]byte, 1)
		if _, err := ts[1].RecvTyped(ctx, 0, 40, got, bytesType, 1); err != nil || got[0] != want {
			t.Fatalf("typed receive: %q %v, want %q", got, err, want)
		}
	}
	if err := <-sent; err != nil {
		t.Fatal(err)
	}
}
