package datatype

import (
	"fmt"
	"testing"
	"time"
)

func TestCrossover(t *testing.T) {
	ms := time.Millisecond
	for _, tc := range []struct {
		name      string
		pack, sgl []time.Duration // observed in turn, as Next asks
		prefer    Scheme
		want      Scheme
	}{
		{"sgl faster", []time.Duration{5 * ms, 4 * ms}, []time.Duration{3 * ms, 9 * ms}, SchemePack, SchemeSGL},
		{"pack faster", []time.Duration{2 * ms, 2 * ms}, []time.Duration{3 * ms, 3 * ms}, SchemeSGL, SchemePack},
		{"tie keeps pack", []time.Duration{3 * ms, 4 * ms}, []time.Duration{3 * ms, 5 * ms}, SchemePack, SchemePack},
		{"tie keeps sgl", []time.Duration{3 * ms, 4 * ms}, []time.Duration{3 * ms, 5 * ms}, SchemeSGL, SchemeSGL},
		{"within the margin keeps the preference", []time.Duration{100 * ms, 100 * ms}, []time.Duration{98 * ms, 99 * ms}, SchemePack, SchemePack},
		{"beyond the margin", []time.Duration{100 * ms, 100 * ms}, []time.Duration{96 * ms, 99 * ms}, SchemePack, SchemeSGL},
		{"lower median of two is the best, not the mean", []time.Duration{10 * ms, 1 * ms}, []time.Duration{2 * ms, 2 * ms}, SchemeSGL, SchemePack},
		{"median, not best", []time.Duration{9 * ms, 1 * ms, 9 * ms}, []time.Duration{5 * ms, 5 * ms, 6 * ms}, SchemePack, SchemeSGL},
		{"median, not mean", []time.Duration{3 * ms, 3 * ms, 90 * ms}, []time.Duration{5 * ms, 5 * ms, 5 * ms}, SchemeSGL, SchemePack},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c := NewCrossover(len(tc.pack), 1, tc.prefer)
			took := map[Scheme][]time.Duration{SchemePack: tc.pack, SchemeSGL: tc.sgl}
			var asked []Scheme
			for i := 0; i < len(tc.pack)+len(tc.sgl); i++ {
				if _, ok := c.Verdict(); ok {
					t.Fatalf("verdict after %d of %d trials", i, len(tc.pack)+len(tc.sgl))
				}
				s := c.Next()
				asked = append(asked, s)
				if len(took[s]) == 0 {
					t.Fatalf("trials %v: more %v than %d", asked, s, len(tc.pack))
				}
				c.Observe(s, took[s][0])
				took[s] = took[s][1:]
			}
			// Pack, SGL, SGL, pack, pack, SGL, ...
			var want []Scheme
			for i := range len(tc.pack) + len(tc.sgl) {
				want = append(want, [2]Scheme{SchemePack, SchemeSGL}[(i+1)/2%2])
			}
			if fmt.Sprint(asked) != fmt.Sprint(want) {
				t.Fatalf("trials %v, want %v", asked, want)
			}
			v, ok := c.Verdict()
			if !ok || v != tc.want || c.Next() != tc.want {
				t.Fatalf("verdict %v (%v), next %v; want %v", v, ok, c.Next(), tc.want)
			}
			// Later observations change nothing.
			c.Observe(SchemePack, 0)
			c.Observe(SchemeSGL, 0)
			if v, _ := c.Verdict(); v != tc.want {
				t.Fatalf("verdict changed to %v", v)
			}
		})
	}
	c := NewCrossover(0, 0, SchemeZCopy) // at least one trial each, runs of 1; pack preferred
	c.Observe(SchemeZCopy, time.Nanosecond)
	c.Observe(SchemePack, 2*ms)
	if _, ok := c.Verdict(); ok {
		t.Fatal("verdict before SGL was timed")
	}
	c.Observe(SchemeSGL, ms)
	if v, ok := c.Verdict(); !ok || v != SchemeSGL {
		t.Fatalf("verdict %v %v", v, ok)
	}
	if p, s := c.Best(); p != 2*ms || s != ms {
		t.Fatalf("best %v %v", p, s)
	}
	// Medians: what the verdict was judged on, lower median, trials kept
	// in arrival order (Medians sorts a copy).
	c = NewCrossover(3, 1, SchemePack)
	if p, s := c.Medians(); p != 0 || s != 0 {
		t.Fatalf("medians before any trial %v %v, want 0 0", p, s)
	}
	for i, d := range []time.Duration{9 * ms, 5 * ms, 1 * ms, 7 * ms, 4 * ms, 6 * ms} {
		c.Observe([2]Scheme{SchemePack, SchemeSGL}[i%2], d)
	}
	if p, s := c.Medians(); p != 4*ms || s != 6*ms {
		t.Fatalf("medians %v %v, want 4ms 6ms", p, s)
	}
	if p, s := c.Medians(); p != 4*ms || s != 6*ms {
		t.Fatalf("second call: medians %v %v", p, s)
	}
}

// TestCrossoverRuns: with runs longer than one transfer, Next hands out
// whole runs of one scheme and the first transfer after a change of scheme
// is not timed, so a fast transfer after a switch does not decide.
func TestCrossoverRuns(t *testing.T) {
	ms := time.Millisecond
	c := NewCrossover(1, 2, SchemePack)
	var asked []Scheme
	// The first of each run is fast, the rest slow for pack and fast for
	// SGL: timing the first transfers would make it a tie (pack kept).
	took := map[Scheme][]time.Duration{SchemePack: {1 * ms, 9 * ms}, SchemeSGL: {9 * ms, 1 * ms}}
	for i := 0; ; i++ {
		if _, ok := c.Verdict(); ok {
			break
		}
		if i == 10 {
			t.Fatalf("no verdict after %v", asked)
		}
		s := c.Next()
		asked = append(asked, s)
		c.Observe(s, took[s][0])
		took[s] = took[s][1:]
	}
	if fmt.Sprint(asked) != "[pack pack sgl sgl]" {
		t.Fatalf("trials %v, want two runs of two", asked)
	}
	if v, _ := c.Verdict(); v != SchemeSGL {
		t.Fatalf("verdict %v, want sgl (the first transfer of each run timed?)", v)
	}
	if p, s := c.Best(); p != 9*ms || s != 1*ms {
		t.Fatalf("best %v %v, want 9ms 1ms", p, s)
	}
	// Runs of four, P S S P P S: timed 3, 3+4, 3+4, then SGL's eighth
	// timing is the second transfer of its third run (transfer 22).
	th := DefaultThresholds()
	th.CrossoverTrials, th.CrossoverRun = 8, 4
	if n, sgl := th.CrossoverTransfers(); n != 22 || sgl != 10 {
		t.Errorf("CrossoverTransfers with runs of 4: %d, %d SGL; want 22, 10", n, sgl)
	}
	th.CrossoverRun = 1
	if n, sgl := th.CrossoverTransfers(); n != 16 || sgl != 8 {
		t.Errorf("CrossoverTransfers alternating: %d, %d SGL; want 16, 8", n, sgl)
	}
}

func TestInCrossoverBand(t *testing.T) {
	th := DefaultThresholds()
	if th.CrossoverBand != 4 {
		t.Errorf("default band %d, want 4", th.CrossoverBand)
	}
	// T = 8 KiB: [2 KiB, 32 KiB]
	for _, tc := range []struct {
		avg  float64
		segs int64
		want bool
	}{
		{1024, 64, false}, {2048, 64, true}, {4096, 64, true}, {32768, 64, true}, {32769, 64, false},
		{4096, 1, false},       // contiguous: nothing to measure
		{4096, 1 << 17, false}, // too many segments for SGL
	} {
		if got := th.InCrossoverBand(Stats{AvgBlock: tc.avg, Segments: tc.segs}); got != tc.want {
			t.Errorf("avg %v, %d segments: %v, want %v", tc.avg, tc.segs, got, tc.want)
		}
	}
	th.CrossoverBand = 0
	if th.InCrossoverBand(Stats{AvgBlock: 8192, Segments: 64}) {
		t.Error("band 0 measures")
	}
	th.CrossoverTrials = -1
	if th.Validate() == nil {
		t.Error("negative trials accepted")
	}
	th.CrossoverTrials, th.CrossoverRun = 8, -1
	if th.Validate() == nil {
		t.Error("negative run accepted")
	}
	th.CrossoverTrials, th.CrossoverRun = MaxCrossoverTrials+1, 4
	if th.Validate() == nil {
		t.Error("trials above MaxCrossoverTrials accepted")
	}
	th.CrossoverTrials, th.CrossoverRun = MaxCrossoverTrials, MaxCrossoverTrials
	if err := th.Validate(); err != nil {
		t.Errorf("trials and run at MaxCrossoverTrials: %v", err)
	}
}

// ExampleCrossover: time both schemes on a layout's first transfers, then
// use the faster.
func ExampleCrossover() {
	c := NewCrossover(2, 3, SchemePack) // runs of three, two timed
	took := map[Scheme]time.Duration{SchemePack: 30 * time.Microsecond, SchemeSGL: 22 * time.Microsecond}
	for {
		if _, ok := c.Verdict(); ok {
			break
		}
		s := c.Next()
		c.Observe(s, took[s]) // the caller runs and times the transfer
	}
	fmt.Println(c.Next())
	// Output: sgl
}
