package main

import (
	"math"
	"strings"
	"testing"

	"github.com/troupe-hpc/troupe/overlap"
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

// A row is one whole round, the one of median overlap%, so that its times
// give its overlap% (a median of each field mixed rounds: with these three
// rounds, 50 % beside times that give 0 %).
func TestOverlapMedianRound(t *testing.T) {
	row := func(comm, comp, total float64) overlapRow {
		pct := math.Max(100*(1-(total-comp)/comm), 0)
		return overlapRow{Size: 1 << 20, Mode: "expected", Engine: "on", OverlapPct: math.Round(pct*10) / 10,
			TCommUs: comm, TComputeUs: comp, TTotalUs: total, SenderUs: comm / 2}
	}
	rounds := []overlapRow{
		row(100, 100, 110), // 90 %
		row(200, 50, 250),  // 0 %
		row(400, 300, 500), // 50 %
	}
	got := medianRound(rounds)
	if got != rounds[2] {
		t.Fatalf("medianRound = %+v, want the 50 %% round %+v", got, rounds[2])
	}
	check := func(r overlapRow) {
		t.Helper()
		pct := math.Max(100*(1-(r.TTotalUs-r.TComputeUs)/r.TCommUs), 0)
		if math.Abs(pct-r.OverlapPct) > 0.05 {
			t.Errorf("row %+v: its times give %.1f %%, it says %.1f %%", r, pct, r.OverlapPct)
		}
	}
	check(got)
	// Of an even number, the lower middle round; of equal ones, the first.
	if got := medianRound(rounds[:2]); got != rounds[1] {
		t.Errorf("two rounds: %+v, want the 0 %% round", got)
	}
	tie := []overlapRow{row(100, 100, 150), row(200, 200, 300), row(300, 0, 300)}
	if got := medianRound(tie); got != tie[0] {
		t.Errorf("equal overlap%%: %+v, want the first round", got)
	}
	if got := medianRound(rounds[:1]); got != rounds[0] {
		t.Errorf("one round: %+v", got)
	}
	if got := medianRound(nil); got != (overlapRow{}) {
		t.Errorf("no rounds: %+v", got)
	}
}

// A --typed message packs exactly the row's size; a size that is not a
// whole number of 1 KiB blocks is refused (100 B packed 1024, 1536 B
// packed 1024).
func TestOvMessageTypedSize(t *testing.T) {
	for _, size := range []int{1024, 2048, 3072, 64 << 10} {
		m, err := newOvMessage(size, true)
		if err != nil {
			t.Fatalf("size %d: %v", size, err)
		}
		if n, err := m.dt.PackedSize(1); err != nil || n != int64(size) {
			t.Errorf("size %d: packs %d bytes (%v)", size, n, err)
		}
		if len(m.buf) != 2*size-1024 {
			t.Errorf("size %d: buffer of %d bytes, want the vector's extent %d", size, len(m.buf), 2*size-1024)
		}
	}
	for _, size := range []int{100, 1000, 1536, 0} {
		if m, err := newOvMessage(size, true); err == nil {
			n, _ := m.dt.PackedSize(1)
			t.Errorf("size %d accepted (packs %d bytes)", size, n)
		}
	}
	if m, err := newOvMessage(100, false); err != nil || len(m.buf) != 100 || m.dt != nil {
		t.Errorf("untyped 100 B: %d bytes, %v", len(m.buf), err)
	}
}

// The table prints the engine counters once, those of the last job with
// the engine on, as its line says (found by review: with --rounds 3 it
// printed three lines, each saying "last job").
func TestOverlapPrintsLastCounters(t *testing.T) {
	res := newOverlapResults()
	job := func(engine string, offloaded uint64) []overlapLine {
		lines := []overlapLine{
			{Row: &overlapRow{Size: 1 << 20, Mode: "expected", Engine: engine, OverlapPct: 50, TCommUs: 100, TComputeUs: 100, TTotalUs: 150}},
			{Extra: &overlapExtra{Bench: "latency", Engine: engine, Size: 8, LatUs: 2}},
		}
		if engine == "on" {
			lines = append(lines, overlapLine{Extra: &overlapExtra{Bench: "stats", Engine: engine, Stats: &overlap.Stats{Offloaded: offloaded}}})
		}
		return lines
	}
	for round := range 3 {
		res.add("off", job("off", 0))
		res.add("on", job("on", uint64(100+round)))
	}
	var out strings.Builder
	if err := res.print(&out, overlapFlags{tls: "shm", rounds: 3}); err != nil {
		t.Fatal(err)
	}
	var counters []string
	for _, l := range strings.Split(out.String(), "\n") {
		if strings.HasPrefix(l, "# engine counters") {
			counters = append(counters, l)
		}
	}
	if len(counters) != 1 || !strings.Contains(counters[0], "last job with the engine on") || !strings.Contains(counters[0], "offloaded 102 ") {
		t.Errorf("engine counters lines %q, want one, of the last job (offloaded 102)", counters)
	}
}
