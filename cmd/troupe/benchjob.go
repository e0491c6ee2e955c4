package main

import (
	"context"
	"encoding/json"
	"fmt"
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

// benchOut opens, on rank 0 of a benchmark job, the file its rows go to
// (TROUPE_BENCH_OUT); other ranks get a nil encoder. closeOut closes the
// file.
func benchOut(rank int) (enc *json.Encoder, closeOut func() error, err error) {
	if rank != 0 {
		return nil, func() error { return nil }, nil
	}
	fh, err := os.OpenFile(os.Getenv(envBenchOut), os.O_WRONLY|os.O_TRUNC, 0)
	if err != nil {
		return nil, nil, fmt.Errorf("opening %s: %w", envBenchOut, err)
	}
	return json.NewEncoder(fh), fh.Close, nil
}

// writeBenchRows writes rows, on rank 0 only, to the benchmark job's
// results file.
func writeBenchRows[T any](rank int, rows []T) error {
	enc, closeOut, err := benchOut(rank)
	if err != nil || enc == nil {
		return err
	}
	for _, r := range rows {
		if err := enc.Encode(r); err != nil {
			closeOut()
			return err
		}
	}
	return closeOut()
}
