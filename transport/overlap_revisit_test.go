package transport

import (
	"bytes"
	"context"
	"testing"
	"time"

	"github.com/troupe-hpc/troupe/overlap"
)

// localJobEach starts n in-process ranks, rank i with opts(i), closed when
// the test ends.
func localJobEach(t *testing.T, n int, opts func(rank int) Options) []*Transport {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	ts, stop, err := startLocal(ctx, n, opts)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(stop)
	return ts
}

// TestOverlapRevisitAbsentReceiver: with the engine on, a rank that posts a
// large receive and then does not call into its transport again does not
// hold its sender's blocking Send for ever. The engine may onload the
// transfer when its header arrives (the receiver was in the transport a
// moment ago), but it asks to revisit it, and the progress goroutine
// offloads it once the receiver has stayed away: the Send completes and
// the receive has the data. In direct and queue progress mode, over UCX
// rendezvous and over CMA, with the default engine (TROUPE_OVERLAP=on; it
// offloads at the header or at the revisit, depending on timing) and with
// an engine whose cost model is so slow (95 ns/B, so OffloadRatio*K is
// about 50 ms for 1 MiB) that it always onloads at the header and only
// the revisit can start the transfer. The progress goroutine's idle sleep
// is lengthened to ten minutes, so that only its bound by the earliest
// revisit time wakes it soon after the revisit (about 50 ms; the Send's
// time is logged, not asserted: timing is for benchmarks, and without the
// bound something else woke it after about 200 ms).
// Before the revisit, the Send hung in every run of the slow model.
func TestOverlapRevisitAbsentReceiver(t *testing.T) {
	old := idleWaitMax.Swap(int64(10 * time.Minute))
	t.Cleanup(func() { idleWaitMax.Store(old) })
	slow := overlap.DefaultConfig()
	slow.Alpha = 95
	if _, err := overlap.New(slow); err != nil {
		t.Fatal(err)
	}
	for _, engine := range []string{"default", "slow-model"} {
		for _, cma := range []string{"off", "on"} {
			for _, mode := range []ProgressMode{ProgressDirect, ProgressQueue} {
				t.Run(engine+"/cma-"+cma+"/"+mode.String(), func(t *testing.T) {
					t.Setenv("TROUPE_CMA", cma)
					var ts []*Transport
					if engine == "default" {
						t.Setenv(OverlapEnv, "on")
						ts = localJob(t, 2, mode)
					} else {
						ts = localJobEach(t, 2, func(int) Options {
							eng, _ := overlap.New(slow) // checked above
							return Options{Progress: mode, Overlap: eng}
						})
					}
					const n, tag = 1 << 20, 6
					want := pattern(n, 5)
					got := make([]byte, n)
					rr, err := ts[1].Irecv(0, tag, got)
					if err != nil {
						t.Fatal(err)
					}
					// Queue mode posts it on the progress goroutine: it must be
					// in the engine's table (expected) before the send starts.
					waitTable(t, ts[1], "the receive to be posted", func(s OverlapTable) bool { return s.Posted == 1 })
					// Rank 1 stays out of its transport until the Send is done.
					ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
					defer cancel()
					sent := time.Now()
					if err := ts[0].Send(ctx, 1, tag, want); err != nil {
						s, _ := ts[1].OverlapStats()
						t.Fatalf("blocking Send to a rank that posted its receive and stays away: %v (receiver's tables %+v, engine %+v)",
							err, ts[1].OverlapTable(), s)
					}
					took := time.Since(sent)
					st, err := rr.Wait(testCtx(t))
					if err != nil {
						t.Fatal(err)
					}
					if st.Size != n || !bytes.Equal(got, want) {
						t.Fatalf("received %d B, data intact %v", st.Size, bytes.Equal(got, want))
					}
					s, _ := ts[1].OverlapStats()
					t.Logf("Send took %v; engine: offloaded %d (revisited %d), onloaded %d", took, s.Offloaded, s.Revisited, s.Onloaded)
					if s.Offloaded != 1 || s.Onloaded != 0 || s.OnloadPending != 0 || s.Tracked != 0 {
						t.Fatalf("the transfer should count once, as offloaded (at its header or by a revisit): %+v", s)
					}
					if engine == "slow-model" && s.Revisited != 1 {
						t.Fatalf("the slow model onloads at the header: the transfer should have been revisited: %+v", s)
					}
					if tab := ts[1].OverlapTable(); tab != (OverlapTable{}) {
						t.Fatalf("engine tables not empty: %+v", tab)
					}
					if c := ts[1].CMAStats(); (cma == "on") != (c.Received > 0) {
						t.Fatalf("CMA %s, but rank 1 received %d messages by CMA (%s)", cma, c.Received, c.Off)
					}
				})
			}
		}
	}
}
