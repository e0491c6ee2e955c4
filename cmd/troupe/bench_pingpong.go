package main

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"os"
	"os/exec"
	"sort"
	"strconv"
	"strings"
	"time"

	"github.com/spf13/cobra"

	"github.com/troupe-hpc/troupe/transport"
	"github.com/troupe-hpc/troupe/transport/bootstrap"
	"github.com/troupe-hpc/troupe/transport/perf"
)

// envBenchOut names the file where rank 0 of a benchmark job writes its
// results, one JSON object per line, for the launching process to format.
const envBenchOut = "TROUPE_BENCH_OUT"

type pingpongFlags struct {
	tls      string
	json     bool
	plot     string
	minSize  int
	maxSize  int
	scale    float64
	progress string
	compare  int
	any      bool
}

func newPingpongCmd() *cobra.Command {
	var f pingpongFlags
	cmd := &cobra.Command{
		Use:   "pingpong",
		Short: "One-way latency and bandwidth (window 64) between two ranks, OSU style",
		Long: `pingpong starts a two-rank job through the embedded launcher and prints
one-way latency (half the round trip) and bandwidth with 64 messages in flight
for 8 B ... 4 MiB. --compare N interleaves N rounds of troupe and raw
ucx_perftest (8 B tag_lat, 1 MiB tag_bw) and prints a text table of the
rounds, medians and ratios; it takes none of --json, --plot, --min and --max.`,
		Args: cobra.NoArgs,
	}
	fl := cmd.Flags()
	fl.StringVar(&f.tls, "tls", "shm", "UCX transports: shm, tcp, or a UCX_TLS value")
	fl.BoolVar(&f.json, "json", false, `print one JSON object per size: {"size":8,"lat_us":...,"bw_MBps":...}`)
	fl.StringVar(&f.plot, "plot", "", "draw latency and bandwidth curves into this PNG file")
	fl.IntVar(&f.minSize, "min", 8, "smallest message size in bytes")
	fl.IntVar(&f.maxSize, "max", 4<<20, "largest message size in bytes")
	fl.Float64Var(&f.scale, "scale", 1, "iteration count multiplier (positive, finite)")
	fl.StringVar(&f.progress, "progress", "direct", "transport progress mode: direct or queue")
	fl.IntVar(&f.compare, "compare", 0, "interleave N rounds against raw ucx_perftest and report medians (8 B and 1 MiB, a text table: not with --json, --plot, --min, --max)")
	fl.BoolVar(&f.any, "any-source", false, "receive every message with transport.AnySource (what wildcard matching costs)")
	setBenchRun(cmd, func(ctx context.Context) error { return pingpongRank(ctx, f) },
		func(ctx context.Context, out io.Writer) error {
			if err := checkSizes(f.minSize, f.maxSize); err != nil {
				return err
			}
			if err := checkCounts("--scale", f.scale); err != nil {
				return err
			}
			if f.progress != "direct" && f.progress != "queue" {
				return fmt.Errorf("--progress %q: want direct or queue", f.progress)
			}
			if f.compare < 0 {
				return fmt.Errorf("--compare %d: want a number of rounds (0: no comparison)", f.compare)
			}
			if f.compare > 0 {
				// The comparison measures 8 B and 1 MiB and prints a table
				// of its own: flags of the sweep would be ignored.
				for _, c := range []struct {
					name string
					set  bool
				}{{"json", f.json}, {"plot", f.plot != ""}, {"min", cmd.Flags().Changed("min")}, {"max", cmd.Flags().Changed("max")}} {
					if c.set {
						return fmt.Errorf("--compare measures 8 B latency and 1 MiB bandwidth and prints a text table: --%s does not apply to it", c.name)
					}
				}
				return pingpongCompare(ctx, out, f)
			}
			pts, err := runPingpongJob(ctx, f, f.minSize, f.maxSize)
			if err != nil {
				return err
			}
			if f.json {
				enc := json.NewEncoder(out)
				for _, p := range pts {
					if err := enc.Encode(p); err != nil {
						return err
					}
				}
			} else {
				recv := ""
				if f.any {
					recv = ", any-source receives"
				}
				fmt.Fprintf(out, "# troupe ping-pong, 2 ranks, UCX_TLS=%s, progress %s%s\n", bootstrap.UCXTLS(f.tls), f.progress, recv)
				fmt.Fprintf(out, "%-10s %14s %18s\n", "# size", "latency (us)", "bandwidth (MB/s)")
				for _, p := range pts {
					fmt.Fprintf(out, "%-10s %14.2f %18.1f\n", perf.FormatSize(p.Size), p.LatUs, p.BwMBs)
				}
			}
			if f.plot != "" {
				return plotPingpong(f.plot, pts)
			}
			return nil
		})
	return cmd
}

func init() { benchCmd.AddCommand(newPingpongCmd()) }

// runPingpongJob launches two ranks of this executable and returns rank 0's results.
func runPingpongJob(ctx context.Context, f pingpongFlags, minSize, maxSize int) ([]perf.Point, error) {
	return runBenchJob[perf.Point](ctx, 2, f.tls, 0, []string{"bench", "pingpong", "--as-rank",
		"--min", strconv.Itoa(minSize), "--max", strconv.Itoa(maxSize),
		"--scale", strconv.FormatFloat(f.scale, 'g', -1, 64), "--progress", f.progress,
		"--any-source=" + strconv.FormatBool(f.any)}, nil)
}

func readJSONLines[T any](path string) ([]T, error) {
	fh, err := os.Open(path)
	if err != nil {
		return nil, err
	}
	defer fh.Close()
	var res []T
	sc := bufio.NewScanner(fh)
	for sc.Scan() {
		var v T
		if err := json.Unmarshal(sc.Bytes(), &v); err != nil {
			return nil, fmt.Errorf("reading benchmark results: %w", err)
		}
		res = append(res, v)
	}
	return res, sc.Err()
}

func pingpongRank(ctx context.Context, f pingpongFlags) error {
	boot, err := bootstrap.FromEnv(ctx)
	if err != nil {
		return err
	}
	defer boot.Close()
	opts := transport.Options{Bootstrap: boot}
	if f.progress == "queue" {
		opts.Progress = transport.ProgressQueue
	}
	t, err := transport.New(ctx, opts)
	if err != nil {
		return err
	}
	defer t.Close()
	enc, closeOut, err := benchOut(t.Rank())
	if err != nil {
		return err
	}
	defer closeOut()
	var encErr error
	_, err = perf.Sweep(ctx, t, perf.Config{MinSize: f.minSize, MaxSize: f.maxSize, Scale: f.scale, AnySource: f.any}, func(p perf.Point) {
		if e := enc.Encode(p); e != nil && encErr == nil {
			encErr = e
		}
	})
	if err != nil {
		return err
	}
	if encErr != nil {
		return encErr
	}
	return boot.Barrier(ctx, "bench.pingpong.done")
}

// perftest runs one ucx_perftest server/client pair on loopback and returns
// the client's average latency (us) and bandwidth (MB/s).
func perftest(ctx context.Context, tls, test string, size, iters int) (lat, bw float64, err error) {
	port := strconv.Itoa(20000 + rand.IntN(20000))
	env := os.Environ()
	if v := bootstrap.UCXTLS(tls); v != "" {
		env = append(env, "UCX_TLS="+v)
	}
	args := []string{"-t", test, "-s", strconv.Itoa(size), "-n", strconv.Itoa(iters), "-p", port}
	srv := exec.CommandContext(ctx, "ucx_perftest", args...)
	srv.Env = env
	srv.Stdout, srv.Stderr = io.Discard, io.Discard
	if err := srv.Start(); err != nil {
		return 0, 0, fmt.Errorf("starting ucx_perftest (apt-get install ucx-utils): %w", err)
	}
	defer func() { _ = srv.Process.Kill(); _ = srv.Wait() }()
	// The client retries until the server listens: ucx_perftest has no readiness signal.
	for attempt := 0; attempt < 100; attempt++ {
		cli := exec.CommandContext(ctx, "ucx_perftest", append([]string{"127.0.0.1"}, args...)...)
		cli.Env = env
		out, cerr := cli.CombinedOutput()
		if cerr == nil {
			return parsePerftest(string(out))
		}
		if ctx.Err() != nil {
			return 0, 0, ctx.Err()
		}
		time.Sleep(20 * time.Millisecond)
	}
	return 0, 0, errors.New("ucx_perftest client could not connect to its server")
}

// parsePerftest reads the "Final:" line: iterations, latency 50%ile, average,
// overall, bandwidth average, overall, message rate average, overall.
// ucx_perftest's "MB/s" are MiB/s (its bandwidth column equals the message
// rate for 1 MiB messages); the result is converted to troupe's unit, 10^6
// bytes per second.
func parsePerftest(out string) (lat, bw float64, err error) {
	for _, line := range strings.Split(out, "\n") {
		fs := strings.Fields(line)
		if len(fs) >= 7 && fs[0] == "Final:" {
			lat, err1 := strconv.ParseFloat(fs[3], 64)
			bw, err2 := strconv.ParseFloat(fs[5], 64)
			if err := errors.Join(err1, err2); err != nil {
				return 0, 0, fmt.Errorf("parsing ucx_perftest output %q: %w", line, err)
			}
			return lat, bw * (1 << 20) / 1e6, nil
		}
	}
	return 0, 0, fmt.Errorf("no Final: line in ucx_perftest output:\n%s", out)
}

func median(xs []float64) float64 {
	s := append([]float64(nil), xs...)
	sort.Float64s(s)
	if len(s) == 0 {
		return 0
	}
	if len(s)%2 == 1 {
		return s[len(s)/2]
	}
	return (s[len(s)/2-1] + s[len(s)/2]) / 2
}

func pingpongCompare(ctx context.Context, out io.Writer, f pingpongFlags) error {
	const small, large = 8, 1 << 20
	var tLat, tBw, pLat, pBw []float64
	fmt.Fprintf(out, "# troupe vs ucx_perftest, UCX_TLS=%s, %d interleaved rounds\n", bootstrap.UCXTLS(f.tls), f.compare)
	fmt.Fprintf(out, "%-6s %16s %16s %18s %18s\n", "round", "troupe 8B (us)", "perftest 8B (us)", "troupe 1M (MB/s)", "perftest 1M (MB/s)")
	for r := 0; r < f.compare; r++ {
		a, err := runPingpongJob(ctx, f, small, small)
		if err != nil {
			return err
		}
		b, err := runPingpongJob(ctx, f, large, large)
		if err != nil {
			return err
		}
		pl, _, err := perftest(ctx, f.tls, "tag_lat", small, 100000)
		if err != nil {
			return err
		}
		_, pb, err := perftest(ctx, f.tls, "tag_bw", large, 2000)
		if err != nil {
			return err
		}
		tLat, tBw, pLat, pBw = append(tLat, a[0].LatUs), append(tBw, b[0].BwMBs), append(pLat, pl), append(pBw, pb)
		fmt.Fprintf(out, "%-6d %16.3f %16.3f %18.1f %18.1f\n", r+1, a[0].LatUs, pl, b[0].BwMBs, pb)
	}
	ml, mpl, mb, mpb := median(tLat), median(pLat), median(tBw), median(pBw)
	fmt.Fprintf(out, "%-6s %16.3f %16.3f %18.1f %18.1f\n", "median", ml, mpl, mb, mpb)
	fmt.Fprintf(out, "# 8 B latency: troupe - perftest = %+.3f us (target <= +1 us)\n", ml-mpl)
	fmt.Fprintf(out, "# 1 MiB bandwidth: troupe / perftest = %.1f%% (target >= 90%%)\n", 100*mb/mpb)
	return nil
}
