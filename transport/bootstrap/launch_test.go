//go:build unix

package bootstrap

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"regexp"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"
	"go.uber.org/zap/zaptest"
)

// Environment of the test binary re-executed as a rank.
const (
	childEnv      = "TROUPE_TEST_CHILD"       // "1": act as a rank
	failRankEnv   = "TROUPE_TEST_FAIL_RANK"   // rank that fails after the barrier
	failHowEnv    = "TROUPE_TEST_FAIL_HOW"    // "exit3" or "sigkill"
	hangEnv       = "TROUPE_TEST_HANG"        // "1": other ranks wait to be stopped
	ignoreTermEnv = "TROUPE_TEST_IGNORE_TERM" // "1": hanging ranks ignore SIGTERM
	grandEnv      = "TROUPE_TEST_GRANDCHILD"  // "1": hanging ranks fork a sleeping grandchild
	skipRankEnv   = "TROUPE_TEST_SKIP_RANK"   // rank that exits 0 without joining
	termLostEnv   = "TROUPE_TEST_TERM_LOST"   // "1": hanging ranks report, at SIGTERM, the lost rank they were told of
)

func TestMain(m *testing.M) {
	if os.Getenv(childEnv) == "1" {
		os.Exit(childMain())
	}
	goleak.VerifyTestMain(m)
}

// childMain is a rank: it joins with FromEnv, all-gathers a value, prints
// what it saw, meets the others at a barrier, then exits as told.
func childMain() int {
	if sr := os.Getenv(skipRankEnv); sr != "" && sr == os.Getenv(EnvRank) {
		return 0
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	b, err := FromEnv(ctx)
	if err != nil {
		fmt.Fprintln(os.Stderr, "join:", err)
		return 10
	}
	defer b.Close()
	rank := b.Rank()
	vals, err := b.AllGather(ctx, "hello", fmt.Appendf(nil, "v%d", rank))
	if err != nil {
		fmt.Fprintln(os.Stderr, "allgather:", err)
		return 11
	}
	strs := make([]string, len(vals))
	for i, v := range vals {
		strs[i] = string(v)
	}
	fmt.Printf("rank %d of %d saw %s\n", rank, b.Size(), strings.Join(strs, ","))
	fmt.Printf("UCX_TLS=%s\n", os.Getenv("UCX_TLS"))
	fmt.Printf("GOMAXPROCS %d\n", runtime.GOMAXPROCS(0))
	fmt.Printf("TROUPE_SPIN=%s\n", os.Getenv(EnvSpin))
	fmt.Fprintf(os.Stderr, "pid %d\n", os.Getpid())
	if err := b.Barrier(ctx, "done"); err != nil {
		fmt.Fprintln(os.Stderr, "barrier:", err)
		return 12
	}
	failing := os.Getenv(failRankEnv) == strconv.Itoa(rank)
	hang := os.Getenv(hangEnv) == "1" && !failing
	if hang && os.Getenv(termLostEnv) == "1" {
		lost := make(chan string, 1)
		b.(LossNotifier).NotifyLost(func(r int, reason string) {
			select {
			case lost <- fmt.Sprintf("lost rank %d: %s", r, reason):
			default:
			}
		})
		term := make(chan os.Signal, 1)
		signal.Notify(term, syscall.SIGTERM)
		go func() {
			<-term
			// The launcher wrote the notice before its SIGTERM; the
			// two may still be taken in either order here.
			select {
			case l := <-lost:
				fmt.Println("SIGTERM; " + l)
			case <-time.After(5 * time.Second):
				fmt.Println("SIGTERM; told of no lost rank")
			}
			os.Exit(0)
		}()
	}
	if hang {
		if os.Getenv(ignoreTermEnv) == "1" {
			signal.Ignore(syscall.SIGTERM)
		}
		if os.Getenv(grandEnv) == "1" {
			gc := exec.Command("sleep", "1000")
			if err := gc.Start(); err != nil {
				fmt.Fprintln(os.Stderr, "grandchild:", err)
				return 13
			}
			fmt.Fprintf(os.Stderr, "grandchild %d\n", gc.Process.Pid)
		}
		fmt.Println("waiting")
	}
	// Everyone is set up before the failing rank fails.
	if err := b.Barrier(ctx, "ready"); err != nil {
		fmt.Fprintln(os.Stderr, "barrier:", err)
		return 12
	}
	if failing {
		fmt.Fprintf(os.Stderr, "rank %d failing\n", rank)
		switch os.Getenv(failHowEnv) {
		case "sigkill":
			syscall.Kill(os.Getpid(), syscall.SIGKILL)
			time.Sleep(time.Hour)
		default:
			return 3
		}
	}
	if hang {
		time.Sleep(time.Hour)
	}
	return 0
}

// lockedBuffer is an io.Writer safe to read while Launch writes to it; it
// calls onLine for every complete line written.
type lockedBuffer struct {
	mu     sync.Mutex
	buf    bytes.Buffer
	onLine func(string)
}

func (b *lockedBuffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	n, err := b.buf.Write(p)
	b.mu.Unlock()
	if b.onLine != nil {
		for _, l := range strings.Split(strings.TrimRight(string(p), "\n"), "\n") {
			b.onLine(l)
		}
	}
	return n, err
}

func (b *lockedBuffer) String() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.String()
}

func launchCfg(t *testing.T, n int, env ...string) (LaunchConfig, *lockedBuffer, *lockedBuffer) {
	stdout, stderr := &lockedBuffer{}, &lockedBuffer{}
	return LaunchConfig{
		N:       n,
		Program: os.Args[0],
		Args:    []string{"-test.run=^$"},
		Env:     append([]string{childEnv + "=1"}, env...),
		Stdout:  stdout,
		Stderr:  stderr,
		Grace:   2 * time.Second,
		Log:     zaptest.NewLogger(t),
	}, stdout, stderr
}

var pidRE = regexp.MustCompile(`(?m)^\[(\d+)\] (pid|grandchild) (\d+)$`)

// assertGone checks every pid printed by the ranks is dead (gone, or a zombie
// waiting for an init that does not reap).
func assertGone(t *testing.T, stderr string) {
	t.Helper()
	ms := pidRE.FindAllStringSubmatch(stderr, -1)
	require.NotEmpty(t, ms)
	for _, m := range ms {
		pid, _ := strconv.Atoi(m[3])
		stat, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
		if err != nil {
			continue // gone
		}
		// Field 3 of /proc/PID/stat, after the parenthesised command name.
		fields := strings.Fields(string(stat[bytes.LastIndexByte(stat, ')')+1:]))
		assert.Equal(t, "Z", fields[0], "rank %s %s %d still alive: %s", m[1], m[2], pid, stat)
	}
}

func TestLaunchSuccess(t *testing.T) {
	const n = 3
	cfg, stdout, stderr := launchCfg(t, n)
	cfg.TLS = "shm"
	err := Launch(t.Context(), cfg)
	require.NoError(t, err, "stderr:\n%s", stderr)
	out := stdout.String()
	for r := range n {
		assert.Contains(t, out, fmt.Sprintf("[%d] rank %d of %d saw v0,v1,v2\n", r, r, n))
		assert.Contains(t, out, fmt.Sprintf("[%d] UCX_TLS=self,sm\n", r))
	}
	for _, l := range strings.Split(strings.TrimSpace(out), "\n") {
		assert.Regexp(t, `^\[[0-2]\] `, l)
	}
	assert.Len(t, pidRE.FindAllString(stderr.String(), -1), n)
	assertGone(t, stderr.String())
}

// A rank's output line longer than the reader's 64 KiB buffer is passed
// on whole, with one prefix (it was cut into prefixed pieces); one longer
// than maxOutputLine is cut at that length.
func TestLaunchLongLines(t *testing.T) {
	stdout, stderr := &lockedBuffer{}, &lockedBuffer{}
	err := Launch(t.Context(), LaunchConfig{
		N: 1, Program: "sh",
		Args: []string{"-c", fmt.Sprintf(`head -c 100000 /dev/zero | tr '\0' a; echo; head -c %d /dev/zero | tr '\0' b; echo`,
			maxOutputLine+10)},
		Stdout: stdout, Stderr: stderr, Grace: time.Second,
	})
	require.NoError(t, err, stderr.String())
	lines := strings.Split(strings.TrimSuffix(stdout.String(), "\n"), "\n")
	require.Len(t, lines, 3)
	assert.Equal(t, "[0] "+strings.Repeat("a", 100000), lines[0])
	assert.Equal(t, "[0] "+strings.Repeat("b", maxOutputLine), lines[1])
	assert.Equal(t, "[0] "+strings.Repeat("b", 10), lines[2])
}

// A line of exactly maxOutputLine bytes is passed on whole: it came out
// as that line and an empty one (the cut came before its newline).
func TestLaunchLineOfMaxLength(t *testing.T) {
	stdout, stderr := &lockedBuffer{}, &lockedBuffer{}
	err := Launch(t.Context(), LaunchConfig{
		N: 1, Program: "sh",
		Args:   []string{"-c", fmt.Sprintf(`head -c %d /dev/zero | tr '\0' b; echo; echo next`, maxOutputLine)},
		Stdout: stdout, Stderr: stderr, Grace: time.Second,
	})
	require.NoError(t, err, stderr.String())
	lines := strings.Split(strings.TrimSuffix(stdout.String(), "\n"), "\n")
	if len(lines) != 2 || lines[0] != "[0] "+strings.Repeat("b", maxOutputLine) || lines[1] != "[0] next" {
		t.Fatalf("got lines of %v bytes, want [0] and %d b's, then [0] next", lineLengths(lines), maxOutputLine)
	}
}

// lineLengths returns the length of each line (they are too long to print).
func lineLengths(lines []string) []int {
	n := make([]int, len(lines))
	for i, l := range lines {
		n[i] = len(l)
	}
	return n
}

// pump cuts a line only where it is longer than maxOutputLine, into pieces
// of that length and a shorter rest, never leaving an empty piece; lines
// end at "\n" or "\r\n", and the output's end ends the last one.
func TestPumpLineLengths(t *testing.T) {
	const m = maxOutputLine
	x := func(n int) string { return strings.Repeat("x", n) }
	for _, tc := range []struct {
		name string
		in   string
		want []string
	}{
		{"max-1", x(m-1) + "\n", []string{x(m - 1)}},
		{"max", x(m) + "\nnext\n", []string{x(m), "next"}},
		{"max crlf", x(m) + "\r\nnext\n", []string{x(m), "next"}},
		{"max+1", x(m+1) + "\n", []string{x(m), "x"}},
		{"2max", x(2*m) + "\n\n", []string{x(m), x(m), ""}},
		{"2max+1", x(2*m+1) + "\n", []string{x(m), x(m), "x"}},
		{"max at end", x(m), []string{x(m)}},
		{"max+64k at end", x(m + 64<<10), []string{x(m), x(64 << 10)}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			rp := &rankProc{rank: 3}
			rp.outWG.Add(1)
			var out bytes.Buffer
			(&sink{}).pump(rp, strings.NewReader(tc.in), &out)
			var want strings.Builder
			for _, l := range tc.want {
				want.WriteString("[3] " + l + "\n")
			}
			if out.String() != want.String() {
				got := strings.Split(strings.TrimSuffix(out.String(), "\n"), "\n")
				t.Fatalf("got lines of %v bytes (prefix included), want %v", lineLengths(got), lineLengths(tc.want))
			}
		})
	}
}

func TestLaunchProcsPerRank(t *testing.T) {
	for _, tc := range []struct {
		name  string
		procs int
		want  int
	}{
		{"count", 2, 2},
		{"split", ProcsSplit, SplitProcs(runtime.GOMAXPROCS(0), 2)},
	} {
		t.Run(tc.name, func(t *testing.T) {
			cfg, stdout, stderr := launchCfg(t, 2, "GOMAXPROCS=5")
			cfg.ProcsPerRank = tc.procs
			require.NoError(t, Launch(t.Context(), cfg), "stderr:\n%s", stderr)
			for r := range 2 {
				// What the rank's Go runtime uses, not just its environment.
				assert.Contains(t, stdout.String(), fmt.Sprintf("[%d] GOMAXPROCS %d\n", r, tc.want))
			}
		})
	}
	cfg, _, _ := launchCfg(t, 1)
	cfg.ProcsPerRank = -3
	assert.ErrorContains(t, Launch(t.Context(), cfg), "processors per rank must be")
}

func TestSplitProcs(t *testing.T) {
	assert.Equal(t, 8, SplitProcs(16, 2))
	assert.Equal(t, 5, SplitProcs(16, 3))
	assert.Equal(t, 1, SplitProcs(2, 2))
	assert.Equal(t, 1, SplitProcs(2, 8), "at least one each")
	assert.Equal(t, 4, SplitProcs(4, 0))
}

func TestLaunchRankExitStatus(t *testing.T) {
	const n = 3
	cfg, stdout, stderr := launchCfg(t, n, failRankEnv+"=1", failHowEnv+"=exit3", hangEnv+"=1", grandEnv+"=1")
	cfg.TLS = "tcp"
	err := Launch(t.Context(), cfg)
	var rf *RankFailure
	require.ErrorAs(t, err, &rf, "stdout:\n%s\nstderr:\n%s", stdout, stderr)
	assert.Equal(t, 1, rf.Rank)
	assert.Equal(t, 3, rf.ExitCode)
	assert.Zero(t, rf.Signal)
	assert.Contains(t, rf.Error(), "rank 1 (pid ")
	assert.Contains(t, rf.Error(), "exited with status 3")
	assert.Contains(t, rf.Tail, "rank 1 failing")
	assert.Contains(t, rf.Tail, "rank 1 of 3 saw v0,v1,v2")

	errOut := stderr.String()
	assert.Regexp(t, `troupe: rank 1 \(pid \d+\) exited with status 3; its last \d+ line\(s\):\n(  \[1\] .*\n)+`, errOut)
	assert.Contains(t, errOut, "\n  [1] rank 1 failing\n")
	assert.Contains(t, errOut, "stopping 2 remaining rank(s)")
	assert.Contains(t, stdout.String(), "[0] UCX_TLS=self,tcp\n")
	// The others were stopped, and their grandchildren too.
	assert.Len(t, pidRE.FindAllString(errOut, -1), n+2)
	assertGone(t, errOut)
}

func TestLaunchRankKilled(t *testing.T) {
	const n = 3
	// The survivors ignore SIGTERM, so stopping them needs the SIGKILL.
	cfg, stdout, stderr := launchCfg(t, n, failRankEnv+"=0", failHowEnv+"=sigkill", hangEnv+"=1", ignoreTermEnv+"=1")
	cfg.Grace = 200 * time.Millisecond
	cfg.TailLines = 2
	err := Launch(t.Context(), cfg)
	var rf *RankFailure
	require.ErrorAs(t, err, &rf, "stdout:\n%s\nstderr:\n%s", stdout, stderr)
	assert.Equal(t, 0, rf.Rank)
	assert.Equal(t, syscall.SIGKILL, rf.Signal)
	assert.Equal(t, -1, rf.ExitCode)
	assert.Contains(t, rf.Error(), "killed by signal 9 (killed)")
	assert.Len(t, rf.Tail, 2)
	// stdout and stderr are separate pipes, merged in order of arrival.
	assert.Contains(t, rf.Tail, "rank 0 failing")
	assert.Contains(t, stderr.String(), "troupe: rank 0 (pid ")
	assertGone(t, stderr.String())
}

// The survivors of a killed rank are told it is lost (LossNotifier) before
// the launcher stops them.
func TestLaunchSurvivorsToldOfLostRank(t *testing.T) {
	const n = 3
	cfg, stdout, stderr := launchCfg(t, n, failRankEnv+"=1", failHowEnv+"=sigkill", hangEnv+"=1", termLostEnv+"=1")
	cfg.Grace = 20 * time.Second // they exit at SIGTERM
	err := Launch(t.Context(), cfg)
	var rf *RankFailure
	require.ErrorAs(t, err, &rf, "stdout:\n%s\nstderr:\n%s", stdout, stderr)
	assert.Equal(t, 1, rf.Rank)
	for _, r := range []int{0, 2} {
		assert.Regexp(t, fmt.Sprintf(`(?m)^\[%d\] SIGTERM; lost rank 1: connection closed without goodbye`, r), stdout.String())
	}
	assertGone(t, stderr.String())
}

func TestLaunchContextCancel(t *testing.T) {
	const n = 2
	cfg, _, stderr := launchCfg(t, n, hangEnv+"=1")
	ctx, cancel := context.WithCancel(t.Context())
	defer cancel()
	var mu sync.Mutex
	waiting := 0
	stdout := &lockedBuffer{onLine: func(l string) {
		if strings.HasSuffix(l, "] waiting") {
			mu.Lock()
			waiting++
			if waiting == n {
				cancel()
			}
			mu.Unlock()
		}
	}}
	cfg.Stdout = stdout
	err := Launch(ctx, cfg)
	assert.ErrorIs(t, err, context.Canceled)
	var rf *RankFailure
	assert.False(t, errors.As(err, &rf))
	assertGone(t, stderr.String())
}

func TestLaunchForwardsSignal(t *testing.T) {
	const n = 2
	cfg, _, stderr := launchCfg(t, n, hangEnv+"=1")
	var mu sync.Mutex
	waiting := 0
	cfg.Stdout = &lockedBuffer{onLine: func(l string) {
		if strings.HasSuffix(l, "] waiting") {
			mu.Lock()
			waiting++
			if waiting == n {
				// Launch has signal.Notify'd SIGINT: this goes to it, not to the test.
				syscall.Kill(os.Getpid(), syscall.SIGINT)
			}
			mu.Unlock()
		}
	}}
	err := Launch(t.Context(), cfg)
	require.Error(t, err)
	assert.Contains(t, err.Error(), "interrupted by interrupt")
	assert.Contains(t, stderr.String(), "troupe: got interrupt, forwarding interrupt to 2 rank(s)")
	assertGone(t, stderr.String())
}

func TestLaunchRankExitsWithoutJoining(t *testing.T) {
	// Rank 1 exits with status 0 before joining: rank 0's all-gather fails
	// naming it (no hang), and rank 0's exit is the reported failure.
	cfg, stdout, stderr := launchCfg(t, 2, skipRankEnv+"=1")
	err := Launch(t.Context(), cfg)
	var rf *RankFailure
	require.ErrorAs(t, err, &rf, "stdout:\n%s\nstderr:\n%s", stdout, stderr)
	assert.Equal(t, 0, rf.Rank)
	assert.Equal(t, 11, rf.ExitCode)
	assert.Contains(t, strings.Join(rf.Tail, "\n"), `rank 1 disconnected before collective "hello" completed`)
}

func TestLaunchBadConfig(t *testing.T) {
	err := Launch(t.Context(), LaunchConfig{N: 0, Program: "true"})
	assert.ErrorContains(t, err, "at least one rank")
	err = Launch(t.Context(), LaunchConfig{N: 1})
	assert.ErrorContains(t, err, "no program")
	err = Launch(t.Context(), LaunchConfig{N: 2, Program: "/nonexistent/troupe-test-program"})
	assert.Error(t, err)
}

func TestLaunchRankNotJoining(t *testing.T) {
	// A program that is not a troupe rank: Launch still reports its failure.
	// Rank 1 fails once rank 0 has written its line (a file says so), so
	// that the line is there to be passed on when rank 0 is stopped (on a
	// loaded machine rank 1 failed first, and rank 0 was stopped before
	// its echo ran).
	ready := filepath.Join(t.TempDir(), "ready")
	stderr := &lockedBuffer{}
	script := `echo "hello from $TROUPE_RANK/$TROUPE_SIZE"
if [ "$TROUPE_RANK" = 1 ]; then
	while [ ! -e "$READY" ]; do sleep 0.01; done
	exit 7
fi
touch "$READY"
exec sleep 1000`
	err := Launch(t.Context(), LaunchConfig{N: 2, Program: "sh", Args: []string{"-c", script},
		Env: []string{"READY=" + ready}, Stdout: stderr, Stderr: stderr, Grace: time.Second})
	var rf *RankFailure
	require.ErrorAs(t, err, &rf)
	assert.Equal(t, 1, rf.Rank)
	assert.Equal(t, 7, rf.ExitCode)
	assert.Equal(t, []string{"hello from 1/2"}, rf.Tail)
	assert.Contains(t, stderr.String(), "[0] hello from 0/2\n")
}

func TestUCXTLS(t *testing.T) {
	assert.Equal(t, "", UCXTLS(""))
	assert.Equal(t, "self,sm", UCXTLS("shm"))
	assert.Equal(t, "self,tcp", UCXTLS("tcp"))
	assert.Equal(t, "rc,ud", UCXTLS("rc,ud"))
}

// Eight ranks on a 16-CPU machine get two Ps each with ProcsSplit; more
// ranks than CPUs still get one each.
func ExampleSplitProcs() {
	fmt.Println(SplitProcs(16, 8), SplitProcs(2, 4))
	// Output: 2 1
}

func TestSpinEnv(t *testing.T) {
	assert.Equal(t, "", spinEnv(2, 2, nil), "not oversubscribed")
	assert.Equal(t, "TROUPE_SPIN=10us", spinEnv(4, 2, []string{"PATH=/bin"}))
	assert.Equal(t, "", spinEnv(4, 2, []string{"TROUPE_SPIN=1ms"}), "the environment's value stays")
	d, err := time.ParseDuration(strings.TrimPrefix(spinEnv(3, 1, nil), EnvSpin+"="))
	require.NoError(t, err)
	assert.Equal(t, OversubscribedSpin, d)
}

// A job with more ranks than the launcher has processors gets the short
// spin in every rank; one that fits gets none, and a TROUPE_SPIN of the
// caller's stays.
func TestLaunchOversubscribedSpin(t *testing.T) {
	procs := runtime.GOMAXPROCS(0)
	if procs > 8 {
		t.Skipf("%d processors: an oversubscribed job would take %d ranks", procs, procs+1)
	}
	for _, tc := range []struct {
		name string
		n    int
		env  []string
		want string
	}{
		{"fits", 1, nil, ""},
		{"oversubscribed", procs + 1, nil, "10us"},
		{"set by the caller", procs + 1, []string{"TROUPE_SPIN=3ms"}, "3ms"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			cfg, stdout, stderr := launchCfg(t, tc.n, tc.env...)
			require.NoError(t, Launch(t.Context(), cfg), "stderr:\n%s", stderr)
			for r := range tc.n {
				assert.Contains(t, stdout.String(), fmt.Sprintf("[%d] TROUPE_SPIN=%s\n", r, tc.want))
			}
		})
	}
}
