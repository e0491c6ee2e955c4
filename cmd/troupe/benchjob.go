package main

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"os"
	"os/signal"
	"runtime/pprof"
	"runtime/trace"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/spf13/cobra"

	"github.com/troupe-hpc/troupe/actor"
	"github.com/troupe-hpc/troupe/transport/bootstrap"
)

// runBenchJob launches n ranks of this executable with args (a benchmark's
// hidden --as-rank form) and extra environment, over the transports tls,
// and returns the rows rank 0 wrote, one JSON object per line, to the file
// named by TROUPE_BENCH_OUT. procs is bootstrap.LaunchConfig.ProcsPerRank
// (0: each rank gets Go's default GOMAXPROCS).
func runBenchJob[T any](ctx context.Context, n int, tls string, procs int, args, env []string) ([]T, error) {
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
		N:            n,
		Program:      self,
		Args:         args,
		Env:          append([]string{envBenchOut + "=" + out.Name()}, env...),
		TLS:          tls,
		ProcsPerRank: procs,
		Stdout:       os.Stderr,
		Stderr:       os.Stderr,
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

// envBenchTrace, when set, makes each rank of a benchmark job that calls
// benchTrace write a Go execution trace (runtime/trace) to
// $TROUPE_BENCH_TRACE.rank<N>, for `go tool trace`.
const envBenchTrace = "TROUPE_BENCH_TRACE"

// benchTrace starts the rank's execution trace when envBenchTrace asks for
// one; the returned function stops it.
func benchTrace(rank int) (stop func(), err error) {
	base := os.Getenv(envBenchTrace)
	if base == "" {
		return func() {}, nil
	}
	fh, err := os.Create(fmt.Sprintf("%s.rank%d", base, rank))
	if err != nil {
		return nil, err
	}
	if err := trace.Start(fh); err != nil {
		fh.Close()
		return nil, err
	}
	return func() { trace.Stop(); fh.Close() }, nil
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

// setBenchRun makes cmd a launcher-driven benchmark: with the hidden
// --as-rank flag (which it registers) it runs rank, one rank of the job;
// without it, run, the whole benchmark writing its report to the command's
// output. Both stop on SIGINT or SIGTERM.
func setBenchRun(cmd *cobra.Command, rank func(context.Context) error, run func(context.Context, io.Writer) error) {
	var asRank bool
	cmd.Flags().BoolVar(&asRank, "as-rank", false, "run as one rank of the job (internal)")
	_ = cmd.Flags().MarkHidden("as-rank")
	cmd.RunE = func(cmd *cobra.Command, _ []string) error {
		ctx, stop := signal.NotifyContext(cmd.Context(), os.Interrupt, syscall.SIGTERM)
		defer stop()
		if asRank {
			stopProfile, err := startRankProfile()
			if err != nil {
				return err
			}
			defer stopProfile()
			return rank(ctx)
		}
		return run(ctx, cmd.OutOrStdout())
	}
}

// envCPUProfile names the CPU profile prefix of benchmark ranks: with
// TROUPE_CPUPROFILE=p each rank writes p.rank<N> (for go tool pprof).
const envCPUProfile = "TROUPE_CPUPROFILE"

// startRankProfile starts the CPU profile TROUPE_CPUPROFILE asks for, if
// any, and returns the function that stops it.
func startRankProfile() (stop func(), err error) {
	prefix := os.Getenv(envCPUProfile)
	if prefix == "" {
		return func() {}, nil
	}
	fh, err := os.Create(fmt.Sprintf("%s.rank%s", prefix, os.Getenv(bootstrap.EnvRank)))
	if err != nil {
		return nil, fmt.Errorf("%s: %w", envCPUProfile, err)
	}
	if err := pprof.StartCPUProfile(fh); err != nil {
		fh.Close()
		return nil, fmt.Errorf("%s: %w", envCPUProfile, err)
	}
	return func() { pprof.StopCPUProfile(); fh.Close() }, nil
}

// joinInts formats xs as a comma-separated flag value.
func joinInts(xs []int) string {
	s := make([]string, len(xs))
	for i, x := range xs {
		s[i] = strconv.Itoa(x)
	}
	return strings.Join(s, ",")
}

// maxScale bounds --scale, the iteration count multiplier.
const maxScale = 1e6

// maxCount bounds counts of repetitions (round trips, messages) a
// benchmark takes on the command line.
const maxCount = 1e8

// maxBenchSize bounds the message sizes a benchmark accepts: every rank
// allocates buffers of the largest.
const maxBenchSize = 1 << 30

// checkSizes refuses a --min/--max range a size sweep cannot run: sizes
// below 1 (a doubling sweep from 0 never ends), above maxBenchSize, or
// --min above --max (an empty table).
func checkSizes(minSize, maxSize int) error {
	switch {
	case minSize < 1:
		return fmt.Errorf("--min %d: want at least 1", minSize)
	case maxSize > maxBenchSize:
		return fmt.Errorf("--max %d: want at most %d", maxSize, maxBenchSize)
	case minSize > maxSize:
		return fmt.Errorf("--min %d is above --max %d", minSize, maxSize)
	}
	return nil
}

// shutdownRank shuts a benchmark rank's actor runtime down, giving up
// after 20 s: a rank that fails while the others wait at a barrier of
// their own would otherwise wait at the shutdown barrier for ever, and
// the launcher, which stops the job when a rank exits with an error,
// would never hear of it.
func shutdownRank(rt *actor.Runtime) {
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	_ = rt.Shutdown(ctx)
}

// checkCounts refuses counts, multipliers and durations a benchmark cannot
// run with: each named value must be positive (a zero or negative one was
// once silently replaced by a default or ran nothing), and a multiplier
// finite (NaN or Inf times an iteration count converted to int gave the
// benchmark's minimum count).
func checkCounts(vals ...any) error {
	for i := 0; i+1 < len(vals); i += 2 {
		name := vals[i].(string)
		var ok bool
		want := "a positive value"
		switch v := vals[i+1].(type) {
		case int:
			ok = v > 0
		case float64:
			// NaN > 0 is false; a multiplier above maxScale overflowed
			// the iteration counts to their floor (int(2e4*1e300) is
			// MinInt64 on amd64).
			ok = v > 0 && v <= maxScale
			want = fmt.Sprintf("a positive number up to %g", float64(maxScale))
		case time.Duration:
			ok = v > 0
		}
		if !ok {
			return fmt.Errorf("%s %v: want %s", name, vals[i+1], want)
		}
	}
	return nil
}
