package transport

import (
	"bytes"
	"errors"
	"fmt"
	"testing"

	"github.com/troupe-hpc/troupe/datatype"
)

// Layouts are evicted (MaxLayouts 2) while typed receives are being posted
// on other goroutines. Evicting released the layout's registration under
// the worker lock while holding nc.mu, and posting a receive counts its RTS
// receive under nc.mu while holding the worker lock: both ranks froze for
// good (in 1 of 2 to 30 runs). Every transfer must complete with the right
// bytes.
func TestLayoutEvictionWhilePostingNoDeadlock(t *testing.T) {
	ts := localJob(t, 2, ProgressDirect)
	for _, tr := range ts {
		if err := tr.SetNoncontigOptions(NoncontigOptions{MaxLayouts: 2, KeyPool: 4}); err != nil {
			t.Fatal(err)
		}
	}
	ctx := testCtx(t)
	vec, err := datatype.Vector(64, 128, 256, datatype.Float64) // 64 blocks of 1 KiB, stride 2 KiB
	if err != nil {
		t.Fatal(err)
	}
	span := int(vec.Extent())
	const workers, rounds = 4, 100
	errs := make(chan error, workers)
	for g := range workers {
		go func() {
			o := TypedOptions{Scheme: datatype.SchemeAuto}
			if g%2 == 0 {
				o.Scheme = datatype.SchemeZCopy
			}
			for i := range rounds {
				src := pattern(span, g*rounds+i)
				dst := bytes.Repeat([]byte{0xee}, span)
				rr, err := ts[1].IrecvTypedWith(0, 20+g, dst, vec, 1, o)
				if err == nil {
					err = ts[0].SendTypedWith(ctx, 1, 20+g, src, vec, 1, o)
				}
				if err == nil {
					_, err = rr.Wait(ctx)
				}
				if err == nil {
					if d := vectorDiff(dst, src); d != "" {
						err = fmt.Errorf("wrong bytes: %s", d)
					}
				}
				if err != nil {
					errs <- fmt.Errorf("goroutine %d, transfer %d: %w", g, i, err)
					return
				}
			}
			errs <- nil
		}()
	}
	for range workers {
		if err := <-errs; err != nil {
			t.Fatal(err)
		}
	}
}

// Deregister(buf), which docs/noncontig.md asks for before memory that
// typed zero-copy transfers used is freed, also drops the layouts over it:
// the next zero-copy receive into buf registers it anew and its sender
// gets fresh keys. The layout kept the invalidated registration, and the
// sender reused the old keys (with RDMA, into the old pages).
func TestDeregisterDropsLayouts(t *testing.T) {
	ts := localJob(t, 2, ProgressDirect)
	ctx := testCtx(t)
	vec, err := datatype.Vector(64, 128, 256, datatype.Float64)
	if err != nil {
		t.Fatal(err)
	}
	span := int(vec.Extent())
	dst := make([]byte, span)
	transfer := func(seed int) {
		t.Helper()
		o := TypedOptions{Scheme: datatype.SchemeZCopy}
		src := pattern(span, seed)
		for i := range dst {
			dst[i] = 0xee // the gaps must stay untouched
		}
		rr, err := ts[1].IrecvTypedWith(0, 3, dst, vec, 1, o)
		if err != nil {
			t.Fatal(err)
		}
		if err := ts[0].SendTypedWith(ctx, 1, 3, src, vec, 1, o); err != nil {
			t.Fatal(err)
		}
		if _, err := rr.Wait(ctx); err != nil {
			t.Fatal(err)
		}
		if d := vectorDiff(dst, src); d != "" {
			t.Fatalf("transfer %d: %s", seed, d)
		}
	}
	transfer(1)
	transfer(2) // the layout's registration and keys are cached now
	before := ts[1].NoncontigStats()
	if n := ts[1].Deregister(dst); n == 0 {
		t.Fatal("Deregister invalidated nothing")
	}
	transfer(3)
	after := ts[1].NoncontigStats()
	if after.Registrations != before.Registrations+1 || after.KeysOmitted != before.KeysOmitted {
		t.Fatalf("after Deregister: receiver registrations %d -> %d (want one more), keys omitted %d -> %d (want none: fresh keys)",
			before.Registrations, after.Registrations, before.KeysOmitted, after.KeysOmitted)
	}
}

// A receive with TypedOptions.Refuse takes the next message of its (source,
// tag) and refuses it, whatever scheme the sender proposes: the receive
// fails with ErrRefused, the sender's transfer fails, nothing lands, and
// the next transfer on that (source, tag) goes through (the sequence stays
// in step).
func TestTypedRecvRefuse(t *testing.T) {
	vec, err := datatype.Vector(64, 128, 256, datatype.Float64)
	if err != nil {
		t.Fatal(err)
	}
	span := int(vec.Extent())
	for _, scheme := range []datatype.Scheme{datatype.SchemePack, datatype.SchemeSGL, datatype.SchemeZCopy} {
		t.Run(scheme.String(), func(t *testing.T) {
			ts := localJob(t, 2, ProgressDirect)
			ctx := testCtx(t)
			o := TypedOptions{Scheme: scheme}
			refused, err := ts[1].IrecvTypedWith(0, 4, nil, datatype.Byte, 0, TypedOptions{Refuse: true})
			if err != nil {
				t.Fatal(err)
			}
			if err := ts[0].SendTypedWith(ctx, 1, 4, pattern(span, 1), vec, 1, o); err == nil {
				t.Fatal("the refused transfer's send succeeded")
			}
			if _, err := refused.Wait(ctx); !errors.Is(err, ErrRefused) {
				t.Fatalf("refusing receive: %v, want ErrRefused", err)
			}
			dst := bytes.Repeat([]byte{0xee}, span)
			rr, err := ts[1].IrecvTypedWith(0, 4, dst, vec, 1, o)
			if err != nil {
				t.Fatal(err)
			}
			src := pattern(span, 2)
			if err := ts[0].SendTypedWith(ctx, 1, 4, src, vec, 1, o); err != nil {
				t.Fatal(err)
			}
			if _, err := rr.Wait(ctx); err != nil {
				t.Fatal(err)
			}
			if d := vectorDiff(dst, src); d != "" {
				t.Fatalf("the transfer after the refused one: %s", d)
			}
		})
	}
}
