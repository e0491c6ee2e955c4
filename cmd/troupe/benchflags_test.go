package main

import (
	"io"
	"strings"
	"testing"

	"github.com/spf13/cobra"
)

// Bad benchmark flags are refused before any rank starts, naming the flag
// (some hung for ever: --window 0 and --min 0; some ran something else:
// --progress bogus ran direct; --max 2^63-1 ran out of memory).
func TestBenchFlagsRefused(t *testing.T) {
	for _, c := range []struct {
		cmd  func() *cobra.Command
		args []string
		want string
	}{
		{newGPUBenchCmd, []string{"--window", "0"}, "--window 0"},
		{newGPUBenchCmd, []string{"--min", "-8"}, "--min -8"},
		{newGPUBenchCmd, []string{"--min", "128", "--max", "64"}, "above --max"},
		{newOverlapCmd, []string{"--min", "0"}, "--min 0"},
		{newOverlapCmd, []string{"--gather-size", "-1"}, "--gather-size -1"},
		{newPingpongCmd, []string{"--progress", "bogus"}, `--progress "bogus"`},
		{newPingpongCmd, []string{"--max", "9223372036854775807"}, "--max 9223372036854775807"},
		{newPingpongCmd, []string{"--max", "0"}, "above --max"},
		{newOverlapCmd, []string{"--rounds", "0"}, "--rounds 0"},
		{newNoncontigCmd, []string{"--point-time", "-1s"}, "--point-time -1s"},
		{newNoncontigCmd, []string{"--scale", "-3"}, "--scale -3"},
		{newOverlapCmd, []string{"--typed", "--min", "1536"}, "--min 1536"},
		{newPingpongCmd, []string{"--scale", "0"}, "--scale 0"},
		{newPingpongCmd, []string{"--scale", "-1"}, "--scale -1"},
		{newPingpongCmd, []string{"--scale", "NaN"}, "--scale NaN"},
		{newGPUBenchCmd, []string{"--scale", "0"}, "--scale 0"},
		{newGPUBenchCmd, []string{"--scale", "-0.5"}, "--scale -0.5"},
		{newGPUBenchCmd, []string{"--scale", "+Inf"}, "--scale +Inf"},
		{newOverlapCmd, []string{"--scale", "Inf"}, "--scale +Inf"},
		{newNoncontigCmd, []string{"--scale", "NaN"}, "--scale NaN"},
		{newActorBenchCmd, []string{"--scale", "-Inf"}, "--scale -Inf"},
		{newPingpongCmd, []string{"--compare", "2", "--json"}, "--json"},
		{newPingpongCmd, []string{"--compare", "2", "--plot", "pp.png"}, "--plot"},
		{newPingpongCmd, []string{"--compare", "2", "--min", "64"}, "--min"},
		{newPingpongCmd, []string{"--compare", "2", "--max", "64"}, "--max"},
		{newPingpongCmd, []string{"--compare", "-1"}, "--compare -1"},
		{newOverlapCmd, []string{"--gather-delay=-1ms"}, "--gather-delay -1ms"},
		{newOverlapCmd, []string{"--gather-ranks", "1"}, "--gather-ranks 1"},
		{newOverlapCmd, []string{"--gather-ranks", "-2"}, "--gather-ranks -2"},
		{newNoncontigCmd, []string{"--layout", "milc_zd", "--no-apps"}, "--no-apps"},
		{newNoncontigCmd, []string{"--layout", "bogus"}, `unknown layout "bogus"`},
		{newNoncontigCmd, []string{"--layout", ""}, "empty layout name"},
		// Found by a review of 2026-12-07: a rank panicked (makeslice) or
		// a run measured its floor of iterations.
		{newPingpongCmd, []string{"--scale", "1e300"}, "--scale 1e+300"},
		{newActorBenchCmd, []string{"--rtts", "9223372036854775807"}, "--rtts 9223372036854775807"},
		{newActorBenchCmd, []string{"--rtt-sizes", "9223372036854775807"}, "--rtt-sizes: size 9223372036854775807"},
		{newNoncontigCmd, []string{"--layout", "vec_1073741824x1073741824"}, "would pass"},
	} {
		cmd := c.cmd()
		cmd.SetArgs(c.args)
		cmd.SetOut(io.Discard)
		cmd.SetErr(io.Discard)
		if err := cmd.ExecuteContext(t.Context()); err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("%s %v: %v, want an error naming %q", cmd.Name(), c.args, err, c.want)
		}
	}
	// A name that is no benchmark is an error (it printed the help, status 0).
	rootCmd.SetArgs([]string{"bench", "pingong"})
	rootCmd.SetOut(io.Discard)
	rootCmd.SetErr(io.Discard)
	defer rootCmd.SetArgs(nil)
	if err := rootCmd.Execute(); err == nil || !strings.Contains(err.Error(), `unknown benchmark "pingong"`) {
		t.Errorf("troupe bench pingong: %v", err)
	}
}

// bench gpu allocates --window device buffers and as many pinned buffers of
// --max bytes on each rank: a window that takes more than maxBenchSize
// bytes, or more than maxGPUWindow buffers, is refused before the job
// starts (found by review: --window had no upper bound, and --window 64
// --max 1G asked each rank for 128 GiB). The jobs here get a UCX
// transport that does not exist, so that a build without the check fails
// in transport.New, before allocating anything.
func TestGPUBenchWindowBounded(t *testing.T) {
	for _, c := range []struct {
		args []string
		want string
	}{
		{[]string{"--window", "100000", "--max", "8"}, "--window 100000"},
		{[]string{"--window", "64", "--max", "33554432"}, "--window 64 of --max 33554432"},
		{[]string{"--window", "2", "--min", "1073741824", "--max", "1073741824"}, "--window 2 of --max 1073741824"},
	} {
		cmd := newGPUBenchCmd()
		cmd.SetArgs(append(c.args, "--tls", "no-such-transport"))
		cmd.SetOut(io.Discard)
		cmd.SetErr(io.Discard)
		if err := cmd.ExecuteContext(t.Context()); err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("bench gpu %v: %v, want an error naming %q", c.args, err, c.want)
		}
	}
}
