package main

import (
	"bytes"
	"encoding/json"
	"io"
	"os"
	"os/exec"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/troupe-hpc/troupe/samples/protobench/bench"
)

// TestMain lets -selfspawn re-execute the test binary as the server.
func TestMain(m *testing.M) {
	if os.Getenv(childEnv) == "1" {
		if err := run(os.Args[1:], os.Stdin, os.Stdout); err != nil {
			os.Stderr.WriteString("protobench child: " + err.Error() + "\n")
			os.Exit(1)
		}
		os.Exit(0)
	}
	os.Exit(m.Run())
}

// childCmd runs the test binary as protobench (see TestMain).
func childCmd(t *testing.T, args ...string) *exec.Cmd {
	exe, err := os.Executable()
	require.NoError(t, err)
	cmd := exec.Command(exe, args...)
	cmd.Env = append(os.Environ(), childEnv+"=1")
	return cmd
}

// An argument that is not a flag is refused: the flag package stops
// there, and every flag after it was ignored (here -peer: "-role client
// needs -peer").
func TestStrayArgument(t *testing.T) {
	var stderr strings.Builder
	status := exitStatus(run([]string{"-role", "client", "stray", "-peer", "127.0.0.1:1"}, nil, io.Discard), &stderr)
	if status != 2 || !strings.Contains(stderr.String(), `unexpected argument "stray"`) {
		t.Fatalf("status %d, stderr %q", status, stderr.String())
	}
	stderr.Reset()
	if status := exitStatus(run([]string{"-sizes", "x"}, nil, io.Discard), &stderr); status != 2 {
		t.Fatalf("-sizes x: status %d, stderr %q", status, stderr.String())
	}
}

// TestSelfSpawnJSON runs "protobench -selfspawn -json" (a tiny run) in a
// child process, which starts the server as its own child, and checks the
// JSON rows' exact shape. Each process holds one protoactor remote, which
// keeps the race detector quiet (see bench.Run).
func TestSelfSpawnJSON(t *testing.T) {
	var out, errOut bytes.Buffer
	cmd := childCmd(t, "-selfspawn", "-json", "-iters", "50", "-warmup", "10",
		"-sizes", "64", "-bytes", "1", "-min-msgs", "100", "-max-msgs", "100", "-timeout", "20s")
	cmd.Stdout, cmd.Stderr = &out, &errOut
	require.NoError(t, cmd.Run(), "stderr:\n%s", errOut.String())

	lines := strings.Split(strings.TrimSpace(out.String()), "\n")
	require.Len(t, lines, 2, "output:\n%s", out.String())

	var rtt map[string]any
	require.NoError(t, json.Unmarshal([]byte(lines[0]), &rtt))
	require.ElementsMatch(t, []string{"impl", "test", "size", "us"}, keys(rtt))
	require.Equal(t, "protoactor-grpc", rtt["impl"])
	require.Equal(t, "rtt", rtt["test"])
	require.EqualValues(t, 8, rtt["size"])
	require.Greater(t, rtt["us"].(float64), 0.0)

	var tput map[string]any
	require.NoError(t, json.Unmarshal([]byte(lines[1]), &tput))
	require.ElementsMatch(t, []string{"impl", "test", "size", "msgs_per_s", "MBps"}, keys(tput))
	require.Equal(t, "protoactor-grpc", tput["impl"])
	require.Equal(t, "tput", tput["test"])
	require.EqualValues(t, 64, tput["size"])
	require.Greater(t, tput["msgs_per_s"].(float64), 0.0)
	require.Greater(t, tput["MBps"].(float64), 0.0)
}

// TestRunCounts starts the server in a child process and runs bench.Run
// here, checking that every round trip was answered and every message
// counted (Run fails if the counter's count differs from what was sent).
func TestRunCounts(t *testing.T) {
	child, err := bench.SpawnServer(childCmd(t, "-role", "server", "-addr", "127.0.0.1:0", "-stdin-eof"), 20*time.Second)
	require.NoError(t, err)
	defer func() { require.NoError(t, child.Stop()) }()

	cfg := bench.DefaultConfig(child.Addr())
	cfg.RTTWarmup, cfg.RTTIters = 5, 30
	cfg.TputSizes = []int{64, 512}
	cfg.TputBytes, cfg.TputMinMsgs, cfg.TputMaxMsgs = 1, 200, 200
	cfg.Timeout = 20 * time.Second
	rows, err := bench.Run(cfg)
	require.NoError(t, err)
	require.Len(t, rows, 3)

	require.Equal(t, "rtt", rows[0].Test)
	require.Equal(t, 8, rows[0].Size)
	require.Equal(t, 30, rows[0].Count)
	require.Greater(t, rows[0].US, 0.0)
	require.Greater(t, rows[0].MedianUS, 0.0)
	for i, size := range cfg.TputSizes {
		r := rows[1+i]
		require.Equal(t, "tput", r.Test)
		require.Equal(t, size, r.Size)
		require.Equal(t, 200, r.Count)
		require.Greater(t, r.MsgsPerS, 0.0)
		require.InDelta(t, r.MsgsPerS*float64(size)/1e6, r.MBps, 1e-6)
	}
}

func keys(m map[string]any) []string {
	var ks []string
	for k := range m {
		ks = append(ks, k)
	}
	return ks
}
