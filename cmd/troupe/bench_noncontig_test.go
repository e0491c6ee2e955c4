package main

import (
	"testing"
	"time"
)

// Read cyclically, the benchmarks' turn orders must give every scheme every
// other scheme as its predecessor exactly once, so that no scheme pays more
// than another for what the previous one left behind.
func TestNoncontigTurnsBalanced(t *testing.T) {
	check := func(name string, turns []int, n int) {
		t.Helper()
		if len(turns) != n*(n-1) {
			t.Fatalf("%s has %d turns, want %d", name, len(turns), n*(n-1))
		}
		seen := map[[2]int]int{}
		for i, k := range turns {
			prev := turns[(i+len(turns)-1)%len(turns)]
			if k < 0 || k >= n {
				t.Fatalf("%s: turn %d names item %d of %d", name, i, k, n)
			}
			if prev == k {
				t.Errorf("%s: turn %d repeats item %d", name, i, k)
			}
			seen[[2]int{prev, k}]++
		}
		for a := 0; a < n; a++ {
			for b := 0; b < n; b++ {
				if a != b && seen[[2]int{a, b}] != 1 {
					t.Errorf("%s: %d runs right after %d %d times, want once", name, b, a, seen[[2]int{a, b}])
				}
			}
		}
	}
	check("ncTurns", ncTurns, len(ncSchemeOrder))
	check("ncActorTurns", ncActorTurns, len(ncActorWays))
	for n := 2; n <= 7; n++ {
		check("balancedTurns", balancedTurns(n), n)
	}
	if got := balancedTurns(1); len(got) != 1 || got[0] != 0 {
		t.Errorf("balancedTurns(1) = %v, want [0]", got)
	}
}

func TestNCSettle(t *testing.T) {
	// rounds returns the bests of n rounds, all {10, 20} but the last
	// round's, which is last.
	rounds := func(n int, last ...float64) [][]float64 {
		h := make([][]float64, n)
		for i := range h {
			h[i] = []float64{10, 20}
		}
		if last != nil {
			h[n-1] = last
		}
		return h
	}
	k := ncSettleRounds
	future := time.Now().Add(time.Hour)
	improvedEarly := append([][]float64{{12, 20}}, rounds(k+1)...)
	cases := []struct {
		name    string
		max     int
		end     time.Time
		history [][]float64
		want    bool
	}{
		{"too few rounds to tell", 16, future, rounds(k), true},
		{"steady", 16, future, rounds(k+1, 10, 19.9), false},
		{"one way still improving", 16, future, rounds(k+1, 10, 19.7), true},
		{"improved before the last rounds only", 16, future, improvedEarly, false},
		{"round cap", k + 1, future, rounds(k+1, 5, 20), false},
		{"time spent", 16, time.Now().Add(-time.Second), rounds(k+1, 5, 20), false},
	}
	for _, c := range cases {
		s := &ncSettle{min: 1, max: c.max, end: c.end, history: c.history}
		if got := s.unsettled(len(c.history) - 1); got != c.want {
			t.Errorf("%s: unsettled = %v, want %v", c.name, got, c.want)
		}
	}
}
