package transport

import (
	"bytes"
	"context"
	"errors"
	"testing"
	"time"

	"github.com/troupe-hpc/troupe/datatype"
)

// A typed send whose context has already ended when it is called still
// sends its message (SendTypedWith's contract), whatever the race between
// ctx and the completion of the RTS/CTS requests: the receiver, posted
// first, gets every message. (Found by review, 2026-11-25: a step whose
// request finished just as ctx ended was taken for failed, not paused,
// and the rest of the transfer was never sent.)
func TestTypedSendEndedContextRace(t *testing.T) {
	for _, c := range []struct {
		name    string
		scheme  datatype.Scheme
		mode    ProgressMode
		chunked bool
	}{ // the chunked pack case is slow (2 MiB an iteration): fewer of them
		{"pack-chunked-queue", datatype.SchemePack, ProgressQueue, true},
		{"sgl-queue", datatype.SchemeSGL, ProgressQueue, false},
		{"zcopy-queue", datatype.SchemeZCopy, ProgressQueue, false},
		{"pack-queue", datatype.SchemePack, ProgressQueue, false},
		{"sgl-direct", datatype.SchemeSGL, ProgressDirect, false},
	} {
		t.Run(c.name, func(t *testing.T) {
			ts := localJobWith(t, 2, Options{Progress: c.mode, WaitSpin: time.Nanosecond})
			ctx := testCtx(t)
			vec := probeVector(t)
			if c.chunked { // 2 MiB packed: 16 chunks, more than the 4 a pack sender keeps in flight
				var err error
				if vec, err = datatype.Vector(2048, 128, 256, datatype.Float64); err != nil {
					t.Fatal(err)
				}
			}
			o := TypedOptions{Scheme: c.scheme}
			span := int(vec.Extent())
			ended, cancel := context.WithCancel(ctx)
			cancel()
			iters := 200
			if c.chunked {
				iters = 50
			}
			for i := range iters {
				src := pattern(span, i)
				dst := bytes.Repeat([]byte{0xee}, span)
				got := make(chan error, 1)
				rr, err := ts[1].PrepareRecvTyped(0, 7, dst, vec, 1, o)
				if err != nil {
					t.Fatal(err)
				}
				go func() {
					rctx, rcancel := context.WithTimeout(ctx, 5*time.Second)
					defer rcancel()
					_, err := rr.Run(rctx)
					got <- err
				}()
				serr := ts[0].SendTypedWith(ended, 1, 7, src, vec, 1, o)
				if serr != nil && !errors.Is(serr, context.Canceled) {
					t.Fatalf("iteration %d: send: %v", i, serr)
				}
				select {
				case err := <-got:
					if err != nil {
						t.Fatalf("iteration %d: typed receive: %v", i, err)
					}
				case <-time.After(10 * time.Second): // a detector, not synchronisation
					t.Fatalf("iteration %d: the receiver matched the RTS and still waits for the data 10 s after the send returned %v", i, serr)
				}
				if d := blockDiff(dst, src, 1024, 2048); d != "" {
					t.Fatalf("iteration %d: %s", i, d)
				}
			}
		})
	}
}
