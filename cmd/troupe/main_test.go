package main

import (
	"errors"
	"fmt"
	"os"
	"os/exec"
	"strings"
	"testing"

	"github.com/troupe-hpc/troupe/transport/bootstrap"
)

// envTestMain makes the test binary act as the troupe command: the
// benchmarks launch their ranks with os.Executable (here, the test binary),
// so a test that runs a real benchmark job sets it for the ranks.
const envTestMain = "TROUPE_TEST_AS_TROUPE"

func TestMain(m *testing.M) {
	if os.Getenv(envTestMain) == "1" {
		main()
		os.Exit(0)
	}
	// A rank of a job that a test started by mistake (a flag check that
	// let a benchmark through) would run the whole test suite, which
	// starts jobs of its own: fail the rank at once instead.
	if os.Getenv(bootstrap.EnvRdv) != "" {
		fmt.Fprintf(os.Stderr, "test binary started as a rank without %s=1\n", envTestMain)
		os.Exit(2)
	}
	os.Exit(m.Run())
}

// troupe prints an error once, after one "troupe: " (Launch's errors began
// with "troupe:" too, and came out as "troupe: troupe: ...").
func TestErrorPrefixOnce(t *testing.T) {
	for _, tc := range []struct {
		args []string
		want string
	}{
		{[]string{"run", "-n", "1", "--", "/nonexistent/prog"}, `troupe: bootstrap: exec: "/nonexistent/prog": `},
		{[]string{"run", "-n", "0", "--", "true"}, `troupe: `},
	} {
		cmd := exec.Command(os.Args[0], tc.args...)
		cmd.Env = append(os.Environ(), envTestMain+"=1")
		var stderr strings.Builder
		cmd.Stderr = &stderr
		err := cmd.Run()
		var ee *exec.ExitError
		if !errors.As(err, &ee) || ee.ExitCode() != 1 || !strings.HasPrefix(stderr.String(), tc.want) ||
			strings.Count(stderr.String(), "troupe:") != 1 {
			t.Errorf("troupe %s: %v, stderr %q; want status 1 and one %q", strings.Join(tc.args, " "), err, stderr.String(), tc.want)
		}
	}
}
