package transport

import (
	"bytes"
	"context"
	"errors"
	"testing"
	"time"

	"github.com/troupe-hpc/troupe/datatype"
)

// A prepared typed send run inside an active-message handler is refused
// with ErrInHandler before anything leaves, and stays runnable: run
// outside the handler, its message goes. (Found by review, 2026-11-25:
// Run posted its RTS, then its first wait was refused, and the receiver
// that matched the RTS waited for ever.)
func TestHandlerRunsPreparedTypedSend(t *testing.T) {
	for _, scheme := range []datatype.Scheme{datatype.SchemeSGL, datatype.SchemePack} {
		t.Run(scheme.String(), func(t *testing.T) {
			ts := localJob(t, 2, ProgressQueue)
			ctx := testCtx(t)
			vec := probeVector(t)
			o := TypedOptions{Scheme: scheme}
			span := int(vec.Extent())
			src := pattern(span, 3)
			x, err := ts[0].PrepareSendTyped(1, 9, src, vec, 1, o)
			if err != nil {
				t.Fatal(err)
			}
			runErr := inHandler(ctx, t, ts, 1, 0, func() error {
				_, err := x.Run(ctx)
				return err
			})
			t.Logf("Run in a handler: %v", runErr)
			if runErr != nil && !errors.Is(runErr, ErrInHandler) {
				t.Fatalf("Run in a handler: %v", runErr)
			}
			if runErr != nil {
				// Refused: it must be runnable outside the handler.
				go func() { _, _ = x.Run(ctx) }() // its outcome: the receive's below
			}
			dst := bytes.Repeat([]byte{0xee}, span)
			got := make(chan error, 1)
			go func() {
				rctx, rcancel := context.WithTimeout(ctx, 5*time.Second)
				defer rcancel()
				_, err := ts[1].RecvTypedWith(rctx, 0, 9, dst, vec, 1, o)
				got <- err
			}()
			select {
			case err := <-got:
				if err != nil {
					t.Fatalf("typed receive after the handler's Run (%v): %v", runErr, err)
				}
			case <-time.After(10 * time.Second): // a detector, not synchronisation
				t.Fatalf("Run in a handler returned %v, and the receiver still waits for its message 10 s on", runErr)
			}
			if d := blockDiff(dst, src, 1024, 2048); d != "" {
				t.Fatal(d)
			}
		})
	}
}
