package main

import (
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
