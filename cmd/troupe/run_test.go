package main

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"runtime"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"go.uber.org/zap/zapcore"

	"github.com/troupe-hpc/troupe/transport/bootstrap"
)

// execRun runs a fresh `troupe run` command with args, as the CLI would.
func execRun(t *testing.T, args ...string) (string, error) {
	t.Helper()
	out := &runTestBuffer{} // shared by Launch's output and the logger
	cmd := newRunCmd()
	cmd.SetArgs(args)
	cmd.SetOut(out)
	cmd.SetErr(out)
	cmd.SilenceUsage, cmd.SilenceErrors = true, true
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	err := cmd.ExecuteContext(ctx)
	return out.String(), err
}

type runTestBuffer struct {
	mu  sync.Mutex
	buf bytes.Buffer
}

func (b *runTestBuffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.Write(p)
}

func (b *runTestBuffer) String() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.String()
}

func TestRunRegistered(t *testing.T) {
	c, _, err := rootCmd.Find([]string{"run"})
	require.NoError(t, err)
	assert.Equal(t, "run", c.Name())
}

func TestRunSuccess(t *testing.T) {
	out, err := execRun(t, "-n", "3", "--tls", "shm", "--", "sh", "-c", `echo "rank $TROUPE_RANK of $TROUPE_SIZE tls $UCX_TLS"; [ ${#TROUPE_TOKEN} = 32 ] && [ -n "$TROUPE_RDV" ]`)
	require.NoError(t, err, out)
	for _, r := range []string{"0", "1", "2"} {
		assert.Contains(t, out, "["+r+"] rank "+r+" of 3 tls self,sm\n")
	}
}

func TestRunProgramFlagsNotParsed(t *testing.T) {
	// Without "--", flags after PROGRAM still belong to PROGRAM.
	out, err := execRun(t, "-n", "1", "--tls=rc", "sh", "-c", `echo "$UCX_TLS $0 $1"`, "-n", "--tail")
	require.NoError(t, err, out)
	assert.Equal(t, "[0] rc -n --tail\n", out)
}

func TestRunRankFails(t *testing.T) {
	out, err := execRun(t, "-n", "3", "--tail", "1", "--grace", "1s", "--", "sh", "-c",
		`echo "start $TROUPE_RANK"; if [ "$TROUPE_RANK" = 1 ]; then echo "dying" >&2; exit 3; fi; exec sleep 1000`)
	var rf *bootstrap.RankFailure
	require.True(t, errors.As(err, &rf), "err %v, out:\n%s", err, out)
	assert.Equal(t, 1, rf.Rank)
	assert.Equal(t, 3, rf.ExitCode)
	assert.Len(t, rf.Tail, 1)
	assert.Contains(t, out, "troupe: rank 1 (pid ")
	assert.Contains(t, out, "exited with status 3; its last 1 line(s):\n")
	assert.Contains(t, out, "stopping 2 remaining rank(s)")
	assert.Contains(t, err.Error(), "rank 1")
}

func TestRunProcs(t *testing.T) {
	out, err := execRun(t, "-n", "2", "--procs", "3", "--", "sh", "-c", `echo "procs $GOMAXPROCS"`)
	require.NoError(t, err, out)
	assert.Contains(t, out, "[0] procs 3\n")
	assert.Contains(t, out, "[1] procs 3\n")

	t.Setenv("GOMAXPROCS", "7") // the flag wins over the environment
	want := fmt.Sprintf("procs %d\n", bootstrap.SplitProcs(runtime.GOMAXPROCS(0), 2))
	out, err = execRun(t, "-n", "2", "--procs", "split", "--", "sh", "-c", `echo "procs $GOMAXPROCS"`)
	require.NoError(t, err, out)
	assert.Contains(t, out, "[0] "+want)
	assert.Contains(t, out, "[1] "+want)

	out, err = execRun(t, "-n", "1", "--", "sh", "-c", `echo "procs $GOMAXPROCS"`)
	require.NoError(t, err, out)
	assert.Equal(t, "[0] procs 7\n", out, "without --procs the environment passes through")
}

func TestRunBadArgs(t *testing.T) {
	_, err := execRun(t, "-n", "2")
	assert.Error(t, err)
	_, err = execRun(t, "-n", "0", "--", "true")
	assert.ErrorContains(t, err, "-n must be >= 1")
	_, err = execRun(t, "-n", "1", "--", "/nonexistent/program")
	assert.Error(t, err)
	for _, v := range []string{"0", "-2", "half", "1.5"} {
		_, err = execRun(t, "-n", "1", "--procs", v, "--", "true")
		assert.ErrorContains(t, err, "--procs must be split or a count >= 1", v)
	}
	for _, v := range []string{"0", "-1s"} { // 0 once meant the 5 s default
		_, err = execRun(t, "-n", "1", "--grace", v, "--", "true")
		assert.ErrorContains(t, err, "--grace must be > 0", v)
	}
}

func TestRunLogger(t *testing.T) {
	var buf bytes.Buffer
	log, err := runLogger("", &buf)
	require.NoError(t, err)
	assert.False(t, log.Core().Enabled(zapcore.InfoLevel))
	assert.True(t, log.Core().Enabled(zapcore.WarnLevel))
	log, err = runLogger("debug", &buf)
	require.NoError(t, err)
	assert.True(t, log.Core().Enabled(zapcore.DebugLevel))
	log.Debug("hello")
	assert.True(t, strings.Contains(buf.String(), "hello"))
	_, err = runLogger("loud", &buf)
	assert.Error(t, err)
}

// TestRunOutOfRangeCounts: an -n or --procs beyond what a machine runs is
// a clear error (-n of MaxInt panicked allocating the rendezvous; a
// --procs beyond int32 was ignored by the ranks' Go runtime).
func TestRunOutOfRangeCounts(t *testing.T) {
	for _, args := range [][]string{
		{"-n", "9223372036854775807", "--", "true"},
		{"-n", "2", "--procs", "2147483648", "--", "true"},
		{"-n", "1", "--tail", "1000000000", "--", "true"}, // kept every line a rank wrote
	} {
		if _, err := execRun(t, args...); err == nil {
			t.Errorf("troupe run %v: no error", args)
		}
	}
}
