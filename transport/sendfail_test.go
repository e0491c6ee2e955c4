package transport

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"testing"
	"time"
)

// failSendPosts makes rank tr's posts of USER sends to (dst, tag) fail at
// once with err until the returned function is called.
func failSendPosts(tr *Transport, dst, tag int, err error) (stop func()) {
	return setFault(tr, &tr.sendPostFault, func(d, tg int) error {
		if d == dst && tg == tag {
			return err
		}
		return nil
	})
}

// setFault sets one of tr's fault hooks, *hook, to f under the lock that
// guards it, until the returned function is called.
func setFault[F any](tr *Transport, hook *F, f F) (stop func()) {
	tr.mu.Lock()
	*hook = f
	tr.mu.Unlock()
	return func() {
		var none F
		tr.mu.Lock()
		*hook = none
		tr.mu.Unlock()
	}
}

// waitResult is what a Wait returned.
type waitResult struct {
	st  Status
	err error
}

// waitAsync waits for r in a goroutine of its own.
func waitAsync(ctx context.Context, r *Request) <-chan waitResult {
	ch := make(chan waitResult, 1)
	go func() {
		st, err := r.Wait(ctx)
		ch <- waitResult{st, err}
	}()
	return ch
}

// A send whose post fails at once (an endpoint error or out of memory at
// that instant) gives its (destination, tag) sequence number back: the
// next send to that pair is received by an ordinary receive. Before the
// fix the failed send kept the number, the next message went out under
// the one after it, and the receive, which waits for the number the failed
// send took, never matched it.
func TestSendPostFailureKeepsSequence(t *testing.T) {
	injected := errors.New("injected post failure")
	// Each flavour fails its post once, then sends for real.
	flavours := []struct {
		name string
		send func(ctx context.Context, tr *Transport, tag int, b []byte) error
	}{
		{"Send", func(ctx context.Context, tr *Transport, tag int, b []byte) error {
			return tr.Send(ctx, 1, tag, b)
		}},
		{"Isend", func(ctx context.Context, tr *Transport, tag int, b []byte) error {
			r, err := tr.Isend(1, tag, b)
			if err != nil {
				return err
			}
			_, err = r.Wait(ctx)
			return err
		}},
		{"SendIOV", func(ctx context.Context, tr *Transport, tag int, b []byte) error {
			h := len(b) / 2
			return tr.SendIOV(ctx, 1, tag, [][]byte{b[:h], b[h:]})
		}},
	}
	for _, mode := range []ProgressMode{ProgressDirect, ProgressQueue} {
		for _, cfg := range [][2]string{{"off", "on"}, {"on", "on"}, {"off", "off"}} {
			engine, cma := cfg[0], cfg[1]
			t.Run(fmt.Sprintf("%s/engine-%s/cma-%s", mode, engine, cma), func(t *testing.T) {
				t.Setenv(OverlapEnv, engine)
				t.Setenv("TROUPE_CMA", cma)
				ts := localJob(t, 2, mode)
				ctx := testCtx(t)
				tag := 20
				// 8 B: eager; 1 MiB: the CMA descriptor between ranks of
				// one host, UCX's rendezvous with CMA off.
				for _, n := range []int{8, 1 << 20} {
					for _, f := range flavours {
						tag++
						// A message before the failure, so the failed
						// send's number is not the first.
						first := pattern(n, 1)
						got := make([]byte, n)
						rr, err := ts[1].Irecv(0, tag, got)
						if err != nil {
							t.Fatal(err)
						}
						// The receiving rank waits in the library while the
						// sender sends, as a rank of a job would: with the
						// engine on, a rendezvous transfer it onloads waits
						// for the receiver's next call (docs/overlap.md).
						recvd := waitAsync(ctx, rr)
						if err := f.send(ctx, ts[0], tag, first); err != nil {
							t.Fatalf("%s %d B: first send: %v", f.name, n, err)
						}
						if res := <-recvd; res.err != nil || res.st.Size != n || !bytes.Equal(got, first) {
							t.Fatalf("%s %d B: first receive: %+v %v", f.name, n, res.st, res.err)
						}

						stop := failSendPosts(ts[0], 1, tag, injected)
						err = f.send(ctx, ts[0], tag, pattern(n, 2))
						stop()
						if !errors.Is(err, injected) {
							t.Fatalf("%s %d B: failed send returned %v, want the injected failure", f.name, n, err)
						}

						want := pattern(n, 3)
						rr, err = ts[1].Irecv(0, tag, got)
						if err != nil {
							t.Fatal(err)
						}
						// The guard against a message that is never matched
						// (a rendezvous send waits for its receiver).
						wctx, cancel := context.WithTimeout(ctx, 5*time.Second)
						recvd = waitAsync(wctx, rr)
						if err := f.send(wctx, ts[0], tag, want); err != nil {
							cancel()
							t.Fatalf("%s %d B: send after the failed one: %v", f.name, n, err)
						}
						res := <-recvd
						cancel()
						st, err := res.st, res.err
						if err != nil {
							t.Fatalf("%s %d B: receive after the failed send: %v", f.name, n, err)
						}
						if st.Size != n || st.Source != 0 || st.Tag != tag || !bytes.Equal(got, want) {
							t.Fatalf("%s %d B: receive after the failed send: status %+v, data equal %v", f.name, n, st, bytes.Equal(got, want))
						}
					}
				}
			})
		}
	}
}
