// Command faces is the Faces nearest-neighbour exchange on a 3-D grid of
// ranks, with device-memory faces exchanged through stream-triggered queues
// and through plain host-driven sends, each checked against a serial
// reference. Run it through the embedded launcher:
//
//	bin/troupe run -n 4 -- bin/faces [-L 8] [-iters 20] [-mode both|queue|plain]
//
// TROUPE_GPU selects the gpu backend (host where no GPU is found).
package main

import (
	"context"
	"flag"
	"fmt"
	"io"
	"os"
	"os/signal"
	"syscall"

	"github.com/troupe-hpc/troupe/gpu"
	"github.com/troupe-hpc/troupe/samples/faces/facesim"
	"github.com/troupe-hpc/troupe/samples/internal/cli"
	"github.com/troupe-hpc/troupe/transport"
	"github.com/troupe-hpc/troupe/transport/bootstrap"
)

func main() {
	f, status := parseFlags(os.Args[1:], os.Stderr)
	if status >= 0 {
		os.Exit(status)
	}
	if err := run(f.L, f.iters, f.mode); err != nil {
		fmt.Fprintln(os.Stderr, "faces:", err)
		os.Exit(1)
	}
}

// flags are the command line.
type flags struct {
	L, iters int
	mode     string
}

// parseFlags parses the command line. status is -1 when the program should
// run, else its exit status: 0 after -h, 2 after a usage error (printed to
// stderr).
func parseFlags(args []string, stderr io.Writer) (f flags, status int) {
	fs := flag.NewFlagSet("faces", flag.ContinueOnError)
	fs.IntVar(&f.L, "L", 8, "cells per block edge")
	fs.IntVar(&f.iters, "iters", 20, "iterations per mode")
	fs.StringVar(&f.mode, "mode", "both", "exchange: queue (stream-triggered), plain (host-driven sends) or both")
	return f, cli.Parse(fs, args, stderr)
}

func run(L, iters int, mode string) error {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	boot, err := bootstrap.FromEnv(ctx)
	if err != nil {
		return err
	}
	defer boot.Close()
	t, err := transport.New(ctx, transport.Options{Bootstrap: boot})
	if err != nil {
		return err
	}
	defer t.Close()
	sys, err := gpu.Open()
	if err != nil {
		return err
	}
	defer sys.Close()
	modes := []string{facesim.ModeQueue, facesim.ModePlain}
	if mode != "both" {
		modes = []string{mode}
	}
	r, err := facesim.NewRank(t, sys, facesim.Config{L: L, Iters: iters})
	if err != nil {
		return err
	}
	defer func() {
		// The transport first: an iteration that failed may leave
		// requests posted on the rank's buffers, which UCX must not
		// touch once they are freed.
		_ = t.Close()
		_ = r.Close()
	}()
	if t.Rank() == 0 {
		g := facesim.NewGrid(t.Size())
		fmt.Printf("# faces: %d ranks as %dx%dx%d, %d^3 uint64 cells per rank, %d iterations, gpu backend %s\n",
			t.Size(), g.Dims[0], g.Dims[1], g.Dims[2], L, iters, sys.Backend())
	}
	for _, m := range modes {
		r.Reset()
		if err := boot.Barrier(ctx, "faces.start."+m); err != nil {
			return err
		}
		d, err := r.Iterate(ctx, m)
		if err != nil {
			return fmt.Errorf("rank %d, %s: %w", t.Rank(), m, err)
		}
		status := "ok"
		if err := r.Check(); err != nil {
			status = err.Error()
		}
		all, err := boot.AllGather(ctx, "faces.check."+m, []byte(status))
		if err != nil {
			return err
		}
		for rank, s := range all {
			if string(s) != "ok" {
				return fmt.Errorf("%s: rank %d differs from the serial reference: %s", m, rank, s)
			}
		}
		if t.Rank() == 0 {
			fmt.Printf("faces: mode=%s matches the serial reference on all %d ranks; %.1f us per iteration (rank 0)\n",
				m, t.Size(), float64(d.Microseconds())/float64(iters))
		}
	}
	return boot.Barrier(ctx, "faces.done")
}
