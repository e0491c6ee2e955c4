package perf

import (
	"context"
	"fmt"
	"math"
	"slices"
	"testing"
	"time"

	"github.com/troupe-hpc/troupe/transport"
)

func TestSizes(t *testing.T) {
	for _, c := range []struct {
		cfg  Config
		want []int
	}{
		{Config{MinSize: 1, MaxSize: 16}, []int{1, 2, 4, 8, 16}},
		{Config{MinSize: 8, MaxSize: 8}, []int{8}},
		{Config{MinSize: 3, MaxSize: 20}, []int{3, 6, 12}},
		{Config{MinSize: 64, MaxSize: 8}, nil},
	} {
		if got := c.cfg.Sizes(); !slices.Equal(got, c.want) {
			t.Errorf("%+v: sizes %v, want %v", c.cfg, got, c.want)
		}
	}
	all := Config{}.Sizes() // the defaults: 8 B to 4 MiB
	if len(all) != 20 || all[0] != 8 || all[len(all)-1] != 4<<20 {
		t.Errorf("default sizes %v, want 8 B to 4 MiB by powers of two", all)
	}
}

func TestFormatSize(t *testing.T) {
	for n, want := range map[int]string{8: "8", 1000: "1000", 1024: "1K", 1536: "1536", 64 << 10: "64K", 4 << 20: "4M", 3 << 19: "1536K"} {
		if got := FormatSize(n); got != want {
			t.Errorf("FormatSize(%d) = %q, want %q", n, got, want)
		}
	}
}

// TestSweep runs a short sweep between two ranks over UCX: rank 0 gets one
// point per size with a positive, finite latency and bandwidth, rank 1 the
// same sizes with zero values, and report is called on rank 0 only; with
// receives naming the peer and with any-source receives.
func TestSweep(t *testing.T) {
	for _, anySource := range []bool{false, true} {
		t.Run(fmt.Sprintf("any-source=%v", anySource), func(t *testing.T) { testSweep(t, anySource) })
	}
}

func testSweep(t *testing.T, anySource bool) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	ts, stop, err := transport.StartLocal(ctx, 2, transport.Options{})
	if err != nil {
		t.Fatal(err)
	}
	defer stop()
	cfg := Config{MinSize: 8, MaxSize: 64 << 10, Window: 4, Scale: 0.001, AnySource: anySource}
	pts := make([][]Point, 2)
	reported := make([]int, 2)
	errs := make(chan error, 2)
	for r, tr := range ts {
		go func() {
			var err error
			pts[r], err = Sweep(ctx, tr, cfg, func(Point) { reported[r]++ })
			errs <- err
		}()
	}
	for range ts {
		if err := <-errs; err != nil {
			t.Fatal(err)
		}
	}
	sizes := cfg.Sizes()
	for r := range ts {
		if len(pts[r]) != len(sizes) {
			t.Fatalf("rank %d: %d points, want %d", r, len(pts[r]), len(sizes))
		}
	}
	if reported[0] != len(sizes) || reported[1] != 0 {
		t.Fatalf("reported %d points on rank 0 and %d on rank 1, want %d and 0", reported[0], reported[1], len(sizes))
	}
	for i, p := range pts[0] {
		if p.Size != sizes[i] || !(p.LatUs > 0) || !(p.BwMBs > 0) || math.IsInf(p.LatUs, 0) || math.IsInf(p.BwMBs, 0) {
			t.Errorf("rank 0 point %d: %+v, want size %d with a positive latency and bandwidth", i, p, sizes[i])
		}
		if q := pts[1][i]; q.Size != sizes[i] || q.LatUs != 0 || q.BwMBs != 0 {
			t.Errorf("rank 1 point %d: %+v, want size %d with zero values", i, q, sizes[i])
		}
	}
}

func ExampleFormatSize() {
	for _, n := range []int{8, 4096, 1 << 20, 1536} {
		fmt.Println(FormatSize(n))
	}
	// Output:
	// 8
	// 4K
	// 1M
	// 1536
}

// A sweep up to a size near the largest int ends at its last power-of-two
// step (found by review: doubling past math.MaxInt wrapped to negative
// sizes, then to 0 for ever, appending without end).
func TestSizesNoOverflow(t *testing.T) {
	if got := (Config{MinSize: 1 << 62, MaxSize: math.MaxInt}).Sizes(); !slices.Equal(got, []int{1 << 62}) {
		t.Errorf("sizes from 2^62 to MaxInt: %v, want [2^62]", got)
	}
	got := Config{MinSize: 3, MaxSize: math.MaxInt}.Sizes()
	if len(got) != 62 || got[len(got)-1] != 3<<61 {
		t.Errorf("sizes from 3 to MaxInt: %v, want 62 sizes ending at 3<<61", got)
	}
}

// Latency and Bandwidth refuse sizes and windows they cannot measure with
// an error (found by review: Bandwidth panicked dividing by zero for a
// size or window of 0, and a negative size or window panicked in make).
func TestBadArguments(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	ts, stop, err := transport.StartLocal(ctx, 2, transport.Options{})
	if err != nil {
		t.Fatal(err)
	}
	defer stop()
	for _, c := range []struct {
		name string
		run  func() (float64, error)
	}{
		{"Bandwidth size 0", func() (float64, error) { return Bandwidth(ctx, ts[0], 0, 64, 1) }},
		{"Bandwidth window 0", func() (float64, error) { return Bandwidth(ctx, ts[0], 8, 0, 1) }},
		{"Bandwidth window -1", func() (float64, error) { return Bandwidth(ctx, ts[0], 8, -1, 1) }},
		{"Bandwidth size -8", func() (float64, error) { return Bandwidth(ctx, ts[0], -8, 64, 1) }},
		{"Latency size -1", func() (float64, error) { return Latency(ctx, ts[0], -1, 1) }},
	} {
		var v float64
		var err error
		panicked := func() (p any) {
			defer func() { p = recover() }()
			v, err = c.run()
			return nil
		}()
		if panicked != nil || err == nil {
			t.Errorf("%s: %v, %v (panic: %v), want an error", c.name, v, err, panicked)
		}
	}
}
