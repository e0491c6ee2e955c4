package transport

import (
	"context"
	"errors"
	"fmt"
	"runtime"
	"testing"
	"time"
)

// A goroutine blocked in a receive or a probe (nothing will arrive)
// returns ErrClosed when another goroutine closes the transport, in both
// progress modes (found by review 2026-11-25: probes stayed blocked until
// their own context ended, as Close woke no probe waiting for an arrival).
func TestCloseWakesBlockedCalls(t *testing.T) {
	for _, mode := range []ProgressMode{ProgressDirect, ProgressQueue} {
		for _, op := range []string{"recv", "wait", "waitany", "probe", "mprobe", "probe-any", "probetyped"} {
			t.Run(fmt.Sprintf("%v/%s", mode, op), func(t *testing.T) {
				ts := localJob(t, 2, mode)
				// The blocked call's own context outlasts the test's
				// patience: only Close may end it.
				ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
				defer cancel()
				got := make(chan error, 1)
				buf := make([]byte, 8)
				go func() {
					var err error
					switch op {
					case "recv":
						_, err = ts[1].Recv(ctx, 0, 3, buf)
					case "wait":
						var r *Request
						if r, err = ts[1].Irecv(0, 3, buf); err == nil {
							_, err = r.Wait(ctx)
						}
					case "waitany":
						var r *Request
						if r, err = ts[1].Irecv(0, 3, buf); err == nil {
							_, _, err = WaitAny(ctx, []*Request{r})
						}
					case "probe":
						_, err = ts[1].Probe(ctx, 0, 3)
					case "mprobe":
						_, err = ts[1].Mprobe(ctx, 0, 3)
					case "probe-any":
						_, err = ts[1].Probe(ctx, AnySource, 3)
					case "probetyped":
						_, err = ts[1].ProbeTyped(ctx, 0, 3)
					}
					got <- err
				}()
				for { // until the call has parked, or waits for an arrival
					ts[1].mu.Lock()
					probing := ts[1].arrival != nil
					ts[1].mu.Unlock()
					if probing || ts[1].parked.Load() > 0 {
						break
					}
					select {
					case err := <-got:
						t.Fatalf("returned before Close: %v", err)
					default:
					}
					runtime.Gosched()
				}
				go ts[1].Close()
				select {
				case err := <-got:
					if !errors.Is(err, ErrClosed) {
						t.Fatalf("after Close: %v, want ErrClosed", err)
					}
				case <-time.After(10 * time.Second):
					t.Fatal("still blocked 10 s after Close")
				}
			})
		}
	}
}
