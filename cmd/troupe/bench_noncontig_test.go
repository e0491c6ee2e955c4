package main

import (
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/troupe-hpc/troupe/gpu"
	"github.com/troupe-hpc/troupe/transport"
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

// A way whose statistic got worse by more than the gain is not settled
// either: a median moves both ways.
func TestNCSettleWorse(t *testing.T) {
	h := [][]float64{{10, 20}, {10, 20}, {10, 20}, {10, 21}}
	s := &ncSettle{min: 1, max: 16, end: time.Now().Add(time.Hour), history: h}
	if !s.unsettled(len(h) - 1) {
		t.Error("a way 5 % slower than three rounds ago counted as settled")
	}
}

func TestNCMeasure(t *testing.T) {
	us := func(v float64) time.Duration { return time.Duration(v * 2e3) } // a round trip of v us one way
	m := newNCMeasure(2, "median")
	for _, batch := range [][]float64{{4, 5, 30}, {3, 6, 3}} {
		m.startBatch()
		for _, v := range batch {
			m.add(0, us(v))
		}
		m.endBatch(0)
	}
	if got := m.median(0); got != 4.5 { // 3 3 4 5 6 30
		t.Errorf("median = %v, want 4.5", got)
	}
	if got := m.bestBatch(0); got != 4 { // batches 13 and 4
		t.Errorf("best batch = %v, want 4", got)
	}
	if got := m.stat(0); got != 4.5 {
		t.Errorf("median stat = %v, want 4.5", got)
	}
	if got := m.bestBatch(1); got != 0 || len(m.batches[1]) != 0 {
		t.Errorf("way without batches: best %v, batches %v", got, m.batches[1])
	}
	m.best = true
	if got := m.stats(); got[0] != 4 || got[1] != 0 {
		t.Errorf("best stats = %v, want [4 0]", got)
	}
}

// The table counts adaptive against the best fixed scheme only (pack2 is
// not a scheme to beat) and A/A pairs within 5 % either way.
func TestPrintNoncontigAA(t *testing.T) {
	var pts []ncPoint
	add := func(layout string, lat map[string]float64) {
		for s, l := range lat {
			pts = append(pts, ncPoint{Layout: layout, Scheme: s, LatUs: l, Bytes: 1024, Blocks: 16, Batches: 12})
		}
	}
	add("a", map[string]float64{"pack": 10, "sgl": 20, "zcopy": 30, "adaptive": 10.4, "pack2": 9.6})
	add("b", map[string]float64{"pack": 10, "sgl": 20, "zcopy": 30, "adaptive": 10, "pack2": 8})
	for i := range pts {
		if pts[i].Scheme == "adaptive" && pts[i].Layout == "b" {
			pts[i].Used = &transport.SchemeCounts{Pack: 90, SGL: 10}
		}
	}
	var out strings.Builder
	if err := printNoncontig(&out, noncontigFlags{aa: true, stat: "best", procs: "3"}, pts); err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{
		"2 ranks (GOMAXPROCS 3 each)",
		"pack2/pack",
		"# adaptive within 5% of the best fixed scheme at 2 of 2 points",
		"# pack measured twice (A/A) within 5% of itself at 1 of 2 points",
		"adaptive used",
		"pack 90%",
	} {
		if !strings.Contains(out.String(), want) {
			t.Errorf("table lacks %q:\n%s", want, out.String())
		}
	}
}

func TestNoncontigBadProcs(t *testing.T) {
	// Rejected before any rank starts.
	_, err := runNoncontigJob(t.Context(), noncontigFlags{procs: "half", stat: "best", rounds: 1, maxRounds: 1})
	if err == nil || !strings.Contains(err.Error(), "--procs must be split or a count") {
		t.Fatalf("err = %v, want the --procs error", err)
	}
}

// The adaptive row's scheme mix comes from counter differences, sends and
// receives alike, and is labelled by its most frequent scheme.
func TestAdaptiveUsed(t *testing.T) {
	var u transport.SchemeCounts
	a := transport.NoncontigStats{Sent: transport.SchemeCounts{Pack: 5, SGL: 1}, Received: transport.SchemeCounts{Pack: 5}}
	b := transport.NoncontigStats{Sent: transport.SchemeCounts{Pack: 5, SGL: 9}, Received: transport.SchemeCounts{Pack: 5, SGL: 8, ZCopy: 1}}
	addUsed(&u, a, b)
	addUsed(&u, b, b) // nothing happened in between
	if want := (transport.SchemeCounts{SGL: 16, ZCopy: 1}); u != want {
		t.Fatalf("addUsed = %+v, want %+v", u, want)
	}
	for _, c := range []struct {
		u    *transport.SchemeCounts
		want string
	}{
		{nil, "-"},
		{&transport.SchemeCounts{}, "-"},
		{&transport.SchemeCounts{Pack: 7}, "pack"},
		{&transport.SchemeCounts{SGL: 3}, "sgl"},
		{&u, "sgl 94%"},
		{&transport.SchemeCounts{Pack: 1, ZCopy: 3}, "zcopy 75%"},
	} {
		if got := usedLabel(c.u); got != c.want {
			t.Errorf("usedLabel(%+v) = %q, want %q", c.u, got, c.want)
		}
	}
}

// A real two-rank job of the typed benchmark (UCX between two processes of
// this test binary), with exact and with any-source receives: every scheme
// is measured, and the adaptive row counts exactly its timed transfers, two
// per ping-pong on rank 0.
func TestNoncontigJob(t *testing.T) {
	t.Setenv(envTestMain, "1")
	for _, anySource := range []bool{false, true} {
		t.Run(fmt.Sprintf("any-source=%v", anySource), func(t *testing.T) { noncontigJob(t, anySource) })
	}
}

func noncontigJob(t *testing.T, anySource bool) {
	f := noncontigFlags{tls: "shm", scale: 0.1, rounds: 1, maxRounds: 1, budget: time.Minute,
		layouts: []string{"vec_64x16", "vec_4096x16"}, stat: "best", procs: "split", anySource: anySource}
	pts, err := runNoncontigJob(t.Context(), f)
	if err != nil {
		t.Fatal(err)
	}
	if len(pts) != 2*len(ncSchemeOrder) {
		t.Fatalf("%d points, want %d: %+v", len(pts), 2*len(ncSchemeOrder), pts)
	}
	for _, p := range pts {
		if p.LatUs <= 0 || p.Batches < 1 {
			t.Errorf("%s %s: latency %v, %d batches", p.Layout, p.Scheme, p.LatUs, p.Batches)
		}
		if p.Scheme != "adaptive" {
			if p.Used != nil {
				t.Errorf("%s %s carries adaptive counts", p.Layout, p.Scheme)
			}
			continue
		}
		iters, _ := ncIters(p.Bytes, p.Blocks, f.scale)
		want := int64(2 * max(iters/4, 3) * p.Batches)
		if u := p.Used; u == nil || u.Pack+u.SGL+u.ZCopy != want {
			t.Errorf("%s adaptive used %+v, want %d transfers in all", p.Layout, p.Used, want)
		} else if p.Layout == "vec_64x16" && u.Pack != want {
			t.Errorf("vec_64x16 (64 B blocks) adaptive used %+v, want pack only", u)
		}
	}
}

// --layout selects sweep and DDTBench layouts by name, builds any other
// vec_<block>x<count>, and refuses a name it cannot build.
func TestNoncontigCasesByName(t *testing.T) {
	cs, err := noncontigCases(noncontigFlags{layouts: []string{"vec_64x16", "milc_zd", "vec_24x5"}})
	if err != nil {
		t.Fatal(err)
	}
	var names []string
	for _, c := range cs {
		names = append(names, c.name)
	}
	if got := strings.Join(names, " "); got != "vec_64x16 milc_zd vec_24x5" {
		t.Fatalf("cases %q", got)
	}
	if n, err := cs[2].dt.PackedSize(1); err != nil || n != 120 || cs[2].alloc != 4*48+24 {
		t.Fatalf("vec_24x5: %d packed bytes (%v), extent %d; want 120 and %d", n, err, cs[2].alloc, 4*48+24)
	}
	for _, bad := range []string{"foo", "vec_7x3", "vec_0x3", "vec_64x0", "vec_64x-1", "vec_64x16x", "vec_064x16"} {
		if _, err := noncontigCases(noncontigFlags{layouts: []string{bad}}); err == nil {
			t.Errorf("layout %q accepted", bad)
		}
	}
	if _, err := noncontigCases(noncontigFlags{layouts: []string{"vec_24x5"}, noVec: true}); err == nil {
		t.Error("a vector layout accepted with --no-vectors")
	}
}

// A DDTBench layout named with --no-apps is refused as left out (the error
// said it was unknown and listed it as a choice), and so is an empty name.
func TestNoncontigCasesExcluded(t *testing.T) {
	_, err := noncontigCases(noncontigFlags{layouts: []string{"milc_zd"}, noApp: true})
	if err == nil || !strings.Contains(err.Error(), "--no-apps") || strings.Contains(err.Error(), "unknown") {
		t.Errorf("milc_zd with --no-apps: %v, want an error naming --no-apps", err)
	}
	for _, names := range [][]string{{""}, {"milc_zd", ""}} {
		if _, err := noncontigCases(noncontigFlags{layouts: names}); err == nil || !strings.Contains(err.Error(), "empty") {
			t.Errorf("layouts %q: %v, want an error about the empty name", names, err)
		}
	}
}

// A real two-rank job of --actor --device: every way is measured at every
// layout, the device points name their backend, and the table shows each
// path's device/Go-memory ratio.
func TestNoncontigActorDeviceJob(t *testing.T) {
	t.Setenv(envTestMain, "1")
	t.Setenv(gpu.EnvBackend, gpu.BackendHost)
	f := noncontigFlags{tls: "shm", scale: 0.1, rounds: 1, maxRounds: 1, budget: time.Minute,
		layouts: []string{"vec_64x16", "vec_4096x16"}, stat: "best", procs: "split", actor: true, device: true, burst: 1}
	pts, err := runNoncontigJob(t.Context(), f)
	if err != nil {
		t.Fatal(err)
	}
	if len(pts) != 2*len(ncActorDeviceWays) {
		t.Fatalf("%d points, want %d: %+v", len(pts), 2*len(ncActorDeviceWays), pts)
	}
	seen := map[string]int{}
	for _, p := range pts {
		seen[p.Scheme]++
		if p.LatUs <= 0 || p.Batches < 1 || p.Backend != gpu.BackendHost {
			t.Errorf("%s %s: latency %v, %d batches, backend %q", p.Layout, p.Scheme, p.LatUs, p.Batches, p.Backend)
		}
	}
	for _, w := range ncActorDeviceWays {
		if seen[w.name] != 2 {
			t.Errorf("way %s measured at %d layouts, want 2", w.name, seen[w.name])
		}
	}
	var out strings.Builder
	if err := printNoncontig(&out, f, pts); err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{"gpu backend host", "dev-am/am", "dev-adaptive/adaptive", "vec_4096x16"} {
		if !strings.Contains(out.String(), want) {
			t.Errorf("table lacks %q:\n%s", want, out.String())
		}
	}
}
