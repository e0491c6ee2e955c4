package integration

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"runtime"
	"strings"
	"testing"

	dt "github.com/troupe-hpc/troupe/datatype"
	"github.com/troupe-hpc/troupe/datatype/layouts"
	"github.com/troupe-hpc/troupe/transport"
)

// Typed (noncontiguous) transfers between real processes over real UCX
// (issue 5): the correctness matrix (every scheme x every layout of
// shared/ddt-layouts.md x same or different receive layout with the same
// type signature x TCP and shared memory), cache behaviour through the
// counters, and the error paths.

var ncSchemes = []dt.Scheme{dt.SchemePack, dt.SchemeSGL, dt.SchemeZCopy, dt.SchemeAuto}

// ncVariants are the receive layouts: the sender's own layout, the packed
// data as a contiguous array, and an indexed type of irregular blocks; the
// last two have the sender's type signature.
var ncVariants = []string{"same", "contig", "indexed"}

const ncSentinel = 0xee

func init() {
	for _, name := range layouts.Names {
		for _, v := range ncVariants {
			scenarios["ncmatrix/"+name+"/"+v] = ncMatrix(name, v)
		}
	}
	scenarios["nccache"] = ncCache
	scenarios["ncerrors"] = ncErrors
	scenarios["ncregfail"] = ncRegFail
}

// recvLayout builds the receive type of a variant for layout l, with the
// allocation and origin it needs.
func recvLayout(l layouts.Layout, variant string) (*dt.Type, int64, int64, error) {
	if variant == "same" {
		return l.Type, l.Alloc, l.Base, nil
	}
	runs, err := l.Type.TypeSignature(1)
	if err != nil {
		return nil, 0, 0, fmt.Errorf("%s is not homogeneous: %w", l.Name, err)
	}
	basic := runs[0].Type
	n := runs[0].Count
	if variant == "contig" {
		t, err := dt.Contiguous(n, basic)
		return t, n * basic.Size(), 0, err
	}
	// indexed: blocks of 3, 5, 1, 7 elements with one-element gaps.
	var lens, disps []int64
	pat := []int64{3, 5, 1, 7}
	var at, left int64 = 0, n
	for i := 0; left > 0; i++ {
		b := min(pat[i%len(pat)], left)
		lens, disps = append(lens, b), append(disps, at)
		at += b + 1
		left -= b
	}
	t, err := dt.Indexed(lens, disps, basic)
	return t, at * basic.Size(), 0, err
}

// ncMatrix: rank 0 sends layout name with every scheme to rank 1, which
// receives it into the variant's layout with the same scheme and checks the
// bytes and that every byte outside the layout kept its sentinel.
func ncMatrix(name, variant string) scenario {
	return func(ctx context.Context, r *rank) error {
		t := r.t
		l, err := layouts.Build(name)
		if err != nil {
			return err
		}
		src := make([]byte, l.Alloc)
		layouts.Fill(src, l.Base)
		packed := make([]byte, l.Packed)
		if _, err := l.Type.Pack(packed, src, l.Base, 1); err != nil {
			return err
		}
		tag := 0
		{
			rt, alloc, base, err := recvLayout(l, variant)
			if err != nil {
				return err
			}
			var dst, want []byte
			if r.id() == 1 {
				want = bytes.Repeat([]byte{ncSentinel}, int(alloc))
				if _, err := rt.Unpack(want, packed, base, 1); err != nil {
					return fmt.Errorf("%s/%s: reference unpack: %w", name, variant, err)
				}
				dst = make([]byte, alloc)
			}
			for _, s := range ncSchemes {
				tag++
				o := transport.TypedOptions{Scheme: s}
				// The adaptive default runs several times so that it sees
				// the layout cached (and maybe registered).
				reps := 1
				if s == dt.SchemeAuto {
					reps = 3
				}
				for rep := 0; rep < reps; rep++ {
					what := fmt.Sprintf("%s/%s/%v #%d", name, variant, s, rep)
					switch r.id() {
					case 0:
						o.Base = int(l.Base)
						if err := t.SendTypedWith(ctx, 1, tag, src, l.Type, 1, o); err != nil {
							return fmt.Errorf("%s: send: %w", what, err)
						}
					case 1:
						fillSentinel(dst)
						o.Base = int(base)
						st, err := t.RecvTypedWith(ctx, 0, tag, dst, rt, 1, o)
						if err != nil {
							return fmt.Errorf("%s: recv: %w", what, err)
						}
						if err := checkStatus(st, 0, tag, int(l.Packed)); err != nil {
							return fmt.Errorf("%s: %w", what, err)
						}
						if d := diff(dst, want); d != "" {
							return fmt.Errorf("%s: %s", what, d)
						}
					}
				}
			}
		}
		st := t.NoncontigStats()
		r.logf("%s/%s: all schemes ok; sent %+v received %+v, %d chunks on several goroutines", name, variant, st.Sent, st.Received, st.ParallelChunks)
		if r.id() == 1 && (st.Received.Pack == 0 || st.Received.SGL == 0 || st.Received.ZCopy == 0) {
			return fmt.Errorf("%s: a scheme was never used: %+v", name, st.Received)
		}
		// Page-bound layouts (nas_mg_x) pack and unpack their host-pack
		// chunks on several goroutines when the rank has more than one P;
		// no other layout does.
		mine := l.Type
		if r.id() == 1 {
			if mine, _, _, err = recvLayout(l, variant); err != nil {
				return err
			}
		}
		paged := mine.Workers(1, runtime.GOMAXPROCS(0)) > 1
		if chunks := l.Packed / int64(transport.DefaultNoncontigOptions().PackChunk); paged && st.ParallelChunks < chunks || !paged && st.ParallelChunks != 0 {
			return fmt.Errorf("%s/%s: %d chunks moved on several goroutines (page-bound %v, GOMAXPROCS %d)",
				name, variant, st.ParallelChunks, paged, runtime.GOMAXPROCS(0))
		}
		return nil
	}
}

// ncCache: a layout used again costs no registration and, for windows, no
// key exchange; the adaptive default moves from pack to zero-copy once the
// layout is registered in the background; the key pool is refilled.
func ncCache(ctx context.Context, r *rank) error {
	t := r.t
	// The UMR paper's window bound (blocks >= 512 B) instead of this
	// machine's default, so that the adaptive default reaches the windows.
	o := transport.DefaultNoncontigOptions()
	o.Thresholds.WindowMinBlock = 512
	if err := t.SetNoncontigOptions(o); err != nil {
		return err
	}
	vec, err := dt.Vector(64, 2048, 4096, dt.Float64) // 64 blocks of 16 KiB
	if err != nil {
		return err
	}
	buf := make([]byte, vec.Extent())
	copy(buf, pattern(len(buf), 11))
	peer := 1 - r.id()
	xfer := func(tag int, s dt.Scheme) error {
		o := transport.TypedOptions{Scheme: s}
		if r.id() == 0 {
			return t.SendTypedWith(ctx, peer, tag, buf, vec, 1, o)
		}
		_, err := t.RecvTypedWith(ctx, peer, tag, buf, vec, 1, o)
		return err
	}
	before := t.NoncontigStats()
	for i := 0; i < 4; i++ {
		if err := xfer(1, dt.SchemeZCopy); err != nil {
			return fmt.Errorf("zcopy #%d: %w", i, err)
		}
	}
	after := t.NoncontigStats()
	regs := after.Registrations - before.Registrations
	if regs != 1 {
		return fmt.Errorf("4 zcopy transfers of one layout made %d registrations, want 1", regs)
	}
	if after.WindowMaps-before.WindowMaps != 1 {
		return fmt.Errorf("4 zcopy transfers mapped %d window sets, want 1", after.WindowMaps-before.WindowMaps)
	}
	if r.id() == 1 {
		if x, o := after.KeyExchanges-before.KeyExchanges, after.KeysOmitted-before.KeysOmitted; x != 1 || o != 3 {
			return fmt.Errorf("receiver: %d key exchanges and %d CTS without keys, want 1 and 3", x, o)
		}
	} else if h := after.RemoteKeyHits - before.RemoteKeyHits; h != 3 {
		return fmt.Errorf("sender: %d remote window cache hits, want 3", h)
	}
	r.logf("second use of a layout: no registration, no key exchange")

	// Adaptive: first use goes pack and starts the background registration;
	// once both sides are registered it goes zero-copy. Each round is a
	// real transfer (no sleeping); the registrar needs a few at most.
	abuf := make([]byte, vec.Extent())
	adaptive := func(tag int) error {
		if r.id() == 0 {
			return t.SendTyped(ctx, peer, tag, abuf, vec, 1)
		}
		_, err := t.RecvTyped(ctx, peer, tag, abuf, vec, 1)
		return err
	}
	s0 := t.NoncontigStats()
	if err := adaptive(2); err != nil {
		return err
	}
	s1 := t.NoncontigStats()
	if s1.Sent.Pack+s1.Received.Pack != s0.Sent.Pack+s0.Received.Pack+1 {
		return fmt.Errorf("first adaptive use did not go pack: %+v -> %+v", s0, s1)
	}
	switched := -1
	for i := 0; i < 200 && switched < 0; i++ {
		if err := adaptive(2); err != nil {
			return err
		}
		// Both ranks see the same transfers, so they leave together.
		if s := t.NoncontigStats(); s.Sent.ZCopy+s.Received.ZCopy > s1.Sent.ZCopy+s1.Received.ZCopy {
			switched = i + 1
		}
	}
	if switched < 0 {
		return fmt.Errorf("adaptive never switched to zero-copy in 200 transfers")
	}
	r.logf("adaptive switched to zero-copy after %d transfers", switched)
	return nil
}

// ncErrors: a signature mismatch and a receive layout too small fail on
// both sides with *TypeMismatchError, and the pair keeps working.
func ncErrors(ctx context.Context, r *rank) error {
	t := r.t
	f64, err := dt.Vector(16, 4, 8, dt.Float64)
	if err != nil {
		return err
	}
	i64, err := dt.Vector(16, 4, 8, dt.Int64)
	if err != nil {
		return err
	}
	small, err := dt.Contiguous(32, dt.Float64)
	if err != nil {
		return err
	}
	buf := make([]byte, f64.Extent())
	for _, s := range []dt.Scheme{dt.SchemePack, dt.SchemeSGL, dt.SchemeZCopy} {
		o := transport.TypedOptions{Scheme: s}
		for i, rt := range []*dt.Type{i64, small} {
			tag := 10*int(s) + i
			var err error
			if r.id() == 0 {
				err = t.SendTypedWith(ctx, 1, tag, buf, f64, 1, o)
			} else {
				_, err = t.RecvTypedWith(ctx, 0, tag, buf, rt, 1, o)
			}
			var me *transport.TypeMismatchError
			if !errors.As(err, &me) {
				return fmt.Errorf("%v %v: got %v, want *TypeMismatchError", s, rt, err)
			}
			wantIs := transport.ErrTypeMismatch
			if rt == small {
				wantIs = transport.ErrTruncated
			}
			if !errors.Is(err, wantIs) {
				return fmt.Errorf("%v %v: %v is not %v", s, rt, err, wantIs)
			}
		}
		// And a good transfer right after.
		if r.id() == 0 {
			err = t.SendTypedWith(ctx, 1, 99, buf, f64, 1, o)
		} else {
			_, err = t.RecvTypedWith(ctx, 0, 99, buf, f64, 1, o)
		}
		if err != nil {
			return fmt.Errorf("%v: transfer after the errors: %w", s, err)
		}
	}
	if st := t.NoncontigStats(); st.Errors != 6 {
		return fmt.Errorf("%d errors counted, want 6", st.Errors)
	}
	r.logf("mismatch and too-small fail on both sides")
	return nil
}

// ncRegFail: with every registration failing, zero-copy falls back to pack,
// the data still arrives and the failures and fallbacks are counted.
func ncRegFail(ctx context.Context, r *rank) error {
	t := r.t
	o := transport.DefaultNoncontigOptions()
	o.FailRegistration = true
	if err := t.SetNoncontigOptions(o); err != nil {
		return err
	}
	vec, err := dt.Vector(8, 1024, 2048, dt.Float64)
	if err != nil {
		return err
	}
	src := pattern(int(vec.Extent()), 5)
	dst := bytes.Repeat([]byte{ncSentinel}, len(src))
	want := bytes.Repeat([]byte{ncSentinel}, len(src))
	packed := make([]byte, 8*8192)
	if _, err := vec.Pack(packed, src, 0, 1); err != nil {
		return err
	}
	if _, err := vec.Unpack(want, packed, 0, 1); err != nil {
		return err
	}
	for i := 0; i < 3; i++ {
		so := transport.TypedOptions{Scheme: dt.SchemeZCopy}
		if r.id() == 0 {
			err = t.SendTypedWith(ctx, 1, 1, src, vec, 1, so)
		} else {
			_, err = t.RecvTypedWith(ctx, 0, 1, dst, vec, 1, so)
			if err == nil {
				if d := diff(dst, want); d != "" {
					return fmt.Errorf("fallback transfer %d: %s", i, d)
				}
			}
		}
		if err != nil {
			return fmt.Errorf("transfer %d: %w", i, err)
		}
	}
	st := t.NoncontigStats()
	if st.RegistrationFailures != 1 || st.Fallbacks != 3 || st.Sent.ZCopy+st.Received.ZCopy != 0 || st.Sent.Pack+st.Received.Pack != 3 {
		return fmt.Errorf("counters after failing registrations: %+v", st)
	}
	r.logf("registration failure fell back to pack")
	return nil
}

// fillSentinel sets every byte of b to ncSentinel with a few large copies
// (a byte loop over the 273 MB NAS allocations is slow under -race).
func fillSentinel(b []byte) {
	if len(b) == 0 {
		return
	}
	b[0] = ncSentinel
	for done := 1; done < len(b); done *= 2 {
		copy(b[done:], b[:done])
	}
}

func forNCTLS(t *testing.T, f func(t *testing.T, c cfg)) {
	for _, tls := range []string{"tcp", "shm"} {
		t.Run(tls, func(t *testing.T) { f(t, cfg{tls, "direct"}) })
	}
}

func TestNoncontigMatrix(t *testing.T) {
	forNCTLS(t, func(t *testing.T, c cfg) {
		for _, name := range layouts.Names {
			for _, v := range ncVariants {
				t.Run(name+"/"+v, func(t *testing.T) {
					res := runJob(t, "ncmatrix/"+name+"/"+v, 2, c)
					if !strings.Contains(res.stdout, fmt.Sprintf("[1] rank 1: %s/%s: all schemes ok", name, v)) {
						t.Fatalf("no success line:\n%s", res.dump())
					}
				})
			}
		}
	})
}

func TestNoncontigCache(t *testing.T) {
	forNCTLS(t, func(t *testing.T, c cfg) {
		res := runJob(t, "nccache", 2, c)
		for _, line := range []string{"[1] rank 1: second use of a layout: no registration, no key exchange", "rank 0: adaptive switched to zero-copy"} {
			if !strings.Contains(res.stdout, line) {
				t.Fatalf("missing %q:\n%s", line, res.dump())
			}
		}
	})
}

func TestNoncontigErrors(t *testing.T) {
	forNCTLS(t, func(t *testing.T, c cfg) {
		res := runJob(t, "ncerrors", 2, c)
		if !strings.Contains(res.stdout, "[0] rank 0: mismatch and too-small fail on both sides") {
			t.Fatalf("no error line:\n%s", res.dump())
		}
	})
}

func TestNoncontigRegistrationFailure(t *testing.T) {
	forNCTLS(t, func(t *testing.T, c cfg) {
		res := runJob(t, "ncregfail", 2, c)
		if !strings.Contains(res.stdout, "[1] rank 1: registration failure fell back to pack") {
			t.Fatalf("no fallback line:\n%s", res.dump())
		}
	})
}
