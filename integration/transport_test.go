package integration

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"regexp"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/troupe-hpc/troupe/transport/bootstrap"
)

// syncBuffer is an io.Writer safe for the launcher's concurrent writes.
type syncBuffer struct {
	mu  sync.Mutex
	buf bytes.Buffer
}

func (b *syncBuffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.Write(p)
}

func (b *syncBuffer) String() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.String()
}

type jobResult struct {
	err            error
	stdout, stderr string
	wall           time.Duration
}

func (j jobResult) dump() string {
	return fmt.Sprintf("launch error: %v\n--- stdout ---\n%s--- stderr ---\n%s", j.err, j.stdout, j.stderr)
}

// cfg is how a job runs: UCX transports (a LaunchConfig.TLS value) and the
// transport's progress mode.
type cfg struct{ tls, progress string }

// launch runs n copies of this test binary as the ranks of role through the
// embedded launcher.
func launch(t *testing.T, role string, n int, c cfg) jobResult {
	t.Helper()
	return launchFor(t, role, n, c, rankTimeout)
}

// launchFor is launch with each rank's life limited to life.
func launchFor(t *testing.T, role string, n int, c cfg, life time.Duration) jobResult {
	t.Helper()
	exe, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), life+10*time.Second)
	defer cancel()
	var stdout, stderr syncBuffer
	start := time.Now()
	err = bootstrap.Launch(ctx, bootstrap.LaunchConfig{
		N:       n,
		Program: exe,
		Env:     []string{roleEnv + "=" + role, progressEnv + "=" + c.progress, rankTimeoutEnv + "=" + life.String()},
		TLS:     c.tls,
		Stdout:  &stdout,
		Stderr:  &stderr,
		// Survivors of a dead rank finish their checks after the
		// launcher's SIGTERM; they need far less than this.
		Grace: 15 * time.Second,
	})
	res := jobResult{err: err, stdout: stdout.String(), stderr: stderr.String(), wall: time.Since(start)}
	t.Logf("%s over %s, %s progress: %d ranks, %v", role, c.tls, c.progress, n, res.wall.Round(time.Millisecond))
	return res
}

// okLine is what rankMain prints, prefixed by the launcher, on success.
func okLine(role string, r int) string { return fmt.Sprintf("[%d] %s: rank %d OK\n", r, role, r) }

// testTLS is the UCX_TLS each transport choice of cfg.tls must give the
// ranks: spelled out here, not taken from bootstrap.UCXTLS, the mapping
// under test (a "shm" that gave "self,tcp" passed every shm run over TCP).
var testTLS = map[string]string{"tcp": "self,tcp", "shm": "self,sm"}

// checkTLS requires every rank to have run with UCX limited to tls.
func checkTLS(t *testing.T, res jobResult, n int, c cfg) {
	t.Helper()
	tls, ok := testTLS[c.tls]
	if !ok {
		t.Fatalf("no UCX_TLS known for transport choice %q", c.tls)
	}
	for r := 0; r < n; r++ {
		if want := fmt.Sprintf("[%d] rank %d: UCX_TLS=%s progress=%s\n", r, r, tls, c.progress); !strings.Contains(res.stdout, want) {
			t.Fatalf("rank %d did not run with %q:\n%s", r, strings.TrimSpace(want), res.dump())
		}
	}
}

// runJob launches a role and requires every rank to succeed.
func runJob(t *testing.T, role string, n int, c cfg) jobResult {
	t.Helper()
	return runJobFor(t, role, n, c, rankTimeout)
}

// runJobFor is runJob with each rank's life limited to life.
func runJobFor(t *testing.T, role string, n int, c cfg, life time.Duration) jobResult {
	t.Helper()
	res := launchFor(t, role, n, c, life)
	if res.err != nil {
		t.Fatalf("job failed:\n%s", res.dump())
	}
	for r := 0; r < n; r++ {
		if !strings.Contains(res.stdout, okLine(role, r)) {
			t.Fatalf("rank %d did not report success:\n%s", r, res.dump())
		}
	}
	if strings.Contains(res.stderr, "FAILED") {
		t.Fatalf("a rank reported a failure:\n%s", res.dump())
	}
	checkTLS(t, res, n, c)
	if testing.Verbose() {
		t.Logf("output:\n%s", res.stdout)
	}
	return res
}

// forTLS runs f over TCP and over shared memory, each in both progress modes.
func forTLS(t *testing.T, f func(t *testing.T, c cfg)) {
	for _, tls := range []string{"tcp", "shm"} {
		t.Run(tls, func(t *testing.T) {
			for _, p := range []string{"direct", "queue"} {
				t.Run(p, func(t *testing.T) { f(t, cfg{tls, p}) })
			}
		})
	}
}

func TestDataIntegrity(t *testing.T) {
	forTLS(t, func(t *testing.T, c cfg) {
		res := runJob(t, "integrity", 2, c)
		for _, n := range integritySizes {
			if !strings.Contains(res.stdout, fmt.Sprintf("[0] rank 0: %d B round trip ok", n)) {
				t.Fatalf("no round trip line for %d B:\n%s", n, res.dump())
			}
		}
	})
}

func TestIOV(t *testing.T) {
	forTLS(t, func(t *testing.T, c cfg) { runJob(t, "iov", 2, c) })
}

func TestRMA(t *testing.T) {
	forTLS(t, func(t *testing.T, c cfg) {
		res := runJob(t, "rma", 2, c)
		if !strings.Contains(res.stdout, "[1] rank 1: memory holds rank 0's puts") {
			t.Fatalf("rank 1 did not verify its memory:\n%s", res.dump())
		}
	})
}

func TestSameTagOrder(t *testing.T) {
	forTLS(t, func(t *testing.T, c cfg) {
		res := runJob(t, "order", 2, c)
		if !strings.Contains(res.stdout, fmt.Sprintf("%d same-tag messages arrived in order", orderN)) {
			t.Fatalf("no ordering line:\n%s", res.dump())
		}
	})
}

func TestTruncation(t *testing.T) {
	forTLS(t, func(t *testing.T, c cfg) {
		res := runJob(t, "truncate", 2, c)
		if !strings.Contains(res.stdout, "[1] rank 1: got *TruncatedError with the real sizes") {
			t.Fatalf("no truncation line:\n%s", res.dump())
		}
	})
}

var nsLine = regexp.MustCompile(`(?m)^\[(\d)\] rank \d: (KILL|LOST)_AT_NS=(\d+)$`)

// TestDeadPeer: rank 2 of 3 kills itself with SIGKILL; ranks 0 and 1 see
// their pending receives from it fail with ErrPeerLost within 2 s and keep
// exchanging messages. The launcher reports rank 2's death, and only that.
func TestDeadPeer(t *testing.T) {
	forTLS(t, func(t *testing.T, c cfg) {
		res := launch(t, "deadpeer", 3, c)
		var rf *bootstrap.RankFailure
		if !errors.As(res.err, &rf) {
			t.Fatalf("Launch returned %v, want a *RankFailure for rank 2:\n%s", res.err, res.dump())
		}
		if rf.Rank != 2 || rf.Signal != syscall.SIGKILL {
			t.Fatalf("Launch reported rank %d %s, want rank 2 killed by SIGKILL:\n%s", rf.Rank, rf.Status(), res.dump())
		}
		for r := 0; r < 2; r++ {
			if !strings.Contains(res.stdout, okLine("deadpeer", r)) {
				t.Fatalf("survivor rank %d did not report success:\n%s", r, res.dump())
			}
		}
		if strings.Contains(res.stderr, "FAILED") {
			t.Fatalf("a rank reported a failure:\n%s", res.dump())
		}
		checkTLS(t, res, 3, c)
		var kill int64
		lostAt := map[int]int64{}
		for _, m := range nsLine.FindAllStringSubmatch(res.stdout, -1) {
			r, _ := strconv.Atoi(m[1])
			ns, _ := strconv.ParseInt(m[3], 10, 64)
			if m[2] == "KILL" {
				kill = ns
			} else {
				lostAt[r] = ns
			}
		}
		if kill == 0 || len(lostAt) != 2 {
			t.Fatalf("missing KILL_AT_NS/LOST_AT_NS lines:\n%s", res.dump())
		}
		for r := 0; r < 2; r++ {
			d := time.Duration(lostAt[r] - kill)
			t.Logf("%s/%s: rank %d saw rank 2's death %v after its SIGKILL", c.tls, c.progress, r, d.Round(time.Microsecond))
			if d > detectLimit {
				t.Errorf("rank %d: pending receive failed %v after the kill, more than %v", r, d, detectLimit)
			}
		}
		if testing.Verbose() {
			t.Logf("output:\n%s\nstderr:\n%s", res.stdout, res.stderr)
		}
	})
}

// TestOneProcessor runs round trips of every size and a same-tag stream, in
// both progress modes, and an actor stream, with each rank limited to one P
// (GOMAXPROCS=1, as a rank bound to one core gets): the progress goroutine
// and the waiters then share one thread, and must hand it to each other
// rather than sleep on it (docs/transport.md, "One processor per rank").
func TestOneProcessor(t *testing.T) {
	t.Setenv("GOMAXPROCS", "1")
	oneP := func(t *testing.T, res jobResult, n int) {
		t.Helper()
		for r := 0; r < n; r++ {
			requireLines(t, res, fmt.Sprintf("[%d] rank %d: GOMAXPROCS=1", r, r))
		}
	}
	forTLS(t, func(t *testing.T, c cfg) {
		res := runJob(t, "integrity", 2, c)
		oneP(t, res, 2)
		for _, n := range integritySizes {
			requireLines(t, res, fmt.Sprintf("[0] rank 0: %d B round trip ok", n))
		}
		res = runJob(t, "order", 2, c)
		requireLines(t, res, fmt.Sprintf("%d same-tag messages arrived in order", orderN))
	})
	t.Run("actor-order", func(t *testing.T) {
		res := runJob(t, "actor-order", actorRanks, cfg{"shm", "direct"})
		oneP(t, res, actorRanks)
		requireLine(t, res, fmt.Sprintf("[1] rank 1: both streams of %d messages arrived intact and in order", orderStream))
	})
}
