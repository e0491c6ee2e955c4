// Package integration runs the transport between real OS processes: each test
// launches several copies of this test binary through the embedded launcher
// (bootstrap.Launch); a copy started with TROUPE_ITEST_ROLE set plays one rank
// of the named scenario instead of running tests.
package integration

import (
	"context"
	"fmt"
	"os"
	"runtime"
	"testing"
	"time"

	"github.com/troupe-hpc/troupe/transport"
	"github.com/troupe-hpc/troupe/transport/bootstrap"
)

// roleEnv names the scenario a re-executed test binary plays as a rank;
// progressEnv its transport's progress mode ("direct" or "queue").
const (
	roleEnv     = "TROUPE_ITEST_ROLE"
	progressEnv = "TROUPE_ITEST_PROGRESS"
)

// rankTimeout bounds a rank's whole life; a test may give its ranks longer
// through rankTimeoutEnv (a time.ParseDuration string).
const rankTimeout = 40 * time.Second

const rankTimeoutEnv = "TROUPE_ITEST_RANK_TIMEOUT"

// rankLife is this rank's time limit: rankTimeoutEnv, else rankTimeout.
func rankLife() time.Duration {
	if d, err := time.ParseDuration(os.Getenv(rankTimeoutEnv)); err == nil && d > 0 {
		return d
	}
	return rankTimeout
}

func TestMain(m *testing.M) {
	if role := os.Getenv(roleEnv); role != "" {
		os.Exit(rankMain(role))
	}
	os.Exit(m.Run())
}

// scenario is one rank's part of a scenario. It returns nil on success.
type scenario func(ctx context.Context, r *rank) error

var scenarios = map[string]scenario{}

// rank is what a scenario gets: the transport and the bootstrapper.
type rank struct {
	t *transport.Transport
	b bootstrap.Bootstrapper
	// skipFinalBarrier: the scenario lost a rank, so no job-wide barrier.
	skipFinalBarrier bool
}

func (r *rank) id() int { return r.t.Rank() }

// logf prints a line on the rank's stdout (unbuffered: it survives a SIGKILL
// right after).
func (r *rank) logf(format string, args ...any) {
	fmt.Fprintf(os.Stdout, "rank %d: "+format+"\n", append([]any{r.id()}, args...)...)
}

// rankMain plays one rank of a scenario: it joins the job from the
// environment, runs the scenario, meets the others at a final barrier, and
// prints "<role>: rank N OK" on success. Failures go to stderr with a
// non-zero exit status.
func rankMain(role string) int {
	sc := scenarios[role]
	if sc == nil {
		fmt.Fprintf(os.Stderr, "integration: unknown role %q\n", role)
		return 2
	}
	ctx, cancel := context.WithTimeout(context.Background(), rankLife())
	defer cancel()
	b, err := bootstrap.FromEnv(ctx)
	if err != nil {
		fmt.Fprintf(os.Stderr, "%s: joining: %v\n", role, err)
		return 3
	}
	defer b.Close()
	opts := transport.Options{Bootstrap: b}
	switch p := os.Getenv(progressEnv); p {
	case "", "direct":
	case "queue":
		opts.Progress = transport.ProgressQueue
	default:
		fmt.Fprintf(os.Stderr, "integration: unknown progress mode %q\n", p)
		return 2
	}
	tr, err := transport.New(ctx, opts)
	if err != nil {
		fmt.Fprintf(os.Stderr, "%s: rank %d: transport.New: %v\n", role, b.Rank(), err)
		return 4
	}
	r := &rank{t: tr, b: b}
	r.logf("UCX_TLS=%s progress=%v", os.Getenv("UCX_TLS"), opts.Progress)
	r.logf("GOMAXPROCS=%d", runtime.GOMAXPROCS(0))
	r.logf("bootstrap=%T", b)
	if err := sc(ctx, r); err != nil {
		fmt.Fprintf(os.Stderr, "%s: rank %d FAILED: %v\n", role, b.Rank(), err)
		return 1
	}
	// Nobody closes its endpoints while a peer still talks to it.
	if !r.skipFinalBarrier {
		if err := b.Barrier(ctx, "integration.done"); err != nil {
			fmt.Fprintf(os.Stderr, "%s: rank %d: final barrier: %v\n", role, b.Rank(), err)
			return 5
		}
	}
	if err := tr.Close(); err != nil {
		fmt.Fprintf(os.Stderr, "%s: rank %d: close: %v\n", role, b.Rank(), err)
		return 6
	}
	fmt.Printf("%s: rank %d OK\n", role, b.Rank())
	return 0
}
