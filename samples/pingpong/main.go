// Command pingpong is troupe's two-rank ping-pong: an OSU-style table of
// one-way latency and bandwidth over the transport. Run it through the
// embedded launcher:
//
//	troupe run -n 2 -- pingpong [-max 4194304] [-progress direct|queue]
package main

import (
	"context"
	"flag"
	"fmt"
	"io"
	"os"
	"os/signal"
	"syscall"
	"time"

	"github.com/troupe-hpc/troupe/samples/internal/cli"
	"github.com/troupe-hpc/troupe/transport"
	"github.com/troupe-hpc/troupe/transport/bootstrap"
	"github.com/troupe-hpc/troupe/transport/perf"
)

func main() {
	f, status := parseFlags(os.Args[1:], os.Stderr)
	if status >= 0 {
		os.Exit(status)
	}
	if err := run(f.maxSize, f.scale, f.progress, f.idle); err != nil {
		fmt.Fprintln(os.Stderr, "pingpong:", err)
		os.Exit(1)
	}
}

// flags are the command line.
type flags struct {
	maxSize  int
	scale    float64
	progress string
	idle     time.Duration
}

// parseFlags parses the command line. status is -1 when the program should
// run, else its exit status: 0 after -h, 2 after a usage error (printed to
// stderr).
func parseFlags(args []string, stderr io.Writer) (f flags, status int) {
	fs := flag.NewFlagSet("pingpong", flag.ContinueOnError)
	fs.IntVar(&f.maxSize, "max", 4<<20, "largest message size in bytes")
	fs.Float64Var(&f.scale, "scale", 1, "iteration count multiplier")
	fs.StringVar(&f.progress, "progress", "direct", "progress mode: direct or queue")
	fs.DurationVar(&f.idle, "idle", 0, "after the sweep, stay idle this long and report the CPU time used")
	return f, cli.Parse(fs, args, stderr)
}

func run(maxSize int, scale float64, progress string, idle time.Duration) error {
	switch {
	case progress != "direct" && progress != "queue":
		return fmt.Errorf("-progress %q: want direct or queue", progress)
	case maxSize < 8 || maxSize > 1<<30:
		return fmt.Errorf("-max %d: want 8 to %d bytes", maxSize, 1<<30)
	case scale <= 0:
		return fmt.Errorf("-scale %g: want a positive multiplier", scale)
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	boot, err := bootstrap.FromEnv(ctx)
	if err != nil {
		return err
	}
	defer boot.Close()
	if boot.Size() < 2 {
		return fmt.Errorf("needs at least 2 ranks, job has %d (troupe run -n 2 -- pingpong)", boot.Size())
	}
	opts := transport.Options{Bootstrap: boot}
	if progress == "queue" {
		opts.Progress = transport.ProgressQueue
	}
	t, err := transport.New(ctx, opts)
	if err != nil {
		return err
	}
	defer t.Close()
	if t.Rank() == 0 {
		fmt.Printf("# troupe ping-pong, ranks 0 <-> 1, progress %s, UCX_TLS=%s\n", opts.Progress, os.Getenv("UCX_TLS"))
		fmt.Printf("%-10s %14s %16s\n", "# size", "latency (us)", "bandwidth (MB/s)")
	}
	_, err = perf.Sweep(ctx, t, perf.Config{MaxSize: maxSize, Scale: scale}, func(p perf.Point) {
		fmt.Printf("%-10s %14.2f %16.1f\n", perf.FormatSize(p.Size), p.LatUs, p.BwMBs)
	})
	if err != nil {
		return err
	}
	if idle > 0 {
		// Endpoints are up and the worker has nothing to do: the progress
		// goroutine should sleep on the worker's event fd.
		before := cpuTime()
		start := time.Now()
		select {
		case <-time.After(idle):
		case <-ctx.Done():
			return ctx.Err()
		}
		used := cpuTime() - before
		fmt.Printf("idle rank %d: %.1f ms CPU in %.1f s = %.2f%% of a core\n", t.Rank(), used.Seconds()*1e3,
			time.Since(start).Seconds(), 100*used.Seconds()/time.Since(start).Seconds())
	}
	// Nobody leaves while the other may still be draining its last messages.
	return boot.Barrier(ctx, "pingpong.done")
}

// cpuTime is the process's user plus system CPU time.
func cpuTime() time.Duration {
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		return 0
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}
