package main

import (
	"os"
	"testing"
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
	os.Exit(m.Run())
}
