package overlap_test

import (
	"fmt"
	"time"

	"github.com/troupe-hpc/troupe/overlap"
)

// A late sender: the receive is posted, the receiver goes off to compute,
// and the RTS arrives 200us later. The expected onload delay (200us and
// counting) exceeds K (one 1 MiB transfer, about 86us at 12.5 GB/s), so the
// engine offloads: the progress goroutine starts the transfer right away.
func Example_expected() {
	e, err := overlap.New(overlap.DefaultConfig())
	if err != nil {
		panic(err)
	}
	us := time.Microsecond
	for _, ev := range []overlap.Event{
		{Kind: overlap.RecvPosted, At: 0, ID: 1, Peer: 3, Size: 1 << 20},
		{Kind: overlap.HeaderArrived, At: 200 * us, ID: 1, Peer: 3, Size: 1 << 20, Expected: true},
		{Kind: overlap.TransferStarted, At: 200 * us, ID: 1},
		{Kind: overlap.TransferCompleted, At: 290 * us, ID: 1},
	} {
		d, err := e.Step(ev)
		if err != nil {
			panic(err)
		}
		if d.Action != overlap.None {
			fmt.Println(ev.Kind, "->", d)
		}
	}
	fmt.Printf("offloaded=%d onloaded=%d\n", e.Stats().Offloaded, e.Stats().Onloaded)
	// Output:
	// RecvPosted -> Onload(id=1 delay<=K)
	// HeaderArrived -> Offload(id=1 delay>K)
	// offloaded=1 onloaded=0
}

// A late receiver: the RTS arrives before any receive is posted. The
// engine prefetches it into pool slot 0 so the sender is released; when the
// receive is posted the transport copies from the slot and reports
// PrefetchConsumed, which frees the slot.
func Example_unexpected() {
	e, _ := overlap.New(overlap.DefaultConfig())
	us := time.Microsecond
	for _, ev := range []overlap.Event{
		{Kind: overlap.HeaderArrived, At: 0, ID: 7, Peer: 2, Size: 1 << 20},
		{Kind: overlap.TransferStarted, At: 0, ID: 7},
		{Kind: overlap.TransferCompleted, At: 90 * us, ID: 7},
		{Kind: overlap.RecvPosted, At: 500 * us, ID: 7, Peer: 2, Size: 1 << 20},
		{Kind: overlap.PrefetchConsumed, At: 520 * us, ID: 7},
	} {
		d, _ := e.Step(ev)
		if d.Action != overlap.None {
			fmt.Println(ev.Kind, "->", d)
		}
	}
	s := e.Stats()
	fmt.Printf("useful=%d in-use=%d high-water=%d\n", s.PrefetchUseful, s.PoolInUse, s.PoolHighWater)
	// Output:
	// HeaderArrived -> Prefetch(id=7 slot=0 prefetch)
	// RecvPosted -> Prefetch(id=7 slot=0 prefetched)
	// useful=1 in-use=0 high-water=1
}

// With the engine off every transfer is onloaded: today's behaviour, kept
// so the benefit of the engine can be measured.
func Example_disabled() {
	cfg := overlap.DefaultConfig()
	cfg.Enabled = false
	e, _ := overlap.New(cfg)
	d, _ := e.Step(overlap.Event{Kind: overlap.HeaderArrived, ID: 1, Peer: 0, Size: 1 << 20})
	fmt.Println(d)
	// Output:
	// Onload(id=1 disabled)
}

// Calibrate fits alpha and beta from one-way ping-pong times.
func ExampleCalibrate() {
	samples := []overlap.Sample{
		{Size: 64 << 10, Time: 7243 * time.Nanosecond},
		{Size: 256 << 10, Time: 22972 * time.Nanosecond},
		{Size: 1 << 20, Time: 85886 * time.Nanosecond},
		{Size: 4 << 20, Time: 337543 * time.Nanosecond},
	}
	fit, err := overlap.Calibrate(samples)
	if err != nil {
		panic(err)
	}
	cfg := fit.Apply(overlap.DefaultConfig())
	fmt.Printf("alpha=%.3f ns/B beta=%v r2>0.999=%v\n", cfg.Alpha, cfg.Beta.Round(100*time.Nanosecond), fit.R2 > 0.999)
	// Output:
	// alpha=0.080 ns/B beta=2µs r2>0.999=true
}
