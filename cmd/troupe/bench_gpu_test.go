package main

import (
	"slices"
	"testing"
	"time"
)

// oneWayUs halves the mean or the median round trip; the median ignores
// the slow tail that moves the mean.
func TestOneWayUs(t *testing.T) {
	us := func(v ...int) []time.Duration {
		d := make([]time.Duration, len(v))
		for i, x := range v {
			d[i] = time.Duration(x) * time.Microsecond
		}
		return d
	}
	rts := us(30, 10, 400, 20, 20)
	if got := oneWayUs(rts, "mean"); got != 48 {
		t.Errorf("mean: %v us one way, want 48 (a mean round trip of 96)", got)
	}
	if got := oneWayUs(rts, "median"); got != 10 {
		t.Errorf("median: %v us one way, want 10 (a median round trip of 20)", got)
	}
	if rts[0] != 30*time.Microsecond {
		t.Error("median sorted its argument")
	}
	if got := oneWayUs(nil, "median"); got != 0 {
		t.Errorf("no round trips: %v", got)
	}
}

// The sizes step by 4 from --min and end at --max even where the steps
// skip it (--min 1024 --max 3072 measured 1024 only; the default range
// ended at 2 MiB, not 4 MiB).
func TestGPUSizes(t *testing.T) {
	for _, c := range []struct {
		min, max int
		want     []int
	}{
		{8, 4 << 20, []int{8, 32, 128, 512, 2048, 8192, 32768, 131072, 524288, 2097152, 4194304}},
		{1024, 3072, []int{1024, 3072}},
		{1024, 4096, []int{1024, 4096}},
		{1024, 1024, []int{1024}},
		{1, 16, []int{1, 4, 16}},
		{1, 17, []int{1, 4, 16, 17}},
		{1 << 29, 1 << 30, []int{1 << 29, 1 << 30}},
		{0, 4, []int{0, 1, 4}},
		{8, 4, nil},
	} {
		if got := gpuSizes(c.min, c.max); !slices.Equal(got, c.want) {
			t.Errorf("gpuSizes(%d, %d) = %v, want %v", c.min, c.max, got, c.want)
		}
	}
}

// Of an even number of round trips, the median is the mean of the middle
// two, as median and the noncontig benchmark take it (found by review:
// oneWayUs took the upper middle one, 15 us one way here instead of 12.5).
func TestOneWayUsEvenMedian(t *testing.T) {
	rts := []time.Duration{40 * time.Microsecond, 10 * time.Microsecond, 30 * time.Microsecond, 20 * time.Microsecond}
	if got := oneWayUs(rts, "median"); got != 12.5 {
		t.Errorf("median of 10, 20, 30, 40 us round trips: %v us one way, want 12.5", got)
	}
	if got := oneWayUs(rts[:2], "median"); got != 12.5 {
		t.Errorf("median of 40, 10 us round trips: %v us one way, want 12.5", got)
	}
}
