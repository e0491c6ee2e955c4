package main

import "testing"

// Read cyclically, ncTurns must give every scheme every other scheme as its
// predecessor exactly once, so that no scheme pays more than another for
// what the previous one left behind.
func TestNoncontigTurnsBalanced(t *testing.T) {
	n := len(ncSchemeOrder)
	if len(ncTurns) != n*(n-1) {
		t.Fatalf("ncTurns has %d turns, want %d", len(ncTurns), n*(n-1))
	}
	seen := map[[2]int]int{}
	for i, k := range ncTurns {
		prev := ncTurns[(i+len(ncTurns)-1)%len(ncTurns)]
		if k < 0 || k >= n {
			t.Fatalf("turn %d names scheme %d of %d", i, k, n)
		}
		if prev == k {
			t.Errorf("turn %d repeats scheme %v", i, ncSchemeOrder[k])
		}
		seen[[2]int{prev, k}]++
	}
	for a := 0; a < n; a++ {
		for b := 0; b < n; b++ {
			if a != b && seen[[2]int{a, b}] != 1 {
				t.Errorf("%v runs right after %v %d times, want once", ncSchemeOrder[b], ncSchemeOrder[a], seen[[2]int{a, b}])
			}
		}
	}
}
