package datatype

import "testing"

// TestDeltaCodedLists checks which uniform lists are stored as 16-bit steps
// and that random and sequential access give back every displacement.
func TestDeltaCodedLists(t *testing.T) {
	ascending := make([]int64, 300)
	for i := range ascending {
		ascending[i] = int64(5*i + (7*i*i+3*i)%5) // the LAMMPS list shape
	}
	bigStep := append([]int64(nil), ascending...)
	bigStep[200] += 9000 // 9000 float64s: a step of more than 64 KiB
	for i := 201; i < len(bigStep); i++ {
		bigStep[i] += 9000
	}
	descending := make([]int64, 100)
	for i := range descending {
		descending[i] = int64(1000 - 3*i - i%2)
	}
	cases := []struct {
		name  string
		disps []int64
		delta bool
	}{
		{"ascending", ascending, true},
		{"step over 64 KiB", bigStep, false},
		{"descending", descending, false},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			x, err := IndexedBlock(1, c.disps, Float64)
			if err != nil {
				t.Fatal(err)
			}
			nd, err := x.program(1)
			if err != nil {
				t.Fatal(err)
			}
			if nd.op != opList || nd.ulen != 8 {
				t.Fatalf("not a uniform list of 8-byte leaves: op %d ulen %d", nd.op, nd.ulen)
			}
			if got := nd.deltas != nil; got != c.delta {
				t.Fatalf("delta-coded %v, want %v", got, c.delta)
			}
			if nd.entries() != len(c.disps) {
				t.Fatalf("%d entries, want %d", nd.entries(), len(c.disps))
			}
			prev := int64(0)
			for i, d := range c.disps {
				want := 8*d - nd.off // relative to the list's own offset
				if got := nd.disp(i); got != want {
					t.Fatalf("disp(%d) = %d, want %d", i, got, want)
				}
				if i > 0 {
					if got := nd.nextDisp(i, prev); got != want {
						t.Fatalf("nextDisp(%d) = %d, want %d", i, got, want)
					}
				}
				prev = want
			}
		})
	}
}
