package main

import "testing"

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
