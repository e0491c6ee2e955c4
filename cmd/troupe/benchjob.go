package main

import (
	"context"
	"os"

	"github.com/troupe-hpc/troupe/transport/bootstrap"
)

// runBenchJob launches n ranks of this executable with args (a benchmark's
// hidden --as-rank form) and extra environment, over the transports tls,
// and returns the rows rank 0 wrote, one JSON object per line, to the file
// named by TROUPE_BENCH_OUT.
func runBenchJob[T any](ctx context.Context, n int, tls string, args, env []string) ([]T, error) {
	self, err := os.Executable()
	if err != nil {
		return nil, err
	}
	out, err := os.CreateTemp("", "troupe-bench-*.jsonl")
	if err != nil {
		return nil, err
	}
	out.Close()
	defer os.Remove(out.Name())
	err = bootstrap.Launch(ctx, bootstrap.LaunchConfig{
		N:       n,
		Program: self,
		Args:    args,
		Env:     append([]string{envBenchOut + "=" + out.Name()}, env...),
		TLS:     tls,
		Stdout:  os.Stderr,
		Stderr:  os.Stderr,
	})
	if err != nil {
		return nil, err
	}
	return readJSONLines[T](out.Name())
}
