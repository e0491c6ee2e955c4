package main

import (
	"math"
	"testing"
)

// roundRatios pairs the rounds in order, skips a round whose engine-off
// latency is zero, and stops at the shorter list.
func TestRoundRatios(t *testing.T) {
	got := roundRatios([]float64{1.1, 0.9, 2, 5}, []float64{1, 1, 0})
	want := []float64{110, 90}
	if len(got) != len(want) {
		t.Fatalf("roundRatios = %v, want %v", got, want)
	}
	for i := range want {
		if math.Abs(got[i]-want[i]) > 1e-9 {
			t.Fatalf("roundRatios = %v, want %v", got, want)
		}
	}
	if r := roundRatios(nil, []float64{1}); r != nil {
		t.Fatalf("no engine-on rounds: got %v, want none", r)
	}
}
