package main

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/troupe-hpc/troupe/transport"
	"github.com/troupe-hpc/troupe/transport/bootstrap"
)

// asMainEnv makes a re-executed test binary run faces (or, with
// dieEnv set, a rank that dies mid-run) instead of the tests, so that the
// launcher can start it as real rank processes.
const (
	asMainEnv = "FACES_TEST_AS_MAIN"
	dieEnv    = "FACES_TEST_RANK1_DIES"
)

func TestMain(m *testing.M) {
	if os.Getenv(asMainEnv) != "" {
		if os.Getenv(dieEnv) != "" && os.Getenv("TROUPE_RANK") == "1" {
			os.Exit(dyingRank())
		}
		os.Args = append([]string{"faces"}, os.Args[1:]...)
		main()
		os.Exit(0)
	}
	os.Exit(m.Run())
}

// dyingRank plays rank 1 of a 2-rank queue-mode job: it joins the job,
// receives rank 0's first face of the first iteration (so rank 0's queue
// is running) and leaves at once, its connections open, as a killed
// process does. It exits 0, so the launcher does not stop rank 0: rank 0
// must notice on its own.
func dyingRank() int {
	ctx := context.Background()
	boot, err := bootstrap.FromEnv(ctx)
	if err != nil {
		fmt.Fprintln(os.Stderr, "dying rank:", err)
		return 2
	}
	t, err := transport.New(ctx, transport.Options{Bootstrap: boot})
	if err != nil {
		fmt.Fprintln(os.Stderr, "dying rank:", err)
		return 2
	}
	if err := boot.Barrier(ctx, "faces.start.queue"); err != nil {
		fmt.Fprintln(os.Stderr, "dying rank:", err)
		return 2
	}
	// Rank 0's face d=0 (-x, neighbour rank 1 on a 2x1x1 grid), tag 0.
	if _, err := t.Recv(ctx, 0, 0, make([]byte, 8*8*8)); err != nil {
		fmt.Fprintln(os.Stderr, "dying rank:", err)
		return 2
	}
	return 0
}

// TestQueueModePeerLost: a neighbour dies during a queue-mode run of a
// million iterations. Rank 0 must report the lost peer and exit non-zero
// within seconds; it used to go on iterating, every exchange with the
// dead rank failing unseen, and SIGTERM did not stop it.
func TestQueueModePeerLost(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	var out bytes.Buffer
	start := time.Now()
	err := bootstrap.Launch(ctx, bootstrap.LaunchConfig{
		N:       2,
		Program: os.Args[0],
		Args:    []string{"-mode", "queue", "-L", "8", "-iters", "1000000"},
		Env:     []string{asMainEnv + "=1", dieEnv + "=1", "UCX_LOG_LEVEL=error"},
		Stdout:  &out,
		Stderr:  &out,
	})
	if ctx.Err() != nil {
		t.Fatalf("rank 0 still running %v after its neighbour died:\n%s", time.Since(start), out.String())
	}
	if err == nil {
		t.Fatalf("the job succeeded with a dead rank:\n%s", out.String())
	}
	t.Logf("%v after %v:\n%s", err, time.Since(start), out.String())
	if !strings.Contains(out.String(), "[0] faces: rank 0, queue: ") || !strings.Contains(out.String(), "peer rank 1 lost") {
		t.Fatalf("rank 0 did not report the lost peer (%v):\n%s", err, out.String())
	}
}

// An argument that is not a flag is refused: the flag package stops
// there, and every flag after it was ignored.
func TestStrayArgument(t *testing.T) {
	var stderr strings.Builder
	f, status := parseFlags([]string{"-L", "4", "stray", "-iters", "1"}, &stderr)
	if status != 2 || !strings.Contains(stderr.String(), `unexpected argument "stray"`) {
		t.Fatalf("status %d, flags %+v, stderr %q", status, f, stderr.String())
	}
}

func TestFlags(t *testing.T) {
	var stderr strings.Builder
	f, status := parseFlags([]string{"-L", "4", "-iters", "1", "-mode", "plain"}, &stderr)
	if status != -1 || f != (flags{L: 4, iters: 1, mode: "plain"}) || stderr.Len() != 0 {
		t.Fatalf("status %d, flags %+v, stderr %q", status, f, stderr.String())
	}
	if _, status := parseFlags([]string{"-h"}, &stderr); status != 0 {
		t.Fatalf("-h: status %d", status)
	}
	if _, status := parseFlags([]string{"-L", "x"}, &stderr); status != 2 {
		t.Fatalf("-L x: status %d", status)
	}
}
