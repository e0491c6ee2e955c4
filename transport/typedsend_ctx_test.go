package transport

import (
	"bytes"
	"context"
	"errors"
	"runtime"
	"testing"
	"time"

	"github.com/troupe-hpc/troupe/datatype"
)

// A typed send whose context ends after its RTS reached the receiver
// returns the context's error, and its message still goes, as a Send's
// does, inline in the RTS or by any scheme: the receiver posted afterwards gets it intact (before 2026-11-25
// the sender abandoned the protocol and such a receiver waited for its
// data for ever), and the next transfer into the same layout runs (the
// zero-copy receiver had marked the sender as holding window keys that
// never reached it).
func TestTypedSendContextEndsAfterRTS(t *testing.T) {
	small, err := datatype.Vector(4, 2, 4, datatype.Int16) // its data inline in the RTS
	if err != nil {
		t.Fatal(err)
	}
	// 2 MiB packed: 16 chunks, more than the 4 in flight a pack sender
	// keeps, so that it stops waiting for the receiver.
	large, err := datatype.Vector(2048, 128, 256, datatype.Float64)
	if err != nil {
		t.Fatal(err)
	}
	for _, c := range []struct {
		name          string
		scheme        datatype.Scheme
		dt            *datatype.Type
		block, stride int
	}{
		{"inline", datatype.SchemePack, small, 4, 8},
		{"pack", datatype.SchemePack, nil, 1024, 2048},
		{"pack-chunked", datatype.SchemePack, large, 1024, 2048},
		{"sgl", datatype.SchemeSGL, nil, 1024, 2048},
		{"zcopy", datatype.SchemeZCopy, nil, 1024, 2048},
	} {
		t.Run(c.name, func(t *testing.T) {
			ts := localJob(t, 2, ProgressQueue)
			ctx := testCtx(t)
			vec := probeVector(t)
			if c.dt != nil {
				vec = c.dt
			}
			o := TypedOptions{Scheme: c.scheme}
			span := int(vec.Extent())
			src := pattern(span, 5)
			sctx, cancel := context.WithCancel(ctx)
			sent := sendTypedAsync(sctx, ts[0], 1, 7, src, vec, o)
			for { // until the RTS has arrived (each probe progresses the worker)
				_, ok, err := ts[1].IprobeTyped(0, 7)
				if err != nil {
					t.Fatal(err)
				}
				if ok {
					break
				}
				if ctx.Err() != nil {
					t.Fatal("the typed message never arrived")
				}
				runtime.Gosched()
			}
			cancel()
			if err := <-sent; !errors.Is(err, context.Canceled) {
				t.Fatalf("typed send whose context ended before the receive: %v, want context.Canceled", err)
			}
			for round := range 2 {
				if round == 1 {
					src = pattern(span, 6)
					sent = sendTypedAsync(ctx, ts[0], 1, 7, src, vec, o)
				}
				rctx, rcancel := context.WithTimeout(ctx, 10*time.Second)
				dst := bytes.Repeat([]byte{0xee}, span)
				st, err := ts[1].RecvTypedWith(rctx, 0, 7, dst, vec, 1, o)
				rcancel()
				if err != nil {
					t.Fatalf("round %d: typed receive: %v", round, err)
				}
				if d := blockDiff(dst, src, c.block, c.stride); d != "" || st.Size != int(vec.Size()) {
					t.Fatalf("round %d: received %d bytes: %s", round, st.Size, d)
				}
			}
			if err := <-sent; err != nil {
				t.Fatal(err)
			}
		})
	}
}

// A typed send whose context has ended while an earlier send to the same
// (rank, tag) has not posted its RTS yet still goes after it: the
// receiver gets both messages in the order sent (before 2026-11-25 the
// send gave its place up, and the receive waiting for that place waited
// for ever).
func TestTypedSendContextEndsBeforeTurn(t *testing.T) {
	ts := localJob(t, 2, ProgressDirect)
	ctx := testCtx(t)
	bytesType, err := datatype.Contiguous(1, datatype.Byte)
	if err != nil {
		t.Fatal(err)
	}
	first, err := ts[0].PrepareSendTyped(1, 41, []byte("a"), bytesType, 1, TypedOptions{})
	if err != nil {
		t.Fatal(err)
	}
	ended, cancel := context.WithCancel(ctx)
	cancel()
	if err := ts[0].SendTyped(ended, 1, 41, []byte("b"), bytesType, 1); !errors.Is(err, context.Canceled) {
		t.Fatalf("typed send with an ended context behind a prepared one: %v, want context.Canceled", err)
	}
	ran := make(chan error, 1)
	go func() {
		_, err := first.Run(ctx)
		ran <- err
	}()
	rctx, rcancel := context.WithTimeout(ctx, 10*time.Second)
	defer rcancel()
	for _, want := range []byte("ab") {
		got := make([]byte, 1)
		if _, err := ts[1].RecvTyped(rctx, 0, 41, got, bytesType, 1); err != nil || got[0] != want {
			t.Fatalf("typed receive: %q %v, want %q", got, err, want)
		}
	}
	if err := <-ran; err != nil {
		t.Fatal(err)
	}
}
