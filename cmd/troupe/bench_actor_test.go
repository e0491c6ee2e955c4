package main

import (
	"fmt"
	"testing"
)

func TestBestActorRows(t *testing.T) {
	run1 := []actorRow{
		{Impl: "troupe", Test: "rtt", Size: 8, Us: 3},
		{Impl: "troupe", Test: "tput", Size: 64, MsgsPerS: 100, MBps: 6.4},
		{Impl: "protoactor-grpc", Test: "tput", Size: 64, MsgsPerS: 90, MBps: 5.76},
	}
	run2 := []actorRow{
		{Impl: "troupe", Test: "rtt", Size: 8, Us: 2},
		{Impl: "troupe", Test: "tput", Size: 64, MsgsPerS: 80, MBps: 5.12},
		{Impl: "protoactor-grpc", Test: "tput", Size: 64, MsgsPerS: 95, MBps: 6.08},
		{Impl: "troupe", Test: "tput", Size: 1 << 20, MsgsPerS: 10, MBps: 10485.76},
	}
	got := bestActorRows(bestActorRows(nil, run1), run2)
	want := []actorRow{
		{Impl: "troupe", Test: "rtt", Size: 8, Us: 2},
		{Impl: "troupe", Test: "tput", Size: 64, MsgsPerS: 100, MBps: 6.4},
		{Impl: "protoactor-grpc", Test: "tput", Size: 64, MsgsPerS: 95, MBps: 6.08},
		{Impl: "troupe", Test: "tput", Size: 1 << 20, MsgsPerS: 10, MBps: 10485.76},
	}
	if len(got) != len(want) {
		t.Fatalf("got %d rows, want %d: %+v", len(got), len(want), got)
	}
	for i := range want {
		if got[i] != want[i] {
			t.Errorf("row %d: got %+v, want %+v", i, got[i], want[i])
		}
	}
}

// A real two-rank job of the actor benchmark (UCX between two processes of
// this test binary): one round-trip row per --rtt-sizes payload, the tag
// round trip and one throughput row, all with positive values.
func TestActorJob(t *testing.T) {
	t.Setenv(envTestMain, "1")
	f := actorBenchFlags{tls: "shm", rtts: 50, rttSize: []int{8, 20000}, sizes: []int{64}, scale: 0.001}
	rows, err := runActorBenchJob(t.Context(), f)
	if err != nil {
		t.Fatal(err)
	}
	want := map[string]bool{"rtt/8": false, "rtt/20000": false, "tag_rtt/8": false, "tput/64": false}
	for _, r := range rows {
		k := fmt.Sprintf("%s/%d", r.Test, r.Size)
		seen, ok := want[k]
		if !ok || seen {
			t.Errorf("unexpected or repeated row %+v", r)
			continue
		}
		want[k] = true
		if r.Test == "tput" && (r.MsgsPerS <= 0 || r.MBps <= 0) || r.Test != "tput" && r.Us <= 0 {
			t.Errorf("row %+v: want a positive measurement", r)
		}
	}
	for k, seen := range want {
		if !seen {
			t.Errorf("no %s row in %+v", k, rows)
		}
	}
}

func TestActorFlagsValidate(t *testing.T) {
	ok := actorBenchFlags{rttSize: []int{0, 8}, sizes: []int{64}, scale: 1, repeat: 1}
	if err := ok.validate(); err != nil {
		t.Fatalf("valid sizes refused: %v", err)
	}
	bad := []actorBenchFlags{ok, ok, ok, ok, ok, ok}
	bad[0].rttSize = []int{-1}
	bad[1].sizes = []int{0}
	bad[2].sizes = []int{1 << 40}
	bad[3].rtts = -5
	bad[4].scale = -1
	bad[5].repeat = 0
	for _, f := range bad {
		if err := f.validate(); err == nil {
			t.Errorf("%+v accepted", f)
		}
	}
}
