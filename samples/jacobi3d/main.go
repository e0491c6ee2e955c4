// Command jacobi3d is troupe's Jacobi3D sample: a 3-D Jacobi solver (7-point
// stencil) whose grid is cut into more blocks than ranks, each block an
// element of an actor array; halo faces travel as actor messages and the
// residual as an array reduction to a driver on rank 0. Run it through the
// embedded launcher:
//
//	troupe run -n 4 -- jacobi3d -grid 96 -blocks 4x4x4 -iters 100
//
// With -gpu the fields live in gpu device memory, the stencil runs as
// kernels on the blocks' streams (the host backend's; the cuda backend has
// no kernels yet) and halos travel as device buffers, through actor
// messages (-gpu-api messaging) or channels (-gpu-api channel).
//
// Rank 0 prints the residual, the field hash, the time per sweep and the
// share of time spent communicating, and with -check compares the field with
// a serial reference (exit status 1 on FAIL). See docs/jacobi3d.md.
package main

import (
	"context"
	"flag"
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

	"github.com/troupe-hpc/troupe/actor"
	"github.com/troupe-hpc/troupe/samples/internal/cli"
	"github.com/troupe-hpc/troupe/samples/jacobi3d/jacobi"
)

func main() {
	os.Exit(run(os.Args[1:], os.Stdout, os.Stderr))
}

// checkAutoMax is the largest grid (points) checked against the serial
// reference by default: 48^3.
const checkAutoMax = 48 * 48 * 48

// run is the program: it returns the exit status.
func run(args []string, stdout, stderr io.Writer) int {
	fs := flag.NewFlagSet("jacobi3d", flag.ContinueOnError)
	fs.SetOutput(stderr)
	grid := fs.Int("grid", 96, "cube grid: N interior points per dimension")
	nx := fs.Int("nx", 0, "interior points in x (overrides -grid)")
	ny := fs.Int("ny", 0, "interior points in y (overrides -grid)")
	nz := fs.Int("nz", 0, "interior points in z (overrides -grid)")
	iters := fs.Int("iters", 100, "timed sweeps (with -tol: the most sweeps after the warm-up)")
	warmup := fs.Int("warmup", 10, "untimed sweeps before the timed ones")
	blocks := fs.String("blocks", "", "actor array shape AxBxC (default: one block per rank when every rank has one processor (GOMAXPROCS), else two per processor; as evenly as the count factors, the largest count along z)")
	tol := fs.Float64("tol", 0, "stop once the residual is <= tol (0: run warmup+iters sweeps)")
	every := fs.Int("every", 1, "reduce the residual every N sweeps (and after the last)")
	wholeSweep := fs.Bool("whole-sweep", false, "sweep each block whole before sending its faces (default: the slabs next to the neighbours first, their faces sent while the rest is swept)")
	check := fs.Bool("check", false, "compare with a serial reference on rank 0 (default: on when the grid has at most 48^3 points)")
	timeout := fs.Duration("timeout", 10*time.Minute, "give up after this long")
	cpuProfile := fs.String("cpuprofile", "", "write each rank's CPU profile to FILE.RANK")
	traceOut := fs.String("trace", "", "write each rank's Go execution trace (go tool trace) to FILE.RANK")
	useGPU := fs.Bool("gpu", false, "keep the fields in gpu device memory and run the stencil on the device (TROUPE_GPU picks the backend: host or cuda)")
	gpuAPI := fs.String("gpu-api", jacobi.APIMessaging, "with -gpu, how device halos travel: messaging (actor messages with a gpu.Buffer field) or channel")
	if status := cli.Parse(fs, args, stderr); status >= 0 {
		return status
	}
	cfg := jacobi.Config{NX: *grid, NY: *grid, NZ: *grid, Warmup: *warmup, Iters: *iters, Tol: *tol, ReduceEvery: *every, WholeSweep: *wholeSweep}
	if err := gpuFlags(fs, *useGPU, *gpuAPI, &cfg); err != nil {
		fmt.Fprintln(stderr, "jacobi3d:", err)
		return 2
	}
	for _, o := range []struct {
		v   int
		dst *int
	}{{*nx, &cfg.NX}, {*ny, &cfg.NY}, {*nz, &cfg.NZ}} {
		if o.v != 0 { // 0: the -grid value; a negative one is refused below
			*o.dst = o.v
		}
	}
	if cfg.NX < 1 || cfg.NY < 1 || cfg.NZ < 1 {
		fmt.Fprintf(stderr, "jacobi3d: grid %dx%dx%d: want at least one point in every dimension\n", cfg.NX, cfg.NY, cfg.NZ)
		return 2
	}
	cfg.Check = cfg.NX*cfg.NY*cfg.NZ <= checkAutoMax
	fs.Visit(func(f *flag.Flag) {
		if f.Name == "check" {
			cfg.Check = *check
		}
	})
	if *blocks != "" {
		b, err := parseBlocks(*blocks)
		if err != nil {
			fmt.Fprintln(stderr, "jacobi3d:", err)
			return 2
		}
		cfg.Blocks = b
	}
	if *timeout <= 0 {
		fmt.Fprintf(stderr, "jacobi3d: -timeout %v: want a positive duration\n", *timeout)
		return 2
	}

	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	ctx, cancel := context.WithTimeout(ctx, *timeout)
	defer cancel()
	rt, err := actor.Init(ctx, actor.Options{})
	if err != nil {
		fmt.Fprintln(stderr, "jacobi3d:", err)
		return 1
	}
	status := 0
	for _, r := range []struct {
		what, base string
		start      func(io.Writer) error
		stop       func()
	}{
		{"cpu profile", *cpuProfile, pprof.StartCPUProfile, pprof.StopCPUProfile},
		{"trace", *traceOut, trace.Start, trace.Stop},
	} {
		if r.base == "" {
			continue
		}
		stop, err := startRecording(r.what, fmt.Sprintf("%s.%d", r.base, rt.Rank()), r.start, r.stop)
		if err != nil {
			fmt.Fprintln(stderr, "jacobi3d:", err)
			return 1
		}
		defer stop()
	}
	if cfg.Blocks == [3]int{} {
		b, err := jacobi.JobBlocks(ctx, rt, "jacobi3d", cfg.NX, cfg.NY, cfg.NZ)
		if err != nil {
			fmt.Fprintf(stderr, "jacobi3d: rank %d: %v\n", rt.Rank(), err)
			return 1
		}
		cfg.Blocks = b
	}
	res, err := jacobi.Run(ctx, rt, cfg)
	if err != nil {
		fmt.Fprintf(stderr, "jacobi3d: rank %d: %v\n", rt.Rank(), err)
		status = 1
	} else if res != nil {
		report(stdout, rt.Size(), cfg, res)
		if res.Checked && !res.Pass {
			status = 1
		}
	}
	sctx, scancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer scancel()
	if err := rt.Shutdown(sctx); err != nil {
		fmt.Fprintf(stderr, "jacobi3d: rank %d: shutdown: %v\n", rt.Rank(), err)
		status = max(status, 1)
	}
	return status
}

// startRecording starts a per-rank recording (what: "cpu profile" or
// "trace") into path with start, and returns the function that ends it
// with stop and closes the file.
func startRecording(what, path string, start func(io.Writer) error, stop func()) (func(), error) {
	f, err := os.Create(path)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", what, err)
	}
	if err := start(f); err != nil {
		f.Close()
		return nil, fmt.Errorf("%s: %w", what, err)
	}
	return func() {
		stop()
		f.Close()
	}, nil
}

// gpuFlags sets the GPU mode of cfg from -gpu and -gpu-api (which needs
// -gpu when given).
func gpuFlags(fs *flag.FlagSet, on bool, api string, cfg *jacobi.Config) error {
	apiSet := false
	fs.Visit(func(f *flag.Flag) { apiSet = apiSet || f.Name == "gpu-api" })
	switch {
	case apiSet && !on:
		return fmt.Errorf("-gpu-api %s needs -gpu", api)
	case !on:
		return nil
	case api != jacobi.APIMessaging && api != jacobi.APIChannel:
		return fmt.Errorf("-gpu-api %q: want %s or %s", api, jacobi.APIMessaging, jacobi.APIChannel)
	}
	cfg.GPU, cfg.GPUAPI = true, api
	return nil
}

// parseBlocks parses "AxBxC".
func parseBlocks(s string) ([3]int, error) {
	var b [3]int
	parts := strings.Split(s, "x")
	if len(parts) != 3 {
		return b, fmt.Errorf("-blocks %q: want AxBxC", s)
	}
	for i, p := range parts {
		n, err := strconv.Atoi(p)
		if err != nil || n <= 0 {
			return b, fmt.Errorf("-blocks %q: %q is not a positive count", s, p)
		}
		b[i] = n
	}
	return b, nil
}

// report prints rank 0's results, one "key value" per line (the contract of
// docs/jacobi3d.md: residual, field_hash, iter_ms, comm_ms), after a header.
func report(w io.Writer, ranks int, cfg jacobi.Config, r *jacobi.Result) {
	nb := cfg.Blocks[0] * cfg.Blocks[1] * cfg.Blocks[2]
	mode := fmt.Sprintf("%d warm-up + %d timed sweeps", cfg.Warmup, cfg.Iters)
	if cfg.Tol > 0 {
		mode = fmt.Sprintf("until residual <= %g (at most %d sweeps, %d warm-up)", cfg.Tol, cfg.Sweeps(), cfg.Warmup)
	}
	fmt.Fprintf(w, "# jacobi3d: grid %dx%dx%d, blocks %dx%dx%d (%d actors, %.1f per rank), %d ranks, %s, residual reduced every %d sweep(s), UCX_TLS=%s\n",
		cfg.NX, cfg.NY, cfg.NZ, cfg.Blocks[0], cfg.Blocks[1], cfg.Blocks[2], nb, float64(nb)/float64(ranks), ranks, mode,
		max(cfg.ReduceEvery, 1), os.Getenv("UCX_TLS"))
	fmt.Fprintf(w, "# iter_ms: median wall time per timed sweep (driver, between residual reductions at least 10 sweeps apart); mean_iter_ms: timed wall time / timed sweeps\n")
	fmt.Fprintf(w, "# comm_ms: time per sweep a rank had none of its blocks computing (waiting for halos and the driver, message handling), mean over ranks; comm_share: that time / the ranks' timed wall time\n")
	fmt.Fprintf(w, "# kernel_ms: time inside the stencil kernel per sweep (unpack + sweep + pack), summed over all blocks\n")
	if r.GPUBackend != "" {
		fmt.Fprintf(w, "# gpu: fields in device memory, stencil kernels on each block's stream (%s backend), halos as device buffers through the %s API\n",
			r.GPUBackend, r.GPUAPI)
		fmt.Fprintf(w, "gpu_api %s\n", r.GPUAPI)
		fmt.Fprintf(w, "gpu_backend %s\n", r.GPUBackend)
		fmt.Fprintf(w, "gpu_ipc_halos %d\n", r.GPUIPC)
	}
	fmt.Fprintf(w, "sweeps %d\n", r.Sweeps)
	fmt.Fprintf(w, "residual %s\n", strconv.FormatFloat(r.Residual, 'g', -1, 64))
	fmt.Fprintf(w, "field_hash %d\n", r.FieldHash)
	fmt.Fprintf(w, "iter_ms %.4f\n", r.IterMs)
	fmt.Fprintf(w, "mean_iter_ms %.4f\n", r.MeanIterMs)
	fmt.Fprintf(w, "comm_ms %.4f\n", r.CommMs)
	fmt.Fprintf(w, "comm_share %.1f%%\n", 100*r.CommShare)
	fmt.Fprintf(w, "kernel_ms %.4f\n", r.KernelMs)
	fmt.Fprintf(w, "elapsed_ms %.1f\n", float64(r.Elapsed)/float64(time.Millisecond))
	if !r.Checked {
		fmt.Fprintf(w, "check skipped (default above 48^3 points; -check forces it)\n")
		return
	}
	verdict := "PASS"
	if !r.Pass {
		verdict = "FAIL"
	}
	fmt.Fprintf(w, "check %s max_abs_diff %g serial_residual %s serial_field_hash %d\n", verdict, r.MaxAbsDiff,
		strconv.FormatFloat(r.SerialResidual, 'g', -1, 64), r.SerialHash)
}
