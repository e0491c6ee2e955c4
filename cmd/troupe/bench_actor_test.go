package main

import "testing"

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
