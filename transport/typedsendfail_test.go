package transport

import (
	"bytes"
	"context"
	"errors"
	"testing"
	"time"

	"github.com/troupe-hpc/troupe/datatype"
)

// failRTSPosts makes rank tr's posts of typed sends' RTSs to (dst, tag)
// fail at once with err until the returned function is called.
func failRTSPosts(tr *Transport, dst, tag int, err error) (stop func()) {
	return setFault(tr, &tr.rtsPostFault, func(d, tg int) error {
		if d == dst && tg == tag {
			return err
		}
		return nil
	})
}

// typedRecvsPosted counts rank tr's typed protocol receives from peer in
// UCX.
func typedRecvsPosted(tr *Transport, peer int) int {
	tr.mu.Lock()
	defer tr.mu.Unlock()
	n := 0
	for _, r := range tr.ops {
		if r.recv && r.peer == peer && r.op == "typed recv" {
			n++
		}
	}
	return n
}

// A typed send whose RTS fails at its post (an endpoint error or out of
// memory at that instant) fails with that error and leaves nothing
// posted: before the fix the receive it posted for the receiver's CTS or
// acknowledgement stayed in UCX for good (a leaked request, which would
// take the reply of the transfer that reuses its transfer id), and a
// chunked pack send sent its chunks anyway and waited for good for a
// receiver that never heard of them. Every scheme, both progress modes;
// the next typed send goes.
func TestTypedSendRTSPostFailureWithdrawsReply(t *testing.T) {
	small, err := datatype.Vector(4, 2, 4, datatype.Int16) // inline in the RTS
	if err != nil {
		t.Fatal(err)
	}
	// 2 MiB packed: 16 chunks, more than the 4 in flight.
	large, err := datatype.Vector(2048, 128, 256, datatype.Float64)
	if err != nil {
		t.Fatal(err)
	}
	injected := errors.New("injected RTS post failure")
	forModes(t, func(t *testing.T, mode ProgressMode) {
		ts := localJob(t, 2, mode)
		ctx := testCtx(t)
		vec := probeVector(t)
		tag := 30
		for _, c := range []struct {
			name          string
			scheme        datatype.Scheme
			dt            *datatype.Type
			block, stride int // in bytes
		}{
			{"inline", datatype.SchemePack, small, 4, 8},
			{"pack", datatype.SchemePack, vec, 1024, 2048},
			{"pack-chunked", datatype.SchemePack, large, 1024, 2048},
			{"sgl", datatype.SchemeSGL, vec, 1024, 2048},
			{"zcopy", datatype.SchemeZCopy, vec, 1024, 2048},
		} {
			tag++
			o := TypedOptions{Scheme: c.scheme}
			span := int(c.dt.Extent())
			src := pattern(span, tag)
			stop := failRTSPosts(ts[0], 1, tag, injected)
			sctx, cancel := context.WithTimeout(ctx, 10*time.Second) // a failure guard
			err := ts[0].SendTypedWith(sctx, 1, tag, src, c.dt, 1, o)
			cancel()
			stop()
			if !errors.Is(err, injected) {
				t.Fatalf("%s: typed send whose RTS post failed: %v, want the post's error", c.name, err)
			}
			// Withdrawn under the worker lock as the RTS failed, before
			// the send could see its failure.
			if n := typedRecvsPosted(ts[0], 1); n != 0 {
				t.Fatalf("%s: %d typed receives still posted after the send failed at its RTS (its reply's receive was left posted)", c.name, n)
			}
			// The next typed send (its own tag: the failed one's number
			// is not given back, docs/transport.md) goes.
			tag++
			sent := sendTypedAsync(ctx, ts[0], 1, tag, src, c.dt, o)
			dst := bytes.Repeat([]byte{0xee}, span)
			if _, err := ts[1].RecvTypedWith(ctx, 0, tag, dst, c.dt, 1, o); err != nil {
				t.Fatalf("%s: typed receive after the failure: %v", c.name, err)
			}
			if err := <-sent; err != nil {
				t.Fatalf("%s: typed send after the failure: %v", c.name, err)
			}
			if d := blockDiff(dst, src, c.block, c.stride); d != "" {
				t.Fatalf("%s: typed message after the failure: %s", c.name, d)
			}
		}
	})
}
