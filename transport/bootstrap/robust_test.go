//go:build unix

package bootstrap

import (
	"bytes"
	"context"
	"fmt"
	"math"
	"net"
	"os"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// A transient Accept error (EMFILE: the launcher is, for a moment, at its
// descriptor limit, e.g. because anyone on the machine opened connections
// to the loopback port) must not stop the rendezvous for good: once
// descriptors are free again, a rank holding the token must still be able
// to join.
func TestRendezvousAcceptErrorIsNotFatal(t *testing.T) {
	s, tok, logs := newTestServer(t, 1)

	var old syscall.Rlimit
	require.NoError(t, syscall.Getrlimit(syscall.RLIMIT_NOFILE, &old))
	fds, err := os.ReadDir("/proc/self/fd")
	require.NoError(t, err)
	// Room for exactly one more descriptor (ReadDir's own is closed again):
	// the client end of the connection below takes it, the server's
	// accept then fails with EMFILE.
	lim := old
	lim.Cur = uint64(len(fds))
	require.NoError(t, syscall.Setrlimit(syscall.RLIMIT_NOFILE, &lim))
	restored := false
	restore := func() {
		if !restored {
			restored = true
			require.NoError(t, syscall.Setrlimit(syscall.RLIMIT_NOFILE, &old))
		}
	}
	defer restore()

	c, err := net.Dial("tcp", s.Addr())
	require.NoError(t, err)
	waitFor(t, logs, "rendezvous accept failed", 1)
	restore()
	c.Close()

	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Second)
	defer cancel()
	b, err := Dial(ctx, s.Addr(), tok, 0, 1)
	require.NoError(t, err, "the rendezvous stopped accepting after one failed Accept")
	b.Close()
}

// pump's lines end at "\n" or "\r\n": only that one "\r" goes; the
// others are part of the line.
func TestPumpKeepsCarriageReturns(t *testing.T) {
	for _, tc := range []struct{ in, want string }{
		{"a\r\r\n", "[0] a\r\n"},
		{"progress 1\rprogress 2\r\r\n", "[0] progress 1\rprogress 2\r\n"},
		{"\r\r\n", "[0] \r\n"},
	} {
		rp := &rankProc{rank: 0}
		rp.outWG.Add(1)
		var out bytes.Buffer
		(&sink{}).pump(rp, strings.NewReader(tc.in), &out)
		assert.Equal(t, tc.want, out.String(), "input %q", tc.in)
	}
}

// An absurd rank count is an error, not a panic of the launcher.
func TestLaunchHugeN(t *testing.T) {
	var err error
	func() {
		defer func() {
			if r := recover(); r != nil {
				err = fmt.Errorf("panic: %v", r)
				t.Errorf("Launch panicked with N=MaxInt: %v", r)
			}
		}()
		err = Launch(t.Context(), LaunchConfig{N: math.MaxInt, Program: "true"})
	}()
	assert.Error(t, err)
}

// Many collectives at once on every rank, barriers and all-gathers under
// reused names, with loss subscribers: no race, no mixed data.
func TestConcurrentCollectivesReuse(t *testing.T) {
	const size = 4
	s, tok, _ := newTestServer(t, size)
	ctx := testCtx(t)
	bs := joinAll(t, ctx, s, tok, size)
	var wg sync.WaitGroup
	for r, b := range bs {
		b.(LossNotifier).NotifyLost(func(int, string) {})
		for k := range 3 {
			wg.Go(func() {
				for it := range 30 {
					key := fmt.Sprintf("k%d", k)
					vals, err := b.AllGather(ctx, key, fmt.Appendf(nil, "%d/%d/%d", r, k, it))
					if !assert.NoError(t, err) {
						return
					}
					for i, v := range vals {
						assert.Equal(t, fmt.Sprintf("%d/%d/%d", i, k, it), string(v))
					}
					if !assert.NoError(t, b.Barrier(ctx, key)) {
						return
					}
				}
			})
		}
	}
	wg.Wait()
}

// The launcher's supervision (a failure, the stop, output pumps, tails)
// under the race detector.
func TestLaunchFailureRace(t *testing.T) {
	cfg, stdout, stderr := launchCfg(t, 3, failRankEnv+"=2", hangEnv+"=1")
	cfg.Stderr = stdout // one writer for both
	err := Launch(t.Context(), cfg)
	var rf *RankFailure
	require.ErrorAs(t, err, &rf, "out:\n%s", stdout)
	assert.Equal(t, 2, rf.Rank)
	assert.Equal(t, 3, rf.ExitCode)
	_ = stderr
}

// A collective called with a context whose deadline has already passed
// sends nothing: it returns the context's error and leaves the rank in the
// job. (It closed the rank's connection: the server reported the live rank
// lost to every other rank, and every later collective of the job failed.)
func TestExpiredDeadlineDoesNotKillRank(t *testing.T) {
	const size = 2
	s, tok, _ := newTestServer(t, size)
	ctx := testCtx(t)
	bs := joinAll(t, ctx, s, tok, size)
	lost := lostNotices(bs[1])

	expired, cancel := context.WithDeadline(ctx, time.Now().Add(-time.Second))
	defer cancel()
	err := bs[0].Barrier(expired, "x")
	assert.ErrorIs(t, err, context.DeadlineExceeded)

	var wg sync.WaitGroup
	errs := make([]error, size)
	for r := range size {
		wg.Go(func() { _, errs[r] = bs[r].AllGather(ctx, "after", []byte{byte(r)}) })
	}
	wg.Wait()
	assert.NoError(t, errs[0], "rank 0")
	assert.NoError(t, errs[1], "rank 1")
	select {
	case n := <-lost:
		t.Errorf("rank 1 was told rank %d is lost: %s", n.rank, n.reason)
	default:
	}
}

// A per-rank GOMAXPROCS that Go's runtime cannot take (it parses the
// variable as an int32 and silently ignores anything else) is refused,
// instead of leaving every rank with all the CPUs.
func TestProcsPerRankOutOfRange(t *testing.T) {
	_, err := gomaxprocs(LaunchConfig{N: 1, ProcsPerRank: math.MaxInt32 + 1})
	assert.Error(t, err, "GOMAXPROCS=%d is ignored by Go programs", math.MaxInt32+1)
}

// Hostile frames from joined ranks: the server drops the sender and tells
// the others, and never panics or hangs.
func TestHostileJoinedFrames(t *testing.T) {
	bad := [][]byte{
		[]byte{0, 0, 0, 0},
		append([]byte{0, 0, 0, 5}, "{\"op\""...),
		append([]byte{0, 0, 0, 31}, `{"op":"gather","value":"!!!!"}x`...),
		append([]byte{0, 0, 0, 24}, `{"op":"gather","key":12}`...),
		append([]byte{0, 0, 0, 14}, `{"op":"join"} `...),
		{0xff, 0xff, 0xff, 0xff},
		{0x00, 0xff, 0xff},
	}
	size := len(bad) + 1
	s, tok, logs := newTestServer(t, size)
	ctx := testCtx(t)
	b0, err := Dial(ctx, s.Addr(), tok, 0, size)
	require.NoError(t, err)
	defer b0.Close()
	for i, b := range bad {
		r := i + 1
		c, err := net.Dial("tcp", s.Addr())
		require.NoError(t, err)
		j, _ := encodeFrame(&frame{Op: opJoin, Version: protocolVersion, Token: tok.String(), Rank: r, Size: size, Notify: true})
		_, err = c.Write(j)
		require.NoError(t, err)
		f, err := readFrame(c)
		require.NoError(t, err)
		require.Equal(t, opOK, f.Op)
		_, err = c.Write(b)
		require.NoError(t, err)
		if len(b) < 4 {
			c.Close()
		}
		waitFor(t, logs, "rank lost", r)
		c.Close()
	}
	err = b0.Barrier(ctx, "x")
	var lost *RankLostError
	assert.ErrorAs(t, err, &lost)
}

// stallingWriter is a consumer of the launcher's output that stalls on its
// second write (a paused terminal, a pager, a slow network) until the
// process whose pid the first line carries has exited, and then for
// stall longer.
type stallingWriter struct {
	mu     sync.Mutex
	n      int
	stall  time.Duration
	buf    bytes.Buffer
	pidErr error
	pid    int
}

func (w *stallingWriter) Write(p []byte) (int, error) {
	w.mu.Lock()
	defer w.mu.Unlock()
	w.n++
	switch w.n {
	case 1:
		_, w.pidErr = fmt.Sscanf(string(p), "[0] %d\n", &w.pid)
	case 2:
		if w.pidErr == nil {
			// Reaped by Launch: then kill(pid, 0) fails with ESRCH.
			for syscall.Kill(w.pid, 0) == nil {
				time.Sleep(time.Millisecond)
			}
			time.Sleep(w.stall)
		}
	}
	return w.buf.Write(p)
}

// A rank's output is passed on whole however slowly the launcher's output
// is consumed: when the consumer stalled for longer than outputDrain after
// the rank exited, the launcher closed the pipe and dropped what the rank
// had written and the launcher had not read yet (1860 lines of 10000).
func TestLaunchSlowConsumerKeepsOutput(t *testing.T) {
	w := &stallingWriter{stall: outputDrain + time.Second}
	err := Launch(t.Context(), LaunchConfig{
		N: 1, Program: "sh", Args: []string{"-c", `echo $$; exec seq 1 10000`},
		Stdout: w, Stderr: w, Grace: time.Second,
	})
	require.NoError(t, err)
	require.NoError(t, w.pidErr, "first line: %q", strings.SplitN(w.buf.String(), "\n", 2)[0])
	lines := strings.Split(strings.TrimSuffix(w.buf.String(), "\n"), "\n")
	require.Equal(t, 10001, len(lines), "lines passed on")
	for i, l := range lines[1:] {
		if l != fmt.Sprintf("[0] %d", i+1) {
			t.Fatalf("line %d is %q", i+2, l)
		}
	}
}

// A descendant that escaped the rank's process group (setsid: the rank
// waits until it leads a session of its own) and holds its output pipe
// open without writing does not keep Launch waiting: it returns while the
// descendant still runs.
func TestLaunchEscapedDescendantHoldingOutput(t *testing.T) {
	var out lockedBuffer
	err := Launch(t.Context(), LaunchConfig{
		N: 1, Program: "sh", Args: []string{"-c", `setsid sleep 60 & p=$!; until [ "$(cut -d' ' -f6 /proc/$p/stat)" = $p ]; do :; done; echo "escaped $p"`},
		Stdout: &out, Stderr: &out, Grace: time.Second,
	})
	require.NoError(t, err)
	var pid int
	_, err = fmt.Sscanf(out.String(), "[0] escaped %d\n", &pid)
	require.NoError(t, err, out.String())
	defer syscall.Kill(pid, syscall.SIGKILL)
	stat, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	require.NoError(t, err, "the escaped descendant is gone")
	state := strings.Fields(string(stat[bytes.LastIndexByte(stat, ')')+1:]))[0]
	assert.NotEqual(t, "Z", state, "the escaped descendant ended before Launch returned: %s", stat)
}

// The failure report's tail is bounded (MaxTailLines): a huge TailLines
// made the launcher keep every line a rank wrote, and move them all for
// each new line once full (200000 kept of 400000 lines took 37 s).
func TestLaunchTailLinesBounded(t *testing.T) {
	err := Launch(t.Context(), LaunchConfig{N: 1, Program: "true", TailLines: MaxTailLines + 1})
	assert.ErrorContains(t, err, "tail")
	err = Launch(t.Context(), LaunchConfig{N: 1, Program: "true", TailLines: MaxTailLines})
	assert.NoError(t, err)
}

// The tail keeps the last lines in order, however many came.
func TestTailKeepsLastLines(t *testing.T) {
	for _, keep := range []int{1, 3, 7} {
		for _, n := range []int{0, 1, keep - 1, keep, keep + 1, 3*keep + 2} {
			rp := &rankProc{max: keep}
			var want []string
			for i := range n {
				l := strconv.Itoa(i)
				rp.addTail(l)
				want = append(want, l)
			}
			want = want[max(0, n-keep):]
			if got := rp.lastLines(); strings.Join(got, ",") != strings.Join(want, ",") {
				t.Errorf("keep %d after %d lines: %q, want %q", keep, n, got, want)
			}
		}
	}
}

// A descendant that escaped the rank's process group and keeps writing to
// its output pipe, slowly or as fast as it can, does not keep Launch
// waiting either: the rank's own output is all read by then, and what
// follows is the descendant's. drain waited while any output moved, so
// Launch returned only once such a descendant stopped (and ignored its
// context and signals meanwhile).
func TestLaunchEscapedDescendantWriting(t *testing.T) {
	// The descendant writes for 15 s (it outlives the pipe: a write to it
	// once the launcher closed it fails, and it goes on).
	for name, writer := range map[string]string{
		"ticking":  `trap "" PIPE; (sleep 15; kill $$) & while :; do echo tick; sleep 0.1; done 2>/dev/null`,
		"flooding": `trap "" PIPE; (sleep 15; kill $$) & while :; do echo tick; done 2>/dev/null`,
	} {
		t.Run(name, func(t *testing.T) {
			pidFile := t.TempDir() + "/pid"
			script := `setsid sh -c '` + writer + `' & p=$!
until [ "$(cut -d' ' -f6 /proc/$p/stat)" = $p ]; do :; done
echo $p > "$1"; echo "rank done"`
			var out countingWriter
			err := Launch(t.Context(), LaunchConfig{
				N: 1, Program: "sh", Args: []string{"-c", script, "sh", pidFile},
				Stdout: &out, Stderr: &out, Grace: time.Second,
			})
			require.NoError(t, err)
			b, err := os.ReadFile(pidFile)
			require.NoError(t, err)
			pid, err := strconv.Atoi(strings.TrimSpace(string(b)))
			require.NoError(t, err)
			defer syscall.Kill(-pid, syscall.SIGKILL)
			stat, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
			require.NoError(t, err, "the escaped descendant is gone: Launch waited for it")
			state := strings.Fields(string(stat[bytes.LastIndexByte(stat, ')')+1:]))[0]
			assert.NotEqual(t, "Z", state, "the escaped descendant ended before Launch returned: %s", stat)
			assert.True(t, out.saw("[0] rank done\n"), "the rank's own line was passed on")
		})
	}
}

// countingWriter keeps no output but whether a given line was written.
type countingWriter struct {
	mu    sync.Mutex
	lines map[string]bool
}

func (w *countingWriter) Write(p []byte) (int, error) {
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.lines == nil {
		w.lines = map[string]bool{}
	}
	if !bytes.HasSuffix(p, []byte("tick\n")) {
		w.lines[string(p)] = true
	}
	return len(p), nil
}

func (w *countingWriter) saw(line string) bool {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.lines[line]
}
