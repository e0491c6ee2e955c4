package main

import (
	"fmt"
	"os"
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
