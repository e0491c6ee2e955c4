package main

import (
	"math"
	"testing"
)

// ucx_perftest prints MiB/s under "MB/s"; parsePerftest must convert to
// 10^6 bytes per second so that the ratio against troupe is fair.
func TestParsePerftestConvertsMiB(t *testing.T) {
	out := "+-----+\nFinal:                  2000     83.846    95.363    95.363    10486.19   10486.19       10486       10486\n"
	lat, bw, err := parsePerftest(out)
	if err != nil {
		t.Fatal(err)
	}
	if lat != 95.363 {
		t.Errorf("latency %v, want the average column 95.363", lat)
	}
	if want := 10486.19 * 1048576 / 1e6; math.Abs(bw-want) > 1e-6 {
		t.Errorf("bandwidth %v MB/s, want %v (10486.19 MiB/s)", bw, want)
	}
	if _, _, err := parsePerftest("no final line"); err == nil {
		t.Error("output without a Final: line parsed without error")
	}
}
